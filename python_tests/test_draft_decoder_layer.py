"""The draft decoder layer op (specdec_ext.ops.draft_decoder_layer) against the reference written op by op: outputs
and cache writes over dtypes, head groupings, biases, input norms and masks (a query that sees nothing included);
bad write slots (an error, or no writes and zero outputs without validation); clear errors for mismatched arguments;
and the EAGLE layers, whose forward takes the op on CPU, against their module path."""

from __future__ import annotations

import pytest
import torch

from helpers import make_gen
from specdec_ext import ops
from specdec_ext.models import draft_layer as DL
from specdec_ext.models import eagle as E
from specdec_ext.ops import reference as ref


def _case(dtype, *, B=2, T=3, Din=96, H=96, nH=4, nKV=2, D=64, I=80, S=24, kv_len=20, bias=True, segments=0,
          seed=0, empty_query=False, int8=(), int4=()):
    """Random inputs (weights packed; those named in ``int8`` by pack_linear_weight_int8, their scales in
    ``scales``; those named in ``int4`` by pack_linear_weight_int4, their group scales in ``group_scales`` too), the
    mask allowing each position's own slot and ~half the others."""
    g = make_gen(seed)

    def rnd(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    Q = (nH + 2 * nKV) * D
    weights = dict(qkv=rnd(Q, Din), o=rnd(H, nH * D), gate_up=rnd(2 * I, H), down=rnd(H, I))
    slots = torch.stack([torch.randperm(kv_len, generator=g)[:T] for _ in range(B)])
    mask = torch.rand(B, T, kv_len, generator=g) < 0.5
    mask[torch.arange(B)[:, None], torch.arange(T)[None], slots] = True
    if empty_query:
        mask[0, 0] = False  # sees nothing: zero attention output
    quantized = {k: ops.pack_linear_weight_int8(w) for k, w in weights.items() if k in int8}
    quantized.update({k: ops.pack_linear_weight_int4(w) for k, w in weights.items() if k in int4})
    return dict(
        x=rnd(B, T, Din), residual=rnd(B, T, H),
        packed={k: quantized[k].packed if k in quantized else ops.pack_linear_weight(w) for k, w in weights.items()},
        scales={k: q.scales for k, q in quantized.items()},
        group_scales={k: quantized[k].group_scales for k in int4},
        qkv_bias=rnd(Q) if bias else None, norm_weight=1 + rnd(H), input_norm_weight=1 + rnd(Din) if segments else None,
        segments=max(segments, 1), position_ids=torch.randint(0, 500, (B, T), generator=g),
        inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)),
        k_cache=rnd(B, nKV, S, D, scale=1.0), v_cache=rnd(B, nKV, S, D, scale=1.0), write_slots=slots, mask=mask,
        num_heads=nH, intermediate_size=I)


def _run(c, device, fn=None, validate=True):
    """(output, k_cache, v_cache) of the op (or ``fn``: the reference) on copies of the case's caches."""
    k, v = c["k_cache"].clone().to(device), c["v_cache"].clone().to(device)
    dev = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in c.items()
           if n not in ("packed", "scales", "group_scales")}
    p = {n: t.to(device) for n, t in c["packed"].items()}
    scales = {f"{n}_scales": t.to(device) for n, t in c.get("scales", {}).items()}
    scales.update({f"{n}_group_scales": t.to(device) for n, t in c.get("group_scales", {}).items()})
    if fn is None:
        out = ops.draft_decoder_layer(dev["x"], dev["residual"], p["qkv"], p["o"], dev["norm_weight"], p["gate_up"],
                                      p["down"], dev["position_ids"], dev["inv_freq"], k, v, dev["write_slots"],
                                      dev["mask"], c["num_heads"], c["intermediate_size"], 1e-5,
                                      qkv_bias=dev["qkv_bias"], input_norm_weight=dev["input_norm_weight"],
                                      input_norm_segments=c["segments"], validate=validate, **scales)
    else:
        out = fn(dev["x"], dev["input_norm_weight"], c["segments"], dev["residual"], p["qkv"], dev["qkv_bias"], p["o"],
                 dev["norm_weight"], p["gate_up"], p["down"], dev["position_ids"], dev["inv_freq"], k, v,
                 dev["write_slots"], dev["mask"], c["num_heads"], c["intermediate_size"], 1e-5, validate=validate,
                 **scales)
    return out.cpu(), k.cpu(), v.cpu()


def _assert_matches_reference(c, device, dtype):
    got, gk, gv = _run(c, device)
    want, wk, wv = _run(c, "cpu", ref.draft_decoder_layer)
    assert got.shape == c["residual"].shape and got.dtype == dtype
    scale = float(want.float().abs().max()) + 1.0
    # float32: accumulation order only; 16-bit types: a value that lands next to a rounding boundary may round to the
    # neighbouring value in one intermediate and carry that ulp through the later products (through an int8
    # product's input quantisation that ulp can move a row's scale: then the quantisation error, ~1% of the scale)
    int8 = bool(c["scales"]) and dtype is not torch.float32
    atol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2 if int8 else 4e-3}[dtype] * scale
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    cache_tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2 if int8 else 1e-2,
                 torch.float16: 2e-2 if int8 else 2e-3}[dtype]
    torch.testing.assert_close(gk.float(), wk.float(), atol=cache_tol, rtol=0)
    torch.testing.assert_close(gv.float(), wv.float(), atol=cache_tol, rtol=0)
    untouched = torch.ones_like(gk, dtype=torch.bool)
    for b, row in enumerate(c["write_slots"].tolist()):
        untouched[b, :, row] = False
    assert torch.equal(gk[untouched], c["k_cache"][untouched]) and torch.equal(gv[untouched], c["v_cache"][untouched])


@pytest.mark.parametrize("shape", [
    dict(),  # GQA (2 query heads per kv head), bias
    dict(nH=4, nKV=4, bias=False),  # MHA, no bias
    dict(nH=6, nKV=2, D=128, B=1, T=1, kv_len=1, S=3),  # one position, one key
    dict(B=3, T=7, kv_len=24, S=24),  # every slot of the cache in the mask
    dict(segments=2, Din=192),  # EAGLE-3: two RMS-normalised input halves
    dict(empty_query=True),
])
def test_matches_reference(device, dtype, shape):
    _assert_matches_reference(_case(dtype, **shape), device, dtype)


@pytest.mark.parametrize("int8", [("qkv", "o", "gate_up", "down"), ("qkv", "down"), ("o", "gate_up")])
@pytest.mark.parametrize("shape", [dict(), dict(segments=2, Din=192), dict(B=1, T=1, kv_len=1, S=3, bias=False)])
def test_int8_weights_match_reference(device, dtype, int8, shape):
    """A quantised draft's layer: the named weights int8 (each product then packed_linear_int8's, its input rows
    quantised in the layer), the others float, against the reference composed of the same products."""
    _assert_matches_reference(_case(dtype, int8=int8, **shape), device, dtype)


def test_int8_weights_are_the_int8_products():
    """Independently of the reference's layer: with every weight int8 the layer's qkv product is exactly
    packed_linear_int8 of its input (the cache holds the new values after RoPE, so read them at position 0, where
    RoPE is the identity) -- and it differs from the float layer (the weights really are the quantised ones)."""
    c = _case(torch.float32, int8=("qkv", "o", "gate_up", "down"), bias=False)
    c["position_ids"].zero_()
    _, k, v = _run(c, "cpu")
    qkv = ops.packed_linear_int8(c["x"], c["packed"]["qkv"], c["scales"]["qkv"])  # [B, T, Q]
    nH, D = c["num_heads"], 64
    nKV = c["k_cache"].shape[1]
    for b, row in enumerate(c["write_slots"].tolist()):
        for t, slot in enumerate(row):
            want_k = qkv[b, t, nH * D:(nH + nKV) * D].view(nKV, D)
            want_v = qkv[b, t, (nH + nKV) * D:].view(nKV, D)
            assert torch.equal(k[b, :, slot], want_k) and torch.equal(v[b, :, slot], want_v)
    float_case = _case(torch.float32, bias=False)
    float_case["position_ids"].zero_()
    assert not torch.equal(_run(float_case, "cpu")[0], _run(c, "cpu")[0])


@pytest.mark.parametrize("int8, int4", [((), ("qkv", "o", "gate_up", "down")), (("o",), ("qkv", "down")),
                                        ((), ("gate_up",))])
@pytest.mark.parametrize("shape", [dict(I=96), dict(segments=2, Din=192, I=64),
                                   dict(B=1, T=1, kv_len=1, S=3, bias=False, I=32)])
def test_int4_weights_match_reference(device, dtype, int8, int4, shape):
    """A quantised draft's layer with int4 weights (each product then packed_linear_int4's, its input rows quantised
    in the layer), beside int8 and float ones, against the reference composed of the same products."""
    _assert_matches_reference(_case(dtype, int8=int8, int4=int4, **shape), device, dtype)


def test_int4_weights_are_the_int4_products():
    """Independently of the reference's layer: with every weight int4 the layer's qkv product is exactly
    packed_linear_int4 of its input (read in the cache at position 0, where RoPE is the identity), and the layer
    differs from the int8 one (the weights really are the int4 ones)."""
    every = ("qkv", "o", "gate_up", "down")
    c = _case(torch.float32, int4=every, bias=False, I=96)
    c["position_ids"].zero_()
    _, k, v = _run(c, "cpu")
    qkv = ops.packed_linear_int4(c["x"], c["packed"]["qkv"], c["group_scales"]["qkv"], c["scales"]["qkv"])
    nH, D = c["num_heads"], 64
    nKV = c["k_cache"].shape[1]
    for b, row in enumerate(c["write_slots"].tolist()):
        for t, slot in enumerate(row):
            assert torch.equal(k[b, :, slot], qkv[b, t, nH * D:(nH + nKV) * D].view(nKV, D))
            assert torch.equal(v[b, :, slot], qkv[b, t, (nH + nKV) * D:].view(nKV, D))
    int8_case = _case(torch.float32, int8=every, bias=False, I=96)
    int8_case["position_ids"].zero_()
    assert not torch.equal(_run(int8_case, "cpu")[0], _run(c, "cpu")[0])


@pytest.mark.parametrize("change, message", [
    (lambda c: c["group_scales"].update(o=c["group_scales"]["o"][:, :-1].contiguous()),
     r"o_group_scales must be pack_linear_weight_int4's group scales for \[H, num_heads D\] = \[96, 256\]"),
    (lambda c: c["group_scales"].update(o=c["group_scales"]["o"].float()), r"o_group_scales must be Byte"),
    (lambda c: c["packed"].update(o=ops.pack_linear_weight_int8(torch.randn(96, 256)).packed), r"o_weight must be Byte"),
    (lambda c: (c["scales"].pop("o"),), r"o_group_scales is given without o_scales"),
    (lambda c: (c["packed"].update(down=ops.pack_linear_weight_int4(torch.randn(96, 80)).packed),
                c["scales"].update(down=torch.ones(96)),
                c["group_scales"].update(down=ops.pack_linear_weight_int4(torch.randn(96, 80)).group_scales)),
     r"the in_features of \[H, intermediate_size\] must be a multiple of 32 for an int4 weight"),
])
def test_bad_int4_arguments_name_the_argument(device, change, message):
    c = _case(torch.float32, int4=("o",))
    change(c)
    with pytest.raises(ValueError, match=message):
        _run(c, device)


@pytest.mark.parametrize("change, message", [
    (lambda c: c["scales"].update(o=c["scales"]["o"][:-1]), r"o_scales must have shape \[96\]"),
    (lambda c: c["scales"].update(o=c["scales"]["o"].double()), r"o_scales must be Float"),
    (lambda c: c["packed"].update(o=ops.pack_linear_weight(torch.randn(96, 256))),
     r"o_weight must be Char"),
    (lambda c: c["packed"].update(o=ops.pack_linear_weight_int8(torch.randn(64, 256)).packed),
     r"o_weight \(with o_scales\) must be "
     r"pack_linear_weight_int8's output for \[H, num_heads D\] = \[96, 256\]"),
    (lambda c: c["scales"].update(qkv=torch.ones(512)), r"qkv_weight must be Char"),  # scales for a float weight
])
def test_bad_int8_arguments_name_the_argument(device, change, message):
    c = _case(torch.float32, int8=("o",))
    change(c)
    with pytest.raises(ValueError, match=message):
        _run(c, device)


def test_query_that_sees_nothing_gets_zero_attention(device):
    """With all of its mask False a position's attention is zero: its output is residual + MLP(norm(residual))."""
    c = _case(torch.float32, empty_query=True)
    got, _, _ = _run(c, device)
    zero_o = dict(c, packed=dict(c["packed"], o=ops.pack_linear_weight(torch.zeros(96, 4 * 64))))
    want, _, _ = _run(zero_o, device)
    torch.testing.assert_close(got[0, 0], want[0, 0], atol=1e-6, rtol=0)


def test_a_row_attends_over_its_own_keys_only(device, dtype):
    """A row whose mask ends early (a short row in a batch whose mask spans a long one: [B, T, kv_len] with kv_len
    the longest row's) gives what it gives alone, and never reads the slots past its last visible key (NaN there
    stays out of its output)."""
    c = _case(dtype, B=3, T=3, kv_len=200, S=256, seed=4)
    g = make_gen(5)
    own = 10
    c["write_slots"][0] = torch.tensor([3, 5, 7])
    c["mask"][0] = False
    c["mask"][0, :, :own] = torch.rand(3, own, generator=g) < 0.5
    c["mask"][0, torch.arange(3), c["write_slots"][0]] = True
    for cache in (c["k_cache"], c["v_cache"]):
        cache[0, :, own:] = float("nan")
    batch, _, _ = _run(c, device)
    alone = dict(c, **{n: c[n][:1] for n in ("x", "residual", "position_ids", "k_cache", "v_cache", "write_slots")},
                 mask=c["mask"][:1, :, :own])
    got, _, _ = _run(alone, device)
    assert torch.equal(batch[0], got[0]) and bool(batch.float().isfinite().all())


def test_bad_write_slot(device):
    c = _case(torch.float32)
    c["write_slots"][1, 2] = 24  # S = 24
    with pytest.raises(ValueError, match=r"write_slots\[1, 2\] = 24 is out of range \[0, S\)"):
        _run(c, device)
    with pytest.raises(ValueError, match=r"write_slots\[1, 2\] = 24 is out of range \[0, S\)"):
        _run(c, "cpu", ref.draft_decoder_layer)
    out, k, v = _run(c, device, validate=False)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the bad row: zeros, and none of its slots written
    assert torch.equal(k[1], c["k_cache"][1]) and torch.equal(v[1], c["v_cache"][1])
    good, _, _ = _run(dict(c, write_slots=c["write_slots"][:1], **{n: c[n][:1] for n in (
        "x", "residual", "position_ids", "mask", "k_cache", "v_cache")}), device)
    torch.testing.assert_close(out[0], good[0], atol=0, rtol=0)  # the good row is unaffected


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(mask=c["mask"].new_ones(2, 3, 25)), r"mask must have shape \[B, T, kv_len\]"),
    (lambda c: c.update(mask=c["mask"].float()), r"mask must be Bool"),
    (lambda c: c["packed"].update(o=c["packed"]["qkv"]), r"o_weight must be pack_linear_weight's output"),
    (lambda c: c["packed"].update(down=c["packed"]["down"].to(torch.bfloat16)), r"down_weight must have x's dtype"),
    (lambda c: c.update(qkv_bias=c["qkv_bias"][:-1]), r"qkv_bias must have shape \[512\]"),
    (lambda c: c.update(num_heads=3), r"num_heads must be a positive multiple"),
    (lambda c: c.update(k_cache=c["k_cache"][..., :32].contiguous(), v_cache=c["v_cache"][..., :32].contiguous()),
     r"head dim D = 32"),
    (lambda c: c.update(inv_freq=c["inv_freq"].double()), r"inv_freq must be Float"),
    (lambda c: c.update(position_ids=c["position_ids"][:, :2]), r"position_ids must have shape \[B, N\]"),
    (lambda c: c.update(residual=c["residual"][:1]), r"residual must have shape \[B, T, H\]"),
    (lambda c: c.update(input_norm_weight=c["x"][0, 0], segments=5), r"input_norm_segments must be >= 1 and divide"),
])
def test_bad_arguments_name_the_argument(device, change, message):
    c = _case(torch.float32)
    change(c)
    with pytest.raises(ValueError, match=message):
        _run(c, device)


def test_intermediate_size_the_packed_weights_do_not_hold_is_refused(device):
    """bfloat16 packs K in pairs and N in panels of 32: intermediate_size 79 for weights of 80 passes every shape
    check, and would have split gate from up one row off. The padding rows' marker (params.h) catches it on CPU, as
    in the reference."""
    c = _case(torch.bfloat16)
    c["intermediate_size"] = 79
    message = ("draft_decoder_layer: gate_up_weight holds 160 output features (pack_linear_weight's output for a "
               "weight of 160 rows) but the first dimension of [2 intermediate_size, H] = 158")
    with pytest.raises(ValueError) as info:
        _run(c, "cpu", ref.draft_decoder_layer)
    assert str(info.value) == message
    if device == "cpu":
        with pytest.raises(ValueError) as info:
            _run(c, device)
        assert str(info.value).splitlines()[0] == message


@pytest.mark.parametrize("slot", [2**63 - 1, 2**63 - 2, -2**63, -1])
def test_write_slots_at_the_int64_ends(device, slot):
    c = _case(torch.float32)
    c["write_slots"][1, 0] = slot
    with pytest.raises(ValueError) as info:
        _run(c, "cpu", ref.draft_decoder_layer)
    message = str(info.value)
    assert message == (f"draft_decoder_layer: write_slots[1, 0] = {slot} is out of range [0, S) (S: the cache's "
                       "positions)")
    with pytest.raises(ValueError) as info:
        _run(c, device)
    assert str(info.value).splitlines()[0] == message
    out, k, v = _run(c, device, validate=False)
    assert torch.equal(k[1], c["k_cache"][1]) and torch.equal(v[1], c["v_cache"][1])  # nothing written


@pytest.mark.parametrize("change, message", [
    # (num_heads + 2 nKV) * D wrapped to a small Q for num_heads = 2^62 (D = 64): overflow-checked now
    (dict(num_heads=2**62), r"num_heads \* D = 4611686018427387904 \* 64 overflows int64"),
    (dict(num_heads=2**63 - 1), r"num_heads must be a positive multiple"),
    (dict(num_heads=2**63 - 2), r"num_heads \* D = .* overflows int64"),
    (dict(intermediate_size=2**62), r"2 \* intermediate_size = 2 \* 4611686018427387904 overflows int64"),
    (dict(intermediate_size=2**63 - 1), r"overflows int64"),
    (dict(intermediate_size=-2**63), r"intermediate_size must be >= 1"),
    (dict(segments=2**63 - 1), r"input_norm_segments must be >= 1 and divide"),
])
def test_sizes_at_the_int64_ends(change, message):
    c = _case(torch.float32, segments=2)
    c.update(change)
    with pytest.raises(ValueError, match=message):
        _run(c, "cpu")


def test_caches_that_alias_are_refused():
    """k_cache and v_cache are written in place: one tensor for both, or a cache over an input, is refused."""
    c = _case(torch.float32)
    p = c["packed"]

    def call(k, v, x=c["x"]):
        return ops.draft_decoder_layer(x, c["residual"], p["qkv"], p["o"], c["norm_weight"], p["gate_up"], p["down"],
                                       c["position_ids"], c["inv_freq"], k, v, c["write_slots"], c["mask"],
                                       c["num_heads"], c["intermediate_size"], 1e-5, qkv_bias=c["qkv_bias"])

    k = c["k_cache"].clone()
    with pytest.raises(ValueError, match=r"k_cache and v_cache share memory"):
        call(k, k)
    both = torch.cat([c["k_cache"], c["v_cache"]], 0).view(2, *c["k_cache"].shape)
    out = call(both[0], both[1])  # two halves of one storage: disjoint, accepted, the same bits as two tensors
    k2, v2 = c["k_cache"].clone(), c["v_cache"].clone()
    assert torch.equal(out, call(k2, v2)) and torch.equal(both[0], k2) and torch.equal(both[1], v2)
    flat = torch.zeros(k.numel() + c["x"].numel())
    k_view = flat[:k.numel()].view(k.shape)
    x_view = flat[k.numel() - 1:k.numel() - 1 + c["x"].numel()].view(c["x"].shape)  # one element shared
    with pytest.raises(ValueError, match=r"k_cache and x share memory"):
        call(k_view, c["v_cache"].clone(), x=x_view)


def test_cuda_inputs_must_share_a_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU to mix devices")
    c = _case(torch.float32)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        ops.draft_decoder_layer(c["x"].cuda(), c["residual"], c["packed"]["qkv"], c["packed"]["o"], c["norm_weight"],
                                c["packed"]["gate_up"], c["packed"]["down"], c["position_ids"], c["inv_freq"],
                                c["k_cache"], c["v_cache"], c["write_slots"], c["mask"], 4, 80, 1e-5)


# ---- the EAGLE layers take the op ---------------------------------------------------------------------------------


def _eagle(version, dtype):
    cfg = E.EagleConfig(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=64, head_dim=64, rms_norm_eps=1e-5, draft_vocab_size=32 if version == 3 else None)
    torch.manual_seed(version)
    m = E.Eagle1Model(cfg, fc_bias=True, attention_bias=True) if version == 1 else E.Eagle3Model(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m.to(dtype).eval()


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_eagle_layer_op_matches_module_path(monkeypatch, version, dtype):
    """A cached forward through the op (the drafter's calls) equals the module path (SDPA, module RMSNorms): same
    outputs within the dtype's rounding, same cache writes; and the op really ran (counted)."""
    m = _eagle(version, dtype)
    from specdec_ext.models.fast_linear import packed_operand

    if packed_operand((m.fc,)) is None:
        pytest.skip(f"no packed {dtype} kernel path on this CPU: the layer takes the module path only")
    g = make_gen(3)
    B, T, S, kv = 2, 4, 40, 30
    hidden = torch.randn(B, T, m.feature_size, generator=g).to(dtype)
    embeds = torch.randn(B, T, 128, generator=g).to(dtype)
    pos = torch.randint(0, 300, (B, T), generator=g)
    slots = torch.stack([torch.randperm(kv, generator=g)[:T] for _ in range(B)])
    mask = torch.rand(B, T, kv, generator=g) < 0.6
    mask[torch.arange(B)[:, None], torch.arange(T)[None], slots] = True
    calls = []
    real = ops.draft_decoder_layer
    monkeypatch.setattr(ops, "draft_decoder_layer", lambda **kw: calls.append(1) or real(**kw))
    results = []
    for rows in (DL.NATIVE_LAYER_MAX_ROWS, 0):
        monkeypatch.setattr(DL, "NATIVE_LAYER_MAX_ROWS", rows)
        cache = E.EagleKVCache(B, 2, S, 64, dtype, "cpu")
        cache.k.copy_(torch.randn(cache.k.shape, generator=make_gen(4)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=make_gen(5)))
        with torch.no_grad():
            out = m(hidden, embeds, pos, mask=mask, cache=cache, write_slots=slots, kv_len=kv)
        results.append((out, cache.k.clone(), cache.v.clone()))
    assert len(calls) == 1  # the first forward only
    (a, ka, va), (b, kb, vb) = results
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol * (1 + float(b.float().abs().max())), rtol=0)
    torch.testing.assert_close(ka.float(), kb.float(), atol=tol, rtol=0)
    torch.testing.assert_close(va.float(), vb.float(), atol=tol, rtol=0)


def test_eagle_layer_keeps_the_module_path_with_gradients():
    """Training (gradients through the draft) never takes the op, which has no autograd."""
    m = _eagle(1, torch.float32).train()
    B, T = 1, 3
    cache = E.EagleKVCache(B, 2, 8, 64, torch.float32, "cpu")
    out = m(torch.randn(B, T, 128), torch.randn(B, T, 128), torch.arange(T)[None],
            mask=torch.ones(B, T, 8, dtype=torch.bool), cache=cache, write_slots=torch.arange(T)[None], kv_len=8)
    out.sum().backward()
    assert m.fc.weight.grad is not None and m.layers[0].self_attn.q_proj.weight.grad is not None


def test_eagle_layer_keeps_the_module_path_for_unusual_calls(monkeypatch):
    """A float (additive) mask, a trainable parameter with gradients on, or no write slots: the module path runs
    (the op takes bool masks and has no autograd), with its own results and errors."""
    m = _eagle(1, torch.float32)
    from specdec_ext.models.fast_linear import packed_operand

    if packed_operand((m.fc,)) is None:
        pytest.skip("no packed float32 kernel path on this CPU: the layer takes the module path only")
    calls = []
    real = ops.draft_decoder_layer
    monkeypatch.setattr(ops, "draft_decoder_layer", lambda **kw: calls.append(1) or real(**kw))
    B, T, S = 1, 2, 8
    args = (torch.randn(B, T, 128), torch.randn(B, T, 128), torch.arange(T)[None])
    cache = E.EagleKVCache(B, 2, S, 64, torch.float32, "cpu")
    bool_mask = torch.ones(B, T, S, dtype=torch.bool)
    with torch.no_grad():
        m(*args, mask=bool_mask, cache=cache, write_slots=torch.arange(T)[None], kv_len=S)
        assert len(calls) == 1
        m(*args, mask=torch.zeros(B, T, S), cache=cache, write_slots=torch.arange(T)[None], kv_len=S)
        assert len(calls) == 1
    m.requires_grad_(False)
    m.layers[0].mlp.down_proj.weight.requires_grad_(True)  # one trainable parameter, gradients on
    out = m(*args, mask=bool_mask, cache=cache, write_slots=torch.arange(T)[None], kv_len=S)
    assert len(calls) == 1 and out.requires_grad
