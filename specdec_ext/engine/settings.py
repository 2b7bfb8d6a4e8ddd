"""A request's settings (:class:`RequestSettings`): budget, sampling, randomness and when to stop.

``Engine.add_request`` takes them as keywords or as one :class:`RequestSettings`; :meth:`RequestSettings.validated`
checks every field once, at admission, and raises a ``ValueError`` naming the field (``TypeError`` only for a value
of the wrong Python kind, such as a generator that is not a ``torch.Generator``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from specdec_ext.engine.limits import is_int
from specdec_ext.state import GREEDY_TEMPERATURE  # (the ops' greedy epsilon)

__all__ = ["GREEDY_TEMPERATURE", "RequestSettings"]


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class RequestSettings:
    """How one request generates.

    ``max_new_tokens``: tokens to generate at most (>= 1). ``temperature``: 0 = greedy; otherwise sampling with
    ``top_k`` (0 = off) and ``top_p`` (1 = off). ``seed`` or ``generator`` (not both): the request's own random
    stream (neither: a fresh generator seeded from torch's global one). ``stop_token_ids``: tokens that end the
    request (included in its output; the engine adds the target's EOS ids unless ``ignore_eos``). ``stop``: strings
    that end the request when its detokenized text contains one (the text stops before it; needs the engine's
    tokenizer).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    generator: torch.Generator | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def of(cls, settings: "RequestSettings | None" = None, **kwargs) -> "RequestSettings":
        """``settings`` or the keywords (not both), validated. Unknown keywords are a ``ValueError`` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"add_request: unknown setting {unknown[0]!r} (settings: {', '.join(sorted(names))})")
        if settings is not None:
            if not isinstance(settings, RequestSettings):
                raise TypeError(f"add_request: settings must be a RequestSettings, got {type(settings).__name__}")
            if kwargs:
                raise ValueError(f"add_request: give a RequestSettings or keywords, not both (got settings and "
                                 f"{', '.join(sorted(kwargs))})")
            return settings.validated()
        return cls(**kwargs).validated()

    def validated(self) -> "RequestSettings":
        """These settings with ``stop_token_ids`` / ``stop`` as tuples, after checking every field."""
        n = self.max_new_tokens
        if not is_int(n) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        t = self.temperature
        if not _is_number(t) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {self.top_k!r}")
        p = self.top_p
        if not _is_number(p) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = no top-p filter), got {p!r}")
        if self.seed is not None and not (is_int(self.seed) and -2 ** 63 <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be an integer in [-2^63, 2^64) (what torch.Generator.manual_seed takes) or "
                             f"None, got {self.seed!r}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}")
        if self.seed is not None and self.generator is not None:
            raise ValueError("seed and generator: give one of them (a seed makes the request's own generator)")
        ids = self.stop_token_ids
        ids = (ids,) if is_int(ids) else ids
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0 (an integer or a list of them), got {ids!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        return dataclasses.replace(self, max_new_tokens=int(n), temperature=float(t), top_k=int(self.top_k),
                                   top_p=float(p), stop_token_ids=tuple(sorted({int(i) for i in ids})),
                                   stop=tuple(stop))

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """The request's random stream: its own generator, one seeded with ``seed``, or (sampling without either)
        one seeded from torch's global generator (so ``torch.manual_seed`` makes a run reproducible). Greedy
        requests draw nothing: None."""
        if self.generator is not None:
            return self.generator
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2 ** 62, ()))
        return torch.Generator(device=device).manual_seed(seed)
