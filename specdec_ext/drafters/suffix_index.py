"""The suffix drafter's text index (:class:`SuffixIndex`) and its two queries (:func:`longest_match`,
:func:`speculation_tree`); :mod:`specdec_ext.drafters.suffix` drives them.

An index holds documents of token ids in one flat list, each closed by a separator, and maps every k-gram (k = 1 ..
``key_len``) inside a document to the ascending absolute positions of its last token. A lookup reads a **view**:
``(index, lo, hi)``, the k-grams ending in ``[lo, hi)``, so a row can read the corpus as it was when it joined (new
documents lie at or past ``hi``) and its own context without its last token (the query itself). Matches longer than
``key_len`` are found by extending the latest occurrences of the ``key_len``-gram backwards, which costs
``max_occurrences * max_pattern`` comparisons at most, whatever the corpus' size, where a suffix tree would hold
``max_pattern`` nodes per token.

Memory: :meth:`SuffixIndex.evict` drops whole documents, oldest first, until the live tokens fit a budget; the
dropped tokens and their positions stay until no view needs them (:meth:`SuffixIndex.pin`), and are then compacted
away in one pass once they are as many as the live tokens (amortised O(1) per token).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import Counter, deque

SEP = -1  # closes every document (never a token id): no k-gram, match or continuation crosses it


class SuffixIndex:
    """Documents of token ids with a k-gram position index (see the module doc). The last document may be open:
    :meth:`extend` appends to it, :meth:`close` ends it."""

    def __init__(self, key_len: int):
        self.key_len = key_len
        self.tokens: list[int] = []  # physical: absolute position p is tokens[p - base]
        self.base = 0
        self.keys: dict[tuple[int, ...], list[int]] = {}
        self.docs: deque[tuple[int, int]] = deque()  # live closed documents: (start, end) absolute, end = its SEP
        self.open_start = 0  # where the open document starts (absolute)
        self._pins: Counter[int] = Counter()  # view starts still read by someone

    @property
    def end(self) -> int:
        """One past the last absolute position."""
        return self.base + len(self.tokens)

    @property
    def start(self) -> int:
        """The first live absolute position (the oldest live document's start)."""
        return self.docs[0][0] if self.docs else self.open_start

    @property
    def live_tokens(self) -> int:
        """Tokens of the live documents, separators excluded."""
        return self.end - self.start - len(self.docs)

    def token(self, p: int) -> int:
        return self.tokens[p - self.base]

    def extend(self, new: list[int]) -> None:
        """Appends ``new`` to the open document, indexing every k-gram that ends in it."""
        toks, keys, base, K = self.tokens, self.keys, self.base, self.key_len
        for t in new:
            toks.append(t)
            p = base + len(toks) - 1
            lo = max(p - K + 1, self.open_start) - base
            hi = p - base + 1
            for s in range(lo, hi):
                keys.setdefault(tuple(toks[s:hi]), []).append(p)

    def close(self) -> None:
        """Ends the open document (an empty one is dropped)."""
        if self.end > self.open_start:
            self.docs.append((self.open_start, self.end))
            self.tokens.append(SEP)
        self.open_start = self.end

    def add_document(self, doc: list[int]) -> None:
        self.extend(doc)
        self.close()

    def evict(self, budget: int) -> None:
        """Drops the oldest documents until the live tokens are at most ``budget``; compacts when that pays."""
        while self.docs and self.live_tokens > budget:
            self.docs.popleft()
        cut = min([self.start, *self._pins])
        if cut - self.base >= max(self.end - cut, 1024):
            self._compact(cut)

    def pin(self, lo: int) -> None:
        """A view starting at ``lo`` is in use: its tokens survive compaction until :meth:`unpin`."""
        self._pins[lo] += 1

    def unpin(self, lo: int) -> None:
        self._pins[lo] -= 1
        if self._pins[lo] <= 0:
            del self._pins[lo]

    def _compact(self, cut: int) -> None:
        del self.tokens[: cut - self.base]
        self.base = cut
        for key in list(self.keys):
            lst = self.keys[key]
            i = bisect_left(lst, cut)
            if i == len(lst):
                del self.keys[key]
            elif i:
                del lst[:i]


View = tuple[SuffixIndex, int, int]  # (index, lo, hi): the k-grams ending in [lo, hi)


def _occurrences(view: View, key: tuple[int, ...], cap: int) -> list[int]:
    index, lo, hi = view
    lst = index.keys.get(key)
    if not lst:
        return []
    j = bisect_left(lst, hi)
    return lst[max(bisect_left(lst, lo), j - cap):j]


def _match_length(index: SuffixIndex, p: int, query: list[int], known: int, longest: int) -> int:
    """How many tokens before and at ``p`` equal the end of ``query`` (at least ``known``, at most ``longest``)."""
    m, L, first = known, len(query), index.base
    while m < longest:
        q = p - m
        if q < first or index.tokens[q - first] != query[L - 1 - m]:  # (a separator never equals a token)
            break
        m += 1
    return m


def longest_match(query: list[int], views: list[View], max_pattern: int, min_match: int,
                  max_occurrences: int) -> tuple[int, list[tuple[SuffixIndex, int]]]:
    """The longest suffix of ``query`` (``min_match`` .. ``max_pattern`` tokens) that occurs in the views, and its
    occurrences ``(index, position of its last token)`` (in each view the latest ``max_occurrences``); ``(0, [])``
    when none occurs."""
    K = next(iter(views))[0].key_len if views else 1
    for k in range(min(K, max_pattern, len(query)), min_match - 1, -1):
        key = tuple(query[len(query) - k:])
        found = [(v[0], p) for v in views for p in _occurrences(v, key, max_occurrences)]
        if not found:
            continue
        if k < K or k == max_pattern or len(query) == k:
            return k, found  # (no (k+1)-gram occurs, or none is asked for)
        lengths = [_match_length(index, p, query, k, min(max_pattern, len(query))) for index, p in found]
        m = max(lengths)
        return m, [occ for occ, n in zip(found, lengths) if n == m]
    return 0, []


def speculation_tree(occurrences: list[tuple[SuffixIndex, int]], budget: int, max_depth: int,
                     min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """Best-first expansion of what follows ``occurrences``: a path's estimated probability is the share of the
    occurrences that continue with it (the product of the conditional shares along it; occurrences that end
    earlier count in every share's denominator); up to ``budget`` nodes of probability >= ``min_prob``, no deeper
    than ``max_depth``. A continuation runs to its document's end (a row's own context: to its last token).
    Returns the nodes' tokens, parents (-1: under the root, which is not included) and probabilities, parents
    before children."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    if budget <= 0 or max_depth <= 0 or not occurrences:
        return tokens, parents, probs
    heap: list = []  # (-probability, push order, token, parent node, its occurrences, depth)
    order, total = 0, len(occurrences)

    def push_children(node: int, occ: list[tuple[SuffixIndex, int]], depth: int) -> None:
        nonlocal order
        groups: dict[int, list[tuple[SuffixIndex, int]]] = {}
        for index, p in occ:
            q = p + 1
            if q < index.end:
                t = index.tokens[q - index.base]
                if t != SEP:
                    groups.setdefault(t, []).append((index, q))
        for t, grp in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            child_prob = len(grp) / total  # (a count ratio, not a product of rounded ones)
            if child_prob >= min_prob:
                heapq.heappush(heap, (-child_prob, order, t, node, grp, depth + 1))
                order += 1

    push_children(-1, occurrences, 0)
    while heap and len(tokens) < budget:
        neg, _, t, parent, grp, depth = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        probs.append(-neg)
        if depth < max_depth:
            push_children(len(tokens) - 1, grp, depth)
    return tokens, parents, probs
