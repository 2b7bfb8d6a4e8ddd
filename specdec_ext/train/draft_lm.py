"""A small draft LM distilled from the target (for :class:`specdec_ext.drafters.DraftModelDrafter`): a
``LlamaForCausalLM`` with the target's vocabulary and head size, ``num_layers`` layers of ``hidden_size`` (by default
half the target's: a draft forward must cost a small fraction of the target's, since a chain of k runs it k times),
trained
with KL(target || draft) on the target's logits at every position (``kl_weight``) plus cross-entropy on the data
(``1 - kl_weight``; on self-distilled data the tokens are the target's own). Saved with ``save_pretrained``.

``parallel = K > 1`` trains a parallel draft (PARD, :class:`specdec_ext.drafters.ParallelDraftDrafter`) on
conditional drop-token batches (:mod:`specdec_ext.train.parallel_batch`): every real position learns its next token
as before, and the kept masks after it learn the tokens 2 .. K places on, each against the target's distribution at
that place (and the text's token). The mask token is one new vocabulary row after the target's (given a draft LM to
start from, its embeddings grow by that row, the mean of the others), recorded as ``pard_token`` and K as
``pard_num_tokens`` in the config."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_ext.drafters.draft_model import DraftModelDrafter
from specdec_ext.drafters.parallel_draft import ParallelDraftDrafter, parallel_draft_config
from specdec_ext.drafters.shapes import drafter_shape
from specdec_ext.models.config import text_config
from specdec_ext.train.common import first_param, freeze, in_target_dtype
from specdec_ext.train.loop import TrainConfig, evaluate_acceptance, train_loop
from specdec_ext.train.parallel_batch import parallel_batch

__all__ = ["draft_config_for", "draft_lm_drafter", "first_layers", "train_draft_lm"]


def draft_config_for(target, num_layers: int = 2, hidden_size: int | None = None, intermediate_size: int | None = None):
    from transformers import LlamaConfig

    t = text_config(target.config)
    hd = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    # half the target's width (whole heads): 2 such layers and the vocabulary product read ~1/7 of a 6-layer
    # target's bytes, where the target's width made each draft forward ~0.4 of the target's
    H = hidden_size or max(hd, t.hidden_size // 2 // hd * hd)
    if H % hd:
        raise ValueError(f"train_draft_lm: hidden_size {H} must be a multiple of the head size {hd}")
    nH = H // hd
    nKV = max(1, min(nH, getattr(t, "num_key_value_heads", None) or nH))
    while nH % nKV:
        nKV -= 1
    kw = dict(vocab_size=t.vocab_size, hidden_size=H, intermediate_size=intermediate_size or 2 * H,
              num_hidden_layers=num_layers, num_attention_heads=nH, num_key_value_heads=nKV, head_dim=hd,
              max_position_embeddings=getattr(t, "max_position_embeddings", 2048),
              rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6), tie_word_embeddings=False)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(t, k, None) is not None:
            kw[k] = getattr(t, k)
    theta = getattr(t, "rope_theta", None) or (getattr(t, "rope_parameters", None) or {}).get("rope_theta")
    if theta:
        kw["rope_theta"] = theta
    return LlamaConfig(**kw)


def draft_lm_drafter(model, target, num_draft_tokens: int | None = None) -> DraftModelDrafter:
    """The drafter that decodes with a trained draft LM (the held-out evaluation's and the report's): a chain of
    ``num_draft_tokens`` (None: the library's chain on the target's device,
    :func:`~specdec_ext.drafters.shapes.drafter_shape`), drafted in one forward by a parallel draft."""
    parallel = parallel_draft_config(model.config) is not None
    shape = drafter_shape("parallel-draft" if parallel else "draft-model", first_param(target).device.type)
    if num_draft_tokens is not None:
        shape["num_draft_tokens"] = num_draft_tokens
    return (ParallelDraftDrafter if parallel else DraftModelDrafter)(in_target_dtype(model, target), **shape)


def first_layers(model, num_layers: int):
    """The draft LM ``model`` (Llama-shaped: ``model.model.layers``) cut to its first ``num_layers`` decoder layers in
    place, its final norm and head kept: a smaller draft that starts from a trained one (training re-fits the
    layers it kept to the head)."""
    layers = model.model.layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= len(layers):
        raise ValueError(f"first_layers: num_layers must be an integer in [1, {len(layers)}] (the draft LM's "
                         f"layers), got {num_layers!r}")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    return model


def _with_mask_row(model, num_tokens: int):
    """``model`` with one more vocabulary row, the mask token (the mean embedding; its output row the mean too),
    recorded in the config with ``num_tokens``; a model that records a mask token already keeps it."""
    recorded = parallel_draft_config(model.config)
    if recorded is None:
        V = text_config(model.config).vocab_size
        model.resize_token_embeddings(V + 1, mean_resizing=True)
        model.config.pard_token = V
    model.config.pard_num_tokens = num_tokens
    return model


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True: attends) as the additive float mask every attention implementation reads."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def train_draft_lm(target, seqs: list[list[int]], cfg: TrainConfig, num_layers: int = 2,
                   hidden_size: int | None = None, intermediate_size: int | None = None, kl_weight: float = 1.0,
                   temperature: float = 1.0, heldout_prompts: list[list[int]] | None = None, model=None,
                   num_draft_tokens: int | None = None, parallel: int = 1, retention: float = 0.5,
                   min_retention: float = 0.1):
    """``(draft, result)``: a small LlamaForCausalLM distilled from the frozen ``target`` on ``seqs`` (``model``:
    start from this draft LM instead of a new one); ``num_draft_tokens``: the held-out evaluation's chain
    (:func:`draft_lm_drafter`). ``parallel = K > 1``: a parallel draft of K positions (module doc), its masks kept
    at the rates of :func:`~specdec_ext.train.parallel_batch.retention_rates`."""
    import warnings

    from transformers import LlamaForCausalLM

    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"train_draft_lm: parallel must be an integer >= 1 (1 = an ordinary draft LM), got "
                         f"{parallel!r}")
    for name, v in (("retention", retention), ("min_retention", min_retention)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
            raise ValueError(f"train_draft_lm: {name} must be a number in (0, 1], got {v!r}")
    freeze(target)
    device = first_param(target).device
    cfg.device = str(device)
    if model is None:
        torch.manual_seed(cfg.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = LlamaForCausalLM(draft_config_for(target, num_layers, hidden_size, intermediate_size))
        if model.config.hidden_size == text_config(target.config).hidden_size:
            with torch.no_grad():  # start from the target's embeddings and output head when they fit
                model.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
                model.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
    if parallel > 1:
        model = _with_mask_row(model, parallel)
    model = model.to(device=device, dtype=torch.float32)
    T = temperature
    V = text_config(target.config).vocab_size

    def distill_loss(tl, dl, y, ok):
        """KL(target || draft) at temperature T over the target's ids (``tl[..., V]`` and ``dl[..., V or V + 1]``
        logits per entry; a parallel draft's mask row counts against the draft) and cross-entropy on ``y`` (-100: no
        label), weighted by ``kl_weight``, over the entries ``ok``."""
        n = ok.sum().clamp_min(1)
        loss = 0.0
        if kl_weight > 0:
            p = F.log_softmax(tl / T, -1)
            q = F.log_softmax(dl / T, -1)[..., :V]
            kl = (p.exp() * (p - q)).sum(-1)
            loss = loss + kl_weight * (T * T) * (kl * ok).sum() / n
        if kl_weight < 1:
            loss = loss + (1 - kl_weight) * F.cross_entropy(dl.reshape(-1, dl.shape[-1]), y.reshape(-1),
                                                            ignore_index=-100)
        return loss, int(ok.sum())

    def parallel_loss_fn(toks, mask):
        with torch.no_grad():
            tl = target(input_ids=toks, attention_mask=mask.long()).logits.float()
        pb = parallel_batch(toks, mask, parallel, model.config.pard_token, retention, min_retention)
        dl = model(input_ids=pb.input_ids, position_ids=pb.position_ids,
                   attention_mask=_additive(pb.attention, torch.float32)).logits.float()
        ok = pb.source >= 0
        src = pb.source.clamp(min=0)
        y = toks.gather(1, (src + 1).clamp(max=toks.shape[1] - 1)).masked_fill(~ok, -100)
        return distill_loss(tl.gather(1, src[..., None].expand(*src.shape, V)), dl, y, ok)

    def loss_fn(toks, mask):
        with torch.no_grad():
            tl = target(input_ids=toks, attention_mask=mask.long()).logits.float()
        dl = model(input_ids=toks, attention_mask=mask.long()).logits.float()
        m = mask[:, :-1] & mask[:, 1:]
        return distill_loss(tl[:, :-1], dl[:, :-1], toks[:, 1:].masked_fill(~m, -100), m)

    eval_fn = None
    if heldout_prompts:
        def eval_fn(step):
            return evaluate_acceptance(target, draft_lm_drafter(model, target, num_draft_tokens), heldout_prompts,
                                       cfg.eval_new_tokens)

    c = model.config
    signature = {"layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size}
    if parallel > 1:
        signature.update(parallel=parallel, retention=retention, min_retention=min_retention)
    result = train_loop(model, parallel_loss_fn if parallel > 1 else loss_fn, seqs, cfg, eval_fn, name="draft",
                        signature=signature)
    return model.eval(), result
