"""specdec_ext.drafters.dynamic_tree: the EAGLE-2 tree against a plain-Python build of the same definition, the
masks each level attends under, and specdec_ext.models.masked_forward against ordinary forwards."""

from __future__ import annotations

import math

import pytest
import torch

from specdec_ext.drafters.dynamic_tree import ScoreCalibration, grow_dynamic_tree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VD = 7


def _table_logits(tok: int, parent_tok: int) -> torch.Tensor:
    """The toy draft: logits of a node's children from its token and its parent's (continuous: no ties)."""
    g = torch.Generator().manual_seed(1000 * tok + parent_tok + 17)
    return 3.0 * torch.randn(VD, generator=g)


def _reference_paths(root: int, root_logits: torch.Tensor, depth: int, k: int, total: int, scale: float):
    """EAGLE-2 from its definition, in Python: candidates with cumulative log-probabilities, a frontier of the k
    best children per level, and the ``total`` best candidates overall. Returns {token path: score}."""
    def children(path, score, logits):
        lp = torch.log_softmax(scale * logits.double(), -1)
        top = torch.topk(lp, k)
        return [(path + (int(t),), score + float(v)) for v, t in zip(top.values, top.indices)]

    cands = children((), 0.0, root_logits)
    frontier = cands
    for _ in range(1, depth):
        level = [c for path, s in frontier
                 for c in children(path, s, _table_logits(path[-1], path[-2] if len(path) > 1 else root))]
        cands = cands + level
        frontier = sorted(level, key=lambda c: -c[1])[:k]
    best = sorted(cands, key=lambda c: -c[1])[:total]
    return {path: s for path, s in best}


@pytest.mark.parametrize("k,depth,total", [(2, 4, 6), (3, 3, 8), (2, 1, 2), (3, 4, 30)])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_tree_equals_the_definition_and_levels_see_their_ancestors(k, depth, total, scale):
    roots = [3, 5]
    valid = torch.tensor([4, 9])
    root_logits = torch.stack([_table_logits(r, 0) for r in roots])
    kv_len = int(valid.max()) + (depth - 1) * k
    fed = [{}, {}]  # per row: token path -> cache slot
    prev_paths = [[(int(t),) for t in ()] for _ in roots]
    levels = []

    def level(d, tok, parent, mask, slots):
        assert tok.shape == parent.shape == slots.shape == (2, k) and mask.shape == (2, k, kv_len)
        levels.append(d)
        out = torch.empty(2, k, VD)
        for b in range(2):
            paths = []
            for j in range(k):
                path = ((int(tok[b, j]),) if d == 1 else prev_paths[b][int(parent[b, j])] + (int(tok[b, j]),))
                paths.append(path)
                fed[b][path] = int(slots[b, j])
                assert int(slots[b, j]) == int(valid[b]) + (d - 1) * k + j
                # attends to the prefix, then exactly its own fed ancestors and itself
                want = torch.zeros(kv_len, dtype=torch.bool)
                want[: int(valid[b])] = True
                for i in range(1, len(path) + 1):
                    want[fed[b][path[:i]]] = True
                assert torch.equal(mask[b, j], want), (d, b, j)
                out[b, j] = _table_logits(path[-1], path[-2] if len(path) > 1 else roots[b])
            prev_paths[b] = paths
        return out

    cal = None
    if scale != 1.0:
        cal = ScoreCalibration()
        cal.log_scale = torch.tensor(math.log(scale))
    tree = grow_dynamic_tree(torch.tensor(roots), root_logits, level, depth=depth, top_k=k, total_tokens=total,
                             valid=valid, kv_len=kv_len, calibration=cal)
    assert levels == list(range(1, depth))
    for b in range(2):
        want = _reference_paths(roots[b], root_logits[b], depth, k, total, scale)
        par, tok = tree.parents[b].tolist(), tree.tokens[b].tolist()
        assert tok[0] == roots[b] and par[0] == -1 and len(tok) == len(want) + 1
        paths = [()]
        for i in range(1, len(tok)):
            assert 0 <= par[i] < i  # parents first
            paths.append(paths[par[i]] + (tok[i],))
        assert set(paths[1:]) == set(want)
    if cal is not None:  # the calibrated probability of the best child, for the update
        best = torch.softmax(scale * root_logits.double(), -1).max(-1).values
        torch.testing.assert_close(cal.predicted.double(), best, rtol=1e-5, atol=1e-6)


def test_masked_forward_equals_ordinary_forwards():
    """Two sibling tokens fed in one masked forward, each seeing the prefix and itself, give the logits of two
    separate one-token forwards; their K/V land at the given slots."""
    transformers = pytest.importorskip("transformers")
    from specdec_ext.models import TreeKVCache, extend, masked_forward, tree_forward

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(0, 50, (1, 6))
    cache = TreeKVCache(cfg, 1, 16)
    extend(model, cache, prompt)
    a, b = 7, 11
    want = [tree_forward(model, cache, torch.tensor([[t]]), None, 6, validate=False)[0, 0] for t in (a, b)]
    mask = torch.zeros(1, 2, 9, dtype=torch.bool)
    mask[:, :, :6] = True
    mask[0, 0, 7] = mask[0, 1, 8] = True  # written at slots 7 and 8 (slot 6 left out)
    got = masked_forward(model, cache, torch.tensor([[a, b]]), torch.tensor([[6, 6]]), torch.tensor([7]), mask)
    torch.testing.assert_close(got[0], torch.stack(want), rtol=1e-4, atol=1e-5)
    assert cache.lengths.tolist() == [7]  # left at write_at
    with pytest.raises(ValueError, match="mask must have shape"):
        masked_forward(model, cache, torch.tensor([[a, b]]), torch.tensor([[6, 6]]), torch.tensor([7]),
                       torch.ones(1, 3, 9, dtype=torch.bool))
