"""What a request joining a running batch costs: its prefill alone (the engine's way) against its prompt chunked
into the decoding rows' forwards (vLLM's and SGLang's chunked prefill), on the model family's target.

The engine's step forwards B decoding rows of N tree nodes each (``[B, N]``). A joining prompt of P tokens either

* **alone**: one forward of ``[1, P - 1]`` before the step (its last token is the step's root), or
* **chunked by C**: rides along as an extra row of C prompt tokens in ``ceil((P - 1) / C)`` steps; the batch's
  forward then is ``[B + 1, max(N, C)]`` (this library's forwards take one node count for every row, so the
  decoding rows are padded when C > N), and the request's first token comes that many steps later.

The extra cost of a join is ``t_prefill(P - 1)`` alone and ``steps * (t_step(B + 1, max(N, C)) - t_step(B, N))``
chunked; both are timed here side by side (median of interleaved repeats), for the decoding rows' EAGLE-2 tree
size of the family, several batch sizes and prompt lengths. With one thread (the default) the clock is the
thread's CPU time, which other processes on a shared machine do not disturb; with more, wall time.

    python benchmarks/python/bench_join.py [--threads 1] [--repeats 15] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from specdec_ext.bench.machine import machine_info, machine_tag  # noqa: E402
from specdec_ext.models import TreeKVCache, tree_forward, use_tree_attention  # noqa: E402
from specdec_ext.models.fast_linear import pack_linears_where_fast, packed_linears  # noqa: E402
from specdec_ext.models.tree_forward import extend_kernel_max_tokens  # noqa: E402
from specdec_ext.zoo import load_family  # noqa: E402

CONTEXT = 96  # tokens each decoding row already holds (a mid-generation row)


class Forwards:
    """Times ``[rows, nodes]`` chain forwards of the target over rows that hold ``CONTEXT`` tokens."""

    def __init__(self, target, max_nodes: int, clock):
        self.target, self.clock = target, clock
        self.vocab = target.config.vocab_size
        self.caches = {}
        self.max_len = CONTEXT + max_nodes + 1

    def _cache(self, rows: int) -> TreeKVCache:
        if rows not in self.caches:
            p = next(self.target.parameters())
            self.caches[rows] = TreeKVCache(self.target.config, rows, self.max_len, dtype=p.dtype, device=p.device)
        return self.caches[rows]

    def step(self, rows: int, nodes: int, prefix: int = CONTEXT) -> float:
        tokens = torch.randint(0, self.vocab, (rows, nodes))
        cache = self._cache(rows)
        use_kernel = False if nodes > extend_kernel_max_tokens(tokens.device) else None
        t0 = self.clock()
        tree_forward(self.target, cache, tokens, None, prefix, validate=False, use_kernel=use_kernel)
        return self.clock() - t0


def measure(fw: Forwards, batch: int, nodes: int, prompt: int, chunks: list[int], repeats: int) -> dict:
    """Median times of every forward the two ways need, interleaved repeat by repeat."""
    shapes = {("step", batch, nodes), ("prefill", 1, prompt - 1)}
    for c in chunks:
        shapes.add(("step", batch + 1, max(nodes, c)))
    times = {s: [] for s in shapes}
    for _ in range(repeats):
        for s in sorted(shapes):
            kind, rows, n = s
            times[s].append(fw.step(rows, n, CONTEXT if kind == "step" else 0))
    med = {s: statistics.median(v) for s, v in times.items()}
    base = med[("step", batch, nodes)]
    out = {"batch": batch, "nodes": nodes, "prompt": prompt, "step_ms": 1e3 * base,
           "alone_ms": 1e3 * med[("prefill", 1, prompt - 1)], "chunked": []}
    for c in chunks:
        steps = math.ceil((prompt - 1) / c)
        extra = med[("step", batch + 1, max(nodes, c))] - base
        out["chunked"].append({"chunk": c, "steps_to_first_token": steps, "per_step_extra_ms": 1e3 * extra,
                               "total_extra_ms": 1e3 * steps * extra})
    best = min(out["chunked"], key=lambda r: r["total_extra_ms"])
    out["best_chunk"] = best["chunk"]
    out["chunked_over_alone"] = best["total_extra_ms"] / out["alone_ms"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prompts", default="32,64,128")
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    p.add_argument("--note", default="", help="what else ran on the machine, when (stored in the JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    fam = load_family()
    target = fam.target
    use_tree_attention(target)
    pack_linears_where_fast(target)
    nodes = int(fam.drafter_kwargs("eagle2").get("total_tokens", 16))
    batches = [int(x) for x in args.batches.split(",")]
    prompts = [int(x) for x in args.prompts.split(",")]
    chunks = sorted({nodes, 2 * nodes, 4 * nodes})
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    fw = Forwards(target, max(prompts + [4 * nodes]), clock)
    rows = []
    with torch.no_grad(), packed_linears(True):
        for _ in range(3):  # warm-up: first-shape costs
            for b in batches:
                fw.step(b, nodes)
        for b in batches:
            for P in prompts:
                r = measure(fw, b, nodes, P, [c for c in chunks if c <= max(P - 1, nodes)], args.repeats)
                rows.append(r)
                best = min(r["chunked"], key=lambda x: x["total_extra_ms"])
                print(f"B={b:2d} N={nodes} P={P:4d}: step {r['step_ms']:6.2f} ms | alone +{r['alone_ms']:6.2f} ms"
                      f" (first token this step) | chunked by {best['chunk']:3d}: +{best['total_extra_ms']:6.2f} ms"
                      f" over {best['steps_to_first_token']} steps ({best['per_step_extra_ms']:5.2f} ms each) | "
                      f"chunked / alone {r['chunked_over_alone']:.2f}", flush=True)
    info = machine_info()
    result = {"machine": info, "note": args.note, "threads": args.threads, "clock": clock.__name__,
              "repeats": args.repeats, "context": CONTEXT,
              "tree_nodes": nodes, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"join_{machine_tag(info)}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
