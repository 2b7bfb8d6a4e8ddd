"""Where a draft LM's or a parallel draft's decoding time goes, on the family's target: per drafter, the shares of
the decode loop (the engine's draft + verify + bookkeeping time, as the e2e suite's "draft share") spent in the
draft's forwards (its embedding, decoder layers, final norm and vocabulary product through the op route) and, of
those, in its decoder layers; the rest of the drafter's part is its catch-up and bookkeeping around the forward.

    python benchmarks/python/bench_draft_split.py --drafts DIR ... [--chain 4] [--rounds 3] [--json OUT]

Each drafter decodes the same held-out prompts (batch 1, greedy, EOS ignored) after a warm-up, in turns, for
``--rounds`` rounds; every share is a ratio of times measured in the same decodes. On a CPU only: the draft's forward
is timed where it runs as op calls (:class:`~specdec_ext.models.llama_step.LlamaStepOps`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from specdec_ext.bench.draft_lms import add_draft_lm_args, draft_names, draft_quant, load_draft
from specdec_ext.bench.machine import machine_info
from specdec_ext.bench.models import from_zoo
from specdec_ext.drafters import DraftModelDrafter, ParallelDraftDrafter
from specdec_ext.generate import generate
from specdec_ext.models.llama_step import LlamaStepOps


@contextlib.contextmanager
def _timed_draft_ops(drafter, spent: dict):
    """Adds to ``spent["forward"]`` / ``spent["layers"]`` the seconds of ``LlamaStepOps.run`` / ``.layers`` calls made
    on ``drafter``'s own ops (the target's calls go through the same class, untimed)."""
    run, layers = LlamaStepOps.run, LlamaStepOps.layers

    def timed(fn, key):
        def call(self, *args, **kwargs):
            if self is not drafter._ops:
                return fn(self, *args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        return call

    LlamaStepOps.run, LlamaStepOps.layers = timed(run, "forward"), timed(layers, "layers")
    try:
        yield
    finally:
        LlamaStepOps.run, LlamaStepOps.layers = run, layers


def _drafter(directory: str, chain: int, quant: str | None):
    model, parallel = load_draft(directory)
    return (ParallelDraftDrafter if parallel else DraftModelDrafter)(model, num_draft_tokens=chain, draft_quant=quant)


def _decode(target, drafter, prompts, new_tokens: int) -> dict:
    spent = {"forward": 0.0, "layers": 0.0, "loop": 0.0, "draft": 0.0, "tokens": 0, "steps": 0}
    with _timed_draft_ops(drafter, spent):
        for p in prompts:
            _, st = generate(target, drafter, torch.tensor(p), max_new_tokens=new_tokens, eos_token_id=[])
            spent["loop"] += st.draft_s + st.verify_s + st.bookkeeping_s
            spent["draft"] += st.draft_s
            spent["tokens"] += st.new_tokens
            spent["steps"] += st.steps
    return spent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_draft_lm_args(ap)
    ap.add_argument("--chain", type=int, default=4, help="draft tokens a step")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = from_zoo(args.zoo)
    prompts, note = models.prompts(args.num_prompts + 1, args.prompt_len, 0)
    names = draft_names(args.drafts)
    drafters = {n: _drafter(d, args.chain, draft_quant(args)) for n, d in zip(names, args.drafts)}
    for d in drafters.values():  # warm-up (and the ops' first shapes)
        _decode(models.target, d, prompts[-1:], 16)
    rounds: dict[str, list[dict]] = {name: [] for name in drafters}
    for _ in range(args.rounds):
        for name, d in drafters.items():
            rounds[name].append(_decode(models.target, d, prompts[:args.num_prompts], args.max_new_tokens))
    rows = []
    print(f"{'draft':28s} {'accepted':>8s} {'drafter':>8s} {'forward':>8s} {'layers':>8s}  (shares of the loop, median "
          f"of {args.rounds} rounds)")
    for name, runs in rounds.items():
        def med(key):
            return statistics.median(r[key] / r["loop"] for r in runs)
        row = {"draft": name, "directory": os.path.abspath(args.drafts[names.index(name)]),
               "kind": type(drafters[name]).__name__, "chain": args.chain,
               "accepted_per_step": statistics.median(r["tokens"] / r["steps"] for r in runs),
               "drafter_share": med("draft"), "forward_share": med("forward"), "layers_share": med("layers"),
               "rounds": runs}
        rows.append(row)
        print(f"{name:28s} {row['accepted_per_step']:8.2f} {row['drafter_share']:8.1%} {row['forward_share']:8.1%} "
              f"{row['layers_share']:8.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "prompts": note, "draft_quant": args.draft_quant,
                       "num_prompts": args.num_prompts,
                       "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
