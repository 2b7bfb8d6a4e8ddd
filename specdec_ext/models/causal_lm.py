"""A Hugging Face causal LM from a local folder (``save_pretrained`` layout), refusing what would run wrong: weights
that leave parameters uninitialised (another model's folder, e.g. an EAGLE draft, loads as a random LM otherwise),
weights whose shapes differ from ``config.json``, unreadable or unsafe files. No network, no remote code; pickled
weights go through torch's weights-only unpickler (transformers' own default). Errors are ``ValueError`` (missing
files ``FileNotFoundError``) naming the folder or file."""

from __future__ import annotations

import os
import pickle

import torch

from specdec_ext.models.safe_files import read_json, reason

__all__ = ["WEIGHT_FILES", "load_causal_lm"]

# in the order transformers prefers them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _listed(keys, n: int = 4) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def load_causal_lm(path: str, dtype: torch.dtype | None = None):
    """``AutoModelForCausalLM.from_pretrained(path)`` (``dtype`` None: the checkpoint's), checked as above."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_model: {path!r} is not a local directory (models are loaded from disk only; "
                                "download them first)")
    config = read_json(os.path.join(path, "config.json"), "load_model")
    weights = next((os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))), None)
    if weights is None:
        raise FileNotFoundError(f"load_model: {path!r} holds none of {', '.join(WEIGHT_FILES)} (the model's weights)")
    if not isinstance(config.get("model_type"), str):
        raise ValueError(f"load_model: {os.path.join(path, 'config.json')!r} names no 'model_type' (not a Hugging "
                         "Face model folder?)")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", local_files_only=True,
                                                           output_loading_info=True, ignore_mismatched_sizes=True,
                                                           weights_only=True, trust_remote_code=False)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, pickle.UnpicklingError,
            SafetensorError) as e:  # the files, not this library: re-raised naming them
        raise ValueError(f"load_model: cannot load {weights!r} with {os.path.join(path, 'config.json')!r}: "
                         f"{reason(e)}") from None
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, stored, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ValueError(f"load_model: the weights in {weights!r} do not fit {os.path.join(path, 'config.json')!r}: "
                         f"{key!r} is {list(stored)} in the weights but {list(wanted)} by the config{more}")
    missing = info.get("missing_keys") or ()
    if missing:
        total = len(model.state_dict())
        raise ValueError(f"load_model: {weights!r} leaves {len(missing)} of the model's {total} tensors "
                         f"uninitialised ({_listed(missing)}): not this {config['model_type']!r} model's weights (an "
                         "EAGLE or Medusa draft folder? Those load as drafters: --eagle / --medusa, load_eagle / "
                         "load_medusa)")
    return model
