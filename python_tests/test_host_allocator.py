"""The host allocator's thresholds (specdec_ext/host_allocator.py): set once per process on glibc, so a block of a
few MiB comes from the heap instead of a fresh mapping (checked by glibc's own accounting), and left alone where
the environment says how malloc should behave. Each case runs in a process of its own: the settings are global."""

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import ctypes, ctypes.util, json, sys
from specdec_ext.host_allocator import host_allocator_settings, tune_host_allocator

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = Mallinfo2
first = tune_host_allocator() if sys.argv[1] == "tune" else None
again = tune_host_allocator() if sys.argv[1] == "tune" else None
before = libc.mallinfo2().hblks
p = libc.malloc(8 << 20)  # 8 MiB: above glibc's starting mmap threshold, below ours
mapped = libc.mallinfo2().hblks - before
libc.free(p)
print(json.dumps({"first": first, "again": again, "mapped": mapped, "record": host_allocator_settings()}))
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")
    except OSError:
        return False


def _child(mode: str, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES",
                                                                         "SPECDEC_HOST_ALLOCATOR"))}
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=120,
                         env={**environ, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2) to see where blocks come from")
def test_glibc_blocks_of_a_few_mib_come_from_the_heap_once_tuned():
    plain = _child("leave")
    assert plain["mapped"] == 1, plain  # glibc's default: a fresh mapping for 8 MiB
    assert plain["record"] == {"settings": None, "reason": "not tuned"}
    tuned = _child("tune")
    assert tuned["mapped"] == 0, tuned  # from the heap
    assert tuned["first"] == {"mmap_threshold": 64 << 20, "trim_threshold": 512 << 20, "top_pad": 64 << 20}
    assert tuned["again"] == tuned["first"] and tuned["record"]["reason"] == "fixed thresholds"


@pytest.mark.parametrize("env, reason", [({"SPECDEC_HOST_ALLOCATOR": "default"}, "SPECDEC_HOST_ALLOCATOR=default"),
                                         ({"MALLOC_ARENA_MAX": "2"}, "the environment sets MALLOC_ARENA_MAX")])
def test_the_environment_s_choice_stands(env, reason):
    out = _child("tune", **env)
    assert out["first"] is None and out["record"] == {"settings": None, "reason": reason}
    if _glibc_with_mallinfo2():
        assert out["mapped"] == 1, out  # glibc left as it was
