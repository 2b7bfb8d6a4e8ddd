"""``specdec bench``: end-to-end benchmarks of speculative decoding (see the README's "Benchmarks" section).

* :mod:`~specdec_ext.bench.e2e`: plain decoding vs each drafter vs Hugging Face assisted generation and prompt
  lookup, greedy and temperature 1: tokens/s, speedup, acceptance, predicted speedup, peak memory;
* :mod:`~specdec_ext.bench.context_sweep`: acceptance and speedup against the prompt length;
* ``specdec_ext.bench.batch_sweep`` (``run_batch_sweep``): tokens/s against the batch size (its own module,
  imported lazily by :func:`load_batch_sweep`);
* :mod:`~specdec_ext.bench.engine_load` (``--suite engine``): the :class:`~specdec_ext.Engine` under load, plain vs
  each drafter vs adaptive: throughput, TTFT and ITL p50/p99 against concurrency and Poisson arrival rates, with
  :mod:`~specdec_ext.bench.load_clients` (the request mix, open- and closed-loop clients, what they measure);
* :mod:`~specdec_ext.bench.draft_lms`: what the draft-LM benchmark scripts share (``benchmarks/python``);
* :mod:`~specdec_ext.bench.plots` (PNGs), :mod:`~specdec_ext.bench.machine` (machine and versions),
  :mod:`~specdec_ext.bench.models` (the zoo family, user directories or tiny random models),
  :mod:`~specdec_ext.bench.cli` (``add_bench_command``).
"""

from __future__ import annotations

__all__ = ["BatchSweepUnavailable", "load_batch_sweep"]


class BatchSweepUnavailable(RuntimeError):
    """``specdec_ext.bench.batch_sweep`` is not installed (yet)."""


def load_batch_sweep():
    """``specdec_ext.bench.batch_sweep.run_batch_sweep``, imported on first use; raises
    :class:`BatchSweepUnavailable` with a clear message when the module is not there."""
    try:
        from specdec_ext.bench.batch_sweep import run_batch_sweep
    except ModuleNotFoundError as err:
        if err.name in ("specdec_ext.bench.batch_sweep",):
            raise BatchSweepUnavailable("the batch sweep (specdec_ext/bench/batch_sweep.py) is not part of this "
                                        "installation yet") from None
        raise
    except ImportError as err:
        raise BatchSweepUnavailable(f"specdec_ext.bench.batch_sweep has no run_batch_sweep ({err})") from None
    return run_batch_sweep
