"""Drafters for :func:`specdec_ext.generate.generate`, behind one protocol (:mod:`specdec_ext.drafters.base`).

* :class:`NgramDrafter`: prompt lookup, no model.
* :class:`DraftModelDrafter`: a smaller HF causal LM with the target's tokenizer (chain of k sampled drafts).
"""

from specdec_ext.drafters.base import (DecodeState, Drafter, DraftTree, SamplingParams, StepResult, check_vocab,
                                       pad_chains)
from specdec_ext.drafters.draft_model import DraftModelDrafter
from specdec_ext.drafters.ngram import NgramDrafter, ngram_lookup

__all__ = ["DecodeState", "DraftModelDrafter", "DraftTree", "Drafter", "NgramDrafter", "SamplingParams",
           "StepResult", "check_vocab", "ngram_lookup", "pad_chains"]
