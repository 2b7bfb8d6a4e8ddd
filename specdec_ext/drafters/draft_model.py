"""Draft-model drafter: a smaller Hugging Face causal LM with the target's tokenizer drafts a chain of k tokens.

Each step the draft model first catches up on the context tokens its own cache lacks (usually 1 or 2: the tokens the
target accepted or corrected last step; the whole prompt at the first step, or after a deferred prefill; one more per
plain step skipped), then samples k tokens one at a time
with :func:`specdec_ext.ops.sample_tokens` under the generation's temperature / top-k / top-p (argmax when greedy),
feeding each back. The draft probabilities (float32 ``[B, k + 1, V]``, row i = the distribution of token i + 1) go to
lossless verification; greedy verification needs none. The draft's last token is never fed: k drafts cost k draft
forwards.

Cache. The draft model has its own :class:`~specdec_ext.models.TreeKVCache` with per-row lengths. After
verification the rows keep the context prefix the cache already holds correctly: the old context plus the accepted
drafts it fed (``min(accepted, k - 1)``), never the whole context (at least the newest token is pending, so that the
next step has logits to draft from). Rejected entries are simply overwritten: rolling back is setting a length.
The catch-up is one forward over the longest lag T: each row feeds the last T tokens of its context, recomputing the
entries before its own lag (the same tokens at the same positions) rather than writing padding after its context,
so rows that joined at different times (a joining row's lag is its prompt) fit in a cache of the context's size.

Top-k tree (``tree_width = w > 1``). The root gets the draft's top-w tokens as children and each of them grows a
greedy (argmax) chain, to depth k: ``N = 1 + w * k`` nodes, in level order (node ``(d - 1) * w + i`` is branch i at
depth d). Each level is drafted by one tree forward over the root and every node so far (the draft model's tree
forward writes a tree's nodes right after the prefix, so a level's nodes cannot attend to tree nodes written by an
earlier forward; recomputing the small tree is the simple correct choice). After verification
:meth:`~specdec_ext.models.TreeKVCache.accept` moves the accepted path's K/V into place, as for the target. The
drafts are deterministic (``draft_probs = None``), which lossless verification accepts as they are, so the tree
also serves sampling (with the acceptance of deterministic drafts; i.i.d. sampled siblings are not implemented).

Dynamic tree (``total_tokens = M`` with ``tree_width = w > 1``): EAGLE-2's tree
(:func:`specdec_ext.drafters.dynamic_tree.grow_dynamic_tree`) from the draft model's own probabilities: depth k, the
top-w children of the w best frontier nodes scored at each level (one forward of w tokens per level, through
:func:`~specdec_ext.models.masked_forward`), and the M best candidates by cumulative probability verified, under
calibrated scores (``calibrate``; :class:`~specdec_ext.drafters.dynamic_tree.ScoreCalibration`). The tree's K/V are
scratch: the next step's catch-up feeds the accepted tokens. Deterministic drafts, as above.

Forwards go through :func:`~specdec_ext.models.tree_forward` with ``validate=False`` and per-row prefix lengths
kept on the host (the loop reads its results once per step), so the drafter adds no device synchronisation. On CPUs
a Llama, Mistral or Qwen2 draft model runs its chains, catch-ups and dynamic-tree levels as op calls instead
(:class:`~specdec_ext.models.llama_step.LlamaStepOps`, built at a generation's first :meth:`propose`: one
``draft_decoder_layer`` op per layer, ~0.45 ms a forward for the family's draft LM where its Hugging Face forward took
~1 ms); its logits agree with the Hugging Face forward's to the dtype's rounding, and sampled drafts carry the
probabilities they were drawn from, so verification stays lossless.
"""

from __future__ import annotations

import copy

import torch

from specdec_ext import ops
from specdec_ext.drafters.base import (all_unsure, check_confidence_threshold, check_vocab, sample_drafts,
                                       to_device)
from specdec_ext.drafters.dynamic_tree import (CalibratedScores, ScoreCalibration, check_tree_shape, grow_dynamic_tree,
                                               max_tree_nodes)
from specdec_ext.models import TreeKVCache, masked_forward, tree_forward, use_tree_attention
from specdec_ext.models.config import check_window, forward_accepts, text_config
from specdec_ext.models import draft_layer
from specdec_ext.models.fast_linear import pack_linears, packed_linears
from specdec_ext.models.quantized import check_draft_quant, quantize_weights
from specdec_ext.models.llama_step import LlamaStepOps
from specdec_ext.models.tree_forward import extend_kernel_max_tokens
from specdec_ext.state import DecodeState, DraftTree, StepResult, plain_tree


def _param(model: torch.nn.Module) -> torch.Tensor:
    return next(p for p in model.parameters() if p.is_floating_point())


class DraftModelDrafter(CalibratedScores):
    """Chain drafts of ``num_draft_tokens`` tokens from ``model`` (see the module doc).

    ``tree_width``: 1 = a chain; w > 1 = the top-k tree of the module doc (``1 + w * k`` nodes), or with
    ``total_tokens`` the dynamic tree (depth ``num_draft_tokens``, ``total_tokens`` drafts; ``calibrate`` /
    ``calibration_rate`` as for :class:`~specdec_ext.drafters.EagleDrafter`, :attr:`score_scale` the current scale).
    ``tree_attention``: switch the draft model to the ``specdec_tree`` attention implementation when it supports
    transformers' attention interface (ordinary forwards are unchanged).
    ``confidence_threshold`` (chains; 0 = off): stop drafting once every row's newest draft had a probability below
    it under the draft's own distribution (greedy: its softmax maximum; sampling: the sampled token's probability).
    That token is still proposed, but no forward is spent on drafts after it, which are mostly rejected: longer
    chains then cost little where the draft is unsure (Hugging Face's ``assistant_confidence_threshold``). Stopping
    depends on the draft alone, so verification stays lossless. Each check reads one value back: a device
    synchronisation per draft token on a GPU.
    ``packed_linears``: the draft model's ``nn.Linear`` layers draft with their weights packed once for few-row
    products (:func:`specdec_ext.models.fast_linear.pack_linears`; float32 / bfloat16 on CPU, elsewhere
    unchanged); other callers of the model are unaffected. ``draft_quant="int8"``: the draft model (quantised in
    place: its float weights are released) drafts on int8 weights
    (:func:`~specdec_ext.models.quantized.quantize_weights`), its layers still one op call each on CPUs.
    """

    hidden_state_layers: tuple[int, ...] = ()
    defers_prefill = True
    serves_row_subsets = True

    def __init__(self, model: torch.nn.Module, num_draft_tokens: int = 4, tree_width: int = 1,
                 tree_attention: bool = True, confidence_threshold: float = 0.0, total_tokens: int | None = None,
                 calibrate: bool = True, calibration_rate: float = 0.2, packed_linears: bool = True,
                 draft_quant: str | None = None):
        check_tree_shape("DraftModelDrafter", num_draft_tokens, tree_width, 1 if total_tokens is None else total_tokens,
                         names=("num_draft_tokens", "tree_width", "total_tokens"))
        if total_tokens is not None and tree_width < 2:
            raise ValueError(f"DraftModelDrafter: total_tokens makes a dynamic tree, which needs tree_width >= 2 "
                             f"(got {tree_width}; a chain drafts num_draft_tokens tokens)")
        self.dynamic = total_tokens is not None
        self.total_tokens = total_tokens
        self.calibrate = bool(calibrate)
        self.calibration = ScoreCalibration(calibration_rate, "DraftModelDrafter")
        self.confidence_threshold = check_confidence_threshold("DraftModelDrafter", confidence_threshold, tree_width)
        self.draft_quant = check_draft_quant("DraftModelDrafter", draft_quant)
        self.model = model.eval() if self.draft_quant is None else quantize_weights(model.eval(), self.draft_quant)
        self.k = self.max_depth = num_draft_tokens
        self.width = tree_width
        self.max_nodes = (max_tree_nodes(num_draft_tokens, tree_width, total_tokens) if self.dynamic
                          else 1 + tree_width * num_draft_tokens)
        self.tree_attention = tree_attention
        self.packed_linears = bool(packed_linears)
        self.cache: TreeKVCache | None = None
        # the draft model as op calls for this generation (None: its Hugging Face forward), built at its first propose
        self._ops: LlamaStepOps | None = None
        self._ops_built = False
        self.forwards = 0  # draft model forwards in the current generation

    @classmethod
    def from_target(cls, target: torch.nn.Module, draft_quant: str = "int8", **kwargs) -> "DraftModelDrafter":
        """The target on int8 (or int4: ``draft_quant="int4"``) weights as its own draft model (QSpec-style
        self-speculation): nothing to train and nothing on disk; memory: the quantised weights, a quarter (an
        eighth) of the target's float32 bytes. The draft is a copy of
        the target's modules that shares its float tensors until :func:`quantize_weights` replaces its linear layers
        and embeddings (norms stay shared, read only), so no second float copy is ever made. ``kwargs``: as for the
        constructor."""
        if check_draft_quant("DraftModelDrafter.from_target", draft_quant) is None:
            raise ValueError("DraftModelDrafter.from_target: draft_quant must be one of the schemes "
                             "(the float target as its own draft would accept everything and save nothing)")
        shared = {id(t): t for t in (*target.parameters(), *target.buffers())}
        return cls(copy.deepcopy(target, shared), draft_quant=draft_quant, **kwargs)

    def begin(self, target: torch.nn.Module, state: DecodeState, prefill_hidden_states=None, *,
              defer_prefill: bool = False) -> None:
        """Checks the pair, allocates the draft cache and prefills it with the prompts (``defer_prefill``: not
        now; the first speculative :meth:`propose` catches up on them)."""
        self._check_vocab(state.vocab_size)
        if self.width > state.vocab_size:
            raise ValueError(f"DraftModelDrafter: tree_width = {self.width} exceeds the vocabulary "
                             f"({state.vocab_size})")

        # positions used: below the longest context (prompt + budget) + the tree, i.e. the target cache's size - 1
        check_window("DraftModelDrafter", self.model.config, state.max_len - 1)
        p = _param(self.model)
        if p.device != state.device:
            raise ValueError(f"DraftModelDrafter: the draft model is on {p.device} but the target on {state.device}; "
                             "put both on one device")
        if self.tree_attention:
            use_tree_attention(self.model)
        if self.packed_linears:
            pack_linears(self.model)
        self.fed = 0  # drafts fed in the last propose (their K/V sit after the context)
        self.forwards = 0
        self._keeps_logits = forward_accepts(self.model, "logits_to_keep")
        self._ops, self._ops_built = None, False  # (the prompt's prefill below is long: the Hugging Face forward)
        self.cache, self.valid = None, []
        self.add_rows(target, state, defer_prefill=defer_prefill)

    def _check_vocab(self, target_vocab: int) -> None:
        check_vocab(type(self).__name__, text_config(self.model.config).vocab_size, target_vocab)

    def add_rows(self, target: torch.nn.Module, rows: DecodeState, prefill_hidden_states=None, *,
                 defer_prefill: bool = False) -> None:
        """The joining rows' draft cache, prefilled with each prompt but its last token (the first root) now, in
        their prefill (left to the first propose it would bill a whole prompt forward to a decoding step), then
        appended to the running rows' cache."""
        p = _param(self.model)
        room = (self.k - 1) * self.width if self.dynamic else self.k  # positions written after the context
        cache = TreeKVCache(self.model.config, rows.batch_size, rows.max_len + room + 1, dtype=p.dtype,
                            device=rows.device)
        lengths = [n - 1 for n in rows.prompt_lens]
        T = max(lengths)
        valid = [0] * rows.batch_size  # per row: context tokens the draft cache holds correctly
        if T > 0 and not defer_prefill:
            with packed_linears(self.packed_linears):
                self._forward(rows.tokens[:, :T], torch.zeros(rows.batch_size, dtype=torch.int64, device=rows.device),
                              to_device(lengths, rows.device), cache, keep=1)  # (logits unread)
            valid = lengths
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.add_rows(cache)
        self.valid = self.valid + valid

    def _forward(self, tokens: torch.Tensor, prefix: torch.Tensor, num: torch.Tensor,
                 cache: TreeKVCache | None = None, keep: int = 0) -> torch.Tensor:
        """Appends ``tokens[B, T]`` (row b's first ``num[b]``) after ``prefix[b]`` in ``cache`` (default: the draft
        cache); returns the logits ``[B, T, V]`` of all T tokens, or with ``keep`` > 0 of the last ``keep`` only (the
        vocabulary product of the rest would be thrown away: a large part of a small draft's forward)."""
        B, T = tokens.shape
        kept = {"logits_to_keep": keep} if keep and self._keeps_logits else {}
        if cache is not None:  # joining rows' own cache (their prefill): the Hugging Face forward
            logits = tree_forward(self.model, cache, tokens, None, prefix, validate=False,
                                  use_kernel=False if T > extend_kernel_max_tokens(tokens.device) else None, **kept)
            cache.rewind(prefix + num)
            self.forwards += 1
            return logits[:, -keep:] if keep else logits
        # (read at each call, so that tests may lift the limit; on a CPU reading prefix's maximum is free)
        if self._ops is not None and B * T <= draft_layer.NATIVE_LAYER_MAX_ROWS:
            pos = prefix[:, None] + torch.arange(T, device=tokens.device)
            mask = torch.arange(int(prefix.max()) + T, device=tokens.device)[None, None, :] <= pos[:, :, None]
            logits = self._ops.run(tokens, pos, pos, mask, logits_to_keep=keep).logits
        else:
            use_kernel = False if T > extend_kernel_max_tokens(tokens.device) else None
            logits = tree_forward(self.model, self.cache, tokens, None, prefix,
                                  use_kernel=use_kernel, validate=False, **kept)
        self.cache.rewind(prefix + num, validate=False)  # (context lengths: in range)
        self.forwards += 1
        return logits[:, -keep:] if keep else logits

    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        if not self._ops_built and self.cache is not None:
            self._ops = LlamaStepOps.build(self.model, self.cache) if self.packed_linears else None
            self._ops_built = True
        with packed_linears(self.packed_linears):
            return self._propose(state, max_depth, max_nodes)

    def _propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        B, dev = state.batch_size, state.device
        root = state.last_tokens
        k = min(self.k, max_depth, max_nodes - 1)
        # a tree that the node budget cannot hold at depth 1 (or, dynamic, with more than one draft per level)
        # drafts the chain of the budget instead
        if self.dynamic:
            total = min(self.total_tokens, max_nodes - 1)
            shape = "dynamic" if total > k else "chain"
        else:
            shape = "tree" if self.width > 1 and max_nodes - 1 >= self.width else "chain"
            if shape == "tree":
                k = min(k, (max_nodes - 1) // self.width)
        self.fed = 0
        self.caught_up = k > 0
        if k <= 0:  # a plain step: no draft forward, so the cache does not catch up either (observe keeps valid)
            return plain_tree(root)
        last = self._catch_up(state)[:, 0]
        if shape == "dynamic":
            return self._propose_dynamic(state, root, last, k, total)
        if shape == "tree":
            return self._propose_tree(state, root, last, k)
        drafts, probs = [], []
        pos = state.lengths
        for i in range(k):
            tok, p = sample_drafts(last, state)
            drafts.append(tok)
            probs.append(p)
            if i == k - 1 or (self.confidence_threshold and all_unsure(last, tok, p, self.confidence_threshold)):
                break
            last = self._forward(tok[:, None], pos, torch.ones_like(pos))[:, 0]
            pos = pos + 1
        n = len(drafts)
        self.fed = n - 1
        tokens = torch.stack([root] + drafts, 1)
        parents = ops.chain_parents(B, n + 1, device=dev)
        draft_probs = None
        if not state.sampling.greedy:
            draft_probs = torch.stack(probs + [torch.zeros_like(probs[0])], 1)  # leaf row: never read
        return DraftTree(tokens, parents, draft_probs)

    def _catch_up(self, state: DecodeState, extra: int = 0, fill: int = 0) -> torch.Tensor:
        """The catch-up: one forward of the longest lag T, followed by ``extra`` tokens ``fill`` right after each
        row's context (the parallel draft's mask tokens; their K/V are dropped again). Each row feeds the last T
        tokens of its context (from 0 where it has fewer), so no row writes past its context; after its valid
        prefix, an up-to-date row would write a joining row's whole prompt there. Returns the logits
        ``[B, extra + 1, V]`` of each row's predictions: after its context, then after each ``fill`` token (the
        forward keeps the logits from the earliest row's first prediction on; the tokens before it only write K/V)."""
        dev = state.device
        lengths = [len(t) for t in state.host_tokens]
        T = max(n - v for n, v in zip(lengths, self.valid))
        start = to_device([max(n - T, 0) for n in lengths], dev)  # <= valid[b]: the positions before it recompute
        num = state.lengths - start  # min(length, T) per row
        steps = torch.arange(T + extra, device=dev)
        tokens = state.tokens.gather(1, (start[:, None] + steps).clamp(max=state.max_len - 1))
        if extra:
            tokens = tokens.masked_fill(steps[None] >= num[:, None], fill)
        first = min(min(lengths), T) - 1  # the forward's position of the earliest row's prediction after its context
        logits = self._forward(tokens, start, num, keep=T + extra - first)
        at = [min(n, T) - 1 - first for n in lengths]  # row b's prediction after its context, in the kept logits
        if len(set(at)) == 1:  # (one row, or rows that lag alike: a view)
            return logits[:, at[0]: at[0] + extra + 1]
        rows = to_device(at, dev)[:, None] + torch.arange(extra + 1, device=dev)
        return logits.gather(1, rows[..., None].expand(-1, -1, logits.shape[-1]))

    def _propose_tree(self, state: DecodeState, root: torch.Tensor, last: torch.Tensor, k: int) -> DraftTree:
        B, w, dev = state.batch_size, self.width, state.device
        prefix = state.lengths - 1  # the root's position
        tokens = [root[:, None], last.topk(w, dim=-1).indices]  # level 1: the top-w children of the root
        parents = [-1] + [0] * w
        for d in range(1, k):  # level d + 1: each branch's argmax child
            flat = torch.cat(tokens, 1)
            par = to_device(parents, dev).expand(B, -1).contiguous()
            logits = tree_forward(self.model, self.cache, flat, par, prefix, validate=False)
            self.forwards += 1
            tokens.append(logits[:, -w:].argmax(-1))
            parents += list(range(1 + (d - 1) * w, 1 + d * w))
        self.fed = k - 1  # levels 1 .. k - 1 have K/V in the cache (after the prefix, in node order)
        self.tree_fed = k > 1
        par = to_device(parents, dev).expand(B, -1).contiguous()
        return DraftTree(torch.cat(tokens, 1), par, None)

    def _propose_dynamic(self, state: DecodeState, root: torch.Tensor, last: torch.Tensor, k: int,
                         total: int) -> DraftTree:
        B, w = state.batch_size, self.width
        valid = state.lengths  # the catch-up left every context token in the cache; tree slots follow
        root_pos = valid - 1

        def level(d, tok, parent, mask, slots):
            self.forwards += 1
            pos = (root_pos + d)[:, None].expand(B, w)
            if self._ops is not None:  # (the level's w nodes sit at slots[:, 0] + j, as masked_forward writes them)
                return self._ops.forward(tok, pos, slots, mask)
            return masked_forward(self.model, self.cache, tok, pos, slots[:, 0], mask)

        tree = grow_dynamic_tree(root, last, level, depth=k, top_k=w, total_tokens=total, valid=valid,
                                 kv_len=max(len(t) for t in state.host_tokens) + (k - 1) * w,
                                 calibration=self.calibration if self.calibrate else None)
        self.cache.rewind(valid)
        return tree

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        self.calibration.update(result)
        if self.width > 1 and getattr(self, "tree_fed", False):
            # The last tree forward left the nodes' K/V at prefix + node index: keep the accepted path's fed nodes.
            prefix = to_device([len(ctx) - n - 1 for ctx, n in zip(state.host_tokens, result.appended)],
                               state.device)
            self.cache.accept(result.accepted, result.accept_len.clamp(max=self.fed), prefix, validate=False)
            self.tree_fed = False
        if not getattr(self, "caught_up", True):
            return  # the cache still holds the first valid[b] tokens of each row, which are still its context
        for b, ctx in enumerate(state.host_tokens):
            new_len = len(ctx)
            old_len = new_len - result.appended[b]
            accepted = max(result.appended[b] - 1, 0)
            self.valid[b] = min(old_len + min(accepted, self.fed), new_len - 1)

    def retire(self, keep: torch.Tensor) -> None:
        """Keeps the rows ``keep`` of the draft cache (one ``index_select``) and of the valid lengths."""
        if self.cache is None:
            return
        self.cache.keep_rows(keep)
        rows = keep.tolist()
        self.valid = [self.valid[i] for i in rows]
