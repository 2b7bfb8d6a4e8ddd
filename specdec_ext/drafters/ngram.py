"""N-gram (prompt lookup) drafter: no model, no training.

For each row, the longest suffix of the context (``max_ngram_size`` tokens down to ``min_ngram_size``) that also
occurs earlier in the context proposes the tokens that followed that earlier occurrence, as a chain of up to
``num_pred_tokens``. Among several earlier occurrences of the same n-gram the **most recent** wins (HF's prompt
lookup takes the first; in repetitive text the latest repetition predicts best). No match: a 1-node tree (a plain
decoding step). The drafts are deterministic (``draft_probs = None``), so lossless sampling accepts them as they are.

The search runs on the host over the row's context (``DecodeState.host_tokens``), which the loop keeps without
extra device synchronisation. Per row and n-gram size, a dictionary maps every n-gram that has a continuation to its
latest start; it is extended with the tokens appended since the last step, so a step costs O(new tokens *
max_ngram_size) dictionary operations, not a scan of the context. :func:`ngram_lookup` is the plain scan (the
specification; the tests compare the two).
"""

from __future__ import annotations

import torch

from specdec_ext.drafters.base import pad_chains
from specdec_ext.state import DecodeState, DraftTree, StepResult, plain_tree


def ngram_lookup(context: list[int], max_ngram_size: int, num_pred_tokens: int, min_ngram_size: int = 1) -> list[int]:
    """The continuation (at most ``num_pred_tokens`` tokens) of the most recent earlier occurrence of the longest
    context suffix of ``min_ngram_size..max_ngram_size`` tokens; ``[]`` when none occurs."""
    L = len(context)
    if num_pred_tokens <= 0:
        return []
    for n in range(min(max_ngram_size, L - 1), min_ngram_size - 1, -1):
        suffix = context[L - n:]
        first = suffix[0]
        # Occurrences ending before the suffix's own position: start s with s + n <= L - 1 (a continuation exists).
        for s in range(L - n - 1, -1, -1):
            if context[s] == first and context[s:s + n] == suffix:
                return context[s + n:s + n + num_pred_tokens]
    return []


class NgramDrafter:
    """Prompt-lookup drafter (see the module doc). ``num_pred_tokens``: longest chain proposed."""

    hidden_state_layers: tuple[int, ...] = ()
    forwards = 0  # no network
    defers_prefill = False  # no prefill forward to defer
    serves_row_subsets = True

    def __init__(self, num_pred_tokens: int = 8, max_ngram_size: int = 3, min_ngram_size: int = 1):
        if num_pred_tokens < 1 or max_ngram_size < 1 or not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"NgramDrafter: need num_pred_tokens >= 1 and 1 <= min_ngram_size <= max_ngram_size, "
                             f"got {num_pred_tokens}, {min_ngram_size}, {max_ngram_size}")
        self.num_pred_tokens = num_pred_tokens
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self.max_nodes = num_pred_tokens + 1
        self.max_depth = num_pred_tokens

    def begin(self, target: torch.nn.Module, state: DecodeState, prefill_hidden_states=None) -> None:
        self._index, self._indexed = [], []
        self.add_rows(target, state)

    def add_rows(self, target: torch.nn.Module, rows: DecodeState, prefill_hidden_states=None) -> None:
        """Empty indices for the joining rows (built from their contexts at their first lookup)."""
        sizes = range(self.min_ngram_size, self.max_ngram_size + 1)
        self._index += [{n: {} for n in sizes} for _ in range(rows.batch_size)]
        self._indexed += [0] * rows.batch_size  # per row: context length the index covers

    def _lookup(self, b: int, ctx: list[int], k: int) -> list[int]:
        """:func:`ngram_lookup` through row b's incremental index."""
        index, L = self._index[b], len(ctx)
        for n, table in index.items():  # windows that now have a continuation: starts i with i + n <= L - 1
            for i in range(max(self._indexed[b] - n, 0), L - n):
                table[tuple(ctx[i:i + n])] = i
        self._indexed[b] = L
        if k <= 0:
            return []
        for n in range(min(self.max_ngram_size, L - 1), self.min_ngram_size - 1, -1):
            start = index[n].get(tuple(ctx[L - n:]))
            if start is not None:
                return ctx[start + n:start + n + k]
        return []

    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        if getattr(self, "_index", None) is None or len(self._index) != state.batch_size:
            self.begin(None, state)
        k = min(self.num_pred_tokens, max_depth, max_nodes - 1)
        if k <= 0:  # a plain step (the adaptive drafter's): the indices catch up at the next lookup
            return plain_tree(state.last_tokens)
        chains = [self._lookup(b, ctx, k) for b, ctx in enumerate(state.host_tokens)]
        return pad_chains(chains, [ctx[-1] for ctx in state.host_tokens], state.device)

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        pass

    def retire(self, keep: torch.Tensor) -> None:
        """Keeps the per-row indices of the rows ``keep`` (host lists only)."""
        if getattr(self, "_index", None) is None:
            return
        rows = keep.tolist()
        self._index = [self._index[i] for i in rows]
        self._indexed = [self._indexed[i] for i in rows]
