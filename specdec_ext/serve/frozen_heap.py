"""A server's loaded objects kept out of Python's cyclic garbage collector (:func:`freeze_startup_objects`).

Why. A process that has imported torch, transformers and the server's stack tracks 200,000-450,000 container
objects (functions, tuples, dicts of those modules, the model's modules). A full (generation 2) collection walks all
of them: 76-190 ms on the 2-core VMs, during which no thread runs, so every request in flight stalls a step's time
or more, several times a minute under load. None of those objects ever becomes garbage. Frozen once the server is
built (``gc.freeze``: moved to the permanent generation, which collections skip), they cost nothing; what the
requests allocate is collected as before. CPython's documentation recommends the same for pre-fork servers, and
the engines serving LLMs freeze after start-up too.

A process-wide setting: the ``specdec serve`` command and the serve benchmark call it once their servers are up;
a library user embedding :func:`~specdec_ext.serve.app.create_app` decides for their own process.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_objects"]


def freeze_startup_objects() -> int:
    """Collects what is garbage now, then freezes every object still alive (``gc.freeze``); returns how many
    objects the permanent generation holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
