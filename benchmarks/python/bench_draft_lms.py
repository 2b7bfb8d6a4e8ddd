"""Draft LMs and parallel drafts (PARD) for one target, side by side: the family's own and any trained ones (a
training recipe's A/B), each decoding the same held-out prompts as a chain, with plain decoding, in the e2e suite's
round-robin (``specdec bench --suite e2e``: every speedup a ratio of times measured in one run), repeated
``--rounds`` times.

    python benchmarks/python/bench_draft_lms.py --drafts DIR ... [--chains 4 6] [--rounds 3] [--json OUT]

A directory whose ``config.json`` records a ``pard_token`` drafts in parallel (one forward a step, a chain of each
``--chains`` length); any other is a draft LM (a chain of 4, the family's CPU shape). ``--zoo DIR``: the family
(default the shipped one): its target, held-out prompts, and its own ``draft-model`` and ``parallel-draft``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from specdec_ext.bench.e2e import E2EConfig, run_e2e, with_drafter
from specdec_ext.bench.machine import machine_info
from specdec_ext.bench.models import from_zoo
from specdec_ext.bench.draft_lms import add_draft_lm_args, draft_names, draft_quant, load_draft
from specdec_ext.drafters import DraftModelDrafter, ParallelDraftDrafter


def _drafters(directory: str, name: str, chains: list[int], quant: str | None) -> dict:
    """``{method name: maker}`` for one directory: a draft LM's chain of 4, or a parallel draft's chains."""
    model, parallel = load_draft(directory)
    if not parallel:
        return {f"draft-model:{name}": lambda: DraftModelDrafter(model, num_draft_tokens=4, draft_quant=quant)}
    return {f"parallel-draft:{name}:{k}": (lambda k=k: ParallelDraftDrafter(model, num_draft_tokens=k,
                                                                            draft_quant=quant))
            for k in chains}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_draft_lm_args(ap)
    ap.add_argument("--chains", type=int, nargs="+", default=[4], help="chain lengths of the parallel drafts")
    ap.add_argument("--temperatures", default="0,1")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = from_zoo(args.zoo)
    methods = ["plain", "draft-model", "parallel-draft"]
    for d, draft in zip(args.drafts, draft_names(args.drafts)):
        for name, make in _drafters(d, draft, args.chains, draft_quant(args)).items():
            models = with_drafter(models, name, make, {name: os.path.abspath(d)})
            methods.append(name)
    cfg = E2EConfig(methods=methods, hf=False, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                    max_new_tokens=args.max_new_tokens,
                    temperatures=tuple(float(t) for t in args.temperatures.split(",")))
    runs = [run_e2e(models, cfg) for _ in range(args.rounds)]
    table = []
    for T in cfg.temperatures:
        for m in methods:
            rows = [r for run in runs for r in run["runs"] if r["method"] == m and r["temperature"] == T]
            table.append({"method": m, "temperature": T,
                          "speedups": [r["speedup"] for r in rows],
                          "median_speedup": statistics.median(r["speedup"] for r in rows),
                          "mean_accepted_length": rows[0]["mean_accepted_length"],
                          "draft_share": [r.get("draft_share") for r in rows]})
    print(f"{'method':44s} {'T':>4s}  median speedup (rounds)  accepted  draft share")
    for r in table:
        shares = [s for s in r["draft_share"] if s is not None]
        print(f"{r['method']:44s} {r['temperature']:4.1f}  {r['median_speedup']:.2f}x "
              f"({', '.join(f'{s:.2f}' for s in r['speedups'])})  {r['mean_accepted_length']:.2f}  "
              f"{statistics.median(shares) if shares else float('nan'):.1%}")
    greedy = [c for run in runs for c in run["greedy_checks"]]
    print(f"greedy outputs: {sum(c['equal'] for c in greedy)} of {len(greedy)} comparisons identical")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "drafts": args.drafts, "draft_quant": args.draft_quant,
                       "chains": args.chains, "rounds": args.rounds, "table": table, "runs": runs}, f, indent=1)
    return 0 if all(c["equal"] for c in greedy) else 1


if __name__ == "__main__":
    raise SystemExit(main())
