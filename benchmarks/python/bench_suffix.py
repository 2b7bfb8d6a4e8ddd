"""Suffix decoding against the n-gram drafter and plain decoding, on the model family's target: an agent-style
workload of repeated requests, and ordinary held-out prompts.

Workloads (greedy, ``--new-tokens`` each; requests in sequence, each decoded to its end before the next arrives,
through one engine per method that lives for the whole workload, as a server's would):

* **agent**: ``--tools`` "tool-call templates", the first ``TEMPLATE`` tokens of as many held-out prompts
  (:func:`specdec_ext.zoo.evaluate.heldout_prompts`), and ``--requests`` requests, each a template chosen at random
  (seeded) with a small variation: ``ARG`` tokens at a random place in its middle replaced by a window of another
  held-out prompt (the call's arguments). Requests of one template share most of their prompt, as an agent's
  repeated tool calls do, so their outputs repeat each other in part.
* **plain**: ``--plain-prompts`` held-out prompts of ``TEMPLATE`` tokens, each once (no repetition across
  requests: the suffix drafter only has each prompt's own text and unrelated earlier outputs).

Methods: plain decoding, the family's n-gram drafter (``NgramDrafter``, the family's shapes) and ``SuffixDrafter``
(its defaults unless ``--suffix`` says otherwise), the three advanced request by request (interleaved, so machine
noise falls on all of them alike). Every output is checked equal to plain decoding's. Each engine first decodes one
unrelated warm-up request (first-shape costs). With one thread (the default) the clock is the thread's CPU time,
which other processes on a shared machine do not disturb; with more, wall time. Speedup = plain's time / the
method's time over the workload; the loop speedup is the same over the engine's own wall time in its decoding steps
(``DecodeStats`` draft + verify + bookkeeping), without the prefills, which every method pays alike.

    python benchmarks/python/bench_suffix.py [--threads 1] [--requests 24] [--new-tokens 64] [--name suffix]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from specdec_ext import Engine, RequestSettings  # noqa: E402
from specdec_ext.bench.machine import machine_info, machine_tag  # noqa: E402
from specdec_ext.drafters import SuffixDrafter  # noqa: E402
from specdec_ext.zoo import load_family  # noqa: E402
from specdec_ext.zoo.evaluate import heldout_prompts  # noqa: E402

TEMPLATE = 96  # tokens of a tool-call template (and of an ordinary prompt)
ARG = 6  # tokens of a request's variation


def agent_requests(prompts: list[list[int]], tools: int, requests: int, seed: int) -> list[dict]:
    """The agent workload (module doc): per request its template and prompt."""
    gen = torch.Generator().manual_seed(seed)
    templates, sources = [p[:TEMPLATE] for p in prompts[:tools]], prompts[tools:] or prompts
    out = []
    for _ in range(requests):
        k = int(torch.randint(0, tools, (1,), generator=gen))
        src = sources[int(torch.randint(0, len(sources), (1,), generator=gen))]
        at = int(torch.randint(TEMPLATE // 4, 3 * TEMPLATE // 4, (1,), generator=gen))
        s = int(torch.randint(0, len(src) - ARG, (1,), generator=gen))
        out.append({"template": k, "prompt": templates[k][:at] + src[s:s + ARG] + templates[k][at + ARG:]})
    return out


class Method:
    """One method's engine over a workload: times and counts per request."""

    def __init__(self, name: str, target, drafter, max_len: int, clock):
        self.name, self.drafter, self.clock = name, drafter, clock
        self.engine = Engine(target, drafter, max_batch=1, max_len=max_len, eos_token_id=[])
        self.seconds, self.tokens, self.steps, self.draft_s, self.loop_s, self.outputs = [], [], [], [], [], []

    def decode(self, prompt: list[int], new_tokens: int, record: bool = True) -> list[int]:
        e = self.engine
        draft0, loop0 = e.stats.draft_s, self._loop_s()
        t0 = self.clock()
        e.add_request(prompt, RequestSettings(max_new_tokens=new_tokens))
        tokens, steps = [], 0
        while e.has_unfinished():
            for _, new, _ in e.step():
                tokens += new
            steps += 1
        if record:
            self.seconds.append(self.clock() - t0)
            self.tokens.append(len(tokens))
            self.steps.append(steps)
            self.draft_s.append(e.stats.draft_s - draft0)
            self.loop_s.append(self._loop_s() - loop0)
            self.outputs.append(tokens)
        return tokens

    def _loop_s(self) -> float:
        """The engine's own wall time in its decoding steps, the prefills excluded."""
        s = self.engine.stats
        return s.draft_s + s.verify_s + s.bookkeeping_s

    def summary(self, plain: "Method | None") -> dict:
        total = sum(self.seconds)
        out = {"seconds": round(total, 4), "tokens": sum(self.tokens), "steps": sum(self.steps),
               "tokens_per_s": round(sum(self.tokens) / total, 2),
               "mean_accepted_length": round(sum(self.tokens) / sum(self.steps), 3),
               "draft_share": round(sum(self.draft_s) / total, 4), "loop_seconds": round(sum(self.loop_s), 4),
               "per_request_accepted_length": [round(t / s, 2) for t, s in zip(self.tokens, self.steps)]}
        if plain is not None:
            out["speedup"] = round(sum(plain.seconds) / total, 3)
            out["loop_speedup"] = round(sum(plain.loop_s) / sum(self.loop_s), 3)
            out["outputs_equal_plain"] = self.outputs == plain.outputs
        return out


def run_workload(fam, prompts: list[list[int]], warmup: list[int], new_tokens: int, suffix_kw: dict, clock,
                 log) -> dict:
    max_len = max(map(len, prompts + [warmup])) + new_tokens + 32
    methods = [Method("plain", fam.target, None, max_len, clock),
               Method("ngram", fam.target, fam.make_drafter("ngram"), max_len, clock),
               Method("suffix", fam.target, SuffixDrafter(**suffix_kw), max_len, clock)]
    try:
        for m in methods:
            m.decode(warmup, new_tokens, record=False)
        for i, p in enumerate(prompts):
            for m in methods:
                m.decode(p, new_tokens)
            log(f"  request {i:3d}: " + " | ".join(f"{m.name} {m.seconds[-1]:.3f} s ({m.tokens[-1] / m.steps[-1]:.2f})"
                                                   for m in methods))
    finally:
        for m in methods:
            m.engine.close()
    plain = methods[0]
    res = {m.name: m.summary(None if m is plain else plain) for m in methods}
    res["suffix_over_ngram_speedup"] = round(res["suffix"]["speedup"] / res["ngram"]["speedup"], 3)
    res["suffix_over_ngram_loop_speedup"] = round(res["suffix"]["loop_speedup"] / res["ngram"]["loop_speedup"], 3)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tools", type=int, default=4)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--plain-prompts", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--suffix", default="", help="SuffixDrafter settings, e.g. max_depth=8,max_nodes=12")
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    p.add_argument("--name", default="suffix", help="the result file's name before the machine tag")
    p.add_argument("--note", default="", help="what else ran on the machine, when (stored in the JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    suffix_kw = {}
    for item in filter(None, args.suffix.split(",")):
        key, _, value = item.partition("=")
        suffix_kw[key] = float(value) if "." in value else int(value)
    fam = load_family()
    held = heldout_prompts(fam.tokenizer, 64, 2 * TEMPLATE)
    if len(held) < args.tools + 2:
        raise SystemExit(f"bench_suffix: {len(held)} held-out prompts; need at least --tools + 2")
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    warmup = held[-1][:TEMPLATE]
    agent = agent_requests(held[:-1], args.tools, args.requests, args.seed)
    plain_prompts = [q[TEMPLATE:] for q in held[:-1]][: args.plain_prompts]  # (not the templates' tokens)
    results = {}
    with torch.no_grad():
        for name, prompts in (("agent", [r["prompt"] for r in agent]), ("plain", plain_prompts)):
            print(f"{name} workload: {len(prompts)} requests", flush=True)
            results[name] = run_workload(fam, prompts, warmup, args.new_tokens, suffix_kw, clock,
                                         lambda s: print(s, flush=True))
            r = results[name]
            print(f"{name}: plain {r['plain']['tokens_per_s']} tok/s | ngram x{r['ngram']['speedup']} "
                  f"(accepted {r['ngram']['mean_accepted_length']}) | suffix x{r['suffix']['speedup']} (accepted "
                  f"{r['suffix']['mean_accepted_length']}) | suffix / ngram {r['suffix_over_ngram_speedup']} (decoding "
                  f"loop alone {r['suffix_over_ngram_loop_speedup']}) | "
                  f"equal to plain: {r['ngram']['outputs_equal_plain'] and r['suffix']['outputs_equal_plain']}",
                  flush=True)
    info = machine_info()
    d = SuffixDrafter(**suffix_kw)
    result = {"machine": info, "note": args.note, "threads": args.threads, "clock": clock.__name__,
              "new_tokens": args.new_tokens, "template_tokens": TEMPLATE, "arg_tokens": ARG, "tools": args.tools,
              "seed": args.seed, "agent_templates": [r["template"] for r in agent],
              "settings": {"ngram": fam.drafter_kwargs("ngram"),
                           "suffix": {k: getattr(d, k) for k in ("max_depth", "max_nodes", "max_pattern", "min_match",
                                                                 "spec_factor", "min_prob", "corpus_tokens",
                                                                 "max_occurrences")}},
              **results}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}_{machine_tag(info)}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
