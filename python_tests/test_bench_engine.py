"""``specdec bench --suite engine`` (specdec_ext.bench.engine_load, load_clients) on tiny random models.

* The clients: Poisson requests are added only once their arrival time has passed (a fake clock), a closed loop
  never has more than C requests in flight, and every request's tokens equal Hugging Face's greedy decoding of its
  prompt alone (plain and with a drafter, rows joining and leaving).
* The summary's arithmetic on hand-made traces (TTFT from arrival, a k-token step as k intervals of g / k).
* The suite end to end through the CLI: JSON with machine info, settings and every configuration; every request
  finished, the tokens counted equal the engine's count and the workload's budgets, greedy outputs equal plain
  decoding's; the PNG. Timings are not asserted (tiny random models on a shared CPU), only that they are sane.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

from hf_reference import hf_greedy  # noqa: E402
from test_bench import models  # noqa: E402  (the tiny random models, built once)

from specdec_ext import Engine, RequestSettings  # noqa: E402
from specdec_ext.bench import cli as bench_cli  # noqa: E402
from specdec_ext.bench import engine_load  # noqa: E402
from specdec_ext.bench.engine_load import summarise_loads  # noqa: E402
from specdec_ext.bench.rounds import median_round, paired_ratio, round_order  # noqa: E402
from specdec_ext.bench.load_clients import (ClosedClients, Job, PoissonArrivals, Trace, drive,  # noqa: E402
                                            make_workload, summarise)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def workload(n=5, new=8):
    m = models()
    prompts, _ = m.prompts(3, 16, seed=0)
    return make_workload(prompts, n, new, seed=1)


class FakeClock:
    """Time moves 0.05 s per reading and by whatever the driver sleeps."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.05
        return self.t

    def sleep(self, dt):
        self.t += dt


def greedy(jobs):
    return lambda i: RequestSettings(max_new_tokens=jobs[i].max_new_tokens)


def test_workload_varies_prompts_and_budgets_within_bounds():
    prompts = [list(range(10, 30)), list(range(40, 52))]
    jobs = make_workload(prompts, 20, 16, seed=3)
    assert jobs == make_workload(prompts, 20, 16, seed=3)  # seeded
    for i, j in enumerate(jobs):
        p = prompts[i % 2]
        assert len(p) // 2 <= len(j.prompt) <= len(p) and j.prompt == p[len(p) - len(j.prompt):]
        assert 4 <= j.max_new_tokens <= 16
    assert len({j.max_new_tokens for j in jobs}) > 3 and len({len(j.prompt) for j in jobs}) > 3
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        make_workload(prompts, 3, 0, seed=0)


@pytest.mark.parametrize("drafter_name", [None, "draft-model"])
def test_poisson_requests_join_at_their_times_and_decode_exactly(drafter_name):
    m = models()
    jobs = workload()
    clock = FakeClock()
    source = PoissonArrivals(len(jobs), rate=4.0, seed=5)
    times = list(source.times)
    drafter = m.make_drafter(drafter_name) if drafter_name else None
    with Engine(m.target, drafter, max_batch=2, max_len=128, eos_token_id=[]) as engine:
        traces = drive(engine, jobs, source, greedy(jobs), clock=clock, sleep=clock.sleep)
        emitted = engine.stats.new_tokens
    assert [t.arrival for t in traces] == times
    for job, tr in zip(jobs, traces):
        assert tr.chunks[0][0] > tr.arrival  # added after it arrived, first token after that
        assert tr.finish_reason == "length" and tr.finish == tr.chunks[-1][0]
        assert tr.tokens == hf_greedy(m.target, job.prompt, job.max_new_tokens)
    assert emitted == sum(len(t.tokens) for t in traces) == sum(j.max_new_tokens for j in jobs)


def test_closed_loop_keeps_c_requests_in_flight():
    m = models()
    jobs = workload(n=7, new=6)
    with Engine(m.target, m.make_drafter("ngram"), max_batch=8, max_len=128, eos_token_id=[]) as engine:
        traces = drive(engine, jobs, ClosedClients(len(jobs), 3), greedy(jobs))
        assert engine.stats.batch_size == 3  # never more than the clients, though the engine has 8 rows
    finishes = sorted(t.finish for t in traces)
    assert [t.arrival for t in traces[:3]] == [0.0] * 3
    for tr in traces[3:]:  # each later request is sent at an earlier request's finish
        assert tr.arrival in finishes and tr.arrival < tr.finish
    for job, tr in zip(jobs, traces):
        assert tr.tokens == hf_greedy(m.target, job.prompt, job.max_new_tokens)


def test_summary_arithmetic():
    a = Trace(arrival=1.0, chunks=[(1.5, 1), (1.7, 2), (2.0, 1)], tokens=[1, 2, 3, 4], finish=2.0)
    b = Trace(arrival=0.0, chunks=[(0.1, 3), (0.5, 4)], tokens=list(range(7)), finish=0.5)
    s = summarise([a, b])
    assert s["tokens"] == 11 and s["finished"] == 2 and s["duration_s"] == 2.0
    assert s["tokens_per_s"] == pytest.approx(5.5)
    assert s["ttft_p50_ms"] == pytest.approx(300.0)  # TTFTs 500 and 100 ms
    # ITL samples: a: 100, 100 (0.2 s over 2 tokens), 300; b: 100 x 4 -> sorted 100 x 6, 300
    assert s["itl_p50_ms"] == pytest.approx(100.0)
    assert s["itl_p99_ms"] == pytest.approx(100.0 + 0.94 * 200.0)
    assert s["latency_p50_ms"] == pytest.approx(750.0)


def test_round_order_rotates_every_method_through_every_place():
    methods = ["plain", "ngram", "eagle2", "adaptive"]
    orders = [round_order(methods, r) for r in range(4)]
    assert orders[0] == methods and round_order(methods, 4) == methods
    for place in range(4):
        assert sorted(o[place] for o in orders) == sorted(methods)


def test_engine_suite_through_the_cli(tmp_path, capsys):
    out = tmp_path / "res"
    rc = bench_cli.main(["--tiny", "--suite", "engine", "--out", str(out), "--name", "engine_load",
                         "--concurrency", "1,3", "--rates", "300", "--requests", "4", "--engine-prompt-len", "16",
                         "--engine-max-new-tokens", "8", "--max-batch", "2",
                         "--engine-methods", "plain,ngram,draft-model,adaptive", "--repeats", "2",
                         "--warmup-rounds", "1",
                         "--note", "shared machine"])
    assert rc == 0
    files = sorted(os.listdir(out))
    stem = files[0].removesuffix(".json")
    assert stem.startswith("engine_load_") and files == [stem + ".json", stem + "_engine.png"]
    data = json.loads((out / files[0]).read_text())
    assert data["note"] == "shared machine" and data["suites"] == ["engine"]
    for key in ("cpu", "cores", "torch", "torch_threads", "specdec_ext"):
        assert key in data["machine"], key
    eng = data["engine"]
    cfg = eng["config"]
    assert cfg["methods"] == ["plain", "ngram", "draft-model", "adaptive"]
    assert cfg["adaptive_inner"] in ("ngram", "draft-model") and cfg["temperature"] == 0.0
    rates = cfg["adaptive_inner_rates"]  # ("best": the fixed drafters timed at one client before the loads)
    assert set(rates) == {"ngram", "draft-model"} and cfg["adaptive_inner"] == max(rates, key=rates.get)
    assert data["machine"]["host_allocator"]["reason"]  # (what the run's malloc thresholds were, and why)
    loads = [("closed", 1), ("closed", 3), ("poisson", 300.0)]
    assert [(r["load"], r["value"], r["method"]) for r in eng["rows"]] == \
        [(k, v, m) for k, v in loads for m in cfg["methods"]]
    prompts, _ = models().prompts(6, 16, 0)
    for r in eng["rows"]:
        n = 6 if (r["load"], r["value"]) == ("closed", 3) else 4  # (a closed loop sends 2 per client at least)
        jobs = make_workload(prompts, 6, 8, seed=0)[:n]
        assert r["requests"] == r["finished"] == n, r
        assert r["tokens"] == r["engine_new_tokens"] == sum(j.max_new_tokens for j in jobs), r
        assert r["outputs_match_plain"] is True, r
        assert r["tokens_per_s"] > 0 and r["duration_s"] > 0
        # two rounds; the row is the lower one's (the lower middle of an even count)
        assert len(r["tokens_per_s_rounds"]) == 2 and r["tokens_per_s"] == min(r["tokens_per_s_rounds"])
        assert len(r["warmup_tokens_per_s"]) == 1 and r["warmup_tokens_per_s"][0] > 0  # (a warm-up round first)
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["ttft_p99_ms"] <= r["latency_p99_ms"] <= 1e3 * r["duration_s"]
        assert r["mean_accepted_length"] >= 1.0 and r["max_batch_seen"] <= (3 if r["value"] == 3 else 2)
        if r["method"] == "plain":
            assert r["mean_accepted_length"] == 1.0
        if r["method"] == "adaptive":
            assert sum(r["depth_hist"].values()) == r["steps"]
            assert all(n <= r["depth_hist"][d] for d, n in r["chain_hist"].items())  # chain steps: some of them
    s = eng["summary"]
    assert s["all_finished"] and s["all_outputs_match_plain"]
    assert len(s["per_load"]) == 3 and all(e["vs_plain"]["plain"] == 1.0 for e in s["per_load"])
    at = {(r["load"], r["value"], r["method"]): r for r in eng["rows"]}
    for e in s["per_load"]:  # the warm-up round's ratio, on the record beside the goal (not judged)
        a, p, b = (at[(e["load"], e["value"], m)]["warmup_tokens_per_s"][0] for m in ("adaptive", "plain",
                                                                                    e["best_fixed"]))
        assert e["adaptive_vs_better_warmup"] == pytest.approx(a / max(p, b))
    assert isinstance(s["goal_met"], bool) and s["min_adaptive_vs_better"] > 0 and s["min_adaptive_vs_better_paired"] > 0
    assert (out / files[1]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert ("| load | plain tok/s | ngram | draft-model | adaptive | best fixed | adaptive / better | paired rounds | "
            "warm-up rounds |") in printed
    assert "goal (adaptive >= 0.95 x the better" in printed


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0,2"], "--concurrency must be >= 1"),
    (["--rates", "1,-2"], "--rates must be > 0"),
    (["--engine-methods", "plain,warp"], "unknown method(s) ['warp']"),
    (["--adaptive-inner", "warp"], "adaptive_inner must be 'best' or one of"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--warmup-rounds", "-1"], "--warmup-rounds must be >= 0"),
])
def test_engine_suite_bad_arguments(argv, message, tmp_path, capsys):
    rc = bench_cli.main(["--tiny", "--suite", "engine", "--out", str(tmp_path), *argv])
    assert rc == 2 and message in capsys.readouterr().err


def test_the_goal_is_judged_on_rounds_paired_in_time():
    """A VM that slows down between rounds: adaptive's median round ran in a slow phase, the fixed drafter's in a
    fast one. Within every round adaptive is ahead, which the paired ratio says; the ratio of medians does not."""
    def row(method, rate, median_round):  # (the row reported for a method is its median round: here chosen)
        rounds = [rate * v for v in (1.0, 0.8, 0.6)]  # the VM's speed in rounds 0, 1, 2
        return {"load": "closed", "value": 2, "method": method, "tokens_per_s": rounds[median_round],
                "tokens_per_s_rounds": rounds, "finished": 4, "requests": 4, "finished_rounds": [4, 4, 4],
                "requests_rounds": [4, 4, 4], "outputs_match_plain": True}
    rows = [row("plain", 100, 1), row("eagle1", 150, 0), row("adaptive", 160, 2)]
    s = summarise_loads(rows, ["plain", "eagle1", "adaptive"], ["eagle1"])
    e = s["per_load"][0]
    assert e["best_fixed"] == "eagle1"
    assert e["adaptive_vs_better"] == pytest.approx(96 / 150)
    assert e["adaptive_vs_better_paired"] == pytest.approx(160 / 150)
    assert s["goal_met"] and s["above_both_at"] == ["closed:2"] and s["min_adaptive_vs_better"] < 0.95
    assert paired_ratio(rows[2], rows[0], rows[1]) == pytest.approx(160 / 150)
    assert paired_ratio({"tokens_per_s_rounds": [1.0]}, rows[0], rows[1]) is None  # rounds that do not line up
    assert paired_ratio(rows[2]) is None  # nothing to compare with
    assert paired_ratio({"tokens_per_s_rounds": [1, 4]}, {"tokens_per_s_rounds": [1, 1]},
                        {"tokens_per_s_rounds": [2, 2]}) == pytest.approx((0.5 + 2.0) / 2)  # an even count
    assert s["all_finished"]
    rows[1]["finished_rounds"] = [4, 3, 4]  # a request left unfinished in a round that is not the median one
    assert rows[1]["finished"] == 4 and not summarise_loads(rows, ["plain", "eagle1", "adaptive"],
                                                            ["eagle1"])["all_finished"]


def test_median_round_keeps_the_counts_of_every_round():
    runs = [({"tokens_per_s": 3.0, "errors": 0}, []), ({"tokens_per_s": 1.0, "errors": 2}, []),
            ({"tokens_per_s": 2.0, "errors": 0}, [])]
    row = median_round(runs, counts=("errors",))
    assert row["tokens_per_s"] == 2.0 and row["errors"] == 0  # the median round's own row
    assert row["tokens_per_s_rounds"] == [3.0, 1.0, 2.0] and row["errors_rounds"] == [0, 2, 0]
