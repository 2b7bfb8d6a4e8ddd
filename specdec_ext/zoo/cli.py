"""``specdec zoo build``: rebuild the model family (see :mod:`specdec_ext.zoo.build`)."""

from __future__ import annotations

import argparse

from specdec_ext.threads import add_threads_argument
from specdec_ext.zoo.spec import SPECS

__all__ = ["add_zoo_command"]


def zoo_build_cmd(args) -> int:
    from specdec_ext.zoo.build import build_zoo

    spec = SPECS["quick" if args.quick else args.spec]
    if args.seed is not None:
        from dataclasses import replace

        spec = replace(spec, seed=args.seed)
    build_zoo(args.out, spec, resume=args.resume, progress=not args.no_progress, corpus_root=args.corpus,
              target_only=args.target_only)
    return 0


def zoo_evaluate_cmd(args) -> int:
    from specdec_ext.zoo.build import reevaluate_family

    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    reevaluate_family(args.out, rounds=args.rounds)
    return 0


def add_zoo_command(sub) -> None:
    p = sub.add_parser("zoo", help="the small model family: rebuild it from the Python standard library")
    zsub = p.add_subparsers(dest="zoo_command", required=True)
    b = zsub.add_parser("build", help="train tokenizer, target, draft LM, Medusa, EAGLE-1 and EAGLE-3 (offline, CPU)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--out", required=True, help="output directory (the family layout; see specdec_ext/zoo/family.py)")
    b.add_argument("--quick", action="store_true", help="a tiny, barely trained family in seconds (tests, CI)")
    b.add_argument("--resume", action="store_true", help="skip finished stages, continue a stage from its checkpoint")
    b.add_argument("--spec", choices=[k for k in SPECS if k != "quick"], default="family",
                   help="what to build: the shipped family; the hybrid family (a MiniMax target, Lightning attention "
                   "layers beside softmax attention, with its own drafters; quick-hybrid: the same in seconds); or "
                   "the transfer target (a Qwen2 model unlike the family, trained on the other half of the corpus, "
                   "for measuring the training commands' defaults)")
    b.add_argument("--target-only", action="store_true",
                   help="only the tokenizer and target, plus the training / held-out texts as OUT/data/*.jsonl")
    b.add_argument("--corpus", default=None, help="directory of .py files (default: this Python's standard library)")
    b.add_argument("--seed", type=int, default=None)
    add_threads_argument(b)  # (applied by specdec's main, as for every command)
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=zoo_build_cmd)
    e = zsub.add_parser("evaluate", help="re-measure a built family with the current drafter shapes and code; rewrite "
                        "its card (evaluation, shapes, test floors); weights untouched",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("--out", required=True, help="the family directory (e.g. specdec_ext/zoo/family)")
    e.add_argument("--rounds", type=int, default=3,
                   help="timed rounds, round-robin over plain decoding and the drafters; the card's speedups are the "
                        "medians (its fastest drafter is `specdec serve --zoo`'s default)")
    add_threads_argument(e)
    e.set_defaults(func=zoo_evaluate_cmd)
