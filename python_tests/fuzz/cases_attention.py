"""Fuzz specs of the attention-side ops: tree_attention, compact_kv, draft_decoder_layer."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from fuzz.compare import close
from fuzz.spec import FLOAT_DTYPES, Arg, OpSpec, dim, dtype_of, to_cpu
from helpers import make_gen, per_row, random_parents
from specdec_ext import ops
from specdec_ext.ops import reference as ref
from test_tree_attention import ATOL as ATTENTION_ATOL  # |ours - ref_f32| <= 2 |ref_lowp - ref_f32| + ATOL

R = torch.ops.specdec_ext
SEED = st.integers(0, 2**31 - 1)
# draft_decoder_layer (test_draft_decoder_layer's _assert_matches_reference): output atol per unit of scale, cache atol
LAYER_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
CACHE_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# ... plus float32 roundings of the product's terms: k and v are sums over the normed input whose order differs from
# the reference's (which sums in float64), so the error scales with sum |a_i w_i|, not with the value, which may
# cancel to far less than its terms; and RoPE's x1 cos - x2 sin is bounded by the pair's length (|(x1, x2)|, which
# the rotation keeps). The test's inputs keep |k| < 2, where the atol covers this.
CACHE_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# tree_attention: float32 roundings of the largest score allowed in the output, per unit of |v| (_compare_attention),
# and the score bound past which a query's output is unspecified (a margin under float32's largest value)
SCORE_ULPS = 2
OVERFLOW = torch.finfo(torch.float32).max / 4


def _pack_mask(dense: torch.Tensor) -> torch.Tensor:
    """Bit-packed int32 words [B, N, ceil(N/32)] of a dense bool mask (bit j % 32 of word j // 32)."""
    B, N, _ = dense.shape
    W = (N + 31) // 32
    padded = torch.zeros(B, N, W * 32, dtype=torch.int64)
    padded[..., :N] = dense.to(torch.int64)
    words = (padded.view(B, N, W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# tree_attention --------------------------------------------------------------------------------------------------


def _attention_case(r) -> dict:
    g = make_gen(r["seed"])
    B, N, D = r["B"], r["N"], r["D"]
    H, Hkv = r["heads"]
    S = r["prefix"] + N + r["extra"]
    dt = dtype_of(r["dtype"])
    if r["mask"] in ("ancestor", "ancestor_packed"):
        dense = ref.tree_ancestor_mask(random_parents(B, N, g, "random"))
    else:
        dense = torch.rand(B, N, N, generator=g) < 0.5
    prefix = r["prefix"] if r["number"] and not r["raw"] else torch.randint(0, r["prefix"] + 1, (B,), generator=g)
    scale = r["scale"] if r["scale"] is not None or not r["raw"] else D**-0.5
    return {"q": torch.randn(B, H, N, D, generator=g).to(dt), "k_cache": torch.randn(B, Hkv, S, D, generator=g).to(dt),
            "v_cache": torch.randn(B, Hkv, S, D, generator=g).to(dt), "prefix_lens": prefix,
            "tree_mask": _pack_mask(dense) if r["mask"].endswith("packed") else dense, "scale": scale}


def _attention_kinds(r) -> dict:
    S = r["prefix"] + r["N"] + r["extra"]
    return {"q": Arg("float"), "k_cache": Arg("float"), "v_cache": Arg("float", alias="k_cache"),
            "prefix_lens": Arg("row_i", (0, S - r["N"], S)),
            "tree_mask": Arg("index" if r["mask"].endswith("packed") else "mask"), "scale": Arg("real")}


def _attention_ref(a, validate, compute_dtype=torch.float32, to_float=False):
    q, k, v = (a[n].float() if to_float else a[n] for n in ("q", "k_cache", "v_cache"))
    scale = a["scale"] if a["scale"] is not None else a["q"].shape[-1] ** -0.5
    return ref.tree_attention(q, k, v, per_row(a["prefix_lens"], a["q"].shape[0], torch.int64), a["tree_mask"],
                              scale, validate, compute_dtype=compute_dtype)


def _compare_attention(got, want, a, rerun, validate=True):
    """Flash-attention's rule (test_tree_attention): the float32 reference on the same rounded inputs, and the
    reference's own error when it computes in the inputs' low precision."""
    dt = a["q"].dtype
    assert got.dtype == want.dtype and got.shape == want.shape, f"output {got.dtype} {tuple(got.shape)}"
    got = got.cpu().float()
    want32 = _attention_ref(a, False, to_float=True)
    ref_err = 0.0
    if dt != torch.float32:
        low = _attention_ref(a, False, compute_dtype=dt).float()
        fin = low.isfinite() & want32.isfinite()
        ref_err = float((low[fin] - want32[fin]).abs().max()) if bool(fin.any()) else 0.0
    # outputs are averages of v: ATOL is for |v| ~ 1 (the test's inputs), fuzzed values may be far larger
    v = a["v_cache"].float()
    v_scale = max(1.0, float(v[v.isfinite()].abs().max())) if bool(v.isfinite().any()) else 1.0
    # a float32 score s is rounded to ~eps |s| (its dot product's order, the exp2 argument s log2 e), which moves
    # the softmax weights by that much relative: with large scores (a fuzzed scale, wide heads) this is the
    # softmax's own conditioning, not an error of the kernel's (scale 8, D 256: |s| ~ 400, errors ~1e-4)
    scores, reach = _abs_scores(a)
    fin = scores[scores.isfinite()]
    score_err = SCORE_ULPS * torch.finfo(torch.float32).eps * (float(fin.max()) if fin.numel() else 0.0) * v_scale
    # a query whose scores reach float32's range is unspecified (ops.tree_attention): which of them turn into inf
    # or NaN depends on where the scale is applied and on the order of the sums
    # and so is a query with a masked key whose value is not finite: the kernels read masked values with weight 0
    # up to the row's last visible key (0 x inf is NaN) and no further
    masked, seen = _sees_nonfinite_values(a)
    off = ((reach > OVERFLOW) | masked)[..., None].expand_as(got)
    got, want32 = _nonfinite_alike(got.masked_fill(off, 0.0), want32.masked_fill(off, 0.0), seen)
    close(got, want32, 2 * ref_err + ATTENTION_ATOL[dt] * v_scale + score_err, 0.0, "output")


def _nonfinite_alike(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``rows`` (the output's leading dims) saw an inf or NaN value: the same elements must be non-finite,
    which of inf and NaN left open (a weight that underflows to 0 in one precision makes 0 x inf NaN where another
    keeps inf); those rows are then compared no further."""
    rows = rows[..., None].expand_as(want)
    assert torch.equal(~got.isfinite() & rows, ~want.isfinite() & rows), \
        "output: non-finite at other positions than the reference's, where an inf or NaN value was attended to"
    return got.masked_fill(rows, 0.0), want.masked_fill(rows, 0.0)


def _sees_nonfinite_values(a) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query ``[B, H, N]``: whether a key it may not see holds an inf or NaN value (the kernels read masked
    values with weight 0 up to the row's last visible key, and 0 x inf is NaN: unspecified), and whether one it sees
    does."""
    B, H, N, _ = a["q"].shape
    v = a["v_cache"]
    masked, seen = torch.zeros(B, H, N, dtype=torch.bool), torch.zeros(B, H, N, dtype=torch.bool)
    if v.numel() == 0 or bool(v.isfinite().all()):
        return masked, seen
    dense = ref.unpack_tree_mask(a["tree_mask"].cpu(), N)  # [B, N, N]
    prefix = per_row(a["prefix_lens"], B, torch.int64)
    for b in range(B):
        p = int(prefix[b])
        if not 0 <= p <= v.shape[2] - N:  # (a row refused, or with validate=False answered with zeros)
            continue
        G = H // v.shape[1]
        bad = ~v[b, :, :p + N].isfinite().all(-1)  # [Hkv, keys]
        sees = torch.ones(N, p + N, dtype=torch.bool)
        sees[:, p:] = dense[b]
        masked[b] = ((~sees)[None] & bad[:, None, :]).any(-1).repeat_interleave(G, 0)
        seen[b] = (sees[None] & bad[:, None, :]).any(-1).repeat_interleave(G, 0)
    return masked, seen


def _abs_scores(a) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query ``[B, H, N]``, in float64: ``(size, reach)``. ``size``: the largest ``|scale| sum_d |q_d k_d|`` over
    the keys of its row's cache (a bound on every partial sum of its scaled scores). ``reach``: the largest value a
    path forms on the way: that, the unscaled ``sum_d |q_d k_d|`` (the reference scales the scores after the
    product) and ``|scale q_d| log2(e)`` (the CUDA path scales q by that first). NaN and inf in q or k count as 0
    here: they propagate the same way in every path and are compared as they are."""
    q, k = a["q"].double(), a["k_cache"].double()
    B, H, N, _ = q.shape
    if q.numel() == 0 or k.numel() == 0 or k.shape[1] == 0 or H % k.shape[1]:
        zero = torch.zeros(B, H, N, dtype=torch.float64)
        return zero, zero
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    scale = abs(a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5)
    qa, ka = q.abs().nan_to_num(0, 0, 0), k.abs().nan_to_num(0, 0, 0)
    products = torch.einsum("bhnd,bhsd->bhns", qa, ka).amax(-1)
    if not products.numel():
        return products, products
    reach = torch.maximum(products * max(scale, 1.0), qa.amax(-1) * scale * math.log2(math.e))
    return products * scale, reach


def _attention_call(fn):
    return lambda a, v: fn(a["q"], a["k_cache"], a["v_cache"], a["prefix_lens"], a["tree_mask"], a["scale"], v)


TREE_ATTENTION = OpSpec(
    name="tree_attention",
    base=st.fixed_dictionaries({
        "B": dim(1, 2, 5), "heads": st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 1)]),
        "N": st.sampled_from([1, 2, 3, 4, 5, 6, 33]), "D": st.sampled_from([64, 64, 80, 96, 128, 256]),
        "dtype": st.sampled_from(FLOAT_DTYPES), "prefix": dim(0, 8, 70, 150), "extra": st.integers(0, 3),
        "mask": st.sampled_from(["ancestor", "ancestor_packed", "random", "random_packed"]),
        "scale": st.sampled_from([None, None, 0.125, 1.0]), "number": st.booleans(), "seed": SEED}),
    kinds=_attention_kinds,
    build=_attention_case,
    raw=_attention_call(R.tree_attention),
    wrapper=_attention_call(ops.tree_attention),
    reference=_attention_ref,
    compare=_compare_attention,
)

# compact_kv ------------------------------------------------------------------------------------------------------


def _compact_case(r) -> dict:
    g = make_gen(r["seed"])
    B, S, L = r["B"], r["S"], r["L"]
    shape = (B, r["H"], S, r["D"]) if r["seq_dim"] == 2 else (B, S, r["D"])
    caches = [torch.randn(*shape, generator=g).to(dtype_of(r["dtype"])) for _ in range(r["caches"])]
    if r["number"] and not r["raw"]:
        lengths = r["length"] % (min(L, S) + 1)
        dst = r["dst"] % (S - lengths + 1)
    else:
        lengths = torch.randint(0, min(L, S) + 1, (B,), generator=g)
        dst = (torch.rand(B, generator=g) * (S - lengths + 1)).long()
    return {"caches": caches, "src_positions": torch.randint(0, S, (B, L), generator=g), "dst_start": dst,
            "lengths": lengths, "seq_dim": r["seq_dim"]}


def _compact_call(fn):
    return lambda a, v: fn(a["caches"], a["src_positions"], a["dst_start"], a["lengths"], a["seq_dim"], v)


COMPACT_KV = OpSpec(
    name="compact_kv",
    base=st.fixed_dictionaries({
        "B": dim(1, 3, 9), "S": dim(1, 10, 40), "L": dim(0, 6, 20), "H": st.integers(1, 2),
        "D": dim(1, 5, 64, 129), "seq_dim": st.sampled_from([1, 2]), "caches": dim(1, 3, 130),
        "dtype": st.sampled_from(FLOAT_DTYPES + ["float64"]), "number": st.booleans(), "length": st.integers(0, 9),
        "dst": st.integers(0, 9), "seed": SEED}),
    kinds=lambda r: {"caches": Arg("caches"), "src_positions": Arg("index", (0, r["S"])),
                     "dst_start": Arg("row_i", (0, r["S"])), "lengths": Arg("row_i", (0, r["L"], r["S"])),
                     "seq_dim": Arg("int", (0, 1, 2, 3, 4))},
    build=_compact_case,
    raw=_compact_call(R.compact_kv),
    wrapper=lambda a, v: ops.compact_kv(a["caches"], a["src_positions"], a["dst_start"], a["lengths"], a["seq_dim"],
                                        validate=v),
    reference=lambda a, v: ref.compact_kv(a["caches"], a["src_positions"],
                                          per_row(a["dst_start"], a["src_positions"].shape[0], torch.int64),
                                          per_row(a["lengths"], a["src_positions"].shape[0], torch.int64),
                                          a["seq_dim"], v),
    compare=lambda got, want, a, rerun: None,  # the caches are compared (spec.inplace)
    inplace=("caches",),
)

# draft_decoder_layer ---------------------------------------------------------------------------------------------


def _layer_case(r) -> dict:
    g = make_gen(r["seed"])
    dt = dtype_of(r["dtype"])
    B, T, nKV, D, H, I, S = r["B"], r["T"], r["nKV"], r["D"], r["H"], r["I"], r["S"]
    nH = nKV * r["group"]
    Din = H * max(r["segments"], 1)
    kv_len = 1 + r["kv_len"] % S

    def rnd(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    Q = (nH + 2 * nKV) * D
    slots = torch.randint(0, S, (B, T), generator=g)
    mask = torch.rand(B, T, kv_len, generator=g) < 0.5
    own = slots < kv_len
    mask[torch.arange(B)[:, None].expand(B, T)[own], torch.arange(T)[None].expand(B, T)[own], slots[own]] = True
    return {
        "x": rnd(B, T, Din), "input_norm_weight": 1 + rnd(Din) if r["segments"] else None,
        "input_norm_segments": max(r["segments"], 1), "residual": rnd(B, T, H),
        "qkv_weight": ref.pack_linear_weight(rnd(Q, Din)), "qkv_bias": rnd(Q) if r["bias"] else None,
        "o_weight": ref.pack_linear_weight(rnd(H, nH * D)), "norm_weight": 1 + rnd(H),
        "gate_up_weight": ref.pack_linear_weight(rnd(2 * I, H)), "down_weight": ref.pack_linear_weight(rnd(H, I)),
        "position_ids": torch.randint(0, 500, (B, T), generator=g),
        "inv_freq": 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)),
        "k_cache": rnd(B, nKV, S, D, scale=1.0), "v_cache": rnd(B, nKV, S, D, scale=1.0), "write_slots": slots,
        "mask": mask, "num_heads": nH, "intermediate_size": I, "eps": 1e-5}


def _layer_kinds(r) -> dict:
    nH = r["nKV"] * r["group"]
    kinds = {"x": Arg("float"), "residual": Arg("float"), "qkv_weight": Arg("float"), "o_weight": Arg("float"),
             "norm_weight": Arg("float"), "gate_up_weight": Arg("float"), "down_weight": Arg("float"),
             "position_ids": Arg("index", (0,)), "inv_freq": Arg("float"), "k_cache": Arg("float"),
             "v_cache": Arg("float", alias="k_cache"), "write_slots": Arg("index", (0, r["S"], 1 + r["kv_len"] % r["S"])),
             "mask": Arg("mask"), "num_heads": Arg("int", (nH, r["nKV"])), "intermediate_size": Arg("int", (r["I"],)),
             "eps": Arg("real"), "input_norm_segments": Arg("int", (1, 2))}
    if r["bias"]:
        kinds["qkv_bias"] = Arg("float")
    if r["segments"]:
        kinds["input_norm_weight"] = Arg("float")
    return kinds


_LAYER_ORDER = ("x", "input_norm_weight", "input_norm_segments", "residual", "qkv_weight", "qkv_bias", "o_weight",
                "norm_weight", "gate_up_weight", "down_weight", "position_ids", "inv_freq", "k_cache", "v_cache",
                "write_slots", "mask", "num_heads", "intermediate_size", "eps")


def _layer_raw(fn):
    return lambda a, v: fn(*(a[n] for n in _LAYER_ORDER), validate=v)


def _layer_wrapper(a, v):
    return ops.draft_decoder_layer(
        a["x"], a["residual"], a["qkv_weight"], a["o_weight"], a["norm_weight"], a["gate_up_weight"],
        a["down_weight"], a["position_ids"], a["inv_freq"], a["k_cache"], a["v_cache"], a["write_slots"], a["mask"],
        a["num_heads"], a["intermediate_size"], a["eps"], qkv_bias=a["qkv_bias"],
        input_norm_weight=a["input_norm_weight"], input_norm_segments=a["input_norm_segments"], validate=v)


def _compare_layer(got, want, a, rerun):
    """Flash-attention's rule, as for tree_attention: within the atol of ``want`` plus (low precision) twice the
    reference's own error, its distance from the same layer computed in float32."""
    run = _layer_raw(ref.draft_decoder_layer)
    after = to_cpu(a)
    run(after, False)  # (the caches as the call leaves them)
    # as for tree_attention: a token whose attention scores may reach float32's range, or that may not see a slot
    # holding inf or NaN, is unspecified
    masked, seen = _sees_nonfinite_slots(after)
    off = (_layer_score_reach(a, after) > OVERFLOW) | masked
    if all(bool(t.isfinite().all()) for t in a.values() if isinstance(t, torch.Tensor) and t.is_floating_point()):
        # from finite inputs, a token whose reference output is not finite overflowed float32 on the way (a huge
        # weight or value): where the inf or NaN appears depends on each path's order of operations, so the
        # kernel's row is unspecified there (it must still be finite wherever the reference is)
        off |= (~want.isfinite()).any(-1)
    off = off[..., None].expand_as(want)
    got, want = _nonfinite_alike(got.masked_fill(off, 0.0), want.masked_fill(off, 0.0), seen & ~off[..., 0])
    scale = float(want.float().nan_to_num(0, 0, 0).abs().max()) + 1.0 if want.numel() else 1.0
    tol = LAYER_ATOL[want.dtype] * scale
    if want.dtype != torch.float32:  # (rounding each intermediate to 8 or 11 bits, as the module does, errs too)
        want32 = run(_float32_layer(a), False).masked_fill(off, 0.0)
        tol = tol + 2 * (want.float() - want32).abs().nan_to_num(0, 0, 0)
    close(got, want, tol, 0.0, "output")


def _sees_nonfinite_slots(after: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``[B, T]``: whether a cache slot it may not see holds an inf or NaN value after the call's writes,
    and whether one it sees does (as :func:`_sees_nonfinite_values` for tree_attention)."""
    v, mask = after["v_cache"], after["mask"]
    bad = (~v[:, :, :mask.shape[-1]].isfinite()).any(-1).any(1)  # [B, kv_len]: some kv head's value there
    return ((~mask) & bad[:, None, :]).any(-1), (mask & bad[:, None, :]).any(-1)


def _layer_score_reach(a: dict, after: dict) -> torch.Tensor:
    """Per token ``[B, T]``, in float64: a bound on the values its attention scores reach in any path (as
    :func:`_abs_scores`'s ``reach``), from the sizes of its query's terms (``sum |a_i w_i| + |b|``, each RoPE pair by
    its length) and of the cache's keys after the call's writes. NaN and inf count as 0 (compared as they are)."""
    x = a["x"].double().abs().nan_to_num(0, 0, 0)
    w = a["input_norm_weight"]
    if w is not None:  # the RMSNorm: each segment divided by its RMS (the RMS of |x| is x's), times |w|
        B, T, Din = x.shape
        seg = x.view(B, T, a["input_norm_segments"], -1)
        x = (seg * torch.rsqrt(seg.pow(2).mean(-1, keepdim=True) + a["eps"])).view(B, T, Din)
        x = x * w.double().abs().nan_to_num(0, 0, 0)
    nH, (nKV, D) = a["num_heads"], (a["k_cache"].shape[1], a["k_cache"].shape[3])
    wq = ref.unpack_linear_weight(a["qkv_weight"], *_weight_shapes(a)["qkv_weight"])[:nH * D]
    q = x @ wq.double().abs().nan_to_num(0, 0, 0).T
    if a["qkv_bias"] is not None:
        q = q + a["qkv_bias"][:nH * D].double().abs().nan_to_num(0, 0, 0)
    q = _pair_length(q.view(*q.shape[:2], nH, D).float()).double()  # [B, T, nH, D]
    kv_len = a["mask"].shape[-1]
    k = after["k_cache"][:, :, :kv_len].double().abs().nan_to_num(0, 0, 0).repeat_interleave(nH // nKV, 1)
    products = _last_max(torch.einsum("bthd,bhsd->bths", q, k).flatten(2))  # (scale 1 / sqrt(D) < 1)
    return torch.maximum(products, _last_max(q.flatten(2)) * D**-0.5 * math.log2(math.e))


def _last_max(t: torch.Tensor) -> torch.Tensor:
    """The maximum over the last dimension (0 where it is empty)."""
    return t.amax(-1) if t.shape[-1] else t.new_zeros(t.shape[:-1])


def _weight_shapes(a: dict) -> dict[str, tuple[int, int]]:
    """``{packed weight's name: (out_features, in_features)}`` of the layer's arguments."""
    nKV, D = a["k_cache"].shape[1], a["k_cache"].shape[3]
    nH, I, H, Din = a["num_heads"], a["intermediate_size"], a["residual"].shape[-1], a["x"].shape[-1]
    return {"qkv_weight": ((nH + 2 * nKV) * D, Din), "o_weight": (H, nH * D), "gate_up_weight": (2 * I, H),
            "down_weight": (H, I)}


def _float32_layer(a: dict) -> dict:
    """The arguments in float32 (packed weights repacked), for the reference's float32 answer."""
    shapes = _weight_shapes(a)
    out = {}
    for n, t in a.items():
        if n in shapes:
            t = ref.pack_linear_weight(ref.unpack_linear_weight(t, *shapes[n]).float())
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.float()
        out[n] = t
    return out


def _pair_length(t: torch.Tensor) -> torch.Tensor:
    """Per element, the length of its RoPE pair (|(x1, x2)|; the last odd element: its own size); 0 where not finite."""
    t = t.float()
    half = t.shape[-1] // 2
    pair = torch.hypot(t[..., :half], t[..., half:2 * half])  # (no overflow of the squares near 1e30)
    return torch.cat([pair, pair, t[..., 2 * half:].abs()], -1).nan_to_num(0, 0, 0)


def _layer_terms(a: dict) -> dict:
    """The caches as the reference leaves them when every product term is taken by its size: |x|, the norm weight's
    |w| (the RMS of |x| is x's), |qkv_weight|, |qkv_bias| and no rotation (inv_freq 0), so each written k and v is
    sum |a_i w_i| + |b| of its product."""
    qkv = ref.unpack_linear_weight(a["qkv_weight"], *_weight_shapes(a)["qkv_weight"]).abs()

    def size(t):
        return None if t is None else t.abs()

    terms = {**a, "x": a["x"].abs(), "input_norm_weight": size(a["input_norm_weight"]), "qkv_bias": size(a["qkv_bias"]),
             "qkv_weight": ref.pack_linear_weight(qkv), "inv_freq": torch.zeros_like(a["inv_freq"]),
             "k_cache": a["k_cache"].abs(), "v_cache": a["v_cache"].abs()}
    try:
        _layer_raw(ref.draft_decoder_layer)(terms, False)
    except ValueError:  # refused before writing anything (a bad packed weight): the caches as they were
        pass
    return terms


def _close_cache(name: str, got: torch.Tensor, want: torch.Tensor, args: dict) -> None:
    size = torch.maximum(_pair_length(want), _pair_length(_layer_terms(args)[name]))
    close(got, want, CACHE_ATOL[want.dtype] + CACHE_RTOL[want.dtype] * size, 0.0, "cache")


DRAFT_DECODER_LAYER = OpSpec(
    name="draft_decoder_layer",
    base=st.fixed_dictionaries({
        "B": dim(1, 2, 5), "T": dim(1, 3, 9), "nKV": st.integers(1, 2), "group": st.integers(1, 2),
        "D": st.sampled_from([64, 64, 80]), "H": st.sampled_from([8, 16, 24, 64]), "I": st.sampled_from([8, 20]),
        "segments": st.sampled_from([0, 1, 2]), "S": dim(1, 8, 40), "kv_len": st.integers(0, 8),
        "bias": st.booleans(), "dtype": st.sampled_from(FLOAT_DTYPES), "seed": SEED}),
    kinds=_layer_kinds,
    build=_layer_case,
    raw=_layer_raw(R.draft_decoder_layer),
    wrapper=_layer_wrapper,
    reference=_layer_raw(ref.draft_decoder_layer),
    compare=_compare_layer,
    inplace=("k_cache", "v_cache"),
    inplace_tolerance=_close_cache,
)

SPECS = [TREE_ATTENTION, COMPACT_KV, DRAFT_DECODER_LAYER]
