"""Builds specdec_ext._C with torch's cpp_extension (ninja).

Install against the torch you already have:   pip install --no-build-isolation .   (or -e .)

Environment:
  SPECDEC_CUDA=auto|0|1   auto (default): build the CUDA kernels when torch is a CUDA build and a CUDA toolkit
                          (nvcc) is found; whether a GPU is present does not matter. 0: CPU only. 1: CUDA required
                          (fails with a clear message when the toolchain is missing).
  CUDA_HOME               the toolkit folder (holding bin/nvcc); found from nvcc on PATH when unset.
  TORCH_CUDA_ARCH_LIST    GPU architectures; default "8.0;9.0" (A100, H100/H200) to keep builds short.
  MAX_JOBS                parallel compile jobs (default 2).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0"


def _rel(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _toolkit_from_nvcc() -> str | None:
    """The toolkit folder of the nvcc on PATH. nvcc may be a wrapper script, so ask nvcc itself (its TOP)."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "-v", "--dryrun", "-c", "-x", "cu", os.devnull], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"TOP=(\S+)", out.stdout + out.stderr)
    if match:
        return os.path.realpath(match.group(1))
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def _is_toolkit(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h"))


def _find_cuda_home() -> str | None:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), _toolkit_from_nvcc(),
                      "/usr/local/cuda"):
        if _is_toolkit(candidate):
            return os.path.realpath(candidate)
    return None


def _want_cuda(torch_cuda: str | None) -> tuple[bool, str | None]:
    mode = os.environ.get("SPECDEC_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        sys.exit(f"SPECDEC_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False, None
    cuda_home = _find_cuda_home()
    problems = []
    if torch_cuda is None:
        problems.append("the installed torch is a CPU-only build (torch.version.cuda is None)")
    if cuda_home is None:
        problems.append("no CUDA toolkit found (set CUDA_HOME to the folder holding bin/nvcc, or put nvcc on PATH)")
    if problems:
        if mode == "1":
            sys.exit("SPECDEC_CUDA=1 but the CUDA kernels cannot be built: " + "; ".join(problems))
        print("specdec_ext: building CPU kernels only: " + "; ".join(problems), file=sys.stderr)
        return False, None
    return True, cuda_home


def _extensions():
    import torch

    with_cuda, cuda_home = _want_cuda(torch.version.cuda)
    if with_cuda:
        # cpp_extension reads CUDA_HOME when it is imported, so set it first.
        os.environ["CUDA_HOME"] = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    os.environ.setdefault("MAX_JOBS", "2")
    from torch.utils import cpp_extension

    sources = _rel("csrc/ops/*.cpp") + _rel("csrc/kernels/cpu/*.cpp")
    # -fno-trapping-math lets GCC if-convert the float selects in vocabulary loops (and so vectorise them); it
    # changes no results, only the assumption that comparisons may raise FP exceptions.
    cxx = ["-O3", "-fno-trapping-math", "-fopenmp", "-fvisibility=hidden"]
    define_macros = []
    kwargs = {}
    ext_cls = cpp_extension.CppExtension
    if with_cuda:
        cpp_extension.CUDA_HOME = cuda_home
        sources += _rel("csrc/ops/*.cu") + _rel("csrc/kernels/cuda/*.cu")
        define_macros.append(("SPECDEC_WITH_CUDA", "1"))
        kwargs["extra_compile_args"] = {"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr",
                                                             "-lineinfo"]}
        ext_cls = cpp_extension.CUDAExtension
        print(f"specdec_ext: building CPU + CUDA kernels (CUDA_HOME={cuda_home}, "
              f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})", file=sys.stderr)
    else:
        kwargs["extra_compile_args"] = {"cxx": cxx}
    return [ext_cls("specdec_ext._C", sources, define_macros=define_macros, extra_link_args=["-fopenmp"],
                    **kwargs)], cpp_extension.BuildExtension.with_options(use_ninja=True)


ext_modules, build_ext = _extensions()
setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
