"""The learning-rate schedule of a training run and its length: linear warm-up, then constant or cosine decay
towards ``min_lr_ratio * lr`` (reached just after the last step); the step count given, or chosen from a time
budget and the corpus size.

A time budget (``minutes``) fixes the step count after the first ``probe_steps`` steps have been timed (sooner
when finishing the probe would overrun the budget): ``steps = done + (budget - time so far) / (mean step time)``,
capped at ``max_epochs`` passes over the training sequences. The cap, because more passes stop paying on a small
corpus (the family's EAGLE-1 accepted less after 3.5 passes than after 1.6: README, "Training drafters"): a
generous budget on little data stops early rather than over-fitting. The probe steps run at the rates of the
longest run the cap allows (its warm-up is the longest, so their rates are the lowest the run could have); from
the probe's end on, the rates are those of the chosen step count. The plan (:class:`SchedulePlan`) is saved in the
checkpoint, so a resumed run keeps it.

The probe's first steps can run slower than the rest (a machine still busy loading, allocations growing), so the
count is fixed once more at the *check*: after as many steps again as the probe or a tenth of the count, whichever
is more, from the steps timed since the probe (the warm-up stays; the cosine is stretched or shrunk from there on).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["DEFAULT_STEPS", "SchedulePlan", "lr_at", "resolve_warmup", "epoch_cap", "steps_for_budget"]

DEFAULT_STEPS = 1000  # neither a step count nor a time budget given


@dataclass
class SchedulePlan:
    """What fixes every step's rate: the total ``steps`` and ``warmup``; with a time budget also the probe (its
    ``probe_steps`` first steps ran as a run of ``probe_total`` steps with ``probe_warmup`` would) and the timings
    that chose ``steps`` (the probe's, then the check's)."""

    steps: int
    warmup: int
    probe_steps: int = 0
    probe_total: int = 0
    probe_warmup: int = 0
    step_seconds: float | None = None  # the probe's mean step time
    budget_seconds: float | None = None
    check_step: int = 0  # the step at which the check re-fixed ``steps`` (0: not yet)
    check_seconds: float | None = None  # the mean step time the check measured

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "SchedulePlan":
        try:
            plan = cls(**d)
        except TypeError:
            raise ValueError(f"{where}: the checkpoint's schedule plan {d!r} is not one this library writes") from None
        return plan


def resolve_warmup(warmup: int | None, warmup_fraction: float, steps: int) -> int:
    """``warmup`` steps when given, else ``warmup_fraction`` of ``steps`` (at least one step when there are any)."""
    if warmup is not None:
        return warmup
    return min(steps, max(1, round(warmup_fraction * steps))) if steps and warmup_fraction else 0


def _rate(step: int, lr: float, steps: int, warmup: int, schedule: str, min_lr_ratio: float) -> float:
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "cosine":
        frac = min(1.0, (step - warmup) / max(1, steps - warmup))  # (reaches min_lr_ratio * lr after the last step)
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
    return lr


def lr_at(step: int, plan: SchedulePlan, lr: float, schedule: str, min_lr_ratio: float) -> float:
    """The learning rate of step ``step`` (0-based) under ``plan``."""
    if step < plan.probe_steps:
        return _rate(step, lr, plan.probe_total, plan.probe_warmup, schedule, min_lr_ratio)
    return _rate(step, lr, plan.steps, plan.warmup, schedule, min_lr_ratio)


def epoch_cap(batches_per_epoch: float, max_epochs: float) -> int:
    """Steps that make ``max_epochs`` passes over the data, ``batches_per_epoch`` batches a pass (at least 1)."""
    return max(1, math.ceil(max_epochs * batches_per_epoch))


def steps_for_budget(budget_seconds: float, elapsed_seconds: float, step_seconds: float, done: int, cap: int) -> int:
    """The total step count that ends the run at ``budget_seconds`` after ``done`` steps took ``elapsed_seconds``
    (``step_seconds`` each from now on), within ``[done, cap]``."""
    more = math.floor(max(0.0, budget_seconds - elapsed_seconds) / max(step_seconds, 1e-9))
    return max(done, min(cap, done + more))
