"""The tree kernel as a Hugging Face attention implementation (transformers' ``AttentionInterface``).

``import specdec_ext.models`` registers :data:`TREE_ATTENTION` (``"specdec_tree"``) in transformers'
``AttentionInterface`` (the attention function) and ``AttentionMaskInterface`` (the mask builder: transformers' own
``sdpa_mask``, so ordinary forwards get exactly the masks they get under ``"sdpa"``). Nothing in transformers is
patched and no module is touched: the model's config names the implementation and every attention layer looks it up.

How the tree metadata reaches the function. In transformers 5.x the causal-LM forward passes its ``**kwargs`` down
through the decoder layers to the attention function (verified for Llama, Qwen2, Qwen3, Mistral, Gemma, Phi3 in
5.24). :func:`~specdec_ext.models.tree_forward.tree_forward` passes two keyword arguments:

* ``specdec_prefix_lens``: ``[B]`` int64, tokens in the cache before the tree's root;
* ``specdec_tree_mask``: :func:`specdec_ext.ops.tree_ancestor_mask` output (dense bool ``[B, N, N]`` or packed
  int32 ``[B, N, ceil(N/32)]``),

and also sets them in a context variable (:func:`tree_metadata`) for a model that drops unknown kwargs on the way.
With metadata the function calls :func:`specdec_ext.ops.tree_attention` on the full ``[B, Hkv, S, D]`` cache
buffers (the tree nodes' keys/values sit at ``prefix_lens[b] + j``) and ignores ``attention_mask``. Without metadata
(prefill, plain decoding, any forward outside :func:`tree_forward`) it is transformers' ``sdpa_attention_forward``
with the mask it was given: identical results.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec_ext import ops
from specdec_ext.models.config import text_config
from specdec_ext.ops.reference import unpack_tree_mask

TREE_ATTENTION = "specdec_tree"
PREFIX_LENS_KWARG = "specdec_prefix_lens"
TREE_MASK_KWARG = "specdec_tree_mask"


class TreeMetadata(NamedTuple):
    prefix_lens: torch.Tensor  # [B] int64
    tree_mask: torch.Tensor  # dense bool [B, N, N] or packed int32 [B, N, ceil(N/32)]


_CURRENT: contextvars.ContextVar[TreeMetadata | None] = contextvars.ContextVar("specdec_tree_metadata", default=None)


@contextlib.contextmanager
def tree_metadata(prefix_lens: torch.Tensor, tree_mask: torch.Tensor):
    """Within this block, :func:`tree_attention_forward` verifies a tree even if the kwargs did not reach it."""
    token = _CURRENT.set(TreeMetadata(prefix_lens, tree_mask))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [B, H, q, D]``, ``key`` / ``value`` ``[B, Hkv, S, D]`` ->
    ``([B, q, H, D], None)``. Tree verification through ``ops.tree_attention`` when tree metadata is present,
    otherwise transformers' SDPA attention unchanged."""
    prefix_lens = kwargs.pop(PREFIX_LENS_KWARG, None)
    tree_mask = kwargs.pop(TREE_MASK_KWARG, None)
    if (prefix_lens is None) != (tree_mask is None):
        raise ValueError(f"{TREE_ATTENTION}: pass both {PREFIX_LENS_KWARG} and {TREE_MASK_KWARG}, or neither")
    if prefix_lens is None:
        meta = _CURRENT.get()
        if meta is not None:
            prefix_lens, tree_mask = meta
    if prefix_lens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)

    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{TREE_ATTENTION}: the tree kernel does not support {name}; use the 4-D mask "
                                      "fallback (tree_forward(..., use_kernel=False)) with an implementation that does")
    if dropout:
        raise NotImplementedError(f"{TREE_ATTENTION}: attention dropout is not supported (put the model in eval mode)")
    if tree_mask.shape[1] != query.shape[2]:
        raise ValueError(f"{TREE_ATTENTION}: {TREE_MASK_KWARG} is for N = {tree_mask.shape[1]} tree nodes but the "
                         f"query holds {query.shape[2]} positions")
    # Validation reads a status back; on CUDA that is a device sync per layer, and tree_forward checked the lengths.
    out = ops.tree_attention(query, key, value, prefix_lens, tree_mask, scale=scaling,
                             validate=query.device.type == "cpu")
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers :data:`TREE_ATTENTION` with transformers (idempotent; done on ``import specdec_ext.models``)."""
    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """Whether ``model`` computes attention through transformers' ``AttentionInterface`` (so that
    :data:`TREE_ATTENTION` reaches it). Models that do not verify trees through the 4-D mask fallback."""
    cls = type(model)
    check = getattr(cls, "is_backend_compatible", None)
    return bool(check()) if callable(check) else False


TREE_KERNEL_HEAD_DIMS = (64, 80, 96, 128, 256)  # head sizes ops.tree_attention is compiled for


def _kernel_head_dim(model: torch.nn.Module) -> bool:
    """Whether the model's attention head size is one the tree kernel supports (others verify through the 4-D
    mask fallback, which any head size can use)."""
    cfg = text_config(model.config)
    hd = getattr(cfg, "head_dim", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not hd and heads:
        hd = getattr(cfg, "hidden_size", 0) // heads
    return hd in TREE_KERNEL_HEAD_DIMS


def use_tree_attention(model: torch.nn.Module) -> bool:
    """Switches ``model`` to :data:`TREE_ATTENTION` when it uses the attention interface and its head size is one
    the kernel supports (:data:`TREE_KERNEL_HEAD_DIMS`); returns whether it did.

    Ordinary forwards stay identical (SDPA); :func:`tree_forward` then verifies trees through the kernel.
    """
    if not uses_attention_interface(model) or not _kernel_head_dim(model):
        return False
    register()
    model.set_attn_implementation(TREE_ATTENTION)
    return getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION


def is_tree_attention(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently set to :data:`TREE_ATTENTION`."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == TREE_ATTENTION


def additive_attention_mask(mask: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4-D mask ``[B, 1, T, max_len]`` in ``dtype`` of a bool ``mask[B, T, kv_len]`` (True = attend;
    ``kv_len <= max_len``, the slots past it masked): what a Hugging Face attention layer reads."""
    B, T, kv_len = mask.shape
    additive = torch.full((B, 1, T, max_len), torch.finfo(dtype).min, dtype=dtype, device=mask.device)
    additive[:, 0, :, :kv_len].masked_fill_(mask, 0.0)
    return additive


def tree_attention_mask(prefix_lens: torch.Tensor, tree_mask: torch.Tensor, kv_len: int,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense 4-D mask of a tree verification over ``kv_len`` cache positions: ``[B, 1, N, kv_len]``; node i of
    row b may attend to positions ``< prefix_lens[b]`` and to ``prefix_lens[b] + j`` for its ancestors-or-self j.
    ``tree_mask``: dense bool ``[B, N, N]`` or packed int32. Bool (True = attend) when ``dtype`` is None, else
    additive in ``dtype`` (0 / ``finfo(dtype).min``)."""
    B, N = tree_mask.shape[:2]
    dense = tree_mask if tree_mask.dtype == torch.bool else unpack_tree_mask(tree_mask, N)
    prefix_lens = torch.as_tensor(prefix_lens, dtype=torch.int64, device=dense.device).expand(B)
    k = torch.arange(kv_len, device=dense.device)
    rel = k[None, :] - prefix_lens[:, None]  # [B, S]: position relative to the root
    in_tree = (rel >= 0) & (rel < N)
    gathered = torch.gather(dense, 2, rel.clamp(0, N - 1)[:, None, :].expand(B, N, kv_len))  # [B, N, S]
    allowed = (rel < 0)[:, None, :] | (in_tree[:, None, :] & gathered)
    allowed = allowed[:, None]
    if dtype is None:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=dense.device)
    return torch.where(allowed, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype, device=dense.device))
