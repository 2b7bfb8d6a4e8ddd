"""One drafter object serving many requests keeps bounded state, so its speed cannot drift with the request count.

A server keeps its drafter (the tree drafters keep their score calibration across generations on purpose). Over 12
greedy requests with one drafter each — EAGLE-2 (a random draft: a model pair it never saw, so acceptance is low and
the calibration is pushed hardest), the draft model's dynamic tree and Medusa's per-step tree, and the n-gram
drafter — every request of the same size leaves the drafter holding the same tensors (same shapes: caches and
features are per generation, not accumulated), the same attributes, the calibration scale inside its clamp, and the
same work per step (draft forwards per target forward bounded by the tree's depth); the output stays the target's
greedy output. Timing is measured where it belongs, in ``benchmarks/python/bench_drafter_reuse.py``."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from test_drafter_eagle import random_draft  # noqa: E402
from test_drafter_eagle import target as eagle_target  # noqa: E402
from test_drafter_medusa import random_heads  # noqa: E402
from test_drafter_medusa import target as medusa_target  # noqa: E402
from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter, NgramDrafter  # noqa: E402
from specdec_ext.drafters.dynamic_tree import _tree_constants  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REQUESTS = 12
PROMPTS = [[5, 17, 3, 9, 30, 2, 8, 41], [7, 7, 12, 60, 4, 19, 22, 5], [11, 3, 3, 3, 50, 27, 9, 14]]


def _held(drafter) -> dict:
    """The shapes of the tensors a drafter holds, one level into the objects it keeps (its caches, calibration)."""
    out = {}
    for name, value in vars(drafter).items():
        if isinstance(value, torch.Tensor):
            out[name] = tuple(value.shape)
        elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for sub, t in vars(value).items():
                if isinstance(t, torch.Tensor):
                    out[f"{name}.{sub}"] = tuple(t.shape)
    return out


def _drafters():
    torch.manual_seed(0)
    return {
        "eagle2": (eagle_target(), lambda: EagleDrafter(random_draft(1), depth=4, top_k=3, total_tokens=8), 4),
        "draft-model tree": (eagle_target(),
                             lambda: DraftModelDrafter(make_model("llama", seed=3, num_hidden_layers=1),
                                                       num_draft_tokens=3, tree_width=2, total_tokens=6), 3),
        "medusa per-step tree": (medusa_target(), lambda: MedusaDrafter(random_heads(), dynamic=True, max_nodes=8),
                                 0),
        "ngram": (eagle_target(), lambda: NgramDrafter(num_pred_tokens=4), 0),
    }


@pytest.mark.parametrize("name", ["eagle2", "draft-model tree", "medusa per-step tree", "ngram"])
def test_a_drafter_serving_many_requests_keeps_bounded_state(name):
    target, make, depth = _drafters()[name]
    drafter = make()
    reference = {i: generate(target, None, torch.tensor(p), max_new_tokens=8, eos_token_id=[])[0].tolist()
                 for i, p in enumerate(PROMPTS)}
    held, attributes, per_step = {}, None, []
    for r in range(REQUESTS):
        i = r % len(PROMPTS)
        out, stats = generate(target, drafter, torch.tensor(PROMPTS[i]), max_new_tokens=8, eos_token_id=[])
        assert out.tolist() == reference[i], f"request {r}"
        # the same tensors after every request of this prompt's size, and no attribute added along the way
        assert held.setdefault(i, _held(drafter)) == _held(drafter), f"request {r}: the drafter's state changed shape"
        assert attributes is None or set(vars(drafter)) == attributes, f"request {r}: new drafter attributes"
        attributes = set(vars(drafter))
        calibration = getattr(drafter, "calibration", None)
        if calibration is not None and calibration.log_scale is not None:
            assert abs(float(calibration.log_scale)) <= math.log(16.0) + 1e-6
        if depth:  # the draft network's forwards per target forward: the tree's levels and one catch-up at most
            per_step.append(stats.draft_forwards / stats.steps)
    assert all(x <= depth + 1 for x in per_step)
    assert not depth or min(per_step) > 0  # (the drafter's network did run)
    assert _tree_constants.cache_info().currsize <= 32
