"""Hugging Face's linear-attention layers over a draft tree, reading the modules' own weights (no forked model files).

:func:`prepare` (called by :func:`~specdec_ext.models.tree_forward` with a
:class:`~specdec_ext.models.hybrid_cache.HybridCache`) switches each supported linear-attention module of a model to
a subclass of its own class (``module.__class__``) whose ``forward`` adds one branch: with a ``HybridCache`` as the
``cache`` argument it runs the tree form (:func:`lightning_tree_forward`); with any other cache, or none, it is the
Hugging Face forward unchanged. A class switch rather than a per-call swap of ``forward`` or a hook: a hook cannot
replace a forward, a per-call swap would hand another thread's plain forward of the same (shared) model the tree
path, and the switched class survives ``deepcopy`` and pickling (an instance attribute holding a bound method would
not rebind cleanly). The weights, buffers and ``state_dict`` stay the module's own.

Gated DeltaNet (Qwen3-Next, Qwen3.5) follows the same pattern in :mod:`~specdec_ext.models.deltanet_layers`, Bamba's
Mamba-2 in :mod:`~specdec_ext.models.mamba2_layers`.

MiniMax (``MiniMaxLightningAttention``): ``qkv = silu(qkv_proj(x))`` split per head into q, k, v; per head
``S_t = exp(-slope_h) S_{t-1} + k_t^T v_t`` and ``o_t = q_t S_t`` (no softmax, no scale, no RoPE); then RMSNorm over
all heads, ``sigmoid(output_gate(x))`` times it, ``out_proj``. Over a tree, node i's ``o_i`` comes from the saved
state and its ancestors' keys and values in one pass (:func:`specdec_ext.ops.tree_linear_attention`);
long chains (prefills) go in chunks of :data:`CHAIN_CHUNK` tokens, each from the state after the previous ones, so
the pass stays linear in the prompt length.
"""

from __future__ import annotations

import weakref

import torch
from transformers.models.bamba.modeling_bamba import BambaMixer
from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from specdec_ext import ops
from specdec_ext.models.deltanet_layers import TreeGatedDeltaNet, TreeQwen35GatedDeltaNet
from specdec_ext.models.hybrid_cache import HybridCache
from specdec_ext.models.mamba2_layers import TreeBambaMixer

__all__ = ["CHAIN_CHUNK", "TreeLightningAttention", "lightning_log_decay", "lightning_tree_forward", "prepare"]

CHAIN_CHUNK = 128  # a chain's tokens per parallel pass: [H, C, C] weights a chunk


def lightning_log_decay(module: MiniMaxLightningAttention) -> torch.Tensor:
    """``[H]`` float32: the log of the module's per-head decay (``-slope_rate``, the buffer its own forward uses)."""
    return -module.slope_rate.detach().reshape(-1).float()


def _attend(q, k, v, state, log_decay, parents, chain: bool) -> torch.Tensor:
    """``o [B, H, N, Dv]``: the tree form in one pass, or a long chain chunk by chunk from a local state."""
    B, _, N, _ = q.shape
    if not chain or N <= CHAIN_CHUNK:
        return ops.tree_linear_attention(q, k, v, state, log_decay, parents, validate=False)
    running = state.clone()
    outs = []
    for c in range(0, N, CHAIN_CHUNK):
        n = min(CHAIN_CHUNK, N - c)
        qc, kc, vc = q[:, :, c:c + n], k[:, :, c:c + n], v[:, :, c:c + n]
        chunk = ops.chain_parents(B, n, q.device)
        outs.append(ops.tree_linear_attention(qc, kc, vc, running, log_decay, chunk, validate=False))
        path = torch.arange(n, device=q.device).expand(B, n)
        ops.commit_linear_state(running, kc, vc, log_decay, path, n, validate=False)
    return torch.cat(outs, 2)


def lightning_tree_forward(module: MiniMaxLightningAttention, cache: HybridCache,
                           hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
    """MiniMax's Lightning attention for the ``[B, N, hidden]`` tree nodes of a verification forward: their outputs
    from the cache's saved state, their keys and values recorded in the cache for the commit (module doc)."""
    B, N, _ = hidden_states.shape
    H, D = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden_states)).reshape(B, N, H, 3 * D)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, D, dim=3))
    log_decay = lightning_log_decay(module)
    step = cache.tree_layer(module.layer_idx)
    o = _attend(q, k, v, step.states["state"], log_decay, step.parents, step.chain)
    cache.record(module.layer_idx, keys=k, values=v, log_decay=log_decay)
    o = module.norm(o.transpose(1, 2).reshape(B, N, H * D))
    o = torch.sigmoid(module.output_gate(hidden_states)) * o
    return module.out_proj(o), None


class TreeLightningAttention(MiniMaxLightningAttention):
    """``MiniMaxLightningAttention`` whose forward runs the tree form with a :class:`HybridCache` (module doc);
    modules become it through :func:`prepare`, never by construction."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        tree_cache = cache if cache is not None else kwargs.get("past_key_values")  # (HF's deprecated name)
        if isinstance(tree_cache, HybridCache):
            return lightning_tree_forward(self, tree_cache, hidden_states)
        return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)


# Hugging Face class -> its tree subclass
TREE_CLASSES: dict[type, type] = {MiniMaxLightningAttention: TreeLightningAttention,
                                  Qwen3NextGatedDeltaNet: TreeGatedDeltaNet,
                                  Qwen3_5GatedDeltaNet: TreeQwen35GatedDeltaNet,
                                  BambaMixer: TreeBambaMixer}

_PREPARED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def prepare(model: torch.nn.Module, cache: HybridCache) -> None:
    """Switches ``model``'s supported linear-attention modules to their tree subclasses (idempotent; module doc) and
    checks that they are exactly the cache's linear layers: a model whose linear layers are other modules (remote
    code, another class) is a NotImplementedError naming them, never a forward that silently skips the tree path."""
    layers = _PREPARED.get(model)
    if layers is None:
        found = []
        for module in model.modules():
            tree_cls = TREE_CLASSES.get(type(module))
            if tree_cls is not None:
                module.__class__ = tree_cls
            if type(module) in TREE_CLASSES.values():
                found.append(module.layer_idx)
        layers = _PREPARED[model] = tuple(sorted(found))
    if list(layers) != cache.linear_layers:
        names = sorted(c.__name__ for c in TREE_CLASSES)
        raise NotImplementedError(f"tree_forward: the model's config has linear layers {cache.linear_layers} but its "
                                  f"modules of {names} are layers {list(layers)}; the tree path supports these "
                                  "transformers classes only")
