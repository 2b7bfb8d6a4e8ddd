"""Bamba's Mamba-2 mixers over a draft tree, reading the modules' own weights.

The pattern of :mod:`~specdec_ext.models.linear_layers`: ``BambaMixer`` becomes :class:`TreeBambaMixer`, whose
forward runs :func:`mamba2_tree_forward` with a :class:`~specdec_ext.models.hybrid_cache.HybridCache` and is Hugging
Face's otherwise. The mixer, as the module computes it: ``in_proj`` gives the gate, ``xBC`` and ``dt``; ``xBC`` goes
through the depthwise causal convolution (``conv1d``, SiLU; over a tree, a node's window is its nearest ancestors,
the saved window above the root: :func:`specdec_ext.ops.tree_causal_conv1d`) and splits into x, B, C
(B and C per group, shared by consecutive heads); ``dt = softplus(dt + dt_bias)``, ``A = -exp(A_log)``; the
selective state update, input-dependent, so each node's state is one step from its parent's, level by level
(:func:`~specdec_ext.ops.tree_selective_state`, with the ``D`` skip); the gated RMSNorm with the gate and
``out_proj``. The cache keeps each node's convolution input and update inputs; the commit replays the accepted path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.bamba.modeling_bamba import BambaMixer

from specdec_ext import ops
from specdec_ext.models.hybrid_cache import HybridCache

__all__ = ["TreeBambaMixer", "mamba2_tree_forward"]


def mamba2_tree_forward(module: BambaMixer, cache: HybridCache, hidden_states: torch.Tensor) -> torch.Tensor:
    """Bamba's Mamba-2 mixer for the ``[B, N, hidden]`` tree nodes of a verification forward (module doc)."""
    Bsz, N, _ = hidden_states.shape
    H, P, Ds, G = module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups
    gate, xbc, dt = module.in_proj(hidden_states).split([module.intermediate_size, module.conv_dim, H], dim=-1)
    xbc = xbc.transpose(1, 2)  # [B, conv_dim, N]
    step = cache.tree_layer(module.layer_idx)
    mixed = ops.tree_causal_conv1d(xbc, step.states["conv"], module.conv1d.weight.squeeze(1), module.conv1d.bias,
                                   step.parents, module.activation, validate=False).transpose(1, 2).contiguous()
    x, Bm, Cm = torch.split(mixed, [module.intermediate_size, G * Ds, G * Ds], dim=-1)
    x = x.reshape(Bsz, N, H, P).transpose(1, 2).float()  # [B, H, N, P]
    Bm, Cm = (t.reshape(Bsz, N, G, Ds).repeat_interleave(H // G, dim=2).transpose(1, 2).float() for t in (Bm, Cm))
    dt = F.softplus(dt.float() + module.dt_bias.float()).transpose(1, 2)  # [B, H, N]
    A = -torch.exp(module.A_log.float())
    y = ops.tree_selective_state(x, dt, A, Bm, Cm, module.D.float(), step.states["state"], step.parents,
                                 validate=False)
    cache.record(module.layer_idx, x=x, dt=dt, Bm=Bm, xbc=xbc.float(), A=A)
    scan = y.transpose(1, 2).reshape(Bsz, N, H * P)
    return module.out_proj(module.norm(scan, gate).to(hidden_states.dtype))


class TreeBambaMixer(BambaMixer):
    """``BambaMixer`` whose forward runs the tree form with a :class:`HybridCache` (module doc); modules become it
    through :func:`specdec_ext.models.linear_layers.prepare`, never by construction."""

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        tree_cache = cache if cache is not None else kwargs.get("cache_params")  # (HF's deprecated name)
        if isinstance(tree_cache, HybridCache):
            return mamba2_tree_forward(self, tree_cache, hidden_states)
        return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
