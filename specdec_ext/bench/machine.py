"""What machine and software a benchmark ran on (recorded in every result file)."""

from __future__ import annotations

import os
import platform
import re
import socket

import torch

import specdec_ext
from specdec_ext.hardware import cpu_model
from specdec_ext.host_allocator import host_allocator_settings


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001  (not installed or broken: record its absence)
        return None
    return getattr(mod, "__version__", "unknown")


def machine_info() -> dict:
    """CPU model, cores (and the ones this process may use), torch threads, the host allocator's settings, versions
    of python / torch / transformers / specdec_ext (and whether its CUDA kernels are built), and the CUDA device when
    there is one."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    info = {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "host_allocator": host_allocator_settings(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "specdec_ext": getattr(specdec_ext, "__version__", "unknown"),
        "specdec_cuda_kernels": bool(specdec_ext.built_with_cuda()),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    gpu_sm=f"{p.major}.{p.minor}")
    return info


def machine_tag(info: dict | None = None) -> str:
    """A short file-name-safe tag: ``cpu_<vendor>_<cores>core`` or ``gpu_<name>``."""
    info = info or machine_info()
    if info.get("gpu"):
        name = info["gpu"]
        base = "gpu_" + name
    else:
        cpu = info.get("cpu", "cpu").lower()
        vendor = next((v for v in ("epyc", "xeon", "ryzen", "core", "apple", "graviton", "neoverse") if v in cpu),
                      cpu.split()[0] if cpu else "cpu")
        base = f"cpu_{vendor}_{info.get('usable_cores') or info.get('cores')}core"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("_").lower()
