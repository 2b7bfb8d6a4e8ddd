"""tree_attention vs the reference (flash-attention's error rule), SDPA, mask layouts, strided caches, GQA, long
prefixes, per-row prefixes, validation and bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_raises_exactly, expected_error, make_gen, ops, random_parents, ref

# atol of the rule |ours - ref_f32|max <= 2 |ref_lowp - ref_f32|max + atol (for float32 ref_lowp == ref_f32).
ATOL = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def make_case(B, H, Hkv, N, D, prefixes, seed, S=None, kind="random"):
    gen = make_gen(seed)
    S = S or max(prefixes) + N + 3
    parents = random_parents(B, N, gen, kind)
    q = torch.randn(B, H, N, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    return q, k, v, torch.tensor(prefixes, dtype=torch.int64), parents


def check_against_reference(got, q, k, v, prefix, mask, scale, dtype):
    """Flash-attention's rule: the reference in float32 on the same (rounded) inputs, and in the low precision."""
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    want = ref.tree_attention(qd.float(), kd.float(), vd.float(), prefix, mask.cpu(), scale)
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.cpu().float() - want).abs().max().item()
    if dtype == torch.float32:
        ref_err = 0.0
    else:
        low = ref.tree_attention(qd, kd, vd, prefix, mask.cpu(), scale, compute_dtype=dtype)
        ref_err = (low.float() - want).abs().max().item()
    assert err <= 2 * ref_err + ATOL[dtype], f"max error {err:.3g} > 2 * {ref_err:.3g} + {ATOL[dtype]}"


# (B, H, Hkv, N, D, prefixes): every head dim, GQA 1/2/4, N from 1 to 64, prefixes from 0, different per row.
SHAPES = [
    (1, 4, 1, 1, 64, [37]),
    (3, 4, 2, 5, 80, [0, 77, 130]),
    (2, 8, 2, 26, 96, [200, 65]),
    (2, 4, 4, 26, 128, [1, 300]),
    (1, 8, 2, 64, 128, [129]),
    (2, 2, 1, 8, 256, [70, 0]),
]


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("B,H,Hkv,N,D,prefixes", SHAPES)
def test_matches_reference(device, dtype, B, H, Hkv, N, D, prefixes, packed):
    q, k, v, prefix, parents = make_case(B, H, Hkv, N, D, prefixes, seed=B * 100 + N * 7 + D)
    mask = ops.tree_ancestor_mask(parents, packed=packed)
    scale = 1.0 / math.sqrt(D)
    got = ops.tree_attention(q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device),
                             prefix.to(device), mask.to(device), scale)
    assert got.device.type == device
    check_against_reference(got, q, k, v, prefix, mask, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix", [5, 63, 64, 100, 250, 300])
def test_tree_node_equals_decoding_its_path(dtype, prefix):
    """Bit for bit: a tree node's output is what decoding its root-to-node path one token at a time gives (the path's
    K/V at consecutive slots after the prefix, one query). Greedy speculative decoding is identical to plain greedy
    decoding only if near-tied logits come out the same both ways. CPU kernel (the CUDA kernel is not yet checked)."""
    gen = make_gen(11 + prefix)
    H, Hkv, D, N = 6, 2, 64, 24
    parents = random_parents(1, N, gen, "random")[0].tolist()
    S = prefix + N + 1
    q = torch.randn(1, H, N, D, generator=gen).to(dtype)
    k = torch.randn(1, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, S, D, generator=gen).to(dtype)
    scale = D ** -0.5
    tree = ops.tree_attention(q, k, v, torch.tensor([prefix]), ops.tree_ancestor_mask(torch.tensor([parents])),
                              scale)
    one = ops.tree_ancestor_mask(ops.chain_parents(1, 1))
    for i in range(N):
        path, j = [], i
        while j != -1:
            path.append(j)
            j = parents[j]
        path.reverse()
        k2, v2 = k.clone(), v.clone()
        k2[:, :, prefix: prefix + len(path)] = k[:, :, [prefix + n for n in path]]
        v2[:, :, prefix: prefix + len(path)] = v[:, :, [prefix + n for n in path]]
        seq = ops.tree_attention(q[:, :, i: i + 1], k2, v2, torch.tensor([prefix + len(path) - 1]), one, scale)
        assert torch.equal(seq[:, :, 0], tree[:, :, i]), (i, path)


def test_dense_and_packed_masks_agree(device, dtype):
    q, k, v, prefix, parents = make_case(2, 4, 2, 40, 64, [10, 90], seed=3, kind="deep")
    args = [t.to(dtype).to(device) for t in (q, k, v)]
    dense = ops.tree_attention(*args, prefix.to(device), ops.tree_ancestor_mask(parents.to(device)))
    packed = ops.tree_attention(*args, prefix.to(device), ops.tree_ancestor_mask(parents.to(device), packed=True))
    assert torch.equal(dense, packed)


def test_equals_sdpa_with_dense_mask(device):
    """float32: the op equals torch SDPA with the equivalent dense boolean mask (GQA through enable_gqa)."""
    B, H, Hkv, N, D, P = 2, 8, 2, 26, 128, 150
    q, k, v, prefix, parents = make_case(B, H, Hkv, N, D, [P, P], seed=11, S=P + N)
    mask = ops.tree_ancestor_mask(parents)
    full = torch.ones(B, 1, N, P + N, dtype=torch.bool)
    full[:, 0, :, P:] = mask
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1),
                                          attn_mask=full, scale=0.1)
    got = ops.tree_attention(q.to(device), k.to(device), v.to(device), prefix.to(device), mask.to(device), 0.1)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["seq_major", "padded"])
def test_strided_caches(device, dtype, layout):
    """Caches may be views: [B, S, Hkv, D] storage transposed to [B, Hkv, S, D], or a slice of a longer cache;
    q may be strided too. Results equal the contiguous ones exactly."""
    B, H, Hkv, N, D = 2, 4, 2, 9, 64
    q, k, v, prefix, parents = make_case(B, H, Hkv, N, D, [5, 40], seed=5)
    mask = ops.tree_ancestor_mask(parents).to(device)
    q, k, v = (t.to(dtype).to(device) for t in (q, k, v))
    want = ops.tree_attention(q, k, v, prefix.to(device), mask)

    def strided(t):
        if layout == "seq_major":
            return t.transpose(1, 2).contiguous().transpose(1, 2)
        big = torch.full((t.shape[0], t.shape[1], t.shape[2] + 17, t.shape[3]), float("nan"), dtype=t.dtype,
                         device=t.device)
        big[:, :, : t.shape[2]] = t
        return big[:, :, : t.shape[2]]

    ks, vs = strided(k), strided(v)
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not ks.is_contiguous() and not qs.is_contiguous()
    assert torch.equal(ops.tree_attention(qs, ks, vs, prefix.to(device), mask), want)


def test_long_prefix(device):
    """A prefix over 32k positions (bfloat16, GQA 4/1, N = 8) against the float32 reference."""
    dtype = torch.bfloat16
    q, k, v, prefix, parents = make_case(1, 4, 1, 8, 64, [33000], seed=7)
    mask = ops.tree_ancestor_mask(parents)
    got = ops.tree_attention(q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device),
                             prefix.to(device), mask.to(device), 0.125)
    check_against_reference(got, q, k, v, prefix, mask, 0.125, dtype)


def test_peaked_scores(device, dtype):
    """Large scores (a few keys dominate, others underflow) stay finite and match the reference."""
    q, k, v, prefix, parents = make_case(2, 2, 1, 6, 64, [100, 3], seed=9)
    q = q * 4
    mask = ops.tree_ancestor_mask(parents)
    got = ops.tree_attention(q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device),
                             prefix.to(device), mask.to(device), 1.0)
    assert torch.isfinite(got.float()).all()
    check_against_reference(got, q, k, v, prefix, mask, 1.0, dtype)


def test_custom_masks_and_empty_rows(device):
    """Any bool mask is accepted: a node that sees no tree node attends to the prefix only; with prefix 0 and an
    all-false mask row it attends to nothing and gets zeros (the reference's convention)."""
    B, H, Hkv, N, D = 2, 2, 1, 5, 64
    q, k, v, prefix, _ = make_case(B, H, Hkv, N, D, [0, 12], seed=13)
    mask = torch.rand(B, N, N, generator=make_gen(1)) < 0.4
    mask[:, 2] = False
    got = ops.tree_attention(q.to(device), k.to(device), v.to(device), prefix.to(device), mask.to(device), 0.125)
    want = ref.tree_attention(q, k, v, prefix, mask, 0.125)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)
    assert torch.equal(got[0, :, 2].cpu(), torch.zeros(H, D))


def test_default_scale_and_int_prefix(device):
    q, k, v, prefix, parents = make_case(1, 2, 2, 4, 64, [20], seed=17)
    mask = ops.tree_ancestor_mask(parents).to(device)
    a = ops.tree_attention(q.to(device), k.to(device), v.to(device), 20, mask)
    b = ops.tree_attention(q.to(device), k.to(device), v.to(device), prefix.to(device), mask, 1 / 8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [-1, 1000])
def test_bad_prefix_lens(device, bad):
    q, k, v, prefix, parents = make_case(3, 2, 1, 4, 64, [5, 6, 7], seed=19, S=40)
    prefix[1] = bad
    mask = ops.tree_ancestor_mask(parents)
    msg = expected_error(ref.tree_attention, q, k, v, prefix, mask, 0.125)
    assert "prefix_lens[1]" in msg
    args = [t.to(device) for t in (q, k, v, prefix, mask)]
    assert_raises_exactly(msg, ops.tree_attention, *args, 0.125)
    out = ops.tree_attention(*args, 0.125, validate=False)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
    want = ref.tree_attention(q, k, v, prefix, mask, 0.125, validate=False)
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=1e-5)


def _args(**over):
    q, k, v, prefix, parents = make_case(2, 4, 2, 5, 64, [3, 4], seed=0, S=20)
    a = dict(q=q, k=k, v=v, prefix=prefix, mask=ops.tree_ancestor_mask(parents), scale=0.125)
    a.update(over)
    return a


BAD = [
    ("q_3d", dict(q=torch.randn(2, 4, 64)), r"q must have 4 dimensions"),
    ("head_dim", dict(q=torch.randn(2, 4, 5, 48), k=torch.randn(2, 2, 20, 48), v=torch.randn(2, 2, 20, 48)),
     r"head dim D = 48 is not supported"),
    ("gqa", dict(q=torch.randn(2, 3, 5, 64)), r"H = 3 must be a multiple of .* Hkv = 2"),
    ("kv_dtype", dict(k=torch.randn(2, 2, 20, 64).half()), r"k_cache must have q's dtype"),
    ("v_shape", dict(v=torch.randn(2, 2, 19, 64)), r"v_cache must have k_cache's shape"),
    ("k_batch", dict(k=torch.randn(3, 2, 20, 64)), r"k_cache must have shape \[B, Hkv, S, D\]"),
    ("k_stride", dict(k=torch.randn(2, 2, 20, 128)[..., ::2]), r"k_cache must have unit stride"),
    ("short_cache", dict(k=torch.randn(2, 2, 4, 64), v=torch.randn(2, 2, 4, 64)), r"fewer than the N = 5"),
    ("prefix_dtype", dict(prefix=torch.tensor([3, 4], dtype=torch.int32)), r"prefix_lens must be Long"),
    ("mask_dtype", dict(mask=torch.zeros(2, 5, 5, dtype=torch.uint8)), r"tree_mask must be bool"),
    ("mask_shape", dict(mask=torch.zeros(2, 5, 4, dtype=torch.bool)), r"tree_mask must have shape \[B, N, N\]"),
    ("packed_shape", dict(mask=torch.zeros(2, 5, 2, dtype=torch.int32)), r"tree_mask must have shape"),
    ("float64", dict(q=torch.randn(2, 4, 5, 64).double()), r"q must be float32, float16 or bfloat16"),
]


@pytest.mark.parametrize("name,over,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments(name, over, pattern):
    a = _args(**over)
    with pytest.raises(ValueError, match=pattern):
        torch.ops.specdec_ext.tree_attention(a["q"], a["k"], a["v"], a["prefix"], a["mask"], a["scale"])
