"""Training Medusa heads, EAGLE-1/3 drafts and small draft LMs for a local target (CLI: ``specdec train-medusa``,
``specdec train-eagle``, ``specdec train-draft``), and the report of what a drafter will give
(``specdec evaluate-drafter``: :mod:`specdec_ext.train.report`)."""

from specdec_ext.train.data import DataError, load_corpus, self_distill, split_heldout
from specdec_ext.train.draft_lm import train_draft_lm
from specdec_ext.train.eagle import train_eagle
from specdec_ext.train.loop import TrainConfig, TrainResult, evaluate_acceptance, train_loop
from specdec_ext.train.medusa import train_medusa

__all__ = ["DataError", "TrainConfig", "TrainResult", "evaluate_acceptance", "load_corpus", "self_distill",
           "split_heldout", "train_draft_lm", "train_eagle", "train_loop", "train_medusa"]
