"""Timing the target as the engine runs it, for the cost models of the training commands (the drafter report's
verification curve, ``tune-self-spec``'s costs).

:class:`PrefilledTarget` prepares the target as :class:`~specdec_ext.engine.Engine` does (packed products, the tree
attention, its layers as op calls on CPUs) with a cache holding a prompt but its last token, which is the root of
every timed forward; :func:`fastest_times` times callables the way every such measurement here does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdec_ext.models import TreeKVCache, extend, tree_forward, use_tree_attention
from specdec_ext.models.fast_linear import pack_linears_where_fast, packed_linears
from specdec_ext.models.llama_step import LlamaStepOps

__all__ = ["PrefilledTarget", "fastest_times"]


def fastest_times(fns: list[Callable[[], object]], repeats: int, clock=time.perf_counter) -> list[float]:
    """Each callable's fastest of ``repeats`` timed calls, the calls taken in turns (round-robin) after one untimed
    call each: on a shared machine interference only ever adds time, and turns spread drifts over every callable."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


class PrefilledTarget:
    """``target`` prepared as the engine prepares it, with a one-row cache of ``room`` positions holding
    ``prompt[:-1]`` (:attr:`cache`, :attr:`prefix`); :meth:`chain` gives the verification forward of an n-node
    chain from the prompt's last token, as the engine runs it (op calls where it would take them)."""

    @torch.no_grad()
    def __init__(self, target: torch.nn.Module, prompt: list[int], room: int):
        if not prompt or room < len(prompt):
            raise ValueError(f"PrefilledTarget: needs a prompt and room >= its {len(prompt)} tokens, got room = {room}")
        p = next(q for q in target.parameters() if q.is_floating_point())
        pack_linears_where_fast(target)
        use_tree_attention(target)
        self.target, self.device = target, p.device
        self.cache = TreeKVCache(target.config, 1, room, dtype=p.dtype, device=p.device)
        self.step_ops = LlamaStepOps.build(target, self.cache)
        self.prefix = len(prompt) - 1
        self.root = torch.tensor([[prompt[-1]]], device=p.device)
        if self.prefix:
            with packed_linears(True):
                extend(target, self.cache, torch.tensor([prompt[:-1]], device=p.device), step_ops=self.step_ops)

    def chain(self, n: int) -> Callable[[], None]:
        """One n-node chain forward after the prompt (the cache keeps the prompt: it is rewound afterwards)."""
        if not 1 <= n <= self.cache.max_len - self.prefix:
            raise ValueError(f"PrefilledTarget.chain: n must be in [1, {self.cache.max_len - self.prefix}], got {n}")
        tokens = self.root.expand(1, n)

        def forward() -> None:
            with packed_linears(True), torch.no_grad():
                tree_forward(self.target, self.cache, tokens, None, self.prefix, validate=False,
                             step_ops=self.step_ops)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        return forward
