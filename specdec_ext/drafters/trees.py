"""Static draft trees from a Medusa-style *choices* list.

A choice is a path below the root: ``(i, j, k)`` is "the i-th best candidate of head 0, then the j-th best of
head 1, then the k-th best of head 2" (ranks count from 0). A choices list is the set of tree nodes other than the
root; it must be prefix-closed (every proper prefix of a choice is a choice too). Medusa lists its trees in
priority order (most likely to be accepted first); :func:`static_tree` keeps that order when it truncates a tree
to a node budget, and lays the nodes out by (depth, path) as Medusa does, so parents precede their children.

``MC_SIM_7B_63`` is Medusa's default tree ``mc_sim_7b_63`` (63 choices, 64 nodes with the root, depth 4, ranks up
to 9), copied from FasterDecoding/Medusa ``medusa/model/medusa_choices.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from specdec_ext import ops
from specdec_ext.state import TreeTables

__all__ = ["MC_SIM_7B_63", "StaticTree", "static_tree"]

MC_SIM_7B_63: tuple[tuple[int, ...], ...] = tuple(tuple(c) for c in [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
    [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
    [1, 6], [0, 7, 0],
])


@dataclass(frozen=True)
class StaticTree:
    """A static tree laid out for drafting and verification. Node 0 is the root; node i > 0 is ``choices[i - 1]``.

    ``parents[i]`` (parent node, -1 for the root; parents precede children), ``depth[i]`` (root 0), ``rank[i]``
    (the node's rank in the top-k of head ``depth[i] - 1``; -1 for the root), ``top_k`` (largest rank + 1: how
    many candidates each head must provide), ``max_depth`` (= heads used). ``gather_index[i - 1]`` =
    ``(depth[i] - 1) * top_k + rank[i]``: where node i's token sits in the flattened ``[max_depth, top_k]``
    candidate table. Its tensors (parents, :meth:`tables`, ...) are made once per batch size and device and are
    read-only: the tree is the same every step.
    """

    choices: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]
    top_k: int
    max_depth: int
    _tensors: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def gather_index(self) -> tuple[int, ...]:
        return tuple((d - 1) * self.top_k + r for d, r in zip(self.depth[1:], self.rank[1:]))

    def parents_tensor(self, batch: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``parents[batch, N]`` int64 on ``device`` (built once per batch size and device)."""
        return self._tensor(("parents", batch), [self.parents] * batch, device)

    def tables(self, batch: int, device: torch.device | str | None = None) -> TreeTables:
        """The tree's :class:`~specdec_ext.state.TreeTables` for ``batch`` rows on ``device`` (what the verification
        forward would otherwise derive from the parents every step)."""
        return self._cached(("tables", batch), device, lambda: TreeTables.of(self.parents_tensor(batch, device)))

    def ancestors_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[N, N]`` bool: node j is node i or one of its ancestors (a drafter feeding the tree level by level)."""
        return self._cached("ancestors", device,
                            lambda: ops.tree_ancestor_mask(self.parents_tensor(1, device), validate=False)[0])

    def level_tensors(self, device: torch.device | str | None = None) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per depth d = 1 .. max_depth (entry d - 1): int64 ``(nodes, their parents, their ranks)``."""
        def make():
            levels = [[i for i in range(self.num_nodes) if self.depth[i] == d] for d in range(1, self.max_depth + 1)]
            return tuple(tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in
                               (nodes, [self.parents[i] for i in nodes], [self.rank[i] for i in nodes]))
                         for nodes in levels)
        return self._cached("levels", device, make)

    def cut(self, depth: int, max_nodes: int | None = None) -> "StaticTree":
        """The tree without its nodes deeper than ``depth``, and then (``max_nodes`` below its size) its first
        ``max_nodes`` nodes, root included, in the tree's order (shallower first; :func:`static_tree`'s
        truncation). Made once per shape: the trees a drafter cuts to its step's depth and node budgets."""
        d = max(0, min(int(depth), self.max_depth))
        n = None if max_nodes is None or max_nodes >= self.num_nodes else max(1, int(max_nodes))
        if (d, n) == (self.max_depth, None):
            return self
        key = ("cut", d, n)
        tree = self._tensors.get(key)
        if tree is None:
            tree = self._tensors[key] = static_tree([c for c in self.choices if len(c) <= d], n)
        return tree

    def gather_index_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        return self._tensor("gather", self.gather_index, device)

    def candidate_parents_tensor(self, batch: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[batch, N - 1]`` int64: the non-root nodes as candidates (node i is candidate i - 1), each one's parent
        candidate, -1 for the root's children (:func:`specdec_ext.ops.select_tree_nodes`' input)."""
        return self._tensor(("candidate_parents", batch), [[p - 1 for p in self.parents[1:]]] * batch, device)

    def _tensor(self, name, values, device) -> torch.Tensor:
        return self._cached(name, device, lambda: torch.tensor(values, dtype=torch.int64, device=device))

    def _cached(self, name, device, make):
        key = (name, str(torch.device(device) if device is not None else torch.device("cpu")))
        t = self._tensors.get(key)
        if t is None:
            t = self._tensors[key] = make()
        return t


def _normalise(choices: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    if isinstance(choices, (str, bytes)):
        raise TypeError("tree choices must be a list of paths such as [[0], [0, 0], [1]], got a string")
    out, seen = [], set()
    for n, c in enumerate(choices):
        if isinstance(c, int):
            raise TypeError(f"tree choices[{n}] = {c!r}: every choice is a path (a list of ranks such as [0, 1]), "
                            "not a number")
        path = tuple(c)
        if not path:
            raise ValueError(f"tree choices[{n}] is empty (the root is implicit; every choice is a non-empty path)")
        for r in path:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"tree choices[{n}] = {list(path)}: ranks must be integers >= 0")
        if path in seen:
            raise ValueError(f"tree choices[{n}] = {list(path)} appears twice")
        seen.add(path)
        out.append(path)
    for n, path in enumerate(out):
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"tree choices[{n}] = {list(path)}: its parent {list(path[:-1])} is not among the "
                             "choices (the choices list must contain every prefix of every choice)")
    return out


def static_tree(choices: Iterable[Sequence[int]] = MC_SIM_7B_63, max_nodes: int | None = None) -> StaticTree:
    """The :class:`StaticTree` of a choices list (default: Medusa's ``mc_sim_7b_63``).

    ``max_nodes`` (root included) truncates the tree: choices are taken in the listed (priority) order, skipping
    any whose parent was not taken, until ``max_nodes - 1`` are kept. ``max_nodes = 1`` gives the root alone.
    """
    paths = _normalise(choices)
    if max_nodes is not None:
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"static_tree: max_nodes must be an integer >= 1, got {max_nodes!r}")
        kept, kept_set = [], set()
        for p in paths:
            if len(kept) >= max_nodes - 1:
                break
            if len(p) == 1 or p[:-1] in kept_set:
                kept.append(p)
                kept_set.add(p)
        paths = kept
    ordered = sorted(paths, key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(ordered)}
    parents = [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in ordered]
    depth = [0] + [len(p) for p in ordered]
    rank = [-1] + [p[-1] for p in ordered]
    top_k = max(rank[1:], default=-1) + 1
    return StaticTree(tuple(ordered), tuple(parents), tuple(depth), tuple(rank), top_k, max(depth))
