"""Streaming HTTP clients for the serve benchmark, run as a process of their own so that their work (HTTP, SSE
parsing) does not share the server process's interpreter lock:

    python serve_clients.py < spec.json > results.json

``spec``: ``{"url", "model", "concurrency", "time_limit_s", "jobs": [{"prompt": [ids], "max_tokens": n}, ...]}``.
``concurrency`` clients share the jobs in order (a closed loop: each sends its next job when its last one ended)
until the jobs run out or ``time_limit_s`` passes (no new job starts after it). Every request streams greedy,
with ``ignore_eos`` and ``return_token_ids``. Output: one record per job sent, in job order: ``arrival`` (seconds
from the start), ``chunks`` (``[time, tokens]`` per chunk that carried tokens), ``tokens``, ``finish``,
``finish_reason`` and ``error`` (None, an HTTP status or the exception's name).

Only the standard library and httpx: this file must not import specdec_ext (torch, the models), which would cost
the run seconds and memory.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


async def _one(client: httpx.AsyncClient, spec: dict, job: dict, t0: float) -> dict:
    rec = {"arrival": time.perf_counter() - t0, "chunks": [], "tokens": [], "finish": None, "finish_reason": None,
           "error": None}
    body = {"model": spec["model"], "prompt": job["prompt"], "max_tokens": job["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"].get("message", "error")
                    continue
                choice = chunk["choices"][0]
                ids = choice.get("token_ids") or []
                if ids:
                    rec["chunks"].append([time.perf_counter() - t0, len(ids)])
                    rec["tokens"] += ids
                if choice.get("finish_reason") is not None:
                    rec["finish_reason"] = choice["finish_reason"]
        rec["finish"] = time.perf_counter() - t0
    except httpx.HTTPError as err:
        rec["error"] = type(err).__name__
    return rec


async def run(spec: dict) -> list[dict]:
    jobs, clients = spec["jobs"], int(spec["concurrency"])
    records: dict[int, dict] = {}
    nxt = iter(range(len(jobs)))
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(base_url=spec["url"], timeout=httpx.Timeout(300.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def loop():
            for i in nxt:
                if time.perf_counter() - t0 > spec["time_limit_s"]:
                    return
                records[i] = await _one(client, spec, jobs[i], t0)

        await asyncio.gather(*(loop() for _ in range(clients)))
    return [records[i] for i in sorted(records)]


def main() -> int:
    spec = json.load(sys.stdin)
    json.dump(asyncio.run(run(spec)), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
