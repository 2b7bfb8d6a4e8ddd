"""The weight-only int4 linear kernel (specdec_ext.ops.pack_linear_weight_int4 / packed_linear_int4) against the
reference: the packed layout, group multipliers and scales bit for bit, products bit for bit (exact integer sums, so
every path gives the reference's bits), the quantisation's definition checked on its own terms (each weight within
half a step of its group, the multipliers' range), the product against float64 arithmetic on the dequantised
operands, rows independent of the call, non-finite rows, and clear errors for mismatched arguments."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdec_ext import ops
from specdec_ext.ops import reference as ref

# (out_features N, in_features K): whole panels and groups and not (a part-filled last panel, group and K-octet)
SHAPES = [(64, 32), (37, 21), (1, 1), (100, 383), (96, 7), (33, 130), (32, 64)]
# 1-16 rows reach every tile of the CPU paths (AVX2: 1 row x 1 panel; AVX-512: 1-2 rows x 2 panels, 1-4 x 1)
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 25]


def _weight(N, K, dtype, seed):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * K ** -0.5
    w[:, : min(K, 32)] *= 4.0  # a loud first group: the other groups' multipliers fall below 63
    return w.to(dtype)


def _dequantised(w):
    q, m, scales = ref.quantize_weight_int4(w)
    step = scales.double()[:, None] * m.double().repeat_interleave(32, 1)[:, : w.shape[1]]
    return q, m, scales, step


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_layout_and_scales_match_reference(device, dtype, shape):
    N, K = shape
    w = _weight(N, K, dtype, N * K)
    packed, group_scales, scales = ops.pack_linear_weight_int4(w.to(device))
    Kp = -(-K // 32) * 32
    assert packed.shape == ((N + 31) // 32, Kp // 8, 32, 4) and packed.dtype == torch.uint8
    assert group_scales.shape == ((N + 31) // 32, Kp // 32, 32) and group_scales.dtype == torch.uint8
    assert scales.shape == (N,) and scales.dtype == torch.float32 and packed.device.type == device
    want = ref.pack_linear_weight_int4(w)
    assert torch.equal(packed.cpu(), want[0]) and torch.equal(group_scales.cpu(), want[1])
    assert torch.equal(scales.cpu(), want[2])
    # the layout's formula, by hand, and the padding (q = 0 as nibble 8; multiplier 0)
    q, m, _, step = _dequantised(w)
    p = packed.cpu().int()
    for n, k in [(0, 0), (N - 1, K - 1), (N // 2, K // 3), (min(N - 1, 33), min(K - 1, 5)), (0, min(K - 1, 13))]:
        byte = p[n // 32, k // 8, n % 32, k % 4]
        assert (byte >> (4 if k % 8 >= 4 else 0)) & 15 == q[n, k] + 8
        assert group_scales.cpu()[n // 32, k // 32, n % 32] == m[n, k // 32]
    u = torch.stack([p & 15, p >> 4], 3)  # [panel, octet, lane, nibble, e]
    assert int((u != 8).sum()) == int((q != 0).sum())  # nothing else differs from the zero nibble
    assert int(group_scales.cpu().int().sum()) == int(m.int().sum())
    # the definition on its own terms: multipliers in [1, 63], 63 for the loudest group; each weight within half a
    # step of its group (no clamping needed below 7.5 steps)
    assert (m >= 1).all() and (m <= 63).all() and (m.amax(1) == 63).all() and (q.abs() <= 7).all()
    assert (m.int().amin(1) < 63).all() if K > 32 else True
    err = (q.double() * step - w.double()).abs()
    assert (err <= step * 0.5 * (1 + 1e-4)).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_product_matches_reference_bit_for_bit(device, dtype, shape, bias):
    N, K = shape
    g = torch.Generator().manual_seed(7 * N + K)
    w = _weight(N, K, dtype, 7 * N + K)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    weight = ops.pack_linear_weight_int4(w.to(device))
    for M in ROWS:
        x = torch.randn(M, K, generator=g).to(dtype)
        got = ops.packed_linear_int4(x.to(device), *weight, None if b is None else b.to(device))
        assert got.shape == (M, N) and got.dtype == dtype and got.device.type == device
        want = ref.packed_linear_int4(x, *(t.cpu() for t in weight), b)
        assert torch.equal(got.cpu(), want), (M, (got.cpu().float() - want.float()).abs().max())


@pytest.mark.parametrize("shape", [(100, 383), (64, 384), (300, 64)])
def test_product_is_the_dequantised_operands_product(shape):
    """Independently of the reference's integer formulation: y = (qx sx) (q step)^T + b up to float32 rounding, and
    against the float product within the quantisation bound (each operand within half a step), about 9% of the
    output's scale for Gaussian data."""
    N, K = shape
    g = torch.Generator().manual_seed(11)
    w = _weight(N, K, torch.float32, 5)
    b = torch.randn(N, generator=g)
    x = torch.randn(16, K, generator=g)
    got = ops.packed_linear_int4(x, *ops.pack_linear_weight_int4(w), b).double()
    q, _, _, step = _dequantised(w)
    qx, sx = ref.quantize_rows_int8(x)
    exact_q = (qx.double() * sx.double()[:, None]) @ (q.double() * step).T + b.double()
    assert torch.allclose(got, exact_q, rtol=1e-6, atol=1e-6 * float(exact_q.abs().max()))
    exact = F.linear(x.double(), w.double(), b.double())
    dx = (x.abs().amax(1).double() / 127 / 2)[:, None]
    bound = (x.abs().double() @ (step / 2).T + dx * w.abs().double().sum(1)[None, :] +
             dx * (step / 2).sum(1)[None, :])
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-5 * (exact.abs() + 1e-3)).all()
    relative = float((got - b.double() - (exact - b.double())).norm() / (exact - b.double()).norm())
    assert 0.02 < relative < 0.15, relative


@pytest.mark.parametrize("shape", [(100, 383), (64, 384)])
def test_rows_are_independent_of_the_batch(device, dtype, shape):
    N, K = shape
    g = torch.Generator().manual_seed(3)
    weight = ops.pack_linear_weight_int4(_weight(N, K, dtype, 3).to(device))
    b = torch.randn(N, generator=g).to(dtype).to(device)
    x = torch.randn(40, K, generator=g).to(dtype).to(device)
    alone = torch.cat([ops.packed_linear_int4(x[i: i + 1], *weight, b) for i in range(40)])
    for M in ROWS + [40]:
        assert torch.equal(ops.packed_linear_int4(x[:M], *weight, b), alone[:M]), M
        assert torch.equal(ops.packed_linear_int4(x[40 - M:], *weight, b), alone[40 - M:]), M


def test_non_finite_zero_and_tiny_rows(device):
    """A row of x holding inf or NaN gives NaN outputs and leaves the other rows alone; a zero row gives the bias; a
    weight row below 2^-100 packs as zeros (scale 0, multipliers 0) and gives the bias."""
    w = _weight(40, 24, torch.float32, 1)
    w[5] = 1e-35
    weight = ops.pack_linear_weight_int4(w.to(device))
    assert weight.scales[5] == 0 and int(weight.group_scales.cpu()[0, :, 5].sum()) == 0
    b = torch.randn(40).to(device)
    x = torch.randn(4, 24).to(device)
    x[1, 3] = math.inf
    x[2, 0] = math.nan
    x[3] = 0.0
    y = ops.packed_linear_int4(x, *weight, b)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[3], b) and y[0, 5] == b[5]
    assert torch.equal(y[0], ops.packed_linear_int4(x[:1], *weight, b)[0])
    assert torch.equal(y[[0, 3]].cpu(), ref.packed_linear_int4(x[[0, 3]].cpu(), *(t.cpu() for t in weight),
                                                               b.cpu()))


def test_leading_dimensions_empty_rows_and_strides(device):
    weight = ops.pack_linear_weight_int4(_weight(40, 24, torch.float32, 2).to(device))
    x = torch.randn(2, 3, 24).to(device)
    y = ops.packed_linear_int4(x, *weight)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y, ops.packed_linear_int4(x.reshape(6, 24), *weight).view(2, 3, 40))
    assert ops.packed_linear_int4(x[:, :0], *weight).shape == (2, 0, 40)
    strided = torch.randn(5, 48).to(device)[:, ::2]
    assert torch.equal(ops.packed_linear_int4(strided, *weight), ops.packed_linear_int4(strided.contiguous(), *weight))


def test_packed_linear_int4_path_names_a_known_path():
    assert ops.packed_linear_int4_path() in ("avx512_vnni", "avx2", "generic")


@pytest.mark.parametrize("case", ["x_int", "packed_dtype", "group_scales_dtype", "scales_dtype", "wrong_in_features",
                                  "wrong_out_features", "group_scales_shape", "bias_shape", "bias_dtype",
                                  "non_contiguous", "empty_scales", "scalar_x", "non_finite_weight", "int_weight",
                                  "huge_k", "empty_weight"])
def test_bad_arguments_name_the_argument(case):
    w = torch.randn(40, 24)
    packed, group_scales, scales = ops.pack_linear_weight_int4(w)
    x = torch.randn(3, 24)
    bad_w = w.clone()
    bad_w[7, 3] = math.nan
    calls = {
        "x_int": (lambda: ops.packed_linear_int4(x.long(), packed, group_scales, scales), "x must be float32"),
        "packed_dtype": (lambda: ops.packed_linear_int4(x, packed.to(torch.int8), group_scales, scales),
                         "packed_weight must be Byte"),
        "group_scales_dtype": (lambda: ops.packed_linear_int4(x, packed, group_scales.float(), scales),
                               "group_scales must be Byte"),
        "scales_dtype": (lambda: ops.packed_linear_int4(x, packed, group_scales, scales.double()),
                         "scales must be Float"),
        "wrong_in_features": (lambda: ops.packed_linear_int4(torch.randn(3, 40), packed, group_scales, scales),
                              "packed_weight must have shape"),
        "wrong_out_features": (lambda: ops.packed_linear_int4(x, packed, group_scales, torch.ones(70)),
                               "packed_weight must have shape"),
        "group_scales_shape": (lambda: ops.packed_linear_int4(x, packed, group_scales[:, :, :16].contiguous(), scales),
                               "group_scales must have shape"),
        "bias_shape": (lambda: ops.packed_linear_int4(x, packed, group_scales, scales, torch.randn(41)),
                       "bias must have shape"),
        "bias_dtype": (lambda: ops.packed_linear_int4(x, packed, group_scales, scales, torch.randn(40).bfloat16()),
                       "bias must be"),
        "non_contiguous": (lambda: ops.packed_linear_int4(x, packed.transpose(0, 1), group_scales, scales),
                           "packed_weight must have shape|must be contiguous"),
        "empty_scales": (lambda: ops.packed_linear_int4(x, packed, group_scales, torch.ones(0)),
                         "scales must be non-empty"),
        "scalar_x": (lambda: ops.packed_linear_int4(torch.tensor(1.0), packed, group_scales, scales),
                     "x must have shape"),
        "non_finite_weight": (lambda: ops.pack_linear_weight_int4(bad_w), "weight must be finite"),
        "int_weight": (lambda: ops.pack_linear_weight_int4(torch.ones(4, 4, dtype=torch.int32)),
                       "weight must be float"),
        "huge_k": (lambda: ops.pack_linear_weight_int4(torch.ones(1, 32769)), r"in_features must be in \[1, 32768\]"),
        "empty_weight": (lambda: ops.pack_linear_weight_int4(torch.ones(0, 4)), "weight must be non-empty"),
    }
    fn, message = calls[case]
    with pytest.raises(ValueError, match=message):
        fn()
    if case in ("non_finite_weight", "huge_k"):  # the reference refuses the same way
        with pytest.raises(ValueError, match=message):
            ref.pack_linear_weight_int4(bad_w if case == "non_finite_weight" else torch.ones(1, 32769))
