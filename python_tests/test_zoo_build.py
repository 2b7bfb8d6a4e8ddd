"""`specdec zoo build --quick` end to end (a tiny family in well under a minute): every member in its official
layout and loadable by our loaders, the model card, resumption, the corpus split, the tokenizer, and the demo on
the result."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.zoo import QUICK, build_zoo, load_family  # noqa: E402
from specdec_ext.zoo.corpus import python_sources, read_sources, split_sources  # noqa: E402
from specdec_ext.zoo.evaluate import heldout_prompts  # noqa: E402
from specdec_ext.train.data import document_stream, encode_texts  # noqa: E402
from specdec_ext.zoo.tokenizer import train_tokenizer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zoo") / "family")
    threads = torch.get_num_threads()
    try:
        card = build_zoo(out, QUICK, progress=False, threads=1)
    finally:
        torch.set_num_threads(threads)
    return out, card


def test_every_member_is_in_its_official_layout(built):
    from safetensors import safe_open

    out, card = built
    for member, files in {"target": ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"],
                          "draft": ["config.json", "model.safetensors", "tokenizer.json"],
                          "medusa": ["config.json", "medusa_lm_head.safetensors"],
                          "eagle1": ["config.json", "model.safetensors"],
                          "eagle3": ["config.json", "model.safetensors"]}.items():
        for f in files:
            assert os.path.isfile(os.path.join(out, member, f)), (member, f)

    def keys(member, name):
        with safe_open(os.path.join(out, member, name), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    H, V = QUICK.hidden_size, QUICK.vocab_size
    medusa = keys("medusa", "medusa_lm_head.safetensors")  # legacy layout: ResBlocks only, the target's lm_head
    assert set(medusa) == {f"{h}.0.linear.{p}" for h in range(QUICK.medusa_heads) for p in ("weight", "bias")}
    assert medusa["0.0.linear.weight"].shape == (H, H) and medusa["0.0.linear.weight"].dtype == torch.bfloat16
    e1 = keys("eagle1", "model.safetensors")
    assert e1["fc.weight"].shape == (H, 2 * H) and "layers.0.self_attn.q_proj.weight" in e1
    assert not any(k.startswith("embed_tokens") for k in e1)
    e3 = keys("eagle3", "model.safetensors")
    assert e3["fc.weight"].shape == (H, 3 * H) and e3["lm_head.weight"].shape == (QUICK.eagle3_vocab, H)
    assert e3["d2t"].shape == (QUICK.eagle3_vocab,) and e3["t2d"].shape == (V,) and int(e3["t2d"].sum()) == \
        QUICK.eagle3_vocab
    assert "midlayer.self_attn.q_proj.weight" in e3 and "embed_tokens.weight" not in e3
    with open(os.path.join(out, "eagle3", "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == QUICK.eagle3_vocab
    assert card["total_bytes"] == sum(m["bytes"] for m in card["members"].values())


def test_family_loads_and_every_drafter_is_greedy_identical(built):
    out, card = built
    fam = load_family(out)
    assert fam.target.config.vocab_size == len(fam.tokenizer) == QUICK.vocab_size
    assert next(fam.target.parameters()).dtype == torch.float32
    prompt = torch.tensor(heldout_prompts(fam.tokenizer, 1, 12)[0])
    want, _ = generate(fam.target, None, prompt, max_new_tokens=20, eos_token_id=[])
    for name in fam.drafter_names:
        got, stats = generate(fam.target, fam.make_drafter(name), prompt, max_new_tokens=20, eos_token_id=[])
        assert got.tolist() == want.tolist(), name
    evaluation = card["evaluation"]["drafters"]
    assert set(evaluation) == {"plain", *fam.drafter_names}
    assert all(evaluation[n]["greedy_identical"] for n in fam.drafter_names)
    for n in fam.drafter_names:
        assert 1.0 <= evaluation[n]["mean_accepted_length"]
        assert card["floors"]["mean_accepted_length"][n] == round(0.85 * evaluation[n]["mean_accepted_length"], 2)


def test_card_records_training_and_the_readme_renders_it(built):
    out, card = built
    for stage in ("target", "draft", "medusa", "eagle1", "eagle3"):
        t = card["training"][stage]
        assert t["steps"] == getattr(QUICK, f"{stage}_steps") and t["wall_seconds"] >= 0 and t["last_loss"] > 0
    assert card["training"]["target"]["last_loss"] < card["training"]["target"]["first_loss"]
    with open(os.path.join(out, "README.md")) as f:
        text = f.read()
    for needle in ("## Data", "## Training", "## Measured acceptance", "specdec zoo build", "| eagle3"):
        assert needle in text


def test_resume_skips_finished_stages(built, capsys):
    out, card = built
    again = build_zoo(out, QUICK, resume=True, progress=False, threads=1)
    err = capsys.readouterr().err
    for stage in ("corpus", "tokenizer", "target", "draft", "medusa", "eagle1", "eagle3", "evaluate"):
        assert f"== {stage}: done earlier (resume), skipped" in err
    assert again["training"]["target"] == card["training"]["target"]


def test_demo_on_the_built_family(built, capsys):
    from specdec_ext.cli import main

    out, _ = built
    rc = main(["demo", "--family", out, "--prompts", "2", "--prompt-tokens", "12", "--max-new-tokens", "12",
               "--no-color", "--threads", "1"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "accepted draft tokens «between marks»" in text
    for name in ("plain",) + tuple(load_family(out).drafter_names):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(name + " "))
        assert line.rstrip().endswith("yes") or name == "plain", line


def test_demo_bad_arguments_are_named(built):
    from specdec_ext.cli import main

    out, _ = built
    with pytest.raises(SystemExit, match="--max-new-tokens must be >= 1"):
        main(["demo", "--family", out, "--max-new-tokens", "0"])
    with pytest.raises(SystemExit, match="unknown drafter 'medusa2'"):
        main(["demo", "--family", out, "--drafters", "medusa2"])
    with pytest.raises(SystemExit, match="missing"):
        main(["demo", "--family", os.path.join(out, "nope")])
    with pytest.raises(SystemExit):
        main(["demo", "--family", out, "--dtype", "float16"])  # (argparse names the choices)


def test_demo_in_bfloat16(built, capsys):
    from specdec_ext.cli import main

    out, _ = built
    rc = main(["demo", "--family", out, "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "8",
               "--drafters", "ngram,draft-model", "--stream-with", "ngram", "--no-color", "--dtype", "bfloat16"])
    text = capsys.readouterr().out
    assert rc == 0 and "bfloat16" in text and "draft" in text


def test_corpus_split_is_by_path_hash_and_disjoint():
    files = python_sources()
    train, held = split_sources(files)
    assert held and not set(train) & set(held) and len(train) + len(held) == len(files)
    assert all(zlib.crc32(f.encode()) % 50 == 0 for f in held)
    assert files == sorted(files) and not any("/test/" in f or f.startswith("test/") for f in files)


def test_tokenizer_round_trips_bytes_and_ends_documents():
    texts = read_sources(python_sources(max_files=5))
    tok = train_tokenizer(texts, 300)
    assert len(tok) == 300 and tok.eos_token_id == 0
    sample = "def f(x):\n    return 'é' + x  # ünïcode\n"
    assert tok.decode(tok(sample, add_special_tokens=False)["input_ids"]) == sample
    stream = document_stream(encode_texts(tok, ["a = 1\n", "b = 2\n"], add_special_tokens=False), tok.eos_token_id)
    assert stream.count(0) == 2 and stream[-1] == 0
    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        train_tokenizer(texts, 100)


def test_reevaluate_rewrites_the_card_not_the_weights(built, tmp_path, capsys):
    import json
    import shutil

    from specdec_ext.cli import main
    from specdec_ext.drafters.shapes import CPU_SHAPES

    src, _ = built
    out = tmp_path / "family"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns(".build"))
    card_file = out / "card.json"
    card = json.loads(card_file.read_text())
    card["spec"]["drafters"]["eagle2"] = {"depth": 2, "top_k": 1, "total_tokens": 2}  # an old shape
    card_file.write_text(json.dumps(card))
    weights = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.parent != out}
    threads = torch.get_num_threads()
    try:
        assert main(["zoo", "evaluate", "--out", str(out), "--threads", "1", "--rounds", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    new = json.loads(card_file.read_text())
    assert new["spec"]["drafters"] == CPU_SHAPES and new["evaluation"]["rounds"] == 2
    for k, r in card["evaluation"]["drafters"].items():  # (greedy: the same tokens every round, where the shape held)
        if k != "plain" and card["spec"]["drafters"].get(k) == CPU_SHAPES.get(k):
            assert new["evaluation"]["drafters"][k]["mean_accepted_length"] == r["mean_accepted_length"], k
    assert new["training"] == card["training"] and new["evaluation"]["prompt_ids"] == card["evaluation"]["prompt_ids"]
    ev = new["evaluation"]["drafters"]
    assert set(ev) == {"plain", *load_family(str(out)).drafter_names}
    assert all(r["greedy_identical"] for k, r in ev.items() if k != "plain")
    assert new["floors"]["mean_accepted_length"] == {k: round(0.85 * r["mean_accepted_length"], 2)
                                                     for k, r in ev.items() if k != "plain"}
    assert "depth=5, top_k=2, total_tokens=8" in (out / "README.md").read_text()
    assert weights == {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.parent != out}
    (out / "card.json").write_text(json.dumps({k: v for k, v in new.items() if k != "evaluation"}))
    with pytest.raises(SystemExit, match="no evaluation.prompt_ids"):
        main(["zoo", "evaluate", "--out", str(out)])
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        main(["zoo", "evaluate", "--out", str(out), "--rounds", "0"])


def test_evaluation_rounds_take_the_median_of_each_rounds_ratio_to_plain(monkeypatch):
    """evaluate_drafters(rounds=3): round-robin timing, tokens/s the median round's, the speedup the median of the
    rounds' ratios to that round's plain decoding (a clock and a decoder that script each run's time)."""
    from types import SimpleNamespace

    import specdec_ext.generate as generate_module
    from specdec_ext.zoo.evaluate import evaluate_drafters

    seconds = {None: [1.0, 4.0, 1.0], "a": [0.5, 1.0, 0.25], "b": [2.0, 2.0, 2.0]}  # per prompt, per round
    clock, runs = [0.0], []

    def fake_generate(target, drafter, prompt, max_new_tokens, eos_token_id):
        name = getattr(drafter, "name", None)
        runs.append(name)
        clock[0] += seconds[name][sum(r == name for r in runs) - 1]
        return torch.cat([prompt, torch.arange(4)]), SimpleNamespace(new_tokens=4, row_steps=2, accept_hist=[2, 2])

    monkeypatch.setattr(generate_module, "generate", fake_generate)
    monkeypatch.setattr("specdec_ext.zoo.evaluate.time.perf_counter", lambda: clock[0])
    made = []
    family = SimpleNamespace(target=None, drafter_names=["a", "b"],
                             make_drafter=lambda n: made.append(n) or SimpleNamespace(name=n))
    got = evaluate_drafters(family, [[1, 2]], 4, rounds=3)
    assert runs == [None, "a", "b"] * 3  # round-robin, plain first
    assert made == ["a", "b"] * 3  # a fresh drafter each round (suffix decoding must not see earlier rounds)
    assert got["plain"]["tokens_per_s"] == 4.0  # rates 4, 1, 4
    assert got["a"]["tokens_per_s"] == 8.0 and got["a"]["speedup"] == 4.0  # rates 8, 4, 16; ratios 2, 4, 4
    assert got["b"]["tokens_per_s"] == 2.0 and got["b"]["speedup"] == 0.5  # ratios 0.5, 2, 0.5
    assert got["a"]["mean_accepted_length"] == 2.0 and got["a"]["greedy_identical"]
    with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
        evaluate_drafters(family, [[1, 2]], 4, rounds=0)


def test_corpus_halves_are_disjoint_and_share_the_heldout_files():
    files = python_sources()
    train, held = split_sources(files)
    odd, held_odd = split_sources(files, "odd")
    even, held_even = split_sources(files, "even")
    assert held_odd == held_even == held
    assert odd and even and not set(odd) & set(even) and sorted(odd + even) == sorted(train)
    assert all((zlib.crc32(f.encode()) // 50) % 2 == 1 for f in odd)
    with pytest.raises(ValueError, match="part must be"):
        split_sources(files, "half")


def test_a_spec_names_its_architecture_and_corpus_part():
    from dataclasses import replace

    from specdec_ext.zoo.spec import TRANSFER

    assert TRANSFER.architecture == "qwen2" and TRANSFER.corpus_part == "odd" and TRANSFER.max_positions == 8192
    with pytest.raises(ValueError, match="architecture must be one of"):
        replace(QUICK, architecture="gpt2")
    with pytest.raises(ValueError, match="corpus_part must be one of"):
        replace(QUICK, corpus_part="first")
    assert TRANSFER.target_long_seq_len == 4096 and TRANSFER.target_long_batch == 1  # 2048 tokens a step, as before
    with pytest.raises(ValueError, match="target_long_seq_len must be above target_seq_len"):
        replace(QUICK, target_long_steps=2, target_long_seq_len=QUICK.max_positions * 2)
    with pytest.raises(ValueError, match="target_long_seq_len must be above target_seq_len"):
        replace(QUICK, target_long_steps=2)  # (no length given)


def test_a_target_only_build_gives_a_qwen2_target_and_its_data_for_the_training_commands(tmp_path, capsys):
    """The transfer experiment's first stage at QUICK size: a Qwen2 target (biases on q/k/v) continued on long
    windows, its tokenizer, and its training texts as JSONL that `specdec train-draft` reads with its defaults."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from specdec_ext.cli import main

    out = str(tmp_path / "transfer")
    spec = replace(QUICK, architecture="qwen2", corpus_part="odd", rope_theta=1e6, max_positions=1024,
                   target_long_seq_len=128, target_long_steps=3)
    threads = torch.get_num_threads()
    try:
        card = build_zoo(out, spec, progress=False, threads=1, target_only=True)
    finally:
        torch.set_num_threads(threads)
    assert set(card["training"]) == {"corpus", "tokenizer", "target", "target_long"} and "evaluation" not in card
    long = card["training"]["target_long"]  # 3 steps of two 128-token windows (as many tokens as 4 x 64)
    assert long["steps"] == 3 and long["seq_len"] == 128 and long["batch"] == 2 and long["tokens"] == 3 * 2 * 127
    assert long["heldout_windows"] >= 1 and long["heldout_loss"] != long["heldout_loss_before"]
    assert card["spec"]["architecture"] == "qwen2" and not os.path.isdir(os.path.join(out, "draft"))
    target = AutoModelForCausalLM.from_pretrained(os.path.join(out, "target"))
    assert type(target).__name__ == "Qwen2ForCausalLM" and target.config.tie_word_embeddings
    assert target.model.layers[0].self_attn.q_proj.bias is not None
    assert target.config.rope_parameters["rope_theta"] == 1e6 and target.config.max_position_embeddings == 1024
    files = python_sources(max_files=QUICK.max_files)
    odd = [f for f in split_sources(files, "odd")[0] if f != files[-1]]  # (QUICK holds out the last file)
    with open(os.path.join(out, "data", "train.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["text"] for r in records] == read_sources(odd)
    assert main(["train-draft", "--model", os.path.join(out, "target"), "--data",
                 os.path.join(out, "data", "train.jsonl"), "--out", str(tmp_path / "draft"), "--steps", "2",
                 "--max-length", "32", "--heldout", "0", "--no-progress", "--no-report"]) == 0
    draft = AutoModelForCausalLM.from_pretrained(str(tmp_path / "draft"))
    assert draft.config.hidden_size == QUICK.hidden_size // 2  # the default: half the target's width


def test_a_hybrid_spec_lays_out_lightning_and_attention_layers():
    from dataclasses import replace

    from specdec_ext.zoo.spec import HYBRID, QUICK_HYBRID

    assert HYBRID.layer_types == ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3  # 3 Lightning layers to 1 softmax layer, attention first
    assert HYBRID.max_positions == 16384 and HYBRID.hybrid and not QUICK.hybrid and QUICK.layer_types is None
    assert QUICK_HYBRID.layer_types == ["full_attention", "linear_attention"] * 2
    for bad in (1, QUICK.num_layers + 1):
        with pytest.raises(ValueError, match="attention_every must be in"):
            replace(QUICK_HYBRID, attention_every=bad)


def test_a_hybrid_family_builds_and_every_drafter_is_greedy_identical_on_it(tmp_path, capsys):
    """The hybrid member's recipe at QUICK size, every stage: a MiniMax target (Lightning layers, their states in a
    HybridCache), every drafter trained against it, greedy identical to plain decoding on it; the card says what
    it is; the demo runs it."""
    from specdec_ext.cli import main
    from specdec_ext.models import HybridCache, make_cache
    from specdec_ext.zoo.spec import QUICK_HYBRID

    out = str(tmp_path / "hybrid")
    threads = torch.get_num_threads()
    try:
        card = build_zoo(out, QUICK_HYBRID, progress=False, threads=1)
    finally:
        torch.set_num_threads(threads)
    fam = load_family(out)
    assert fam.target.config.model_type == "minimax"
    assert fam.target.config.layer_types == QUICK_HYBRID.layer_types
    assert isinstance(make_cache(fam.target.config, 1, 64), HybridCache)
    assert card["name"] == "specdec-zoo-pystdlib-hybrid"
    evaluation = card["evaluation"]["drafters"]
    assert set(evaluation) == {"plain", *fam.drafter_names}
    assert all(evaluation[n]["greedy_identical"] for n in fam.drafter_names)
    with open(os.path.join(out, "README.md")) as f:
        assert "MiniMax hybrid target (Lightning attention layers" in f.read()
    rc = main(["demo", "--family", out, "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "8",
               "--no-color", "--threads", "1", "--drafters", "eagle2,draft-model"])
    text = capsys.readouterr().out
    assert rc == 0 and "M-parameter MiniMax hybrid" in text
    with pytest.raises(SystemExit, match="--hybrid and --family are exclusive"):
        main(["demo", "--hybrid", "--family", out])
