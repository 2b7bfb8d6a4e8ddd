"""EAGLE-1 / EAGLE-3 official checkpoint loading (specdec_ext.models.checkpoints.load_eagle) and the draft networks
(specdec_ext.models.eagle).

* Files written here by hand in the official key layout (random weights): EAGLE-1 ``pytorch_model.bin`` and
  ``model.safetensors``, with and without ``fc.bias`` and ``embed_tokens``, no ``layers.0.input_layernorm``;
  EAGLE-3 with ``midlayer.*``, ``norm``, ``lm_head`` over a draft vocabulary, ``d2t`` / ``t2d``, no ``embed_tokens``
  (taken from the target), also vLLM's ``layers.0.`` renaming. Every tensor lands where it belongs.
* The networks equal references built from transformers' Llama modules (EAGLE-1: ``LlamaDecoderLayer`` with an
  identity ``input_layernorm``; EAGLE-3: ``LlamaAttention`` over 2H inputs).
* Errors name the problem: a wrong shape (key and both shapes), missing / unexpected keys, an input_layernorm in
  EAGLE-1, a draft for another target (hidden size, vocabulary), missing files.
* A loaded draft of each version drafts through :func:`generate` (greedy output equals plain decoding).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext.drafters.eagle import EagleDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.checkpoints import load_eagle, save_eagle  # noqa: E402
from specdec_ext.models.eagle import Eagle1Model, Eagle3Model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, I, NH, NKV, HD = 64, 128, 4, 2, 64
VD = 40  # EAGLE-3 draft vocabulary
L_TARGET = 8  # EAGLE-3 reads layers (2, 4, 5)

_T: dict = {}


def target():
    if "m" not in _T:
        _T["m"] = make_model("llama", seed=5, num_hidden_layers=L_TARGET)
    return _T["m"]


def config(version: int, **extra) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": I,
           "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD, "num_hidden_layers": 1,
           "vocab_size": V, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
           "model_type": "llama", "torch_dtype": "float32"}
    if version == 3:
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VD)
    cfg.update(extra)
    return cfg


def eagle1_sd(fc_bias: bool, embed: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.1 * torch.randn(*s, generator=g)  # noqa: E731
    sd = {"fc.weight": r(H, 2 * H),
          "layers.0.self_attn.q_proj.weight": r(NH * HD, H), "layers.0.self_attn.k_proj.weight": r(NKV * HD, H),
          "layers.0.self_attn.v_proj.weight": r(NKV * HD, H), "layers.0.self_attn.o_proj.weight": r(H, NH * HD),
          "layers.0.mlp.gate_proj.weight": r(I, H), "layers.0.mlp.up_proj.weight": r(I, H),
          "layers.0.mlp.down_proj.weight": r(H, I), "layers.0.post_attention_layernorm.weight": 1 + r(H)}
    if fc_bias:
        sd["fc.bias"] = r(H)
    if embed:
        sd["embed_tokens.weight"] = r(V, H)
    return sd


def eagle3_sd(seed: int = 0, prefix: str = "midlayer.") -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.1 * torch.randn(*s, generator=g)  # noqa: E731
    ids = torch.randperm(V, generator=g)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    p = prefix
    return {"fc.weight": r(H, 3 * H),
            f"{p}self_attn.q_proj.weight": r(NH * HD, 2 * H), f"{p}self_attn.k_proj.weight": r(NKV * HD, 2 * H),
            f"{p}self_attn.v_proj.weight": r(NKV * HD, 2 * H), f"{p}self_attn.o_proj.weight": r(H, NH * HD),
            f"{p}mlp.gate_proj.weight": r(I, H), f"{p}mlp.up_proj.weight": r(I, H), f"{p}mlp.down_proj.weight": r(H, I),
            f"{p}hidden_norm.weight": 1 + r(H), f"{p}input_layernorm.weight": 1 + r(H),
            f"{p}post_attention_layernorm.weight": 1 + r(H), "norm.weight": 1 + r(H), "lm_head.weight": r(VD, H),
            "d2t": ids - torch.arange(VD), "t2d": t2d}


def write(path, cfg: dict, sd: dict, safetensors: bool):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    else:
        torch.save(sd, path / "pytorch_model.bin")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Loading the official layouts.


@pytest.mark.parametrize("safetensors", [False, True], ids=["bin", "safetensors"])
@pytest.mark.parametrize("fc_bias,embed", [(True, False), (False, False), (False, True)],
                         ids=["vicuna_bias", "llama3_no_bias", "with_embed"])
def test_load_eagle1(tmp_path, safetensors, fc_bias, embed):
    sd = eagle1_sd(fc_bias, embed)
    d = write(tmp_path / "e1", config(1, bias=fc_bias), sd, safetensors)
    m = load_eagle(d, target=target())
    assert isinstance(m, Eagle1Model) and m.version == 1
    assert (m.fc.bias is not None) == fc_bias and (m.embed_tokens is not None) == embed
    got = m.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    assert not hasattr(m.layers[0], "input_layernorm")
    assert m.fc.weight.dtype == torch.float32 and not m.training


@pytest.mark.parametrize("safetensors", [False, True], ids=["bin", "safetensors"])
def test_load_eagle3(tmp_path, safetensors):
    sd = eagle3_sd()
    d = write(tmp_path / "e3", config(3), sd, safetensors)
    m = load_eagle(d, target=target())
    assert isinstance(m, Eagle3Model) and m.version == 3
    assert m.embed_tokens is None  # from the target
    assert m.aux_layers == (2, 4, 5)
    got = m.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    assert m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool
    ids = torch.arange(VD)
    assert torch.equal(m.to_target_ids(ids), sd["t2d"].nonzero()[:, 0])
    # vLLM's renaming (layers.0. instead of midlayer.) loads the same
    d2 = write(tmp_path / "vllm", config(3), eagle3_sd(prefix="layers.0."), safetensors)
    m2 = load_eagle(d2, target=target())
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    # explicit feature layers from eagle_config
    d3 = write(tmp_path / "aux", config(3, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}), sd, False)
    assert load_eagle(d3, target=target()).aux_layers == (1, 3, 6)
    assert EagleDrafter(load_eagle(d3)).hidden_state_layers == (1, 3, 6)


def test_eagle3_same_vocab_drops_identity_maps(tmp_path):
    sd = eagle3_sd()
    sd["lm_head.weight"] = torch.randn(V, H) * 0.1
    sd["d2t"] = torch.zeros(V, dtype=torch.int64)
    sd["t2d"] = torch.ones(V, dtype=torch.bool)
    m = load_eagle(write(tmp_path / "e3", config(3, draft_vocab_size=V), sd, False), target=target())
    assert m.d2t is None and m.draft_vocab_size == V
    assert torch.equal(m.to_target_ids(torch.arange(5)), torch.arange(5))


def test_dtype_device_from_target_and_round_trip(tmp_path):
    tgt = make_model("llama", seed=5, num_hidden_layers=L_TARGET, dtype=torch.bfloat16)
    m = load_eagle(write(tmp_path / "e3", config(3), eagle3_sd(), True), target=tgt)
    assert m.fc.weight.dtype == torch.bfloat16 and m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool
    for version, model in ((1, load_eagle(write(tmp_path / "e1", config(1), eagle1_sd(True, False), False))),
                           (3, load_eagle(write(tmp_path / "e3b", config(3), eagle3_sd(), False)))):
        for st in (False, True):
            out = save_eagle(model, tmp_path / f"rt{version}{st}", safetensors=st)
            assert out.endswith("model.safetensors" if st else "pytorch_model.bin")
            again = load_eagle(tmp_path / f"rt{version}{st}")
            assert again.version == version
            for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
                assert k == k2 and torch.equal(a, b)


def test_resolve_eagle_dtype():
    from specdec_ext.models.checkpoints import resolve_eagle_dtype
    from specdec_ext.models.fast_linear import bfloat16_is_fast

    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_eagle_dtype(None, f32) is f32 and resolve_eagle_dtype(None, bf16) is bf16
    assert resolve_eagle_dtype("bfloat16", f32) is bf16 and resolve_eagle_dtype(torch.float16, f32) is torch.float16
    # auto: bfloat16 only for a float32 target, and only where bfloat16 products are fast
    assert resolve_eagle_dtype("auto", f32) is (bf16 if bfloat16_is_fast("cpu") else f32)
    assert resolve_eagle_dtype("auto", bf16) is bf16 and resolve_eagle_dtype("auto", torch.float16) is torch.float16
    for bad in ("int8", torch.int64, 3, "fp32"):
        with pytest.raises(ValueError, match="eagle_dtype"):
            resolve_eagle_dtype(bad, f32)


def test_bfloat16_is_fast_follows_the_kernel_path():
    from specdec_ext import ops
    from specdec_ext.models.fast_linear import bfloat16_is_fast, packed_enabled

    want = packed_enabled(torch.bfloat16) and ops.packed_linear_path(torch.bfloat16) == "avx512_bf16"
    assert bfloat16_is_fast("cpu") == want
    assert bfloat16_is_fast("cuda") and bfloat16_is_fast(torch.device("cuda", 0))


# ---------------------------------------------------------------------------------------------------------------
# Errors.


def test_errors_name_the_mismatch(tmp_path):
    tgt = target()
    bad = eagle1_sd(True, False)
    bad["layers.0.mlp.up_proj.weight"] = torch.zeros(I + 1, H)
    with pytest.raises(ValueError, match=r"'layers.0.mlp.up_proj.weight' .* shape \[129, 64\], expected \[128, 64\]"):
        load_eagle(write(tmp_path / "a", config(1), bad, False))
    bad = eagle1_sd(True, False)
    del bad["layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks key\(s\) \['layers.0.self_attn.k_proj.weight'\]"):
        load_eagle(write(tmp_path / "b", config(1), bad, False))
    bad = eagle1_sd(True, False)
    bad["layers.0.input_layernorm.weight"] = torch.ones(H)
    with pytest.raises(ValueError, match="no input_layernorm"):
        load_eagle(write(tmp_path / "c", config(1), bad, False))
    bad = eagle1_sd(True, False)
    bad["layers.0.something"] = torch.ones(H)
    with pytest.raises(ValueError, match=r"unexpected key\(s\) \['layers.0.something'\]"):
        load_eagle(write(tmp_path / "d", config(1), bad, False))
    bad = eagle3_sd()
    bad["t2d"] = torch.zeros(V + 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"'t2d' .* shape \[104\], expected \[101\]"):
        load_eagle(write(tmp_path / "e", config(3), bad, False))
    # a draft for another target: hidden size, vocabulary
    other_h = make_model("llama", seed=5, num_hidden_layers=L_TARGET, hidden_size=128, num_attention_heads=2,
                         num_key_value_heads=1)
    d1 = write(tmp_path / "f", config(1, base_model_name_or_path="tiny"), eagle1_sd(True, False), False)
    with pytest.raises(ValueError, match=r"\(built for 'tiny'\) has hidden size 64 .* target's hidden_size is 128"):
        load_eagle(d1, target=other_h)
    d3 = write(tmp_path / "g", config(3), eagle3_sd(), False)
    with pytest.raises(ValueError, match=r"target features of hidden size 64 .* target's hidden_size is 128"):
        load_eagle(d3, target=other_h)
    other_v = make_model("llama", seed=5, num_hidden_layers=L_TARGET, vocab_size=V + 20)
    with pytest.raises(ValueError, match=r"vocabulary of 101 \('t2d' and config vocab_size\) but the target's "
                                         r"vocab_size is 121"):
        load_eagle(d3, target=other_v)
    with pytest.raises(ValueError, match=r"vocabulary of 101 .* target's vocab_size is 121"):
        load_eagle(d1, target=other_v)
    bad = eagle3_sd()
    bad["d2t"] = bad["d2t"] + 200
    with pytest.raises(ValueError, match="'d2t' .* outside the vocabulary"):
        load_eagle(write(tmp_path / "h", config(3), bad, False))
    with pytest.raises(FileNotFoundError, match="neither an EAGLE checkpoint directory"):
        load_eagle(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither pytorch_model.bin nor model.safetensors"):
        load_eagle(tmp_path / "empty")
    # a draft handed to a drafter for another target fails at the start of generation
    drafter = EagleDrafter(load_eagle(d1), depth=2, top_k=2, total_tokens=4)
    with pytest.raises(ValueError, match="hidden size of 64 but the target's hidden_size is 128"):
        generate(other_h, drafter, [1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"vocabulary size \(101\) differs from the target's \(121\)"):
        generate(other_v, drafter, [1, 2, 3], max_new_tokens=2)
    assert tgt is not None


def test_unreadable_files_and_bad_configs_name_the_file(tmp_path):
    """Truncated safetensors; config.json invalid, a list, with sizes that are no positive integers, or EAGLE-3
    feature layers the target does not have: ValueErrors naming the file."""
    import re

    d = write(tmp_path / "t", config(1), eagle1_sd(True, False), True)
    weights = str(d / "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(weights) + r".*truncated or not a safetensors file\?"):
        load_eagle(d)
    cfg = str(tmp_path / "c" / "config.json")
    for text, match in (("{", "is not valid JSON"), ('["llama"]', "must hold a JSON object")):
        write(tmp_path / "c", config(1), eagle1_sd(True, False), False)
        open(cfg, "w").write(text)
        with pytest.raises(ValueError, match=re.escape(cfg) + ".*" + match):
            load_eagle(tmp_path / "c")
    for key, value in (("hidden_size", "64"), ("num_attention_heads", 0), ("vocab_size", True), ("head_dim", 6.4),
                       ("rms_norm_eps", "small")):
        d = write(tmp_path / key, config(1, **{key: value}), eagle1_sd(True, False), False)
        with pytest.raises(ValueError, match=re.escape(str(d / "pytorch_model.bin")) + f".*{key!r} must be a positive"):
            load_eagle(d)
    d = write(tmp_path / "nosize", {k: v for k, v in config(1).items() if k != "intermediate_size"},
              eagle1_sd(True, False), False)
    with pytest.raises(ValueError, match=r"pytorch_model.bin.*lacks \['intermediate_size'\]"):
        load_eagle(d)
    bad_aux = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4]}}
    with pytest.raises(ValueError, match="lists three layer indices"):
        load_eagle(write(tmp_path / "aux", config(3, **bad_aux), eagle3_sd(), False))
    far = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, L_TARGET + 1]}}
    with pytest.raises(ValueError, match=rf"fuses target layers \[2, 4, {L_TARGET + 1}\] .* has {L_TARGET} layers"):
        load_eagle(write(tmp_path / "far", config(3, **far), eagle3_sd(), False), target=target())


# ---------------------------------------------------------------------------------------------------------------
# The networks against transformers' Llama modules.


def _causal_additive(T: int) -> torch.Tensor:
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


@torch.no_grad()
def test_eagle1_forward_equals_llama_decoder_layer(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    sd = eagle1_sd(True, False, seed=3)
    m = load_eagle(write(tmp_path / "e1", config(1), sd, False))
    cfg = transformers.LlamaConfig(**{k: v for k, v in config(1).items() if k not in ("architectures",)})
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in sd.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    g = torch.Generator().manual_seed(1)
    B, T = 2, 6
    feats, emb = torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)
    pos = torch.arange(3, 3 + T).expand(B, T)
    x = torch.cat([emb, feats], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    want = layer(x, attention_mask=_causal_additive(T), position_ids=pos,
                 position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))
    torch.testing.assert_close(m(feats, emb, pos), want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_eagle3_forward_equals_reference(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    sd = eagle3_sd(seed=4)
    m = load_eagle(write(tmp_path / "e3", config(3), sd, False))
    cfg = transformers.LlamaConfig(**{k: v for k, v in config(3).items() if k not in ("architectures",)})
    cfg._attn_implementation = "eager"
    acfg = transformers.LlamaConfig(**{**cfg.to_dict(), "hidden_size": 2 * H})
    acfg._attn_implementation = "eager"
    attn = LlamaAttention(acfg, 0).eval()
    attn.o_proj = torch.nn.Linear(NH * HD, H, bias=False)
    attn.load_state_dict({k[len("midlayer.self_attn."):]: v for k, v in sd.items()
                          if k.startswith("midlayer.self_attn.")})

    def rms(x, w, eps=1e-5):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    g = torch.Generator().manual_seed(2)
    B, T = 2, 5
    feats, emb = torch.randn(B, T, 3 * H, generator=g), torch.randn(B, T, H, generator=g)
    pos = torch.arange(T).expand(B, T)
    h = feats @ sd["fc.weight"].T
    x = torch.cat([rms(emb, sd["midlayer.input_layernorm.weight"]), rms(h, sd["midlayer.hidden_norm.weight"])], -1)
    a, _ = attn(x, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos), attention_mask=_causal_additive(T))
    h = h + a
    y = rms(h, sd["midlayer.post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(y @ sd["midlayer.mlp.gate_proj.weight"].T) * (y @ sd["midlayer.mlp.up_proj.weight"].T)
    h = h + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    out = m(feats, emb, pos, from_target=True)
    torch.testing.assert_close(out, h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.logits(out), rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T, atol=1e-5,
                               rtol=1e-5)
    # own outputs are fed back without fc
    torch.testing.assert_close(m(h, emb, pos, from_target=False)[:, 0],
                               m.midlayer(h, emb, pos)[:, 0])


@torch.no_grad()
def test_rotary_frequencies_stay_float32_in_a_bfloat16_draft(tmp_path):
    """A bfloat16 draft rotates with the float32 frequencies of HF's LlamaRotaryEmbedding (the ones it was trained
    with), not their bfloat16 roundings; the precomputed tables a drafter hands a level (``rotary=``) give the same
    result as the positions."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    sd = eagle1_sd(True, False, seed=5)
    m = load_eagle(write(tmp_path / "e1", config(1), sd, False)).to(torch.bfloat16)
    cfg = transformers.LlamaConfig(**{k: v for k, v in config(1).items() if k not in ("architectures",)})
    rot = m.rotary
    assert rot.inv_freq.dtype == torch.float32
    pos = torch.tensor([[5, 700, 1999]])
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)
    got_cos, got_sin = rot(pos)
    torch.testing.assert_close(got_cos[:, 0], cos, atol=1e-4, rtol=0)  # (bfloat16 frequencies: off by ~0.5)
    torch.testing.assert_close(got_sin[:, 0].abs(), sin.abs(), atol=1e-4, rtol=0)
    assert (got_sin[..., : HD // 2] * sin[:, None, :, : HD // 2] <= 1e-6).all()  # rotate-half's sign is carried
    g = torch.Generator().manual_seed(3)
    B, T = 1, 3
    feats, emb = torch.randn(B, T, H, generator=g).bfloat16(), torch.randn(B, T, H, generator=g).bfloat16()
    tables = rot(pos.expand(B, T))
    assert torch.equal(m(feats, emb, pos.expand(B, T), rotary=tables), m(feats, emb, pos.expand(B, T)))


# ---------------------------------------------------------------------------------------------------------------
# Loaded drafts run.


@pytest.mark.parametrize("version", [1, 3])
def test_loaded_draft_generates(tmp_path, version):
    tgt = target()
    d = write(tmp_path / "e", config(version, bias=False), eagle1_sd(False, False) if version == 1 else eagle3_sd(),
              True)
    drafter = EagleDrafter.from_pretrained(d, target=tgt, depth=3, top_k=3, total_tokens=8)
    assert drafter.max_nodes == 9
    assert drafter.hidden_state_layers == ((-1,) if version == 1 else (2, 4, 5))
    prompts = [[3, 4, 5, 6], [7, 8]]
    plain, _ = generate(tgt, None, prompts, max_new_tokens=8)
    out, stats = generate(tgt, drafter, prompts, max_new_tokens=8)
    assert all(torch.equal(a, b) for a, b in zip(out, plain))
    assert stats.target_forwards == stats.steps


def test_from_pretrained_drafts_over_the_draft_vocabulary_file(tmp_path):
    """An EAGLE-1 directory with ``draft_vocab.json`` (what ``specdec train-eagle`` writes) drafts over those ids by
    default; ``draft_vocab=None`` over the whole vocabulary; a bad file or value is a named error. Output unchanged."""
    from specdec_ext.models.draft_vocab import write_draft_vocab

    tgt = target()
    d = write(tmp_path / "e", config(1, bias=False), eagle1_sd(False, False), True)
    assert EagleDrafter.from_pretrained(d, target=tgt, depth=3, top_k=3, total_tokens=8).draft_vocab is None
    ids = list(range(0, V, 3))
    write_draft_vocab(d, ids)
    drafter = EagleDrafter.from_pretrained(d, target=tgt, depth=3, top_k=3, total_tokens=8)
    assert drafter.draft_vocab.tolist() == ids
    assert EagleDrafter.from_pretrained(d, target=tgt, depth=3, top_k=3, total_tokens=8,
                                        draft_vocab=None).draft_vocab is None
    prompts = [[3, 4, 5, 6], [7, 8]]
    plain, _ = generate(tgt, None, prompts, max_new_tokens=8)
    out, _ = generate(tgt, drafter, prompts, max_new_tokens=8)
    assert all(torch.equal(a, b) for a, b in zip(out, plain))
    with pytest.raises(ValueError, match="draft_vocab must be 'file', None or token ids"):
        EagleDrafter.from_pretrained(d, target=tgt, draft_vocab="frequent")
    (tmp_path / "e" / "draft_vocab.json").write_text('{"ids": "all"}')
    with pytest.raises(ValueError, match=r"EagleDrafter.from_pretrained: .*draft_vocab.json.* must hold"):
        EagleDrafter.from_pretrained(d, target=tgt)
