"""Official Medusa-1 checkpoints (specdec_ext.models.checkpoints): directories written here by hand in the published
layout (``config.json`` + ``medusa_lm_head.pt`` / ``.safetensors``, keys ``{h}.{l}.linear.weight|bias`` and
``{h}.{L}.weight``; random weights) load, compute the heads' formula, and bad files / mismatched targets give
errors naming the key and the shapes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from specdec_ext.drafters.medusa import MedusaDrafter
from specdec_ext.models.checkpoints import load_medusa, medusa_heads_from_state_dict, save_medusa

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, V = 64, 101


def official_state_dict(K: int, L: int, own_lm_head: bool, seed: int = 0, hidden: int = H, vocab: int = V):
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for h in range(K):
        for l in range(L):
            sd[f"{h}.{l}.linear.weight"] = 0.1 * torch.randn(hidden, hidden, generator=gen)
            sd[f"{h}.{l}.linear.bias"] = 0.1 * torch.randn(hidden, generator=gen)
        if own_lm_head:
            sd[f"{h}.{L}.weight"] = torch.randn(vocab, hidden, generator=gen)
    return sd


def write_checkpoint(path, sd, fmt: str = "pt", config: dict | None = None):
    os.makedirs(path, exist_ok=True)
    cfg = {"medusa_num_heads": 5, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    if config is not None:
        cfg = config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if fmt == "pt":
        torch.save(sd, os.path.join(path, "medusa_lm_head.pt"))
    else:
        from safetensors.torch import save_file

        save_file(sd, os.path.join(path, "medusa_lm_head.safetensors"))
    return str(path)


def formula(sd, x, K: int, L: int, lm_weight=None):
    """The published head forward, written out: per ResBlock x = x + SiLU(W x + b); logits = W_lm x."""
    out = []
    for h in range(K):
        y = x
        for l in range(L):
            y = y + F.silu(y @ sd[f"{h}.{l}.linear.weight"].T + sd[f"{h}.{l}.linear.bias"])
        w = sd[f"{h}.{L}.weight"] if lm_weight is None else lm_weight
        out.append(y @ w.T)
    return torch.stack(out, -2)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("own_lm_head", [True, False], ids=["own_lm_head", "legacy"])
@pytest.mark.parametrize("L", [1, 2])
def test_load_official_layout_matches_formula(tmp_path, fmt, own_lm_head, L):
    K = 3
    sd = official_state_dict(K, L, own_lm_head, seed=L)
    path = write_checkpoint(tmp_path / "medusa", sd, fmt, {"medusa_num_heads": 5, "medusa_num_layers": L,
                                                         "base_model_name_or_path": "x"})
    with pytest.warns(UserWarning, match="medusa_num_heads = 5 .* holds 3 heads"):
        heads = load_medusa(path)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size) == (K, L, H)
    assert heads.has_lm_head == own_lm_head and heads.vocab_size == (V if own_lm_head else None)
    assert heads.config["base_model_name_or_path"] == "x"
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if own_lm_head:
            got = heads(x)
            want = formula(sd, x, K, L)
        else:
            lm = torch.nn.Linear(H, V, bias=False)
            got = heads(x, lm_head=lm)
            want = formula(sd, x, K, L, lm.weight)
            with pytest.raises(ValueError, match="legacy heads .* need the target's lm_head"):
                heads(x)
        assert got.shape == (2, 5, K, V)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(heads(x, lm_head=lm if not own_lm_head else None, num_heads=2), want[..., :2, :],
                                   rtol=1e-5, atol=1e-5)
    # the official keys round-trip through save_medusa
    out = save_medusa(heads, tmp_path / "again", safetensors=(fmt == "safetensors"))
    assert os.path.basename(out) == ("medusa_lm_head.safetensors" if fmt == "safetensors" else "medusa_lm_head.pt")
    back = load_medusa(tmp_path / "again")
    assert set(back.heads.state_dict()) == set(sd)
    for k, v in back.heads.state_dict().items():
        torch.testing.assert_close(v, sd[k])


def test_weights_file_path_and_no_config(tmp_path):
    sd = official_state_dict(2, 1, True)
    f = tmp_path / "heads.pt"
    torch.save(sd, f)
    heads = load_medusa(f)  # a bare weights file, no config.json: everything from the keys
    assert heads.num_heads == 2 and heads.config == {}


def test_wrong_shapes_name_the_key(tmp_path):
    sd = official_state_dict(3, 1, True)
    sd["1.0.linear.weight"] = torch.zeros(H, H + 1)
    with pytest.raises(ValueError, match=r"'1\.0\.linear\.weight'.*shape \[64, 65\], expected \[64, 64\]"):
        load_medusa(write_checkpoint(tmp_path / "a", sd))
    sd = official_state_dict(3, 1, True)
    sd["2.1.weight"] = torch.zeros(V + 3, H)
    with pytest.raises(ValueError, match=r"'2\.1\.weight'.*shape \[104, 64\], expected \[101, 64\]"):
        load_medusa(write_checkpoint(tmp_path / "b", sd, "safetensors"))
    sd = official_state_dict(2, 1, True)
    sd["0.0.linear.bias"] = torch.zeros(H - 1)
    with pytest.raises(ValueError, match=r"'0\.0\.linear\.bias'.*shape \[63\], expected \[64\]"):
        medusa_heads_from_state_dict(sd)


def test_malformed_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a Medusa checkpoint directory nor a weights file"):
        load_medusa(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.pt"):
        load_medusa(tmp_path / "empty")
    sd = official_state_dict(2, 1, True)
    sd["0.0.linear.scale"] = torch.zeros(H)
    with pytest.raises(ValueError, match=r"unexpected key '0\.0\.linear\.scale'"):
        medusa_heads_from_state_dict(sd)
    sd = official_state_dict(3, 1, True)
    for k in [k for k in sd if k.startswith("1.")]:
        sd[k.replace("1.", "4.", 1)] = sd.pop(k)
    with pytest.raises(ValueError, match=r"heads \[0, 2, 4\]"):
        medusa_heads_from_state_dict(sd)
    sd = official_state_dict(2, 1, True)
    del sd["1.1.weight"]
    with pytest.raises(ValueError, match="differ in layout"):
        medusa_heads_from_state_dict(sd)
    sd = official_state_dict(2, 1, True)
    del sd["1.0.linear.bias"]
    with pytest.raises(ValueError, match=r"lacks key '1\.0\.linear\.bias'"):
        medusa_heads_from_state_dict(sd)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "medusa_lm_head.pt").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="cannot read"):
        load_medusa(tmp_path / "bad")


def test_mismatched_target(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                                   num_key_value_heads=1, head_dim=64, vocab_size=V)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(cfg).eval()
    ok = write_checkpoint(tmp_path / "ok", official_state_dict(2, 1, True),
                          config={"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "t"})
    heads = load_medusa(ok, target=target, dtype=torch.float64)
    assert next(heads.parameters()).dtype == torch.float64
    assert next(load_medusa(ok, target=target.to(torch.bfloat16)).parameters()).dtype == torch.bfloat16
    target.float()
    other_h = write_checkpoint(tmp_path / "h", official_state_dict(2, 1, True, hidden=32),
                               config={"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "b"})
    with pytest.raises(ValueError, match=r"built for 'b'.*hidden size 32.*\[32, 32\].*hidden_size is 64"):
        load_medusa(other_h, target=target)
    other_v = write_checkpoint(tmp_path / "v", official_state_dict(2, 1, True, vocab=50), "safetensors",
                               {"medusa_num_heads": 2, "medusa_num_layers": 1})
    with pytest.raises(ValueError, match=r"vocabulary of 50 .*'0\.1\.weight' has shape \[50, 64\].*vocab_size is 101"):
        load_medusa(other_v, target=target)
    # heads loaded without a target are checked when generation begins
    drafter = MedusaDrafter.from_pretrained(other_h, choices=[[0], [0, 0]])
    from specdec_ext.generate import generate

    with pytest.raises(ValueError, match="hidden size 32 .* hidden_size is 64"):
        generate(target, drafter, torch.tensor([1, 2, 3]), max_new_tokens=3)
    drafter = MedusaDrafter(load_medusa(other_v), choices=[[0]])
    with pytest.raises(ValueError, match=r"vocabulary size \(50\) differs from the target's \(101\)"):
        generate(target, drafter, torch.tensor([1, 2, 3]), max_new_tokens=3)


def test_unreadable_files_name_the_file(tmp_path):
    """Truncated safetensors, invalid or non-object config.json, a pickle that is no state dict: ValueErrors naming
    the file (not safetensors' or json's bare errors, nor an AttributeError)."""
    import re

    sd = official_state_dict(2, 1, True)
    path = write_checkpoint(tmp_path / "t", sd, "safetensors")
    weights = os.path.join(path, "medusa_lm_head.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(weights) + r".*truncated or not a safetensors file\?.*metadata"):
        load_medusa(path)
    path = write_checkpoint(tmp_path / "c", sd)
    cfg = os.path.join(path, "config.json")
    for text, match in (("{\"medusa_num_heads\": 2,", "is not valid JSON"), ("[2, 1]", "must hold a JSON object")):
        with open(cfg, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=re.escape(cfg) + ".*" + match):
            load_medusa(path)
    write_checkpoint(tmp_path / "l", sd)
    torch.save([torch.zeros(2)], tmp_path / "l" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="does not hold a state dict"):
        load_medusa(tmp_path / "l")
