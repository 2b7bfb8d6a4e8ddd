"""EAGLE-1 and EAGLE-3 draft training for a frozen target (anchors 1a).

EAGLE-1: at position t the draft reads the target's feature f_t (last hidden state after the final norm) and the
embedding of token t + 1, predicts f_{t+1}; loss = smooth-L1(f'_{t+1}, f_{t+1}) + w_tok * soft CE of
``lm_head(f'_{t+1})`` (the target's frozen ``lm_head``) against the target's distribution at t + 1 (reported as
KL, i.e. less the target's entropy). With ``ttt_steps > 1`` (training-time test, as below; EAGLE-1's published
recipe is 1 step, this library's default 3) step k feeds the draft's own predicted features back in, as the deeper
levels of a tree do at drafting time, so their errors stop compounding.

EAGLE-3: the features are the inputs of three target layers (default ``(2, L // 2, L - 3)``) concatenated and fused
by ``fc``; the draft predicts the next token directly (its own ``norm`` + ``lm_head`` over a draft vocabulary).
Training-time test: step 0 reads target features; step k feeds the draft's own outputs of step k - 1 (shifted one
position) back in, so the draft learns to continue from its own predictions; loss weights 0.8^k. A reduced draft
vocabulary keeps the ``draft_vocab`` most frequent target tokens of the data (``d2t`` / ``t2d``); the target's
distribution is renormalised over it (positions whose target argmax is outside it are masked).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_ext.drafters.eagle import EagleDrafter
from specdec_ext.drafters.shapes import eagle_tree_shape
from specdec_ext.models.config import text_config
from specdec_ext.models.eagle import Eagle1Model, Eagle3Model, EagleConfig, default_eagle3_layers
from specdec_ext.train.common import first_param, freeze, in_target_dtype, target_hidden
from specdec_ext.models.draft_vocab import draft_vocab_ids
from specdec_ext.train.loop import TrainConfig, evaluate_acceptance, train_loop

__all__ = ["DEFAULT_TTT_STEPS", "eagle_config_for", "eagle_drafter", "train_eagle"]


def eagle_config_for(target, draft_vocab: int | None = None, aux_layers=None) -> EagleConfig:
    """An EAGLE draft config matching ``target`` (:meth:`EagleConfig.for_target`: one decoder layer of its shape)."""
    return EagleConfig.for_target(target, draft_vocab, aux_layers)


def _training_time_test(m, feats, embeds, pos, valid, steps):
    """The draft's passes of a training-time test: yields ``(k, out, weights)`` for k < ``steps``. Pass 0 reads the
    target's features ``feats[B, T', .]``; pass k reads pass k - 1's outputs one position on (its own prediction
    of the feature at t fed at t, as a tree's deeper levels do), so its first k positions have no input and weigh
    0 in ``weights`` (``valid`` as float otherwise)."""
    hidden = feats
    for k in range(steps):
        if k > 0 and valid.shape[1] <= k:
            break
        out = m(hidden, embeds, pos, from_target=k == 0)
        v = valid.clone()
        v[:, :k] = False
        yield k, out, v.float()
        hidden = torch.cat([out[:, :1], out[:, :-1]], 1)


def _token_head(lm, vocab_ids):
    """``(weight, bias)`` of the target's ``lm_head`` rows the token loss scores: all, or ``vocab_ids``'."""
    w, b = lm.weight, getattr(lm, "bias", None)
    if vocab_ids is None:
        return w, b
    return w.index_select(0, vocab_ids), None if b is None else b.index_select(0, vocab_ids)


def _eagle1_loss(m, target, toks, mask, w_tok, ttt_steps, decay, vocab_ids=None):
    emb, lm = target.get_input_embeddings(), target.get_output_embeddings()
    feats, logits = target_hidden(target, toks, mask)
    T = toks.shape[1]
    valid = mask[:, 2:] & mask[:, :-2]  # input (f_t, tok_{t+1}), targets f_{t+1} / p_{t+1}
    pos = torch.arange(T - 2, device=toks.device)[None].expand(toks.shape[0], -1)
    with torch.no_grad():
        e = emb(toks[:, 1: T - 1])
    goal = feats[:, 1: T - 1]
    tl = logits[:, 1: T - 1]
    scored = valid
    if vocab_ids is not None:  # the token loss over the ids the draft will rank (where the target's argmax is one)
        in_vocab = torch.zeros(tl.shape[-1], dtype=torch.bool, device=tl.device)
        in_vocab[vocab_ids] = True
        scored = valid & in_vocab[tl.argmax(-1)]
        tl = tl.index_select(-1, vocab_ids)
    logp = F.log_softmax(tl, -1)
    w, b = _token_head(lm, vocab_ids)
    total = 0.0
    for k, out, vf in _training_time_test(m, feats[:, : T - 2], e, pos, valid, ttt_steps):
        n = vf.sum().clamp_min(1)
        reg = (F.smooth_l1_loss(out.float(), goal, reduction="none").mean(-1) * vf).sum() / n
        logq = F.log_softmax(F.linear(out.to(w.dtype), w, b).float(), -1)
        sf = vf * scored.float()
        ce = ((logp.exp() * (logp - logq)).sum(-1) * sf).sum() / sf.sum().clamp_min(1)  # KL(target || draft)
        total = total + decay ** k * (reg + w_tok * ce)
    return total, int(valid.sum())


def _eagle3_loss(m, target, toks, mask, ttt_steps, decay):
    emb = target.get_input_embeddings()
    feats, logits = target_hidden(target, toks, mask, m.aux_layers)
    T = toks.shape[1]
    valid = mask[:, 2:] & mask[:, :-2]
    pos = torch.arange(T - 2, device=toks.device)[None].expand(toks.shape[0], -1)
    with torch.no_grad():
        e = emb(toks[:, 1: T - 1])
    tl = logits[:, 1: T - 1]  # the target's distribution of token t + 2
    if m.t2d is not None:
        ids = m.d2t + torch.arange(m.d2t.numel(), device=m.d2t.device)
        valid = valid & m.t2d[tl.argmax(-1)]
        tl = tl[..., ids]
    logp = F.log_softmax(tl, -1)
    total = 0.0
    for k, out, vf in _training_time_test(m, feats[:, : T - 2], e, pos, valid, ttt_steps):
        logq = F.log_softmax(m.logits(out).float(), -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)  # KL(target || draft): soft CE less its floor
        total = total + decay ** k * (kl * vf).sum() / vf.sum().clamp_min(1)
    return total, int(valid.sum())


def eagle_drafter(model, target, draft_vocab: torch.Tensor | None = None, tree: dict | None = None) -> EagleDrafter:
    """The drafter that decodes with a trained draft (the held-out evaluation's and the report's): the EAGLE-2 tree
    the library decodes with on the target's device (:func:`~specdec_ext.drafters.shapes.drafter_shape` of
    ``eagle2`` / ``eagle3``, :func:`~specdec_ext.drafters.shapes.eagle_tree_shape`; ``tree`` applied), over ``draft_vocab`` (EAGLE-1's FR-Spec ids) when given."""
    shape = eagle_tree_shape(model.version, first_param(target).device.type)
    return EagleDrafter(in_target_dtype(model, target), target=target, draft_vocab=draft_vocab,
                        **{**shape, **(tree or {})})


DEFAULT_TTT_STEPS = 3  # EAGLE-3's published recipe; for EAGLE-1 the family's (1 step accepted 1-4% less)


def train_eagle(target, seqs: list[list[int]], cfg: TrainConfig, version: int = 1, draft_vocab: int | None = None,
                aux_layers=None, token_weight: float = 0.1, ttt_steps: int | None = None, decay: float = 0.8,
                heldout_prompts: list[list[int]] | None = None, fc_bias: bool = True, model=None,
                eval_tree: dict | None = None, eval_draft_vocab: torch.Tensor | None = None,
                vocab_loss: bool = False):
    """``(draft, result)``: an EAGLE-1 (``version=1``) or EAGLE-3 draft trained on ``seqs`` for ``target``.
    ``ttt_steps``: training-time-test steps (None: ``DEFAULT_TTT_STEPS``), loss weights ``decay ** k``.
    ``eval_draft_vocab``: EAGLE-1: the FR-Spec ids the held-out evaluation drafts over (as the draft will be used);
    ``vocab_loss``: the token loss over them too (train-eagle's default): the target's distribution renormalised
    over the ids, positions whose target argmax is outside them left out, as EAGLE-3's over its draft vocabulary."""
    if version not in (1, 3):
        raise ValueError(f"train_eagle: version must be 1 or 3, got {version!r}")
    if ttt_steps is None:
        ttt_steps = DEFAULT_TTT_STEPS
    if isinstance(ttt_steps, bool) or not isinstance(ttt_steps, int) or ttt_steps < 1:
        raise ValueError(f"train_eagle: ttt_steps must be an integer >= 1, got {ttt_steps!r}")
    freeze(target)
    device = first_param(target).device
    cfg.device = str(device)
    tcfg = text_config(target.config)
    if model is None:
        torch.manual_seed(cfg.seed)
        if version == 1:
            if draft_vocab or aux_layers:
                raise ValueError("train_eagle: a reduced draft vocabulary and aux layers are EAGLE-3 features "
                                 "(--version 3)")
            model = Eagle1Model(eagle_config_for(target), fc_bias=fc_bias)
        else:
            L = tcfg.num_hidden_layers
            layers = tuple(int(i) for i in aux_layers) if aux_layers else default_eagle3_layers(L)
            if len(layers) != 3 or any(not 0 <= i <= L for i in layers):
                raise ValueError(f"train_eagle: EAGLE-3 fuses three target layers in [0, {L}]; got {list(layers)}")
            V = tcfg.vocab_size
            dv = draft_vocab if draft_vocab and draft_vocab < V else None
            model = Eagle3Model(eagle_config_for(target, dv, layers))
            if dv:
                model.set_vocab_map(draft_vocab_ids(seqs, V, dv))
            model.aux_layers = layers
    model = model.to(device=device, dtype=torch.float32)
    if vocab_loss and (version != 1 or eval_draft_vocab is None):
        raise ValueError("train_eagle: vocab_loss takes EAGLE-1's token loss over eval_draft_vocab (give the ids)")
    loss_ids = eval_draft_vocab.to(device=device, dtype=torch.int64).sort().values if vocab_loss else None

    def loss_fn(toks, mask):
        if version == 1:
            return _eagle1_loss(model, target, toks, mask, token_weight, ttt_steps, decay, loss_ids)
        return _eagle3_loss(model, target, toks, mask, ttt_steps, decay)

    eval_fn = None
    if heldout_prompts:
        def eval_fn(step):
            return evaluate_acceptance(target, eagle_drafter(model, target, eval_draft_vocab, eval_tree),
                                       heldout_prompts, cfg.eval_new_tokens)

    signature = {"version": version, "hidden_size": model.config.hidden_size}
    if version == 3:
        signature.update(draft_vocab=model.config.draft_vocab_size, aux_layers=list(model.aux_layers or ()))
    result = train_loop(model, loss_fn, seqs, cfg, eval_fn, name=f"eagle{version}", signature=signature)
    return model.eval(), result
