"""Do the training commands' defaults transfer to a model nothing was tuned on? The whole experiment, end to end:

1. the transfer target (``specdec zoo build --spec transfer --target-only``: a Qwen2 model unlike the family —
   wider, shallower, 4:1 GQA, its own 6144-id tokenizer, RoPE base 1e6, 8k positions — trained by the zoo's target
   recipe on the other half of the corpus, then continued on 4096-token windows) and its training texts as a
   user's JSONL data;
2. every drafter trained on it by the ``specdec train-*`` commands with their defaults and a time budget only
   (``--minutes``), ``--jobs`` of them at a time, the machine's cores shared between them (``--jobs 1``: each
   drafter alone on all of them, as a user trains one);
3. the result laid out as a family (``OUT/target``, ``draft``, ``medusa``, ``eagle1``, ``eagle3``; ``card.json``
   with the library's CPU drafter shapes; ``transfer.json``: the commands, training times and reports) and measured
   by ``specdec bench --zoo OUT --suite e2e,context`` at batch 1 on the held-out files, plain decoding side by
   side: speed, and acceptance against context length (256 to 8000 tokens).

Nothing here is tuned on the transfer target: the flags below are the budget, the data, the output and threads.

    python benchmarks/python/bench_transfer.py --out /tmp/transfer [--minutes 25] [--jobs 1] [--results DIR]

Each finished stage leaves its output, and a rerun skips it (delete a member's folder to retrain it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# member folder -> the training command and its arguments (the defaults, nothing else)
DRAFTERS = {
    "eagle1": ["train-eagle"],
    "draft": ["train-draft"],
    "medusa": ["train-medusa"],
    "eagle3": ["train-eagle", "--version", "3"],
}


def _specdec(*args: str) -> list[str]:
    return [sys.executable, "-m", "specdec_ext", *args]


def _run_logged(cmd: list[str], log: str) -> subprocess.Popen:
    print(f"$ {' '.join(cmd[2:])}   (log: {log})", flush=True)
    with open(log, "w") as f:  # (the child keeps its own copy of the descriptor)
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)


def build_target(out: str, threads: int) -> None:
    """The target's stages; a rerun (``--resume``) skips the finished ones and rewrites the card."""
    os.makedirs(out, exist_ok=True)
    p = _run_logged(_specdec("zoo", "build", "--spec", "transfer", "--target-only", "--resume", "--out", out,
                             "--threads", str(threads), "--no-progress"), os.path.join(out, "build.log"))
    if p.wait():
        raise SystemExit(f"the target build failed; see {out}/build.log")


def job_threads(jobs: int) -> int:
    """Torch threads of each of ``jobs`` trainings run at once: the cores shared out."""
    return max(1, (os.cpu_count() or 1) // jobs)


def train_drafters(out: str, minutes: float, jobs: int, members: list[str]) -> dict:
    """Trains the missing ``members``, ``jobs`` at a time; returns each member's wall seconds (None: kept)."""
    data = os.path.join(out, "data", "train.jsonl")
    todo = [m for m in members if not os.path.isfile(os.path.join(out, m, "config.json"))]
    seconds: dict[str, float | None] = {m: None for m in members if m not in todo}
    running: list[tuple[str, subprocess.Popen, float]] = []
    while todo or running:
        while todo and len(running) < jobs:
            m = todo.pop(0)
            cmd = _specdec(*DRAFTERS[m], "--model", os.path.join(out, "target"), "--data", data, "--out",
                           os.path.join(out, m), "--minutes", str(minutes), "--threads", str(job_threads(jobs)),
                           "--no-progress")
            running.append((m, _run_logged(cmd, os.path.join(out, f"train_{m}.log")), time.perf_counter()))
        time.sleep(5)
        for item in list(running):
            m, p, t0 = item
            if p.poll() is not None:
                running.remove(item)
                if p.returncode:
                    raise SystemExit(f"training {m} failed; see {out}/train_{m}.log")
                seconds[m] = round(time.perf_counter() - t0, 1)
                print(f"{m}: trained in {seconds[m] / 60:.1f} min", flush=True)
    return seconds


def reports(out: str) -> dict:
    """Each member's end-of-training report (``drafter_report.json``), by member."""
    from specdec_ext.train.report import REPORT_FILE

    found = {}
    for m in DRAFTERS:
        path = os.path.join(out, m, REPORT_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                found[m] = json.load(f)
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="working directory (the transfer target and its drafters)")
    ap.add_argument("--minutes", type=float, default=25.0, help="each drafter's training budget (--minutes)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="drafters trained at once, sharing the cores (default 1: each alone on the machine)")
    ap.add_argument("--build-threads", type=int, default=2, help="threads of the target's training")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"),
                    help="where specdec bench writes its JSON")
    ap.add_argument("--name", default="transfer", help="the results file's name stem")
    ap.add_argument("--members", default=",".join(DRAFTERS),
                    help=f"the drafters to train now, comma-separated (default all: {','.join(DRAFTERS)})")
    ap.add_argument("--skip-bench", action="store_true", help="build and train only")
    ap.add_argument("--suites", default="e2e,context", help="specdec bench --suite (default e2e,context)")
    ap.add_argument("--context-lengths", default="256,1024,4096,8000",
                    help="the context sweep's prompt lengths (the target's long stage trains at 4096)")
    ap.add_argument("--context-prompts", type=int, default=4,
                    help="the context sweep's prompts per length (the held-out text holds 6 windows of 8000 tokens, "
                         "13 of 4096, one of them the warm-up's)")
    ap.add_argument("--context-new-tokens", type=int, default=64, help="the context sweep's tokens per generation")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    members = [m for m in args.members.split(",") if m]
    if not members or any(m not in DRAFTERS for m in members):
        ap.error(f"--members: comma-separated names of {', '.join(DRAFTERS)}, got {args.members!r}")
    t0 = time.perf_counter()
    build_target(out, args.build_threads)
    seconds = train_drafters(out, args.minutes, args.jobs, members)
    # the experiment's record beside the card (which a rerun of the build rewrites)
    record_file = os.path.join(out, "transfer.json")
    record = {"commands": {m: " ".join(c) for m, c in DRAFTERS.items()}, "trained": {}}
    if os.path.isfile(record_file):
        with open(record_file) as f:
            record = json.load(f)
    for m, s in seconds.items():
        if s is not None:
            record["trained"][m] = {"minutes": args.minutes, "jobs": args.jobs, "threads": job_threads(args.jobs),
                                    "wall_seconds": s}
    record["reports"] = reports(out)
    with open(record_file, "w") as f:
        json.dump(record, f, indent=1)
    print(f"built and trained in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    missing = [m for m in DRAFTERS if not os.path.isfile(os.path.join(out, m, "config.json"))]
    if args.skip_bench or missing:
        print(f"not measured: {'--skip-bench' if args.skip_bench else 'untrained ' + ', '.join(missing)}")
        return 0
    cmd = _specdec("bench", "--zoo", out, "--suite", args.suites, "--context-lengths", args.context_lengths,
                   "--context-prompts", str(args.context_prompts), "--context-new-tokens", str(args.context_new_tokens),
                   "--threads", "1", "--temperatures", "0", "--no-hf", "--out", args.results, "--name", args.name,
                   "--note", "transfer target (bench_transfer.py): drafters trained by the train-* defaults, "
                   f"--minutes {args.minutes:g} each")
    print(f"$ {' '.join(cmd[2:])}", flush=True)
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
