#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh), the C++ kernel tests (CMake + ctest), then the Python suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k verify`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
source scripts/setup.sh  # sourced: keeps its CUDA_HOME

echo "== C++ kernel tests (ctest)"
# CMake compiles the CUDA kernels too when it finds nvcc (point it at the real toolkit, not a wrapper script).
cuda_flag=-DSPECDEC_CUDA=ON
if [ "${SPECDEC_CUDA:-auto}" = 0 ]; then cuda_flag=-DSPECDEC_CUDA=OFF; fi
if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then export CUDACXX="$CUDA_HOME/bin/nvcc"; fi
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release "$cuda_flag" >/dev/null
cmake --build build/cmake -j2
ctest --test-dir build/cmake --output-on-failure

echo "== Python tests (pytest)"
"$PY" -m pytest python_tests -q "$@"
