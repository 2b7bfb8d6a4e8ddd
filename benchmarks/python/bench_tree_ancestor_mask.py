"""Benchmark tree_ancestor_mask: reference vs vectorised torch (repeated squaring) vs our kernel, dense and packed.

Random trees. Bytes: 8*B*N (parents) + B*N*N (dense bool) or 4*B*N*ceil(N/32) (packed int32).
"""

from __future__ import annotations

import common  # noqa: F401
import torch

import baselines
import specdec_ext.ops as ops
from bench_build_tree import random_parents
from specdec_ext.ops import reference

OP = "tree_ancestor_mask"


def shapes(quick: bool):
    s = [(8, 64), (64, 64)]
    return s if quick else s + [(8, 256)]


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    for B, N in shapes(args.quick):
        parents = random_parents(B, N, 5 + B + N)
        for packed in (False, True):
            W = (N + 31) // 32
            nbytes = 8.0 * B * N + (4.0 * B * N * W if packed else 1.0 * B * N * N)
            formula = "8*B*N+" + ("4*B*N*ceil(N/32)" if packed else "B*N*N")
            common.run_case(
                table, args, op=OP, shape=f"B={B},N={N}," + ("packed" if packed else "dense"), dtype=torch.int64,
                inputs=dict(parents=parents),
                reference=lambda parents, packed=packed: (reference.tree_ancestor_mask(parents, packed),),
                baseline=lambda parents, packed=packed: (baselines.tree_ancestor_mask(parents, packed),),
                ours=lambda parents, packed=packed: (ops.tree_ancestor_mask(parents, packed),),
                bytes_ours=nbytes, formula_ours=formula, bytes_all=nbytes, formula_all=formula, ref_repeats=2)
    return common.finish(table, args)


if __name__ == "__main__":
    main()
