"""Benchmark packed_linear_int8: few-row products over int8 weights (ours) vs packed_linear over the float32 (or
bfloat16) weights (the baseline), measured side by side in one run.

Cases: every weight matrix of one forward (q, k, v, o, gate, up, down per layer, then the vocabulary projection) of
the model family's target (8 layers, hidden 384, SwiGLU 1024, vocabulary 4096), its draft LM (2 layers, hidden 256,
512, vocabulary 4096) and its EAGLE draft's layer and head (hidden 384, 1024, draft vocabulary 1024), and one
4096 x 4096 matrix. The weights cycle through copies of at least 96 MB (more than the last-level cache), so they
stream from memory as in decoding. M = rows per product: 1-4 (drafting, the goal's rows), 9 and 16 (trees).
Bytes: the weights read once (sum of N*K*elem; int8: 1 byte per weight plus 4 per output channel). Checked first:
ours against the reference bit for bit. Goal (reported, not asserted): int8 at least 2x float32 packed at 1-4 rows.
"""

from __future__ import annotations

import math
import os

import common  # noqa: F401  (sets sys.path)
import torch

import specdec_ext.ops as ops
from specdec_ext.ops import reference as ref

OP = "packed_linear_int8"
MODELS = {  # name: (layers, hidden, intermediate, kv width, vocabulary)
    "family": (8, 384, 1024, 128, 4096),
    "family-draft": (2, 256, 512, 128, 4096),
    "family-eagle": (1, 384, 1024, 128, 1024),
}
STREAM_BYTES = 96 << 20


def shapes(name: str) -> list[tuple[int, int]]:
    """(N, K) of every product of one forward, in order."""
    if name == "4096x4096":
        return [(4096, 4096)]
    layers, h, f, kv, vocab = MODELS[name]
    return [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)] * layers + [(vocab, h)]


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(STREAM_BYTES / nbytes))


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    rows = [1, 2, 3, 4] if args.quick else [1, 2, 3, 4, 9, 16]
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    table.note(f"packed_linear_int8 path {ops.packed_linear_int8_path()}; packed_linear path float32 "
               f"{ops.packed_linear_path(torch.float32)}, bfloat16 {ops.packed_linear_path(torch.bfloat16)}; "
               f"torch threads {torch.get_num_threads()}; load average at the start {os.getloadavg()[0]:.2f}")
    for dev in common.devices(args):
        for dtype in dtypes:
            es = torch.empty((), dtype=dtype).element_size()
            for name in [*MODELS, "4096x4096"]:
                mats = shapes(name)
                float_bytes = sum(n * k for n, k in mats) * es
                int8_bytes = sum(n * k + 4 * n for n, k in mats)
                g = torch.Generator().manual_seed(0)
                weights = [(torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(dev) for n, k in mats]
                base = [[ops.pack_linear_weight(w) for w in weights] for _ in range(copies_for(float_bytes))]
                int8 = [[ops.pack_linear_weight_int8(w) for w in weights] for _ in range(copies_for(int8_bytes))]
                for M in rows:
                    g = torch.Generator().manual_seed(M)
                    xs = {k: torch.randn(M, k, generator=g).to(dtype).to(dev) for k in {k for _, k in mats}}
                    k0 = mats[-1][1]
                    packed, scales = int8[0][-1]
                    got = ops.packed_linear_int8(xs[k0], packed, scales).cpu()
                    if not torch.equal(got, ref.packed_linear_int8(xs[k0].cpu(), packed.cpu(), scales.cpu())):
                        raise AssertionError(f"{OP} {name} M={M}: differs from the reference")
                    state = {"base": 0, "int8": 0}

                    def forward_base():
                        ws = base[state["base"] % len(base)]
                        state["base"] += 1
                        for (n, k), p in zip(mats, ws):
                            ops.packed_linear(xs[k], p, None, n)

                    def forward_int8():
                        ws = int8[state["int8"] % len(int8)]
                        state["int8"] += 1
                        for (n, k), (p, s) in zip(mats, ws):
                            ops.packed_linear_int8(xs[k], p, s)

                    shape = f"{name},M={M}"
                    dname = common.dtype_name(dtype)
                    table.case(OP, shape, dname)
                    repeats = max(8, args.repeats)
                    # alternating halves, so that drift in the machine's load lands on both
                    times = {"baseline": [], "ours": []}
                    for _ in range(2):
                        times["baseline"].append(common.time_fn(forward_base, dev, repeats // 2, warmup=2))
                        times["ours"].append(common.time_fn(forward_int8, dev, repeats // 2, warmup=2))
                    for impl, nbytes, formula in (
                            ("baseline", float_bytes, f"sum(N*K)*{es} ({len(mats)} matrices)"),
                            ("ours", int8_bytes, f"sum(N*K + 4*N) ({len(mats)} matrices)")):
                        table.add(common.Result(OP, shape, dname, impl, dev, min(times[impl]), float(nbytes), formula,
                                                repeats))
        print("  check: ours equals the reference bit for bit; bytes: weights once")
    ratios = {}
    for r in table.ratios():
        if r["shape"].endswith(("M=1", "M=2", "M=3", "M=4")) and "speedup_vs_baseline" in r:
            ratios.setdefault((r["device"], r["dtype"]), []).append(r["speedup_vs_baseline"])
    for (dev, dname), values in sorted(ratios.items()):
        table.note(f"{dev} {dname}: int8 / packed {dname} speed at 1-4 rows: min {min(values):.2f}x, "
                   f"max {max(values):.2f}x (goal >= 2x)")
    return common.finish(table, args)


if __name__ == "__main__":
    main()
