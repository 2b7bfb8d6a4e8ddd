"""Benchmark sample_tokens: reference vs the equivalent torch ops vs our CPU (and CUDA) kernel.

Random logits (uniform in [-2, 2) plus 20 larger values per row); T = 0.8, top_k = 50, top_p = 0.9 ("filtered") and
T = 1 without filters ("plain"). The baseline is torch softmax + topk-based top-k / top-p (full sort only without top-k) + inverse CDF with the
same uniforms. Bytes: R * V * (elem + 4): logits read, probs written (same for every implementation).
Goal (reported, not asserted): CPU >= 2x faster than the equivalent torch ops.
"""

from __future__ import annotations

import common  # noqa: F401
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

OP = "sample_tokens"


def shapes(quick: bool, gpu: bool):
    s = [(64, 32000, torch.float32, True), (64, 32000, torch.float32, False), (1, 128000, torch.float32, True)]
    s = s if quick else s + [(8, 32000, torch.float32, True), (64, 32000, torch.bfloat16, True)]
    return s + [(64, 128000, torch.float32, True), (512, 32000, torch.float32, True)] if gpu else s


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    for R, V, dtype, filtered in shapes(args.quick, common.want_gpu_shapes(args)):
        g = torch.Generator().manual_seed(R + V)
        logits = torch.rand(R, V, generator=g) * 4 - 2
        logits.scatter_(1, torch.randint(0, V, (R, 20), generator=g), 4 + 4 * torch.rand(R, 20, generator=g))
        logits = logits.to(dtype)
        uniforms = torch.rand(R, generator=g)
        T = torch.full((R,), 0.8 if filtered else 1.0)
        k = torch.full((R,), 50 if filtered else 0, dtype=torch.int64)
        p = torch.full((R,), 0.9 if filtered else 1.0)
        es = logits.element_size()
        nbytes = float(R * V * (es + 4))
        common.run_case(
            table, args, op=OP, shape=f"R={R},V={V}," + ("T=.8,k=50,p=.9" if filtered else "T=1"), dtype=dtype,
            inputs=dict(logits=logits, uniforms=uniforms, temperature=T, top_k=k, top_p=p),
            reference=reference.sample_tokens, baseline=baselines.sample_tokens,
            ours=lambda logits, uniforms, temperature, top_k, top_p: tuple(
                ops.sample_tokens(logits, uniforms, temperature, top_k, top_p)),
            bytes_ours=nbytes, formula_ours=f"R*V*({es}+4)", bytes_all=nbytes, formula_all=f"R*V*({es}+4)",
            float_outputs=(1,), ref_repeats=2)
    return common.finish(table, args)


if __name__ == "__main__":
    main()
