"""sample_tokens vs the reference: draws, returned distributions, layouts, parameters and validation.
The empirical distribution of the draws is tested in test_losslessness.py."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import (assert_close_lowp, assert_draws_match, assert_raises_exactly, expected_error, make_gen, on, ops,
                     per_row, ref, shifted_uniforms, strided_rows)

SHAPES = [(1, 7), (3, 7), (64, 7), (1, 111), (7, 111), (64, 111), (1, 32000), (3, 32000), (7, 32000)]
TEMPS = [1.0, 0.7, 1.3, 0.0, 0.5, 2.0, 1.0, 0.9]
TOPKS = [0, 5, 50, 3, 0, 1, 10**6, 0]
TOPPS = [1.0, 0.9, 0.5, 1.0, 0.8, 1.0, 0.95, 0.7]
# probs are float32 weights normalised by their float32 sum over up to V = 32000 terms.
P_ATOL, P_RTOL = 1e-6, 2e-5


def _params(R):
    rep = lambda v: torch.tensor((v * (R // len(v) + 1))[:R])  # noqa: E731
    return dict(temperature=rep(TEMPS).float(), top_k=rep(TOPKS), top_p=rep(TOPPS).float())


def run_ref(logits, u, temperature=1.0, top_k=0, top_p=1.0, validate=True):
    R = logits.shape[0]
    return ref.sample_tokens(logits.cpu(), u.cpu(), per_row(temperature, R, torch.float32),
                             per_row(top_k, R, torch.int64), per_row(top_p, R, torch.float32), validate)


def run_op(device, logits, u, validate=True, **params):
    params = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in params.items()}
    return ops.sample_tokens(*on(device, logits, u), validate=validate, **params)


def check_tokens(got, logits, u, **params):
    want = run_ref(logits, u, **params)
    assert_draws_match(got, want[0], lambda d: run_ref(logits, shifted_uniforms(u, d), **params)[0], "tokens")
    return want


@pytest.mark.parametrize("R,V", SHAPES)
def test_matches_reference(device, dtype, R, V):
    gen = make_gen(R * 1000 + V)
    logits = torch.randn(R, V, generator=gen) * 2
    u = torch.rand(R, generator=gen)
    params = _params(R)
    x = logits.to(dtype)
    tokens, probs = run_op(device, x, u, **params)
    assert tokens.dtype == torch.int64 and tokens.shape == (R,) and tokens.device.type == device
    assert probs.dtype == torch.float32 and probs.shape == (R, V) and probs.device.type == device
    want_tokens, want_probs = check_tokens(tokens, x, u, **params)
    _, probs_f32 = run_ref(logits, u, **params)
    assert_close_lowp(probs, want_probs, probs_f32, atol=P_ATOL, rtol=P_RTOL, name="probs")
    # The drawn token is in the support of the returned distribution, which sums to 1.
    probs = probs.cpu()
    assert bool((probs[torch.arange(R), tokens.cpu()] > 0).all())
    # Accurate float32 normalisation leaves the sum within ~1e-7 of 1; 4e-6 is generous.
    torch.testing.assert_close(probs.sum(-1), torch.ones(R), atol=4e-6, rtol=0)


@pytest.mark.parametrize("R,V", [(7, 111), (3, 32000)])
def test_strided_logits(device, dtype, R, V):
    gen = make_gen(V)
    x = (torch.randn(R, V, generator=gen) * 2).to(dtype)
    u = torch.rand(R, generator=gen)
    params = _params(R)
    a = run_op(device, x, u, **params)
    b = run_op(device, strided_rows(x.to(device)), u, **params)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_temperature_zero_and_top_k_one(device, dtype):
    """Temperature 0: one-hot on the first argmax whatever u. top_k = 1: the maximum only, but ties at the top-k
    threshold are kept (params.h), so a tied maximum is split evenly and drawn by u."""
    gen = make_gen(4)
    x = (torch.randn(16, 111, generator=gen) * 3).to(dtype)
    x[3, [10, 20]] = 50.0  # a tie at the maximum
    argmax = torch.tensor([int((r == r.max()).nonzero()[0, 0]) for r in x.float()])
    assert int(argmax[3]) == 10
    u = torch.rand(16, generator=gen)
    u[3] = 0.75
    onehot = torch.nn.functional.one_hot(argmax, 111).float()
    tokens, probs = run_op(device, x, u, temperature=0.0, top_k=7, top_p=0.3)
    assert torch.equal(tokens.cpu(), argmax)
    assert torch.equal(probs.cpu(), onehot)
    tokens, probs = run_op(device, x, u, temperature=0.8, top_k=1)
    onehot[3, 10] = onehot[3, 20] = 0.5
    argmax[3] = 20  # u = 0.75 falls in the second half
    assert torch.equal(tokens.cpu(), argmax)
    assert torch.equal(probs.cpu(), onehot)


def test_independent_distribution(device):
    """The returned distribution equals softmax / top-k / top-p computed here in float64 (not via the reference)."""
    gen = make_gen(12)
    R, V = 6, 111
    logits = torch.randn(R, V, generator=gen) * 2
    params = dict(temperature=torch.tensor([1.0, 0.6, 1.5, 1.0, 0.8, 1.2]), top_k=torch.tensor([0, 0, 20, 7, 30, 0]),
                  top_p=torch.tensor([1.0, 0.7, 1.0, 0.9, 0.6, 0.99]))
    _, probs = run_op(device, logits, torch.rand(R, generator=gen), **params)
    for r in range(R):
        x = logits[r].double() / float(params["temperature"][r])
        order = torch.argsort(x, descending=True)
        k = int(params["top_k"][r]) or V
        kept = order[:k]
        w = torch.softmax(x[kept], 0)
        keep_n = int((torch.cumsum(w, 0) < float(params["top_p"][r]) - 1e-12).sum()) + 1
        kept = kept[:keep_n]
        want = torch.zeros(V, dtype=torch.float64)
        want[kept] = torch.softmax(x[kept], 0)
        torch.testing.assert_close(probs[r].cpu().double(), want, atol=1e-6, rtol=1e-5)


def test_top_p_nucleus_exact_at_large_vocab(device):
    """The top-p cut at V = 32000 agrees with exact (float64) arithmetic on the float32 weights, as the reference's
    does: the running-mass goal top_p * sum(w) must come from an accurate sum of the weights."""
    gen = make_gen(0)
    R, V = 64, 32000
    logits = torch.randn(R, V, generator=gen)
    _, probs = run_op(device, logits, torch.rand(R, generator=gen), top_p=0.9)
    w = torch.exp(logits - logits.max(1, keepdim=True).values).double()  # the float32 weights, summed exactly
    cum = torch.sort(w, 1, descending=True).values.cumsum(1)
    exact = (cum < 0.9 * w.sum(1, keepdim=True)).sum(1) + 1
    _, ref_probs = run_ref(logits, torch.rand(R, generator=gen), top_p=0.9)
    assert torch.equal((ref_probs > 0).sum(1), exact), "the reference itself disagrees with exact arithmetic"
    kept = (probs.cpu() > 0).sum(1)
    wrong = (kept != exact).nonzero().flatten().tolist()
    assert not wrong, (f"top-p kept a different number of tokens than exact arithmetic in {len(wrong)}/{R} rows, "
                       f"e.g. row {wrong[0]}: {int(kept[wrong[0]])} vs {int(exact[wrong[0]])}")


# ---------------------------------------------------------------------------------------------------------------
# Validation.

BAD = {
    "temperature_negative": (lambda x, s: s["temperature"].__setitem__(1, -1.0),
                             "sample_tokens: temperature[1] must be finite and >= 0 (0 = greedy)"),
    "temperature_nan": (lambda x, s: s["temperature"].__setitem__(1, math.nan),
                        "sample_tokens: temperature[1] must be finite and >= 0 (0 = greedy)"),
    "top_p_zero": (lambda x, s: s["top_p"].__setitem__(1, 0.0), "sample_tokens: top_p[1] must be in (0, 1]"),
    "top_p_large": (lambda x, s: s["top_p"].__setitem__(1, 1.5), "sample_tokens: top_p[1] must be in (0, 1]"),
    "nan_logits": (lambda x, s: x.__setitem__((1, 9), math.nan), "sample_tokens: logits[1, 9] is NaN or +inf"),
    "inf_logits": (lambda x, s: (x.__setitem__((1, 9), math.nan), x.__setitem__((1, 4), math.inf)),
                   "sample_tokens: logits[1, 4] is NaN or +inf"),
    "all_neg_inf": (lambda x, s: x.__setitem__(1, -math.inf),
                    "sample_tokens: logits[1] is -inf everywhere: no token can be chosen"),
    "params_before_logits": (lambda x, s: (x.__setitem__(1, math.nan), s["top_p"].__setitem__(1, 2.0)),
                             "sample_tokens: top_p[1] must be in (0, 1]"),
}


def _bad(case):
    gen = make_gen(3)
    x = torch.randn(3, 17, generator=gen)
    u = torch.rand(3, generator=gen)
    params = dict(temperature=torch.ones(3), top_k=torch.zeros(3, dtype=torch.int64), top_p=torch.ones(3))
    BAD[case][0](x, params)
    return x, u, params, BAD[case][1]


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_error(device, dtype, case):
    x, u, params, msg = _bad(case)
    x = x.to(dtype)
    assert expected_error(run_ref, x, u, **params) == msg
    assert_raises_exactly(msg, run_op, device, x, u, **params)


@pytest.mark.parametrize("case", sorted(BAD))
def test_no_validate_sentinels(device, dtype, case):
    x, u, params, _ = _bad(case)
    x = x.to(dtype)
    tokens, probs = run_op(device, x, u, validate=False, **params)
    want = run_ref(x, u, validate=False, **params)
    assert int(tokens[1]) == -1 and not bool(probs[1].any())
    assert torch.equal(tokens.cpu(), want[0])
    torch.testing.assert_close(probs.cpu(), want[1], atol=P_ATOL, rtol=P_RTOL)
