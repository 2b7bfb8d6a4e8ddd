"""The ``specdec`` command line's errors: every one is one line ``specdec <command>: ...`` on stderr with a non-zero
exit (2 for a bad command line, 130 for Ctrl-C, 1 otherwise), the traceback only with ``specdec --debug``; bad
``--device``, ``--chat`` without a chat template, broken model folders; ``--print-ids``."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext import cli  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = "5 6 7 8 5 6 7 8 5 6"


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


def word_tokenizer(chat_template: str | None):
    """A word-level tokenizer ("w0" .. "w100") for the 101-token tiny model, with ``chat_template``."""
    from test_train_data_cli import word_tokenizer as with_a_chat_template

    tok = with_a_chat_template()
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory, model):
    """The tiny model with a tokenizer that has no chat template."""
    path = tmp_path_factory.mktemp("tiny_llama_text")
    model.save_pretrained(path)
    word_tokenizer(None).save_pretrained(path)
    return str(path)


def error_of(argv: list[str]) -> tuple[int | str, str]:
    """``cli.main(argv)``'s exit as the process would report it: (status, the stderr line), whether main exits
    through SystemExit(message) (printed by Python, status 1) or prints and exits with a status."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    code = exc.value.code
    return (1, code) if isinstance(code, str) else (code, None)


def one_line(argv: list[str], capsys, status: int = 1) -> str:
    code, line = error_of(argv)
    if line is None:
        line = capsys.readouterr().err
        assert line.endswith("\n")
        line = line[:-1]
    assert code == status
    assert "\n" not in line and "Traceback" not in line, line
    words = [a for a in argv if a != "--debug"]
    command = " ".join(["specdec"] + words[: 2 if words[0] == "zoo" else 1])
    assert line.startswith(command + ": "), (command, line)
    return line


def test_bad_command_lines_are_one_line_with_status_2(capsys):
    line = one_line(["generate", "--model", "m", "--max-new-tokens", "x"], capsys, status=2)
    assert line == ("specdec generate: argument --max-new-tokens: invalid int value: 'x' (see specdec generate "
                    "--help)")
    line = one_line(["generate", "--prompt-ids", "1"], capsys, status=2)
    assert "the following arguments are required: --model" in line
    line = one_line(["zoo", "evaluate"], capsys, status=2)
    assert line.startswith("specdec zoo evaluate: the following arguments are required: --out")
    code, _ = error_of(["frobnicate"])
    assert code == 2 and capsys.readouterr().err.startswith("specdec: argument command: invalid choice: 'frobnicate'")


@pytest.mark.parametrize("command", [["generate", "--model", "M", "--prompt-ids", "1"], ["bench", "--tiny"],
                                     ["train-medusa", "--model", "M", "--data", "D", "--out", "O"]])
def test_bad_devices_are_refused_before_anything_loads(command, capsys):
    """--device is checked once, in main, for every command that has it (the model folder "M" does not exist:
    the device error comes first)."""
    for bad in ("bogus", "mps", "cuda:-1", ""):
        line = one_line(command + ["--device", bad], capsys)
        assert line.endswith(f": --device must be cpu or cuda[:<index>] (specdec_ext's kernels run on CPUs and CUDA "
                             f"GPUs), got {bad!r}"), line
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        line = one_line(command + ["--device", f"cuda:{n}"], capsys)
        assert f"this machine has {n} CUDA GPU(s)" in line
    else:
        line = one_line(command + ["--device", "cuda"], capsys)
        assert ": --device 'cuda': no CUDA GPU is available here" in line and line.endswith("; use cpu")


def test_bench_entry_point_refuses_a_bad_device(capsys):
    from specdec_ext.bench import cli as bench_cli

    assert bench_cli.main(["--tiny", "--device", "bogus"]) == 2
    assert capsys.readouterr().err.startswith("specdec bench: --device must be cpu or cuda[:<index>]")


def test_generate_input_errors(model_dir, text_model_dir, capsys):
    line = one_line(["generate", "--model", model_dir + "_missing", "--prompt-ids", "1"], capsys)
    assert "_missing' is not a local directory" in line
    line = one_line(["generate", "--model", model_dir, "--prompt-ids", "1 x"], capsys)
    assert line == "specdec generate: --prompt-ids must be integers, got '1 x'"
    line = one_line(["generate", "--model", model_dir, "--prompt-ids", "1", "--ngram", "--draft-model", model_dir],
                    capsys)
    assert line == ("specdec generate: choose one drafter (--ngram, --suffix, --draft-model, --medusa, --eagle, "
                    "--self-spec or --early-exit)")
    line = one_line(["generate", "--model", model_dir, "--prompt-ids", "1 500"], capsys)
    assert "token 500, outside the target's vocabulary [0, 101)" in line
    # --chat: an error where the tokenizer has no chat template (it used to be ignored), and with --prompt-ids
    line = one_line(["generate", "--model", text_model_dir, "--prompt", "w5 w6", "--chat"], capsys)
    assert line == (f"specdec generate: --chat: the tokenizer in {text_model_dir!r} has no chat template; drop "
                    "--chat to use the prompt as it is")
    line = one_line(["generate", "--model", text_model_dir, "--prompt-ids", "5 6", "--chat"], capsys)
    assert "--chat wraps --prompt text in the chat template" in line
    line = one_line(["generate", "--model", model_dir, "--prompt", "hello"], capsys)
    assert "no tokenizer could be loaded from" in line and line.endswith("pass --prompt-ids instead of --prompt")


def test_print_ids_with_a_tokenizer(model, text_model_dir, capsys):
    """--print-ids: token ids out, streamed or at the end, though the folder has a tokenizer (text otherwise)."""
    want, _ = generate(model, None, torch.tensor([int(t) for t in IDS.split()]), max_new_tokens=9, eos_token_id=[0])
    new = want[10:].tolist()
    for extra in ([], ["--no-stream"], ["--ngram"]):
        assert cli.main(["generate", "--model", text_model_dir, "--prompt-ids", IDS, "--max-new-tokens", "9",
                         "--eos-id", "0", "--print-ids", *extra]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert [int(t) for t in lines[0].split()] == new and "tokens/s" in lines[-1]
    # text in, ids out
    text = " ".join(f"w{t}" for t in IDS.split())
    assert cli.main(["generate", "--model", text_model_dir, "--prompt", text, "--max-new-tokens", "9", "--eos-id", "0",
                     "--print-ids"]) == 0
    assert [int(t) for t in capsys.readouterr().out.splitlines()[0].split()] == new
    # without --print-ids: the same tokens as text
    assert cli.main(["generate", "--model", text_model_dir, "--prompt-ids", IDS, "--max-new-tokens", "9", "--eos-id",
                     "0", "--no-stream"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == [f"w{t}" for t in new]


def _broken_copy(model, tmp_path, name: str) -> str:
    path = str(tmp_path / name)
    model.save_pretrained(path)
    return path


def test_broken_model_folders_are_one_line(model, tmp_path, capsys):
    """Whatever a loader raises for a broken folder reaches the user as one line that names the folder."""
    trunc = _broken_copy(model, tmp_path, "truncated")
    weights = os.path.join(trunc, "model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2])
    bad_json = _broken_copy(model, tmp_path, "bad_json")
    with open(os.path.join(bad_json, "config.json"), "w") as f:
        f.write("{not json")
    for path in (trunc, bad_json):
        line = one_line(["generate", "--model", path, "--prompt-ids", "1 2"], capsys)
        assert path in line, line


class _CreatesFile:
    """A pickle that, when unpickled without weights_only, creates a file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_checkpoint_does_not_run_and_is_one_line(model, tmp_path, capsys):
    path = _broken_copy(model, tmp_path, "pickled")
    os.remove(os.path.join(path, "model.safetensors"))
    marker = str(tmp_path / "ran")
    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _CreatesFile(marker)}, f, protocol=2)
    code, line = error_of(["generate", "--model", path, "--prompt-ids", "1 2"])
    assert not os.path.exists(marker)
    assert code == 1 and line.startswith("specdec generate: ") and "\n" not in line


def test_a_medusa_config_that_is_a_list_is_one_line(model, model_dir, tmp_path, capsys):
    from specdec_ext.drafters import MedusaHeads
    from specdec_ext.models.checkpoints import save_medusa

    heads = tmp_path / "heads"
    save_medusa(MedusaHeads(2, model.config.hidden_size, model.config.vocab_size), heads, safetensors=True)
    (heads / "config.json").write_text(json.dumps([1, 2, 3]))
    line = one_line(["generate", "--model", model_dir, "--medusa", str(heads), "--prompt-ids", "1 2"], capsys)
    assert "config.json" in line, line


def test_unexpected_errors_and_interrupts(model_dir, monkeypatch, capsys):
    """A bug's exception is one line with its type and the --debug hint; with --debug it propagates; Ctrl-C is
    one line and status 130."""
    def boom(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli, "generate_cmd", boom)
    argv = ["generate", "--model", model_dir, "--prompt-ids", "1"]
    assert one_line(argv, capsys) == ("specdec generate: unexpected RuntimeError: boom second line (run with specdec "
                                      "--debug for the traceback)")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["--debug", *argv])

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "generate_cmd", interrupted)
    assert one_line(argv, capsys, status=130) == "specdec generate: interrupted"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--debug", *argv])


def _specdec(*argv, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "specdec_ext", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_the_process_prints_one_line(model_dir):
    """(--debug's traceback: test_unexpected_errors_and_interrupts, in process.)"""
    proc = _specdec("generate", "--model", model_dir + "_missing", "--prompt-ids", "1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("specdec generate: ") and "is not a local directory" in err


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_mid_generation_is_one_line_and_status_130(model, model_dir):
    budget = 300
    out, _ = generate(model, None, torch.tensor([1, 2, 3]), max_new_tokens=budget, eos_token_id=[])
    eos = min(set(range(101)) - set(out.tolist()))  # never emitted: the generation runs until interrupted
    # (a shell runs a background job with SIGINT ignored, and Python keeps an ignored SIGINT ignored: the child gets
    # the default disposition back, so that the test does not depend on how the test run was started)
    proc = _specdec("generate", "--model", model_dir, "--prompt-ids", "1 2 3", "--max-new-tokens", str(budget),
                    "--eos-id", str(eos), "--print-ids",
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.read(1)  # the first streamed token: the generation is running
        assert first, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    # (stderr's earlier lines are transformers' loading progress bar)
    assert proc.returncode == 130 and err.endswith("\nspecdec generate: interrupted\n") and "Traceback" not in err
