"""Progress of a long training command (the training loop, self-distillation): tqdm when installed, else plain lines
on stderr."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """tqdm when installed, else a plain printer to stderr (every ~2 s)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, initial: int = 0):
        self.enabled, self.total, self.n, self.desc = enabled, total, initial, desc
        self.bar = None
        self.last = 0.0
        self.post = ""
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        if not self.enabled:
            return
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last > 2 or self.n >= self.total:
            self.last = now
            extra = " ".join(f"{k}={v}" for k, v in postfix.items())
            print(f"{self.desc}: {self.n}/{self.total} {extra}", file=sys.stderr, flush=True)

    def set_total(self, total: int) -> None:
        """A new total (a run whose length is fixed after it started: a time budget)."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def write(self, msg: str) -> None:
        """An event line (the step count a budget chose, an evaluation): printed even without the bar, so that a
        logged run (``--no-progress``) records it."""
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
