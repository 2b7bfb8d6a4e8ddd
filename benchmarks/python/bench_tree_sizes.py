"""How far a drafter's speedup can go on this machine: the e2e measurement over a range of draft sizes, each with its
verification-bound speedup (the speedup if drafting and bookkeeping cost nothing; ``specdec_ext.bench.e2e``).

A bigger tree accepts more tokens per step but costs the target more per verification; the bound is where those two
alone leave the speedup, whatever the drafter's own cost. When the bound stays under a goal at every size, no
faster drafting reaches the goal with this drafter's acceptance: better acceptance (a better-trained drafter) or a
cheaper verification (another machine, another dtype) is needed.

    python benchmarks/python/bench_tree_sizes.py --drafter medusa --sizes 4,6,8,10,12,16 [--dtype bfloat16]

Sizes are the drafter's own size argument: ``max_nodes`` (Medusa per-step trees, root included), ``total_tokens``
(EAGLE-2/3 trees: draft tokens, with the family's depth and top-k), ``num_draft_tokens`` (draft-model,
parallel-draft and early-exit chains),
``num_pred_tokens`` (n-gram). One
run, every size round-robin over the prompts with plain decoding (the same protocol as ``specdec bench --suite e2e``,
greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from specdec_ext.bench.e2e import measure, summarise  # noqa: E402
from specdec_ext.bench.machine import machine_info  # noqa: E402
from specdec_ext.bench.models import from_zoo  # noqa: E402

SIZE_ARGUMENT = {"medusa": "max_nodes", "eagle2": "total_tokens", "eagle3": "total_tokens",
                 "draft-model": "num_draft_tokens", "parallel-draft": "num_draft_tokens", "ngram": "num_pred_tokens",
                 "early-exit": "num_draft_tokens"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", choices=sorted(SIZE_ARGUMENT), default="medusa")
    ap.add_argument("--sizes", default="4,6,8,10,12,16", help="comma-separated draft sizes (see the module doc)")
    ap.add_argument("--size-argument", default=None,
                    help="the drafter's argument the sizes set (default: the drafter's own, see the module doc)")
    ap.add_argument("--fixed", default="{}", metavar="JSON",
                    help="other drafter arguments, the same for every size, e.g. '{\"tree_width\": 2, "
                         "\"num_draft_tokens\": 8}' with --drafter parallel-draft --size-argument total_tokens")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/tree_sizes_<drafter>_"
                                                "<dtype>.json)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes must be integers >= 1, got {args.sizes!r}")
    torch.set_num_threads(args.threads)
    models = from_zoo(dtype=getattr(torch, args.dtype), eagle_dtype="auto")
    family_drafter = models.make_drafter
    key = args.size_argument or SIZE_ARGUMENT[args.drafter]
    try:
        fixed = json.loads(args.fixed)
    except json.JSONDecodeError as err:
        ap.error(f"--fixed must be a JSON object of drafter arguments: {err}")
    if not isinstance(fixed, dict):
        ap.error(f"--fixed must be a JSON object of drafter arguments, got {args.fixed!r}")
    names = {f"{args.drafter}@{n}": n for n in sizes}
    models.make_drafter = lambda name: family_drafter(args.drafter, **{**fixed, key: names[name]})
    prompts, how = models.prompts(args.num_prompts, args.prompt_len)
    accs, _ = measure(models, ["plain", *names], prompts, 0.0, args.max_new_tokens, memory=False)
    rows = summarise(accs, 0.0)
    print(f"{args.drafter} ({key}; {fixed or 'the family shape otherwise'}), {args.dtype}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens ({how})")
    print(f"{'size':>5} {'speedup':>8} {'mean accepted':>14} {'bound':>7} {'step ms':>8} {'draft share':>12}")
    for r in rows:
        if r["method"] in names:
            print(f"{names[r['method']]:5d} {r['speedup']:7.2f}x {r['mean_accepted_length']:14.2f} "
                  f"{r['verification_bound_speedup']:6.2f}x {r['step_ms']:8.2f} {r['draft_share']:11.1%}")
    out = args.out or os.path.join(os.path.dirname(HERE), "results", f"tree_sizes_{args.drafter}_{args.dtype}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": {**machine_info(), "torch_threads": args.threads}, "drafter": args.drafter,
                   "size_argument": key, "fixed": fixed,
                   "dtype": args.dtype, "prompts": {"count": len(prompts), "length": args.prompt_len, "source": how},
                   "max_new_tokens": args.max_new_tokens, "command": " ".join(sys.argv),
                   "rows": [dict(r, size=names.get(r["method"])) for r in rows]}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
