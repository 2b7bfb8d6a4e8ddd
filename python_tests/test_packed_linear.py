"""The packed linear kernel (specdec_ext.ops.pack_linear_weight / packed_linear) against the reference: the packed
layout bit for bit, products against float64, every output row independent of the other rows of the call (bitwise,
through every tile shape of the CPU kernel), and clear errors for mismatched arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec_ext import ops
from specdec_ext.ops import reference as ref

# (out_features N, in_features K): multiples of 32 and not, odd K (a half-filled last K-pair in 16-bit types)
SHAPES = [(64, 32), (37, 21), (1, 1), (100, 383), (96, 7)]
# row counts reaching every tile of the CPU kernel: 1-4 (two panels per tile), 5-12 (one), 13+ (balanced blocks)
ROWS = [1, 2, 3, 4, 5, 8, 12, 13, 25]


def _tolerance(dtype, K, scale):
    # float32 accumulation over K products, then one rounding to dtype
    if dtype == torch.float32:
        return 1e-6 * K * scale
    return (4e-3 if dtype == torch.bfloat16 else 5e-4) * scale + 1e-6 * K * scale


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_layout_matches_reference(device, dtype, shape):
    N, K = shape
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N * K)).to(dtype)
    packed = ops.pack_linear_weight(w.to(device))
    want = ref.pack_linear_weight(w)
    P = 1 if dtype == torch.float32 else 2
    assert packed.shape == ((N + 31) // 32, (K + P - 1) // P, 32, P) and packed.dtype == dtype
    assert torch.equal(packed.cpu(), want)  # a copy: bit-exact, padding markers included


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_product_matches_float64(device, dtype, shape, bias):
    N, K = shape
    g = torch.Generator().manual_seed(7 * N + K)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    packed = ops.pack_linear_weight(w).to(device)
    for M in ROWS:
        x = torch.randn(M, K, generator=g).to(dtype)
        got = ops.packed_linear(x.to(device), packed, None if b is None else b.to(device), N).cpu()
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.shape == (M, N) and got.dtype == dtype
        scale = float(want.abs().max()) + 1.0
        torch.testing.assert_close(got.double(), want, atol=_tolerance(dtype, K, scale), rtol=0)
        # the reference's own packing round trip agrees with the same tolerance
        torch.testing.assert_close(ref.packed_linear(x, ref.pack_linear_weight(w), b, N).double(), want,
                                   atol=_tolerance(dtype, K, scale), rtol=0)


@pytest.mark.parametrize("shape", [(100, 383), (64, 384)])
def test_rows_are_independent_of_the_batch(device, dtype, shape):
    """Row m of a product of M rows equals the product of row m alone, bit for bit (the property that makes one
    decoded token and the same token inside a verified tree give identical logits)."""
    N, K = shape
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(40, K, generator=g).to(dtype).to(device)
    alone = torch.cat([ops.packed_linear(x[i: i + 1], packed, b, N) for i in range(40)])
    for M in ROWS + [40]:
        assert torch.equal(ops.packed_linear(x[:M], packed, b, N), alone[:M]), M
        assert torch.equal(ops.packed_linear(x[40 - M:], packed, b, N), alone[40 - M:]), M


def test_leading_dimensions_and_empty_rows(device):
    w = torch.randn(40, 24).to(device)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(2, 3, 24).to(device)
    y = ops.packed_linear(x, packed, None, 40)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert ops.packed_linear(x[:, :0], packed, None, 40).shape == (2, 0, 40)
    strided = torch.randn(5, 48).to(device)[:, ::2]  # a non-contiguous input is read correctly
    torch.testing.assert_close(ops.packed_linear(strided, packed, None, 40), F.linear(strided, w), atol=1e-5,
                               rtol=1e-5)


def test_packed_linear_path_names_a_known_path():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert ops.packed_linear_path(dtype) in ("avx512", "avx512_bf16", "avx2", "generic")
    assert ops.packed_linear_path(torch.float16) == "generic"
    with pytest.raises(ValueError, match="dtype"):
        ops.packed_linear_path(torch.int32)


@pytest.mark.parametrize("case", ["dtype_mix", "wrong_out_features", "wrong_in_features", "bias_shape",
                                  "bias_dtype", "not_packed", "non_contiguous", "zero_out", "int_weight"])
def test_bad_arguments_name_the_argument(case):
    w = torch.randn(40, 24)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(3, 24)
    calls = {
        "dtype_mix": (lambda: ops.packed_linear(x.bfloat16(), packed, None, 40), "packed_weight must have x's dtype"),
        "wrong_out_features": (lambda: ops.packed_linear(x, packed, None, 70), "packed_weight must have shape"),
        "wrong_in_features": (lambda: ops.packed_linear(torch.randn(3, 30), packed, None, 40),
                              "packed_weight must have shape"),
        "bias_shape": (lambda: ops.packed_linear(x, packed, torch.randn(41), 40), "bias must have shape"),
        "bias_dtype": (lambda: ops.packed_linear(x, packed, torch.randn(40).double(), 40), "bias must be"),
        "not_packed": (lambda: ops.packed_linear(x, w, None, 40), "packed_weight must have 4 dimensions|"
                                                                   "packed_weight must have shape"),
        "non_contiguous": (lambda: ops.packed_linear(x, packed.transpose(0, 1), None, 40),
                           "packed_weight must have shape|must be contiguous"),
        "zero_out": (lambda: ops.packed_linear(x, packed, None, 0), "out_features must be >= 1"),
        "int_weight": (lambda: ops.pack_linear_weight(torch.ones(4, 4, dtype=torch.int32)), "weight must be float"),
    }
    fn, message = calls[case]
    with pytest.raises(ValueError, match=message):
        fn()


@pytest.mark.parametrize("N, out_features", [(33, 40), (33, 34), (40, 33), (64, 63), (63, 64), (1, 32)])
def test_out_features_the_weight_does_not_hold_is_refused(dtype, N, out_features):
    """The shape gives N only to within a panel of 32; the padding rows' marker (params.h) tells the rest. Before,
    out_features = 40 over a 33-row weight returned 7 extra zero columns. The reference refuses the same way."""
    w = torch.randn(N, 24).to(dtype)
    packed = ops.pack_linear_weight(w)
    assert packed.shape[0] == (out_features + 31) // 32  # the shape check alone would pass
    x = torch.randn(3, 24).to(dtype)
    message = (f"packed_linear: packed_weight holds {N} output features (pack_linear_weight's output for a weight of "
               f"{N} rows) but out_features = {out_features}")
    with pytest.raises(ValueError) as info:
        ref.packed_linear(x, ref.pack_linear_weight(w), None, out_features)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        ops.packed_linear(x, packed, None, out_features)
    assert str(info.value).splitlines()[0] == message
    y = ops.packed_linear(x, packed, None, N)  # the right count still works
    assert y.shape == (3, N)


@pytest.mark.parametrize("value", [2**63 - 1, -2**63, 2**62, 2**63 - 31])
def test_out_features_at_the_int64_ends(value):
    """ceil(N / 32) without the N + 31 that wraps: a clear error, never a shape that happens to match."""
    packed = ops.pack_linear_weight(torch.randn(40, 24))
    with pytest.raises(ValueError, match=r"out_features must be >= 1|packed_weight must have shape"):
        ops.packed_linear(torch.randn(3, 24), packed, None, value)
    with pytest.raises(ValueError, match=r"out_features = .* does not fit int64"):
        ops.packed_linear(torch.randn(3, 24), packed, None, 2**63)
