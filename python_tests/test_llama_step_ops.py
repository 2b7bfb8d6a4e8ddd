"""LlamaStepOps (specdec_ext.models.llama_step): a small Hugging Face Llama-family LM as op calls, the draft-model
drafter's hot path.

* Against the Hugging Face forward (``masked_forward``, SDPA): logits and every written K/V entry agree to the
  dtype's rounding, for Llama, Mistral and Qwen2 (q/k/v biases), float32 and bfloat16, two rows at different
  prefixes with arbitrary masks and write slots.
* ``build`` returns None, and the drafter keeps the Hugging Face forward, for what the ops do not reproduce: other
  architectures (Qwen3's q/k norms, Gemma), non-default RoPE, a sliding window shorter than the cache, forward
  hooks (on any module, or global), gradients, training mode, no packed kernel, a subclassed linear layer.
* Through the drafter: greedy output equals Hugging Face's greedy output (chains and dynamic trees), the ops ran,
  and sampled output follows the target distribution (chi-square, with the ops taking every row).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import hf_greedy  # noqa: E402
from test_generate_sampling import PROMPT, ROWS, V as SMALL_V, chi_square_p, exact_distributions, tiny  # noqa: E402
from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext.models import draft_layer  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models import TreeKVCache, masked_forward  # noqa: E402
from specdec_ext.models import fast_linear  # noqa: E402
from specdec_ext.models.llama_step import LlamaStepOps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _needs_kernel(dtype: torch.dtype):
    if not fast_linear.packed_enabled(dtype) or fast_linear.layer_operand(torch.nn.Linear(4, 4).to(dtype)) is None:
        pytest.skip(f"no packed {dtype} kernel path on this CPU: the draft model keeps its Hugging Face forward")


def _build(model, cache):
    with torch.no_grad():
        return LlamaStepOps.build(model, cache)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_forward_matches_the_hugging_face_forward(family, dtype):
    _needs_kernel(dtype)
    model = make_model(family, seed=3, dtype=dtype)
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # (the qkv bias operand is exercised)
    fast_linear.pack_linears(model)
    g = torch.Generator().manual_seed(5)
    B, T, S, kv = 2, 3, 48, 40
    tokens = torch.randint(0, V, (B, T), generator=g)
    pos = torch.randint(10, 30, (B, 1), generator=g) + torch.arange(T)
    write_at = torch.tensor([20, 33])
    slots = write_at[:, None] + torch.arange(T)
    mask = torch.rand(B, T, kv, generator=g) < 0.7
    mask[torch.arange(B)[:, None], torch.arange(T)[None], slots] = True
    history = torch.randn(2, 2, B, 2, S, 64, generator=g).to(dtype)  # cached K/V the tokens attend to
    caches = []
    for _ in range(2):
        cache = TreeKVCache(model.config, B, S, dtype=dtype)
        cache.storage.copy_(history)
        caches.append(cache)
    with torch.no_grad(), fast_linear.packed_linears():
        ops = LlamaStepOps.build(model, caches[0])
        assert ops is not None
        got = ops.forward(tokens, pos, slots, mask)
        want = masked_forward(model, caches[1], tokens, pos, write_at, mask)
    tol = 2e-5 if dtype == torch.float32 else 4e-2
    scale = 1 + float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=0)
    torch.testing.assert_close(caches[0].storage.float(), caches[1].storage.float(), atol=tol * 8, rtol=0)


def test_build_refuses_what_the_ops_do_not_reproduce(monkeypatch):
    _needs_kernel(torch.float32)
    cache_for = lambda m, S=32: TreeKVCache(m.config, 1, S)  # noqa: E731
    llama = make_model("llama", seed=1)
    assert _build(llama, cache_for(llama)) is not None
    for family in ("qwen3", "gemma"):  # q/k norms; scaled embeddings and GeLU
        other = make_model(family, seed=1)
        assert _build(other, cache_for(other)) is None, family
    scaled = make_model("llama", seed=1, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert _build(scaled, cache_for(scaled)) is None
    windowed = make_model("mistral", seed=1, sliding_window=16)
    assert _build(windowed, cache_for(windowed, 32)) is None
    assert _build(windowed, cache_for(windowed, 16)) is not None  # (the window covers the whole cache)
    handle = llama.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert _build(llama, cache_for(llama)) is None
    handle.remove()
    with torch.no_grad():  # transformers leaves its output-capturing hooks on the layers: inactive outside it, taken
        llama(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert any(layer._forward_hooks for layer in llama.model.layers), "the capture hooks this checks are gone"
    assert _build(llama, cache_for(llama)) is not None
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        assert _build(llama, cache_for(llama)) is None
    finally:
        handle.remove()
    with torch.enable_grad():
        assert LlamaStepOps.build(llama, cache_for(llama)) is None
    llama.train()
    assert _build(llama, cache_for(llama)) is None
    llama.eval()

    class Custom(torch.nn.Linear):
        pass

    llama.model.layers[0].self_attn.o_proj.__class__ = Custom
    assert _build(llama, cache_for(llama)) is None
    llama.model.layers[0].self_attn.o_proj.__class__ = torch.nn.Linear
    monkeypatch.setattr(fast_linear, "_ENABLED", False)
    assert _build(llama, cache_for(llama)) is None


@pytest.mark.parametrize("kw", [dict(num_draft_tokens=3), dict(num_draft_tokens=4, tree_width=2, total_tokens=5)],
                         ids=["chain", "dynamic_tree"])
def test_drafter_greedy_equals_hugging_face_through_the_ops(kw):
    _needs_kernel(torch.float32)
    target = make_model("llama", seed=11, num_hidden_layers=3)
    draft = make_model("llama", seed=11, num_hidden_layers=3)
    with torch.no_grad():  # a draft close to the target: drafts are accepted
        for p in draft.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    drafter = DraftModelDrafter(draft, **kw)
    calls = []
    real = LlamaStepOps.run  # (every op route's forward)
    LlamaStepOps.run = lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw)
    try:
        for n in (2, 9):
            prompt = torch.arange(3, 3 + n) % V
            out, stats = generate(target, drafter, prompt, max_new_tokens=24, eos_token_id=[])
            assert out[n:].tolist() == hf_greedy(target, prompt.tolist(), 24)
            assert stats.new_tokens > stats.target_forwards  # drafts were accepted
    finally:
        LlamaStepOps.run = real
    assert isinstance(drafter._ops, LlamaStepOps) and calls


@pytest.mark.parametrize("kw", [dict(num_draft_tokens=3), dict(num_draft_tokens=3, tree_width=2, total_tokens=4)],
                         ids=["chain", "dynamic_tree"])
def test_sampling_through_the_ops_matches_the_target_distribution(monkeypatch, kw):
    """The chi-square test of test_generate_sampling with the ops taking all rows (their row limit lifted): the
    draft probabilities the ops computed are the ones verification divides by."""
    _needs_kernel(torch.float32)
    monkeypatch.setattr(draft_layer, "NATIVE_LAYER_MAX_ROWS", 10 ** 9)
    target, draft = tiny(21), tiny(21, noise=0.3)
    joint, third = exact_distributions(target, 0.8, 0, 1.0)
    prompts = torch.tensor(PROMPT).expand(ROWS, -1).contiguous()
    drafter = DraftModelDrafter(draft, **kw)
    gen = torch.Generator().manual_seed(97)
    out, _ = generate(target, drafter, prompts, max_new_tokens=3, eos_token_id=[], temperature=0.8, generator=gen)
    assert isinstance(drafter._ops, LlamaStepOps)
    new = out[:, len(PROMPT):]
    pair = torch.bincount(new[:, 0] * SMALL_V + new[:, 1], minlength=SMALL_V * SMALL_V)
    assert chi_square_p(pair, joint) > 1e-3  # (false alarms: 1e-3 per check, as test_generate_sampling)
    assert chi_square_p(torch.bincount(new[:, 2], minlength=SMALL_V), third) > 1e-3
