"""specdec_ext: speculative decoding kernels and engine for PyTorch and Hugging Face models."""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch, which _C links against)

from specdec_ext import _C  # loads the compiled library and its op registrations
from specdec_ext import ops

__version__ = "0.1.0"

__all__ = ["AdaptiveDrafter", "Engine", "RequestSettings", "ops", "built_with_cuda", "__version__"]


def __getattr__(name: str):
    # AdaptiveDrafter and Engine import the drafters and through them transformers: loaded on first
    # use, so that `import specdec_ext` for the ops alone stays light.
    if name == "AdaptiveDrafter":
        from specdec_ext.adaptive import AdaptiveDrafter

        return AdaptiveDrafter
    if name in ("Engine", "RequestSettings"):  # (the engine imports the models layer: transformers)
        from specdec_ext import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'specdec_ext' has no attribute {name!r}")


def built_with_cuda() -> bool:
    """True when the installed extension was built with its CUDA kernels (independent of a GPU being present)."""
    return bool(_C.built_with_cuda())
