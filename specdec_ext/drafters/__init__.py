"""Drafters for :func:`specdec_ext.generate.generate`, behind one protocol (:mod:`specdec_ext.drafters.base`).

* :class:`NgramDrafter`: prompt lookup, no model.
* :class:`SuffixDrafter`: suffix decoding over the row's context and earlier requests' outputs, no model.
* :class:`DraftModelDrafter`: a smaller HF causal LM with the target's tokenizer (chain of k sampled drafts).
* :class:`ParallelDraftDrafter`: a parallel draft LM (PARD): every draft of a chain or tree from one forward.
* :class:`MedusaDrafter`: Medusa-1 heads on the target's last hidden state, static trees (:func:`static_tree`).
* :class:`EagleDrafter`: EAGLE-1 / EAGLE-3 draft networks, EAGLE-2 dynamic trees (or chains, or static trees).
* :class:`SelfSpecDrafter`: the target drafts for itself with some decoder layers skipped (chains, EAGLE-2 trees).
* :class:`EarlyExitDrafter`: the target's first layers, a trained adapter layer and the target's LM head draft
  (Kangaroo); a chain's verification then starts at the exit layer.
"""

from specdec_ext.drafters.base import (DecodeState, Drafter, DraftTree, SamplingParams, StepResult, check_vocab,
                                       pad_chains, pad_trees)
from specdec_ext.drafters.draft_model import DraftModelDrafter
from specdec_ext.drafters.eagle import EagleDrafter
from specdec_ext.drafters.early_exit import EarlyExitDrafter
from specdec_ext.drafters.medusa import MedusaDrafter
from specdec_ext.drafters.ngram import NgramDrafter, ngram_lookup
from specdec_ext.drafters.parallel_draft import ParallelDraftDrafter
from specdec_ext.drafters.self_spec import SelfSpecDrafter
from specdec_ext.drafters.suffix import SuffixDrafter
from specdec_ext.drafters.trees import MC_SIM_7B_63, StaticTree, static_tree
from specdec_ext.models.medusa import MedusaHeads  # (the network; here too for MedusaDrafter's users)

__all__ = ["DecodeState", "DraftModelDrafter", "DraftTree", "Drafter", "EagleDrafter", "EarlyExitDrafter",
           "MC_SIM_7B_63", "MedusaDrafter", "MedusaHeads", "NgramDrafter", "ParallelDraftDrafter", "SamplingParams",
           "SelfSpecDrafter", "StaticTree", "StepResult", "SuffixDrafter", "check_vocab", "ngram_lookup", "pad_chains",
           "pad_trees", "static_tree"]
