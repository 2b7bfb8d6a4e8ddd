"""Runs the fuzzing of some ops in this process, so that the pytest process survives a crash (test_fuzz_ops starts
it with ``python -m fuzz.worker``, ``python_tests`` on PYTHONPATH).

    python -m fuzz.worker --ops build_tree,compact_kv --examples 200 --report out.jsonl [--seed S] [--collect]
    python -m fuzz.worker --replay '<recipe JSON from a failure report>'

The report gets one JSON line per op: {"op", "examples", "answered", "refused", "meta", "failures": [...]}. Before
each example the recipe is written to ``<report>.current``: when the process dies (a signal, a sanitizer report), that
file names the example that killed it. Without ``--collect`` an op stops at its first failure, with the example's
mutations reduced to those the failure needs; with it, up to MAX_COLLECTED distinct failures per op are listed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import resource
import sys
import traceback
import zlib
from collections import Counter

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from fuzz.registry import SPECS
from fuzz.spec import Failure, check, recipes

MAX_COLLECTED = 25


def _signature(message: str) -> str:
    """A failure's kind: its first two lines with the numbers taken out."""
    head = " ".join(message.splitlines()[:2])
    return re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "#", head)


def _minimized(spec, recipe: dict, message: str, record) -> tuple[dict, str]:
    """The recipe with each mutation dropped that the same kind of failure does not need (``record``: called with
    each recipe tried, which may crash too)."""
    sig = _signature(message)
    for m in list(recipe["mutations"]):
        trial = {**recipe, "mutations": [x for x in recipe["mutations"] if x is not m]}
        record(trial)
        try:
            check(spec, trial)
        except Failure as err:
            if _signature(str(err)) == sig:
                recipe, message = trial, str(err)
        except Exception:  # noqa: BLE001  (another kind of failure: keep the mutation)
            pass
    return recipe, message


def run_op(name: str, examples: int, seed: int | None, current_path: str, collect: bool) -> dict:
    spec = SPECS[name]
    counts: Counter = Counter()
    failures: dict[str, str] = {}

    def record(recipe: dict) -> None:
        with open(current_path, "w") as f:
            f.write(json.dumps(recipe))

    @settings(max_examples=examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate], print_blob=False,
              report_multiple_bugs=False)
    @given(recipes(spec))
    def fuzz(recipe):
        record(recipe)
        try:
            counts[check(spec, recipe)] += 1
        except Failure as err:
            counts["failed"] += 1
            if not collect:
                raise
            sig = _signature(str(err))
            if sig not in failures and len(failures) < MAX_COLLECTED:
                failures[sig] = _minimized(spec, recipe, str(err), record)[1]

    # A fixed seed per op by default: the same examples every run (derandomize would derive them from this
    # function's source, so any edit of the harness would change them).
    fuzz = hypothesis_seed(zlib.crc32(name.encode()) if seed is None else seed)(fuzz)
    try:
        fuzz()
    except Failure as err:
        recipe = json.loads(open(current_path).read())
        failures[_signature(str(err))] = _minimized(spec, recipe, str(err), record)[1]
    except Exception:  # noqa: BLE001  (a bug of the fuzz harness itself: reported as this op's failure)
        failures["harness"] = (f"{name}: the fuzz harness failed on recipe {open(current_path).read()}\n"
                               f"{traceback.format_exc()}")
    return {"op": name, "examples": sum(counts.values()), "answered": counts["answered"],
            "refused": counts["refused"], "meta": counts["meta"], "failed": counts["failed"],
            "failures": list(failures.values())}


def _limit_memory() -> None:
    """An address-space limit (SPECDEC_FUZZ_MEMORY_GB, default 8), so that an example that allocates without bound
    gets an allocation error instead of the machine's memory. Not under AddressSanitizer, which reserves terabytes
    of address space for its shadow memory (scripts/asan.sh caps allocations with max_allocation_size_mb instead)."""
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        return
    limit = int(float(os.environ.get("SPECDEC_FUZZ_MEMORY_GB", "8")) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated op names (default: all)")
    p.add_argument("--examples", type=int, default=100, help="examples per op")
    p.add_argument("--seed", type=int, help="hypothesis seed (default: one per op, the same examples every run)")
    p.add_argument("--report", help="JSON-lines report file (default: stdout)")
    p.add_argument("--collect", action="store_true", help="keep going after a failure, list distinct failures")
    p.add_argument("--replay", help="run one recipe (JSON) and print its verdict")
    a = p.parse_args(argv)
    faulthandler.enable()  # a crash prints the Python stack of the example that caused it
    _limit_memory()
    if a.replay:
        recipe = json.loads(a.replay)
        print(check(SPECS[recipe["op"]], recipe))
        return 0
    names = a.ops.split(",") if a.ops else list(SPECS)
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        p.error(f"unknown ops {unknown}; known: {', '.join(SPECS)}")
    out = open(a.report, "a") if a.report else sys.stdout
    current = (a.report or "fuzz") + ".current"
    for name in names:
        out.write(json.dumps({"op": name, "event": "start"}) + "\n")
        out.flush()
        result = run_op(name, a.examples, a.seed, current, a.collect)
        out.write(json.dumps({**result, "event": "done"}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
