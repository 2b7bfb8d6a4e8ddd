"""Hugging Face integration (needs ``transformers>=5``: ``pip install specdec_ext[hf]``).

* :mod:`~specdec_ext.models.attention`: the tree kernel as transformers attention implementation ``"specdec_tree"``
  (registered on import), :func:`use_tree_attention`, :func:`uses_attention_interface`.
* :mod:`~specdec_ext.models.kv_cache`: :class:`TreeKVCache`, a static ``Cache`` with per-row lengths, ``rewind``,
  ``compact`` / ``accept`` (one ``ops.compact_kv`` call for all layers).
* :mod:`~specdec_ext.models.hybrid_cache`: :func:`make_cache` (the cache for a model's config) and
  :class:`HybridCache` (a ``TreeKVCache`` plus the recurrent states of a hybrid's linear-attention layers, committed
  along the accepted path); :mod:`~specdec_ext.models.linear_layers` (Lightning),
  :mod:`~specdec_ext.models.deltanet_layers` (Gated DeltaNet) and :mod:`~specdec_ext.models.mamba2_layers`
  (Mamba-2) run those layers over a tree.
* :mod:`~specdec_ext.models.tree_forward`: :func:`tree_forward` (the verification forward, logits ``[B, N, V]``),
  :func:`extend` (append tokens per row: prefill, decoding); :func:`tree_attention_mask` (the 4-D fallback mask,
  from :mod:`~specdec_ext.models.attention`).
* :mod:`~specdec_ext.models.fast_linear`: :func:`pack_linears` (a model's ``nn.Linear`` layers and mixture-of-experts
  blocks multiply with packed weights inside :func:`packed_linears` blocks, e.g. ``specdec_ext.generate``),
  :func:`unpack_linears`.
* :mod:`~specdec_ext.models.step_ops`: :func:`~specdec_ext.models.step_ops.build_step_ops`, the target's
  verification forward as direct calls where a route reproduces it (Llama-family op calls, MiniMax hybrids).
* :mod:`~specdec_ext.models.config`: what is read from a model's config (text config, sliding window), in one place.
* Draft networks: :mod:`~specdec_ext.models.medusa` (Medusa heads), :mod:`~specdec_ext.models.eagle` (EAGLE-1/3);
  :mod:`~specdec_ext.models.checkpoints` loads and saves them in their published formats.
"""

from specdec_ext.models.attention import (TREE_ATTENTION, is_tree_attention, register, tree_attention_forward,
                                          tree_attention_mask, tree_metadata, use_tree_attention,
                                          uses_attention_interface)
from specdec_ext.models.fast_linear import pack_linears, packed_linears, unpack_linears
from specdec_ext.models.hybrid_cache import HybridCache, make_cache
from specdec_ext.models.kv_cache import TreeKVCache, TreeKVLayer
from specdec_ext.models.tree_forward import extend, masked_forward, tree_forward

register()

__all__ = [
    "HybridCache",
    "TREE_ATTENTION",
    "TreeKVCache",
    "TreeKVLayer",
    "extend",
    "is_tree_attention",
    "make_cache",
    "masked_forward",
    "pack_linears",
    "packed_linears",
    "register",
    "tree_attention_forward",
    "tree_attention_mask",
    "tree_forward",
    "tree_metadata",
    "use_tree_attention",
    "unpack_linears",
    "uses_attention_interface",
]
