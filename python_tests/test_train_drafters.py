"""specdec_ext.train on a tiny random Llama target (4 layers, hidden 64, vocab 101): Medusa-1, EAGLE-1, EAGLE-3 and
a distilled draft LM are trained on the target's own greedy continuations (self-distillation) for a few dozen
steps, on one thread. Checked: the loss falls; the saved files are in the official layouts and load through our loaders; the
trained drafter is lossless through generate (greedy == plain greedy) and accepts more than an untrained one (on
the training prompts: this target's continuations are memorised, not generalised); a resumed run equals an
uninterrupted one."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.checkpoints import load_eagle, load_medusa  # noqa: E402
from specdec_ext.models.eagle import Eagle1Model, Eagle3Model  # noqa: E402
from specdec_ext.train import TrainConfig, self_distill, train_draft_lm, train_eagle, train_medusa  # noqa: E402
from specdec_ext.train.loop import CHECKPOINT_FILE, evaluate_acceptance  # noqa: E402
from specdec_ext.train.eagle import eagle_drafter  # noqa: E402
from specdec_ext.train.medusa import medusa_drafter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 24
_CACHE: dict = {}


def target():
    if "m" not in _CACHE:
        _CACHE["m"] = make_model("llama", seed=11, num_hidden_layers=4)
    return _CACHE["m"]


def data():
    if "d" not in _CACHE:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, V, (4,), generator=g).tolist() for _ in range(12)]
        seqs = self_distill(target(), [p[:2] + [0] * 28 for p in prompts], prompt_len=2, new_tokens=28,
                            eos_token_id=[], progress=False)  # 2 random tokens, the target's 28
        _CACHE["d"] = seqs, [s[:4] for s in seqs[:6]]
    return _CACHE["d"]


def cfg(steps=40, lr=3e-3, **kw):
    return TrainConfig(steps=steps, lr=lr, batch_size=6, progress=False, eval_new_tokens=NEW, **kw)


def plain(prompts):
    if "plain" not in _CACHE:
        _CACHE["plain"] = generate(target(), None, [torch.tensor(p) for p in prompts], max_new_tokens=NEW,
                                   eos_token_id=[])[0]
    return _CACHE["plain"]


def check_lossless(drafter, prompts):
    out, stats = generate(target(), drafter, [torch.tensor(p) for p in prompts], max_new_tokens=NEW, eos_token_id=[])
    for a, b in zip(out, plain(prompts)):
        assert a.tolist() == b.tolist()
    return stats.mean_accepted_length


def falls(losses, ratio=0.5):
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert last < ratio * first, (first, last)
    return first, last


@pytest.mark.parametrize("share", [False, True])
def test_medusa_trains_saves_and_decodes(tmp_path, share):
    seqs, prompts = data()
    heads, res = train_medusa(target(), seqs, cfg(lr=6e-3), num_heads=3, heldout_prompts=prompts, share_lm_head=share)
    # heads sharing the target's lm_head (one ResBlock of 64 features each) learn slower than heads with their own
    print("medusa loss", falls(res.losses, 0.8 if share else 0.5), "accepted", res.evals)
    out = tmp_path / "medusa"
    from specdec_ext.models.checkpoints import save_medusa

    save_medusa(heads, out, base_model_name_or_path="tiny", safetensors=True)
    from safetensors.torch import load_file

    keys = set(load_file(out / "medusa_lm_head.safetensors"))
    own = () if share else ("1.weight",)
    assert keys == {f"{h}.{k}" for h in range(3) for k in ("0.linear.weight", "0.linear.bias", *own)}
    assert json.loads((out / "config.json").read_text())["medusa_num_heads"] == 3
    loaded = load_medusa(out, target=target())
    for a, b in zip(loaded.state_dict().values(), heads.state_dict().values()):
        assert torch.equal(a, b)
    # the evaluation's drafter (the library's CPU tree) reproduces its number; the 63-choice tree shows the learning
    assert check_lossless(medusa_drafter(loaded, target()), prompts) == pytest.approx(res.evals[-1][1])
    assert check_lossless(MedusaDrafter(loaded), prompts) > 2.0


def test_medusa_soft_labels_are_the_targets_future_distributions():
    """medusa_loss(soft_labels=True) = sum_h decay^h * mean over positions t of KL(target's distribution of token
    t + 2 + h || head h at t), computed here position by position; and training on it decodes losslessly."""
    import torch.nn.functional as F

    from specdec_ext.drafters import MedusaHeads
    from specdec_ext.train.medusa import medusa_loss

    torch.manual_seed(0)
    model = target()
    heads = MedusaHeads(2, model.config.hidden_size, model.config.vocab_size, 1)
    with torch.no_grad():
        for prm in heads.parameters():  # not the identity / zero initialisation: heads that disagree with the target
            prm.normal_(0, 0.1)
    toks = torch.randint(3, V, (2, 9))
    mask = torch.ones_like(toks, dtype=torch.bool)
    mask[1, 7:] = False  # padding: positions whose token t + 2 + h is padding do not count
    with torch.no_grad():
        loss, _ = medusa_loss(heads, model, toks, mask, decay=0.5, soft_labels=True)
        out = model(input_ids=toks, attention_mask=mask.long(), output_hidden_states=True)
        hid, logits = out.hidden_states[-1].float(), out.logits.float()
        want = 0.0
        for h in range(2):
            kls = []
            for b in range(2):
                for t in range(9 - (h + 2)):
                    if not mask[b, t + h + 2]:
                        continue
                    p = F.log_softmax(logits[b, t + h + 1], -1)
                    q = F.log_softmax(heads.heads[h](hid[b, t]), -1)
                    kls.append(float((p.exp() * (p - q)).sum()))
            want += 0.5 ** h * sum(kls) / len(kls)
    assert float(loss) == pytest.approx(want, rel=1e-4)
    seqs, prompts = data()
    trained, res = train_medusa(target(), seqs, cfg(steps=25), num_heads=3, share_lm_head=True, soft_labels=True)
    falls(res.losses, 0.9)
    assert check_lossless(MedusaDrafter(trained), prompts) > 1.0


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_trains_saves_and_beats_untrained(tmp_path, version):
    seqs, prompts = data()
    kw = dict(version=version, draft_vocab=64 if version == 3 else None, heldout_prompts=prompts)
    untrained, r0 = train_eagle(target(), seqs, cfg(steps=1), **kw)
    model, res = train_eagle(target(), seqs, cfg(steps=50 if version == 3 else 40), **kw)
    print(f"eagle{version} loss", falls(res.losses), "accepted", r0.evals[-1][1], "->", res.evals[-1][1])
    assert res.evals[-1][1] > max(2.0, r0.evals[-1][1] + 0.5)
    from specdec_ext.models.checkpoints import save_eagle

    save_eagle(model, tmp_path, base_model_name_or_path="tiny", safetensors=True)
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "model.safetensors"))
    if version == 1:
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
                "layers.0.post_attention_layernorm.weight"} <= keys
        assert not any("input_layernorm" in k or k.startswith("lm_head") for k in keys)
    else:
        assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
        cfg3 = json.loads((tmp_path / "config.json").read_text())
        assert cfg3["draft_vocab_size"] == 64 and cfg3["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
    loaded = load_eagle(tmp_path, target=target())
    assert isinstance(loaded, Eagle1Model if version == 1 else Eagle3Model)
    acc = check_lossless(eagle_drafter(loaded, target()), prompts)  # the evaluation's drafter: the library's CPU tree
    assert acc == pytest.approx(res.evals[-1][1])


def test_eagle1_training_time_test_feeds_its_own_features():
    """EAGLE-1 with ttt_steps = 2: step 0 is the published loss (features from the target); step 1 feeds each
    position the draft's own prediction of its feature (step 0's output one position earlier), as the second level
    of a tree does, against the same targets, without position 0, weighted by decay. Computed here position by
    position from the two draft passes."""
    import torch.nn.functional as F

    from specdec_ext.train.common import target_hidden
    from specdec_ext.train.eagle import _eagle1_loss, eagle_config_for

    torch.manual_seed(0)
    model = target()
    draft = Eagle1Model(eagle_config_for(model))
    with torch.no_grad():
        for prm in draft.parameters():
            prm.normal_(0, 0.05)
    toks = torch.randint(3, V, (2, 9))
    mask = torch.ones_like(toks, dtype=torch.bool)
    mask[1, 7:] = False
    w, decay = 0.3, 0.5
    with torch.no_grad():
        one, n = _eagle1_loss(draft, model, toks, mask, w, 1, decay)
        two, n2 = _eagle1_loss(draft, model, toks, mask, w, 2, decay)
        feats, logits = target_hidden(model, toks, mask)
        T = toks.shape[1]
        e = model.get_input_embeddings()(toks[:, 1: T - 1])
        pos = torch.arange(T - 2)[None].expand(2, -1)
        out0 = draft(feats[:, : T - 2], e, pos)
        fed = out0.clone()
        fed[:, 1:] = out0[:, :-1]  # position t reads the draft's own f'_t, predicted at t - 1
        out1 = draft(fed, e, pos)
        lm = model.get_output_embeddings()

        def step_loss(out, first):
            terms = []
            for b in range(2):
                for t in range(first, T - 2):
                    if not (mask[b, t] and mask[b, t + 2]):
                        continue
                    reg = F.smooth_l1_loss(out[b, t], feats[b, t + 1])
                    p = F.log_softmax(logits[b, t + 1], -1)
                    q = F.log_softmax(lm(out[b, t]), -1)
                    terms.append(float(reg) + w * float((p.exp() * (p - q)).sum()))
            return sum(terms) / len(terms)

    assert n == n2 == int((mask[:, 2:] & mask[:, :-2]).sum())
    assert float(one) == pytest.approx(step_loss(out0, 0), rel=1e-4)
    assert float(two) == pytest.approx(step_loss(out0, 0) + decay * step_loss(out1, 1), rel=1e-4)
    with pytest.raises(ValueError, match="ttt_steps"):
        train_eagle(model, data()[0], cfg(steps=1), version=1, ttt_steps=0)


def test_draft_lm_distils(tmp_path):
    seqs, prompts = data()
    _, r0 = train_draft_lm(target(), seqs, cfg(steps=1), num_layers=1, heldout_prompts=prompts)
    model, res = train_draft_lm(target(), seqs, cfg(steps=40), num_layers=1, heldout_prompts=prompts)
    print("draft loss", falls(res.losses), "accepted", r0.evals[-1][1], "->", res.evals[-1][1])
    assert res.evals[-1][1] > max(2.0, r0.evals[-1][1] + 0.5)
    model.save_pretrained(tmp_path)
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.num_hidden_layers == 1 and loaded.config.vocab_size == V
    check_lossless(DraftModelDrafter(loaded), prompts)


def test_first_layers_is_the_smaller_llama_with_those_weights(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_ext.train.draft_lm import first_layers

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    big = LlamaForCausalLM(config).eval()
    weights = {k: v.clone() for k, v in big.state_dict().items() if not k.startswith("model.layers.2.")}
    cut = first_layers(big, 2)
    small = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2})).eval()
    small.load_state_dict(weights)  # (strict: the cut model holds exactly these)
    x = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(cut(x).logits, small(x).logits, rtol=0, atol=0)
    cut.save_pretrained(tmp_path)
    assert LlamaForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 2
    for bad in (0, 3, 1.0, True):
        with pytest.raises(ValueError, match=r"first_layers: num_layers must be an integer in \[1, 2\]"):
            first_layers(cut, bad)


def test_the_zoo_parallel_draft_is_the_draft_lms_first_layers_trained_on_the_targets_own_text(monkeypatch):
    """The family's recipe (zoo spec): the draft LM's first layer, adapted on the windows the steps read with their
    ends rewritten by the target, exactly what self_distill gives for them; with self-distillation off, the
    windows as they are."""
    from dataclasses import replace

    from transformers import LlamaConfig, LlamaForCausalLM

    import specdec_ext.train.draft_lm as draft_lm_module
    from specdec_ext.zoo.build import train_parallel_draft
    from specdec_ext.zoo.spec import QUICK

    torch.manual_seed(0)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, V, (20,), generator=g).tolist() for _ in range(9)]
    spec = replace(QUICK, drafter_seq_len=20, draft_layers=2, parallel_draft_layers=1, parallel_draft_tokens=3,
                   parallel_draft_self_distill=12)
    seen = []
    real = draft_lm_module.train_draft_lm
    monkeypatch.setattr(draft_lm_module, "train_draft_lm",
                        lambda target, data, *a, **kw: seen.append(data) or real(target, data, *a, **kw))
    model, result, distilled = train_parallel_draft(target(), copy.deepcopy(draft), seqs, spec,
                                                    cfg(steps=2, lr=1e-3), progress=False)
    want = self_distill(target(), seqs, prompt_len=8, new_tokens=12, seed=spec.seed, progress=False,
                        max_sequences=2 * 6)
    assert seen == [want] and distilled == len(want) == 9  # (fewer windows than the steps read: all of them)
    assert [w[:8] for w in want] == [s[:8] for s in seqs] and want != seqs  # (prompts kept, ends rewritten)
    assert model.config.num_hidden_layers == 1 and model.config.pard_num_tokens == 3 and result.summary()["steps"] == 2
    assert model.config.vocab_size == V + 1  # the mask row
    seen.clear()
    _, _, distilled = train_parallel_draft(target(), copy.deepcopy(draft), seqs,
                                           replace(spec, parallel_draft_self_distill=0), cfg(steps=1, lr=1e-3),
                                           progress=False)
    assert seen == [seqs] and distilled == 0
    with pytest.raises(ValueError, match="parallel_draft_layers must be in"):
        replace(spec, parallel_draft_layers=3)
    with pytest.raises(ValueError, match="parallel_draft_self_distill must be in"):
        replace(spec, parallel_draft_self_distill=20)


def test_resume_equals_uninterrupted(tmp_path):
    seqs, prompts = data()
    full, r_full = train_medusa(target(), seqs, cfg(steps=12), num_heads=2)
    a = tmp_path / "a"
    _, r_half = train_medusa(target(), seqs, cfg(steps=6, checkpoint_dir=str(a)), num_heads=2)
    assert (a / CHECKPOINT_FILE).is_file() and r_half.step == 6
    resumed, r_res = train_medusa(target(), seqs, cfg(steps=12, checkpoint_dir=str(a), resume=True), num_heads=2)
    assert r_res.step == 12 and len(r_res.losses) == 12
    assert r_res.seconds > r_half.seconds > 0  # training time carries over the interruption
    assert r_res.losses == pytest.approx(r_full.losses, rel=1e-5, abs=1e-6)
    for x, y in zip(full.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(x, y)
    state = torch.load(a / CHECKPOINT_FILE, weights_only=True)
    assert state["step"] == 12 and state["optimizer"]["state"]


def test_parallel_draft_adapts_a_draft_lm_and_accepts_more_than_it_started_with(tmp_path):
    from specdec_ext.drafters import ParallelDraftDrafter
    from specdec_ext.generate import load_model

    seqs, prompts = data()
    draft_lm, _ = train_draft_lm(target(), seqs, cfg(steps=40), num_layers=1)
    start = copy.deepcopy(draft_lm)
    model, res = train_draft_lm(target(), seqs, cfg(steps=60), model=draft_lm, parallel=4, retention=0.7,
                                min_retention=0.3, heldout_prompts=prompts, num_draft_tokens=4)
    print("parallel draft loss", falls(res.losses, ratio=0.7))
    assert model.config.pard_token == V and model.config.pard_num_tokens == 4 and model.config.vocab_size == V + 1
    start.resize_token_embeddings(V + 1, mean_resizing=True)  # the same draft LM, its mask row untrained
    start.config.pard_token, start.config.pard_num_tokens = V, 4
    before = check_lossless(ParallelDraftDrafter(start), prompts)
    model.save_pretrained(tmp_path)
    after = check_lossless(ParallelDraftDrafter(load_model(str(tmp_path))), prompts)
    print("accepted", before, "->", after, "(training's own evaluation:", res.evals[-1][1], ")")
    assert after > before + 0.5 and res.evals[-1][1] == pytest.approx(after)
