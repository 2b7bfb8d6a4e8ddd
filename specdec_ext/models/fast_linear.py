"""Linear layers with the weight packed once, for the few-row products of decoding on CPUs.

Decoding multiplies one row (plain decoding), or the 2-16 rows of a draft tree (verification, drafting), by every
weight of a model. On CPUs aten's products are poor at that size: float32 products of 5-16 rows cost 1.6-2x a
one-row product (MKL lays the weight out again on every call), and bfloat16 one-row products stream the weight at a
third of memory bandwidth. :func:`linear` instead calls the ``specdec_ext::packed_linear`` kernel on a copy of the
weight laid out once (:func:`specdec_ext.ops.pack_linear_weight`), where a few rows cost about what reading the
weight costs, as on a GPU. Measured on the development CPU (AVX-512 with AVX512-BF16, 1 thread, the family
target's 57 weight matrices streamed from memory, ``benchmarks/python/bench_packed_linear.py``): float32 1 row
5.4 -> 2.6 ms, 9 rows 9.7 -> 3.5 ms; bfloat16 1 row 4.5 -> 1.6 ms, 9 rows 5.6 -> 1.8 ms. Every output element is
one float32 accumulation in a fixed order, so a row's result does not depend on how many rows the call has.

The kernel's vector paths need AVX-512 (float32), AVX512-BF16 (bfloat16) or AVX2 with FMA (both dtypes, on x86-64
CPUs without those) (:func:`specdec_ext.ops.packed_linear_path`); elsewhere bfloat16 falls back to weights packed
once for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``, 1.5-2x aten at 1-4 rows where the CPU has a bfloat16 oneDNN path),
and everything else (float16, CUDA tensors, calls that record gradients) takes ``F.linear``.
``SPECDEC_PACKED_LINEAR=0`` turns every fast path off.

:func:`linear` is ``F.linear`` with that fast path; :class:`Linear` is an ``nn.Linear`` whose forward uses it (same
parameters, same state-dict keys); :func:`fused_linear` runs several projections of one input (q/k/v, gate/up) as
one product. The packed copy (as large as the weight) is cached per weight tensor and rebuilt when the weight
changes in place (its version counter) or is replaced.

A model that is not ours (a Hugging Face target or draft model) is prepared with :func:`pack_linears`: its plain
``nn.Linear`` layers become :class:`PackableLinear` (same parameters, keys and ``isinstance``), which take the fast
path only inside a :func:`packed_linears` block and are ``nn.Linear`` everywhere else. :func:`specdec_ext.generate`
prepares its target so by default (:func:`pack_linears_where_fast`; ``packed_linears=False`` opts out) and runs
inside such a block, so plain and speculative decoding both use the packed weights while the model is unchanged for
any other caller (training, Hugging Face's ``generate``). The cost is memory: a packed copy of every weight, built at
its first product inside the block.

Mixture-of-experts blocks keep their experts as 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
behind transformers' experts interface, whose CPU route (``grouped_mm``) multiplies a few rows at aten's speed after
sorting and histogramming them. :func:`pack_linears` points such a model's experts at :data:`EXPERTS_IMPLEMENTATION`
(``"specdec_packed"``): inside the block each expert's two products are packed products of its rows, weighted and
summed in expert order (a row's result is again independent of the batch); outside it, or for a layout it does not
serve (biases, post-expert norms, no gate, expert parallelism), the implementation the model had runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from specdec_ext.ops import pack_linear_weight, packed_linear_int4, packed_linear_int8, packed_linear_path

__all__ = ["EXPERTS_IMPLEMENTATION", "INT4", "INT8", "Linear", "PLAIN_LINEAR_TYPES", "PackableLinear", "PackedLinear",
           "bfloat16_is_fast", "fused_linear", "in_packed_linears_block", "layer_operand", "linear", "module_linear",
           "pack_linears", "pack_linears_where_fast", "packed_enabled", "packed_linears", "packed_operand",
           "packed_experts_forward", "tensor_version", "unpack_linears"]

_ENABLED = os.environ.get("SPECDEC_PACKED_LINEAR", "1") != "0"
_PACKED = WeakIdKeyDictionary()  # weight -> its PackedLinear (source: the weight's version and address)
_BROKEN: list[str] = []  # why the oneDNN fallback is off on this machine (set at its first failure)
_MKLDNN = torch.backends.mkldnn.is_available()
_OURS = "ours"  # the specdec_ext::packed_linear kernel
_ONEDNN = "onednn"  # the bfloat16 fallback
INT8 = "int8"  # specdec_ext::packed_linear_int8 (an int8 weight and its scales: specdec_ext.models.quantized)
INT4 = "int4"  # specdec_ext::packed_linear_int4 (an int4 weight, its scales and group scales: the same module)


@dataclass(slots=True, eq=False)
class PackedLinear:
    """A linear product's operands, packed once for one kernel: every cache of packed weights here holds these.
    ``packed`` is the weight (or several layers' weights concatenated along the outputs) in ``kernel``'s layout,
    ``dtype`` the weight's. ``source`` records what it was packed from (ids, versions and addresses: a plain tuple,
    compared at C speed) and ``tensors`` holds those tensors, so that no id in ``source`` is reused while the
    record is remembered. The ``INT8`` kind holds an int8 weight (``packed``) with its ``scales``, the ``INT4`` kind
    an int4 weight with its ``scales`` and ``group_scales``; ``dtype`` is then the dtype it computes in."""

    kernel: str
    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    dtype: torch.dtype
    source: tuple = ()
    tensors: tuple = ()
    scales: torch.Tensor | None = None
    group_scales: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The product of ``x`` (None where the kernel cannot take it: oneDNN and a 1-D input)."""
        if self.kernel == INT8:
            return packed_linear_int8(x, self.packed, self.scales, self.bias)
        if self.kernel == INT4:
            return packed_linear_int4(x, self.packed, self.group_scales, self.scales, self.bias)
        return _apply(self.kernel, x, self.packed, self.bias, self.out_features)


@functools.cache
def _kernel_choice(dtype: torch.dtype) -> str | None:
    """Which fast path ``dtype`` takes on this CPU (None: F.linear), decided once per dtype."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    if packed_linear_path(dtype) != "generic":
        return _OURS
    return _ONEDNN if dtype is torch.bfloat16 and _MKLDNN else None


def _kernel_for(dtype: torch.dtype) -> str | None:
    kernel = _kernel_choice(dtype)
    return None if kernel == _ONEDNN and _BROKEN else kernel


def packed_enabled(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`linear` may take a packed path for ``dtype`` on this machine."""
    return _ENABLED and _kernel_for(dtype) is not None


def bfloat16_is_fast(device: torch.device | str = "cpu") -> bool:
    """Whether bfloat16 products beat float32 ones on ``device``: a CUDA device, or a CPU where :func:`linear` takes
    the AVX512-BF16 path (half the bytes per weight and twice the multiply rate). Elsewhere a CPU computes bfloat16
    through float32 conversions and is slower than float32."""
    if torch.device(device).type == "cuda":
        return True
    if not _ENABLED or _kernel_for(torch.bfloat16) != _OURS:
        return False
    # (the AVX2 path reads half the bytes too, but multiplies through float32 conversions, as attention does)
    return packed_linear_path(torch.bfloat16) == "avx512_bf16"


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter; -1 for inference tensors, which have none (in-place updates of a weight made
    under ``torch.inference_mode`` are then not seen: rebuild such a model rather than edit it in place)."""
    return -1 if t.is_inference() else t._version


def _packed(weight: torch.Tensor, kernel: str) -> PackedLinear | None:
    """``weight`` packed for ``kernel`` (without a bias: a layer's bias is its own), remembered per weight."""
    source = (tensor_version(weight), weight.data_ptr())
    hit = _PACKED.get(weight)
    if hit is not None and hit.kernel == kernel and hit.source == source:
        return hit
    if kernel == _OURS:
        packed = pack_linear_weight(weight.detach())
    else:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        except (RuntimeError, AttributeError) as e:  # a build or CPU without the bf16 oneDNN path
            _BROKEN.append(f"{type(e).__name__}: {e}")
            return None
    # (no tensors held: the weak key is the weight, which a strong reference here would keep alive)
    record = PackedLinear(kernel, packed, None, weight.shape[0], weight.dtype, source)
    _PACKED[weight] = record
    return record


def _fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """The fast path for this call, or None. (Cheapest tests first: this runs before every product.)"""
    if x.dtype is not weight.dtype or x.is_cuda or weight.is_cuda or not _ENABLED:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return None
    if not (weight.device.type == "cpu" and x.device.type == "cpu" and weight.dim() == 2 and x.dim() >= 1
            and x.shape[-1] == weight.shape[1] and weight.numel() > 0
            and (bias is None or (bias.dtype is weight.dtype and bias.device.type == "cpu"))):
        return None
    return _kernel_for(weight.dtype)


@functools.cache
def _packed_linear_op():
    return torch.ops.specdec_ext.packed_linear.default  # (resolved once: the attribute chain costs ~1 us a call)


def _apply(kernel: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor | None:
    if kernel == _OURS:
        return _packed_linear_op()(x, packed, bias, out_features)
    if x.dim() >= 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """(result, the weight's PackedLinear, or None when F.linear ran)."""
    kernel = _fast(x, weight, bias)
    if kernel is not None:
        packed = _packed(weight, kernel)
        if packed is not None:
            y = _apply(kernel, x, packed.packed, bias, packed.out_features)
            if y is not None:
                return y, packed
    return F.linear(x, weight, bias), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x[..., K]``, ``weight[N, K]``, ``bias[N]`` -> ``[..., N]``; on CPU without
    gradients, float32 and bfloat16 go through the weight packed once (see the module doc)."""
    return _linear(x, weight, bias)[0]


def _module_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """:func:`linear` for a layer, with its packed weight remembered on the layer: a decoding step makes hundreds of
    these calls, and the checks of :func:`linear` cost a few microseconds each (the product of a 256-wide layer
    takes about as long). The remembered weight is used only while it is the same tensor at the same version, for
    a CPU input of its dtype without gradients; anything else takes :func:`linear`."""
    w = module.weight
    hit = module._specdec_packed  # (its bias is the module's, read at each call)
    if (hit is not None and hit.source == (id(w), tensor_version(w), w.data_ptr())
            and x.dtype is w.dtype and not x.is_cuda and not torch.is_grad_enabled()):
        y = _apply(hit.kernel, x, hit.packed, module.bias, hit.out_features)
        if y is not None:
            return y
    y, used = _linear(x, w, module.bias)
    if used is not None:
        module._specdec_packed = PackedLinear(used.kernel, used.packed, None, used.out_features, used.dtype,
                                              (id(w), *used.source), (w,))
    return y


def _fused_key(layers: Sequence[nn.Linear]) -> tuple:
    """What a fused weight was built from (its :attr:`PackedLinear.source`): each layer's weight and bias by id,
    version and address; the record holds the tensors themselves (:func:`_fused_tensors`)."""
    key = []
    for layer in layers:
        params = layer._parameters  # (not layer.weight: a module's attribute lookup costs ~0.6 us)
        for t in (params["weight"], params.get("bias")):
            key.append((id(t), tensor_version(t), t.data_ptr()) if t is not None else None)
    return tuple(key)


def _fused_tensors(layers: Sequence[nn.Linear]) -> tuple:
    return tuple(t for layer in layers for t in (layer.weight, layer.bias))


def _concatenated(layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights concatenated along the outputs, and their biases (zeros for a layer without; None when
    none has one)."""
    with torch.no_grad():
        weight = torch.cat([layer.weight for layer in layers]) if len(layers) > 1 else layers[0].weight.detach()
        biases = [layer.bias for layer in layers]
        if all(b is None for b in biases):
            return weight, None
        return weight, torch.cat([b.detach() if b is not None else layer.weight.new_zeros(layer.weight.shape[0])
                                  for b, layer in zip(biases, layers)])


def layer_operand(layer: nn.Linear) -> PackedLinear | None:
    """One linear layer's operands for ``specdec_ext::packed_linear``, with its bias: the packed copy its own
    products use (:func:`linear`'s cache, validated by the weight's version and address: a weight replaced or changed
    in place is packed again), or None where that kernel does not serve it (see :func:`packed_operand`)."""
    params = layer._parameters
    w, bias = params["weight"], params.get("bias")
    if not _ENABLED or w.device.type != "cpu" or _kernel_for(w.dtype) != _OURS:
        return None
    weight = _packed(w, _OURS)
    return PackedLinear(_OURS, weight.packed, bias.detach() if bias is not None else None, weight.out_features,
                        weight.dtype)


def packed_operand(layers: Sequence[nn.Linear]) -> PackedLinear | None:
    """The operands of the layers' concatenation for ``specdec_ext::packed_linear`` (and ops built on it,
    :func:`specdec_ext.ops.draft_decoder_layer`), or None where that kernel does not serve them (CUDA weights,
    a dtype or CPU without its vector path, ``SPECDEC_PACKED_LINEAR=0``). One layer: :func:`layer_operand` (the copy
    its own products use); several: remembered on the first layer as :func:`fused_linear` remembers it (the same
    entry). Either way the weights are packed once."""
    if len(layers) == 1:
        return layer_operand(layers[0])
    first = layers[0]
    key = _fused_key(layers)
    hit = first.__dict__.get("_specdec_fused")
    if hit is not None and hit.kernel == _OURS and hit.source == key:  # (packed from these very tensors, as they are)
        return hit
    w = first.weight
    if not _ENABLED or w.device.type != "cpu" or _kernel_for(w.dtype) != _OURS:
        return None
    weight, bias = _concatenated(layers)
    record = PackedLinear(_OURS, pack_linear_weight(weight), bias, weight.shape[0], weight.dtype, key,
                          _fused_tensors(layers))
    first.__dict__["_specdec_fused"] = record
    _share_panels(layers, record.packed)
    return record


def _share_panels(layers: Sequence[nn.Linear], packed: torch.Tensor) -> None:
    """Makes each layer's own packed weight (:func:`_packed`'s, for its products outside the fused call) a view of
    its panels in the fused ``packed``, where its outputs start on a 32-row panel and fill whole panels (or end the
    group, whose padding is its own): one packed copy of q/k/v or gate/up, not two. A layer packed already keeps
    its copy."""
    start = 0
    for i, layer in enumerate(layers):
        w = layer._parameters["weight"]
        n = w.shape[0]
        if start % 32:
            return
        if n % 32 and i < len(layers) - 1:
            return
        held = _PACKED.get(w)
        if held is None or held.source != (tensor_version(w), w.data_ptr()):
            view = packed[start // 32: start // 32 + (n + 31) // 32]
            _PACKED[w] = PackedLinear(_OURS, view, None, n, w.dtype, (tensor_version(w), w.data_ptr()))
        start += n


def fused_linear(x: torch.Tensor, layers: Sequence[nn.Linear]) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)`` for linear layers with the same input width (q/k/v or
    gate/up projections): on the fast path one product with the weights concatenated and packed once. The first
    layer remembers the fused packed weight (rebuilt when any weight or bias is replaced or changed in place); a
    call that finds it valid costs the product plus ~3 us, where the generic route costs ~20 us more."""
    first = layers[0]
    hit = first.__dict__.get("_specdec_fused")
    if hit is not None and not (x.dtype is hit.dtype and hit.source == _fused_key(layers)):
        hit = None  # another input dtype, or a weight replaced or changed since it was packed
    # (the cheap checks of a decoding step first; with gradients on, the fast path's own, which frozen models pass)
    fast = hit is not None and not x.is_cuda and not torch.is_grad_enabled()
    if not fast and not _fast(x, first.weight, first.bias):
        return torch.cat([layer(x) for layer in layers], -1)
    if hit is not None:
        y = hit(x)
        if y is not None:
            return y
    weight, bias = _concatenated(layers)
    y, used = _linear(x, weight, bias)
    if used is not None:  # (the fused copy lives on in the packed one; _PACKED's entry dies with `weight`)
        first.__dict__["_specdec_fused"] = PackedLinear(used.kernel, used.packed, bias, used.out_features,
                                                        weight.dtype, _fused_key(layers), _fused_tensors(layers))
    return y


def module_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a linear layer that is not ours (a target's ``lm_head``): the fast path when it is a plain
    ``nn.Linear`` without hooks, else the module's own call (its subclass's forward, its hooks)."""
    kind = type(module)
    if kind in PLAIN_LINEAR_TYPES and not (module._forward_hooks or module._forward_pre_hooks):
        return linear(x, module.weight, module.bias) if kind is nn.Linear else _module_forward(module, x)
    return module(x)


class _RemembersPacked:
    """The packed weights a layer remembers (:func:`_module_forward`, and :func:`fused_linear` on a group's first
    layer); never pickled or deep-copied (a copy packs its own weights at its first product)."""

    _specdec_packed = None  # the PackedLinear of the last fast product (source: the weight's id, version, address)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_specdec_packed", None)
        state.pop("_specdec_fused", None)
        return state


class Linear(_RemembersPacked, nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters and state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _module_forward(self, x)


_IN_BLOCK = contextvars.ContextVar("specdec_packed_linears", default=False)


def in_packed_linears_block() -> bool:
    """Whether :class:`PackableLinear` layers take the fast path here (inside an enabled :func:`packed_linears`)."""
    return _IN_BLOCK.get()


@contextlib.contextmanager
def packed_linears(enabled: bool = True):
    """Within this block, :class:`PackableLinear` layers take :func:`linear`'s fast path (``enabled=False``: a
    no-op block)."""
    token = _IN_BLOCK.set(bool(enabled))
    try:
        yield
    finally:
        _IN_BLOCK.reset(token)


class PackableLinear(_RemembersPacked, nn.Linear):
    """An ``nn.Linear`` of someone else's model after :func:`pack_linears`: :func:`linear` inside a
    :func:`packed_linears` block, ``F.linear`` outside (exactly ``nn.Linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _IN_BLOCK.get():
            return _module_forward(self, x)
        return F.linear(x, self.weight, self.bias)


# The linear layers whose forward is exactly F.linear on the fast path (subclasses may compute something else).
PLAIN_LINEAR_TYPES = (nn.Linear, Linear, PackableLinear)


def pack_linears(model: nn.Module) -> int:
    """Makes every plain ``nn.Linear`` of ``model`` (not subclasses: quantised or custom layers keep their own
    forward) a :class:`PackableLinear`, and points its mixture-of-experts blocks at :data:`EXPERTS_IMPLEMENTATION`
    (module doc), in place; returns how many linear layers and experts blocks are packable. Idempotent. The packed
    weights are built at the first product inside :func:`packed_linears` (memory: a copy of each float32 or
    bfloat16 weight)."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackableLinear
        n += type(module) is PackableLinear
    return n + _pack_experts(model)


def pack_linears_where_fast(model: nn.Module) -> int:
    """:func:`pack_linears` for a model whose weights are on a CPU in a dtype with a packed path here
    (:func:`packed_enabled`); a no-op (0) otherwise, e.g. on CUDA or in float16 (what :func:`specdec_ext.generate`
    does to its target by default)."""
    p = next((q for q in model.parameters() if q.is_floating_point()), None)
    if p is None or p.device.type != "cpu" or not packed_enabled(p.dtype):
        return 0
    return pack_linears(model)


def unpack_linears(model: nn.Module) -> None:
    """Undoes :func:`pack_linears` (plain ``nn.Linear`` again) and drops the packed copies."""
    for module in model.modules():
        if type(module) is PackableLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("_specdec_packed", None)
            _PACKED.pop(module.weight, None)
        elif _is_experts(module) and "_specdec_experts_fallback" in module.__dict__:
            module.config._experts_implementation = module.__dict__.pop("_specdec_experts_fallback")
            for key in ("_specdec_experts_packed", "_specdec_experts"):
                module.__dict__.pop(key, None)


EXPERTS_IMPLEMENTATION = "specdec_packed"  # (in transformers' experts interface: pack_linears's packed products)


def _is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts block dispatched through the experts interface (the
    ``use_experts_implementation`` decorator wraps its forward and gives it ``_apply_gate``)."""
    params = module._parameters
    return (hasattr(type(module), "_apply_gate") and hasattr(type(module).forward, "__wrapped__")
            and isinstance(params.get("gate_up_proj"), torch.Tensor)
            and isinstance(params.get("down_proj"), torch.Tensor)
            and getattr(module, "config", None) is not None)


def _experts_layout_served(module: nn.Module) -> bool:
    """The layouts the packed route reproduces: gate and up concatenated in one 3-D weight, no biases, no
    post-expert norm, every expert local."""
    return (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
            and not getattr(module, "has_bias", True)
            and not getattr(module, "has_post_expert_norm", True) and not getattr(module, "_is_expert_parallel", True)
            and module.gate_up_proj.dim() == 3 and module.down_proj.dim() == 3)


def _pack_experts(model: nn.Module) -> int:
    """Points ``model``'s experts blocks at the packed route (idempotent), each remembering the implementation the
    model had (blocks share the model's config) and whether the route serves its layout; returns how many it
    serves."""
    blocks = [m for m in model.modules() if _is_experts(m)]
    for block in blocks:
        block.__dict__.setdefault("_specdec_experts_fallback", block.config._experts_implementation)
        block.__dict__["_specdec_experts_packed"] = _experts_layout_served(block)
    for block in blocks:
        block.config._experts_implementation = EXPERTS_IMPLEMENTATION
    return sum(block._specdec_experts_packed for block in blocks)


def _expert_operand(module: nn.Module, name: str, expert: int) -> PackedLinear:
    """Expert ``expert``'s weight of parameter ``name`` packed, remembered on the block per (name, expert) and
    rebuilt when the parameter is replaced or changed in place."""
    param = module._parameters[name]
    source = (id(param), tensor_version(param), param.data_ptr())
    cache = module.__dict__.setdefault("_specdec_experts", {})
    hit = cache.get((name, expert))
    if hit is not None and hit.source == source:
        return hit
    weight = param[expert].detach()
    weight = (weight.t() if module.is_transposed else weight).contiguous()  # [out, in]
    record = PackedLinear(_OURS, pack_linear_weight(weight), None, weight.shape[0], weight.dtype, source, (param,))
    cache[(name, expert)] = record
    return record


def _expert_rows(module: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``down(gate(x) * up(x))`` of one expert for its rows ``x [S, H]``."""
    h = module._apply_gate(_expert_operand(module, "gate_up_proj", expert)(x))
    return _expert_operand(module, "down_proj", expert)(h)


def _fallback_experts(module: nn.Module):
    name = module.__dict__.get("_specdec_experts_fallback")
    original = type(module).forward.__wrapped__
    if name in (None, "eager", EXPERTS_IMPLEMENTATION):  # (never itself: a block whose memory was lost runs eager)
        return original
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, original)


def packed_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts interface's function for :data:`EXPERTS_IMPLEMENTATION`: ``hidden_states [S, H]``, each row's
    experts ``top_k_index [S, k]`` and weights ``top_k_weights [S, k]`` -> ``[S, H]``, the weighted sum of the
    rows' experts (module doc). Outside a :func:`packed_linears` block, for an input the kernel does not take, or
    with gradients, the block's previous implementation."""
    w = module._parameters["gate_up_proj"]
    if not (_IN_BLOCK.get() and module.__dict__.get("_specdec_experts_packed") and hidden_states.dtype is w.dtype
            and not hidden_states.is_cuda and not w.is_cuda and not torch.is_grad_enabled()
            and _kernel_for(w.dtype) == _OURS and _ENABLED):
        return _fallback_experts(module)(module, hidden_states, top_k_index, top_k_weights)
    if module.num_experts == 1 and top_k_index.shape[-1] == 1:  # (a dense MLP behind a router: no routing to do)
        y = _expert_rows(module, 0, hidden_states) * top_k_weights
        return y.to(hidden_states.dtype)
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():
        if expert >= module.num_experts:  # (a sentinel: no local expert)
            continue
        rows, slot = torch.where(top_k_index == expert)
        y = _expert_rows(module, expert, hidden_states[rows]) * top_k_weights[rows, slot, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, packed_experts_forward)
