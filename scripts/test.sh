#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh), the C++ kernel tests (CMake + ctest), then the Python suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k verify`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
source scripts/setup.sh  # sourced: keeps its PATH and CUDA_HOME

echo "== C++ kernel tests (ctest)"
# setup.sh configured build/cmake and compiled the kernel libraries there (CUDA ones too when it built them): only
# the tests and benchmarks compile now.
cmake --build build/cmake -j"${MAX_JOBS:-2}"
ctest --test-dir build/cmake --output-on-failure

echo "== Python tests (pytest)"
"$PY" -m pytest python_tests -q "$@"
