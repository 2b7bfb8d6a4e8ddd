"""Benchmark verify_tree_sampling: reference vs vectorised torch baseline vs our CPU (and CUDA) kernel.

Planted draft trees (2-4 accepted tokens per row), T = 0.8, top_k = 50, top_p = 0.9, uniforms in [0.05, 0.9);
deterministic drafts (draft_probs=None) and i.i.d. drafts (draft_probs given). The baseline computes the filtered
target distribution (topk-based top-k / top-p) for every [B, N] row, then walks the tree. Bytes: ours = rows on the
accepted paths, sum(accept_len + 1) * V * (elem [+ 4 for draft_probs]); baseline = B * N * V * elem (+ the
draft_probs rows of the path).
Goal (reported, not asserted): CPU at B=8, N=64, V=32000 fp32 >= 5x faster than the baseline.
"""

from __future__ import annotations

import common  # noqa: F401
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

OP = "verify_tree_sampling"


def shapes(quick: bool, gpu: bool):
    s = [(8, 64, 32000, torch.float32, False), (8, 64, 32000, torch.float32, True),
         (1, 64, 128000, torch.float32, False)]
    s = s if quick else s + [(8, 64, 32000, torch.bfloat16, False)]
    return s + [(64, 8, 128000, torch.float32, False)] if gpu else s


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    for B, N, V, dtype, with_q in shapes(args.quick, common.want_gpu_shapes(args)):
        logits, tokens, parents, accept_len, _ = common.planted_tree_inputs(B, N, V, seed=7 + B + N + V, dtype=dtype)
        table.note(common.planted_note(accept_len))
        g = torch.Generator().manual_seed(3)
        uniforms = torch.rand(B, N, generator=g) * 0.85 + 0.05
        draft = torch.softmax(torch.randn(B, N, V, generator=g), -1) if with_q else None
        T, k, p = torch.full((B,), 0.8), torch.full((B,), 50, dtype=torch.int64), torch.full((B,), 0.9)
        es = logits.element_size()
        per_row = es + (4 if with_q else 0)
        rows = float((accept_len + 1).sum())
        common.run_case(
            table, args, op=OP, shape=f"B={B},N={N},V={V},{'q' if with_q else 'q=None'}", dtype=dtype,
            inputs=dict(logits=logits, tokens=tokens, parents=parents, draft_probs=draft, uniforms=uniforms,
                        temperature=T, top_k=k, top_p=p),
            reference=reference.verify_tree_sampling,
            baseline=baselines.verify_tree_sampling,
            ours=lambda logits, tokens, parents, draft_probs, uniforms, temperature, top_k, top_p: tuple(
                ops.verify_tree_sampling(logits, tokens, parents, uniforms, draft_probs, temperature, top_k, top_p)),
            bytes_ours=rows * V * per_row, formula_ours=f"sum(accept_len+1)*V*{per_row}",
            bytes_all=B * N * V * es + (rows * V * 4 if with_q else 0),
            formula_all=f"B*N*V*{es}" + (" + sum(accept_len+1)*V*4" if with_q else ""))
    return common.finish(table, args)


if __name__ == "__main__":
    main()
