"""Hugging Face's own greedy decoding: the independent reference every drafter's greedy output must equal."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    """``model.generate(do_sample=False)`` continuation of one prompt, with transformers' SDPA attention (not ours),
    stopping at ``eos`` (None: only the token budget)."""
    saved = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.int64))
    finally:
        model.set_attn_implementation(saved)
    return out[0, len(prompt):].tolist()


class CountForwards:
    """Counts a model's forward calls (a forward pre-hook), so tests can check that generation makes exactly one
    target forward per step and no hidden extra passes. Usable as a context manager."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()
