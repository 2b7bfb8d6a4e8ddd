"""Where the engine can run: :func:`check_device` turns a user's device string into a ``torch.device`` or a clear
error, before any model is loaded (a bad ``--device`` otherwise surfaces deep inside ``model.to`` or the first op)."""

from __future__ import annotations

import torch

from specdec_ext import _C  # (the compiled library itself: whether it holds the CUDA kernels)

__all__ = ["check_device"]


def check_device(device: str | torch.device, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` this machine and build can run on: ``cpu``, or ``cuda[:i]`` where a GPU ``i``
    is present and the extension holds its CUDA kernels. Raises ``ValueError`` naming ``what`` otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is not None and dev.type == "cpu":
        return dev
    if dev is None or dev.type != "cuda":  # the kernels exist for CPUs and CUDA GPUs only
        raise ValueError(f"{what} must be cpu or cuda[:<index>] (specdec_ext's kernels run on CPUs and CUDA GPUs), "
                         f"got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{what} {device!r}: no CUDA GPU is available here (torch {torch.__version__}, CUDA "
                         f"{torch.version.cuda or 'not built'}); use cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{what} {device!r}: this machine has {count} CUDA GPU(s), cuda:0 .. cuda:{count - 1}")
    if not _C.built_with_cuda():
        raise ValueError(f"{what} {device!r}: specdec_ext was built without its CUDA kernels (SPECDEC_CUDA=0); "
                         "rebuild it with CUDA, or use cpu")
    return dev
