"""Benchmark compact_kv: a per-cache gather + scatter in torch (the baseline) vs our one-call kernel (all caches).

Every layer's K and V ([B, Hkv=8, S, D=128], HF layout; or a flat [B, S, 1024] static cache), accepted paths of A
positions out of a 64-node tree after a prefix P, moved to P.. P+A-1. Checked against the reference first. Bytes:
each moved position read and written, 2*caches*B*Hkv*A*D*elem (positions already in place are not moved by ours; the
inputs avoid them). Goal (reported, not asserted): CUDA, 32 layers (64 caches), A=8: under 20 us.
"""

from __future__ import annotations

import common  # noqa: F401  (sets sys.path)
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

OP = "compact_kv"
HKV, D = 8, 128


def shapes(quick: bool):
    """(layers, B, A accepted, S, layout, dtype)."""
    bf = torch.bfloat16
    s = [(32, 1, 8, 2048, "hf", bf), (32, 8, 8, 512, "hf", bf)]
    if not quick:
        s += [(32, 32, 4, 256, "hf", bf), (32, 8, 8, 512, "flat", bf), (8, 8, 16, 512, "hf", torch.float32)]
    return s


def make_inputs(layers, B, A, S, layout, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (B, HKV, S, D) if layout == "hf" else (B, S, HKV * D)
    caches = [torch.randn(*shape, generator=g).to(dtype) for _ in range(2 * layers)]
    P = S // 2
    src = torch.empty(B, A, dtype=torch.int64)
    for b in range(B):  # an accepted path through a 64-node tree: increasing positions, none already in place
        src[b] = P + 1 + torch.randperm(63, generator=g)[:A].sort().values
    dst = torch.full((B,), P, dtype=torch.int64)
    lengths = torch.full((B,), A, dtype=torch.int64)
    return caches, src, dst, lengths, (2 if layout == "hf" else 1)


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    devs = common.devices(args)
    for layers, B, A, S, layout, dtype in shapes(args.quick):
        caches, src, dst, lengths, seq_dim = make_inputs(layers, B, A, S, layout, dtype, seed=layers + B + A)
        shape = f"caches={2 * layers},B={B},A={A},S={S},{layout}"
        dname = common.dtype_name(dtype)
        table.case(OP, shape, dname)
        es = caches[0].element_size()
        nbytes = 2.0 * len(caches) * B * HKV * A * D * es
        formula = f"2*caches*B*Hkv*A*D*{es}"
        want = [c.clone() for c in caches]
        reference.compact_kv(want, src, dst, lengths, seq_dim)
        for dev in devs:
            if dev == "cpu" and args.device == "cuda":
                continue
            cs = [c.to(dev) for c in caches]
            sd, dd, ld = src.to(dev), dst.to(dev), lengths.to(dev)
            got = [c.clone() for c in cs]
            ops.compact_kv(got, sd, dd, ld, seq_dim)
            base = [c.clone() for c in cs]
            baselines.compact_kv(base, sd, dd, ld, seq_dim)
            common.sync(dev)
            for name, res in (("ours", got), ("baseline", base)):
                if not all(torch.equal(r.cpu(), w) for r, w in zip(res, want)):
                    raise AssertionError(f"{OP} {name}-{dev} differs from the reference")
            if dev == "cpu" and B == 1:  # the reference clones whole caches: timed on one row only
                n_ref = 2
                table.add(common.Result(OP, shape, dname, "reference", "cpu", common.time_fn(
                    lambda: reference.compact_kv(cs, src, dst, lengths, seq_dim), "cpu", n_ref, 1), nbytes,
                    formula, n_ref))
            # Repeated calls move already-moved data again: same work, so the timing is representative.
            table.add(common.Result(OP, shape, dname, "baseline", dev, common.time_fn(
                lambda: baselines.compact_kv(cs, sd, dd, ld, seq_dim), dev, args.repeats), nbytes, formula,
                args.repeats))
            table.add(common.Result(OP, shape, dname, "ours", dev, common.time_fn(
                lambda: ops.compact_kv(cs, sd, dd, ld, seq_dim, validate=False), dev, args.repeats), nbytes,
                formula, args.repeats))
        print("  check: ours and the baseline equal the reference; bytes: " + formula, flush=True)
    return common.finish(table, args)


if __name__ == "__main__":
    main()
