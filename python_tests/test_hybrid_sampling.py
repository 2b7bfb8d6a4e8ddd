"""Speculative sampling on a hybrid target (MiniMax: Lightning + softmax attention) is lossless end to end.

test_generate_sampling's chi-square test on a tiny-vocabulary hybrid: 5000 copies of one prompt in one generate
call (rows accept different lengths, so their Lightning states commit paths of different lengths), the first three
generated tokens against the target's exact distribution (Hugging Face's own forward of every continuation), for
plain sampling (a check of the test), the draft-model drafter (sampled chain, top-2 tree) and the n-gram drafter.
The draft is the target without its Lightning mixers, its output head perturbed. p < 1e-3 per test.

Power: the Lightning layer's output is scaled up so that its state weighs in; committing only each accepted path's
root to the states (drafts accepted but never folded in) gives p-values below 1e-60 here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

from test_generate_sampling import PROMPT, ROWS, V, chi_square_p, exact_distributions  # noqa: E402
from test_hybrid_minimax import mixerless_draft  # noqa: E402

from specdec_ext.drafters import DraftModelDrafter, NgramDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# layer 0 is the Lightning layer: MiniMax scales its decay down with depth, to ~0 in the last layer
LAYERS = ["linear_attention", "full_attention"]
LIGHTNING_SCALE = 30.0


def tiny_minimax(layer_types: list[str], seed: int = 21):
    cfg = transformers.MiniMaxConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
                                     num_experts_per_tok=1, layer_types=layer_types, block_size=4,
                                     max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = transformers.MiniMaxForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than the near-uniform random init; the Lightning layer weighs in
        m.lm_head.weight.mul_(8.0)
        for i, t in enumerate(layer_types):
            if t == "linear_attention":
                m.model.layers[i].self_attn.out_proj.weight.mul_(LIGHTNING_SCALE)
    return m


def noisy_mixerless_draft(target, noise: float = 0.3):
    """The target without its Lightning mixer (test_hybrid_minimax's draft), output head perturbed."""
    d = mixerless_draft(target)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(22)
        d.lm_head.weight.add_(noise * torch.randn(d.lm_head.weight.shape, generator=gen))
    return d


def test_speculative_sampling_on_a_hybrid_matches_the_target_distribution():
    target = tiny_minimax(LAYERS)
    draft = noisy_mixerless_draft(target)
    joint, third = exact_distributions(target, 1.0, 0, 1.0)
    prompts = torch.tensor(PROMPT).expand(ROWS, -1).contiguous()
    for seed, drafter in ((1234, None), (4321, DraftModelDrafter(draft, num_draft_tokens=3)),
                          (5678, DraftModelDrafter(draft, num_draft_tokens=3, tree_width=2)),
                          (8765, NgramDrafter(num_pred_tokens=2, max_ngram_size=2))):
        gen = torch.Generator().manual_seed(seed)
        out, st = generate(target, drafter, prompts, max_new_tokens=3, eos_token_id=[], temperature=1.0,
                           generator=gen)
        new = out[:, len(PROMPT):]
        assert new.shape == (ROWS, 3)
        p_pair = chi_square_p(torch.bincount(new[:, 0] * V + new[:, 1], minlength=V * V), joint)
        p_third = chi_square_p(torch.bincount(new[:, 2], minlength=V), third)
        assert p_pair > 1e-3 and p_third > 1e-3, (drafter, p_pair, p_third)
        if isinstance(drafter, NgramDrafter):  # "1" occurs in the prompt: it proposes "4 1" / "5 ..." after a "1"
            assert sum(st.accept_hist[1:]) > 0, st.accept_hist
        elif drafter is not None:  # not vacuous: drafts were accepted, and some rejected
            assert st.accept_hist[0] > 0 and sum(st.accept_hist[1:]) > ROWS // 10, st.accept_hist
