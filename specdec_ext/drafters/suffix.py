"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from the text the drafter has seen, across requests.

No model. The drafter keeps a corpus of earlier requests' outputs (one per engine: every row of every batch it
serves adds to it and reads it) and, per row, the row's own context. Each step, for each row:

1. **Match.** The longest suffix of the row's context (``min_match`` .. ``max_pattern`` tokens) that occurs in
   the row's own context (before its last token) or in the corpus; its occurrences (the latest
   ``max_occurrences`` in each: recent text predicts best, and it bounds a lookup's cost).
2. **Tree.** What followed those occurrences, expanded best-first by estimated probability (the product of the
   continuations' frequencies along the path, :func:`~specdec_ext.drafters.suffix_index.speculation_tree`) into a
   tree of at most ``floor(spec_factor * match length)`` drafts (SuffixDecoding's adaptive size: a long match is
   confident, a short one is not worth a wide tree), none below ``min_prob``, within ``max_nodes`` and the depth
   asked. No match: a 1-node tree (a plain decoding step).

Drafts are deterministic (``draft_probs = None``): greedy and lossless sampling verify them as they are.

Across requests. A row that leaves (:meth:`SuffixDrafter.retire`: finished or aborted) adds one document to the
corpus: its output, preceded by the last ``max_pattern`` tokens of its prompt, so that the next request with the
same prompt end finds the output's first tokens (the whole prompt would spend the budget on text that each new
request brings in its own context anyway). The corpus holds at most ``corpus_tokens`` tokens; the oldest documents
are evicted first.

A row reads the corpus as it was when the row joined (documents added later are not in its view, and documents
evicted since stay readable to it until it leaves): its tree depends on its own context, the depth asked and the
drafter's history before it joined, never on the rows beside it, so a seeded request's tokens do not depend on its
batch. Everything runs on the host over ``DecodeState.host_tokens``: no device synchronisation.
"""

from __future__ import annotations

import math

import torch

from specdec_ext.drafters.base import pad_trees
from specdec_ext.drafters.suffix_index import SuffixIndex, longest_match, speculation_tree
from specdec_ext.state import DecodeState, DraftTree, StepResult, plain_tree

KEY_LEN = 4  # k-grams indexed per position: longer matches extend the latest occurrences of the 4-gram backwards


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"SuffixDrafter: {name} must be an integer >= {low}, got {value!r}")
    return value


def _check_float(name: str, value, low: float, high: float, low_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value > low if low_open else value >= low) or value > high:
        bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if math.isfinite(high) else "")
        raise ValueError(f"SuffixDrafter: {name} must be a finite number {bound}, got {value!r}")
    return float(value)


class _Row:
    """One row's own context (indexed) and its view of the corpus: ``[lo, hi)`` as the row joined."""

    __slots__ = ("context", "prompt_len", "lo", "hi")

    def __init__(self, prompt: list[int], corpus: SuffixIndex):
        self.context = SuffixIndex(corpus.key_len)
        self.context.extend(prompt)
        self.prompt_len = len(prompt)
        self.lo, self.hi = corpus.start, corpus.end
        corpus.pin(self.lo)

    def sync(self, tokens: list[int]) -> None:
        """Takes the tokens appended to the row's context since the last call."""
        if len(tokens) > self.context.end:
            self.context.extend(tokens[self.context.end:])


class SuffixDrafter:
    """Suffix-decoding drafter (see the module doc).

    ``max_depth``: deepest tree; ``max_nodes``: largest tree, root included. ``max_pattern``: longest context suffix
    matched; ``min_match``: shortest. ``spec_factor``: drafts per matched token; ``min_prob``: least estimated
    probability of a draft. ``corpus_tokens``: the corpus' token budget (0: each row drafts from its own context
    only). ``max_occurrences``: occurrences read per lookup, per source. The defaults come from a host-only
    acceptance sweep on the model family (README, "Suffix decoding across requests").
    """

    hidden_state_layers: tuple[int, ...] = ()
    forwards = 0  # no network
    defers_prefill = False  # no prefill forward to defer
    serves_row_subsets = True

    def __init__(self, max_depth: int = 16, max_nodes: int = 17, *, max_pattern: int = 16, min_match: int = 1,
                 spec_factor: float = 3.0, min_prob: float = 0.1, corpus_tokens: int = 1 << 18,
                 max_occurrences: int = 64):
        self.max_depth = _check_int("max_depth", max_depth, 1)
        self.max_nodes = _check_int("max_nodes", max_nodes, 2)
        self.max_pattern = _check_int("max_pattern", max_pattern, 1)
        self.min_match = _check_int("min_match", min_match, 1)
        if min_match > max_pattern:
            raise ValueError(f"SuffixDrafter: min_match must be <= max_pattern ({max_pattern}), got {min_match}")
        self.spec_factor = _check_float("spec_factor", spec_factor, 0.0, math.inf, low_open=True)
        self.min_prob = _check_float("min_prob", min_prob, 0.0, 1.0, low_open=False)
        self.corpus_tokens = _check_int("corpus_tokens", corpus_tokens, 0)
        self.max_occurrences = _check_int("max_occurrences", max_occurrences, 1)
        self.corpus = SuffixIndex(min(KEY_LEN, max_pattern))
        self._rows: list[_Row] = []

    # ---- rows joining and leaving ---------------------------------------------------------------------------------
    def begin(self, target: torch.nn.Module, state: DecodeState, prefill_hidden_states=None) -> None:
        """A new batch. Rows of an earlier batch that never left (an interrupted generation) leave first: their
        verified tokens join the corpus as any leaving row's do."""
        self.retire(torch.zeros(0, dtype=torch.int64))
        self.add_rows(target, state)

    def add_rows(self, target: torch.nn.Module, rows: DecodeState, prefill_hidden_states=None) -> None:
        self._rows += [_Row(ctx, self.corpus) for ctx in rows.host_tokens]

    def retire(self, keep: torch.Tensor) -> None:
        """The leaving rows' outputs (after the end of their prompts) join the corpus, oldest documents are evicted
        to the budget, and the rows ``keep`` stay."""
        kept = keep.tolist()
        stay = set(kept)
        for i, row in enumerate(self._rows):
            if i in stay:
                continue
            self.corpus.unpin(row.lo)
            ctx = row.context
            if self.corpus_tokens and ctx.end > row.prompt_len:
                start = max(row.prompt_len - self.max_pattern, 0)
                self.corpus.add_document(ctx.tokens[start:])
        self.corpus.evict(self.corpus_tokens)
        self._rows = [self._rows[i] for i in kept]

    # ---- the step -------------------------------------------------------------------------------------------------
    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        if len(self._rows) != state.batch_size:
            self.begin(None, state)
        depth = min(self.max_depth, max_depth)
        nodes = min(self.max_nodes, max_nodes)
        if depth <= 0 or nodes <= 1:  # a plain step (the adaptive drafter's): observe keeps the rows in sync
            return plain_tree(state.last_tokens)
        trees = []
        for row, ctx in zip(self._rows, state.host_tokens):
            row.sync(ctx)
            trees.append(self._tree(row, ctx, depth, nodes))
        return pad_trees(trees, state.device)

    def _tree(self, row: _Row, ctx: list[int], depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        if depth <= 0 or max_nodes <= 1:
            return [ctx[-1]], [-1]
        views = [(row.context, 0, len(ctx) - 1), (self.corpus, row.lo, row.hi)]
        m, occurrences = longest_match(ctx, views, self.max_pattern, self.min_match, self.max_occurrences)
        budget = min(max_nodes - 1, math.floor(self.spec_factor * m))
        tokens, parents, _ = speculation_tree(occurrences, budget, depth, self.min_prob)
        return [ctx[-1], *tokens], [-1, *(p + 1 for p in parents)]

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        """Takes each row's emitted tokens (so a row that leaves now brings its whole output to the corpus)."""
        for row, ctx in zip(self._rows, state.host_tokens):
            row.sync(ctx)
