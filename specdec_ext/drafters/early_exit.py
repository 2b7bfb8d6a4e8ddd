"""Self-speculation by early exit with a trained adapter (Kangaroo / LayerSkip style): the target's first
``exit_layer`` decoder layers, one trained adapter layer, and the target's own final norm and LM head draft.

The draft of the token after position t: the target's shallow layers run on token t (over the target's own KV cache
of those layers, so their output ``h_L`` is exactly the target's), the adapter (:mod:`specdec_ext.models.early_exit`)
reads ``h_L`` at every position up to t through its own K/V, and the target's norm and LM head give the logits. The
weights are the target's but for the adapter (one decoder layer).

Shallow K/V. The shallow layers of a draft token write their K/V into the target's cache at the slots the
verification will write (``prefix_lens + j``, as :class:`~specdec_ext.drafters.SelfSpecDrafter`'s scratch): the
engine's verification overwrites them, or, for a chain, reuses them.

Verification from the exit layer (``reuse_shallow=True``, chains only). A chain's nodes are drafted one at a time at
their own slots and positions, each seeing its ancestors: exactly what the verification forward's first
``exit_layer`` layers compute for them. So after drafting the chain the drafter runs the shallow layers once more on
the last draft (no adapter, no head), and hands the nodes' ``h_L`` to the engine
(:class:`~specdec_ext.state.ShallowStates`), whose op route then runs only the layers after the exit layer. This is
exact, not approximate: on that route every stage computes a row on its own, in a fixed order, so a node's shallow
states are the same bits whether it is computed alone or in the verification's batch of nodes (test:
``python_tests/test_drafter_early_exit.py``). Where verification runs the Hugging Face modules (CUDA, hooks) it runs
every layer and rewrites the same K/V. A dynamic tree's levels are drafted at scratch slots that verification does
not keep, so a tree is verified from layer 0.

Adapter K/V. ``valid[b]`` context positions of row b have adapter K/V computed from exact ``h_L``. The drafter keeps
every position's ``h_L`` (``hidden_state_layers = (exit_layer,)``: the prompt's from the prefill, the accepted nodes'
from each verification) and each :meth:`propose` first catches up on the positions ``valid .. n - 2`` through the
adapter alone (n: the context length; the root's own comes with its draft). A chain's drafted positions that were
accepted are already valid (their adapter K/V were written at their slots from exact ``h_L``); a tree's are not.

Shapes as :class:`~specdec_ext.drafters.SelfSpecDrafter`'s: a chain (``tree_width = 1``) of ``num_draft_tokens``,
sampled under the rows' settings with their probabilities (lossless), or an EAGLE-2 dynamic tree
(``tree_width >= 2`` with ``total_tokens``) from the draft's own probabilities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_ext import ops
from specdec_ext.drafters.base import (all_unsure, check_confidence_threshold, own_target_cache, sample_drafts,
                                       to_device)
from specdec_ext.drafters.dynamic_tree import CalibratedScores, ScoreCalibration, grow_dynamic_tree, scratch_tree_nodes
from specdec_ext.models import TreeKVCache, draft_layer
from specdec_ext.models.attention import additive_attention_mask
from specdec_ext.models.config import text_config
from specdec_ext.models.draft_layer import DraftLayer
from specdec_ext.models.draft_vocab import VocabRows, read_draft_vocab
from specdec_ext.models.early_exit import EarlyExitAdapter, check_adapter_target, load_early_exit
from specdec_ext.models.eagle import EagleKVCache
from specdec_ext.models.kv_cache import append_batch_rows, keep_batch_rows, write_rows
from specdec_ext.models.layer_skip import LayerSkipLM
from specdec_ext.models.llama_step import LlamaStepOps
from specdec_ext.models.quantized import check_draft_quant, quantize_weights
from specdec_ext.state import DecodeState, DraftTree, ShallowStates, StepResult, plain_tree

__all__ = ["EarlyExitDrafter"]


class EarlyExitDrafter(CalibratedScores):
    """Drafts with the target's first ``adapter.exit_layer`` layers and ``adapter`` (see the module doc).

    ``num_draft_tokens``: the chain's length, or the dynamic tree's depth; ``tree_width`` / ``total_tokens`` /
    ``calibrate`` / ``calibration_rate``: as :class:`~specdec_ext.drafters.SelfSpecDrafter`'s. ``reuse_shallow``:
    a chain's verification starts at the exit layer (module doc). ``op_calls``: the shallow layers and the head as
    the target's op calls where they serve (CPUs), else its modules (the adapter's own forward takes its op where a
    call qualifies, as the EAGLE layers do); the drafts agree to float rounding.
    ``draft_vocab``: target token ids (FR-Spec, :mod:`~specdec_ext.models.draft_vocab`) the draft scores instead of
    the whole vocabulary: a copy of those rows of the LM head, and a head product that reads only them; sampled
    drafts keep their distribution over those ids (zero elsewhere), so sampling stays lossless.
    ``confidence_threshold`` (chains; 0 = off): stop a chain after a draft every row was less sure of than this
    (Kangaroo's second early exit; :class:`~specdec_ext.drafters.DraftModelDrafter`'s rule).
    ``draft_quant="int8"``: the adapter and those rows on int8 weights (in place; the target's layers stay as they
    are, and so do the exact shallow states).
    """

    defers_prefill = True  # (the first propose's catch-up reads the prompt's features)
    serves_row_subsets = False  # (it drafts over the target's cache, which holds every row)

    def __init__(self, adapter: EarlyExitAdapter, num_draft_tokens: int = 4, tree_width: int = 1,
                 total_tokens: int | None = None, calibrate: bool = True, calibration_rate: float = 0.2,
                 reuse_shallow: bool = True, op_calls: bool = True, draft_vocab=None, draft_quant: str | None = None,
                 confidence_threshold: float = 0.0):
        if not isinstance(adapter, EarlyExitAdapter):
            raise ValueError(f"EarlyExitDrafter: adapter must be an EarlyExitAdapter (load_early_exit), got "
                             f"{type(adapter).__name__}")
        self.max_nodes = scratch_tree_nodes("EarlyExitDrafter", num_draft_tokens, tree_width, total_tokens)
        self.confidence_threshold = check_confidence_threshold("EarlyExitDrafter", confidence_threshold, tree_width)
        self.draft_quant = check_draft_quant("EarlyExitDrafter", draft_quant)
        self.adapter = adapter.eval() if self.draft_quant is None else quantize_weights(adapter.eval(), draft_quant)
        self.exit_layer = adapter.exit_layer
        self.hidden_state_layers = (adapter.exit_layer,)
        self.k = self.max_depth = num_draft_tokens
        self.width, self.total_tokens = tree_width, total_tokens
        self.dynamic = total_tokens is not None
        self.reuse_shallow, self.op_calls, self.calibrate = bool(reuse_shallow), bool(op_calls), bool(calibrate)
        self.calibration = ScoreCalibration(calibration_rate, "EarlyExitDrafter")
        self.draft_vocab = None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.int64)
        if self.draft_vocab is not None and (self.draft_vocab.dim() != 1 or not self.draft_vocab.numel()
                                             or self.draft_vocab.unique().numel() != self.draft_vocab.numel()):
            raise ValueError("EarlyExitDrafter: draft_vocab must be a non-empty list of distinct token ids")
        self._vocab_ids = None  # draft_vocab on the device
        self._lm_sub = None  # the LM head's draft_vocab rows (made once per LM-head weight: _rows)
        self._rows = None if self.draft_vocab is None else VocabRows(self.draft_vocab, self.draft_quant)
        self.target = None
        self._dtype: torch.dtype | None = None  # the target's
        self.view: LayerSkipLM | None = None  # the target's first exit_layer layers (the modules' route)
        self.cache: TreeKVCache | None = None  # the engine's target cache (state.target_cache)
        self.akv: EagleKVCache | None = None  # the adapter's K/V
        self.feats: torch.Tensor | None = None  # [B, max_len + 1, H]: every context position's h_L
        self.valid: list[int] = []
        self._ops: LlamaStepOps | None = None
        self._adapter_op: DraftLayer | None = None  # the adapter as an op call (with _ops)
        self._ops_built = False
        self._drafted = 0  # the last propose's adapter forwards at the rows' own slots from prefix_lens (chain: k)
        self.forwards = 0

    @property
    def vocab_head(self) -> torch.nn.Module | None:
        """The copy of the LM head's ``draft_vocab`` rows the draft scores with (None without a draft vocabulary, or
        before a generation begins)."""
        return self._lm_sub

    @classmethod
    def from_pretrained(cls, path: str, target: torch.nn.Module, **shape) -> "EarlyExitDrafter":
        """The drafter of a ``specdec train-self-spec`` directory (:func:`~specdec_ext.models.early_exit.
        load_early_exit`), checked against ``target``, in its dtype and on its device; over the directory's
        ``draft_vocab.json`` when it has one (unless ``shape`` gives ``draft_vocab``)."""
        shape.setdefault("draft_vocab", read_draft_vocab(path, "EarlyExitDrafter"))
        return cls(load_early_exit(path, target=target), **shape)

    # ---- rows ---------------------------------------------------------------------------------------------------
    def begin(self, target: torch.nn.Module, state: DecodeState, prefill_hidden_states=None, *,
              defer_prefill: bool = False) -> None:
        """Checks the target against the adapter and makes the view of its shallow layers."""
        a = self.adapter
        check_adapter_target(a.exit_layer, a.target_num_layers, a.config, target, "EarlyExitDrafter")
        p = next(q for q in a.parameters() if q.is_floating_point())
        if p.device != state.device:
            raise ValueError(f"EarlyExitDrafter: the adapter is on {p.device} but the target on {state.device}")
        if self.view is None or self.view.source is not target:
            N = text_config(target.config).num_hidden_layers
            self.view = LayerSkipLM(target, list(range(a.exit_layer, N)), owner="EarlyExitDrafter")
        self.target = target
        self._dtype = next(q for q in target.parameters() if q.is_floating_point()).dtype
        self._vocab_ids, self._lm_sub = None, None
        if self.draft_vocab is not None:
            V = text_config(target.config).vocab_size
            if int(self.draft_vocab.min()) < 0 or int(self.draft_vocab.max()) >= V:
                raise ValueError(f"EarlyExitDrafter: draft_vocab holds ids outside the target's vocabulary [0, {V})")
            if self.width > self.draft_vocab.numel():
                raise ValueError(f"EarlyExitDrafter: tree_width = {self.width} exceeds the draft vocabulary "
                                 f"({self.draft_vocab.numel()} ids)")
            self._vocab_ids, self._lm_sub = self._rows.of(target.lm_head, self._dtype, state.device)
        self.akv, self.feats, self.valid = None, None, []
        self._ops, self._ops_built = None, False
        self.forwards = 0
        self.add_rows(target, state, prefill_hidden_states, defer_prefill=defer_prefill)

    def add_rows(self, target: torch.nn.Module, rows: DecodeState, prefill_hidden_states=None, *,
                 defer_prefill: bool = False) -> None:
        """The joining rows' adapter K/V and prompt features, then the adapter's prefill over them (unless
        ``defer_prefill``), appended after the running rows."""
        cache = own_target_cache("EarlyExitDrafter", target, rows, self.width)
        if prefill_hidden_states is None and max(rows.prompt_lens) > 1:
            raise ValueError("EarlyExitDrafter: the prompt's hidden states are missing (the loop must run the target's "
                             f"prefill with output_hidden_states for hidden_state_layers = {self.hidden_state_layers})")
        if cache is not self.cache:
            self.cache, self._ops, self._ops_built = cache, None, False
        running = (self.akv, self.feats, self.valid)
        c, p = self.adapter.config, next(q for q in self.adapter.parameters() if q.is_floating_point())
        B, dev = rows.batch_size, rows.device
        S = rows.max_len + self.max_nodes + 1  # the last slot takes padding writes, never read
        self.akv = EagleKVCache(B, c.num_key_value_heads, S, c.head_dim, p.dtype, dev)
        self._positions = torch.arange(S, device=dev)
        self.feats = torch.zeros(B, rows.max_len + 1, c.hidden_size, dtype=p.dtype, device=dev)
        if prefill_hidden_states is not None:
            h = prefill_hidden_states[0]
            self.feats[:, : h.shape[1]] = h.to(p.dtype)
        self.valid = [0] * B
        if not defer_prefill:
            self._catch_up(rows)
        if running[0] is not None:  # (the running cache object stays)
            akv, feats, valid = running
            akv.k, akv.v = append_batch_rows(akv.k, self.akv.k), append_batch_rows(akv.v, self.akv.v)
            self.akv, self.feats, self.valid = akv, append_batch_rows(feats, self.feats), valid + self.valid

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        """Keeps the accepted nodes' ``h_L`` (the target's) and marks the adapter K/V the chain wrote at accepted
        positions as valid."""
        if result.hidden_states is None:
            raise ValueError("EarlyExitDrafter.observe: the step's hidden states are missing (the loop must run the "
                             f"target with output_hidden_states for hidden_state_layers = {self.hidden_state_layers})")
        self.calibration.update(result)
        hs = result.hidden_states[0].to(self.feats.dtype)  # [B, N, H]
        B, N, H = hs.shape
        for b, a in enumerate(result.appended):  # positions prefix .. prefix + a - 1 now hold accepted tokens
            prefix = len(state.host_tokens[b]) - a - 1
            if self.valid[b] == prefix:
                self.valid[b] = prefix + min(a, self._drafted)
        if B == 1:
            a = result.appended[0]
            if a:
                end = len(state.host_tokens[0]) - 1
                self.feats[0, end - a: end].copy_(hs[0].index_select(0, result.accepted[0, :a]))
            return
        g = hs.gather(1, result.accepted.clamp(min=0)[:, :, None].expand(B, N, H))
        appended = to_device(result.appended, state.device)
        j = torch.arange(N, device=state.device)
        idx = torch.where(j < appended[:, None], (state.lengths - appended - 1)[:, None] + j, self.feats.shape[1] - 1)
        write_rows(self.feats[:, None], idx, g[:, None])

    def retire(self, keep: torch.Tensor) -> None:
        """Keeps the rows ``keep`` of the adapter K/V, the features and the valid lengths."""
        if self.akv is None:
            return
        rows = keep.tolist()
        self.akv.k, self.akv.v, self.feats = (keep_batch_rows(t, rows) for t in (self.akv.k, self.akv.v, self.feats))
        self.valid = [self.valid[i] for i in rows]

    # ---- the draft network ----------------------------------------------------------------------------------------
    def _shallow(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor):
        """The target's first ``exit_layer`` layers on ``tokens[B, T]`` at ``pos``, their K/V written at ``slots``
        (contiguous per row on the modules' route), each attending to the slots ``mask[B, T, kv_len]``; returns
        ``h_L[B, T, H]``. The cache's lengths are the caller's to restore."""
        if self._ops is not None and tokens.numel() <= draft_layer.NATIVE_LAYER_MAX_ROWS:
            return self._ops.layers(self._ops.embed(tokens), pos, slots, mask, 0, self.exit_layer)
        additive = additive_attention_mask(mask, self.cache.max_len, self._dtype)  # (the target's dtype)
        self.cache.rewind(slots[:, 0], validate=False)
        return self.view.hidden(input_ids=tokens, attention_mask=additive, position_ids=pos, cache=self.cache)

    def _adapt(self, h: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The adapter over ``h_L[B, T, H]`` at ``pos``, its K/V written at ``slots``, attending to its K/V under
        ``mask[B, T, kv_len]``: its op call (operands looked up once a generation) where it takes the call."""
        h = h.to(self.feats.dtype)
        op, akv = self._adapter_op, self.akv
        if op is not None and DraftLayer.takes(h.shape[0] * h.shape[1], mask, None):
            return op(h, h, pos, akv.k, akv.v, slots, mask)
        return self.adapter(h, pos, mask=mask, cache=akv, write_slots=slots, kv_len=mask.shape[2])

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The draft logits of the adapter's output: over the whole vocabulary, or over ``draft_vocab``."""
        h = h.to(self._dtype)
        if self._lm_sub is not None:
            norm = self.view.model.norm
            return self._lm_sub(F.rms_norm(h, norm.weight.shape, norm.weight, norm.variance_epsilon))
        if self._ops is not None:
            return self._ops.head(h)
        return self.target.lm_head(self.view.model.norm(h))

    def _sample(self, logits: torch.Tensor, state: DecodeState):
        """A draft token per row from ``logits[B, Vd]`` and its distribution over the target's vocabulary (None when
        greedy): :func:`~specdec_ext.drafters.base.sample_drafts`, mapped from the draft vocabulary."""
        tok, p = sample_drafts(logits, state)
        if self._vocab_ids is None:
            return tok, p
        if p is not None:
            p = p.new_zeros(p.shape[0], state.vocab_size).index_copy_(1, self._vocab_ids, p)
        return self._vocab_ids[tok], p

    def _draft(self, tokens, pos, slots, mask):
        """One draft forward: ``(h_L, logits)`` of ``tokens[B, T]`` (the logits of the token after each)."""
        self.forwards += 1
        h = self._shallow(tokens, pos, slots, mask)
        return h, self._head(self._adapt(h, pos, slots, mask))

    def _catch_up(self, state: DecodeState) -> None:
        """The adapter over each row's positions ``valid .. n - 2`` from their kept ``h_L`` (n: the context
        length; the root, at n - 1, comes with its draft)."""
        ends = [len(t) - 1 for t in state.host_tokens]
        count = [max(e - v, 0) for v, e in zip(self.valid, ends)]
        if not any(count):
            return
        B, T, dev = state.batch_size, max(count), state.device
        kv_len = max(v + c for v, c in zip(self.valid, count))
        if self.valid.count(self.valid[0]) == B and count.count(T) == B:  # rows in step (batch 1): slices, no gathers
            start = self.valid[0]
            pos = self._positions[start: start + T].expand(B, T)
            feat, slots = self.feats[:, start: start + T], pos
        else:
            start_t, count_t = to_device([self.valid, count], dev)
            j = self._positions[:T]
            pos = start_t[:, None] + j
            slots = torch.where(j < count_t[:, None], pos, self.akv.max_len - 1)
            H = self.feats.shape[-1]
            feat = self.feats.gather(1, pos.clamp(max=self.feats.shape[1] - 1)[:, :, None].expand(B, T, H))
        mask = self._positions[:kv_len][None, None, :] <= pos[:, :, None]
        self._adapt(feat, pos, slots, mask)
        self.valid = [v + c for v, c in zip(self.valid, count)]

    # ---- drafting -----------------------------------------------------------------------------------------------
    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        root = state.last_tokens
        k = min(self.k, int(max_depth), int(max_nodes) - 1)
        self._drafted = 0
        if k <= 0:
            return plain_tree(root)
        if not self._ops_built:
            self._ops = LlamaStepOps.build(self.target, self.cache) if self.op_calls else None
            self._adapter_op = None if self._ops is None else self.adapter.draft_layer(
                self.feats.dtype, self.feats.device, self.akv.k.dtype)
            self._ops_built = True
        self._catch_up(state)
        prefix = state.prefix_lens
        kv_len = max(len(t) for t in state.host_tokens)  # slots up to the root's
        try:
            pos = prefix[:, None]
            mask = self._positions[:kv_len][None, None, :] <= pos[:, :, None]
            h_root, logits = self._draft(root[:, None], pos, pos, mask)
            total = min(self.total_tokens, int(max_nodes) - 1) if self.dynamic else 0
            if self.dynamic and total > k:
                self._drafted = 1
                return self._propose_dynamic(state, root, logits[:, 0], k, total, kv_len)
            return self._propose_chain(state, root, h_root, logits[:, 0], k, kv_len)
        finally:
            self.cache.rewind(prefix, validate=False)  # (the lengths the engine left: its prefix)

    def _propose_chain(self, state, root, h_root, last, k, kv_len) -> DraftTree:
        drafts, probs, shallow = [], [], [h_root]
        # every draft's slot and position (after the root's), and the slots each one attends to
        at = state.lengths[:, None] + self._positions[:k]
        masks = self._positions[None, None, : kv_len + k] <= at[:, :, None]
        for i in range(k):
            tok, p = self._sample(last, state)
            drafts.append(tok)
            probs.append(p)
            last_one = i == k - 1 or (self.confidence_threshold
                                      and all_unsure(last, tok, p, self.confidence_threshold))
            if not last_one or self.reuse_shallow:
                here, mask = at[:, i: i + 1], masks[:, i: i + 1, : kv_len + i + 1]
                if not last_one:
                    h, logits = self._draft(tok[:, None], here, here, mask)
                    last = logits[:, 0]
                else:  # the last draft's shallow layers only: verification starts after them
                    h = self._shallow(tok[:, None], here, here, mask)
                shallow.append(h)
            if last_one:
                break
        self._drafted = len(drafts)  # (the root's and each draft's but the last adapter K/V, at their own slots)
        k = len(drafts)
        tokens = torch.stack([root] + drafts, 1)
        draft_probs = None
        if not state.sampling.greedy:
            draft_probs = torch.stack(probs + [torch.zeros_like(probs[0])], 1)  # the leaf's row: never read
        states = ShallowStates(self.exit_layer, torch.cat(shallow, 1)) if self.reuse_shallow else None
        return DraftTree(tokens, ops.chain_parents(state.batch_size, k + 1, device=state.device), draft_probs,
                         shallow=states)

    def _propose_dynamic(self, state, root, last, k, total, kv_len) -> DraftTree:
        B, w = state.batch_size, self.width
        valid = state.lengths  # the root's K/V is at prefix_lens: the tree's slots follow it
        root_pos = valid - 1

        def level(d, tok, parent, mask, slots):
            pos = (root_pos + d)[:, None].expand(B, w)
            return self._draft(tok, pos, slots, mask)[1]

        ids = self._vocab_ids
        return grow_dynamic_tree(root, last, level, depth=k, top_k=w, total_tokens=total, valid=valid,
                                 kv_len=kv_len + (k - 1) * w, target_ids=None if ids is None else ids.__getitem__,
                                 calibration=self.calibration if self.calibrate else None)
