"""specdec serve soak: ``SPECDEC_SERVE_SOAK`` requests (default 1,000) from 16 concurrent raw-HTTP clients — streamed
and not, greedy and seeded-sampled, some with stop strings — against one server (draft-model drafter, 8 rows, so
requests queue). Every request finishes (none stuck), greedy ones equal plain decoding, the process's resident
memory stays flat after the warm-up, and the metrics agree with the responses (generated tokens, requests, and
accepted draft tokens = generated tokens - row-steps + what stops and budgets cut from the requests' last steps).
1,000 requests take ~25 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest

from test_serve import MODEL, httpx, live_server, plain_greedy  # (skips without the server's packages)

import test_generate_greedy as greedy_t  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

REQUESTS = int(os.environ.get("SPECDEC_SERVE_SOAK", "1000"))
CLIENTS = 16
DEPTH = 4  # the draft model's chain


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def jobs(n: int) -> list[dict]:
    rng = random.Random(5)
    prompts = [greedy_t.prompt_of(rng.randint(2, 14), 300 + i) for i in range(12)]
    out = []
    for i in range(n):
        body = {"model": MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": rng.randint(2, 10),
                "return_token_ids": True, "stream": i % 3 == 0}
        if i % 5 == 4:
            body.update(temperature=1.0, seed=i, top_p=0.95)
        else:
            body.update(temperature=0)
        if i % 7 == 6:
            body.update(stop=["w1"])
        out.append(body)
    return out


async def send(client: httpx.AsyncClient, body: dict) -> dict:
    """(token ids, finish reason, usage) of one request, streamed or not."""
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        return {"ids": j["choices"][0]["token_ids"], "reason": j["choices"][0]["finish_reason"], "usage": j["usage"]}
    ids, reason, usage = [], None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids += chunk["choices"][0].get("token_ids", [])
            reason = chunk["choices"][0]["finish_reason"] or reason
            usage = chunk.get("usage") or usage
    return {"ids": ids, "reason": reason, "usage": usage}


def test_soak():
    target = greedy_t.target("llama")
    work = jobs(REQUESTS)
    refs = {}
    for b in work:
        key = (tuple(b["prompt"]), b["max_tokens"])
        if b["temperature"] == 0 and "stop" not in b and key not in refs:
            refs[key] = plain_greedy(target, b["prompt"], b["max_tokens"])
    warm = max(1, REQUESTS // 5)
    with live_server(target, greedy_t.make_drafter("draft", target, k=DEPTH), max_batch=8) as server:
        async def run_all():
            results, mem = [None] * REQUESTS, {}
            queue = list(range(REQUESTS))[::-1]
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                async def worker():
                    while queue:
                        i = queue.pop()
                        if i == warm:
                            mem["warm"] = rss_mib()
                        results[i] = await send(client, work[i])

                await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CLIENTS))), timeout=600)
            return results, mem

        results, mem = asyncio.run(run_all())
        mem["end"] = rss_mib()
        m = server.metrics()
        in_flight = server.loop.in_flight()
    assert in_flight == 0 and m["specdec:num_requests_running"] == 0 and m["specdec:num_requests_waiting"] == 0
    for b, r in zip(work, results):
        assert r["reason"] in ("stop", "length") and len(r["ids"]) == r["usage"]["completion_tokens"] >= 1
        assert r["usage"]["prompt_tokens"] == len(b["prompt"])
        key = (tuple(b["prompt"]), b["max_tokens"])
        if key in refs and b["temperature"] == 0 and "stop" not in b:
            assert r["ids"] == refs[key], b
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    finished = sum(v for k, v in m.items() if k.startswith("specdec:request_success_total"))
    assert finished == REQUESTS and m["specdec:time_to_first_token_seconds_count"] == REQUESTS
    assert m["specdec:generation_tokens_total"] == generated
    assert m["specdec:prompt_tokens_total"] == sum(len(b["prompt"]) for b in work)
    # a row-step emits its accepted drafts + 1 token, less what a stop or the budget cut from a request's last run
    # (a row drafts as deep as the batch's neediest row): at most the drafter's depth, once per request
    dropped = m["specdec:spec_decode_num_accepted_tokens_total"] + m["specdec:engine_row_steps_total"] - generated
    assert 0 <= dropped <= DEPTH * REQUESTS, dropped
    assert mem["end"] - mem["warm"] < 24, mem  # MiB: flat after the warm-up (no per-request leak)
