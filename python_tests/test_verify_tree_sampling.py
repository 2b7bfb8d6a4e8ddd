"""verify_tree_sampling vs the reference (with and without draft probabilities), greedy equivalence at temperature
0, layouts, sampling-parameter handling and validation. Distributional losslessness: test_losslessness.py."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import (assert_equal_tuples, assert_raises_exactly, assert_verification_matches, cpu,
                     expected_error, make_gen, on, ops, per_row, plant_path, random_logits, random_parents,
                     random_tokens, ref, shifted_uniforms, strided_rows)

NAMES = ["accepted", "accept_len", "next_token"]
SHAPES = [(1, 1, 7), (3, 5, 7), (7, 26, 7), (7, 64, 7), (1, 64, 111), (3, 26, 111), (7, 5, 111),
          (3, 5, 32000), (7, 26, 32000), (1, 64, 32000)]
TEMPS = [1.0, 0.7, 1.3, 0.0, 0.5, 2.0, 1.0]
TOPKS = [0, 5, 50, 3, 0, 1, 10**6]
TOPPS = [1.0, 0.9, 0.5, 1.0, 0.8, 1.0, 0.95]


def make_case(B, N, V, seed, kind="random", with_q=True, boost=15.0):
    gen = make_gen(seed)
    parents = random_parents(B, N, gen, kind)
    tokens = random_tokens(B, N, V, gen)
    logits = random_logits(B, N, V, gen)
    if N > 1:
        plant_path(logits, tokens, parents, gen, boost=boost, rows=range(0, B, 2) if B > 1 else [0], deepest=True)
    q = None
    if with_q:
        q = torch.softmax(torch.randn(B, N, V, generator=gen) * 2, -1)
        q[..., ::5] = 0  # tokens the drafter cannot produce
        q = q / q.sum(-1, keepdim=True)
    uniforms = torch.rand(B, N, generator=gen)
    params = dict(temperature=torch.tensor(TEMPS[:B]), top_k=torch.tensor(TOPKS[:B]), top_p=torch.tensor(TOPPS[:B]))
    return logits, tokens, parents, q, uniforms, params


def run_ref(logits, tokens, parents, q, uniforms, temperature=1.0, top_k=0, top_p=1.0, validate=True):
    B = logits.shape[0]
    return ref.verify_tree_sampling(logits.cpu(), tokens.cpu(), parents.cpu(), None if q is None else q.cpu(),
                                    uniforms.cpu(), per_row(temperature, B, torch.float32),
                                    per_row(top_k, B, torch.int64), per_row(top_p, B, torch.float32), validate)


def check_vs_ref(got, logits, tokens, parents, q, uniforms, validate=True, **params):
    """Compares op outputs with the reference (next_token as an inverse-CDF draw, see helpers.U_TOL)."""
    want = run_ref(logits, tokens, parents, q, uniforms, validate=validate, **params)

    def redraw(delta):
        u = uniforms.clone()
        u[:, 0] = shifted_uniforms(u[:, 0], delta)
        return run_ref(logits, tokens, parents, q, u, validate=validate, **params)[2]

    assert_verification_matches(cpu(*got), want, redraw)
    return want


def run_op(device, logits, tokens, parents, q, uniforms, validate=True, **params):
    params = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in params.items()}
    return ops.verify_tree_sampling(*on(device, logits, tokens, parents, uniforms), draft_probs=on(device, q)[0],
                                    validate=validate, **params)


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("B,N,V", SHAPES)
def test_matches_reference(device, dtype, B, N, V, with_q):
    logits, tokens, parents, q, uniforms, params = make_case(B, N, V, seed=B * 7919 + N * 31 + V, kind="deep",
                                                             with_q=with_q)
    x = logits.to(dtype)
    got = run_op(device, x, tokens, parents, q, uniforms, **params)
    assert isinstance(got, ops.Verification) and all(t.device.type == device for t in got)
    want = check_vs_ref(got, x, tokens, parents, q, uniforms, **params)
    if N >= 26:
        assert int(want[1].max()) >= 2, "the planted path should make the reference accept several nodes"


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("B,N,V", [(7, 26, 7), (3, 64, 111), (3, 5, 32000)])
def test_small_acceptance_probabilities(device, B, N, V, with_q):
    """No planted path: acceptance is a genuine coin flip (random trees, random logits, wide fan-out)."""
    logits, tokens, parents, q, uniforms, params = make_case(B, N, V, seed=N + V, kind="wide", with_q=with_q,
                                                             boost=1.0)
    check_vs_ref(run_op(device, logits, tokens, parents, q, uniforms, **params), logits, tokens, parents, q, uniforms,
                 **params)


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("B,N,V", [(7, 26, 7), (3, 64, 111), (3, 5, 32000)])
def test_temperature_zero_is_greedy(device, dtype, B, N, V, with_q):
    logits, tokens, parents, q, uniforms, _ = make_case(B, N, V, seed=3 * N + V, kind="deep", with_q=with_q,
                                                        boost=2.0)
    x = logits.to(dtype)
    got = run_op(device, x, tokens, parents, q, uniforms, temperature=0.0, top_k=3, top_p=0.5)
    greedy = ops.verify_tree_greedy(*on(device, x, tokens, parents))
    assert_equal_tuples(got, cpu(*greedy), NAMES)
    assert_equal_tuples(got, ref.verify_tree_greedy(x, tokens, parents), NAMES)


@pytest.mark.parametrize("layout", ["gap", "transposed"])
def test_strided_logits_and_draft_probs(device, dtype, layout):
    logits, tokens, parents, q, uniforms, params = make_case(3, 26, 111, seed=77, kind="deep")
    x = logits.to(dtype)
    contiguous = run_op(device, x, tokens, parents, q, uniforms, **params)
    got = run_op(device, strided_rows(x.to(device), layout), tokens, parents, strided_rows(q.to(device), layout),
                 uniforms, **params)
    assert_equal_tuples(got, cpu(*contiguous), NAMES)
    check_vs_ref(got, x, tokens, parents, q, uniforms, **params)


def test_scalar_and_tensor_params_agree(device):
    logits, tokens, parents, q, uniforms, _ = make_case(3, 26, 111, seed=5)
    a = run_op(device, logits, tokens, parents, q, uniforms, temperature=0.8, top_k=20, top_p=0.9)
    b = run_op(device, logits, tokens, parents, q, uniforms, temperature=torch.tensor(0.8),
               top_k=torch.tensor([20, 20, 20]), top_p=torch.full((3,), 0.9, dtype=torch.float64))
    assert_equal_tuples(a, cpu(*b), NAMES)
    check_vs_ref(a, logits, tokens, parents, q, uniforms, temperature=0.8, top_k=20, top_p=0.9)


@pytest.mark.parametrize("top_k", [0, 111, 500])
def test_top_k_outside_range_means_no_top_k(device, top_k):
    logits, tokens, parents, q, uniforms, _ = make_case(3, 26, 111, seed=9)
    want = run_op(device, logits, tokens, parents, q, uniforms, top_k=0)
    got = run_op(device, logits, tokens, parents, q, uniforms, top_k=top_k)
    assert_equal_tuples(got, cpu(*want), NAMES)
    check_vs_ref(got, logits, tokens, parents, q, uniforms, top_k=top_k)


def test_next_token_column_zero(device):
    """Column 0 of uniforms only draws next_token: the accepted path does not depend on it, and next_token is an
    inverse-CDF draw, hence non-decreasing in uniforms[:, 0] for a fixed path."""
    B, N, V = 1, 9, 7
    logits, tokens, parents, q, uniforms, _ = make_case(B, N, V, seed=21, kind="chain", boost=1.0)
    grid = torch.linspace(0, 0.999, 64)
    u = uniforms.expand(64, N).clone()
    u[:, 0] = grid
    rep = lambda t: t.expand(64, *t.shape[1:]).contiguous()  # noqa: E731
    got = cpu(*run_op(device, rep(logits), rep(tokens), rep(parents), rep(q), u))
    assert bool((got[0] == got[0][0]).all()) and bool((got[1] == got[1][0]).all())
    assert bool((got[2][1:] >= got[2][:-1]).all())
    check_vs_ref(got, rep(logits), rep(tokens), rep(parents), rep(q), u)


# ---------------------------------------------------------------------------------------------------------------
# Validation.


def _valid(B=3, N=6, V=11):
    """Chains whose every draft is the (overwhelmingly likely) target token, so every node is reached."""
    logits, tokens, parents, q, uniforms, _ = make_case(B, N, V, seed=123, kind="chain", boost=15.0)
    for b in range(B):
        for i in range(1, N):
            logits[b, i - 1, tokens[b, i]] = logits[b, i - 1].max() + 15.0
    return logits, tokens, parents, q, uniforms


def _msg(s):
    return "verify_tree_sampling: " + s


BAD = {
    # name: (mutator(logits, tokens, parents, q, params), message)
    "temperature_negative": (lambda l, t, p, q, s: s["temperature"].__setitem__(1, -0.5),
                             _msg("temperature[1] must be finite and >= 0 (0 = greedy)")),
    "temperature_nan": (lambda l, t, p, q, s: s["temperature"].__setitem__(1, math.nan),
                        _msg("temperature[1] must be finite and >= 0 (0 = greedy)")),
    "top_p_zero": (lambda l, t, p, q, s: s["top_p"].__setitem__(1, 0.0), _msg("top_p[1] must be in (0, 1]")),
    "top_p_above_one": (lambda l, t, p, q, s: s["top_p"].__setitem__(1, 1.01), _msg("top_p[1] must be in (0, 1]")),
    "top_p_negative": (lambda l, t, p, q, s: s["top_p"].__setitem__(1, -0.2), _msg("top_p[1] must be in (0, 1]")),
    "top_p_nan": (lambda l, t, p, q, s: s["top_p"].__setitem__(1, math.nan), _msg("top_p[1] must be in (0, 1]")),
    "bad_root": (lambda l, t, p, q, s: p.__setitem__((1, 0), 2),
                 _msg("parents[1, 0] must be -1 (node 0 is the root), got 2")),
    "parent_not_earlier": (lambda l, t, p, q, s: p.__setitem__((1, 2), 4),
                           _msg("parents[1, 2] = 4 is not an earlier node: expected 0 <= parent < 2 "
                                "(nodes are topologically ordered and only node 0 is a root)")),
    "token_out_of_range": (lambda l, t, p, q, s: t.__setitem__((1, 4), 11),
                           _msg("tokens[1, 4] = 11 is out of range for the vocabulary")),
    "nan_logits": (lambda l, t, p, q, s: l.__setitem__((1, 0, 3), math.nan), _msg("logits[1, 0, 3] is NaN or +inf")),
    "inf_logits_deeper": (lambda l, t, p, q, s: l.__setitem__((1, 2, 10), math.inf),
                          _msg("logits[1, 2, 10] is NaN or +inf")),
    "all_neg_inf": (lambda l, t, p, q, s: l.__setitem__((1, 0), -math.inf),
                    _msg("logits[1, 0] is -inf everywhere: no token can be chosen")),
    "negative_draft_prob": (lambda l, t, p, q, s: q.__setitem__((1, 0, int(t[1, 1])), -0.25),
                            None),
    "nan_draft_prob": (lambda l, t, p, q, s: q.__setitem__((1, 1, int(t[1, 2])), math.nan), None),
}


def _apply(case):
    logits, tokens, parents, q, uniforms = _valid()
    params = dict(temperature=torch.ones(3), top_k=torch.zeros(3, dtype=torch.int64), top_p=torch.ones(3))
    BAD[case][0](logits, tokens, parents, q, params)
    msg = BAD[case][1]
    if case == "negative_draft_prob":
        msg = _msg(f"draft_probs[1, 0, {int(tokens[1, 1])}] is negative or NaN")
    if case == "nan_draft_prob":
        msg = _msg(f"draft_probs[1, 1, {int(tokens[1, 2])}] is negative or NaN")
    return logits, tokens, parents, q, uniforms, params, msg


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_error(device, dtype, case):
    logits, tokens, parents, q, uniforms, params, msg = _apply(case)
    x = logits.to(dtype)
    assert expected_error(run_ref, x, tokens, parents, q, uniforms, **params) == msg
    assert_raises_exactly(msg, run_op, device, x, tokens, parents, q, uniforms, **params)


@pytest.mark.parametrize("case", sorted(BAD))
def test_no_validate_sentinels(device, dtype, case):
    logits, tokens, parents, q, uniforms, params, _ = _apply(case)
    x = logits.to(dtype)
    got = cpu(*run_op(device, x, tokens, parents, q, uniforms, validate=False, **params))
    check_vs_ref(got, x, tokens, parents, q, uniforms, validate=False, **params)
    assert got[0][1].tolist() == [-1] * 6 and int(got[1][1]) == 0 and int(got[2][1]) == -1
    good = torch.tensor([0, 2])
    sub = {k: v[good] for k, v in params.items()}
    check_vs_ref(tuple(t[good] for t in got), x[good], tokens[good], parents[good], q[good], uniforms[good], **sub)
    assert int(got[1][0]) >= 1, "row 0 has a planted path"


def test_draft_prob_checked_only_when_tested(device):
    """A negative draft probability at a token no child carries (or below a node never reached) is not read."""
    logits, tokens, parents, q, uniforms = _valid()
    unused = next(v for v in range(11) if v not in tokens[0].tolist())
    q[0, 0, unused] = -1.0
    q[0, 5, :] = -1.0  # node 5 is a leaf: its row is never read
    got = run_op(device, logits, tokens, parents, q, uniforms)
    check_vs_ref(got, logits, tokens, parents, q, uniforms)


def test_validation_order(device):
    """Sampling parameters (temperature, then top_p) before the tree, the tree before tokens, tokens before logits."""
    logits, tokens, parents, q, uniforms = _valid()
    params = dict(temperature=torch.ones(3), top_k=torch.zeros(3, dtype=torch.int64), top_p=torch.ones(3))
    logits[2, 0, 0] = math.nan
    tokens[2, 3] = -1
    parents[2, 4] = 4
    params["top_p"][2] = 2.0
    params["temperature"][2] = -1.0
    steps = [("temperature", _msg("temperature[2] must be finite and >= 0 (0 = greedy)")),
             ("top_p", _msg("top_p[2] must be in (0, 1]")),
             ("parents", _msg("parents[2, 4] = 4 is not an earlier node: expected 0 <= parent < 4 "
                              "(nodes are topologically ordered and only node 0 is a root)")),
             ("tokens", _msg("tokens[2, 3] = -1 is out of range for the vocabulary")),
             ("logits", _msg("logits[2, 0, 0] is NaN or +inf"))]
    for fix, msg in steps:
        assert expected_error(run_ref, logits, tokens, parents, q, uniforms, **params) == msg
        assert_raises_exactly(msg, run_op, device, logits, tokens, parents, q, uniforms, **params)
        if fix == "temperature":
            params["temperature"][2] = 1.0
        elif fix == "top_p":
            params["top_p"][2] = 1.0
        elif fix == "parents":
            parents[2, 4] = 3
        elif fix == "tokens":
            tokens[2, 3] = 1


def test_nan_draft_probs_away_from_the_drafted_tokens_agree_with_the_reference(device):
    """A NaN in draft_probs at a token no child drafted is not validated (only drafted tokens are); the residual
    r - q * sum(r) is then NaN there, and every implementation falls back to the target (params.h). The CPU kernel
    used to clamp the NaN to 0 and draw from a different residual."""
    gen = make_gen(40)
    B, N, V = 1, 3, 6
    logits = torch.randn(B, N, V, generator=gen)
    tokens, parents = torch.tensor([[0, 0, 1]]), torch.tensor([[-1, 0, 0]])
    q = torch.softmax(torch.randn(B, N, V, generator=gen), -1)
    q[0, 0] = torch.tensor([0.45, 0.45, 0.04, 0.03, 0.02, float("nan")])
    params = (torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))
    for u0 in torch.linspace(0.01, 0.99, 25).tolist():
        uniforms = torch.tensor([[u0, 0.999, 0.999]])  # both children rejected: next_token from the residual
        got = ops.verify_tree_sampling(*on(device, logits, tokens, parents, uniforms, q))
        want = ref.verify_tree_sampling(logits, tokens, parents, q, uniforms, *params)
        assert_equal_tuples(got, want, NAMES)
