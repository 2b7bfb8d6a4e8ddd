"""A causal LM with some of its decoder layers skipped: the draft of self-speculation by layer skipping (SWIFT,
Draft & Verify), sharing every weight and — for the layers it runs — the KV cache of the full model.

:class:`LayerSkipLM` is a view of a Hugging Face Llama-family causal LM (``model_type`` in
:data:`LAYER_SKIP_MODEL_TYPES`, whose decoder is embeddings, RoPE, a stack of decoder layers and a final norm): its
forward runs the embeddings, the decoder layers *not* in ``skip_layers`` (each with its own ``layer_idx``, so it
reads and writes its own layer of the cache), the final norm and the LM head. The view copies nothing and does not
modify the model, so the full model's forwards stay as they were.

The view takes the forward arguments that :func:`~specdec_ext.models.tree_forward` and
:func:`~specdec_ext.models.masked_forward` pass to a model (``input_ids``, a 4-D ``attention_mask``,
``position_ids``, the cache, the tree kernel's metadata), so both run it as they run the model itself: with the
model set to the ``"specdec_tree"`` attention implementation its attention layers read the tree metadata, otherwise
the 4-D mask (transformers' mask builders return a 4-D mask as it is, which is why the view can skip them). A cache
layer of a skipped layer is neither read nor written.

The view has the Llama layout itself (``model.embed_tokens / layers / norm / rotary_emb`` and ``lm_head``, with
``layers`` the kept ones), so on CPUs :class:`~specdec_ext.models.llama_step.LlamaStepOps` can run it as op calls
(one ``draft_decoder_layer`` op per kept layer) over :class:`KeptLayers`, the cache's kept layers in the view's
order: a draft forward then costs its products and little else, where the Hugging Face modules' framework work is
most of a small model's forward. (The op reads each kept layer's q/k/v and gate/up weights packed together once:
the only bytes self-speculation adds, a repacking of weights the target has, not a second model.)
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec_ext.models.config import text_config
from specdec_ext.models.kv_cache import TreeKVCache

__all__ = ["KeptLayers", "LAYER_SKIP_MODEL_TYPES", "LayerSkipLM", "check_skip_layers"]

# Decoders whose model forward is exactly embeddings -> rotary -> layers(mask, position embeddings) -> norm
# (transformers 5.24): the view reproduces that forward with a subset of the layers.
LAYER_SKIP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_skip_layers(owner: str, skip_layers, num_layers: int | None = None,
                      name: str = "skip_layers") -> tuple[int, ...]:
    """``skip_layers`` as a sorted tuple of distinct layer indices, or a ``ValueError`` naming ``owner`` and
    ``name``: a list or tuple of integers, each in ``[0, num_layers)`` when ``num_layers`` is given."""
    if not isinstance(skip_layers, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in skip_layers):
        raise ValueError(f"{owner}: {name} must be a list of integer layer indices, got {skip_layers!r}")
    if len(set(skip_layers)) != len(skip_layers):
        raise ValueError(f"{owner}: {name} must not repeat a layer, got {list(skip_layers)}")
    bad = [i for i in skip_layers if i < 0 or (num_layers is not None and i >= num_layers)]
    if bad:
        where = f"[0, {num_layers})" if num_layers is not None else ">= 0"
        raise ValueError(f"{owner}: {name} must hold layer indices in {where} (the target's decoder layers), got "
                         f"{bad}")
    return tuple(sorted(skip_layers))


class _Decoder(torch.nn.Module):
    """The decoder modules the view runs (the model's own, shared): ``layers`` holds the kept layers only."""

    def __init__(self, embed_tokens, layers, norm, rotary_emb):
        super().__init__()
        self.embed_tokens, self.norm, self.rotary_emb = embed_tokens, norm, rotary_emb
        self.layers = torch.nn.ModuleList(layers)


class LayerSkipLM(torch.nn.Module):
    """``model`` without the decoder layers ``skip_layers`` (see the module doc). ``config`` is the model's;
    ``model`` / ``lm_head`` the Llama layout with the kept layers only (so that
    :class:`~specdec_ext.models.llama_step.LlamaStepOps` can run it over :class:`KeptLayers` of a cache);
    ``source`` the full model."""

    def __init__(self, model: torch.nn.Module, skip_layers, owner: str = "LayerSkipLM"):
        super().__init__()
        cfg = text_config(model.config)
        base = getattr(model, "model", None)
        parts = [getattr(base, n, None) for n in ("embed_tokens", "layers", "norm", "rotary_emb")]
        if getattr(cfg, "model_type", None) not in LAYER_SKIP_MODEL_TYPES or any(p is None for p in parts) \
                or not isinstance(getattr(model, "lm_head", None), torch.nn.Module):
            raise ValueError(f"{owner}: layer skipping supports {', '.join(LAYER_SKIP_MODEL_TYPES)} causal LMs "
                             f"(embed_tokens, layers, norm, rotary_emb and lm_head), got model_type "
                             f"{getattr(cfg, 'model_type', None)!r} ({type(model).__name__})")
        embed, layers, norm, rotary = parts
        self.skip_layers = check_skip_layers(owner, skip_layers, len(layers))
        self.kept_layers = tuple(i for i in range(len(layers)) if i not in self.skip_layers)
        self.model = _Decoder(embed, [layers[i] for i in self.kept_layers], norm, rotary)
        self.lm_head = model.lm_head
        self.config = model.config
        self.__dict__["source"] = model  # (not a submodule: the full model's other layers are not the view's)
        self.training = model.training  # (the flag alone: train() would reach into the shared layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache,
                use_cache: bool = True, **kwargs) -> CausalLMOutputWithPast:
        h = self.hidden(input_ids, attention_mask, position_ids, cache, use_cache, **kwargs)
        return CausalLMOutputWithPast(logits=self.lm_head(self.model.norm(h)))

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache,
               use_cache: bool = True, **kwargs) -> torch.Tensor:
        """The residual stream ``[B, T, H]`` after the kept layers (before the final norm): :meth:`forward` without
        its head, for a draft that reads the target's shallow layers (an early-exit draft keeps the first ones)."""
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
            raise ValueError("LayerSkipLM: attention_mask must be a 4-D mask (run it through tree_forward or "
                             "masked_forward)")
        base = self.model
        h = base.embed_tokens(input_ids)
        rope = base.rotary_emb(h, position_ids)
        for layer in base.layers:  # (each with its own layer_idx: its own layer of the cache)
            h = layer(h, attention_mask=attention_mask, position_embeddings=rope, position_ids=position_ids,
                      cache=cache, use_cache=use_cache, **kwargs)
        return h


class KeptLayers:
    """The layers of a :class:`~specdec_ext.models.TreeKVCache` that a :class:`LayerSkipLM` runs, in its order,
    as :class:`~specdec_ext.models.llama_step.LlamaStepOps` reads a cache (``layers``, ``sliding_window``,
    ``max_len``, ``dtype``): the cache's current views at every read, so rows joining and leaving it are seen."""

    def __init__(self, cache: TreeKVCache, kept_layers: tuple[int, ...]):
        self._cache, self._kept = cache, kept_layers

    @property
    def layers(self) -> list:
        layers = self._cache.layers
        return [layers[i] for i in self._kept]

    @property
    def sliding_window(self):
        return self._cache.sliding_window

    @property
    def max_len(self) -> int:
        return self._cache.max_len

    @property
    def dtype(self) -> torch.dtype:
        return self._cache.dtype
