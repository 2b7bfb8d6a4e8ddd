"""Verification policy: which op verifies a step's trees, per row (:class:`Verifier`).

* every row greedy: ``ops.verify_tree_greedy`` (no uniforms);
* ``acceptance="exact"`` otherwise: ``ops.verify_tree_sampling`` with each row's temperature / top-k / top-p; a
  greedy row in that batch gets temperature 0, which the op verifies as greedy (one-hot target weights on the first
  argmax: its tokens are exactly the greedy ones);
* ``acceptance="typical"``: Medusa's typical acceptance (lossy when sampling; at temperature 0 it equals greedy).

Each row's uniforms come from its own generator, ``max_nodes`` of them per step whatever the tree's size or the
batch (:meth:`~specdec_ext.state.DecodeState.uniforms`), so a seeded request's random stream does not depend on
what else shares its batch.
"""

from __future__ import annotations

from specdec_ext import ops
from specdec_ext.state import DecodeState, DraftTree

__all__ = ["ACCEPTANCE", "Verifier"]

ACCEPTANCE = ("exact", "typical")


class Verifier:
    """Verifies a step's trees under ``acceptance`` (see the module doc); ``max_nodes``: uniforms per row and step."""

    def __init__(self, acceptance: str, max_nodes: int, posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3):
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {acceptance!r}")
        for name, value in (("posterior_threshold", posterior_threshold), ("posterior_alpha", posterior_alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        self.acceptance = acceptance
        self.max_nodes = max_nodes
        self.threshold, self.alpha = float(posterior_threshold), float(posterior_alpha)

    def __call__(self, logits, tree: DraftTree, state: DecodeState) -> ops.Verification:
        s = state.sampling
        if s.greedy:
            return ops.verify_tree_greedy(logits, tree.tokens, tree.parents, validate=False)
        u = state.uniforms(state.batch_size, self.max_nodes)
        if self.acceptance == "typical":
            return ops.verify_tree_typical(logits, tree.tokens, tree.parents, u[:, 0], s.temperature,
                                           self.threshold, self.alpha, validate=False)
        return ops.verify_tree_sampling(logits, tree.tokens, tree.parents, u[:, : tree.num_nodes], tree.draft_probs,
                                        s.temperature, s.top_k, s.top_p, validate=False)
