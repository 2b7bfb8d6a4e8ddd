"""specdec_ext.generate, greedy: plain decoding and every drafter give exactly Hugging Face's greedy output.

Tiny random models (Llama, Qwen3 and Gemma3, float32, CPU). The n-gram drafter is made to accept (random tiny models
fall into cycles under greedy decoding; a repetitive prompt helps) and the draft-model drafter (chain and top-k
tree) uses a slightly perturbed copy of the target, so that both accept drafts: the tests assert mean accepted
length > 1 and count the target's forwards (one per step, plus at most one prefill) so that they cannot pass
vacuously or hide extra passes.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from helpers import record_valid_at_propose  # noqa: E402
from hf_reference import CountForwards, hf_greedy  # noqa: E402
from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext import ops  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, NgramDrafter, ngram_lookup  # noqa: E402
import specdec_ext.drafters.draft_model as draft_model_module  # noqa: E402
from specdec_ext.drafters.base import all_unsure  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.fast_linear import pack_linears, packed_enabled  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


_MODELS: dict = {}


def target(family: str):
    if family not in _MODELS:
        _MODELS[family] = make_model(family, seed=11)
    return _MODELS[family]


def perturbed_copy(model, scale: float = 1e-3, seed: int = 0):
    d = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return d


def make_drafter(kind: str, model, k: int = 4):
    if kind == "plain":
        return None
    if kind == "ngram":
        return NgramDrafter(num_pred_tokens=k, max_ngram_size=3)
    if kind == "tree":  # top-2 tree: 1 + 2 * k nodes
        return DraftModelDrafter(perturbed_copy(model, scale=3e-3), num_draft_tokens=k, tree_width=2)
    if kind == "dynamic":  # EAGLE-2 tree of the draft model's own probabilities: depth k, 6 drafts
        return DraftModelDrafter(perturbed_copy(model, scale=3e-3), num_draft_tokens=k, tree_width=2, total_tokens=6)
    return DraftModelDrafter(perturbed_copy(model), num_draft_tokens=k)




def prompt_of(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(3, V, (max(1, (length + 1) // 2),), generator=gen).tolist()
    return (base * 2)[:length]  # repetitive: the n-gram drafter finds matches in the prompt itself


def run_and_check(model, drafter, prompt, max_new_tokens, eos=None):
    with CountForwards(model) as counter:
        out, stats = generate(model, drafter, torch.tensor(prompt), max_new_tokens=max_new_tokens,
                              eos_token_id=eos if eos is not None else [])
    new = out[len(prompt):].tolist()
    assert out[: len(prompt)].tolist() == prompt
    assert stats.target_forwards == stats.steps
    assert counter.calls == stats.target_forwards + stats.prefill_forwards  # no hidden target passes
    assert stats.prefill_forwards == (1 if len(prompt) > 1 else 0)
    assert stats.new_tokens == len(new)
    assert sum(stats.accept_hist) == stats.steps
    assert stats.new_tokens <= sum((d + 1) * c for d, c in enumerate(stats.accept_hist))
    assert stats.mean_accepted_length == pytest.approx(len(new) / stats.steps)
    return new, stats


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("kind", ["plain", "ngram", "draft", "tree", "dynamic"])
def test_greedy_equals_hf_generate(family, kind):
    model = target(family)
    accepted_lengths = []
    for plen, max_new, seed in [(1, 9, 0), (6, 1, 1), (11, 24, 2), (4, 13, 3)]:
        prompt = prompt_of(plen, seed)
        want = hf_greedy(model, prompt, max_new)
        got, stats = run_and_check(model, make_drafter(kind, model), prompt, max_new)
        assert got == want, (plen, max_new, seed)
        accepted_lengths.append(stats.mean_accepted_length)
        if kind == "plain":
            assert stats.steps == max_new and stats.accept_hist[0] == max_new
    if kind != "plain":
        assert max(accepted_lengths) > 1.2, accepted_lengths  # drafts were accepted


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft", "dynamic"])
def test_packed_target_greedy_equals_hf_generate(kind):
    """A target prepared with pack_linears multiplies through the packed_linear kernel inside generate (plain and
    speculative decoding alike) and still gives HF's greedy output (HF's generate, outside the block: aten)."""
    model = copy.deepcopy(target("llama"))
    assert pack_linears(model) > 0
    for plen, max_new, seed in [(1, 9, 0), (11, 24, 2)]:
        prompt = prompt_of(plen, seed)
        got, _ = run_and_check(model, make_drafter(kind, target("llama")), prompt, max_new)
        assert got == hf_greedy(model, prompt, max_new), (plen, max_new, seed)
    if packed_enabled(torch.float32):
        assert model.lm_head._specdec_packed is not None  # the kernel ran


@pytest.mark.parametrize("kind", ["ngram", "draft", "tree", "dynamic"])
def test_eos_and_budget_inside_an_accepted_run(kind):
    """EOS at every position of the first accepted runs, and budgets ending anywhere: output is HF's."""
    model = target("llama")
    prompt = prompt_of(8, 5)
    full = hf_greedy(model, prompt, 24)
    inside = 0
    checked_hf = False
    for j in range(1, 12):
        eos = full[j]
        if eos in full[:j]:
            continue
        want = full[: j + 1]
        if not checked_hf:  # HF's semantics of eos_token_id, once
            assert hf_greedy(model, prompt, 24, eos=eos) == want
            checked_hf = True
        drafter = make_drafter(kind, model)
        got, stats = run_and_check(model, drafter, prompt, 24, eos=eos)
        assert got == want, j
        # EOS was emitted by a step that accepted drafts after it was proposed (inside an accepted run)
        inside += int(stats.steps < len(got))
    assert inside > 0
    for max_new in (2, 3, 5, 6, 7):
        got, _ = run_and_check(model, make_drafter(kind, model), prompt, max_new)
        assert got == full[:max_new]


def test_draft_model_identical_to_target_accepts_everything():
    model = target("qwen3")
    prompt = prompt_of(5, 9)
    want = hf_greedy(model, prompt, 23)
    drafter = DraftModelDrafter(copy.deepcopy(model), num_draft_tokens=4)
    got, stats = run_and_check(model, drafter, prompt, 23)
    assert got == want
    # 23 tokens = 4 full steps of 5 (4 drafts + bonus), then a step truncated to the budget: 3 tokens
    assert stats.steps == 5 and stats.mean_accepted_length == pytest.approx(23 / 5)
    assert stats.accept_hist[4] == 4 and stats.accept_hist[2] == 1
    assert stats.acceptance_by_depth[0] == 1.0
    # the prompt's prefill in begin(), then per step: catch-up (the root) + (k - 1) chain forwards; last step k = 2
    assert stats.draft_forwards == 1 + 4 * 4 + 2


@pytest.mark.parametrize("threshold", [0.65, 0.7])
def test_draft_model_confidence_threshold_stops_chains_early_and_stays_greedy_identical(threshold, monkeypatch):
    """An unsure draft stops its chain early (shorter trees, fewer draft forwards per step) and the output stays
    plain greedy's, at one row and in a batch; each chain ends at the first draft every row was unsure of."""
    model = copy.deepcopy(target("llama"))
    with torch.no_grad():  # sharper than the random init's near-uniform distributions: drafts are sure now and then
        model.lm_head.weight.mul_(16.0)
    draft = perturbed_copy(model, scale=0.03)
    for prompts in ([prompt_of(6, 3)], [prompt_of(6, 3), prompt_of(3, 4), prompt_of(9, 5)]):
        want = [hf_greedy(model, p, 24) for p in prompts]
        drafter = DraftModelDrafter(draft, num_draft_tokens=5, confidence_threshold=threshold)
        sizes, stops = [], []
        propose, unsure = drafter.propose, all_unsure

        def spy_unsure(logits, tok, probs, limit):
            conf = torch.softmax(logits.float(), -1).amax(-1)  # greedy: the argmax's probability
            stops.append(bool((conf < threshold).all()))
            assert limit == threshold and unsure(logits, tok, probs, limit) == stops[-1]
            return stops[-1]

        def spy_propose(state, max_depth, max_nodes):
            tree = propose(state, max_depth, max_nodes)
            sizes.append(tree.num_nodes)
            return tree

        drafter.propose = spy_propose
        monkeypatch.setattr(draft_model_module, "all_unsure", spy_unsure)
        out, stats = generate(model, drafter, [torch.tensor(p) for p in prompts], max_new_tokens=24,
                              eos_token_id=[])
        assert [o[len(p):].tolist() for o, p in zip(out, prompts)] == want
        assert any(stops) and not all(stops), stops
        assert min(sizes) < 6 and max(sizes) == 6, sizes  # some chains stopped early, some ran to k = 5
        # per step: the catch-up forward, then one per draft but the last
        assert stats.draft_forwards == 1 + sum(n - 1 for n in sizes)


def test_confidence_threshold_bad_arguments_name_it():
    model = target("llama")
    for bad in (1.0, -0.1, "0.5", True):
        with pytest.raises(ValueError, match="confidence_threshold must be a number in \\[0, 1\\)"):
            DraftModelDrafter(model, confidence_threshold=bad)
    with pytest.raises(ValueError, match="confidence_threshold applies to chains"):
        DraftModelDrafter(model, tree_width=2, confidence_threshold=0.5)


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft", "tree", "dynamic"])
def test_batch_of_prompts_of_different_lengths(kind):
    """Rows finish at different steps (EOS, budget inside an accepted run): each row equals its own HF run."""
    model = target("llama")
    prompts = [prompt_of(n, 20 + n) for n in (1, 7, 12)]
    fulls = [hf_greedy(model, p, 14) for p in prompts]
    eos = fulls[1][3] if fulls[1][3] not in fulls[1][:3] else None
    eos_list = [eos] if eos is not None else []
    drafter = make_drafter(kind, model)
    out, stats = generate(model, drafter, prompts, max_new_tokens=14, eos_token_id=eos_list)
    for p, row, full in zip(prompts, out, fulls):
        want = full
        if eos is not None and eos in full:
            want = full[: full.index(eos) + 1]
        assert row.tolist() == p + want
    assert stats.new_tokens == sum(len(r) - len(p) for r, p in zip(out, prompts))
    # 2-D input: padded tensor output
    out2, _ = generate(model, make_drafter(kind, model), torch.tensor([prompts[1], prompts[1]]), max_new_tokens=5,
                       eos_token_id=[], pad_token_id=0)
    assert out2.shape == (2, 12) and out2[0].tolist() == out2[1].tolist() == prompts[1] + fulls[1][:5]


def test_streamer_receives_prompt_then_every_token():
    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    model = target("llama")
    prompt = prompt_of(6, 4)
    s = Collect()
    out, _ = generate(model, NgramDrafter(4), torch.tensor([prompt]), max_new_tokens=12, eos_token_id=[], streamer=s)
    assert s.ended and s.puts[0] == [prompt]
    assert sum(s.puts[1:], []) == out[0, 6:].tolist()


def test_ngram_lookup():
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 2, 3]
    assert ngram_lookup(ctx, 3, 4) == [7, 8, 2, 3]  # "2 3" most recently followed by 7 8 ...
    assert ngram_lookup(ctx, 3, 2) == [7, 8]
    assert ngram_lookup([5, 6, 7], 3, 4) == []
    assert ngram_lookup([5, 5], 2, 3) == [5]
    assert ngram_lookup([4], 3, 3) == []
    assert ngram_lookup(ctx + [5], 3, 4, min_ngram_size=2) == []


def test_top_k_tree_accepts_other_branches():
    """With a draft whose argmax often differs from the target's, the top-3 tree's other branches get accepted."""
    model = target("llama")
    prompt = prompt_of(11, 2)
    drafter = DraftModelDrafter(perturbed_copy(model, scale=3e-3), num_draft_tokens=4, tree_width=3)
    first_nodes = []
    observe = drafter.observe

    def recording(state, tree, result):
        if tree.num_nodes > 1:
            first_nodes.append(int(result.accepted[0, 1]))
        observe(state, tree, result)

    drafter.observe = recording
    got, stats = run_and_check(model, drafter, prompt, 40)
    assert got == hf_greedy(model, prompt, 40)
    assert drafter.max_nodes == 13 and stats.mean_accepted_length > 2
    assert {2, 3} & set(first_nodes), first_nodes  # a second or third branch was the accepted one


def test_dynamic_tree_of_the_draft_model():
    """The draft model's EAGLE-2 tree: one catch-up forward and one forward per further level each step, other
    branches than the draft's argmax accepted, the calibrated scale learned, and the output plain greedy's."""
    model = target("llama")
    prompt = prompt_of(11, 2)
    drafter = DraftModelDrafter(perturbed_copy(model, scale=3e-3), num_draft_tokens=4, tree_width=3,
                                total_tokens=9)
    assert drafter.max_nodes == 10
    trees, firsts = [], []
    propose, observe = drafter.propose, drafter.observe

    def spy_propose(state, max_depth, max_nodes):
        before = drafter.forwards
        tree = propose(state, max_depth, max_nodes)
        depth = int(ops.build_tree(tree.parents, torch.zeros(1, dtype=torch.int64)).depth.max())
        trees.append((tree.num_nodes, depth, drafter.forwards - before, min(4, max_depth)))
        return tree

    def spy_observe(state, tree, result):
        if tree.num_nodes > 1 and int(result.accept_len[0]) > 0:
            firsts.append(int(result.accepted[0, 1]))  # the accepted depth-1 node
        observe(state, tree, result)

    drafter.propose, drafter.observe = spy_propose, spy_observe
    got, stats = run_and_check(model, drafter, prompt, 40)
    assert got == hf_greedy(model, prompt, 40)
    assert stats.mean_accepted_length > 2
    for nodes, depth, forwards, levels in trees:
        if nodes > 1:  # the catch-up + one forward per level below the first; the best 9 may not reach the last
            assert nodes <= 10 and depth <= levels and forwards == levels
    assert max(t[1] for t in trees) >= 2 and max(t[0] for t in trees) == 10  # (flat random models: shallow trees)
    assert 1 in firsts and set(firsts) - {1}, firsts  # the draft's best child, and others, were accepted
    assert drafter.score_scale != 1.0  # calibrated during the generation
    with pytest.raises(ValueError, match="total_tokens makes a dynamic tree, which needs tree_width >= 2"):
        DraftModelDrafter(model, tree_width=1, total_tokens=4)
    with pytest.raises(ValueError, match="total_tokens must be an integer >= 1"):
        DraftModelDrafter(model, tree_width=2, total_tokens=0)
    for kw, name in (({"num_draft_tokens": 0}, "num_draft_tokens"), ({"tree_width": 0}, "tree_width")):
        with pytest.raises(ValueError, match=f"DraftModelDrafter: {name} must be an integer >= 1"):
            DraftModelDrafter(model, **kw)
    with pytest.raises(ValueError, match="calibration_rate must be a number in \\(0, 1\\]"):
        DraftModelDrafter(model, tree_width=2, total_tokens=4, calibration_rate=2.0)


def test_ngram_index_equals_the_scan():
    """The drafter's incremental n-gram index proposes exactly what the plain scan (ngram_lookup) proposes, also
    after plain steps that skipped it."""
    from specdec_ext.drafters import DecodeState

    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        vocab = 3 + trial % 5
        ctx = torch.randint(0, vocab, (1,), generator=gen).tolist()
        state = DecodeState.of_prompts([ctx], max_len=1, vocab_size=vocab)
        drafter = NgramDrafter(num_pred_tokens=4, max_ngram_size=3, min_ngram_size=1 + trial % 2)
        drafter.begin(None, state)
        for step in range(15):
            want = ngram_lookup(ctx, 3, 4, drafter.min_ngram_size)
            if step % 3 == 1:  # a plain step (depth 0) now and then: no lookup, the index catches up later
                state = DecodeState.of_prompts([ctx], max_len=len(ctx), vocab_size=vocab)
                assert drafter.propose(state, 0, 5).num_nodes == 1
            else:
                assert drafter._lookup(0, ctx, 4) == want, ctx
            ctx.extend(torch.randint(0, vocab, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                     generator=gen).tolist())


def test_draft_model_prefills_its_cache_in_begin():
    """The draft model reads the prompt (all but the root) during the generation's prefill, so the first decoding
    step feeds only the root; output unchanged."""
    model = target("llama")
    drafter = DraftModelDrafter(copy.deepcopy(model), num_draft_tokens=3)
    seen = record_valid_at_propose(drafter)
    prompts = [prompt_of(11, 3), prompt_of(4, 4)]
    outs, _ = generate(model, drafter, prompts, max_new_tokens=6, eos_token_id=[])
    assert seen[0] == [10, 3]
    for p, o in zip(prompts, outs):
        assert o[len(p):].tolist() == hf_greedy(model, p, 6)
