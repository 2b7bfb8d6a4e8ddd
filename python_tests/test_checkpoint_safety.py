"""No loader of specdec_ext runs code from a file. Each one (Medusa heads, EAGLE drafts, Hugging Face model folders,
the model family, every ``train-*`` command's ``--resume``, ``train_loop``'s resume, ``zoo build --resume``) is
handed a crafted pickle whose unpickling would create a file (``__reduce__`` -> ``builtins.open``), written both as
a ``torch.save`` archive and as a bare pickle: the file must not appear, and the error must name the checkpoint.
The first test is the control: unpickled without ``weights_only``, the same files do create it."""

from __future__ import annotations

import os
import pickle
import re

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext.drafters import MedusaHeads  # noqa: E402
from specdec_ext.models.checkpoints import load_eagle, load_medusa, save_eagle, save_medusa  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CreatesFile:
    """Unpickled by a full unpickler, this object's reconstruction opens (creates) ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def write_crafted(path, marker, kind: str) -> str:
    payload = {"0.0.linear.weight": CreatesFile(str(marker))}
    if kind == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    return str(path)


@pytest.fixture(params=["torch.save", "pickle"])
def kind(request):
    return request.param


def refused(fn, path, marker, exc=ValueError):
    """``fn()`` raises ``exc`` naming ``path``, and ``marker`` was not created."""
    with pytest.raises(exc, match=re.escape(str(path))):
        fn()
    assert not os.path.exists(marker), "the crafted pickle ran"


def test_control_the_crafted_files_run_without_weights_only(tmp_path, kind):
    marker = tmp_path / "ran"
    f = write_crafted(tmp_path / "crafted.pt", marker, kind)
    if kind == "torch.save":
        torch.load(f, weights_only=False)
    else:
        with open(f, "rb") as fh:
            pickle.load(fh)
    assert marker.exists()


@pytest.fixture(scope="module")
def tiny():
    return make_model("llama", seed=1)


def test_load_medusa(tmp_path, tiny, kind):
    d = tmp_path / "medusa"
    save_medusa(MedusaHeads(2, 64, 101), d)
    f = write_crafted(d / "medusa_lm_head.pt", tmp_path / "ran", kind)
    refused(lambda: load_medusa(d, target=tiny), f, tmp_path / "ran")


def test_load_eagle(tmp_path, tiny, kind):
    from specdec_ext.models.eagle import Eagle1Model
    from specdec_ext.train.eagle import eagle_config_for

    d = tmp_path / "eagle"
    save_eagle(Eagle1Model(eagle_config_for(tiny)), d)
    f = write_crafted(d / "pytorch_model.bin", tmp_path / "ran", kind)
    refused(lambda: load_eagle(d, target=tiny), f, tmp_path / "ran")


def hf_folder_with_pickle(model, d, marker, kind) -> str:
    model.save_pretrained(d)
    os.remove(os.path.join(d, "model.safetensors"))
    return write_crafted(os.path.join(d, "pytorch_model.bin"), marker, kind)


def test_load_model(tmp_path, tiny, kind):
    from specdec_ext.generate import load_model

    f = hf_folder_with_pickle(tiny, tmp_path / "model", tmp_path / "ran", kind)
    refused(lambda: load_model(str(tmp_path / "model")), f, tmp_path / "ran")


@pytest.mark.parametrize("member", ["target", "draft", "medusa", "eagle1"])
def test_load_family(tmp_path, tiny, member):
    from test_train_data_cli import word_tokenizer

    from specdec_ext.models.eagle import Eagle1Model, Eagle3Model
    from specdec_ext.train.eagle import eagle_config_for
    from specdec_ext.zoo import load_family

    root = tmp_path / "family"
    for name in ("target", "draft"):
        tiny.save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
    save_medusa(MedusaHeads(2, 64, 101), root / "medusa")
    save_eagle(Eagle1Model(eagle_config_for(tiny)), root / "eagle1")
    save_eagle(Eagle3Model(eagle_config_for(tiny, 50, (0, 1, 2))), root / "eagle3")
    weights = {"target": "pytorch_model.bin", "draft": "pytorch_model.bin", "medusa": "medusa_lm_head.pt",
               "eagle1": "pytorch_model.bin"}[member]
    for f in os.listdir(root / member):
        if f.endswith((".safetensors", ".bin", ".pt")):
            os.remove(root / member / f)
    f = write_crafted(root / member / weights, tmp_path / "ran", "torch.save")
    refused(lambda: load_family(str(root)), f, tmp_path / "ran")


def crafted_trainer_state(checkpoint_dir, marker, kind) -> str:
    from specdec_ext.train.loop import CHECKPOINT_FILE

    os.makedirs(checkpoint_dir, exist_ok=True)
    return write_crafted(os.path.join(checkpoint_dir, CHECKPOINT_FILE), marker, kind)


def test_train_loop_resume(tmp_path, kind):
    from specdec_ext.train import TrainConfig, train_loop

    module = torch.nn.Linear(4, 4)
    ckdir = tmp_path / "ck"
    f = crafted_trainer_state(ckdir, tmp_path / "ran", kind)
    cfg = TrainConfig(steps=2, batch_size=2, progress=False, checkpoint_dir=str(ckdir), resume=True, device="cpu")

    def loss_fn(toks, mask):
        return module(toks.float()[:, :4]).square().mean(), 1

    refused(lambda: train_loop(module, loss_fn, [[1, 2, 3, 4]] * 4, cfg), f, tmp_path / "ran")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("target")
    tiny.save_pretrained(d)
    (d / "ids.jsonl").write_text('{"input_ids": [5, 6, 7, 8, 9, 10, 11, 12]}\n' * 6)
    return d


@pytest.mark.parametrize("command", ["train-medusa", "train-eagle", "train-draft"])
def test_train_command_resume(tmp_path, model_dir, command, capsys):
    out = tmp_path / "out"
    f = crafted_trainer_state(out / "checkpoint", tmp_path / "ran", "torch.save")
    from test_train_data_cli import failure

    msg = failure(capsys, command, "--model", str(model_dir), "--data", str(model_dir / "ids.jsonl"), "--out", str(out),
                  "--steps", "2", "--heldout", "0", "--no-progress", "--resume")
    assert f in msg and "weights-only" in msg, msg
    assert not os.path.exists(tmp_path / "ran")


def test_zoo_build_resume(tmp_path):
    from dataclasses import replace

    from specdec_ext.zoo import QUICK, build_zoo

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n\n" for j in range(40)))
    out = tmp_path / "family"
    f = crafted_trainer_state(out / ".build" / "target", tmp_path / "ran", "torch.save")
    spec = replace(QUICK, vocab_size=300)
    refused(lambda: build_zoo(str(out), spec, resume=True, progress=False, corpus_root=str(corpus), threads=1), f,
            tmp_path / "ran")
