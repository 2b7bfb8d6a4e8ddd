"""The MiniMax hybrid as direct calls (``models.minimax_step.MiniMaxStepOps``, the engine's target route).

* Over prompts of different lengths and two rounds of random trees (rows accepting different lengths), the direct
  route's logits, hidden states and committed states (Lightning states, attention K/V) are bit for bit those of the
  module route (the kernel route through Hugging Face's modules), float32 and bfloat16, routed experts (top-2 of 4)
  and one expert (its router skipped); the tree logits equal Hugging Face's own forward of each path, and the decay
  off by 1e-3 in the Lightning layers breaks that (test_hybrid_minimax's check, through this route).
* The engine builds it for a MiniMax target and greedy decoding through it equals Hugging Face's ``generate``.
* It is refused (None: the modules run) in training mode, with gradients, with a forward hook, over a cache that is
  not the model's hybrid cache, and for other architectures.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hybrid_minimax as hm  # noqa: E402
from helpers import random_parents, root_path  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from test_generate_greedy import prompt_of  # noqa: E402

from specdec_ext.engine import Engine  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models import (TreeKVCache, extend, linear_layers, make_cache, tree_forward,  # noqa: E402
                                use_tree_attention)
from specdec_ext.models.fast_linear import pack_linears, packed_linears  # noqa: E402
from specdec_ext.models.minimax_step import MiniMaxStepOps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def model_of(experts: int, dtype=torch.float32):
    if experts == 4:
        m = copy.deepcopy(hm.target())  # (the shared model stays as the other tests use it)
    else:
        torch.manual_seed(11)
        m = transformers.MiniMaxForCausalLM(hm.minimax_config(num_local_experts=1, num_experts_per_tok=1)).eval()
    m = m.to(dtype)
    use_tree_attention(m)
    pack_linears(m)
    return m


@torch.no_grad()
def rounds(model, direct: bool, seed: int = 1):
    """Two rounds of random trees over three prefilled rows: [(logits, hidden states, linear states, K/V)]."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [prompt_of(n, 20 + n) for n in (5, 9, 2)]
    B, N = len(prompts), 9
    cache = make_cache(model.config, B, 64, dtype=model.dtype)
    toks = torch.zeros(B, max(map(len, prompts)), dtype=torch.int64)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = torch.tensor(p)
    extend(model, cache, toks, torch.tensor([len(p) for p in prompts]))
    ops = MiniMaxStepOps.build(model, cache) if direct else None
    assert (ops is not None) == direct
    seen = []
    for round_ in range(2):
        parents = random_parents(B, N, gen, "random")
        tokens = torch.randint(3, hm.V, (B, N), generator=gen)
        out = tree_forward(model, cache, tokens, parents, cache.lengths, step_ops=ops, return_outputs=True,
                           output_hidden_states=True)
        accepted = torch.full((B, N), -1, dtype=torch.int64)
        accept_len = torch.zeros(B, dtype=torch.int64)
        for b in range(B):
            keep = root_path(parents[b].tolist(), int(torch.randint(0, N, (1,), generator=gen)))[: 1 + round_ + b]
            accepted[b, : len(keep)] = torch.tensor(keep)
            accept_len[b] = len(keep) - 1
        cache.accept(accepted, accept_len, cache.lengths)
        seen.append((out.logits.clone(), [h.clone() for h in out.hidden_states],
                     [cache.linear_state(l).clone() for l in cache.linear_layers],
                     cache.layers[0].keys.clone(), cache.layers[0].values.clone()))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", [4, 1])
def test_direct_route_is_the_module_route_bit_for_bit(experts, dtype):
    model = model_of(experts, dtype)
    with packed_linears():
        direct, modules = rounds(model, True), rounds(model, False)
    for (a_logits, a_hidden, a_states, a_k, a_v), (b_logits, b_hidden, b_states, b_k, b_v) in zip(direct, modules):
        assert torch.equal(a_logits, b_logits)
        assert len(a_hidden) == len(b_hidden) and all(torch.equal(x, y) for x, y in zip(a_hidden, b_hidden))
        assert all(torch.equal(x, y) for x, y in zip(a_states, b_states))
        assert torch.equal(a_k, b_k) and torch.equal(a_v, b_v)


def test_direct_route_equals_hf_and_the_decay_mutation_fails_it(monkeypatch):
    model = hm.target()
    built = []
    real_tree_forward = hm.tree_forward

    def through_direct(m, cache, *args, **kwargs):  # (test_hybrid_minimax's trees, through this route)
        with torch.no_grad():
            ops = MiniMaxStepOps.build(m, cache)
        built.append(ops is not None)
        return real_tree_forward(m, cache, *args, step_ops=ops, **kwargs)

    monkeypatch.setattr(hm, "tree_forward", through_direct)
    logit_err, state_err = hm.tree_errors(model, True, seed=1)
    assert built and all(built)
    assert logit_err < hm.TOL and state_err < hm.TOL, (logit_err, state_err)
    real = linear_layers.lightning_log_decay
    monkeypatch.setattr(linear_layers, "lightning_log_decay", lambda m: real(m) + math.log1p(-1e-3))
    bad_logits, bad_state = hm.tree_errors(model, True, seed=1)
    assert bad_logits > 10 * hm.TOL and bad_state > 10 * hm.TOL, (bad_logits, bad_state)


def test_engine_uses_it_and_greedy_equals_hf():
    model = model_of(1)
    engine = Engine(model, None, max_batch=2, max_len=64)
    assert isinstance(engine.target_ops, MiniMaxStepOps)
    prompts = [prompt_of(n, s) for s, n in ((1, 7), (2, 13))]
    outs, _ = generate(model, None, prompts, max_new_tokens=12, eos_token_id=[])
    assert [o.tolist() for o in outs] == [p + hf_greedy(model, p, 12) for p in prompts]


@torch.no_grad()
def test_refused_where_the_modules_must_run():
    model = hm.target()
    cache = make_cache(model.config, 1, 32)
    assert MiniMaxStepOps.build(model, cache) is not None
    handle = model.model.layers[1].register_forward_hook(lambda *a: None)
    try:
        assert MiniMaxStepOps.build(model, cache) is None
    finally:
        handle.remove()
    model.train()
    try:
        assert MiniMaxStepOps.build(model, cache) is None
    finally:
        model.eval()
    with torch.enable_grad():
        assert MiniMaxStepOps.build(model, cache) is None
    attention_only = TreeKVCache(hm.mixerless_draft(model).config, 1, 32)
    assert MiniMaxStepOps.build(model, attention_only) is None
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=hm.V, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1)).eval()
    assert MiniMaxStepOps.build(llama, make_cache(llama.config, 1, 32)) is None
