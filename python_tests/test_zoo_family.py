"""The shipped model families (specdec_ext/zoo/family, and the hybrid one in specdec_ext/zoo/hybrid): every
drafter's greedy output equals plain greedy decoding, and its mean accepted length stays above the floor recorded in
the model card — a regression in training, in the checkpoint loaders or in decoding fails here. The prompts are the
card's own (held-out source, stored as ids). On the hybrid family plain decoding also equals Hugging Face's own
greedy ``generate``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.zoo import SHIPPED_DIR, load_family  # noqa: E402
from specdec_ext.zoo.evaluate import evaluate_drafters  # noqa: E402
from specdec_ext.zoo.family import SHIPPED_HYBRID_DIR  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def family():
    return load_family(SHIPPED_DIR)


@pytest.fixture(scope="module", params=[SHIPPED_DIR, SHIPPED_HYBRID_DIR], ids=["family", "hybrid"])
def each_family(request):
    return load_family(request.param)


def test_the_hybrid_familys_plain_decoding_equals_hugging_faces_generate():
    """The trained hybrid target (its Lightning layers' states in a HybridCache) decodes greedily as Hugging Face's
    own generate does (its MiniMaxCache), on two of the card's prompts."""
    from hf_reference import hf_greedy
    from specdec_ext.models import HybridCache, make_cache

    fam = load_family(SHIPPED_HYBRID_DIR)
    assert fam.target.config.model_type == "minimax"
    assert isinstance(make_cache(fam.target.config, 1, 64), HybridCache)
    for prompt in fam.card["evaluation"]["prompt_ids"][:2]:
        ours, _ = generate(fam.target, None, torch.tensor(prompt), max_new_tokens=32, eos_token_id=[])
        assert ours[len(prompt):].tolist() == hf_greedy(fam.target, prompt, 32)


def test_card_describes_the_shipped_files(each_family):
    family = each_family
    card = family.card
    assert card["total_bytes"] <= 80e6  # the budget for everything shipped
    assert set(card["floors"]["mean_accepted_length"]) == set(family.drafter_names)
    n = sum(p.numel() for p in family.target.parameters())
    assert n == card["members"]["target"]["params"]
    assert 15e6 * 0.9 <= n <= 30e6


def test_every_drafter_is_greedy_identical_and_above_its_floor(each_family):
    family = each_family
    ev = family.card["evaluation"]
    prompts = ev["prompt_ids"]
    got = evaluate_drafters(family, prompts, ev["new_tokens"])
    floors = family.card["floors"]["mean_accepted_length"]
    for name in family.drafter_names:
        assert got[name]["greedy_identical"], name
        assert got[name]["mean_accepted_length"] >= floors[name], (name, got[name], floors[name])


def test_batched_family_generation_equals_each_prompt_alone(family):
    """Batch of the card's prompts (cut to different lengths) through EAGLE-3: each row equals its prompt alone."""
    prompts = [torch.tensor(p[: 20 + 9 * i]) for i, p in enumerate(family.card["evaluation"]["prompt_ids"][:4])]
    rows, stats = generate(family.target, family.make_drafter("eagle3"), prompts, max_new_tokens=24,
                           eos_token_id=[])
    for p, row in zip(prompts, rows):
        alone, _ = generate(family.target, None, p, max_new_tokens=24, eos_token_id=[])
        assert row.tolist() == alone.tolist()
    assert stats.mean_accepted_length > 1.5


def test_bfloat16_eagle_drafts_for_the_float32_target():
    """load_family(eagle_dtype=bfloat16): the EAGLE drafts run in bfloat16 (their files' exact weights) for the
    float32 target; outputs stay the target's greedy ones and acceptance stays at the card's level."""
    fam = load_family(SHIPPED_DIR, eagle_dtype=torch.bfloat16)
    assert fam.target.lm_head.weight.dtype == torch.float32
    assert fam.eagle1.fc.weight.dtype == fam.eagle3.fc.weight.dtype == torch.bfloat16
    ev = fam.card["evaluation"]
    got = evaluate_drafters(fam, ev["prompt_ids"], ev["new_tokens"], names=("eagle2", "eagle3"))
    floors = fam.card["floors"]["mean_accepted_length"]
    for name in ("eagle2", "eagle3"):
        assert got[name]["greedy_identical"], name
        assert got[name]["mean_accepted_length"] >= floors[name], (name, got[name], floors[name])
    with pytest.raises(ValueError, match="eagle_dtype"):
        load_family(SHIPPED_DIR, eagle_dtype="int8")


def test_eagle1_drafts_use_the_familys_frequent_ids(family):
    """"draft_vocab": "frequent" reads eagle1/draft_vocab.json (the training data's most frequent ids); a family
    without the file (built before it existed) falls back to the EAGLE-3 draft's vocabulary."""
    import dataclasses
    import json
    import os

    with open(os.path.join(family.path, "eagle1", "draft_vocab.json")) as f:
        ids = json.load(f)["ids"]
    assert len(ids) == family.card["spec"]["eagle1_vocab"] and ids == sorted(set(ids))
    for name in ("eagle1", "eagle2"):
        assert family.make_drafter(name).draft_vocab.tolist() == ids
    older = dataclasses.replace(family, path="/nonexistent-family")
    e3 = family.eagle3
    want = e3.to_target_ids(torch.arange(e3.draft_vocab_size)).sort().values
    assert torch.equal(older.make_drafter("eagle2").draft_vocab, want)
