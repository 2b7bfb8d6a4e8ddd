"""Temperatures in [0, 1e-5) are greedy in every sampling op (params.h kGreedyTemperature): logits divided by a
smaller temperature can overflow float32, which used to turn weights into NaN."""

from __future__ import annotations

import pytest
import torch

from helpers import make_gen, on, random_logits, random_parents, random_tokens
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
