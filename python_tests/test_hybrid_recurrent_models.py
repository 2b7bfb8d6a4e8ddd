"""Hybrid targets with input-dependent gates, verified exactly on trees: Qwen3-Next and Qwen3.5 (Gated DeltaNet +
gated softmax attention) and Bamba (Mamba-2 + attention).

For each family, a tiny random model (3 linear layers to 1 attention layer, float32; GQA in the DeltaNet heads,
Qwen3-Next with its MoE, Qwen3.5's text model dense; Bamba with 2 groups of B / C for 4 heads): after
prompts of different lengths, every tree node's logits equal Hugging Face's own forward of its path alone; after
``accept`` the committed recurrent states and convolution windows equal those Hugging Face's cache holds after the
accepted sequence; a second tree on top is exact again. A convolution window taken from the wrong ancestors (the
parent's window instead of the node's) breaks the equality. Greedy ``generate()`` with plain decoding, the n-gram
drafter and the draft-model drafter (the target without its linear mixers) equals Hugging Face's
``generate(do_sample=False)``, batch > 1 with different prompt lengths, and through the Engine with rows joining and
leaving. (The model's head size is not the tree kernel's: its attention verifies through the 4-D mask.)
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import random_parents, root_path  # noqa: E402
import test_drafter_eagle as eagle_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from test_generate_greedy import prompt_of  # noqa: E402
from test_hybrid_minimax import (NEW, V, engine_rows_equal_hf, generate_equals_hf, mixerless_draft,  # noqa: E402
                                 prefilled)

from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter, NgramDrafter  # noqa: E402
from specdec_ext.models.medusa import MedusaHeads  # noqa: E402
from specdec_ext.models import HybridCache, tree_forward  # noqa: E402
from specdec_ext import ops  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
TOL = 2e-6  # (float32: measured ~2e-7)

_MODELS: dict = {}
_SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, layer_types=LAYERS, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=128)
FAMILIES = {  # name -> (config class, model class, config, seed: one whose greedy output repeats itself, so that
    # the n-gram drafter's drafts are accepted)  (Bamba's mixers are scaled down, below, for the same reason)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32), 0),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _SMALL, 3),
    "bamba": ("BambaConfig", "BambaForCausalLM",
              dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=1, attn_layer_indices=[LAYERS.index("full_attention")], mamba_n_heads=4,
                   mamba_d_head=16, mamba_d_state=8, mamba_expand=1, mamba_n_groups=2, mamba_d_conv=4,
                   max_position_embeddings=128), 0),
}


def target(family: str):
    if family not in _MODELS:
        config_cls, model_cls, kwargs, seed = FAMILIES[family]
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = getattr(transformers, config_cls)(**kwargs)
            assert cfg.layer_types == LAYERS
            model = getattr(transformers, model_cls)(cfg).eval()
        with torch.no_grad():  # (random Mamba-2 mixers swamp the residual stream: greedy output never repeats)
            for layer in model.model.layers:
                if hasattr(layer, "mamba"):
                    layer.mamba.out_proj.weight.mul_(0.1)
        _MODELS[family] = model
    return _MODELS[family]


@torch.no_grad()
def hf_run(model, seq: list[int]):
    out = model(torch.tensor([seq]), use_cache=True)
    return out.logits[0], out.cache


def tree_errors(model, seed: int) -> tuple[float, float]:
    """(largest |tree logits - HF logits| over two rounds of trees, largest committed state / window error)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [prompt_of(n, 20 + n) for n in (5, 9, 2)]
    B, N = len(prompts), 9
    cache = prefilled(model, prompts)
    assert isinstance(cache, HybridCache)
    seqs = [list(p) for p in prompts]
    logit_err, state_err = 0.0, 0.0
    for round_ in range(2):
        parents = random_parents(B, N, gen, "random")
        tokens = torch.randint(3, V, (B, N), generator=gen)
        logits = tree_forward(model, cache, tokens, parents, cache.lengths)
        accepted = torch.full((B, N), -1, dtype=torch.int64)
        accept_len = torch.zeros(B, dtype=torch.int64)
        for b in range(B):
            prow = parents[b].tolist()
            for i in range(N):
                want = hf_run(model, seqs[b] + tokens[b, root_path(prow, i)].tolist())[0][-1]
                logit_err = max(logit_err, float((logits[b, i] - want).abs().max()))
            keep = root_path(prow, int(torch.randint(0, N, (1,), generator=gen)))[: 1 + round_ + b]
            accepted[b, : len(keep)] = torch.tensor(keep)
            accept_len[b] = len(keep) - 1
            seqs[b] += tokens[b, keep].tolist()
        cache.accept(accepted, accept_len, cache.lengths)
        for b in range(B):  # HF's cache after the accepted sequence: its states and the window's last K - 1 inputs
            hf_cache = hf_run(model, seqs[b])[1]
            for l in cache.linear_layers:
                hf_layer = hf_cache.layers[l]
                W = cache.linear_state(l, "conv").shape[-1]
                state_err = max(state_err,
                                float((cache.linear_state(l)[b] - hf_layer.recurrent_states[0][0]).abs().max()),
                                float((cache.linear_state(l, "conv")[b]
                                       - hf_layer.conv_states[0][0][:, -W:]).abs().max()))
    return logit_err, state_err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tree_logits_and_commits_equal_hf(family, monkeypatch):
    model = target(family)
    logit_err, state_err = tree_errors(model, seed=1)
    assert logit_err < TOL and state_err < TOL, (logit_err, state_err)
    # mutation: every node's convolution window taken from its parent's (one ancestor too high) must be caught
    real = ops.tree_causal_conv1d

    def parent_windows(x, conv_state, weight, bias, parents, activation=None, validate=True):
        shifted = x.gather(2, parents.clamp(min=0)[:, None, :].expand_as(x))
        return real(shifted, conv_state, weight, bias, parents, activation, validate)

    monkeypatch.setattr(ops, "tree_causal_conv1d", parent_windows)
    bad_logits, _ = tree_errors(model, seed=1)
    assert bad_logits > 10 * TOL, bad_logits


def make_drafter(kind: str, model):
    if kind == "plain":
        return None
    if kind == "ngram":
        return NgramDrafter(num_pred_tokens=4, max_ngram_size=3)
    return DraftModelDrafter(mixerless_draft(model), num_draft_tokens=4, tree_width=2 if kind == "tree" else 1)


PROMPTS = [prompt_of(n, 40 + n) for n in (7, 1, 12, 4)]


def references(family: str) -> list[list[int]]:
    if ("ref", family) not in _MODELS:
        _MODELS["ref", family] = [hf_greedy(target(family), p, NEW) for p in PROMPTS]
    return _MODELS["ref", family]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["plain", "ngram", "draft", "tree"])
def test_greedy_generate_equals_hf(family, kind):
    model = target(family)
    generate_equals_hf(model, make_drafter(kind, model), PROMPTS, references(family))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa"])
def test_greedy_generate_with_network_drafters_equals_hf(family, kind):
    """The drafters that read the target's hidden states (EAGLE-1 / EAGLE-3 drafts on EAGLE-2 trees, Medusa heads on
    a dynamic tree; random networks: few drafts are accepted, but some are) on each recurrent family: HF's greedy
    output, batch > 1."""
    model = target(family)
    if kind == "medusa":
        torch.manual_seed(11)
        heads = MedusaHeads(3, model.config.hidden_size)
        with torch.no_grad():
            for p in heads.parameters():
                p.normal_(0, 0.05)
        drafter = MedusaDrafter(heads, dynamic=True, max_nodes=8)
    else:
        seed = EAGLE3_SEEDS[family] if kind == "eagle3" else 0
        drafter = EagleDrafter(eagle_t.random_draft(int(kind[-1]), seed), target=model, depth=4, top_k=4,
                               total_tokens=16)
    generate_equals_hf(model, drafter, PROMPTS, references(family), min_accepted=1.0)


# random EAGLE-3 drafts that get some drafts accepted on each family (so that the test above is not vacuous)
EAGLE3_SEEDS = {"qwen3_next": 1, "qwen3_5": 1, "bamba": 0}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_rows_joining_and_leaving_equal_hf(family):
    model = target(family)
    prompts = PROMPTS + [prompt_of(n, 60 + n) for n in (3, 10)]
    refs = references(family) + [hf_greedy(model, p, NEW) for p in prompts[len(PROMPTS):]]
    engine_rows_equal_hf(model, make_drafter("ngram", model), prompts, refs)
