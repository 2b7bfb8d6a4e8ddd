"""One request's bookkeeping (:class:`Request`): what it asked for, what it emitted, and why it finished.

A step hands each row its accepted run (drafts + the correction or bonus token); :meth:`Request.emit` keeps the
part that may be emitted: the run is cut after the first stop token, at the budget, and after the token that
completed a stop string — whichever comes first — and the finish reason is set (``"stop"``: a stop token or stop
string; ``"length"``: the budget). An aborted request finishes with ``"abort"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec_ext.engine.settings import RequestSettings
from specdec_ext.engine.stop_strings import TextStops

__all__ = ["FINISH_REASONS", "Request"]

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Request:
    """A request of the engine (see the module doc). ``stop_ids``: its stop tokens with the engine's EOS ids."""

    id: int
    prompt: list[int]
    settings: RequestSettings
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    text: TextStops | None = None
    output: list[int] = field(default_factory=list)  # generated tokens so far
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens the request may still emit."""
        return self.settings.max_new_tokens - len(self.output)

    def emit(self, run: list[int]) -> list[int]:
        """Takes a step's accepted run and returns the tokens emitted from it (see the module doc)."""
        new = []
        for token in run[: self.remaining]:
            new.append(token)
            if token in self.stop_ids or (self.text is not None and self.text.push(token)):
                self.finish_reason = "stop"
                break
        self.output.extend(new)
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = "length"
        return new
