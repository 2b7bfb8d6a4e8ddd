"""Parallel draft model (PARD): a draft LM that, given the context and ``k - 1`` mask tokens after it, predicts the
next ``k`` tokens in one forward (the prediction after the context, then one after each mask).

Each step is the draft model's catch-up forward (:class:`~specdec_ext.drafters.DraftModelDrafter`'s: the context
tokens its cache lacks, usually the last step's accepted tokens and the correction) with the mask tokens appended:
one draft forward per step, whatever the depth. Position ``d`` of that forward (the context's last token, then
mask ``d``) gives the distribution of draft ``d + 1``. The masks' K/V are dropped after the forward (the cache
rewinds to the context), so the cache only ever holds real tokens, and a rejected draft costs nothing to roll back.

- Chain: draft ``d + 1`` is the argmax of position ``d`` (greedy), or a sample of it under the row's temperature /
  top-k / top-p with the distribution kept (``draft_probs``), so lossless verification samples the target's
  distribution exactly: a draft's proposal need not condition on the drafts before it, only be the distribution it
  was drawn from.
- Tree (``tree_width = w > 1`` with ``total_tokens = M``): EAGLE-2's dynamic tree
  (:func:`~specdec_ext.drafters.dynamic_tree.grow_dynamic_tree`, calibrated scores) over the per-position
  distributions of the same forward: every node at depth d gets position d's top-w tokens as children, the w best
  frontier nodes by cumulative score grow, and the M best candidates are verified. No forward per level: the level
  callback hands back position d's logits. Deterministic drafts (``draft_probs = None``), lossless under sampling.

The mask token is an id of the draft's vocabulary that text never uses: ``specdec train-draft --parallel K`` adds
one row after the target's vocabulary (the draft's vocabulary is then the target's plus one; logits beyond the
target's vocabulary are never drafted) and records it in the draft's ``config.json`` as ``pard_token``, with the
number of positions it was trained for as ``pard_num_tokens``.
"""

from __future__ import annotations

import torch

from specdec_ext import ops
from specdec_ext.drafters.base import sample_drafts
from specdec_ext.drafters.draft_model import DraftModelDrafter
from specdec_ext.drafters.dynamic_tree import grow_dynamic_tree
from specdec_ext.models.config import text_config
from specdec_ext.state import DecodeState, DraftTree, plain_tree

__all__ = ["ParallelDraftDrafter", "parallel_draft_config"]


def parallel_draft_config(config) -> tuple[int, int] | None:
    """``(mask token id, positions trained)`` recorded in a parallel draft's config, or None for an ordinary LM."""
    c = text_config(config)
    mask = getattr(c, "pard_token", None)
    if mask is None:
        return None
    return int(mask), int(getattr(c, "pard_num_tokens", None) or 4)


class ParallelDraftDrafter(DraftModelDrafter):
    """Drafts of up to ``num_draft_tokens`` tokens from one forward of the parallel draft ``model`` (module doc).

    ``mask_token_id`` / ``num_draft_tokens``: default the ``pard_token`` / ``pard_num_tokens`` of the model's config.
    ``tree_width`` > 1 needs ``total_tokens`` (the dynamic tree); ``calibrate`` / ``calibration_rate``,
    ``packed_linears``, ``draft_quant`` and ``tree_attention`` as for
    :class:`~specdec_ext.drafters.DraftModelDrafter`."""

    def __init__(self, model: torch.nn.Module, mask_token_id: int | None = None, num_draft_tokens: int | None = None,
                 tree_width: int = 1, total_tokens: int | None = None, calibrate: bool = True,
                 calibration_rate: float = 0.2, tree_attention: bool = True, packed_linears: bool = True,
                 draft_quant: str | None = None):
        recorded = parallel_draft_config(model.config)
        if mask_token_id is None and recorded is None:
            raise ValueError("ParallelDraftDrafter: the model's config records no pard_token (the mask token of a "
                             "parallel draft; `specdec train-draft --parallel K` writes it): pass mask_token_id")
        if num_draft_tokens is None:
            num_draft_tokens = recorded[1] if recorded else 4
        mask_token_id = recorded[0] if mask_token_id is None else mask_token_id
        if tree_width > 1 and total_tokens is None:
            raise ValueError(f"ParallelDraftDrafter: tree_width = {tree_width} needs total_tokens (the dynamic tree "
                             "over the forward's per-position top-k); tree_width = 1 drafts a chain")
        super().__init__(model, num_draft_tokens=num_draft_tokens, tree_width=tree_width,
                         tree_attention=tree_attention, total_tokens=total_tokens, calibrate=calibrate,
                         calibration_rate=calibration_rate, packed_linears=packed_linears, draft_quant=draft_quant)
        V = text_config(self.model.config).vocab_size
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < V:
            raise ValueError(f"ParallelDraftDrafter: mask_token_id must be an id of the draft's vocabulary "
                             f"[0, {V}), got {mask_token_id!r}")
        self.mask_token_id = mask_token_id

    def _check_vocab(self, target_vocab: int) -> None:
        V = text_config(self.model.config).vocab_size
        if V not in (target_vocab, target_vocab + 1):
            raise ValueError(f"ParallelDraftDrafter: the draft's vocabulary ({V} ids) must be the target's "
                             f"({target_vocab}), or the target's and its mask token ({target_vocab + 1})")
        if self.mask_token_id < target_vocab and V == target_vocab + 1:
            raise ValueError(f"ParallelDraftDrafter: mask_token_id {self.mask_token_id} is a target token, but the "
                             f"draft has a row of its own for the mask ({target_vocab})")

    def _propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        B, dev, Vt = state.batch_size, state.device, state.vocab_size
        root = state.last_tokens
        k = min(self.k, max_depth, max_nodes - 1)
        total = min(self.total_tokens, max_nodes - 1) if self.dynamic else k
        self.fed = 0  # the masks' K/V are dropped: the cache holds the context only
        self.caught_up = k > 0
        if k <= 0:
            return plain_tree(root)
        drafts_at = self._catch_up(state, extra=k - 1, fill=self.mask_token_id)[..., :Vt]  # [B, k, Vt] logits
        if self.dynamic and total > k:
            w = self.width

            def level(d, tok, parent, mask, slots):  # every depth-d node shares position d's prediction
                return drafts_at[:, d, None].expand(B, w, Vt)

            return grow_dynamic_tree(root, drafts_at[:, 0], level, depth=k, top_k=w, total_tokens=total,
                                     valid=state.lengths,
                                     kv_len=max(len(t) for t in state.host_tokens) + (k - 1) * w,
                                     calibration=self.calibration if self.calibrate else None)
        parents = ops.chain_parents(B, k + 1, device=dev)
        if state.sampling.greedy:
            return DraftTree(torch.cat([root[:, None], drafts_at.argmax(-1)], 1), parents, None)
        drafts, dists = zip(*(sample_drafts(drafts_at[:, d], state) for d in range(k)))
        tokens = torch.stack([root, *drafts], 1)
        return DraftTree(tokens, parents, torch.stack([*dists, torch.zeros_like(dists[0])], 1))  # leaf row unread
