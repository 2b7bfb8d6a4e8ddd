#!/usr/bin/env bash
# Installs everything specdec_ext needs and builds it in place (editable), on a fresh machine or an old one.
#   - torch: kept when already installed (>= 2.4); otherwise torch==2.14.1 (on this project's machines a CUDA 13.0
#     build that pip takes from local disk).
#   - the extension: CUDA kernels when torch is a CUDA build and nvcc is found (SPECDEC_CUDA=auto|0|1 overrides).
# A second run only rebuilds what changed (build/ keeps the objects; ninja prints [n/m] while it compiles), so it
# takes seconds when nothing did. `rm -rf build` forces a full rebuild.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1  # the build's progress lines in order, as they come
# cmake and ninja that pip installs land next to this Python: found even when its environment is not activated.
PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"

# (versions from the installed metadata: importing torch just to read its version costs seconds)
if ! "$PY" -c 'import importlib.metadata as md, sys; sys.exit(tuple(map(int, md.version("torch").split(".")[:2])) < (2, 4))' 2>/dev/null; then
  echo "== installing torch==2.14.1"
  "$PY" -m pip install -q torch==2.14.1
fi

# Build and test tools; pip runs only when one is missing or off its pin (its own no-op check costs seconds).
# hypothesis pinned: the fuzz suite's fixed-seed examples depend on its version (the same CI examples everywhere)
# the server (specdec serve) and its tests: fastapi, uvicorn, prometheus-client; openai and httpx drive it
deps=("setuptools>=77" wheel ninja numpy pytest hypothesis==6.155.2 scipy matplotlib transformers==5.24.0
      fastapi==0.163.2 uvicorn==0.54.0 prometheus-client==0.26.0 openai==3.51.0 httpx==0.28.1)
if ! cmake --version 2>/dev/null | awk '/version/ { split($3, v, "."); ok = v[1] > 3 || (v[1] == 3 && v[2] >= 18) } END { exit !ok }'; then
  deps+=("cmake>=3.18")  # the kernels are built by CMake (setup.py); a system cmake >= 3.18 does as well
fi
if ! "$PY" - "${deps[@]}" <<'EOF'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:
    sys.exit(1)
for spec in sys.argv[1:]:
    req = Requirement(spec)
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if not req.specifier.contains(version, prereleases=True):
        sys.exit(1)
EOF
then
  echo "== installing build and test tools"
  "$PY" -m pip install -q "${deps[@]}"
fi

# CUDA_HOME: the toolkit that holds nvcc (nvcc on PATH may be a wrapper script, so ask nvcc for its TOP).
if [ "${SPECDEC_CUDA:-auto}" != 0 ] && [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  top=$(nvcc -v --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  if [ -n "$top" ]; then export CUDA_HOME=$(realpath "$top"); fi
fi

echo "== building specdec_ext (SPECDEC_CUDA=${SPECDEC_CUDA:-auto}${CUDA_HOME:+, CUDA_HOME=$CUDA_HOME})"
start=$(date +%s)
# torch's ninja prints each compile command in full: keep its [n/m] counter and the source file, pass the rest
# (warnings, errors) through unchanged.
"$PY" setup.py -q build_ext --inplace 2>&1 |
  sed -u -E "s#^(\[[0-9]+/[0-9]+\]) .* -c ([^ ]+) .*#\1 Building \2#; s#$PWD/##g"

# The editable install (importable from anywhere) is registered once; again when pyproject.toml changes.
if ! "$PY" - <<'EOF'
import importlib.metadata as md
import json
import os
import sys

try:
    dist = md.distribution("specdec_ext")
except md.PackageNotFoundError:
    sys.exit(1)
url = json.loads(dist.read_text("direct_url.json") or "{}")
here = os.path.realpath(".")
if not url.get("dir_info", {}).get("editable") or url.get("url") != "file://" + here:
    sys.exit(1)
metadata = [dist.locate_file(f) for f in dist.files or () if f.name == "METADATA"]
sys.exit(0 if metadata and os.path.getmtime(metadata[0]) >= os.path.getmtime("pyproject.toml") else 1)
EOF
then
  echo "== registering the editable install (pip install -e .)"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
fi
"$PY" -c 'import specdec_ext, torch; print(f"specdec_ext built, CUDA kernels: {specdec_ext.built_with_cuda()}, torch {torch.__version__}")'
echo "== build took $(( $(date +%s) - start )) s"
