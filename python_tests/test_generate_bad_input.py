"""specdec_ext.generate: bad input gives a clear error before anything is generated; the CLI's generate command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext import cli  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, Drafter, NgramDrafter  # noqa: E402
from specdec_ext.generate import generate, load_model  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=3)


def test_bad_input(model):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, None, torch.zeros(1, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, NgramDrafter(), [[1, 2], []])
    with pytest.raises(ValueError, match=r"token 500, outside the target's vocabulary \[0, 101\)"):
        generate(model, None, torch.tensor([1, 500]))
    other = make_model("llama", seed=4, vocab_size=57)
    with pytest.raises(ValueError, match=r"vocabulary size \(57\) differs from the target's \(101\)"):
        generate(model, DraftModelDrafter(other, 3), torch.tensor([1, 2, 3]), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"max_cache_len = 20 is too small.*needs 26 cache positions"):
        generate(model, NgramDrafter(num_pred_tokens=5), torch.tensor([1, 2, 3, 4]), max_new_tokens=16,
                 max_cache_len=20)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the target's max_position_embeddings = {limit}"):
        generate(model, None, torch.tensor([1, 2, 3]), max_new_tokens=limit)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        generate(model, None, torch.tensor([1, 2]), temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(model, None, torch.tensor([1, 2]), temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        generate(model, None, torch.tensor([1, 2]), temperature=1.0, top_k=-3)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate(model, None, torch.tensor([1, 2]), max_new_tokens=0)
    with pytest.raises(ValueError, match="a streamer needs batch size 1"):
        generate(model, None, torch.tensor([[1, 2], [3, 4]]), streamer=object())
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(model, None, torch.tensor([1, 2]), eos_token_id=1000)
    with pytest.raises(ValueError, match="num_pred_tokens >= 1"):
        NgramDrafter(num_pred_tokens=0)
    with pytest.raises(FileNotFoundError, match="is not a local directory"):
        load_model("/nonexistent/model/dir")
    assert isinstance(NgramDrafter(), Drafter) and isinstance(DraftModelDrafter(other, 2), Drafter)


class _Partial:
    """A drafter with one member missing or wrong (see the tests below)."""

    max_nodes = 3
    max_depth = 2
    hidden_state_layers = ()
    forwards = 0
    defers_prefill = False
    serves_row_subsets = True

    def begin(self, target, state, prefill_hidden_states=None):
        pass

    def add_rows(self, target, rows, prefill_hidden_states=None):
        pass

    def retire(self, keep):
        pass

    def propose(self, state, max_depth, max_nodes):
        raise AssertionError("never reached: the drafter is refused before the generation starts")


def test_non_drafters_are_refused_naming_the_argument(model):
    """Item 10: a model (or anything else) where a drafter is expected is a ValueError at the start, not an
    AttributeError from inside the loop."""
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"generate: drafter must be a drafter \(max_nodes, max_depth, "
                                         r"hidden_state_layers, forwards, defers_prefill, serves_row_subsets, begin, "
                                         r"add_rows, propose, observe, retire: .*got LlamaForCausalLM without "
                                         r"max_nodes, max_depth, hidden_state_layers, forwards, defers_prefill, "
                                         r"serves_row_subsets, begin, add_rows, propose, observe, retire.*"
                                         r"DraftModelDrafter\(model\)"):
        generate(model, model, ids)
    with pytest.raises(ValueError, match="got str without max_nodes"):
        generate(model, "ngram", ids)
    with pytest.raises(ValueError, match="got _Partial without observe$"):
        generate(model, _Partial(), ids)
    for attr, value, msg in (("max_nodes", 0, r"drafter.max_nodes must be an integer >= 1, got 0"),
                             ("max_nodes", 2.5, r"drafter.max_nodes must be an integer >= 1, got 2.5"),
                             ("max_depth", -1, r"drafter.max_depth must be an integer >= 0, got -1"),
                             ("hidden_state_layers", None, r"hidden_state_layers must be a sequence of integers"),
                             ("hidden_state_layers", (-1.0,), r"hidden_state_layers must be a sequence of integers")):
        bad = _Partial()
        bad.observe = lambda *a: None
        setattr(bad, attr, value)
        with pytest.raises(ValueError, match=msg):
            generate(model, bad, ids)
    # arguments swapped: the drafter where the target goes
    with pytest.raises(ValueError, match=r"target must be a Hugging Face causal LM .*got NgramDrafter"):
        generate(NgramDrafter(), model, ids)


def test_prompts_must_be_integer_token_ids(model):
    """Item 10: a float prompt tensor was silently accepted (rounded to ids); any non-integer prompt is a
    ValueError that says what it got."""
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids .*dtype torch.float32"):
        generate(model, None, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids .*dtype torch.bool"):
        generate(model, None, torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match=r"input_ids\[1\] must hold integer token ids .*dtype torch.float16"):
        generate(model, None, [torch.tensor([1, 2]), torch.tensor([3.0], dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"input_ids\[0\] must be a list of integer token ids .*got float 1.5"):
        generate(model, None, [1.5, 2.0])
    with pytest.raises(ValueError, match=r"input_ids\[0\] .*got a list holding 2.5 \(float\)"):
        generate(model, None, [[1, 2.5]])
    with pytest.raises(ValueError, match=r"input_ids\[0\] must be a 1-D tensor of token ids, got shape \(1, 2\)"):
        generate(model, None, [torch.tensor([[1, 2]])])
    with pytest.raises(ValueError, match="input_ids must be a tensor or a list of prompts, got str"):
        generate(model, None, "1 2 3")
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id, a list of them or None, got 1.5"):
        generate(model, None, torch.tensor([1, 2]), eos_token_id=1.5)
    with pytest.raises(ValueError, match=r"streamer must have put\(\) and end\(\).*got object"):
        generate(model, None, torch.tensor([1, 2]), streamer=object())
    with pytest.raises(ValueError, match="generator must be a torch.Generator, got int"):
        generate(model, None, torch.tensor([1, 2]), temperature=1.0, generator=3)
    with pytest.raises(ValueError, match="seed must be an integer, got 0.5"):
        generate(model, None, torch.tensor([1, 2]), temperature=1.0, seed=0.5)
    with pytest.raises(ValueError, match="max_cache_len must be an integer, got 40.0"):
        generate(model, None, torch.tensor([1, 2]), max_cache_len=40.0)
    # integer ids of any integer type are token ids: the same tokens as int64
    want, _ = generate(model, NgramDrafter(), torch.tensor([5, 6, 7, 5, 6]), max_new_tokens=6, eos_token_id=[])
    for ids in (torch.tensor([5, 6, 7, 5, 6], dtype=torch.int32), [5, 6, 7, 5, 6], [[5, 6, 7, 5, 6]]):
        got, _ = generate(model, NgramDrafter(), ids, max_new_tokens=6, eos_token_id=[])
        got = got[0] if isinstance(got, list) else got
        assert got.tolist() == want.tolist()


def test_sliding_window_models_are_refused_past_the_window():
    """Tree verification applies no sliding-window mask: a generation that could reach past the window is an error
    (never wrong tokens); one that fits runs and equals HF."""
    import transformers

    config = transformers.GPTNeoConfig(vocab_size=101, max_position_embeddings=64, hidden_size=64, num_layers=2,
                                       num_heads=4, attention_types=[[["global", "local"], 1]], window_size=16,
                                       intermediate_size=128)
    torch.manual_seed(0)
    neo = transformers.GPTNeoForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match=r"sliding-window attention \(window 16\).*needs? 19 positions"):
        generate(neo, NgramDrafter(num_pred_tokens=3), torch.tensor([1, 2, 3, 4]), max_new_tokens=12, eos_token_id=[])
    out, _ = generate(neo, NgramDrafter(num_pred_tokens=3), torch.tensor([1, 2, 3, 4]), max_new_tokens=9,
                      eos_token_id=[])
    hf = neo.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=9, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    assert out.tolist() == hf[0].tolist()
    mistral = make_model("mistral", seed=1, sliding_window=12)
    with pytest.raises(NotImplementedError, match=r"window 12"):
        generate(mistral, None, torch.tensor([1, 2, 3]), max_new_tokens=10, eos_token_id=[])
    with pytest.raises(NotImplementedError, match=r"DraftModelDrafter: .*window 12"):
        generate(make_model("llama", seed=1), DraftModelDrafter(mistral, 2), torch.tensor([1, 2, 3]),
                 max_new_tokens=8, eos_token_id=[])


def test_exact_cache_fits(model):
    """The default cache is exactly large enough: max_cache_len at the minimum works."""
    out, _ = generate(model, NgramDrafter(num_pred_tokens=5), torch.tensor([1, 2, 3, 4]), max_new_tokens=16,
                      max_cache_len=26, eos_token_id=[])
    assert out.numel() == 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


def _summary_ok(text: str) -> None:
    assert "tokens/s" in text and "mean accepted length" in text


def test_cli_generate_ngram_and_draft_model(model_dir, capsys):
    ids = "5 6 7 8 5 6 7 8 5 6"
    assert cli.main(["generate", "--model", model_dir, "--ngram", "--prompt-ids", ids, "--max-new-tokens", "12",
                     "--eos-id", "0"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    streamed = [int(t) for t in lines[0].split()]
    assert len(streamed) <= 12 and streamed
    _summary_ok(lines[-1])
    want, _ = generate(load_model(model_dir), None, torch.tensor([int(t) for t in ids.split()]), max_new_tokens=12,
                       eos_token_id=[0])
    assert streamed == want[10:].tolist()
    assert cli.main(["generate", "--model", model_dir, "--draft-model", model_dir, "--prompt-ids", ids,
                     "--max-new-tokens", "8", "--temperature", "0.7", "--top-p", "0.9", "--no-stream",
                     "--tree-width", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out[0].split()) <= 8
    _summary_ok(out[-1])
    assert cli.main(["generate", "--model", model_dir, "--draft-model", model_dir, "--prompt-ids", ids,
                     "--max-new-tokens", "12", "--eos-id", "0", "--no-stream", "--confidence-threshold", "0.5"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert [int(t) for t in out[0].split()] == want[10:].tolist()  # greedy: plain decoding's tokens
    assert cli.main(["generate", "--model", model_dir, "--draft-model", model_dir, "--prompt-ids", ids,
                     "--max-new-tokens", "12", "--eos-id", "0", "--no-stream", "--tree-width", "2",
                     "--tree-total-tokens", "5"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert [int(t) for t in out[0].split()] == want[10:].tolist()  # the dynamic tree, greedy: plain's tokens
    with pytest.raises(SystemExit, match="total_tokens makes a dynamic tree"):
        cli.main(["generate", "--model", model_dir, "--draft-model", model_dir, "--prompt-ids", ids,
                  "--tree-total-tokens", "5"])
    with pytest.raises(SystemExit, match="confidence_threshold must be a number in"):
        cli.main(["generate", "--model", model_dir, "--draft-model", model_dir, "--prompt-ids", ids,
                  "--confidence-threshold", "1.5"])
    with pytest.raises(SystemExit, match="no tokenizer could be loaded"):
        cli.main(["generate", "--model", model_dir, "--prompt", "hello"])
    with pytest.raises(SystemExit, match="is not a local directory"):
        cli.main(["generate", "--model", model_dir + "_missing", "--prompt-ids", "1"])


def test_cli_generate_text_prompt_with_a_local_tokenizer(model, tmp_path, capsys):
    """A word-level tokenizer ("w0" .. "w100") saved next to the model: --prompt text in, text streamed out."""
    from test_cli_errors import word_tokenizer

    word_tokenizer("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                   "{% if add_generation_prompt %}w3{% endif %}").save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    prompt = "w5 w6 w7 w8 w5 w6 w7"
    assert cli.main(["generate", "--model", str(tmp_path), "--ngram", "--prompt", prompt, "--max-new-tokens", "9",
                     "--eos-id", "0"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    want, _ = generate(model, None, torch.tensor([5, 6, 7, 8, 5, 6, 7]), max_new_tokens=9, eos_token_id=[0])
    assert out[0].split() == [f"w{t}" for t in want[7:].tolist()]
    _summary_ok(out[-1])
    # --chat: the tokenizer's chat template wraps the prompt (here "w1 <prompt> w2 w3")
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6", "--chat", "--max-new-tokens", "5",
                     "--eos-id", "0"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    want, _ = generate(model, None, torch.tensor([1, 5, 6, 2, 3]), max_new_tokens=5, eos_token_id=[0])
    assert out[0].split() == [f"w{t}" for t in want[5:].tolist()]


def test_python_m_specdec_ext_generate(model_dir):
    proc = subprocess.run([sys.executable, "-m", "specdec_ext", "generate", "--model", model_dir, "--ngram",
                           "--prompt-ids", "1 2 3 1 2 3", "--max-new-tokens", "6"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _summary_ok(proc.stdout)
