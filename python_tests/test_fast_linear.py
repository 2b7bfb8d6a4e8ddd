"""Linear layers with packed weights (specdec_ext.models.fast_linear): the packed paths (the packed_linear kernel,
or oneDNN for bfloat16 where the kernel has no vector path) against ``F.linear`` in float64, the caches following
in-place weight updates, training untouched, and the EAGLE draft networks in bfloat16 (packed, fused q/k/v and
gate/up) against the same network in float32."""

import copy

import pytest
import torch
import torch.nn.functional as F

from specdec_ext.models import fast_linear
from specdec_ext.models.eagle import Eagle1Model, Eagle3Model, EagleConfig
from specdec_ext.models.fast_linear import Linear, fused_linear, linear, module_linear

needs_packed = pytest.mark.skipif(not fast_linear.packed_enabled(),
                                  reason="this CPU / torch build has no packed bfloat16 oneDNN linear")


def _ref(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _bf16_close(got, want):
    # bfloat16 inputs, float32 accumulation, one bfloat16 rounding of the result
    torch.testing.assert_close(got.double(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


@needs_packed
@pytest.mark.parametrize("shape", [(1, 96), (4, 96), (2, 3, 96), (65, 96)])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_packed_matches_float64(shape, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16() if bias else None
    x = torch.randn(*shape, generator=g).bfloat16()
    out = linear(x, w, b)
    assert out.shape == (*shape[:-1], 200) and out.dtype == torch.bfloat16
    assert fast_linear._PACKED.get(w) is not None  # the packed path was taken
    _bf16_close(out, _ref(x, w, b))
    # a non-contiguous input
    xs = torch.randn(shape[0], 192, generator=g).bfloat16()[:, ::2]
    _bf16_close(linear(xs, w, b), _ref(xs, w, b))


@needs_packed
@torch.no_grad()
def test_cache_follows_in_place_updates_and_replacement():
    lin = Linear(32, 48).bfloat16()
    x = torch.randn(3, 32).bfloat16()
    first = lin(x)
    lin.weight.mul_(-2)  # in place: version counter
    _bf16_close(lin(x), _ref(x, lin.weight, lin.bias))
    assert not torch.equal(lin(x), first)
    lin.weight = torch.nn.Parameter(torch.randn(48, 32).bfloat16())  # replaced
    _bf16_close(lin(x), _ref(x, lin.weight, lin.bias))


@needs_packed
def test_inference_mode_weights():
    with torch.inference_mode():
        w = torch.randn(40, 24).bfloat16()  # an inference tensor: no version counter
    x = torch.randn(3, 24).bfloat16()
    _bf16_close(linear(x, w), _ref(x, w))
    with torch.inference_mode():
        _bf16_close(linear(x, w), _ref(x, w))
        layers = [Linear(24, 8).bfloat16(), Linear(24, 4, bias=False).bfloat16()]
        want = torch.cat([_ref(x, lay.weight, lay.bias) for lay in layers], -1)
        _bf16_close(fused_linear(x, layers), want)


def test_training_and_other_dtypes_take_aten():
    lin = Linear(16, 8)
    x = torch.randn(5, 16, requires_grad=True)
    for dtype in (torch.float64, torch.float16):  # no packed path for these dtypes
        l2 = copy.deepcopy(lin).to(dtype)
        with torch.no_grad():
            assert torch.equal(l2(x.detach().to(dtype)), F.linear(x.detach().to(dtype), l2.weight, l2.bias))
    for dtype in (torch.float32, torch.bfloat16):
        lb = copy.deepcopy(lin).to(dtype)
        xb = x.detach().to(dtype).requires_grad_()
        out = lb(xb)  # gradients recorded: aten, exactly
        out.float().sum().backward()
        assert lb.weight.grad is not None and xb.grad is not None
        assert torch.equal(out.detach(), F.linear(xb.detach(), lb.weight.detach(), lb.bias.detach()))
        assert fast_linear._PACKED.get(lb.weight) is None


@pytest.mark.skipif(not fast_linear.packed_enabled(torch.float32),
                    reason="no packed float32 path on this CPU (the packed_linear kernel needs AVX-512)")
@torch.no_grad()
def test_float32_takes_the_packed_kernel():
    g = torch.Generator().manual_seed(4)
    lin = Linear(96, 70)
    for p in lin.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 3, 96, generator=g)
    out = lin(x)
    assert lin._specdec_packed is not None and lin._specdec_packed.kernel == "ours"
    torch.testing.assert_close(out.double(), _ref(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    lin.weight.mul_(-1)  # the layer's remembered packed weight follows in-place updates
    torch.testing.assert_close(lin(x).double(), _ref(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_separate(dtype):
    g = torch.Generator().manual_seed(1)
    layers = [Linear(40, 24, bias=False), Linear(40, 8, bias=True), Linear(40, 16, bias=False)]
    for layer in layers:
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        layer.to(dtype)
    x = torch.randn(2, 5, 40, generator=g).to(dtype)
    want = torch.cat([_ref(x, lay.weight, lay.bias) for lay in layers], -1)
    got = fused_linear(x, layers)
    assert got.shape == (2, 5, 48)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:
        _bf16_close(got, want)
    changes = [lambda: layers[1].weight.add_(1.0),  # a later layer changes in place: the fused weight is rebuilt
               lambda: layers[1].bias.mul_(-2.0),  # so does a bias
               lambda: setattr(layers[2], "weight", torch.nn.Parameter(torch.randn(16, 40, generator=g).to(dtype)))]
    for change in changes:  # (each replaced or changed parameter, after a call that used the remembered weight)
        assert layers[0].__dict__.get("_specdec_fused") is not None or dtype not in (torch.float32, torch.bfloat16)
        change()
        want = torch.cat([_ref(x, lay.weight, lay.bias) for lay in layers], -1)
        if dtype == torch.float32:
            torch.testing.assert_close(fused_linear(x, layers).double(), want, atol=1e-5, rtol=1e-5)
        else:
            _bf16_close(fused_linear(x, layers), want)


@torch.no_grad()
def test_module_linear_falls_back_to_other_modules():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    m = Scaled(8, 4).bfloat16()
    x = torch.randn(3, 8).bfloat16()
    assert torch.equal(module_linear(m, x), m(x))
    plain = torch.nn.Linear(8, 4).bfloat16()
    seen = []
    plain.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    module_linear(plain, x)  # a hooked module is called, so its hooks run
    assert seen == [(3, 4)]


def _eagle_cfg(version):
    return EagleConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=300, draft_vocab_size=300 if version == 1 else 120)


@needs_packed
@pytest.mark.parametrize("version", [1, 3])
@torch.no_grad()
def test_eagle_bfloat16_matches_float32(version):
    torch.manual_seed(version)
    m32 = (Eagle1Model(_eagle_cfg(1)) if version == 1 else Eagle3Model(_eagle_cfg(3))).eval()
    for p in m32.parameters():
        p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    m16 = copy.deepcopy(m32).bfloat16()
    B, T = 2, 5
    feats = torch.randn(B, T, m32.feature_size)
    emb = torch.randn(B, T, 64)
    pos = torch.arange(7, 7 + T).expand(B, T)
    want = m32(feats, emb, pos).double()
    got = m16(feats.bfloat16(), emb.bfloat16(), pos)
    assert fast_linear._PACKED.get(m16.fc.weight) is not None
    torch.testing.assert_close(got.double(), want, atol=0.05 * want.abs().max().item(), rtol=0.05)
    lm = torch.nn.Linear(64, 300, bias=False)
    if version == 1:
        lw = m32.logits(want.float(), lm).double()
        lg = m16.logits(got, copy.deepcopy(lm).bfloat16()).double()
    else:
        lw = m32.logits(want.float()).double()
        lg = m16.logits(got).double()
    torch.testing.assert_close(lg, lw, atol=0.05 * lw.abs().max().item(), rtol=0.05)


class _Custom(torch.nn.Linear):  # a subclass with its own forward: pack_linears leaves it alone
    def forward(self, x):
        return super().forward(x) + 1.0


@needs_packed
@torch.no_grad()
def test_pack_linears_of_a_foreign_model_is_gated_by_the_block():
    import pickle

    from specdec_ext.models.fast_linear import PackableLinear, pack_linears, packed_linears, unpack_linears

    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32, bias=False),
                                _Custom(32, 8)).bfloat16()
    keys = list(model.state_dict())
    x = torch.randn(3, 64, generator=g).bfloat16()
    want = model(x)
    assert pack_linears(model) == 2 and pack_linears(model) == 2  # idempotent
    assert [type(m) for m in model] == [PackableLinear, torch.nn.ReLU, PackableLinear, _Custom]
    assert all(isinstance(m, torch.nn.Linear) for m in model[::2]) and list(model.state_dict()) == keys
    assert torch.equal(model(x), want)  # outside the block: nn.Linear exactly, nothing packed
    assert model[0].weight not in fast_linear._PACKED
    with packed_linears():
        inside = model(x)
    assert model[0].weight in fast_linear._PACKED and model[2].weight in fast_linear._PACKED
    h = F.relu(linear(x, model[0].weight, model[0].bias))
    assert torch.equal(inside, model[3](linear(h, model[2].weight)))  # the packed path, layer by layer (linear's
    # own accuracy against float64: test_packed_matches_float64)
    with packed_linears(enabled=False):
        assert torch.equal(model(x), want)
    clone = pickle.loads(pickle.dumps(model))  # a packed model still pickles and copies as a model
    assert type(clone[0]) is PackableLinear and torch.equal(copy.deepcopy(model)(x), want)
    with torch.enable_grad():  # training through a packed layer is aten's (gradients flow)
        layer = torch.nn.Linear(64, 96)
        pack_linears(torch.nn.Sequential(layer))
        with packed_linears():
            layer(x.float()).sum().backward()
        assert layer.weight.grad is not None
    unpack_linears(model)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear, _Custom]
    assert model[0].weight not in fast_linear._PACKED and torch.equal(model(x), want)


def test_fused_weight_is_packed_once_for_a_frozen_model_with_gradients_on(monkeypatch):
    """Frozen layers called with gradients enabled take the fast path too, and reuse the remembered fused weight
    rather than concatenating and packing it again on every call."""
    from specdec_ext.models import fast_linear as FL

    layers = [Linear(64, 32), Linear(64, 16, bias=False)]
    for layer in layers:
        layer.requires_grad_(False)
    x = torch.randn(2, 64)
    want = torch.cat([torch.nn.functional.linear(x, lay.weight, lay.bias) for lay in layers], -1)
    packs = []
    original = FL._packed
    monkeypatch.setattr(FL, "_packed", lambda w, kernel: packs.append(1) or original(w, kernel))
    with torch.enable_grad():
        for _ in range(4):
            torch.testing.assert_close(fused_linear(x, layers), want, atol=1e-5, rtol=1e-5)
    if FL.packed_enabled(torch.float32):
        assert len(packs) == 1


@pytest.mark.skipif(not fast_linear.packed_enabled(torch.float32), reason="no packed float32 path on this CPU")
@pytest.mark.parametrize("outs, shared", [((64, 32, 32), (True, True, True)), ((64, 32, 20), (True, True, True)),
                                          ((64, 20, 32), (True, False, False))])
def test_member_layers_multiply_with_views_of_the_fused_panels(outs, shared):
    """After the fused q/k/v operand is packed (what the op calls use), each member layer's own products read its
    panels of that one copy where its outputs start on a 32-row panel and fill whole panels (or end the group),
    and pack a copy of their own otherwise; every product equals F.linear."""
    torch.manual_seed(0)
    layers = [fast_linear.PackableLinear(48, n).requires_grad_(False) for n in outs]
    fused = fast_linear.packed_operand(layers)
    base, end = fused.packed.data_ptr(), fused.packed.data_ptr() + fused.packed.numel() * 4
    x = torch.randn(5, 48)
    with fast_linear.packed_linears(), torch.no_grad():
        for layer, want_view in zip(layers, shared):
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
            ptr = layer._specdec_packed.packed.data_ptr()
            assert (base <= ptr < end) == want_view
        layers[0].weight.mul_(2)  # a weight changed in place is packed anew, not read from the stale view
        torch.testing.assert_close(layers[0](x), F.linear(x, layers[0].weight, layers[0].bias), atol=1e-5, rtol=1e-5)


# ---- generate() takes the packed path by default ----------------------------------------------------------------
def _linear_types(model):
    return {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.skipif(not fast_linear.packed_enabled(torch.float32), reason="no packed float32 path on this CPU")
def test_generate_packs_the_target_by_default_and_opts_out():
    pytest.importorskip("transformers")
    from test_hf_tree_attention import make_model

    from specdec_ext.generate import generate

    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    plain = make_model("llama", seed=5)
    out_aten, _ = generate(plain, None, ids, max_new_tokens=6, eos_token_id=[], packed_linears=False)
    assert _linear_types(plain) == {torch.nn.Linear}  # the opt-out leaves the model as it is
    packed = make_model("llama", seed=5)
    out, _ = generate(packed, None, ids, max_new_tokens=6, eos_token_id=[])
    assert _linear_types(packed) == {fast_linear.PackableLinear}
    q = packed.model.layers[0].self_attn.q_proj
    # the kernel ran, not F.linear: the engine's op calls multiply with q/k/v packed as one weight
    assert q._specdec_fused is not None and q._specdec_fused.kernel == "ours"
    assert torch.equal(out, out_aten)  # greedy: the same tokens as aten's products
    # outside generate the model is nn.Linear exactly
    x = torch.randn(2, q.in_features)
    assert torch.equal(q(x), F.linear(x, q.weight, q.bias))


def test_generate_does_not_pack_where_there_is_no_packed_path():
    pytest.importorskip("transformers")
    from test_hf_tree_attention import make_model

    from specdec_ext.generate import generate

    model = make_model("llama", seed=5, dtype=torch.float16)  # float16: aten's products on every CPU
    assert fast_linear.pack_linears_where_fast(model) == 0
    generate(model, None, torch.tensor([3, 1, 4]), max_new_tokens=2, eos_token_id=[])
    assert _linear_types(model) == {torch.nn.Linear}


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_generate_packed_linears_must_be_a_bool(value):
    pytest.importorskip("transformers")
    from test_hf_tree_attention import make_model

    from specdec_ext.generate import generate

    with pytest.raises(ValueError, match="generate: packed_linears must be True or False"):
        generate(make_model("llama", seed=5), None, torch.tensor([3, 1]), max_new_tokens=1, packed_linears=value)
