"""EAGLE drafts for one target, side by side: each checkpoint directory decodes the same held-out prompts as an
EAGLE-2 tree, interleaved prompt by prompt with plain decoding, so that every speedup is a ratio of times measured in
one run (a training recipe's A/B: the same target, drafts trained differently).

    python benchmarks/python/bench_eagle_drafts.py --zoo DIR --drafts A B ... [--json OUT]

``--zoo DIR``: a family directory (its target and held-out prompts, as ``specdec bench --zoo``); the tree is the
library's for the device (``EagleDrafter.from_pretrained``'s default) unless ``--shape`` names one.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec_ext.bench.machine import machine_info
from specdec_ext.bench.models import from_zoo
from specdec_ext.drafters.eagle import EagleDrafter
from specdec_ext.generate import generate
from specdec_ext.models.checkpoints import resolve_eagle_dtype


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", required=True, help="family directory: the target and the held-out prompts")
    ap.add_argument("--drafts", nargs="+", required=True, help="EAGLE checkpoint directories for that target")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--shape", default=None, help="depth,top_k,total_tokens (default: the library's CPU tree)")
    ap.add_argument("--eagle-dtype", default="auto", help="the drafts' dtype (as specdec bench --eagle-dtype)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = from_zoo(args.zoo)
    prompts, how = models.prompts(args.prompts + 1, args.prompt_len)
    warm, prompts = prompts[-1], prompts[:-1]
    shape = {}  # (none given: from_pretrained takes the library's tree for the device)
    if args.shape:
        shape = dict(zip(("depth", "top_k", "total_tokens"), (int(x) for x in args.shape.split(","))))
    dtype = resolve_eagle_dtype(args.eagle_dtype, next(models.target.parameters()).dtype, "cpu")
    drafters = {d: EagleDrafter.from_pretrained(d, models.target, dtype=dtype, **shape) for d in args.drafts}
    drafters["plain"] = None
    for d in drafters.values():
        generate(models.target, d, warm, max_new_tokens=16)
    seconds = dict.fromkeys(drafters, 0.0)
    emitted = {name: [0, 0] for name in drafters}  # tokens, row-steps
    for p in prompts:  # round-robin, prompt by prompt: the machine's drift hits every method alike
        for name, d in drafters.items():
            t0 = time.perf_counter()
            _, stats = generate(models.target, d, p, max_new_tokens=args.new_tokens, eos_token_id=[])
            seconds[name] += time.perf_counter() - t0
            emitted[name][0] += stats.new_tokens
            emitted[name][1] += stats.row_steps
    plain = seconds["plain"]
    rows = [{"draft": name, "seconds": round(s, 4), "speedup": round(plain / s, 3),
             "mean_accepted_length": round(emitted[name][0] / emitted[name][1], 3)} for name, s in seconds.items()]
    first = next(iter(drafters.values()))
    shape = {"depth": first.depth, "top_k": first.top_k, "total_tokens": first.total_tokens}  # (as they decode)
    print(f"{len(prompts)} prompts ({how}), {args.new_tokens} new tokens, tree {shape}, drafts in {dtype}; "
          f"plain {len(prompts) * args.new_tokens / plain:.1f} tokens/s")
    for r in rows[:-1]:
        print(f"  {r['draft']}: x{r['speedup']:.3f}, mean accepted length {r['mean_accepted_length']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "zoo": args.zoo, "prompts": how, "new_tokens": args.new_tokens,
                       "shape": shape, "eagle_dtype": str(dtype), "threads": args.threads, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
