"""specdec_ext.generate, sampling: speculative sampling is lossless end to end.

A tiny-vocabulary target (V = 8, random 1-layer Llama) and a draft model with a perturbed output head. One generate
call runs B copies of the prompt as a batch (rows accept different lengths, so this also exercises per-row lengths
and retired rows); the first three generated tokens of every row are compared with the exact target distribution
(computed by running the target on every continuation): a chi-square test on the joint distribution of the first two
tokens and on the marginal of the third, for the draft-model drafter (chain of sampled drafts with their
probabilities, and the deterministic top-2 tree), the n-gram drafter (deterministic drafts) and, as a check of the
test itself, plain sampling.

False-alarm rate: each chi-square test rejects at p < 1e-3 (8 tests per parameter set, 2 parameter sets: at most
1.6% false alarms over independent seeds); seeds are fixed, so the outcome is deterministic. Power: replacing the
draft probabilities by a uniform distribution (a lossy verifier) gives p-values below 1e-200 here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
stats_mod = pytest.importorskip("scipy.stats")

from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext.drafters import DraftModelDrafter, NgramDrafter, ParallelDraftDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.ops.reference import filtered_weights  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


V = 8
ROWS = 5000
PROMPT = [3, 1, 4, 1, 5]


def tiny(seed: int, noise: float = 0.0):
    """A 1-layer Llama with V = 8; ``noise`` perturbs the output head (a draft close to, not equal to, seed's)."""
    model = make_model("llama", seed=seed, vocab_size=V, num_hidden_layers=1, num_attention_heads=1,
                       num_key_value_heads=1, hidden_size=32, intermediate_size=64)
    with torch.no_grad():  # sharper distributions than the near-uniform random init
        model.lm_head.weight.mul_(8.0)
        gen = torch.Generator().manual_seed(seed + 1)
        model.lm_head.weight.add_(noise * torch.randn(model.lm_head.weight.shape, generator=gen))
    return model


@torch.no_grad()
def exact_distributions(model, T: float, top_k: int, top_p: float):
    """p(t1, t2) [V, V] and p(t3) [V] of the target under the filters, by running every continuation."""
    def probs(seqs: torch.Tensor) -> torch.Tensor:
        logits = model(seqs).logits[:, -1].float()
        w = torch.stack([filtered_weights(row, T, top_k, top_p) for row in logits]).double()
        return w / w.sum(-1, keepdim=True)

    p1 = probs(torch.tensor([PROMPT]))[0]
    t1 = torch.arange(V)
    p2 = probs(torch.cat([torch.tensor(PROMPT).expand(V, -1), t1[:, None]], 1))  # [V(t1), V(t2)]
    joint = p1[:, None] * p2
    pairs = torch.cartesian_prod(t1, t1)
    p3 = probs(torch.cat([torch.tensor(PROMPT).expand(V * V, -1), pairs], 1))  # [V*V, V]
    third = (joint.reshape(-1, 1) * p3).sum(0)
    return joint, third


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test; cells with expected count < 5 are pooled."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = float(counts.sum())
    assert float(counts[probs == 0].sum()) == 0, "a token outside the target's support was generated"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if float(exp[-1]) < 5:  # pool too small: fold it into the smallest big cell
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[-1] += counts[~big].sum()
        exp[-1] += expected[~big].sum()
    return float(stats_mod.chisquare(obs.numpy(), exp.numpy() * float(obs.sum() / exp.sum())).pvalue)


def parallel(draft):
    """``draft`` as a parallel draft: one more vocabulary row, the mask token (its proposals after the first position
    are whatever the untrained mask gives: lossless verification must not care)."""
    draft.resize_token_embeddings(V + 1, mean_resizing=False)
    draft.config.pard_token, draft.config.pard_num_tokens = V, 3
    return draft


def stopping_at_random(drafter: DraftModelDrafter) -> DraftModelDrafter:
    """A draft model whose chains stop early at random (seeded): with one prompt in 5000 rows every row is rarely
    unsure at once, so the real stopping rule would hardly ever cut a chain here. Chains of varying length, with
    their draft probabilities, must stay lossless."""
    gen = torch.Generator().manual_seed(7)
    drafter._unsure = lambda logits, tok, probs: bool(torch.rand((), generator=gen) < 0.5)
    return drafter


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_speculative_sampling_matches_the_target_distribution(T, top_k, top_p):
    target, draft = tiny(21), tiny(21, noise=0.3)
    joint, third = exact_distributions(target, T, top_k, top_p)
    prompts = torch.tensor(PROMPT).expand(ROWS, -1).contiguous()
    for seed, drafter in ((1234, None), (4321, DraftModelDrafter(draft, num_draft_tokens=3)),
                          (5678, DraftModelDrafter(draft, num_draft_tokens=3, tree_width=2)),
                          (6789, DraftModelDrafter(draft, num_draft_tokens=3, tree_width=2, total_tokens=4)),
                          (8765, NgramDrafter(num_pred_tokens=2, max_ngram_size=2)),
                          (3579, ParallelDraftDrafter(parallel(tiny(21, noise=0.3)))),
                          (9753, ParallelDraftDrafter(parallel(tiny(21, noise=0.3)), tree_width=2, total_tokens=4)),
                          (2468, stopping_at_random(DraftModelDrafter(draft, num_draft_tokens=3,
                                                                      confidence_threshold=0.5)))):
        gen = torch.Generator().manual_seed(seed)
        out, st = generate(target, drafter, prompts, max_new_tokens=3, eos_token_id=[], temperature=T, top_k=top_k,
                           top_p=top_p, generator=gen)
        new = out[:, len(PROMPT):]
        assert new.shape == (ROWS, 3)
        pair = torch.bincount(new[:, 0] * V + new[:, 1], minlength=V * V)
        p_pair = chi_square_p(pair, joint)
        p_third = chi_square_p(torch.bincount(new[:, 2], minlength=V), third)
        assert p_pair > 1e-3 and p_third > 1e-3, (drafter, p_pair, p_third)
        if isinstance(drafter, NgramDrafter):  # "1" occurs in the prompt: it proposes "4 1" / "5 ..." after a "1"
            assert sum(st.accept_hist[1:]) > 0, st.accept_hist
        elif drafter is not None:
            # not vacuous: drafts were accepted, and some rejected (the residual distribution was sampled)
            assert st.accept_hist[0] > 0 and sum(st.accept_hist[1:]) > ROWS // 10, st.accept_hist
            assert st.mean_accepted_length > 1.1


def test_sampling_is_reproducible_with_a_seed():
    target, draft = tiny(21), tiny(21, noise=0.3)
    prompts = torch.tensor(PROMPT).expand(4, -1)
    a, _ = generate(target, DraftModelDrafter(draft, 3), prompts, max_new_tokens=6, eos_token_id=[], temperature=0.9,
                    seed=7)
    b, _ = generate(target, DraftModelDrafter(draft, 3), prompts, max_new_tokens=6, eos_token_id=[], temperature=0.9,
                    generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
