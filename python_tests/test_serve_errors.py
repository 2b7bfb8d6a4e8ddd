"""specdec serve under bad input and faults: every error path's status code and OpenAI-style body (naming the
field), the API key, a full queue (429), clients that disconnect (their requests are aborted and their rows go to
the next request), and 200 requests of garbage after which the server still answers correctly.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

from test_serve import MODEL, complete, httpx, live_server, plain_greedy  # (skips without the server's packages)

import test_generate_greedy as greedy_t  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMIT = 64 * 1024  # the test server's max_body_bytes


@pytest.fixture(scope="module")
def server():
    target = greedy_t.target("llama")
    with live_server(target, greedy_t.make_drafter("ngram", target), max_body_bytes=LIMIT) as s:
        yield s


def error_of(r: httpx.Response, status: int, param=None) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


OK = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0}

BAD_FIELDS = [  # (changes to a good body, the field the 400 names, a word its message holds)
    ({"max_tokens": "5"}, "max_tokens", "integer"),
    ({"max_tokens": 5.5}, "max_tokens", "integer"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": 100000}, "max_tokens", "positions"),  # beyond the context
    ({"prompt": 5}, "prompt", "prompt"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [5, 1000]}, "prompt", "vocabulary"),
    ({"prompt": ["w1", "w2"]}, "prompt", "1"),  # (n = 1: one prompt)
    ({"temperature": "hot"}, "temperature", "number"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -5}, "top_k", ">= 0"),
    ({"seed": 2 ** 70}, "seed", "[-2^63, 2^64)"),
    ({"seed": "1"}, "seed", "integer"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"stop": [1, 2]}, "stop", "string"),
    ({"stop_token_ids": [1000]}, "stop_token_ids", "vocabulary"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"n": 2}, "n", "n = 1"),
    ({"logprobs": 2}, "logprobs", "not supported"),
    ({"echo": True}, "echo", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"ignore_eos": 1}, "ignore_eos", "boolean"),
]


@pytest.mark.parametrize("change,param,word", BAD_FIELDS, ids=[f"{p}={c[p]!r}"[:40] for c, p, _ in BAD_FIELDS])
def test_bad_fields_answer_400_naming_the_field(server, change, param, word):
    for stream in (False, True):  # (a stream's errors come before it starts: the same 400)
        message = error_of(server.post("/v1/completions", {**OK, **change, "stream": stream}
                                       if param != "stream" else {**OK, **change}), 400, param)
        assert word in message, message


def test_malformed_bodies_and_missing_fields(server):
    assert "JSON" in error_of(server.post("/v1/completions", content=b"{not json"), 400)
    assert "JSON" in error_of(server.post("/v1/completions", content=b"\xff\xfe\x00"), 400)
    assert "object" in error_of(server.post("/v1/completions", [1, 2]), 400)
    assert "missing" in error_of(server.post("/v1/completions", {"model": MODEL}), 400, "prompt")
    assert "finite" in error_of(server.post("/v1/completions", content=b'{"prompt": "w1", "temperature": NaN}'), 400,
                             "temperature")
    error_of(server.post("/v1/chat/completions", {"messages": []}), 400, "messages")
    error_of(server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}), 400,
             "messages.0.content")
    error_of(server.post("/v1/chat/completions", {"messages": [{"role": "boss", "content": "w1"}]}), 400,
             "messages.0.role")
    # the word tokenizer has no chat template (and this server was given none)
    assert "chat template" in error_of(server.post("/v1/chat/completions",
                                                   {"messages": [{"role": "user", "content": "w1"}]}), 400, "messages")


def test_unknown_model_route_method_and_huge_body(server):
    error_of(server.post("/v1/completions", {**OK, "model": "gpt-9"}), 404, "model")
    error_of(server.post("/v1/nothing", OK), 404)
    error_of(httpx.get(server.url + "/v1/completions"), 405)
    big = json.dumps({**OK, "prompt": "w1 " * LIMIT}).encode()
    assert "exceeds" in error_of(server.post("/v1/completions", content=big), 413)

    def chunks():  # no content-length: the limit holds while the body streams in
        for _ in range(LIMIT // 1024 + 2):
            yield b" " * 1024

    error_of(server.post("/v1/completions", content=chunks()), 413)
    assert server.post("/v1/completions", OK).status_code == 200  # (and it still serves)


def test_api_key():
    target = greedy_t.target("llama")
    with live_server(target, api_key="sesame") as s:
        error_of(httpx.post(s.url + "/v1/completions", json=OK), 401)
        error_of(httpx.post(s.url + "/v1/completions", json=OK, headers={"Authorization": "Bearer sesam"}), 401)
        error_of(httpx.get(s.url + "/v1/models", headers={"Authorization": "Basic sesame"}), 401)
        assert httpx.post(s.url + "/v1/completions", json=OK, headers={"Authorization": "Bearer sesame"},
                          timeout=30).status_code == 200
        assert complete(s, [5, 6, 7], max_tokens=3).usage.completion_tokens == 3  # (the openai client sends it)
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics need no key
        assert httpx.get(s.url + "/metrics").status_code == 200


LONG = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1900, "temperature": 0, "ignore_eos": True}


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_full_queue_answers_429_and_disconnects_free_rows():
    target = greedy_t.target("llama")
    with live_server(target, max_batch=1, max_queue=1, max_len=2048) as s:
        with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # it runs (the one row)
            queued = {}
            worker = threading.Thread(target=lambda: queued.update(r=s.post("/v1/completions", LONG | {
                "max_tokens": 5})))
            worker.start()
            wait_for(lambda: s.metrics()["specdec:num_requests_waiting"] == 1, what="the second request to queue")
            assert "--max-queue 1" in error_of(s.post("/v1/completions", OK), 429)
            assert s.metrics()["specdec:request_rejected_total{reason=\"queue_full\"}"] == 1
        # the stream's client went away: its request is aborted and the queued one takes the row
        worker.join(30)
        assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 5
        m = s.metrics()
        assert m["specdec:request_success_total{finished_reason=\"abort\"}"] == 1
        assert m["specdec:generation_tokens_total"] < 1900  # (the long one did not run to its end)
        assert s.loop.in_flight() == 0

        # a non-streamed request whose client times out is aborted too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json=LONG, timeout=0.5)
        wait_for(lambda: s.metrics()["specdec:request_success_total{finished_reason=\"abort\"}"] == 2,
                 what="the abort of the timed-out request")
        t0 = time.monotonic()
        r = s.post("/v1/completions", OK)
        assert r.status_code == 200 and time.monotonic() - t0 < 5  # the row is free again
        assert s.loop.in_flight() == 0 and s.metrics()["specdec:num_requests_running"] == 0


WRONG = {"prompt": [None, 3, [None], {"a": 1}, [[1], [2]], [-3], ""], "max_tokens": ["x", 2 ** 80, 1.5, -1, [1]],
         "temperature": ["x", -1e308, [1], True], "top_p": [2, -0.5, "x"], "top_k": [-2, 1.5, "x"],
         "seed": [2 ** 80, 1.5, "x"], "stop": [3, [None], {"a": 1}, [""]], "stream": ["x", 1],
         "stop_token_ids": [[-3], "x", [2 ** 80]], "model": [3, "other"], "n": [2, 0, "x"],
         "stream_options": ["x", {"include_usage": 3}]}


def garbage(rng: random.Random, i: int):
    """One bad request: (method, path, body bytes, headers)."""
    kind = i % 8
    if kind == 0:
        return "POST", "/v1/completions", rng.randbytes(rng.randint(0, 2000)), {}
    if kind == 1:
        return "POST", "/v1/chat/completions", rng.randbytes(rng.randint(0, 200)), {"content-type": "application/json"}
    if kind == 2:  # a huge body
        return "POST", "/v1/completions", b'{"prompt": "' + b"w1 " * (LIMIT // 2) + b'"}', {}
    if kind == 3:  # a known field of a wrong type or value
        field = rng.choice(sorted(WRONG))
        return "POST", "/v1/completions", json.dumps({**OK, field: rng.choice(WRONG[field])}).encode(), {}
    if kind == 4:  # deep nesting
        depth = rng.choice([1000, 100000])
        return "POST", "/v1/completions", b"[" * depth + b"]" * depth, {}
    if kind == 5:
        msgs = rng.choice([[{"role": "user"}], [{"content": "w1"}], "w1", [None], [{"role": "user", "content": [1]}]])
        return "POST", "/v1/chat/completions", json.dumps({"messages": msgs}).encode(), {}
    if kind == 6:
        return rng.choice(["PUT", "DELETE", "PATCH"]), rng.choice(["/v1/completions", "/health", "/x"]), b"{}", {}
    return "POST", "/v1/completions", json.dumps({**OK, "prompt": [rng.randint(-10, 10 ** 6) for _ in range(5)]}
                                                  ).encode(), {}


def test_survives_200_requests_of_garbage_and_still_answers_correctly(server):
    rng = random.Random(0)
    statuses = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for i in range(190):
            method, path, body, headers = garbage(rng, i)
            r = client.request(method, path, content=body, headers=headers)
            statuses.append(r.status_code)
            assert 400 <= r.status_code < 500, (i, method, path, body[:80], r.status_code, r.text[:200])
            assert "error" in r.json()
    for i in range(10):  # not even HTTP
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as sock:
            sock.sendall(rng.randbytes(300) + b"\r\n\r\n")
            sock.recv(4096)  # (an answer or a close; either way the server goes on)
    assert {400, 404, 405, 413} <= set(statuses)
    prompt = greedy_t.prompt_of(7, 2)
    r = complete(server, prompt, max_tokens=8)
    assert r.choices[0].model_extra["token_ids"] == plain_greedy(greedy_t.target("llama"), prompt, 8)
    assert server.loop.failure is None and server.loop.in_flight() == 0
