#!/usr/bin/env bash
# Installs everything specdec_ext needs and builds it in place (editable), on a fresh machine or an old one.
#   - torch: kept when already installed (>= 2.4); otherwise torch==2.14.1 (on this project's machines a CUDA 13.0
#     build that pip takes from local disk).
#   - the extension: CUDA kernels when torch is a CUDA build and nvcc is found (SPECDEC_CUDA=auto|0|1 overrides).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c 'import torch, sys; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 4))' 2>/dev/null; then
  echo "== installing torch==2.14.1"
  "$PY" -m pip install -q torch==2.14.1
fi
# hypothesis pinned: the fuzz suite's derandomized examples depend on its version (the same CI examples everywhere)
"$PY" -m pip install -q "setuptools>=64" wheel ninja numpy pytest hypothesis==6.155.2 scipy matplotlib transformers==5.24.0

# CUDA_HOME: the toolkit that holds nvcc (nvcc on PATH may be a wrapper script, so ask nvcc for its TOP).
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  top=$(nvcc -v --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  if [ -n "$top" ]; then export CUDA_HOME=$(realpath "$top"); fi
fi

echo "== building specdec_ext (SPECDEC_CUDA=${SPECDEC_CUDA:-auto}${CUDA_HOME:+, CUDA_HOME=$CUDA_HOME})"
start=$(date +%s)
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" -c 'import specdec_ext, torch; print(f"specdec_ext built, CUDA kernels: {specdec_ext.built_with_cuda()}, torch {torch.__version__}")'
echo "== build took $(( $(date +%s) - start )) s"
