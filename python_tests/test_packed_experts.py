"""Mixture-of-experts blocks through packed products (``fast_linear.pack_linears`` and the ``"specdec_packed"``
experts implementation).

* Inside a ``packed_linears`` block the experts' output equals the weighted sum of each row's experts computed in
  float64 (float32 and bfloat16, routed top-2 of 4 experts and the one-expert dense MLP); a row's bits do not depend
  on which other rows share the call; the packed weights follow an in-place update.
* Outside the block, and for a layout the route does not serve, the block's previous implementation runs, bit for
  bit; ``unpack_linears`` gives the model its implementation back; packed models deep-copy and pickle.
* Greedy decoding of a tiny Mixtral (an attention-only MoE) through ``generate`` (plain and with the n-gram
  drafter, batch > 1) equals Hugging Face's ``generate(do_sample=False)``; the hybrid tests cover MiniMax.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import hf_greedy  # noqa: E402
from test_generate_greedy import prompt_of  # noqa: E402

from specdec_ext.drafters import NgramDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models import fast_linear  # noqa: E402
from specdec_ext.models.fast_linear import (EXPERTS_IMPLEMENTATION, pack_linears, packed_linears,  # noqa: E402
                                            unpack_linears)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not fast_linear.packed_enabled(torch.float32)
                                 or fast_linear._kernel_for(torch.float32) != fast_linear._OURS,
                                 reason="this CPU has no packed_linear vector path")]

V = 101


def mixtral(experts: int = 4, top_k: int = 2, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                                     num_experts_per_tok=top_k, max_position_embeddings=256, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.MixtralForCausalLM(cfg).to(dtype).eval()


def routed(block, x):
    """The router's choice for rows ``x [S, H]``: (top_k_index, top_k_weights)."""
    _, weights, index = block.gate(x)
    return index, weights


def float64_experts(experts, x, index, weights):
    """The weighted sum of each row's experts, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for s in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[s, j])
            gate, up = (x[s].double() @ experts.gate_up_proj[e].double().t()).chunk(2)
            hidden = torch.nn.functional.silu(gate) * up
            out[s] += weights[s, j].double() * (hidden @ experts.down_proj[e].double().t())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k", [(4, 2), (1, 1)])
@torch.no_grad()
def test_packed_experts_match_float64_and_are_row_independent(dtype, experts, top_k):
    if dtype is torch.bfloat16 and fast_linear._kernel_for(torch.bfloat16) != fast_linear._OURS:
        pytest.skip("no packed bfloat16 path on this CPU")
    model = mixtral(experts, top_k, dtype)
    assert pack_linears(model) > 0
    block = model.model.layers[0].mlp
    x = torch.randn(7, 64).to(dtype)
    index, weights = routed(block, x)
    if experts > 1:
        assert index.unique().numel() > 1  # (rows really go to different experts)
    with packed_linears():
        got = block.experts(x, index, weights)
        assert block.experts.__dict__.get("_specdec_experts")  # the packed route ran
        alone = torch.cat([block.experts(x[s:s + 1], index[s:s + 1], weights[s:s + 1]) for s in range(7)])
    want = float64_experts(block.experts, x, index, weights)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)
    assert torch.equal(got, alone)


@torch.no_grad()
def test_outside_the_block_and_unpacked_the_previous_implementation_runs():
    plain, packed = mixtral(), mixtral()
    pack_linears(packed)
    assert packed.config._experts_implementation == EXPERTS_IMPLEMENTATION
    previous = plain.config._experts_implementation
    ids = torch.tensor([prompt_of(12, 3)])
    assert torch.equal(packed(ids).logits, plain(ids).logits)  # outside a packed_linears block: unchanged
    unpack_linears(packed)
    assert packed.config._experts_implementation == previous
    assert "_specdec_experts" not in packed.model.layers[0].mlp.experts.__dict__
    assert torch.equal(packed(ids).logits, plain(ids).logits)


@torch.no_grad()
def test_unserved_layout_falls_back():
    model = mixtral()
    block = model.model.layers[0].mlp
    model.config._experts_implementation = "eager"  # (its forward ignores the flag below)
    block.experts.has_bias = True  # (a layout with biases: the packed route does not reproduce it)
    pack_linears(model)
    x = torch.randn(5, 64)
    index, weights = routed(block, x)
    want = type(block.experts).forward.__wrapped__(block.experts, x, index, weights)
    with packed_linears():
        got = block.experts(x, index, weights)
    assert "_specdec_experts" not in block.experts.__dict__
    assert torch.equal(got, want)


@torch.no_grad()
def test_packed_weights_follow_in_place_updates():
    model = mixtral()
    pack_linears(model)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, 64)
    index, weights = routed(model.model.layers[0].mlp, x)
    with packed_linears():
        first = experts(x, index, weights)
        experts.down_proj.mul_(-2)
        second = experts(x, index, weights)
    torch.testing.assert_close(second, -2 * first, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_packed_models_copy_and_pickle():
    model = mixtral()
    pack_linears(model)
    ids = torch.tensor([prompt_of(10, 4)])
    with packed_linears():
        want = model(ids).logits
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(other(ids).logits, want)


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_greedy_generate_on_a_mixture_of_experts_target_equals_hf(drafter):
    model = mixtral(seed=3)
    prompts = [prompt_of(n, s) for s, n in ((0, 12), (1, 20), (2, 7))]
    want = [hf_greedy(model, p, 24) for p in prompts]
    outs, _ = generate(model, NgramDrafter() if drafter else None, prompts, max_new_tokens=24, eos_token_id=[])
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION  # generate packed the experts
    assert [o.tolist() for o in outs] == [p + w for p, w in zip(prompts, want)]
