"""specdec_ext.Engine over many short requests: memory stays flat and nothing is left behind.

One engine (max_batch = 8, the tiny Llama of test_generate_greedy; plain and the draft-model drafter) decodes a
stream of short requests, 12 of them unfinished at any time (a queue behind the batch): prompts of 1 .. 8 tokens,
budgets of 1 .. 6 tokens, greedy and seeded sampled, ending by their budget, by a stop token or by an abort (of a
running request after its first tokens, or of a queued one). Every few steps (right after the queue was topped up)
it measures

* the bytes of every distinct tensor storage that the engine and its drafter reach through their attributes (the
  target cache, the state, the drafter's cache and per-row tensors, the models' weights and packed copies);
* the size of every container (dict / list / deque / set / tuple) reached the same way, outside the models;
* the process's resident memory (``/proc/self/statm``).

After the warm-up the tensor bytes at each batch occupancy (running rows) must be exactly those of the first
measurement at that occupancy (the caches are allocated for ``max_batch`` rows once), and the resident memory may
grow by at most RSS_SLACK. At the end the engine has no unfinished request and no per-request bookkeeping: its
request table, queue, running rows and pending events are empty, no container whose size followed the requests or
rows during the run still holds anything, no Request object of the run is alive anywhere, and the cache has no rows.
2,000 requests take 10 - 15 s per drafter here.

The slack, measured (2 shared cores, 2,000 requests, plain and draft model; resident memory read after a full
collection every 100 steps): after the warm-up it moved by at most 39 KiB; keeping every Request object alive (a
deliberate leak of ~0.7 KiB a request) grew it by 1.3 MiB over the 1,800 measured requests, which the 512 KiB
slack rejects. The tensor, container and Request-object checks see leaks exactly.

Two tests hold engine bugs found here fixed: an abort of the last request is reported by the step a
has_unfinished() loop makes, and an engine that empties leaves the drafter none of its rows.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import os

import pytest
import torch

pytest.importorskip("transformers")

import test_generate_greedy as greedy_t  # noqa: E402

from specdec_ext import Engine, RequestSettings  # noqa: E402
from specdec_ext.engine.request import Request  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")

UNFINISHED = 12  # requests kept unfinished: 8 running, 4 queued
TOTAL, WARMUP = 2000, 200  # requests
RSS_SLACK = 512 * 2**10  # bytes; see the module doc
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def held(roots: dict) -> tuple[int, dict[str, int]]:
    """The bytes of the distinct tensor storages reachable from ``roots`` (name: object) through attributes, and
    the size of every container reached outside ``torch.nn.Module``s and Request objects, by path (and the number of
    Request objects reached)."""
    storages: dict[int, int] = {}
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    stack = list(roots.items())
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type, torch.Generator,
                                                              torch.device, torch.dtype)) or callable(obj) and \
                not isinstance(obj, torch.nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
            continue
        if isinstance(obj, Request):  # (its contents are the request's own; the Request objects are counted)
            sizes["Request objects"] = sizes.get("Request objects", 0) + 1
            continue
        in_module = ".m." in path
        if isinstance(obj, dict):
            if not in_module:
                sizes[path] = len(obj)
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, collections.deque, set, frozenset)):
            if not in_module:
                sizes[path] = len(obj)
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__") or dataclasses.is_dataclass(obj):
            mark = ".m" if isinstance(obj, torch.nn.Module) else ""
            stack += [(f"{path}{mark}.{k}", v) for k, v in vars(obj).items()]
        elif hasattr(obj, "__slots__"):
            stack += [(f"{path}.{k}", getattr(obj, k)) for k in obj.__slots__ if hasattr(obj, k)]
    return sum(storages.values()), sizes


def request(n: int, ref: dict) -> tuple[list[int], RequestSettings, str]:
    """Request ``n``: ``(prompt, settings, how it should end)``; ``ref[prompt]`` is the prompt's greedy output."""
    prompt = greedy_t.prompt_of(1 + n % 8, n % 13)
    budget = 1 + n % 6
    how = ("abort-running", "abort-queued", "stop", "length", "length")[n % 5]
    kw = dict(max_new_tokens=budget)
    if n % 3 == 0:
        kw.update(temperature=0.9, top_k=20, seed=n)
    elif how == "stop" and budget > 1:
        kw.update(stop_token_ids=[ref[tuple(prompt)][budget - 2]])  # a greedy token before the budget
    return prompt, RequestSettings(**kw), how


def drive(engine: Engine, total: int, ref: dict, every: int = 10) -> tuple[list[tuple], dict[str, set], list]:
    """Feeds ``total`` requests through ``engine``, keeping UNFINISHED of them unfinished (a queue behind the
    batch) until the last ones; every ``every`` steps (right after the queue was topped up) records ``(requests
    added, running rows, tensor bytes, resident memory)`` (the memory every 10th time, else None) and the sizes each
    container had. Returns the records, the sizes
    seen per container and each request's finish reason. (Its own bookkeeping is allocated up front, so that the
    resident memory measures the engine's.)"""
    records, seen_sizes = [], collections.defaultdict(set)
    reasons, how = [None] * total, [None] * total
    added, steps = 0, 0
    while added < total or engine.has_unfinished():
        while added < total and len(engine.requests) < UNFINISHED:
            prompt, settings, how[added] = request(added, ref)
            assert engine.add_request(prompt, settings) == added
            added += 1
        if steps % every == 0 and added < total:
            # resident memory after a full collection (cyclic garbage waits for one; it costs 0.4 s with torch and
            # transformers loaded, hence every 10th time)
            mem = None
            if steps % (10 * every) == 0:
                gc.collect()
                mem = rss()
            nbytes, sizes = held({"engine": engine})
            for k, v in sizes.items():
                seen_sizes[k].add(v)
            records.append((added, len(engine.scheduler.running), nbytes, mem))
        newest = added - 1
        if how[newest] == "abort-queued" and newest in engine.requests and engine.requests[newest] in \
                engine.scheduler.waiting:
            engine.abort(newest)
        for rid, _, reason in engine.step():
            if reason is not None:
                reasons[rid] = reason
            elif how[rid] == "abort-running":
                engine.abort(rid)
        steps += 1
        assert steps < 10 * total
    # An abort's event comes with the next step, which a loop over has_unfinished() does not call when the abort
    # ended the last unfinished request (see test_abort_of_the_last_request_leaves_nothing_behind).
    for rid, _, reason in engine.step():
        reasons[rid] = reason
    return records, seen_sizes, reasons


def greedy_outputs(model, prompts) -> dict:
    with Engine(model, max_batch=8, max_len=64, eos_token_id=[]) as plain:
        ids = {plain.add_request(list(p), max_new_tokens=6): p for p in prompts}
        out = {p: [] for p in prompts}
        while plain.has_unfinished():
            for rid, new, _ in plain.step():
                out[ids[rid]].extend(new)
    return out


def check_flat(records: list[tuple], warmup: int) -> None:
    """After the warm-up, the tensor bytes at each occupancy (running rows) are those of the first record after the
    warm-up with that occupancy, and resident memory grew by RSS_SLACK at most."""
    after = [r for r in records if r[0] > warmup]
    assert len(after) >= 20
    first: dict[int, tuple] = {}
    for added, running, nbytes, _ in after:
        base = first.setdefault(running, (added, nbytes))
        assert nbytes == base[1], (f"tensor bytes with {running} rows: {base[1]} after {base[0]} requests, "
                                   f"{nbytes} after {added}")
    assert len(first) >= 3, sorted(first)  # (several occupancies compared)
    mems = [r[3] for r in after if r[3] is not None]
    assert len(mems) >= 3
    growth = max(mems) - mems[0]
    assert growth <= RSS_SLACK, f"resident memory grew by {growth / 2**20:.2f} MiB after the warm-up"


def left_behind(engine: Engine, seen_sizes: dict[str, set]) -> dict[str, int]:
    """The containers held by the (empty) engine and its drafter that are not empty although their size followed
    the requests or rows during the run (per-request or per-row bookkeeping), and the Request objects they hold."""
    _, sizes = held({"engine": engine})
    return {k: v for k, v in sizes.items() if v and (len(seen_sizes.get(k, ())) > 1 or k == "Request objects")}


@pytest.mark.parametrize("kind", ["plain", "draft"])
def test_many_short_requests_leave_memory_flat(kind):
    model = greedy_t.target("llama")
    ref = greedy_outputs(model, {tuple(greedy_t.prompt_of(1 + n % 8, n % 13)) for n in range(8 * 13)})
    gc.collect()
    held_before = [o for o in gc.get_objects() if type(o) is Request]  # (other tests' engines may hold some;
    earlier = {id(o) for o in held_before}  # kept alive here, so that no new object takes one of their ids)
    engine = Engine(model, greedy_t.make_drafter(kind, model), max_batch=8, max_len=64, eos_token_id=[])
    with engine:
        records, seen_sizes, reasons = drive(engine, TOTAL, ref)
    counts = collections.Counter(reasons)
    assert sum(counts.values()) == TOTAL and None not in counts
    assert min(counts["abort"], counts["stop"], counts["length"]) >= TOTAL // 20, counts
    check_flat(records, WARMUP)
    # the engine's own bookkeeping is empty, and no Request object of the run is alive anywhere
    assert not engine.has_unfinished() and not engine.requests and not engine._events
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.state is None and engine.cache.storage.shape[2] == 0
    engine_only = {k: v for k, v in left_behind(engine, seen_sizes).items() if not k.startswith("engine.drafter")}
    assert not engine_only, engine_only
    # the engine answers take_text for the requests that ended in its last step, until the next one: at most a
    # batch of them and the aborts before that step, nothing older
    last = {id(r) for r in engine._ended.values()}
    assert len(last) <= 2 * 8 and all(r.finished for r in engine._ended.values())
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Request and id(o) not in last | earlier]


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_an_empty_engine_leaves_the_drafter_no_rows(kind):
    model = greedy_t.target("llama")
    ref = greedy_outputs(model, {tuple(greedy_t.prompt_of(1 + n % 8, n % 13)) for n in range(8 * 13)})
    with Engine(model, greedy_t.make_drafter(kind, model), max_batch=8, max_len=64, eos_token_id=[]) as engine:
        _, seen_sizes, _ = drive(engine, 60, ref, every=1)
        assert engine.state is None
        assert not left_behind(engine, seen_sizes)


def test_abort_of_the_last_request_leaves_nothing_behind():
    model = greedy_t.target("llama")
    with Engine(model, max_batch=2, max_len=64, eos_token_id=[]) as engine:
        rid = engine.add_request([5, 6, 7], max_new_tokens=8)
        events = []
        while engine.has_unfinished():
            events += engine.step()
            if len(events) == 1:
                engine.abort(rid)
        assert events[-1] == (rid, [], "abort")
        assert not engine.scheduler.running and not engine._events and engine.state is None
