"""A Hugging Face Llama-family LM run as op calls: on CPUs the hot path of a draft LM's forwards and of the target's.

For a small model the Hugging Face forward is mostly framework work: the family's 2-layer draft LM spent ~1 ms a
forward in ~150 small calls around eight products (~40% of a draft-model step), and the family's 8-layer target
~16 ms against ~8 for its layers as ops. :class:`LlamaStepOps` runs the same network as one
:func:`specdec_ext.ops.draft_decoder_layer` call per decoder layer (:class:`~specdec_ext.models.draft_layer.DraftLayer`)
(input RMSNorm, the qkv product, RoPE, the cache write, masked GQA attention over the cache, the o product and
residual, RMSNorm, SwiGLU, the down product and residual), then the final norm and one vocabulary product, writing
K/V straight into a :class:`~specdec_ext.models.TreeKVCache` at explicit slots. The drafters call it directly;
the target's verification forward goes through it inside :func:`~specdec_ext.models.tree_forward` (``step_ops``,
which the engine passes).

The results agree with the Hugging Face forward to the dtype's rounding, not bit for bit (RoPE is computed in
float32 and rounded once, where Hugging Face rotates in the model's dtype; the norms sum in another order). For a
drafter that is all it needs: drafts are proposals, and the probabilities a sampled draft was drawn from are the
ones computed here. For the target what matters is that its tokens do not depend on how they were batched: every
stage computes a row on its own (the products accumulate each output in a fixed order, the attention softmax has
two passes over the visible keys in slot order), so a tree node gets the bits of decoding its path one token at a
time, and plain and speculative decoding through the engine give the same tokens.

:meth:`LlamaStepOps.build` returns None (the drafter keeps the Hugging Face forward) unless the model is one it
reproduces: a Llama, Mistral or Qwen2 decoder (``model_type``) with SiLU MLPs, default RoPE, no sliding window
shorter than the cache, one RMSNorm eps, a head size the op is compiled for, weights of one dtype on a CPU with the
packed kernel (or int8 weights: :func:`~specdec_ext.models.quantized.quantize_weights`), no forward hooks on any of
its modules (or global ones; transformers' own output-capturing hooks aside), eval mode and no gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from specdec_ext.models.attention import tree_attention_mask
from specdec_ext.models.draft_layer import DraftLayer
from specdec_ext.models.fast_linear import PackedLinear
from specdec_ext.models.kv_cache import TreeKVCache
from specdec_ext.models.quantized import QuantizedEmbedding, embedding_lookup, linear_dtype, linear_operand
from specdec_ext.state import ShallowStates

__all__ = ["HiddenStates", "LlamaStepOps", "StepOutput", "op_route_allowed", "rope_is_default"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def rope_is_default(config) -> bool:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) == "default"


def _serves_cache(cache: TreeKVCache) -> bool:
    """Whether the op calls reproduce the model over ``cache``: no sliding window shorter than it (the op's mask
    is the caller's, which knows no window)."""
    return cache.sliding_window is None or cache.sliding_window >= cache.max_len


_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _draft_layer(layer: nn.Module, eps: float, dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype,
                 num_heads: int, inv_freq: torch.Tensor) -> DraftLayer | None:
    """The op's operands for one decoder layer, or None where the layer is not the plain Llama layer (or the op may
    not run it)."""
    mods = layer._modules
    norms = (mods.get("input_layernorm"), mods.get("post_attention_layernorm"))
    if any(n is None or getattr(n, "variance_epsilon", None) != eps for n in norms) \
            or any(mods.get(block) is None or any(mods[block]._modules.get(n) is None for n in names)
                   for block, names in _LINEARS.items()):
        return None
    return DraftLayer.of(layer, dtype=dtype, device=device, cache_dtype=cache_dtype, num_heads=num_heads, eps=eps,
                         inv_freq=inv_freq, input_norm_weight=norms[0].weight)


# transformers' output-capturing hooks (installed on the decoder layers by a forward with output_hidden_states and
# left there) record only inside that forward's own collector, which the op calls never open: they do not count.
_CAPTURE_HOOK_MODULE = "transformers.utils.output_capturing"


def _foreign_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward hooks the op calls would skip (any but transformers' output capturing)."""
    return any(getattr(h, "__module__", None) != _CAPTURE_HOOK_MODULE
               for h in (*module._forward_hooks.values(), *module._forward_pre_hooks.values()))


def op_route_allowed(model: nn.Module) -> bool:
    """Whether a route that bypasses ``model``'s modules may run it: eval mode, no gradients, and no forward hooks
    (global, or on any module) that the route would skip."""
    return not (torch.is_grad_enabled() or model.training or _module_hooks._global_forward_hooks
                or _module_hooks._global_forward_pre_hooks or any(_foreign_hooks(m) for m in model.modules()))


@dataclass(slots=True, eq=False)
class StepOutput:
    """What :meth:`LlamaStepOps.run` computed, named as a Hugging Face model's output is: ``logits`` ``[B, T', V]``
    (the last ``logits_to_keep`` tokens' when that was given) and, when asked for, ``hidden_states`` (the
    embeddings, each decoder layer's output but the last, and the last one after the final norm: Hugging Face's
    ``output_hidden_states`` tuple)."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


class HiddenStates:
    """Hugging Face's hidden-state tuple as a route fills it: entry i is the residual stream after i decoder layers
    (0: the embeddings; the last entry after the final norm), kept at the entries asked for and None elsewhere.
    Keeping every layer's output of a prefill alive costs fresh memory per layer, which a caller that reads one
    entry (EAGLE-1 the last) should not pay.

    :meth:`of` takes a route's ``hidden_states`` argument: False (none: no collector), True (every entry) or the
    entries' indices (negative from the end, as a drafter's ``hidden_state_layers``)."""

    __slots__ = ("entries", "keep")

    def __init__(self, keep: frozenset[int], count: int):
        self.keep = keep
        self.entries: list[torch.Tensor | None] = [None] * count

    @classmethod
    def of(cls, hidden_states: bool | tuple[int, ...], count: int) -> "HiddenStates | None":
        if hidden_states is False:
            return None
        if hidden_states is True:
            return cls(frozenset(range(count)), count)
        bad = [i for i in hidden_states if isinstance(i, bool) or not isinstance(i, int) or not -count <= i < count]
        if bad:
            raise ValueError(f"hidden_states: entries must be integers in [{-count}, {count}) (the embeddings and "
                             f"{count - 1} decoder layers' outputs), got {tuple(hidden_states)}")
        return cls(frozenset(i % count for i in hidden_states), count)

    def put(self, i: int, h: torch.Tensor) -> None:
        """Entry ``i`` is ``h`` (kept where asked for)."""
        if i in self.keep:
            self.entries[i] = h

    def as_tuple(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(self.entries)


class LlamaStepOps:
    """The model as op calls (see the module doc). Build with :meth:`build`; it serves the weights and the cache
    object it was built with (the cache's tensors are read at each call; :meth:`on` serves another cache) and the
    hooks present then."""

    def __init__(self, cache: TreeKVCache, embed, vocab_size: int, layers: list[DraftLayer], norm: nn.Module,
                 lm: PackedLinear):
        self.cache, self.vocab_size = cache, vocab_size  # (vocab_size: the embedding's rows)
        self._embed, self._layers, self._norm, self._lm = embed, layers, norm, lm  # (embed: ids -> embeddings)

    @classmethod
    def build(cls, model: nn.Module, cache: TreeKVCache) -> "LlamaStepOps | None":
        """The operands, or None where the Hugging Face forward must run (module doc)."""
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES or getattr(cfg, "hidden_act", None) != "silu" \
                or not rope_is_default(cfg) or getattr(cfg, "pretraining_tp", 1) != 1:
            return None
        if not _serves_cache(cache) or not op_route_allowed(model):
            return None
        base = getattr(model, "model", None)
        lm_head = getattr(model, "lm_head", None)
        if base is None or lm_head is None or linear_dtype(lm_head) is None:
            return None
        embed, layers, norm, rotary = (getattr(base, n, None) for n in ("embed_tokens", "layers", "norm", "rotary_emb"))
        lookup = embedding_lookup(embed) if isinstance(embed, nn.Module) else None
        if lookup is None or layers is None or norm is None \
                or rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
            return None
        table = embed.packed if type(embed) is QuantizedEmbedding else embed.weight
        dtype, device = (embed.dtype if type(embed) is QuantizedEmbedding else table.dtype), table.device
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        eps = getattr(norm, "variance_epsilon", None)
        if heads % kv_heads or getattr(cfg, "attention_dropout", 0.0) or eps is None:
            return None
        inv_freq = rotary.inv_freq.float()  # (Hugging Face rotates with the buffer as float32, whatever the dtype)
        ops = [_draft_layer(layer, eps, dtype, device, cache.dtype, heads, inv_freq) for layer in layers]
        lm = linear_operand((lm_head,))
        if any(op is None for op in ops) or lm is None or linear_dtype(lm_head) is not dtype:
            return None
        return cls(cache, lookup, embed.num_embeddings, ops, norm, lm)

    def on(self, cache: TreeKVCache) -> "LlamaStepOps | None":
        """The same operands over ``cache`` (another cache of the same model: a prefill's own), or None where they
        cannot serve it (another dtype, a sliding window shorter than it)."""
        if cache is self.cache:
            return self
        if cache.dtype is not self.cache.dtype or not _serves_cache(cache):
            return None
        return LlamaStepOps(cache, self._embed, self.vocab_size, self._layers, self._norm, self._lm)

    def run(self, tokens: torch.Tensor, position_ids: torch.Tensor, write_slots: torch.Tensor, mask: torch.Tensor,
            *, hidden_states: bool | tuple[int, ...] = False, logits_to_keep: int = 0,
            shallow: ShallowStates | None = None) -> StepOutput:
        """``tokens[B, T]`` at ``position_ids[B, T]``; their K/V are written at cache slots ``write_slots[B, T]`` of
        every layer and token t attends to the slots s < kv_len with ``mask[b, t, s]`` (bool ``[B, T, kv_len]``).
        The cache's lengths are left to the caller. ``logits_to_keep`` > 0: the logits of the last that many tokens
        only; ``hidden_states``: also Hugging Face's hidden-state tuple (:class:`StepOutput`), every entry (True) or
        the entries given (the rest None; :class:`HiddenStates`). ``shallow``: the tokens' residual stream after the
        first ``shallow.layer`` layers, whose K/V are already at ``write_slots`` (an early-exit draft ran them): only
        the layers after those run, and the tuple's entries before ``shallow.layer`` are None."""
        start = 0 if shallow is None else shallow.layer
        h = self._embed(tokens) if shallow is None else shallow.hidden
        states = HiddenStates.of(hidden_states, len(self._layers) + 1)
        if states is not None:
            states.put(start, h)
        h = self.layers(h, position_ids, write_slots, mask, start, len(self._layers), states)
        h = self._norm.forward(h)
        if states is not None:
            states.put(len(self._layers), h)
        logits = self._lm(h[:, -logits_to_keep:] if logits_to_keep > 0 else h)
        return StepOutput(logits, states.as_tuple() if states is not None else None)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``[B, T, H]`` of ``tokens[B, T]``."""
        return self._embed(tokens)

    def layers(self, h: torch.Tensor, position_ids: torch.Tensor, write_slots: torch.Tensor, mask: torch.Tensor,
               start: int, stop: int, states: HiddenStates | None = None) -> torch.Tensor:
        """Decoder layers ``start .. stop - 1`` over the residual stream ``h[B, T, H]`` (arguments as :meth:`run`'s;
        each layer's K/V written at ``write_slots``); layer i's output goes to ``states`` entry i + 1 when given."""
        views = self.cache.layers
        for i in range(start, stop):
            h = self._layers[i](h, h, position_ids, views[i].keys, views[i].values, write_slots, mask)
            if states is not None:
                states.put(i + 1, h)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The logits ``[..., V]`` of a residual stream ``h[..., H]``: the final norm, then the vocabulary product."""
        return self._lm(self._norm.forward(h))

    def verify(self, tokens: torch.Tensor, prefix: torch.Tensor, tree_mask: torch.Tensor, chain: bool,
               position_ids: torch.Tensor, *, hidden_states: bool | tuple[int, ...] = False, logits_to_keep: int = 0,
               validate: bool = True, shallow: ShallowStates | None = None) -> StepOutput:
        """A tree forward (:func:`~specdec_ext.models.tree_forward`'s op route): ``tokens [B, N]`` written at slots
        ``prefix[b] + j``, each attending to its row's prefix and its ancestors (``tree_mask``, dense or packed), as
        one bool mask over the slots in use. ``chain`` and ``validate`` are the tree's (unused here: the mask says
        it all). ``shallow``: as :meth:`run`'s. The cache's lengths are left as they were."""
        N = tokens.shape[1]
        kv_len = int((prefix + N).max())  # (the op route runs on CPUs: a read, not a device synchronisation)
        mask = tree_attention_mask(prefix, tree_mask, kv_len)[:, 0]
        slots = prefix[:, None] + torch.arange(N, device=tokens.device)
        return self.run(tokens, position_ids, slots, mask, hidden_states=hidden_states, logits_to_keep=logits_to_keep,
                        shallow=shallow)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, write_slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The logits ``[B, T, V]`` of :meth:`run`."""
        return self.run(tokens, position_ids, write_slots, mask).logits
