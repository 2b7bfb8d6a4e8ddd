"""The decode loop's state types, which the engine (:mod:`specdec_ext.engine`) and the drafters both use.

* :class:`DraftTree`: one step's draft tree per row (``tokens[B, N]``, ``parents[B, N]``, ``draft_probs``), and
  optionally its :class:`TreeTables` (position offsets and ancestor mask), which a tree that is the same every step
  computes once; :func:`plain_tree` is the 1-node tree of a plain decoding step.
* :class:`ShallowStates`: a chain's residual stream after the target's first layers, computed while drafting (an
  early-exit draft), from which verification runs only the remaining layers.
* :class:`SamplingParams`: per-row temperature (0 = greedy), top-k and top-p, as ``[B]`` tensors.
* :class:`DecodeState`: every row's context, lengths, sampling and random stream; rows join (:meth:`append`) and
  leave (:meth:`keep_rows`) between steps.
* :class:`StepResult`: a step's verification outcome, handed to the drafter's ``observe``.

The drafter protocol that reads them is :mod:`specdec_ext.drafters.base`.
"""

from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass, replace

import torch

from specdec_ext import ops

__all__ = ["DecodeState", "DraftTree", "GREEDY_TEMPERATURE", "SamplingParams", "ShallowStates", "StepResult",
           "TreeTables", "plain_tree"]

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy: the ops' epsilon (docs/ARCHITECTURE.md)


@dataclass(frozen=True)
class TreeTables:
    """What the verification forward (:func:`~specdec_ext.models.tree_forward`) derives from a tree's parents:
    ``depth[B, N]`` int64 (each node's position offset from the root, ``ops.build_tree``'s depth) and ``mask``, the
    ancestor-or-self mask the attention reads (``ops.tree_ancestor_mask``: the kernel's packed int32 ``[B, N,
    ceil(N/32)]`` or dense bool ``[B, N, N]``; the kernel and the 4-D mask route take either). Read-only: a static
    tree hands the same tables on every step."""

    depth: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, parents: torch.Tensor, packed: bool = True, validate: bool = True) -> "TreeTables":
        """The tables of ``parents[B, N]`` (int64); ``validate`` checks the tree (ValueError naming the row)."""
        depth = ops.build_tree(parents, 0, validate=validate).depth
        return cls(depth, ops.tree_ancestor_mask(parents, packed=packed, validate=False))


@dataclass(frozen=True)
class ShallowStates:
    """Every tree node's residual stream after the target's first ``layer`` decoder layers, ``hidden[B, N, H]`` in the
    target's dtype, with those layers' K/V of every node already in the target's cache at the slots the
    verification writes (``prefix_lens[b] + j``): an early-exit draft ran the target's shallow layers on the very
    tokens, positions and masks the verification would (a chain), so the verification forward may start at layer
    ``layer`` (:meth:`~specdec_ext.models.llama_step.LlamaStepOps.run`). A route that cannot start there runs every
    layer and writes the same K/V again."""

    layer: int
    hidden: torch.Tensor


@dataclass
class DraftTree:
    """One step's draft tree per row (see :mod:`specdec_ext.drafters.base`). ``tables``: the tree's
    :class:`TreeTables` when its drafter has them at hand (a static tree's, made once), else None (the verification
    forward computes them); they must be those of ``parents``. ``row_depth`` / ``row_nodes``: when rows of
    different sizes share the batch's ``N`` (``drafters.base.pad_trees``), row b's own tree is its first
    ``row_nodes[b]`` nodes, none deeper than ``row_depth[b]``, and the rest are padding, every node of it deeper:
    verification ignores it (so a row's tokens do not depend on its neighbours); None: every node is a draft."""

    tokens: torch.Tensor  # [B, N] int64; tokens[:, 0] is the root (last emitted token)
    parents: torch.Tensor  # [B, N] int64; parents[:, 0] == -1, parents[:, i] < i
    draft_probs: torch.Tensor | None = None  # [B, N, V] float32, row u = distribution of u's children; or None
    tables: TreeTables | None = None
    row_depth: list[int] | None = None  # host ints, one per row (set together with row_nodes)
    row_nodes: list[int] | None = None
    shallow: ShallowStates | None = None  # the nodes' shallow layers, already run (an early-exit draft's chain)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@functools.lru_cache(maxsize=64)
def _plain_parts(batch: int, device: torch.device) -> tuple[torch.Tensor, TreeTables]:
    """The 1-node tree's parents and tables for ``batch`` rows (made once per batch size and device; read-only)."""
    parents = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
    return parents, TreeTables.of(parents, validate=False)


def plain_tree(roots: torch.Tensor) -> DraftTree:
    """The 1-node tree of each row's root ``roots[B]``: a plain decoding step."""
    parents, tables = _plain_parts(roots.shape[0], roots.device)
    return DraftTree(roots[:, None], parents, None, tables)


@dataclass
class SamplingParams:
    """Each row's sampling: ``temperature`` / ``top_p`` float32 ``[B]``, ``top_k`` int64 ``[B]`` on the state's
    device (the ops take them per row), and ``greedy_rows`` on the host. Built by :meth:`rows`, validated by the
    engine's :class:`~specdec_ext.engine.RequestSettings`."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy_rows: list[bool]

    @classmethod
    def rows(cls, temperature: list[float], top_k: list[int], top_p: list[float], device) -> "SamplingParams":
        t = torch.tensor(temperature, dtype=torch.float32)
        return cls(t.to(device), torch.tensor(top_k, dtype=torch.int64).to(device),
                   torch.tensor(top_p, dtype=torch.float32).to(device), [x < GREEDY_TEMPERATURE for x in temperature])

    @classmethod
    def greedy_rows_of(cls, batch: int, device="cpu") -> "SamplingParams":
        """``batch`` greedy rows (temperature 0, no top-k / top-p filter)."""
        return cls.rows([0.0] * batch, [0] * batch, [1.0] * batch, device)

    @property
    def greedy(self) -> bool:
        """Every row is greedy (then argmax drafting and greedy verification suffice)."""
        return all(self.greedy_rows)

    def keep_rows(self, keep: torch.Tensor, rows: list[int]) -> "SamplingParams":
        return SamplingParams(self.temperature.index_select(0, keep), self.top_k.index_select(0, keep),
                              self.top_p.index_select(0, keep), [self.greedy_rows[i] for i in rows])

    def append(self, other: "SamplingParams") -> "SamplingParams":
        return SamplingParams(torch.cat([self.temperature, other.temperature]), torch.cat([self.top_k, other.top_k]),
                              torch.cat([self.top_p, other.top_p]), self.greedy_rows + other.greedy_rows)


@dataclass
class DecodeState:
    """What the loop knows about every row; drafters read it (and must not modify it).

    ``tokens`` is a device buffer ``[B, max_len]`` (right-padded) with each row's context; ``host_tokens`` the same
    as Python lists (available without a device sync: the loop reads its results back once per step).
    ``generators[b]``: row b's random stream (None for a greedy row); rows may share one generator.
    """

    tokens: torch.Tensor  # [B, max_len] int64 on the target's device
    lengths: torch.Tensor  # [B] int64 on the device: context length (prompt + emitted, root included)
    host_tokens: list[list[int]]  # per row, the context as Python ints
    prompt_lens: list[int]
    done: list[bool]  # per row: finished (stop, budget or abort); the row leaves the batch after the step
    max_len: int  # capacity of ``tokens`` and of the target cache
    sampling: SamplingParams
    generators: list[torch.Generator | None]
    vocab_size: int
    step: int = 0
    # The target's KV cache, which the engine owns (None: a state made outside an engine). It holds every row's
    # ``prefix_lens`` context tokens; a drafter that drafts with the target itself (self-speculation) reads it and
    # writes scratch K/V at and after ``prefix_lens``, which the verification forward overwrites.
    target_cache: object | None = None
    # Per row, the tokens it may still emit (its budget left; a stop may end it sooner), kept current by the engine
    # after every step (None: not known, a state made outside an engine).
    budgets: list[int] | None = None

    @classmethod
    def of_prompts(cls, prompts: list[list[int]], max_len: int, vocab_size: int, device="cpu",
                   sampling: SamplingParams | None = None,
                   generators: list[torch.Generator | None] | None = None,
                   target_cache=None, budgets: list[int] | None = None) -> "DecodeState":
        """The state of rows that start with ``prompts`` (nothing emitted yet): greedy unless ``sampling`` says
        otherwise, with ``generators`` (default: none), the engine's ``target_cache`` and the rows' ``budgets``."""
        B = len(prompts)
        buf = torch.zeros(B, max_len, dtype=torch.int64)
        for b, p in enumerate(prompts):
            buf[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        dev = torch.device(device)
        return cls(tokens=buf.to(dev), lengths=lengths.to(dev), host_tokens=[list(p) for p in prompts],
                   prompt_lens=[len(p) for p in prompts], done=[False] * B, max_len=max_len,
                   sampling=sampling if sampling is not None else SamplingParams.greedy_rows_of(B, dev),
                   generators=list(generators) if generators is not None else [None] * B, vocab_size=vocab_size,
                   target_cache=target_cache, budgets=list(budgets) if budgets is not None else None)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def prefix_lens(self) -> torch.Tensor:
        """``[B]``: tokens in the target cache before the root (``lengths - 1``)."""
        return self.lengths - 1

    @property
    def last_tokens(self) -> torch.Tensor:
        """``[B]``: each row's root, the last context token."""
        return self.tokens.gather(1, (self.lengths - 1)[:, None])[:, 0]

    def keep_rows(self, keep: torch.Tensor, keep_host: list[int] | None = None) -> None:
        """Keeps only the rows ``keep`` (int64 ``[B']``, distinct), which become rows ``0 .. B' - 1``: the device
        tensors by one ``index_select`` each, the host lists by ``keep_host`` (= ``keep.tolist()``, passed by the
        loop so that a device ``keep`` costs no synchronisation)."""
        rows = keep.tolist() if keep_host is None else list(keep_host)
        keep = keep.to(self.device, non_blocking=True)
        self.tokens = self.tokens.index_select(0, keep)
        self.lengths = self.lengths.index_select(0, keep)
        self.host_tokens = [self.host_tokens[i] for i in rows]
        self.prompt_lens = [self.prompt_lens[i] for i in rows]
        self.done = [self.done[i] for i in rows]
        self.sampling = self.sampling.keep_rows(keep, rows)
        self.generators = [self.generators[i] for i in rows]
        if self.budgets is not None:
            self.budgets = [self.budgets[i] for i in rows]

    def rows_of(self, rows: list[int]) -> "DecodeState":
        """The rows ``rows`` (distinct host ints, in that order) as a state of their own, this one untouched (the
        device rows copied, the host lists shared), without the target's cache (which holds every row)."""
        sub = replace(self, target_cache=None)
        sub.keep_rows(torch.tensor(rows, dtype=torch.int64), rows)
        return sub

    def append(self, other: "DecodeState") -> None:
        """The rows of ``other`` (same ``max_len`` and vocabulary) join as the last rows."""
        if other.max_len != self.max_len or other.vocab_size != self.vocab_size:
            raise ValueError(f"DecodeState.append: rows of max_len {other.max_len} / vocabulary {other.vocab_size} "
                             f"cannot join a state of max_len {self.max_len} / vocabulary {self.vocab_size}")
        self.tokens = torch.cat([self.tokens, other.tokens])
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.host_tokens = self.host_tokens + other.host_tokens
        self.prompt_lens = self.prompt_lens + other.prompt_lens
        self.done = self.done + other.done
        self.sampling = self.sampling.append(other.sampling)
        self.generators = self.generators + other.generators
        self.budgets = None if self.budgets is None or other.budgets is None else self.budgets + other.budgets

    def uniforms(self, rows: int, *shape: int) -> torch.Tensor:
        """Uniform [0, 1) numbers ``[rows, *shape]`` on the state's device, row b's drawn from row b's generator
        (``prod(shape)`` numbers per row, whatever else is in the batch); zeros for a greedy row, which draws
        nothing."""
        if rows != self.batch_size:
            raise ValueError(f"DecodeState.uniforms: {rows} rows asked of a batch of {self.batch_size}")
        dev = self.device
        draws = [torch.rand(shape, generator=gen, device=gen.device).to(dev, non_blocking=True)
                 if gen is not None and not greedy else torch.zeros(shape, device=dev)
                 for gen, greedy in zip(self.generators, self.sampling.greedy_rows)]
        return torch.stack(draws) if draws else torch.zeros((0, *shape), device=dev)

@dataclass
class StepResult:
    """Verification outcome of one step, handed to the drafter's ``observe`` after ``state`` was updated."""

    accepted: torch.Tensor  # [B, N] int64 node indices of the accepted path, root first, -1 padded
    accept_len: torch.Tensor  # [B] int64 accepted draft tokens (root excluded)
    next_token: torch.Tensor  # [B] int64 correction or bonus token
    appended: list[int]  # per row, tokens appended to the context this step (cut at a stop or the budget)
    hidden_states: tuple[torch.Tensor, ...] | None = None  # per requested layer, [B, N, H] at every tree node
    _: KW_ONLY
    # ``accept_len`` on the host (read back with the step's tokens): what the verification accepted, before any cut
    # at a stop or the budget, so an outcome without a device read (``appended`` - 1 is cut where a row finished)
    host_accept_len: list[int]

    def rows_of(self, rows: list[int]) -> "StepResult":
        """The outcome of the rows ``rows`` alone (host ints, in that order), as :meth:`DecodeState.rows_of` gives
        their state."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.accepted.device)
        hidden = None if self.hidden_states is None else tuple(h.index_select(0, index) for h in self.hidden_states)
        return StepResult(self.accepted.index_select(0, index), self.accept_len.index_select(0, index),
                          self.next_token.index_select(0, index), [self.appended[i] for i in rows], hidden,
                          host_accept_len=[self.host_accept_len[i] for i in rows])
