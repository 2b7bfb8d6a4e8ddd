"""torch.library.opcheck for every op (schema, fake / meta implementation, autograd registration, AOT dispatch),
and a torch.compile(fullgraph=True) smoke test through the typed wrappers."""

from __future__ import annotations

import pytest
import torch

import specdec_ext
from helpers import make_gen, ops, plant_path, random_parents, random_tokens

OPS = torch.ops.specdec_ext


def _inputs(device, dtype=torch.float32, B=2, N=5, V=11):
    gen = make_gen(0)
    parents = random_parents(B, N, gen)
    tokens = random_tokens(B, N, V, gen)
    tokens[:, 0] = 0
    logits = torch.randn(B, N, V, generator=gen)
    plant_path(logits, tokens, parents, gen, boost=4.0)
    q = torch.softmax(torch.randn(B, N, V, generator=gen), -1)
    u = torch.rand(B, N, generator=gen)
    d = dict(parents=parents, tokens=tokens, logits=logits.to(dtype), q=q, u=u, u1=u[:, 0].contiguous(),
             T=torch.tensor([1.0, 0.7]), k=torch.tensor([0, 3]), p=torch.tensor([1.0, 0.9]),
             prefix=torch.tensor([0, 7]), scores=torch.randn(B, N, generator=gen))
    return {k: v.to(device) for k, v in d.items()}


def _cases(device, dtype):
    x = _inputs(device, dtype)
    a = _attention_inputs(device, dtype)
    cases = []
    for validate in (True, False):
        cases += [
            ("build_tree", (x["parents"], x["prefix"], validate)),
            ("tree_ancestor_mask", (x["parents"], False, validate)),
            ("tree_ancestor_mask", (x["parents"], True, validate)),
            ("verify_tree_greedy", (x["logits"], x["tokens"], x["parents"], validate)),
            ("verify_tree_sampling", (x["logits"], x["tokens"], x["parents"], x["q"], x["u"], x["T"], x["k"], x["p"],
                                      validate)),
            ("verify_tree_sampling", (x["logits"], x["tokens"], x["parents"], None, x["u"], x["T"], x["k"], x["p"],
                                      validate)),
            ("verify_tree_typical", (x["logits"], x["tokens"], x["parents"], x["u1"], x["T"], 0.09, 0.3, validate)),
            ("sample_tokens", (x["logits"][:, 0], x["u1"], x["T"], x["k"], x["p"], validate)),
            ("expand_tree_step", (x["logits"], x["scores"], 3, 4, validate)),
            ("tree_attention", (a["q"], a["k"], a["v"], a["prefix"], a["dense"], 0.125, validate)),
            ("tree_attention", (a["q"], a["k"], a["v"], a["prefix"], a["packed"], 0.125, validate)),
            ("compact_kv", ([a["k"].clone(), a["v"].clone()], a["src"], a["dst"], a["len"], 2, validate)),
        ]
    gen = make_gen(2)
    w = torch.randn(37, 21, generator=gen).to(device=device, dtype=dtype)
    xs = torch.randn(3, 21, generator=gen).to(device=device, dtype=dtype)
    bias = torch.randn(37, generator=gen).to(device=device, dtype=dtype)
    packed = OPS.pack_linear_weight(w)
    cases += [("pack_linear_weight", (w,)), ("packed_linear", (xs, packed, bias, 37)),
              ("packed_linear", (xs[None], packed, None, 37))]
    cases += [("draft_decoder_layer", _draft_layer_args(device, dtype, eagle3)) for eagle3 in (False, True)]
    cases += [("draft_decoder_layer", _draft_layer_args(device, dtype, False, quant)) for quant in ("int8", "int4")]
    cases += [("advance_tree_frontier", _frontier_args(device)), ("select_tree_nodes", _selection_args(device))]
    packed8, scales8 = OPS.pack_linear_weight_int8(w)
    cases += [("pack_linear_weight_int8", (w,)), ("packed_linear_int8", (xs, packed8, scales8, bias)),
              ("packed_linear_int8", (xs[None], packed8, scales8, None))]
    int4 = tuple(OPS.pack_linear_weight_int4(w))
    cases += [("pack_linear_weight_int4", (w,)), ("packed_linear_int4", (xs, *int4, bias)),
              ("packed_linear_int4", (xs[None], *int4, None))]
    return cases + _recurrent_cases(device, dtype)


def _recurrent_cases(device, dtype):
    """The recurrent tree ops and their commits (B = 2 rows of a 5-node tree, 3 heads, float32 states)."""
    gen = make_gen(6)
    B, H, N, Dk, Dv, C, K = 2, 3, 5, 4, 6, 7, 4

    def rnd(*shape, float32=False):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.float32 if float32 else dtype)

    parents = random_parents(B, N, gen).to(device)
    path, lengths = torch.tensor([[0, 1, -1], [0, -1, -1]], device=device), torch.tensor([2, 1], device=device)
    parents[:, 1] = 0
    q, k, v = rnd(B, H, N, Dk), rnd(B, H, N, Dk), rnd(B, H, N, Dv)
    state, decay = rnd(B, H, Dk, Dv, float32=True), -torch.rand(H, generator=gen).to(device)
    g, beta = -rnd(B, H, N, float32=True).abs(), rnd(B, H, N, float32=True).sigmoid()
    x, conv = rnd(B, C, N), rnd(B, C, K - 1, float32=True)
    A, D = -rnd(H, float32=True).abs(), rnd(H, float32=True)
    cases = []
    for validate in (True, False):
        cases += [
            ("tree_linear_attention", (q, k, v, state, decay, parents, validate)),
            ("commit_linear_state", (state.clone(), k, v, decay, path, lengths, validate)),
            ("tree_causal_conv1d", (x, conv, rnd(C, K), rnd(C) if validate else None, parents,
                                    "silu" if validate else None, validate)),
            ("commit_conv_state", (conv.clone(), x, path, lengths, validate)),
            ("tree_gated_delta_rule", (q, k, v, g, beta, state, parents, validate)),
            ("commit_gated_delta_state", (state.clone(), k, v, g, beta, path, lengths, validate)),
            ("tree_selective_state", (v, g.abs(), A, q, k, D, state.transpose(2, 3).contiguous(), parents,
                                      validate)),
            ("commit_selective_state", (state.transpose(2, 3).contiguous(), v, g.abs(), A, q, path, lengths,
                                        validate)),
        ]
    return cases


def _frontier_args(device):
    gen = make_gen(4)
    B, F, K, S, C, L = 2, 3, 2, 3, 9, 12
    return (torch.randint(0, 50, (B, F, K), generator=gen).to(device), torch.randn(B, F, K, generator=gen).to(device),
            torch.tensor([[0, 5, 2], [1, 3, 4]], device=device), (torch.rand(B, F, C, generator=gen) < 0.5).to(device),
            C - S - 1, torch.randint(0, C, (B, L), generator=gen).to(device), True)


def _selection_args(device):
    gen = make_gen(5)
    scores = -torch.rand(2, 6, generator=gen).cumsum(1)  # children score below their parents
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2], [-1, -1, 1, 1, 0, 3]])
    return (torch.randint(0, 50, (2, 6), generator=gen).to(device), scores.to(device), parents.to(device),
            torch.tensor([3, 4], device=device), 4, True)


def _draft_layer_args(device, dtype, eagle3: bool, quant: str | None = None):
    """draft_decoder_layer's arguments: B = 2 rows of T = 3 positions, H = 64, 2 query and 1 kv heads of D = 64,
    I = 40, S = 10 cache slots, kv_len = 8; EAGLE-3's two normalised input halves, or EAGLE-1's bias; with
    ``quant="int8"``, the qkv and down weights packed as int8 with their scales (o and gate_up float); with
    ``"int4"``, the qkv and o weights as int4 with their scales and group scales (gate_up and down float)."""
    gen = make_gen(3)
    B, T, H, nH, nKV, D, I, S = 2, 3, 64, 2, 1, 64, 40, 10
    Din = 2 * H if eagle3 else H

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(device=device, dtype=dtype)

    def packed(n, k):
        return OPS.pack_linear_weight(rnd(n, k))

    def weight(n, k, kind):  # (packed, scales, group scales)
        if kind == "int8":
            return (*OPS.pack_linear_weight_int8(rnd(n, k)), None)
        if kind == "int4":
            w_packed, group_scales, scales = OPS.pack_linear_weight_int4(rnd(n, k))
            return w_packed, scales, group_scales
        return packed(n, k), None, None

    Q = (nH + 2 * nKV) * D
    qkv, o, down = weight(Q, Din, quant), weight(H, nH * D, quant if quant == "int4" else None), \
        weight(H, I, quant if quant == "int8" else None)
    mask = torch.rand(B, T, 8, generator=gen) < 0.5
    slots = torch.tensor([[0, 5, 6], [7, 1, 2]])
    mask[torch.arange(B)[:, None], torch.arange(T)[None], slots] = True
    return (rnd(B, T, Din), rnd(Din) if eagle3 else None, 2 if eagle3 else 1, rnd(B, T, H), qkv[0],
            None if eagle3 else rnd(Q), o[0], rnd(H), packed(2 * I, H), down[0],
            torch.randint(0, 100, (B, T), generator=gen).to(device), torch.rand(D // 2, generator=gen).to(device),
            rnd(B, nKV, S, D), rnd(B, nKV, S, D), slots.to(device), mask.to(device), nH, I, 1e-5, qkv[1], o[1],
            None, down[1], qkv[2], o[2], None, None, True)


def _attention_inputs(device, dtype):
    gen = make_gen(1)
    B, H, Hkv, N, D, S = 2, 4, 2, 5, 64, 16
    parents = random_parents(B, N, gen)
    d = dict(q=torch.randn(B, H, N, D, generator=gen).to(dtype), k=torch.randn(B, Hkv, S, D, generator=gen).to(dtype),
             v=torch.randn(B, Hkv, S, D, generator=gen).to(dtype), prefix=torch.tensor([3, 11]),
             dense=ops.tree_ancestor_mask(parents), packed=ops.tree_ancestor_mask(parents, packed=True),
             src=torch.tensor([[4, 6, 7], [12, 13, 15]]), dst=torch.tensor([3, 11]), len=torch.tensor([3, 2]))
    return {k: v.to(device) for k, v in d.items()}


@pytest.mark.parametrize("index", range(55))
def test_opcheck(device, dtype, index):
    name, args = _cases(device, dtype)[index]
    if dtype != torch.float32 and name in ("build_tree", "tree_ancestor_mask", "advance_tree_frontier",
                                           "select_tree_nodes"):
        pytest.skip("tree ops take no float input: covered by the float32 variant")
    torch.library.opcheck(getattr(OPS, name).default, args)


def test_meta_shapes():
    """The fakes give every output's shape and dtype without data (meta tensors)."""
    x = _inputs("meta", B=3, N=6, V=13)
    info = ops.build_tree(x["parents"], x["prefix"][:1].expand(3))
    assert [tuple(t.shape) for t in info] == [(3, 6)] * 4 + [(3, 6, 6), (3,)]
    assert ops.tree_ancestor_mask(x["parents"], packed=True).dtype == torch.int32
    v = ops.verify_tree_greedy(x["logits"], x["tokens"], x["parents"])
    assert [tuple(t.shape) for t in v] == [(3, 6), (3,), (3,)] and all(t.dtype == torch.int64 for t in v)
    toks, scores, sel = ops.expand_tree_step(x["logits"], x["scores"], 4, 9)
    assert toks.shape == (3, 6, 4) and scores.dtype == torch.float32 and sel.shape == (3, 9)
    a = _attention_inputs("meta", torch.bfloat16)
    out = ops.tree_attention(a["q"], a["k"], a["v"], a["prefix"], a["packed"])
    assert out.shape == a["q"].shape and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert ops.compact_kv([a["k"], a["v"]], a["src"], a["dst"], a["len"]) is None
    layer = OPS.draft_decoder_layer(*(t.to("meta") if isinstance(t, torch.Tensor) else t
                                      for t in _draft_layer_args("cpu", torch.bfloat16, True)))
    assert layer.shape == (2, 3, 64) and layer.dtype == torch.bfloat16 and layer.device.type == "meta"
    frontier = OPS.advance_tree_frontier(*(t.to("meta") if isinstance(t, torch.Tensor) else t
                                           for t in _frontier_args("cpu")))
    assert [tuple(t.shape) for t in frontier] == [(2, 3), (2, 3), (2, 3), (2, 3, 9), (2, 3, 12)]
    tree = OPS.select_tree_nodes(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in _selection_args("cpu")))
    assert [tuple(t.shape) for t in tree] == [(2, 5), (2, 5)] and tree[0].dtype == torch.int64


@pytest.mark.parametrize("index", range(55))
def test_a_meta_tensor_among_cpu_ones_is_refused(index):
    """One argument on the meta device, the rest on CPU: the dispatcher picks the fake (Meta outranks CPU), which
    used to return uninitialised tensors as results; it must raise naming the argument and both devices (the
    glue's own message, run by the fake: fakes._checks). Every tensor argument of every case, in turn."""
    name, args = _cases("cpu", torch.float32)[index]
    op = getattr(OPS, name).default
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) or isinstance(a, list)]
    for i in positions:
        moved = list(args)
        if isinstance(args[i], list):
            moved[i] = [*args[i][:-1], args[i][-1].to("meta")]
        else:
            moved[i] = args[i].to("meta")
        if len(positions) == 1 and not isinstance(args[i], list):  # the only tensor: all on meta, shapes only
            out = op(*moved)
            assert all(t.device.type == "meta" for t in (out if isinstance(out, tuple) else (out,)))
            continue
        with pytest.raises(ValueError, match=rf"^{name}: (\S+ is on (meta but \S+ is on cpu|cpu but \S+ is on meta); "
                                             r"all tensors must be on one device|every cache must have caches\[0\]'s "
                                             r"shape .* and device (cpu|meta); caches\[\d+\] has .*, (meta|cpu)$)"):
            op(*moved)


def _to_meta(a):
    if isinstance(a, list):
        return [_to_meta(x) for x in a]
    return a.to("meta") if isinstance(a, torch.Tensor) else a


def _spoiled(args, position: int):
    """args with the tensor at ``position`` (a list: its last element) given a wrong dtype: float64 for a float or
    integer tensor, int64 for a bool one."""
    def spoil(t):
        return t.to(torch.int64) if t.dtype == torch.bool else t.to(torch.float64 if t.dtype != torch.float64
                                                                      else torch.float32)
    out = list(args)
    a = args[position]
    out[position] = [*a[:-1], spoil(a[-1])] if isinstance(a, list) else spoil(a)
    return out


@pytest.mark.parametrize("index", range(55))
def test_all_meta_calls_are_refused_as_cpu_calls_are(index):
    """Every tensor argument in turn given a wrong dtype: when the CPU op refuses it, the same call on meta tensors
    (which only the fake sees) raises the same ValueError, word for word; when the CPU op takes it, so does meta."""
    name, args = _cases("cpu", torch.float32)[index]
    op = getattr(OPS, name).default
    refused = 0
    for i, a in enumerate(args):
        if not isinstance(a, (torch.Tensor, list)):
            continue
        bad = _spoiled(args, i)
        try:
            op(*[x.clone() if isinstance(x, torch.Tensor) else [y.clone() for y in x] if isinstance(x, list) else x
                 for x in bad])
        except ValueError as err:
            refused += 1
            with pytest.raises(ValueError) as meta_err:
                op(*_to_meta(bad))
            assert str(meta_err.value).replace("meta", "cpu") == str(err)  # (messages naming the device)
        else:
            op(*_to_meta(bad))
    assert refused >= 1  # every op checks the dtype of at least one of its tensors


def test_meta_calls_meet_the_scalar_checks():
    """Scalar arguments too: an expand_tree_step num_select beyond F * top_k (the size of an output) and a negative
    top_k are refused on meta as on CPU, before any allocation."""
    x = _inputs("cpu")
    for top_k, num_select in ((3, 2**63 - 2), (-1, 1)):
        with pytest.raises(ValueError) as cpu_err:
            ops.expand_tree_step(x["logits"], x["scores"], top_k, num_select)
        with pytest.raises(ValueError) as meta_err:
            ops.expand_tree_step(x["logits"].to("meta"), x["scores"].to("meta"), top_k, num_select)
        assert str(meta_err.value) == str(cpu_err.value)


def test_every_case_is_checked():
    assert len(_cases("cpu", torch.float32)) == 55  # (the parametrisation of test_opcheck)


def test_built_with_cuda_is_bool():
    assert isinstance(specdec_ext.built_with_cuda(), bool)


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    """One compiled step (tree topology, mask, greedy and sampling verification, draft sampling, expansion) through
    the wrappers, with Python-number and tensor parameters, equals eager."""

    def step(logits, tokens, parents, q, u, scores):
        info = ops.build_tree(parents, 4)
        mask = ops.tree_ancestor_mask(parents, packed=True)
        g = ops.verify_tree_greedy(logits, tokens, parents)
        s = ops.verify_tree_sampling(logits, tokens, parents, u, q, temperature=0.8, top_k=5, top_p=0.9)
        t = ops.verify_tree_typical(logits, tokens, parents, u[:, 0].contiguous(), torch.full((2,), 0.7,
                                    device=logits.device))
        d_tok, d_probs = ops.sample_tokens(logits[:, 0], u[:, 1].contiguous(), temperature=1.1, top_k=4)
        e = ops.expand_tree_step(logits, scores, 3, 5)
        return (*info, mask, *g, *s, *t, d_tok, d_probs, *e, info.position_ids + g.accept_len[:, None])

    x = _inputs(device)
    args = (x["logits"], x["tokens"], x["parents"], x["q"], x["u"], x["scores"])
    eager = step(*args)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(*args)
    assert len(compiled) == len(eager)
    for a, b in zip(compiled, eager):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.slow
def test_torch_compile_attention_and_compaction(device):
    """tree_attention and the in-place compact_kv (a mutating op) under torch.compile(fullgraph=True) equal eager,
    including the mutation of the caches."""

    def step(q, k, v, parents, src):
        mask = ops.tree_ancestor_mask(parents, packed=True)
        out = ops.tree_attention(q, k, v, 3, mask)
        ops.compact_kv([k, v], src, 3, 2)
        return out * 2

    gen = make_gen(2)
    q, k, v = (torch.randn(*s, generator=gen).to(device) for s in [(2, 4, 5, 64), (2, 2, 12, 64), (2, 2, 12, 64)])
    parents, src = random_parents(2, 5, gen).to(device), torch.tensor([[5, 7], [4, 6]], device=device)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    eager = step(q, k1, v1, parents, src)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q, k2, v2, parents, src)
    assert torch.equal(compiled, eager) and torch.equal(k2, k1) and torch.equal(v2, v1)
    assert not torch.equal(k2, k)
