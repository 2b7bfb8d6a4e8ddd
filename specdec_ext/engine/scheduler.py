"""Which requests run (:class:`Scheduler`): a FIFO queue in front of ``max_batch`` rows.

``running[i]`` is the request in row i of the engine's batch. Requests wait in arrival order and are admitted
between steps as rows free up; finished and aborted requests leave the batch after the step in which they ended.
:meth:`Scheduler.retire` chooses the rows that stay in the order the caches move least: each leaving row's slot
below the new batch size is taken by a staying row from the end (``[0, 5, 2, 3, 4]`` when row 1 of 6 leaves), so
rows that keep their slot cost nothing (``TreeKVCache.keep_rows``).
"""

from __future__ import annotations

from collections import deque

from specdec_ext.engine.request import Request

__all__ = ["PREFILL_PADDING", "PREFILL_SMALL", "Scheduler", "prefill_groups"]


class Scheduler:
    """The queue and the running rows of one engine (``max_batch`` rows at most)."""

    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def __len__(self) -> int:
        """Requests not finished: running and waiting."""
        return len(self.running) + len(self.waiting)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """The waiting requests that fit in the free rows, oldest first; they become the last running rows."""
        free = self.max_batch - len(self.running)
        joining = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        self.running.extend(joining)
        return joining

    def reorder_admitted(self, order: list[int]) -> None:
        """The last ``len(order)`` running rows (the ones just admitted) become ``[those[i] for i in order]``."""
        n = len(order)
        if sorted(order) != list(range(n)) or n > len(self.running):
            raise ValueError(f"Scheduler.reorder_admitted: order must be a permutation of the last {n} rows' "
                             f"indices (of {len(self.running)} running), got {order!r}")
        tail = self.running[len(self.running) - n:]
        self.running[len(self.running) - n:] = [tail[i] for i in order]

    def drop_waiting(self, request: Request) -> bool:
        """Takes ``request`` out of the queue; False when it is not waiting (it runs, or finished)."""
        try:
            self.waiting.remove(request)
        except ValueError:
            return False
        return True

    def retire(self) -> list[int] | None:
        """Drops the finished running requests; returns the kept rows (old row of each new row, see the module
        doc), or None when every row stays."""
        rows = self.running
        live = [not r.finished for r in rows]
        if all(live):
            return None
        n = sum(live)
        tail = iter([b for b in range(n, len(rows)) if live[b]])
        keep = [b if live[b] else next(tail) for b in range(n)]
        self.running = [rows[b] for b in keep]
        return keep


# a prefill group's padded tokens (its rows x its longest prompt) stay within this many times its own tokens, or
# within PREFILL_SMALL tokens (a forward that small costs about its weights' read, whatever its rows)
PREFILL_PADDING = 2.0
PREFILL_SMALL = 512


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """The joining rows (indices into ``lengths``, the tokens each prefills) in groups, each prefilled by one forward
    that pads its rows to its longest: by length, a group growing while its padded tokens stay within
    :data:`PREFILL_PADDING` times its own or :data:`PREFILL_SMALL`, so a long prompt joining short ones gets a
    forward of its own instead of making each of them as long. One group keeps the rows in their order."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    total = 0
    for i in order:
        n = lengths[i]
        padded = (len(groups[-1]) + 1) * n if groups else 0
        if not groups or (padded > PREFILL_SMALL and padded > PREFILL_PADDING * (total + n)):
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return [list(range(len(lengths)))] if len(groups) == 1 else groups
