"""The decode engine: requests join and leave a running batch between speculative steps (continuous batching).

* :mod:`~specdec_ext.engine.settings`: :class:`RequestSettings` (budget, sampling, seed, stop tokens and strings).
* :mod:`~specdec_ext.engine.stop_strings`: :class:`TextStops` (incremental detokenization, stop strings).
* :mod:`~specdec_ext.engine.request`: :class:`Request` (a request's output and finish reason).
* :mod:`~specdec_ext.engine.scheduler`: :class:`Scheduler` (FIFO queue, ``max_batch`` rows).
"""

from specdec_ext.engine.request import FINISH_REASONS, Request
from specdec_ext.engine.scheduler import Scheduler
from specdec_ext.engine.settings import RequestSettings
from specdec_ext.engine.stop_strings import TextStops

__all__ = ["FINISH_REASONS", "Request", "RequestSettings", "Scheduler", "TextStops"]
