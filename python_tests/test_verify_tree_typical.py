"""verify_tree_typical (Medusa typical acceptance) vs the reference, greedy equivalence at temperature 0,
layouts and validation."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import (assert_equal_tuples, assert_raises_exactly, assert_verification_matches, cpu,
                     distinct_sibling_tokens, expected_error, make_gen, on, ops, per_row, plant_path, random_logits,
                     random_parents, random_tokens, ref, shifted_uniforms, strided_rows)

NAMES = ["accepted", "accept_len", "next_token"]
SHAPES = [(1, 1, 7), (3, 5, 7), (7, 26, 7), (7, 64, 7), (1, 64, 111), (3, 26, 111), (7, 5, 111),
          (3, 5, 32000), (7, 26, 32000), (1, 64, 32000)]
TEMPS = [0.7, 1.0, 0.0, 1.3, 0.5, 2.0, 0.7]


def make_case(B, N, V, seed, kind="random", boost=15.0):
    gen = make_gen(seed)
    parents = random_parents(B, N, gen, kind)
    tokens = random_tokens(B, N, V, gen)
    logits = random_logits(B, N, V, gen)
    if N > 1:
        plant_path(logits, tokens, parents, gen, boost=boost, rows=range(0, B, 2), deepest=True)
    uniforms = torch.rand(B, generator=gen)
    return logits, tokens, parents, uniforms, torch.tensor(TEMPS[:B])


def run_ref(logits, tokens, parents, uniforms, temperature=0.7, posterior_threshold=0.09, posterior_alpha=0.3,
            validate=True):
    B = logits.shape[0]
    return ref.verify_tree_typical(logits.cpu(), tokens.cpu(), parents.cpu(), uniforms.cpu(),
                                   per_row(temperature, B, torch.float32), posterior_threshold, posterior_alpha,
                                   validate)


def run_op(device, logits, tokens, parents, uniforms, temperature=0.7, validate=True, **kw):
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device)
    return ops.verify_tree_typical(*on(device, logits, tokens, parents, uniforms), temperature=temperature,
                                   validate=validate, **kw)


def check_vs_ref(got, logits, tokens, parents, uniforms, **kw):
    want = run_ref(logits, tokens, parents, uniforms, **kw)
    assert_verification_matches(
        cpu(*got), want, lambda d: run_ref(logits, tokens, parents, shifted_uniforms(uniforms, d), **kw)[2])
    return want


@pytest.mark.parametrize("thr,alpha", [(0.09, 0.3), (0.3, 0.09), (0.0, 0.0), (0.6, 0.8)])
@pytest.mark.parametrize("B,N,V", SHAPES)
def test_matches_reference(device, dtype, B, N, V, thr, alpha):
    if V == 32000 and (thr, alpha) != (0.09, 0.3):
        pytest.skip("the threshold grid runs on small vocabularies only (keeps the reference quick)")
    logits, tokens, parents, uniforms, temps = make_case(B, N, V, seed=B * 7919 + N * 31 + V, kind="deep")
    x = logits.to(dtype)
    got = run_op(device, x, tokens, parents, uniforms, temps, posterior_threshold=thr, posterior_alpha=alpha)
    assert isinstance(got, ops.Verification) and all(t.device.type == device for t in got)
    want = check_vs_ref(got, x, tokens, parents, uniforms, temperature=temps, posterior_threshold=thr,
                        posterior_alpha=alpha)
    if N >= 26:
        assert int(want[1].max()) >= 2, "the planted path should make the reference accept several nodes"


@pytest.mark.parametrize("B,N,V", [(7, 26, 7), (3, 64, 111), (3, 26, 32000)])
def test_temperature_zero_is_greedy_acceptance(device, dtype, B, N, V):
    """At T = 0 a node is acceptable iff its token is its parent's argmax; with distinct sibling tokens that is the
    greedy path, and next_token (drawn from a one-hot) is the argmax."""
    gen = make_gen(N + V)
    parents = random_parents(B, N, gen, "random")
    tokens = distinct_sibling_tokens(parents, V, gen)
    logits = random_logits(B, N, V, gen)
    plant_path(logits, tokens, parents, gen, boost=1.0, rows=range(B), deepest=True)
    x = logits.to(dtype)
    got = run_op(device, x, tokens, parents, torch.rand(B, generator=gen), 0.0)
    greedy = ops.verify_tree_greedy(*on(device, x, tokens, parents))
    assert_equal_tuples(got, cpu(*greedy), NAMES)
    assert int(greedy[1].max()) >= 2


def test_deepest_path_lowest_index(device):
    """The deepest fully acceptable node wins; equal depths go to the lower node index."""
    V = 6
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 4]])
    tokens = torch.tensor([[-1, 1, 2, 3, 4, 5, 0]])
    logits = torch.full((1, 7, V), -10.0)
    logits[0, 0, [1, 2]] = 5.0        # nodes 1 and 2 acceptable (p = 0.5 each)
    logits[0, 1, 3] = 5.0             # node 3 (depth 2)
    logits[0, 2, [4, 5]] = 5.0        # nodes 4, 5 (depth 2)
    logits[0, 4, 1] = 5.0             # node 6 has token 0: not acceptable
    got = run_op(device, logits, tokens, parents, torch.tensor([0.3]), 1.0)
    assert got.accepted.cpu().tolist() == [[0, 1, 3, -1, -1, -1, -1]]
    check_vs_ref(got, logits, tokens, parents, torch.tensor([0.3]), temperature=1.0)
    logits[0, 4, 0] = 5.0             # now node 6 (depth 3) is acceptable
    got = run_op(device, logits, tokens, parents, torch.tensor([0.3]), 1.0)
    assert got.accepted.cpu().tolist() == [[0, 2, 4, 6, -1, -1, -1]]
    check_vs_ref(got, logits, tokens, parents, torch.tensor([0.3]), temperature=1.0)


@pytest.mark.parametrize("layout", ["gap", "transposed"])
def test_strided_logits(device, dtype, layout):
    logits, tokens, parents, uniforms, temps = make_case(3, 26, 111, seed=5, kind="deep")
    x = logits.to(dtype).to(device)
    a = run_op(device, x, tokens, parents, uniforms, temps)
    b = run_op(device, strided_rows(x, layout), tokens, parents, uniforms, temps)
    assert_equal_tuples(b, cpu(*a), NAMES)


# ---------------------------------------------------------------------------------------------------------------
# Validation.


def _msg(s):
    return "verify_tree_typical: " + s


BAD = {
    "temperature_negative": (lambda l, t, p, T: T.__setitem__(1, -0.1), _msg("temperature[1] must be finite and >= 0 (0 = greedy)")),
    "temperature_nan": (lambda l, t, p, T: T.__setitem__(1, math.nan), _msg("temperature[1] must be finite and >= 0 (0 = greedy)")),
    "bad_root": (lambda l, t, p, T: p.__setitem__((1, 0), 1),
                 _msg("parents[1, 0] must be -1 (node 0 is the root), got 1")),
    "parent_not_earlier": (lambda l, t, p, T: p.__setitem__((1, 5), 5),
                           _msg("parents[1, 5] = 5 is not an earlier node: expected 0 <= parent < 5 "
                                "(nodes are topologically ordered and only node 0 is a root)")),
    "token_out_of_range": (lambda l, t, p, T: t.__setitem__((1, 3), 1000),
                           _msg("tokens[1, 3] = 1000 is out of range for the vocabulary")),
    "nan_logits": (lambda l, t, p, T: l.__setitem__((1, 0, 6), math.nan), _msg("logits[1, 0, 6] is NaN or +inf")),
    "inf_logits_deeper": (lambda l, t, p, T: l.__setitem__((1, 2, 0), math.inf), _msg("logits[1, 2, 0] is NaN or +inf")),
    "all_neg_inf": (lambda l, t, p, T: l.__setitem__((1, 0), -math.inf),
                    _msg("logits[1, 0] is -inf everywhere: no token can be chosen")),
}


def _bad(case):
    logits, tokens, parents, uniforms, _ = make_case(3, 6, 11, seed=9, kind="chain")
    for b in range(3):  # every draft overwhelmingly likely: every node is reached
        for i in range(1, 6):
            logits[b, i - 1, tokens[b, i]] = logits[b, i - 1].max() + 15.0
    temps = torch.ones(3)
    BAD[case][0](logits, tokens, parents, temps)
    return logits, tokens, parents, uniforms, temps, BAD[case][1]


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_error(device, dtype, case):
    logits, tokens, parents, uniforms, temps, msg = _bad(case)
    x = logits.to(dtype)
    assert expected_error(run_ref, x, tokens, parents, uniforms, temps) == msg
    assert_raises_exactly(msg, run_op, device, x, tokens, parents, uniforms, temps)


@pytest.mark.parametrize("case", sorted(BAD))
def test_no_validate_sentinels(device, dtype, case):
    logits, tokens, parents, uniforms, temps, _ = _bad(case)
    x = logits.to(dtype)
    got = cpu(*run_op(device, x, tokens, parents, uniforms, temps, validate=False))
    check_vs_ref(got, x, tokens, parents, uniforms, temperature=temps, validate=False)
    assert got[0][1].tolist() == [-1] * 6 and int(got[1][1]) == 0 and int(got[2][1]) == -1
    good = torch.tensor([0, 2])
    check_vs_ref(tuple(t[good] for t in got), x[good], tokens[good], parents[good], uniforms[good],
                 temperature=temps[good])
    assert int(got[1][0]) == 5


def test_threshold_close_to_one(device):
    """posterior_alpha = posterior_threshold = 1 with a near-certain target: p(x) = 1 - 7e-10 exceeds
    exp(-H) = 1 - 1.6e-8, so the node is acceptable (as the reference says). The comparison must not round the
    threshold to float32 (which gives exactly 1.0 and rejects every token)."""
    x = torch.tensor([2.3122074604034424, -2.795747756958008, 2.1862528324127197, 1.7173027992248535,
                      18.53555679321289, -0.7312676310539246, 3.5355563163757324]).expand(1, 2, 7).contiguous()
    tokens, parents, u = torch.tensor([[-1, 4]]), torch.tensor([[-1, 0]]), torch.tensor([0.5])
    p, thr = ref.typical_threshold(x[0, 0], 0.7, 1.0, 1.0)
    assert float(p[4]) > thr > 1 - 2**-25  # the threshold rounds to 1.0 in float32
    got = run_op(device, x, tokens, parents, u, 0.7, posterior_threshold=1.0, posterior_alpha=1.0)
    want = check_vs_ref(got, x, tokens, parents, u, temperature=0.7, posterior_threshold=1.0, posterior_alpha=1.0)
    assert int(want[1][0]) == 1
