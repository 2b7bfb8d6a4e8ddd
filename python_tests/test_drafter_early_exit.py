"""Self-speculation by early exit (specdec_ext.drafters.EarlyExitDrafter), its adapter's format and its training.

Tiny random targets of test_drafter_self_spec (4 layers, float32, CPU; layers 1 and 2 damped), drafting with an
adapter initialised as a copy of the target's last layer (close to the target with its damped layers skipped:
drafts often accepted).

* The draft: its first chain equals a reference from Hugging Face modules alone and no cache (the whole context's
  hidden states after the exit layer from a full forward, the target's own last layer over them, its norm and
  head), on the op route and on the modules' route.
* Verification from the exit layer: a chain's shallow states handed to the verification forward give bit-identical
  logits, hidden states and K/V to the full forward; the engine's verification runs only the layers after the exit
  layer; the drafter's own shallow states of the nodes equal the target's.
* Greedy output equals Hugging Face's ``generate(do_sample=False)``: chains and dynamic trees, both routes, with
  and without the reuse, a batch of prompts of different lengths, the engine with rows joining and leaving, the
  adaptive drafter.
* Sampling is lossless: the chi-square test of test_generate_sampling for sampled chains and dynamic trees.
* The format: a round trip; bad files and bad arguments are ValueErrors naming what is wrong.
* Training lowers the KL to the target; ``specdec train-self-spec`` then ``specdec generate --early-exit`` end to
  end; the e2e benchmark's early-exit row.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

import test_drafter_self_spec as self_spec_t  # noqa: E402
import test_generate_greedy as greedy_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext.drafters import EarlyExitDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models import TreeKVCache, extend, tree_forward, use_tree_attention  # noqa: E402
from specdec_ext.models.early_exit import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, EarlyExitAdapter,  # noqa: E402
                                           load_early_exit, save_early_exit)
from specdec_ext.models.fast_linear import pack_linears_where_fast  # noqa: E402
from specdec_ext.models.llama_step import LlamaStepOps  # noqa: E402
from specdec_ext.state import DecodeState  # noqa: E402
from specdec_ext.train.early_exit import _loss, train_early_exit  # noqa: E402
from specdec_ext.train.loop import TrainConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

target = self_spec_t.target


def adapter_of(m, exit_layer: int = 2) -> EarlyExitAdapter:
    last = m.config.num_hidden_layers - 1
    return EarlyExitAdapter.from_target_layer(m, exit_layer, source_layer=last).eval().requires_grad_(False)


def make_drafter(m, shape: str = "chain", exit_layer: int = 2, k: int = 4, **kw) -> EarlyExitDrafter:
    if shape == "tree":
        return EarlyExitDrafter(adapter_of(m, exit_layer), num_draft_tokens=k, tree_width=3, total_tokens=8, **kw)
    return EarlyExitDrafter(adapter_of(m, exit_layer), num_draft_tokens=k, **kw)


def prefilled(m, prompts, max_len: int = 64, exit_layer: int = 2):
    """The engine's layout after a prefill: every prompt but its last token in a TreeKVCache, the state, and the
    prefill's hidden states after ``exit_layer`` layers."""
    use_tree_attention(m)
    cache = TreeKVCache(m.config, len(prompts), max_len)
    T = max(len(p) for p in prompts) - 1
    toks = torch.zeros(len(prompts), T, dtype=torch.int64)
    for b, p in enumerate(prompts):
        toks[b, : len(p) - 1] = torch.tensor(p[:-1], dtype=torch.int64)
    out = extend(m, cache, toks, torch.tensor([len(p) - 1 for p in prompts]), output_hidden_states=True,
                 return_outputs=True)
    state = DecodeState.of_prompts(prompts, max_len, m.config.vocab_size, target_cache=cache)
    return cache, state, (out.hidden_states[exit_layer],)


# ---------------------------------------------------------------------------------------------------------------
# The draft itself, and verification from the exit layer.

@torch.no_grad()
def reference_chain(model, prompt: list[int], exit_layer: int, k: int) -> list[int]:
    """The greedy chain of an adapter that copies ``model``'s last layer, after ``prompt``, from Hugging Face modules
    alone and no cache: per draft, a full forward of the context for its hidden states after ``exit_layer`` layers,
    the last layer over all of them (causal), the final norm and the LM head at the last position."""
    m = copy.deepcopy(model)
    m.set_attn_implementation("sdpa")
    base, ctx = m.model, list(prompt)
    for _ in range(k):
        ids = torch.tensor([ctx])
        h = m(ids, output_hidden_states=True).hidden_states[exit_layer]
        T = len(ctx)
        pos = torch.arange(T)[None]
        causal = torch.full((T, T), torch.finfo(h.dtype).min).triu(1)[None, None]
        out = base.layers[-1](h, attention_mask=causal, position_embeddings=base.rotary_emb(h, pos), position_ids=pos)
        ctx.append(int(m.lm_head(base.norm(out))[0, -1].argmax()))
    return ctx[len(prompt):]


@pytest.mark.parametrize("route", ["ops", "modules"])
@pytest.mark.parametrize("exit_layer", [1, 2])
def test_first_chain_equals_the_hugging_face_reference(exit_layer, route):
    """Rows of different lengths after their prefill (the engine's layout): each row's chain is the reference's; the
    op route under no_grad, the modules with gradients on (where the op route stands aside)."""
    m = target()
    prompts = [greedy_t.prompt_of(n, 60 + n) for n in (9, 1, 5)]
    cache, state, hidden = prefilled(m, prompts, exit_layer=exit_layer)
    drafter = make_drafter(m, exit_layer=exit_layer)
    drafter.begin(m, state, hidden)
    before = cache.storage.clone()
    with torch.no_grad() if route == "ops" else torch.enable_grad():
        tree = drafter.propose(state, 4, 5)
    assert (drafter._ops is not None) == (route == "ops")
    assert drafter.forwards == 4
    for b, p in enumerate(prompts):
        assert tree.tokens[b].tolist() == [p[-1]] + reference_chain(m, p, exit_layer, 4), b
    assert torch.equal(cache.lengths, state.prefix_lens)
    for b, p in enumerate(prompts):  # the prefix's K/V untouched
        assert torch.equal(cache.storage[:, :, b, :, : len(p) - 1], before[:, :, b, :, : len(p) - 1])
    assert tree.shallow is not None and tree.shallow.layer == exit_layer
    assert tree.shallow.hidden.shape == (3, 5, m.config.hidden_size)


@torch.no_grad()
def test_verification_from_the_exit_layer_is_bit_identical():
    """The chain's shallow states (the draft's) and the K/V it left: the op route's verification from the exit
    layer gives the full forward's logits, hidden states and cache, bit for bit; the shallow states are the full
    forward's own."""
    m = target()
    pack_linears_where_fast(m)
    prompts = [greedy_t.prompt_of(n, 20 + n) for n in (9, 1, 5)]
    cache, state, hidden = prefilled(m, prompts)
    drafter = make_drafter(m)
    drafter.begin(m, state, hidden)
    tree = drafter.propose(state, 4, 5)
    ops = LlamaStepOps.build(m, cache)
    assert ops is not None and drafter._ops is not None
    prefix = state.prefix_lens
    kw = {"step_ops": ops, "output_hidden_states": True, "return_outputs": True}
    fast = tree_forward(m, cache, tree.tokens, None, prefix, shallow=tree.shallow, **kw)
    kv_fast = cache.storage.clone()
    full = tree_forward(m, cache, tree.tokens, None, prefix, **kw)
    assert torch.equal(fast.logits, full.logits)
    assert torch.equal(kv_fast, cache.storage)
    assert torch.equal(tree.shallow.hidden, full.hidden_states[2])
    assert fast.hidden_states[0] is None and torch.equal(fast.hidden_states[2], full.hidden_states[2])
    for i in range(3, 5):
        assert torch.equal(fast.hidden_states[i], full.hidden_states[i])
    modules = tree_forward(m, cache, tree.tokens, None, prefix, shallow=tree.shallow)  # runs every layer
    torch.testing.assert_close(modules, full.logits, rtol=1e-5, atol=1e-5)


def test_the_engine_verifies_chains_from_the_exit_layer(monkeypatch):
    """Through the engine, a chain's verification runs the target's layers 2 and 3 only (the op route), a dynamic
    tree's all four, and the output is the target's greedy output either way."""
    m = target()
    calls = []
    layers = LlamaStepOps.layers

    def spy(self, h, position_ids, write_slots, mask, start, stop, states=None):
        calls.append((h.shape[1], start, stop))
        return layers(self, h, position_ids, write_slots, mask, start, stop, states)

    monkeypatch.setattr(LlamaStepOps, "layers", spy)
    prompt = greedy_t.prompt_of(11, 2)
    for shape, start in (("chain", 2), ("tree", 0)):
        calls.clear()
        out, stats = generate(m, make_drafter(m, shape), torch.tensor(prompt), max_new_tokens=20, eos_token_id=[])
        assert out[len(prompt):].tolist() == hf_greedy(m, prompt, 20), shape
        # the target's forwards (the drafts' own calls stop at the exit layer): the prefill from layer 0, then every
        # verification from ``start``
        target_calls = [(n, begin) for n, begin, stop in calls if stop == 4]
        assert target_calls[0] == (len(prompt) - 1, 0) and stats.prefill_forwards == 1
        assert [begin for _, begin in target_calls[1:]] == [start] * stats.steps, shape
        assert stats.mean_accepted_length > 1.5


# ---------------------------------------------------------------------------------------------------------------
# Greedy: token-identical.

@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_equals_hf_generate(family, shape):
    m = target(family)
    self_spec_t.check_greedy(m, lambda: make_drafter(m, shape))


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("op_calls", [True, False])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_batch_of_prompts_of_different_lengths(shape, op_calls, reuse):
    m = target()
    prompts = [greedy_t.prompt_of(n, 40 + n) for n in (7, 1, 12, 4)]
    drafter = make_drafter(m, shape, op_calls=op_calls, reuse_shallow=reuse)
    outs, stats = generate(m, drafter, prompts, max_new_tokens=14, eos_token_id=[])
    assert (drafter._ops is not None) == op_calls
    for b, (p, o) in enumerate(zip(prompts, outs)):
        assert o.tolist() == p + hf_greedy(m, p, 14), b
    assert stats.target_forwards == stats.steps and stats.mean_accepted_length > 1.5


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_draft_vocabulary(shape):
    """Drafting over some of the vocabulary (FR-Spec ids): token-identical still, fewer drafts accepted than over
    all of it when the ids leave out tokens the target emits, and the drafts are ids of the draft vocabulary."""
    m = target()
    prompts = [greedy_t.prompt_of(n, 40 + n) for n in (7, 1, 12, 4)]
    half = list(range(0, m.config.vocab_size, 2)) + list(range(1, 40, 2))
    drafter = make_drafter(m, shape, draft_vocab=half)
    proposed = []
    propose = drafter.propose

    def spy(state, *a):
        tree = propose(state, *a)
        proposed.append(tree.tokens[:, 1:])
        return tree

    drafter.propose = spy
    outs, stats = generate(m, drafter, prompts, max_new_tokens=14, eos_token_id=[])
    for b, (p, o) in enumerate(zip(prompts, outs)):
        assert o.tolist() == p + hf_greedy(m, p, 14), b
    allowed = torch.zeros(m.config.vocab_size, dtype=torch.bool)
    allowed[half] = True
    assert all(bool(allowed[t].all()) for t in proposed)
    assert drafter._lm_sub is not None and drafter._lm_sub.weight.shape[0] == len(half)
    with pytest.raises(ValueError, match="draft_vocab holds ids outside"):
        generate(m, make_drafter(m, shape, draft_vocab=[0, m.config.vocab_size]), prompts[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="distinct token ids"):
        make_drafter(m, shape, draft_vocab=[3, 3])


def test_confidence_threshold_stops_chains():
    """Chains of 6 that stop after a draft the adapter was unsure of: the same tokens, fewer draft forwards and
    shorter trees than without the stop; a threshold for a tree, or out of [0, 1), is refused."""
    m = target()
    prompts = [greedy_t.prompt_of(n, 30 + n) for n in (9, 3)]
    runs = {}
    for threshold in (0.0, 0.9):
        drafter = make_drafter(m, k=6, confidence_threshold=threshold)
        outs, stats = generate(m, drafter, prompts, max_new_tokens=24, eos_token_id=[])
        for b, (p, o) in enumerate(zip(prompts, outs)):
            assert o.tolist() == p + hf_greedy(m, p, 24), (threshold, b)
        runs[threshold] = (drafter.forwards, stats.draft_tokens / stats.steps)
    assert runs[0.9][1] < runs[0.0][1], runs  # shorter chains a step
    with pytest.raises(ValueError, match="confidence_threshold applies to chains"):
        make_drafter(m, "tree", confidence_threshold=0.5)
    with pytest.raises(ValueError, match=r"confidence_threshold must be a number in \[0, 1\)"):
        make_drafter(m, confidence_threshold=1.0)


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantised_adapter(shape, scheme):
    """``draft_quant="int8"`` / ``"int4"``: the adapter's linear layers quantised (int8: a quarter of the float32
    bytes, scales aside; int4: an eighth), token-identical output, and acceptance close to the float adapter's (int4:
    above half of it)."""
    from specdec_ext.models.quantized import QuantizedLinear, module_bytes

    m = target()
    prompts = [greedy_t.prompt_of(n, 50 + n) for n in (9, 3, 14)]
    float_drafter, quantised = make_drafter(m, shape), make_drafter(m, shape, draft_quant=scheme)
    down = quantised.adapter.mlp.down_proj
    assert isinstance(down, QuantizedLinear) and down.scheme == scheme
    ratio = module_bytes(quantised.adapter) / module_bytes(float_drafter.adapter)
    assert ratio < (0.3 if scheme == "int8" else 0.17), ratio
    accepted = []
    for drafter in (float_drafter, quantised):
        outs, stats = generate(m, drafter, prompts, max_new_tokens=16, eos_token_id=[])
        for b, (p, o) in enumerate(zip(prompts, outs)):
            assert o.tolist() == p + hf_greedy(m, p, 16), b
        accepted.append(stats.mean_accepted_length)
    # int8's error is ~1% of a product's scale, int4's ~9%: on this small random model int4 gives up more acceptance
    assert accepted[1] > (0.8 if scheme == "int8" else 0.5) * accepted[0], accepted
    with pytest.raises(ValueError, match="draft_quant must be None or one of"):
        make_drafter(m, shape, draft_quant="int2")


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_engine_rows_joining_and_leaving_equal_decoding_alone(shape):
    m = target()
    self_spec_t.check_engine_rows(m, make_drafter(m, shape))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_inside_the_adaptive_drafter(shape):
    m = target()
    self_spec_t.check_adaptive(m, make_drafter(m, shape))


# ---------------------------------------------------------------------------------------------------------------
# Sampling: lossless.

@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_sampling_matches_the_target_distribution(T, top_k, top_p):
    """test_drafter_self_spec's chi-square test on its 2-layer target drafting with its layer 0 and an adapter
    copied from its layer 1, perturbed (drafts accepted often, rejected sometimes): sampled chains, a dynamic tree,
    and sampled chains over six of the eight ids (a draft distribution that is zero on the other two)."""
    tgt = self_spec_t.sampling_target()
    adapter = EarlyExitAdapter.from_target_layer(tgt, 1).eval().requires_grad_(False)
    with torch.no_grad():
        adapter.mlp.down_proj.weight.mul_(0.5)
    self_spec_t.check_lossless(tgt, ((4321, EarlyExitDrafter(adapter, num_draft_tokens=3)),
                                     (6789, EarlyExitDrafter(adapter, num_draft_tokens=3, tree_width=2,
                                                             total_tokens=4)),
                                     (2468, EarlyExitDrafter(adapter, num_draft_tokens=3,
                                                             draft_vocab=[0, 1, 2, 4, 5, 7]))), T, top_k, top_p)


# ---------------------------------------------------------------------------------------------------------------
# The format and bad input.

def test_round_trip(tmp_path):
    m = target()
    adapter = adapter_of(m, 1)
    with torch.no_grad():
        adapter.mlp.up_proj.weight.add_(0.01)
    save_early_exit(adapter, tmp_path / "ee", base_model_name_or_path="../target")
    cfg = json.loads((tmp_path / "ee" / ADAPTER_CONFIG).read_text())
    assert cfg["specdec_format"] == "early-exit-adapter" and cfg["exit_layer"] == 1 and cfg["target_num_layers"] == 4
    back = load_early_exit(tmp_path / "ee", target=m)
    assert back.exit_layer == 1 and not back.training
    for (k, v), (k2, v2) in zip(adapter.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    drafter = EarlyExitDrafter.from_pretrained(str(tmp_path / "ee"), m, num_draft_tokens=3)
    assert drafter.exit_layer == 1 and drafter.hidden_state_layers == (1,) and drafter.max_nodes == 4
    prompt = greedy_t.prompt_of(6, 5)
    out, _ = generate(m, drafter, torch.tensor(prompt), max_new_tokens=10, eos_token_id=[])
    assert out[len(prompt):].tolist() == hf_greedy(m, prompt, 10)
    save_early_exit(adapter, tmp_path / "bf16", dtype=torch.bfloat16)
    assert load_early_exit(tmp_path / "bf16").self_attn.q_proj.weight.dtype == torch.float32  # (no target: float32)


@pytest.mark.parametrize("change,match", [
    ({"specdec_format": "eagle"}, "is not an early-exit adapter"),
    ({"format_version": 2}, "format_version 2"),
    ({"exit_layer": 0}, "'exit_layer' must be an integer >= 1"),
    ({"exit_layer": 4}, "exit_layer 4 but the target has only 4 layers"),
    ({"hidden_size": "32"}, "'hidden_size' must be an integer"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"rms_norm_eps": -1}, "'rms_norm_eps' must be a positive number"),
    ({"rope_scaling": [1]}, "'rope_scaling' must be an object"),
    ({"target_num_layers": 6}, "trained for a target of 6 layers"),
])
def test_bad_config_names_the_field(tmp_path, change, match):
    m = target()
    save_early_exit(adapter_of(m), tmp_path)
    path = tmp_path / ADAPTER_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=match):
        load_early_exit(tmp_path, target=m)


def test_bad_weights_and_files(tmp_path):
    from safetensors.torch import load_file, save_file

    m = target()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_early_exit(tmp_path)
    save_early_exit(adapter_of(m), tmp_path)
    weights = tmp_path / ADAPTER_WEIGHTS
    sd = load_file(weights)
    save_file({k: v for k, v in sd.items() if k != "mlp.down_proj.weight"}, weights)
    with pytest.raises(ValueError, match=r"missing \['mlp.down_proj.weight'\]"):
        load_early_exit(tmp_path)
    save_file({**sd, "mlp.down_proj.weight": torch.zeros(3, 3)}, weights)
    with pytest.raises(ValueError, match="wrong shape"):
        load_early_exit(tmp_path)
    weights.write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="cannot read .* as safetensors"):
        load_early_exit(tmp_path)
    (tmp_path / ADAPTER_CONFIG).write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_early_exit(tmp_path)


def test_bad_arguments_name_them():
    m = target()
    with pytest.raises(ValueError, match="adapter must be an EarlyExitAdapter"):
        EarlyExitDrafter(m)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        make_drafter(m, k=0)
    with pytest.raises(ValueError, match="tree_width >= 2 and total_tokens"):
        EarlyExitDrafter(adapter_of(m), tree_width=2)
    with pytest.raises(ValueError, match=r"exit_layer must be in \[1, 3\]"):
        EarlyExitAdapter.from_target_layer(m, 4)
    with pytest.raises(ValueError, match=r"source_layer must be in \[2, 3\]"):
        EarlyExitAdapter.from_target_layer(m, 2, source_layer=1)
    other = make_model("llama", seed=3, num_hidden_layers=3)
    with pytest.raises(ValueError, match="trained for a target of 4 layers"):
        generate(other, make_drafter(m), [3, 4, 5], max_new_tokens=4)
    state = DecodeState.of_prompts([[3, 4, 5]], 32, m.config.vocab_size)  # outside an engine: no target cache
    with pytest.raises(ValueError, match="state.target_cache"):
        make_drafter(m).begin(m, state, (torch.zeros(1, 2, m.config.hidden_size),))
    with pytest.raises(ValueError, match="layer skipping supports llama"):
        gemma = make_model("gemma", seed=1, num_hidden_layers=4)
        generate(gemma, EarlyExitDrafter(EarlyExitAdapter.from_target_layer(m, 2)), [3, 4, 5], max_new_tokens=4)


# ---------------------------------------------------------------------------------------------------------------
# Training, the command line and the benchmark.

def test_training_lowers_the_kl_to_the_target():
    m = target()
    seqs = [greedy_t.prompt_of(32, s) for s in range(16)]
    toks = torch.tensor(seqs[:4])
    mask = torch.ones_like(toks, dtype=torch.bool)
    start = EarlyExitAdapter.from_target_layer(m, 1)
    with torch.no_grad():
        before = float(_loss(start, m, toks, mask)[0])
    adapter, result = train_early_exit(m, seqs, TrainConfig(steps=30, lr=3e-3, batch_size=4, progress=False),
                                       exit_layer=1)
    with torch.no_grad():
        after = float(_loss(adapter, m, toks, mask)[0])
    assert after < 0.7 * before, (before, after)
    assert all(not p.requires_grad for p in adapter.parameters()) and not any(p.requires_grad for p in m.parameters())
    with pytest.raises(ValueError, match=r"exit_layer must be an integer in \[1, 3\]"):
        train_early_exit(m, seqs, TrainConfig(steps=1, progress=False), exit_layer=0)


def test_cli_train_then_generate(tmp_path, capsys):
    from specdec_ext.cli import main

    m = target()
    m.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": greedy_t.prompt_of(40, s)}) for s in range(12)))
    out = tmp_path / "ee"
    assert main(["train-self-spec", "--model", str(tmp_path / "model"), "--data", str(data), "--out", str(out),
                 "--steps", "4", "--heldout", "2", "--eval-new-tokens", "8", "--prompt-len", "16",
                 "--no-progress"]) == 0
    assert "mean accepted length" in capsys.readouterr().out
    adapter = load_early_exit(out, target=m)
    assert adapter.exit_layer == 1  # a quarter of 4 layers
    assert not (out / "draft_vocab.json").exists()  # (the tiny vocabulary is under the default's 1024 ids)
    prompt = greedy_t.prompt_of(8, 4)
    assert main(["generate", "--model", str(tmp_path / "model"), "--early-exit", str(out), "--prompt-ids",
                 " ".join(map(str, prompt)), "--max-new-tokens", "12", "--eos-id", "0", "--no-stream"]) == 0
    printed = capsys.readouterr().out
    assert " ".join(map(str, hf_greedy(m, prompt, 12, eos=0))) in printed and "accepted" in printed
    vocab_dir = tmp_path / "ee_vocab"  # the draft vocabulary: the data's 40 most frequent ids, beside the adapter
    assert main(["train-self-spec", "--model", str(tmp_path / "model"), "--data", str(data), "--out", str(vocab_dir),
                 "--steps", "1", "--heldout", "0", "--draft-vocab", "40", "--exit-layer", "2", "--no-progress",
                 "--no-report"]) == 0
    drafter = EarlyExitDrafter.from_pretrained(str(vocab_dir), m)
    assert drafter.exit_layer == 2 and drafter.draft_vocab.numel() == 40
    assert main(["generate", "--model", str(tmp_path / "model"), "--early-exit", str(vocab_dir), "--prompt-ids",
                 " ".join(map(str, prompt)), "--max-new-tokens", "12", "--eos-id", "0", "--no-stream"]) == 0
    assert " ".join(map(str, hf_greedy(m, prompt, 12, eos=0))) in capsys.readouterr().out
    with pytest.raises(SystemExit, match="choose one drafter"):
        main(["generate", "--model", str(tmp_path / "model"), "--early-exit", str(out), "--ngram", "--prompt-ids",
              "3 4"])
    assert main(["generate", "--model", str(tmp_path / "model"), "--early-exit", str(vocab_dir), "--draft-quant",
                 "int8", "--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens", "12", "--eos-id", "0",
                 "--no-stream"]) == 0  # (the adapter and its vocabulary rows on int8 weights)
    assert " ".join(map(str, hf_greedy(m, prompt, 12, eos=0))) in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is not an early-exit adapter"):
        (out / ADAPTER_CONFIG).write_text(json.dumps({"specdec_format": "x"}))
        main(["generate", "--model", str(tmp_path / "model"), "--early-exit", str(out), "--prompt-ids", "3 4"])


def test_e2e_bench_early_exit_row(tmp_path):
    from specdec_ext.bench.e2e import EARLY_EXIT, E2EConfig, run_e2e
    from specdec_ext.bench.models import tiny_random

    models = tiny_random(seed=0, max_positions=400)
    save_early_exit(EarlyExitAdapter.from_target_layer(models.target, 1), tmp_path / "ee")
    res = run_e2e(models, E2EConfig(num_prompts=2, prompt_len=16, max_new_tokens=8, temperatures=(0.0,),
                                    methods=[EARLY_EXIT], hf=False, early_exit=str(tmp_path / "ee")),
                  log=lambda s: 0)
    rows = {r["method"]: r for r in res["runs"]}
    assert set(rows) == {"plain", EARLY_EXIT} and rows[EARLY_EXIT]["tokens_per_s"] > 0
    assert "error" not in rows[EARLY_EXIT] and rows[EARLY_EXIT]["drafter_weight_mb"] > 0
    assert [c["equal"] for c in res["greedy_checks"]] == [True]
