"""Fuzzing every op (hypothesis): random valid cases, mutated in their shapes, dtypes, devices (meta), layouts,
values (extreme integers, NaN / inf, malformed trees) and scalar arguments. Each example must give a clear argument
error or the reference's answer (``specdec_ext.ops.reference``).

Layout: ``spec`` (a case: recipe -> arguments, mutations, the per-example check), one ``cases_*`` module per op family
(how to build each op's valid arguments, call it, and compare with the reference), ``worker`` (runs ops' fuzzing in a
separate process, so a crash is a report, not a dead test run), ``test_fuzz_ops`` (the pytest side).
"""
