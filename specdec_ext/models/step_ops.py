"""The target's verification forward as direct calls, where a route reproduces the model: one constructor for the
engine, one type for :func:`~specdec_ext.models.tree_forward`'s ``step_ops``.

* :class:`~specdec_ext.models.llama_step.LlamaStepOps`: Llama, Mistral and Qwen2 over a ``TreeKVCache`` (one fused
  op per decoder layer; the dtype's rounding of the module route);
* :class:`~specdec_ext.models.minimax_step.MiniMaxStepOps`: MiniMax hybrids over a ``HybridCache`` (the module
  route's calls without the module tree; its bits).

Both answer ``on(cache)`` (the same route over another cache of the model, or None) and ``verify(...)`` (a tree's
forward, the cache's lengths left as they were).
"""

from __future__ import annotations

from torch import nn

from specdec_ext.models.kv_cache import TreeKVCache
from specdec_ext.models.llama_step import LlamaStepOps
from specdec_ext.models.minimax_step import MiniMaxStepOps

__all__ = ["StepOps", "build_step_ops"]

StepOps = LlamaStepOps | MiniMaxStepOps


def build_step_ops(model: nn.Module, cache: TreeKVCache) -> StepOps | None:
    """The direct-call route of ``model`` over ``cache``, or None where its modules must run."""
    return LlamaStepOps.build(model, cache) or MiniMaxStepOps.build(model, cache)
