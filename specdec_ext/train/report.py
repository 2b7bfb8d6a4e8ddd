"""What a trained drafter will give on this machine: acceptance per draft depth and mean accepted length on held-out
sequences, and the speedup over plain decoding they predict with the target's measured cost curve.

Acceptance at depth d is the probability that the draft token at depth d is accepted given that the d - 1 before it
were: ``reached(d) / reached(d - 1)``, where ``reached(d)`` is the fraction of steps that accepted at least d drafts
(``reached(0) = 1``), counted over greedy speculative decoding of the held-out prompts at batch 1. A depth whose
acceptance is low is where more training (or a shallower tree) would pay.

Prediction. A step of the drafter emits ``tau`` tokens (the mean accepted length) for one target forward over its
tree of ``n`` nodes and its own drafting; a plain step emits one token for a one-node forward::

    speedup = tau * t_target(1) / (t_target(n) + t_draft)

``t_target(m)``: the target's verification forward of an m-node chain after the prompt, on a prefilled cache, as the
engine runs it (inside its packed-products block): measured at m = 1, 2, 4, ... and the largest tree, the fastest of
repeated forwards taken in turns, and interpolated linearly between. ``n``: the mean nodes a step verified; ``t_draft``:
the drafter's measured seconds a step (propose and observe: ``DecodeStats.draft_s`` over the steps). What both
kinds of step share (bookkeeping, the prefill) is left out, so the prediction is an upper bound on long outputs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from specdec_ext.generate import generate
from specdec_ext.train.timing import PrefilledTarget, fastest_times

__all__ = ["REPORT_FILE", "DrafterReport", "conditional_acceptance", "cost_at", "predicted_speedup",
           "target_cost_curve", "evaluate_drafter"]

REPORT_FILE = "drafter_report.json"


def conditional_acceptance(accept_hist: list[int]) -> list[float]:
    """``[d - 1]``: P(draft depth d accepted | the d - 1 before it were), from ``accept_hist[k]`` = steps that
    accepted k drafts; depths no step reached the parent of are left out (nothing to measure there)."""
    total = sum(accept_hist)
    out = []
    for d in range(1, len(accept_hist)):
        parent = sum(accept_hist[d - 1:])  # steps that accepted at least d - 1
        if parent == 0 or total == 0:
            break
        out.append(sum(accept_hist[d:]) / parent)
    return out


def cost_at(curve: dict[int, float], nodes: float) -> float:
    """The curve's seconds at ``nodes`` (linear between the measured sizes; the ends held beyond them)."""
    if not curve:
        raise ValueError("cost_at: an empty cost curve")
    sizes = sorted(curve)
    if nodes <= sizes[0]:
        return curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if nodes <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (nodes - lo) / (hi - lo)
    return curve[sizes[-1]]


def predicted_speedup(mean_accepted_length: float, curve: dict[int, float], nodes: float,
                      draft_seconds: float) -> float:
    """The module doc's formula."""
    return mean_accepted_length * cost_at(curve, 1) / (cost_at(curve, nodes) + draft_seconds)


def _sizes(max_nodes: int) -> list[int]:
    sizes, m = [], 1
    while m < max_nodes:
        sizes.append(m)
        m *= 2
    return sizes + [max_nodes]


def target_cost_curve(target: torch.nn.Module, prompt: list[int], max_nodes: int, repeats: int = 10,
                      clock=time.perf_counter) -> dict[int, float]:
    """``{m: seconds}`` of the target's forward over an m-node chain after ``prompt`` (module doc), m = 1, 2, 4, ...,
    ``max_nodes``, as the engine runs it (:class:`~specdec_ext.train.timing.PrefilledTarget`); each the fastest of
    ``repeats`` forwards, the sizes taken in turns (:func:`~specdec_ext.train.timing.fastest_times`)."""
    if max_nodes < 1 or len(prompt) < 1:
        raise ValueError(f"target_cost_curve: needs a prompt and max_nodes >= 1, got {len(prompt)} tokens and "
                         f"max_nodes = {max_nodes}")
    timed = PrefilledTarget(target, prompt, len(prompt) + max_nodes)
    sizes = _sizes(max_nodes)
    return dict(zip(sizes, fastest_times([timed.chain(m) for m in sizes], repeats, clock)))


@dataclass
class DrafterReport:
    """The module doc's numbers for one drafter; :meth:`to_dict` is the JSON saved beside the checkpoint."""

    prompts: int
    new_tokens: int
    steps: int
    mean_accepted_length: float
    acceptance_by_depth: list[float]
    nodes_per_step: float
    draft_seconds_per_step: float
    target_seconds: dict[int, float]
    predicted_speedup: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_seconds"] = {str(k): v for k, v in self.target_seconds.items()}
        return d

    def lines(self) -> list[str]:
        acc = " ".join(f"{a:.2f}" for a in self.acceptance_by_depth) or "(no drafts accepted)"
        curve = ", ".join(f"{m}: {s * 1e3:.2f}" for m, s in sorted(self.target_seconds.items()))
        return [f"mean accepted length {self.mean_accepted_length:.2f} ({self.steps} steps, {self.prompts} held-out "
                f"prompts x {self.new_tokens} tokens)",
                f"acceptance by depth (given the depth before accepted): {acc}",
                f"target forward ms by nodes: {curve}; a step verifies {self.nodes_per_step:.1f} nodes and drafts "
                f"in {self.draft_seconds_per_step * 1e3:.2f} ms",
                f"predicted speedup over plain decoding on this machine: {self.predicted_speedup:.2f}x"]

    def save(self, path: str | os.PathLike) -> str:
        """The report as JSON at ``path`` (train-* write it as ``REPORT_FILE`` beside the drafter); returns it."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return path


def evaluate_drafter(target: torch.nn.Module, drafter, prompts: list[list[int]], new_tokens: int = 64,
                     repeats: int = 10) -> DrafterReport:
    """The report of ``drafter`` on ``prompts``: one greedy generation per prompt (batch 1, no EOS), then the
    target's cost curve up to the drafter's tree size, measured after the first prompt. Acceptance is reported for
    the depths 1 .. ``drafter.max_depth`` (no step can accept deeper)."""
    if not prompts:
        raise ValueError("evaluate_drafter: no held-out prompts (hold some out: --heldout N)")
    if new_tokens < 1:
        raise ValueError(f"evaluate_drafter: new_tokens must be >= 1, got {new_tokens}")
    hist = [0] * drafter.max_nodes
    steps = row_steps = new = drafts = 0
    draft_s = 0.0
    for p in prompts:
        _, st = generate(target, drafter, torch.tensor(p), max_new_tokens=new_tokens, eos_token_id=[])
        hist = [a + b for a, b in zip(hist, st.accept_hist + [0] * (len(hist) - len(st.accept_hist)))]
        steps += st.steps
        row_steps += st.row_steps
        new += st.new_tokens
        drafts += st.draft_tokens
        draft_s += st.draft_s
    nodes = 1 + drafts / max(row_steps, 1)
    curve = target_cost_curve(target, prompts[0], drafter.max_nodes, repeats)
    tau = new / max(row_steps, 1)
    per_step = draft_s / max(steps, 1)
    by_depth = conditional_acceptance(hist[: drafter.max_depth + 1])
    return DrafterReport(prompts=len(prompts), new_tokens=new_tokens, steps=steps, mean_accepted_length=tau,
                         acceptance_by_depth=by_depth, nodes_per_step=nodes,
                         draft_seconds_per_step=per_step, target_seconds=curve,
                         predicted_speedup=predicted_speedup(tau, curve, nodes, per_step))
