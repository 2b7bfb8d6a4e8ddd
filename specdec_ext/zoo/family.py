"""Loading the small model family (the one shipped in the repository, or one rebuilt by ``specdec zoo build``).

Layout of a family directory (every member in its official format)::

    target/   Llama causal LM (the hybrid family: MiniMax) + tokenizer (save_pretrained; bf16 safetensors)
    draft/    small Llama draft LM distilled from the target + the same tokenizer
    parallel_draft/  that draft LM adapted to draft several tokens in one forward (PARD; a mask token in its config;
              families built before it have none)
    medusa/   Medusa-1 heads sharing the target's lm_head (config.json + medusa_lm_head.safetensors)
    eagle1/   EAGLE-1 draft (config.json + model.safetensors) and draft_vocab.json (the ids its drafts use)
    eagle3/   EAGLE-3 draft with a reduced vocabulary (d2t / t2d)
    early_exit/  the early-exit adapter of self-speculation (config.json + adapter.safetensors, draft_vocab.json;
              attention targets only, families built before it have none)
    card.json the model card's data: corpus, sizes, training, losses, accepted lengths and their test floors
    README.md the model card
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch

from specdec_ext.models.safe_files import read_json
from specdec_ext.models.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab
from specdec_ext.drafters.shapes import CPU_SHAPES, DRAFTER_NAMES

__all__ = ["Family", "family_dir", "load_family", "make_drafter", "SHIPPED_DIR", "SHIPPED_HYBRID_DIR"]

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "family")
# the hybrid member (a MiniMax target: Lightning layers beside softmax attention) with its own drafters, in the
# same layout (`specdec zoo build --spec hybrid`)
SHIPPED_HYBRID_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hybrid")


def family_dir(path: str | os.PathLike | None = None) -> str:
    """``path``, else ``$SPECDEC_ZOO``, else the family shipped with the package."""
    return os.fspath(path or os.environ.get("SPECDEC_ZOO") or SHIPPED_DIR)


@dataclass
class Family:
    """The loaded family; :meth:`make_drafter` gives a fresh drafter (drafters hold per-generation state)."""

    path: str
    target: torch.nn.Module
    tokenizer: object
    draft_lm: torch.nn.Module
    medusa_heads: torch.nn.Module
    eagle1: torch.nn.Module
    eagle3: torch.nn.Module
    card: dict = field(default_factory=dict)
    parallel_draft: torch.nn.Module | None = None  # (None: a family built before the member existed)
    early_exit: torch.nn.Module | None = None  # (None: likewise, or a hybrid target)

    @property
    def drafter_names(self) -> tuple[str, ...]:
        """The drafters this family has: every one of ``DRAFTER_NAMES``, less those whose member is missing (the
        parallel draft, the early-exit adapter)."""
        missing = {"parallel-draft": self.parallel_draft is None, "early-exit": self.early_exit is None}
        return tuple(n for n in DRAFTER_NAMES if not missing.get(n, False))

    def drafter_kwargs(self, name: str) -> dict:
        shapes = {**CPU_SHAPES, **(self.card.get("spec", {}).get("drafters") or {})}
        if name not in shapes or name not in self.drafter_names:
            raise ValueError(f"unknown drafter {name!r}; the family has {', '.join(self.drafter_names)}")
        return dict(shapes[name])

    def make_drafter(self, name: str, **overrides):
        return make_drafter(self, name, **overrides)


def make_drafter(family: Family, name: str, **overrides):
    """A fresh drafter ``name`` (one of ``DRAFTER_NAMES``) with the family's shapes, ``overrides`` applied."""
    from specdec_ext.drafters import (DraftModelDrafter, EagleDrafter, EarlyExitDrafter, MedusaDrafter, NgramDrafter,
                                      ParallelDraftDrafter, SuffixDrafter)

    kw = {**family.drafter_kwargs(name), **overrides}

    def own(network):  # a quantised drafter changes its network in place: not the family's shared one
        return copy.deepcopy(network) if kw.get("draft_quant") else network

    if name == "ngram":
        return NgramDrafter(**kw)
    if name == "suffix":
        return SuffixDrafter(**kw)
    if name == "draft-model":
        return DraftModelDrafter(own(family.draft_lm), **kw)
    if name == "parallel-draft":
        return ParallelDraftDrafter(own(family.parallel_draft), **kw)
    if name == "medusa":
        return MedusaDrafter(own(family.medusa_heads), **kw)
    if name == "early-exit":
        kw.setdefault("draft_vocab", read_draft_vocab(os.path.join(family.path, "early_exit"), "make_drafter"))
        return EarlyExitDrafter(own(family.early_exit), **kw)
    if name in ("eagle1", "eagle2"):
        eagle1_dir = os.path.join(family.path, "eagle1")
        if kw.get("draft_vocab") == "frequent" and not os.path.isfile(os.path.join(eagle1_dir, DRAFT_VOCAB_FILE)):
            kw["draft_vocab"] = "eagle3"  # (a family built before the file existed)
        if kw.get("draft_vocab") == "frequent":  # the training data's most frequent ids (zoo build, FR-Spec)
            kw["draft_vocab"] = read_draft_vocab(eagle1_dir, "make_drafter")
        elif kw.get("draft_vocab") == "eagle3":  # the EAGLE-3 draft's vocabulary: also frequent ids, 2048 of them
            e3 = family.eagle3
            kw["draft_vocab"] = e3.to_target_ids(torch.arange(e3.draft_vocab_size, device=e3.fc.weight.device))
        return EagleDrafter(own(family.eagle1), target=family.target, **kw)
    return EagleDrafter(own(family.eagle3), target=family.target, **kw)


def _require(path: str, what: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_family: {path!r} is missing ({what}); rebuild the family with "
                                "`specdec zoo build --out DIR` and point SPECDEC_ZOO (or path=) at DIR")


def load_family(path: str | os.PathLike | None = None, device: torch.device | str = "cpu",
                dtype: torch.dtype | str = torch.float32, packed_linears: bool = True,
                eagle_dtype: torch.dtype | str | None = None) -> Family:
    """The family in ``path`` (default: :func:`family_dir`) on ``device`` in ``dtype`` (the files are bf16;
    float32 is the fast choice on CPUs without bf16 matrix units). ``packed_linears``: prepare the target and the
    draft LM with :func:`~specdec_ext.models.fast_linear.pack_linears`, so that :func:`specdec_ext.generate`
    multiplies with packed weights (plain and speculative decoding alike; memory: a copy of their weights).
    ``eagle_dtype``: the EAGLE drafts' dtype
    (:func:`~specdec_ext.models.checkpoints.resolve_eagle_dtype`; default the target's). Their files are
    bfloat16, so bfloat16 drafts keep their exact weights and read half the bytes of float32 ones at every draft
    level: with a float32 target on a CPU with AVX512-BF16, EAGLE-2 steps are ~8% and EAGLE-3 steps ~15% shorter
    (``"auto"`` picks that). Only the drafts' proposals change; the output is the target's."""
    from transformers import AutoTokenizer

    from specdec_ext.models.causal_lm import load_causal_lm
    from specdec_ext.models.checkpoints import load_eagle, load_medusa, resolve_eagle_dtype
    from specdec_ext.models.early_exit import load_early_exit
    from specdec_ext.models.fast_linear import pack_linears

    root = family_dir(path)
    _require(root, "the family directory")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    eagle_dtype = resolve_eagle_dtype(eagle_dtype, dtype, device)  # (a bad value fails before anything loads)
    for member in ("target", "draft", "medusa", "eagle1", "eagle3"):
        _require(os.path.join(root, member), f"the {member} member")
    target = load_causal_lm(os.path.join(root, "target"), dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "target"), local_files_only=True)
    draft = load_causal_lm(os.path.join(root, "draft"), dtype).to(device).eval()
    pdir = os.path.join(root, "parallel_draft")
    parallel = load_causal_lm(pdir, dtype).to(device).eval() if os.path.isdir(pdir) else None
    if packed_linears:
        for model in (target, draft, parallel):
            if model is not None:
                pack_linears(model)
    medusa = load_medusa(os.path.join(root, "medusa"), target=target)
    eagle1 = load_eagle(os.path.join(root, "eagle1"), target=target, dtype=eagle_dtype)
    eagle3 = load_eagle(os.path.join(root, "eagle3"), target=target, dtype=eagle_dtype)
    edir = os.path.join(root, "early_exit")
    early_exit = load_early_exit(edir, target=target) if os.path.isdir(edir) else None
    card_file = os.path.join(root, "card.json")
    card = read_json(card_file, "load_family") if os.path.isfile(card_file) else {}
    return Family(root, target, tokenizer, draft, medusa, eagle1, eagle3, card, parallel, early_exit)
