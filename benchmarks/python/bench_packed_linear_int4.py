"""Benchmark packed_linear_int4: few-row products over int4 weights (ours) vs packed_linear_int8 over the same
weights in int8 (the baseline: does int4 pay over int8?), measured side by side in one run.

Cases: the int8 bench's (every weight matrix of one forward of the family's target, its draft LM and its EAGLE draft,
and one 4096 x 4096 matrix; bench_packed_linear_int8.py) and one decoder layer of a Llama-2-7B-shaped model (q, k,
v, o 4096 x 4096, gate and up 11008 x 4096, down 4096 x 11008). The weights cycle through copies of at least 96 MB
(more than the last-level cache), so they stream from memory as in decoding. M = rows per product: 1-4 (drafting),
9 and 16 (trees). Bytes: the weights read once (int8: 1 byte a weight plus 4 per output channel; int4: half a byte a
weight plus 1 per group of 32 and 4 per output channel). Checked first: ours against the reference bit for bit.
"""

from __future__ import annotations

import os

import common  # noqa: F401  (sets sys.path)
import torch
from bench_packed_linear_int8 import MODELS, copies_for, shapes

import specdec_ext.ops as ops
from specdec_ext.ops import reference as ref

OP = "packed_linear_int4"
LLAMA_7B_LAYER = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]


def case_shapes(name: str) -> list[tuple[int, int]]:
    return LLAMA_7B_LAYER if name == "7b-layer" else shapes(name)


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    rows = [1, 2, 3, 4] if args.quick else [1, 2, 3, 4, 9, 16]
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    table.note(f"packed_linear_int4 path {ops.packed_linear_int4_path()}; packed_linear_int8 path "
               f"{ops.packed_linear_int8_path()}; torch threads {torch.get_num_threads()}; load average at the "
               f"start {os.getloadavg()[0]:.2f}")
    for dev in common.devices(args):
        for dtype in dtypes:
            for name in [*MODELS, "4096x4096", "7b-layer"]:
                mats = case_shapes(name)
                int8_bytes = sum(n * k + 4 * n for n, k in mats)
                int4_bytes = sum(n * (-(-k // 32) * 16 + -(-k // 32)) + 4 * n for n, k in mats)
                g = torch.Generator().manual_seed(0)
                weights = [(torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(dev) for n, k in mats]
                int8 = [[ops.pack_linear_weight_int8(w) for w in weights] for _ in range(copies_for(int8_bytes))]
                int4 = [[ops.pack_linear_weight_int4(w) for w in weights] for _ in range(copies_for(int4_bytes))]
                del weights
                for M in rows:
                    g = torch.Generator().manual_seed(M)
                    xs = {k: torch.randn(M, k, generator=g).to(dtype).to(dev) for k in {k for _, k in mats}}
                    k0 = mats[-1][1]
                    w4 = int4[0][-1]
                    got = ops.packed_linear_int4(xs[k0], *w4).cpu()
                    if not torch.equal(got, ref.packed_linear_int4(xs[k0].cpu(), *(t.cpu() for t in w4))):
                        raise AssertionError(f"{OP} {name} M={M}: differs from the reference")
                    state = {"int8": 0, "int4": 0}

                    def forward_int8():
                        ws = int8[state["int8"] % len(int8)]
                        state["int8"] += 1
                        for (n, k), (p, s) in zip(mats, ws):
                            ops.packed_linear_int8(xs[k], p, s)

                    def forward_int4():
                        ws = int4[state["int4"] % len(int4)]
                        state["int4"] += 1
                        for (n, k), w in zip(mats, ws):
                            ops.packed_linear_int4(xs[k], *w)

                    shape = f"{name},M={M}"
                    dname = common.dtype_name(dtype)
                    table.case(OP, shape, dname)
                    repeats = max(8, args.repeats)
                    # alternating halves, so that drift in the machine's load lands on both
                    times = {"baseline": [], "ours": []}
                    for _ in range(2):
                        times["baseline"].append(common.time_fn(forward_int8, dev, repeats // 2, warmup=2))
                        times["ours"].append(common.time_fn(forward_int4, dev, repeats // 2, warmup=2))
                    for impl, nbytes, formula in (
                            ("baseline", int8_bytes, f"sum(N*K + 4*N) ({len(mats)} matrices, int8)"),
                            ("ours", int4_bytes, f"sum(N*K/2 + N*K/32 + 4*N) ({len(mats)} matrices, int4)")):
                        table.add(common.Result(OP, shape, dname, impl, dev, min(times[impl]), float(nbytes), formula,
                                                repeats))
                del int8, int4
        print("  check: ours equals the reference bit for bit; bytes: weights once")
    ratios = {}
    for r in table.ratios():
        if r["shape"].endswith(("M=1", "M=2", "M=3", "M=4")) and "speedup_vs_baseline" in r:
            ratios.setdefault((r["device"], r["dtype"], r["shape"].split(",")[0]), []).append(r["speedup_vs_baseline"])
    for (dev, dname, name), values in sorted(ratios.items()):
        table.note(f"{dev} {dname} {name}: int4 / int8 speed at 1-4 rows: min {min(values):.2f}x, max "
                   f"{max(values):.2f}x")
    return common.finish(table, args)


if __name__ == "__main__":
    main()
