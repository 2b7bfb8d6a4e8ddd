"""How other engines keep a hybrid target's recurrent states through speculation, as caches the engine can run: the
honest baselines of the hybrid benchmark (:mod:`specdec_ext.bench.hybrid`).

A linear layer's state is overwritten in place, so a rejected draft corrupts it. This library's
:class:`~specdec_ext.models.HybridCache` keeps no per-node state: the verification forward records each node's
inputs (Lightning: its key and value) and the commit advances the state along the accepted path only. The other
engines (``../shared/docs/anchors_2026.md``, section 1) verify chains and either

* :class:`SnapshotCache` (vLLM): write the state after every draft position during the verification forward into
  per-sequence snapshot slots, then keep the accepted position's snapshot. Persistent memory: one state per draft
  position per sequence; bandwidth: the chain's states written every step.
* :class:`ReplayCache` (llama.cpp, TRT-LLM): checkpoint the state before verifying, advance it along the whole
  chain, and when a draft is rejected restore the checkpoint and run the accepted tokens through the target again
  (an extra forward pass). Persistent memory: one checkpoint per sequence.

Both are :class:`~specdec_ext.models.HybridCache` subclasses that change only the state bookkeeping; the attention
layers' K/V, the model's forward and the outputs are the library's, so a table of the three measures the bookkeeping
and nothing else. They support Lightning layers (MiniMax) and chains (neither engine verifies a Lightning tree);
a tree is a ValueError. Every cache here (and :class:`TimedHybridCache`, the library's own) times its bookkeeping
in ``bookkeeping_s``.
"""

from __future__ import annotations

import contextlib
import time

import torch

from specdec_ext.models.hybrid_cache import HybridCache
from specdec_ext.models.step_ops import build_step_ops
from specdec_ext.models.tree_forward import extend

__all__ = ["BASELINE_CACHES", "ReplayCache", "SnapshotCache", "TimedHybridCache", "state_bytes_per_row"]


def state_bytes_per_row(cache: HybridCache) -> int:
    """Bytes of recurrent state one sequence keeps in ``cache`` (every linear layer's states)."""
    return sum(t[0].numel() * t.element_size() for t in cache._all_states.values())


class TimedHybridCache(HybridCache):
    """The library's :class:`~specdec_ext.models.HybridCache` with its state bookkeeping timed: recording the
    nodes' inputs in the forward and the commit (``bookkeeping_s``, seconds since construction)."""

    snapshot_positions = 0  # per-sequence states kept besides the committed one (module doc)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bookkeeping_s = 0.0
        self._timing = 0  # (nesting depth: a replay's own commits count once)

    @contextlib.contextmanager
    def _timed(self):
        t0 = time.perf_counter()
        self._timing += 1
        try:
            yield
        finally:
            self._timing -= 1
            if not self._timing:
                self.bookkeeping_s += time.perf_counter() - t0

    def record(self, layer_idx: int, **recorded: torch.Tensor) -> None:
        with self._timed():
            super().record(layer_idx, **recorded)

    def _commit(self, path: torch.Tensor, lengths: torch.Tensor, validate: bool) -> None:
        with self._timed():
            super()._commit(path, lengths, validate)

    def persistent_state_bytes_per_row(self) -> int:
        """The committed states plus whatever else a sequence keeps between steps."""
        return state_bytes_per_row(self) * (1 + self.snapshot_positions)


def _lightning_only(cache: HybridCache, who: str) -> None:
    if set(cache._states) != {"state"} or "keys" not in cache._node_shapes:
        raise NotImplementedError(f"{who}: Lightning layers (MiniMax) only, got {cache.kind.name}")


def _require_chain(cache: HybridCache, who: str) -> None:
    """Refuses a verification tree that is not a chain (neither engine verifies a Lightning tree)."""
    p = cache._pending
    if p.num_nodes > 1 and not p.chain and not bool((p.parents == torch.arange(-1, p.num_nodes - 1,
                                                                              device=p.parents.device)).all()):
        raise ValueError(f"{who}: chains only (that engine verifies a chain of drafts on hybrid targets)")


def _rows_at_least(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """``buffer``, or a zeroed one with ``rows`` rows when it has fewer (rows joined past the capacity)."""
    if buffer.shape[0] >= rows:
        return buffer
    return torch.zeros(rows, *buffer.shape[1:], dtype=buffer.dtype, device=buffer.device)


class SnapshotCache(TimedHybridCache):
    """vLLM's way (module doc): during a verification forward of at most ``positions`` nodes (the verified chain:
    root + drafts), each linear layer writes the state after every chain position into the sequence's snapshot
    slots; the commit copies the accepted position's snapshot into the state. Longer chains (prefills) commit as the
    library does: vLLM's prefill also writes the final state only."""

    def __init__(self, *args, positions: int = 8, **kwargs):
        super().__init__(*args, **kwargs)
        _lightning_only(self, "SnapshotCache")
        if positions < 1:
            raise ValueError(f"SnapshotCache: positions must be >= 1, got {positions}")
        self.snapshot_positions = positions
        S = self._all_states["state"]
        self._all_snapshots = torch.zeros(S.shape[0], S.shape[1], positions, *S.shape[2:], dtype=S.dtype,
                                          device=S.device)
        self._snapshotting = False

    @contextlib.contextmanager
    def tree_step(self, tokens, prefix_lens, tree_mask, chain, validate=True):
        with super().tree_step(tokens, prefix_lens, tree_mask, chain, validate):
            self._snapshotting = tokens.shape[1] <= self.snapshot_positions
            if self._snapshotting:
                _require_chain(self, "SnapshotCache")
            yield

    def record(self, layer_idx: int, **recorded: torch.Tensor) -> None:
        super().record(layer_idx, **recorded)
        if not self._snapshotting:
            return
        with self._timed():  # S_j = a^(j+1) S_0 + sum_{i <= j} a^(j - i) k_i^T v_i, every j written out
            slot = self._slot(layer_idx)
            k, v, log_decay = recorded["keys"].float(), recorded["values"].float(), recorded["log_decay"]
            N = k.shape[2]
            j = torch.arange(N, device=k.device, dtype=torch.float32)
            gap = j[:, None] - j[None, :]
            weights = torch.where(gap >= 0, torch.exp(log_decay[:, None, None] * gap.clamp(min=0)),
                                  torch.zeros((), device=k.device))  # [H, N, N]
            decayed = torch.exp(log_decay[:, None] * (j[None, :] + 1))  # [H, N]
            kv = torch.einsum("bhnd,bhne->bhnde", k, v)
            snaps = torch.einsum("hji,bhide->bjhde", weights, kv)
            snaps += decayed.t()[None, :, :, None, None] * self._states["state"][:, slot, None]
            self._all_snapshots = _rows_at_least(self._all_snapshots, self.batch_size)
            self._all_snapshots[: self.batch_size, slot, :N].copy_(snaps)

    def _commit(self, path: torch.Tensor, lengths: torch.Tensor, validate: bool) -> None:
        if not self._snapshotting:
            return super()._commit(path, lengths, validate)
        with self._timed():  # the accepted position's snapshot becomes the state (rows accepting 0 keep theirs)
            B = self.batch_size
            pick = (lengths - 1).clamp(min=0).view(B, 1, 1, 1, 1, 1)
            snaps = self._all_snapshots[:B]
            chosen = snaps.gather(2, pick.expand(B, snaps.shape[1], 1, *snaps.shape[3:])).squeeze(2)
            state = self._states["state"]
            state.copy_(torch.where((lengths > 0).view(B, 1, 1, 1, 1), chosen, state))
            self._pending = None
            self._snapshotting = False


class ReplayCache(TimedHybridCache):
    """llama.cpp's way (module doc): a verification forward of at most ``positions`` nodes checkpoints the states
    first; the commit advances them along the whole chain, and when a row accepted fewer nodes than were verified,
    restores the checkpoint and runs the accepted tokens through ``model`` again (:func:`extend`: every layer, K/V
    rewritten; every row when one rejected: llama.cpp replays a batch together). The verified tokens are the ones
    the verification forward hands :meth:`tree_step`."""

    snapshot_positions = 1  # the checkpoint

    def __init__(self, *args, model=None, positions: int = 8, **kwargs):
        super().__init__(*args, **kwargs)
        _lightning_only(self, "ReplayCache")
        if model is None:
            raise ValueError("ReplayCache: model (the target whose forward replays accepted tokens) is required")
        self.model, self.verify_nodes = model, positions
        self._checkpoint = torch.zeros_like(self._all_states["state"])
        self._verifying = False
        self._replaying = False
        self._tokens: torch.Tensor | None = None
        self._ops: list | None = None
        self.replays = 0

    def _step_ops(self):
        """The target's direct-call route over this cache, as the engine's verification forwards use it (None:
        the modules), built at the first replay."""
        if self._ops is None:
            with torch.no_grad():
                self._ops = [build_step_ops(self.model, self)]
        return self._ops[0]

    @contextlib.contextmanager
    def tree_step(self, tokens, prefix_lens, tree_mask, chain, validate=True):
        with super().tree_step(tokens, prefix_lens, tree_mask, chain, validate):
            self._verifying = not self._replaying and tokens.shape[1] <= self.verify_nodes
            if self._verifying:
                self._tokens = tokens
                _require_chain(self, "ReplayCache")
                with self._timed():
                    self._checkpoint = _rows_at_least(self._checkpoint, self.batch_size)
                    self._checkpoint[: self.batch_size].copy_(self._states["state"])
            yield

    def compact(self, src_positions, dst_start, lengths, validate: bool = True) -> None:
        if not self._verifying:
            return super().compact(src_positions, dst_start, lengths, validate)
        self._verifying = False
        N = self._pending.num_nodes
        n = self._row_tensor(lengths, "lengths")
        if bool((n == N).all()):  # every draft accepted: the state advanced along the chain is the right one
            return super().compact(src_positions, dst_start, n, validate)
        tokens = self._tokens[:, : int(n.max())]  # (the accepted tokens, rows right-padded)
        with self._timed():
            # the verification forward's decode advanced the states along the whole chain (as llama.cpp's does)...
            full = torch.arange(N, device=self.device).expand(self.batch_size, N)
            super()._commit(full, torch.full_like(n, N), validate)
            # ...so restore the checkpoint and replay the accepted tokens through the model
            self._states["state"].copy_(self._checkpoint[: self.batch_size])
            self._pending = None
            self._replaying = True
            try:
                extend(self.model, self, tokens, n, step_ops=self._step_ops())
            finally:
                self._replaying = False
            self.replays += 1


# benchmark method suffix -> the cache class that keeps the states that way
BASELINE_CACHES = {"snapshots": SnapshotCache, "replay": ReplayCache}
