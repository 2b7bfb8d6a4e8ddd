#!/usr/bin/env bash
# The CPU kernels under AddressSanitizer + UndefinedBehaviorSanitizer: builds the extension into build/asan (the
# in-place specdec_ext/_C*.so is not touched), runs the op tests and the fuzz suite against it, then builds the C++
# kernel tests (tests/cpp) the same way in build/asan-cmake and runs them with ctest. Clean or fail: any sanitizer
# report ends the run with a non-zero status.
#
#   bash scripts/asan.sh                               # op tests + fuzz (CI budget) + ctest
#   SPECDEC_FUZZ_EXAMPLES=2000 bash scripts/asan.sh    # a longer fuzz run
#   bash scripts/asan.sh -k compact_kv                 # extra arguments go to pytest
#   ASAN_SKIP_CPP=1 / ASAN_SKIP_PYTHON=1               # one half only
#
# Rebuilds are incremental (ninja). Needs gcc/g++ with libasan and libubsan (Debian: part of gcc).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=$ROOT/build/asan
# vptr checks compare type_info across shared objects, which -fvisibility=hidden makes unreliable.
SAN="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize=vptr -fno-sanitize-recover=all"
SAN="$SAN -fno-omit-frame-pointer -g"
# detect_leaks=0: the Python interpreter's own allocations look like leaks at exit.
# allocator_may_return_null=1, max_allocation_size_mb: an allocation beyond 8 GiB (a fuzz example with absurd sizes)
# raises torch's allocation error instead of taking the machine's memory.
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:max_allocation_size_mb=8192"
export ASAN_OPTIONS="$ASAN_OPTIONS:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:abort_on_error=1:halt_on_error=1"

OP_TESTS=(test_build_tree.py test_tree_ancestor_mask.py test_tree_bookkeeping.py test_verify_tree_greedy.py
          test_verify_tree_sampling.py test_verify_tree_typical.py test_sample_tokens.py test_expand_tree_step.py
          test_tree_attention.py test_compact_kv.py test_packed_linear.py test_draft_decoder_layer.py
          test_bad_input.py test_properties.py test_tiny_temperature.py test_opcheck.py fuzz)

status=0
if [ -z "${ASAN_SKIP_PYTHON:-}" ]; then
  echo "== building the extension with ${SAN%% *} in $OUT"
  start=$(date +%s)
  # The package there: links to the Python sources (always current) and the sanitizer build of _C.
  mkdir -p "$OUT/lib/specdec_ext"
  for entry in specdec_ext/*; do
    case "$(basename "$entry")" in _C*.so | __pycache__) continue ;; esac
    ln -sfn "$ROOT/$entry" "$OUT/lib/specdec_ext/$(basename "$entry")"
  done
  SPECDEC_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} CFLAGS="$SAN" LDFLAGS="$SAN" \
    "$PY" setup.py build_ext --build-lib "$OUT/lib" --build-temp "$OUT/temp"
  so=$(ls "$OUT"/lib/specdec_ext/_C*.so)
  [ "$(nm -D "$so" | grep -c __asan_report)" -gt 0 ] || { echo "asan.sh: $so is not instrumented" >&2; exit 1; }
  echo "== build took $(( $(date +%s) - start )) s"

  # libasan first; libstdc++ with it, or ASan finds no real __cxa_throw to forward C++ exceptions to (python itself
  # does not link libstdc++) and aborts on torch's first exception.
  preload="$(${CXX:-c++} -print-file-name=libasan.so) $(${CXX:-c++} -print-file-name=libstdc++.so)"
  # Run from build/asan: `python -m` puts the working directory first on sys.path, and the checkout root would
  # shadow PYTHONPATH with the in-place build.
  cd "$OUT"
  LD_PRELOAD="$preload" PYTHONPATH="$OUT/lib" "$PY" -c "import specdec_ext._C as c, sys
sys.exit(0 if c.__file__.startswith('$OUT/') else 'asan.sh: the tests would load ' + c.__file__)"
  echo "== op tests and fuzz suite under the sanitizers"
  start=$(date +%s)
  set +e
  LD_PRELOAD="$preload" PYTHONPATH="$OUT/lib" "$PY" -m pytest -q -rfE -p no:cacheprovider \
    "${OP_TESTS[@]/#/$ROOT/python_tests/}" "$@" 2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
  set -e
  cd "$ROOT"
  echo "== pytest under the sanitizers took $(( $(date +%s) - start )) s (exit status $rc)"
  if [ "$rc" != 0 ]; then status=1; fi
  if grep -qE "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer" "$OUT/pytest.log"; then
    echo "asan.sh: sanitizer reports in $OUT/pytest.log" >&2
    status=1
  fi
fi

if [ -z "${ASAN_SKIP_CPP:-}" ]; then
  echo "== C++ kernel tests (tests/cpp) with the sanitizers in build/asan-cmake"
  cmake -S . -B build/asan-cmake -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPECDEC_CUDA=OFF \
    -DSPECDEC_BENCHMARKS=OFF -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" >/dev/null
  cmake --build build/asan-cmake -j"${MAX_JOBS:-2}"
  ctest --test-dir build/asan-cmake --output-on-failure || status=1
fi

if [ "$status" = 0 ]; then echo "== asan.sh: clean"; else echo "== asan.sh: FAILED" >&2; fi
exit "$status"
