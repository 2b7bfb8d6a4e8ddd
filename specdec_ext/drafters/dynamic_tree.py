"""EAGLE-2 dynamic draft trees with calibrated scores, for any drafter that can run its network on a tree level.

:func:`grow_dynamic_tree` builds the tree (EAGLE-2, E ``topK_genrate``). From the root's logits the top ``top_k``
tokens are the depth-1 candidates (score = log-probability). Each further depth runs the drafter's network once on
the ``top_k`` frontier nodes (the ``level`` callback: each node attends to the row's valid prefix and to its own
ancestors in the tree) and :func:`specdec_ext.ops.expand_tree_step` scores the ``top_k`` children of every frontier
node (cumulative log-probability) and keeps the best ``top_k`` as the next frontier. At the end the
``total_tokens`` best candidates by cumulative score (ties: shallower / earlier first, so a node's parent always
ranks before it) form the tree, in candidate order (parents first). The drafts are deterministic
(``draft_probs = None``): lossless under greedy and sampling verification. Nothing here synchronises with the
device. A level's bookkeeping (the next frontier's tokens, scores, parents, ancestor rows and masks) is one op,
:func:`specdec_ext.ops.advance_tree_frontier`, and the final selection another,
:func:`specdec_ext.ops.select_tree_nodes`: a tree step pays a few microseconds per small op, and these were ~25.

The tree goes out without :class:`~specdec_ext.state.TreeTables` (the verification forward derives them): the
growth's ancestor rows cover only the frontier nodes, by tree slot, and ``select_tree_nodes`` does not return which
candidate each kept node is, so remapping them would cost the gathers that ``tree_ancestor_mask`` does in one op.

Tree slots. Level d's frontier (d = 1 .. depth - 1) is fed at the drafter's cache slots ``valid[b] + (d - 1) *
top_k + j``; the mask handed to ``level`` (``[B, top_k, kv_len]`` bool) allows the prefix (slots ``< valid[b]``)
and the node's ancestors-or-self among the fed slots. The slots are scratch: the drafter discards them after the
step (its next catch-up recomputes the accepted tokens from the real context).

:class:`ScoreCalibration`. EAGLE-2 ranks nodes by the draft's cumulative probability as an estimate of the chance
the target accepts them. A draft trained to match the target's *distribution* is under-confident about acceptance
when verification is greedy (the target's argmax is accepted, not a sample) or when the target's distribution is
flat; on the model family in bfloat16 the EAGLE tree then spent its nodes on second-best siblings and reached mean
accepted length 3.2 where sharper scores reach 3.6-4.7 with the same trees. So the scores are log-softmax of
``scale * logits``, and after each step ``log(scale)`` moves by ``rate * (accepted - predicted)``, where
*predicted* is the calibrated probability of the root's best child and *accepted* whether the target accepted it
(mean over the batch's live rows): the scale settles where that prediction matches the observed rate, whatever the
model, the text or the sampling temperature. It only decides which candidates fill the tree, never which tokens are
candidates, so verification stays lossless. The scale lives on the device (no synchronisation) and stays within
``[1/16, 16]``.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from specdec_ext import ops
from specdec_ext.state import DraftTree, StepResult

__all__ = ["CalibratedScores", "ScoreCalibration", "check_tree_shape", "grow_dynamic_tree", "max_tree_nodes",
           "scratch_tree_nodes"]

_MIN_LOG_SCALE, _MAX_LOG_SCALE = -math.log(16.0), math.log(16.0)


def check_tree_shape(owner: str, depth: int, top_k: int, total_tokens: int,
                     names: tuple[str, str, str] = ("depth", "top_k", "total_tokens")) -> None:
    """ValueError naming ``owner`` and the argument (as the owner calls it: ``names``) unless depth, top_k and
    total_tokens are integers >= 1."""
    for name, val in zip(names, (depth, top_k, total_tokens)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{owner}: {name} must be an integer >= 1, got {val!r}")


def max_tree_nodes(depth: int, top_k: int, total_tokens: int) -> int:
    """Nodes of the largest dynamic tree, root included."""
    return 1 + min(total_tokens, top_k + (depth - 1) * top_k * top_k)


def scratch_tree_nodes(owner: str, num_draft_tokens: int, tree_width: int, total_tokens: int | None) -> int:
    """The ``max_nodes`` of a drafter of chains (``tree_width = 1``, no ``total_tokens``) or dynamic trees
    (``tree_width >= 2`` with ``total_tokens``) whose levels write scratch K/V into the target's cache after the
    prefix (self-speculation): the larger of the largest tree and the scratch, ``1 + (depth - 1) * width`` slots, so
    that the room the engine leaves after each row holds both. A ValueError naming ``owner`` and the argument for a
    bad shape."""
    check_tree_shape(owner, num_draft_tokens, tree_width, 1 if total_tokens is None else total_tokens,
                     names=("num_draft_tokens", "tree_width", "total_tokens"))
    if (total_tokens is None) != (tree_width == 1):
        raise ValueError(f"{owner}: a dynamic tree needs tree_width >= 2 and total_tokens, a chain tree_width = 1 "
                         f"without total_tokens; got tree_width = {tree_width}, total_tokens = {total_tokens}")
    if total_tokens is None:
        return 1 + num_draft_tokens
    return max(max_tree_nodes(num_draft_tokens, tree_width, total_tokens), 1 + (num_draft_tokens - 1) * tree_width)


class ScoreCalibration:
    """The score scale of the module doc: :meth:`apply` to the draft logits, :meth:`update` with each step's
    result. ``rate`` in (0, 1]."""

    def __init__(self, rate: float = 0.2, owner: str = "ScoreCalibration"):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < rate <= 1.0:
            raise ValueError(f"{owner}: calibration_rate must be a number in (0, 1], got {rate!r}")
        self.rate = float(rate)
        self.log_scale: torch.Tensor | None = None  # [] float32 on the device
        self.predicted: torch.Tensor | None = None  # [B]: calibrated probability of the root's best child

    @property
    def scale(self) -> float:
        """The current factor (1.0 before any update; reading it synchronises with the device)."""
        return 1.0 if self.log_scale is None else float(self.log_scale.exp())

    def reset(self) -> None:
        self.log_scale = None
        self.predicted = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``scale * logits`` in float32."""
        return logits.float() * self.factor(logits.device)

    def factor(self, device) -> torch.Tensor:
        """The scale as a ``[]`` float32 tensor on ``device`` (for several :meth:`apply`-like products)."""
        if self.log_scale is None or self.log_scale.device != torch.device(device):
            self.log_scale = torch.zeros((), dtype=torch.float32, device=device)
        return self.log_scale.exp()

    def update(self, result: StepResult) -> None:
        """One step from whether node 1 (the root's best child, which always ranks first) was accepted."""
        predicted, self.predicted = self.predicted, None
        if predicted is None or result.accepted.shape[1] < 2:
            return
        gap = ((result.accepted[:, 1] == 1).float() - predicted).mean()
        self.log_scale = torch.add(self.log_scale, gap, alpha=self.rate).clamp_(_MIN_LOG_SCALE, _MAX_LOG_SCALE)


# level(d, tokens [B, k] target ids, parent [B, k] index into the previous frontier, mask [B, k, kv_len] bool,
#       slots [B, k] int64) -> logits [B, k, Vd] of the frontier's children
LevelFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CalibratedScores:
    """The two members of a drafter whose trees rank candidates by calibrated scores (its :class:`ScoreCalibration`
    in ``self.calibration``), one definition for all of them."""

    calibration: ScoreCalibration

    @property
    def score_scale(self) -> float:
        """The factor on the draft logits that ranks tree candidates (1.0 before any calibration; reading it
        synchronises with the device)."""
        return self.calibration.scale

    def reset_calibration(self) -> None:
        """Forgets the calibrated scale (back to 1.0)."""
        self.calibration.reset()


@functools.lru_cache(maxsize=32)
def _tree_constants(B: int, k: int, depth: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors every tree of this shape starts from, made once (a step pays ~5 us per small op). Read-only.

    The ancestor table ``front_anc[b, j, c]`` has a column per tree slot ``s`` at ``c = 1 + s``, and two columns
    that never change: ``c = 0`` (True: the row's valid prefix) and ``c = slots_n + 1`` (False: beyond the tree),
    so that a cache position's column is its offset from the row's first tree slot plus one, clamped to that range,
    and a level's mask is one gather (:func:`specdec_ext.ops.advance_tree_frontier` makes the next one)."""
    slots_n = (depth - 1) * k
    anc = torch.zeros(B, k, slots_n + 2, dtype=torch.bool, device=device)
    anc[:, :, 0] = True
    anc[:, :, 1: k + 1].diagonal(dim1=1, dim2=2).fill_(True)  # level 1's nodes: slots 0 .. k - 1
    return {"front_anc": anc, "zero": torch.zeros(B, 1, dtype=torch.float32, device=device),
            "first_front": torch.arange(k, device=device).expand(B, k),
            "root_parent": torch.zeros(B, k, dtype=torch.int64, device=device),
            "root_marks": torch.full((B, k), -1, dtype=torch.int64, device=device),
            "level_slots": torch.arange(slots_n, device=device).view(1, depth - 1, k),
            # the first candidate index of level d (d >= 1: k + (d - 1) k^2; level 0's k frontier nodes are the
            # first candidates) repeated over that level's k frontier nodes
            "front_offsets": torch.tensor([0] + [k + (d - 1) * k * k for d in range(1, max(depth - 1, 1))],
                                          device=device).repeat_interleave(k)[None]}


def grow_dynamic_tree(root: torch.Tensor, root_logits: torch.Tensor, level: LevelFn, *, depth: int, top_k: int,
                      total_tokens: int, valid: torch.Tensor, kv_len: int,
                      target_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      calibration: ScoreCalibration | None = None) -> DraftTree:
    """The dynamic tree of the module doc. ``root[B]`` token ids, ``root_logits[B, Vd]`` the draft's prediction
    after the root; ``valid[B]`` the drafter's valid prefix lengths and ``kv_len >= max(valid) + (depth - 1) *
    top_k`` the mask width; ``target_ids`` maps indices of the logits' last dimension to target token ids (default:
    the same). Returns the tree with ``min(total_tokens, candidates) + 1`` nodes."""
    B, dev, k = root.shape[0], root.device, top_k
    ids = target_ids if target_ids is not None else (lambda x: x)
    if calibration is not None:
        factor = calibration.factor(dev)  # (once: the scale does not change while the tree grows)

        def scale(x):
            return x.float() * factor
    else:
        def scale(x):
            return x
    const = _tree_constants(B, k, depth, torch.device(dev))
    ct, cs, _ = ops.expand_tree_step(scale(root_logits[:, None]), const["zero"], k, k, validate=False)
    if calibration is not None:
        calibration.predicted = cs[:, 0, 0].exp()
    # all candidates so far (flat) and their scores
    cand_tok = [ids(ct.reshape(B, k))]
    cand_score = [cs.reshape(B, k)]
    # each level's frontier, the parents of the next level's k * k candidates, as indices among that level's
    # candidates (the level's first candidate index is added at the end: const["front_offsets"])
    fronts = []
    front_cand = const["first_front"]  # frontier = all depth-1 candidates
    front_tok, front_score = cand_tok[0], cand_score[0]
    front_parent = const["root_parent"]  # depth 1: every node's parent is the root
    slots_n = (depth - 1) * k
    if slots_n:
        front_anc = const["front_anc"]
        # the ancestor-table column of every cache position (see _tree_constants), and every level's slots
        column = (torch.arange(1, kv_len + 1, device=dev) - valid[:, None]).clamp_(0, slots_n + 1)
        mask = front_anc.gather(2, column[:, None, :].expand(B, k, kv_len))  # the prefix or an ancestor (or self)
        level_slots = valid[:, None, None] + const["level_slots"]  # [B, depth - 1, k]
    for d in range(1, depth):
        lg = scale(level(d, front_tok, front_parent, mask, level_slots[:, d - 1]))  # [B, k, Vd]
        ct, cs, sel = ops.expand_tree_step(lg, front_score, k, k, validate=False)
        ct = ids(ct)
        cand_tok.append(ct.reshape(B, k * k))
        cand_score.append(cs.reshape(B, k * k))
        fronts.append(front_cand)
        if d == depth - 1:
            break
        # the k best children: tokens, scores, parents, ancestor rows and masks (their own slots: 1 + d k + j)
        front_tok, front_score, front_parent, front_anc, mask = ops.advance_tree_frontier(
            ct, cs, sel, front_anc, 1 + d * k, column, validate=False)
        front_cand = sel
    parent = const["root_marks"]  # each candidate's parent candidate (-1: the root)
    if fronts:
        front_cands = torch.cat(fronts, 1) + const["front_offsets"][:, : len(fronts) * k]
        parent = torch.cat([parent, front_cands.repeat_interleave(k, 1)], 1)
    tokens, parents = ops.select_tree_nodes(torch.cat(cand_tok, 1), torch.cat(cand_score, 1), parent, root,
                                            total_tokens, validate=False)
    return DraftTree(tokens, parents, None)
