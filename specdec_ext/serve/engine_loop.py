"""The engine thread (:class:`EngineLoop`) and the per-request channels the HTTP handlers read (:class:`Ticket`).

The :class:`~specdec_ext.engine.Engine` is not thread-safe, so one thread makes every engine call. Handlers only
:meth:`EngineLoop.submit` (a new request) and :meth:`EngineLoop.cancel` (a client went away); both put a command
in a list under a lock and wake the thread. The thread applies the commands between steps, steps while anything is
unfinished, hands each request's events to its ticket (an ``asyncio.Queue`` fed with ``call_soon_threadsafe``: one
call per step for every ticket of an event loop), and sleeps on the condition when idle. A cancel is applied before
the next step's work, so a disconnected client's request leaves within one step.

A ticket's queue receives, in order: :class:`Admitted` or :class:`Rejected` (the engine refused the request:
``add_request``'s ValueError), then one :class:`Delta` per step that gave the request tokens or ended it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field

from specdec_ext.engine import RequestSettings

__all__ = ["Admitted", "Delta", "EngineLoop", "QueueFull", "Rejected", "ServerClosed", "Ticket"]


class QueueFull(Exception):
    """More requests wait for a row than the loop's ``max_queue`` (HTTP 429)."""


class ServerClosed(Exception):
    """The loop stopped admitting (shutting down) or the engine failed (HTTP 503)."""


@dataclass(frozen=True)
class Admitted:
    request_id: int


@dataclass(frozen=True)
class Rejected:
    message: str  # add_request's ValueError (it names the setting), or the engine's failure
    server_error: bool = False  # True: not the request's fault (HTTP 500)


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort" or None
    time: float  # perf_counter when the step that made it returned


@dataclass(eq=False)
class Ticket:
    """One request between a handler and the engine thread."""

    prompt: list[int]
    settings: RequestSettings
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    number: int = 0
    request_id: int | None = None  # set by the engine thread
    cancelled: bool = False
    first_token: float | None = None  # engine-thread bookkeeping for the latency histograms
    last_token: float | None = None
    generated: int = 0

    def put(self, item) -> None:
        _deliver_all([(self, item)])


def _deliver_all(items: list[tuple[Ticket, object]]) -> None:
    """Hands each ``(ticket, item)`` to its ticket's queue: one ``call_soon_threadsafe`` per event loop for all of
    them, in order. Each such call wakes the event loop (a write to its self-pipe) and asks for the interpreter
    lock the engine thread holds, so a step's tokens for 16-64 rows go over in one hand-off, not one per row."""
    by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]]] = {}
    for ticket, item in items:
        by_loop.setdefault(id(ticket.loop), (ticket.loop, []))[1].append((ticket.queue, item))
    for loop, batch in by_loop.values():
        try:
            loop.call_soon_threadsafe(_put_each, batch)
        except RuntimeError:  # (the event loop closed: nobody reads these tickets any more)
            pass


def _put_each(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class EngineLoop:
    """Runs ``engine`` in a thread of its own (see the module doc). ``max_queue``: the most requests that may wait
    for a row (submitted, not running yet); beyond it :meth:`submit` raises :class:`QueueFull`. ``metrics``: a
    :class:`~specdec_ext.serve.metrics.ServerMetrics` (or None) told about admissions, tokens and finishes."""

    def __init__(self, engine, max_queue: int = 1024, metrics=None):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"EngineLoop: max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._cond = threading.Condition()
        self._adds: list[Ticket] = []
        self._cancels: list[Ticket] = []
        self._tickets: dict[int, Ticket] = {}  # by engine request id: admitted, unfinished
        self._waiting = 0  # requests in the engine's queue (no row yet), as of the last step
        self._numbers = itertools.count()
        self._admitting = True
        self._stop = False
        self.failure: str | None = None  # the engine's error, once a step raised (the loop then serves nothing)
        self.step_s = 0.0  # wall time inside engine.step() (the engine's own time, for the server's overhead)
        self.busy_s = 0.0  # wall time of loop iterations that had work (engine + event hand-off)
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # ---- handler side (any thread) --------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread (once; later calls do nothing)."""
        with self._cond:
            if self._thread.is_alive() or self._stop:
                return
            self._thread.start()

    @property
    def admitting(self) -> bool:
        return self._admitting and self.failure is None

    def submit(self, prompt: list[int], settings: RequestSettings) -> Ticket:
        """Queues a request; call from the event loop whose queue will receive its events."""
        ticket = Ticket(prompt, settings, asyncio.Queue(), asyncio.get_running_loop())
        with self._cond:
            if self.failure is not None:
                raise ServerClosed(f"the engine failed and serves no more requests: {self.failure}")
            if not self._admitting:
                raise ServerClosed("the server is shutting down and admits no new requests")
            if self._waiting + len(self._adds) >= self.max_queue:
                raise QueueFull(f"{self._waiting + len(self._adds)} requests already wait for a row "
                                f"(--max-queue {self.max_queue}); retry later")
            ticket.number = next(self._numbers)
            self._adds.append(ticket)
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Aborts ``ticket``'s request before the next step (nothing if it already finished)."""
        with self._cond:
            if ticket.cancelled:
                return
            ticket.cancelled = True
            self._cancels.append(ticket)
            self._cond.notify()

    def stop_admitting(self) -> None:
        with self._cond:
            self._admitting = False

    def in_flight(self) -> int:
        with self._cond:
            return len(self._tickets) + len(self._adds)

    def close(self, timeout: float = 10.0) -> None:
        """Aborts what is still running, stops the thread (waits up to ``timeout`` s for it) and closes the
        engine."""
        with self._cond:
            self._admitting = False
            self._cancels.extend(t for t in list(self._tickets.values()) + self._adds if not t.cancelled)
            for t in self._cancels:
                t.cancelled = True
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    # ---- the engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._adds or self._cancels or self._stop or
                           (engine.has_unfinished() and self.failure is None)):
                    self._cond.wait()
                adds, self._adds = self._adds, []
                cancels, self._cancels = self._cancels, []
                stop = self._stop
            t0 = time.perf_counter()
            for ticket in adds:
                self._admit(ticket)
            for ticket in cancels:
                if ticket.request_id is not None and ticket.request_id in self._tickets:
                    engine.abort(ticket.request_id)
            if self.failure is None and engine.has_unfinished():
                self._step()
            if stop and not (self.failure is None and engine.has_unfinished()):
                self._fail_all("the server shut down")
                return
            with self._cond:
                self._waiting = len(engine.scheduler.waiting)
            if self.metrics is not None:
                self.metrics.update_engine(engine, self)
            self.busy_s += time.perf_counter() - t0

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:  # (gone before it reached the engine)
            ticket.put(Delta([], "", "abort", time.perf_counter()))
            return
        if self.failure is not None:
            ticket.put(Rejected(f"the engine failed: {self.failure}", server_error=True))
            return
        try:
            rid = self.engine.add_request(ticket.prompt, ticket.settings)
        except (ValueError, TypeError) as err:
            ticket.put(Rejected(str(err)))
            return
        ticket.request_id = rid
        self._tickets[rid] = ticket
        ticket.put(Admitted(rid))
        if self.metrics is not None:
            self.metrics.admitted(ticket)

    def _step(self) -> None:
        engine = self.engine
        t0 = time.perf_counter()
        try:
            events = engine.step()
        except Exception as err:  # noqa: BLE001  (the engine's state is unknown now: fail loudly, serve nothing)
            self.failure = f"{type(err).__name__}: {err}"
            self._fail_all(f"the engine failed: {self.failure}")
            return
        now = time.perf_counter()
        self.step_s += now - t0
        deltas = []
        for rid, new, reason in events:
            ticket = self._tickets.get(rid)
            if ticket is None:
                continue
            text = engine.take_text(rid) if engine.tokenizer is not None else ""
            if self.metrics is not None:
                self.metrics.tokens(ticket, len(new), now)
            ticket.generated += len(new)
            if reason is not None:
                del self._tickets[rid]
                if self.metrics is not None:
                    self.metrics.finished(ticket, reason, now)
            deltas.append((ticket, Delta(list(new), text, reason, now)))
        _deliver_all(deltas)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            pending, self._adds = self._adds, []
        for ticket in list(self._tickets.values()) + pending:
            ticket.put(Rejected(message, server_error=True))
        self._tickets.clear()
