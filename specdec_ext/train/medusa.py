"""Medusa-1 training: a frozen target, K heads on its last hidden state (after the final norm); head h at position
t predicts token t + 2 + h; loss = sum_h w^h * CE (w = 0.8 by default), or with ``soft_labels`` (train_medusa's
default) the KL to the target's own distribution of that token; lr 1e-3 (anchors 1a). Heads start as identity
ResBlocks with the target's ``lm_head`` copied into their own ``lm_head`` (Medusa's initialisation), or
(``share_lm_head``) reuse the target's frozen ``lm_head`` (legacy layout: ResBlocks only); saved with
:func:`specdec_ext.models.checkpoints.save_medusa` (official layout, safetensors)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_ext.drafters.medusa import MedusaDrafter
from specdec_ext.drafters.shapes import drafter_shape
from specdec_ext.models.config import text_config
from specdec_ext.models.medusa import MedusaHeads
from specdec_ext.train.common import first_param, freeze, in_target_dtype, target_hidden
from specdec_ext.train.loop import TrainConfig, evaluate_acceptance, train_loop

__all__ = ["medusa_drafter", "medusa_loss", "train_medusa"]


def medusa_loss(heads: MedusaHeads, target, toks: torch.Tensor, mask: torch.Tensor, decay: float = 0.8,
                soft_labels: bool = False):
    hid, target_logits = target_hidden(target, toks, mask)
    teacher = F.log_softmax(target_logits, -1) if soft_labels else None
    hid = hid.to(first_param(heads).dtype)
    lm = None if heads.has_lm_head else target.get_output_embeddings()
    total, n = 0.0, 0
    for h in range(heads.num_heads):
        off = h + 2
        if toks.shape[1] <= off:
            break
        x = heads.heads[h](hid[:, :-off])  # one head at a time: [B, T - off, V] logits, not [B, T, K, V]
        lg = (x if lm is None else lm(x.to(lm.weight.dtype))).float()
        if teacher is not None:  # KL(target || head) against the target's own distribution of token t + off
            t, m = teacher[:, off - 1: -1], mask[:, off:].float()
            kl = (t.exp() * (t - F.log_softmax(lg, -1))).sum(-1)
            loss = (kl * m).sum() / m.sum().clamp(min=1.0)
        else:
            y = toks[:, off:].masked_fill(~mask[:, off:], -100)
            loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), ignore_index=-100)
        total = total + decay ** h * loss
        n += int(mask[:, off:].sum()) if h == 0 else 0
    return total, n


def medusa_drafter(heads: MedusaHeads, target) -> MedusaDrafter:
    """The drafter that decodes with trained heads (the held-out evaluation's and the report's), in the tree the
    library decodes with on the target's device (:func:`~specdec_ext.drafters.shapes.drafter_shape`)."""
    return MedusaDrafter(in_target_dtype(heads, target), **drafter_shape("medusa", first_param(target).device.type))


def train_medusa(target, seqs: list[list[int]], cfg: TrainConfig, num_heads: int = 4, num_layers: int = 1,
                 decay: float = 0.8, heldout_prompts: list[list[int]] | None = None, heads: MedusaHeads | None = None,
                 share_lm_head: bool = False, soft_labels: bool = True):
    """``(heads, result)``: Medusa-1 heads trained on ``seqs`` (token lists) for the frozen ``target``.
    ``share_lm_head``: legacy heads (ResBlocks only) that reuse the target's frozen ``lm_head`` (compact: no
    ``[V, H]`` matrix per head). ``soft_labels``: head h learns the target's own distribution of token t + 2 + h
    given the text up to t + 1 + h (KL to it) instead of the corpus token (cross-entropy): what verification
    accepts, as in Medusa's self-distillation, without generating a new corpus; the default, since on the family
    it accepted more (mean accepted length 2.38 against 2.21, ``zoo/spec.py``)."""
    freeze(target)
    device = first_param(target).device
    cfg.device = str(device)
    tcfg = text_config(target.config)
    if heads is None:
        torch.manual_seed(cfg.seed)
        if share_lm_head and num_layers < 1:
            raise ValueError("train_medusa: heads that share the target's lm_head need num_layers >= 1")
        heads = MedusaHeads(num_heads, tcfg.hidden_size, None if share_lm_head else tcfg.vocab_size, num_layers)
        if not share_lm_head:
            heads.init_lm_heads_from(target.get_output_embeddings())
    heads = heads.to(device=device, dtype=torch.float32)

    def loss_fn(toks, mask):
        return medusa_loss(heads, target, toks, mask, decay, soft_labels)

    eval_fn = None
    if heldout_prompts:
        def eval_fn(step):
            return evaluate_acceptance(target, medusa_drafter(heads, target), heldout_prompts, cfg.eval_new_tokens)

    signature = {"heads": heads.num_heads, "layers": heads.num_layers,
                 "lm_head": "own" if heads.has_lm_head else "the target's"}
    result = train_loop(heads, loss_fn, seqs, cfg, eval_fn, name="medusa", signature=signature)
    return heads.eval(), result
