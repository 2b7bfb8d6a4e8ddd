"""A static, preallocated KV cache with per-row lengths, for Hugging Face models (transformers 5.x ``Cache`` API).

Layout. One contiguous tensor ``storage[L, 2, B, Hkv, S, D]`` (L layers; 0 = keys, 1 = values; B rows; S = max_len
positions), allocated once. Layer l's ``keys`` / ``values`` are the views ``storage[l, 0]`` / ``storage[l, 1]``: the
``[B, Hkv, S, D]`` layout transformers' attention functions expect, each view contiguous, so :meth:`compact` moves
every layer's K and V with ONE :func:`specdec_ext.ops.compact_kv` call over the 2L views. Row b holds
``lengths[b]`` committed tokens at positions ``[0, lengths[b])``; entries at and beyond it are stale and simply
overwritten later.

Writes. ``update`` (called by every attention layer) writes the layer's new ``[B, Hkv, q, D]`` keys/values at
positions ``lengths[b] + j`` of each row (``index_copy_`` of whole D-rows into the flattened buffer: ``scatter_``
with an expanded index costs ~10x more, and on CPU in bfloat16 ~100x) and advances that layer's length by q. The
flat index is computed (and bounds-checked) by the first layer of a forward and reused by the others: every layer
starts a forward at the same lengths, which the cache knows without reading them, because only cache-wide methods
(``rewind``, ``compact``, ``keep_rows``, ``reset``, ``crop``) set lengths. Then it returns the FULL buffers, so an
attention function sees positions ``[0, S)`` and must mask: :func:`~specdec_ext.models.tree_forward.tree_forward`
passes the tree metadata (or a 4-D mask), and transformers' own masks for ordinary forwards span all S positions
(``get_mask_sizes`` returns ``(S, 0)``, as HF's ``StaticCache``). Ordinary forwards (``model(ids, cache=cache)``)
need every row at the same length; rows of different lengths go through ``tree_forward`` / ``extend``.

Speculative step. ``tree_forward`` rewinds to the prefix, runs the tree's N nodes (their K/V land at
``prefix_lens[b] + j``) and rewinds again; after verification :meth:`accept` (or :meth:`compact`) moves the accepted
path right after the prefix and sets the lengths.

Rows joining and leaving. The rows are allocated once (``capacity``, default the batch size) and the batch is a
view of the first ``batch_size`` of them. :meth:`keep_rows` drops finished rows in place: surviving rows that must
move to a lower slot are copied there (the engine fills finished rows' slots with the last live rows, so only those
move), and the batch becomes a view of the first B' slots; nothing is reallocated. :meth:`add_rows` appends the rows
of another cache (joining requests' prefill) into the allocated rows after the batch. The engine calls them once
per retirement or join, so a finished row costs nothing in later steps.

Sliding-window layers are stored in full (no ring buffer); per-layer head counts and head dims must be equal.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec_ext import ops
from specdec_ext.models.config import attention_window, row_tensor, text_config


def flat_row_index(batch: int, heads: int, length: int, slots: torch.Tensor) -> torch.Tensor:
    """Indices ``[B * H * T]`` of ``(b, h, slots[b, t])`` in a ``[B, H, S, D]`` buffer viewed as ``[B * H * S, D]``
    (``slots``: int64 ``[B, T]``, in ``[0, S)``), ordered like ``src.reshape(-1, D)`` for ``src[B, H, T, D]``."""
    rows = torch.arange(batch * heads, device=slots.device).view(batch, heads, 1) * length
    return (rows + slots[:, None, :]).reshape(-1)


def copy_rows(buf: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """Rows ``index`` (from :func:`flat_row_index`) of a contiguous ``buf[B, H, S, D]`` viewed as ``[B * H * S, D]``
    take ``src[B, H, T, D]``: one ``index_copy_`` of whole D-rows (``scatter_`` with an index expanded over D costs
    ~10x more on CPU, ~100x in bfloat16). Rows indexed twice hold one of the writes."""
    B, H, S, D = buf.shape
    buf.view(B * H * S, D).index_copy_(0, index, src.to(buf.dtype).reshape(-1, D))


_FEW_MOVES = 8  # row moves done one copy each (more: one gather and one write, fewer calls)


def keep_batch_rows(t: torch.Tensor, rows: list[int], dim: int = 0) -> torch.Tensor:
    """``t``'s batch rows ``rows`` (distinct host ints; ``dim`` is the batch dimension) as rows ``0 .. len(rows) -
    1``, in place: only rows that change slot move, and the result is a view of the first slots. Retiring finished
    rows fills their slots with live rows from the end, so this moves a few rows where ``index_select`` would copy
    (and reallocate) the whole cache. A few moves between disjoint slots (a retirement's) copy each row straight to
    its slot; others are gathered, then written, so overlaps are safe (a second copy of the moved rows)."""
    moves = [(i, r) for i, r in enumerate(rows) if i != r]
    if len(moves) <= _FEW_MOVES and {i for i, _ in moves}.isdisjoint(r for _, r in moves):
        for i, r in moves:
            t.select(dim, i).copy_(t.select(dim, r))
    elif moves:
        dst = torch.tensor([i for i, _ in moves], device=t.device)
        src = torch.tensor([r for _, r in moves], device=t.device)
        t.index_copy_(dim, dst, t.index_select(dim, src))
    return t.narrow(dim, 0, len(rows))


def append_batch_rows(t: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``t``'s rows then ``new``'s (dim 0; the other dims equal), without copying ``t`` where it can (see
    :func:`grow_batch_rows`)."""
    if new.shape[1:] != t.shape[1:] or new.dtype != t.dtype or new.device != t.device:
        raise ValueError(f"append_batch_rows: new rows must be [n, {', '.join(map(str, t.shape[1:]))}] {t.dtype} on "
                         f"{t.device}, got {tuple(new.shape)} {new.dtype} on {new.device}")
    out = _with_room(t, new.shape[0])
    out.narrow(0, t.shape[0], new.shape[0]).copy_(new)
    return out


def grow_batch_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t``'s rows then ``n`` rows of zeros, grown as :func:`append_batch_rows` grows (rows that join with nothing to
    copy yet: zeroed where they lie, not made apart and copied in)."""
    out = _with_room(t, n)
    out.narrow(0, t.shape[0], n).zero_()
    return out


def _with_room(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[B + n, ...]`` whose first B rows are ``t``'s (the last n unset): when ``t`` is the first rows of a contiguous
    buffer with room for n more (what :func:`keep_batch_rows` leaves), a longer view of that buffer; otherwise a
    buffer of twice the rows (at least enough) with ``t`` copied in, so rows joining one or two at a time cost
    amortised O(1) reallocations."""
    B = t.shape[0]
    shape = (B + n, *t.shape[1:])
    room = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    if t.is_contiguous() and room >= math.prod(shape):
        return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape)
    out = t.new_empty((max(B + n, 2 * B), *t.shape[1:])).narrow(0, 0, B + n)
    out.narrow(0, 0, B).copy_(t)
    return out


def write_rows(buf: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """``buf[b, h, slots[b, t]] = src[b, h, t]`` for a contiguous ``buf[B, H, S, D]`` (:func:`copy_rows`). ``slots``
    must lie in ``[0, S)`` (a slot outside lands in another head's rows)."""
    B, H, S, _ = buf.shape
    copy_rows(buf, flat_row_index(B, H, S, slots), src)


class _WriteIndex:
    """The flat write index of the current forward, shared by a cache's layers (see the module doc).

    ``epoch`` advances whenever lengths are set from outside ``update``; ``uniform`` says whether every layer started
    the epoch at the same lengths (False from a single layer's ``crop`` / ``reset`` until ``rewind``, ``compact`` or
    ``reset`` sets every layer alike: meanwhile nothing is shared)."""

    def __init__(self):
        self.epoch, self.uniform, self.key, self.index = 0, True, None, None

    def lengths_set(self, uniform: bool | None) -> None:
        """Lengths were set; ``uniform``: whether they are now equal across layers (None: as equal as before)."""
        self.epoch += 1
        self.key, self.index = None, None
        if uniform is not None:
            self.uniform = uniform


class TreeKVLayer(CacheLayerMixin):
    """One layer of :class:`TreeKVCache`: views into the shared storage and the shared length table."""

    # As HF's StaticLayer: a compileable cache makes transformers always materialise the decoding mask (with
    # q_length == 1 it would otherwise skip the mask and attend to all S positions, stale ones included).
    is_compileable = True
    is_croppable = True
    is_sliding = False  # stored in full; the mask applies any window
    supports_early_init = False  # allocated up front

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, layer_idx: int,
                 write_index: _WriteIndex | None = None):
        super().__init__()
        self.keys, self.values, self.lengths, self.layer_idx = keys, values, lengths, layer_idx
        self._shared = write_index or _WriteIndex()
        self._epoch, self._written = -1, 0  # the epoch this layer last wrote in, and positions written since
        self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim = keys.shape
        self.v_head_dim = values.shape[-1]
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        B, Hkv, S, D = self.keys.shape
        if key_states.shape[0] != B or key_states.shape[1] != Hkv or key_states.shape[3] != D:
            raise ValueError(f"TreeKVCache layer {self.layer_idx}: new keys must have shape [B={B}, Hkv={Hkv}, q, "
                             f"D={D}], got {tuple(key_states.shape)} (batch size or model config differs from the "
                             "cache's)")
        if value_states.shape != key_states.shape:
            raise ValueError(f"TreeKVCache layer {self.layer_idx}: values {tuple(value_states.shape)} and keys "
                             f"{tuple(key_states.shape)} differ")
        q = key_states.shape[2]
        if q:
            idx = self._write_index(q)
            copy_rows(self.keys, idx, key_states)
            copy_rows(self.values, idx, value_states)
            self.lengths.add_(q)
        return self.keys, self.values

    def _write_index(self, q: int) -> torch.Tensor:
        """Flat row indices ``[B * Hkv * q]`` of positions ``lengths[b] + j`` in the ``[B * Hkv * S, D]`` view."""
        shared = self._shared
        if self._epoch != shared.epoch:
            self._epoch, self._written = shared.epoch, 0
        key = (shared.epoch, self._written, q)
        self._written += q
        if shared.uniform and shared.key == key:  # an earlier layer of this forward computed it
            return shared.index
        B, Hkv, S, _ = self.keys.shape
        pos = self.lengths[:, None] + torch.arange(q, device=self.device)  # [B, q]
        # (checked here, once per forward: a position outside [0, S) would land in another head's rows)
        if self.device.type == "cpu":
            if bool(((pos[:, -1] >= S) | (pos[:, 0] < 0)).any()):
                raise ValueError(f"TreeKVCache: writing {q} positions after lengths {self.lengths.tolist()} "
                                 f"overflows max_len = {S} (or starts below 0)")
        else:
            torch._assert_async(((pos[:, -1] < S) & (pos[:, 0] >= 0)).all())
        index = flat_row_index(B, Hkv, S, pos)
        shared.key, shared.index = key, index
        return index

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        lo, hi = int(self.lengths.min()), int(self.lengths.max())
        if lo != hi:
            raise ValueError(f"TreeKVCache: rows have different lengths ({self.lengths.tolist()}); an ordinary forward "
                             "needs equal lengths: use specdec_ext.models.extend / tree_forward instead")
        return lo

    def get_max_length(self) -> int:
        return self.max_cache_len

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise RuntimeError("TreeKVCache can only be cropped by a negative count (tokens to remove); use rewind")
        self.lengths.sub_(abs(tokens_to_remove)).clamp_(min=0)
        self._shared.lengths_set(uniform=False)  # this layer alone (TreeKVCache.crop makes it uniform again)

    def reset(self) -> None:
        self.lengths.zero_()
        self._shared.lengths_set(uniform=False)

    def offload(self):
        raise NotImplementedError("TreeKVCache does not offload")

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TreeKVCache does not support beam search reordering")


class TreeKVCache(Cache):
    """Static KV cache ``[L, 2, B, Hkv, S, D]`` with per-row lengths, ``rewind`` and ``compact`` (see module doc).

    ``config``: the model's config (``model.config``; its text/decoder config is used). ``batch_size`` rows of
    ``max_len`` positions, in ``dtype`` (the model's dtype) on ``device``. ``other_layers``: cache layers for the
    model's non-attention layers by layer index (a hybrid model's, given by
    :class:`~specdec_ext.models.hybrid_cache.HybridCache`); storage ``L`` then counts the attention layers only. Any
    other layer type is refused (NotImplementedError naming it).
    """

    def __init__(self, config, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", capacity: int | None = None, *,
                 other_layers: dict | None = None):
        cfg = text_config(config)
        L = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        Hkv = getattr(cfg, "num_key_value_heads", None) or heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * L
        # other_layers: the cache layers of a hybrid model's non-attention layers, by layer index (a subclass's,
        # e.g. HybridCache's recurrent states); K/V storage is allocated for the attention layers only
        other_layers = other_layers or {}
        unsupported = sorted({t for i, t in enumerate(layer_types)
                              if i not in other_layers and t not in ("full_attention", "sliding_attention")})
        if unsupported:
            raise NotImplementedError(
                f"TreeKVCache holds full/sliding attention layers only, got {unsupported} layers (model_type "
                f"{getattr(cfg, 'model_type', None)!r}); specdec_ext.models.make_cache picks the cache for a model "
                "and names the hybrid layer types it supports")
        kv_layers = [i for i in range(L) if i not in other_layers]
        capacity = batch_size if capacity is None else capacity
        if batch_size < 0 or capacity < max(batch_size, 1) or max_len < 1:
            raise ValueError(f"TreeKVCache: need 0 <= batch_size <= capacity, capacity >= 1 and max_len >= 1, got "
                             f"batch_size {batch_size}, capacity {capacity}, max_len {max_len}")
        # rows allocated once; the batch is a view of the first batch_size of them (see add_rows / keep_rows)
        self._all_storage = torch.zeros(len(kv_layers), 2, capacity, Hkv, max_len, D, dtype=dtype, device=device)
        self._all_lengths = torch.zeros(len(kv_layers), capacity, dtype=torch.int64, device=device)
        self.storage = self._all_storage.narrow(2, 0, batch_size)
        self._lengths = self._all_lengths.narrow(1, 0, batch_size)
        self._write_index = _WriteIndex()
        # the attention layers, in storage order (Cache.layers holds every model layer, by layer index)
        self._kv_layers = [TreeKVLayer(self.storage[s, 0], self.storage[s, 1], self._lengths[s], l, self._write_index)
                           for s, l in enumerate(kv_layers)]
        by_index = {**dict(zip(kv_layers, self._kv_layers)), **other_layers}
        super().__init__(layers=[by_index[i] for i in range(L)])
        self.max_len = max_len
        # The window of the model's sliding-window layers, if any (tree_forward refuses trees that reach past it).
        self.sliding_window = attention_window(config)

    # -- state -------------------------------------------------------------------------------------------------

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` int64: committed tokens per row (a copy)."""
        return self._lengths[0].clone()

    @property
    def batch_size(self) -> int:
        return self.storage.shape[2]

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def kv_views(self) -> list[torch.Tensor]:
        """Every layer's K then V, ``[B, Hkv, S, D]`` each (the list :meth:`compact` hands to ``compact_kv``)."""
        return [self.storage[l, kv] for l in range(self.storage.shape[0]) for kv in (0, 1)]

    def _row_tensor(self, value, name: str) -> torch.Tensor:
        return row_tensor(value, self.batch_size, self.device, name, "TreeKVCache")

    @property
    def capacity(self) -> int:
        """Rows allocated (the batch may grow to this many without reallocating)."""
        return self._all_storage.shape[2]

    def _view_rows(self, n: int) -> None:
        """The batch becomes the first n allocated rows (layers view them; earlier views are stale)."""
        self.storage = self._all_storage.narrow(2, 0, n)
        self._lengths = self._all_lengths.narrow(1, 0, n)
        for s, layer in enumerate(self._kv_layers):
            layer.keys, layer.values, layer.lengths = self.storage[s, 0], self.storage[s, 1], self._lengths[s]
            layer.batch_size = n
        self._write_index.lengths_set(None)

    def add_rows(self, src: "TreeKVCache") -> None:
        """``src``'s rows (a cache of the same model: joining rows' prefill) join as the last rows, with their
        lengths. Its ``max_len`` may be shorter (a prefill's cache need only hold the prompts): its slots are copied
        into the first slots of the allocated rows after the batch, and the rest of those rows is left as it is
        (slots past a row's length are never read before they are written). Past the capacity the storage is
        reallocated (twice as many rows, so that joins cost amortised O(1) reallocations)."""
        if not isinstance(src, TreeKVCache) or src.storage.shape[:2] != self.storage.shape[:2] or (
                src.storage.shape[3] != self.storage.shape[3] or src.storage.shape[5] != self.storage.shape[5]
                or src.max_len > self.max_len):
            raise ValueError(f"TreeKVCache.add_rows: src must be a TreeKVCache of the same model with max_len <= "
                             f"{self.max_len} (storage [L, 2, B, Hkv, S, D] = {list(self.storage.shape[:2])} + [B, "
                             f"{self.storage.shape[3]}, S, {self.storage.shape[5]}]), got "
                             f"{tuple(src.storage.shape) if isinstance(src, TreeKVCache) else type(src).__name__}")
        B, n, S = self.batch_size, src.batch_size, src.max_len
        if B + n > self.capacity:
            grown = torch.zeros(*self._all_storage.shape[:2], max(B + n, 2 * self.capacity),
                                *self._all_storage.shape[3:], dtype=self.dtype, device=self.device)
            grown.narrow(2, 0, B).copy_(self.storage)
            lengths = torch.zeros(self._all_lengths.shape[0], grown.shape[2], dtype=torch.int64, device=self.device)
            lengths.narrow(1, 0, B).copy_(self._lengths)
            self._all_storage, self._all_lengths = grown, lengths
        self._all_storage.narrow(2, B, n).narrow(4, 0, S).copy_(src.storage)
        self._all_lengths.narrow(1, B, n).copy_(src._lengths)
        self._view_rows(B + n)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keeps only the rows ``index`` (int64 ``[B']``, distinct, any order; best a CPU tensor: a device one is
        read back), which become rows ``0 .. B' - 1``. In place: row ``index[i]`` moves to slot i where they differ
        (one gather of those rows, then one write), and the batch dimension becomes a view of the first B' slots.
        Keeping a row where it is costs nothing, so ``[0, 5, 2, 3, 4]`` (the last row fills finished row 1's slot,
        as the decode loop orders it) moves one row; an ``index_select`` would copy and reallocate the whole cache
        (45 ms for a 93 MB cache of 64 rows on a CPU core, more than a decoding step). Layers then view the new
        slots (views taken earlier, e.g. :meth:`kv_views`, are stale)."""
        if not isinstance(index, torch.Tensor) or index.dim() != 1:
            raise ValueError(f"TreeKVCache.keep_rows: index must be a 1-D tensor of row indices, got "
                             f"{tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__}")
        rows = index.tolist()
        B = self.batch_size
        if any(not 0 <= r < B for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"TreeKVCache.keep_rows: rows {rows} must be distinct and in [0, {B})")
        keep_batch_rows(self.storage, rows, dim=2)
        keep_batch_rows(self._lengths, rows, dim=1)
        self._view_rows(len(rows))

    def crop(self, tokens_to_remove: int) -> None:
        uniform = self._write_index.uniform
        super().crop(tokens_to_remove)  # (every layer alike: as uniform as before)
        self._write_index.lengths_set(uniform)

    def reset(self) -> None:
        super().reset()
        self._write_index.lengths_set(True)

    def rewind(self, lengths: torch.Tensor | int, validate: bool = True) -> None:
        """Sets every layer's per-row length to ``lengths`` (number or ``[B]``); entries beyond are stale.
        ``validate=False`` (callers that checked the lengths, or built them in range): no range check."""
        t = self._row_tensor(lengths, "lengths")
        if validate and t.device.type == "cpu" and bool(((t < 0) | (t > self.max_len)).any()):
            raise ValueError(f"TreeKVCache.rewind: lengths {t.tolist()} must be in [0, max_len = {self.max_len}]")
        self._lengths.copy_(t.expand_as(self._lengths))
        self._write_index.lengths_set(True)

    def compact(self, src_positions: torch.Tensor, dst_start: torch.Tensor | int, lengths: torch.Tensor | int,
                validate: bool = True) -> None:
        """For every layer's K and V (one ``ops.compact_kv`` call), row b and i < lengths[b]: position
        ``dst_start[b] + i`` takes the old position ``src_positions[b, i]``; then the row's length is
        ``dst_start[b] + lengths[b]``. ``src_positions[B, L]`` int64."""
        if src_positions.dim() != 2 or src_positions.shape[0] != self.batch_size:
            raise ValueError(f"TreeKVCache.compact: src_positions must have shape [B={self.batch_size}, L], got "
                             f"{tuple(src_positions.shape)}")
        dst = self._row_tensor(dst_start, "dst_start")
        n = self._row_tensor(lengths, "lengths")
        ops.compact_kv(self.kv_views(), src_positions.to(device=self.device, dtype=torch.int64), dst, n, seq_dim=2,
                       validate=validate)
        self._lengths.copy_((dst + n).expand_as(self._lengths))
        self._write_index.lengths_set(True)

    def accept(self, accepted: torch.Tensor, accept_len: torch.Tensor, prefix_lens: torch.Tensor | int,
               validate: bool = True) -> None:
        """After verifying a tree whose root sat at ``prefix_lens``: keeps the accepted path (``accepted[B, N]``
        node indices, root first, -1 padded; ``accept_len[B]`` draft tokens accepted, root excluded), i.e. moves the
        root's and accepted nodes' K/V to ``prefix_lens[b] + i``; the row's length becomes
        ``prefix_lens[b] + accept_len[b] + 1``."""
        prefix = self._row_tensor(prefix_lens, "prefix_lens")
        if accepted.dim() != 2 or accepted.shape[0] != self.batch_size:
            raise ValueError(f"TreeKVCache.accept: accepted must have shape [B={self.batch_size}, N], got "
                             f"{tuple(accepted.shape)}")
        accepted = accepted.to(device=self.device, dtype=torch.int64)
        src = prefix[:, None] + accepted.clamp(min=0)
        self.compact(src, prefix, self._row_tensor(accept_len, "accept_len") + 1, validate=validate)
