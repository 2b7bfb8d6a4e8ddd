"""Where a decoding step's time goes: target forwards, draft-network forwards, and everything else (verification
ops, cache compaction, tree building, sampling, the loop's bookkeeping) — per drafter, on the model family.

Issue 4 asks that everything outside the target and draft forwards stay under 15% of step time. Forward times are
taken by module hooks (host wall time inside the outermost hooked module: the target, the draft network, and the
target's lm_head / embeddings when a drafter calls them itself; an EAGLE draft's forwards are its op calls,
``EagleStepOps.forward``, and the draft LM's, ``LlamaStepOps.forward`` and its ``forward``, are timed directly, since
hooks on their modules would switch them to the module path); the decode loop's time runs from the end of the
prefill and the drafter's begin() to the end of generate(). CPU only (on an asynchronous device host times do not
bound device work).

    python benchmarks/python/bench_step_overhead.py [--threads 1] [--prompts 4] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.eagle_step import EagleStepOps  # noqa: E402
from specdec_ext.models.llama_step import LlamaStepOps  # noqa: E402
from specdec_ext.zoo import load_family  # noqa: E402


class ForwardClock:
    """Accumulates host time spent inside hooked modules, per category, outermost call only."""

    def __init__(self):
        self.seconds = {"target": 0.0, "draft": 0.0}
        self.depth = 0
        self.start = 0.0
        self.category = None
        self.active = False
        self.handles = []

    def _enter(self, category: str) -> None:
        if self.depth == 0:
            self.start, self.category = time.perf_counter(), category
        self.depth += 1

    def _exit(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self.active:
            self.seconds[self.category] += time.perf_counter() - self.start

    def hook(self, module, category: str):
        self.handles += [module.register_forward_pre_hook(lambda *a: self._enter(category)),
                         module.register_forward_hook(lambda *a: self._exit())]

    def wrap(self, fn, category: str):
        """``fn`` timed as ``category`` (a network product a drafter computes without calling a module)."""
        def timed(*args, **kwargs):
            self._enter(category)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit()
        return timed

    def remove(self):
        for h in self.handles:
            h.remove()


def measure(fam, name: str, prompts, max_new_tokens: int) -> dict:
    totals = {"loop": 0.0, "target": 0.0, "draft": 0.0, "tokens": 0, "steps": 0}
    for p in prompts:
        clock = ForwardClock()
        clock.hook(fam.target, "target")
        drafter = None if name == "plain" else fam.make_drafter(name)
        nets = {"medusa": [fam.medusa_heads]}.get(name, [])
        ops_forward = EagleStepOps.forward, LlamaStepOps.forward
        if name in ("eagle1", "eagle2", "eagle3"):
            # EAGLE drafters run their network as op calls (EagleStepOps), which hooks on its modules would turn
            # off: time those calls instead (a fallback to the modules happens inside them)
            EagleStepOps.forward = clock.wrap(ops_forward[0], "draft")
        if name == "draft-model":  # the same for the draft LM (LlamaStepOps), plus its Hugging Face forwards (the
            LlamaStepOps.forward = clock.wrap(ops_forward[1], "draft")  # prompt's, trees), timed by a wrapper too
            drafter.model.forward = clock.wrap(drafter.model.forward, "draft")
        for net in nets:  # the network and its direct children (drafters call some of them, e.g. lm_head, alone),
            rotary = getattr(net, "rotary", None)  # and EAGLE's RoPE tables (a drafter computes a tree's at once)
            for mod in [net, *net.children(), *([rotary] if rotary is not None else [])]:
                clock.hook(mod, "draft")
        for mod in (fam.target.get_output_embeddings(), fam.target.get_input_embeddings()):
            clock.hook(mod, "draft")  # when a drafter calls them itself; inside the target's forward: target time
        if hasattr(drafter, "_logits"):  # EAGLE's vocabulary projection (over a draft vocabulary: no module call)
            drafter._logits = clock.wrap(drafter._logits, "draft")
        loop_start = [None]

        def arm():
            loop_start[0] = time.perf_counter()
            clock.active = True
        if drafter is None:  # plain: the prefill is the first target forward; the loop starts at its end
            def after_prefill(*a):
                handle.remove()
                arm()
            handle = fam.target.register_forward_hook(after_prefill)
        else:  # the loop starts when the drafter's begin() (after the prefill) returns
            begin = drafter.begin

            def begin_then_arm(*a, **k):
                begin(*a, **k)
                arm()
            drafter.begin = begin_then_arm
        try:
            out, stats = generate(fam.target, drafter, torch.tensor(p), max_new_tokens=max_new_tokens,
                                  eos_token_id=[])
        finally:
            EagleStepOps.forward, LlamaStepOps.forward = ops_forward
            if name == "draft-model":
                del drafter.model.forward
        end = time.perf_counter()
        clock.remove()
        totals["loop"] += end - loop_start[0]
        totals["target"] += clock.seconds["target"]
        totals["draft"] += clock.seconds["draft"]
        totals["tokens"] += stats.new_tokens
        totals["steps"] += stats.steps
    other = totals["loop"] - totals["target"] - totals["draft"]
    return {"method": name, "steps": totals["steps"], "tokens": totals["tokens"],
            "ms_per_step": 1e3 * totals["loop"] / totals["steps"],
            "target_forward_pct": 100 * totals["target"] / totals["loop"],
            "draft_forward_pct": 100 * totals["draft"] / totals["loop"],
            "outside_forwards_pct": 100 * other / totals["loop"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--eagle-dtype", default="auto", help="EAGLE drafts' dtype (auto, float32, bfloat16; as the "
                                                         "e2e bench)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results", "step_overhead_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    fam = load_family(args.family, eagle_dtype=args.eagle_dtype)
    prompts = fam.card["evaluation"]["prompt_ids"][: args.prompts]
    rows = [measure(fam, name, prompts, args.max_new_tokens) for name in ("plain",) + fam.drafter_names]
    print(f"{'method':<12} {'ms/step':>8} {'target fwd':>11} {'draft fwd':>10} {'outside forwards':>17}")
    for r in rows:
        print(f"{r['method']:<12} {r['ms_per_step']:8.2f} {r['target_forward_pct']:10.1f}% "
              f"{r['draft_forward_pct']:9.1f}% {r['outside_forwards_pct']:16.1f}%")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                               "torch": torch.__version__},
                   "eagle_dtype": str(fam.eagle1.fc.weight.dtype).replace("torch.", ""),
                   "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
