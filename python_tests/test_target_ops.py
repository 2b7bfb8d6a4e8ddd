"""The target's verification forward as op calls (``tree_forward(..., step_ops=LlamaStepOps)``), which the engine
takes on CPUs for Llama / Mistral / Qwen2 targets.

* Against the modules' route of the same ``tree_forward`` (the kernel route through Hugging Face's modules): logits,
  every hidden state of ``output_hidden_states`` and every written K/V entry agree to float32 rounding, for random
  trees and chains over two rows at different prefix lengths, with ``logits_to_keep``.
* Bit for bit against itself: a tree node's logits equal those of decoding its root path one token at a time
  through the same route (what greedy identity between speculative and plain decoding rests on), and a row's logits
  do not depend on the other rows of the batch.
* Through ``generate``: greedy output equals Hugging Face's own ``generate`` for plain decoding, a draft model and
  EAGLE, with the op route taking every step; the engine keeps the modules where the ops do not serve (hooks,
  ``packed_linears=False``, ``tree_attention=False``, another architecture).
* Bad token ids are a named error, not an out-of-range read.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import hf_greedy  # noqa: E402
from test_drafter_eagle import random_draft, target as eagle_target  # noqa: E402
from test_hf_tree_attention import V, make_model, random_tree, root_path  # noqa: E402

from specdec_ext import Engine  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, EagleDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models import fast_linear, make_cache, tree_forward, use_tree_attention  # noqa: E402
from specdec_ext.models.llama_step import LlamaStepOps  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not fast_linear.packed_enabled(torch.float32),
                                 reason="no packed float32 kernel on this CPU: the target keeps its modules")]

S = 64  # cache positions


def _target(family: str, seed: int = 3, **overrides):
    model = make_model(family, seed=seed, **overrides)
    fast_linear.pack_linears(model)
    use_tree_attention(model)
    return model


def _ops(model, cache):
    with torch.no_grad():
        ops = LlamaStepOps.build(model, cache)
    assert ops is not None
    return ops


def _prefilled(model, prompts: torch.Tensor, lens: list[int], step_ops=None):
    cache = make_cache(model.config, prompts.shape[0], S)
    with fast_linear.packed_linears():
        tree_forward(model, cache, prompts, None, 0, step_ops=step_ops.on(cache) if step_ops else None)
    cache.rewind(torch.tensor(lens))
    return cache


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_op_route_matches_the_modules(family, shape):
    model = _target(family)
    g = torch.Generator().manual_seed(11)
    lens = [13, 7]
    prompts = torch.randint(0, V, (2, 13), generator=g)
    mod_cache = _prefilled(model, prompts, lens)
    ops = _ops(model, mod_cache)
    op_cache = _prefilled(model, prompts, lens, ops)
    N = 9
    tokens = torch.randint(0, V, (2, N), generator=g)
    parents = random_tree(g, 2, N) if shape == "tree" else None
    prefix = torch.tensor(lens)
    with fast_linear.packed_linears():
        want = tree_forward(model, mod_cache, tokens, parents, prefix, return_outputs=True,
                            output_hidden_states=True)
        got = tree_forward(model, op_cache, tokens, parents, prefix, return_outputs=True, output_hidden_states=True,
                           step_ops=ops.on(op_cache))
        last = tree_forward(model, op_cache, tokens, parents, prefix, logits_to_keep=1, step_ops=ops.on(op_cache))
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(last, want.logits[:, -1:], atol=2e-5, rtol=1e-4)
    assert len(got.hidden_states) == len(want.hidden_states) == model.config.num_hidden_layers + 1
    for mine, theirs in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for b, n in enumerate(lens):  # every K/V entry the forwards wrote (and the prefix), in every layer
        for mine, theirs in zip(op_cache.layers, mod_cache.layers):
            torch.testing.assert_close(mine.keys[b, :, : n + N], theirs.keys[b, :, : n + N], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values[b, :, : n + N], theirs.values[b, :, : n + N], atol=2e-5,
                                       rtol=1e-4)
    assert op_cache.lengths.tolist() == lens  # rewound to the prefix, as the modules' route leaves it


@pytest.mark.parametrize("layers", [(-1,), (0, 2, -1), (1,)])
def test_hidden_layers_keep_only_the_entries_asked_for(layers):
    """``hidden_layers`` (the engine passes a drafter's ``hidden_state_layers``): the op route's tuple has every
    entry's place, the asked ones bitwise those of the whole tuple and the others None."""
    model = _target("llama", num_hidden_layers=3)
    g = torch.Generator().manual_seed(4)
    lens = [9, 6]
    prompts = torch.randint(0, V, (2, 9), generator=g)
    ops = _ops(model, make_cache(model.config, 2, S))
    tokens = torch.randint(0, V, (2, 5), generator=g)
    parents = random_tree(g, 2, 5)
    outs = []
    for hidden_layers in (None, layers):
        cache = _prefilled(model, prompts, lens, ops)
        with fast_linear.packed_linears():
            outs.append(tree_forward(model, cache, tokens, parents, torch.tensor(lens), return_outputs=True,
                                     output_hidden_states=True, hidden_layers=hidden_layers,
                                     step_ops=ops.on(cache)))
    whole, some = outs
    count = model.config.num_hidden_layers + 1
    assert len(some.hidden_states) == len(whole.hidden_states) == count
    kept = {i % count for i in layers}
    for i, (mine, theirs) in enumerate(zip(some.hidden_states, whole.hidden_states)):
        assert (mine is None) == (i not in kept), i
        if mine is not None:
            assert torch.equal(mine, theirs), i
    assert torch.equal(some.logits, whole.logits)
    cache = _prefilled(model, prompts, lens, ops)
    with fast_linear.packed_linears(), pytest.raises(ValueError, match=r"hidden_states: entries must be integers "
                                                                       r"in \[-4, 4\)"):
        tree_forward(model, cache, tokens, parents, torch.tensor(lens), output_hidden_states=True,
                     hidden_layers=(4,), step_ops=ops.on(cache))


def test_a_tree_node_gets_the_bits_of_decoding_its_path():
    model = _target("llama", seed=5)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, V, (1, 10), generator=g)
    cache = _prefilled(model, prompt, [10])
    ops = _ops(model, cache)
    cache = _prefilled(model, prompt, [10], ops)
    N = 10
    tokens = torch.randint(0, V, (1, N), generator=g)
    parents = random_tree(g, 1, N)
    with fast_linear.packed_linears():
        tree = tree_forward(model, cache, tokens, parents, 10, step_ops=ops.on(cache))
        for leaf in (N - 1, N - 3):
            path = root_path(parents[0].tolist(), leaf)
            step = make_cache(model.config, 1, S)
            tree_forward(model, step, prompt, None, 0, step_ops=ops.on(step))
            for depth, node in enumerate(path):  # one token at a time, each attending to the path before it
                one = tree_forward(model, step, tokens[:, node: node + 1], None, 10 + depth, step_ops=ops.on(step))
                assert torch.equal(one[0, 0], tree[0, node]), (leaf, depth)


def test_a_row_does_not_depend_on_its_batch():
    model = _target("qwen2", seed=6)
    g = torch.Generator().manual_seed(8)
    prompts = torch.randint(0, V, (3, 12), generator=g)
    lens = [12, 5, 9]
    cache = _prefilled(model, prompts, lens)
    ops = _ops(model, cache)
    cache = _prefilled(model, prompts, lens, ops)
    tokens = torch.randint(0, V, (3, 6), generator=g)
    parents = random_tree(g, 3, 6)
    with fast_linear.packed_linears():
        together = tree_forward(model, cache, tokens, parents, torch.tensor(lens), step_ops=ops.on(cache))
        for b in range(3):
            alone = _prefilled(model, prompts[b: b + 1], [lens[b]], ops)
            mine = tree_forward(model, alone, tokens[b: b + 1], parents[b: b + 1], lens[b], step_ops=ops.on(alone))
            assert torch.equal(mine[0], together[b]), b


def _count_runs(monkeypatch) -> list:
    calls = []  # (the layer count of the model each call ran)
    original = LlamaStepOps.run
    monkeypatch.setattr(LlamaStepOps, "run",
                        lambda self, *a, **k: calls.append(len(self._layers)) or original(self, *a, **k))
    return calls


@pytest.mark.parametrize("drafter_kind", ["plain", "draft_model", "eagle"])
def test_generate_greedy_equals_hugging_face_with_the_op_route(monkeypatch, drafter_kind):
    target = eagle_target() if drafter_kind == "eagle" else make_model("llama", seed=7)
    prompt = [5, 17, 3, 99, 42, 8, 23]
    want = hf_greedy(target, prompt, 24)
    drafter = None
    if drafter_kind == "draft_model":
        drafter = DraftModelDrafter(make_model("llama", seed=8, num_hidden_layers=1), num_draft_tokens=4)
    elif drafter_kind == "eagle":  # (EAGLE-3: the target's hidden states of three layers feed the draft)
        drafter = EagleDrafter(random_draft(3), target=target, depth=3, top_k=2, total_tokens=8)
    calls = _count_runs(monkeypatch)
    out, stats = generate(target, drafter, torch.tensor(prompt), max_new_tokens=24, eos_token_id=[])
    assert out[len(prompt):].tolist() == want
    # the prefill and every verification ran as the target's op calls (a draft model's are its own, 1 layer)
    assert calls.count(target.config.num_hidden_layers) == stats.target_forwards + stats.prefill_forwards > 1


def test_the_engine_keeps_the_modules_where_the_ops_do_not_serve():
    target = make_model("llama", seed=1)
    with Engine(target, max_batch=2, max_len=S) as engine:
        assert engine.target_ops is not None
    with Engine(target, max_batch=2, max_len=S, packed_linears=False) as engine:
        assert engine.target_ops is None
    with Engine(target, max_batch=2, max_len=S, tree_attention=False) as engine:
        assert engine.target_ops is None
    handle = target.model.layers[0].register_forward_hook(lambda *a: None)
    try:
        with Engine(target, max_batch=2, max_len=S) as engine:
            assert engine.target_ops is None  # (the hook must run: the modules do)
    finally:
        handle.remove()
    qwen3 = make_model("qwen3", seed=1)  # (q/k norms: not the layer the op computes)
    with Engine(qwen3, max_batch=2, max_len=S) as engine:
        assert engine.target_ops is None


def test_bad_token_ids_are_refused_by_name():
    model = _target("llama")
    cache = make_cache(model.config, 1, S)
    ops = _ops(model, cache)
    with fast_linear.packed_linears(), pytest.raises(ValueError, match=r"tree_forward: tokens must be token ids in"):
        tree_forward(model, cache, torch.tensor([[3, V]]), None, 0, step_ops=ops)
