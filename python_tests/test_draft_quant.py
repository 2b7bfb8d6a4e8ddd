"""Int8 and int4 draft networks (``draft_quant="int8" | "int4"``, ``--draft-quant``): quantize_weights against the
int8 and int4 specs (specdec_ext.ops.reference), the drafters on quantised weights token-identical to plain greedy
decoding (batch > 1, through their op paths), sampling with a quantised draft lossless (chi-square), memory, and the
errors."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext.drafter_args import add_drafter_arguments, check_one_drafter, drafter_from_args  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.eagle import Eagle1Model, Eagle3Model, EagleConfig  # noqa: E402
from specdec_ext.models.medusa import MedusaHeads  # noqa: E402
from specdec_ext.models.quantized import (QuantizedEmbedding, QuantizedLinear, linear_operand, module_bytes,  # noqa: E402
                                          quantize_weights)
from specdec_ext.ops import reference as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 211
PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [150, 2, 2, 61, 9, 33, 120, 4]]
NEW = 24


def target(seed: int = 3):
    return make_model("llama", seed=seed, vocab_size=V, hidden_size=128, intermediate_size=256,
                      num_attention_heads=2, num_key_value_heads=1)


def plain(model) -> list[torch.Tensor]:
    return generate(model, None, PROMPTS, max_new_tokens=NEW, eos_token_id=[])[0]


def float_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 2}


SCHEMES = ["int8", "int4"]


def reference_product(scheme: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if scheme == "int4":
        return ref.packed_linear_int4(x, *ref.pack_linear_weight_int4(weight))
    return ref.packed_linear_int8(x, *ref.pack_linear_weight_int8(weight))


def dequantised_rows(scheme: str, table: torch.Tensor) -> torch.Tensor:
    """The rows of ``table`` as a quantised embedding holds them (the specs' values, float32)."""
    if scheme == "int4":
        q, m, s = ref.quantize_weight_int4(table)
        return (q.int() * m.int().repeat_interleave(32, 1)[:, : table.shape[1]]).float() * s[:, None]
    q, s = ref.quantize_rows_int8(table)
    return q.float() * s[:, None]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_weights_installs_quantised_layers_and_drops_the_float_weights(scheme):
    model = target()
    before = module_bytes(model)
    weights = float_weights(model)
    assert quantize_weights(model, scheme) is model
    kinds = {type(m) for m in model.modules()}
    assert nn.Linear not in kinds and nn.Embedding not in kinds and {QuantizedLinear, QuantizedEmbedding} <= kinds
    assert not any(p.dim() == 2 for p in model.parameters())  # no float matrix left
    assert module_bytes(model) <= (0.3 if scheme == "int8" else 0.17) * before, (module_bytes(model), before)
    assert all(m.scheme == scheme for m in model.modules() if type(m) is QuantizedLinear)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    storages = {m.packed.untyped_storage().data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert len(storages) == 1  # q, k and v are views of the one fused weight (no second copy)
    assert linear_operand((attn.q_proj, attn.k_proj, attn.v_proj)) is attn.q_proj.group.operand
    assert linear_operand((attn.k_proj, attn.q_proj, attn.v_proj)) is None  # not the group, in its order
    assert linear_operand((mlp.gate_proj, mlp.up_proj)).out_features == 2 * 256
    for name, m in model.named_modules():  # each product is packed_linear_int8's / _int4's of the original weight
        if type(m) is QuantizedLinear:
            x = torch.randn(3, m.in_features)
            assert torch.equal(m(x), reference_product(scheme, x, weights[name + ".weight"])), name
    x = torch.randn(2, 128)
    qkv = linear_operand((attn.q_proj, attn.k_proj, attn.v_proj))(x)
    assert torch.equal(qkv, torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1))
    ids = torch.tensor([[0, 5, V - 1], [31, 32, 64]])
    rows = dequantised_rows(scheme, weights["model.embed_tokens.weight"])
    assert torch.equal(model.model.embed_tokens(ids), rows[ids])
    size = module_bytes(model)
    quantize_weights(model, scheme)  # idempotent
    assert module_bytes(model) == size


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_tied_embedding_reads_the_output_layers_weight(scheme):
    model = make_model("llama", seed=4, vocab_size=V, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    w = model.lm_head.weight.detach().clone()
    quantize_weights(model, scheme)
    assert model.model.embed_tokens.packed is model.lm_head.packed
    assert model.model.embed_tokens.group_scales is model.lm_head.group_scales
    ids = torch.arange(V)
    assert torch.equal(model.model.embed_tokens(ids), dequantised_rows(scheme, w))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantised_draft_model_is_token_identical_and_drafts_through_the_op(scheme):
    tgt = target()
    want = plain(tgt)
    for kw in (dict(num_draft_tokens=4), dict(num_draft_tokens=3, tree_width=2, total_tokens=6)):
        drafter = DraftModelDrafter(copy.deepcopy(tgt), draft_quant=scheme, **kw)  # the target as its own draft
        out, st = generate(tgt, drafter, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
        assert all(torch.equal(a, b) for a, b in zip(out, want))
        # the quantised copy of the target predicts it well: drafts really are accepted (not a vacuous pass)
        assert st.mean_accepted_length > 2.0, st.accept_hist
        ops = drafter._ops
        assert ops is not None and all(layer.qkv_scales is not None and layer.down_scales is not None
                                       for layer in ops._layers)
        assert all((layer.qkv_group_scales is not None) == (scheme == "int4") for layer in ops._layers)
        assert ops._lm.scales is not None and (ops._lm.group_scales is not None) == (scheme == "int4")


def eagle_draft(version: int, seed: int = 0):
    cfg = EagleConfig(hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=V, head_dim=64, draft_vocab_size=64 if version == 3 else None)
    torch.manual_seed(seed)
    m = Eagle1Model(cfg, fc_bias=True) if version == 1 else Eagle3Model(cfg)
    if version == 3:
        m.set_vocab_map(torch.randperm(V)[:64].sort().values)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("version, kw", [(1, dict(depth=4, top_k=1, total_tokens=4)),
                                         (1, dict(depth=4, top_k=3, total_tokens=10, draft_vocab=torch.arange(0, V,
                                                                                                              2))),
                                         (3, dict(depth=4, top_k=3, total_tokens=10, aux_layers=(0, 1, 2)))])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantised_eagle_drafts_are_token_identical(version, kw, scheme):
    tgt = target()
    want = plain(tgt)
    draft = eagle_draft(version)
    before = module_bytes(draft)
    drafter = EagleDrafter(draft, target=tgt, draft_quant=scheme, **kw)
    assert drafter.model is draft and module_bytes(draft) <= 0.3 * before
    out, st = generate(tgt, drafter, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    layer = drafter._ops._layer if drafter._ops is not None else None  # the op path ran on the quantised weights
    assert layer is not None and layer.qkv_scales is not None
    assert (layer.qkv_group_scales is not None) == (scheme == "int4")
    if "draft_vocab" in kw:
        assert type(drafter._lm_sub) is QuantizedLinear and drafter._lm_sub.scheme == scheme


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantised_medusa_heads_are_token_identical(scheme):
    tgt = target()
    want = plain(tgt)
    torch.manual_seed(5)
    heads = MedusaHeads(3, 128)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    float_out = generate(tgt, MedusaDrafter(copy.deepcopy(heads), dynamic=True, max_nodes=8), PROMPTS,
                         max_new_tokens=NEW, eos_token_id=[])[0]
    drafter = MedusaDrafter(heads, dynamic=True, max_nodes=8, draft_quant=scheme)
    assert heads.dtype is torch.float32 and type(heads.heads[0][0].linear) is QuantizedLinear
    assert heads.heads[0][0].linear.scheme == scheme
    out, _ = generate(tgt, drafter, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert all(torch.equal(a, b) for a, b in zip(out, want)) and all(torch.equal(a, b)
                                                                        for a, b in zip(float_out, want))


@pytest.mark.parametrize("T,top_k,top_p,scheme", [(1.0, 0, 1.0, "int8"), (0.8, 5, 0.9, "int8"), (1.0, 0, 1.0, "int4")])
def test_sampling_with_a_quantised_draft_matches_the_target_distribution(T, top_k, top_p, scheme):
    """test_generate_sampling's chi-square test (tiny V = 8 target, 5000 rows, p < 1e-3) with the perturbed draft on
    quantised weights: its draft probabilities are the quantised network's own, so verification stays lossless."""
    sampling = pytest.importorskip("test_generate_sampling")
    tgt = sampling.tiny(21)
    joint, third = sampling.exact_distributions(tgt, T, top_k, top_p)
    prompts = torch.tensor(sampling.PROMPT).expand(sampling.ROWS, -1).contiguous()
    Vs = sampling.V
    for seed, kw in ((4321, dict(num_draft_tokens=3)), (5678, dict(num_draft_tokens=3, tree_width=2))):
        drafter = DraftModelDrafter(sampling.tiny(21, noise=0.3), draft_quant=scheme, **kw)
        out, st = generate(tgt, drafter, prompts, max_new_tokens=3, eos_token_id=[], temperature=T, top_k=top_k,
                           top_p=top_p, generator=torch.Generator().manual_seed(seed))
        new = out[:, len(sampling.PROMPT):]
        p_pair = sampling.chi_square_p(torch.bincount(new[:, 0] * Vs + new[:, 1], minlength=Vs * Vs), joint)
        p_third = sampling.chi_square_p(torch.bincount(new[:, 2], minlength=Vs), third)
        assert p_pair > 1e-3 and p_third > 1e-3, (kw, p_pair, p_third)
        assert st.accept_hist[0] > 0 and sum(st.accept_hist[1:]) > sampling.ROWS // 10, st.accept_hist


def test_bad_draft_quant_is_a_named_error():
    with pytest.raises(ValueError, match=r"DraftModelDrafter: draft_quant must be None or one of \('int8', 'int4'\), "
                                         r"got 'int2'"):
        DraftModelDrafter(target(), draft_quant="int2")
    with pytest.raises(ValueError, match=r"EagleDrafter: draft_quant must be"):
        EagleDrafter(eagle_draft(1), draft_quant=8)
    with pytest.raises(ValueError, match=r"quantize_weights: scheme must be one of"):
        quantize_weights(nn.Linear(4, 4), "fp8")
    with pytest.raises(ValueError, match=r"renormalises its rows"):
        quantize_weights(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)))
    with pytest.raises(ValueError, match=r"must be finite"):
        quantize_weights(nn.Sequential(nn.Linear(4, 4)).apply(lambda m: m.weight.data.fill_(float("nan"))
                                                              if isinstance(m, nn.Linear) else None))
    emb = quantize_weights(nn.Sequential(nn.Embedding(10, 4)))[0]
    with pytest.raises(ValueError, match=r"QuantizedEmbedding: ids must be in \[0, 10\)"):
        emb(torch.tensor([3, 10]))


def test_cli_flag(tmp_path):
    p = argparse.ArgumentParser()
    add_drafter_arguments(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--no-packed-linears", action="store_true")
    with pytest.raises(ValueError, match=r"--draft-quant quantises a drafter's network; --ngram and --suffix"):
        check_one_drafter(p.parse_args(["--ngram", "--draft-quant", "int8"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--draft-quant", "int2"])
    tgt = target()
    tgt.save_pretrained(tmp_path / "draft")
    for scheme in SCHEMES:
        drafter = drafter_from_args(p.parse_args(["--draft-model", str(tmp_path / "draft"), "--draft-quant", scheme]),
                                    tgt)
        assert drafter.draft_quant == scheme and drafter.model.lm_head.scheme == scheme
        out, _ = generate(tgt, drafter, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
        assert all(torch.equal(a, b) for a, b in zip(out, plain(tgt)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_target_on_quantised_weights_drafts_for_itself(scheme):
    """DraftModelDrafter.from_target (QSpec-style): identical output, high acceptance (the draft is the target up to
    its quantisation), the target untouched and no float copy of its matrices made (norms shared)."""
    tgt = target()
    want = plain(tgt)
    weights = {n: p.data_ptr() for n, p in tgt.named_parameters()}
    drafter = DraftModelDrafter.from_target(tgt, scheme, num_draft_tokens=5)
    assert {n: p.data_ptr() for n, p in tgt.named_parameters()} == weights and type(tgt.lm_head) is not QuantizedLinear
    draft = drafter.model
    assert not any(p.dim() == 2 for p in draft.parameters())
    assert draft.model.norm.weight is tgt.model.norm.weight
    out, st = generate(tgt, drafter, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert st.mean_accepted_length > (3.0 if scheme == "int8" else 2.0), st.accept_hist
    with pytest.raises(ValueError, match=r"from_target: draft_quant must be"):
        DraftModelDrafter.from_target(tgt, draft_quant=None)


def test_quantised_drafters_in_the_engine_with_rows_joining_and_the_adaptive_drafter():
    """Through the Engine (rows joining mid-generation, one queued) the int8 and int4 EAGLE-2 drafters, and the
    adaptive drafter around the int8 and int4 target-as-draft, give each request the tokens of decoding it alone."""
    from specdec_ext import AdaptiveDrafter, Engine

    tgt = target()
    want = plain(tgt)
    for drafter in (EagleDrafter(eagle_draft(1), target=tgt, depth=4, top_k=3, total_tokens=10, draft_quant="int8"),
                    EagleDrafter(eagle_draft(1), target=tgt, depth=4, top_k=3, total_tokens=10, draft_quant="int4"),
                    AdaptiveDrafter(DraftModelDrafter.from_target(tgt, num_draft_tokens=4)),
                    AdaptiveDrafter(DraftModelDrafter.from_target(tgt, "int4", num_draft_tokens=4))):
        with Engine(tgt, drafter, max_batch=2, max_len=64, eos_token_id=[]) as engine:
            ids = {engine.add_request(PROMPTS[0], max_new_tokens=NEW): 0}
            got: dict[int, list[int]] = {0: [], 1: [], 2: []}
            steps = 0
            while engine.has_unfinished():
                if steps == 2:  # two join after a few steps (the second waits for a free row)
                    ids[engine.add_request(PROMPTS[1], max_new_tokens=NEW)] = 1
                    ids[engine.add_request(PROMPTS[2], max_new_tokens=NEW)] = 2
                for rid, new, _ in engine.step():
                    got[ids[rid]] += list(new)
                steps += 1
        for b, p in enumerate(PROMPTS):
            assert got[b] == want[b][len(p):].tolist(), (type(drafter).__name__, b)
