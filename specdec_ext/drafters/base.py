"""The drafter protocol: what :func:`specdec_ext.generate.generate` asks of a drafter, and what it hands over.

One speculative step, for every row b of the batch::

    tree  = drafter.propose(state, max_depth)          # DraftTree: tokens[B, N], parents[B, N], draft_probs
    logits = tree_forward(target, cache, tree.tokens, tree.parents, state.prefix_lens)
    result = verify(logits, tree)                       # accepted path, accept_len, next_token
    drafter.observe(state, tree, result)                # after the state took the emitted tokens

The tree's node 0 is the **root**: the last emitted token of the row, not yet in the target's KV cache
(``tokens[:, 0] == state.last_tokens``). ``parents`` are topologically ordered (parent index < child index).
``draft_probs[B, N, V]`` (float32) is indexed by the parent: row u is the distribution u's children were sampled
from (needed for lossless sampling of *sampled* drafts); ``None`` means deterministic drafts (n-gram, top-k
children, greedy chains), which greedy and lossless verification both accept as they are. A drafter that has
nothing to propose for a row pads: a 1-node tree is a plain decoding step, and extra nodes of any content are safe
(verification is lossless whatever the drafts are), merely wasted work.

Hidden states (for Medusa / EAGLE): a drafter lists the indices it needs into the target's ``output_hidden_states``
tuple in ``hidden_state_layers`` (HF convention: 0 = embeddings, i = after decoder layer i, -1 = the last, which for
most HF models is after the final norm). The loop then asks the target for hidden states, and passes them to
:meth:`Drafter.begin` (prefill positions, ``[B, P_max - 1, H]`` each, row b meaningful up to ``prompt_len[b] - 1``)
and :meth:`Drafter.observe` (every tree node, ``[B, N, H]`` each; gather with ``result.accepted``). Dynamic trees
(EAGLE-2) simply return a different ``parents`` each step: the loop derives everything else from it.

Lengths. ``state.lengths[b]`` counts the row's context tokens (prompt + emitted, root included); the target cache
holds ``state.prefix_lens = lengths - 1`` of them.

Finished rows are retired. After a step in which rows finished (EOS or budget) and others did not, the loop drops
the finished rows from the batch — from the state, the target cache and the drafter — so that they cost no compute
in later steps::

    drafter.observe(state, tree, result)                # every row of the step, the finishing ones included
    drafter.retire(keep)                                # keep: int64 [B'], the surviving rows
    # from now on B = B' and row i is the old row keep[i]

``retire(keep)`` must select ``keep`` in every per-row piece of drafter state (caches: one ``index_select`` over the
batch dimension; host lists: ``[lst[i] for i in keep.tolist()]``). ``keep`` is a CPU tensor (host values: reading
it costs no device synchronisation); move it with ``keep.to(device, non_blocking=True)`` for device state. Its
order is the loop's choice: surviving rows keep their slots, and each finished row's slot below B' is taken by a
live row from the end (``[0, 5, 2, 3, 4]`` when row 1 of 6 finished), so that in-place caches move as few rows as
possible. It is called only between steps, never with every row or with no row (a finished last row ends the
generation).

``retire`` is optional: a drafter without it (a third-party drafter written before it existed) still works, with
the loop's older behaviour: finished rows are *frozen* — they ride along in the batch until every row has finished,
their context and cache stay as they are, their results are ignored (``result.accept_len[b] = -1``,
``result.appended[b] = 0``) and ``state.done[b]`` is True. A drafter with ``retire`` only ever sees live rows.

One generation at a time. A drafter's caches and counters belong to the generation it serves, so
:func:`~specdec_ext.generate.generate` holds it (:func:`serving`) from start to end, and a second generation that
asks for a busy drafter — from another thread, or from a streamer callback — gets a ``ValueError`` at once instead
of corrupting the first one. Create one drafter per concurrent generation (they may share read-only weights, such
as one draft model or one set of heads). A drafter that wraps another exposes it as ``inner``
(:class:`~specdec_ext.adaptive.AdaptiveDrafter`): the wrapped drafter is held too.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class DraftTree:
    """One step's draft tree per row (see the module doc)."""

    tokens: torch.Tensor  # [B, N] int64; tokens[:, 0] is the root (last emitted token)
    parents: torch.Tensor  # [B, N] int64; parents[:, 0] == -1, parents[:, i] < i
    draft_probs: torch.Tensor | None = None  # [B, N, V] float32, row u = distribution of u's children; or None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass
class SamplingParams:
    """Sampling parameters of a generation (temperature 0 = greedy). Validated once by :func:`generate`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # the ops' greedy epsilon (docs/ARCHITECTURE.md)

    def validate(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
                self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = no top-p filter), got {self.top_p!r}")


@dataclass
class DecodeState:
    """What the loop knows about every row; drafters read it (and must not modify it).

    ``tokens`` is a device buffer ``[B, max_len]`` (right-padded) with each row's context; ``host_tokens`` the same
    as Python lists (available without a device sync: the loop reads its results back once per step).
    """

    tokens: torch.Tensor  # [B, max_len] int64 on the target's device
    lengths: torch.Tensor  # [B] int64 on the device: context length (prompt + emitted, root included)
    host_tokens: list[list[int]]  # per row, the context as Python ints
    prompt_lens: list[int]
    done: list[bool]  # per row: finished (EOS or budget); retired after the step (or frozen: see the module doc)
    max_len: int  # capacity of ``tokens`` and of the target cache
    sampling: SamplingParams
    generator: torch.Generator | None
    vocab_size: int
    step: int = 0

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
        """Keeps only the rows ``keep`` (int64 ``[B']``, distinct; see the module doc's retirement): the device
        tensors by one ``index_select`` each, the host lists by ``keep_host`` (= ``keep.tolist()``, passed by the
        loop so that a device ``keep`` costs no synchronisation)."""
        rows = keep.tolist() if keep_host is None else list(keep_host)
        keep = keep.to(self.device, non_blocking=True)
        self.tokens = self.tokens.index_select(0, keep)
        self.lengths = self.lengths.index_select(0, keep)
        self.host_tokens = [self.host_tokens[i] for i in rows]
        self.prompt_lens = [self.prompt_lens[i] for i in rows]
        self.done = [self.done[i] for i in rows]

    def uniforms(self, *shape: int) -> torch.Tensor:
        """Uniform [0, 1) numbers from the user's generator, on the state's device."""
        gen = self.generator
        dev = gen.device if gen is not None else self.device
        u = torch.rand(*shape, generator=gen, device=dev)
        return u if u.device == self.device else u.to(self.device, non_blocking=True)


@dataclass
class StepResult:
    """Verification outcome of one step, handed to :meth:`Drafter.observe` after ``state`` was updated."""

    accepted: torch.Tensor  # [B, N] int64 node indices of the accepted path, root first, -1 padded
    accept_len: torch.Tensor  # [B] int64 accepted draft tokens (root excluded); -1 for rows frozen before the step
    next_token: torch.Tensor  # [B] int64 correction or bonus token
    appended: list[int]  # per row, tokens appended to the context this step (0 for frozen rows)
    # (frozen rows exist only with a drafter that has no ``retire``; see the module doc)
    hidden_states: tuple[torch.Tensor, ...] | None = None  # per requested layer, [B, N, H] at every tree node


@runtime_checkable
class Drafter(Protocol):
    """A source of draft trees (see the module doc).

    ``max_nodes``: the largest tree (root included) :meth:`propose` returns; the loop sizes the target cache with
    it. ``hidden_state_layers``: indices into the target's hidden states that :meth:`begin` / :meth:`observe` need
    (empty: none, and the target is run without ``output_hidden_states``). :meth:`retire` is optional for
    :func:`~specdec_ext.generate.generate` (which looks it up with ``getattr``), though ``isinstance(x, Drafter)``
    checks for it like the other members.
    """

    max_nodes: int
    hidden_state_layers: tuple[int, ...]

    def begin(self, target: torch.nn.Module, state: DecodeState,
              prefill_hidden_states: tuple[torch.Tensor, ...] | None = None) -> None:
        """Start of a generation: check compatibility with ``target`` (clear errors), allocate caches.

        A drafter with its own network usually runs it over the prompt here (its prefill). It may also accept a
        keyword ``defer_prefill: bool = False``: with ``True`` it skips that forward, and its first speculative
        :meth:`propose` catches up on the prompt instead (:class:`~specdec_ext.adaptive.AdaptiveDrafter` asks for
        it, so that a generation it keeps plain never pays for the draft's prefill)."""

    def propose(self, state: DecodeState, max_depth: int) -> DraftTree:
        """A tree of at most ``max_nodes`` nodes (root included) per row, no deeper than ``max_depth`` (drafts past
        the remaining budget could not be emitted; deeper trees are still correct, only wasted work). No host
        synchronisation beyond reading ``state``."""

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        """After verification and the state update: roll internal caches back to the accepted prefix."""

    def retire(self, keep: torch.Tensor) -> None:
        """After :meth:`observe`, when some rows finished: keep only the rows ``keep`` (CPU int64 ``[B']``, distinct,
        in the loop's order), which become rows ``0 .. B' - 1`` of every later call. Optional (see the module doc): without
        it, finished rows stay in the batch, frozen."""


REQUIRED_MEMBERS = ("max_nodes", "hidden_state_layers", "begin", "propose", "observe")  # retire is optional


def check_drafter(name: str, drafter) -> None:
    """A ``ValueError`` naming ``name`` unless ``drafter`` has the protocol's required members (:class:`Drafter`,
    ``retire`` aside) with a ``max_nodes`` >= 1 and integer ``hidden_state_layers``."""
    missing = [m for m in REQUIRED_MEMBERS if not hasattr(drafter, m)]
    missing += [m for m in ("begin", "propose", "observe") if m not in missing and not callable(getattr(drafter, m))]
    if missing:
        hint = (" (to draft with a model, wrap it: DraftModelDrafter(model), or MedusaDrafter / EagleDrafter for "
                "their heads)" if isinstance(drafter, torch.nn.Module) else "")
        raise ValueError(f"{name}: drafter must be a drafter (max_nodes, hidden_state_layers, begin(), propose(), "
                         f"observe(): the protocol of specdec_ext.drafters.Drafter), got {type(drafter).__name__} "
                         f"without {', '.join(missing)}{hint}")
    n = drafter.max_nodes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: drafter.max_nodes must be an integer >= 1, got {n!r}")
    layers = drafter.hidden_state_layers
    try:
        ok = all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name}: drafter.hidden_state_layers must be a sequence of integers, got {layers!r}")


_SERVING: set[int] = set()  # id() of every drafter a generation holds (held objects stay alive, ids stay unique)
_SERVING_LOCK = threading.Lock()


@contextlib.contextmanager
def serving(drafter, name: str = "generate"):
    """Holds ``drafter`` (and the drafters it wraps, through ``inner``) for one generation; a ``ValueError`` at once
    if another generation holds one of them (see the module doc). ``None`` holds nothing."""
    chain = []
    while drafter is not None and all(d is not drafter for d in chain):
        chain.append(drafter)
        drafter = getattr(drafter, "inner", None)
    ids = [id(d) for d in chain]
    with _SERVING_LOCK:  # a test-and-set, never a wait: a busy drafter is an error, not a queue
        busy = [d for d in chain if id(d) in _SERVING]
        if busy:
            raise ValueError(f"{name}: this {type(busy[0]).__name__} is in use by another generation; a drafter "
                             "serves one generation at a time: create one drafter per concurrent generation")
        _SERVING.update(ids)
    try:
        yield
    finally:
        with _SERVING_LOCK:
            _SERVING.difference_update(ids)


def to_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host values (lists of numbers) as a tensor on ``device`` without a device synchronisation: built on the host,
    then copied with ``non_blocking=True`` (a blocking host-to-device copy waits for the stream on CUDA; from
    pageable memory the asynchronous copy stages the data at once, so the host list may go away)."""
    t = torch.tensor(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)


def check_vocab(name: str, drafter_vocab: int, target_vocab: int) -> None:
    if drafter_vocab != target_vocab:
        raise ValueError(f"{name}: the drafter's vocabulary size ({drafter_vocab}) differs from the target's "
                         f"({target_vocab}); drafter and target must share one tokenizer and vocabulary")


def pad_chains(chains: list[list[int]], roots: list[int], device: torch.device) -> DraftTree:
    """A batch of chains (row b: root then ``chains[b]``) as one tree; shorter rows are padded by repeating their
    last token (safe, see the module doc)."""
    n = 1 + max((len(c) for c in chains), default=0)
    rows = []
    for root, chain in zip(roots, chains):
        row = [root] + list(chain)
        rows.append(row + [row[-1]] * (n - len(row)))
    tokens = to_device(rows, device)
    parents = torch.arange(-1, n - 1, dtype=torch.int64, device=device).expand(len(rows), n).contiguous()
    return DraftTree(tokens, parents, None)

