"""Benchmark tree_attention: torch SDPA with the equivalent dense mask (the baseline) vs our CPU (and CUDA) kernel.

GQA 32 query heads over 8 kv heads, head dim 128, random trees (tree_ancestor_mask), every row with the same
prefix P; the cache holds exactly P + N positions. The mask for SDPA is built once, outside the timing. Before
timing, ours is checked against the float32 reference (tolerance by dtype). The reference (a Python loop over rows)
is timed on the smaller shapes only. Bytes: K and V read once, 2*B*Hkv*(P+N)*D*elem (both implementations).
Goal (reported, not asserted): CPU at N <= 64 and P >= 1k at least 1.5x faster than SDPA; CUDA at B=1, N=64,
P=32k, bf16 at least 70% of the device copy bandwidth.
"""

from __future__ import annotations

import common  # noqa: F401  (sets sys.path)
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

OP = "tree_attention"
H, HKV, D = 32, 8, 128
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def shapes(quick: bool, gpu: bool):
    """(B, N, P, dtype)."""
    bf, f32 = torch.bfloat16, torch.float32
    if quick:
        s = [(1, 8, 1024, bf), (1, 64, 1024, bf), (1, 64, 1024, f32)]
    else:
        s = [(1, 1, 4096, bf), (1, 8, 128, bf), (1, 8, 1024, bf), (1, 26, 1024, bf), (1, 64, 1024, bf),
             (1, 64, 4096, bf), (1, 8, 32768, bf), (8, 26, 1024, bf), (8, 64, 128, bf), (32, 8, 128, bf),
             (32, 1, 1024, bf), (1, 64, 1024, f32), (1, 64, 4096, f32), (8, 26, 1024, f32),
             (1, 64, 1024, torch.float16), (8, 26, 1024, torch.float16)]
    if gpu:
        s += [(1, 64, 32768, bf), (8, 64, 8192, bf), (32, 26, 4096, bf), (32, 64, 1024, bf), (1, 26, 32768, bf)]
    return s


def make_inputs(B, N, P, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    parents = torch.empty(B, N, dtype=torch.int64)
    parents[:, 0] = -1
    for i in range(1, N):
        parents[:, i] = torch.randint(0, i, (B,), generator=g)
    S = P + N
    q = torch.randn(B, H, N, D, generator=g).to(dtype)
    k = torch.randn(B, HKV, S, D, generator=g).to(dtype)
    v = torch.randn(B, HKV, S, D, generator=g).to(dtype)
    prefix = torch.full((B,), P, dtype=torch.int64)
    return q, k, v, prefix, ops.tree_ancestor_mask(parents)


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    devs = common.devices(args)
    cpu_timing = args.device in ("all", "cpu")
    for B, N, P, dtype in shapes(args.quick, "cuda" in devs):  # the GPU-sized shapes only when CUDA runs
        q, k, v, prefix, mask = make_inputs(B, N, P, dtype, seed=B + N + P)
        scale = D ** -0.5
        shape = f"B={B},N={N},P={P},H={H}/{HKV},D={D}"
        dname = common.dtype_name(dtype)
        table.case(OP, shape, dname)
        nbytes = 2.0 * B * HKV * (P + N) * D * q.element_size()
        formula = f"2*B*Hkv*(P+N)*D*{q.element_size()}"
        small = B * (P + N) <= 8 * 1100
        want = reference.tree_attention(q[:1], k[:1], v[:1], prefix[:1], mask[:1], scale)  # row 0 (rows alike)
        for dev in devs:
            if dev == "cpu" and not cpu_timing:
                continue
            qd, kd, vd, pd, md = (t.to(dev) for t in (q, k, v, prefix, mask))
            dense = baselines.tree_attention_dense_mask(pd, md, P + N)
            got = ops.tree_attention(qd, kd, vd, pd, md, scale)
            common.sync(dev)
            common.check_close(f"{OP} ours-{dev} vs reference", got[:1].float(), want.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
            base = baselines.tree_attention_sdpa(qd, kd, vd, dense, scale)
            common.check_close(f"{OP} sdpa-{dev} vs reference", base[:1].float(), want.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
            if dev == "cpu" and small:
                n_ref = 2
                table.add(common.Result(OP, shape, dname, "reference", "cpu", common.time_fn(
                    lambda: reference.tree_attention(q, k, v, prefix, mask, scale), "cpu", n_ref, 1), nbytes,
                    formula, n_ref))
            reps = args.repeats if nbytes < 2e8 else max(3, args.repeats // 4)
            table.add(common.Result(OP, shape, dname, "baseline", dev, common.time_fn(
                lambda: baselines.tree_attention_sdpa(qd, kd, vd, dense, scale), dev, reps), nbytes, formula, reps))
            table.add(common.Result(OP, shape, dname, "ours", dev, common.time_fn(
                lambda: ops.tree_attention(qd, kd, vd, pd, md, scale), dev, reps), nbytes, formula, reps))
        print("  check: ours and SDPA agree with the float32 reference; bytes: " + formula, flush=True)
    table.note("baseline = torch SDPA with the equivalent dense boolean mask [B, 1, N, P+N] (enable_gqa=True)")
    return common.finish(table, args)


if __name__ == "__main__":
    main()
