"""Verification policy: which op verifies a step's trees, per row (:class:`Verifier`).

* every row greedy: ``ops.verify_tree_greedy`` (no uniforms);
* ``acceptance="exact"`` otherwise: ``ops.verify_tree_sampling`` with each row's temperature / top-k / top-p; a
  greedy row in that batch gets temperature 0, which the op verifies as greedy (one-hot target weights on the first
  argmax: its tokens are exactly the greedy ones);
* ``acceptance="typical"``: Medusa's typical acceptance (lossy when sampling; at temperature 0 it equals greedy).

Each row's uniforms come from its own generator, ``max_nodes`` of them per step whatever the tree's size or the
batch (:meth:`~specdec_ext.state.DecodeState.uniforms`), so a seeded request's random stream does not depend on
what else shares its batch.

Padding. Rows of one batch share the tree's ``N``; a drafter whose row b has a smaller tree pads it with deeper
nodes and says so in ``DraftTree.row_depth`` / ``row_nodes`` (``drafters.base.pad_trees``). Verification walks the
whole tree; a row whose walk reached its own depth is cut there, and its next token is drawn afresh from the
target's distribution at the node it stopped on, with the same uniform — what the walk draws at a node without
children. A row's tokens are then those of its own tree, whatever its neighbours' trees add. (Under greedy
verification a padding node is accepted only when it holds the target's argmax, so all-greedy batches skip the
cut.)
"""

from __future__ import annotations

import torch

from specdec_ext import ops
from specdec_ext.drafters.base import to_device
from specdec_ext.state import DecodeState, DraftTree, SamplingParams

__all__ = ["ACCEPTANCE", "Verifier"]

ACCEPTANCE = ("exact", "typical")


class Verifier:
    """Verifies a step's trees under ``acceptance`` (see the module doc); ``max_nodes``: uniforms per row and step;
    ``where``: the name its errors start with."""

    def __init__(self, acceptance: str, max_nodes: int, posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, where: str = "Verifier"):
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"{where}: acceptance must be 'exact' or 'typical', got {acceptance!r}")
        for name, value in (("posterior_threshold", posterior_threshold), ("posterior_alpha", posterior_alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{where}: {name} must be a number in [0, 1], got {value!r}")
        self.acceptance = acceptance
        self.max_nodes = max_nodes
        self.threshold, self.alpha = float(posterior_threshold), float(posterior_alpha)

    def __call__(self, logits, tree: DraftTree, state: DecodeState) -> ops.Verification:
        s = state.sampling
        if s.greedy:
            return ops.verify_tree_greedy(logits, tree.tokens, tree.parents, validate=False)
        u = state.uniforms(state.batch_size, self.max_nodes)
        typical = self.acceptance == "typical"
        if typical:
            v = ops.verify_tree_typical(logits, tree.tokens, tree.parents, u[:, 0], s.temperature, self.threshold,
                                        self.alpha, validate=False)
        else:
            v = ops.verify_tree_sampling(logits, tree.tokens, tree.parents, u[:, : tree.num_nodes],
                                         tree.draft_probs, s.temperature, s.top_k, s.top_p, validate=False)
        if tree.row_nodes is None or min(tree.row_nodes, default=0) == tree.num_nodes:
            return v  # nothing padded
        return _cut_at(v, logits, tree.row_depth, u[:, 0], s, typical)


def _cut_at(v: ops.Verification, logits: torch.Tensor, limit: list[int], u0: torch.Tensor, s: SamplingParams,
            typical: bool) -> ops.Verification:
    """``v`` with each row's walk cut at depth ``limit[b]`` (see "Padding" in the module doc); no host
    synchronisation."""
    B, N, V = logits.shape
    cap = to_device(limit, logits.device)
    stopped_on = v.accepted.gather(1, cap[:, None]).clamp(min=0)  # [B, 1]: the path's node at depth cap (if any)
    x = logits.gather(1, stopped_on[:, :, None].expand(B, 1, V))[:, 0]
    top_k, top_p = (0, 1.0) if typical else (s.top_k, s.top_p)  # (typical acceptance draws from softmax(x / T))
    fresh = ops.sample_tokens(x, u0, s.temperature, top_k, top_p, validate=False)[0]
    reached = v.accept_len >= cap
    j = torch.arange(N, device=logits.device)
    return ops.Verification(torch.where(j <= cap[:, None], v.accepted, -1), torch.minimum(v.accept_len, cap),
                            torch.where(reached, fresh, v.next_token))
