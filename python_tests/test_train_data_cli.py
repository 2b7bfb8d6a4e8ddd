"""specdec_ext.train data loading (text, JSONL text / input_ids, chat JSONL; chunking; clear errors naming the file
and line) and the ``specdec train-medusa`` / ``train-eagle`` / ``train-draft`` commands on a tiny saved target."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext.cli import main  # noqa: E402
from specdec_ext.models.checkpoints import load_eagle, load_medusa  # noqa: E402
from specdec_ext.train import DataError, load_corpus, split_heldout  # noqa: E402
from specdec_ext.train.cli import _minutes_left  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")

def word_tokenizer(eos: str | None = None):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token=eos)
    tok.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
    return tok


def write(path, text):
    path.write_text(text)
    return str(path)


def test_formats_and_packing(tmp_path):
    """Text documents (a file, a 'text' or 'messages' record) are packed in file order, EOS after each (none without
    an EOS token; not twice), into windows of max_length; the last window is kept from min_length tokens on;
    explicit input_ids stay sequences of their own."""
    EOS = V - 1
    eos_tok, plain_tok = word_tokenizer(eos=f"w{EOS}"), word_tokenizer()
    a = write(tmp_path / "a.txt", " ".join(f"w{i}" for i in range(3, 23)) + "\n\nw5 w6 w7 w8 w9\n")
    b = write(tmp_path / "b.txt", "w30 w31 w32")
    assert load_corpus([a, b], eos_tok, max_length=8) == [
        list(range(3, 11)), list(range(11, 19)), [19, 20, 21, 22, 5, 6, 7, 8], [9, EOS, 30, 31, 32, EOS]]
    assert load_corpus([a, b], plain_tok, max_length=8) == [
        list(range(3, 11)), list(range(11, 19)), [19, 20, 21, 22, 5, 6, 7, 8], [9, 30, 31, 32]]
    assert load_corpus([a, b], plain_tok, max_length=8, min_length=5) == load_corpus([a, b], plain_tok, 8)[:3]
    jl = write(tmp_path / "b.jsonl", "\n".join(json.dumps(r) for r in [
        {"text": "w3 w4 w5 w6"}, {"input_ids": [7, 8, 9, 10, 11]},
        {"messages": [{"role": "user", "content": "w40 w41"}, {"role": "assistant", "content": "w42"}]},
        {"text": f"w7 w{EOS}"}]) + "\n")
    assert load_corpus([jl], eos_tok, max_length=16) == [[3, 4, 5, 6, EOS, 1, 40, 41, 2, 1, 42, 2, EOS, 7, EOS],
                                                         [7, 8, 9, 10, 11]]
    train, held = split_heldout([[i] * 4 for i in range(10)], 3, seed=1)
    assert len(train) == 7 and len(held) == 3 and not any(h in train for h in held)


def test_a_code_corpus_keeps_its_indentation(tmp_path):
    """A folder of .py files: the windows, joined, decode to the files exactly (indentation, blank lines), each
    followed by EOS, in sorted order (byte-level BPE tokenizer trained here on the files)."""
    pytest.importorskip("tokenizers")
    from specdec_ext.zoo.tokenizer import EOS_TOKEN, train_tokenizer

    d = tmp_path / "src"
    (d / "pkg").mkdir(parents=True)
    texts = {"pkg/b.py": "class B:\n    def f(self, x):\n        if x:\n            return 1\n\n\n        return 2\n",
             "a.py": "import os\n\n\ndef g():\n    \"\"\"Doc.\n\n    More.\n    \"\"\"\n    return os.sep\n"}
    for name, text in texts.items():
        write(d / name, text)
    tok = train_tokenizer(list(texts.values()) * 4, 300)
    seqs = load_corpus(str(d), tok, max_length=16, min_length=1)
    assert all(len(s) == 16 for s in seqs[:-1]) and 1 <= len(seqs[-1]) <= 16
    stream = [i for s in seqs for i in s]
    assert tok.decode(stream) == texts["a.py"] + EOS_TOKEN + texts["pkg/b.py"] + EOS_TOKEN
    assert stream.count(tok.eos_token_id) == 2


@pytest.mark.parametrize("content,match", [
    ("", "b.jsonl: the file is empty"),
    ('{"input_ids": [1, 2, 3, 4]}\n{"txt": "w1"}\n', r"b.jsonl:2: the record has none of the fields"),
    ('{"input_ids": [1, 2, 3, 4]}\nnot json\n', r"b.jsonl:2: not valid JSON"),
    ('{"input_ids": [1, 2, 3, "x"]}\n', r"b.jsonl:1: 'input_ids' must be a list of integers"),
    ('{"input_ids": [1, 2, 3, 400]}\n', r"b.jsonl:1: token id 400 is outside the model's vocabulary"),
    ('{"input_ids": ' + json.dumps(list(range(40))) + '}\n', r"b.jsonl:1: 'input_ids' has 40 tokens, longer than"),
    ('{"text": "w1 w2"}\n', r"b.jsonl:1: a 'text' record needs a tokenizer"),
])
def test_bad_data_names_file_and_line(tmp_path, content, match):
    f = write(tmp_path / "b.jsonl", content)
    with pytest.raises(DataError, match=match):
        load_corpus(f, None, max_length=16, context=32, vocab_size=V)


def test_directory_of_files(tmp_path):
    tok = word_tokenizer()
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    write(d / "b.txt", "w5 w6 w7 w8")
    write(d / "sub" / "a.py", "w9 w10 w11 w12")
    write(d / "empty.txt", "")
    (d / "binary.txt").write_bytes(b"\xff\xfe w3")
    assert load_corpus(str(d), tok) == [[5, 6, 7, 8, 9, 10, 11, 12]]  # one stream: b.txt, then sub/a.py
    with pytest.raises(DataError, match="binary.txt: not UTF-8 text"):
        load_corpus(str(d / "binary.txt"), tok)
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="none: the directory holds no files"):
        load_corpus(str(tmp_path / "none"), tok)


def test_bad_data_other(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_corpus(str(tmp_path / "missing.txt"), None)
    with pytest.raises(DataError, match="exceeds the model's context"):
        load_corpus(write(tmp_path / "c.jsonl", '{"input_ids": [1, 2, 3, 4]}\n'), None, max_length=64, context=32)
    with pytest.raises(DataError, match="plain text needs a tokenizer"):
        load_corpus(write(tmp_path / "d.txt", "w1 w2"), None)
    with pytest.raises(DataError, match="chat template"):
        tok = word_tokenizer()
        tok.chat_template = None
        load_corpus(write(tmp_path / "e.jsonl", '{"messages": [{"role": "user", "content": "w3"}]}\n'), tok)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    m = make_model("llama", seed=11, num_hidden_layers=4, max_position_embeddings=128)
    m.save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(f"w{int(i)}" for i in torch.randint(3, V, (12,), generator=g)) for _ in range(10)]
    (d / "corpus.txt").write_text("\n\n".join(lines) + "\n")
    return d


def failure(capsys, *argv) -> str:
    """The message of a failed command (raised as SystemExit, or printed with a non-zero status)."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        return str(e.code)
    assert rc != 0
    return capsys.readouterr().err


def run(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


COMMON = ("--steps", "20", "--batch-size", "4", "--self-distill", "16", "--prompt-len", "6", "--heldout", "2",
          "--eval-new-tokens", "8", "--no-progress", "--max-length", "16")


@pytest.mark.parametrize("share", [False, True])
def test_cli_train_medusa_and_resume(model_dir, tmp_path, capsys, share):
    out = tmp_path / "medusa"
    args = ("train-medusa", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--out", str(out),
            "--heads", "2", "--checkpoint-every", "10", *(("--share-lm-head",) if share else ()), *COMMON)
    text = run(capsys, *args)
    assert "specdec train-medusa: 20 steps, loss" in text and "mean accepted length" in text
    assert (out / "medusa_lm_head.safetensors").is_file()
    heads = load_medusa(out)
    assert heads.num_heads == 2 and heads.has_lm_head == (not share)
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 20 and len(log["losses"]) == 20
    # more steps, resumed from the checkpoint: continues at step 20
    text = run(capsys, *[a if a != "20" else "30" for a in args], "--resume")
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 30 and len(log["losses"]) == 30
    if not share:  # resuming other heads: what the checkpoint holds against what was asked, as one message
        i = args.index("--heads") + 1
        msg = failure(capsys, *args[:i], "3", *args[i + 1:], "--resume")
        assert str(out / "checkpoint" / "trainer_state.pt") in msg and "heads=2" in msg and "heads=3" in msg, msg


@pytest.mark.parametrize("version", ["1", "3"])
def test_cli_train_eagle(model_dir, tmp_path, capsys, version):
    extra = ("--draft-vocab", "50", "--aux-layers", "1", "2", "3", "--warmup", "5") if version == "3" else ()
    text = run(capsys, "train-eagle", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"),
               "--out", str(tmp_path), "--version", version, *extra, *COMMON)
    assert "specdec train-eagle: 20 steps" in text
    m = load_eagle(tmp_path)
    assert m.version == int(version)
    if version == "3":
        assert m.draft_vocab_size == 50 and int(m.t2d.sum()) == 50 and tuple(m.aux_layers) == (1, 2, 3)


def test_cli_train_draft(model_dir, tmp_path, capsys):
    text = run(capsys, "train-draft", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"),
               "--out", str(tmp_path), "--layers", "1", "--hidden-size", "64", *COMMON)
    assert "specdec train-draft: 20 steps" in text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert m.config.num_hidden_layers == 1
    assert AutoTokenizer.from_pretrained(tmp_path)("w5 w6")["input_ids"] == [5, 6]


def test_the_target_rewrites_each_window_past_its_prompt_by_default(model_dir, tmp_path, capsys):
    """train-* self-distils by default (each window past its --prompt-len tokens: --max-length minus it), records
    it, and --self-distill 0 trains on the data as is; the distillation's time comes out of --minutes."""
    base = ("--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--steps", "2", "--batch-size", "4",
            "--prompt-len", "6", "--heldout", "2", "--no-progress", "--no-report", "--max-length", "16")
    for flags, want in (((), 10), (("--self-distill", "4"), 4), (("--self-distill", "0"), 0),
                        (("--prompt-len", "64"), 8)):  # (a prompt of at most half the window)
        out = tmp_path / f"eagle{want}"
        text = run(capsys, "train-eagle", *base, *flags, "--out", str(out))
        assert json.loads((out / "training_log.json").read_text())["self_distill"] == want
        assert ("self-distillation rewrote" in text) == (want > 0)
    assert _minutes_left("train-eagle", None, 30.0, 5, 5) is None
    assert _minutes_left("train-eagle", 10.0, 120.0, 5, 5) == pytest.approx(8.0)
    with pytest.raises(SystemExit, match=r"took 9\.5 of the 10 --minutes.*--distill-share.*--self-distill 0"):
        _minutes_left("train-eagle", 10.0, 570.0, 5, 5)


def test_self_distillation_rewrites_the_windows_the_steps_read_and_a_resumed_run_the_same(model_dir, tmp_path,
                                                                                            capsys):
    """--steps 1 of 2 windows rewrites 2 windows (a seeded subset) and trains on those; --resume with more steps
    rewrites the same 2 (the sampler refuses other data), and a damaged record is a named error."""
    out = tmp_path / "eagle"
    args = ["train-eagle", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--out", str(out),
            "--batch-size", "2", "--prompt-len", "6", "--heldout", "2", "--no-progress", "--no-report",
            "--max-length", "16", "--checkpoint-every", "1"]
    text = run(capsys, *args, "--steps", "1")
    record = json.loads((out / "checkpoint" / "self_distill.json").read_text())
    assert record["sequences"] == 2 and record["of"] > 2, record
    assert f"self-distillation rewrote 2 of {record['of']} windows" in text
    assert json.loads((out / "training_log.json").read_text())["self_distilled_windows"] == 2
    run(capsys, *args, "--steps", "3", "--resume")
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 3 and log["self_distilled_windows"] == 2
    (out / "checkpoint" / "self_distill.json").write_text("{\"sequences\": \"two\"}")
    msg = failure(capsys, *args, "--steps", "4", "--resume")
    assert "self_distill.json' does not record the windows" in msg, msg
    assert "--distill-share must be in (0, 1], got 0" in failure(capsys, *args, "--steps", "1", "--distill-share", "0")


def test_cli_train_parallel_draft_from_a_draft_lm_and_decode_with_it(model_dir, tmp_path, capsys):
    from specdec_ext.drafter_args import drafter_from_args
    from specdec_ext.drafters import ParallelDraftDrafter
    from specdec_ext.generate import load_model

    lm, pard = tmp_path / "lm", tmp_path / "pard"
    run(capsys, "train-draft", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"), "--out", str(lm),
        "--layers", "1", "--hidden-size", "64", *COMMON)
    text = run(capsys, "train-draft", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"),
               "--out", str(pard), "--init", str(lm), "--layers", "1", "--parallel", "3", *COMMON)
    assert "specdec train-draft: 20 steps" in text
    m = load_model(str(pard))
    assert (m.config.pard_token, m.config.pard_num_tokens, m.config.vocab_size) == (V, 3, V + 1)
    assert m.config.num_hidden_layers == 1  # --init's shape, its first (only) layer kept
    log = json.loads((pard / "training_log.json").read_text())
    assert log["parallel"] == 3 and log["init"] == str(lm)
    # --draft-model DIR of a parallel draft drafts in parallel, its chain the positions it was trained for
    ns = argparse.Namespace(ngram=False, suffix=False, draft_model=str(pard), medusa=None, eagle=None, self_spec=None,
                            early_exit=None, draft_quant="none", dtype=None, device="cpu", num_draft_tokens=None,
                            tree_width=1, tree_total_tokens=None, confidence_threshold=0.0, no_packed_linears=False)
    drafter = drafter_from_args(ns, load_model(str(model_dir)))
    assert isinstance(drafter, ParallelDraftDrafter) and drafter.k == 3
    ns.confidence_threshold = 0.5
    with pytest.raises(ValueError, match="--confidence-threshold stops a chain drafted token by token"):
        drafter_from_args(ns, load_model(str(model_dir)))
    msg = failure(capsys, "train-draft", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"),
                  "--out", str(tmp_path / "x"), "--init", str(lm), "--layers", "3")
    assert "--layers 3: the --init draft LM has 1 layer(s); it keeps its first 1 to 1" in msg
    msg = failure(capsys, "train-draft", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"),
                  "--out", str(tmp_path / "x"), "--init", str(lm), "--hidden-size", "32")
    assert "--init starts from that draft LM's own width" in msg
    msg = failure(capsys, "train-draft", "--model", str(model_dir), "--data", str(model_dir / "corpus.txt"),
                  "--out", str(tmp_path / "x"), "--parallel", "0")
    assert "--parallel must be >= 1" in msg


def test_cli_bad_data(model_dir, tmp_path):
    empty = write(tmp_path / "empty.txt", "  \n")
    with pytest.raises(SystemExit, match="bad data: .*empty.txt: the file is empty"):
        main(["train-medusa", "--model", str(model_dir), "--data", empty, "--out", str(tmp_path / "o")])
    data = write(tmp_path / "ids.jsonl", '{"input_ids": [5, 6, 7, 8, 9, 10]}\n' * 4)
    with pytest.raises(SystemExit, match=r"three target layers in \[0, 4\]; got \[1, 2, 9\]"):
        main(["train-eagle", "--model", str(model_dir), "--data", data, "--out", str(tmp_path / "o"),
              "--version", "3", "--aux-layers", "1", "2", "9", "--no-progress", "--steps", "1"])
    with pytest.raises(SystemExit, match="--draft-vocab needs --version 3"):
        main(["train-eagle", "--model", str(model_dir), "--data", empty, "--out", str(tmp_path / "o"),
              "--draft-vocab", "10"])


def test_a_broken_tokenizer_is_named_not_ignored(model_dir, tmp_path, capsys):
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    msg = failure(capsys, "train-medusa", "--model", str(broken), "--data", str(broken / "corpus.txt"),
                  "--out", str(tmp_path / "o"), "--no-progress")
    assert str(broken) in msg and "holds a tokenizer (tokenizer.json" in msg and "cannot be loaded" in msg, msg
