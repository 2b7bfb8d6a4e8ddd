"""The self-speculation file: which decoder layers a target skips when it drafts for itself, as small JSON.

Written by ``specdec tune-self-spec`` (:mod:`specdec_ext.train.self_spec_tune`), read by ``specdec generate
--self-spec FILE`` and :meth:`specdec_ext.drafters.SelfSpecDrafter.from_file`::

    {
      "format": "specdec_ext.self_spec/1",
      "num_layers": 8,               // the target's decoder layers (a file is refused for another layer count)
      "skip_layers": [2, 5],         // the layers the draft skips, each in [0, num_layers)
      "num_draft_tokens": 4,         // the chain length the tuner chose (>= 1)
      "tuning": {...}                // optional: what the tuner measured (an object, for people; not read back)
    }

Every other key, a wrong type or an index out of range is a ``ValueError`` naming the file and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from specdec_ext.models.config import text_config
from specdec_ext.models.layer_skip import check_skip_layers
from specdec_ext.models.safe_files import read_json

__all__ = ["FORMAT", "SelfSpecFile", "read_self_spec", "write_self_spec"]

FORMAT = "specdec_ext.self_spec/1"
_KEYS = ("format", "num_layers", "skip_layers", "num_draft_tokens", "tuning")
_REQUIRED = ("format", "num_layers", "skip_layers", "num_draft_tokens")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SelfSpecFile:
    """The file's contents (see the module doc), checked."""

    num_layers: int
    skip_layers: tuple[int, ...]
    num_draft_tokens: int
    tuning: dict = field(default_factory=dict)

    def __post_init__(self):
        where = "SelfSpecFile"
        if not _is_int(self.num_layers) or self.num_layers < 1:
            raise ValueError(f"{where}: num_layers must be an integer >= 1, got {self.num_layers!r}")
        object.__setattr__(self, "skip_layers", check_skip_layers(where, self.skip_layers, self.num_layers))
        if not _is_int(self.num_draft_tokens) or self.num_draft_tokens < 1:
            raise ValueError(f"{where}: num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}")
        if not isinstance(self.tuning, dict):
            raise ValueError(f"{where}: tuning must be an object, got {type(self.tuning).__name__}")

    def check_target(self, target: torch.nn.Module, where: str) -> None:
        """A ValueError naming ``where`` unless ``target`` has the file's number of decoder layers."""
        n = getattr(text_config(target.config), "num_hidden_layers", None)
        if n != self.num_layers:
            raise ValueError(f"{where}: the skipped layers were chosen for a target of {self.num_layers} decoder "
                             f"layers, but this target has {n}")

    def to_json(self) -> dict:
        return {"format": FORMAT, "num_layers": self.num_layers, "skip_layers": list(self.skip_layers),
                "num_draft_tokens": self.num_draft_tokens, "tuning": self.tuning}


def read_self_spec(path: str | os.PathLike) -> SelfSpecFile:
    """The checked contents of the self-speculation file ``path`` (a ValueError naming the file and the field)."""
    where = f"self-spec file {os.fspath(path)!r}"
    data = read_json(os.fspath(path), "self-spec")
    unknown = [k for k in data if k not in _KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} (expected {', '.join(_KEYS)})")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    if data["format"] != FORMAT:
        raise ValueError(f"{where}: format must be {FORMAT!r}, got {data['format']!r}")
    try:
        return SelfSpecFile(data["num_layers"], data["skip_layers"], data["num_draft_tokens"], data.get("tuning", {}))
    except ValueError as err:
        raise ValueError(f"{where}: {str(err).removeprefix('SelfSpecFile: ')}") from None


def write_self_spec(path: str | os.PathLike, plan: SelfSpecFile) -> None:
    """Writes ``plan`` as the file of the module doc (``tuning`` must hold JSON values)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plan.to_json(), f, indent=2)
        f.write("\n")
