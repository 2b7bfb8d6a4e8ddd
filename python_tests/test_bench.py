"""``specdec bench`` (specdec_ext.bench): the suite in --quick mode on tiny random models writes valid JSON with the
expected fields and PNGs; the greedy comparison with Hugging Face really compares outputs; bad arguments give clear
errors. Timings are not asserted (tiny random models on a shared CPU)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from specdec_ext.bench import BatchSweepUnavailable, load_batch_sweep
from specdec_ext.bench import cli as bench_cli
from specdec_ext.bench.context_sweep import fit_lengths, run_context_sweep
from specdec_ext.bench.e2e import E2EConfig, compare_outputs, greedy_checks, measure, run_e2e
from specdec_ext.bench.machine import machine_info, machine_tag
from specdec_ext.bench.models import tiny_random
from specdec_ext.bench.plots import main as plots_main
from specdec_ext.bench.plots import plot_batch


pytestmark = pytest.mark.usefixtures("one_torch_thread")


_MODELS: dict = {}


def models():
    if "m" not in _MODELS:
        _MODELS["m"] = tiny_random(seed=0, max_positions=400)
    return _MODELS["m"]


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_suite_writes_json_and_pngs(tmp_path, capsys):
    out = tmp_path / "res"
    rc = bench_cli.main(["--tiny", "--quick", "--suite", "e2e,context", "--out", str(out), "--context-lengths",
                         "16,64", "--num-prompts", "2", "--prompt-len", "24", "--max-new-tokens", "12",
                         "--context-prompts", "2", "--context-new-tokens", "6"])
    assert rc == 0
    files = sorted(os.listdir(out))
    js = [f for f in files if f.endswith(".json")]
    assert len(js) == 1 and js[0].startswith("bench_")
    data = json.loads((out / js[0]).read_text())
    m = data["machine"]
    for key in ("cpu", "cores", "torch", "transformers", "specdec_ext", "python", "torch_threads"):
        assert key in m, key
    assert data["models"]["name"] == "tiny-random" and data["quick"] is True
    e2e = data["e2e"]
    methods = {(r["method"], r["temperature"]) for r in e2e["runs"]}
    for meth in ("plain", "ngram", "draft-model", "medusa", "eagle2", "hf-plain", "hf-assisted", "hf-prompt-lookup"):
        assert (meth, 0.0) in methods and (meth, 1.0) in methods, meth
    for r in e2e["runs"]:
        assert "error" not in r, r
        assert r["new_tokens"] == 2 * 12  # EOS ignored: the full budget, every prompt
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0 and r["peak_mem_mb"] > 0
        assert r["mean_accepted_length"] >= 1.0
        if r["impl"] == "specdec":
            assert r["predicted_speedup"] > 0 and r["step_ms"] > 0
            assert r["verification_bound_speedup"] >= r["speedup"]  # free drafting can only be faster
            assert isinstance(r["acceptance_by_depth"], list)
            assert sum(r["accept_hist"]) == r["target_forwards"]  # B = 1: one row-step per target forward
        if r["method"] == "plain":
            assert r["speedup"] == 1.0 and r["mean_accepted_length"] == 1.0
    # greedy: every method equals plain decoding, HF ones equal their counterparts too
    checks = {(c["a"], c["b"]): c for c in e2e["greedy_checks"]}
    for pair in (("hf-plain", "plain"), ("hf-assisted", "draft-model"), ("hf-prompt-lookup", "ngram"),
                 ("eagle2", "plain"), ("medusa", "plain")):
        assert checks[pair]["equal"], checks[pair]
    assert e2e["hf_settings"]["assisted"]["num_assistant_tokens"] == 4
    ctx = data["context"]
    assert {r["context_len"] for r in ctx["rows"]} == {16, 64}
    assert all("mean_accepted_length" in r and "speedup" in r for r in ctx["rows"])
    assert ctx["config"]["num_prompts"] == 2 and ctx["config"]["max_new_tokens"] == 6
    assert all(r["new_tokens"] == 2 * 6 for r in ctx["rows"] if r["impl"] == "specdec" and "error" not in r)
    pngs = [f for f in files if f.endswith(".png")]
    assert {p.rsplit("_", 1)[1] for p in pngs} == {"e2e.png", "context.png"}
    for p in pngs:
        assert (out / p).read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "wrote" in printed
    assert "| method | T=0 tokens/s" in printed and "| hf-assisted | " in printed  # the Markdown tables
    assert "| prompt tokens | plain tokens/s | ngram: accepted / speedup / loop speedup" in printed
    # the plots can be redrawn from the JSON alone
    for p in pngs:
        os.remove(out / p)
    assert plots_main([str(out / js[0])]) == 0
    assert sorted(f for f in os.listdir(out) if f.endswith(".png")) == sorted(pngs)


def test_verification_bound_takes_out_drafting_and_bookkeeping_only():
    """bound = plain's time per token over the method's time per token without its draft and bookkeeping time
    (prefill and verification stay)."""
    from specdec_ext.bench.e2e import _Acc, summarise

    plain = _Acc(new_tokens=100, wall_s=2.0, steps=100, row_steps=100, loop_s=1.9, unverified_s=0.1, runs=1)
    spec = _Acc(new_tokens=100, wall_s=1.0, steps=25, row_steps=25, loop_s=0.9, unverified_s=0.5, runs=1)
    rows = {r["method"]: r for r in summarise({"plain": plain, "eagle2": spec}, 0.0)}
    assert rows["eagle2"]["speedup"] == 2.0
    assert rows["eagle2"]["verification_bound_speedup"] == 4.0  # 100 tokens in 1.0 - 0.5 s vs 100 in 2.0 s
    assert rows["eagle2"]["mean_accepted_length"] == 4.0


def test_hf_baselines_run_on_aten_products_unless_asked(monkeypatch):
    """With a packed target, Hugging Face's methods multiply with aten's products by default (as its users run
    them) and with the packed weights under hf_packed_linears; hf_settings records which."""
    import copy

    from specdec_ext.bench import e2e as E
    from specdec_ext.models.fast_linear import PackableLinear, in_packed_linears_block, pack_linears

    m = copy.copy(models())
    m.target = copy.deepcopy(m.target)
    pack_linears(m.target)
    seen = []
    original = PackableLinear.forward

    def spy(self, x):
        seen.append(in_packed_linears_block())
        return original(self, x)

    monkeypatch.setattr(PackableLinear, "forward", spy)
    for packed in (False, True):
        settings = E.hf_settings(m, {}, E.E2EConfig(hf_packed_linears=packed))
        assert settings["packed_linears"] is packed
        seen.clear()
        tokens, _, forwards = E._run_hf(m, "hf-plain", [5, 6, 7], 0.0, 3, 0, settings)
        assert len(tokens) == 3 and forwards >= 1 and seen and set(seen) == {packed}


def test_compare_outputs_flags_a_wrong_output():
    a = [[1, 2, 3, 4], [5, 6, 7]]
    assert compare_outputs(a, [list(r) for r in a])["equal"]
    c = compare_outputs(a, [[1, 2, 9, 4], [5, 6, 7]], "hf-assisted", "plain")
    assert not c["equal"] and c["num_mismatching_prompts"] == 1
    assert c["mismatches"][0] == {"prompt": 0, "position": 2, "hf-assisted": 3, "plain": 9, "lengths": [4, 4]}
    short = compare_outputs(a, [[1, 2, 3], [5, 6, 7]])
    assert not short["equal"] and short["mismatches"][0]["position"] == 3
    assert not compare_outputs(a, a[:1])["equal"]


def test_greedy_check_sees_a_corrupted_hf_output():
    """The real comparison path: run HF assisted generation and ours, corrupt one HF token, the check fails."""
    m = models()
    prompts, _ = m.prompts(2, 20)
    accs, _ = measure(m, ["plain", "draft-model", "hf-assisted"], prompts, 0.0, 10, warmup_tokens=2, log=lambda s: 0)
    assert all(c["equal"] for c in greedy_checks(accs))
    accs["hf-assisted"].outputs[1][5] = (accs["hf-assisted"].outputs[1][5] + 1) % m.vocab_size
    bad = [c for c in greedy_checks(accs) if not c["equal"]]
    assert {(c["a"], c["b"]) for c in bad} == {("hf-assisted", "plain"), ("hf-assisted", "draft-model")}
    assert bad[0]["mismatches"][0]["prompt"] == 1 and bad[0]["mismatches"][0]["position"] == 5


def test_e2e_records_a_failing_method_and_goes_on():
    m = models()

    class Broken:
        max_nodes, max_depth, hidden_state_layers, forwards, defers_prefill = 3, 2, (), 0, False
        serves_row_subsets = True

        def begin(self, *a, **k):
            raise RuntimeError("broken drafter")

        add_rows = propose = observe = retire = begin  # a full protocol, so that generate reaches it and it fails

    saved = m.make_drafter
    m.make_drafter = lambda name: Broken() if name == "ngram" else saved(name)
    try:
        res = run_e2e(m, E2EConfig(num_prompts=1, prompt_len=16, max_new_tokens=4, temperatures=(0.0,),
                                   methods=["ngram"], hf=False), log=lambda s: 0)
    finally:
        m.make_drafter = saved
    rows = {r["method"]: r for r in res["runs"]}
    assert "broken drafter" in rows["ngram"]["error"] and rows["plain"]["tokens_per_s"] > 0


def test_context_sweep_caps_at_max_positions():
    kept, note = fit_lengths([128, 256, 4096], 1024, 64, 9)
    assert kept == [128, 256, 1024 - 64 - 9] and "max_position_embeddings is 1024" in note
    assert fit_lengths([128, 256], 4096, 64, 9) == ([128, 256], None)
    res = run_context_sweep(models(), [32, 1000], ["ngram"], num_prompts=1, max_new_tokens=8, log=lambda s: 0)
    assert res["config"]["lengths"] == [32, 400 - 8 - 5] and res["note"]
    assert {r["method"] for r in res["rows"]} == {"plain", "ngram"}


def test_context_sweep_continues_the_same_text_at_every_length(monkeypatch):
    """A shorter length's prompts are the last tokens of the longest length's: only the context before the text
    being continued changes."""
    import specdec_ext.bench.context_sweep as cs

    seen = {}
    real = cs.measure

    def spy(models, methods, prompts, *args, **kw):
        seen[len(prompts[0])] = (prompts, kw["warmup_prompt"])
        return real(models, methods, prompts, *args, **kw)

    monkeypatch.setattr(cs, "measure", spy)
    res = run_context_sweep(models(), [16, 64, 200], ["ngram"], num_prompts=2, max_new_tokens=4, log=lambda s: 0)
    assert sorted(seen) == [16, 64, 200] and res["config"]["lengths"] == [16, 64, 200]
    longest, warm = seen[200]
    assert len({tuple(p) for p in longest}) == 2 and warm not in longest
    for n in (16, 64):
        assert seen[n][0] == [p[-n:] for p in longest] and seen[n][1] == warm[-n:]
        assert res["prompt_sources"][str(n)].startswith(f"the last {n} tokens of the 200-token prompts")


def test_machine_info_and_tag():
    info = machine_info()
    assert info["cores"] >= 1 and info["torch"] == torch.__version__
    tag = machine_tag(info)
    assert tag and all(ch.isalnum() or ch in "_.-" for ch in tag)
    assert machine_tag({"gpu": "NVIDIA H200"}) == "gpu_nvidia_h200"


@pytest.mark.parametrize("argv, message", [
    (["--suite", "e2e,speed"], "unknown suite(s) ['speed']"),
    (["--draft-model", "/nonexistent"], "--draft-model needs --model"),
    (["--model", "/nonexistent/dir"], "--model '/nonexistent/dir' is not a directory"),
    (["--tiny", "--model", "."], "--tiny cannot be combined"),
    (["--tiny", "--temperatures", "0,-1"], "--temperatures must be >= 0"),
    (["--tiny", "--temperatures", "0,hot"], "--temperatures must be a comma-separated list of floats"),
    (["--tiny", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--tiny", "--context-new-tokens", "0"], "--context-new-tokens must be >= 1"),
    (["--tiny", "--context-lengths", "128,x"], "--context-lengths must be a comma-separated list of ints"),
    (["--tiny", "--suite", "e2e", "--methods", "ngram,warp", "--quick"], "unknown method(s) ['warp']"),
    (["--tiny", "--device", "tpu"], "--device must be cpu or cuda"),
])
def test_cli_errors_are_clear(argv, message, capsys, tmp_path):
    rc = bench_cli.main(argv + ["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("specdec bench: ") and message in err, err


def test_batch_sweep_missing_is_said_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "specdec_ext.bench.batch_sweep", None)  # as if the module were not installed
    with pytest.raises(BatchSweepUnavailable, match="batch_sweep.py"):
        load_batch_sweep()
    rc = bench_cli.main(["--tiny", "--suite", "batch", "--out", str(tmp_path)])
    assert rc == 2 and "--suite batch: the batch sweep (specdec_ext/bench/batch_sweep.py) is not part" in \
        capsys.readouterr().err


def test_batch_plot_reads_the_batch_sweep_rows(tmp_path):
    rows = [{"batch_size": b, "plain_tokens_per_s": 10.0 * b, "fixed_tokens_per_s": {"1": 12.0 * b, "2": 9.0 * b},
             "adaptive_tokens_per_s": 11.5 * b} for b in (1, 4, 16)]
    path = plot_batch({"batch": {"drafter": "eagle2", "rows": rows}, "machine": {"cpu": "x"}}, str(tmp_path / "b.png"))
    assert path and (tmp_path / "b.png").read_bytes()[:8] == PNG_MAGIC
    assert plot_batch({"batch": {"skipped": "not installed"}}, str(tmp_path / "c.png")) is None


def test_call_batch_sweep_passes_what_the_signature_asks_for():
    m = models()
    seen = {}

    def sweep(target, make_drafter, quick=False, unknown_default=3):
        seen.update(target=target, quick=quick, unknown_default=unknown_default)
        return [{"batch_size": 1, "method": "plain", "tokens_per_s": 1.0}]

    res = bench_cli.call_batch_sweep(sweep, m, True, 0, print)
    assert seen == {"target": m.target, "quick": True, "unknown_default": 3}
    assert res == {"rows": [{"batch_size": 1, "method": "plain", "tokens_per_s": 1.0}]}


def test_specdec_cli_has_the_bench_command(capsys):
    from specdec_ext import cli

    try:
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "--help"])
    except ImportError as err:  # another subcommand's module missing in a half-updated tree
        pytest.skip(f"specdec CLI not importable: {err}")
    assert exc.value.code == 0 and "--suite" in capsys.readouterr().out


def test_user_model_dirs(tmp_path):
    m = models()
    m.target.save_pretrained(tmp_path / "target")
    m.draft_lm.save_pretrained(tmp_path / "draft")
    out = tmp_path / "res"
    rc = bench_cli.main(["--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"), "--suite",
                         "e2e", "--temperatures", "0", "--num-prompts", "1", "--prompt-len", "16", "--max-new-tokens",
                         "6", "--out", str(out), "--name", "mine", "--no-plots"])
    assert rc == 0
    (js,) = [f for f in os.listdir(out) if f.endswith(".json")]
    assert js.startswith("mine_") and not [f for f in os.listdir(out) if f.endswith(".png")]
    data = json.loads((out / js).read_text())
    assert data["models"]["model_dir"] == str(tmp_path / "target")
    assert {r["method"] for r in data["e2e"]["runs"]} == {"plain", "ngram", "draft-model", "hf-plain", "hf-assisted",
                                                         "hf-prompt-lookup"}
    assert all(c["equal"] for c in data["e2e"]["greedy_checks"])


def test_zoo_family_is_the_default(monkeypatch):
    """from_zoo adapts whatever load_family returns (stand-in here: the tiny models) and records its settings."""
    import specdec_ext.zoo as zoo
    from specdec_ext.bench.models import from_zoo

    m = models()

    class StandIn:
        path = "/somewhere/family"
        target, tokenizer, draft_lm = m.target, None, m.draft_lm
        drafter_names = ("ngram", "draft-model")

        def make_drafter(self, name):
            return m.make_drafter(name)

        def drafter_kwargs(self, name):
            return {"num_pred_tokens": 4} if name == "ngram" else {"num_draft_tokens": 4}

    seen = {}
    monkeypatch.setattr(zoo, "load_family", lambda *a, **k: seen.update(k) or StandIn())
    bm = from_zoo(device="cpu")
    assert seen["device"] == "cpu" and bm.name == "zoo" and bm.drafter_names == ["ngram", "draft-model"]
    assert bm.describe()["family_path"] == "/somewhere/family"
    assert bm.describe()["drafter_settings"]["ngram"] == {"num_pred_tokens": 4}
    prompts, how = bm.prompts(2, 10)
    assert len(prompts) == 2 and all(len(p) == 10 for p in prompts) and how.startswith("synthetic")


def test_prompts_from_heldout_text():
    from specdec_ext.bench.models import BenchModels

    def char_tok(text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}

    m = models()
    texts = [f"def f{i}(x):\n    return x * {i}\n" * 20 for i in range(3)]
    bm = BenchModels("t", m.target, char_tok, None, [], m.make_drafter, texts=texts, text_source="unit")
    prompts, how = bm.prompts(3, 50)
    assert [len(p) for p in prompts] == [50, 50, 50] and "middle 50 tokens of 3 held-out documents" in how
    assert prompts[0] != prompts[1]
    long_prompts, how = bm.prompts(2, 500)  # longer than any document: windows of the joined text
    assert [len(p) for p in long_prompts] == [500, 500] and "windows" in how


def _bench_script(name: str):
    """The module of ``benchmarks/python/<name>.py`` (scripts, not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "python",
                        f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tree_sizes_benchmark_runs_every_size_with_its_bound(tmp_path, capsys):
    """benchmarks/python/bench_tree_sizes.py on the shipped family, tiny settings: one row per size, each with a
    verification bound at least its measured speedup; bad sizes are refused by name."""
    mod = _bench_script("bench_tree_sizes")
    out = tmp_path / "sizes.json"
    assert mod.main(["--drafter", "medusa", "--sizes", "2,4", "--num-prompts", "1", "--prompt-len", "16",
                     "--max-new-tokens", "8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["size"]: r for r in data["rows"] if r["size"] is not None}
    assert set(rows) == {2, 4} and data["size_argument"] == "max_nodes"
    for r in rows.values():
        assert r["new_tokens"] == 8 and r["verification_bound_speedup"] >= r["speedup"] > 0
    with pytest.raises(SystemExit):
        mod.main(["--sizes", "4,x"])
    assert "--sizes" in capsys.readouterr().err


def test_join_benchmark_compares_alone_and_chunked_on_the_same_forwards(tmp_path):
    """benchmarks/python/bench_join.py on the shipped family, tiny settings: each row's chunked cost is the extra
    of the step with one more row, times the steps its prompt takes, and the ratio is that over the alone prefill."""
    mod = _bench_script("bench_join")
    assert mod.main(["--repeats", "1", "--batches", "2", "--prompts", "20", "--out", str(tmp_path)]) == 0
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("join_*.json")]
    (row,) = result["rows"]
    N = result["tree_nodes"]
    assert row["batch"] == 2 and row["prompt"] == 20 and row["alone_ms"] > 0
    for c in row["chunked"]:
        assert c["steps_to_first_token"] == -(-19 // c["chunk"])
        assert c["total_extra_ms"] == pytest.approx(c["steps_to_first_token"] * c["per_step_extra_ms"])
    best = min(row["chunked"], key=lambda c: c["total_extra_ms"])
    assert row["best_chunk"] == best["chunk"] >= N
    assert row["chunked_over_alone"] == pytest.approx(best["total_extra_ms"] / row["alone_ms"])


def test_draft_lms_benchmark_sets_trained_drafts_beside_the_familys(tmp_path, capsys):
    """benchmarks/python/bench_draft_lms.py with the family's own draft LM and parallel draft as the "trained" ones:
    a parallel draft is recognised by its config (one method per chain length), the same weights accept the same
    tokens as the family's methods, and every greedy output is plain decoding's."""
    from specdec_ext.zoo.family import family_dir

    mod = _bench_script("bench_draft_lms")
    out = tmp_path / "lms.json"
    fam = family_dir()
    assert mod.main(["--drafts", os.path.join(fam, "draft"), os.path.join(fam, "parallel_draft"), "--chains", "2", "4",
                     "--rounds", "1", "--temperatures", "0", "--num-prompts", "1", "--prompt-len", "16",
                     "--max-new-tokens", "12", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["table"]}
    assert set(rows) == {"plain", "draft-model", "parallel-draft", "draft-model:draft",
                         "parallel-draft:parallel_draft:2", "parallel-draft:parallel_draft:4"}
    assert rows["draft-model:draft"]["mean_accepted_length"] == rows["draft-model"]["mean_accepted_length"]
    assert rows["parallel-draft:parallel_draft:4"]["mean_accepted_length"] == \
        rows["parallel-draft"]["mean_accepted_length"]  # (the family's CPU shape: a chain of 4)
    assert "greedy outputs: 5 of 5 comparisons identical" in capsys.readouterr().out


def test_draft_split_benchmark_nests_the_forward_in_the_drafters_part(tmp_path, capsys):
    """benchmarks/python/bench_draft_split.py on the family's draft LM and parallel draft, tiny settings: per draft,
    its decoder layers within its forward within the drafter's part of the loop; two drafts of one folder name are
    told apart by their parents, and the same weights accept the same tokens."""
    from specdec_ext.zoo.family import family_dir

    fam = family_dir()
    for parent in ("a", "b"):
        (tmp_path / parent).mkdir()
        os.symlink(os.path.join(fam, "draft"), tmp_path / parent / "draft")
    mod = _bench_script("bench_draft_split")
    out = tmp_path / "split.json"
    assert mod.main(["--drafts", str(tmp_path / "a" / "draft"), str(tmp_path / "b" / "draft"),
                     os.path.join(fam, "parallel_draft"), "--rounds", "1", "--num-prompts", "1", "--prompt-len", "16",
                     "--max-new-tokens", "12", "--json", str(out)]) == 0
    rows = {r["draft"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"a/draft", "b/draft", "parallel_draft"}
    assert rows["a/draft"]["kind"] == "DraftModelDrafter" and rows["parallel_draft"]["kind"] == "ParallelDraftDrafter"
    assert rows["a/draft"]["accepted_per_step"] == rows["b/draft"]["accepted_per_step"] > 1
    for r in rows.values():
        assert 0 < r["layers_share"] < r["forward_share"] < r["drafter_share"] < 1
    # --draft-quant: the drafts' weights, recorded
    assert mod.main(["--drafts", os.path.join(fam, "parallel_draft"), "--draft-quant", "int8", "--rounds", "1",
                     "--num-prompts", "1", "--prompt-len", "16", "--max-new-tokens", "12", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["draft_quant"] == "int8" and data["rows"][0]["accepted_per_step"] > 1
    assert mod._drafter(os.path.join(fam, "parallel_draft"), 4, "int8").draft_quant == "int8"
