"""End-to-end benchmark (a thin wrapper over ``specdec bench``): plain decoding vs every drafter vs Hugging Face
assisted generation and prompt lookup, plus the context-length sweep, on the project's model family.

    python benchmarks/python/bench_e2e.py            # results: benchmarks/results/e2e_<machine>.json + PNGs
    python benchmarks/python/bench_e2e.py --quick    # small settings
    python benchmarks/python/bench_e2e.py --model DIR --draft-model DIR --suite e2e

Every ``specdec bench`` option is accepted (``--help``); defaults here: ``--suite e2e,context``, ``--name e2e``,
``--out benchmarks/results``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    from specdec_ext.bench.cli import main as bench_main

    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {a.split("=", 1)[0] for a in argv}
    if "--suite" not in flags:
        argv += ["--suite", "e2e,context"]
    if "--name" not in flags:
        argv += ["--name", "e2e"]
    if "--out" not in flags:
        argv += ["--out", os.path.join(ROOT, "benchmarks", "results")]
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
