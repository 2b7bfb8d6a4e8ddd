"""Clients that load an :class:`~specdec_ext.Engine` the way a server's users would, and what they measure.

* :func:`make_workload`: the request mix (prompts of varied lengths, varied ``max_new_tokens``), seeded;
* :class:`PoissonArrivals`: an open loop, requests arriving as a Poisson process at ``rate`` requests/s;
* :class:`ClosedClients`: a closed loop, ``C`` clients each sending its next request when its last one finished;
* :func:`drive`: steps the engine against wall time; a request *arrives* at its time and is added before the next
  step once that time has passed (so a request that arrives during a step waits for it, as on a server);
* :func:`summarise`: throughput, time to first token, inter-token latency, from the times tokens left ``step()``;
* :func:`run_direct`: requests straight into an engine of their own, C at a time; :func:`fastest_drafter`: of some
  drafters, the fastest at one client that way (the suites' choice of a "best" drafter).

Inter-token latency: a step that hands a request ``k`` tokens ``g`` seconds after its previous ones counts as ``k``
intervals of ``g / k`` (the pace its stream advances at). Counting it as one gap ``g`` and ``k - 1`` zeros would put
the median at zero for any drafter that accepts more than half of its steps' drafts.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from specdec_ext.engine import Engine, RequestSettings

__all__ = ["REPLAY_EXCLUDED", "ClosedClients", "Job", "PoissonArrivals", "Trace", "drive", "fastest_drafter",
           "make_workload", "percentile", "run_direct", "summarise"]

# Drafters a load benchmark leaves out unless named: the engine and serve suites replay the same requests at every
# load and round (and a closed loop sends each prompt twice), which a drafter that drafts from earlier requests'
# outputs turns into look-ups of its own replays (suffix decoding ran at 4x plain at one client in the engine suite,
# 13 tokens a step in the serve suite). It is measured on a workload of its own (benchmarks/python/bench_suffix.py).
REPLAY_EXCLUDED = ("suffix",)


@dataclass(frozen=True)
class Job:
    """One request of the workload."""

    prompt: list[int]
    max_new_tokens: int


def make_workload(prompts: list[list[int]], n: int, max_new_tokens: int, seed: int) -> list[Job]:
    """``n`` jobs cycling through ``prompts``: each prompt cut to a length drawn in [half, all] of its tokens, each
    budget drawn in [max_new_tokens / 4, max_new_tokens] (a serving mix: short and long answers side by side)."""
    if not prompts or n < 1 or max_new_tokens < 1:
        raise ValueError(f"make_workload: needs prompts, n >= 1 and max_new_tokens >= 1, got {len(prompts)} prompts, "
                         f"n = {n}, max_new_tokens = {max_new_tokens}")
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        length = rng.randint(max(1, len(p) // 2), len(p))
        jobs.append(Job(list(p[len(p) - length:]), rng.randint(max(1, max_new_tokens // 4), max_new_tokens)))
    return jobs


class PoissonArrivals:
    """Open loop: ``n`` requests at the times of a Poisson process of ``rate`` requests/s (the first at 0)."""

    def __init__(self, n: int, rate: float, seed: int):
        if not rate > 0:
            raise ValueError(f"PoissonArrivals: rate must be > 0 requests/s, got {rate!r}")
        rng = random.Random(seed)
        self.times, t = [], 0.0
        for _ in range(n):
            self.times.append(t)
            t += rng.expovariate(rate)
        self._next = 0

    def due(self, now: float) -> list[tuple[int, float]]:
        """(job index, arrival time) of the requests that arrived by ``now`` and were not handed out yet."""
        out = []
        while self._next < len(self.times) and self.times[self._next] <= now:
            out.append((self._next, self.times[self._next]))
            self._next += 1
        return out

    def finished(self, index: int, now: float) -> None:
        pass  # (an open loop's arrivals do not wait for anything)

    def next_time(self) -> float | None:
        return self.times[self._next] if self._next < len(self.times) else None

    def exhausted(self) -> bool:
        return self._next == len(self.times)


class ClosedClients:
    """Closed loop: ``clients`` clients share ``n`` jobs; each sends one at 0 and its next one the moment its last one
    finishes."""

    def __init__(self, n: int, clients: int):
        if clients < 1:
            raise ValueError(f"ClosedClients: clients must be >= 1, got {clients!r}")
        self.n, self._sent = n, 0
        self._ready = [0.0] * min(clients, n)  # arrival times of requests about to be sent

    def due(self, now: float) -> list[tuple[int, float]]:
        out = []
        for at in self._ready:
            out.append((self._sent, at))
            self._sent += 1
        self._ready = []
        return out

    def finished(self, index: int, now: float) -> None:
        if self._sent + len(self._ready) < self.n:
            self._ready.append(now)

    def next_time(self) -> float | None:
        return None  # (the next request waits for a finish, never for the clock)

    def exhausted(self) -> bool:
        return self._sent == self.n and not self._ready


@dataclass
class Trace:
    """One request as its client saw it: arrival, (time, tokens) per step that handed it tokens, finish."""

    arrival: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: float | None = None
    finish_reason: str | None = None


def drive(engine, jobs: list[Job], source, settings_of, clock=time.perf_counter, sleep=time.sleep) -> list[Trace]:
    """Runs ``jobs`` through ``engine`` as ``source`` (:class:`PoissonArrivals` or :class:`ClosedClients`) sends
    them; ``settings_of(index)`` gives a job's :class:`~specdec_ext.RequestSettings` (its budget set from the job).
    Returns each job's :class:`Trace`, times in seconds from the start."""
    traces: dict[int, Trace] = {}
    index_of: dict[int, int] = {}
    t0 = clock()
    while not source.exhausted() or engine.has_unfinished():
        now = clock() - t0
        for i, at in source.due(now):
            index_of[engine.add_request(jobs[i].prompt, settings_of(i))] = i
            traces[i] = Trace(at)
        if not engine.has_unfinished():
            nxt = source.next_time()
            if nxt is None:
                raise RuntimeError("drive: nothing running and nothing due (the source sent no request)")
            sleep(max(0.0, nxt - now))
            continue
        events = engine.step()
        now = clock() - t0
        for rid, new, reason in events:
            i = index_of[rid]
            tr = traces[i]
            if new:
                tr.chunks.append((now, len(new)))
                tr.tokens.extend(new)
            if reason is not None:
                tr.finish, tr.finish_reason = now, reason
                source.finished(i, now)
    return [traces[i] for i in sorted(traces)]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between the sorted values (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(traces: list[Trace]) -> dict:
    """Throughput (tokens from the first arrival to the last finish), TTFT and ITL percentiles in ms, request
    latency (arrival to finish), and the counts the check needs."""
    ttft, itl, latency = [], [], []
    for tr in traces:
        if tr.chunks:
            ttft.append(tr.chunks[0][0] - tr.arrival)
            for (t_prev, _), (t, k) in zip(tr.chunks, tr.chunks[1:]):
                itl.extend([(t - t_prev) / k] * k)
        if tr.finish is not None:
            latency.append(tr.finish - tr.arrival)
    tokens = sum(len(tr.tokens) for tr in traces)
    ends = [tr.finish for tr in traces if tr.finish is not None]
    span = (max(ends) - min(tr.arrival for tr in traces)) if ends else 0.0

    def ms(values, q):
        v = percentile(values, q)
        return None if v is None else round(1e3 * v, 3)

    return {"requests": len(traces), "finished": len(ends), "tokens": tokens, "duration_s": round(span, 4),
            "tokens_per_s": tokens / span if span > 0 else 0.0,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
            "latency_p50_ms": ms(latency, 50), "latency_p99_ms": ms(latency, 99)}


def run_direct(models, drafter, jobs: list[Job], concurrency: int) -> dict:
    """``jobs`` straight into an engine of ``concurrency`` rows (no HTTP), a closed loop of that many clients,
    greedy, EOS ignored: :func:`summarise`'s row."""
    longest = max(len(j.prompt) + j.max_new_tokens for j in jobs)
    max_len = longest + (drafter.max_nodes if drafter is not None else 1)

    def settings_of(i):
        return RequestSettings(max_new_tokens=jobs[i].max_new_tokens, ignore_eos=True)

    with Engine(models.target, drafter, max_batch=concurrency, max_len=max_len, eos_token_id=[]) as engine:
        return summarise(drive(engine, jobs, ClosedClients(len(jobs), concurrency), settings_of))


def fastest_drafter(models, names: list[str], jobs: list[Job], rounds: int = 3) -> tuple[str, dict[str, float]]:
    """Of the drafters ``names`` (``models.make_drafter``): the fastest at one client on ``jobs`` straight into an
    engine, by its median tokens/s over ``rounds`` rounds in a rotated order (each drafter warmed up on two short
    requests first), and every drafter's median. One pass had the order of two drafters within a few percent of
    each other turn on the VM's moment."""
    if not names:
        raise ValueError("fastest_drafter: no drafter to choose from")
    drafters = {n: models.make_drafter(n) for n in names}
    warm = [Job(j.prompt, min(8, j.max_new_tokens)) for j in jobs[:2]]
    for d in drafters.values():
        run_direct(models, d, warm, 1)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            rates[n].append(run_direct(models, drafters[n], jobs, 1)["tokens_per_s"])
    medians = {n: statistics.median(v) for n, v in rates.items()}
    return max(names, key=lambda n: medians[n]), medians
