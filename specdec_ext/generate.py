"""The decode loop: prefill, then draft -> verify -> accept until EOS or the budget; :class:`DecodeStats`.

::

    prefill(prompt[:-1])                                  # the last prompt token is the first step's root
    while rows are generating:
        tree   = drafter.propose(state, max_depth)        # 1-node tree without a drafter: plain decoding
        logits = tree_forward(target, cache, tree)        # ONE target forward per step
        accepted, accept_len, next_token = verify(logits, tree)   # greedy, or lossless rejection sampling
        cache.accept(accepted, accept_len)                # one compact_kv call for every layer
        emitted = path tokens + next_token  -> host       # the step's ONE device synchronisation
        cut at EOS / budget, append, stream; drafter.observe(...)
        rows that finished: cache.keep_rows(keep), state.keep_rows(keep), drafter.retire(keep)

Every emitted token comes out of a verification: the prompt's last token is not prefilled but is the first root,
so plain decoding (``drafter=None``) is the same loop with 1-node trees — the baseline runs through the same cache,
forward and verification ops as every drafter. Greedy (temperature 0) uses ``ops.verify_tree_greedy``; otherwise
``ops.verify_tree_sampling`` with uniforms from the user's ``torch.Generator`` (lossless whatever the drafts).

Batch. Tensors are ``[B, ...]`` throughout and rows have their own lengths (prompts of different lengths, different
accepted lengths). Rows that finish (EOS or ``max_new_tokens``) are *retired* after the step: the target cache
(:meth:`~specdec_ext.models.TreeKVCache.keep_rows`), the state and the drafter (``Drafter.retire``) keep only the
live rows, one ``index_select`` per tensor, so the next step's drafter and target forwards run on the live rows only
(a finished row would otherwise cost its N tree tokens of target compute, and its drafting, every step until the
last row ends). Which rows finished is known on the host from the step's one read-back, so retiring adds no
synchronisation. Results go back in the caller's row order; ``DecodeStats.row_steps`` counts the live rows of each
step (= the rows of its batch) and ``DecodeStats.retirements`` the compactions. A drafter without ``retire``
(written before it existed) gets the older behaviour: finished rows are frozen — they ride along in the batch until
every row has finished, their results ignored and their cache length held (accept_len = -1).

Budget. A drafter is asked for trees at most ``remaining - 1`` deep (for the row with the most budget left), so it
never works for tokens that cannot be emitted; an accepted run that crosses EOS or the budget is cut there.

Synchronisation. Inputs are validated once up front; inside the loop every op runs with ``validate=False`` and the
host reads one small tensor per step (accepted lengths and emitted tokens), which also feeds host-side drafters
(n-gram) and the streamer. Host values going to the device (kept rows, appended counts, drafters' lengths) are
copied with ``non_blocking=True``, which does not wait for the device. Times in :class:`DecodeStats` are host wall
times per phase; on an asynchronous device the queued work is attributed to the phase that waits for it
(verification, whose read-back ends the step).

Linear layers. The loop runs inside :func:`~specdec_ext.models.fast_linear.packed_linears`, and by default
(``packed_linears=True``) first prepares the target with
:func:`~specdec_ext.models.fast_linear.pack_linears_where_fast`: on a CPU with a packed path for its dtype, its
``nn.Linear`` layers multiply with their weights packed once for few-row products (several times faster than aten
at 1-16 rows), in plain decoding and speculative decoding alike (the draft model's drafter does the same to its
model).
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
import time
from dataclasses import dataclass, field

import torch

from specdec_ext import ops
from specdec_ext.drafters.base import (DecodeState, DraftTree, SamplingParams, StepResult, check_drafter, serving,
                                       to_device)
from specdec_ext.models import TreeKVCache, tree_forward, use_tree_attention
from specdec_ext.models.causal_lm import load_causal_lm
from specdec_ext.models.config import check_window, text_config
from specdec_ext.models.fast_linear import pack_linears_where_fast, packed_linears
from specdec_ext.models.tree_forward import extend_kernel_max_tokens

__all__ = ["DecodeStats", "generate", "load_model"]


@dataclass
class DecodeStats:
    """What a generation did. A *row-step* is one row taking part in one step (B = 1: a step)."""

    batch_size: int = 1
    new_tokens: int = 0  # tokens emitted, all rows
    steps: int = 0  # speculative steps
    target_forwards: int = 0  # target forwards in the decode loop (one per step); the prefill is counted apart
    prefill_forwards: int = 0  # 0 (prompts of one token) or 1
    draft_forwards: int = 0  # draft model forwards (drafters that have a model)
    row_steps: int = 0  # sum over steps of the rows still generating (= rows in the step's batch, when retiring)
    retirements: int = 0  # steps after which finished rows were dropped from the batch
    accept_hist: list[int] = field(default_factory=list)  # [d] = row-steps that accepted d draft tokens
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter.propose + drafter.observe + drafter.retire
    verify_s: float = 0.0  # target forward + verification + cache compaction + the read-back
    bookkeeping_s: float = 0.0  # host work: EOS / budget cuts, context update, streaming
    total_s: float = 0.0  # the whole call

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row-step (= tokens per target forward at B = 1): 1 + mean accepted drafts."""
        return self.new_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """``[d - 1]``: fraction of row-steps that accepted at least d draft tokens, d = 1, 2, ..."""
        total = sum(self.accept_hist)
        out, running = [], total
        for d in range(1, len(self.accept_hist)):
            running -= self.accept_hist[d - 1]
            out.append(running / total if total else 0.0)
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> str:
        loop = self.draft_s + self.verify_s + self.bookkeeping_s
        pct = (lambda x: 100.0 * x / loop) if loop > 0 else (lambda x: 0.0)
        return (f"{self.new_tokens} tokens in {self.total_s:.3f} s: {self.tokens_per_s:.1f} tokens/s | mean accepted "
                f"length {self.mean_accepted_length:.2f} | {self.target_forwards} target forwards (+"
                f"{self.prefill_forwards} prefill) | time: draft {pct(self.draft_s):.0f}% verify "
                f"{pct(self.verify_s):.0f}% bookkeeping {pct(self.bookkeeping_s):.0f}% (prefill "
                f"{self.prefill_s:.3f} s)")


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


def _is_token(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _check_ids_tensor(t: torch.Tensor, what: str) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"generate: {what} must hold integer token ids (e.g. torch.int64), got a tensor of dtype "
                         f"{t.dtype}")


def _prompts(input_ids) -> tuple[list[list[int]], str]:
    """Prompts as lists of ints, and the input form ("1d", "2d" or "list") the output mirrors."""
    if isinstance(input_ids, torch.Tensor):
        _check_ids_tensor(input_ids, "input_ids")
        if input_ids.dim() == 1:
            return [input_ids.tolist()], "1d"
        if input_ids.dim() == 2:
            return input_ids.tolist(), "2d"
        raise ValueError(f"generate: input_ids must be [P] or [B, P], got shape {tuple(input_ids.shape)}")
    if isinstance(input_ids, (list, tuple)):
        if input_ids and all(_is_token(t) for t in input_ids):
            return [[int(t) for t in input_ids]], "1d"
        rows = []
        for b, row in enumerate(input_ids):
            if isinstance(row, torch.Tensor):
                _check_ids_tensor(row, f"input_ids[{b}]")
                if row.dim() != 1:
                    raise ValueError(f"generate: input_ids[{b}] must be a 1-D tensor of token ids, got shape "
                                     f"{tuple(row.shape)}")
                rows.append(row.tolist())
            elif isinstance(row, (list, tuple)) and all(_is_token(t) for t in row):
                rows.append([int(t) for t in row])
            else:
                raise ValueError(f"generate: input_ids[{b}] must be a list of integer token ids or a 1-D integer "
                                 f"tensor, got {_describe(row)}")
        return rows, "list"
    raise ValueError(f"generate: input_ids must be a tensor or a list of prompts, got {type(input_ids).__name__}")


def _describe(value) -> str:
    if isinstance(value, (list, tuple)):
        odd = next((t for t in value if not _is_token(t)), None)
        return f"a {type(value).__name__} holding {odd!r} ({type(odd).__name__})"
    return f"{type(value).__name__} {value!r}"[:120]


def _accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


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


def _eos_list(eos_token_id, target) -> list[int]:
    if eos_token_id is None:
        gc = getattr(target, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        _check_ids_tensor(eos_token_id, "eos_token_id")
        return [int(x) for x in eos_token_id.flatten().tolist()]
    if _is_token(eos_token_id):
        return [int(eos_token_id)]
    if isinstance(eos_token_id, (list, tuple)) and all(_is_token(x) for x in eos_token_id):
        return [int(x) for x in eos_token_id]
    raise ValueError(f"generate: eos_token_id must be a token id, a list of them or None, got {eos_token_id!r}")


def _in_packed_linears_block(fn):
    """Prepares the target's linear layers (``packed_linears=True``, the default) and runs ``fn`` in the block."""
    @functools.wraps(fn)
    def wrapper(target, *args, **kwargs):
        enabled = kwargs.get("packed_linears", True)
        if not isinstance(enabled, bool):
            raise ValueError(f"generate: packed_linears must be True or False, got {enabled!r}")
        if enabled:
            pack_linears_where_fast(target)
        with packed_linears(enabled):
            return fn(target, *args, **kwargs)
    return wrapper


def _one_generation_per_drafter(fn):
    """Checks the target and the drafter, then holds the drafter for the call (``drafters.base.serving``): a
    drafter's state belongs to one generation."""
    @functools.wraps(fn)
    def wrapper(target=None, drafter=None, *args, **kwargs):
        if not isinstance(target, torch.nn.Module) or getattr(target, "config", None) is None:
            raise ValueError(f"generate: target must be a Hugging Face causal LM (a torch.nn.Module with a config), "
                             f"got {type(target).__name__}")
        if drafter is not None:
            check_drafter("generate", drafter)
        with serving(drafter, "generate"):
            return fn(target, drafter, *args, **kwargs)
    return wrapper


@_one_generation_per_drafter
@_in_packed_linears_block
@torch.no_grad()
def generate(target: torch.nn.Module, drafter=None, input_ids=None, *, max_new_tokens: int | list[int] = 32,
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
    if input_ids is None:
        raise ValueError("generate: input_ids is required")
    if acceptance not in ("exact", "typical"):
        raise ValueError(f"generate: acceptance must be 'exact' or 'typical', got {acceptance!r}")
    if acceptance == "typical" and not (0 <= posterior_threshold <= 1 and 0 <= posterior_alpha <= 1):
        raise ValueError(f"generate: posterior_threshold and posterior_alpha must be in [0, 1], got "
                         f"{posterior_threshold}, {posterior_alpha}")
    prompts, form = _prompts(input_ids)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: empty prompt (every prompt needs at least one token)")
    cfg = text_config(target.config)
    V = cfg.vocab_size
    bad = [(b, t) for b, p in enumerate(prompts) for t in p if not 0 <= t < V]
    if bad:
        raise ValueError(f"generate: prompt {bad[0][0]} holds token {bad[0][1]}, outside the target's vocabulary "
                         f"[0, {V})")
    budgets = _budgets(max_new_tokens, len(prompts))
    sampling = SamplingParams(temperature, top_k, top_p)
    sampling.validate()
    eos = _eos_list(eos_token_id, target)
    if any(not 0 <= e < V for e in eos):
        raise ValueError(f"generate: eos_token_id {eos} outside the target's vocabulary [0, {V})")
    B = len(prompts)
    if streamer is not None and B != 1:
        raise ValueError("generate: a streamer needs batch size 1")
    if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
        raise ValueError(f"generate: streamer must have put() and end() (Hugging Face's streamer protocol), got "
                         f"{type(streamer).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generate: generator must be a torch.Generator, got {type(generator).__name__}")
    if seed is not None and not _is_token(seed):
        raise ValueError(f"generate: seed must be an integer, got {seed!r}")
    for arg, value in (("pad_token_id", pad_token_id), ("max_cache_len", max_cache_len)):
        if value is not None and not _is_token(value):
            raise ValueError(f"generate: {arg} must be an integer, got {value!r}")
    max_nodes = drafter.max_nodes if drafter is not None else 1  # checked by _one_generation_per_drafter
    P = max(len(p) for p in prompts)
    needed = max(len(p) + n for p, n in zip(prompts, budgets))
    limit = getattr(cfg, "max_position_embeddings", None)
    demand = (f"the longest prompt ({P} tokens) plus max_new_tokens ({max_new_tokens})"
              if isinstance(max_new_tokens, int) else "a prompt plus its max_new_tokens")
    if limit is not None and needed > limit:
        raise ValueError(f"generate: {demand} needs {needed} positions, which exceeds the target's "
                         f"max_position_embeddings = {limit}")
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
    if tree_attention:
        use_tree_attention(target)

    # ---- state, cache, prefill -------------------------------------------------------------------------------
    buf = torch.zeros(B, max_len, dtype=torch.int64)
    for b, p in enumerate(prompts):
        buf[b, : len(p)] = torch.tensor(p)
    state = DecodeState(tokens=buf.to(device), lengths=torch.tensor([len(p) for p in prompts], device=device),
                        host_tokens=[list(p) for p in prompts], prompt_lens=[len(p) for p in prompts],
                        done=[False] * B, max_len=max_len, sampling=sampling, generator=generator, vocab_size=V)
    stats = DecodeStats(batch_size=B, accept_hist=[0] * max_nodes)
    cache = TreeKVCache(target.config, B, max_len, dtype=param.dtype, device=device)
    layers = tuple(drafter.hidden_state_layers) if drafter is not None else ()
    hidden_kwargs = {"output_hidden_states": True, "return_outputs": True} if layers else {}
    prefill_hidden = None
    if streamer is not None:
        streamer.put(torch.tensor([prompts[0]]))
    t0 = time.perf_counter()
    if P > 1:  # everything but each prompt's last token (the first root); its logits are not needed
        T = P - 1
        extra = {"logits_to_keep": 1} if _accepts(target, "logits_to_keep") else {}
        out = tree_forward(target, cache, state.tokens[:, :T], None, 0,
                           use_kernel=False if T > extend_kernel_max_tokens(device) else None, validate=False,
                           **hidden_kwargs, **extra)
        if layers:
            prefill_hidden = tuple(out.hidden_states[i] for i in layers)
        stats.prefill_forwards = 1
    cache.rewind(state.prefix_lens)
    if drafter is not None:
        drafter.begin(target, state, prefill_hidden)
    stats.prefill_s = time.perf_counter() - t0
    generated = [0] * B
    # Retire finished rows (see the module doc) unless the drafter cannot follow (no ``retire``: frozen rows).
    retiring = drafter is None or callable(getattr(drafter, "retire", None))
    rows = list(range(B))  # original row of each batch position
    results: list[list[int] | None] = [None] * B  # finished rows' tokens, in the original order

    # ---- the loop ---------------------------------------------------------------------------------------------
    while not all(state.done):
        t0 = time.perf_counter()
        Bs = len(rows)  # rows in this step's batch (B minus the retired rows)
        budget = max(budgets[b] - generated[b] for b in range(Bs) if not state.done[b])
        if drafter is None:
            tree = DraftTree(state.last_tokens[:, None], torch.full((Bs, 1), -1, dtype=torch.int64, device=device))
        else:
            tree = drafter.propose(state, budget - 1)
        t1 = time.perf_counter()
        N = tree.tokens.shape[1]
        prefix = state.prefix_lens
        out = tree_forward(target, cache, tree.tokens, tree.parents, prefix, validate=False, **hidden_kwargs)
        logits = out.logits if layers else out
        if sampling.greedy:
            v = ops.verify_tree_greedy(logits, tree.tokens, tree.parents, validate=False)
        elif acceptance == "typical":
            v = ops.verify_tree_typical(logits, tree.tokens, tree.parents, state.uniforms(Bs), sampling.temperature,
                                        posterior_threshold, posterior_alpha, validate=False)
        else:
            v = ops.verify_tree_sampling(logits, tree.tokens, tree.parents, state.uniforms(Bs, N), tree.draft_probs,
                                         sampling.temperature, sampling.top_k, sampling.top_p, validate=False)
        if any(state.done):  # frozen rows (only with a drafter without retire): hold their cache
            accept_len = torch.where(to_device(state.done, device, torch.bool), -1, v.accept_len)
        else:
            accept_len = v.accept_len
        cache.accept(v.accepted, accept_len, prefix, validate=False)
        path = tree.tokens.gather(1, v.accepted.clamp(min=0))  # [B, N] accepted path tokens, root first
        j = torch.arange(N, device=device)
        emitted = torch.where(j == v.accept_len[:, None], v.next_token[:, None],
                              torch.cat([path[:, 1:], v.next_token[:, None]], 1))  # [B, N], first accept_len + 1
        host = torch.cat([v.accept_len[:, None], emitted], 1).tolist()  # the step's one synchronisation
        stats.target_forwards += 1
        t2 = time.perf_counter()

        appended = [0] * Bs
        for b in range(Bs):
            if state.done[b]:
                continue
            a = host[b][0]
            new = host[b][1: a + 2][: budgets[b] - generated[b]]
            for i, t in enumerate(new):
                if t in eos:
                    new = new[: i + 1]
                    state.done[b] = True
                    break
            state.host_tokens[b].extend(new)
            appended[b] = len(new)
            generated[b] += len(new)
            if generated[b] >= budgets[b]:
                state.done[b] = True
            stats.accept_hist[a] += 1
            stats.row_steps += 1
            stats.new_tokens += len(new)
        n_app = to_device(appended, device)
        pos = state.lengths[:, None] + j
        state.tokens.scatter_(1, pos, torch.where(j < n_app[:, None], emitted, state.tokens.gather(1, pos)))
        state.lengths = state.lengths + n_app
        state.step += 1
        stats.steps += 1
        if streamer is not None and appended[0]:
            streamer.put(torch.tensor(state.host_tokens[0][-appended[0]:]))
        t3 = time.perf_counter()
        if drafter is not None:
            drafter.observe(state, tree, StepResult(v.accepted, accept_len, v.next_token, appended,
                                                    tuple(out.hidden_states[i] for i in layers) if layers else None))
        t4 = time.perf_counter()
        if retiring and any(state.done) and not all(state.done):  # retire the rows that finished this step
            # the live rows, each finished row's slot below B' taken by a live row from the end: rows that keep
            # their slot cost the caches nothing (TreeKVCache.keep_rows moves only the others)
            n_live = sum(not d for d in state.done)
            tail = iter([b for b in range(n_live, Bs) if not state.done[b]])
            keep_host = [next(tail) if state.done[b] else b for b in range(n_live)]
            for b in range(Bs):
                if state.done[b]:
                    results[rows[b]] = state.host_tokens[b]
            keep = torch.tensor(keep_host, dtype=torch.int64)  # host values: caches and drafters read them, no sync
            keep_dev = keep.to(device, non_blocking=True)
            cache.keep_rows(keep)
            state.keep_rows(keep_dev, keep_host)
            rows = [rows[b] for b in keep_host]
            generated = [generated[b] for b in keep_host]
            budgets = [budgets[b] for b in keep_host]
            t5 = time.perf_counter()
            if drafter is not None:
                drafter.retire(keep)
            t6 = time.perf_counter()
            stats.retirements += 1
            stats.draft_s += t6 - t5
            stats.bookkeeping_s += t5 - t4
        stats.draft_s += (t1 - t0) + (t4 - t3)
        stats.verify_s += t2 - t1
        stats.bookkeeping_s += t3 - t2

    if streamer is not None:
        streamer.end()
    stats.draft_forwards = int(getattr(drafter, "forwards", 0) or 0)
    stats.total_s = time.perf_counter() - t_start
    for b, r in enumerate(rows):
        results[r] = state.host_tokens[b]
    outs = [torch.tensor(t, dtype=torch.int64) for t in results]
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
