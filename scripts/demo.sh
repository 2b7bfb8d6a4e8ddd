#!/usr/bin/env bash
# The main job: set-up (scripts/setup.sh), then the demo. Extra arguments go to `specdec demo`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
source scripts/setup.sh
"$PY" -m specdec_ext demo "$@"
