"""The machine's processor as results record it: benchmark results (:mod:`specdec_ext.bench.machine`) and the model
zoo's build records (:mod:`specdec_ext.zoo.build`) both name it."""

from __future__ import annotations

import platform

__all__ = ["cpu_model"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what :mod:`platform` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
