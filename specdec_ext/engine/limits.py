"""What a request may ask of a target, checked in one place for the engine and for ``generate``: the target itself,
token ids inside the vocabulary, the target's EOS ids, and the positions a prompt and its budget need. Each check takes ``where``,
the name its ``ValueError`` starts with (``"add_request"``, ``"Engine"``, ``"generate"``).
"""

from __future__ import annotations

import numbers

import torch

from specdec_ext.models.config import text_config

__all__ = ["check_id_tensor", "check_positions", "check_target", "check_token_ids", "eos_token_ids", "is_int"]


def is_int(value) -> bool:
    """An integer that is not a bool (Python or NumPy)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_id_tensor(where: str, what: str, t: torch.Tensor) -> None:
    """``t`` (named ``what``) holds integers: token ids may not be floats, complex numbers or bools."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{where}: {what} must hold integer token ids (e.g. torch.int64), got a tensor of dtype "
                         f"{t.dtype}")


def check_target(where: str, target) -> None:
    """``target`` is a Hugging Face causal LM: a ``torch.nn.Module`` with a config."""
    if not isinstance(target, torch.nn.Module) or getattr(target, "config", None) is None:
        raise ValueError(f"{where}: target must be a Hugging Face causal LM (a torch.nn.Module with a config), got "
                         f"{type(target).__name__}")


def check_token_ids(where: str, what: str, ids: list[int], vocab_size: int) -> None:
    """Every id of ``ids`` (named ``what`` in the error) lies in ``[0, vocab_size)``."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{where}: {what} holds token {bad}, outside the target's vocabulary [0, {vocab_size})")


def eos_token_ids(where: str, eos_token_id, target) -> list[int]:
    """``eos_token_id`` (an id, a list or a tensor of them; None: the target's ``generation_config``) as a list of
    ids inside the target's vocabulary."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        check_id_tensor(where, "eos_token_id", eos_token_id)
        eos_token_id = eos_token_id.flatten().tolist()
    ids = [eos_token_id] if is_int(eos_token_id) else eos_token_id
    if not isinstance(ids, (list, tuple)) or not all(is_int(i) for i in ids):
        raise ValueError(f"{where}: eos_token_id must be a token id, a list of them or None, got {eos_token_id!r}")
    V = text_config(target.config).vocab_size
    if any(not 0 <= i < V for i in ids):
        raise ValueError(f"{where}: eos_token_id {list(ids)} outside the target's vocabulary [0, {V})")
    return [int(i) for i in ids]


def check_positions(where: str, what: str, needed: int, position_limit: int | None) -> None:
    """``needed`` positions (``what``: the prompt and budget that need them) fit the target's
    ``max_position_embeddings`` (None: no limit)."""
    if position_limit is not None and needed > position_limit:
        raise ValueError(f"{where}: {what} needs {needed} positions, which exceeds the target's "
                         f"max_position_embeddings = {position_limit}")
