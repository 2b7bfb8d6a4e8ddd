"""``specdec bench --suite serve --tiny --quick``: the server under load from streaming clients in a process of their
own, for plain, the fixed drafter and adaptive, a warm-up round then two rounds in a rotated order. Every request
finishes without an error and gets its whole budget (EOS ignored), the greedy outputs of the drafters equal plain
decoding's in every round, plain decoding accepts nothing and the drafters something, the JSON holds every row with
its rounds and the goals' check on paired rounds, and the PNG is written.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("matplotlib")

from specdec_ext.bench.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_serve_suite_quick(tmp_path):
    assert main(["--tiny", "--quick", "--suite", "serve", "--out", str(tmp_path), "--name", "s", "--threads", "1",
                 "--requests", "4", "--repeats", "2", "--warmup-rounds", "1", "--serve-per-client", "3"]) == 0
    files = sorted(os.listdir(tmp_path))
    json_file = next(f for f in files if f.endswith(".json"))
    png = next(f for f in files if f.endswith("_serve.png"))
    with open(tmp_path / png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    serve = json.load(open(tmp_path / json_file))["serve"]
    rows = {(r["method"], r["concurrency"]): r for r in serve["rows"]}
    assert set(rows) == {(m, c) for m in ("plain", "fixed", "adaptive", "control") for c in (1, 2)}
    for (method, c), r in rows.items():
        assert r["errors"] == 0 and r["finished"] == r["sent"] == max(4, 3 * c), r  # (--serve-per-client 3)
        assert r["errors_rounds"] == [0, 0] and r["warmup_errors"] == 0 and r["finished_rounds"] == r["sent_rounds"]
        assert r["tokens"] == r["budget_tokens"] > 0  # every request ran its whole budget
        assert r["tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] is not None
        assert r["engine_step_s"] > 0 and r["overhead"] is not None
        if method == "plain":
            assert r["mean_accepted_length"] == 1.0 and r["outputs_match_plain"] is None
        elif method == "control":  # a second plain server: plain's tokens again
            assert r["mean_accepted_length"] == 1.0 and r["outputs_match_plain"] is True
        else:
            assert r["outputs_match_plain"] is True and r["mean_accepted_length"] >= 1.0
    s = serve["summary"]
    assert s["errors"] == 0 and s["all_finished"] and s["all_outputs_match_plain"]
    assert set(s["overhead"]) == {"plain", "fixed", "adaptive"} and s["overhead_at"] == 2
    assert all(v > 0 for v in s["server_vs_direct_throughput"].values())
    assert [e["concurrency"] for e in s["per_concurrency"]] == [1, 2]
    for r in rows.values():  # the median of two rounds is the slower one; each round's throughput beside it
        assert len(r["tokens_per_s_rounds"]) == 2 and r["tokens_per_s"] == min(r["tokens_per_s_rounds"])
        assert len(r["warmup_tokens_per_s"]) == 1 and r["warmup_tokens_per_s"][0] > 0  # (unmeasured, on record)
    for e in s["per_concurrency"]:
        a, p, f = (rows[(m, e["concurrency"])]["warmup_tokens_per_s"][0] for m in ("adaptive", "plain", "fixed"))
        assert e["adaptive_vs_better_warmup"] == pytest.approx(a / max(p, f))
    for e in s["per_concurrency"]:
        a, p, f = (rows[(m, e["concurrency"])]["tokens_per_s_rounds"] for m in ("adaptive", "plain", "fixed"))
        assert e["adaptive_vs_better_paired"] == pytest.approx(
            sum(x / max(y, z) for x, y, z in zip(a, p, f)) / 2)  # statistics.median of two: their mean
    assert s["min_adaptive_vs_better"] == pytest.approx(min(e["adaptive_vs_better_paired"]
                                                            for e in s["per_concurrency"]))
    controls = []
    for e in s["per_concurrency"]:  # the noise floor: the control over plain in the same rounds
        c, p = (rows[(m, e["concurrency"])]["tokens_per_s_rounds"] for m in ("control", "plain"))
        controls.append(sum(x / y for x, y in zip(c, p)) / 2)
        assert e["control_vs_plain_paired"] == pytest.approx(controls[-1])
    assert s["control_vs_plain_range"] == pytest.approx([min(controls), max(controls)])


def test_serve_suite_bad_arguments(capsys, tmp_path):
    assert main(["--tiny", "--quick", "--suite", "serve", "--serve-time-limit", "0"]) == 2
    assert "--serve-time-limit must be > 0" in capsys.readouterr().err
    assert main(["--tiny", "--quick", "--suite", "serve", "--serve-per-client", "0"]) == 2
    assert "--serve-per-client must be >= 1 request, got 0" in capsys.readouterr().err
    assert main(["--tiny", "--quick", "--suite", "serve", "--serve-drafter", "eagle9", "--no-plots",
                 "--out", str(tmp_path)]) == 2
    assert "drafter 'eagle9' is not one of" in capsys.readouterr().err


def test_the_best_fixed_drafter_is_the_fastest_at_one_client_on_the_suites_requests(monkeypatch):
    """"best": each drafter but those the replayed workload favours (suffix decoding would look up the replays) is
    timed at one client straight into an engine on the suite's first requests (after a warm-up on two short ones),
    three rounds in a rotated order, and the one with the best median kept (one fast round does not decide); a named
    drafter is taken as named, an unknown one refused."""
    from types import SimpleNamespace

    import specdec_ext.bench.load_clients as load_clients
    import specdec_ext.bench.serve_load as serve_load
    from specdec_ext.bench.load_clients import Job

    rates = {"ngram": [500.0], "suffix": [900.0], "eagle1": [700.0, 650.0, 720.0], "medusa": [990.0, 600.0, 610.0]}
    timed = []

    def fake_direct(models, drafter, jobs, concurrency):
        timed.append((drafter.name, [j.max_new_tokens for j in jobs], concurrency))
        if len(jobs) == 2:  # the warm-up
            return {"tokens_per_s": 1.0}
        n = sum(1 for name, k, _ in timed if name == drafter.name and len(k) == 3)
        series = rates[drafter.name]
        return {"tokens_per_s": series[(n - 1) % len(series)]}

    monkeypatch.setattr(load_clients, "run_direct", fake_direct)
    models = SimpleNamespace(drafter_names=list(rates), make_drafter=lambda n: SimpleNamespace(name=n, max_nodes=9))
    jobs = [Job([1] * 10, 6), Job([1] * 20, 12), Job([1] * 5, 3)]
    pick, medians = serve_load._fixed_drafter(models, "best", jobs)
    assert pick == "eagle1" and medians == {"ngram": 500.0, "eagle1": 700.0, "medusa": 610.0}  # (medusa's one fast
    # round does not decide)
    warm = [(n, [6, 8], 1) for n in ("ngram", "eagle1", "medusa")]
    rounds = [("ngram", "eagle1", "medusa"), ("eagle1", "medusa", "ngram"), ("medusa", "ngram", "eagle1")]
    assert timed == warm + [(n, [6, 12, 3], 1) for order in rounds for n in order]
    timed.clear()
    assert serve_load._fixed_drafter(models, "suffix", jobs) == ("suffix", None) and not timed  # (named: as asked)
    with pytest.raises(ValueError, match="drafter 'eagle9' is not one of"):
        serve_load._fixed_drafter(models, "eagle9", jobs)
