"""Fuzz specs of the packed linear ops: pack_linear_weight, packed_linear."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fuzz.compare import close, same
from fuzz.spec import FLOAT_DTYPES, Arg, OpSpec, dim, dtype_of
from helpers import make_gen
from specdec_ext import ops
from specdec_ext.ops import reference as ref
from test_packed_linear import _tolerance

R = torch.ops.specdec_ext
SEED = st.integers(0, 2**31 - 1)
_SHAPE = {"N": st.sampled_from([1, 5, 31, 32, 33, 37, 64, 70, 100, 200]), "K": dim(1, 40, 129, 383),
          "dtype": st.sampled_from(FLOAT_DTYPES), "seed": SEED}


def _weight(r) -> torch.Tensor:
    return torch.randn(r["N"], r["K"], generator=make_gen(r["seed"])).to(dtype_of(r["dtype"]))


PACK_LINEAR_WEIGHT = OpSpec(
    name="pack_linear_weight",
    base=st.fixed_dictionaries(_SHAPE),
    kinds=lambda r: {"weight": Arg("float")},
    build=lambda r: {"weight": _weight(r)},
    raw=lambda a, v: R.pack_linear_weight(a["weight"]),
    wrapper=lambda a, v: ops.pack_linear_weight(a["weight"]),
    reference=lambda a, v: ref.pack_linear_weight(a["weight"]),
    compare=lambda got, want, a, rerun: same(got, want, "packed"),
)


def _linear_case(r) -> dict:
    g = make_gen(r["seed"] + 1)
    dt = dtype_of(r["dtype"])
    return {"x": torch.randn(*r["lead"], r["K"], generator=g).to(dt),
            "packed_weight": ref.pack_linear_weight(_weight(r)),
            "bias": torch.randn(r["N"], generator=g).to(dt) if r["bias"] else None, "out_features": r["N"]}


def _linear_kinds(r) -> dict:
    padded = 32 * ((r["N"] + 31) // 32)
    kinds = {"x": Arg("float"), "packed_weight": Arg("float"), "out_features": Arg("int", (r["N"], padded))}
    if r["bias"]:
        kinds["bias"] = Arg("float")
    return kinds


def _compare_linear(got, want, a, rerun):
    """Against the reference's product in float64 before its rounding (test_packed_linear's tolerance); where that
    product is beyond the dtype's range, the answer is the infinity it rounds to."""
    x, dt = a["x"], a["x"].dtype
    want64 = ref.packed_linear(x.double(), a["packed_weight"], a["bias"], a["out_features"])
    assert got.dtype == want.dtype and got.shape == want.shape, f"output {got.dtype} {tuple(got.shape)}"
    rounded = want64.to(dt).double()
    target = torch.where(rounded.isinf(), rounded, want64)
    finite = target[target.isfinite()]
    scale = float(finite.abs().max()) + 1.0 if finite.numel() else 1.0
    close(got.double(), target, _tolerance(dt, x.shape[-1], scale), 0.0, "output")


PACKED_LINEAR = OpSpec(
    name="packed_linear",
    base=st.fixed_dictionaries({**_SHAPE, "lead": st.sampled_from([[1], [3], [2, 3], [0], [5], [13], [25], [2, 20]]),
                                "bias": st.booleans()}),
    kinds=_linear_kinds,
    build=_linear_case,
    raw=lambda a, v: R.packed_linear(a["x"], a["packed_weight"], a["bias"], a["out_features"]),
    wrapper=lambda a, v: ops.packed_linear(a["x"], a["packed_weight"], a["bias"], a["out_features"]),
    reference=lambda a, v: ref.packed_linear(a["x"], a["packed_weight"], a["bias"], a["out_features"]),
    compare=_compare_linear,
)

SPECS = [PACK_LINEAR_WEIGHT, PACKED_LINEAR]
