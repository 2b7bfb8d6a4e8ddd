"""An EAGLE-1 draft's FR-Spec vocabulary: the training data's most frequent target ids, which the drafter scores
instead of the whole ``lm_head`` (``EagleDrafter(draft_vocab=ids)``), kept as ``draft_vocab.json`` beside the draft.

Written by ``specdec train-eagle`` (EAGLE-1) and ``specdec zoo build``; read by
:meth:`~specdec_ext.drafters.EagleDrafter.from_pretrained` (so ``--eagle DIR`` drafts over it) and the family's
drafters (the end-of-training report drafts over the same ids). The default size (:func:`default_draft_vocab_size`) is a
quarter of the vocabulary and at least 1024 ids: on the family (4096 ids) 1024 drafted as well as the whole
vocabulary and fastest (``drafters/shapes.py``); FR-Spec keeps a quarter of Llama-3's 128k ids.
"""

from __future__ import annotations

import json
import os

import torch
from torch.nn.utils import skip_init

from specdec_ext.models.fast_linear import Linear, tensor_version
from specdec_ext.models.quantized import QuantizedLinear
from specdec_ext.models.safe_files import read_json

__all__ = ["DRAFT_VOCAB_FILE", "VocabRows", "default_draft_vocab_size", "draft_vocab_ids", "read_draft_vocab",
           "vocab_rows", "write_draft_vocab"]

DRAFT_VOCAB_FILE = "draft_vocab.json"


def default_draft_vocab_size(vocab_size: int) -> int | None:
    """The ids to keep for a ``vocab_size`` vocabulary; None when that is the whole vocabulary (nothing to save)."""
    n = max(1024, vocab_size // 4)
    return n if n < vocab_size else None


def draft_vocab_ids(seqs: list[list[int]], vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` most frequent token ids of ``seqs`` (ties by id; never-seen ids fill up), sorted."""
    if not 0 < n <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {n}")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s, dtype=torch.int64), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # stable: lower ids first among ties
    return counts.topk(n).indices.sort().values


def write_draft_vocab(directory: str | os.PathLike, ids) -> str:
    """``directory/draft_vocab.json`` holding ``ids`` (sorted); returns its path."""
    path = os.path.join(directory, DRAFT_VOCAB_FILE)
    with open(path, "w") as f:
        json.dump({"ids": sorted(int(i) for i in ids),
                   "source": "the most frequent token ids of the drafter's training data"}, f)
    return path


def read_draft_vocab(directory: str | os.PathLike, who: str) -> torch.Tensor | None:
    """The ids in ``directory/draft_vocab.json`` (int64), None when there is no such file; a file that does not hold
    ``{"ids": [token ids]}`` is a ``ValueError`` naming it (``who``: the caller, for the message)."""
    path = os.path.join(directory, DRAFT_VOCAB_FILE)
    if not os.path.isfile(path):
        return None
    ids = read_json(path, who).get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{who}: {path!r} must hold {{\"ids\": [token ids]}}")
    return torch.tensor(ids, dtype=torch.int64)


@torch.no_grad()
def vocab_rows(lm_head: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype, device) -> Linear:
    """A layer of its own holding ``lm_head``'s rows ``ids`` (a copy, in ``dtype`` on ``device``): the draft
    vocabulary's logits, ``[..., len(ids)]``, in one few-row product (it packs its weight once, as every layer)."""
    w, bias = lm_head.weight, getattr(lm_head, "bias", None)
    sub = skip_init(Linear, w.shape[1], ids.numel(), bias=bias is not None, device=device,
                    dtype=dtype).requires_grad_(False)
    sub.weight.copy_(w.index_select(0, ids.to(w.device)))
    if bias is not None:
        sub.bias.copy_(bias.index_select(0, ids.to(w.device)))
    return sub


class VocabRows:
    """A drafter's :func:`vocab_rows` of draft-vocabulary ids ``ids`` (int8 with ``draft_quant="int8"``), made again
    only when the LM head's weight, the device or the dtype changed: a drafter kept across generations copies and
    packs the rows once."""

    def __init__(self, ids: torch.Tensor, draft_quant: str | None = None):
        self.ids, self.draft_quant = ids, draft_quant
        self._key, self._made = None, None

    def of(self, lm_head: torch.nn.Module, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.nn.Module]:
        """``(ids on device, the rows' layer)`` for ``lm_head`` in ``dtype``."""
        w = lm_head.weight
        key = (w, tensor_version(w), w.data_ptr(), torch.device(device), dtype)
        if self._key is None or self._key[0] is not w or self._key[1:] != key[1:]:
            ids = self.ids.to(device)
            sub = vocab_rows(lm_head, ids, dtype, device)
            self._made = ids, (sub if self.draft_quant is None else QuantizedLinear.of(sub, self.draft_quant))
            self._key = key
        return self._made
