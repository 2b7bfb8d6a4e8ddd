"""A drafter's decoder layer as one :func:`specdec_ext.ops.draft_decoder_layer` call: its operands, whether the op
may run, and the call.

Three routes run a draft's decoder layer through the op: an EAGLE layer's own forward (when a call qualifies),
:class:`~specdec_ext.models.eagle_step.EagleStepOps` (the EAGLE drafter's step) and
:class:`~specdec_ext.models.llama_step.LlamaStepOps` (a draft LM's layers). Each takes the layer's operands from
:meth:`DraftLayer.of` once, asks :meth:`DraftLayer.takes` of a call where its own fallback could run instead, and
calls the record. The layer is a Llama decoder layer by submodule names (``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``post_attention_layernorm``), which EAGLE-1's and EAGLE-3's layers share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec_ext import ops
from specdec_ext.models.attention import TREE_KERNEL_HEAD_DIMS
from specdec_ext.models.quantized import linear_dtype, linear_operand

__all__ = ["NATIVE_LAYER_MAX_ROWS", "DraftLayer"]

# The op runs a call of at most this many rows (B * T): the tree levels and the catch-ups of decoding. A whole
# prompt's catch-up takes the module's path (SDPA's blocked attention).
NATIVE_LAYER_MAX_ROWS = 64


def op_serves(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the op can run a layer at all here: a CPU (its weights are packed for the CPU kernel), a head size
    it is compiled for, and one dtype for the input, the weights and the cache."""
    return device.type == "cpu" and head_dim in TREE_KERNEL_HEAD_DIMS and cache_dtype is dtype


@dataclass(slots=True, eq=False)
class DraftLayer:
    """One decoder layer's operands of :func:`specdec_ext.ops.draft_decoder_layer`, named as its parameters (the
    weights packed once: ``qkv_weight`` of ``cat(q, k, v)``, ``gate_up_weight`` of ``cat(gate, up)``; a weight
    with its ``*_scales`` is int8, with its ``*_group_scales`` too int4, from
    :class:`~specdec_ext.models.quantized.QuantizedLinear` layers). It serves the weights as they were when it was
    built."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    norm_weight: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor
    inv_freq: torch.Tensor
    num_heads: int
    intermediate_size: int
    eps: float
    input_norm_weight: torch.Tensor | None
    input_norm_segments: int
    qkv_scales: torch.Tensor | None = None
    o_scales: torch.Tensor | None = None
    gate_up_scales: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None
    qkv_group_scales: torch.Tensor | None = None
    o_group_scales: torch.Tensor | None = None
    gate_up_group_scales: torch.Tensor | None = None
    down_group_scales: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: nn.Module, *, dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype,
           num_heads: int, eps: float, inv_freq: torch.Tensor, input_norm_weight: torch.Tensor | None = None,
           input_norm_segments: int = 1) -> "DraftLayer | None":
        """The operands of ``layer`` for inputs of ``dtype`` on ``device`` over a cache of ``cache_dtype``, or None
        where the op may not run it (:func:`op_serves`; a linear layer that is not a plain or quantised one of
        ``dtype``; the packed kernels do not serve the weights; a bias on o, gate, up or down, which the op has no
        operand for; an int4 weight over inputs that are not whole groups of 32).
        (Submodules and parameters are read from the modules' dicts: ``module.attr`` costs ~0.6 us a lookup.)"""
        attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
        qkv = (attn["q_proj"], attn["k_proj"], attn["v_proj"])
        o, gate_up, down = attn["o_proj"], (mlp["gate_proj"], mlp["up_proj"]), mlp["down_proj"]
        linears = (*qkv, o, *gate_up, down)
        if any(linear_dtype(m) is not dtype for m in linears) \
                or not op_serves(device, dtype, cache_dtype, qkv[0].out_features // num_heads):
            return None  # (checked before anything is packed)
        packed = (linear_operand(qkv), linear_operand((o,)), linear_operand(gate_up), linear_operand((down,)))
        if any(p is None for p in packed) or any(p.bias is not None for p in packed[1:]):
            return None
        in_features = (qkv[0].in_features, o.in_features, gate_up[0].in_features, down.in_features)
        if any(p.group_scales is not None and k % 32 for p, k in zip(packed, in_features)):
            return None  # (the op's int4 products take inputs of whole groups of 32)
        return cls(qkv_weight=packed[0].packed, qkv_bias=packed[0].bias, o_weight=packed[1].packed,
                   norm_weight=layer._modules["post_attention_layernorm"]._parameters["weight"],
                   gate_up_weight=packed[2].packed, down_weight=packed[3].packed, inv_freq=inv_freq,
                   num_heads=num_heads, intermediate_size=down.in_features, eps=eps,
                   input_norm_weight=input_norm_weight, input_norm_segments=input_norm_segments,
                   qkv_scales=packed[0].scales, o_scales=packed[1].scales, gate_up_scales=packed[2].scales,
                   down_scales=packed[3].scales, qkv_group_scales=packed[0].group_scales,
                   o_group_scales=packed[1].group_scales, gate_up_group_scales=packed[2].group_scales,
                   down_group_scales=packed[3].group_scales)

    @staticmethod
    def takes(rows: int, mask: torch.Tensor, kv_len: int | None) -> bool:
        """Whether the op takes a call of ``rows`` (B * T) under ``mask`` over ``kv_len`` cache slots: at most
        :data:`NATIVE_LAYER_MAX_ROWS` rows and a bool mask over exactly those slots. Anything unusual takes the
        caller's module path, which also reports a caller's mistakes in its own words."""
        return rows <= NATIVE_LAYER_MAX_ROWS and mask.dtype is torch.bool and (kv_len is None
                                                                              or kv_len == mask.shape[-1])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, position_ids: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, write_slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The layer over ``x`` added to ``residual`` (see :func:`specdec_ext.ops.draft_decoder_layer`)."""
        return ops.draft_decoder_layer(
            x=x, residual=residual, qkv_weight=self.qkv_weight, qkv_bias=self.qkv_bias, o_weight=self.o_weight,
            norm_weight=self.norm_weight, gate_up_weight=self.gate_up_weight, down_weight=self.down_weight,
            position_ids=position_ids, inv_freq=self.inv_freq, k_cache=k_cache, v_cache=v_cache,
            write_slots=write_slots, mask=mask, num_heads=self.num_heads, intermediate_size=self.intermediate_size,
            eps=self.eps, input_norm_weight=self.input_norm_weight, input_norm_segments=self.input_norm_segments,
            qkv_scales=self.qkv_scales, o_scales=self.o_scales, gate_up_scales=self.gate_up_scales,
            down_scales=self.down_scales, qkv_group_scales=self.qkv_group_scales, o_group_scales=self.o_group_scales,
            gate_up_group_scales=self.gate_up_group_scales, down_group_scales=self.down_group_scales, validate=True)
