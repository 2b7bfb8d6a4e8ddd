"""The cache of a hybrid model (attention layers plus linear-attention layers), and the constructor that picks a
model's cache.

:func:`make_cache` returns a :class:`~specdec_ext.models.TreeKVCache` for an attention-only model, a
:class:`HybridCache` for a supported hybrid (:data:`LINEAR_KINDS`: MiniMax's Lightning layers, the Gated DeltaNet
of Qwen3-Next and Qwen3.5, Bamba's Mamba-2), and refuses anything else with a NotImplementedError naming the layer type.

:class:`HybridCache` is a ``TreeKVCache`` (its K/V storage, lengths, ``rewind`` / ``compact`` / ``accept`` /
``keep_rows`` / ``add_rows``, for the attention layers only) plus the linear layers' states, named by their kind
(:class:`LinearKind`; ``[B, Llin, ...]`` in float32: a state sums the whole context, and rounding it to bfloat16
every step would drift). A state is overwritten in place, so it holds the committed tokens only and never a draft:

* A verification forward (:func:`~specdec_ext.models.tree_forward`, inside :meth:`HybridCache.tree_step`) hands each
  linear layer its states and the tree (:meth:`~HybridCache.tree_layer`), and the layer records what its kind's
  commit needs per node (:meth:`~HybridCache.record`: Lightning's keys and values, like the attention layers' K/V
  at ``prefix + j``; DeltaNet's and Mamba-2's update and convolution inputs). No per-node state is kept.
* :meth:`compact` (so :meth:`accept`) moves the accepted path's K/V as before and advances every linear layer's
  states along the same nodes with the kind's commit, one op call per state over all layers (as more heads); rows
  accept different lengths.
* :meth:`rewind` to more tokens than committed commits the first nodes of the last forward when they are a chain
  (a prefill's or :func:`~specdec_ext.models.extend`'s tokens, rows of different lengths); a state cannot go back,
  so rewinding below the committed length is a ValueError, as is ``crop``.
* Rows joining and leaving (``add_rows`` / ``keep_rows`` / ``reset``) carry the states with the K/V rows.

An ordinary forward (``model(ids, cache=cache)``) is refused by the linear layers: their states advance by commits
only. The linear layers' forwards over a tree live in :mod:`~specdec_ext.models.linear_layers`,
:mod:`~specdec_ext.models.deltanet_layers` and :mod:`~specdec_ext.models.mamba2_layers`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from specdec_ext import ops
from specdec_ext.models.config import row_tensor, text_config
from specdec_ext.models.kv_cache import TreeKVCache, keep_batch_rows
from specdec_ext.ops import reference as ref

__all__ = ["HybridCache", "LINEAR_KINDS", "LinearKind", "LinearStateLayer", "linear_layer_kinds", "make_cache"]

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class LinearKind(NamedTuple):
    """A supported kind of linear layer. ``states(cfg)``: its persistent per-layer states by name, each shape
    (the cache adds ``[B, Llin]`` in front; float32). ``nodes(cfg)``: what its tree forward records for the commit,
    by name: a shape where ``"N"`` marks the node dimension and a leading ``"B"`` the rows (else one value per
    layer). ``commit(states, nodes, path, lengths, validate)`` advances every layer's states along the accepted
    ``path[B, L]`` in one call per state (layers as more heads). ``check`` refuses configs whose options the tree
    path does not reproduce."""
    name: str
    states: Callable[[object], dict[str, tuple[int, ...]]]
    nodes: Callable[[object], dict[str, tuple]]
    commit: Callable[..., None]
    check: Callable[[object], None]


def _minimax_head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _lightning_states(cfg) -> dict:
    D = _minimax_head_dim(cfg)
    return {"state": (cfg.num_attention_heads, D, D)}


def _lightning_nodes(cfg) -> dict:
    H, D = cfg.num_attention_heads, _minimax_head_dim(cfg)
    return {"keys": ("B", H, "N", D), "values": ("B", H, "N", D), "log_decay": (H,)}


def _lightning_commit(states, nodes, path, lengths, validate) -> None:
    ops.commit_linear_state(states["state"].flatten(1, 2), nodes["keys"].flatten(1, 2),
                            nodes["values"].flatten(1, 2), nodes["log_decay"].flatten(), path, lengths,
                            validate=validate)


def _minimax_check(cfg) -> None:
    # MiniMax applies config.sliding_window to its attention layers without naming them sliding in layer_types,
    # and tree verification does not apply windows
    if getattr(cfg, "sliding_window", None) is not None:
        raise NotImplementedError(f"make_cache: MiniMax with sliding_window = {cfg.sliding_window} is not supported "
                                  "(tree verification does not apply sliding-window masks)")


def _deltanet_states(cfg) -> dict:
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = 2 * cfg.linear_num_key_heads * Dk + Hv * Dv
    return {"state": (Hv, Dk, Dv), "conv": (conv, cfg.linear_conv_kernel_dim - 1)}


def _deltanet_nodes(cfg) -> dict:
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = 2 * cfg.linear_num_key_heads * Dk + Hv * Dv
    return {"k": ("B", Hv, "N", Dk), "v": ("B", Hv, "N", Dv), "g": ("B", Hv, "N"), "beta": ("B", Hv, "N"),
            "x": ("B", conv, "N")}


def _deltanet_commit(states, nodes, path, lengths, validate) -> None:
    ops.commit_gated_delta_state(states["state"].flatten(1, 2), nodes["k"].flatten(1, 2), nodes["v"].flatten(1, 2),
                                 nodes["g"].flatten(1, 2), nodes["beta"].flatten(1, 2), path, lengths,
                                 validate=validate)
    ops.commit_conv_state(states["conv"].flatten(1, 2), nodes["x"].flatten(1, 2), path, lengths, validate=validate)


def _deltanet_check(cfg) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"make_cache: Gated DeltaNet with hidden_act {cfg.hidden_act!r} is not supported "
                                  "(its convolution's activation must be silu)")


def _mamba2_sizes(cfg) -> tuple[int, int, int, int]:
    """(heads, head dim, state size, convolution channels) of a Bamba Mamba-2 mixer."""
    inner = int(cfg.mamba_expand * cfg.hidden_size)
    return cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state


def _mamba2_states(cfg) -> dict:
    H, P, Ds, conv = _mamba2_sizes(cfg)
    return {"state": (H, P, Ds), "conv": (conv, cfg.mamba_d_conv - 1)}


def _mamba2_nodes(cfg) -> dict:
    H, P, Ds, conv = _mamba2_sizes(cfg)
    return {"x": ("B", H, "N", P), "dt": ("B", H, "N"), "Bm": ("B", H, "N", Ds), "xbc": ("B", conv, "N"),
            "A": (H,)}


def _mamba2_commit(states, nodes, path, lengths, validate) -> None:
    ops.commit_selective_state(states["state"].flatten(1, 2), nodes["x"].flatten(1, 2), nodes["dt"].flatten(1, 2),
                               nodes["A"].flatten(), nodes["Bm"].flatten(1, 2), path, lengths, validate=validate)
    ops.commit_conv_state(states["conv"].flatten(1, 2), nodes["xbc"].flatten(1, 2), path, lengths, validate=validate)


def _mamba2_check(cfg) -> None:
    limit = tuple(getattr(cfg, "time_step_limit", (0.0, float("inf"))))
    if limit != (0.0, float("inf")) or getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"make_cache: Mamba-2 with time_step_limit {limit} / hidden_act "
                                  f"{cfg.hidden_act!r} is not supported (Hugging Face's own decoding ignores the "
                                  "limit; the convolution's activation must be silu)")


# (model_type, layer type) -> kind: the hybrids whose linear layers tree verification runs exactly
LINEAR_KINDS: dict[tuple[str, str], LinearKind] = {
    ("minimax", "linear_attention"): LinearKind("Lightning attention (fixed per-head decay)", _lightning_states,
                                                _lightning_nodes, _lightning_commit, _minimax_check),
    ("qwen3_next", "linear_attention"): LinearKind("Gated DeltaNet", _deltanet_states, _deltanet_nodes,
                                                   _deltanet_commit, _deltanet_check),
}
LINEAR_KINDS[("qwen3_5_text", "linear_attention")] = LINEAR_KINDS[("qwen3_next", "linear_attention")]  # (same layer)
LINEAR_KINDS[("bamba", "linear_attention")] = LinearKind("Mamba-2", _mamba2_states, _mamba2_nodes, _mamba2_commit,
                                                         _mamba2_check)


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
    """One linear layer's entry in the cache's layer list: views of its states. Not a ``CacheLayerMixin``, so
    transformers' ``Cache`` takes sequence lengths and mask sizes from the attention layers."""

    is_compileable = True  # (as TreeKVLayer: transformers then always materialises the attention layers' masks)
    is_croppable = False
    is_sliding = False
    supports_early_init = False
    is_initialized = True

    def __init__(self, cache: "HybridCache", slot: int, layer_idx: int):
        self._cache, self.slot, self.layer_idx = cache, slot, layer_idx

    @property
    def states(self) -> dict[str, torch.Tensor]:
        """The layer's states after each row's committed tokens, by name (``[B, ...]`` float32 views)."""
        return {name: t[:, self.slot] for name, t in self._cache._states.items()}

    @property
    def batch_size(self) -> int:
        return self._cache.batch_size

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for t in self.states.values():
            t.zero_()

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


class TreeStep(NamedTuple):
    """What a linear layer's tree forward reads (:meth:`HybridCache.tree_layer`): its states ``[B, ...]`` by name,
    the tree's ``parents[B, N]`` and whether it is a chain."""
    states: dict
    parents: torch.Tensor
    chain: bool


class _Pending(NamedTuple):
    """The last verification forward's tree, for the commit: what every linear layer recorded (buffers by name,
    nodes ``[0, N)`` meaningful), parents and depths."""
    nodes: dict
    parents: torch.Tensor  # [B, N] int64
    depth: torch.Tensor  # [B, N] int64
    chain: bool
    num_nodes: int
    recorded: list  # [Llin] bool: which layers' nodes the forward recorded


class HybridCache(TreeKVCache):
    """K/V of the attention layers plus the linear layers' states (see the module doc). Arguments as
    :class:`~specdec_ext.models.TreeKVCache`'s; the model must have linear layers of one kind of
    :data:`LINEAR_KINDS` (use :func:`make_cache` to pick the cache for any model)."""

    def __init__(self, config, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", capacity: int | None = None):
        kinds = linear_layer_kinds(config)
        if not kinds:
            raise ValueError("HybridCache: the model has no linear-attention layers (use TreeKVCache or make_cache)")
        if len(set(kinds.values())) != 1:
            raise NotImplementedError(f"HybridCache: linear layers of several kinds "
                                      f"{sorted({k.name for k in kinds.values()})}")
        self.kind = next(iter(kinds.values()))
        cfg = text_config(config)
        self.linear_layers = sorted(kinds)  # model layer indices, in state-slot order
        layers = {l: LinearStateLayer(self, s, l) for s, l in enumerate(self.linear_layers)}
        super().__init__(config, batch_size, max_len, dtype=dtype, device=device, capacity=capacity,
                         other_layers=layers)
        self._linear_slot = {l: s for s, l in enumerate(self.linear_layers)}
        Llin = len(self.linear_layers)
        self._all_states = {name: torch.zeros(self.capacity, Llin, *shape, dtype=torch.float32, device=device)
                            for name, shape in self.kind.states(cfg).items()}
        self._node_shapes = self.kind.nodes(cfg)
        self._all_state_lengths = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self._view_states(batch_size)
        self._pending: _Pending | None = None
        self._node_buffers: tuple[int, int, dict] | None = None  # (B, Ncap, buffers by name)
        self._open = False  # inside tree_step: the linear layers may run

    # -- state -------------------------------------------------------------------------------------------------

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` int64: committed tokens per row (a copy; the attention layers' lengths outside a forward)."""
        return self._state_lengths.clone()

    def linear_state(self, layer_idx: int, name: str = "state") -> torch.Tensor:
        """Model layer ``layer_idx``'s state ``name`` after each row's committed tokens (``[B, ...]`` float32; the
        recurrent state is ``"state"``, a convolution's saved window ``"conv"``)."""
        return self._states[name][:, self._slot(layer_idx)]

    def _slot(self, layer_idx: int) -> int:
        slot = self._linear_slot.get(layer_idx)
        if slot is None:
            raise ValueError(f"HybridCache: layer {layer_idx} is not one of the linear layers {self.linear_layers}")
        return slot

    def _view_states(self, n: int) -> None:
        self._states = {name: t.narrow(0, 0, n) for name, t in self._all_states.items()}
        self._state_lengths = self._all_state_lengths.narrow(0, 0, n)

    def _view_rows(self, n: int) -> None:
        super()._view_rows(n)
        self._view_states(n)
        self._pending = None

    # -- the verification forward ----------------------------------------------------------------------------

    def _buffers(self, B: int, N: int) -> dict:
        """The node buffers by name (``[B, Llin, ...]`` with the node dimension ``>= N``; reused while the batch and
        the tree size allow: one allocation, not one a step)."""
        held = self._node_buffers
        if held is None or held[0] != B or held[1] < N:
            Llin = len(self.linear_layers)
            bufs = {}
            for name, shape in self._node_shapes.items():
                dims = [N if d == "N" else d for d in shape if d != "B"]
                lead = (B, Llin) if shape[0] == "B" else (Llin,)
                # (float32, as the states: Gated DeltaNet's rule runs in float32 whatever the model's dtype)
                bufs[name] = torch.zeros(*lead, *dims, dtype=torch.float32, device=self.device)
            held = self._node_buffers = (B, N, bufs)
        return held[2]

    @contextlib.contextmanager
    def tree_step(self, tokens: torch.Tensor, prefix_lens: torch.Tensor, tree_mask: torch.Tensor, chain: bool,
                  validate: bool = True):
        """Within this block the linear layers run over a tree of the nodes ``tokens [B, N]`` rooted right after
        ``prefix_lens`` (``[B]``, which must be the committed lengths: the states hold exactly those tokens),
        ``tree_mask`` its ancestor-or-self mask (dense or packed; ``chain``: a chain, which long prefills run in
        chunks). What the layers record stays for :meth:`compact` / :meth:`rewind`. (The token ids themselves are
        for caches that replay them: the benchmark's llama.cpp-style baseline.)"""
        B, N = self.batch_size, tokens.shape[1]
        at_state = (prefix_lens.to(self.device) == self._state_lengths).all()
        if validate or self.device.type == "cpu":
            if not bool(at_state):
                raise ValueError(f"HybridCache: a tree must start at the committed lengths "
                                 f"{self._state_lengths.tolist()} (the recurrent states hold exactly those tokens), "
                                 f"got prefix_lens {prefix_lens.tolist()}")
        else:
            torch._assert_async(at_state)
        nodes = torch.arange(N, device=self.device)
        if chain:  # (a long prefill: no [B, N, N] mask)
            parents, depth = (nodes - 1).expand(B, N), nodes.expand(B, N)
        else:
            mask = ref.unpack_tree_mask(tree_mask, N)
            # a node's parent: the latest earlier node of its ancestor row (-1 for the root)
            parents = torch.where(mask & (nodes[None, :] < nodes[:, None]), nodes, -1).amax(-1)
            depth = mask.sum(-1) - 1
        self._pending = _Pending(self._buffers(B, N), parents, depth, chain, N, [False] * len(self.linear_layers))
        self._open = True
        try:
            yield
        finally:
            self._open = False

    def _open_pending(self, layer_idx: int) -> _Pending:
        p = self._pending
        if not self._open or p is None:
            raise ValueError(f"HybridCache: linear layer {layer_idx} ran outside a verification forward; a model "
                             "with linear-attention layers runs through specdec_ext.models.tree_forward / extend "
                             "(its recurrent states advance by commits only)")
        return p

    def tree_layer(self, layer_idx: int) -> TreeStep:
        """For linear layer ``layer_idx`` inside :meth:`tree_step`: what its tree forward reads."""
        p = self._open_pending(layer_idx)
        slot = self._slot(layer_idx)
        return TreeStep({name: t[:, slot] for name, t in self._states.items()}, p.parents, p.chain)

    def record(self, layer_idx: int, **recorded: torch.Tensor) -> None:
        """For linear layer ``layer_idx`` inside :meth:`tree_step`: keeps what its kind's commit needs, by the names
        of the kind's ``nodes`` (per-node tensors ``[B, ..., N, ...]``, per-layer ones without B or N)."""
        p = self._open_pending(layer_idx)
        slot = self._slot(layer_idx)
        if set(recorded) != set(self._node_shapes):
            raise ValueError(f"HybridCache layer {layer_idx}: records {sorted(self._node_shapes)}, got "
                             f"{sorted(recorded)}")
        N = p.num_nodes
        for name, t in recorded.items():
            shape, buf = self._node_shapes[name], p.nodes[name]
            dst = buf[:, slot] if shape[0] == "B" else buf[slot]
            if "N" in shape:
                axis = [d for d in shape if d != "B"].index("N")
                dst = dst.narrow(axis + (1 if shape[0] == "B" else 0), 0, N)
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"HybridCache layer {layer_idx}: {name} must have shape {tuple(dst.shape)}, got "
                                 f"{tuple(t.shape)}")
            dst.copy_(t)
        p.recorded[slot] = True

    # -- commits -------------------------------------------------------------------------------------------------

    def _commit(self, path: torch.Tensor, lengths: torch.Tensor, validate: bool) -> None:
        """Advances every linear layer's states along ``path[B, L]`` (nodes of the last forward, root first) for
        ``lengths[B]`` nodes: the kind's commit, one op call per state over all layers."""
        p = self._pending
        if not all(p.recorded):
            missing = [l for l, done in zip(self.linear_layers, p.recorded) if not done]
            raise ValueError(f"HybridCache: the last forward did not run linear layers {missing} through the tree "
                             "path (a model not prepared by specdec_ext.models.linear_layers?): nothing to commit")
        self.kind.commit(self._states, p.nodes, path, lengths, validate)
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
        if not isinstance(src, HybridCache) or src.linear_layers != self.linear_layers or src.kind != self.kind \
                or any(src._states[k].shape[1:] != t.shape[1:] for k, t in self._states.items()):
            raise ValueError(f"HybridCache.add_rows: src must be a HybridCache of the same model (linear layers "
                             f"{self.linear_layers} of {self.kind.name}), got {type(src).__name__}")
        B, n = self.batch_size, src.batch_size
        cap = self._all_state_lengths.shape[0]
        if B + n > cap:
            cap = max(B + n, 2 * cap)
            grown = {}
            for name, t in self._all_states.items():
                grown[name] = torch.zeros(cap, *t.shape[1:], dtype=t.dtype, device=self.device)
                grown[name].narrow(0, 0, B).copy_(self._states[name])
            lengths = torch.zeros(cap, dtype=torch.int64, device=self.device)
            lengths.narrow(0, 0, B).copy_(self._state_lengths)
            self._all_states, self._all_state_lengths = grown, lengths
        super().add_rows(src)  # (checks the K/V layout first, then views B + n rows: states included)
        for name, t in self._all_states.items():
            t.narrow(0, B, n).copy_(src._states[name])
        self._all_state_lengths.narrow(0, B, n).copy_(src._state_lengths)

    def keep_rows(self, index: torch.Tensor) -> None:
        """As :meth:`TreeKVCache.keep_rows`, the states moving with their rows."""
        B = self.batch_size
        super().keep_rows(index)  # (checks the index, moves K/V rows, views the first B' rows)
        rows = index.tolist()
        for t in self._all_states.values():
            keep_batch_rows(t.narrow(0, 0, B), rows)
        keep_batch_rows(self._all_state_lengths.narrow(0, 0, B), rows)

    def reset(self) -> None:
        super().reset()  # (every layer: K/V lengths and the states)
        self._state_lengths.zero_()
        self._pending = None

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("HybridCache cannot be cropped: a linear layer's recurrent state cannot forget tokens")

    def _row_tensor(self, value, name: str) -> torch.Tensor:
        return row_tensor(value, self.batch_size, self.device, name, "HybridCache")
