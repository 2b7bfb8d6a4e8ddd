"""Medusa drafter: K heads on the target's last hidden state propose a static or a per-step tree (Medusa-1).

Heads. The network, :class:`~specdec_ext.models.medusa.MedusaHeads` (its layout and keys: that module), reads the
target's last hidden state after the final norm (HF ``hidden_states[-1]``, which for Llama in transformers 5.x is
after the final norm: ``lm_head(hidden_states[-1]) == logits``) at position t, where the target itself predicts token
t + 1, and head h predicts token t + 2 + h; :func:`specdec_ext.models.checkpoints.load_medusa` reads published
checkpoints.

Tree. The root of a step is the last emitted token (token t + 1, which the target chose at position t). The heads
applied to the hidden state at t give candidates for the depths below the root: depth d comes from head d - 1's
top-k. A static tree from a choices list (:mod:`specdec_ext.drafters.trees`, default ``mc_sim_7b_63``) says which
ranks are combined: choice ``(i, j)`` is head 0's i-th best followed by head 1's j-th best. The drafts are
deterministic (``draft_probs = None``): greedy and lossless-sampling verification both accept them as they are.

Per-step tree (``dynamic=True``). The choices list is then a candidate set, and each step keeps the ``max_nodes -
1`` of its nodes with the highest cumulative head probability: node ``(i, j, ..)`` scores ``log p0(i-th) + log
p1(j-th) + ..`` under each head's calibrated distribution (:class:`~specdec_ext.drafters.dynamic_tree.ScoreCalibration`,
learned from whether head 0's best token is accepted), which is EAGLE-2's ranking for heads that do not see each
other's tokens. A child never outscores its parent, so the kept nodes form a tree (ties: parents first). Where the
heads are sure the tree goes deep, where they are not it goes wide; one matrix product scores every candidate, so
nothing is synchronised. On the model family it verified the same number of nodes as the static tree with a mean
accepted length 16% higher.

State. One hidden state per row: after the prefill, the last prompt position before the root; after each step,
the last accepted tree node (where the target chose the new root). A row whose prompt has one token has no hidden
state before its first step; its first tree is then drafted from zeros (wasted but safe: verification is lossless
whatever the drafts). ``propose`` does no host synchronisation.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec_ext import ops
from specdec_ext.drafters.base import check_vocab
from specdec_ext.drafters.dynamic_tree import CalibratedScores, ScoreCalibration
from specdec_ext.drafters.trees import MC_SIM_7B_63, StaticTree, static_tree
from specdec_ext.models.checkpoints import load_medusa
from specdec_ext.models.config import text_config
from specdec_ext.models.medusa import MedusaHeads
from specdec_ext.models.quantized import check_draft_quant, quantize_weights
from specdec_ext.state import DecodeState, DraftTree, StepResult, plain_tree

__all__ = ["MedusaDrafter"]


class MedusaDrafter(CalibratedScores):
    """Medusa-1 drafting with ``heads`` (:class:`MedusaHeads`) on a static tree (see the module doc).

    ``choices``: a Medusa choices list or a :class:`StaticTree`; the default, None, is ``mc_sim_7b_63`` without
    the choices deeper than the number of heads. ``max_nodes`` (root included) truncates the tree (choices kept in
    listed order). Given choices may be no deeper than the number of heads. ``dynamic``: the per-step tree of the
    module doc, ``max_nodes`` nodes (default 16) picked from all the choices each step; ``calibrate`` /
    ``calibration_rate`` as for :class:`~specdec_ext.drafters.EagleDrafter` (:attr:`score_scale`).
    ``draft_quant="int8"``: the heads (quantised in place) run on int8 weights
    (:func:`~specdec_ext.models.quantized.quantize_weights`); the target's ``lm_head`` stays as it is.
    """

    defers_prefill = False  # no network forward over the prompt
    serves_row_subsets = True
    forwards = 0  # (the heads run on the target's hidden states: no forwards of their own are counted)

    @property
    def max_depth(self) -> int:
        """The deepest tree this drafter builds (its tree's depth: one level per head)."""
        return self.tree.max_depth

    hidden_state_layers: tuple[int, ...] = (-1,)

    def __init__(self, heads: MedusaHeads, choices=None, max_nodes: int | None = None, dynamic: bool = False,
                 calibrate: bool = True, calibration_rate: float = 0.2, draft_quant: str | None = None):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"MedusaDrafter: heads must be MedusaHeads, got {type(heads).__name__} (load published "
                            "heads with specdec_ext.models.checkpoints.load_medusa or MedusaDrafter.from_pretrained)")
        if choices is None:
            choices = [c for c in MC_SIM_7B_63 if len(c) <= heads.num_heads]
        self.dynamic = bool(dynamic)
        self.calibrate = bool(calibrate)
        self.calibration = ScoreCalibration(calibration_rate, "MedusaDrafter")
        if self.dynamic:  # every choice is a candidate; max_nodes is the per-step budget
            if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int)
                                          or max_nodes < 1):
                raise ValueError(f"MedusaDrafter: max_nodes must be an integer >= 1 (root included), got "
                                 f"{max_nodes!r}")
            tree = choices if isinstance(choices, StaticTree) else static_tree(choices)
            nodes = min(16 if max_nodes is None else max_nodes, tree.num_nodes)
        elif isinstance(choices, StaticTree):
            tree = static_tree(choices.choices, max_nodes) if max_nodes is not None else choices
        else:
            tree = static_tree(choices, max_nodes)
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"MedusaDrafter: the tree is {tree.max_depth} levels deep but there are only "
                             f"{heads.num_heads} Medusa heads (depth d needs head d - 1); pass choices no deeper "
                             f"than {heads.num_heads}")
        self.draft_quant = check_draft_quant("MedusaDrafter", draft_quant)
        self.heads = heads.eval() if self.draft_quant is None else quantize_weights(heads.eval(), self.draft_quant)
        self.tree = tree
        self.max_nodes = nodes if self.dynamic else tree.num_nodes
        self._paths: dict = {}  # (tree, device) -> [S - 1, depth * top_k] ancestor-or-self rank indicator
        self._lm_head = None
        self.hidden: torch.Tensor | None = None
        self._ready = False  # some row has a hidden state (host flag: no sync)

    @classmethod
    def from_pretrained(cls, path, target: nn.Module | None = None, choices=None,
                        max_nodes: int | None = None, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None, dynamic: bool = False,
                        draft_quant: str | None = None) -> "MedusaDrafter":
        """Loads an official Medusa-1 checkpoint directory (``config.json`` + ``medusa_lm_head.pt`` or
        ``.safetensors``); with ``target`` its hidden size / vocabulary are checked and, unless given, dtype and
        device are taken from it."""
        return cls(load_medusa(path, target=target, dtype=dtype, device=device), choices, max_nodes, dynamic=dynamic,
                   draft_quant=draft_quant)

    def begin(self, target: nn.Module, state: DecodeState, prefill_hidden_states=None) -> None:
        cfg = text_config(target.config)
        H = getattr(cfg, "hidden_size", None)
        if H is not None and H != self.heads.hidden_size:
            raise ValueError(f"MedusaDrafter: the heads were built for hidden size {self.heads.hidden_size} but the "
                             f"target's hidden_size is {H}; these heads belong to another model")
        lm_head = target.get_output_embeddings()
        if self.heads.has_lm_head:
            check_vocab("MedusaDrafter", self.heads.vocab_size, state.vocab_size)
        else:
            if lm_head is None:
                raise ValueError("MedusaDrafter: legacy heads reuse the target's lm_head, but the target has no "
                                 "output embeddings")
            if lm_head.weight.shape[-1] != self.heads.hidden_size:
                raise ValueError(f"MedusaDrafter: the target's lm_head takes {lm_head.weight.shape[-1]} features, the "
                                 f"heads produce {self.heads.hidden_size}")
        if self.heads.device != state.device:
            raise ValueError(f"MedusaDrafter: the Medusa heads are on {self.heads.device} but the target on "
                             f"{state.device}; put both on one device")
        self._lm_head = lm_head
        self.hidden, self._ready = None, False
        self.add_rows(target, state, prefill_hidden_states)

    def add_rows(self, target: nn.Module, rows: DecodeState, prefill_hidden_states=None) -> None:
        """The joining rows' hidden states (each prompt's last position before its root; zeros for a one-token
        prompt), appended to the running rows'."""
        dtype = self.heads.dtype
        B, dev = rows.batch_size, rows.device
        hidden = torch.zeros(B, self.heads.hidden_size, dtype=dtype, device=dev)
        if prefill_hidden_states is not None:
            hs = prefill_hidden_states[0]  # [B, P_max - 1, H]
            last = torch.tensor([max(n - 2, 0) for n in rows.prompt_lens], dtype=torch.int64)
            last = last.to(dev, non_blocking=True)
            has = torch.tensor([n >= 2 for n in rows.prompt_lens]).to(dev, non_blocking=True)
            picked = hs.gather(1, last[:, None, None].expand(B, 1, hs.shape[-1]))[:, 0]
            hidden = torch.where(has[:, None], picked.to(dtype), hidden)
            self._ready = self._ready or any(n >= 2 for n in rows.prompt_lens)
        self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden])

    @torch.no_grad()
    def candidates(self, num_heads: int, top_k: int) -> torch.Tensor:
        """``[B, num_heads, top_k]``: each row's top-k tokens of the first ``num_heads`` heads, best first."""
        logits = self.heads(self.hidden, self._lm_head, num_heads)  # [B, D, V]
        k = min(top_k, logits.shape[-1])
        cand = logits.topk(k, dim=-1).indices
        if k < top_k:  # vocabulary smaller than the tree's widest rank: repeat the last candidate (safe)
            cand = torch.cat([cand, cand[..., -1:].expand(*cand.shape[:-1], top_k - k)], -1)
        return cand

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        """The static tree (nodes deeper than ``max_depth`` left out, at most ``max_nodes``), drafted from each row's
        hidden state."""
        B, dev = state.batch_size, state.device
        root = state.last_tokens
        # (a per-step tree selects its nodes from the whole superset of that depth)
        tree = self.tree.cut(max_depth, None if self.dynamic else max_nodes)
        if tree.num_nodes == 1 or max_nodes <= 1 or not self._ready:
            return plain_tree(root)
        if self.dynamic:
            return self._propose_dynamic(tree, root, min(self.max_nodes, max_nodes))
        cand = self.candidates(tree.max_depth, tree.top_k).reshape(B, tree.max_depth * tree.top_k)
        drafts = cand.index_select(1, tree.gather_index_tensor(dev))
        tokens = torch.cat([root[:, None], drafts], 1)
        return DraftTree(tokens, tree.parents_tensor(B, dev), None, tree.tables(B, dev))

    def _path_matrix(self, tree: StaticTree, device) -> torch.Tensor:
        """``P[i - 1, (d - 1) * top_k + r] = 1`` for each ancestor-or-self (depth d, rank r) of node i: the
        candidates' cumulative scores are ``log_probs_flat @ P.T``."""
        key = (id(tree), str(device))
        hit = self._paths.get(key)
        if hit is None or hit[0] is not tree:
            P = torch.zeros(tree.num_nodes - 1, tree.max_depth * tree.top_k)
            for i in range(1, tree.num_nodes):
                a = i
                while a > 0:
                    P[i - 1, (tree.depth[a] - 1) * tree.top_k + tree.rank[a]] = 1.0
                    a = tree.parents[a]
            hit = self._paths[key] = (tree, P.to(device))
        return hit[1]

    @torch.no_grad()
    def _propose_dynamic(self, tree: StaticTree, root: torch.Tensor, max_nodes: int) -> DraftTree:
        B, dev, D, K = root.shape[0], root.device, tree.max_depth, tree.top_k
        logits = self.heads(self.hidden, self._lm_head, D)  # [B, D, V]
        scaled = self.calibration.apply(logits) if self.calibrate else logits.float()
        top = scaled.topk(min(K, scaled.shape[-1]), dim=-1)
        lp, ids = top.values - scaled.logsumexp(-1, keepdim=True), top.indices  # [B, D, K] best first
        if lp.shape[-1] < K:  # vocabulary smaller than the widest rank: never-chosen fillers
            pad = K - lp.shape[-1]
            lp = torch.cat([lp, lp.new_full((B, D, pad), float("-inf"))], -1)
            ids = torch.cat([ids, ids[..., -1:].expand(B, D, pad)], -1)
        if self.calibrate:
            self.calibration.predicted = lp[:, 0, 0].exp()  # head 0's best token: node 1 of every tree
        score = lp.reshape(B, D * K) @ self._path_matrix(tree, dev).T  # [B, S - 1]
        # the superset's non-root nodes as candidates, parents first (a node scores at most its parent's score)
        tokens = ids.reshape(B, D * K).index_select(1, tree.gather_index_tensor(dev))
        tokens, parents = ops.select_tree_nodes(tokens, score, tree.candidate_parents_tensor(B, dev), root,
                                                max_nodes - 1, validate=False)
        return DraftTree(tokens, parents, None)

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        self.calibration.update(result)
        if result.hidden_states is None:
            raise ValueError("MedusaDrafter.observe: the step's hidden states are missing (the loop must run the "
                             "target with output_hidden_states for hidden_state_layers = (-1,))")
        hs = result.hidden_states[0]  # [B, N, H]
        B, N, H = hs.shape
        node = result.accepted.gather(1, result.accept_len[:, None])  # last accepted node
        self.hidden = hs.gather(1, node[:, :, None].expand(B, 1, H))[:, 0].to(self.hidden.dtype)
        self._ready = True

    def retire(self, keep: torch.Tensor) -> None:
        """Keeps the hidden states of the rows ``keep``."""
        if self.hidden is not None:
            self.hidden = self.hidden.index_select(0, keep.to(self.hidden.device, non_blocking=True))
