"""Weight-only int8 draft networks (``--draft-quant int8``): :func:`quantize_weights` and the layers it installs.

A drafter's network only proposes tokens: the target verifies every draft at its own precision, so greedy output
is the target's whatever the draft computes, and sampled output stays lossless as long as a draft is drawn from the
probabilities the drafter reports (which are the quantised network's own). A draft may therefore hold its weights
in int8: a quarter of float32's bytes to keep and to stream at every draft forward.

:func:`quantize_weights` changes a network in place:

* every linear layer (``nn.Linear`` and this library's :class:`~specdec_ext.models.fast_linear.Linear` /
  ``PackableLinear``) becomes an :class:`Int8Linear`: the weight quantised per output channel and laid out once by
  :func:`specdec_ext.ops.pack_linear_weight_int8`, the float weight released. Its product is
  :func:`specdec_ext.ops.packed_linear_int8` (each input row quantised on the fly, exact integer sums);
* a Llama-style layer's ``q/k/v`` and ``gate/up`` projections are quantised as one weight each (per-channel
  quantisation of a concatenation is the concatenation of the quantisations) and, where their sizes fall on the
  layout's 32-row panels, the members hold views of it: the draft layer op's fused products read it with no second
  copy (:func:`linear_operand`);
* every ``nn.Embedding`` becomes an :class:`Int8Embedding` (rows quantised the same way; a lookup is ``T(q * s)``);
  one tied to a linear layer's weight reads that layer's int8 weight.

Biases and norms stay in the network's dtype. The int8 layers compute in the dtype the float weights had
(:func:`linear_dtype`), on CPU (AVX-512 VNNI / AVX2 / portable) and CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec_ext import ops
from specdec_ext.models.fast_linear import INT8, PLAIN_LINEAR_TYPES, PackedLinear, fused_linear, packed_operand

__all__ = ["DRAFT_QUANT_SCHEMES", "Int8Embedding", "Int8Linear", "check_draft_quant", "embedding_lookup",
           "fused_product", "linear_device", "linear_dtype", "linear_operand", "module_bytes", "quantize_weights"]

DRAFT_QUANT_SCHEMES = ("int8",)

# The groups of sibling projections that the draft layer op multiplies as one weight.
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PANEL = 32  # output rows per panel of the int8 layout (csrc/kernels/common/params.h)


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


class Int8Linear(nn.Module):
    """A linear layer holding only its int8 weight: ``packed`` / ``scales`` (buffers: pack_linear_weight_int8's
    output for ``[out_features, in_features]``) and a float ``bias`` or None; inputs and outputs of ``dtype``. Built
    by :func:`quantize_weights`; not trainable."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 dtype: torch.dtype, group: _Group | None = None, position: int = 0):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, scales.shape[0], dtype
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self.group, self.position = group, position  # the fused weight this one is a view of, and its place there

    @classmethod
    @torch.no_grad()
    def of(cls, layer: nn.Linear) -> "Int8Linear":
        """A float linear layer quantised (the layer itself is left as it is)."""
        return _int8_linear(layer)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def operand(self) -> PackedLinear:
        """This layer's operands for the packed kernels (the int8 kind of :class:`PackedLinear`)."""
        return PackedLinear(INT8, self.packed, self.bias, self.out_features, self.dtype, scales=self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.packed_linear_int8(x, self.packed, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"dtype={self.dtype}"


class Int8Embedding(nn.Module):
    """An embedding table held as int8 rows (``packed`` / ``scales``: pack_linear_weight_int8's layout of the
    ``[num_embeddings, embedding_dim]`` table, shared with a tied :class:`Int8Linear`): row ``i`` looks up as
    ``dtype(q[i] * scales[i])`` (float32 product, rounded once)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, embedding_dim: int, dtype: torch.dtype,
                 padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = scales.shape[0], embedding_dim, dtype
        self.padding_idx = padding_idx
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_floating_point() or ids.dtype is torch.bool:
            raise TypeError(f"Int8Embedding: ids must be integer token ids, got {ids.dtype}")
        if ids.numel() and bool(((ids < 0) | (ids >= self.num_embeddings)).any()):
            raise ValueError(f"Int8Embedding: ids must be in [0, {self.num_embeddings}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without its range check (a read back from the device): for ids already checked, as a
        drafting step's are."""
        rows = self.packed[ids // _PANEL, :, ids % _PANEL]  # [..., ceil(E / 4), 4]: row ids' values, 4 at a time
        q = rows.reshape(*ids.shape, -1)[..., :self.embedding_dim]
        return (q.float() * self.scales[ids].unsqueeze(-1)).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"


def linear_dtype(layer: nn.Module) -> torch.dtype | None:
    """The dtype a linear layer computes in, for the layers the packed kernels serve: a plain float linear layer
    (its weight's) or an :class:`Int8Linear`; None for any other module."""
    kind = type(layer)
    if kind is Int8Linear:
        return layer.dtype
    return layer._parameters["weight"].dtype if kind in PLAIN_LINEAR_TYPES else None


def linear_device(layer: nn.Module) -> torch.device:
    """Where a linear layer's weight lives (:func:`linear_dtype`'s layers)."""
    return layer.device if type(layer) is Int8Linear else layer._parameters["weight"].device


def linear_operand(layers: Sequence[nn.Module]) -> PackedLinear | None:
    """The operands of the layers' concatenation (q/k/v, gate/up, or one layer) for the packed kernels: the int8
    group's weight for :class:`Int8Linear` siblings quantised together (one layer: its own),
    :func:`~specdec_ext.models.fast_linear.packed_operand` for float layers; None for anything else (int8 layers
    not quantised as this group, a mix of kinds, layers those kernels do not serve)."""
    if all(type(m) is Int8Linear for m in layers):
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
    """``torch.cat([layer(x) for layer in layers], -1)`` as one product where the layers allow it: int8 siblings
    quantised together through their group's weight, float layers by
    :func:`~specdec_ext.models.fast_linear.fused_linear`."""
    if type(layers[0]) is not Int8Linear:
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


def _int8_linear(layer: nn.Module, packed=None, scales=None, group: _Group | None = None,
                 position: int = 0) -> Int8Linear:
    w = layer.weight
    if packed is None:
        packed, scales = ops.pack_linear_weight_int8(w.detach())
    bias = layer.bias.detach().clone() if layer.bias is not None else None
    return Int8Linear(packed, scales, bias, w.shape[1], w.dtype, group, position)


def _quantize_group(parent: nn.Module, names: tuple[str, ...]) -> None:
    """The sibling projections ``names`` of ``parent`` quantised as one weight (see the module doc)."""
    layers = [parent._modules[n] for n in names]
    weight = torch.cat([m.weight.detach() for m in layers])
    packed, scales = ops.pack_linear_weight_int8(weight)
    biases = [m.bias for m in layers]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, layers)])
    group = _Group(PackedLinear(INT8, packed, bias, weight.shape[0], weight.dtype, scales=scales), len(layers))
    start = 0
    for i, (name, m) in enumerate(zip(names, layers)):
        n = m.weight.shape[0]
        if start % _PANEL == 0 and (n % _PANEL == 0 or i == len(layers) - 1):  # whole panels: a view
            view = packed[start // _PANEL: (start + n + _PANEL - 1) // _PANEL], scales[start: start + n]
            new = _int8_linear(m, *view, group=group, position=i)
        else:  # (a member off the panel grid keeps its own copy)
            new = _int8_linear(m, group=group, position=i)
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
    """``module`` with its linear layers and embeddings int8, in place (see the module doc); returns it. Layers
    already int8 are kept; a float weight holding inf or NaN is a ValueError. Idempotent."""
    if scheme not in DRAFT_QUANT_SCHEMES:
        raise ValueError(f"quantize_weights: scheme must be one of {DRAFT_QUANT_SCHEMES}, got {scheme!r}")
    by_weight: dict[int, Int8Linear] = {}  # a float weight's id -> the int8 layer made of it (tied embeddings)
    for parent in list(module.modules()):
        for names in _FUSED_GROUPS:
            if _groupable(parent, names):
                olds = [parent._modules[n].weight for n in names]
                _quantize_group(parent, names)
                for w, n in zip(olds, names):
                    by_weight[id(w)] = parent._modules[n]
        for name, child in list(parent._modules.items()):
            if type(child) in PLAIN_LINEAR_TYPES:
                new = _int8_linear(child)
                by_weight[id(child.weight)] = new
                setattr(parent, name, new)
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if type(child) is not nn.Embedding:
                continue
            if child.max_norm is not None:
                raise ValueError(f"quantize_weights: embedding {name!r} renormalises its rows (max_norm), which an "
                                 "int8 table cannot")
            tied = by_weight.get(id(child.weight))
            if tied is not None and tied.in_features == child.embedding_dim:
                packed, scales = tied.packed, tied.scales
            else:
                packed, scales = ops.pack_linear_weight_int8(child.weight.detach())
            setattr(parent, name, Int8Embedding(packed, scales, child.embedding_dim, child.weight.dtype,
                                                child.padding_idx))
    return module


def embedding_lookup(embed: nn.Module):
    """``ids -> embeddings`` of a plain or int8 table without the module call's overhead, or None for any other
    embedding module (a scaled one, one with hooks: call it)."""
    if embed._forward_hooks or embed._forward_pre_hooks:
        return None
    if type(embed) is nn.Embedding and embed.max_norm is None:
        weight = embed.weight
        return lambda ids: F.embedding(ids, weight)
    return embed.lookup if type(embed) is Int8Embedding else None  # (the step's ids are the engine's, checked)
