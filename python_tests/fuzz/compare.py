"""Comparisons of an op's answer with the reference's (NaN-aware; tolerances from the per-op tests)."""

from __future__ import annotations

import torch

from helpers import assert_draws_match


def _meta(got: torch.Tensor, want: torch.Tensor, name: str) -> torch.Tensor:
    assert isinstance(got, torch.Tensor), f"{name}: got {type(got).__name__}, not a tensor"
    got = got.detach().cpu()
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, the reference's {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
    return got


def same(got, want: torch.Tensor, name: str = "output") -> None:
    """Bit-for-bit equal values (NaN equal to NaN)."""
    got = _meta(got, want, name)
    if got.is_floating_point():
        ok = torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    else:
        ok = torch.equal(got, want)
    if not ok:
        bad = (got != want) & ~(got.isnan() & want.isnan()) if got.is_floating_point() else got != want
        idx = bad.nonzero()[:4].tolist()
        raise AssertionError(f"{name} differs at {idx}: got {[got[tuple(i)].item() for i in idx]}, reference "
                             f"{[want[tuple(i)].item() for i in idx]}")


def same_all(got, want, names) -> None:
    assert len(got) == len(want) == len(names), f"{len(got)} outputs, the reference has {len(want)}"
    for g, w, n in zip(got, want, names):
        same(g, w, n)


def close(got, want: torch.Tensor, atol, rtol: float, name: str = "output") -> None:
    """Equal NaN and infinity positions; finite values within ``atol + rtol * |want|`` (``atol``: a number, or a
    tensor of want's shape: a tolerance per element)."""
    got = _meta(got, want, name).float()
    want = want.float()
    assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN at other positions than the reference's"
    inf = want.isinf() | got.isinf()
    assert torch.equal(got[inf], want[inf]), f"{name}: infinities differ from the reference's"
    fin = ~(inf | want.isnan())
    err = (got[fin] - want[fin]).abs()
    per_element = isinstance(atol, torch.Tensor)
    bad = err > (atol.float()[fin] if per_element else atol) + rtol * want[fin].abs()
    shown = f"{float(atol.max()):g} (largest)" if per_element else f"{atol:g}"
    assert not bool(bad.any()), (f"{name}: {int(bad.sum())} values beyond atol {shown} + rtol {rtol:g} (max error "
                                 f"{float(err.max()):.3g})")


def draws(got, want: torch.Tensor, redraw, name: str) -> None:
    """Sampled tokens: equal, or explained by a uniform within rounding of a CDF boundary (helpers.U_TOL)."""
    got = _meta(got, want, name)
    assert_draws_match(got, want, redraw, name)
