"""What the models layer reads from a Hugging Face model's config, and the per-row numbers it takes, in one place.

* :func:`text_config`: the decoder's own config (multimodal configs nest it; a plain causal LM's is the config).
* :func:`attention_window` / :func:`check_window`: a sliding attention window, which tree verification and
  :class:`~specdec_ext.models.TreeKVCache` do not apply, so a generation that could reach past it is refused.
* :func:`forward_accepts`: whether a model's ``forward`` takes a keyword (``logits_to_keep``: older and custom models
  do not).
* :func:`row_tensor`: a number or a ``[B]`` tensor as a ``[B]`` int64 tensor (cache lengths, prefix lengths). Unlike
  the ops' arguments (:mod:`specdec_ext.ops`), which must already be of the right kind and on the right device,
  these are converted: they come from the loop's own bookkeeping, often host lists or CPU tensors.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["attention_window", "check_window", "forward_accepts", "row_tensor", "text_config"]


def text_config(config):
    """The text decoder's config of ``config`` (``get_text_config(decoder=True)`` where the config has one)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def forward_accepts(model, name: str) -> bool:
    """Whether ``model.forward`` has a parameter ``name``."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def attention_window(config) -> int | None:
    """The sliding window of a model's local-attention layers, if it has any (``sliding_window`` with sliding
    layers, as :class:`~specdec_ext.models.TreeKVCache` reads it, or GPT-Neo's ``window_size`` with local layers)."""
    cfg = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    if window and ("sliding_attention" in layer_types if layer_types else getattr(cfg, "use_sliding_window", True)):
        return int(window)
    if "local" in (getattr(cfg, "attention_layers", None) or []) and getattr(cfg, "window_size", None):
        return int(cfg.window_size)
    return None


def check_window(name: str, config, positions: int) -> None:
    """Tree verification and the cache do not apply sliding-window masks: refuse a generation that could reach
    past the window (a clear error, never wrong tokens)."""
    window = attention_window(config)
    if window is not None and positions > window:
        raise NotImplementedError(f"{name}: the model has sliding-window attention (window {window}) and this "
                                  f"generation may need {positions} positions; tree verification does not apply "
                                  "sliding-window masks, so prompt + max_new_tokens + the draft tree must fit in the "
                                  "window")


def row_tensor(value, rows: int, device: torch.device | str, name: str, where: str) -> torch.Tensor:
    """``value`` (a number, or a 0-d or ``[rows]`` tensor) as an int64 ``[rows]`` tensor on ``device`` (possibly an
    expanded view). Any other shape is a ValueError naming ``where`` and ``name``."""
    if isinstance(value, torch.Tensor):
        t = value.to(device=device, dtype=torch.int64)
        if t.dim() == 0:
            t = t.expand(rows)
        if t.shape != (rows,):
            raise ValueError(f"{where}: {name} must be a number or a [{rows}] tensor (batch size {rows}), got "
                             f"shape {tuple(value.shape)}")
        return t
    return torch.full((rows,), int(value), dtype=torch.int64, device=device)
