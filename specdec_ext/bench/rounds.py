"""Rounds of a load benchmark: every method once per round in a rotated order, each method's median round, and the
goal judged on rounds paired in time.

The VM's speed drifts by tens of percent over minutes (docs/ARCHITECTURE.md, "Adaptive speculation"), so medians of
rounds run minutes apart compare different machine speeds; the methods of one round run seconds apart. The engine
and serve suites both measure this way.
"""

from __future__ import annotations

import statistics

__all__ = ["median_round", "paired_ratio", "round_order"]


def round_order(methods: list[str], r: int) -> list[str]:
    """Round ``r``'s order: round 0 the declared one, then rotated, so that no method always runs first or last."""
    k = r % len(methods)
    return methods[k:] + methods[:k]


def median_round(runs: list[tuple[dict, list]], counts: tuple[str, ...] = ()) -> dict:
    """Of ``(row, outputs)`` per round: the row of the round with the median throughput (the lower middle one of an
    even count), with every round's throughput beside it (``tokens_per_s_rounds``, in round order), and each of the
    ``counts`` keys likewise (``<key>_rounds``: errors and unfinished requests are judged on every round, not on the
    median one alone)."""
    ordered = sorted((row for row, _ in runs), key=lambda row: row["tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    for key in ("tokens_per_s", *counts):
        row[f"{key}_rounds"] = [r[key] for r, _ in runs]
    return row


def paired_ratio(row: dict, *others: dict, key: str = "tokens_per_s_rounds") -> float | None:
    """The median over rounds of ``row``'s throughput over the best of ``others``' in the same round (rows with
    ``key``: one throughput per round in the same order, the measured rounds by default, or the warm-up rounds'
    ``warmup_tokens_per_s``): adaptive against the better of plain and the best fixed drafter, or a control against
    its twin; None without rounds that line up."""
    rounds = [r.get(key) for r in (row, *others)]
    if not others or any(not r for r in rounds) or len({len(r) for r in rounds}) != 1:
        return None
    ratios = [a / max(o) for a, *o in zip(*rounds) if max(o) > 0]
    return statistics.median(ratios) if ratios else None
