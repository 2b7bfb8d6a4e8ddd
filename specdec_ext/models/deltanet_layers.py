"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over a draft tree, reading the modules' own weights.

The same pattern as :mod:`~specdec_ext.models.linear_layers` (which switches the modules, by its
``TREE_CLASSES``): ``Qwen3NextGatedDeltaNet`` becomes :class:`TreeGatedDeltaNet` and ``Qwen3_5GatedDeltaNet``
:class:`TreeQwen35GatedDeltaNet`, whose forwards run :func:`deltanet_tree_forward` with a
:class:`~specdec_ext.models.hybrid_cache.HybridCache` and are Hugging Face's otherwise.

The layer, as the modules compute it: input projections give q, k, v, the output gate z and the gates' inputs b, a
(Qwen3-Next: ``in_proj_qkvz`` / ``in_proj_ba`` in grouped order; Qwen3.5: ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``: the only difference); q, k, v go through a depthwise causal convolution of width K
(``conv1d``, SiLU) — over a tree, a node's window is its K - 1 nearest ancestors, the saved window above the root
(:func:`specdec_ext.ops.tree_causal_conv1d`); then ``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a +
dt_bias)``, q and k l2-normalised (q also by ``Dk^-0.5``) and repeated to the value heads, and the gated delta rule,
whose gates depend on the input, so that each node's state is one step from its parent's, level by level
(:func:`~specdec_ext.ops.tree_gated_delta_rule`); then the gated RMSNorm with z and ``out_proj``. The cache
keeps each node's convolution input and rule inputs, and the commit replays the accepted path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet, l2norm

from specdec_ext import ops
from specdec_ext.models.hybrid_cache import HybridCache

__all__ = ["TreeGatedDeltaNet", "TreeQwen35GatedDeltaNet", "deltanet_tree_forward"]


def deltanet_tree_forward(module, cache: HybridCache, hidden_states: torch.Tensor, x: torch.Tensor, z: torch.Tensor,
                          b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet layer for the ``[B, N, hidden]`` tree nodes of a verification forward, from its projections
    (module doc): the convolution's input ``x[B, N, conv_dim]`` (q, k, v), the output gate ``z[B, N, Hv, Dv]`` and
    the gates' inputs ``b`` / ``a`` ``[B, N, Hv]``."""
    B, N, _ = hidden_states.shape
    Hk, Hv, Dk, Dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    x = x.transpose(1, 2)  # [B, conv_dim, N]
    step = cache.tree_layer(module.layer_idx)
    mixed = ops.tree_causal_conv1d(x, step.states["conv"], module.conv1d.weight.squeeze(1), module.conv1d.bias,
                                   step.parents, module.activation, validate=False).transpose(1, 2).contiguous()
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], -1)
    q, k = q.reshape(B, N, Hk, Dk), k.reshape(B, N, Hk, Dk)
    if Hv != Hk:  # each key head serves Hv / Hk consecutive value heads
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v.reshape(B, N, Hv, Dv)))  # [B, Hv, N, D]
    q, k = l2norm(q, dim=-1, eps=1e-6) * Dk ** -0.5, l2norm(k, dim=-1, eps=1e-6)
    beta = b.sigmoid().transpose(1, 2).float()
    g = (-module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)).transpose(1, 2)
    o = ops.tree_gated_delta_rule(q, k, v, g, beta, step.states["state"], step.parents, validate=False)
    cache.record(module.layer_idx, k=k, v=v, g=g, beta=beta, x=x.float())
    core = o.transpose(1, 2).to(hidden_states.dtype).reshape(-1, Dv)
    core = module.norm(core, z.reshape(-1, Dv)).reshape(B, N, Hv * Dv)
    return module.out_proj(core)


class TreeGatedDeltaNet(Qwen3NextGatedDeltaNet):
    """``Qwen3NextGatedDeltaNet`` whose forward runs the tree form with a :class:`HybridCache` (module doc);
    modules become it through :func:`specdec_ext.models.linear_layers.prepare`, never by construction."""

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        tree_cache = cache if cache is not None else kwargs.get("cache_params")  # (HF's deprecated name)
        if not isinstance(tree_cache, HybridCache):
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        B, N, _ = hidden_states.shape
        query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                       self.in_proj_ba(hidden_states))
        x = torch.cat([t.reshape(B, N, -1) for t in (query, key, value)], -1)
        return deltanet_tree_forward(self, tree_cache, hidden_states, x, z, b, a)


class TreeQwen35GatedDeltaNet(Qwen3_5GatedDeltaNet):
    """``Qwen3_5GatedDeltaNet`` whose forward runs the tree form with a :class:`HybridCache` (module doc)."""

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        tree_cache = cache if cache is not None else kwargs.get("cache_params")  # (HF's deprecated name)
        if not isinstance(tree_cache, HybridCache):
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        B, N, _ = hidden_states.shape
        z = self.in_proj_z(hidden_states).reshape(B, N, -1, self.head_v_dim)
        return deltanet_tree_forward(self, tree_cache, hidden_states, self.in_proj_qkv(hidden_states), z,
                                     self.in_proj_b(hidden_states), self.in_proj_a(hidden_states))
