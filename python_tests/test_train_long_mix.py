"""Long-context mixing in the training commands (issue 24): a fraction of the text kept in long windows
(``load_corpus(long_fraction=, long_length=)``), batched apart from the short ones with as many tokens a batch and
spread evenly through each epoch (``BatchSampler(long=...)``, ``TrainConfig.short_length``), resumed exactly, and
``--long-fraction`` / ``--long-length`` through ``train-eagle`` end to end."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from test_train_data_cli import model_dir, word_tokenizer  # noqa: E402,F401 (model_dir: the saved tiny target)

from specdec_ext.cli import main  # noqa: E402
from specdec_ext.train import load_corpus  # noqa: E402
from specdec_ext.train.data import BatchSampler, DataError  # noqa: E402
from specdec_ext.train.loop import TrainConfig, train_loop  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def corpus(model_dir, **kw):
    return load_corpus([str(model_dir / "corpus.txt")], word_tokenizer(), max_length=16, **kw)


def test_long_windows_keep_the_text_and_its_order(model_dir):
    short = corpus(model_dir)
    for fraction in (0.25, 0.5, 1.0):
        mixed = corpus(model_dir, long_length=64, long_fraction=fraction, seed=3)
        assert sum(mixed, []) == sum(short, [])  # the same tokens in the same order, only cut differently
        chunks = -(-sum(map(len, short)) // 64)
        long = [s for s in mixed if len(s) > 16]
        assert len(long) == round(fraction * chunks) and all(len(s) <= 64 for s in long)
    # the seed chooses which chunks stay long
    chosen = {tuple(i for i, s in enumerate(corpus(model_dir, long_length=64, long_fraction=0.5, seed=seed))
                    if len(s) > 16) for seed in range(6)}
    assert len(chosen) > 1


@pytest.mark.parametrize("kw, match", [
    ({"long_fraction": 1.5, "long_length": 64}, "long_fraction must be in"),
    ({"long_fraction": 0.5}, "long_length must be above max_length"),
    ({"long_fraction": 0.5, "long_length": 16}, "long_length must be above max_length"),
    ({"long_fraction": 0.5, "long_length": 4096, "context": 128}, "long_length 4096 exceeds the model's context"),
])
def test_bad_long_mixing_is_named(model_dir, kw, match):
    with pytest.raises(DataError, match=match):
        corpus(model_dir, **kw)


def test_one_window_group_batches_as_before():
    """Without long windows the sampler draws what it always drew (seeded permutations, cut into batches)."""
    got = BatchSampler(10, 3, seed=5)
    g = torch.Generator().manual_seed(5)
    want = []
    for _ in range(3):
        perm = torch.randperm(10, generator=g).tolist()
        want += [perm[0:3], perm[3:6], perm[6:9]]
    assert [got.next() for _ in range(9)] == want and got.batches_per_epoch == pytest.approx(10 / 3)


def test_long_batches_are_apart_and_spread_through_the_epoch():
    long = list(range(0, 30, 5))  # 6 long windows among 30
    s = BatchSampler(30, 4, seed=0, long=long, long_batch_size=2)
    assert s.batches_per_epoch == 24 / 4 + 6 / 2
    epoch = [s.next() for _ in range(9)]
    kinds = ["L" if b[0] in long else "S" for b in epoch]
    assert kinds == list("SLSSLSSLS")  # long batch k after floor((k + 1/2) * 6 / 3) short ones
    assert all(len(b) == (2 if k == "L" else 4) and all((i in long) == (k == "L") for i in b)
               for b, k in zip(epoch, kinds))
    seen = sum(epoch, [])
    assert len(seen) == len(set(seen)) == 30  # every window once an epoch (24 short = 6 whole batches)


def test_a_sampler_with_long_windows_resumes_exactly():
    a = BatchSampler(30, 4, seed=1, long=[2, 7, 11, 20], long_batch_size=1)
    for _ in range(5):
        a.next()
    b = BatchSampler(30, 4, seed=99, long=[2, 7, 11, 20], long_batch_size=1)
    b.load_state_dict(a.state_dict())
    assert [b.next() for _ in range(20)] == [a.next() for _ in range(20)]  # (across an epoch's end too)
    with pytest.raises(ValueError, match="drew its batches from 4 long windows, this run has 0"):
        BatchSampler(30, 4, seed=1).load_state_dict(a.state_dict())


def test_the_loop_trains_long_windows_in_batches_of_as_many_tokens():
    seqs = [[1] * 8 for _ in range(12)] + [[2] * 32 for _ in range(3)]
    shapes = []
    w = torch.nn.Parameter(torch.zeros(()))

    def loss_fn(toks, mask):
        shapes.append(tuple(toks.shape))
        return (w - 1) ** 2, int(mask.sum())

    cfg = TrainConfig(steps=12, batch_size=4, short_length=8, progress=False, device="cpu", minutes=None)
    train_loop(torch.nn.Module(), loss_fn, seqs, cfg, params=[w])
    # an epoch: 3 batches of 4 short windows and 3 of one long window (4 x 8 tokens = 32), interleaved
    assert sorted(shapes) == sorted([(4, 8)] * 6 + [(1, 32)] * 6)
    assert shapes[:6].count((1, 32)) == 3 and "(1, 32), (1, 32)" not in str(shapes)
    with pytest.raises(ValueError, match="short_length must be an integer >= 0"):
        train_loop(torch.nn.Module(), loss_fn, seqs, TrainConfig(steps=1, short_length=-1), params=[w])


def test_train_eagle_with_long_mixing(model_dir, tmp_path):
    out = tmp_path / "eagle"
    assert main(["train-eagle", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--out",
                 str(out), "--steps", "6", "--batch-size", "4", "--heldout", "2", "--eval-new-tokens", "8",
                 "--max-length", "16", "--prompt-len", "6", "--long-fraction", "0.5", "--long-length", "64",
                 "--no-progress", "--no-report"]) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert (log["max_length"], log["long_fraction"], log["long_length"]) == (16, 0.5, 64)
    assert log["steps"] == 6 and all(torch.isfinite(torch.tensor(log["losses"])))
    # the model's context bounds the long windows, and the flag says so
    with pytest.raises(SystemExit, match="long_length 100000 exceeds the model's context"):
        main(["train-eagle", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--out",
              str(tmp_path / "bad"), "--steps", "1", "--max-length", "16", "--long-fraction", "0.5",
              "--long-length", "100000", "--no-progress", "--no-report"])


def windows_of(out):
    log = json.loads((out / "training_log.json").read_text())
    return log["max_length"], log["long_fraction"], log["long_length"]


EAGLE_RUN = ("--steps", "2", "--batch-size", "4", "--heldout", "2", "--eval-new-tokens", "8", "--prompt-len", "6",
             "--no-progress")


def test_eagle_1_and_the_draft_lm_mix_long_windows_by_default(model_dir, tmp_path):
    """EAGLE-1 and the draft LM train a tenth of the text in windows as long as the model's context allows (the tiny
    target's: 128 tokens) unless --max-length already reaches them, --long-fraction 0 turns it off, or the command
    is another (EAGLE-3, Medusa, a parallel draft)."""
    args = ["--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), *EAGLE_RUN]
    runs = {"default": ["train-eagle", "--max-length", "16"],
            "at context": ["train-eagle", "--max-length", "128"],
            "off": ["train-eagle", "--max-length", "16", "--long-fraction", "0"],
            "eagle-3": ["train-eagle", "--max-length", "16", "--version", "3"],
            "medusa": ["train-medusa", "--max-length", "16", "--heads", "2"],
            "draft": ["train-draft", "--max-length", "16", "--layers", "1", "--hidden-size", "64"],
            "draft off": ["train-draft", "--max-length", "16", "--layers", "1", "--hidden-size", "64",
                          "--long-fraction", "0"],
            "parallel": ["train-draft", "--max-length", "16", "--layers", "1", "--hidden-size", "64",
                         "--parallel", "2"]}
    got = {}
    for name, cmd in runs.items():
        out = tmp_path / name.replace(" ", "_")
        assert main([*cmd, *args, "--out", str(out), "--no-report"]) == 0, name
        got[name] = windows_of(out)
    assert got["default"] == got["draft"] == (16, 0.1, 128)
    assert got["at context"] == (128, 0.0, None) and got["off"] == got["draft off"] == (16, 0.0, None)
    assert got["eagle-3"] == got["medusa"] == got["parallel"] == (16, 0.0, None)


def test_evaluate_drafter_holds_out_what_training_held_out(model_dir, tmp_path):
    """Without window flags evaluate-drafter reads them from the drafter's training log, so it scores the very
    prompts train-eagle's end-of-training report did."""
    out = tmp_path / "eagle"
    data = ["--model", str(model_dir), "--data", str(model_dir / "corpus.txt")]
    assert main(["train-eagle", *data, "--out", str(out), *EAGLE_RUN, "--max-length", "16"]) == 0
    trained = json.loads((out / "drafter_report.json").read_text())
    evaluate = ["evaluate-drafter", *data, "--eagle", str(out), "--heldout", "2", "--prompt-len", "6",
                "--new-tokens", "8", "--repeats", "1"]
    assert main(evaluate) == 0
    again = json.loads((out / "drafter_report.json").read_text())
    assert again["prompts"] == trained["prompts"] == 2
    assert (again["steps"], again["acceptance_by_depth"]) == (trained["steps"], trained["acceptance_by_depth"])
    # ... which the log decides: evaluate-drafter's own default window (the model's 128 tokens) holds out others
    from specdec_ext.train.data import prompt_of, split_heldout

    def held(max_length, **kw):
        seqs = load_corpus([str(model_dir / "corpus.txt")], word_tokenizer(), max_length=max_length, **kw)
        return [prompt_of(s, 6) for s in split_heldout(seqs, 2, 0)[1]]
    assert held(16, long_fraction=0.1, long_length=128) != held(128)
