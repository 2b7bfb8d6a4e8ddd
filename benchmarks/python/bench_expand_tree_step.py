"""Benchmark expand_tree_step (EAGLE-2): reference vs torch (log_softmax + topk + topk) vs our CPU (and CUDA) kernel.

Random logits, top_k = 10 per frontier node, num_select = 10. Bytes: B * F * V * elem (every frontier row read).
"""

from __future__ import annotations

import common  # noqa: F401
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

OP = "expand_tree_step"
K, S = 10, 10


def shapes(quick: bool, gpu: bool):
    s = [(8, 10, 32000, torch.float32), (1, 10, 128000, torch.float32)]
    s = s if quick else s + [(8, 10, 32000, torch.bfloat16)]
    return s + [(64, 10, 128000, torch.float32)] if gpu else s


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    for B, F, V, dtype in shapes(args.quick, common.want_gpu_shapes(args)):
        g = torch.Generator().manual_seed(B + F + V)
        logits = (torch.randn(B, F, V, generator=g) * 2).to(dtype)
        scores = -torch.rand(B, F, generator=g) * 3
        es = logits.element_size()
        common.run_case(
            table, args, op=OP, shape=f"B={B},F={F},V={V},k={K},S={S}", dtype=dtype,
            inputs=dict(logits=logits, parent_scores=scores),
            reference=lambda logits, parent_scores: reference.expand_tree_step(logits, parent_scores, K, S),
            baseline=lambda logits, parent_scores: baselines.expand_tree_step(logits, parent_scores, K, S),
            ours=lambda logits, parent_scores: tuple(ops.expand_tree_step(logits, parent_scores, K, S)),
            bytes_ours=float(B * F * V * es), formula_ours=f"B*F*V*{es}", bytes_all=float(B * F * V * es),
            formula_all=f"B*F*V*{es}", float_outputs=(1,), ref_repeats=2,
            baseline_exact=dtype == torch.float32)  # bf16 logits tie often; torch.topk orders ties arbitrarily
    return common.finish(table, args)


if __name__ == "__main__":
    main()
