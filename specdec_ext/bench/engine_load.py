"""``specdec bench --suite engine``: the :class:`~specdec_ext.Engine` under load, plain vs each drafter vs adaptive.

Loads: a closed loop of ``C`` concurrent clients (engine of ``C`` rows) and an open loop of requests arriving as a
Poisson process at each rate (engine of ``max_batch`` rows, the rest queued). At every load, every method serves
the same requests (:func:`~specdec_ext.bench.load_clients.make_workload`) one after the other, ``repeats`` rounds
in a rotated order (round ``r`` starts at the ``r``-th method), and each method reports its median round: a VM
that drifts or a neighbour that wakes up then lands on every method alike instead of on whichever ran last. Each
method keeps one drafter for the whole run (as a server does). ``adaptive`` is an
:class:`~specdec_ext.adaptive.AdaptiveDrafter` around ``adaptive_inner`` (``"best"``: of the fixed drafters among
the methods, the fastest at one client on the suite's first requests before the loads, by the median of three
rounds: :func:`~specdec_ext.bench.load_clients.fastest_drafter`). Per configuration: throughput, TTFT and ITL
p50/p99, mean accepted length, whether greedy outputs equal plain decoding's.

Each load starts with ``warmup_rounds`` unmeasured rounds of every method: first-shape costs at a new batch size,
and the adaptive drafter's learning of a load it has not seen (in the suite's sub-second rounds that took the first
one or two rounds of a load; a server's load moves gradually and pays that once). Adaptive over the better side in
them is reported beside the goal, so what the learning costs is on the record.

The summary asks the issue's question: where does speculation stop paying, and is adaptive within 5% of the better
of plain and the best fixed drafter at every load (and above both somewhere)? It answers from paired rounds: per
round, adaptive over the better of plain and the best fixed drafter (best by median) in that round, then the median
of those ratios. A shared VM's speed drifts by 10-20% over minutes, and the methods of one round run seconds apart,
so the ratio within a round is what a drift leaves alone; the ratio of the medians (also reported) compares rounds
run minutes apart.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from specdec_ext.adaptive import AdaptiveDrafter
from specdec_ext.bench.load_clients import (REPLAY_EXCLUDED, ClosedClients, Job, PoissonArrivals, drive,
                                            fastest_drafter, make_workload, summarise)
from specdec_ext.bench.rounds import median_round, paired_ratio, round_order
from specdec_ext.engine import Engine, RequestSettings

__all__ = ["EngineLoadConfig", "format_table", "run_engine_load"]


@dataclass(frozen=True)
class EngineLoadConfig:
    """What the engine suite runs (the CLI's defaults are modest for a 2-core CPU; flags scale them up)."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    rates: tuple[float, ...] = (2.0, 8.0, 32.0)  # requests/s
    requests: int = 16  # per load point (closed loops: at least 2 per client)
    prompt_len: int = 64  # longest prompt; each job takes [half, all] of its prompt
    max_new_tokens: int = 48  # largest budget; each job draws [1/4, all]
    max_batch: int = 16  # engine rows in the open loop
    temperature: float = 0.0
    methods: tuple[str, ...] | None = None  # default: plain, every drafter but REPLAY_EXCLUDED, adaptive
    adaptive_inner: str = "best"
    seed: int = 0
    repeats: int = 1  # rounds per load, rotated; each method reports its median round
    warmup_rounds: int = 0  # unmeasured rounds of every method first at each load (the CLI's default: 1)


def _loads(cfg: EngineLoadConfig) -> list[tuple[str, float]]:
    return [("closed", c) for c in cfg.concurrency] + [("poisson", r) for r in cfg.rates]


def _methods(cfg: EngineLoadConfig, names: list[str]) -> list[str]:
    methods = list(cfg.methods or ["plain", *(n for n in names if n not in REPLAY_EXCLUDED), "adaptive"])
    bad = [m for m in methods if m not in ("plain", "adaptive", *names)]
    if bad:
        raise ValueError(f"unknown method(s) {bad} (choose from plain, {', '.join(names)}, adaptive)")
    if "adaptive" in methods and cfg.adaptive_inner == "best" and not any(m in names for m in methods):
        raise ValueError("adaptive_inner 'best' needs a fixed drafter among the methods (or name the inner drafter)")
    if cfg.adaptive_inner not in ("best", *names):
        raise ValueError(f"adaptive_inner must be 'best' or one of {', '.join(names)}, got {cfg.adaptive_inner!r}")
    if not (isinstance(cfg.repeats, int) and cfg.repeats >= 1):
        raise ValueError(f"repeats must be an integer >= 1, got {cfg.repeats!r}")
    if not (isinstance(cfg.warmup_rounds, int) and cfg.warmup_rounds >= 0):
        raise ValueError(f"warmup_rounds must be an integer >= 0, got {cfg.warmup_rounds!r}")
    # plain first (the reference outputs), adaptive last
    return ["plain"] + [m for m in methods if m not in ("plain", "adaptive")] + (["adaptive"] if "adaptive" in methods else [])


def _run_one(models, drafter, jobs, source, cfg: EngineLoadConfig, max_batch: int) -> tuple[dict, list]:
    max_nodes = drafter.max_nodes if drafter is not None else 1
    # what the longest request needs (prompt + budget) and the drafter's tree, as Engine.add_request checks it
    max_len = max(len(j.prompt) + j.max_new_tokens for j in jobs) + max_nodes

    def settings_of(i: int) -> RequestSettings:
        return RequestSettings(max_new_tokens=jobs[i].max_new_tokens, temperature=cfg.temperature,
                               seed=cfg.seed + i if cfg.temperature > 0 else None)

    adaptive = isinstance(drafter, AdaptiveDrafter)
    depths, chains = (dict(drafter.depth_hist), dict(drafter.chain_hist)) if adaptive else (None, None)
    with Engine(models.target, drafter, max_batch=max_batch, max_len=max_len, eos_token_id=[]) as engine:
        traces = drive(engine, jobs, source, settings_of)
        st = engine.stats
    row = summarise(traces)
    row.update(engine_new_tokens=st.new_tokens, mean_accepted_length=st.mean_accepted_length, steps=st.steps,
               mean_batch=st.row_steps / st.steps if st.steps else 0.0, max_batch_seen=st.batch_size,
               finish_reasons=sorted({t.finish_reason for t in traces if t.finish_reason}))
    if adaptive:  # this run's steps per depth, and those of them that drafted a chain of a wider drafter
        for key, before, now in (("depth_hist", depths, drafter.depth_hist), ("chain_hist", chains, drafter.chain_hist)):
            row[key] = {str(d): n - before.get(d, 0) for d, n in sorted(now.items()) if n - before.get(d, 0)}
    return row, [t.tokens for t in traces]


def run_engine_load(models, cfg: EngineLoadConfig = EngineLoadConfig(), log=print) -> dict:
    """Every method at every load (module doc); returns the suite's JSON part."""
    names = list(models.drafter_names)
    methods = _methods(cfg, names)
    loads = _loads(cfg)
    n_most = max([cfg.requests] + [max(cfg.requests, 2 * int(c)) for c in cfg.concurrency])
    prompts, prompt_note = models.prompts(min(n_most, 16), cfg.prompt_len, cfg.seed)
    workload = make_workload(prompts, n_most, cfg.max_new_tokens, cfg.seed)
    t_start = time.perf_counter()
    inner, inner_rates = cfg.adaptive_inner, None
    if "adaptive" in methods and inner == "best":
        inner, inner_rates = fastest_drafter(models, [m for m in methods if m in names], workload[:cfg.requests])
        if log:
            log(f"adaptive around {inner} (tokens/s at one client, medians of three rounds: "
                + ", ".join(f"{n} {r:.1f}" for n, r in inner_rates.items()) + ")")
    drafters = {m: models.make_drafter(m) for m in methods if m in names}
    drafters["plain"] = None
    if "adaptive" in methods:
        drafters["adaptive"] = AdaptiveDrafter(models.make_drafter(inner))
    warm = workload[:2]

    def warm_up(m):  # first-shape costs, allocations; the drafter's state carries on (as on a server)
        _run_one(models, drafters[m], [Job(j.prompt, min(8, j.max_new_tokens)) for j in warm],
                 ClosedClients(len(warm), len(warm)), cfg, len(warm))

    for m in drafters:
        warm_up(m)
    rows = []
    for kind, value in loads:
        n = max(cfg.requests, 2 * int(value)) if kind == "closed" else cfg.requests
        jobs = workload[:n]
        runs: dict[str, list[tuple[dict, list]]] = {m: [] for m in methods}
        warm_runs: dict[str, list[tuple[dict, list]]] = {m: [] for m in methods}
        for r in range(-cfg.warmup_rounds, cfg.repeats):  # (warm-up rounds first, unmeasured: see the module doc)
            for m in round_order(methods, r):
                source = ClosedClients(n, int(value)) if kind == "closed" else \
                    PoissonArrivals(n, float(value), cfg.seed + 7919)
                (warm_runs if r < 0 else runs)[m].append(_run_one(models, drafters[m], jobs, source, cfg,
                                                                  int(value) if kind == "closed" else cfg.max_batch))
        reference = runs["plain"][0][1]
        for m in methods:
            row = median_round(runs[m], counts=("finished", "requests"))
            row.update(load=kind, value=value, method=m, outputs_match_plain=None if cfg.temperature > 0 else
                       all(outputs == reference for _, outputs in runs[m] + warm_runs[m]),
                       warmup_tokens_per_s=[w["tokens_per_s"] for w, _ in warm_runs[m]])
            rows.append(row)
            if log:
                log(format_row(row))
    return {"config": {**asdict(cfg), "methods": methods, "adaptive_inner": inner,
                       "adaptive_inner_rates": inner_rates},
            "prompts": prompt_note, "threads": torch.get_num_threads(), "eos": "ignored (every request runs its "
            "budget)", "itl": "a step handing a request k tokens g s after its last ones counts as k intervals of "
            "g / k", "rows": rows, "summary": summarise_loads(rows, methods, names),
            "seconds": round(time.perf_counter() - t_start, 1)}


def summarise_loads(rows: list[dict], methods: list[str], names: list[str]) -> dict:
    """Per load: each method's throughput over plain's, the best fixed drafter, adaptive over the better of plain
    and that drafter; and the goal (>= 0.95 everywhere, > 1 somewhere) as measured."""
    per_load = []
    for kind, value in dict.fromkeys((r["load"], r["value"]) for r in rows):
        at = {r["method"]: r for r in rows if (r["load"], r["value"]) == (kind, value)}
        plain = at["plain"]["tokens_per_s"]
        entry = {"load": kind, "value": value,
                 "vs_plain": {m: (at[m]["tokens_per_s"] / plain if plain > 0 else None) for m in methods if m in at}}
        fixed = [m for m in methods if m in names and m in at]
        if fixed:
            best = max(fixed, key=lambda m: at[m]["tokens_per_s"])
            entry.update(best_fixed=best, speculation_pays=at[best]["tokens_per_s"] > plain)
            if "adaptive" in at:
                better = max(plain, at[best]["tokens_per_s"])
                entry["adaptive_vs_better"] = at["adaptive"]["tokens_per_s"] / better if better > 0 else None
                entry["adaptive_vs_better_paired"] = paired_ratio(at["adaptive"], at["plain"], at[best])
                # (the warm-up rounds, unmeasured for the goal: the adaptive drafter's learning of a new load)
                entry["adaptive_vs_better_warmup"] = paired_ratio(at["adaptive"], at["plain"], at[best],
                                                                  key="warmup_tokens_per_s")
        per_load.append(entry)
    medians = [e["adaptive_vs_better"] for e in per_load if e.get("adaptive_vs_better") is not None]
    ratios = [e["adaptive_vs_better_paired"] for e in per_load if e.get("adaptive_vs_better_paired") is not None]
    above = [f"{e['load']}:{e['value']:g}" for e in per_load if (e.get("adaptive_vs_better_paired") or 0) > 1.0]
    return {"per_load": per_load,
            "min_adaptive_vs_better": min(medians) if medians else None,
            "min_adaptive_vs_better_paired": min(ratios) if ratios else None,
            "within_5pct_everywhere": bool(ratios) and min(ratios) >= 0.95,
            "above_both_at": above,
            "goal_met": bool(ratios) and min(ratios) >= 0.95 and bool(above),
            "speculation_stops_paying_at": [f"{e['load']}:{e['value']:g}" for e in per_load
                                            if e.get("speculation_pays") is False],
            "all_finished": all(f == n for r in rows  # (every measured round: rounds.median_round)
                                for f, n in zip(r["finished_rounds"], r["requests_rounds"])),
            "all_outputs_match_plain": all(r["outputs_match_plain"] is not False for r in rows)}


def _load_name(kind: str, value) -> str:
    return f"C={int(value)}" if kind == "closed" else f"{value:g} req/s"


def format_row(r: dict) -> str:
    return (f"{_load_name(r['load'], r['value']):>11}  {r['method']:<12} {r['tokens_per_s']:8.1f} tok/s  TTFT p50/p99 "
            f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms  ITL p50/p99 {r['itl_p50_ms']:.1f}/"
            f"{r['itl_p99_ms']:.1f} ms  accepted {r['mean_accepted_length']:.2f}  batch {r['mean_batch']:.1f}"
            f"{'' if r['outputs_match_plain'] is not False else '  OUTPUT MISMATCH'}")


def format_table(result: dict) -> str:
    """Markdown: throughput relative to plain per load and method, then the goal check as measured."""
    s = result["summary"]
    methods = [m for m in result["config"]["methods"] if m != "plain"]
    head = ("| load | plain tok/s | " + " | ".join(methods) + " | best fixed | adaptive / better | paired rounds | "
            "warm-up rounds |")
    lines = [f"engine under load: throughput relative to plain (adaptive around {result['config']['adaptive_inner']})",
             head, "|" + "---|" * (head.count("|") - 1)]
    plain = {(r["load"], r["value"]): r["tokens_per_s"] for r in result["rows"] if r["method"] == "plain"}
    for e in s["per_load"]:
        ratios = " | ".join("-" if e["vs_plain"].get(m) is None else f"{e['vs_plain'][m]:.2f}" for m in methods)
        avb, paired, warm = (e.get(k) for k in ("adaptive_vs_better", "adaptive_vs_better_paired",
                                               "adaptive_vs_better_warmup"))
        lines.append(f"| {_load_name(e['load'], e['value'])} | {plain[(e['load'], e['value'])]:.1f} | {ratios} | "
                     f"{e.get('best_fixed', '-')} | {'-' if avb is None else f'{avb:.2f}'} | "
                     f"{'-' if paired is None else f'{paired:.2f}'} | {'-' if warm is None else f'{warm:.2f}'} |")
    if s["min_adaptive_vs_better_paired"] is not None:
        lines.append(f"goal (adaptive >= 0.95 x the better of plain and the best fixed drafter at every load, above "
                     f"both somewhere; paired rounds): {'MET' if s['goal_met'] else 'NOT MET'} as measured - min "
                     f"ratio {s['min_adaptive_vs_better_paired']:.2f} (of the medians: "
                     f"{s['min_adaptive_vs_better']:.2f}), above both at {s['above_both_at'] or 'no load'}")
    lines.append(f"speculation (best fixed drafter) slower than plain at: {s['speculation_stops_paying_at'] or 'none'}"
                 f"; all requests finished: {s['all_finished']}; greedy outputs equal plain: "
                 f"{s['all_outputs_match_plain']}")
    return "\n".join(lines)
