"""Self-speculation by layer skipping (SWIFT / Draft & Verify): the target drafts for itself with some of its decoder
layers skipped. No second model, no training, no extra weights.

The draft is :class:`~specdec_ext.models.layer_skip.LayerSkipLM`: the target's embeddings, the decoder layers not in
``skip_layers``, its final norm and LM head, all shared with the target. Which layers to skip is chosen per model by
measured acceptance and cost (``specdec tune-self-spec``, :mod:`specdec_ext.train.self_spec_tune`) and saved as a
small JSON (:mod:`specdec_ext.drafters.self_spec_file`) that :meth:`SelfSpecDrafter.from_file` loads.

The target's KV cache (Draft & Verify). The layers the draft runs read the *target's* KV cache of the accepted
prefix: after each verification the cache holds every context token but the root, computed by the full model, so
the draft needs no cache of its own, no prefill and no catch-up (its begin, add_rows, observe and retire keep no
per-row state). The engine owns that cache; a drafter sees it through ``state.target_cache``
(:class:`~specdec_ext.state.DecodeState`), which the engine sets on the rows it starts or adds. That field is the
one protocol change self-speculation needs: the drafter protocol hands drafters the target model but not its cache,
and passing the cache through the state (rather than a new protocol method, which every drafter would have to
implement) keeps the other drafters unchanged. The draft tokens' own K/V are scratch: the draft writes them, for the
layers it runs, at the row's cache slots from ``prefix_lens`` on, where the verification forward then writes the
tree's nodes (every layer, from ``prefix_lens``); slots past the tree are beyond the row's length, never read
before they are written again. The draft leaves the cache's lengths at ``prefix_lens``.

Shapes. A chain (``tree_width = 1``): ``num_draft_tokens`` forwards of one token (the root, then each draft but the
last), sampled under the generation's temperature / top-k / top-p with their probabilities (argmax when greedy),
as :class:`~specdec_ext.drafters.DraftModelDrafter`'s chains. An EAGLE-2 dynamic tree (``tree_width = w >= 2``
with ``total_tokens``) from the draft's own probabilities
(:func:`~specdec_ext.drafters.dynamic_tree.grow_dynamic_tree`): the root's forward, then one forward of the w
frontier nodes per level through :func:`~specdec_ext.models.masked_forward` at the tree's scratch slots (``valid =
lengths``: the root's K/V sits at ``prefix_lens``); deterministic drafts (``draft_probs = None``), lossless under
sampling too. Verification is the target's own, so greedy output is the target's greedy output and sampled output
follows the target's distribution.

Room. The dynamic tree's scratch takes ``1 + (depth - 1) * w`` slots after the prefix, which can exceed the tree
that is verified; ``max_nodes`` (which the engine sizes each row's room after its context with) is the larger of
the two, so the scratch always fits the cache.
"""

from __future__ import annotations

import torch

from specdec_ext import ops
from specdec_ext.drafters.base import own_target_cache, sample_drafts
from specdec_ext.drafters.dynamic_tree import CalibratedScores, ScoreCalibration, grow_dynamic_tree, scratch_tree_nodes
from specdec_ext.drafters.self_spec_file import SelfSpecFile, read_self_spec
from specdec_ext.models import TreeKVCache, draft_layer, masked_forward, tree_forward
from specdec_ext.models.layer_skip import KeptLayers, LayerSkipLM, check_skip_layers
from specdec_ext.models.llama_step import LlamaStepOps
from specdec_ext.state import DecodeState, DraftTree, StepResult, plain_tree

__all__ = ["SelfSpecDrafter"]


class SelfSpecDrafter(CalibratedScores):
    """Drafts with the target itself, the decoder layers ``skip_layers`` skipped (see the module doc).

    ``num_draft_tokens``: the chain's length, or the dynamic tree's depth. ``tree_width``: 1 = a chain; w >= 2 with
    ``total_tokens`` = an EAGLE-2 dynamic tree of ``total_tokens`` drafts, w children per frontier node
    (``calibrate`` / ``calibration_rate`` as for :class:`~specdec_ext.drafters.EagleDrafter`). The layer indices
    are checked against the target when a generation begins. ``op_calls``: the kept layers draft as
    :class:`~specdec_ext.models.llama_step.LlamaStepOps` op calls where it serves the model (CPUs; no forward hooks
    on the layers, which transformers leaves after a forward with ``output_hidden_states``), reading each kept
    layer's q/k/v and gate/up weights packed together once (a copy of those weights); elsewhere, or False, the
    Hugging Face modules, no extra bytes. Either way the drafts are the same up to float rounding.
    """

    hidden_state_layers: tuple[int, ...] = ()
    defers_prefill = False  # (no draft prefill, so nothing to defer and no lag to catch up on)
    serves_row_subsets = False  # (it drafts over the target's cache, which holds every row)

    def __init__(self, skip_layers, num_draft_tokens: int = 4, tree_width: int = 1, total_tokens: int | None = None,
                 calibrate: bool = True, calibration_rate: float = 0.2, op_calls: bool = True):
        self.skip_layers = check_skip_layers("SelfSpecDrafter", skip_layers)
        self.max_nodes = scratch_tree_nodes("SelfSpecDrafter", num_draft_tokens, tree_width, total_tokens)
        self.k = self.max_depth = num_draft_tokens
        self.width, self.total_tokens = tree_width, total_tokens
        self.dynamic = total_tokens is not None
        self.op_calls = bool(op_calls)
        self.calibrate = bool(calibrate)
        self.calibration = ScoreCalibration(calibration_rate, "SelfSpecDrafter")
        self.draft: LayerSkipLM | None = None  # the target's view, made when a generation begins
        self.cache: TreeKVCache | None = None  # the engine's target cache (state.target_cache)
        # the view as op calls over the cache's kept layers (None: its Hugging Face forward), built at the first propose
        self._ops: LlamaStepOps | None = None
        self._ops_built = False
        self.forwards = 0  # draft forwards in the current generation

    @classmethod
    def from_file(cls, path: str, target: torch.nn.Module | None = None, **shape) -> "SelfSpecDrafter":
        """The drafter of a ``specdec tune-self-spec`` JSON (:mod:`~specdec_ext.drafters.self_spec_file`): its
        skipped layers and, unless ``shape`` overrides it, its chain length. ``target``: checked against the
        file's layer count now (a ValueError naming the file), rather than when a generation begins."""
        plan: SelfSpecFile = read_self_spec(path)
        if target is not None:
            plan.check_target(target, path)
        shape.setdefault("num_draft_tokens", plan.num_draft_tokens)
        return cls(list(plan.skip_layers), **shape)

    # ---- rows ---------------------------------------------------------------------------------------------------
    def begin(self, target: torch.nn.Module, state: DecodeState, prefill_hidden_states=None, *,
              defer_prefill: bool = False) -> None:
        """Checks the target and its cache (clear errors) and makes the draft view of ``target``."""
        if self.draft is None or self.draft.source is not target:
            self.draft = LayerSkipLM(target, list(self.skip_layers), owner="SelfSpecDrafter")
        self.forwards = 0
        self._ops, self._ops_built = None, False
        self.add_rows(target, state)

    def add_rows(self, target: torch.nn.Module, rows: DecodeState, prefill_hidden_states=None, *,
                 defer_prefill: bool = False) -> None:
        """Nothing per row (the rows' prefill is in the target's cache); checks that the rows carry that cache."""
        cache = own_target_cache("SelfSpecDrafter", target, rows, self.width)
        if cache is not self.cache:
            self.cache = cache
            self._ops, self._ops_built = None, False

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        """Only the dynamic tree's score calibration learns: the engine's verification already put the accepted
        tokens' K/V (the full model's) into the shared cache."""
        self.calibration.update(result)

    def retire(self, keep: torch.Tensor) -> None:
        """Nothing per row to keep (the engine's cache drops its own rows)."""

    # ---- drafting -----------------------------------------------------------------------------------------------
    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        root = state.last_tokens
        k = min(self.k, max_depth, max_nodes - 1)
        if k <= 0:
            return plain_tree(root)
        if not self._ops_built:
            self._ops = (LlamaStepOps.build(self.draft, KeptLayers(self.cache, self.draft.kept_layers))
                         if self.op_calls else None)
            self._ops_built = True
        total = min(self.total_tokens, max_nodes - 1) if self.dynamic else 0
        prefix = state.prefix_lens
        self._kv_len = max(len(t) for t in state.host_tokens)  # slots up to the root's, for the op's masks
        try:
            last = self._forward(root[:, None], prefix)[:, 0]  # the root at its slot: the draft's first logits
            if self.dynamic and total > k:
                return self._propose_dynamic(state, root, last, k, total)
            return self._propose_chain(state, root, last, k)
        finally:
            self.cache.rewind(prefix, validate=False)  # (the lengths the engine left: its prefix)

    def _forward(self, tokens: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The draft's logits ``[B, 1]`` for one token a row, ``tokens[B, 1]``, after ``at[b]`` cache slots (the
        chain's i-th forward: ``at <= prefix_lens + i``, so ``kv_len + i`` slots cover every row's)."""
        self.forwards += 1
        B = tokens.shape[0]
        if self._ops is not None and B <= draft_layer.NATIVE_LAYER_MAX_ROWS:
            pos = at[:, None]
            mask = torch.arange(self._kv_len, device=tokens.device)[None, None, :] <= pos[:, :, None]
            self._kv_len += 1
            return self._ops.forward(tokens, pos, pos, mask)
        return tree_forward(self.draft, self.cache, tokens, None, at, validate=False)

    def _propose_chain(self, state: DecodeState, root: torch.Tensor, last: torch.Tensor, k: int) -> DraftTree:
        drafts, probs = [], []
        at = state.lengths  # the next draft's slot: after the root's
        for i in range(k):
            tok, p = sample_drafts(last, state)
            drafts.append(tok)
            probs.append(p)
            if i < k - 1:
                last = self._forward(tok[:, None], at)[:, 0]
                at = at + 1
        tokens = torch.stack([root] + drafts, 1)
        draft_probs = None
        if not state.sampling.greedy:
            draft_probs = torch.stack(probs + [torch.zeros_like(probs[0])], 1)  # the leaf's row: never read
        return DraftTree(tokens, ops.chain_parents(state.batch_size, k + 1, device=state.device), draft_probs)

    def _propose_dynamic(self, state: DecodeState, root: torch.Tensor, last: torch.Tensor, k: int,
                         total: int) -> DraftTree:
        B, w = state.batch_size, self.width
        valid = state.lengths  # the root's K/V is at prefix_lens: the tree's slots follow it
        root_pos = valid - 1

        def level(d, tok, parent, mask, slots):
            self.forwards += 1
            pos = (root_pos + d)[:, None].expand(B, w)
            if self._ops is not None and B * w <= draft_layer.NATIVE_LAYER_MAX_ROWS:
                return self._ops.forward(tok, pos, slots, mask)  # (the level's nodes at slots[:, 0] + j)
            return masked_forward(self.draft, self.cache, tok, pos, slots[:, 0], mask)

        return grow_dynamic_tree(root, last, level, depth=k, top_k=w, total_tokens=total, valid=valid,
                                 kv_len=max(len(t) for t in state.host_tokens) + (k - 1) * w,
                                 calibration=self.calibration if self.calibrate else None)
