"""Extreme temperatures in every sampling op: [0, 1e-5) is greedy (params.h kGreedyTemperature); above it, weights
are exp((logits - max) / T), so huge logits over a small temperature do not overflow (logits / T would be +inf and
the weights NaN); +inf and NaN temperatures are refused by the kernels and the reference alike (issue 19)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_equal_tuples, assert_raises_exactly, expected_error, make_gen, on, random_logits, \
    random_parents, random_tokens
from specdec_ext import ops
from specdec_ext.ops import reference


@pytest.mark.parametrize("temperature", [1e-30, 1e-9, 9.9e-6])
def test_sample_tokens_tiny_temperature_is_greedy(device, temperature):
    logits = torch.tensor([[1e30, 3e30, 2.0, -5.0], [0.5, 0.25, 0.75, 0.7]])
    uniforms = torch.tensor([0.99, 0.01])
    tokens, probs = ops.sample_tokens(*on(device, logits, uniforms), temperature=temperature)
    assert tokens.cpu().tolist() == logits.argmax(-1).tolist()
    assert torch.equal(probs.cpu(), torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    want = reference.sample_tokens(logits, uniforms, torch.full((2,), temperature), torch.zeros(2, dtype=torch.long),
                                   torch.ones(2))
    assert torch.equal(tokens.cpu(), want[0])


def test_just_above_the_greedy_threshold_samples(device):
    # 1e-5 itself is a real temperature: the distribution is still (numerically) one-hot here, but it goes
    # through the sampling path and must agree with the reference.
    gen = make_gen(7)
    logits = random_logits(1, 1, 50, gen)[0] * 1e-4
    uniforms = torch.rand(1, generator=gen)
    got = ops.sample_tokens(*on(device, logits, uniforms), temperature=1e-5)
    want = reference.sample_tokens(logits, uniforms, torch.full((1,), 1e-5), torch.zeros(1, dtype=torch.long),
                                   torch.ones(1))
    assert torch.equal(got[0].cpu(), want[0])


def test_verify_tree_sampling_tiny_temperature_equals_greedy(device):
    gen = make_gen(11)
    B, N, V = 4, 9, 64
    parents = random_parents(B, N, gen)
    tokens = random_tokens(B, N, V, gen)
    logits = random_logits(B, N, V, gen) * 1e6  # large logits: dividing by 1e-30 would overflow
    uniforms = torch.rand(B, N, generator=gen)
    greedy = ops.verify_tree_greedy(*on(device, logits, tokens, parents))
    sampled = ops.verify_tree_sampling(*on(device, logits, tokens, parents, uniforms), temperature=1e-30)
    for g, s in zip(greedy, sampled):
        assert torch.equal(g.cpu(), s.cpu())


# Rows whose logits / T overflow float32 (max |logit| / T > 3.4e38) or whose -inf logits would give -inf / T: the
# kernels must give the reference's answer, not NaN weights or a -1 token.
HUGE = torch.tensor([[3e38, 1e38, -3e38, 2.9e38, float("-inf")],
                     [-3e38, -3.3e38, float("-inf"), -3.1e38, -3e38],
                     [1e30, 1e30, 0.0, -1e30, 5.0]])


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 0.5, 1.0, 1e30, 3e38])
def test_huge_logits_agree_with_the_reference(device, temperature):
    R, V = HUGE.shape
    params = (torch.full((R,), temperature), torch.zeros(R, dtype=torch.long), torch.ones(R))
    for u in (0.01, 0.49, 0.51, 0.99):
        uniforms = torch.full((R,), u)
        got = ops.sample_tokens(*on(device, HUGE, uniforms), temperature=temperature)
        want = reference.sample_tokens(HUGE, uniforms, *params)
        assert torch.equal(got[0].cpu(), want[0]) and bool((got[0] >= 0).all())
        torch.testing.assert_close(got[1].cpu(), want[1], atol=1e-6, rtol=1e-5)
    # The same rows as a verification chain: node 0's logits are each row, the draft is token 3.
    logits = torch.stack([HUGE, HUGE], 1)  # [R, 2, V]
    tokens = torch.tensor([[0, 3]] * R)
    parents = torch.tensor([[-1, 0]] * R)
    for u in (0.1, 0.9):
        uniforms = torch.full((R, 2), u)
        got = ops.verify_tree_sampling(*on(device, logits, tokens, parents, uniforms), temperature=temperature)
        want = reference.verify_tree_sampling(logits, tokens, parents, None, uniforms, *params)
        assert_equal_tuples(got, want, ["accepted", "accept_len", "next_token"])
        got = ops.verify_tree_typical(*on(device, logits, tokens, parents, uniforms[:, 0].contiguous()),
                                      temperature=temperature)
        want = reference.verify_tree_typical(logits, tokens, parents, uniforms[:, 0], params[0], 0.09, 0.3)
        assert_equal_tuples(got, want, ["accepted", "accept_len", "next_token"])


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1e-30])
def test_infinite_temperature_is_refused_like_the_reference(device, temperature):
    """T = +inf has no single meaning (-inf / inf is NaN; the limit depends on top-k): both refuse it."""
    logits = torch.tensor([[[0.0, float("-inf"), 1.0, 2.0], [0.0, 0.0, 0.0, 0.0]]])
    tokens, parents, uniforms = torch.tensor([[0, 2]]), torch.tensor([[-1, 0]]), torch.tensor([[0.3, 0.5]])
    T, k, p = torch.tensor([temperature]), torch.zeros(1, dtype=torch.long), torch.ones(1)
    message = expected_error(reference.verify_tree_sampling, logits, tokens, parents, None, uniforms, T, k, p)
    assert message == "verify_tree_sampling: temperature[0] must be finite and >= 0 (0 = greedy)"
    assert_raises_exactly(message, ops.verify_tree_sampling, *on(device, logits, tokens, parents, uniforms),
                          temperature=temperature)
    message = expected_error(reference.sample_tokens, logits[0], uniforms[0], T.expand(2), k.expand(2), p.expand(2))
    assert_raises_exactly(message, ops.sample_tokens, *on(device, logits[0], uniforms[0]), temperature=temperature)
    message = expected_error(reference.verify_tree_typical, logits, tokens, parents, uniforms[:, 0], T, 0.09, 0.3)
    assert_raises_exactly(message, ops.verify_tree_typical, *on(device, logits, tokens, parents, uniforms[:, 0]),
                          temperature=temperature)
