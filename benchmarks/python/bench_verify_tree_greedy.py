"""Benchmark verify_tree_greedy: reference vs vectorised torch baseline vs our CPU (and CUDA) kernel.

Planted draft trees (binary-heap trees, 2-4 accepted tokens per row). Bytes: ours = logits rows on the accepted
paths, sum(accept_len + 1) * V * elem; baseline = every row, B * N * V * elem (argmax over all rows).
Goal (reported, not asserted): CPU at B=8, N=64, V=32000 fp32 >= 5x faster than the baseline.
"""

from __future__ import annotations

import common  # noqa: F401  (sets sys.path)
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

OP = "verify_tree_greedy"


def shapes(quick: bool, gpu: bool):
    s = [(8, 64, 32000, torch.float32), (1, 64, 128000, torch.float32), (8, 64, 32000, torch.bfloat16)]
    s = s[:2] if quick else s
    return s + [(64, 8, 128000, torch.float32)] if gpu else s


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    for B, N, V, dtype in shapes(args.quick, common.want_gpu_shapes(args)):
        logits, tokens, parents, accept_len, _ = common.planted_tree_inputs(B, N, V, seed=B + N + V, dtype=dtype)
        table.note(common.planted_note(accept_len))
        es = logits.element_size()
        common.run_case(
            table, args, op=OP, shape=f"B={B},N={N},V={V}", dtype=dtype,
            inputs=dict(logits=logits, tokens=tokens, parents=parents),
            reference=lambda logits, tokens, parents: reference.verify_tree_greedy(logits, tokens, parents),
            baseline=baselines.verify_tree_greedy,
            ours=lambda logits, tokens, parents: tuple(ops.verify_tree_greedy(logits, tokens, parents)),
            bytes_ours=float((accept_len + 1).sum()) * V * es, formula_ours=f"sum(accept_len+1)*V*{es}",
            bytes_all=float(B * N * V * es), formula_all=f"B*N*V*{es}")
    return common.finish(table, args)


if __name__ == "__main__":
    main()
