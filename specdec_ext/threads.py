"""The torch thread count: ``--threads`` of every ``specdec`` command, and :func:`set_threads` for library users.

Why a default of our own. Decoding runs thousands of small parallel regions a second, and a region waits for all of
its threads. Beside a busy process one of them is often descheduled (OpenMP's workers spin between regions and the
scheduler shares their core with the busy process), so every region can wait for a time slice: on a 2-core machine
with one busy process, decoding the model family at 2 threads ran 3-20x slower than at 1 (aten's products and
elementwise ops; our own ops stop splitting by themselves, see ``csrc/ops/split_guard.h``). Torch's default counts
the machine's cores, busy or not. ``auto`` counts the cores that are free: the cores this process may use (its CPU
affinity, capped by a cgroup CPU quota) and torch's own default, less the cores other processes keep busy (the
one-minute load average, but no more than the processes running right now: a load that has ended is not counted).
Set ``OMP_NUM_THREADS`` and ``auto`` keeps torch's count: the user has chosen.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

__all__ = ["add_threads_argument", "apply_threads", "busy_cores", "default_threads", "parse_threads", "quota_cores",
           "set_threads", "usable_cores"]

_TORCH_DEFAULT = torch.get_num_threads()  # (before any command changes it)


def quota_cores(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """The cores a cgroup v2 CPU quota allows (``"quota period"``, rounded up), or None without a quota."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity mask, capped by :func:`quota_cores`."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = quota_cores()
    return max(1, min(n, quota) if quota is not None else n)


def _running_now() -> int | None:
    """Runnable tasks on the machine now, this one excluded (``/proc/stat``'s ``procs_running``)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return max(0, int(line.split()[1]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def busy_cores() -> int:
    """Cores other processes keep busy: the one-minute load average (rounded), at most the tasks running now."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0
    busy = int(load + 0.5)
    now = _running_now()
    return min(busy, now) if now is not None else busy


def default_threads() -> int:
    """``auto``: torch's thread count where ``OMP_NUM_THREADS`` sets it, else ``min(torch's default, usable
    cores) - busy cores``, at least 1 (see the module doc)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return _TORCH_DEFAULT
    return max(1, min(_TORCH_DEFAULT, usable_cores()) - busy_cores())


def parse_threads(value) -> int | str:
    """``"auto"`` or an integer >= 1 (from a command line string or a number); ValueError otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"threads must be 'auto' or an integer >= 1, got {value!r}") from None
    if n < 1:
        raise ValueError(f"threads must be 'auto' or an integer >= 1, got {value!r}")
    return n


def set_threads(threads: int | str = "auto") -> int:
    """Sets torch's thread count to ``threads`` (an integer >= 1, or ``"auto"``: :func:`default_threads`);
    returns it."""
    value = parse_threads(threads)
    n = default_threads() if value == "auto" else value
    torch.set_num_threads(n)
    return n


def _argument(text: str) -> int | str:
    try:
        return parse_threads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).replace("threads must", "must")) from None


_AUTO_HELP = ("torch threads (default: auto = the cores not kept busy by other processes; beside a busy process "
              "every extra thread makes decoding wait)")


def add_threads_argument(parser: argparse.ArgumentParser, default: int | str = "auto", why: str | None = None) -> None:
    """``--threads N|auto`` on ``parser`` (apply it with :func:`apply_threads`); a command whose work is known to
    gain nothing from threads passes its own ``default`` and says ``why``."""
    parse_threads(default)
    help_ = _AUTO_HELP if why is None else f"torch threads (default: {default}: {why}; auto = the cores not kept busy)"
    parser.add_argument("--threads", type=_argument, default=default, metavar="N|auto", help=help_)


def apply_threads(args: argparse.Namespace) -> int:
    """Sets torch's thread count from ``args.threads`` (:func:`add_threads_argument`); returns it."""
    return set_threads(args.threads)
