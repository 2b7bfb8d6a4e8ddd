"""Does a drafter kept across requests keep its speed? One drafter object serves many requests (the shipped family).

A server keeps one drafter and hands it request after request (the EAGLE and dynamic-tree drafters keep their score
calibration across generations on purpose). Each request here is one greedy generation of a held-out prompt (the
prompts taken in turn); plain decoding runs the same request right before it, as the control, so a machine that
slows down slows both. Per request: the drafter's speedup over plain decoding, its mean accepted length and its
state (the calibrated score scale where it has one). Printed per drafter: the mean speedup over the first and over
the last ``--window`` requests and their ratio (1.0 = no drift), the same for the two halves, the accepted length's
ratio (timing-free) and how much plain decoding's own time moved (the machine's load); the JSON has every request.

    python benchmarks/python/bench_drafter_reuse.py                           # eagle2, 100 requests
    python benchmarks/python/bench_drafter_reuse.py --perturb 0.5             # a target the drafter never saw
    python benchmarks/python/bench_drafter_reuse.py --set depth=8 --set top_k=10 --set total_tokens=60
    python benchmarks/python/bench_drafter_reuse.py --drafters eagle2,eagle3,medusa,draft-model,ngram,eagle1 \
        --requests 100 --json benchmarks/results/drafter_reuse_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import common  # noqa: F401  (sets sys.path)
import torch

from specdec_ext.bench.machine import machine_info
from specdec_ext.generate import generate
from specdec_ext.zoo import load_family
from specdec_ext.zoo.evaluate import heldout_prompts


def _tensor_elements(obj, depth: int = 2) -> int:
    """Elements of the tensors an object holds (its attributes, lists and dicts of them, ``depth`` levels down)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if depth == 0:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_elements(x, depth - 1) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_elements(x, depth - 1) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        return sum(_tensor_elements(x, depth - 1) for x in vars(obj).values())
    return 0


def drafter_state(drafter) -> dict:
    """What a drafter carries from one request to the next that could change its speed: its calibrated score scale
    (where it has one) and the elements of every tensor it holds (caches, features, constants), models excluded."""
    out = {"tensor_elements": _tensor_elements(drafter, depth=3)}
    calibration = getattr(drafter, "calibration", None)
    if calibration is not None and getattr(calibration, "log_scale", None) is not None:
        out["score_scale"] = float(calibration.log_scale.exp())
    return out


def timed(family, drafter, prompt, max_new_tokens):
    t0 = time.perf_counter()
    out, stats = generate(family.target, drafter, torch.tensor(prompt), max_new_tokens=max_new_tokens,
                          eos_token_id=[])
    return out.tolist(), time.perf_counter() - t0, stats


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafters", default="eagle2", help="comma-separated family drafter names")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--window", type=int, default=10, help="requests averaged at the start and at the end")
    p.add_argument("--prompts", type=int, default=8, help="distinct held-out prompts, taken in turn")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the quietest comparison)")
    p.add_argument("--perturb", type=float, default=0.0, metavar="SIGMA",
                   help="a target the drafters never saw: every weight matrix of the target times (1 + SIGMA * "
                        "N(0, 1)) noise (seeded), so drafts are accepted less often")
    p.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                   help="override a drafter argument (repeatable), e.g. --set depth=8 --set top_k=10 --set "
                        "total_tokens=60 for EagleDrafter's library defaults")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        args.set = dict((k, int(v)) for k, v in (item.split("=", 1) for item in args.set))
    except ValueError:
        p.error(f"--set takes KEY=INT, got {args.set}")
    if args.requests < 2 * args.window or args.window < 1:
        p.error("--requests must be at least twice --window (>= 1)")
    args.drafters = args.drafters.split(",")
    return args


def drift(rows: list[dict], window: int) -> dict:
    """Speed and acceptance at the start against the end. The accepted length is free of timing noise: a drafter that
    degrades across requests accepts less. ``plain_time_spread`` (slowest over fastest window of plain decoding,
    the same work every time) says how much the machine's load moved the timings meanwhile."""
    def mean(key, part):
        return statistics.mean(r[key] for r in part)
    half = len(rows) // 2
    plain = [mean("plain_s", rows[i:i + window]) for i in range(0, len(rows) - window + 1, window)]
    return {"first_window_speedup": mean("speedup", rows[:window]),
            "last_window_speedup": mean("speedup", rows[-window:]),
            "last_over_first": mean("speedup", rows[-window:]) / mean("speedup", rows[:window]),
            "second_half_over_first": mean("speedup", rows[half:]) / mean("speedup", rows[:half]),
            "accepted_last_over_first": mean("mean_accepted_length", rows[-window:])
            / mean("mean_accepted_length", rows[:window]),
            "plain_time_spread": max(plain) / min(plain)}


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    family = load_family(dtype=getattr(torch, args.dtype))
    if args.perturb:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for w in family.target.parameters():
                if w.dim() == 2:
                    w.mul_(1 + args.perturb * torch.randn(w.shape, generator=g).to(w.dtype))
    prompts = heldout_prompts(family.tokenizer, args.prompts, args.prompt_tokens)
    unknown = [d for d in args.drafters if d not in family.drafter_names]
    if unknown:
        raise SystemExit(f"unknown drafter {unknown[0]!r}; the family has {', '.join(family.drafter_names)}")
    timed(family, None, prompts[0][:16], 8)  # warm-up (packed weights, first calls)
    results, identical = {}, True
    for name in args.drafters:
        drafter = family.make_drafter(name, **args.set)  # one object for every request
        timed(family, drafter, prompts[0][:16], 8)
        rows = []
        for i in range(args.requests):
            prompt = prompts[i % len(prompts)]
            ref, t_plain, _ = timed(family, None, prompt, args.max_new_tokens)
            out, t_draft, stats = timed(family, drafter, prompt, args.max_new_tokens)
            identical &= out == ref
            rows.append({"request": i, "plain_s": t_plain, "drafter_s": t_draft, "speedup": t_plain / t_draft,
                         "mean_accepted_length": stats.mean_accepted_length, **drafter_state(drafter)})
            if (i + 1) % args.window == 0:
                last = rows[-args.window:]
                print(f"{name:<12} requests {i + 2 - args.window:>3}-{i + 1:<3} speedup "
                      f"{statistics.mean(r['speedup'] for r in last):.3f}x, accepted "
                      f"{statistics.mean(r['mean_accepted_length'] for r in last):.2f}"
                      + (f", score scale {last[-1]['score_scale']:.3f}" if "score_scale" in last[-1] else ""),
                      flush=True)
        results[name] = {**drift(rows, args.window), "requests": rows}
    print(f"\n{'drafter':<12} {'first ' + str(args.window):>10} {'last ' + str(args.window):>10} {'last/first':>11} "
          f"{'halves':>7} {'accepted last/first':>20} {'plain-time spread':>18}")
    for name, r in results.items():
        print(f"{name:<12} {r['first_window_speedup']:9.3f}x {r['last_window_speedup']:9.3f}x "
              f"{r['last_over_first']:10.3f} {r['second_half_over_first']:7.3f} {r['accepted_last_over_first']:20.3f} "
              f"{r['plain_time_spread']:17.2f}x")
    print(f"same tokens as plain decoding: {'yes' if identical else 'NO'}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"bench": "drafter_reuse", "machine": machine_info(),
                       "settings": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}, f,
                      indent=1)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
