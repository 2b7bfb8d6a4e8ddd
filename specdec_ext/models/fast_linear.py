"""Linear layers of the drafters' own networks, with the weight laid out once for oneDNN on CPU.

A drafter runs a few rows through small matrices several times per decoding step, so its linear layers are a large
part of the drafting time. On CPU, aten's bfloat16 ``linear`` lays the weight out for oneDNN again on every call;
packing it once (``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s freezing pass does) and
calling ``torch.ops.mkldnn._linear_pointwise`` made a ``[1, 384] x [384, 1024]`` product 1.5x faster and a
``[384, 4096]`` vocabulary projection 2x faster at 1-4 rows on the development CPU, and no slower at 64-200 rows;
the results are bit-identical to aten's in our checks. float32 gains nothing at one row, and float16 needs CPU
features (AVX-NE-CONVERT / AVX512-FP16) many machines lack, so both keep aten's path, as do CUDA tensors and any
call that records gradients (training).

:func:`linear` is ``F.linear`` with that fast path; :class:`Linear` is an ``nn.Linear`` whose forward uses it (same
parameters, same state-dict keys); :func:`fused_linear` runs several projections of one input (q/k/v, gate/up) as
one product. The packed copy (as large as the weight) is cached per weight tensor and rebuilt when the weight
changes in place (its version counter) or is replaced. ``SPECDEC_PACKED_LINEAR=0`` turns the fast path off.

A model that is not ours (a Hugging Face draft model) opts in with :func:`pack_linears`: its plain ``nn.Linear``
layers become :class:`PackableLinear` (same parameters, keys and ``isinstance``), which take the fast path only
inside a :func:`packed_linears` block and are ``nn.Linear`` everywhere else. The draft-model drafter does this for
its draft model and drafts inside the block, so the model is unchanged for any other caller (Hugging Face's own
assisted generation, training). On the model family in bfloat16 it made draft-model decoding 0-4% faster (the
draft LM's 256-wide products cost ~20 us each whichever path they take).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Linear", "PackableLinear", "fused_linear", "linear", "module_linear", "pack_linears", "packed_enabled",
           "packed_linears", "tensor_version", "unpack_linears"]

_ENABLED = os.environ.get("SPECDEC_PACKED_LINEAR", "1") != "0"
_PACKED = WeakIdKeyDictionary()  # weight -> (version, data_ptr, packed weight)
_BROKEN: list[str] = []  # why the fast path is off on this machine (set at the first failure)


_MKLDNN = torch.backends.mkldnn.is_available()


def packed_enabled() -> bool:
    """Whether :func:`linear` may take the packed oneDNN path on this machine."""
    return _ENABLED and _MKLDNN and not _BROKEN


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter; -1 for inference tensors, which have none (in-place updates of a weight made
    under ``torch.inference_mode`` are then not seen: rebuild such a model rather than edit it in place)."""
    return -1 if t.is_inference() else t._version


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    key = (tensor_version(weight), weight.data_ptr())
    hit = _PACKED.get(weight)
    if hit is not None and hit[:2] == key:
        return hit[2]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    except (RuntimeError, AttributeError) as e:  # a build or CPU without the bf16 oneDNN path
        _BROKEN.append(f"{type(e).__name__}: {e}")
        return None
    _PACKED[weight] = (*key, packed)
    return packed


def _fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # (cheapest tests first: this runs before every product of a drafting step)
    if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.is_cuda or weight.is_cuda:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    return (weight.device.type == "cpu" and x.device.type == "cpu" and weight.dim() == 2 and x.dim() >= 2
            and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype is torch.bfloat16 and bias.device.type == "cpu"))
            and packed_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x[..., K]``, ``weight[N, K]``, ``bias[N]`` -> ``[..., N]``; bfloat16 on CPU
    without gradients goes through the weight packed once (see the module doc)."""
    if _fast(x, weight, bias):
        packed = _packed(weight)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


_FUSED = WeakIdKeyDictionary()  # first layer's weight -> (versions, fused weight, fused bias)


def fused_linear(x: torch.Tensor, layers: Sequence[nn.Linear]) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)`` for linear layers with the same input width (q/k/v or
    gate/up projections): on the fast path one product with the weights concatenated once (cached, rebuilt when a
    weight changes)."""
    first = layers[0]
    if not _fast(x, first.weight, first.bias):
        return torch.cat([layer(x) for layer in layers], -1)
    params = [t for layer in layers for t in (layer.weight, layer.bias)]
    key = tuple((tensor_version(t), t.data_ptr()) if t is not None else None for t in params)
    hit = _FUSED.get(first.weight)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            weight = torch.cat([layer.weight for layer in layers])
            biases = [layer.bias for layer in layers]
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else layer.weight.new_zeros(layer.weight.shape[0])
                 for b, layer in zip(biases, layers)])
        hit = _FUSED[first.weight] = (key, weight, bias)
    return linear(x, hit[1], hit[2])


def module_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a linear layer that is not ours (a target's ``lm_head``): the fast path when it is a plain
    ``nn.Linear`` without hooks, else the module's own call (its subclass's forward, its hooks)."""
    if type(module) in (nn.Linear, Linear, PackableLinear) and not (module._forward_hooks
                                                                      or module._forward_pre_hooks):
        return linear(x, module.weight, module.bias)
    return module(x)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters and state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


_IN_BLOCK = contextvars.ContextVar("specdec_packed_linears", default=False)


@contextlib.contextmanager
def packed_linears(enabled: bool = True):
    """Within this block, :class:`PackableLinear` layers take :func:`linear`'s fast path (``enabled=False``: a
    no-op block)."""
    token = _IN_BLOCK.set(bool(enabled))
    try:
        yield
    finally:
        _IN_BLOCK.reset(token)


class PackableLinear(nn.Linear):
    """An ``nn.Linear`` of someone else's model after :func:`pack_linears`: :func:`linear` inside a
    :func:`packed_linears` block, ``F.linear`` outside (exactly ``nn.Linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _IN_BLOCK.get():
            return linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Makes every plain ``nn.Linear`` of ``model`` (not subclasses: quantised or custom layers keep their own
    forward) a :class:`PackableLinear`, in place; returns how many are packable. Idempotent. The packed weights
    are built at the first product inside :func:`packed_linears` (memory: a copy of each bfloat16 weight)."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackableLinear
        n += type(module) is PackableLinear
    return n


def unpack_linears(model: nn.Module) -> None:
    """Undoes :func:`pack_linears` (plain ``nn.Linear`` again) and drops the packed copies."""
    for module in model.modules():
        if type(module) is PackableLinear:
            module.__class__ = nn.Linear
            _PACKED.pop(module.weight, None)
