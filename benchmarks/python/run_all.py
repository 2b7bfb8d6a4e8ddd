"""Runs every Python benchmark in one process and writes one JSON file under benchmarks/results/.

    python benchmarks/python/run_all.py [--quick] [--device all|cpu|cuda] [--threads T] [--out PATH]

The JSON holds machine info (CPU model, cores, torch version, GPU name if any), every result (median ms, GB/s and
its byte formula) and the speedup table (ours vs the vectorised torch baseline and vs the reference). With CUDA
present it also measures the device-to-device copy bandwidth through torch (the ceiling for "% of copy bandwidth").
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import traceback

import common
import torch

BENCHES = ["build_tree", "tree_ancestor_mask", "verify_tree_greedy", "verify_tree_sampling", "verify_tree_typical",
           "sample_tokens", "expand_tree_step", "tree_attention", "compact_kv", "packed_linear", "packed_linear_int8",
           "packed_linear_int4",
           "draft_decoder_layer", "recurrent"]

GOALS = [  # (op, shape prefix, dtype, device, minimum speedup vs baseline): reported, never asserted
    ("verify_tree_greedy", "B=8,N=64,V=32000", "fp32", "cpu", 5.0),
    ("verify_tree_sampling", "B=8,N=64,V=32000", "fp32", "cpu", 5.0),
    ("sample_tokens", "R=", "fp32", "cpu", 2.0),
    ("tree_attention", "B=1,N=8,P=1024,", "bf16", "cpu", 1.5),
    ("tree_attention", "B=1,N=64,P=1024,", "bf16", "cpu", 1.5),
    ("tree_attention", "B=1,N=64,P=4096,", "bf16", "cpu", 1.5),
    ("tree_attention", "B=8,N=26,P=1024,", "bf16", "cpu", 1.5),
    ("tree_attention", "B=1,N=64,P=1024,", "fp32", "cpu", 1.5),
    ("tree_attention", "B=1,N=64,P=1024,", "fp16", "cpu", 1.5),
]


def copy_bandwidth_gbps(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy through torch, counting bytes read + written (as KINDS.md does)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = common.time_fn(lambda: dst.copy_(src), "cuda", repeats)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=["all", "cpu", "cuda"], default="all")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=0)
    p.add_argument("--only", nargs="*", default=None, help="subset of benches")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_<host>_<time>.json)")
    a = p.parse_args()
    passthrough = (["--quick"] if a.quick else []) + ["--device", a.device]
    if a.threads:
        passthrough += ["--threads", str(a.threads)]
    if a.repeats:
        passthrough += ["--repeats", str(a.repeats)]
    if a.threads:
        torch.set_num_threads(a.threads)
    info = common.machine_info()
    print("machine:", json.dumps(info), flush=True)
    out = {"machine": info, "args": vars(a), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "benches": {}, "failures": {}}
    if torch.cuda.is_available() and a.device in ("all", "cuda"):
        out["machine"]["copy_bandwidth_gbps"] = copy_bandwidth_gbps()
        print(f"device-to-device copy bandwidth: {out['machine']['copy_bandwidth_gbps']:.1f} GB/s", flush=True)
    path = a.out or os.path.join(common.ROOT, "benchmarks", "results",
                                 f"bench_{os.uname().nodename}_{datetime.datetime.now():%Y%m%d_%H%M%S}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def save():
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    for name in a.only or BENCHES:
        save()  # partial results survive a time limit
        print(f"\n######## {name}", flush=True)
        try:
            mod = importlib.import_module(f"bench_{name}")
            out["benches"][name] = mod.main(passthrough)
        except Exception:  # noqa: BLE001  (one failing bench must not hide the others)
            out["failures"][name] = traceback.format_exc()
            print(out["failures"][name], file=sys.stderr, flush=True)
    # Goals and % of copy bandwidth.
    ratios = [r for b in out["benches"].values() for r in b.get("ratios", [])]
    out["goals"] = []
    for op, shape, dtype, dev, want in GOALS:
        for r in ratios:
            if r["op"] == op and r["shape"].startswith(shape) and r["dtype"] == dtype and r["device"] == dev \
                    and "speedup_vs_baseline" in r:
                out["goals"].append({"op": op, "shape": r["shape"], "device": dev, "goal_x": want,
                                     "measured_x": r["speedup_vs_baseline"],
                                     "met": r["speedup_vs_baseline"] >= want})
    bw = out["machine"].get("copy_bandwidth_gbps")
    if bw:
        for b in out["benches"].values():
            for r in b.get("results", []):
                if r["device"] == "cuda":
                    r["pct_of_copy_bandwidth"] = 100.0 * r["gbps"] / bw
    print("\n== goals (reported, not asserted)")
    for g in out["goals"]:
        print(f"  {g['op']:<22} {g['shape']:<34} {g['device']}: {g['measured_x']:.2f}x vs baseline "
              f"(goal >= {g['goal_x']}x) {'MET' if g['met'] else 'NOT MET'}")
    if bw:
        print(f"\n== CUDA kernels, % of device copy bandwidth ({bw:.0f} GB/s)")
        for b in out["benches"].values():
            for r in b.get("results", []):
                if r["device"] == "cuda" and r["impl"] == "ours":
                    print(f"  {r['op']:<22} {r['shape']:<34} {r['dtype']:<5} {r['median_ms']:9.4f} ms "
                          f"{r['gbps']:8.1f} GB/s  {r['pct_of_copy_bandwidth']:5.1f}%")
    save()
    print(f"\nwrote {path}")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
