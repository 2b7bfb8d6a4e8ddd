"""The hybrid benchmark: speculation on a hybrid target (Lightning layers beside softmax attention) against the ways
other engines keep its recurrent states, in one run.

Methods, each ``(drafter, states)``:

* ``plain``: plain greedy decoding;
* ``<chain drafter>+snapshots``: chains verified with per-position state snapshots (vLLM's way,
  :class:`~specdec_ext.bench.state_baselines.SnapshotCache`);
* ``<chain drafter>+replay``: chains verified after a checkpoint, the accepted tokens replayed through the target
  after a rejection (llama.cpp's way, :class:`~specdec_ext.bench.state_baselines.ReplayCache`);
* ``<chain drafter>``: the same chains with this library's cache (no per-node state; the commit replays the
  accepted nodes' keys and values);
* ``<tree drafter>``: this library's trees (EAGLE-2), which neither baseline can verify.

Every method decodes every prompt greedily at batch 1 through one :class:`~specdec_ext.engine.Engine` per
generation (as ``generate`` does), the methods taking turns prompt by prompt after a warm-up. Each method keeps one
drafter for the whole run, as the e2e and engine suites do and as a server would: an EAGLE-2 tree ranks its
candidates by scores it calibrates online over the steps (a drafter made afresh for every prompt restarts that
calibration each time, which cost the tree ~10% of its accepted tokens here). Per method: tokens/s
(whole call, prefill included) and the speedup over plain decoding measured beside it, mean accepted length, the
recurrent state one sequence keeps between steps (bytes), the share of decode time spent on state bookkeeping
(recording the nodes' inputs, commits, snapshots, checkpoints and replays: the cache's ``bookkeeping_s`` over the
engine's draft + verify + host time) and whether the output equals plain decoding's token for token (the replay
baseline recomputes K/V in another batch shape, so it may differ in the last bits; reported, not assumed).
"""

from __future__ import annotations

import time

import torch

from specdec_ext.bench.state_baselines import BASELINE_CACHES, ReplayCache, TimedHybridCache, state_bytes_per_row
from specdec_ext.engine import Engine

__all__ = ["cache_factory", "format_table", "hybrid_methods", "run_hybrid_bench"]


def hybrid_methods(chain_drafters=("eagle1", "draft-model"),
                   tree_drafters=("eagle2",)) -> list[tuple[str, str | None, str]]:
    """``[(method name, drafter name or None, states)]`` in table order (module doc); states is ``"ours"`` or a key
    of :data:`~specdec_ext.bench.state_baselines.BASELINE_CACHES`."""
    methods = [("plain", None, "ours")]
    for d in chain_drafters:
        methods += [(f"{d}+{k}", d, k) for k in BASELINE_CACHES] + [(d, d, "ours")]
    methods += [(d, d, "ours") for d in tree_drafters]
    return methods


def cache_factory(states: str, target, positions: int, made: list):
    """The engine's ``make_cache`` for ``states`` (``"ours"`` or a key of ``BASELINE_CACHES``; the baselines keep
    ``positions`` states, the replay runs ``target``): every cache it makes is kept in ``made`` (the first is the
    batch's)."""
    cls = TimedHybridCache if states == "ours" else BASELINE_CACHES[states]
    kwargs = {} if states == "ours" else {"positions": positions}
    if cls is ReplayCache:
        kwargs["model"] = target

    def make(config, batch_size, max_len, **kw):
        cache = cls(config, batch_size, max_len, **kw, **kwargs)
        made.append(cache)
        return cache

    return make


def _decode(target, drafter, states: str, prompt: list[int], max_new_tokens: int) -> dict:
    made: list = []
    positions = drafter.max_nodes if drafter is not None else 1
    t0 = time.perf_counter()
    engine = Engine(target, drafter, max_batch=1, eos_token_id=[], caller="bench hybrid",
                    make_cache=cache_factory(states, target, positions, made))
    with engine:
        rid = engine.add_request(prompt, max_new_tokens=max_new_tokens)
        out: list[int] = []
        while engine.has_unfinished():
            for r, new, _ in engine.step():
                if r == rid:
                    out += new
    seconds = time.perf_counter() - t0
    st, cache = engine.stats, made[0]
    decode_s = st.draft_s + st.verify_s + st.bookkeeping_s
    return {"tokens": out, "seconds": seconds, "decode_s": decode_s, "row_steps": st.row_steps,
            "new_tokens": st.new_tokens, "state_bookkeeping_s": cache.bookkeeping_s,
            "state_bytes": cache.persistent_state_bytes_per_row(), "committed_state_bytes": state_bytes_per_row(cache),
            "replays": getattr(cache, "replays", 0)}


def run_hybrid_bench(family, prompts: list[list[int]], max_new_tokens: int, methods=None, warmup: bool = True,
                     log=print) -> dict:
    """Runs ``methods`` (:func:`hybrid_methods`; default all) on ``family``'s hybrid target over ``prompts``;
    returns ``{"methods": {name: row}, ...}`` (module doc). Methods take turns prompt by prompt."""
    methods = methods or hybrid_methods()
    if methods[0][0] != "plain":
        raise ValueError("run_hybrid_bench: the first method must be plain (the speedups' reference)")
    target = family.target
    drafters = {m: (None if d is None else family.make_drafter(d)) for m, d, _ in methods}  # one a method
    return _run(target, drafters, prompts, max_new_tokens, methods, warmup, log)


def _run(target, drafters, prompts, max_new_tokens, methods, warmup, log) -> dict:
    if warmup:
        for m, _, states in methods:
            _decode(target, drafters[m], states, prompts[0][:16], 8)
    rows = {m: {"drafter": d, "states": s, "tokens": 0, "seconds": 0.0, "decode_s": 0.0, "row_steps": 0,
                "state_bookkeeping_s": 0.0, "replays": 0, "identical": True} for m, d, s in methods}
    for i, p in enumerate(prompts):
        reference = None
        for m, _, states in methods:
            r = _decode(target, drafters[m], states, p, max_new_tokens)
            row = rows[m]
            for k in ("seconds", "decode_s", "row_steps", "state_bookkeeping_s", "replays"):
                row[k] += r[k]
            row["tokens"] += r["new_tokens"]
            row["state_bytes_per_sequence"] = r["state_bytes"]
            row["committed_state_bytes"] = r["committed_state_bytes"]
            if m == "plain":
                reference = r["tokens"]
            else:
                row["identical"] &= r["tokens"] == reference
        log(f"  prompt {i + 1}/{len(prompts)} done")
    plain_tps = rows["plain"]["tokens"] / rows["plain"]["seconds"]
    for m, row in rows.items():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["speedup"] = row["tokens_per_s"] / plain_tps
        row["mean_accepted_length"] = row["tokens"] / max(row["row_steps"], 1)
        row["state_bookkeeping_share"] = row["state_bookkeeping_s"] / max(row["decode_s"], 1e-12)
        if m == "plain":
            row["identical"] = None
    return {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": max_new_tokens,
            "methods": rows}


def format_table(result: dict) -> list[str]:
    """The result as a text table, a line per method."""
    lines = [f"{'method':<22} {'tokens/s':>9} {'speedup':>8} {'accepted':>9} {'state/seq':>10} {'bookkeeping':>12}"
             f"  same as plain"]
    for m, r in result["methods"].items():
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        lines.append(f"{m:<22} {r['tokens_per_s']:9.1f} {r['speedup']:7.2f}x {r['mean_accepted_length']:9.2f} "
                     f"{r['state_bytes_per_sequence'] / 2**20:8.2f}Mi {100 * r['state_bookkeeping_share']:11.1f}%"
                     f"  {same}")
    return lines

