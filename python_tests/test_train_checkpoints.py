"""train_loop's checkpoints on a tiny next-token model (an embedding and a linear layer; no transformers): saved every
N steps and every M minutes, a run killed with SIGKILL resumes from the last periodic checkpoint to the very
parameters and losses of an uninterrupted run, and a checkpoint of another model or other data is refused with an
error saying what it holds and what was asked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from specdec_ext.train.loop import CHECKPOINT_FILE, TrainConfig, read_checkpoint, train_loop

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Run in this process and, for the kill test, as a script in a child process: the same model, data and steps.
TRAINING = '''
import time
import torch
from specdec_ext.train.loop import TrainConfig, train_loop


def run(steps, checkpoint_dir=None, resume=False, every=0, minutes=0.0, step_seconds=0.0, hidden=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(17, hidden), torch.nn.Linear(hidden, 17))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 17, (int(n),), generator=g).tolist() for n in torch.randint(5, 12, (10,), generator=g)]

    def loss_fn(toks, mask):
        if step_seconds:
            time.sleep(step_seconds)  # a slow step: time for the checkpoint clock and for the kill
        logits = model(toks[:, :-1])
        y = toks[:, 1:].masked_fill(~mask[:, 1:], -100)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 17), y.reshape(-1), ignore_index=-100), 1

    cfg = TrainConfig(steps=steps, lr=1e-2, batch_size=3, progress=False, device="cpu", checkpoint_dir=checkpoint_dir,
                      checkpoint_every=every, checkpoint_minutes=minutes, resume=resume)
    result = train_loop(model, loss_fn, seqs, cfg, name="tiny", signature={"hidden": hidden})
    return model, result
'''
_ns: dict = {}
exec(TRAINING, _ns)  # noqa: S102 - the module's own source above
run = _ns["run"]


def same_run(a, b):
    (ma, ra), (mb, rb) = a, b
    assert ra.losses == rb.losses and ra.step == rb.step
    for x, y in zip(ma.state_dict().values(), mb.state_dict().values()):
        assert torch.equal(x, y)


def test_checkpoint_every_n_steps_and_resume_is_exact(tmp_path, monkeypatch):
    ck = str(tmp_path / "ck")
    cross_entropy, calls = torch.nn.functional.cross_entropy, []

    def interrupted_at_step_8(*args, **kwargs):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return cross_entropy(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", interrupted_at_step_8)
    with pytest.raises(KeyboardInterrupt):  # the checkpoint of step 6 remains
        run(12, ck, every=3)
    monkeypatch.undo()
    assert read_checkpoint(os.path.join(ck, CHECKPOINT_FILE), "tiny")["step"] == 6
    same_run(run(12, ck, resume=True, every=3), run(12))


def test_a_killed_run_resumes_from_its_time_based_checkpoint(tmp_path):
    """The child saves whenever 0.1 s of training passed since the last save (steps of 0.04 s) and is killed with
    SIGKILL once a checkpoint of step >= 5 exists; the resumed run equals an uninterrupted one."""
    ck = str(tmp_path / "ck")
    script = TRAINING + f"\nrun(10_000, {ck!r}, minutes=0.1 / 60, step_seconds=0.04)\n"
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"})
    path = os.path.join(ck, CHECKPOINT_FILE)
    try:
        deadline = time.monotonic() + 300
        step = 0
        while step < 5:
            assert child.poll() is None and time.monotonic() < deadline, "the child ended before a checkpoint"
            time.sleep(0.05)
            if os.path.isfile(path):
                step = read_checkpoint(path, "tiny")["step"]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    saved = read_checkpoint(path, "tiny")["step"]
    assert 5 <= saved < 10_000
    same_run(run(saved + 3, ck, resume=True), run(saved + 3))


def test_resume_refuses_another_model_or_other_data(tmp_path):
    ck = str(tmp_path / "ck")
    run(3, ck)
    with pytest.raises(ValueError, match=r"holds a tiny trained with hidden=8; this run asks for hidden=4"):
        run(6, ck, resume=True, hidden=4)
    # a checkpoint without the signature (or one that does not tell the shapes apart): the tensors are compared
    path = os.path.join(ck, CHECKPOINT_FILE)
    state = read_checkpoint(path, "tiny")
    torch.save({**state, "signature": {}}, path)
    with pytest.raises(ValueError, match=r"'0\.weight' is \[17, 8\] there but \[17, 4\] here \(and 1 more\)"):
        run(6, ck, resume=True, hidden=4)
    module = torch.nn.Linear(2, 2)
    seqs = [[1, 2, 3]] * 4
    cfg = TrainConfig(steps=5, batch_size=2, progress=False, device="cpu", checkpoint_dir=ck, resume=True)
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\) this run's model has \(weight, bias\); it has 3"):
        train_loop(module, lambda t, m: (module(t.float()[:, :2]).sum(), 1), seqs, cfg, name="tiny")
    # other data: the batches were drawn from 10 sequences
    torch.save(state, path)
    model = torch.nn.Sequential(torch.nn.Embedding(17, 8), torch.nn.Linear(8, 17))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"drew its batches from 10 training sequences, this run has 4"):
        train_loop(model, lambda t, m: (model(t).sum(), 1), [[1, 2, 3]] * 4, cfg, name="tiny",
                   signature={"hidden": 8})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before loading
    torch.save({"step": 3}, path)
    with pytest.raises(ValueError, match=r"is not a training checkpoint of this library .* it has \['step'\]"):
        run(6, ck, resume=True)


@pytest.mark.parametrize("key,value", [("steps", -1), ("batch_size", 0), ("lr", 0.0), ("lr", float("nan")),
                                       ("checkpoint_every", -2), ("checkpoint_minutes", -1.0), ("warmup", 1.5)])
def test_bad_config_is_a_value_error_naming_the_field(key, value):
    module = torch.nn.Linear(2, 2)
    cfg = TrainConfig(steps=1, progress=False, device="cpu")
    setattr(cfg, key, value)
    with pytest.raises(ValueError, match=f"tiny: {key} must be"):
        train_loop(module, lambda t, m: (module(t.float()[:, :2]).sum(), 1), [[1, 2, 3]], cfg, name="tiny")
