"""specdec_ext: speculative decoding kernels and engine for PyTorch and Hugging Face models."""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch, which _C links against)

from specdec_ext import _C  # loads the compiled library and its op registrations
from specdec_ext import ops
from specdec_ext.adaptive import AdaptiveDrafter  # noqa: E402  (adaptive speculation, see specdec_ext/adaptive.py)

__version__ = "0.1.0"

__all__ = ["ops", "built_with_cuda", "__version__"]


def built_with_cuda() -> bool:
    """True when the installed extension was built with its CUDA kernels (independent of a GPU being present)."""
    return bool(_C.built_with_cuda())
