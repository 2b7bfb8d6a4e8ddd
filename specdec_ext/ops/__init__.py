"""Typed wrappers over ``torch.ops.specdec_ext.*``.

Shapes use B = batch rows, N = tree nodes per row (node 0 is the root, the last accepted token), V = vocabulary,
F = frontier nodes, R = rows to sample. Token ids and indices are int64; float inputs may be float32, float16 or
bfloat16 (accumulation is float32). Sampling parameters may be given as Python numbers (applied to every row) or as
``[B]`` tensors. Randomness is an input: pass ``uniforms`` drawn from your own ``torch.Generator``.

With ``validate=True`` (the default) invalid data raises ``ValueError`` naming the argument, row and node; on CUDA
that check reads back one small status tensor (a device synchronisation). ``validate=False`` skips it: kernels stay
memory-safe and give the invalid row sentinel outputs (-1 indices, 0 lengths, false masks) instead.

The executable specification of every op is :mod:`specdec_ext.ops.reference`.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from specdec_ext import _C  # the compiled library: registers torch.ops.specdec_ext, answers packed_linear_path
from specdec_ext.ops import fakes as _fakes  # noqa: F401  (registers the fake implementations)

__all__ = [
    "TreeInfo",
    "Verification",
    "build_tree",
    "tree_ancestor_mask",
    "verify_tree_greedy",
    "verify_tree_sampling",
    "verify_tree_typical",
    "sample_tokens",
    "expand_tree_step",
    "advance_tree_frontier",
    "select_tree_nodes",
    "tree_attention",
    "compact_kv",
    "chain_parents",
    "pack_linear_weight",
    "packed_linear",
    "packed_linear_path",
    "Int8Weight",
    "pack_linear_weight_int8",
    "packed_linear_int8",
    "packed_linear_int8_path",
    "Int4Weight",
    "pack_linear_weight_int4",
    "packed_linear_int4",
    "packed_linear_int4_path",
    "draft_decoder_layer",
]

_ops = torch.ops.specdec_ext


class TreeInfo(NamedTuple):
    depth: torch.Tensor  # [B, N] int64, root 0
    position_ids: torch.Tensor  # [B, N] int64, prefix_lens + depth
    first_child: torch.Tensor  # [B, N] int64, -1 for leaves
    next_sibling: torch.Tensor  # [B, N] int64, -1 for the last child
    retrieve_paths: torch.Tensor  # [B, N, N] int64, root-to-leaf paths padded with -1
    num_leaves: torch.Tensor  # [B] int64


class Int8Weight(NamedTuple):
    packed: torch.Tensor  # [ceil(N / 32), ceil(K / 4), 32, 4] int8: packed[n // 32, k // 4, n % 32, k % 4] = q[n, k]
    scales: torch.Tensor  # [N] float32: weight[n, k] ~ scales[n] * q[n, k]


class Int4Weight(NamedTuple):
    packed: torch.Tensor  # [ceil(N / 32), Kp / 8, 32, 4] uint8, Kp = ceil(K / 32) * 32: two K-quads' nibbles a lane
    group_scales: torch.Tensor  # [ceil(N / 32), Kp / 32, 32] uint8: m[n, g] in [1, 63] (0 for an all-zero row)
    scales: torch.Tensor  # [N] float32: weight[n, k] ~ scales[n] * m[n, k // 32] * q[n, k], q in [-7, 7]


class Verification(NamedTuple):
    accepted: torch.Tensor  # [B, N] int64: accepted path node indices, root first, padded with -1
    accept_len: torch.Tensor  # [B] int64: accepted draft tokens (root excluded)
    next_token: torch.Tensor  # [B] int64: correction or bonus token


def _per_row(op: str, name: str, value, rows: int, dtype: torch.dtype, like: torch.Tensor,
             like_name: str) -> torch.Tensor:
    """A Python number or a [rows] tensor on ``like``'s device, as a contiguous [rows] tensor of ``dtype``.

    Nothing is moved between devices or cast across kinds behind the caller's back: a tensor on another device, a
    float for an integer parameter (``top_k=2.5``, a float ``prefix_lens`` tensor) or an integer outside int64 is a
    ValueError naming the parameter (a non-number is a TypeError)."""
    integer = not dtype.is_floating_point
    if isinstance(value, torch.Tensor):
        if value.device != like.device:
            raise ValueError(f"{op}: {name} is on {value.device} but {like_name} is on {like.device}; all tensors "
                             "must be on one device")
        if integer and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
            raise ValueError(f"{op}: {name} must be an integer tensor, got {value.dtype}")
        if value.dim() == 0:
            return value.to(dtype=dtype).expand(rows).contiguous()
        if value.shape != (rows,):
            raise ValueError(f"{op}: {name} must be a number or a tensor of shape [{rows}], got {tuple(value.shape)}")
        return value.to(dtype=dtype).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number or a tensor, got {type(value).__name__}")
    if integer and not isinstance(value, int):
        raise ValueError(f"{op}: {name} must be an integer, got {value!r}")
    if integer and not -2**63 <= value < 2**63:
        raise ValueError(f"{op}: {name} = {value} does not fit int64")
    return torch.full((rows,), value, dtype=dtype, device=like.device)


def _int(value, name: str) -> int:
    """An integer scalar argument: ints (and integer-like objects such as numpy ints) within int64; a float is a
    ValueError rather than truncated (``top_k=2.7``), a non-number a TypeError."""
    if type(value) is int and -2**63 <= value < 2**63:  # the common case, first: these calls sit in decode loops
        return value
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        if isinstance(value, (float, torch.Tensor)):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if not -2**63 <= v < 2**63:
        raise ValueError(f"{name} = {v} does not fit int64")
    return v


def _rows(t, name: str, dims: int) -> int:
    """Leading size of an op's main tensor, for its per-row parameters (0 when the op will refuse its shape)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t.shape[0] if t.dim() == dims else 0


def chain_parents(batch: int, length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``parents[B, length]`` of a chain (width-1 tree): node i's parent is i - 1."""
    return torch.arange(-1, length - 1, device=device, dtype=torch.int64).expand(batch, length).contiguous()


def build_tree(parents: torch.Tensor, prefix_lens: torch.Tensor | int = 0, validate: bool = True) -> TreeInfo:
    """Tree topology from ``parents[B, N]`` (int64) and ``prefix_lens[B]`` (tokens in the KV cache before the root).

    Returns depth, position ids (prefix_lens + depth), first-child / next-sibling lists, root-to-leaf retrieve
    paths ``[B, N, N]`` (leaves in increasing node order) and leaf counts.
    """
    prefix = _per_row("build_tree", "prefix_lens", prefix_lens, _rows(parents, "parents", 2), torch.int64, parents,
                      "parents")
    return TreeInfo(*_ops.build_tree.default(parents, prefix, validate))


def tree_ancestor_mask(parents: torch.Tensor, packed: bool = False, validate: bool = True) -> torch.Tensor:
    """Ancestor-or-self mask of each tree node: dense bool ``[B, N, N]``, or bit-packed int32 ``[B, N, ceil(N/32)]``
    (bit ``j % 32`` of word ``j // 32``, least significant first; ``.view(torch.uint8)`` gives FlashInfer's
    little-endian packed layout per row)."""
    return _ops.tree_ancestor_mask.default(parents, packed, validate)


def verify_tree_greedy(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       validate: bool = True) -> Verification:
    """Greedy verification of draft trees.

    logits ``[B, N, V]`` (target logits at every node; rows may be strided, the vocabulary must be contiguous),
    tokens ``[B, N]``, parents ``[B, N]``. Follows, from the root, the first child whose token equals the target
    argmax; ``next_token`` is the argmax at the last accepted node.
    """
    return Verification(*_ops.verify_tree_greedy.default(logits, tokens, parents, validate))


def verify_tree_sampling(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                         uniforms: torch.Tensor, draft_probs: torch.Tensor | None = None,
                         temperature: float | torch.Tensor = 1.0, top_k: int | torch.Tensor = 0,
                         top_p: float | torch.Tensor = 1.0, validate: bool = True) -> Verification:
    """Lossless verification by recursive rejection sampling (chains and trees).

    ``draft_probs[B, N, V]`` (float32): row u is the distribution node u's children were drafted from (i.i.d.
    samples, SpecInfer multi-draft); ``None`` for deterministic drafts (e.g. top-k children), where a rejected
    sibling's token is removed from the residual. Temperature, top-k and top-p shape the target distribution inside
    the op (temperature 0 = greedy). ``uniforms[B, N]`` in [0, 1): column c >= 1 decides node c, column 0 draws
    the next token.
    """
    op = "verify_tree_sampling"
    B = _rows(logits, "logits", 3)
    return Verification(*_ops.verify_tree_sampling.default(
        logits, tokens, parents, draft_probs, uniforms,
        _per_row(op, "temperature", temperature, B, torch.float32, logits, "logits"),
        _per_row(op, "top_k", top_k, B, torch.int64, logits, "logits"),
        _per_row(op, "top_p", top_p, B, torch.float32, logits, "logits"), validate))


def verify_tree_typical(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                        uniforms: torch.Tensor, temperature: float | torch.Tensor = 0.7,
                        posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                        validate: bool = True) -> Verification:
    """Medusa typical acceptance. LOSSY: the output does not follow the target distribution exactly.

    A node is acceptable when the target probability of its token at its parent exceeds
    ``min(posterior_threshold, posterior_alpha * exp(-entropy))``; the deepest fully acceptable path wins (ties:
    lowest node index) and ``next_token`` is sampled at its end with ``uniforms[B]``. A probability equal to its
    threshold within float32 rounding (a uniform distribution with ``posterior_alpha = 1``) may go either way.
    """
    B = _rows(logits, "logits", 3)
    temperature = _per_row("verify_tree_typical", "temperature", temperature, B, torch.float32, logits, "logits")
    return Verification(*_ops.verify_tree_typical.default(
        logits, tokens, parents, uniforms, temperature, float(posterior_threshold), float(posterior_alpha), validate))


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                  top_k: int | torch.Tensor = 0, top_p: float | torch.Tensor = 1.0,
                  validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused temperature / top-k / top-p sampling of one token per row of ``logits[R, V]``.

    Returns ``tokens[R]`` (int64) and ``probs[R, V]`` (float32, the filtered distribution each token was drawn
    from: pass it to :func:`verify_tree_sampling` as ``draft_probs``).
    """
    op, R = "sample_tokens", _rows(logits, "logits", 2)
    return _ops.sample_tokens.default(logits, uniforms,
                                      _per_row(op, "temperature", temperature, R, torch.float32, logits, "logits"),
                                      _per_row(op, "top_k", top_k, R, torch.int64, logits, "logits"),
                                      _per_row(op, "top_p", top_p, R, torch.float32, logits, "logits"), validate)


def expand_tree_step(logits: torch.Tensor, parent_scores: torch.Tensor, top_k: int, num_select: int,
                     validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One EAGLE-2 dynamic-tree expansion step over a frontier of F nodes.

    ``logits[B, F, V]`` are the drafter's logits at the frontier, ``parent_scores[B, F]`` (float32) their cumulative
    log-probabilities. Returns ``cand_tokens[B, F, top_k]`` (each node's top_k tokens), ``cand_scores[B, F, top_k]``
    (parent score + log-softmax) and ``selected[B, num_select]``: flat candidate indices ``f * top_k + j`` of the
    best scores, best first. The new frontier's parent is ``selected // top_k``.
    """
    return _ops.expand_tree_step.default(logits, parent_scores, _int(top_k, "top_k"), _int(num_select, "num_select"),
                                         validate)


class Frontier(NamedTuple):
    tokens: torch.Tensor  # [B, S] int64: the new frontier's tokens
    scores: torch.Tensor  # [B, S] float32: their cumulative scores
    parents: torch.Tensor  # [B, S] int64: each node's parent in the previous frontier
    ancestors: torch.Tensor  # [B, S, C] bool: each node's ancestor-or-self table row
    mask: torch.Tensor  # [B, S, L] bool: each node's attention mask over the cache positions


def advance_tree_frontier(cand_tokens: torch.Tensor, cand_scores: torch.Tensor, selected: torch.Tensor,
                          ancestors: torch.Tensor, self_column: int, column: torch.Tensor,
                          validate: bool = True) -> Frontier:
    """The next frontier of an EAGLE-2 tree from :func:`expand_tree_step`'s selection, in one op.

    ``cand_tokens`` / ``cand_scores`` ``[B, F, K]`` (the step's candidates; tokens may already be mapped to target
    ids), ``selected[B, S]`` (flat ``f * K + j``), ``ancestors[B, F, C]`` (bool: which of C table columns, one per
    tree slot plus any fixed ones, hold an ancestor-or-self of frontier node f), ``self_column``: the new node s
    sits in column ``self_column + s``; ``column[B, L]``: the table column of each of L cache positions. Returns the
    new nodes' tokens, scores and parents (``f``), their ancestor rows (the parent's plus their own column), and
    their masks ``mask[b, s, l] = ancestors[b, s, column[b, l]]``. An index out of range raises ValueError with
    ``validate`` (without: that row's outputs are zero / false).
    """
    return Frontier(*_ops.advance_tree_frontier.default(cand_tokens, cand_scores, selected, ancestors,
                                                        _int(self_column, "self_column"), column, validate))


def select_tree_nodes(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, roots: torch.Tensor,
                      num_nodes: int, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The final tree of an EAGLE-2 growth: the ``num_nodes`` best of C candidates, in one op.

    ``tokens[B, C]``, ``scores[B, C]`` (float32), ``parents[B, C]`` (each candidate's parent candidate, -1 for the
    root's children), ``roots[B]``. Keeps the ``M = min(num_nodes, C)`` highest scores (ties: the lower index; NaN
    ranks last) in candidate order, so that parents come before children, and returns ``tree_tokens[B, M + 1]``
    (the root first) and ``tree_parents[B, M + 1]`` (node indices, -1 for the root). A kept candidate whose parent
    is not a kept earlier candidate raises ValueError with ``validate`` (without: the row is -1 everywhere).
    """
    return _ops.select_tree_nodes.default(tokens, scores, parents, roots, _int(num_nodes, "num_nodes"), validate)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   prefix_lens: torch.Tensor | int, tree_mask: torch.Tensor, scale: float | None = None,
                   validate: bool = True) -> torch.Tensor:
    """Attention of the N nodes of a draft tree over the KV cache, under the tree's ancestor mask.

    ``q[B, H, N, D]``: the tree nodes' queries. ``k_cache`` / ``v_cache`` ``[B, Hkv, S, D]`` (Hugging Face layout;
    rows may be strided, D must be contiguous) hold, per row b, ``prefix_lens[b]`` prefix positions followed by the
    N tree nodes' own keys / values at ``prefix_lens[b] + j`` (so ``prefix_lens[b] + N <= S``). ``tree_mask`` is
    :func:`tree_ancestor_mask`'s output: dense bool ``[B, N, N]`` or packed int32 ``[B, N, ceil(N/32)]``. Node i
    attends to the whole prefix and to the tree nodes j with ``tree_mask[b, i, j]``. Grouped-query attention: query
    head h reads kv head ``h // (H / Hkv)``. D in {64, 80, 96, 128, 256}; q, k, v float32, float16 or bfloat16
    (one dtype; float32 accumulation); ``scale`` defaults to ``1 / sqrt(D)``. Returns ``[B, H, N, D]`` in q's
    dtype. With ``validate`` a prefix length out of range raises ValueError (else that row's output is zero). Scores
    are float32: a query whose scores, scaled or not, (or scaled query entries) reach its range gets an unspecified
    output, inf or NaN, since where each path applies the scale and in what order it sums decide which. A masked key's value
    adds nothing while it is finite; one that is inf or NaN makes the output of the nodes that may not see it
    unspecified (kernels read masked values with weight 0, where 0 x inf is NaN, but not past a row's last visible
    key).
    """
    B = _rows(q, "q", 4)
    if scale is None:  # (an empty head dim: the op's own check refuses it, naming the supported ones)
        scale = q.shape[-1] ** -0.5 if q.dim() >= 1 and q.shape[-1] > 0 else 1.0
    prefix = _per_row("tree_attention", "prefix_lens", prefix_lens, B, torch.int64, q, "q")
    return _ops.tree_attention.default(q, k_cache, v_cache, prefix, tree_mask, float(scale), validate)


def compact_kv(caches, src_positions: torch.Tensor, dst_start: torch.Tensor | int, lengths: torch.Tensor | int,
               seq_dim: int = 2, validate: bool = True) -> None:
    """Moves the accepted path's K/V rows into place, in every cache at once (in place).

    ``caches``: a list of tensors (e.g. every layer's K and V) with one shape, dtype and device, contiguous;
    ``seq_dim`` is the position dimension (2 for the HF layout ``[B, Hkv, S, D]``, 1 for a flat ``[B, S, F]``).
    ``src_positions[B, L]`` (int64), ``dst_start[B]`` and ``lengths[B]`` (numbers or ``[B]`` tensors). For every
    cache, row b and i < lengths[b]: ``cache[b, .., dst_start[b] + i, ..] = old cache[b, .., src_positions[b, i],
    ..]``; all reads of a row happen before its writes, so overlapping ranges are fine. Caches that share memory (one
    tensor twice, overlapping views) are refused: each would be moved twice. With ``validate`` an
    out-of-range length or position raises ValueError (after the valid rows moved; invalid rows stay untouched).
    """
    caches = list(caches)
    B = _rows(src_positions, "src_positions", 2)
    op = "compact_kv"
    _ops.compact_kv.default(caches, src_positions,
                            _per_row(op, "dst_start", dst_start, B, torch.int64, src_positions, "src_positions"),
                            _per_row(op, "lengths", lengths, B, torch.int64, src_positions, "src_positions"),
                            _int(seq_dim, "seq_dim"), validate)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight[N, K]`` (an ``nn.Linear`` weight: out_features N, in_features K; float32, float16 or bfloat16) laid
    out once for :func:`packed_linear`: ``[ceil(N / 32), ceil(K / P), 32, P]`` with P = 1 for float32 and 2 for
    16-bit types, ``packed[n // 32, k // P, n % 32, k % P] = weight[n, k]``. Same dtype and device. The padding rows
    of the last panel hold a marker value that records N, so :func:`packed_linear` refuses an ``out_features`` the
    weight does not hold (checked for CPU tensors; a CUDA one is not read back)."""
    return _ops.pack_linear_weight.default(weight)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``packed_weight = pack_linear_weight(weight)``: ``x[..., K]`` ->
    ``[..., out_features]``, in x's dtype (the weight's and bias's too).

    Every output element is one float32 accumulation over k in order, plus the bias, rounded once to the dtype, so
    a row's result does not depend on the other rows of the call: one token and a tree of tokens through the same
    layer give the same bits for the same row (aten's products change summation order with the row count). Made
    for the 1-16-row products of decoding and verification on CPUs (see :func:`packed_linear_path`); no autograd.
    """
    return _ops.packed_linear.default(x, packed_weight, bias, _int(out_features, "out_features"))


def draft_decoder_layer(x: torch.Tensor, residual: torch.Tensor, qkv_weight: torch.Tensor, o_weight: torch.Tensor,
                        norm_weight: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                        position_ids: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, write_slots: torch.Tensor, mask: torch.Tensor, num_heads: int,
                        intermediate_size: int, eps: float, qkv_bias: torch.Tensor | None = None,
                        input_norm_weight: torch.Tensor | None = None, input_norm_segments: int = 1,
                        qkv_scales: torch.Tensor | None = None, o_scales: torch.Tensor | None = None,
                        gate_up_scales: torch.Tensor | None = None, down_scales: torch.Tensor | None = None,
                        qkv_group_scales: torch.Tensor | None = None, o_group_scales: torch.Tensor | None = None,
                        gate_up_group_scales: torch.Tensor | None = None,
                        down_group_scales: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """One Llama decoder layer of a drafter (EAGLE) over T new positions per row, with its own KV cache.

    ``x[B, T, Din]``: the attention's input; ``residual[B, T, H]``: the residual stream it is added to (EAGLE-1:
    ``x`` itself; EAGLE-3: the hidden state, with ``x = cat(embeddings, hidden)`` and ``input_norm_weight =
    cat(input_layernorm, hidden_norm)`` over ``input_norm_segments = 2``: each segment RMS-normalised on its own).
    Weights are :func:`pack_linear_weight`'s output: ``qkv_weight`` of ``cat(q, k, v)`` ``[(num_heads + 2 nKV) D,
    Din]`` (with ``qkv_bias``), ``o_weight [H, num_heads D]``, ``gate_up_weight`` of ``cat(gate, up)`` ``[2 I,
    H]``, ``down_weight [H, I]``; ``norm_weight [H]`` the post-attention RMSNorm (``eps``). A weight given with
    its scales (``qkv_scales [(num_heads + 2 nKV) D]``, ``o_scales [H]``, ``gate_up_scales [2 I]``, ``down_scales
    [H]``) is :func:`pack_linear_weight_int8`'s output instead, and that product is :func:`packed_linear_int8`'s;
    given with its scales and group scales (``*_group_scales``), :func:`pack_linear_weight_int4`'s, the product
    :func:`packed_linear_int4`'s (its in_features a multiple of 32). A quantised draft: each weight float, int8 or
    int4 on its own. RoPE (rotate-half) at
    ``position_ids[B, T]`` with ``inv_freq[D / 2]`` (float32). The new keys / values are written into ``k_cache`` /
    ``v_cache`` ``[B, nKV, S, D]`` (contiguous; in place) at ``write_slots[B, T]``; then each position attends to
    the cache slots ``s < kv_len`` with ``mask[b, t, s]`` (bool ``[B, T, kv_len]``; grouped-query: query head h
    reads kv head ``h // (num_heads / nKV)``; scale ``1 / sqrt(D)``; a query that sees nothing gets zeros; a
    masked slot holding inf or NaN leaves the output of the positions that may not see it unspecified, as in
    :func:`tree_attention`).

    Returns ``residual + attention``, then ``+ down(silu(gate) * up)`` of its RMSNorm: ``[B, T, H]`` in x's dtype
    (float32, float16 or bfloat16), rounded to it wherever the module (:class:`specdec_ext.models.eagle.Eagle1Layer`
    / ``Eagle3Layer``) rounds. D in {64, 80, 96, 128, 256}. A write slot outside ``[0, S)`` raises ValueError with
    ``validate`` (without: that row writes nothing and returns zeros). CPU and CUDA; no autograd.
    """
    return _ops.draft_decoder_layer.default(
        x, input_norm_weight, _int(input_norm_segments, "input_norm_segments"), residual, qkv_weight, qkv_bias,
        o_weight, norm_weight, gate_up_weight, down_weight, position_ids, inv_freq, k_cache, v_cache, write_slots,
        mask, _int(num_heads, "num_heads"), _int(intermediate_size, "intermediate_size"), float(eps), qkv_scales,
        o_scales, gate_up_scales, down_scales, qkv_group_scales, o_group_scales, gate_up_group_scales,
        down_group_scales, validate)


def packed_linear_path(dtype: torch.dtype) -> str:
    """The CPU code path :func:`packed_linear` takes for ``dtype`` on this machine: ``"avx512"`` (float32 on a CPU
    with AVX-512), ``"avx512_bf16"`` (bfloat16 with AVX512-BF16) or ``"generic"`` (a portable loop: correct, but no
    faster than aten's products)."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"packed_linear_path: dtype must be float32, bfloat16 or float16, got {dtype}")
    return _C.packed_linear_path(names[dtype])


def pack_linear_weight_int8(weight: torch.Tensor) -> Int8Weight:
    """``weight[N, K]`` (an ``nn.Linear`` weight; float32, float16 or bfloat16, finite, K <= 131072) quantised to
    int8 per output channel, symmetric, and laid out once for :func:`packed_linear_int8`: ``scales[n] =
    max_k |weight[n, k]| / 127`` (float32) and ``q[n, k] = round(weight[n, k] / scales[n])`` in [-127, 127],
    ``packed[n // 32, k // 4, n % 32, k % 4] = q[n, k]`` (zero padding), shape ``[ceil(N / 32), ceil(K / 4), 32,
    4]`` int8, on the weight's device: a quarter of the float32 weight's bytes. Exact definition:
    :func:`specdec_ext.ops.reference.quantize_rows_int8`. A weight holding inf or NaN is a ValueError."""
    packed, scales = _ops.pack_linear_weight_int8.default(weight)
    return Int8Weight(packed, scales)


def packed_linear_int8(x: torch.Tensor, packed_weight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` approximated with ``(packed_weight, scales) = pack_linear_weight_int8(weight)``:
    ``x[..., K]`` -> ``[..., N]`` (N = ``len(scales)``), in x's dtype (float32, float16 or bfloat16; the bias's
    too).

    Each row of x is quantised to int8 the same way (per row, symmetric) and the product is exact integer
    arithmetic, ``y = (sum_k qx[m, k] q[n, k]) * (sx[m] * scales[n]) + bias[n]`` in float32 rounded once to the
    dtype, so every path (CPU vector paths, CUDA, :func:`specdec_ext.ops.reference.packed_linear_int8`) gives the
    same bits and a row's result does not depend on the other rows of the call. Its error against the float product
    is the two quantisations' (about 1% of the output's scale for Gaussian data): for drafters, whose outputs only
    steer acceptance. A row of x holding inf or NaN gives NaN outputs. Made for 1-16 rows (see
    :func:`packed_linear_int8_path`); no autograd."""
    return _ops.packed_linear_int8.default(x, packed_weight, scales, bias)


def packed_linear_int8_path() -> str:
    """The CPU code path :func:`packed_linear_int8` takes on this machine: ``"avx512_vnni"`` (AVX-512 VNNI dot
    products), ``"avx2"`` or ``"generic"`` (a portable loop). All give the same bits."""
    return _C.packed_linear_int8_path()


def pack_linear_weight_int4(weight: torch.Tensor) -> Int4Weight:
    """``weight[N, K]`` (an ``nn.Linear`` weight; float32, float16 or bfloat16, finite, K <= 32768) quantised to
    int4 in groups of 32 inputs and laid out once for :func:`packed_linear_int4`: 4.25 bits a weight, an eighth of
    float32's bytes (half of int8's). Scales in two levels, as llama.cpp's k-quants: ``scales[n] = amax / 441``
    (float32, amax = max_k |weight[n, k]|) and a 6-bit multiplier per group, ``m[n, g] = clamp(ceil(amax_g * 63 /
    amax), 1, 63)``, so that ``q[n, k] = clamp(round(weight[n, k] / (scales[n] m[n, g])), -7, 7)`` (amax_g: the
    group's largest magnitude). Exact definition: :func:`specdec_ext.ops.reference.pack_linear_weight_int4`. A
    weight holding inf or NaN is a ValueError."""
    packed, group_scales, scales = _ops.pack_linear_weight_int4.default(weight)
    return Int4Weight(packed, group_scales, scales)


def packed_linear_int4(x: torch.Tensor, packed_weight: torch.Tensor, group_scales: torch.Tensor,
                       scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` approximated with ``pack_linear_weight_int4(weight)``'s three tensors:
    ``x[..., K]`` -> ``[..., N]`` (N = ``len(scales)``), in x's dtype (float32, float16 or bfloat16; the bias's
    too).

    Each row of x is quantised to int8 as :func:`packed_linear_int8` does, and the product is exact integer
    arithmetic, ``y = (sum_g m[n, g] sum_{k in g} qx[m, k] q[n, k]) * (sx[m] * scales[n]) + bias[n]`` in float32
    rounded once to the dtype, so every path (CPU vector paths, CUDA,
    :func:`specdec_ext.ops.reference.packed_linear_int4`) gives the same bits and a row's result does not depend on
    the other rows of the call. Its error against the float product is the quantisations' (about 9% of the output's
    scale for Gaussian data; int8's is about 1%): for drafters, whose outputs only steer acceptance. A row of x
    holding inf or NaN gives NaN outputs. Made for 1-16 rows (see :func:`packed_linear_int4_path`); no autograd."""
    return _ops.packed_linear_int4.default(x, packed_weight, group_scales, scales, bias)


def packed_linear_int4_path() -> str:
    """The CPU code path :func:`packed_linear_int4` takes on this machine: ``"avx512_vnni"`` (AVX-512 VNNI dot
    products), ``"avx2"`` or ``"generic"`` (a portable loop). All give the same bits."""
    return _C.packed_linear_int4_path()


# ----------------------------------------------------------------------------------------------------------------
# Recurrent layers of hybrid targets over a draft tree (the state-space and linear-attention mixers), and the commits
# that advance their saved states along the accepted path. A chain is a width-1 tree (:func:`chain_parents`).

__all__ += ["tree_linear_attention", "commit_linear_state", "tree_causal_conv1d", "commit_conv_state"]


def tree_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                          log_decay: torch.Tensor, parents: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Outputs of the N tree nodes of a linear-attention layer with a fixed per-head decay (Lightning, Simple GLA),
    in one parallel pass and without a per-node state.

    ``q`` / ``k`` ``[B, H, N, Dk]``, ``v[B, H, N, Dv]`` (one float dtype; rows may be strided, the last dimension
    contiguous), ``state[B, H, Dk, Dv]`` float32 (the saved state after the prefix), ``log_decay[H]`` float32 (the
    log of each head's decay a, finite and <= 0), ``parents[B, N]`` int64 (node 0 the root). With ``d_i`` node i's
    depth: ``o_i = a^(d_i + 1) q_i S + sum_{j ancestor-or-self of i} a^(d_i - d_j) (q_i . k_j) v_j`` (no scale:
    scale q first), i.e. ``q_i`` times the state after the root-to-i path. Returns ``[B, H, N, Dv]`` in q's dtype
    (float32 accumulation). With ``validate`` a malformed tree or decay raises ValueError (else zero outputs)."""
    return _ops.tree_linear_attention.default(q, k, v, state, log_decay, parents, validate)


def commit_linear_state(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                        path: torch.Tensor, lengths: torch.Tensor | int, validate: bool = True) -> None:
    """Advances each row's linear-attention state along its accepted path, in place (the analogue of
    :func:`compact_kv`): with ``n = lengths[b]`` and nodes ``p_t = path[b, t]``, ``state[b] <- a^n state[b] +
    sum_{t < n} a^(n - 1 - t) k[b, :, p_t]^T v[b, :, p_t]``.

    ``state[B, H, Dk, Dv]`` float32 (unit last stride), ``k[B, H, N, Dk]`` / ``v[B, H, N, Dv]`` the tree nodes' keys
    and values, ``log_decay[H]`` float32, ``path[B, L]`` int64 root first (-1 padded), ``lengths[B]`` (a number or a
    ``[B]`` tensor; 0 leaves a row as it is). Several layers commit in one call as more heads (``[B, layers * H,
    ...]`` views). With ``validate`` a length outside [0, L], a path node outside [0, N) or a bad decay raises
    ValueError after the valid rows are committed; invalid rows are left untouched."""
    B = _rows(state, "state", 4)
    return _ops.commit_linear_state.default(
        state, k, v, log_decay, path,
        _per_row("commit_linear_state", "lengths", lengths, B, torch.int64, state, "state"), validate)


def tree_causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       parents: torch.Tensor, activation: str | None = None, validate: bool = True) -> torch.Tensor:
    """A depthwise causal convolution of width K over a draft tree (the short convolutions in front of Gated DeltaNet
    and Mamba-2 mixers): node i's window is its K - 1 nearest ancestors' inputs, then its own, the saved inputs
    above the root.

    ``x[B, C, N]`` (the nodes' inputs, any strides), ``conv_state[B, C, K - 1]`` float32 (the saved inputs before
    the root, oldest first), ``weight[C, K]`` and ``bias[C]`` (or None) of x's dtype, ``parents[B, N]`` int64,
    ``activation`` ``"silu"`` or None. ``out[b, c, i] = act(sum_t weight[c, t] window[t] + bias[c])``; returns
    ``[B, C, N]`` in x's dtype (float32 accumulation). With ``validate`` a malformed tree raises ValueError."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be a str or None, got {type(activation).__name__}")
    return _ops.tree_causal_conv1d.default(x, conv_state, weight, bias, parents, activation, validate)


def commit_conv_state(conv_state: torch.Tensor, x: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor | int,
                      validate: bool = True) -> None:
    """Shifts each row's saved convolution window along its accepted path, in place: ``conv_state[b]`` (``[C, K -
    1]`` float32, oldest first) becomes the last K - 1 of (old window, ``x[b, :, path[b, t]]`` for t < lengths[b]).
    ``x[B, C, N]`` the tree nodes' inputs; ``path`` / ``lengths`` and errors as :func:`commit_linear_state`'s."""
    B = _rows(conv_state, "conv_state", 3)
    return _ops.commit_conv_state.default(
        conv_state, x, path, _per_row("commit_conv_state", "lengths", lengths, B, torch.int64, conv_state,
                                      "conv_state"), validate)


__all__ += ["tree_gated_delta_rule", "commit_gated_delta_state", "tree_selective_state", "commit_selective_state"]


def tree_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, parents: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Outputs of the N tree nodes of a gated delta-rule layer (Gated DeltaNet: Qwen3-Next, Qwen3.5).

    ``q`` / ``k`` ``[B, H, N, Dk]`` (as the layer feeds the rule: l2-normalised, q scaled by ``Dk^-0.5``),
    ``v[B, H, N, Dv]`` (one float dtype, last dimension contiguous), ``g`` (log decay) / ``beta`` ``[B, H, N]``
    float32, ``state[B, H, Dk, Dv]`` float32 (the saved state after the prefix), ``parents[B, N]`` int64. Node i's
    state is one step from its parent's (the root's from ``state``): ``S <- exp(g_i) S``, then ``S <- S + k_i
    (beta_i (v_i - S^T k_i))^T``, and ``o_i = S_i^T q_i``. No per-node state is kept beyond one per tree depth.
    Returns ``[B, H, N, Dv]`` in v's dtype (float32 accumulation). With ``validate`` a malformed tree raises
    ValueError (else zero outputs)."""
    return _ops.tree_gated_delta_rule.default(q, k, v, g, beta, state, parents, validate)


def commit_gated_delta_state(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor | int,
                             validate: bool = True) -> None:
    """Advances each row's delta-rule state through its accepted nodes ``path[b, :lengths[b]]`` (root first), in
    place, from the saved state; tensors as :func:`tree_gated_delta_rule`'s, ``path`` / ``lengths`` and errors as
    :func:`commit_linear_state`'s (several layers at once as more heads)."""
    B = _rows(state, "state", 4)
    return _ops.commit_gated_delta_state.default(
        state, k, v, g, beta, path,
        _per_row("commit_gated_delta_state", "lengths", lengths, B, torch.int64, state, "state"), validate)


def tree_selective_state(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
                         D: torch.Tensor, state: torch.Tensor, parents: torch.Tensor,
                         validate: bool = True) -> torch.Tensor:
    """Outputs of the N tree nodes of a Mamba-2 (SSD) layer's selective state update.

    ``x[B, H, N, P]``, ``Bm`` / ``Cm`` ``[B, H, N, Ds]`` (the groups' B and C per head; x's dtype, last dimension
    contiguous), ``dt[B, H, N]`` float32 (after the softplus), ``A`` / ``D`` ``[H]`` float32, ``state[B, H, P, Ds]``
    float32, ``parents[B, N]`` int64. Node i's state is one step from its parent's: ``S <- exp(dt_i A) S + dt_i x_i
    B_i^T``; ``y_i = S_i C_i + D x_i``. Returns ``[B, H, N, P]`` in x's dtype. Errors as
    :func:`tree_gated_delta_rule`'s."""
    return _ops.tree_selective_state.default(x, dt, A, Bm, Cm, D, state, parents, validate)


def commit_selective_state(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           Bm: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor | int,
                           validate: bool = True) -> None:
    """Advances each row's Mamba-2 state through its accepted nodes, in place; tensors as
    :func:`tree_selective_state`'s, ``path`` / ``lengths`` and errors as :func:`commit_linear_state`'s."""
    B = _rows(state, "state", 4)
    return _ops.commit_selective_state.default(
        state, x, dt, A, Bm, path,
        _per_row("commit_selective_state", "lengths", lengths, B, torch.int64, state, "state"), validate)
