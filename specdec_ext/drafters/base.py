"""The drafter protocol: what the engine (:class:`specdec_ext.Engine`, and :func:`~specdec_ext.generate.generate`
through it) asks of a drafter. The state types it hands over live in :mod:`specdec_ext.state`.

One speculative step, for every row b of the batch::

    tree  = drafter.propose(state, max_depth, max_nodes)  # DraftTree: tokens[B, N], parents[B, N], draft_probs
    logits = tree_forward(target, cache, tree.tokens, tree.parents, state.prefix_lens, tables=tree.tables)
    result = verify(logits, tree)                       # accepted path, accept_len, next_token
    drafter.observe(state, tree, result)                # after the state took the emitted tokens

The tree's node 0 is the **root**: the last emitted token of the row, not yet in the target's KV cache
(``tokens[:, 0] == state.last_tokens``). ``parents`` are topologically ordered (parent index < child index).
``draft_probs[B, N, V]`` (float32) is indexed by the parent: row u is the distribution u's children were sampled
from (needed for lossless sampling of *sampled* drafts); ``None`` means deterministic drafts (n-gram, top-k
children, greedy chains), which greedy and lossless verification both accept as they are. A drafter that has
nothing to propose for a row pads: a 1-node tree is a plain decoding step. Rows of one batch share ``N``: a row
whose own tree is smaller pads it with nodes deeper than its own and says so in ``DraftTree.row_depth``, so that
verification ignores them (drafts of any content would be lossless too, but a seeded row's tokens would then
depend on its neighbours). A row's tree depends on the row and on ``max_depth``, never on the other rows.

Hidden states (for Medusa / EAGLE): a drafter lists the indices it needs into the target's ``output_hidden_states``
tuple in ``hidden_state_layers`` (HF convention: 0 = embeddings, i = after decoder layer i, -1 = the last, which for
most HF models is after the final norm). The loop then asks the target for hidden states, and passes them to
:meth:`Drafter.begin` (prefill positions, ``[B, P_max - 1, H]`` each, row b meaningful up to ``prompt_len[b] - 1``)
and :meth:`Drafter.observe` (every tree node, ``[B, N, H]`` each; gather with ``result.accepted``). Dynamic trees
(EAGLE-2) simply return a different ``parents`` each step: the loop derives everything else from it.

Lengths. ``state.lengths[b]`` counts the row's context tokens (prompt + emitted, root included); the target cache
holds ``state.prefix_lens = lengths - 1`` of them.

The target's cache. ``state.target_cache`` is the engine's KV cache of the target (the same object for the
batch's whole life; rows join and leave it before the drafter hears of them), holding ``prefix_lens`` tokens of each
row. A drafter that drafts with the target's own layers (:class:`~specdec_ext.drafters.SelfSpecDrafter`) reads it
and writes scratch K/V at and after ``prefix_lens`` only, which the verification forward overwrites, leaving the
lengths at ``prefix_lens``; other drafters ignore it.

Rows join and leave. The engine (:class:`~specdec_ext.Engine`) runs a changing batch. The first rows of a batch
come through :meth:`Drafter.begin`; rows that join a running batch through :meth:`Drafter.add_rows`, which does for
them what ``begin`` does for its rows (the drafter's prefill over their prompts, with their prefill hidden states)
and appends them after the running rows. Rows that finished or were aborted leave after a step::

    drafter.observe(state, tree, result)                # every row of the step, the finishing ones included
    drafter.retire(keep)                                # keep: int64 [B'], the surviving rows
    # from now on B = B' and row i is the old row keep[i]

``retire(keep)`` must select ``keep`` in every per-row piece of drafter state (caches: one ``index_select`` over the
batch dimension; host lists: ``[lst[i] for i in keep.tolist()]``). ``keep`` is a CPU tensor (host values: reading
it costs no device synchronisation); move it with ``keep.to(device, non_blocking=True)`` for device state. Its
order is the engine's choice: surviving rows keep their slots, and each finished row's slot below B' is taken by a
live row from the end (``[0, 5, 2, 3, 4]`` when row 1 of 6 finished), so that in-place caches move as few rows as
possible. It is called only between steps, never with every row; with no row (an empty ``keep``) when every row
leaves, after which the next rows start a new batch through ``begin``. A drafter only ever sees live rows.

Members the loop and :class:`~specdec_ext.adaptive.AdaptiveDrafter` read (all required, :data:`REQUIRED_MEMBERS`):
``max_nodes`` (largest tree, root included), ``max_depth`` (deepest tree it builds), ``hidden_state_layers``,
``forwards`` (its network's forwards so far; 0 without one), ``defers_prefill`` (whether ``begin`` /
``add_rows`` take ``defer_prefill=True``: skip the prefill forward, and let the first speculative ``propose`` catch
up on the prompts) and ``serves_row_subsets`` (whether its per-row state is its own, so that a wrapper may hand it
some of the batch's rows only — states of those rows alone, :meth:`DecodeState.rows_of` and
:meth:`StepResult.rows_of`, in every call; False for a drafter that drafts over the target's cache, which holds
every row).

One generation at a time. A drafter's caches and counters belong to the generation it serves, so
an engine holds it (:func:`serving`) from its creation to its ``close``, and a second generation that
asks for a busy drafter — from another thread, or from a streamer callback — gets a ``ValueError`` at once instead
of corrupting the first one. Create one drafter per concurrent generation (they may share read-only weights, such
as one draft model or one set of heads). A drafter that wraps another exposes it as ``inner``
(:class:`~specdec_ext.adaptive.AdaptiveDrafter`): the wrapped drafter is held too.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol, runtime_checkable

import torch

from specdec_ext import ops
from specdec_ext.models.config import check_window, text_config
from specdec_ext.models.hybrid_cache import HybridCache
from specdec_ext.models.kv_cache import TreeKVCache
from specdec_ext.state import DecodeState, DraftTree, SamplingParams, StepResult, plain_tree

__all__ = ["DecodeState", "DraftTree", "Drafter", "REQUIRED_MEMBERS", "SamplingParams", "StepResult", "check_drafter",
           "check_vocab", "pad_chains", "pad_trees", "plain_tree", "sample_drafts", "serving",
           "to_device"]


@runtime_checkable
class Drafter(Protocol):
    """A source of draft trees (see the module doc). Every member is required (:func:`check_drafter`).

    ``max_nodes``: the largest tree (root included) :meth:`propose` returns; the engine sizes its cache with it.
    ``max_depth``: the deepest tree it builds. ``hidden_state_layers``: indices into the target's hidden states
    that :meth:`begin` / :meth:`add_rows` / :meth:`observe` need (empty: none, and the target is run without
    ``output_hidden_states``). ``forwards``: its network's forwards so far. ``defers_prefill``: whether
    :meth:`begin` and :meth:`add_rows` honour ``defer_prefill=True``. ``serves_row_subsets``: whether it can serve
    some of the batch's rows only (see the module doc).
    """

    max_nodes: int
    max_depth: int
    hidden_state_layers: tuple[int, ...]
    forwards: int
    defers_prefill: bool
    serves_row_subsets: bool

    def begin(self, target: torch.nn.Module, state: DecodeState,
              prefill_hidden_states: tuple[torch.Tensor, ...] | None = None, *, defer_prefill: bool = False) -> None:
        """A new batch of the rows of ``state``: check compatibility with ``target`` (clear errors), allocate
        caches, run the drafter's prefill over the prompts (``prefill_hidden_states``: ``[B, P_max - 1, H]`` each).
        ``defer_prefill`` (only where ``defers_prefill``): skip that forward; the first speculative
        :meth:`propose` catches up on the prompts."""

    def add_rows(self, target: torch.nn.Module, rows: DecodeState,
                 prefill_hidden_states: tuple[torch.Tensor, ...] | None = None, *, defer_prefill: bool = False) -> None:
        """The rows of ``rows`` (a state of the joining rows alone, with their prefill hidden states) join the
        running batch as its last rows: what :meth:`begin` does for its rows, appended to the per-row state."""

    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        """A tree per row no deeper than ``max_depth`` (drafts past the remaining budget could not be emitted;
        deeper trees are still correct, only wasted work) and of at most ``max_nodes`` nodes, root included
        (``1 <= max_nodes <= self.max_nodes``: the caller's verification budget; 1 is a plain step). A tree
        drafter given fewer nodes than its trees hold builds the best tree of that size it can (for EAGLE-2, a
        chain when the budget is one node per depth), so that a caller can trade acceptance for cost per step.
        No host synchronisation beyond reading ``state``."""

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        """After verification and the state update: roll internal caches back to the accepted prefix."""

    def retire(self, keep: torch.Tensor) -> None:
        """After :meth:`observe`, when some rows left: keep only the rows ``keep`` (CPU int64 ``[B']``, distinct,
        in the engine's order), which become rows ``0 .. B' - 1`` of every later call."""


REQUIRED_MEMBERS = ("max_nodes", "max_depth", "hidden_state_layers", "forwards", "defers_prefill",
                    "serves_row_subsets", "begin", "add_rows", "propose", "observe", "retire")
_METHODS = ("begin", "add_rows", "propose", "observe", "retire")


def check_drafter(name: str, drafter) -> None:
    """A ``ValueError`` naming ``name`` unless ``drafter`` has every member of the protocol (:class:`Drafter`) with
    a ``max_nodes`` >= 1, a ``max_depth`` >= 0 and integer ``hidden_state_layers``."""
    missing = [m for m in REQUIRED_MEMBERS if not hasattr(drafter, m)]
    missing += [m for m in _METHODS if m not in missing and not callable(getattr(drafter, m))]
    if missing:
        hint = (" (to draft with a model, wrap it: DraftModelDrafter(model), or MedusaDrafter / EagleDrafter for "
                "their heads)" if isinstance(drafter, torch.nn.Module) else "")
        raise ValueError(f"{name}: drafter must be a drafter ({', '.join(REQUIRED_MEMBERS)}: the protocol of "
                         f"specdec_ext.drafters.Drafter), got {type(drafter).__name__} without "
                         f"{', '.join(missing)}{hint}")
    for member, low in (("max_nodes", 1), ("max_depth", 0)):
        n = getattr(drafter, member)
        if isinstance(n, bool) or not isinstance(n, int) or n < low:
            raise ValueError(f"{name}: drafter.{member} must be an integer >= {low}, got {n!r}")
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


def sample_drafts(logits: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row from ``logits[B, V]`` under each row's temperature / top-k / top-p, and the
    distributions they were drawn from (float32 ``[B, V]``, for lossless verification); the argmax and None when
    every row is greedy (a greedy row of a mixed batch gets temperature 0, which samples its argmax)."""
    s = state.sampling
    if s.greedy:
        return logits.argmax(-1), None
    return ops.sample_tokens(logits, state.uniforms(logits.shape[0]), s.temperature, s.top_k, s.top_p,
                             validate=False)


def all_unsure(logits: torch.Tensor, tok: torch.Tensor, probs: torch.Tensor | None, threshold: float) -> bool:
    """Whether every row's draft ``tok[B]`` had a probability below ``threshold`` under the draft's own distribution
    (``probs[B, V]`` when sampled; greedy: the softmax maximum of ``logits[B, V]``): a chain's confidence stop, which
    depends on the draft alone (lossless). Reads one value back."""
    if probs is None:
        conf = torch.softmax(logits.float(), -1).amax(-1)
    else:
        conf = probs.gather(1, tok[:, None])[:, 0]
    return bool((conf < threshold).all())


def check_confidence_threshold(owner: str, threshold, tree_width: int) -> float:
    """A chain's confidence stop as a float in [0, 1) (0 = off), or a ValueError naming ``owner``: a number in that
    range, and only for chains (``tree_width = 1``)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold < 1.0:
        raise ValueError(f"{owner}: confidence_threshold must be a number in [0, 1) (0 = off), got {threshold!r}")
    if threshold and tree_width > 1:
        raise ValueError(f"{owner}: confidence_threshold applies to chains (tree_width = 1)")
    return float(threshold)


def own_target_cache(owner: str, target, rows: DecodeState, tree_width: int) -> TreeKVCache:
    """``rows.target_cache``, checked for a drafter that drafts with the target's own layers over it (self-speculation):
    the KV cache of an attention model, a vocabulary of the target's and at least ``tree_width`` ids, a context that
    fits the target's attention window; a ValueError naming ``owner`` otherwise."""
    cache = rows.target_cache
    if not isinstance(cache, TreeKVCache) or isinstance(cache, HybridCache):
        raise ValueError(f"{owner}: needs the target's KV cache (a TreeKVCache of an attention model) in "
                         f"state.target_cache, got {type(cache).__name__}; run it through specdec_ext.Engine or "
                         "generate(), which set it")
    if tree_width > rows.vocab_size:
        raise ValueError(f"{owner}: tree_width = {tree_width} exceeds the vocabulary ({rows.vocab_size})")
    check_window(owner, target.config, rows.max_len - 1)
    if text_config(target.config).vocab_size != rows.vocab_size:
        raise ValueError(f"{owner}: the state's vocabulary differs from the target's")
    return cache


def check_vocab(name: str, drafter_vocab: int, target_vocab: int) -> None:
    if drafter_vocab != target_vocab:
        raise ValueError(f"{name}: the drafter's vocabulary size ({drafter_vocab}) differs from the target's "
                         f"({target_vocab}); drafter and target must share one tokenizer and vocabulary")


def pad_trees(trees: list[tuple[list[int], list[int]]], device: torch.device) -> DraftTree:
    """A batch of host trees (row b: ``(tokens, parents)``, node 0 the root with parent -1, parents earlier than
    children) as one ``DraftTree``. A row with fewer nodes than the largest gets a chain of padding nodes (its last
    token repeated) under its deepest node, so every padding node is deeper than the row's own tree, and
    ``row_depth`` / ``row_nodes`` mark it for verification (which ignores it) and the engine's counts."""
    n = max((len(t) for t, _ in trees), default=1)
    tok_rows, par_rows, depths, sizes = [], [], [], []
    for tokens, parents in trees:
        depth = [0] * len(tokens)
        for i in range(1, len(tokens)):
            depth[i] = depth[parents[i]] + 1
        deepest = max(range(len(tokens)), key=lambda i: (depth[i], -i))
        pad = n - len(tokens)
        tok_rows.append(list(tokens) + [tokens[-1]] * pad)
        par_rows.append(list(parents) + [deepest if j == 0 else len(tokens) + j - 1 for j in range(pad)])
        depths.append(depth[deepest])
        sizes.append(len(tokens))
    tokens_t, parents_t = to_device([tok_rows, par_rows], device)
    return DraftTree(tokens_t, parents_t, None, row_depth=depths, row_nodes=sizes)


def pad_chains(chains: list[list[int]], roots: list[int], device: torch.device) -> DraftTree:
    """A batch of chains (row b: root then ``chains[b]``) as one tree, padded as :func:`pad_trees` pads."""
    return pad_trees([([root, *chain], list(range(-1, len(chain)))) for root, chain in zip(roots, chains)], device)
