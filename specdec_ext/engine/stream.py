"""One request's tokens as the engine's steps accept them (:class:`TokenStream`).

Iterating steps the engine (every running request advances) and yields this request's new tokens of each step —
an accepted run of drafts plus the correction or bonus token — until it finishes; then :attr:`finish_reason` says
why. Other requests' events go to ``on_event`` (or are dropped), so one stream is enough for a single-request
caller such as the CLI, and a server that drives the engine itself reads :meth:`Engine.step`'s events instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

__all__ = ["TokenStream"]


class TokenStream:
    """Iterator over request ``request_id``'s new tokens per step (see the module doc)."""

    def __init__(self, engine, request_id: int, on_event: Callable[[int, list[int], str | None], None] | None = None):
        if request_id not in engine.requests:
            raise ValueError(f"TokenStream: request_id {request_id!r} is not an unfinished request of this engine")
        self.engine, self.request_id, self.on_event = engine, request_id, on_event
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[list[int]]:
        while self.finish_reason is None:
            for rid, new, reason in self.engine.step():
                if rid != self.request_id:
                    if self.on_event is not None:
                        self.on_event(rid, new, reason)
                    continue
                self.finish_reason = reason
                if new:
                    yield new
