"""Self-distillation's rate (tokens the target generates per second) on the model family's target, side by side:

* **before**: what ``self_distill`` did until it went through one engine: fixed chunks of 8 sequences, each chunk a
  :func:`specdec_ext.generate.generate` call (a finished row waits for its chunk; a new engine per chunk);
* **after**: :func:`specdec_ext.train.data.self_distill`, one engine of ``--batch`` rows, a finished row replaced by
  the next sequence (and with ``--drafter``, speculative).

The prompts are the first ``--prompt-len`` tokens of whole ``--max-length`` windows of the family's held-out files,
the continuations cut at the window's length (as ``specdec train-* --self-distill`` does), greedy, with the
target's EOS. Both produce the
same tokens (checked). The target is loaded as the training commands load it (its files are bfloat16; ``--dtype``).
The clock is the process's CPU time on one thread (other processes on a shared machine do not disturb it).

    python benchmarks/python/bench_self_distill.py [--sequences 128] [--batch 64] [--dtype bfloat16]
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

from specdec_ext.generate import generate, load_model  # noqa: E402
from specdec_ext.train.common import load_tokenizer  # noqa: E402
from specdec_ext.train.data import document_stream, encode_texts, prompt_of, self_distill, windows  # noqa: E402
from specdec_ext.zoo.corpus import heldout_texts  # noqa: E402
from specdec_ext.zoo.family import family_dir  # noqa: E402


def before(target, seqs, prompt_len, new_tokens, max_length, chunk=8):
    """The previous implementation (fixed chunks through generate), kept here as the baseline."""
    out = []
    prompts = [prompt_of(s, prompt_len) for s in seqs]
    for i in range(0, len(prompts), chunk):
        toks, _ = generate(target, None, [torch.tensor(p) for p in prompts[i: i + chunk]], max_new_tokens=new_tokens,
                           temperature=0.0, seed=i)
        out += [[int(x) for x in t][:max_length] for t in toks]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=240)
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tdir = os.path.join(family_dir(), "target")
    target = load_model(tdir, dtype=getattr(torch, args.dtype) if args.dtype else None, device="cpu")
    tok = load_tokenizer(tdir)
    stream = document_stream(encode_texts(tok, heldout_texts(), add_special_tokens=False), tok.eos_token_id)
    seqs = [w for w in windows(stream, args.max_length) if len(w) == args.max_length][: args.sequences]
    P = args.prompt_len
    generate(target, None, [torch.tensor(seqs[0][:P])], max_new_tokens=8)  # first-call costs (packing) for neither

    def timed(fn):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        return out, time.process_time() - c0, time.perf_counter() - w0

    ref, cpu_b, wall_b = timed(lambda: before(target, seqs, P, args.new_tokens, args.max_length))
    n = sum(len(o) - len(prompt_of(s, P)) for o, s in zip(ref, seqs))
    rows = [{"method": "before (generate, chunks of 8)", "tokens": n, "cpu_s": round(cpu_b, 2),
             "tokens_per_s": round(n / cpu_b, 1)}]
    print(f"before: {n} tokens, {cpu_b:.1f} s CPU ({wall_b:.1f} s wall): {n / cpu_b:.0f} tokens/s", flush=True)
    for b in args.batch:
        out, cpu_a, wall_a = timed(lambda: self_distill(target, seqs, prompt_len=P, new_tokens=args.new_tokens,
                                                        batch_size=b, progress=False))
        same = out == ref
        rows.append({"method": f"after (one engine, {b} rows)", "tokens": n, "cpu_s": round(cpu_a, 2),
                     "tokens_per_s": round(n / cpu_a, 1), "speedup": round(cpu_b / cpu_a, 2), "same_tokens": same})
        print(f"after, {b} rows: {cpu_a:.1f} s CPU ({wall_a:.1f} s wall): {n / cpu_a:.0f} tokens/s, "
              f"{cpu_b / cpu_a:.2f}x before; same tokens: {same}", flush=True)
        if not same:
            raise SystemExit("self-distillation changed its greedy tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": str(next(target.parameters()).dtype), "sequences": len(seqs), "prompt_len": P,
                       "max_length": args.max_length, "new_tokens": args.new_tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
