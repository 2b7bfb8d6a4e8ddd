"""pytest fixtures of the specdec_ext test suite (helpers live in helpers.py).

Every op test compares the compiled kernels (through the typed wrappers in ``specdec_ext.ops``) with the executable
specification ``specdec_ext.ops.reference``. The reference is a slow Python loop, so it always runs on CPU copies of
the inputs and on a modest number of rows.

CUDA variants are the same tests parametrised over ``device``; they are skipped (with the reason) when no GPU is
present or the extension was built without its CUDA kernels.
"""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICES, DTYPE_IDS, FLOAT_DTYPES


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test that takes more than a few seconds on 2 CPU cores")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that run tiny models (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): they run as
    fast on one thread, and one thread does not stall when another process holds a core."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(params=FLOAT_DTYPES, ids=DTYPE_IDS)
def dtype(request) -> torch.dtype:
    return request.param
