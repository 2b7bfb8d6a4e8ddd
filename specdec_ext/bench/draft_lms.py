"""What the draft-LM benchmarks share (``benchmarks/python/bench_draft_lms.py``: speedups side by side;
``bench_draft_split.py``: where the loop's time goes): their command line and how draft directories become named
models."""

from __future__ import annotations

import argparse
import os

import torch

from specdec_ext.drafters.parallel_draft import parallel_draft_config
from specdec_ext.models.causal_lm import load_causal_lm
from specdec_ext.models.quantized import DRAFT_QUANT_SCHEMES

__all__ = ["add_draft_lm_args", "draft_names", "draft_quant", "load_draft"]


def add_draft_lm_args(ap: argparse.ArgumentParser) -> None:
    """The family, the draft directories and their weights, the rounds, the held-out prompts, the threads and the
    JSON output."""
    ap.add_argument("--zoo", default=None, help="family directory (default: the shipped family)")
    ap.add_argument("--drafts", nargs="+", required=True, help="draft LM / parallel draft directories")
    ap.add_argument("--draft-quant", choices=["none", *DRAFT_QUANT_SCHEMES], default="none",
                    help="the --drafts' weights (the family's own methods stay as they are)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")


def draft_quant(args: argparse.Namespace) -> str | None:
    """The drafters' ``draft_quant`` keyword for ``--draft-quant``."""
    return None if args.draft_quant == "none" else args.draft_quant


def draft_names(directories: list[str]) -> list[str]:
    """A name per directory: its folder's name, with its parent's where two share one."""
    base = [os.path.basename(os.path.normpath(d)) for d in directories]
    return [b if base.count(b) == 1 else os.path.join(os.path.basename(os.path.dirname(os.path.normpath(d))), b)
            for b, d in zip(base, directories)]


def load_draft(directory: str) -> tuple[torch.nn.Module, bool]:
    """The draft LM in ``directory`` (float32, eval mode) and whether it is a parallel draft (its config records a
    mask token)."""
    model = load_causal_lm(directory, torch.float32).eval()
    return model, parallel_draft_config(model.config) is not None
