"""A causal LM with some of its decoder layers skipped: the draft of self-speculation by layer skipping (SWIFT,
Draft & Verify), sharing every weight and — for the layers it runs — the KV cache of the full model.

:class:`LayerSkipLM` is a view of a Hugging Face Llama-family causal LM (``model_type`` in
:data:`LAYER_SKIP_MODEL_TYPES`, whose decoder is embeddings, RoPE, a stack of decoder layers and a final norm): its
forward runs the embeddings, the decoder layers *not* in ``skip_layers`` (each with its own ``layer_idx``, so it
reads and writes its own layer of the cache), the final norm and the LM head. Nothing is copied and the model is not
modified, so the full model's forwards stay as they were and no extra bytes of weights exist.

The view takes the forward arguments that :func:`~specdec_ext.models.tree_forward` and
:func:`~specdec_ext.models.masked_forward` pass to a model (``input_ids``, a 4-D ``attention_mask``,
``position_ids``, the cache, the tree kernel's metadata), so both run it as they run the model itself: with the
model set to the ``"specdec_tree"`` attention implementation its attention layers read the tree metadata, otherwise
the 4-D mask (transformers' mask builders return a 4-D mask as it is, which is why the view can skip them). A cache
layer of a skipped layer is neither read nor written.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec_ext.models.config import text_config

__all__ = ["LAYER_SKIP_MODEL_TYPES", "LayerSkipLM", "check_skip_layers"]

# Decoders whose model forward is exactly embeddings -> rotary -> layers(mask, position embeddings) -> norm
# (transformers 5.24): the view reproduces that forward with a subset of the layers.
LAYER_SKIP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_skip_layers(owner: str, skip_layers, num_layers: int | None = None, name: str = "skip_layers") -> tuple[int, ...]:
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


class LayerSkipLM(torch.nn.Module):
    """``model`` without the decoder layers ``skip_layers`` (see the module doc). ``config`` is the model's."""

    def __init__(self, model: torch.nn.Module, skip_layers, owner: str = "LayerSkipLM"):
        super().__init__()
        cfg = text_config(model.config)
        base = getattr(model, "model", None)
        parts = [getattr(base, n, None) for n in ("embed_tokens", "layers", "norm", "rotary_emb")]
        if getattr(cfg, "model_type", None) not in LAYER_SKIP_MODEL_TYPES or any(p is None for p in parts) \
                or not callable(getattr(model, "lm_head", None)):
            raise ValueError(f"{owner}: layer skipping supports {', '.join(LAYER_SKIP_MODEL_TYPES)} causal LMs "
                             f"(embed_tokens, layers, norm, rotary_emb and lm_head), got model_type "
                             f"{getattr(cfg, 'model_type', None)!r} ({type(model).__name__})")
        self.skip_layers = check_skip_layers(owner, skip_layers, len(base.layers))
        self.model_ = model  # (registered: parameters() and the dtype are the model's)
        self.config = model.config
        skipped = set(self.skip_layers)
        self.kept = [layer for i, layer in enumerate(base.layers) if i not in skipped]
        self._embed, _, self._norm, self._rotary = parts
        self._head = model.lm_head

    @property
    def num_layers(self) -> int:
        """The full model's decoder layers."""
        return len(self.kept) + len(self.skip_layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache,
                use_cache: bool = True, **kwargs) -> CausalLMOutputWithPast:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
            raise ValueError("LayerSkipLM: attention_mask must be a 4-D mask (run it through tree_forward or "
                             "masked_forward)")
        h = self._embed(input_ids)
        rope = self._rotary(h, position_ids)
        for layer in self.kept:
            h = layer(h, attention_mask=attention_mask, position_embeddings=rope, position_ids=position_ids,
                      cache=cache, use_cache=use_cache, **kwargs)
        return CausalLMOutputWithPast(logits=self._head(self._norm(h)))
