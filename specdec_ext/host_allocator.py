"""The host allocator of a decoding process: every ``specdec`` command fixes glibc malloc's thresholds once
(:func:`tune_host_allocator`; library users call it themselves, as they call :func:`~specdec_ext.threads.set_threads`).

Why. glibc serves a request above its mmap threshold (128 KiB at start) with a fresh mapping and unmaps it on free;
each mapped block freed raises the threshold to its size (up to 32 MiB), and free memory at the heap's top beyond
the trim threshold goes back to the kernel. A decode step allocates and frees logits, activations and scratch of
0.1-10 MiB, so whether a step maps them afresh (page faults, pages the kernel zeroes) depends on what the process
freed before: the same step costs differently by history, and two decoders in one process (a server's engines, a
benchmark's methods taking turns) change each other's costs. Fixed thresholds keep those blocks in the heap: a
steady process reuses them and its resident memory levels off at its working set (docs/ARCHITECTURE.md, "The host
allocator", has the measurements).

The user's choice stands: with any of glibc's malloc tunables in the environment, or ``SPECDEC_HOST_ALLOCATOR=default``,
or a C library other than glibc (musl, macOS, Windows), nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["HOST_ALLOCATOR_ENV", "SETTINGS", "host_allocator_settings", "tune_host_allocator"]

HOST_ALLOCATOR_ENV = "SPECDEC_HOST_ALLOCATOR"  # "default": leave malloc as it is

# mallopt's parameters (malloc.h) and the values set
SETTINGS = {
    "mmap_threshold": (-3, 64 << 20),  # M_MMAP_THRESHOLD: blocks under 64 MiB come from the heap (weights still map)
    "trim_threshold": (-1, 512 << 20),  # M_TRIM_THRESHOLD: up to 512 MiB of free heap top stays mapped
    "top_pad": (-2, 64 << 20),  # M_TOP_PAD: the heap grows 64 MiB at a time
}
_USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                  "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")

_state: dict = {"settings": None, "reason": "not tuned"}
_tuned = False


def _glibc_mallopt():
    """glibc's ``mallopt``, or None (another C library, or none that ctypes can open)."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):  # (glibc only)
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def tune_host_allocator() -> dict | None:
    """Fixes glibc malloc's mmap threshold, trim threshold and top pad (:data:`SETTINGS`; see the module doc), once
    per process; returns what was set, or None where nothing was (the environment says otherwise, or not glibc).
    Later calls return the first call's answer."""
    global _tuned
    if not _tuned:
        _tuned = True
        user = [name for name in _USER_TUNABLES if name in os.environ]
        mallopt = None
        if os.environ.get(HOST_ALLOCATOR_ENV, "").strip().lower() == "default":
            _state["reason"] = f"{HOST_ALLOCATOR_ENV}=default"
        elif user:
            _state["reason"] = f"the environment sets {', '.join(user)}"
        elif (mallopt := _glibc_mallopt()) is None:
            _state["reason"] = "not glibc"
        if mallopt is not None:
            done = {name: value for name, (param, value) in SETTINGS.items() if mallopt(param, value) == 1}
            _state.update(settings=done or None, reason="fixed thresholds" if done else "mallopt refused them")
    return _state["settings"]


def host_allocator_settings() -> dict:
    """What :func:`tune_host_allocator` did in this process and why (for a benchmark's record)."""
    return {"settings": _state["settings"], "reason": _state["reason"]}
