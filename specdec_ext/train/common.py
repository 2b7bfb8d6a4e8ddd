"""Shared helpers: target preparation, features, tokenizer loading."""

from __future__ import annotations

import copy
import os

import torch

__all__ = ["freeze", "target_hidden", "load_tokenizer", "first_param", "in_target_dtype"]


def first_param(module):
    return next(p for p in module.parameters() if p.is_floating_point())


def in_target_dtype(module, target):
    """``module`` (trained in float32) in the target's dtype for decoding: itself, or a copy in that dtype."""
    dt = first_param(target).dtype
    return module if first_param(module).dtype == dt else copy.deepcopy(module).to(dt)


def freeze(target):
    target.requires_grad_(False)
    return target.eval()


@torch.no_grad()
def target_hidden(target, toks: torch.Tensor, mask: torch.Tensor, layers=(-1,)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features[B, T, len(layers) * H], logits[B, T, V])`` of the frozen target (float32)."""
    out = target(input_ids=toks, attention_mask=mask.long(), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in layers], -1).float()
    return feats, out.logits.float()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path):
    """The tokenizer saved with the model in ``path``; None when there is none (token-id data only). A tokenizer
    that is there but cannot be loaded is an error naming the folder (not silently "no tokenizer")."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - any failure of transformers' tokenizer loading
        present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
        if present:
            raise ValueError(f"{path!r} holds a tokenizer ({', '.join(present)}) that cannot be loaded: "
                             f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
        return None
