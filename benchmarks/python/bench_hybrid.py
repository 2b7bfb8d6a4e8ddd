"""The hybrid benchmark (specdec_ext.bench.hybrid) on a hybrid family: plain decoding; chains with vLLM's
per-position state snapshots, with llama.cpp's checkpoint + replay, and with this library's cache; this library's
EAGLE-2 trees. All in one run, methods taking turns prompt by prompt; greedy, batch 1.

    python benchmarks/python/bench_hybrid.py [--zoo DIR] [--json OUT]

``--zoo DIR``: a family with a hybrid target (default: the shipped hybrid family, ``specdec zoo build --spec
hybrid``). The context sweep on the same family is ``specdec bench --zoo DIR --suite context``.
"""

from __future__ import annotations

import argparse
import json

import torch

from specdec_ext.bench.hybrid import format_table, hybrid_methods, run_hybrid_bench
from specdec_ext.bench.machine import machine_info
from specdec_ext.models.hybrid_cache import linear_layer_kinds
from specdec_ext.zoo import load_family
from specdec_ext.zoo.evaluate import heldout_prompts
from specdec_ext.zoo.family import SHIPPED_HYBRID_DIR


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default=SHIPPED_HYBRID_DIR, help="family directory with a hybrid target")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--chain-drafters", default="eagle1,draft-model",
                    help="comma-separated drafters whose chains every way of keeping the states verifies")
    ap.add_argument("--tree-drafters", default="eagle2", help="comma-separated drafters verified as trees (ours)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if min(args.prompts, args.prompt_len, args.new_tokens) < 1:
        ap.error("--prompts, --prompt-len and --new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    family = load_family(args.zoo)
    if not linear_layer_kinds(family.target.config):
        ap.error(f"--zoo {args.zoo}: the target has no linear-attention layers (not a hybrid family)")
    prompts = heldout_prompts(family.tokenizer, args.prompts, args.prompt_len)
    methods = hybrid_methods(tuple(filter(None, args.chain_drafters.split(","))),
                             tuple(filter(None, args.tree_drafters.split(","))))
    result = run_hybrid_bench(family, prompts, args.new_tokens, methods)
    print(f"{len(prompts)} held-out prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, "
          f"batch 1, {args.threads} thread(s)")
    print("\n".join(format_table(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "zoo": args.zoo, "threads": args.threads, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
