"""The decode engine: requests join and leave a running batch between speculative steps (continuous batching).

* :mod:`~specdec_ext.engine.settings`: :class:`RequestSettings` (budget, sampling, seed, stop tokens and strings).
* :mod:`~specdec_ext.engine.stop_strings`: :class:`TextStops` (incremental detokenization, stop strings).
* :mod:`~specdec_ext.engine.request`: :class:`Request` (a request's output and finish reason).
* :mod:`~specdec_ext.engine.scheduler`: :class:`Scheduler` (FIFO queue, ``max_batch`` rows).
* :mod:`~specdec_ext.engine.verify`: :class:`Verifier` (greedy / lossless / typical verification, per row).
* :mod:`~specdec_ext.engine.engine`: :class:`Engine` (add_request, step, abort, has_unfinished).
* :mod:`~specdec_ext.engine.stream`: :class:`TokenStream` (one request's tokens as steps accept them).
* :mod:`~specdec_ext.engine.stats`: :class:`DecodeStats`.
"""

from specdec_ext.engine.engine import Engine
from specdec_ext.engine.request import FINISH_REASONS, Request
from specdec_ext.engine.scheduler import Scheduler
from specdec_ext.engine.settings import RequestSettings
from specdec_ext.engine.stats import DecodeStats
from specdec_ext.engine.stop_strings import TextStops
from specdec_ext.engine.stream import TokenStream
from specdec_ext.engine.verify import Verifier

__all__ = ["DecodeStats", "Engine", "FINISH_REASONS", "Request", "RequestSettings", "Scheduler", "TextStops",
           "TokenStream", "Verifier"]
