"""README.md, "Serving: the engine": the example's calls, on a tiny Llama with the n-gram drafter and a word-level
tokenizer, with smaller budgets.

* Three requests (greedy; sampled with a seed and a stop string; sampled through a ``RequestSettings``) in one
  batch; after two steps the third is aborted and a fourth joins in its row. The greedy requests equal Hugging
  Face's greedy decoding of their prompts alone (cut at the target's EOS, which the engine adds); the aborted one
  reports ``"abort"`` once, after the tokens of its two steps; the stop-string request (with these seeds) ends at
  the token that completes the string, and its text (``take_text`` after each event) stops right before it; the
  others' texts are their tokens' text.
* ``TokenStream`` over one request: its tokens are Hugging Face's greedy ones.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import test_generate_greedy as greedy_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from test_engine import word_tokenizer  # noqa: E402

from specdec_ext import Engine, RequestSettings  # noqa: E402
from specdec_ext.drafters import NgramDrafter  # noqa: E402
from specdec_ext.engine import TokenStream  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STOP = "w1"  # (a prefix of w1, w10-w19, w100: a sampled request meets it often, and it spans no token here)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """HF greedy continuation, cut after the target's EOS (the engine stops there by default)."""
    ref = hf_greedy(model, prompt, n)
    cut = next((i + 1 for i, t in enumerate(ref) if t in eos_ids(model)), len(ref))
    return ref[:cut]


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or ())


def test_the_readme_engine_example():
    target, tokenizer = greedy_t.target("llama"), word_tokenizer()
    drafter = NgramDrafter(num_pred_tokens=4, max_ngram_size=3)
    prompt_a, prompt_b, prompt_c, prompt_d = (greedy_t.prompt_of(n, s) for n, s in ((9, 1), (6, 3), (12, 3), (7, 4)))

    engine = Engine(target, drafter, max_batch=3, max_len=1024, tokenizer=tokenizer)
    a = engine.add_request(prompt_a, max_new_tokens=12)
    b = engine.add_request(prompt_b, max_new_tokens=16, temperature=0.7, top_p=0.9, seed=1, stop=[STOP])
    c = engine.add_request(prompt_c, RequestSettings(max_new_tokens=256, temperature=1.0, top_k=50))
    outputs, texts, reasons, steps = {}, {}, {}, 0
    while engine.has_unfinished():
        for request_id, new_tokens, finish_reason in engine.step():
            assert request_id not in reasons, "an event after the request finished"
            outputs.setdefault(request_id, []).extend(new_tokens)
            texts[request_id] = texts.get(request_id, "") + engine.take_text(request_id)
            if finish_reason is not None:
                reasons[request_id] = finish_reason
        steps += 1
        if steps == 2:
            assert [r.id for r in engine.scheduler.running] == [a, b, c]
            engine.abort(c)
            d = engine.add_request(prompt_d, max_new_tokens=8)
        assert steps < 200
    engine.close()

    assert outputs[a] == greedy_reference(target, prompt_a, 12)
    assert outputs[d] == greedy_reference(target, prompt_d, 8)
    assert reasons[c] == "abort" and 2 <= len(outputs[c]) <= 2 * drafter.max_nodes  # two steps' runs
    text = tokenizer.decode(outputs[b])
    assert reasons[b] == "stop" and outputs[b][-1] not in eos_ids(target), (reasons[b], text)  # (these seeds)
    assert STOP in text and STOP not in tokenizer.decode(outputs[b][:-1])  # the last token completed it
    kept = texts[b]
    assert STOP not in kept and kept == (" " + text)[: len(kept)] and len(kept) == (" " + text).index(STOP)
    for rid in (a, d):  # no stop strings: the whole text (each first token after a space, as after the prompt)
        assert texts[rid] == " " + tokenizer.decode(outputs[rid]), rid

    with Engine(target, drafter, max_batch=1, max_len=1024) as engine:
        stream = TokenStream(engine, engine.add_request(prompt_a, max_new_tokens=10))
        streamed = [t for new_tokens in stream for t in new_tokens]
    assert streamed == greedy_reference(target, prompt_a, 10)
    assert stream.finish_reason == ("length" if len(streamed) == 10 else "stop")
