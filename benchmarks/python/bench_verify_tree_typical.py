"""Benchmark verify_tree_typical: reference vs vectorised torch baseline vs our CPU (and CUDA) kernel.

Planted draft trees (2-4 accepted tokens per row), T = 0.7, posterior_threshold 0.09, alpha 0.3. On planted data
only the accepted path's nodes pass the typical rule, so our kernel reads the path's rows: sum(accept_len + 1) * V *
elem. The baseline computes softmax and entropy for every row: B * N * V * elem.
"""

from __future__ import annotations

import common  # noqa: F401
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

OP = "verify_tree_typical"


def shapes(quick: bool, gpu: bool):
    s = [(8, 64, 32000, torch.float32), (1, 64, 128000, torch.float32)]
    s = s if quick else s + [(8, 64, 32000, torch.bfloat16)]
    return s + [(64, 8, 128000, torch.float32)] if gpu else s


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    for B, N, V, dtype in shapes(args.quick, common.want_gpu_shapes(args)):
        logits, tokens, parents, accept_len, _ = common.planted_tree_inputs(B, N, V, seed=11 + B + N + V,
                                                                            dtype=dtype)
        table.note(common.planted_note(accept_len))
        uniforms = torch.rand(B, generator=torch.Generator().manual_seed(5))
        T = torch.full((B,), 0.7)
        es = logits.element_size()
        common.run_case(
            table, args, op=OP, shape=f"B={B},N={N},V={V}", dtype=dtype,
            inputs=dict(logits=logits, tokens=tokens, parents=parents, uniforms=uniforms, temperature=T),
            reference=lambda logits, tokens, parents, uniforms, temperature: reference.verify_tree_typical(
                logits, tokens, parents, uniforms, temperature, 0.09, 0.3),
            baseline=lambda logits, tokens, parents, uniforms, temperature: baselines.verify_tree_typical(
                logits, tokens, parents, uniforms, temperature, 0.09, 0.3),
            ours=lambda logits, tokens, parents, uniforms, temperature: tuple(ops.verify_tree_typical(
                logits, tokens, parents, uniforms, temperature, 0.09, 0.3)),
            bytes_ours=float((accept_len + 1).sum()) * V * es, formula_ours=f"sum(accept_len+1)*V*{es}",
            bytes_all=float(B * N * V * es), formula_all=f"B*N*V*{es}")
    return common.finish(table, args)


if __name__ == "__main__":
    main()
