"""The decode engine (:class:`Engine`): serving code adds requests, steps, aborts; rows join and leave between steps.

::

    engine = Engine(target, drafter, max_batch=8, max_len=512, tokenizer=tok)
    rid = engine.add_request(prompt_ids, max_new_tokens=64, temperature=0.7, seed=1, stop=["\\n\\n"])
    while engine.has_unfinished():
        for request_id, new_tokens, finish_reason in engine.step():
            text = engine.take_text(request_id)  # its new text (stop strings cut; undecided ends held back)

One step (:meth:`Engine.step`)::

    leave(aborted rows); join(queued requests)            # prefill of the joining rows alone, then appended
    tree   = drafter.propose(state, max_depth, max_nodes)  # a 1-node tree without a drafter: plain decoding
    logits = tree_forward(target, cache, tree)            # ONE target forward for every row
    v      = verify(logits, tree, state)                  # per row: greedy, lossless sampling or typical
    cache.accept(v.accepted, v.accept_len)                # one compact_kv call for every layer
    emit: read back (the step's one synchronisation), cut at stop tokens / budget / stop strings, state += tokens
    drafter.observe(...); leave(finished rows)

Every emitted token comes out of a verification: a prompt's last token is not prefilled but is its first root, so
plain decoding is the same loop with 1-node trees.

Joining. Requests wait in a FIFO queue (:class:`~specdec_ext.engine.scheduler.Scheduler`) and join when rows are
free. The joining rows' prefill runs alone, as a batch of its own (or, where their prompts' lengths differ widely,
as batches of similar lengths, the rows reordered by them: :func:`~specdec_ext.engine.scheduler.prefill_groups`,
since one forward pads its rows to its longest), each into a cache of its own (sized to its prompts), whose rows
are then appended to the running cache (:meth:`~specdec_ext.models.TreeKVCache.add_rows`); the drafter gains the
rows (``Drafter.add_rows``, or ``begin`` when the batch was empty) and the rows take part in the same step. A
prefill chunked into the decoding rows' forwards would take one N-token chunk a step (the forward's rows share one
node count) and, on a compute-bound CPU, save little of the compute while delaying the first token by P / N steps
(measured: docs/ARCHITECTURE.md, "Rows join").

Leaving. Finished and aborted rows leave after the step in which they ended (aborted ones before the next step's
work): the target cache, the state and the drafter keep the live rows (``keep_rows`` / ``Drafter.retire``), so they
cost nothing in later steps.

Budget. A greedy row needs no draft past its budget (``remaining - 1`` deep); a sampled row gets the drafter's full
depth whatever its budget, since its tree — and so its random stream — must not depend on its neighbours' budgets,
or a seeded request's tokens would depend on its batch. Tokens past a row's budget are dropped.

The target. Where a direct-call route reproduces it (:func:`~specdec_ext.models.step_ops.build_step_ops`, built once
with the engine, so it serves the weights and hooks the target has then), the engine runs that instead of its
modules, for every tree and every prefill of up to :func:`~specdec_ext.models.tree_forward.extend_kernel_max_tokens`
tokens: plain Llama / Mistral / Qwen2 layers on a CPU as one ``draft_decoder_layer`` call a layer instead of the
modules' ~40 small calls (:class:`~specdec_ext.models.llama_step.LlamaStepOps`), a MiniMax hybrid as the module
route's own calls without the module tree (:class:`~specdec_ext.models.minimax_step.MiniMaxStepOps`). Elsewhere
(CUDA for Llama, other architectures, hooks, ``packed_linears=False`` or ``tree_attention=False``) the modules run.

Synchronisation. Inside a step every op runs with ``validate=False``; the host reads one small tensor per step
(accepted lengths and emitted tokens). Times in :attr:`Engine.stats` are host wall times per phase.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from specdec_ext.drafters.base import check_drafter, serving, to_device
from specdec_ext.engine.limits import (check_id_tensor, check_positions, check_target, check_token_ids,
                                       eos_token_ids, is_int)
from specdec_ext.engine.request import Request
from specdec_ext.engine.scheduler import Scheduler, prefill_groups
from specdec_ext.engine.settings import RequestSettings
from specdec_ext.engine.stats import DecodeStats
from specdec_ext.engine.stop_strings import TextStops
from specdec_ext.engine.verify import Verifier
from specdec_ext.models import TreeKVCache, make_cache, tree_forward, use_tree_attention
from specdec_ext.models.config import check_window, forward_accepts, text_config
from specdec_ext.models.fast_linear import pack_linears_where_fast, packed_linears
from specdec_ext.models.step_ops import build_step_ops
from specdec_ext.models.tree_forward import extend_kernel_max_tokens
from specdec_ext.state import DecodeState, SamplingParams, StepResult, plain_tree

__all__ = ["Engine"]

Event = tuple[int, list[int], "str | None"]


def prompt_list(prompt_ids, where: str = "add_request") -> list[int]:
    """A prompt (a list of ints or a 1-D integer tensor) as a non-empty list of ints, or a ValueError."""
    if isinstance(prompt_ids, torch.Tensor):
        check_id_tensor(where, "prompt_ids", prompt_ids)
        if prompt_ids.dim() != 1:
            raise ValueError(f"{where}: prompt_ids must be a 1-D tensor (one prompt), got shape "
                             f"{tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)) or not all(is_int(t) for t in prompt_ids):
        raise ValueError(f"{where}: prompt_ids must be a list of integer token ids or a 1-D integer tensor, got "
                         f"{type(prompt_ids).__name__}")
    if not prompt_ids:
        raise ValueError(f"{where}: prompt_ids is empty (a prompt needs at least one token)")
    return [int(t) for t in prompt_ids]


class Engine:
    """Continuous-batching speculative decoding of ``target`` (an HF causal LM) with ``drafter`` (None: plain).

    ``max_batch``: rows decoded together (more requests queue). ``max_len``: cache positions per row (a request
    needs its prompt + ``max_new_tokens`` + the drafter's tree size; default: the target's
    ``max_position_embeddings``). ``tokenizer``: detokenizes every request's output (:meth:`take_text`); needed by
    requests with stop strings. ``eos_token_id``: ids that end every request (default: the target's
    ``generation_config``; ``[]``: none). ``acceptance`` / ``posterior_threshold`` / ``posterior_alpha``:
    :mod:`~specdec_ext.engine.verify`. ``tree_attention``: switch the target to the ``specdec_tree`` attention
    implementation. ``packed_linears``: the target's linear layers multiply with packed weights where that is
    faster (CPU).

    The engine holds ``drafter`` until :meth:`close` (or the end of a ``with`` block): one engine per drafter.
    ``caller``: the name the errors of the engine's creation start with (a wrapper such as ``generate`` passes its
    own). ``make_cache``: the cache constructor, called as :func:`specdec_ext.models.make_cache` (the default) is,
    for the batch's cache and each join's prefill cache: another way of keeping a hybrid target's states, such as
    the hybrid benchmark's baselines (:mod:`specdec_ext.bench.state_baselines`).
    """

    def __init__(self, target: torch.nn.Module, drafter=None, *, max_batch: int = 8, max_len: int | None = None,
                 tokenizer=None, eos_token_id=None, acceptance: str = "exact", posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, tree_attention: bool = True, packed_linears: bool = True,
                 caller: str = "Engine", make_cache: Callable[..., TreeKVCache] = make_cache):
        t_start = time.perf_counter()
        check_target(caller, target)
        if drafter is not None:
            check_drafter(caller, drafter)
        if not is_int(max_batch) or max_batch < 1:
            raise ValueError(f"{caller}: max_batch must be an integer >= 1, got {max_batch!r}")
        cfg = text_config(target.config)
        self.vocab_size = V = cfg.vocab_size
        self.max_nodes = drafter.max_nodes if drafter is not None else 1
        self.position_limit = getattr(cfg, "max_position_embeddings", None)
        if max_len is None:
            if self.position_limit is None:
                raise ValueError(f"{caller}: max_len is required (the target's config has no max_position_embeddings)")
            max_len = self.position_limit + self.max_nodes
        if not is_int(max_len) or max_len < self.max_nodes + 1:
            raise ValueError(f"{caller}: max_len must be an integer >= {self.max_nodes + 1} (one prompt token, one new "
                             f"token and the drafter's tree of {self.max_nodes} nodes), got {max_len!r}")
        if not isinstance(packed_linears, bool):
            raise ValueError(f"{caller}: packed_linears must be True or False, got {packed_linears!r}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"{caller}: tokenizer must have a decode() method (a Hugging Face tokenizer), got "
                             f"{type(tokenizer).__name__}")
        self.eos = eos_token_ids(caller, eos_token_id, target)
        self.verify = Verifier(acceptance, self.max_nodes, posterior_threshold, posterior_alpha, where=caller)
        check_window(caller, target.config, max_len - 1)
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.max_batch, self.max_len = int(max_batch), int(max_len)
        param = next(p for p in target.parameters() if p.is_floating_point())
        self.device, self.dtype = param.device, param.dtype
        if tree_attention:
            use_tree_attention(target)
        self.packed = packed_linears
        if packed_linears:
            pack_linears_where_fast(target)
        self._hold = contextlib.ExitStack()
        self._hold.enter_context(serving(drafter, caller))
        self.layers = tuple(drafter.hidden_state_layers) if drafter is not None else ()
        self._hidden_kwargs = {"output_hidden_states": True, "return_outputs": True, "hidden_layers": self.layers} \
            if self.layers else {}
        self._logits_to_keep = {"logits_to_keep": 1} if forward_accepts(target, "logits_to_keep") else {}
        self.make_cache = make_cache
        self.cache = make_cache(target.config, 0, self.max_len, dtype=self.dtype, device=self.device,
                                capacity=self.max_batch)
        with torch.no_grad():  # the target's layers as op calls where they serve it (CPUs; see "The target")
            self.target_ops = build_step_ops(target, self.cache) if packed_linears and tree_attention else None
        self.scheduler = Scheduler(self.max_batch)
        self.state: DecodeState | None = None
        self.requests: dict[int, Request] = {}  # unfinished requests (running or queued) by id
        self._next_id = 0
        self._events: list[Event] = []  # aborts, reported by the next step
        self._aborted: list[Request] = []  # their requests (take_text answers for them after that step)
        self._ended: dict[int, Request] = {}  # requests that ended in the last step (see take_text)
        self.stats = DecodeStats(batch_size=0, accept_hist=[0] * self.max_nodes)
        self._t_start = t_start

    # ---- the interface --------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids, settings: RequestSettings | None = None, **kwargs) -> int:
        """Queues a request (``settings``, or the :class:`RequestSettings` fields as keywords); returns its id."""
        s = RequestSettings.of(settings, **kwargs)
        prompt = prompt_list(prompt_ids)
        check_token_ids("add_request", "prompt_ids", prompt, self.vocab_size)
        check_token_ids("add_request", "stop_token_ids", s.stop_token_ids, self.vocab_size)
        needed = len(prompt) + s.max_new_tokens
        check_positions("add_request", f"prompt_ids ({len(prompt)} tokens) plus max_new_tokens ({s.max_new_tokens})",
                        needed, self.position_limit)
        if needed + self.max_nodes > self.max_len:
            raise ValueError(f"add_request: prompt_ids ({len(prompt)} tokens) plus max_new_tokens "
                             f"({s.max_new_tokens}) plus the drafter's tree ({self.max_nodes}) needs "
                             f"{needed + self.max_nodes} positions, more than the engine's max_len = {self.max_len}")
        if s.stop and self.tokenizer is None:
            raise ValueError("add_request: stop strings need the engine's tokenizer (Engine(..., tokenizer=...))")
        rid = self._next_id
        self._next_id += 1
        stop_ids = frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else frozenset(self.eos))
        text = TextStops(self.tokenizer, s.stop, prompt) if self.tokenizer is not None else None
        request = Request(rid, prompt, s, stop_ids, s.make_generator(self.device), text)
        self.requests[rid] = request
        self.scheduler.add(request)
        return rid

    def abort(self, request_id: int) -> None:
        """Ends a request: a queued one leaves the queue, a running one leaves the batch before the next step's
        work. Either way the next :meth:`step` reports ``(request_id, [], "abort")``. A finished request: nothing to
        do. An id this engine never gave out is a ValueError."""
        if not is_int(request_id) or not 0 <= request_id < self._next_id:
            raise ValueError(f"abort: unknown request_id {request_id!r} (this engine gave out ids 0 .. "
                             f"{self._next_id - 1})")
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return
        request.finish_reason = "abort"
        self.scheduler.drop_waiting(request)  # (a running one leaves at the next retirement)
        self._events.append((request_id, [], "abort"))
        self._aborted.append(request)

    def has_unfinished(self) -> bool:
        """Whether some request is running or queued, or an abort waits to be reported by the next :meth:`step`
        (so that a ``while engine.has_unfinished(): engine.step()`` loop sees every abort)."""
        return bool(self.requests) or bool(self._events)

    def take_text(self, request_id: int) -> str:
        """The text that ``request_id``'s output added since the last call (needs the engine's tokenizer): decoded
        incrementally, cut before a stop string, and holding back an end that could still begin one until a later
        token rules it out or the request ends (the OpenAI API's rule). For an unfinished request, and for one that
        ended in the step just returned (its last piece), until the next :meth:`step`."""
        request = self.requests.get(request_id) or self._ended.get(request_id)
        if request is None:
            raise ValueError(f"take_text: request_id {request_id!r} is neither unfinished nor ended in the last step")
        if request.text is None:
            raise ValueError("take_text: the engine has no tokenizer (Engine(..., tokenizer=...))")
        return request.text.take(final=request.finished)

    def step(self) -> list[Event]:
        """Admits queued requests into free rows, runs one speculative step over the batch, and returns
        ``[(request id, new token ids, finish reason or None)]`` for every request that emitted or ended."""
        events, self._events = self._events, []
        self._ended = {r.id: r for r in self._aborted}
        self._aborted = []
        with packed_linears(self.packed), torch.no_grad():
            self._leave()
            self._join()
            if self.state is not None:
                events += self._step()
                self._leave()
        self.stats.total_s = time.perf_counter() - self._t_start
        return events

    def close(self) -> None:
        """Lets the drafter go (another engine or generation may use it)."""
        self._hold.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the step -------------------------------------------------------------------------------------------------
    def _step(self) -> list[Event]:
        st, stats, drafter, rows = self.state, self.stats, self.drafter, self.scheduler.running
        t0 = time.perf_counter()
        tree = drafter.propose(st, self._draft_depth(rows), drafter.max_nodes) if drafter is not None else \
            plain_tree(st.last_tokens)
        t1 = time.perf_counter()
        prefix = st.prefix_lens
        out = tree_forward(self.target, self.cache, tree.tokens, tree.parents, prefix, validate=False,
                           tables=tree.tables, step_ops=self.target_ops, shallow=tree.shallow, **self._hidden_kwargs)
        v = self.verify(out.logits if self.layers else out, tree, st)
        self.cache.accept(v.accepted, v.accept_len, prefix, validate=False)
        emitted, host = self._read_back(tree, v)
        t2 = time.perf_counter()
        events, appended = [], []
        accept_lens = [h[0] for h in host]
        for b, r in enumerate(rows):
            new = r.emit(host[b][1: host[b][0] + 2])
            st.host_tokens[b].extend(new)
            st.done[b] = r.finished
            st.budgets[b] = r.remaining
            appended.append(len(new))
            events.append((r.id, new, r.finish_reason))
            if r.finished:
                self._ended[r.id] = self.requests.pop(r.id)
            stats.accept_hist[accept_lens[b]] += 1
        self._advance(emitted, appended)
        t3 = time.perf_counter()
        if drafter is not None:
            drafter.observe(st, tree, StepResult(v.accepted, v.accept_len, v.next_token, appended,
                                                 tuple(out.hidden_states[i] for i in self.layers) or None,
                                                 host_accept_len=accept_lens))
        t4 = time.perf_counter()
        stats.steps += 1
        stats.target_forwards += 1
        stats.row_steps += len(rows)
        stats.new_tokens += sum(appended)
        own = tree.row_nodes or [tree.num_nodes] * len(rows)  # (each row's own nodes, root included)
        stats.draft_tokens += sum(own) - len(own)
        stats.drafts += sum(1 for n in own if n > 1)
        stats.draft_forwards = int(drafter.forwards) if drafter is not None else 0
        stats.draft_s += (t1 - t0) + (t4 - t3)
        stats.verify_s += t2 - t1
        stats.bookkeeping_s += t3 - t2
        return events

    def _draft_depth(self, rows: list[Request]) -> int:
        """How deep the step's trees may go: a greedy row needs no draft past its budget; a sampled row gets the
        drafter's full depth whatever its budget, since its tree (and so its random stream) must not depend on the
        rows beside it (see "Budget" in the module doc)."""
        full = self.drafter.max_depth
        return max(min(r.remaining - 1, full) if r.settings.greedy else full for r in rows)

    def _read_back(self, tree, v) -> tuple[torch.Tensor, list[list[int]]]:
        """Each row's accepted path tokens after the root then the next token (``[B, N]``, the first
        ``accept_len + 1`` meaningful), and on the host ``[accept_len, tokens...]`` per row: the step's one
        synchronisation."""
        N = tree.num_nodes
        path = tree.tokens.gather(1, v.accepted.clamp(min=0))  # [B, N] accepted path tokens, root first
        j = torch.arange(N, device=self.device)
        emitted = torch.where(j == v.accept_len[:, None], v.next_token[:, None],
                              torch.cat([path[:, 1:], v.next_token[:, None]], 1))
        return emitted, torch.cat([v.accept_len[:, None], emitted], 1).tolist()

    def _advance(self, emitted: torch.Tensor, appended: list[int]) -> None:
        """The state takes each row's first ``appended[b]`` emitted tokens."""
        st = self.state
        j = torch.arange(emitted.shape[1], device=self.device)
        n = to_device(appended, self.device)
        pos = st.lengths[:, None] + j
        st.tokens.scatter_(1, pos, torch.where(j < n[:, None], emitted, st.tokens.gather(1, pos)))
        st.lengths = st.lengths + n
        st.step += 1

    # ---- rows joining and leaving ---------------------------------------------------------------------------------
    def _join(self) -> None:
        """Queued requests take the free rows: their prefill alone, then their rows join the cache, the drafter and
        the state."""
        joining = self.scheduler.admit()
        if not joining:
            return
        t0 = time.perf_counter()
        groups = prefill_groups([len(r.prompt) - 1 for r in joining])
        if len(groups) > 1:  # the rows in their groups' order (each group's rows are appended together)
            self.scheduler.reorder_admitted([i for g in groups for i in g])
        for group in groups:
            self._prefill([joining[i] for i in group])
        self.stats.joins += 1
        self.stats.batch_size = max(self.stats.batch_size, self.state.batch_size)
        self.stats.prefill_s += time.perf_counter() - t0

    def _prefill(self, joining: list[Request]) -> None:
        """``joining``'s rows (the last admitted, in order): their prefill alone, then their rows join."""
        rows = self._rows_of(joining)
        T = max(rows.prompt_lens) - 1  # everything but each prompt's last token (its first root)
        # a cache that holds the prompts only: the join copies T slots a row, not max_len
        cache = self.make_cache(self.target.config, len(joining), max(T, 1), dtype=self.dtype, device=self.device)
        hidden = None
        if T > 0:
            out = tree_forward(self.target, cache, rows.tokens[:, :T], None, 0, validate=False,
                               use_kernel=False if T > extend_kernel_max_tokens(self.device) else None,
                               step_ops=self.target_ops, **self._hidden_kwargs, **self._logits_to_keep)
            if self.layers:
                hidden = tuple(out.hidden_states[i] for i in self.layers)
            self.stats.prefill_forwards += 1
        cache.rewind(rows.prefix_lens)
        self.cache.add_rows(cache)
        if self.state is None:
            self.state = rows
            if self.drafter is not None:
                self.drafter.begin(self.target, rows, hidden)
        else:
            if self.drafter is not None:
                self.drafter.add_rows(self.target, rows, hidden)
            self.state.append(rows)

    def _rows_of(self, requests: list[Request]) -> DecodeState:
        """The decode state of ``requests`` alone (their prompts, sampling and generators)."""
        s = [r.settings for r in requests]
        sampling = SamplingParams.rows([x.temperature for x in s], [x.top_k for x in s], [x.top_p for x in s],
                                       self.device)
        return DecodeState.of_prompts([r.prompt for r in requests], self.max_len, self.vocab_size, self.device,
                                      sampling, [r.generator for r in requests], target_cache=self.cache,
                                      budgets=[r.remaining for r in requests])

    def _leave(self) -> None:
        """Finished and aborted rows leave the cache, the state and the drafter (see the module doc)."""
        keep = self.scheduler.retire()
        if keep is None:
            return
        t0 = time.perf_counter()
        keep_t = torch.tensor(keep, dtype=torch.int64)  # host values: caches and drafters read them, no sync
        self.cache.keep_rows(keep_t)
        if not keep:
            self.state = None
        else:
            self.state.keep_rows(keep_t.to(self.device, non_blocking=True), keep)
        t1 = time.perf_counter()
        if self.drafter is not None:  # (with no row left too: the drafter holds nothing for rows that are gone)
            self.drafter.retire(keep_t)
        self.stats.draft_s += time.perf_counter() - t1
        self.stats.retirements += 1
        self.stats.bookkeeping_s += time.perf_counter() - t0
