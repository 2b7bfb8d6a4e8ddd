"""Training the early-exit adapter of self-speculation (``specdec train-self-spec``; Kangaroo style) for a frozen
target.

At every position t the adapter reads the target's hidden states after its first ``exit_layer`` layers at
positions <= t (causal attention, no cache: a whole sequence at once) and its output goes through the target's
own final norm and LM head; the loss is KL(target || draft) against the target's next-token distribution at t.
The inputs are exactly the features the adapter reads when drafting (the target's shallow layers compute them for
draft tokens too), so one pass per sequence trains every position and nothing feeds back (no training-time test).
Only the adapter's parameters train; it starts as a copy of the target's layer ``exit_layer``
(:meth:`~specdec_ext.models.early_exit.EarlyExitAdapter.from_target_layer`), i.e. from the target with its later
layers skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_ext.drafters.early_exit import EarlyExitDrafter
from specdec_ext.models.config import text_config
from specdec_ext.models.early_exit import EarlyExitAdapter
from specdec_ext.train.common import first_param, freeze, in_target_dtype
from specdec_ext.train.loop import TrainConfig, evaluate_acceptance, train_loop

__all__ = ["DEFAULT_DRAFT_TOKENS", "default_exit_layer", "early_exit_drafter", "train_early_exit"]

DEFAULT_DRAFT_TOKENS = 4  # the chain the held-out evaluation and the CLI draft with


def default_exit_layer(num_layers: int) -> int:
    """A quarter of the target's layers (at least one): deep enough for the adapter to have features to work from,
    shallow enough that a draft costs a fraction of a target forward."""
    return max(1, int(num_layers) // 4)


@torch.no_grad()
def _target_pass(target, toks: torch.Tensor, mask: torch.Tensor, exit_layer: int):
    """``(h_L[B, T, H], log p[B, T, V])`` of the frozen target: its states after ``exit_layer`` layers, and its
    next-token log-probabilities (float32)."""
    out = target(input_ids=toks, attention_mask=mask.long(), output_hidden_states=True)
    return out.hidden_states[exit_layer], F.log_softmax(out.logits.float(), -1)


def _loss(adapter: EarlyExitAdapter, target, toks: torch.Tensor, mask: torch.Tensor):
    h, logp = _target_pass(target, toks, mask, adapter.exit_layer)
    B, T = toks.shape
    pos = torch.arange(T, device=toks.device)[None].expand(B, T)
    out = adapter(h.float(), pos)  # (causal attention over the whole sequence)
    dt = first_param(target).dtype
    logq = F.log_softmax(target.lm_head(target.model.norm(out.to(dt))).float(), -1)
    valid = mask.float()
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return (kl * valid).sum() / valid.sum().clamp_min(1), int(mask.sum())


def early_exit_drafter(adapter: EarlyExitAdapter, target, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                       **shape) -> EarlyExitDrafter:
    """The drafter a trained adapter decodes with (the held-out evaluation's and the report's): in the target's
    dtype, chains of ``num_draft_tokens``."""
    return EarlyExitDrafter(in_target_dtype(adapter, target).eval(), num_draft_tokens=num_draft_tokens, **shape)


def train_early_exit(target, seqs: list[list[int]], cfg: TrainConfig, exit_layer: int | None = None,
                     heldout_prompts: list[list[int]] | None = None,
                     num_draft_tokens: int = DEFAULT_DRAFT_TOKENS, adapter: EarlyExitAdapter | None = None,
                     draft_vocab: torch.Tensor | None = None):
    """``(adapter, result)``: an early-exit adapter trained on ``seqs`` for ``target`` (``exit_layer`` default
    :func:`default_exit_layer`; ``adapter``: continue from this one; ``draft_vocab``: the ids the held-out
    evaluation drafts over)."""
    t = text_config(target.config)
    N = t.num_hidden_layers
    if adapter is None:
        L = default_exit_layer(N) if exit_layer is None else exit_layer
        if isinstance(L, bool) or not isinstance(L, int) or not 1 <= L < N:
            raise ValueError(f"train_early_exit: exit_layer must be an integer in [1, {N - 1}] (the target has {N} "
                             f"decoder layers), got {exit_layer!r}")
        adapter = EarlyExitAdapter.from_target_layer(target, L)
    freeze(target)
    device = first_param(target).device
    cfg.device = str(device)
    adapter = adapter.to(device=device, dtype=torch.float32).train().requires_grad_(True)

    def loss_fn(toks, mask):
        return _loss(adapter, target, toks, mask)

    eval_fn = None
    if heldout_prompts:
        def eval_fn(step):
            return evaluate_acceptance(target, early_exit_drafter(adapter, target, num_draft_tokens,
                                                                  draft_vocab=draft_vocab),
                                       heldout_prompts, cfg.eval_new_tokens)

    signature = {"exit_layer": adapter.exit_layer, "hidden_size": adapter.config.hidden_size}
    result = train_loop(adapter, loss_fn, seqs, cfg, eval_fn, name="early-exit", signature=signature)
    return adapter.eval().requires_grad_(False), result
