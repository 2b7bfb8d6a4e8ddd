"""specdec serve: a live server on 127.0.0.1 (uvicorn in a thread, a free port) driven by the real ``openai`` client
and raw HTTP (httpx), on the tiny models of the engine's tests and a word-level tokenizer.

* Every drafter kind the tests build (plain, n-gram, draft model chain and tree, Medusa, EAGLE-1 chain, EAGLE-2 /
  EAGLE-3 trees): greedy completions, streamed and not, give ``generate()``'s plain greedy tokens for the same
  prompt; the streamed chunks' text concatenates to the non-streamed text; usage counts the prompt and the output.
* 16 concurrent greedy requests (more than the engine's rows) each equal their single-request result.
* Seeded sampling: the same seed gives the same tokens, alone and beside other requests.
* Stop strings (the text ends before the string, finish reason "stop"), stop token ids, chat completions through a
  chat template, /v1/models, /health and /metrics (vLLM's names, counters consistent with the responses).

:func:`live_server` is the fixture the other test_serve_* files use.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import test_generate_batch as batch_t  # noqa: E402
import test_generate_greedy as greedy_t  # noqa: E402
from test_engine import word_tokenizer  # noqa: E402

from specdec_ext import Engine  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.serve.app import create_app, serve_in_thread  # noqa: E402
from specdec_ext.serve.engine_loop import EngineLoop  # noqa: E402
from specdec_ext.serve.metrics import ServerMetrics  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
NEW = 12
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w7{% endif %}"


class LiveServer:
    """A running server: ``url`` (``http://127.0.0.1:PORT``), ``client`` (openai), ``loop`` (the EngineLoop)."""

    def __init__(self, url: str, loop: EngineLoop, api_key: str | None):
        self.url, self.loop = url, loop
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0, timeout=60)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        """The /metrics samples (``name{labels}`` -> value), comments dropped."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


@contextlib.contextmanager
def live_server(target, drafter=None, *, max_batch: int = 4, max_queue: int = 1024, api_key: str | None = None,
                tokenizer="word", max_len: int | None = 256, chat_template: str | None = None, **app_kw):
    """An Engine of ``target`` + ``drafter`` behind the app, served by uvicorn on a free port of 127.0.0.1 in a
    thread, until the block ends."""
    tok = word_tokenizer() if tokenizer == "word" else tokenizer
    engine = Engine(target, drafter, max_batch=max_batch, max_len=max_len, tokenizer=tok)
    depth = drafter.max_depth if drafter is not None else 0
    loop = EngineLoop(engine, max_queue=max_queue, metrics=ServerMetrics(depth))
    app = create_app(loop, MODEL, api_key=api_key, chat_template=chat_template, **app_kw)
    with serve_in_thread(app) as url:
        yield LiveServer(url, loop, api_key)


def plain_greedy(target, prompt: list[int], n: int) -> list[int]:
    """``generate()``'s plain greedy continuation (cut after the target's EOS, as the server's requests are)."""
    out, _ = generate(target, None, torch.tensor(prompt), max_new_tokens=n)
    return out[len(prompt):].tolist()


def complete(server: LiveServer, prompt, **kw):
    return server.client.completions.create(model=MODEL, prompt=prompt, temperature=kw.pop("temperature", 0),
                                            extra_body={"return_token_ids": True, **kw.pop("extra", {})}, **kw)


def stream(server: LiveServer, prompt, **kw) -> tuple[list[int], str, list, object]:
    """(token ids, text, finish reasons of every chunk, the final chunk's usage) of a streamed completion."""
    ids, text, reasons, use = [], "", [], None
    for chunk in complete(server, prompt, stream=True, **kw):
        choice = chunk.choices[0]
        ids += choice.model_extra.get("token_ids", [])
        text += choice.text
        reasons.append(choice.finish_reason)
        use = chunk.usage or use
    return ids, text, reasons, use


@pytest.mark.parametrize("kind", batch_t.KINDS)
def test_greedy_completions_equal_generate_for_every_drafter(kind):
    target, drafter, prompts = batch_t.case(kind)
    prompts = prompts[:3]
    refs = [plain_greedy(target, p, NEW) for p in prompts]
    with live_server(target, drafter, max_batch=2) as server:
        for p, ref in zip(prompts, refs):
            r = complete(server, p, max_tokens=NEW)
            got = r.choices[0].model_extra["token_ids"]
            assert got == ref, (kind, p)
            assert r.choices[0].finish_reason == ("length" if len(ref) == NEW else "stop")
            assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == len(ref)
            assert r.usage.total_tokens == len(p) + len(ref)
            ids, text, reasons, use = stream(server, p, max_tokens=NEW)
            assert ids == ref, (kind, p, "streamed")
            assert text == r.choices[0].text  # the chunks concatenate to the whole text
            assert reasons[-1] == r.choices[0].finish_reason and set(reasons[:-1]) <= {None}
            assert use.completion_tokens == len(ref) and use.prompt_tokens == len(p)


def test_text_prompt_and_text_output():
    target = greedy_t.target("llama")
    tok = word_tokenizer()
    prompt = greedy_t.prompt_of(9, 5)
    ref = plain_greedy(target, prompt, NEW)
    with live_server(target, greedy_t.make_drafter("ngram", target)) as server:
        r = server.client.completions.create(model=MODEL, prompt=tok.decode(prompt), max_tokens=NEW, temperature=0)
    assert r.choices[0].text == " " + tok.decode(ref)  # (each token after a space, as after the prompt)


def test_sixteen_concurrent_requests_equal_their_single_results():
    target = greedy_t.target("llama")
    prompts = [greedy_t.prompt_of(3 + i % 9, 100 + i) for i in range(16)]
    budgets = [4 + (5 * i) % 13 for i in range(16)]
    with live_server(target, greedy_t.make_drafter("draft", target), max_batch=6) as server:
        alone = [complete(server, p, max_tokens=n).choices[0].model_extra["token_ids"]
                 for p, n in zip(prompts, budgets)]

        async def together():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
            rs = await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=p, max_tokens=n, temperature=0, extra_body={"return_token_ids": True})
                for p, n in zip(prompts, budgets)))
            await client.close()
            return [r.choices[0].model_extra["token_ids"] for r in rs]

        both = asyncio.run(together())
        m = server.metrics()
    assert both == alone
    assert alone == [plain_greedy(target, p, n) for p, n in zip(prompts, budgets)]
    assert m["specdec:request_success_total{finished_reason=\"length\"}"] + \
        m.get("specdec:request_success_total{finished_reason=\"stop\"}", 0) == 32


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch():
    target = greedy_t.target("llama")
    prompt = greedy_t.prompt_of(8, 3)
    with live_server(target, greedy_t.make_drafter("ngram", target)) as server:
        def sample(seed):
            r = complete(server, prompt, max_tokens=NEW, temperature=1.0, top_p=0.9, seed=seed,
                         extra={"top_k": 20, "ignore_eos": True})
            return r.choices[0].model_extra["token_ids"]

        a, b, c = sample(1), sample(1), sample(2)

        async def beside():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
            kw = dict(model=MODEL, max_tokens=NEW, temperature=1.0, top_p=0.9,
                      extra_body={"top_k": 20, "ignore_eos": True, "return_token_ids": True})
            rs = await asyncio.gather(client.completions.create(prompt=greedy_t.prompt_of(5, 9), seed=7, **kw),
                                      client.completions.create(prompt=prompt, seed=1, **kw),
                                      client.completions.create(prompt=greedy_t.prompt_of(11, 4), **kw))
            await client.close()
            return rs[1].choices[0].model_extra["token_ids"]

        d = asyncio.run(beside())
    assert a == b == d and len(a) == NEW
    assert a != c  # (another seed: another stream; these seeds differ)


def test_stop_strings_and_stop_token_ids():
    target = greedy_t.target("llama")
    tok = word_tokenizer()
    prompt = greedy_t.prompt_of(8, 5)
    ref = plain_greedy(target, prompt, 16)
    text = " " + tok.decode(ref)
    word = text.split(" ")[4]  # a word in the middle of the output
    stop = word[1:] + " "  # (ends inside the next token's text: spans a token boundary)
    cut = text.index(stop)
    with live_server(target, greedy_t.make_drafter("ngram", target)) as server:
        r = complete(server, prompt, max_tokens=16, stop=[stop, "zz"])
        ids, streamed, reasons, _ = stream(server, prompt, max_tokens=16, stop=stop)
        t = complete(server, prompt, max_tokens=16, extra={"stop_token_ids": [ref[2]]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:cut]
    assert streamed == text[:cut] and reasons[-1] == "stop"
    assert ids == r.choices[0].model_extra["token_ids"] and r.usage.completion_tokens == len(ids)
    assert t.choices[0].finish_reason == "stop"
    assert t.choices[0].model_extra["token_ids"] == ref[: ref.index(ref[2]) + 1]  # (the stop token is output)


def test_chat_completions_through_the_chat_template():
    target = greedy_t.target("llama")
    tok = word_tokenizer()
    messages = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w9 w10 w11 w9 w10"}]
    prompt = tok("w5 w6 w9 w10 w11 w9 w10 w7")["input_ids"]  # what CHAT_TEMPLATE makes of them
    ref = plain_greedy(target, prompt, NEW)
    with live_server(target, greedy_t.make_drafter("ngram", target), chat_template=CHAT_TEMPLATE) as server:
        r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
                                                  extra_body={"return_token_ids": True})
        chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW,
                                                            temperature=0, stream=True,
                                                            stream_options={"include_usage": True}))
        rest = server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                     extra_body={"ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == " " + tok.decode(ref)
    assert r.usage.prompt_tokens == len(prompt)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref)  # include_usage's chunk
    # no max_tokens: the rest of the context (max_len 256 less the n-gram drafter's tree)
    assert rest.usage.total_tokens == 256 - greedy_t.make_drafter("ngram", target).max_nodes


def test_models_health_and_metrics_counters():
    target = greedy_t.target("llama")
    prompts = [greedy_t.prompt_of(6 + i, 20 + i) for i in range(4)]
    with live_server(target, greedy_t.make_drafter("draft", target)) as server:
        models = server.client.models.list()
        health = httpx.get(server.url + "/health")
        firsts, generated = 0, 0
        for p in prompts:  # streamed: the first chunk's tokens count for TTFT, the later ones for ITL
            chunks = [c.choices[0].model_extra["token_ids"] for c in complete(server, p, max_tokens=NEW, stream=True)]
            firsts += len(chunks[0])
            generated += sum(map(len, chunks))
        m = server.metrics()
    assert [x.id for x in models.data] == [MODEL] and health.status_code == 200
    assert m["specdec:generation_tokens_total"] == generated
    assert m["specdec:prompt_tokens_total"] == sum(map(len, prompts))
    # each row-step emits its accepted drafts plus one token
    assert m["specdec:spec_decode_num_accepted_tokens_total"] == generated - m["specdec:engine_row_steps_total"]
    per_pos = [m[f"specdec:spec_decode_num_accepted_tokens_per_pos_total{{position=\"{i}\"}}"] for i in range(4)]
    assert sum(per_pos) == m["specdec:spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= m["specdec:spec_decode_num_drafts_total"]
    assert m["specdec:spec_decode_num_draft_tokens_total"] >= m["specdec:spec_decode_num_accepted_tokens_total"]
    assert m["specdec:time_to_first_token_seconds_count"] == 4 and m["specdec:e2e_request_latency_seconds_count"] == 4
    assert m["specdec:inter_token_latency_seconds_count"] == generated - firsts
    assert m["specdec:num_requests_running"] == 0 and m["specdec:num_requests_waiting"] == 0


def test_one_steps_tokens_reach_every_request_in_one_hand_off():
    """The engine thread hands a step's deltas for all its requests to the event loop in one
    ``call_soon_threadsafe`` (each call wakes the loop and asks for the interpreter lock), each ticket's queue
    getting its own delta, in the step's order."""
    import asyncio
    from types import SimpleNamespace

    from specdec_ext.serve.engine_loop import Delta, Ticket

    events = [(0, [5, 6], None), (2, [7], "length"), (1, [], "abort")]
    engine = SimpleNamespace(step=lambda: events, tokenizer=object(), take_text=lambda rid: f"t{rid}")
    calls = []
    fake_loop = SimpleNamespace(call_soon_threadsafe=lambda fn, *args: calls.append((fn, args)))
    loop = EngineLoop(engine)
    tickets = {rid: Ticket([1], None, asyncio.Queue(), fake_loop) for rid in range(3)}
    loop._tickets = dict(tickets)
    loop._step()
    assert len(calls) == 1  # one hand-off for the whole step
    fn, args = calls[0]
    fn(*args)
    got = {rid: t.queue.get_nowait() for rid, t in tickets.items()}
    assert [(d.token_ids, d.text, d.finish_reason) for d in (got[0], got[2], got[1])] == \
        [([5, 6], "t0", None), ([7], "t2", "length"), ([], "t1", "abort")]
    assert all(t.queue.empty() for t in tickets.values()) and list(loop._tickets) == [0]  # (the ended ones left)
    assert isinstance(got[0], Delta) and got[0].time == got[2].time  # (one step: one time)
