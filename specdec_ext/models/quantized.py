"""Weight-only int8 and int4 draft networks (``--draft-quant int8|int4``): :func:`quantize_weights` and the layers it
installs.

A drafter's network only proposes tokens: the target verifies every draft at its own precision, so greedy output
is the target's whatever the draft computes, and sampled output stays lossless as long as a draft is drawn from the
probabilities the drafter reports (which are the quantised network's own). A draft may therefore hold its weights
in int8 (a quarter of float32's bytes to keep and to stream at every draft forward) or int4 (groups of 32 with
two-level scales: an eighth, at the cost of a coarser draft).

:func:`quantize_weights` changes a network in place:

* every linear layer (``nn.Linear`` and this library's :class:`~specdec_ext.models.fast_linear.Linear` /
  ``PackableLinear``) becomes a :class:`QuantizedLinear`: the weight quantised and laid out once by
  :func:`specdec_ext.ops.pack_linear_weight_int8` (per output channel) or
  :func:`~specdec_ext.ops.pack_linear_weight_int4`, the float weight released. Its product is
  :func:`specdec_ext.ops.packed_linear_int8` / :func:`~specdec_ext.ops.packed_linear_int4` (each input row quantised
  on the fly, exact integer sums);
* a Llama-style layer's ``q/k/v`` and ``gate/up`` projections are quantised as one weight each (per-channel
  quantisation of a concatenation is the concatenation of the quantisations, for int4's channel scales and group
  multipliers too) and, where their sizes fall on the layouts' 32-row panels, the members hold views of it: the
  draft layer op's fused products read it with no second copy (:func:`linear_operand`);
* every ``nn.Embedding`` becomes a :class:`QuantizedEmbedding` (rows quantised the same way; a lookup is the rows'
  dequantised values); one tied to a linear layer's weight reads that layer's weight.

Biases and norms stay in the network's dtype. The quantised layers compute in the dtype the float weights had
(:func:`linear_dtype`), on CPU (AVX-512 VNNI / AVX2 / portable) and CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec_ext import ops
from specdec_ext.models.fast_linear import INT4, INT8, PLAIN_LINEAR_TYPES, PackedLinear, fused_linear, packed_operand

__all__ = ["DRAFT_QUANT_SCHEMES", "QuantizedEmbedding", "QuantizedLinear", "check_draft_quant", "embedding_lookup",
           "fused_product", "linear_device", "linear_dtype", "linear_operand", "module_bytes", "quantize_weights"]

DRAFT_QUANT_SCHEMES = ("int8", "int4")

# The groups of sibling projections that the draft layer op multiplies as one weight.
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PANEL = 32  # output rows per panel of the int8 and int4 layouts (csrc/kernels/common/params.h)
_GROUP = 32  # input columns per group of int4's multipliers


def check_draft_quant(owner: str, draft_quant) -> str | None:
    """``draft_quant`` as given to a drafter (None: float weights), or a ValueError naming it."""
    if draft_quant is None or draft_quant in DRAFT_QUANT_SCHEMES:
        return draft_quant
    raise ValueError(f"{owner}: draft_quant must be None or one of {DRAFT_QUANT_SCHEMES}, got {draft_quant!r}")


@dataclass(slots=True, eq=False)
class _Group:
    """Sibling layers quantised as one weight: its operand (the concatenation) and how many members it has."""

    operand: PackedLinear
    size: int


def _pack(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(packed, scales, group_scales)`` of a float weight in ``scheme`` (group_scales None for int8)."""
    if scheme == "int4":
        w = ops.pack_linear_weight_int4(weight)
        return w.packed, w.scales, w.group_scales
    return (*ops.pack_linear_weight_int8(weight), None)


class QuantizedLinear(nn.Module):
    """A linear layer holding only its quantised weight: ``packed`` / ``scales`` (buffers:
    pack_linear_weight_int8's output for ``[out_features, in_features]``) or, for int4, ``packed`` /
    ``group_scales`` / ``scales`` (pack_linear_weight_int4's), and a float ``bias`` or None; inputs and outputs of
    ``dtype``. Built by :func:`quantize_weights`; not trainable."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 dtype: torch.dtype, group: _Group | None = None, position: int = 0,
                 group_scales: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, scales.shape[0], dtype
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("group_scales", group_scales)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self.group, self.position = group, position  # the fused weight this one is a view of, and its place there

    @classmethod
    @torch.no_grad()
    def of(cls, layer: nn.Linear, scheme: str = "int8") -> "QuantizedLinear":
        """A float linear layer quantised in ``scheme`` (the layer itself is left as it is)."""
        return _quantized_linear(layer, scheme)

    @property
    def scheme(self) -> str:
        return "int8" if self.group_scales is None else "int4"

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def operand(self) -> PackedLinear:
        """This layer's operands for the packed kernels (the int8 or int4 kind of :class:`PackedLinear`)."""
        return PackedLinear(INT8 if self.group_scales is None else INT4, self.packed, self.bias, self.out_features,
                            self.dtype, scales=self.scales, group_scales=self.group_scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group_scales is None:
            return ops.packed_linear_int8(x, self.packed, self.scales, self.bias)
        return ops.packed_linear_int4(x, self.packed, self.group_scales, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"dtype={self.dtype}, scheme={self.scheme}"


class QuantizedEmbedding(nn.Module):
    """An embedding table held as quantised rows (``packed`` / ``scales``, and for int4 ``group_scales``: the
    pack_linear_weight_int8 / _int4 layout of the ``[num_embeddings, embedding_dim]`` table, shared with a tied
    :class:`QuantizedLinear`): row ``i`` looks up as its dequantised values, ``dtype(q[i] * scales[i])`` (int4:
    ``dtype((q[i] * m[i]) * scales[i])``, the integer product exact; float32 products, rounded once)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, embedding_dim: int, dtype: torch.dtype,
                 padding_idx: int | None = None, group_scales: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = scales.shape[0], embedding_dim, dtype
        self.padding_idx = padding_idx
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("group_scales", group_scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_floating_point() or ids.dtype is torch.bool:
            raise TypeError(f"QuantizedEmbedding: ids must be integer token ids, got {ids.dtype}")
        if ids.numel() and bool(((ids < 0) | (ids >= self.num_embeddings)).any()):
            raise ValueError(f"QuantizedEmbedding: ids must be in [0, {self.num_embeddings}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without its range check (a read back from the device): for ids already checked, as a
        drafting step's are."""
        panel, lane = ids // _PANEL, ids % _PANEL
        rows = self.packed[panel, :, lane]  # [..., octets or quads, 4]: the rows' bytes in K order
        if self.group_scales is None:
            q = rows.reshape(*ids.shape, -1)[..., :self.embedding_dim].float()
        else:  # each 4-byte lane: 4 values in its low nibbles, then 4 in its high ones, stored as q + 8
            b = rows.int()
            u = torch.stack([b & 15, b >> 4], -2).reshape(*ids.shape, -1)[..., :self.embedding_dim]
            m = self.group_scales[panel, :, lane].int().repeat_interleave(_GROUP, -1)[..., :self.embedding_dim]
            q = ((u - 8) * m).float()
        return (q * self.scales[ids].unsqueeze(-1)).to(self.dtype)

    def extra_repr(self) -> str:
        scheme = "int8" if self.group_scales is None else "int4"
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, scheme={scheme}"


def linear_dtype(layer: nn.Module) -> torch.dtype | None:
    """The dtype a linear layer computes in, for the layers the packed kernels serve: a plain float linear layer
    (its weight's) or a :class:`QuantizedLinear`; None for any other module."""
    kind = type(layer)
    if kind is QuantizedLinear:
        return layer.dtype
    return layer._parameters["weight"].dtype if kind in PLAIN_LINEAR_TYPES else None


def linear_device(layer: nn.Module) -> torch.device:
    """Where a linear layer's weight lives (:func:`linear_dtype`'s layers)."""
    return layer.device if type(layer) is QuantizedLinear else layer._parameters["weight"].device


def linear_operand(layers: Sequence[nn.Module]) -> PackedLinear | None:
    """The operands of the layers' concatenation (q/k/v, gate/up, or one layer) for the packed kernels: the
    group's weight for :class:`QuantizedLinear` siblings quantised together (one layer: its own),
    :func:`~specdec_ext.models.fast_linear.packed_operand` for float layers; None for anything else (quantised
    layers not quantised as this group, a mix of kinds, layers those kernels do not serve)."""
    if all(type(m) is QuantizedLinear for m in layers):
        if len(layers) == 1:
            return layers[0].operand()
        group = layers[0].group
        if group is not None and group.size == len(layers) \
                and all(m.group is group and m.position == i for i, m in enumerate(layers)):
            return group.operand
        return None
    if all(type(m) in PLAIN_LINEAR_TYPES for m in layers):
        return packed_operand(layers)
    return None


def fused_product(x: torch.Tensor, layers: Sequence[nn.Module]) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)`` as one product where the layers allow it: quantised
    siblings quantised together through their group's weight, float layers by
    :func:`~specdec_ext.models.fast_linear.fused_linear`."""
    if type(layers[0]) is not QuantizedLinear:
        return fused_linear(x, layers)
    operand = linear_operand(layers)
    if operand is None:
        return torch.cat([layer(x) for layer in layers], -1)
    return operand(x)


def module_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers, each storage counted once (views of one weight, tied
    weights)."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _quantized_linear(layer: nn.Module, scheme: str, packed=None, scales=None, group_scales=None,
                      group: _Group | None = None, position: int = 0) -> QuantizedLinear:
    w = layer.weight
    if packed is None:
        packed, scales, group_scales = _pack(w.detach(), scheme)
    bias = layer.bias.detach().clone() if layer.bias is not None else None
    return QuantizedLinear(packed, scales, bias, w.shape[1], w.dtype, group, position, group_scales)


def _quantize_group(parent: nn.Module, names: tuple[str, ...], scheme: str) -> None:
    """The sibling projections ``names`` of ``parent`` quantised as one weight (see the module doc)."""
    layers = [parent._modules[n] for n in names]
    weight = torch.cat([m.weight.detach() for m in layers])
    packed, scales, group_scales = _pack(weight, scheme)
    biases = [m.bias for m in layers]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, layers)])
    group = _Group(PackedLinear(INT8 if group_scales is None else INT4, packed, bias, weight.shape[0], weight.dtype,
                                scales=scales, group_scales=group_scales), len(layers))
    start = 0
    for i, (name, m) in enumerate(zip(names, layers)):
        n = m.weight.shape[0]
        if start % _PANEL == 0 and (n % _PANEL == 0 or i == len(layers) - 1):  # whole panels: a view
            panels = slice(start // _PANEL, (start + n + _PANEL - 1) // _PANEL)
            view = packed[panels], scales[start: start + n], None if group_scales is None else group_scales[panels]
            new = _quantized_linear(m, scheme, *view, group=group, position=i)
        else:  # (a member off the panel grid keeps its own copy)
            new = _quantized_linear(m, scheme, group=group, position=i)
        setattr(parent, name, new)
        start += n


def _groupable(parent: nn.Module, names: tuple[str, ...]) -> bool:
    layers = [parent._modules.get(n) for n in names]
    if any(type(m) not in PLAIN_LINEAR_TYPES for m in layers):
        return False
    w = [m.weight for m in layers]
    return all(x.shape[1] == w[0].shape[1] and x.dtype is w[0].dtype and x.device == w[0].device for x in w)


@torch.no_grad()
def quantize_weights(module: nn.Module, scheme: str = "int8") -> nn.Module:
    """``module`` with its linear layers and embeddings quantised in ``scheme`` (``"int8"`` or ``"int4"``), in place
    (see the module doc); returns it. Layers already quantised are kept; a float weight holding inf or NaN is a
    ValueError. Idempotent."""
    if scheme not in DRAFT_QUANT_SCHEMES:
        raise ValueError(f"quantize_weights: scheme must be one of {DRAFT_QUANT_SCHEMES}, got {scheme!r}")
    by_weight: dict[int, QuantizedLinear] = {}  # a float weight's id -> the layer made of it (tied embeddings)
    for parent in list(module.modules()):
        for names in _FUSED_GROUPS:
            if _groupable(parent, names):
                olds = [parent._modules[n].weight for n in names]
                _quantize_group(parent, names, scheme)
                for w, n in zip(olds, names):
                    by_weight[id(w)] = parent._modules[n]
        for name, child in list(parent._modules.items()):
            if type(child) in PLAIN_LINEAR_TYPES:
                new = _quantized_linear(child, scheme)
                by_weight[id(child.weight)] = new
                setattr(parent, name, new)
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if type(child) is not nn.Embedding:
                continue
            if child.max_norm is not None:
                raise ValueError(f"quantize_weights: embedding {name!r} renormalises its rows (max_norm), which a "
                                 "quantised table cannot")
            tied = by_weight.get(id(child.weight))
            if tied is not None and tied.in_features == child.embedding_dim:
                packed, scales, group_scales = tied.packed, tied.scales, tied.group_scales
            else:
                packed, scales, group_scales = _pack(child.weight.detach(), scheme)
            setattr(parent, name, QuantizedEmbedding(packed, scales, child.embedding_dim, child.weight.dtype,
                                                     child.padding_idx, group_scales))
    return module


def embedding_lookup(embed: nn.Module):
    """``ids -> embeddings`` of a plain or int8 table without the module call's overhead, or None for any other
    embedding module (a scaled one, one with hooks: call it)."""
    if embed._forward_hooks or embed._forward_pre_hooks:
        return None
    if type(embed) is nn.Embedding and embed.max_norm is None:
        weight = embed.weight
        return lambda ids: F.embedding(ids, weight)
    return embed.lookup if type(embed) is QuantizedEmbedding else None  # (the step's ids are the engine's, checked)
