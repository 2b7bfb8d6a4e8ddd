"""The weight-only int8 linear kernel (specdec_ext.ops.pack_linear_weight_int8 / packed_linear_int8) against the
reference: the packed layout and scales bit for bit, products bit for bit (the kernel's sums are exact integers, so
every path gives the reference's bits), rows independent of the call, the quantisation error within its analytic
bound of the float64 product, non-finite rows, and clear errors for mismatched arguments."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdec_ext import ops
from specdec_ext.ops import reference as ref

# (out_features N, in_features K): multiples of 32 / 4 and not (a part-filled last panel and K-quad)
SHAPES = [(64, 32), (37, 21), (1, 1), (100, 383), (96, 7), (33, 130)]
# 1-16 rows reach every tile of the CPU paths (AVX2: 1 row x 2 panels, 1-2 rows x 1 panel; AVX-512: 1-4 x 2, 1-8 x 1)
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 25]


def _weight(N, K, dtype, seed):
    return (torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * K ** -0.5).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_layout_and_scales_match_reference(device, dtype, shape):
    N, K = shape
    w = _weight(N, K, dtype, N * K)
    packed, scales = ops.pack_linear_weight_int8(w.to(device))
    want_packed, want_scales = ref.pack_linear_weight_int8(w)
    assert packed.shape == ((N + 31) // 32, (K + 3) // 4, 32, 4) and packed.dtype == torch.int8
    assert scales.shape == (N,) and scales.dtype == torch.float32 and packed.device.type == device
    assert torch.equal(packed.cpu(), want_packed) and torch.equal(scales.cpu(), want_scales)
    # the layout's formula, zero padding, and each value within half a step of its channel's scale
    q, _ = ref.quantize_rows_int8(w)
    p = packed.cpu()
    for n, k in [(0, 0), (N - 1, K - 1), (N // 2, K // 3), (min(N - 1, 33), min(K - 1, 5))]:
        assert p[n // 32, k // 4, n % 32, k % 4] == q[n, k]
    assert int(p.abs().sum()) == int(q.abs().sum())  # nothing else is non-zero
    assert (q.abs() <= 127).all() and int(q.abs().amax(1).min()) == 127
    err = (q.double() * scales.cpu().double()[:, None] - w.double()).abs()
    assert (err <= scales.cpu().double()[:, None] * 0.5 * (1 + 1e-4)).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_product_matches_reference_bit_for_bit(device, dtype, shape, bias):
    N, K = shape
    g = torch.Generator().manual_seed(7 * N + K)
    w = _weight(N, K, dtype, 7 * N + K)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    packed, scales = ops.pack_linear_weight_int8(w.to(device))
    for M in ROWS:
        x = torch.randn(M, K, generator=g).to(dtype)
        got = ops.packed_linear_int8(x.to(device), packed, scales, None if b is None else b.to(device))
        assert got.shape == (M, N) and got.dtype == dtype and got.device.type == device
        want = ref.packed_linear_int8(x, packed.cpu(), scales.cpu(), b)
        assert torch.equal(got.cpu(), want), (M, (got.cpu().float() - want.float()).abs().max())


@pytest.mark.parametrize("shape", [(100, 383), (64, 384), (300, 64)])
def test_error_is_within_the_quantisation_bound(shape):
    """|y - x w^T| <= sum_k (|x_k| dw_n + |w_nk| dx + dx dw_n) with dx = sx / 2, dw = sw / 2 (each quantised value
    within half a step), plus float32 rounding; and for Gaussian data about 1% of the output's scale."""
    N, K = shape
    g = torch.Generator().manual_seed(11)
    w = _weight(N, K, torch.float32, 5)
    packed, scales = ops.pack_linear_weight_int8(w)
    x = torch.randn(16, K, generator=g)
    got = ops.packed_linear_int8(x, packed, scales).double()
    exact = F.linear(x.double(), w.double())
    dx = (x.abs().amax(1).double() / 127 / 2)[:, None]
    dw = (scales.double() / 2)[None, :]
    bound = x.abs().double().sum(1, keepdim=True) * dw + dx * w.abs().double().sum(1)[None, :] + K * dx * dw
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-6 * (exact.abs() + 1e-3)).all()
    relative = float((got - exact).norm() / exact.norm())
    assert relative < 0.02, relative


@pytest.mark.parametrize("shape", [(100, 383), (64, 384)])
def test_rows_are_independent_of_the_batch(device, dtype, shape):
    N, K = shape
    g = torch.Generator().manual_seed(3)
    packed, scales = ops.pack_linear_weight_int8(_weight(N, K, dtype, 3).to(device))
    b = torch.randn(N, generator=g).to(dtype).to(device)
    x = torch.randn(40, K, generator=g).to(dtype).to(device)
    alone = torch.cat([ops.packed_linear_int8(x[i: i + 1], packed, scales, b) for i in range(40)])
    for M in ROWS + [40]:
        assert torch.equal(ops.packed_linear_int8(x[:M], packed, scales, b), alone[:M]), M
        assert torch.equal(ops.packed_linear_int8(x[40 - M:], packed, scales, b), alone[40 - M:]), M


def test_non_finite_and_zero_rows(device):
    """A row holding inf or NaN gives NaN outputs and leaves the other rows alone; a zero row gives the bias."""
    packed, scales = ops.pack_linear_weight_int8(_weight(40, 24, torch.float32, 1).to(device))
    b = torch.randn(40).to(device)
    x = torch.randn(4, 24).to(device)
    x[1, 3] = math.inf
    x[2, 0] = math.nan
    x[3] = 0.0
    y = ops.packed_linear_int8(x, packed, scales, b)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[3], b)
    assert torch.equal(y[0], ops.packed_linear_int8(x[:1], packed, scales, b)[0])
    assert torch.equal(y[[0, 3]].cpu(), ref.packed_linear_int8(x[[0, 3]].cpu(), packed.cpu(), scales.cpu(), b.cpu()))
    tiny = torch.full((1, 24), 1e-38, device=device)  # below 2^-120: quantised as zero, not through 127 / amax = inf
    assert torch.equal(ops.packed_linear_int8(tiny, packed, scales, b)[0], b)


def test_leading_dimensions_empty_rows_and_strides(device):
    w = _weight(40, 24, torch.float32, 2).to(device)
    packed, scales = ops.pack_linear_weight_int8(w)
    x = torch.randn(2, 3, 24).to(device)
    y = ops.packed_linear_int8(x, packed, scales)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y, ops.packed_linear_int8(x.reshape(6, 24), packed, scales).view(2, 3, 40))
    assert ops.packed_linear_int8(x[:, :0], packed, scales).shape == (2, 0, 40)
    strided = torch.randn(5, 48).to(device)[:, ::2]
    assert torch.equal(ops.packed_linear_int8(strided, packed, scales),
                       ops.packed_linear_int8(strided.contiguous(), packed, scales))


def test_packed_linear_int8_path_names_a_known_path():
    assert ops.packed_linear_int8_path() in ("avx512_vnni", "avx2", "generic")


@pytest.mark.parametrize("case", ["x_int", "packed_dtype", "scales_dtype", "wrong_in_features", "wrong_out_features",
                                  "bias_shape", "bias_dtype", "not_packed", "non_contiguous", "empty_scales",
                                  "scalar_x", "non_finite_weight", "int_weight", "huge_k", "empty_weight"])
def test_bad_arguments_name_the_argument(case):
    w = torch.randn(40, 24)
    packed, scales = ops.pack_linear_weight_int8(w)
    x = torch.randn(3, 24)
    bad_w = w.clone()
    bad_w[7, 3] = math.nan
    calls = {
        "x_int": (lambda: ops.packed_linear_int8(x.long(), packed, scales), "x must be float32"),
        "packed_dtype": (lambda: ops.packed_linear_int8(x, packed.float(), scales), "packed_weight must be Char"),
        "scales_dtype": (lambda: ops.packed_linear_int8(x, packed, scales.double()), "scales must be Float"),
        "wrong_in_features": (lambda: ops.packed_linear_int8(torch.randn(3, 30), packed, scales),
                              "packed_weight must have shape"),
        "wrong_out_features": (lambda: ops.packed_linear_int8(x, packed, torch.ones(70)),
                               "packed_weight must have shape"),
        "bias_shape": (lambda: ops.packed_linear_int8(x, packed, scales, torch.randn(41)), "bias must have shape"),
        "bias_dtype": (lambda: ops.packed_linear_int8(x, packed, scales, torch.randn(40).bfloat16()), "bias must be"),
        "not_packed": (lambda: ops.packed_linear_int8(x, w.to(torch.int8), scales), "packed_weight must have shape"),
        "non_contiguous": (lambda: ops.packed_linear_int8(x, packed.transpose(0, 1), scales),
                           "packed_weight must have shape|must be contiguous"),
        "empty_scales": (lambda: ops.packed_linear_int8(x, packed, torch.ones(0)), "scales must be non-empty"),
        "scalar_x": (lambda: ops.packed_linear_int8(torch.tensor(1.0), packed, scales), "x must have shape"),
        "non_finite_weight": (lambda: ops.pack_linear_weight_int8(bad_w), "weight must be finite"),
        "int_weight": (lambda: ops.pack_linear_weight_int8(torch.ones(4, 4, dtype=torch.int32)),
                       "weight must be float"),
        "huge_k": (lambda: ops.pack_linear_weight_int8(torch.ones(1, 131073)), r"in_features must be in \[1, 131072\]"),
        "empty_weight": (lambda: ops.pack_linear_weight_int8(torch.ones(0, 4)), "weight must be non-empty"),
    }
    fn, message = calls[case]
    with pytest.raises(ValueError, match=message):
        fn()
    if case in ("non_finite_weight", "huge_k"):  # the reference refuses the same way
        with pytest.raises(ValueError, match=message):
            ref.pack_linear_weight_int8(bad_w if case == "non_finite_weight" else torch.ones(1, 131073))
