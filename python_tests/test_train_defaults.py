"""The training commands' defaults (issue 24) on tiny models: the learning-rate schedule (warm-up, cosine decay) and
its length from a time budget (``minutes``, capped by passes over the data), kept by a resumed run; flag errors
naming the flag; the FR-Spec draft vocabulary that ``train-eagle`` writes and an EAGLE-1 drafter reads back;
self-distillation through one engine (greedy tokens = plain greedy decoding, sampled ones per-sequence seeded and
following the target's distribution); the drafter report's acceptance against a hand count and its speedup
formula against a hand computation."""

from __future__ import annotations

import collections
import json
import math
import time

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import V, make_model  # noqa: E402
from test_train_data_cli import model_dir, word_tokenizer  # noqa: E402,F401 (model_dir: the saved tiny target)

from specdec_ext.cli import main  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, NgramDrafter  # noqa: E402
from specdec_ext.drafters.shapes import CPU_SHAPES  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.checkpoints import load_eagle  # noqa: E402
from specdec_ext.train import load_corpus, split_heldout  # noqa: E402
from specdec_ext.train import data  # noqa: E402
from specdec_ext.train.data import DISTILL_PROBE_BATCHES, _length_groups, self_distill  # noqa: E402
from specdec_ext.train.eagle import eagle_drafter  # noqa: E402
from specdec_ext.models.draft_vocab import default_draft_vocab_size, read_draft_vocab  # noqa: E402
from specdec_ext.train.loop import CHECKPOINT_FILE, TrainConfig, read_checkpoint, train_loop  # noqa: E402
from specdec_ext.train.report import (conditional_acceptance, cost_at, evaluate_drafter,  # noqa: E402
                                      predicted_speedup)
from specdec_ext.train.schedule import SchedulePlan, lr_at  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the schedule ----------------------------------------------------------------------------------------------------
def test_warmup_then_cosine_by_hand():
    lr, S, W, m = 2e-3, 40, 4, 0.1
    plan = SchedulePlan(steps=S, warmup=W)
    assert lr_at(0, plan, lr, "cosine", m) == pytest.approx(lr / W)
    assert lr_at(W - 1, plan, lr, "cosine", m) == pytest.approx(lr)  # the warm-up's last step reaches lr
    assert lr_at(W, plan, lr, "cosine", m) == pytest.approx(lr)  # the decay starts at lr
    mid = W + (S - W) // 2
    assert lr_at(mid, plan, lr, "cosine", m) == pytest.approx(lr * (m + (1 - m) * 0.5))
    last = lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * (S - 1 - W) / (S - W))))
    assert lr_at(S - 1, plan, lr, "cosine", m) == pytest.approx(last)
    assert lr * m < last < lr * (m + 0.01)
    assert all(lr_at(s, plan, lr, "constant", m) == pytest.approx(lr) for s in range(W, S))
    rates = [lr_at(s, plan, lr, "cosine", m) for s in range(S)]
    assert all(a <= b for a, b in zip(rates[:W], rates[1:W])) and all(a >= b for a, b in zip(rates[W:], rates[W + 1:]))


def tiny_run(steps=None, minutes=None, sleep=0.0, checkpoint_dir=None, resume=False, every=0, fail_at=None, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(17, 8), torch.nn.Linear(8, 17))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 17, (8,), generator=g).tolist() for _ in range(30)]
    calls = []
    before = [p.detach().clone() for p in model.parameters()]

    def loss_fn(toks, mask):
        calls.append(1)
        if fail_at is not None and len(calls) > fail_at:  # an interruption after some steps (the last periodic
            raise KeyboardInterrupt(model, before)      # checkpoint stays)
        if sleep:  # seconds a step, or a function of the step's number (from 1)
            time.sleep(sleep(len(calls)) if callable(sleep) else sleep)
        logits = model(toks[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 17), toks[:, 1:].reshape(-1)), 1

    cfg = TrainConfig(steps=steps, minutes=minutes, lr=1e-2, batch_size=3, progress=False, device="cpu",
                      schedule="cosine", warmup=None, checkpoint_dir=checkpoint_dir, checkpoint_every=every,
                      checkpoint_minutes=0, resume=resume, **kw)
    result = train_loop(model, loss_fn, seqs, cfg, name="tiny")
    return model, result, before


def test_the_loop_applies_the_warmup_rate():
    """AdamW's first update moves a weight by the step's rate (m / sqrt(v) = +-1 at step 1): lr / warm-up steps at
    step 0 (the default warm-up: 5% of 40 steps, 2)."""
    with pytest.raises(KeyboardInterrupt) as e:
        tiny_run(steps=40, fail_at=1)
    model, before = e.value.args
    moved = (model[1].weight.detach() - before[1]).abs().max().item()
    assert moved == pytest.approx(1e-2 / 2, rel=1e-3)
    _, result, _ = tiny_run(steps=40)
    assert result.plan.steps == 40 and result.plan.warmup == 2


def test_minutes_fixes_the_step_count_from_the_timed_steps():
    # 50 ms a step, a 1.5 s budget: about 30 steps (less what the probe's overheads took), within the cap
    _, result, _ = tiny_run(minutes=1.5 / 60, sleep=0.05, max_epochs=100.0, probe_steps=4)
    plan = result.plan
    assert plan.step_seconds == pytest.approx(0.05, rel=0.5) and plan.budget_seconds == pytest.approx(1.5)
    assert 15 <= plan.steps <= 30 and result.step == plan.steps
    assert plan.warmup == max(1, round(0.05 * plan.steps)) and plan.probe_total == math.ceil(100 * 30 / 3)
    assert 0.8 <= result.seconds <= 3.0
    # a generous budget on little data stops at max_epochs passes: 2 x 30 sequences / 3 a batch
    _, result, _ = tiny_run(minutes=5.0, max_epochs=2.0, probe_steps=4)
    assert result.step == result.plan.steps == 20


def test_the_check_refixes_the_count_when_the_probe_ran_slow():
    # the first 5 steps at 0.1 s a step, the rest at 0.02: the probe (steps 2-4 timed) plans ~15 steps in 1.5 s;
    # the check (its clock from step 5's end, 4 steps) times 0.02 s a step and plans ~50, and the run ends on time
    _, result, _ = tiny_run(minutes=1.5 / 60, sleep=lambda n: 0.1 if n <= 5 else 0.02, max_epochs=100.0,
                            probe_steps=4)
    plan = result.plan
    assert plan.step_seconds == pytest.approx(0.1, rel=0.3) and plan.check_seconds == pytest.approx(0.02, rel=0.5)
    assert plan.check_step == 9 and 35 <= plan.steps == result.step
    assert plan.warmup == max(1, round(0.05 * 15)) or plan.warmup == max(1, round(0.05 * 14))  # (the probe's)
    assert 1.0 <= result.seconds <= 2.5


def test_the_probe_ends_early_when_it_would_overrun_the_budget():
    # 0.1 s a step and a 0.35 s budget: a probe of 10 steps would take 1 s; it stops at 3 or 4 steps
    _, result, _ = tiny_run(minutes=0.35 / 60, sleep=0.1, max_epochs=100.0, probe_steps=10)
    assert result.step == result.plan.steps <= 4 and result.seconds < 0.7


def test_a_resumed_budget_run_keeps_its_step_count_and_rates(tmp_path):
    d = str(tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        tiny_run(minutes=1.0 / 60, sleep=0.02, max_epochs=100.0, probe_steps=3, checkpoint_dir=d, every=5,
                 fail_at=12)
    saved = read_checkpoint(f"{d}/{CHECKPOINT_FILE}", "t")
    assert saved["step"] == 10 and saved["plan"]["step_seconds"] is not None
    # resumed without the sleep: re-timing would choose far more steps; the plan is the first run's
    _, result, _ = tiny_run(minutes=1.0 / 60, max_epochs=100.0, probe_steps=3, checkpoint_dir=d, resume=True)
    assert result.plan.to_dict() == saved["plan"] and result.step == saved["plan"]["steps"]
    assert result.losses[:10] == saved["losses"]


def test_explicit_steps_on_resume_replan_the_rest(tmp_path):
    d = str(tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):  # interrupted inside the probe (10 steps), checkpointed at step 4
        tiny_run(minutes=1.0, max_epochs=100.0, probe_steps=10, checkpoint_dir=d, every=4, fail_at=6)
    assert read_checkpoint(f"{d}/{CHECKPOINT_FILE}", "t")["plan"]["step_seconds"] is None
    _, result, _ = tiny_run(steps=15, checkpoint_dir=d, resume=True)
    plan = result.plan
    assert result.step == plan.steps == 15 and plan.warmup == 1 and plan.budget_seconds is None
    assert plan.probe_steps == 4  # steps 4 .. 14 at the rates of a 15-step run
    assert lr_at(4, plan, 1e-2, "cosine", 0.1) == pytest.approx(lr_at(4, SchedulePlan(15, 1), 1e-2, "cosine", 0.1))


@pytest.mark.parametrize("kw, match", [
    (dict(steps=10, minutes=1.0), r"give steps \(10\) or minutes \(1.0\), not both"),
    (dict(minutes=-1.0), r"minutes must be a finite number > 0"),
    (dict(minutes=float("nan")), r"minutes must be a finite number > 0"),
    (dict(steps=10, warmup=11), r"warmup \(11 steps\) exceeds steps \(10\)"),
    (dict(steps=10, max_epochs=0.0), r"max_epochs must be a finite number > 0"),
    (dict(steps=10, min_lr_ratio=1.5), r"min_lr_ratio must be at most 1"),
])
def test_bad_schedule_config_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        train_loop(torch.nn.Linear(2, 2), lambda t, m: (None, 0), [[1, 2]], TrainConfig(progress=False, **kw))


# ---- the commands ----------------------------------------------------------------------------------------------------
def cli_error(*argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return str(e.value.code)


@pytest.mark.parametrize("flags, match", [
    (("--steps", "10", "--minutes", "2"), "give --steps (10) or --minutes (2), not both"),
    (("--minutes", "-1"), "--minutes must be a finite number > 0, got -1"),
    (("--minutes", "0"), "--minutes must be a finite number > 0, got 0"),
    (("--max-epochs", "0", "--minutes", "1"), "--max-epochs must be a finite number > 0"),
    (("--warmup", "50", "--steps", "10"), "--warmup (50) exceeds --steps (10)"),
    (("--warmup", "-1"), "--warmup must be >= 0"),
    (("--min-lr-ratio", "2"), "--min-lr-ratio must be in [0, 1]"),
    (("--steps", "0"), "--steps must be >= 1"),
])
def test_bad_schedule_flags_are_named_before_anything_loads(flags, match):
    msg = cli_error("train-medusa", "--model", "/nonexistent", "--data", "d", "--out", "o", *flags)
    assert match in msg and "/nonexistent" not in msg, msg


COMMON = ("--batch-size", "4", "--heldout", "2", "--eval-new-tokens", "8", "--no-progress", "--max-length", "16",
          "--prompt-len", "6")


@pytest.mark.parametrize("vocab_loss", [True, False])
def test_train_eagle_writes_the_fr_spec_vocabulary_and_the_drafter_reads_it(model_dir, tmp_path, capsys, vocab_loss):
    out = tmp_path / "eagle"  # (the token loss over the FR-Spec ids is the default; --no-vocab-loss opts out)
    assert main(["train-eagle", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--out",
                 str(out), "--steps", "6", "--fr-vocab", "20", *COMMON, "--self-distill", "0",  # (counted on the data)
                 *([] if vocab_loss else ["--no-vocab-loss"])]) == 0
    text = capsys.readouterr().out
    ids = json.loads((out / "draft_vocab.json").read_text())["ids"]
    # the 20 most frequent ids of the training sequences (in the windows the log records: EAGLE-1's default
    # long-context mixing), counted here independently
    log = json.loads((out / "training_log.json").read_text())
    assert (log["max_length"], log["long_fraction"], log["long_length"]) == (16, 0.1, 128)
    tok = word_tokenizer()
    train, _ = split_heldout(load_corpus([str(model_dir / "corpus.txt")], tok, max_length=16, long_length=128,
                                         long_fraction=0.1), 2, 0)
    counts = collections.Counter(t for s in train for t in s)
    assert len(ids) == 20 and ids == sorted(ids)
    assert min(counts[i] for i in ids) >= max([counts[i] for i in range(V) if i not in ids])
    # an EAGLE-1 drafter over the ids read back drafts only among them, and decodes as plain greedy decoding does
    target = make_model("llama", seed=11, num_hidden_layers=4, max_position_embeddings=128)
    vocab = read_draft_vocab(out, "test")
    drafter = EagleDrafter(load_eagle(out, target=target), 5, 4, 16, target=target, draft_vocab=vocab)
    assert drafter.draft_vocab.tolist() == ids
    drafted = []
    real = drafter.propose

    def spy(state, max_depth, max_nodes):
        tree = real(state, max_depth, max_nodes)
        n = tree.row_nodes[0] if tree.row_nodes else tree.num_nodes  # (batch 1: no padding nodes after it)
        drafted.extend(tree.tokens[0, 1:n].tolist())
        return tree

    drafter.propose = spy
    prompt = torch.tensor(train[0][:6])
    got, _ = generate(target, drafter, prompt, max_new_tokens=12, eos_token_id=[])
    want, _ = generate(target, None, prompt, max_new_tokens=12, eos_token_id=[])
    assert got.tolist() == want.tolist()
    assert drafted and set(drafted) <= set(ids)
    # the end-of-training report: printed and saved beside the draft
    report = json.loads((out / "drafter_report.json").read_text())
    assert "predicted speedup over plain decoding on this machine" in text
    # ... decoded with the tree the library runs on a CPU (CPU_SHAPES' EAGLE-2: 8 drafts, a 9-node forward)
    sizes = sorted(int(m) for m in report["target_seconds"])
    shape = CPU_SHAPES["eagle2"]
    assert report["prompts"] == 2 and sizes == [1, 2, 4, 8, 9] and shape["total_tokens"] == 8
    assert eagle_drafter(load_eagle(out), target).max_nodes == 9 and report["nodes_per_step"] <= 9
    assert log["fr_vocab"] == 20 and log["schedule"]["steps"] == 6 and log["report"] == report
    assert log["vocab_loss"] is vocab_loss and math.isfinite(log["last_loss"])


def test_cli_minutes_chooses_and_reports_the_step_count(model_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    assert main(["train-draft", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--out",
                 str(out), "--layers", "1", "--hidden-size", "64", "--minutes", "0.05", "--max-epochs", "3",
                 "--no-report", "--self-distill", "0", *COMMON]) == 0  # (distilling would take from the budget)
    text = capsys.readouterr().out
    log = json.loads((out / "training_log.json").read_text())
    plan = log["schedule"]
    # the cap: 3 passes over the training sequences in batches of 4
    assert plan["budget_seconds"] == pytest.approx(3.0) and plan["probe_total"] == math.ceil(3 * log_sequences(
        model_dir) / 4)
    assert log["steps"] == plan["steps"] <= plan["probe_total"]
    assert f"{log['steps']} steps (the count 0.05 minutes fit at" in text


def log_sequences(model_dir) -> int:
    train, _ = split_heldout(load_corpus([str(model_dir / "corpus.txt")], word_tokenizer(), max_length=16), 2, 0)
    return len(train)


def test_default_fr_spec_vocabulary_size():
    assert default_draft_vocab_size(4096) == 1024  # the family's measured choice
    assert default_draft_vocab_size(151936) == 151936 // 4
    assert default_draft_vocab_size(1024) is None and default_draft_vocab_size(V) is None  # nothing to cut


def test_evaluate_drafter_command(model_dir, tmp_path, capsys):
    out = tmp_path / "medusa"
    assert main(["train-medusa", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--out",
                 str(out), "--heads", "2", "--steps", "4", "--no-report", *COMMON]) == 0
    assert not (out / "drafter_report.json").exists()
    capsys.readouterr()
    assert main(["evaluate-drafter", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"),
                 "--medusa", str(out), "--medusa-nodes", "6", "--heldout", "0", "--prompts", "3", "--new-tokens",
                 "10", "--max-length", "16", "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    report = json.loads((out / "drafter_report.json").read_text())
    assert report["prompts"] == 3 and report["new_tokens"] == 10 and set(report["target_seconds"]) == {"1", "2", "4",
                                                                                                      "6"}
    assert f"{report['predicted_speedup']:.2f}x" in text
    assert "evaluate-drafter needs a drafter" in cli_error("evaluate-drafter", "--model", str(model_dir), "--data",
                                                           str(model_dir / "corpus.txt"))


# ---- self-distillation ---------------------------------------------------------------------------------------------
_T: dict = {}


def target():
    if "m" not in _T:
        _T["m"] = make_model("llama", seed=3, num_hidden_layers=2)
    return _T["m"]


def seqs_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_self_distill_greedy_is_plain_greedy(drafter):
    """Each sequence keeps all but its last 14 tokens (a long one its long context), at least its first 6 (at most
    half of it), and the target rewrites the rest up to the sequence's length: plain greedy decoding's tokens."""
    seqs = seqs_of([12, 20, 7, 16, 30, 9, 14, 41])
    eos = 5  # an EOS ends some rows early; their places are refilled
    got = self_distill(target(), seqs, prompt_len=6, new_tokens=14, batch_size=3, eos_token_id=eos, progress=False,
                       drafter=NgramDrafter(num_pred_tokens=3) if drafter else None)
    kept = [max(len(s) - 14, min(6, len(s) // 2)) for s in seqs]
    assert kept == [6, 6, 3, 6, 16, 4, 6, 27]
    for s, g, k in zip(seqs, got, kept):
        want, _ = generate(target(), None, torch.tensor(s[:k]), max_new_tokens=len(s) - k, eos_token_id=eos)
        assert g == want.tolist() and g[:k] == s[:k] and len(g) <= len(s)
    assert sum(len(g) == len(s) for s, g in zip(seqs, got)) >= 2  # (not every row met the EOS)
    with pytest.raises(ValueError, match="new_tokens must be an integer >= 0"):
        self_distill(target(), seqs, new_tokens=-1, progress=False)
    assert self_distill(target(), seqs, new_tokens=0, progress=False) == seqs
    # decoded in engines of similar lengths (at most twice the group's shortest): here 3 of them
    assert _length_groups([0, 1, 2, 3], [10, 300, 12, 25]) == [[0, 2], [3], [1]]
    totals = sorted(len(s) for s in seqs)
    assert len(_length_groups(list(range(len(seqs))), [len(s) for s in seqs])) == 3 and totals[0] * 2 < totals[-1]


def test_self_distill_bounded_by_a_count_or_a_time_budget_rewrites_a_seeded_subset(monkeypatch):
    """``max_sequences`` rewrites the first ones of the seed's order; ``seconds`` times the first
    DISTILL_PROBE_BATCHES batches and rewrites more, chunk by chunk, as long as the rest of the budget fits one."""
    seqs = seqs_of([12, 20, 7, 16, 30, 9, 14, 41, 18, 22])
    full = self_distill(target(), seqs, prompt_len=6, new_tokens=14, batch_size=1, eos_token_id=[], progress=False)
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(3)).tolist()

    def bounded(**kw):
        return self_distill(target(), seqs, prompt_len=6, new_tokens=14, batch_size=1, eos_token_id=[], seed=3,
                            progress=False, **kw)

    assert bounded(max_sequences=4) == [full[i] for i in sorted(order[:4])]
    assert bounded(max_sequences=0) == [] and bounded(max_sequences=99) == full
    probe = DISTILL_PROBE_BATCHES  # (batch_size 1)
    now = [0.0]
    decode = data._decode_group

    def slow_decode(target, drafter, group, *args):  # 2.5 s a sequence on a fake clock
        now[0] += 2.5 * len(group)
        return decode(target, drafter, group, *args)

    monkeypatch.setattr(data, "_decode_group", slow_decode)
    for seconds, n in ((15.0, probe + 2), (16.0, probe + 2), (17.5, probe + 3), (5.0, probe), (0.0, probe),
                       (1e9, len(seqs))):
        now[0] = 0.0
        got = bounded(seconds=seconds, clock=lambda: now[0])
        assert got == [full[i] for i in sorted(order[:n])], seconds
        assert now[0] <= max(seconds, 2.5 * probe), seconds  # (the probe always runs)
    for kw, match in (({"max_sequences": -1}, "max_sequences must be an integer >= 0"),
                      ({"seconds": -1.0}, "seconds must be a number >= 0"),
                      ({"seconds": True}, "seconds must be a number >= 0")):
        with pytest.raises(ValueError, match=match):
            bounded(**kw)


def test_self_distill_sampling_is_seeded_per_sequence_and_follows_the_target():
    seqs = seqs_of([12, 20, 9, 16])
    a = self_distill(target(), seqs, prompt_len=6, new_tokens=8, temperature=0.8, seed=7, batch_size=1,
                     eos_token_id=[], progress=False)
    b = self_distill(target(), seqs, prompt_len=6, new_tokens=8, temperature=0.8, seed=7, batch_size=4,
                     eos_token_id=[], progress=False)
    assert a == b  # a sequence's tokens do not depend on its batch
    # the first sampled token of one prompt over many seeds against the target's distribution (chi-square)
    stats = pytest.importorskip("scipy.stats")
    prompt = seqs[0][:6]
    n = 600
    out = self_distill(target(), [prompt + [0]] * n, prompt_len=6, new_tokens=1, temperature=1.0, seed=0,
                       batch_size=200, eos_token_id=[], progress=False)
    counts = torch.bincount(torch.tensor([o[6] for o in out]), minlength=V).double()
    with torch.no_grad():
        probs = torch.softmax(target()(torch.tensor([prompt])).logits[0, -1].double(), -1)
    big = probs * n >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([probs[big], probs[~big].sum()[None]]) * n
    assert stats.chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


# ---- the report ------------------------------------------------------------------------------------------------------
def test_predicted_speedup_by_hand():
    curve = {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.030}
    assert cost_at(curve, 6) == pytest.approx(0.023)  # halfway between 4 and 8 nodes
    assert cost_at(curve, 1) == 0.010 and cost_at(curve, 20) == 0.030
    # 3 tokens a step for a 6-node forward and 5 ms of drafting: 3 * 10 / (23 + 5)
    assert predicted_speedup(3.0, curve, 6, 0.005) == pytest.approx(30 / 28)
    # accept_hist [steps that accepted 0, 1, 2, 3 drafts] = [2, 3, 4, 1]: depth 1 accepted in 8 of 10 steps, depth 2
    # in 5 of those 8, depth 3 in 1 of those 5
    assert conditional_acceptance([2, 3, 4, 1]) == pytest.approx([8 / 10, 5 / 8, 1 / 5])
    assert conditional_acceptance([4, 0, 0]) == [0.0]  # nothing reached depth 1: deeper depths are not measured


def hand_count(tgt, draft, prompt, new_tokens, k):
    """accept_hist by hand: the target's greedy continuation (plain decoding), and at each step the draft model's
    greedy chain (full forwards, no cache), accepted up to the first mismatch; a chain is cut to the row's budget
    less one (no draft past the budget)."""
    full, _ = generate(tgt, None, torch.tensor(prompt), max_new_tokens=new_tokens, eos_token_id=[])
    out = full.tolist()[len(prompt):]
    hist = [0] * (k + 1)
    j = 0
    while j < new_tokens:
        ctx = prompt + out[:j]
        chain = []
        for _ in range(min(k, new_tokens - j - 1)):
            with torch.no_grad():
                chain.append(int(draft(torch.tensor([ctx + chain])).logits[0, -1].argmax()))
        a = 0
        while a < len(chain) and chain[a] == out[j + a]:
            a += 1
        hist[a] += 1
        j += a + 1
    return hist, j


def test_report_acceptance_matches_a_hand_count():
    tgt = target()
    draft = make_model("llama", seed=3, num_hidden_layers=2)
    with torch.no_grad():  # the target with its second layer's MLP perturbed: drafts that are often, not always, right
        w = draft.model.layers[1].mlp.down_proj.weight
        w.add_(0.02 * torch.randn_like(w))
    prompts = [s[:6] for s in seqs_of([6, 6, 6], seed=4)]
    k, new = 3, 20
    hist = [0] * (k + 1)
    steps = 0
    for p in prompts:
        h, _ = hand_count(tgt, draft, p, new, k)
        hist = [a + b for a, b in zip(hist, h)]
        steps += sum(h)
    report = evaluate_drafter(tgt, DraftModelDrafter(draft, num_draft_tokens=k), prompts, new_tokens=new, repeats=2)
    assert 0 < hist[0] < steps and sum(hist[1:]) > 0  # (a test of both outcomes)
    assert report.steps == steps
    assert report.acceptance_by_depth == pytest.approx(conditional_acceptance(hist))
    assert report.mean_accepted_length == pytest.approx(len(prompts) * new / steps)
    assert set(report.target_seconds) == {1, 2, 4} and all(s > 0 for s in report.target_seconds.values())
    assert report.predicted_speedup == pytest.approx(predicted_speedup(report.mean_accepted_length,
                                                                       report.target_seconds, report.nodes_per_step,
                                                                       report.draft_seconds_per_step))


# ---- EAGLE-1's token loss over the FR-Spec ids (--vocab-loss) --------------------------------------------------------
@pytest.mark.parametrize("restricted", [False, True])
def test_eagle1_token_loss_over_the_draft_vocabulary_by_hand(restricted):
    """One pass (no training-time test): smooth-L1 on the features plus w * KL(target || draft), with the KL over
    the kept ids taken as softmax over logits set to -inf elsewhere, on positions whose target argmax is kept."""
    import torch.nn.functional as F

    from specdec_ext.models.eagle import Eagle1Model
    from specdec_ext.train.common import target_hidden
    from specdec_ext.train.eagle import _eagle1_loss, eagle_config_for

    t = target()
    torch.manual_seed(0)
    m = Eagle1Model(eagle_config_for(t), fc_bias=True)
    toks = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(toks, dtype=torch.bool)
    mask[1, 9:] = False  # a padded row
    feats, logits = target_hidden(t, toks, mask)
    ids = torch.cat([logits[0, 1:4].argmax(-1), torch.arange(3, 40)]).unique()  # some argmaxes kept, others not
    got, n = _eagle1_loss(m, t, toks, mask, 0.5, 1, 0.8, ids if restricted else None)

    T = toks.shape[1]
    valid = (mask[:, 2:] & mask[:, :-2]).float()
    with torch.no_grad():
        out = m(feats[:, : T - 2], t.get_input_embeddings()(toks[:, 1: T - 1]),
                torch.arange(T - 2)[None].expand(2, -1), from_target=True)
        reg = (F.smooth_l1_loss(out, feats[:, 1: T - 1], reduction="none").mean(-1) * valid).sum() / valid.sum()
        p_logits, q_logits = logits[:, 1: T - 1], t.get_output_embeddings()(out)
        w = valid
        if restricted:
            outside = torch.ones(V, dtype=torch.bool)
            outside[ids] = False
            p_logits, q_logits = p_logits.masked_fill(outside, -math.inf), q_logits.masked_fill(outside, -math.inf)
            kept = ~outside[logits[:, 1: T - 1].argmax(-1)]
            assert 0 < int((kept & (valid > 0)).sum()) < int(valid.sum())  # both kinds of position occur
            w = valid * kept.float()
        p, logq = p_logits.softmax(-1), q_logits.log_softmax(-1)
        kl = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), 0.0).sum(-1)
        want = reg + 0.5 * (kl * w).sum() / w.sum()
    assert n == int(valid.sum()) and got.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("flags, match", [
    (("--version", "3", "--vocab-loss"), "--vocab-loss takes EAGLE-1's token loss"),
    (("--fr-vocab", "0", "--vocab-loss"), "needs --version 1 and --fr-vocab other than 0"),
])
def test_vocab_loss_flag_errors(flags, match):
    msg = cli_error("train-eagle", "--model", "/nonexistent", "--data", "d", "--out", "o", *flags)
    assert match in msg, msg
