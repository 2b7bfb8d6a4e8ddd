"""Benchmark draft_decoder_layer: an EAGLE draft's decoder layer as one op (ours) vs the same layer's module path
(the baseline: torch ops around the few-row products, SDPA for the attention).

Case: the model family's EAGLE-1 draft layer (hidden 384, 6 query / 2 key-value heads of 64, SwiGLU 1024) over T
new positions of one row attending to P cached positions, as a drafting step runs it: T = 2 (a tree level of the
family's EAGLE-2 trees), 4 (a catch-up), 10 and 32; P = 600. Both write the same K/V into the same cache from the
same inputs: ours is the op on the layer's weights packed once (what the layer calls on CPU, without the layer's
~10 us of Python around it), the baseline the layer's module path (its products packed on CPU, aten's on CUDA).
Checked first: the two outputs agree within the dtype's rounding. Bytes: the layer's weights read once.

Second case, ``draft_decoder_layer[int8 weights]`` (CPU): the op on the same layer's weights quantised to int8
(``pack_linear_weight_int8``: a quantised draft, ``draft_quant="int8"``) as "ours" against the op on the float
weights as the "baseline", checked first against the reference layer over the same int8 weights.
"""

from __future__ import annotations

import common  # noqa: F401  (sets sys.path)
import torch

import specdec_ext.ops as ops
from specdec_ext.models import draft_layer as DL
from specdec_ext.ops import reference as ref
from specdec_ext.models import eagle as E

OP = "draft_decoder_layer"
P = 600


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    cfg = E.EagleConfig(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2,
                        vocab_size=4096, head_dim=64, rms_norm_eps=1e-5)
    rows = [2, 10] if args.quick else [2, 4, 10, 32]
    for dev in common.devices(args):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            layer = E.Eagle1Layer(cfg).to(device=dev, dtype=dtype).eval()
            with torch.no_grad():
                for p in layer.parameters():
                    p.normal_(0, 0.05)
                sa, mlp = layer.self_attn, layer.mlp
                packed = [ops.pack_linear_weight(torch.cat([m.weight for m in group])) for group in (
                    (sa.q_proj, sa.k_proj, sa.v_proj), (sa.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,))]
            for T in rows:
                g = torch.Generator().manual_seed(T)
                x = torch.randn(1, T, 384, generator=g).to(device=dev, dtype=dtype)
                pos = torch.arange(P, P + T, device=dev)[None]
                mask = torch.arange(P + T, device=dev)[None, None] <= pos[:, :, None]
                cache = E.EagleKVCache(1, 2, P + 64, 64, dtype, dev)
                cache.k.normal_()
                cache.v.normal_()

                def run(native: bool):
                    with torch.no_grad():
                        if native:
                            return ops.draft_decoder_layer(
                                x, x, packed[0], packed[1], layer.post_attention_layernorm.weight, packed[2],
                                packed[3], pos, sa.rotary.inv_freq, cache.k, cache.v, pos, mask, 6, 1024, 1e-5)
                        return layer(x, pos, mask=mask, cache=cache, write_slots=pos, kv_len=P + T)

                # The baseline is the layer's module path: DraftLayer.takes reads the limit at each call.
                saved = DL.NATIVE_LAYER_MAX_ROWS
                DL.NATIVE_LAYER_MAX_ROWS = 0
                try:
                    assert not DL.DraftLayer.takes(T, mask, P + T), "the baseline would run the op"
                    want = run(False).float()
                    got = run(True).float()
                    tol = 1e-4 if dtype == torch.float32 else 5e-2
                    common.check_close(f"{OP} T={T} {common.dtype_name(dtype)}", got, want,
                                       atol=tol * (1 + float(want.abs().max())), rtol=0)
                    shape = f"T={T},P={P},H=384,heads=6/2,I=1024"
                    dname = common.dtype_name(dtype)
                    table.case(OP, shape, dname)
                    es = torch.empty((), dtype=dtype).element_size()
                    nbytes = float(sum(p.numel() for p in layer.parameters()) * es)
                    formula = f"layer weights ({sum(p.numel() for p in layer.parameters())}) x {es}"
                    for impl, native in (("baseline", False), ("ours", True)):
                        table.add(common.Result(OP, shape, dname, impl, dev, common.time_fn(
                            lambda: run(native), dev, args.repeats * 4, warmup=5), nbytes, formula, args.repeats * 4))
                finally:
                    DL.NATIVE_LAYER_MAX_ROWS = saved
                if dev != "cpu":
                    continue
                with torch.no_grad():
                    q8 = [ops.pack_linear_weight_int8(torch.cat([m.weight for m in group])) for group in (
                        (sa.q_proj, sa.k_proj, sa.v_proj), (sa.o_proj,), (mlp.gate_proj, mlp.up_proj),
                        (mlp.down_proj,))]
                scales = dict(qkv_scales=q8[0].scales, o_scales=q8[1].scales, gate_up_scales=q8[2].scales,
                              down_scales=q8[3].scales)

                def run8(fn=ops.draft_decoder_layer):
                    with torch.no_grad():
                        return fn(x, x, q8[0].packed, q8[1].packed, layer.post_attention_layernorm.weight,
                                  q8[2].packed, q8[3].packed, pos, sa.rotary.inv_freq, cache.k, cache.v, pos, mask,
                                  6, 1024, 1e-5, **scales)

                def run8_ref():
                    return ref.draft_decoder_layer(x, None, 1, x, q8[0].packed, None, q8[1].packed,
                                                   layer.post_attention_layernorm.weight, q8[2].packed,
                                                   q8[3].packed, pos, sa.rotary.inv_freq, cache.k.clone(),
                                                   cache.v.clone(), pos, mask, 6, 1024, 1e-5, **scales)

                got, want = run8().float(), run8_ref().float()
                tol = 1e-4 if dtype == torch.float32 else 5e-2
                op8 = OP + "[int8 weights]"
                common.check_close(f"{op8} T={T} {common.dtype_name(dtype)}", got, want,
                                   atol=tol * (1 + float(want.abs().max())), rtol=0)
                table.case(op8, shape, dname)
                n8 = float(sum(q.packed.numel() + 4 * q.scales.numel() for q in q8))
                for impl, fn in (("baseline", lambda: run(True)), ("ours", run8)):
                    table.add(common.Result(op8, shape, dname, impl, dev, common.time_fn(
                        fn, dev, args.repeats * 4, warmup=5), nbytes if impl == "baseline" else n8,
                        formula if impl == "baseline" else "int8 weights + float32 scales", args.repeats * 4))
        print("  check: the op's output equals the module path's within the dtype's rounding")
    return common.finish(table, args)


if __name__ == "__main__":
    main()
