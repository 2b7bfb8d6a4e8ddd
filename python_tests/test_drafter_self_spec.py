"""Self-speculation by layer skipping (specdec_ext.drafters.SelfSpecDrafter) and its file.

Tiny random Llama targets (4 layers, float32, CPU) whose layers 1 and 2 are damped (their output projections
scaled down), as the near-identity middle layers of trained models are: skipping them gives drafts that are often
accepted, skipping the others rarely.

* The draft: with the target's KV cache of the prefix, its first chain equals a reference built from Hugging Face
  modules alone (a full-model forward over the prefix into a ``DynamicCache``, then the kept decoder layers one
  token at a time); with no layer skipped it is the target itself and every draft is accepted.
* Greedy output equals Hugging Face's ``generate(do_sample=False)`` for chains and dynamic trees, one prompt and a
  batch of prompts of different lengths (one of a single token), through the engine with rows joining and leaving,
  and inside the adaptive drafter; the target makes one forward per step (the draft never calls it).
* Sampling is lossless: the chi-square test of test_generate_sampling on a 2-layer V = 8 target, for sampled chains
  (with their probabilities) and deterministic dynamic trees.
* The file: a round trip, and every bad content a ValueError naming the field; bad arguments name the argument.
* The tuner (greedy forward selection): with given forward costs, its rounds, its choice (the damped layers, the
  best estimated speedup of everything it measured) and its time budget; ``specdec tune-self-spec`` then
  ``specdec generate --self-spec`` end to end.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

import test_engine as engine_t  # noqa: E402
import test_generate_greedy as greedy_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from test_hf_tree_attention import make_model  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from specdec_ext import AdaptiveDrafter, Engine  # noqa: E402
from specdec_ext.drafters import SelfSpecDrafter  # noqa: E402
from specdec_ext.drafters.self_spec_file import FORMAT, SelfSpecFile, read_self_spec, write_self_spec  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models import TreeKVCache, draft_layer, extend, use_tree_attention  # noqa: E402
from specdec_ext.models.llama_step import LlamaStepOps  # noqa: E402
from specdec_ext.state import DecodeState  # noqa: E402
from specdec_ext.train.self_spec_tune import Costs, tune_self_spec  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")

DAMPED = (1, 2)
_MODELS: dict = {}


def damped(model, layers=DAMPED, scale: float = 0.05):
    """``model`` with the residual branches of ``layers`` scaled by ``scale`` (near-identity layers)."""
    with torch.no_grad():
        for i in layers:
            layer = model.model.layers[i]
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return model


def target(family: str = "llama"):
    if family not in _MODELS:
        _MODELS[family] = damped(make_model(family, seed=11, num_hidden_layers=4))
    return _MODELS[family]


def make_drafter(shape: str, skip=DAMPED[:1], k: int = 4, **kw) -> SelfSpecDrafter:
    if shape == "tree":  # EAGLE-2 tree of the draft's own probabilities: depth k, 3 children a node, 8 drafts
        return SelfSpecDrafter(list(skip), num_draft_tokens=k, tree_width=3, total_tokens=8, **kw)
    return SelfSpecDrafter(list(skip), num_draft_tokens=k, **kw)


# ---------------------------------------------------------------------------------------------------------------
# The draft itself.

@torch.no_grad()
def reference_chain(model, prompt: list[int], skip, k: int) -> list[int]:
    """The greedy draft chain after ``prompt`` from Hugging Face modules alone: the full model over the prompt but
    its last token (the root) into a DynamicCache, then the kept layers one token at a time (a single query
    attends to every cached position), each kept layer reading and extending its own cache layer."""
    m = copy.deepcopy(model)
    m.set_attn_implementation("sdpa")
    cache = DynamicCache(config=m.config)
    if len(prompt) > 1:
        m(torch.tensor([prompt[:-1]]), cache=cache, use_cache=True)
    base, tok, out = m.model, prompt[-1], []
    for i in range(k):
        pos = torch.tensor([[len(prompt) - 1 + i]])
        h = base.embed_tokens(torch.tensor([[tok]]))
        rope = base.rotary_emb(h, pos)
        for idx, layer in enumerate(base.layers):
            if idx not in skip:
                h = layer(h, attention_mask=None, position_embeddings=rope, position_ids=pos, cache=cache,
                          use_cache=True)
        tok = int(m.lm_head(base.norm(h))[0, -1].argmax())
        out.append(tok)
    return out


@pytest.mark.parametrize("route", ["ops", "modules"])
@pytest.mark.parametrize("skip", [(), (1,), (1, 2), (0, 3)])
def test_first_chain_equals_the_hugging_face_reference(skip, route):
    """Rows of different lengths after their prefill in a TreeKVCache (the engine's layout): each row's chain is
    the reference's (the draft reads the target's own K/V of the prefix), whether the kept layers run as op calls
    (under no_grad, as in the engine) or as the Hugging Face modules (with gradients on, the op route stands
    aside)."""
    m = target()
    use_tree_attention(m)
    prompts = [greedy_t.prompt_of(n, 60 + n) for n in (9, 1, 5)]
    k = 4
    cache = TreeKVCache(m.config, len(prompts), 64)
    T = max(len(p) for p in prompts) - 1
    toks = torch.zeros(len(prompts), T, dtype=torch.int64)
    for b, p in enumerate(prompts):
        toks[b, : len(p) - 1] = torch.tensor(p[:-1], dtype=torch.int64)
    extend(m, cache, toks, torch.tensor([len(p) - 1 for p in prompts]))
    state = DecodeState.of_prompts(prompts, 64, m.config.vocab_size, target_cache=cache)
    drafter = SelfSpecDrafter(list(skip), num_draft_tokens=k)
    drafter.begin(m, state)
    before = cache.storage.clone()
    with torch.no_grad() if route == "ops" else torch.enable_grad():
        tree = drafter.propose(state, k, k + 1)
    assert (drafter._ops is not None) == (route == "ops")
    assert drafter.forwards == k
    for b, p in enumerate(prompts):
        assert tree.tokens[b].tolist() == [p[-1]] + reference_chain(m, p, skip, k), b
    assert torch.equal(cache.lengths, state.prefix_lens)  # lengths as the engine left them
    for b, p in enumerate(prompts):  # the prefix's K/V untouched (scratch only at and after prefix_lens)
        assert torch.equal(cache.storage[:, :, b, :, : len(p) - 1], before[:, :, b, :, : len(p) - 1])


def test_no_skipped_layer_is_the_target_and_accepts_every_draft():
    m = target()
    prompt = greedy_t.prompt_of(7, 3)
    out, stats = generate(m, SelfSpecDrafter([], num_draft_tokens=4), torch.tensor(prompt), max_new_tokens=26,
                          eos_token_id=[])
    assert out[len(prompt):].tolist() == hf_greedy(m, prompt, 26)
    assert stats.accept_hist[4] == stats.steps - 1  # every full chain accepted; the last step is cut by the budget


# ---------------------------------------------------------------------------------------------------------------
# Greedy: token-identical.

def check_greedy(m, make) -> None:
    """Prompts of 1-11 tokens and budgets of 1-24, a fresh drafter ``make()`` each: Hugging Face's greedy tokens,
    one target forward a step, and drafts accepted (shared with test_drafter_early_exit)."""
    accepted = []
    for plen, max_new, seed in [(1, 9, 0), (6, 1, 1), (11, 24, 2), (4, 13, 3)]:
        prompt = greedy_t.prompt_of(plen, seed)
        got, stats = greedy_t.run_and_check(m, make(), prompt, max_new)
        assert got == hf_greedy(m, prompt, max_new), (plen, max_new, seed)
        accepted.append(stats.mean_accepted_length)
    assert max(accepted) > 1.5, accepted  # drafts were accepted


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_equals_hf_generate(family, shape):
    check_greedy(target(family), lambda: make_drafter(shape))


@pytest.mark.parametrize("op_calls", [True, False])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("skip", [(1,), (1, 2), (0, 1, 2, 3)])
def test_batch_of_prompts_of_different_lengths(shape, skip, op_calls):
    m = target()
    prompts = [greedy_t.prompt_of(n, 40 + n) for n in (7, 1, 12, 4)]
    drafter = make_drafter(shape, skip, op_calls=op_calls)
    outs, stats = generate(m, drafter, prompts, max_new_tokens=14, eos_token_id=[])
    assert (drafter._ops is not None) == op_calls
    for b, (p, o) in enumerate(zip(prompts, outs)):
        assert o.tolist() == p + hf_greedy(m, p, 14), b
    assert stats.target_forwards == stats.steps
    if skip == (1,):
        assert stats.mean_accepted_length > 1.5, stats.mean_accepted_length


def check_engine_rows(m, drafter) -> None:
    """Requests arrive at different steps into an engine of fewer rows than requests, with different budgets: each
    one's tokens are Hugging Face's greedy tokens of its prompt alone (shared with test_drafter_early_exit)."""
    prompts = [greedy_t.prompt_of(n, 70 + n) for n in (7, 1, 12, 4, 9, 15)]
    budgets = [16 - 3 * (b % 4) for b in range(len(prompts))]
    arrivals = engine_t.staggered(prompts, budgets, 3)  # (3 at the start, then one a step)
    with Engine(m, drafter, max_batch=3, max_len=96, eos_token_id=[]) as engine:
        tokens, reasons, _ = engine_t.run(engine, arrivals)
        stats = engine.stats
    for b, p in enumerate(prompts):
        assert tokens[b] == hf_greedy(m, p, budgets[b]), b
        assert reasons[b] == "length"
    assert stats.joins >= 3 and stats.retirements >= 3 and stats.mean_accepted_length > 1.5


def check_adaptive(m, drafter) -> None:
    """``drafter`` inside the adaptive drafter: Hugging Face's greedy tokens, and more than one depth chosen."""
    adaptive = AdaptiveDrafter(drafter, explore_every=2)
    prompts = [greedy_t.prompt_of(n, 80 + n) for n in (5, 10)]
    outs, stats = generate(m, adaptive, prompts, max_new_tokens=30, eos_token_id=[])
    for p, o in zip(prompts, outs):
        assert o.tolist() == p + hf_greedy(m, p, 30)
    assert len(adaptive.depth_hist) >= 2, adaptive.depth_hist  # it switched depths (plain steps included or not)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_engine_rows_joining_and_leaving_equal_decoding_alone(shape):
    check_engine_rows(target(), make_drafter(shape))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_inside_the_adaptive_drafter(shape):
    check_adaptive(target(), make_drafter(shape))


# ---------------------------------------------------------------------------------------------------------------
# Sampling: lossless.

def sampling_target():
    """The 2-layer V = 8 target of the chi-square tests (sharper distributions than its near-uniform random init)."""
    tgt = make_model("llama", seed=21, vocab_size=pytest.importorskip("test_generate_sampling").V,
                     num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1, hidden_size=32,
                     intermediate_size=64)
    with torch.no_grad():
        tgt.lm_head.weight.mul_(8.0)
    return tgt


def check_lossless(tgt, drafters, T: float, top_k: int, top_p: float) -> None:
    """The chi-square test of test_generate_sampling (5000 rows of one prompt, p < 1e-3 per test) for each
    ``(seed, drafter)``: the first two tokens' joint distribution and the third's are the target's, and the test is
    not vacuous (drafts were accepted, and some rejected: the residual distribution was sampled)."""
    sampling = pytest.importorskip("test_generate_sampling")
    Vs = sampling.V
    joint, third = sampling.exact_distributions(tgt, T, top_k, top_p)
    prompts = torch.tensor(sampling.PROMPT).expand(sampling.ROWS, -1).contiguous()
    for seed, drafter in drafters:
        out, st = generate(tgt, drafter, prompts, max_new_tokens=3, eos_token_id=[], temperature=T, top_k=top_k,
                           top_p=top_p, generator=torch.Generator().manual_seed(seed))
        new = out[:, len(sampling.PROMPT):]
        p_pair = sampling.chi_square_p(torch.bincount(new[:, 0] * Vs + new[:, 1], minlength=Vs * Vs), joint)
        p_third = sampling.chi_square_p(torch.bincount(new[:, 2], minlength=Vs), third)
        assert p_pair > 1e-3 and p_third > 1e-3, (drafter.dynamic, p_pair, p_third)
        assert st.accept_hist[0] > 0 and sum(st.accept_hist[1:]) > sampling.ROWS // 10, st.accept_hist


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_sampling_matches_the_target_distribution(T, top_k, top_p):
    """On the 2-layer target drafting with its layer 1 skipped: sampled chains and a dynamic tree."""
    check_lossless(sampling_target(), ((4321, SelfSpecDrafter([1], num_draft_tokens=3)),
                                       (6789, SelfSpecDrafter([1], num_draft_tokens=3, tree_width=2,
                                                              total_tokens=4))), T, top_k, top_p)


def test_sampling_through_the_ops_matches_the_target_distribution(monkeypatch):
    """The same test with the op calls taking every row (their row limit lifted, as test_llama_step_ops does): the
    draft probabilities of the kept layers' op path are the ones verification divides by."""
    monkeypatch.setattr(draft_layer, "NATIVE_LAYER_MAX_ROWS", 10 ** 9)
    forwards = []
    real = LlamaStepOps.forward
    monkeypatch.setattr(LlamaStepOps, "forward", lambda self, *a, **k: forwards.append(1) or real(self, *a, **k))
    drafters = ((4321, SelfSpecDrafter([1], num_draft_tokens=3)),
                (6789, SelfSpecDrafter([1], num_draft_tokens=3, tree_width=2, total_tokens=4)))
    check_lossless(sampling_target(), drafters, 1.0, 0, 1.0)
    assert all(isinstance(d._ops, LlamaStepOps) for _, d in drafters) and forwards


# ---------------------------------------------------------------------------------------------------------------
# The file and bad input.

def test_file_round_trip(tmp_path):
    m = target()
    path = tmp_path / "self_spec.json"
    write_self_spec(path, SelfSpecFile(4, (2, 1), 5, {"mean_accepted_length": 2.5}))
    data = json.loads(path.read_text())
    assert data == {"format": FORMAT, "num_layers": 4, "skip_layers": [1, 2], "num_draft_tokens": 5,
                    "tuning": {"mean_accepted_length": 2.5}}
    plan = read_self_spec(path)
    assert plan == SelfSpecFile(4, (1, 2), 5, {"mean_accepted_length": 2.5})
    drafter = SelfSpecDrafter.from_file(path, target=m)
    assert drafter.skip_layers == (1, 2) and drafter.k == 5 and drafter.max_nodes == 6
    tree = SelfSpecDrafter.from_file(path, target=m, num_draft_tokens=3, tree_width=2, total_tokens=6)
    assert tree.k == 3 and tree.dynamic
    prompt = greedy_t.prompt_of(6, 5)
    out, _ = generate(m, drafter, torch.tensor(prompt), max_new_tokens=10, eos_token_id=[])
    assert out[len(prompt):].tolist() == hf_greedy(m, prompt, 10)


GOOD = {"format": FORMAT, "num_layers": 4, "skip_layers": [1], "num_draft_tokens": 4}


@pytest.mark.parametrize("change,match", [
    ({"extra": 1}, "unknown key.*extra"),
    ({"format": "other/1"}, "format must be"),
    ({"skip_layers": [4]}, r"skip_layers must hold layer indices in \[0, 4\).*\[4\]"),
    ({"skip_layers": [-1]}, "skip_layers must hold layer indices"),
    ({"skip_layers": [1, 1]}, "skip_layers must not repeat"),
    ({"skip_layers": "1"}, "skip_layers must be a list"),
    ({"skip_layers": [1.0]}, "skip_layers must be a list"),
    ({"skip_layers": [True]}, "skip_layers must be a list"),
    ({"num_layers": "4"}, "num_layers must be an integer"),
    ({"num_layers": 0}, "num_layers must be an integer"),
    ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer"),
    ({"num_draft_tokens": 2.5}, "num_draft_tokens must be an integer"),
    ({"tuning": [1]}, "tuning must be an object"),
])
def test_bad_file_contents_name_the_field(tmp_path, change, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(ValueError, match=match):
        read_self_spec(path)


def test_bad_files_and_targets(tmp_path):
    path = tmp_path / "f.json"
    path.write_text(json.dumps({k: v for k, v in GOOD.items() if k != "skip_layers"}))
    with pytest.raises(ValueError, match="missing key.*skip_layers"):
        read_self_spec(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_self_spec(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_self_spec(path)
    with pytest.raises(FileNotFoundError):
        read_self_spec(tmp_path / "missing.json")
    path.write_text(json.dumps({**GOOD, "num_layers": 6}))
    with pytest.raises(ValueError, match="chosen for a target of 6 decoder layers, but this target has 4"):
        SelfSpecDrafter.from_file(path, target=target())


def test_bad_arguments_name_them():
    for bad in ("1", [1.5], [1, 1], [-2], None):
        with pytest.raises(ValueError, match="skip_layers"):
            SelfSpecDrafter(bad)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SelfSpecDrafter([1], num_draft_tokens=0)
    with pytest.raises(ValueError, match="tree_width >= 2 and total_tokens"):
        SelfSpecDrafter([1], tree_width=2)
    with pytest.raises(ValueError, match="tree_width >= 2 and total_tokens"):
        SelfSpecDrafter([1], total_tokens=6)
    with pytest.raises(ValueError, match="total_tokens"):
        SelfSpecDrafter([1], tree_width=2, total_tokens=0)
    m = target()
    with pytest.raises(ValueError, match=r"skip_layers must hold layer indices in \[0, 4\)"):
        generate(m, SelfSpecDrafter([7]), [3, 4, 5], max_new_tokens=4)
    state = DecodeState.of_prompts([[3, 4, 5]], 32, m.config.vocab_size)  # made outside an engine: no cache
    with pytest.raises(ValueError, match="state.target_cache"):
        SelfSpecDrafter([1]).begin(m, state)


def test_unsupported_model_type_is_refused():
    m = make_model("gemma", seed=1)
    with pytest.raises(ValueError, match="layer skipping supports llama"):
        generate(m, SelfSpecDrafter([1]), [3, 4, 5], max_new_tokens=4)


# ---------------------------------------------------------------------------------------------------------------
# The tuner.

TUNE_PROMPTS = [greedy_t.prompt_of(n, 90 + n) for n in (12, 16, 9)]


def test_tuner_chooses_the_damped_layers_by_estimated_speedup():
    """With fixed forward costs (a draft layer 0.75 ms, the rest of a draft forward 1 ms, verification 3-4 ms) the
    search is deterministic: round one measures every single layer, later rounds extend the round's best, and the
    result is the best estimated speedup of everything measured: the damped layers, skipped together."""
    costs = Costs(4, draft_all=4e-3, draft_none=1e-3, verify=[3e-3, 3.2e-3, 3.4e-3, 3.6e-3, 3.8e-3])
    lines = []
    plan = tune_self_spec(target(), TUNE_PROMPTS, max_draft_tokens=4, new_tokens=16, costs=costs, log=lines.append)
    history = plan.tuning["history"]
    assert [h["skip_layers"] for h in history[:5]] == [[], [0], [1], [2], [3]] and len(lines) == len(history)
    assert plan.skip_layers == DAMPED and plan.num_layers == 4 and 1 <= plan.num_draft_tokens <= 4
    assert plan.tuning["estimated_speedup"] == max(h["estimated_speedup"] for h in history) > 1.0
    chosen = next(h for h in history if h["skip_layers"] == list(DAMPED))
    assert chosen["num_draft_tokens"] == plan.num_draft_tokens
    # the estimate is the objective of the measured acceptance under these costs
    tokens = chosen["mean_accepted_length"]
    assert chosen["estimated_speedup"] == pytest.approx(costs.speedup(tokens, plan.num_draft_tokens, 2), abs=1e-4)
    assert 1.0 < tokens <= plan.num_draft_tokens + 1
    for h in history:  # a set of an undamped layer is drafted poorly
        if set(h["skip_layers"]) - set(DAMPED):
            assert h["mean_accepted_length"] < tokens
    assert not plan.tuning["stopped_by_time"]
    # the path goes on past the best (two rounds without a new best): {1, 2}, then 3 layers, then all 4
    assert [len(h["skip_layers"]) for h in history] == [0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 4]


def test_tuner_min_skipped_when_a_full_draft_wins():
    """Where drafting with every layer is cheap (a draft forward 1 ms whatever it runs), the empty set wins unless
    the caller asks for layers skipped; then the best set of at least that many."""
    costs = Costs(4, draft_all=1e-3, draft_none=1e-3, verify=[3e-3, 3.2e-3, 3.4e-3, 3.6e-3, 3.8e-3])
    assert tune_self_spec(target(), TUNE_PROMPTS, max_draft_tokens=4, new_tokens=16, costs=costs).skip_layers == ()
    plan = tune_self_spec(target(), TUNE_PROMPTS, max_draft_tokens=4, new_tokens=16, costs=costs, min_skipped=1)
    assert len(plan.skip_layers) >= 1 and set(plan.skip_layers) <= set(DAMPED) and plan.tuning["min_skipped"] == 1
    measured = [h for h in plan.tuning["history"] if h["skip_layers"]]
    assert plan.tuning["estimated_speedup"] == max(h["estimated_speedup"] for h in measured)


def test_tuner_time_budget_and_bad_arguments():
    costs = Costs(4, 4e-3, 1e-3, [3e-3] * 5)
    plan = tune_self_spec(target(), TUNE_PROMPTS, max_draft_tokens=4, new_tokens=16, costs=costs, time_limit_s=0)
    assert plan.skip_layers == () and plan.tuning["stopped_by_time"] and len(plan.tuning["history"]) == 1
    with pytest.raises(ValueError, match="before a set of min_skipped = 1 layers was measured"):
        tune_self_spec(target(), TUNE_PROMPTS, max_draft_tokens=4, new_tokens=16, costs=costs, time_limit_s=0,
                       min_skipped=1)
    for kw, match in (({"max_draft_tokens": 0}, "max_draft_tokens"), ({"new_tokens": 0}, "new_tokens"),
                      ({"min_skipped": 5}, r"min_skipped must be an integer in \[0, 4\]")):
        with pytest.raises(ValueError, match=match):
            tune_self_spec(target(), TUNE_PROMPTS, costs=costs, **kw)
    with pytest.raises(ValueError, match="prompts"):
        tune_self_spec(target(), [], costs=costs)
    with pytest.raises(ValueError, match="raise new_tokens above max_draft_tokens"):
        tune_self_spec(target(), TUNE_PROMPTS, max_draft_tokens=4, new_tokens=2, costs=costs)


def test_cli_tune_then_generate(tmp_path, capsys):
    """``specdec tune-self-spec`` (measured costs) writes a file that ``specdec generate --self-spec`` loads and
    decodes with, token-identical to Hugging Face's greedy output; a bad file is a one-line error."""
    from specdec_ext.cli import main

    m = target()
    m.save_pretrained(tmp_path / "model")
    data = tmp_path / "heldout.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": greedy_t.prompt_of(40, s)}) for s in range(3)))
    out = tmp_path / "self_spec.json"
    assert main(["tune-self-spec", "--model", str(tmp_path / "model"), "--data", str(data), "--out", str(out),
                 "--num-prompts", "2", "--prompt-len", "24", "--new-tokens", "12", "--max-draft-tokens", "3",
                 "--minutes", "5"]) == 0
    plan = read_self_spec(out)
    assert plan.num_layers == 4 and set(plan.skip_layers) <= set(range(4)) and 1 <= plan.num_draft_tokens <= 3
    assert f"-> {out}" in capsys.readouterr().out
    prompt = greedy_t.prompt_of(8, 4)
    assert main(["generate", "--model", str(tmp_path / "model"), "--self-spec", str(out), "--prompt-ids",
                 " ".join(map(str, prompt)), "--max-new-tokens", "12", "--eos-id", "0", "--no-stream"]) == 0
    printed = capsys.readouterr().out
    want = hf_greedy(m, prompt, 12, eos=0)
    assert " ".join(map(str, want)) in printed and "accepted" in printed
    out.write_text(json.dumps({**GOOD, "skip_layers": [9]}))
    with pytest.raises(SystemExit, match=r"skip_layers must hold layer indices in \[0, 4\)"):
        main(["generate", "--model", str(tmp_path / "model"), "--self-spec", str(out), "--prompt-ids", "3 4"])
    with pytest.raises(SystemExit, match="choose one drafter"):
        main(["generate", "--model", str(tmp_path / "model"), "--self-spec", str(out), "--ngram", "--prompt-ids",
              "3 4"])
    with pytest.raises(SystemExit, match="--draft-quant: --self-spec drafts with the target's own weights"):
        main(["generate", "--model", str(tmp_path / "model"), "--self-spec", str(out), "--draft-quant", "int8",
              "--prompt-ids", "3 4"])


def test_e2e_bench_self_spec_row(tmp_path):
    """The e2e benchmark with a self-speculation file gains a "self-spec" row measured beside plain decoding, its
    greedy output identical; a file for another layer count is refused before anything runs."""
    from specdec_ext.bench.e2e import SELF_SPEC, E2EConfig, run_e2e, with_self_spec
    from specdec_ext.bench.models import tiny_random

    models = tiny_random(seed=0, max_positions=400)
    path = tmp_path / "self_spec.json"
    write_self_spec(path, SelfSpecFile(2, (1,), 3))
    res = run_e2e(models, E2EConfig(num_prompts=2, prompt_len=16, max_new_tokens=8, temperatures=(0.0,),
                                    methods=[SELF_SPEC], hf=False, self_spec=str(path)), log=lambda s: 0)
    rows = {r["method"]: r for r in res["runs"]}
    assert set(rows) == {"plain", SELF_SPEC} and rows[SELF_SPEC]["tokens_per_s"] > 0
    assert rows[SELF_SPEC]["mean_accepted_length"] >= 1.0 and "error" not in rows[SELF_SPEC]
    assert rows[SELF_SPEC]["drafter_weight_mb"] == 0  # no weights of its own
    assert [c["equal"] for c in res["greedy_checks"]] == [True]
    with pytest.raises(ValueError, match="self-spec drafts with the target's own weights"):
        with_self_spec(models, str(path)).build_drafter(SELF_SPEC + "-int8")
    write_self_spec(path, SelfSpecFile(3, (1,), 3))
    with pytest.raises(ValueError, match="target of 3 decoder layers, but this target has 2"):
        run_e2e(models, E2EConfig(num_prompts=1, prompt_len=16, max_new_tokens=4, temperatures=(0.0,), hf=False,
                                  self_spec=str(path)), log=lambda s: 0)
