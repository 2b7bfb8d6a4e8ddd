"""Every op's fuzz spec, by op name (the order of the test report)."""

from __future__ import annotations

from fuzz import cases_attention, cases_linear, cases_tree, cases_verify

SPECS = {s.name: s for s in cases_tree.SPECS + cases_verify.SPECS + cases_attention.SPECS + cases_linear.SPECS}
