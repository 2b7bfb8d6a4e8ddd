#!/usr/bin/env bash
# One-shot GPU check for a lent machine (NVIDIA H200: torch + nvcc, no internet), run from the repository root:
#
#   OUT=/some/dir bash benchmarks/device_check.sh
#
# Stages (each time-limited; logs tee'd to $OUT, at most 8 files, no subfolders):
#   00_env.log        nvidia-smi, nvcc, torch, CPU
#   01_build.log      the extension built with CUDA (SPECDEC_CUDA=1, TORCH_CUDA_ARCH_LIST=9.0), and, in parallel,
#                     the CMake build of the kernels + C++ tests + C++ benchmarks (CUDA arch 90)
#   02_pytest.log     python -m pytest python_tests -q -k cuda
#   03_ctest.log      ctest (includes test_cuda_vs_cpu) + the C++ benchmarks (--quick), then bench_tree_attention and
#                     bench_compact_kv in full mode on the GPU (the tree-attention bandwidth and compaction goals), and
#                     bench_recurrent (the recurrent tree ops' CUDA kernels checked against the CPU ones, then timed)
#   04_pybench.log    Python benchmarks on CUDA (run_all.py --quick --device cuda) + device copy bandwidth
#   05_e2e.log        end-to-end decoding, random-weight ~1.1B Llama in bf16 (timing only), its JSON appended
#   bench.json        the benchmark results
#   summary.txt       one line per stage: ok / FAILED / skipped, with seconds
# Total budget: under 8 minutes (DEVICE_CHECK_BUDGET seconds, default 450); a stage that would not fit is skipped.
#
# Environment: OUT (default ./device_out), PYTHON (default python3), DEVICE_CHECK_SKIP_EXT_BUILD=1 (use the
# extension already importable instead of building it; for testing this script on a machine where the package
# must not be reinstalled), DEVICE_CHECK_JOBS (default: nproc).
set -u
set -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/device_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
JOBS=${DEVICE_CHECK_JOBS:-$(nproc 2>/dev/null || echo 4)}
BUDGET=${DEVICE_CHECK_BUDGET:-450}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
FAILED=0

elapsed() { echo $(($(date +%s) - START)); }
remaining() { echo $((BUDGET - $(elapsed))); }
record() {  # stage status seconds [note]
  printf '%-14s %-8s %4ss  %s\n' "$1" "$2" "$3" "${4:-}" | tee -a "$SUMMARY"
  [ "$2" = FAILED ] && FAILED=1
  return 0
}
# run_stage NAME LOG LIMIT_SECONDS COMMAND...: runs COMMAND under timeout (capped by the remaining budget),
# appending its output to LOG. Skips it when less than 20 s of the budget is left.
run_stage() {
  local name=$1 log=$2 limit=$3
  shift 3
  local left
  left=$(remaining)
  if [ "$left" -lt 20 ]; then
    record "$name" skipped 0 "no time left in the ${BUDGET}s budget"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local dt=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    record "$name" ok "$dt"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    record "$name" FAILED "$dt" "timed out after ${limit}s"
  else
    record "$name" FAILED "$dt" "exit code $rc"
  fi
  return "$rc"
}

# ---------------------------------------------------------------------------------------------------------------
# 00: environment.
ENV_LOG="$OUT/00_env.log"
{
  echo "date: $(date -Is)   host: $(uname -n)   repo: $ROOT   commit: $(git rev-parse --short HEAD 2>/dev/null)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)   cores: $(nproc)"
  if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi; else echo "nvidia-smi: not found"; fi
} 2>&1 | tee "$ENV_LOG"

NVCC=$(command -v nvcc || true)
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -n "$NVCC" ]; then
  # nvcc may be a wrapper script: ask it for its toolkit folder (TOP), else take the folder above bin/.
  TOP=$("$NVCC" -v --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/.*TOP=\([^ ]*\).*/\1/p' | head -1)
  if [ -n "$TOP" ] && [ -x "$TOP/bin/nvcc" ]; then CUDA_HOME=$(cd "$TOP" && pwd -P); else
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NVCC")")"); fi
  export CUDA_HOME
  export PATH="$CUDA_HOME/bin:$PATH"
  echo "CUDA_HOME=$CUDA_HOME" | tee -a "$ENV_LOG"
  "$CUDA_HOME/bin/nvcc" --version 2>&1 | tail -2 | tee -a "$ENV_LOG"
else
  echo "nvcc: not found" | tee -a "$ENV_LOG"
fi
"$PY" - <<'PYEOF' 2>&1 | tee -a "$ENV_LOG"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count, "mem GiB",
          round(p.total_memory / 2**30, 1))
PYEOF
HAVE_GPU=0
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then HAVE_GPU=1; fi
if [ "$HAVE_GPU" -eq 1 ]; then record env ok "$(elapsed)"; else
  record env FAILED "$(elapsed)" "no CUDA device visible to torch: GPU stages will fail or be skipped"; fi

# ---------------------------------------------------------------------------------------------------------------
# 01: build the extension with CUDA, and the CMake tree in parallel.
BUILD_LOG="$OUT/01_build.log"
CMAKE_DIR="$ROOT/build/cmake-device"
CMAKE_LOG="$ROOT/build/cmake-device.log"
mkdir -p "$ROOT/build"
if [ -n "$NVCC" ]; then CMAKE_CUDA=ON; else CMAKE_CUDA=OFF; fi
(
  timeout -k 10 300 bash -c "cmake -S '$ROOT' -B '$CMAKE_DIR' -G Ninja -DSPECDEC_CUDA=$CMAKE_CUDA \
      -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build '$CMAKE_DIR' -j $(( (JOBS + 1) / 2 ))"
  echo "cmake build exit code: $?"
) >"$CMAKE_LOG" 2>&1 &
CMAKE_PID=$!

if [ "${DEVICE_CHECK_SKIP_EXT_BUILD:-0}" = 1 ]; then
  record build_ext skipped 0 "DEVICE_CHECK_SKIP_EXT_BUILD=1: using the installed extension"
else
  build_ext() {
    export SPECDEC_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(( (JOBS + 1) / 2 ))
    "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . && return 0
    echo "pip install -e failed; trying setup.py build_ext --inplace"
    "$PY" setup.py build_ext --inplace
  }
  export -f build_ext
  export PY JOBS
  run_stage build_ext "$BUILD_LOG" 240 bash -c build_ext
fi
t0=$(date +%s)
left=$(remaining)
# Wait for the CMake build (bounded by the budget).
while kill -0 "$CMAKE_PID" 2>/dev/null && [ "$(remaining)" -gt 150 ]; do sleep 2; done
if kill -0 "$CMAKE_PID" 2>/dev/null; then kill -- "$CMAKE_PID" 2>/dev/null; fi
wait "$CMAKE_PID" 2>/dev/null
{ echo "=== cmake build (background)"; cat "$CMAKE_LOG"; } >>"$BUILD_LOG"
tail -5 "$CMAKE_LOG"
if grep -q "cmake build exit code: 0" "$CMAKE_LOG"; then record cmake_build ok "$(($(date +%s) - t0))" "waited"; else
  record cmake_build FAILED "$(($(date +%s) - t0))" "see 01_build.log"; fi
"$PY" -c 'import specdec_ext, torch; print("specdec_ext imported from", specdec_ext.__file__)' 2>&1 | tee -a "$BUILD_LOG"

# ---------------------------------------------------------------------------------------------------------------
# 02: CUDA pytest subset.
run_stage pytest_cuda "$OUT/02_pytest.log" 120 "$PY" -m pytest python_tests -q -k cuda -x -p no:cacheprovider \
  --no-header -rs

# ---------------------------------------------------------------------------------------------------------------
# 03: ctest (test_cuda_vs_cpu included) and the C++ benchmarks.
CTEST_LOG="$OUT/03_ctest.log"
if [ -d "$CMAKE_DIR" ]; then
  run_stage ctest "$CTEST_LOG" 90 ctest --test-dir "$CMAKE_DIR" --output-on-failure
  if [ "$HAVE_GPU" -eq 1 ] && [ -x "$CMAKE_DIR/test_cuda_vs_cpu" ]; then
    # Re-run the device test verbosely so the log shows it ran (ctest prints "Skipped" when it exits 77).
    run_stage cuda_vs_cpu "$CTEST_LOG" 60 "$CMAKE_DIR/test_cuda_vs_cpu"
  fi
  cpp_benches() {
    local rc=0
    for b in "$CMAKE_DIR"/bench_*; do
      [ -x "$b" ] || continue
      echo "--- $(basename "$b")"
      timeout -k 5 40 "$b" --quick || rc=1
    done
    return $rc
  }
  export -f cpp_benches
  export CMAKE_DIR
  run_stage cpp_bench "$CTEST_LOG" 100 bash -c cpp_benches
  # tree_attention and compact_kv on the GPU in full mode (the goal shapes: B=1, N=64, P=32k, bf16, GQA 32/8;
  # 32 layers compacted in one launch), CUDA timings only; bench_recurrent's CUDA kernels against its CPU ones.
  attn_benches() {
    local rc=0
    for b in bench_tree_attention bench_compact_kv bench_recurrent; do
      [ -x "$CMAKE_DIR/$b" ] || { echo "$b: not built"; rc=1; continue; }
      echo "--- $b (full, CUDA only)"
      timeout -k 5 40 "$CMAKE_DIR/$b" --no-cpu --repeats 20 || rc=1
    done
    return $rc
  }
  export -f attn_benches
  if [ "$HAVE_GPU" -eq 1 ]; then run_stage attn_bench "$CTEST_LOG" 90 bash -c attn_benches; fi
else
  record ctest skipped 0 "no CMake build"
fi

# ---------------------------------------------------------------------------------------------------------------
# 04: Python benchmarks on CUDA (+ copy bandwidth, measured by run_all.py).
if [ "$HAVE_GPU" -eq 1 ]; then
  run_stage py_bench "$OUT/04_pybench.log" 150 "$PY" benchmarks/python/run_all.py --quick --device cuda \
    --out "$OUT/bench.json"
else
  record py_bench skipped 0 "no GPU"
fi

# ---------------------------------------------------------------------------------------------------------------
# 05: end-to-end decoding on the GPU with a random-weight ~1.1B-parameter Llama in bf16 (specdec bench
# --random-model 1b): plain decoding vs each drafter vs HF assisted generation / prompt lookup. TIMING ONLY: random
# drafts are almost never accepted, so this measures step costs (plain step vs draft + tree verification) at a real
# model size, not speedups. The JSON is appended to the log (no extra file under $OUT).
E2E_LOG="$OUT/05_e2e.log"
if [ "$HAVE_GPU" -eq 1 ] && [ "$(remaining)" -ge 60 ]; then
  E2E_DIR="$ROOT/build/device-e2e"
  rm -rf "$E2E_DIR"
  run_stage e2e_1b "$E2E_LOG" 150 "$PY" -m specdec_ext.bench.cli --random-model 1b --device cuda --dtype bfloat16 \
    --suite e2e --temperatures 0 --num-prompts 2 --prompt-len 128 --max-new-tokens 64 --no-plots \
    --out "$E2E_DIR" --name e2e_random1b
  for f in "$E2E_DIR"/*.json; do
    [ -f "$f" ] && { echo "=== $(basename "$f")"; cat "$f"; } >>"$E2E_LOG"
  done
elif [ "$HAVE_GPU" -eq 1 ]; then
  record e2e_1b skipped 0 "less than 60 s of the ${BUDGET}s budget left"
else
  record e2e_1b skipped 0 "no GPU"
fi

echo "total $(elapsed)s (budget ${BUDGET}s)" | tee -a "$SUMMARY"
if [ "$HAVE_GPU" -ne 1 ]; then
  echo "device_check: no GPU visible: this run cannot validate the CUDA kernels" | tee -a "$SUMMARY"
  exit 3
fi
exit $FAILED
