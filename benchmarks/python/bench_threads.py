"""Decoding speed against torch's thread count, on an idle machine and beside a busy process (the shipped family).

Why: with more than one thread every parallel region waits for all its threads, and beside a busy process a thread
is often descheduled (OpenMP's workers spin between regions, so the scheduler shares a core between one of them and
the busy process): a region can then wait for a whole time slice. Decoding runs thousands of small regions a
second, so a thread count that helps an idle machine a little can make a busy one many times slower.

One run measures every (competitor, threads, method) cell in turns: per round, idle then busy (a
``python -c 'while True: pass'`` process started for that phase), within each phase the thread counts in turn and
within each count every method on every prompt. Ratios are formed round by round and their median printed:
threads T / the first count (the same phase) and busy / idle (the same count). Greedy decoding; every method's
tokens are checked against plain decoding.

    python benchmarks/python/bench_threads.py                                  # 1 and 2 threads, idle and busy
    python benchmarks/python/bench_threads.py --threads 1,2 --methods plain,eagle2 --rounds 3 --json out.json
    python benchmarks/python/bench_threads.py --phases idle --threads 2        # one cell (e.g. to time a process)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import common  # noqa: F401  (sets sys.path)
import torch

from specdec_ext.bench.machine import machine_info
from specdec_ext.generate import generate
from specdec_ext.zoo import load_family
from specdec_ext.zoo.evaluate import heldout_prompts

# a busy loop that ends when this benchmark does (even killed: its parent changes)
BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"


def cpu_description() -> dict:
    """lscpu's model name, core counts and the vector extensions the kernels dispatch on."""
    out = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "Core(s) per socket", "Thread(s) per core", "Socket(s)"):
            out[key.strip()] = value.strip()
        if key.strip() == "Flags":
            flags = set(value.split())
            out["vector"] = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return out


class Competitor:
    """A busy process for the duration of a ``with`` block (none when ``busy`` is false)."""

    def __init__(self, busy: bool):
        self.busy, self.proc = busy, None

    def __enter__(self):
        if self.busy:
            self.proc = subprocess.Popen([sys.executable, "-c", BUSY])
            time.sleep(0.3)  # (let it reach its loop before timing)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def run_method(family, method: str, prompts, max_new_tokens: int):
    """(tokens, seconds, outputs) of one method over the prompts (a fresh drafter per prompt, as a user would)."""
    tokens, seconds, outputs = 0, 0.0, []
    for p in prompts:
        drafter = None if method == "plain" else family.make_drafter(method)
        t0 = time.perf_counter()
        out, stats = generate(family.target, drafter, torch.tensor(p), max_new_tokens=max_new_tokens,
                              eos_token_id=[])
        seconds += time.perf_counter() - t0
        tokens += stats.new_tokens
        outputs.append(out.tolist())
    return tokens, seconds, outputs


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--phases", default="idle,busy", help="idle, busy or both (busy: beside a busy process)")
    p.add_argument("--methods", default="plain,ngram,draft-model,eagle2", help="plain and family drafter names")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        p.error(f"--threads: comma-separated integers, got {args.threads!r}")
    args.phases = args.phases.split(",")
    args.methods = args.methods.split(",")
    if any(t < 1 for t in args.threads) or not set(args.phases) <= {"idle", "busy"} or args.rounds < 1:
        p.error("--threads >= 1, --phases from idle,busy, --rounds >= 1")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    family = load_family(dtype=getattr(torch, args.dtype))
    prompts = heldout_prompts(family.tokenizer, args.prompts, args.prompt_tokens)
    for m in args.methods:  # warm-up: packed weights, caches, first-call costs
        run_method(family, m, [prompts[0][:16]], 8)
    cells: dict = {}  # (phase, threads, method) -> [tokens/s per round]
    loads: dict = {}  # phase -> [1-minute load average at its start, per round] (other work on the machine)
    reference, same = {}, {m: True for m in args.methods}
    for r in range(args.rounds):
        for phase in args.phases:
            loads.setdefault(phase, []).append(os.getloadavg()[0])
            with Competitor(phase == "busy"):
                for t in args.threads:
                    torch.set_num_threads(t)
                    for m in args.methods:
                        tokens, seconds, outs = run_method(family, m, prompts, args.max_new_tokens)
                        cells.setdefault((phase, t, m), []).append(tokens / seconds)
                        if m == "plain":
                            reference.setdefault("plain", outs)
                        elif "plain" in reference:
                            same[m] &= outs == reference["plain"]
            print(f"round {r + 1}/{args.rounds} {phase}: " + ", ".join(
                f"{m}@{t} {cells[(phase, t, m)][-1]:.1f}" for t in args.threads for m in args.methods), flush=True)

    def ratio(a, b):  # median over rounds of the per-round ratio
        return statistics.median(x / y for x, y in zip(cells[a], cells[b]))

    rows = []
    print(f"\n{'phase':<5} {'threads':>7} {'method':<12} {'tokens/s':>9} {'vs plain':>9} "
          f"{'vs ' + str(args.threads[0]) + ' thr':>9} {'busy/idle':>9}")
    for phase in args.phases:
        for t in args.threads:
            for m in args.methods:
                row = {"phase": phase, "threads": t, "method": m,
                       "tokens_per_s": statistics.median(cells[(phase, t, m)]),
                       "per_round": cells[(phase, t, m)],
                       "speedup_vs_plain": ratio((phase, t, m), (phase, t, "plain")) if "plain" in args.methods
                       else None,
                       "vs_first_threads": ratio((phase, t, m), (phase, args.threads[0], m)),
                       "busy_vs_idle": ratio(("busy", t, m), ("idle", t, m))
                       if phase == "busy" and "idle" in args.phases else None}
                rows.append(row)
                fmt = lambda v: f"{v:9.2f}" if v is not None else f"{'-':>9}"  # noqa: E731
                print(f"{phase:<5} {t:>7} {m:<12} {row['tokens_per_s']:9.1f} {fmt(row['speedup_vs_plain'])} "
                      f"{fmt(row['vs_first_threads'])} {fmt(row['busy_vs_idle'])}")
    print("1-minute load average at each phase's start: " + ", ".join(
        f"{phase} {' '.join(f'{x:.1f}' for x in xs)}" for phase, xs in loads.items()))
    print("same tokens as plain: " + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in same.items()
                                               if m != "plain"))
    if args.json:
        out = {"bench": "threads", "machine": {**machine_info(), "lscpu": cpu_description()},
               "settings": {k: v for k, v in vars(args).items() if k != "json"}, "load_1min": loads, "results": rows,
               "same_tokens_as_plain": same}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
