"""Hybrid targets, MiniMax (Lightning attention + softmax attention): trees verified exactly in one forward.

* The spec (``reference.tree_linear_attention`` / ``commit_linear_state``) against a brute-force recurrence in
  float64: every root-to-node path run step by step from the saved state; commits of paths of different lengths.
* A tiny random MiniMax (3 Lightning layers to 1 softmax layer, as MiniCPM-SALA; float32): after prompts of
  different lengths, every tree node's logits equal Hugging Face's own forward of the node's path alone (its own
  ``MiniMaxCache``: prefill, then the path through its recurrent decode), through the tree kernel and the 4-D mask
  fallback; after ``accept`` the committed Lightning states and the attention K/V equal those of the accepted
  sequence prefilled from scratch by Hugging Face; a second tree on top of the commit is exact again. The decay off
  by 1e-3 (in our path only) breaks the equality: the test can fail.
* Greedy ``generate()`` with plain decoding, the n-gram drafter, the draft-model drafter (chain, top-2 tree,
  EAGLE-2-style dynamic tree; the draft is the target with its Lightning mixers dropped, an attention-only MiniMax)
  and EAGLE-1 / EAGLE-3 trees (random drafts fed the hybrid's hidden states) is token-identical to Hugging Face's
  ``generate(do_sample=False)``, batch > 1 with different prompt lengths; the same through the Engine with requests
  joining and leaving a smaller batch.
* Rows joining past the allocated capacity and leaving: each row's states move with it, and decoding goes on exact.
* Refusals: unsupported hybrid layer types (Jamba's Mamba) name the layer type; a hybrid cache refuses
  what its recurrent states cannot do (going back, a tree off the committed lengths, committing a non-chain by
  rewind, ordinary forwards, level-by-level trees).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import random_parents, root_path  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
import test_drafter_eagle as eagle_t  # noqa: E402
from test_engine import run as run_engine, staggered  # noqa: E402
from test_generate_greedy import prompt_of  # noqa: E402  (repetitive prompts: the n-gram drafter finds matches)

from specdec_ext import Engine, ops  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, NgramDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models import (HybridCache, TreeKVCache, extend, make_cache, masked_forward,  # noqa: E402
                                tree_forward, use_tree_attention)
from specdec_ext.models import linear_layers  # noqa: E402
from specdec_ext.ops import reference as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 101  # (test_generate_greedy's vocabulary, which prompt_of draws from)
# 3 Lightning layers to 1 softmax layer, as MiniCPM-SALA. Layer 0 is the attention layer: HF's own MiniMax decoding
# (the reference) reads positions and mask sizes from layer 0 of its cache, which stays empty when layer 0 is linear
# (transformers 5.24: its prefill-then-decode logits then differ from its full forward by ~1e-2).
LAYERS = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]
NEW = 16


def minimax_config(**over):
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2, layer_types=LAYERS,
              block_size=4, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
    kw.update(over)
    return transformers.MiniMaxConfig(**kw)


_MODELS: dict = {}
SCALE = 0.6  # the Lightning mixers' output scale: the mixerless draft's drafts are accepted, not all of them


def target():
    """The tiny hybrid (head_dim 64: the tree kernel's); its Lightning mixers' outputs scaled down, so that the
    attention-only draft below (the same model without them) predicts it often but not always."""
    if "t" not in _MODELS:
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = transformers.MiniMaxForCausalLM(minimax_config()).eval()
        with torch.no_grad():
            for layer in m.model.layers:
                if layer.block_type == "linear_attention":
                    layer.self_attn.out_proj.weight.mul_(SCALE)
        _MODELS["t"] = m
    return _MODELS["t"]


def mixerless_draft(model):
    """``model`` with its linear mixers dropped: the same hybrid class with every layer ``full_attention`` and the
    target's weights, whose former linear layers' attention outputs are zero (o_proj = 0)."""
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "attn_layer_indices"):  # (Bamba derives its layer types from the attention layers' indices)
        cfg.attn_layer_indices = list(range(cfg.num_hidden_layers))
    else:
        cfg.layer_types = ["full_attention"] * len(cfg.layer_types)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = type(model)(cfg).eval()
    own = {k: v for k, v in model.state_dict().items() if k in d.state_dict() and
           d.state_dict()[k].shape == v.shape}
    d.load_state_dict(own, strict=False)
    with torch.no_grad():
        for i, t in enumerate(model.config.layer_types):
            if t == "linear_attention":
                d.model.layers[i].self_attn.o_proj.weight.zero_()
    return d


# ---------------------------------------------------------------------------------------------------------------
# The spec against the recurrence, step by step.


def recurrence_outputs(q, k, v, state, log_decay, parents):
    """Brute force, float64: node i's output is q_i S after running S <- a S + k_j^T v_j along its root path."""
    B, H, N, _ = q.shape
    a = log_decay.double().exp()[:, None, None]
    out = torch.zeros(B, H, N, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        prow = parents[b].tolist()
        for i in range(N):
            S = state[b].double().clone()
            for j in root_path(prow, i):
                S = a * S + k[b, :, j, :, None].double() @ v[b, :, j, None, :].double()
            out[b, :, i] = (q[b, :, i, None, :].double() @ S)[:, 0]
    return out


@pytest.mark.parametrize("kind", ["random", "deep", "wide", "chain", "star"])
def test_spec_equals_the_recurrence_along_every_path(kind):
    gen = torch.Generator().manual_seed(7)
    B, H, N, Dk, Dv = 3, 3, 11, 8, 5
    q, k = torch.randn(B, H, N, Dk, generator=gen), torch.randn(B, H, N, Dk, generator=gen)
    v = torch.randn(B, H, N, Dv, generator=gen)
    state = torch.randn(B, H, Dk, Dv, generator=gen)
    log_decay = torch.tensor([-0.3, -0.01, 0.0])  # (a = 1 included: no decay)
    parents = random_parents(B, N, gen, kind)
    got = ref.tree_linear_attention(q, k, v, state, log_decay, parents)
    want = recurrence_outputs(q, k, v, state, log_decay, parents)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    # the commit: each row's state after a path of its own length (0 included), through the chosen nodes
    lengths = torch.tensor([0, 3, 1])
    path = torch.full((B, N), -1, dtype=torch.int64)
    a = log_decay.double().exp()[:, None, None]
    expect = state.double().clone()
    for b in range(B):
        prow = parents[b].tolist()
        nodes = root_path(prow, max(range(N), key=lambda i: (len(root_path(prow, i)), i)))[: int(lengths[b])]
        path[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
        lengths[b] = len(nodes)
        for j in nodes:
            expect[b] = a * expect[b] + k[b, :, j, :, None].double() @ v[b, :, j, None, :].double()
    committed = state.clone()
    ref.commit_linear_state(committed, k, v, log_decay, path, lengths)
    torch.testing.assert_close(committed.double(), expect, atol=1e-4, rtol=1e-4)
    # and the committed state feeds the next tree as the prefix state: node outputs of a one-node tree
    q1 = q[:, :, :1]
    one = ref.tree_linear_attention(q1, k[:, :, :1], v[:, :, :1], committed, log_decay, parents[:, :1])
    torch.testing.assert_close(one.double(), recurrence_outputs(q1, k[:, :, :1], v[:, :, :1], committed,
                                                                log_decay, parents[:, :1]), atol=1e-4, rtol=1e-4)


def test_spec_bad_input_names_the_argument():
    B, H, N, D = 1, 2, 3, 4
    q = torch.randn(B, H, N, D)
    state = torch.zeros(B, H, D, D)
    parents = random_parents(B, N, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"log_decay\[1\] must be finite and <= 0"):
        ref.tree_linear_attention(q, q, q, state, torch.tensor([-0.1, 0.5]), parents)
    with pytest.raises(ValueError, match="log_decay must have shape"):
        ref.tree_linear_attention(q, q, q, state, torch.tensor([-0.1]), parents)
    bad = parents.clone()
    bad[0, 2] = 2
    with pytest.raises(ValueError, match=r"tree_linear_attention: parents\[0, 2\] = 2 is not an earlier node"):
        ref.tree_linear_attention(q, q, q, state, torch.tensor([-0.1, -0.2]), bad)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 4 is out of range"):
        ref.commit_linear_state(state, q, q, torch.tensor([-0.1, -0.2]), torch.zeros(1, 3, dtype=torch.int64),
                                torch.tensor([4]))
    before = state.clone()
    with pytest.raises(ValueError, match=r"path\[0, 1\] = 3 is out of range \[0, N\)"):
        ref.commit_linear_state(state, q, q, torch.tensor([-0.1, -0.2]), torch.tensor([[0, 3, -1]]),
                                torch.tensor([2]))
    assert torch.equal(state, before)  # an invalid row is left untouched


# ---------------------------------------------------------------------------------------------------------------
# The model: tree logits and committed states against Hugging Face's own forward.


@torch.no_grad()
def hf_run(model, seq: list[int]):
    """Hugging Face's own forward of ``seq`` from scratch (its MiniMaxCache; SDPA): (logits [T, V], cache)."""
    out = model(torch.tensor([seq]), use_cache=True)
    return out.logits[0], out.cache


@torch.no_grad()
def hf_path_logits(model, prompt: list[int], path: list[int]) -> torch.Tensor:
    """The logits after each token of ``path``, ``prompt`` prefilled first and the path then run through HF's
    recurrent decoding (its cache holds the Lightning states)."""
    _, cache = hf_run(model, prompt)
    return model(torch.tensor([path]), cache=cache, use_cache=True).logits[0]


def prefilled(model, prompts: list[list[int]], max_len: int = 64) -> HybridCache:
    cache = make_cache(model.config, len(prompts), max_len)
    T = max(len(p) for p in prompts)
    toks = torch.zeros(len(prompts), T, dtype=torch.int64)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = torch.tensor(p)
    extend(model, cache, toks, torch.tensor([len(p) for p in prompts]))
    return cache


def tree_errors(model, use_kernel: bool, seed: int) -> tuple[float, float]:
    """(largest |tree logits - HF path logits| over two rounds of trees, largest committed-state error)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [prompt_of(n, 20 + n) for n in (5, 9, 2)]
    B, N = len(prompts), 9
    if use_kernel:
        assert use_tree_attention(model)
    try:
        cache = prefilled(model, prompts)
        assert isinstance(cache, HybridCache) and cache.lengths.tolist() == [len(p) for p in prompts]
        seqs = [list(p) for p in prompts]
        logit_err, state_err = 0.0, 0.0
        for round_ in range(2):
            parents = random_parents(B, N, gen, "random")
            tokens = torch.randint(3, V, (B, N), generator=gen)
            if use_kernel:
                use_tree_attention(model)
            logits = tree_forward(model, cache, tokens, parents, cache.lengths)
            accepted = torch.full((B, N), -1, dtype=torch.int64)
            accept_len = torch.zeros(B, dtype=torch.int64)
            model.set_attn_implementation("sdpa")  # (the reference runs HF's own attention)
            for b in range(B):
                prow = parents[b].tolist()
                for leaf in (i for i in range(N) if i not in prow):
                    path = root_path(prow, leaf)
                    want = hf_path_logits(model, seqs[b], tokens[b, path].tolist())
                    logit_err = max(logit_err, float((logits[b, path] - want).abs().max()))
                leaf = int(torch.randint(0, N, (1,), generator=gen))
                keep = root_path(prow, leaf)[: 1 + round_ + b]  # rows accept different lengths
                accepted[b, : len(keep)] = torch.tensor(keep)
                accept_len[b] = len(keep) - 1
                seqs[b] += tokens[b, keep].tolist()
            cache.accept(accepted, accept_len, cache.lengths)
            assert cache.lengths.tolist() == [len(s) for s in seqs]
            for b in range(B):  # committed states and K/V = the accepted sequence prefilled by HF
                _, hf_cache = hf_run(model, seqs[b])
                for l in cache.linear_layers:
                    state_err = max(state_err, float((cache.linear_state(l)[b]
                                                      - hf_cache.linear_cache[l][0]).abs().max()))
                n = len(seqs[b])
                torch.testing.assert_close(cache.layers[0].keys[b, :, :n], hf_cache.layers[0].keys[0])
                torch.testing.assert_close(cache.layers[0].values[b, :, :n], hf_cache.layers[0].values[0])
        return logit_err, state_err
    finally:
        model.set_attn_implementation("sdpa")


TOL = 2e-6  # (float32: measured ~2e-7 on the logits; the mutated decay moves them by ~1e-4)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "mask"])
def test_tree_logits_and_commits_equal_hf(use_kernel, monkeypatch):
    model = target()
    logit_err, state_err = tree_errors(model, use_kernel, seed=1)
    assert logit_err < TOL and state_err < TOL, (logit_err, state_err)
    # mutation: the decay off by 1e-3 in our path only must break both equalities
    real = linear_layers.lightning_log_decay
    monkeypatch.setattr(linear_layers, "lightning_log_decay", lambda m: real(m) + math.log1p(-1e-3))
    bad_logits, bad_state = tree_errors(model, use_kernel, seed=1)
    assert bad_logits > 10 * TOL and bad_state > 10 * TOL, (bad_logits, bad_state)


def test_long_prefill_runs_in_chunks_and_stays_exact():
    """A prompt longer than CHAIN_CHUNK goes through the chunked chain path: the state and the next logits are
    HF's."""
    model = target()
    prompt = prompt_of(linear_layers.CHAIN_CHUNK + 37, 3)
    cache = make_cache(model.config, 1, len(prompt) + 4)
    logits = extend(model, cache, torch.tensor([prompt]))
    want, hf_cache = hf_run(model, prompt)
    torch.testing.assert_close(logits[0], want, atol=TOL, rtol=1e-4)
    for l in cache.linear_layers:
        torch.testing.assert_close(cache.linear_state(l)[0], hf_cache.linear_cache[l][0], atol=TOL, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Greedy generation: every drafter, batch > 1, the engine with rows joining and leaving.


def make_drafter(kind: str, model):
    if kind == "plain":
        return None
    if kind == "ngram":
        return NgramDrafter(num_pred_tokens=4, max_ngram_size=3)
    draft = mixerless_draft(model)
    if kind == "tree":
        return DraftModelDrafter(draft, num_draft_tokens=4, tree_width=2)
    if kind == "dynamic":
        return DraftModelDrafter(draft, num_draft_tokens=4, tree_width=2, total_tokens=6)
    return DraftModelDrafter(draft, num_draft_tokens=4)


PROMPTS = [prompt_of(n, 40 + n) for n in (7, 1, 12, 4)]


def references() -> list[list[int]]:
    if "ref" not in _MODELS:
        _MODELS["ref"] = [hf_greedy(target(), p, NEW) for p in PROMPTS]
    return _MODELS["ref"]


def generate_equals_hf(model, drafter, prompts: list[list[int]], refs: list[list[int]],
                       min_accepted: float = 1.2) -> None:
    """One greedy generate() over every prompt (a batch of different lengths) gives HF's continuations; one target
    forward a step; drafts were accepted (not vacuous: mean accepted length > ``min_accepted``)."""
    outs, stats = generate(model, drafter, [torch.tensor(p) for p in prompts], max_new_tokens=NEW, eos_token_id=[])
    assert [o[len(p):].tolist() for o, p in zip(outs, prompts)] == refs
    assert stats.target_forwards == stats.steps
    if drafter is None:
        assert stats.mean_accepted_length == 1.0
    else:
        assert stats.mean_accepted_length > min_accepted, stats.mean_accepted_length


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft", "tree", "dynamic"])
def test_greedy_generate_equals_hf(kind):
    model = target()
    generate_equals_hf(model, make_drafter(kind, model), PROMPTS, references())


@pytest.mark.parametrize("version", [1, 3])
def test_greedy_generate_with_eagle_trees_equals_hf(version):
    """EAGLE-1 / EAGLE-3 drafts (random networks: few drafts are accepted, but some are) on EAGLE-2 trees of 16
    nodes, fed the hybrid's hidden states: HF's greedy output."""
    model = target()
    drafter = EagleDrafter(eagle_t.random_draft(version), target=model, depth=4, top_k=4, total_tokens=16)
    generate_equals_hf(model, drafter, PROMPTS, references(), min_accepted=1.0)


def engine_rows_equal_hf(model, drafter, prompts: list[list[int]], refs: list[list[int]]):
    """Requests of different budgets join an engine of two rows (three at the start, one queued, then one a step)
    and leave it: each one's tokens equal HF's greedy continuation of its prompt alone. Returns the engine's stats."""
    budgets = [NEW - 3 * (b % 3) for b in range(len(prompts))]
    arrivals = staggered(prompts, budgets, 3)  # (3 at the start, then one a step)
    with Engine(model, drafter, max_batch=2, max_len=64, eos_token_id=[]) as engine:
        tokens, _, _ = run_engine(engine, arrivals)
    assert isinstance(engine.cache, HybridCache)
    for b in range(len(prompts)):
        assert tokens[b] == refs[b][: budgets[b]], b
    assert engine.stats.joins >= 3 and engine.stats.retirements >= 3
    return engine.stats


@pytest.mark.parametrize("kind", ["ngram", "tree"])
def test_engine_rows_joining_and_leaving_equal_hf(kind):
    model = target()
    prompts = PROMPTS + [prompt_of(n, 60 + n) for n in (3, 10)]
    refs = references() + [hf_greedy(model, p, NEW) for p in prompts[len(PROMPTS):]]
    stats = engine_rows_equal_hf(model, make_drafter(kind, model), prompts, refs)
    assert stats.mean_accepted_length > 1.0


# ---------------------------------------------------------------------------------------------------------------
# Refusals.


def test_unsupported_hybrid_layers_are_refused_by_name():
    cfg = transformers.JambaConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, attn_layer_period=2,
                                   attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                   mamba_d_state=8, mamba_expand=1)
    refusal = r"'jamba' layers of type \['linear_attention'\] are not supported"
    with pytest.raises(NotImplementedError, match=refusal + r".*minimax 'linear_attention' \(Lightning"):
        make_cache(cfg, 1, 16)
    with pytest.raises(NotImplementedError, match=r"TreeKVCache holds full/sliding attention layers only, got "
                                                  r"\['linear_attention'\].*make_cache"):
        TreeKVCache(cfg, 1, 16)
    with pytest.raises(NotImplementedError, match="MiniMax with sliding_window = 8 is not supported"):
        make_cache(minimax_config(sliding_window=8), 1, 16)
    with pytest.raises(NotImplementedError, match=refusal):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Engine(transformers.JambaForCausalLM(cfg).eval(), max_len=32)
    llama = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2)
    assert type(make_cache(llama, 1, 8)) is TreeKVCache
    with pytest.raises(ValueError, match="HybridCache: the model has no linear-attention layers"):
        HybridCache(llama, 1, 8)


def test_hybrid_cache_refuses_what_a_recurrent_state_cannot_do():
    model = target()
    cache = prefilled(model, [prompt_of(5, 1), prompt_of(3, 2)])
    with pytest.raises(ValueError, match=r"lengths \[4, 3\] below the committed lengths \[5, 3\]"):
        cache.rewind(torch.tensor([4, 3]))
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match=r"lengths \[5, 2\] below the committed lengths"):
        tree_forward(model, cache, torch.tensor([[5], [6]]), None, torch.tensor([5, 2]))  # a tree off the commits
    with pytest.raises(ValueError, match="reach past the committed lengths"):
        cache.rewind(torch.tensor([6, 3]))  # no forward left to commit
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    tree_forward(model, cache, tokens, torch.tensor([[-1, 0, 0], [-1, 0, 0]]))
    with pytest.raises(ValueError, match="not a chain from the root"):
        cache.rewind(cache.lengths + 3)
    with pytest.raises(ValueError, match="masked_forward: a HybridCache's linear layers"):
        masked_forward(model, cache, tokens, tokens, cache.lengths, torch.ones(2, 3, 8, dtype=torch.bool))
    level = prefilled(model, [prompt_of(4, 1), prompt_of(4, 2)])  # (rows of equal lengths: HF's own checks pass)
    with pytest.raises(ValueError, match="ran outside a verification forward"):
        model(torch.tensor([[5], [6]]), cache=level, use_cache=False)


def test_rows_join_past_the_capacity_and_leave_with_their_states():
    """add_rows past the allocated rows reallocates (states and lengths kept), keep_rows moves each row's states
    with it: every row's states stay those of its own prompt, prefilled alone."""
    model = target()
    prompts = [prompt_of(n, 80 + n) for n in (5, 2, 7, 4)]
    alone = [prefilled(model, [p]) for p in prompts]
    cache = make_cache(model.config, 0, 64, capacity=1)
    for c in alone[:1] + [prefilled(model, prompts[1:])]:  # one row, then three (past the capacity)
        cache.add_rows(c)
    assert cache.capacity >= 4 and cache.lengths.tolist() == [len(p) for p in prompts]
    cache.keep_rows(torch.tensor([3, 1, 2]))  # row 0 leaves, row 3 takes its slot

    def check(rows):
        for b, r in enumerate(rows):
            for l in cache.linear_layers:
                torch.testing.assert_close(cache.linear_state(l)[b], alone[r].linear_state(l)[0])

    check([3, 1, 2])
    with pytest.raises(ValueError, match="src must be a HybridCache of the same model"):
        cache.add_rows(make_cache(mixerless_draft(model).config, 1, 8))
    cache.add_rows(alone[0])
    check([3, 1, 2, 0])
    # and decoding on goes on from the moved states: one more token per row equals HF's
    tokens = torch.tensor([[7], [8], [9], [10]])
    logits = extend(model, cache, tokens)
    for b, r in enumerate([3, 1, 2, 0]):
        want = hf_run(model, prompts[r] + [int(tokens[b, 0])])[0][-1]
        torch.testing.assert_close(logits[b, -1], want, atol=TOL, rtol=1e-4)
