"""``GET /metrics``: the server's Prometheus metrics (:class:`ServerMetrics`), named as vLLM names them.

Prefix ``specdec:`` where vLLM writes ``vllm:`` (llama.cpp: ``llamacpp:``), so dashboards carry over by renaming the
prefix. Speculation (vLLM's names; counters since the server started):

* ``spec_decode_num_drafts_total``: row-steps whose tree held a draft;
* ``spec_decode_num_draft_tokens_total``: draft tokens proposed (padding excluded);
* ``spec_decode_num_accepted_tokens_total``: draft tokens accepted (= generated tokens - row-steps);
* ``spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: row-steps that accepted the draft at depth i+1.

Requests and tokens: ``request_success_total{finished_reason}``, ``prompt_tokens_total``,
``generation_tokens_total``, ``request_rejected_total{reason}`` (a full queue), gauges ``num_requests_running`` /
``num_requests_waiting``; ``engine_steps_total``, ``engine_row_steps_total`` and ``engine_step_seconds_total`` (time
inside the engine's steps). Histograms: ``time_to_first_token_seconds`` (from the request's arrival),
``inter_token_latency_seconds`` (a step that hands a request k tokens g s after its last ones counts as k
intervals of g / k, as the benchmarks count it) and ``e2e_request_latency_seconds``.

The engine thread publishes a snapshot of the engine's counters after each step; a scrape reads the snapshot, never
the engine itself (which is not thread-safe).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "PREFIX", "ServerMetrics"]

PREFIX = "specdec:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, with finer ones below 10 ms for CPU steps of small models
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)


class _EngineCollector:
    """The engine's counters and the queue gauges, from the last snapshot."""

    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.snapshot()
        p = PREFIX
        for name, key, doc in (("spec_decode_num_drafts", "drafts", "row-steps whose tree held a draft"),
                               ("spec_decode_num_draft_tokens", "draft_tokens", "draft tokens proposed"),
                               ("spec_decode_num_accepted_tokens", "accepted_tokens", "draft tokens accepted"),
                               ("engine_steps", "steps", "engine steps"),
                               ("engine_row_steps", "row_steps", "rows taking part in a step, summed over steps"),
                               ("engine_step_seconds", "step_s", "wall time inside the engine's steps")):
            yield CounterMetricFamily(p + name, doc, value=s[key])
        per_pos = CounterMetricFamily(p + "spec_decode_num_accepted_tokens_per_pos",
                                      "row-steps that accepted the draft at depth position + 1", labels=["position"])
        for i, n in enumerate(s["accepted_by_position"]):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        yield GaugeMetricFamily(p + "num_requests_running", "requests in the engine's rows", value=s["running"])
        yield GaugeMetricFamily(p + "num_requests_waiting", "requests waiting for a row", value=s["waiting"])


class ServerMetrics:
    """The server's metrics in a registry of their own (one per app, so tests can run several)."""

    def __init__(self, max_depth: int = 0):
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to the first token, from the request's "
                              "arrival", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "arrival to finish", buckets=E2E_BUCKETS, registry=r)
        self.success = Counter(p + "request_success", "finished requests", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "generated tokens", registry=r)
        self.rejected = Counter(p + "request_rejected", "requests refused before admission", ["reason"], registry=r)
        self._lock = threading.Lock()
        self._snap = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "steps": 0, "row_steps": 0,
                      "step_s": 0.0, "accepted_by_position": [0] * max_depth, "running": 0, "waiting": 0}
        r.register(_EngineCollector(self))

    # ---- told by the engine thread --------------------------------------------------------------------------------
    def admitted(self, ticket) -> None:
        self.prompt_tokens.inc(len(ticket.prompt))

    def tokens(self, ticket, n: int, now: float) -> None:
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if ticket.first_token is None:
            ticket.first_token = now
            self.ttft.observe(now - ticket.arrival)
        else:
            gap = (now - ticket.last_token) / n
            for _ in range(n):
                self.itl.observe(gap)
        ticket.last_token = now

    def finished(self, ticket, reason: str, now: float) -> None:
        self.success.labels(finished_reason=reason).inc()
        self.e2e.observe(now - ticket.arrival)

    def update_engine(self, engine, loop) -> None:
        st = engine.stats
        snap = {"drafts": st.drafts, "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
                "steps": st.steps, "row_steps": st.row_steps, "step_s": loop.step_s,
                "accepted_by_position": st.accepted_by_position, "running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting)}
        with self._lock:
            self._snap = snap

    # ---- read by the handlers -------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._snap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
