"""Fuzzing every op: each example gives a clear argument error or the reference's answer (fuzz.spec.check).

The ops run in a worker process (fuzz.worker), so that a crash (a signal, a sanitizer report) or a hang fails the
op's test, naming the example, instead of ending the test run; after a crash the worker restarts for the remaining
ops. Examples come from a fixed seed per op: every run tries the same ones.

    SPECDEC_FUZZ_EXAMPLES=20000 python -m pytest python_tests/fuzz -q       # the long run (default: CI_EXAMPLES)
    SPECDEC_FUZZ_SEED=7 ...                                                 # other examples than the fixed ones
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.registry import SPECS

CI_EXAMPLES = 60
EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", CI_EXAMPLES))
SEED = os.environ.get("SPECDEC_FUZZ_SEED")
TESTS_DIR = Path(__file__).resolve().parent.parent


def _worker(ops: list[str], report: Path, module: str, examples: int, path: list[str]) -> tuple[int | None, str]:
    """Runs the worker over ``ops`` (the report gets a line per op); returns (exit code or None on a hang, output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path + [str(TESTS_DIR)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", module, "--ops", ",".join(ops), "--examples", str(examples),
           "--report", str(report)] + (["--seed", SEED] if SEED else [])
    # cwd: the tests folder, so that `python -m` puts no checkout root (and its in-place build) on sys.path ahead
    # of PYTHONPATH (scripts/asan.sh points PYTHONPATH at the sanitizer build)
    proc = subprocess.Popen(cmd, cwd=TESTS_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # a hang: far beyond the slowest examples (the reference is plain Python; a sanitizer build is ~3x slower)
        out, _ = proc.communicate(timeout=(120 + 2.0 * examples) * len(ops))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return None, out


def _excerpt(out: str) -> str:
    """What a crash printed: the sanitizer's report (its first lines: the error and the kernel frames) and the
    Python stack (faulthandler), else the output's end."""
    lines = out.splitlines()
    keep = []
    for mark, n in ((r"ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer", 16),
                    (r"^Current thread|^Thread 0x", 10)):
        at = next((i for i, line in enumerate(lines) if re.search(mark, line)), None)
        if at is not None:
            keep += lines[at:at + n] + ["..."]
    return "\n".join(line[:300] for line in keep) if keep else out[-6000:]


def _events(report: Path) -> list[dict]:
    if not report.exists():
        return []
    return [json.loads(line) for line in report.read_text().splitlines() if line.strip()]


def run_fuzz(ops: list[str], folder: Path, module: str = "fuzz.worker", examples: int = EXAMPLES,
             path: list[str] = ()) -> dict[str, dict]:
    """Each op's result: the worker's summary, or {"crash": how, "recipe": ..., "output": ...}. ``module`` is the
    worker to run (``python -m``), ``path`` more PYTHONPATH entries."""
    results: dict[str, dict] = {}
    remaining = list(ops)
    for attempt in range(len(ops)):
        if not remaining:
            break
        report = folder / f"report{attempt}.jsonl"
        rc, out = _worker(remaining, report, module, examples, list(path))
        events = _events(report)
        for e in events:
            if e["event"] == "done":
                results[e["op"]] = e
        started = [e["op"] for e in events if e["event"] == "start" and e["op"] not in results]
        if rc != 0 or started:
            victim = started[0] if started else remaining[0]
            current = Path(f"{report}.current")
            how = "hung (killed after the timeout)" if rc is None else (
                f"crashed ({signal.Signals(-rc).name})" if rc < 0 else f"exited with status {rc}")
            results[victim] = {"crash": how, "recipe": current.read_text() if current.exists() else "(none)",
                               "output": _excerpt(out)}
        remaining = [op for op in remaining if op not in results]
    return results


@pytest.fixture(scope="module")
def fuzz_results(request, tmp_path_factory) -> dict[str, dict]:
    """One worker run for every fuzz test of this session (one process start, not one per op)."""
    ops = [item.callspec.params["op"] for item in request.session.items
           if item.module is request.module and hasattr(item, "callspec") and "op" in item.callspec.params]
    return run_fuzz(ops, tmp_path_factory.mktemp("fuzz"))


@pytest.mark.parametrize("op", list(SPECS))
def test_fuzz(op, fuzz_results):
    result = fuzz_results[op]
    if "crash" in result:
        pytest.fail(f"{op}: the worker {result['crash']} on the example (recipe; replay it with `cd python_tests && "
                    f"python -m fuzz.worker --replay '<recipe>'`):\n{result['recipe']}\n--- output ---\n"
                    f"{result['output']}", pytrace=False)
    if result["failures"]:
        pytest.fail("\n\n".join(result["failures"]), pytrace=False)
    # The fuzzing must reach the kernels' answers, not only their refusals.
    assert result["answered"] >= result["examples"] // 5, (
        f"{op}: only {result['answered']} of {result['examples']} examples were answered (refused "
        f"{result['refused']}, meta {result['meta']})")


CRASHING_WORKER = """
import os, sys
from fuzz import worker
from fuzz.registry import SPECS
spec = SPECS["build_tree"]
spec.raw = spec.wrapper = lambda args, validate: os.abort()  # as a segfault or a sanitizer report would
sys.exit(worker.main())
"""


def test_a_crash_fails_its_op_and_the_others_still_run(tmp_path):
    (tmp_path / "crashing_worker.py").write_text(CRASHING_WORKER)
    results = run_fuzz(["tree_ancestor_mask", "build_tree", "pack_linear_weight"], tmp_path,
                       module="crashing_worker", examples=5, path=[str(tmp_path)])
    assert results["build_tree"]["crash"] == "crashed (SIGABRT)"
    assert json.loads(results["build_tree"]["recipe"])["op"] == "build_tree"  # the example that killed it
    assert "crashing_worker.py" in results["build_tree"]["output"]  # the Python stack of the crash (faulthandler)
    for op in ("tree_ancestor_mask", "pack_linear_weight"):  # before the crash, and after the restart
        assert "crash" not in results[op] and results[op]["examples"] >= 1
