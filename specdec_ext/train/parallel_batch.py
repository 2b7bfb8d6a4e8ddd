"""Training batches for a parallel draft model (PARD), with conditional drop-token (COD) sampling.

A parallel draft sees the context and ``j`` mask tokens after it, and predicts the token ``j + 1`` places after the
context's last one from mask ``j`` (:class:`~specdec_ext.drafters.ParallelDraftDrafter`). Training every window
position as a context end for every ``j < K`` would multiply the sequence by K. COD keeps each anchor's chain of
masks only up to a random depth: anchor ``a`` (a real position) gets masks ``1 .. J_a`` at positions ``a + 1 ..
a + J_a``, where mask ``j`` is kept with probability ``max(retention ** j, min_retention)`` and only when mask
``j - 1`` is (one uniform per anchor, compared against the non-increasing rates), so every kept mask has the masks
before it and the packed sequence is about ``1 + sum_j rate_j`` windows long.

The packed row is the window's real tokens followed by every kept mask. Attention, as at inference: a real token
sees the real tokens up to itself; mask ``j`` of anchor ``a`` sees the real tokens up to ``a`` and its anchor's masks
``1 .. j``. Each entry's *source* is the real position whose next token it learns (a real token ``i``: ``i``; mask
``j`` of anchor ``a``: ``a + j``), so the target's logits and the text's token at ``source + 1`` are its labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ParallelBatch", "parallel_batch", "retention_rates"]


def retention_rates(num_tokens: int, retention: float, min_retention: float) -> torch.Tensor:
    """``[num_tokens - 1]`` float32: the probability that an anchor keeps mask j (j = 1 .. K - 1)."""
    j = torch.arange(1, num_tokens, dtype=torch.float64)
    return (retention ** j).clamp(min=min_retention).float()


@dataclass
class ParallelBatch:
    input_ids: torch.Tensor  # [B, S] int64 (padding: the mask token)
    position_ids: torch.Tensor  # [B, S] int64
    attention: torch.Tensor  # [B, 1, S, S] bool (True: attends)
    source: torch.Tensor  # [B, S] int64: the real position whose next token the entry predicts (-1: no label)


def parallel_batch(toks: torch.Tensor, valid: torch.Tensor, num_tokens: int, mask_token_id: int,
                   retention: float = 0.5, min_retention: float = 0.1,
                   generator: torch.Generator | None = None) -> ParallelBatch:
    """The COD batch (module doc) of ``toks[B, L]`` (``valid[B, L]`` bool: row b's first ``valid[b].sum()``
    tokens are text) for drafts of ``num_tokens`` positions; the uniforms come from ``generator`` (default torch's)."""
    B, L = toks.shape
    rates = retention_rates(num_tokens, retention, min_retention)
    lengths = valid.sum(1).tolist()
    rows = []
    for b in range(B):
        n = int(lengths[b])
        u = torch.rand(n, generator=generator)
        depth = (u[:, None] < rates[None]).sum(1)  # J_a: masks kept per anchor (nested, by the rates' order)
        a = torch.arange(n)
        depth = torch.minimum(depth, (n - 2 - a).clamp(min=0))  # mask j of anchor a learns token a + j + 1 < n
        first = torch.cumsum(depth, 0) - depth  # each anchor's first mask among all masks
        masks = torch.arange(int(depth.sum()))
        anchor = torch.cat([a, a.repeat_interleave(depth)])
        level = torch.cat([torch.zeros(n, dtype=torch.int64), masks - first.repeat_interleave(depth) + 1])
        pos = anchor + level
        source = torch.where(pos + 1 < n, pos, torch.full_like(pos, -1))
        real = level == 0
        ids = torch.where(real, toks[b, :n].index_select(0, pos.clamp(max=max(n - 1, 0))),
                          torch.full_like(pos, mask_token_id))
        rows.append((ids, pos, anchor, level, source, real))
    S = max(len(r[0]) for r in rows)
    input_ids = torch.full((B, S), mask_token_id, dtype=torch.int64)
    position_ids = torch.zeros(B, S, dtype=torch.int64)
    source = torch.full((B, S), -1, dtype=torch.int64)
    attention = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b, (ids, pos, anchor, level, src, real) in enumerate(rows):
        m = len(ids)
        input_ids[b, :m], position_ids[b, :m], source[b, :m] = ids, pos, src
        sees_real = real[None, :] & (pos[None, :] <= anchor[:, None])
        sees_mask = ~real[None, :] & (anchor[None, :] == anchor[:, None]) & (level[None, :] <= level[:, None])
        attention[b, 0, :m, :m] = sees_real | sees_mask
        pad = torch.arange(m, S)
        attention[b, 0, pad, pad] = True  # (padding sees itself: no empty softmax rows)
    return ParallelBatch(input_ids.to(toks.device), position_ids.to(toks.device), attention.to(toks.device),
                         source.to(toks.device))
