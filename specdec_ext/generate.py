"""``generate()``: a fixed batch of prompts decoded to the end, as a short loop over the engine.

::

    engine = Engine(target, drafter, max_batch=B, max_len=...)   # validates, holds the drafter
    ids = [engine.add_request(p, max_new_tokens=n, ...) for p, n in zip(prompts, budgets)]
    while engine.has_unfinished():
        for request_id, new_tokens, _ in engine.step():          # propose, forward, verify, accept, emit
            results[request_id] += new_tokens

Everything about a step (the drafter protocol, verification, retiring finished rows, the one device
synchronisation per step, packed linear layers) is the engine's: :mod:`specdec_ext.engine.engine`. What this module
adds is the HF-style front: prompts in any of the accepted forms, one budget or one per prompt, one set of sampling
settings for every row, a streamer (batch 1), and the output in the input's form. Every row joins at the first step,
so the prefill is one forward over the whole batch, as before the engine existed.

Randomness. Sampled rows draw from one generator, in row order: the user's ``generator``, a fresh one seeded with
``seed``, or one seeded from torch's global generator (so ``torch.manual_seed`` makes a call reproducible).
"""

from __future__ import annotations

import os
import time

import torch

from specdec_ext.drafters.base import check_drafter
from specdec_ext.engine import DecodeStats, Engine, RequestSettings, TokenStream
from specdec_ext.engine.limits import (check_id_tensor, check_positions, check_target, check_token_ids,
                                       eos_token_ids, is_int)
from specdec_ext.models.causal_lm import load_causal_lm
from specdec_ext.models.config import check_window, text_config

__all__ = ["DecodeStats", "generate", "load_model"]


def load_model(path_or_model, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None):
    """A causal LM from a local directory (``AutoModelForCausalLM``, no network) or an already-built model, in
    eval mode, with ``dtype`` and on ``device`` when given. A folder is refused (``ValueError`` naming it) when its
    weights are unreadable, unsafe, shaped unlike its config, or leave parameters uninitialised
    (:func:`~specdec_ext.models.causal_lm.load_causal_lm`)."""
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype) or not getattr(torch, dtype).is_floating_point:
            raise ValueError(f"load_model: dtype must be a floating torch dtype or its name (float32, bfloat16, "
                             f"float16), got {dtype!r}")
        dtype = getattr(torch, dtype)
    if isinstance(path_or_model, (str, os.PathLike)):
        model = load_causal_lm(os.fspath(path_or_model), dtype)
    else:
        model = path_or_model
        if dtype is not None:
            model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()


def _prompts(input_ids) -> tuple[list[list[int]], str]:
    """Prompts as lists of ints, and the input form ("1d", "2d" or "list") the output mirrors."""
    if isinstance(input_ids, torch.Tensor):
        check_id_tensor("generate", "input_ids", input_ids)
        if input_ids.dim() == 1:
            return [input_ids.tolist()], "1d"
        if input_ids.dim() == 2:
            return input_ids.tolist(), "2d"
        raise ValueError(f"generate: input_ids must be [P] or [B, P], got shape {tuple(input_ids.shape)}")
    if isinstance(input_ids, (list, tuple)):
        if input_ids and all(is_int(t) for t in input_ids):
            return [[int(t) for t in input_ids]], "1d"
        rows = []
        for b, row in enumerate(input_ids):
            if isinstance(row, torch.Tensor):
                check_id_tensor("generate", f"input_ids[{b}]", row)
                if row.dim() != 1:
                    raise ValueError(f"generate: input_ids[{b}] must be a 1-D tensor of token ids, got shape "
                                     f"{tuple(row.shape)}")
                rows.append(row.tolist())
            elif isinstance(row, (list, tuple)) and all(is_int(t) for t in row):
                rows.append([int(t) for t in row])
            else:
                raise ValueError(f"generate: input_ids[{b}] must be a list of integer token ids or a 1-D integer "
                                 f"tensor, got {_describe(row)}")
        return rows, "list"
    raise ValueError(f"generate: input_ids must be a tensor or a list of prompts, got {type(input_ids).__name__}")


def _describe(value) -> str:
    if isinstance(value, (list, tuple)):
        odd = next((t for t in value if not is_int(t)), None)
        return f"a {type(value).__name__} holding {odd!r} ({type(odd).__name__})"
    return f"{type(value).__name__} {value!r}"[:120]


def _budgets(max_new_tokens, B: int) -> list[int]:
    """``max_new_tokens`` (one integer, or one per prompt) as a list of B integers >= 1."""
    if isinstance(max_new_tokens, (list, tuple)):
        if len(max_new_tokens) != B:
            raise ValueError(f"generate: max_new_tokens has {len(max_new_tokens)} entries for {B} prompts (give one "
                             "integer, or one per prompt)")
        values = list(max_new_tokens)
    else:
        values = [max_new_tokens] * B
    for n in values:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"generate: max_new_tokens must be an integer >= 1 (or a list of them, one per prompt), "
                             f"got {max_new_tokens!r}")
    return values


@torch.no_grad()
def generate(target: torch.nn.Module = None, drafter=None, input_ids=None, *, max_new_tokens: int | list[int] = 32,
             eos_token_id: int | list[int] | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, generator: torch.Generator | None = None, seed: int | None = None,
             streamer=None, pad_token_id: int | None = None, max_cache_len: int | None = None,
             tree_attention: bool = True, acceptance: str = "exact", posterior_threshold: float = 0.09,
             posterior_alpha: float = 0.3, packed_linears: bool = True):
    """Speculative (or, with ``drafter=None``, plain) generation from ``target`` (an HF causal LM).

    ``input_ids``: ``[P]`` or ``[B, P]`` tensor, or a list of prompts (lists of ints / 1-D tensors, any lengths).
    ``max_new_tokens``: one budget for every row, or a list with one per prompt (requests of different lengths).
    ``eos_token_id``: one id or several (default: the target's ``generation_config``); generation of a row stops
    after its first EOS (included in the output). ``temperature`` 0 is greedy; otherwise sampling with ``top_k``
    (0 = off) and ``top_p`` (1 = off) from ``generator`` (or a fresh one seeded with ``seed``). ``streamer``: HF
    style, ``put(prompt [1, P])`` then ``put(new tokens [n])`` per step, ``end()`` (batch 1 only).
    ``max_cache_len``: positions to allocate in the target cache (default: longest prompt + ``max_new_tokens`` +
    the drafter's tree size); too small is an error before anything runs. ``tree_attention``: switch the target
    to the ``specdec_tree`` attention implementation when it supports it (ordinary forwards are unchanged).
    ``acceptance``: ``"exact"`` (default; greedy-identical at temperature 0, lossless when sampling) or
    ``"typical"``: Medusa's typical acceptance with ``posterior_threshold`` / ``posterior_alpha`` — **lossy**: sampled
    output no longer follows the target distribution exactly (at temperature 0 it equals greedy).
    ``packed_linears``: on a CPU, the target's ``nn.Linear`` layers multiply with their weights packed once for
    few-row products (prepared at the first call, :func:`~specdec_ext.models.fast_linear.pack_linears_where_fast`;
    the model is unchanged outside ``generate``; memory: a copy of its weights); ``False`` keeps aten's products.

    Returns ``(tokens, stats)``: prompt + generated tokens in the input's form (a ``[B, P + n]`` tensor padded
    with ``pad_token_id`` (default: the first EOS, else 0) for a 2-D input, a 1-D tensor for a 1-D input, a list of
    1-D tensors for a list) and a :class:`DecodeStats`.

    Every argument error is a ``ValueError`` raised before anything runs (a generation that would reach past a
    sliding attention window: ``NotImplementedError``). A drafter serves one generation at a time: a call with a
    drafter that another generation holds is a ``ValueError`` (one drafter per concurrent generation; the target
    may be shared).
    """
    t_start = time.perf_counter()
    # ---- validate everything once --------------------------------------------------------------------------------
    # (the engine checks the rest — acceptance, packed_linears, its cache against a sliding window — by this name)
    check_target("generate", target)
    if drafter is not None:
        check_drafter("generate", drafter)  # (its max_nodes sizes the cache below)
    if input_ids is None:
        raise ValueError("generate: input_ids is required")
    prompts, form = _prompts(input_ids)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: empty prompt (every prompt needs at least one token)")
    cfg = text_config(target.config)
    for b, p in enumerate(prompts):
        check_token_ids("generate", f"prompt {b}", p, cfg.vocab_size)
    budgets = _budgets(max_new_tokens, len(prompts))
    settings = RequestSettings.of(temperature=temperature, top_k=top_k, top_p=top_p)  # (named errors)
    eos = eos_token_ids("generate", eos_token_id, target)
    B = len(prompts)
    if streamer is not None and B != 1:
        raise ValueError("generate: a streamer needs batch size 1")
    if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
        raise ValueError(f"generate: streamer must have put() and end() (Hugging Face's streamer protocol), got "
                         f"{type(streamer).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generate: generator must be a torch.Generator, got {type(generator).__name__}")
    if seed is not None and not is_int(seed):
        raise ValueError(f"generate: seed must be an integer, got {seed!r}")
    for arg, value in (("pad_token_id", pad_token_id), ("max_cache_len", max_cache_len)):
        if value is not None and not is_int(value):
            raise ValueError(f"generate: {arg} must be an integer, got {value!r}")
    max_nodes = drafter.max_nodes if drafter is not None else 1
    P = max(len(p) for p in prompts)
    needed = max(len(p) + n for p, n in zip(prompts, budgets))
    demand = (f"the longest prompt ({P} tokens) plus max_new_tokens ({max_new_tokens})"
              if isinstance(max_new_tokens, int) else "a prompt plus its max_new_tokens")
    check_positions("generate", demand, needed, getattr(cfg, "max_position_embeddings", None))
    max_len = needed + max_nodes
    if max_cache_len is not None:
        if max_cache_len < max_len:
            raise ValueError(f"generate: max_cache_len = {max_cache_len} is too small: {demand} plus the drafter's "
                             f"tree size ({max_nodes}) needs {max_len} cache positions")
        max_len = max_cache_len
    check_window("generate", target.config, needed + max_nodes - 1)
    param = next(p for p in target.parameters() if p.is_floating_point())
    device = param.device
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    # ---- the engine: every prompt joins at once, one row each --------------------------------------------------
    with Engine(target, drafter, max_batch=B, max_len=max_len, eos_token_id=eos, acceptance=acceptance,
                posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha,
                tree_attention=tree_attention, packed_linears=packed_linears, caller="generate") as engine:
        shared = generator if not settings.greedy else None  # one stream for every row, drawn in row order
        if not settings.greedy and shared is None:
            shared = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2 ** 62, ())))
        ids = [engine.add_request(p, max_new_tokens=n, temperature=float(temperature), top_k=int(top_k),
                                  top_p=float(top_p), generator=shared) for p, n in zip(prompts, budgets)]
        results = {rid: list(p) for rid, p in zip(ids, prompts)}
        if streamer is not None:
            streamer.put(torch.tensor([prompts[0]]))
            for new in TokenStream(engine, ids[0]):
                results[ids[0]].extend(new)
                streamer.put(torch.tensor(new))
            streamer.end()
        while engine.has_unfinished():
            for rid, new, _ in engine.step():
                results[rid].extend(new)
        stats = engine.stats
    stats.batch_size = B
    stats.total_s = time.perf_counter() - t_start
    outs = [torch.tensor(results[rid], dtype=torch.int64) for rid in ids]
    if form == "1d":
        return outs[0], stats
    if form == "list":
        return outs, stats
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    width = max(r.numel() for r in outs)
    result = torch.full((B, width), pad, dtype=torch.int64)
    for b, r in enumerate(outs):
        result[b, : r.numel()] = r
    return result, stats
