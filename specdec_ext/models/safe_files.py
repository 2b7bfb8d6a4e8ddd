"""Reading checkpoint files without running anything from them: JSON, safetensors, and ``torch.save`` files
through torch's weights-only unpickler (tensors and plain containers; a pickle that names any other global is
refused before it is called). Every error is a ``ValueError`` naming the file (a missing file stays a
``FileNotFoundError``), so a command can print it as one line."""

from __future__ import annotations

import json
import os

import torch

__all__ = ["read_json", "read_safetensors", "read_state_dict", "read_weights_only", "reason"]


def reason(err: Exception) -> str:
    """The line of torch's or safetensors' message that says what is wrong (their boilerplate left out)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for ln in lines:
        if "unsupported" in ln.lower():  # torch names the refused global or opcode here (advice to allow it cut)
            return ln.split("WeightsUnpickler error:")[-1].split(" by default.")[0].strip()
    return (lines[0] if lines else type(err).__name__)[:300]


def read_json(path: str, who: str) -> dict:
    """The JSON object in ``path``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{who}: {path!r} is missing")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{who}: {path!r} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{who}: {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{who}: {path!r} must hold a JSON object ({{...}}), got a JSON {type(value).__name__}")
    return value


def read_weights_only(path: str, who: str):
    """``torch.load(path, weights_only=True)`` on the CPU."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure of the restricted unpickler: re-raised naming the file
        raise ValueError(f"{who}: cannot read {path!r} as a weights-only torch.save file (tensors and plain "
                         f"containers; nothing in it was run): {reason(e)}") from None


def read_safetensors(path: str, who: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except Exception as e:  # noqa: BLE001 - SafetensorError and OS errors: re-raised naming the file
        raise ValueError(f"{who}: cannot read {path!r} as safetensors (truncated or not a safetensors file?): "
                         f"{reason(e)}") from None


def read_state_dict(path: str, who: str) -> dict[str, torch.Tensor]:
    """A mapping of names to tensors from ``.safetensors`` or a weights-only ``torch.save`` file."""
    sd = read_safetensors(path, who) if path.endswith(".safetensors") else read_weights_only(path, who)
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ValueError(f"{who}: {path!r} does not hold a state dict (a mapping of names to tensors)")
    return dict(sd)
