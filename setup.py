"""Builds specdec_ext._C: the torch-free kernels (csrc/kernels) as CMake static libraries in build/cmake (the folder
scripts/test.sh builds the C++ tests in, so each kernel compiles once), then the torch glue (csrc/ops) with torch's
cpp_extension (ninja), linked with them.

Install against the torch you already have:   pip install --no-build-isolation .   (or -e .)
Rebuild in place after a change (what scripts/setup.sh runs):   python setup.py build_ext --inplace

Builds are incremental: the kernels' objects stay in build/cmake and the glue's in build/temp-cpu or
build/temp-cuda (with --build-temp DIR: both in DIR), and ninja recompiles only what a changed source, header or flag
touches (pip's own temporary build folder is not used). The extension is relinked on every build (seconds).

Environment:
  SPECDEC_CUDA=auto|0|1   auto (default): build the CUDA kernels when torch is a CUDA build and a CUDA toolkit
                          (nvcc) is found; whether a GPU is present does not matter. 0: CPU only. 1: CUDA required
                          (fails with a clear message when the toolchain is missing).
  CUDA_HOME               the toolkit folder (holding bin/nvcc); found from nvcc on PATH when unset.
  TORCH_CUDA_ARCH_LIST    GPU architectures; default "8.0;9.0" (A100, H100/H200) to keep builds short.
  MAX_JOBS                parallel compile jobs (default 2).
  CFLAGS, CPPFLAGS        extra compile flags for the glue (setuptools) and the kernels (passed to CMake as
                          CMAKE_CXX_FLAGS), e.g. -fsanitize=address; LDFLAGS also links the C++ tests.
  cmake >= 3.18 is needed (pip install cmake where the system has none).
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_DIR = os.path.join(ROOT, "build")
CMAKE_DIR = os.path.join(BUILD_DIR, "cmake")  # scripts/test.sh builds and runs the C++ tests here
DEFAULT_ARCH_LIST = "8.0;9.0"
MIN_CMAKE = (3, 18)


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


def _cmake_architectures(torch_arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0", "9.0+PTX", "9.0a") as CMAKE_CUDA_ARCHITECTURES ("80-real;90-real", "90",
    "90a-real"): machine code for each, PTX only where +PTX asks for it, as torch's own flags do."""
    archs = []
    for item in re.split(r"[;\s]+", torch_arch_list.strip()):
        if not item:
            continue
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", item)
        if not match:
            sys.exit(f"TORCH_CUDA_ARCH_LIST: expected versions such as 8.0;9.0 or 9.0+PTX, got {item!r}")
        arch = match[1] + match[2] + match[3]
        archs.append(arch if match[4] else f"{arch}-real")
    if not archs:
        sys.exit(f"TORCH_CUDA_ARCH_LIST is empty ({torch_arch_list!r}); unset it for the default {DEFAULT_ARCH_LIST}")
    return ";".join(archs)


def _cmake() -> str:
    cmake = shutil.which("cmake")
    version = None
    if cmake:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
        match = re.search(r"version (\d+)\.(\d+)", out)
        version = (int(match[1]), int(match[2])) if match else None
    if version is None or version < MIN_CMAKE:
        found = f"found {cmake} {version}" if cmake else "none on PATH"
        sys.exit(f"specdec_ext needs cmake >= {'.'.join(map(str, MIN_CMAKE))} to build its kernels ({found}): "
                 "pip install 'cmake>=3.18'")
    return cmake


def _build_kernel_libraries(cmake_dir: str, with_cuda: bool, cuda_home: str | None) -> list[str]:
    """Configures cmake_dir and builds the kernel libraries there; returns them in link order (CUDA first)."""
    cmake = _cmake()
    extra_cxx = " ".join(os.environ.get(v, "") for v in ("CPPFLAGS", "CFLAGS")).strip()
    configure = [cmake, "-S", ROOT, "-B", cmake_dir, "-G", "Ninja", "--log-level=WARNING",
                 "-DCMAKE_BUILD_TYPE=Release", f"-DSPECDEC_CUDA={'ON' if with_cuda else 'OFF'}",
                 f"-DCMAKE_CXX_FLAGS={extra_cxx}", f"-DCMAKE_EXE_LINKER_FLAGS={os.environ.get('LDFLAGS', '')}"]
    targets = ["specdec_kernels_cpu"]
    if with_cuda:
        configure += [f"-DCMAKE_CUDA_COMPILER={os.path.join(cuda_home, 'bin', 'nvcc')}",
                      f"-DCMAKE_CUDA_ARCHITECTURES={_cmake_architectures(os.environ['TORCH_CUDA_ARCH_LIST'])}"]
        targets.insert(0, "specdec_kernels_cuda")
    print(f"specdec_ext: kernels ({', '.join(targets)}) in {os.path.relpath(cmake_dir, ROOT)}", flush=True)
    build = [cmake, "--build", cmake_dir, "-j", os.environ["MAX_JOBS"], "--target", *targets]
    for step, quiet in ((configure, True), (build, False)):
        # configure's status lines are noise on every rebuild; its warnings and errors go to stderr
        if subprocess.run(step, stdout=subprocess.DEVNULL if quiet else None).returncode:
            sys.exit(f"specdec_ext: the kernels' CMake build failed (above): {' '.join(step)}")
    return [os.path.join(cmake_dir, f"lib{t}.a") for t in targets]


def _extensions():
    import torch

    with_cuda, cuda_home = _want_cuda(torch.version.cuda)
    if with_cuda:
        # cpp_extension reads CUDA_HOME when it is imported, so set it first.
        os.environ["CUDA_HOME"] = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    os.environ.setdefault("MAX_JOBS", "2")
    # cmake and ninja installed by pip into this Python's environment are found without activating it.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    sources = _rel("csrc/ops/*.cpp")  # the glue; the kernels' flags live in CMakeLists.txt
    cxx = ["-O3", "-fopenmp", "-fvisibility=hidden"]
    define_macros = []
    kwargs = {}
    ext_cls = cpp_extension.CppExtension
    if with_cuda:
        cpp_extension.CUDA_HOME = cuda_home
        sources += _rel("csrc/ops/*.cu")
        define_macros.append(("SPECDEC_WITH_CUDA", "1"))
        kwargs["extra_compile_args"] = {"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr",
                                                             "-lineinfo"]}
        ext_cls = cpp_extension.CUDAExtension
        print(f"specdec_ext: building CPU + CUDA kernels (CUDA_HOME={cuda_home}, "
              f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})", file=sys.stderr)
    else:
        kwargs["extra_compile_args"] = {"cxx": cxx}
    ext = ext_cls("specdec_ext._C", sources, define_macros=define_macros, extra_link_args=["-fopenmp"], **kwargs)

    class BuildKernelsAndExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        """The kernel libraries first (CMake), then the glue and the link, in persistent folders under build/."""

        def finalize_options(self):
            explicit = self.build_temp is not None  # --build-temp (scripts/asan.sh): its own kernels there too
            super().finalize_options()
            if explicit:
                self.build_temp = os.path.abspath(self.build_temp)
                self.kernels_dir = os.path.join(self.build_temp, "kernels")
            else:
                # A fixed folder (not pip's temporary one) lets ninja skip what is up to date; one per configuration
                # so that switching SPECDEC_CUDA keeps both.
                self.build_temp = os.path.join(BUILD_DIR, "temp-cuda" if with_cuda else "temp-cpu")
                self.kernels_dir = CMAKE_DIR
            self.force = True  # always ask ninja and relink: setuptools' mtime check sees neither headers nor flags

        def run(self):
            # Builds into one folder wait for each other (another shell, pip) instead of racing ninja there.
            os.makedirs(os.path.dirname(self.kernels_dir), exist_ok=True)
            with open(self.kernels_dir + ".lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    print(f"specdec_ext: waiting for another build in {self.kernels_dir}", flush=True)
                    fcntl.flock(lock, fcntl.LOCK_EX)
                super().run()

        def build_extensions(self):
            ext.extra_objects = _build_kernel_libraries(self.kernels_dir, with_cuda, cuda_home)
            super().build_extensions()

        def copy_file(self, infile, outfile, *args, **kwargs):
            # The in-place copy is a rename: processes that have the old extension loaded keep a valid file.
            if os.path.isdir(outfile):
                outfile = os.path.join(outfile, os.path.basename(infile))
            tmp = f"{outfile}.tmp{os.getpid()}"
            shutil.copy2(infile, tmp)
            os.replace(tmp, outfile)
            return outfile, True

    return [ext], BuildKernelsAndExtension


ext_modules, build_ext = _extensions()
setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
