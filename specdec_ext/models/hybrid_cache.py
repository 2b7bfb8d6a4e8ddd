"""The cache of a hybrid model (attention layers plus linear-attention layers), and the constructor that picks a
model's cache.

:func:`make_cache` returns a :class:`~specdec_ext.models.TreeKVCache` for an attention-only model, a
:class:`HybridCache` for a supported hybrid (:data:`LINEAR_KINDS`: MiniMax's Lightning layers today), and refuses
anything else with a NotImplementedError naming the layer type.

:class:`HybridCache` is a ``TreeKVCache`` (its K/V storage, lengths, ``rewind`` / ``compact`` / ``accept`` /
``keep_rows`` / ``add_rows``, for the attention layers only) plus one recurrent state per linear layer:
``state[B, Llin, H, Dk, Dv]`` in float32 (a state sums the whole context: rounding it to bfloat16 every step would
drift). A state is overwritten in place, so it holds the committed tokens only and never a draft:

* A verification forward (:func:`~specdec_ext.models.tree_forward`, inside :meth:`HybridCache.tree_step`) reads each
  linear layer's state and records the tree nodes' keys and values (``[B, Llin, H, N, D]``, like the attention
  layers' K/V at ``prefix + j``); no per-node state is kept (:func:`specdec_ext.ops.reference.tree_linear_attention`).
* :meth:`compact` (so :meth:`accept`) moves the accepted path's K/V as before and advances every linear layer's state
  along the same nodes in one :func:`~specdec_ext.ops.reference.commit_linear_state` call (all layers as more
  heads); rows accept different lengths.
* :meth:`rewind` to more tokens than committed commits the first nodes of the last forward when they are a chain
  (a prefill's or :func:`~specdec_ext.models.extend`'s tokens, rows of different lengths); a state cannot go back,
  so rewinding below the committed length is a ValueError, as is ``crop``.
* Rows joining and leaving (``add_rows`` / ``keep_rows`` / ``reset``) carry the states with the K/V rows.

An ordinary forward (``model(ids, cache=cache)``) is refused by the linear layers: their states advance by commits
only. The linear layers' forward over a tree lives in :mod:`~specdec_ext.models.linear_layers`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from specdec_ext.models.config import row_tensor, text_config
from specdec_ext.models.kv_cache import TreeKVCache, keep_batch_rows
from specdec_ext.ops import reference as ref

__all__ = ["HybridCache", "LINEAR_KINDS", "LinearKind", "LinearStateLayer", "linear_layer_kinds", "make_cache"]

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class LinearKind(NamedTuple):
    """A supported kind of linear layer: its name and, from the model's text config, the per-layer state shape
    ``(heads, key dim, value dim)``; ``check`` refuses configs whose options the tree path does not reproduce."""
    name: str
    state_shape: Callable[[object], tuple[int, int, int]]
    check: Callable[[object], None]


def _minimax_state(cfg) -> tuple[int, int, int]:
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_attention_heads, D, D


def _minimax_check(cfg) -> None:
    # MiniMax applies config.sliding_window to its attention layers without naming them sliding in layer_types,
    # and tree verification does not apply windows
    if getattr(cfg, "sliding_window", None) is not None:
        raise NotImplementedError(f"make_cache: MiniMax with sliding_window = {cfg.sliding_window} is not supported "
                                  "(tree verification does not apply sliding-window masks)")


# (model_type, layer type) -> kind: the hybrids whose linear layers tree verification runs exactly
LINEAR_KINDS: dict[tuple[str, str], LinearKind] = {
    ("minimax", "linear_attention"): LinearKind("Lightning attention (fixed per-head decay)", _minimax_state,
                                                _minimax_check),
}


def linear_layer_kinds(config) -> dict[int, LinearKind]:
    """The model's non-attention layers by layer index with their kinds ({} for an attention-only model). A layer
    type that is neither attention nor in :data:`LINEAR_KINDS` is a NotImplementedError naming it."""
    cfg = text_config(config)
    model_type = getattr(cfg, "model_type", None)
    kinds, unsupported = {}, set()
    for i, t in enumerate(getattr(cfg, "layer_types", None) or ()):
        if t in ATTENTION_LAYER_TYPES:
            continue
        kind = LINEAR_KINDS.get((model_type, t))
        if kind is None:
            unsupported.add(t)
        else:
            kinds[i] = kind
    if unsupported:
        supported = ", ".join(f"{m} {t!r} ({k.name})" for (m, t), k in LINEAR_KINDS.items())
        raise NotImplementedError(f"make_cache: {model_type!r} layers of type {sorted(unsupported)} are not supported "
                                  f"by tree verification (attention layers and {supported} are)")
    for kind in set(kinds.values()):
        kind.check(cfg)
    return kinds


def make_cache(config, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", capacity: int | None = None) -> TreeKVCache:
    """The cache for a model of ``config`` (arguments as :class:`~specdec_ext.models.TreeKVCache`'s): a
    ``TreeKVCache`` for an attention-only model, a :class:`HybridCache` for a supported hybrid, a
    NotImplementedError naming the layer type for anything else."""
    kinds = linear_layer_kinds(config)
    if not kinds:
        return TreeKVCache(config, batch_size, max_len, dtype=dtype, device=device, capacity=capacity)
    return HybridCache(config, batch_size, max_len, dtype=dtype, device=device, capacity=capacity)


class LinearStateLayer:
    """One linear layer's entry in the cache's layer list: a view of its recurrent state. Not a
    ``CacheLayerMixin``, so transformers' ``Cache`` takes sequence lengths and mask sizes from the attention
    layers."""

    is_compileable = True  # (as TreeKVLayer: transformers then always materialises the attention layers' masks)
    is_croppable = False
    is_sliding = False
    supports_early_init = False
    is_initialized = True

    def __init__(self, cache: "HybridCache", slot: int, layer_idx: int):
        self._cache, self.slot, self.layer_idx = cache, slot, layer_idx

    @property
    def state(self) -> torch.Tensor:
        """``[B, H, Dk, Dv]`` float32: the state after the row's committed tokens."""
        return self._cache._state[:, self.slot]

    @property
    def batch_size(self) -> int:
        return self._cache.batch_size

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(f"HybridCache layer {self.layer_idx}: a recurrent state cannot be cropped")

    def offload(self):
        raise NotImplementedError("HybridCache does not offload")

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("HybridCache does not support beam search reordering")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("HybridCache rows join through add_rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("HybridCache rows leave through keep_rows")


class _Pending(NamedTuple):
    """The last verification forward's tree, for the commit: its nodes' keys and values in every linear layer
    (``[B, Llin, H, Ncap, D]``, nodes ``[0, N)`` meaningful), the layers' decays, dense ancestor mask, depths."""
    keys: torch.Tensor
    values: torch.Tensor
    log_decay: torch.Tensor  # [Llin, H] float32
    mask: torch.Tensor  # [B, N, N] bool
    depth: torch.Tensor  # [B, N] int64
    chain: bool
    num_nodes: int
    recorded: list  # [Llin] bool: which layers' nodes the forward recorded


class HybridCache(TreeKVCache):
    """K/V of the attention layers plus the linear layers' recurrent states (see the module doc). Arguments as
    :class:`~specdec_ext.models.TreeKVCache`'s; the model must have linear layers of :data:`LINEAR_KINDS` (use
    :func:`make_cache` to pick the cache for any model)."""

    def __init__(self, config, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", capacity: int | None = None):
        kinds = linear_layer_kinds(config)
        if not kinds:
            raise ValueError("HybridCache: the model has no linear-attention layers (use TreeKVCache or make_cache)")
        cfg = text_config(config)
        shapes = {kind.state_shape(cfg) for kind in kinds.values()}
        if len(shapes) != 1:
            raise NotImplementedError(f"HybridCache: linear layers with different state shapes {sorted(shapes)}")
        (H, Dk, Dv), = shapes
        self.linear_layers = sorted(kinds)  # model layer indices, in state-slot order
        layers = {l: LinearStateLayer(self, s, l) for s, l in enumerate(self.linear_layers)}
        super().__init__(config, batch_size, max_len, dtype=dtype, device=device, capacity=capacity,
                         other_layers=layers)
        self._linear_slot = {l: s for s, l in enumerate(self.linear_layers)}
        self._all_state = torch.zeros(self.capacity, len(self.linear_layers), H, Dk, Dv, dtype=torch.float32,
                                      device=device)
        self._all_state_lengths = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self._state = self._all_state.narrow(0, 0, batch_size)
        self._state_lengths = self._all_state_lengths.narrow(0, 0, batch_size)
        self._pending: _Pending | None = None
        self._node_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._open = False  # inside tree_step: the linear layers may run

    # -- state -------------------------------------------------------------------------------------------------

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` int64: committed tokens per row (a copy; the attention layers' lengths outside a forward)."""
        return self._state_lengths.clone()

    def linear_state(self, layer_idx: int) -> torch.Tensor:
        """``[B, H, Dk, Dv]`` float32: model layer ``layer_idx``'s state after each row's committed tokens."""
        return self._state[:, self._slot(layer_idx)]

    def _slot(self, layer_idx: int) -> int:
        slot = self._linear_slot.get(layer_idx)
        if slot is None:
            raise ValueError(f"HybridCache: layer {layer_idx} is not one of the linear layers {self.linear_layers}")
        return slot

    def _view_rows(self, n: int) -> None:
        super()._view_rows(n)
        self._state = self._all_state.narrow(0, 0, n)
        self._state_lengths = self._all_state_lengths.narrow(0, 0, n)
        self._pending = None

    # -- the verification forward ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def tree_step(self, prefix_lens: torch.Tensor, tree_mask: torch.Tensor, num_nodes: int, chain: bool,
                  validate: bool = True):
        """Within this block the linear layers run over a tree of ``num_nodes`` nodes per row rooted right after
        ``prefix_lens`` (``[B]``, which must be the committed lengths: the states hold exactly those tokens),
        ``tree_mask`` its ancestor-or-self mask (dense or packed; ``chain``: a chain, which long prefills run in
        chunks). The nodes' keys and values stay recorded for :meth:`compact` / :meth:`rewind`."""
        B, N = self.batch_size, num_nodes
        at_state = (prefix_lens.to(self.device) == self._state_lengths).all()
        if validate or self.device.type == "cpu":
            if not bool(at_state):
                raise ValueError(f"HybridCache: a tree must start at the committed lengths "
                                 f"{self._state_lengths.tolist()} (the recurrent states hold exactly those tokens), "
                                 f"got prefix_lens {prefix_lens.tolist()}")
        else:
            torch._assert_async(at_state)
        H, Dk, Dv = self._state.shape[2:]
        Llin = len(self.linear_layers)
        bufs = self._node_buffers  # (reused while the batch and the tree size allow: one allocation, not one a step)
        if bufs is None or bufs[0].shape[0] != B or bufs[0].shape[3] < N:
            bufs = self._node_buffers = (torch.empty(B, Llin, H, N, Dk, dtype=self.dtype, device=self.device),
                                         torch.empty(B, Llin, H, N, Dv, dtype=self.dtype, device=self.device),
                                         torch.zeros(Llin, H, dtype=torch.float32, device=self.device))
        keys, values, log_decay = bufs
        mask = ref.unpack_tree_mask(tree_mask, N)
        depth = mask.sum(-1) - 1
        self._pending = _Pending(keys, values, log_decay, mask, depth, chain, N, [False] * Llin)
        self._open = True
        try:
            yield
        finally:
            self._open = False

    def tree_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
                   log_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """For linear layer ``layer_idx`` inside :meth:`tree_step`: records the nodes' ``keys [B, H, N, Dk]``,
        ``values [B, H, N, Dv]`` and the layer's ``log_decay[H]`` for the commit; returns the layer's saved state
        ``[B, H, Dk, Dv]``, the tree's dense ancestor mask ``[B, N, N]`` and whether the tree is a chain."""
        p = self._pending
        if not self._open or p is None:
            raise ValueError(f"HybridCache: linear layer {layer_idx} ran outside a verification forward; a model "
                             "with linear-attention layers runs through specdec_ext.models.tree_forward / extend "
                             "(its recurrent states advance by commits only)")
        slot = self._slot(layer_idx)
        N = p.num_nodes
        if keys.shape[0] != self.batch_size or keys.shape[2] != N:
            raise ValueError(f"HybridCache layer {layer_idx}: keys {tuple(keys.shape)} are not for [B = "
                             f"{self.batch_size}, H, N = {N}, D] tree nodes")
        p.keys[:, slot, :, :N].copy_(keys)
        p.values[:, slot, :, :N].copy_(values)
        p.log_decay[slot].copy_(log_decay)
        p.recorded[slot] = True
        return self._state[:, slot], p.mask, p.chain

    # -- commits -------------------------------------------------------------------------------------------------

    def _commit(self, path: torch.Tensor, lengths: torch.Tensor, validate: bool) -> None:
        """Advances every linear layer's state along ``path[B, L]`` (nodes of the last forward, root first) for
        ``lengths[B]`` nodes: one commit_linear_state call over all layers (as ``Llin * H`` heads)."""
        p = self._pending
        if not all(p.recorded):
            missing = [l for l, done in zip(self.linear_layers, p.recorded) if not done]
            raise ValueError(f"HybridCache: the last forward did not run linear layers {missing} through the tree "
                             "path (a model not prepared by specdec_ext.models.linear_layers?): nothing to commit")
        B, Llin, H, Dk, Dv = self._state.shape
        Ncap = p.keys.shape[3]
        ref.commit_linear_state(self._state.view(B, Llin * H, Dk, Dv), p.keys.view(B, Llin * H, Ncap, Dk),
                                p.values.view(B, Llin * H, Ncap, Dv), p.log_decay.view(Llin * H), path, lengths,
                                validate=validate)
        self._pending = None  # (its nodes are committed or stale now)

    def compact(self, src_positions: torch.Tensor, dst_start: torch.Tensor | int, lengths: torch.Tensor | int,
                validate: bool = True) -> None:
        """As :meth:`TreeKVCache.compact`, where ``dst_start`` must be the committed lengths and the source
        positions the last forward's nodes (``dst_start[b] + node``): the linear layers' states advance along the
        same nodes (the accepted path)."""
        dst = self._row_tensor(dst_start, "dst_start")
        n = self._row_tensor(lengths, "lengths")
        if self._pending is None:
            if bool((n != 0).any()):
                raise ValueError("HybridCache.compact: no verification forward to commit (its nodes were committed "
                                 "already, or rows joined or left since)")
        else:
            if validate and not torch.equal(dst, self._state_lengths):
                raise ValueError(f"HybridCache.compact: dst_start {dst.tolist()} must be the committed lengths "
                                 f"{self._state_lengths.tolist()} (where the last tree was rooted)")
            if src_positions.dim() != 2 or src_positions.shape[0] != self.batch_size:
                raise ValueError(f"HybridCache.compact: src_positions must have shape [B={self.batch_size}, L], got "
                                 f"{tuple(src_positions.shape)}")
            path = src_positions.to(device=self.device, dtype=torch.int64) - dst[:, None]
            if validate and bool(((path >= self._pending.num_nodes)
                                  & (torch.arange(path.shape[1], device=self.device) < n[:, None])).any()):
                raise ValueError(f"HybridCache.compact: src_positions {src_positions.tolist()} reach past the last "
                                 f"forward's {self._pending.num_nodes} nodes after dst_start {dst.tolist()}")
            self._commit(path, n, validate)
            self._state_lengths.copy_(dst + n)
        super().compact(src_positions, dst, n, validate=validate)

    def rewind(self, lengths: torch.Tensor | int, validate: bool = True) -> None:
        """Sets every row's length: to its committed length (the attention layers' K/V beyond are stale), or past it
        by m tokens, committing the last forward's first m nodes, which must be a chain from the root (a prefill or
        :func:`~specdec_ext.models.extend`). A state cannot forget tokens: a length below the committed one is a
        ValueError."""
        t = self._row_tensor(lengths, "lengths")
        m = t - self._state_lengths
        if bool((m != 0).any()):  # (one host read a call; kernels for the device are a later step)
            if bool((m < 0).any()):
                raise ValueError(f"HybridCache.rewind: lengths {t.tolist()} below the committed lengths "
                                 f"{self._state_lengths.tolist()}: a linear layer's recurrent state cannot go back")
            p = self._pending
            N = 0 if p is None else p.num_nodes
            if bool((m > N).any()):
                raise ValueError(f"HybridCache.rewind: lengths {t.tolist()} reach past the committed lengths "
                                 f"{self._state_lengths.tolist()} plus the last forward's {N} nodes")
            nodes = torch.arange(N, device=self.device)
            last = (m - 1).clamp(min=0)
            if bool(((m > 0) & (p.depth.gather(1, last[:, None])[:, 0] != last)).any()):
                raise ValueError("HybridCache.rewind: the nodes to commit are not a chain from the root (a tree's "
                                 "accepted path commits through accept)")
            self._commit(nodes.expand(self.batch_size, N), m, validate)
            self._state_lengths.copy_(t)
        super().rewind(t, validate=validate)

    # -- rows joining and leaving ----------------------------------------------------------------------------

    def add_rows(self, src: "HybridCache") -> None:
        """As :meth:`TreeKVCache.add_rows`, with ``src``'s committed states (a cache of the same model)."""
        if not isinstance(src, HybridCache) or src.linear_layers != self.linear_layers \
                or src._state.shape[2:] != self._state.shape[2:]:
            raise ValueError(f"HybridCache.add_rows: src must be a HybridCache of the same model (linear layers "
                             f"{self.linear_layers}, states {list(self._state.shape[2:])}), got "
                             f"{type(src).__name__}")
        B, n = self.batch_size, src.batch_size
        if B + n > self._all_state.shape[0]:
            cap = max(B + n, 2 * self._all_state.shape[0])
            grown = torch.zeros(cap, *self._all_state.shape[1:], dtype=torch.float32, device=self.device)
            grown.narrow(0, 0, B).copy_(self._state)
            lengths = torch.zeros(cap, dtype=torch.int64, device=self.device)
            lengths.narrow(0, 0, B).copy_(self._state_lengths)
            self._all_state, self._all_state_lengths = grown, lengths
        super().add_rows(src)  # (checks the K/V layout first, then views B + n rows: states included)
        self._all_state.narrow(0, B, n).copy_(src._state)
        self._all_state_lengths.narrow(0, B, n).copy_(src._state_lengths)

    def keep_rows(self, index: torch.Tensor) -> None:
        """As :meth:`TreeKVCache.keep_rows`, the states moving with their rows."""
        B = self.batch_size
        super().keep_rows(index)  # (checks the index, moves K/V rows, views the first B' rows)
        rows = index.tolist()
        keep_batch_rows(self._all_state.narrow(0, 0, B), rows)
        keep_batch_rows(self._all_state_lengths.narrow(0, 0, B), rows)

    def reset(self) -> None:
        super().reset()  # (every layer: K/V lengths and the states)
        self._state_lengths.zero_()
        self._pending = None

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("HybridCache cannot be cropped: a linear layer's recurrent state cannot forget tokens")

    def _row_tensor(self, value, name: str) -> torch.Tensor:
        return row_tensor(value, self.batch_size, self.device, name, "HybridCache")
