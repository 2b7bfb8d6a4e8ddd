"""Benchmark build_tree: reference vs vectorised torch (ancestor matrix by repeated squaring) vs our kernel.

Random trees (parent of node i uniform in [0, i)). Bytes: 8 * (5*B*N + B*N*N + 2*B) (parents, prefix, and every
output written: depth, positions, first child, next sibling, retrieve paths, leaf counts).
"""

from __future__ import annotations

import common  # noqa: F401
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

OP = "build_tree"


def random_parents(B: int, N: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = (torch.rand(B, N, generator=g) * torch.arange(N)).long()
    p[:, 0] = -1
    return p


def shapes(quick: bool):
    s = [(8, 64), (64, 64)]
    return s if quick else s + [(8, 256), (256, 64)]


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    for B, N in shapes(args.quick):
        parents = random_parents(B, N, B + N)
        prefix = torch.randint(0, 1000, (B,), generator=torch.Generator().manual_seed(1))
        nbytes = 8.0 * (5 * B * N + B * N * N + 2 * B)
        common.run_case(
            table, args, op=OP, shape=f"B={B},N={N}", dtype=torch.int64,
            inputs=dict(parents=parents, prefix_lens=prefix),
            reference=reference.build_tree, baseline=baselines.build_tree,
            ours=lambda parents, prefix_lens: tuple(ops.build_tree(parents, prefix_lens)),
            bytes_ours=nbytes, formula_ours="8*(5*B*N+B*N*N+2*B)", bytes_all=nbytes,
            formula_all="8*(5*B*N+B*N*N+2*B)", ref_repeats=2)
    return common.finish(table, args)


if __name__ == "__main__":
    main()
