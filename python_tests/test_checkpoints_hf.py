"""``load_model`` on broken Hugging Face model folders, as users met them: every failure is a ``ValueError`` (a missing
file a ``FileNotFoundError``) whose message names the file and says what is wrong — truncated or garbage
safetensors, invalid or non-object config.json, a plain pickle for weights, weights shaped unlike the config, and
another model's folder (an EAGLE draft) whose weights would leave the LM randomly initialised."""

from __future__ import annotations

import json
import os
import pickle
import re

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext.generate import load_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    return make_model("llama", seed=2)


def folder(tiny, tmp_path, name) -> str:
    path = str(tmp_path / name)
    tiny.save_pretrained(path)
    return path


def edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_a_good_folder_loads_exactly(tiny, tmp_path):
    model = load_model(folder(tiny, tmp_path, "ok"), dtype="float32")
    for (k, a), b in zip(tiny.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype .* got 'int8'"):
        load_model(str(tmp_path / "ok"), dtype="int8")


@pytest.mark.parametrize("cut", ["half", "header"])
def test_truncated_safetensors(tiny, tmp_path, cut):
    path = folder(tiny, tmp_path, "m")
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2] if cut == "half" else data[:20])
    with pytest.raises(ValueError, match=re.escape(weights) + ".*deserializing header"):
        load_model(path)


def test_config_json_errors(tiny, tmp_path):
    path = folder(tiny, tmp_path, "m")
    cfg = os.path.join(path, "config.json")
    for text, match in (("{not json", r"is not valid JSON \(Expecting property name .* line 1 column 2\)"),
                        ("[1, 2]", r"must hold a JSON object .* got a JSON list"),
                        ('{"hidden_size": 64}', "names no 'model_type'")):
        with open(cfg, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=re.escape(repr(cfg)) + ".*" + match):
            load_model(path)
    os.remove(cfg)
    with pytest.raises(FileNotFoundError, match=re.escape(cfg) + "' is missing"):
        load_model(path)
    with pytest.raises(FileNotFoundError, match="is not a local directory"):
        load_model(str(tmp_path / "nowhere"))


def test_pickled_weights(tiny, tmp_path):
    path = folder(tiny, tmp_path, "m")
    os.remove(os.path.join(path, "model.safetensors"))
    weights = os.path.join(path, "pytorch_model.bin")
    torch.save(tiny.state_dict(), weights)  # a plain torch.save of tensors: loads
    model = load_model(path, dtype="float32")
    assert torch.equal(model.lm_head.weight, tiny.lm_head.weight)
    with open(weights, "wb") as f:
        pickle.dump({"model.embed_tokens.weight": [1.0, 2.0]}, f)  # a bare pickle: refused, named
    with pytest.raises(ValueError, match=re.escape(weights)):
        load_model(path)
    os.remove(weights)
    with pytest.raises(FileNotFoundError, match="holds none of model.safetensors"):
        load_model(path)


@pytest.mark.parametrize("changes,key,stored,wanted", [
    ({"intermediate_size": 96}, "model.layers.0.mlp.down_proj.weight", [64, 128], [64, 96]),
    ({"vocab_size": 120}, "lm_head.weight", [101, 64], [120, 64]),
])
def test_config_shapes_unlike_the_weights(tiny, tmp_path, changes, key, stored, wanted):
    path = folder(tiny, tmp_path, "m")
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=re.escape(f"{key!r} is {stored} in the weights but {wanted} by the config")):
        load_model(path)


def test_an_eagle_draft_folder_is_not_a_draft_model(tiny, tmp_path):
    """What `--draft-model EAGLE_DIR` did: transformers built a one-layer Llama from the draft's layer, with random
    embeddings, norms and lm_head."""
    from specdec_ext.models.checkpoints import save_eagle
    from specdec_ext.models.eagle import Eagle1Model
    from specdec_ext.train.eagle import eagle_config_for

    path = str(tmp_path / "eagle")
    save_eagle(Eagle1Model(eagle_config_for(tiny)), path, safetensors=True)
    with pytest.raises(ValueError, match=re.escape(os.path.join(path, "model.safetensors")) +
                       r"' leaves 4 of the model's 12 tensors uninitialised \(lm_head.weight, model.embed_tokens.weight, "
                       r"model.layers.0.input_layernorm.weight, model.norm.weight\): not this 'llama' model's"):
        load_model(path)
    # one tensor missing from an otherwise complete checkpoint is refused too
    from safetensors.torch import load_file, save_file

    path = folder(tiny, tmp_path, "partial")
    sd = load_file(os.path.join(path, "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"leaves 1 of the model's \d+ tensors uninitialised "
                                         r"\(model.layers.1.mlp.up_proj.weight\)"):
        load_model(path)


def test_tied_embeddings_are_not_missing(tmp_path):
    tied = make_model("llama", seed=3, tie_word_embeddings=True)
    tied.save_pretrained(tmp_path / "tied")
    model = load_model(str(tmp_path / "tied"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
