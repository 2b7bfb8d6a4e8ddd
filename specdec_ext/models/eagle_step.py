"""An EAGLE draft's forward and logits as direct op calls: the drafting loop's hot path on CPUs.

A drafting step runs the draft network ~6 times on 1-8 rows (the catch-up, then one tree level after another).
Through the modules each forward is ~15 framework calls around its products: the embeddings' dtype cast, the
concatenation, ``fc``'s and the layer's module calls, the layer's checks and four packed-operand lookups, then the
vocabulary projection's module call. On the development CPU that was ~80 us of Python per level, as long as the
:func:`specdec_ext.ops.draft_decoder_layer` op itself. :class:`EagleStepOps` looks the packed operands up once (the
lookups also validate them: a weight replaced or changed in place since is packed again), and each forward is then
the embedding lookup and cast, the concatenation, the ``fc`` product and the layer op
(:class:`~specdec_ext.models.draft_layer.DraftLayer`); logits are one product. The
drafter builds one per generation: built per step, right after a verification forward has evicted the caches, the
lookups cost ~0.14 ms a step. These are the calls the module path makes, in the same order and dtypes, so the results are the same
bits (tested against the module path).

:meth:`EagleStepOps.build` returns None, and the drafter keeps the module path, wherever that path could do
something else: gradients, CUDA, a CPU or dtype without the packed kernel, forward hooks (global ones, or on a
module whose call the ops replace: the draft, its ``fc``, its decoder layer, EAGLE-3's ``norm``), subclasses of
those, a head size or dtype mix the op does not serve, or a bias it has no operand for. A single forward takes the module path for more than
:data:`~specdec_ext.models.draft_layer.NATIVE_LAYER_MAX_ROWS` rows (a long prompt's catch-up) or an unusual mask.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from specdec_ext.models import eagle as E
from specdec_ext.models.draft_layer import DraftLayer
from specdec_ext.models.fast_linear import PackedLinear
from specdec_ext.models.quantized import linear_device, linear_dtype, linear_operand

__all__ = ["EagleStepOps"]

# The models whose forwards the ops reproduce, and their decoder layers (a subclass may compute something else).
_DECODERS = {E.Eagle1Model: E.Eagle1Layer, E.Eagle3Model: E.Eagle3Layer}


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _linear_operand(layer: nn.Module) -> PackedLinear | None:
    """The packed operands of a plain or int8 linear layer without hooks, else None."""
    if linear_dtype(layer) is None or _hooked(layer):
        return None
    return linear_operand((layer,))


class EagleStepOps:
    """The draft network as op calls (see the module doc). Build with :meth:`build`; it serves the weights and the
    cache object it was built with (the cache's tensors are read at each call) and the hooks present then."""

    def __init__(self, model: nn.Module, cache: E.EagleKVCache, embed_ids: Callable[[torch.Tensor], torch.Tensor],
                 fc: PackedLinear, layer: DraftLayer, lm: PackedLinear | None):
        self.model, self.cache, self.embed_ids = model, cache, embed_ids
        self.version = model.version
        self.dtype = linear_dtype(model.fc)
        self._fc, self._layer, self._lm = fc, layer, lm
        self._norm = model.norm if self.version == 3 else None

    @classmethod
    def build(cls, model: nn.Module, cache: E.EagleKVCache, embed_ids: Callable[[torch.Tensor], torch.Tensor],
              lm_layer: nn.Module) -> "EagleStepOps | None":
        """The step's operands, or None where the module path must run (module doc). ``embed_ids`` maps token ids
        to embeddings as the drafter does; ``lm_layer`` is the vocabulary projection of :meth:`logits` (EAGLE-1:
        the target's ``lm_head`` or the drafter's draft-vocabulary rows of it; EAGLE-3: the draft's ``lm_head``,
        after its ``norm``)."""
        if torch.is_grad_enabled() or cache is None or _module_hooks._global_forward_hooks \
                or _module_hooks._global_forward_pre_hooks:
            return None
        decoder_type = _DECODERS.get(type(model))
        if decoder_type is None:
            return None
        decoder = model.layers[0] if decoder_type is E.Eagle1Layer else model.midlayer
        # the modules whose calls the ops replace: their hooks would not run (fc's: _linear_operand)
        called = (model, decoder, model.norm) if decoder_type is E.Eagle3Layer else (model, decoder)
        if type(decoder) is not decoder_type or any(_hooked(m) for m in called) \
                or (decoder_type is E.Eagle3Layer and type(model.norm) is not E.RMSNorm):
            return None
        dtype = linear_dtype(model.fc)
        layer = decoder.draft_layer(dtype, linear_device(model.fc), cache.k.dtype) if dtype is not None else None
        fc = _linear_operand(model.fc) if layer is not None else None
        if fc is None:
            return None
        return cls(model, cache, embed_ids, fc, layer, _linear_operand(lm_layer))

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, position_ids: torch.Tensor, *, from_target: bool,
                mask: torch.Tensor, write_slots: torch.Tensor, kv_len: int, rotary=None) -> torch.Tensor:
        """The draft's forward: ``hidden[B, T, Hf]`` (target features, or with ``from_target=False`` the draft's
        own outputs), ``ids[B, T]`` (the next tokens) -> predicted features ``[B, T, H]``; K/V written at
        ``write_slots``, attention over cache slots ``[0, kv_len)`` under ``mask[B, T, kv_len]`` (bool)."""
        B, T = ids.shape
        if not DraftLayer.takes(B * T, mask, kv_len):
            return self.model(hidden, self.embed_ids(ids), position_ids, from_target=from_target, mask=mask,
                              cache=self.cache, write_slots=write_slots, kv_len=kv_len, rotary=rotary)
        dt = self.dtype
        embeds, hidden = self.embed_ids(ids).to(dt), hidden.to(dt)
        if self.version == 1:  # fc(cat(embeds, hidden)), then the layer on it
            h = self._fc(torch.cat((embeds, hidden), -1))
            x = h
        else:  # fc only on target features; the layer attends over cat(norm(embeds), norm(h))
            h = self._fc(hidden) if from_target else hidden
            x = torch.cat((embeds, h), -1)
        return self._layer(x, h, position_ids, self.cache.k, self.cache.v, write_slots, mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Draft logits of predicted features, or None where the projection is not a plain packed layer (the
        drafter then calls its module)."""
        lm = self._lm
        if lm is None:
            return None
        x = hidden.to(lm.dtype) if self.version == 1 else self._norm.forward(hidden)
        if x.dtype is not lm.dtype:
            return None
        return lm(x)
