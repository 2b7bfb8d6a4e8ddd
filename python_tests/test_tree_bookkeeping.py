"""The dynamic-tree bookkeeping ops (specdec_ext.ops.advance_tree_frontier, select_tree_nodes) against their
plain-Python references: random frontiers and candidate sets, ties and NaN scores in the selection, trees grown by
expand_tree_step end to end, and clear errors (or sentinels without validation) for out-of-range indices."""

from __future__ import annotations

import pytest
import torch

from helpers import make_gen
from specdec_ext import ops
from specdec_ext.ops import reference as ref


def _frontier_case(B=3, F=4, K=3, S=4, C=14, L=40, seed=0):
    g = make_gen(seed)
    return dict(cand_tokens=torch.randint(0, 1000, (B, F, K), generator=g),
                cand_scores=torch.randn(B, F, K, generator=g),
                selected=torch.stack([torch.randperm(F * K, generator=g)[:S] for _ in range(B)]),
                ancestors=torch.rand(B, F, C, generator=g) < 0.4, self_column=C - S - 1,
                column=torch.randint(0, C, (B, L), generator=g))


def _on(device, case):
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in case.items()}


@pytest.mark.parametrize("shape", [dict(), dict(B=1, F=1, K=1, S=1, C=3, L=1), dict(B=2, F=2, K=5, S=10, C=12)])
def test_advance_matches_reference(device, shape):
    c = _frontier_case(**shape)
    got = ops.advance_tree_frontier(**_on(device, c))
    want = ref.advance_tree_frontier(**c)
    for name, g, w in zip(got._fields, got, want):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w), name
    # the definition, spelled out for one node
    b, s = 1 if c["selected"].shape[0] > 1 else 0, 0
    f, j = divmod(int(c["selected"][b, s]), c["cand_tokens"].shape[2])
    row = c["ancestors"][b, f].clone()
    row[c["self_column"] + s] = True
    assert int(got.tokens[b, s]) == int(c["cand_tokens"][b, f, j]) and int(got.parents[b, s]) == f
    assert torch.equal(got.mask[b, s].cpu(), row[c["column"][b]])


@pytest.mark.parametrize("bad, row, message", [
    (lambda c: c["selected"].__setitem__((1, 2), 12), 1, r"selected\[1, 2\] = 12 is out of range"),
    (lambda c: c["selected"].__setitem__((2, 0), -1), 2, r"selected\[2, 0\] = -1 is out of range"),
    (lambda c: c["column"].__setitem__((0, 7), 14), 0, r"column\[0, 7\] = 14 is out of range"),
])
def test_advance_bad_indices(device, bad, row, message):
    c = _frontier_case()
    bad(c)
    with pytest.raises(ValueError, match=message):
        ops.advance_tree_frontier(**_on(device, c))
    with pytest.raises(ValueError, match=message):
        ref.advance_tree_frontier(**c)
    out = ops.advance_tree_frontier(**_on(device, c), validate=False)
    assert not out.mask[row].any() and not out.ancestors[row].any() and not out.tokens[row].any()
    want = ref.advance_tree_frontier(**c, validate=False)
    for g, w in zip(out, want):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(self_column=11), r"self_column must be in \[0, C - S\] = \[0, 10\]"),
    (lambda c: c.update(cand_scores=c["cand_scores"].double()), r"cand_scores must be Float"),
    (lambda c: c.update(ancestors=c["ancestors"][:, :2]), r"ancestors must have shape \[B, F, C\]"),
    (lambda c: c.update(selected=c["selected"][:2]), r"selected must have shape \[B, S\]"),
])
def test_advance_bad_arguments(device, change, message):
    c = _frontier_case()
    change(c)
    with pytest.raises(ValueError, match=message):
        ops.advance_tree_frontier(**_on(device, c))


def _candidates(B=3, levels=4, k=3, seed=0, ties=False):
    """A grown tree's candidates: k at level 1, then k children of each of k frontier candidates per level, with
    scores that never exceed the parent's (log-probabilities are <= 0); ``ties``: scores on a coarse grid."""
    g = make_gen(seed)
    toks, scores, parents = [], [], []
    for b in range(B):
        tok, sc, par = [], [], []
        front = []
        for lvl in range(levels):
            new = []
            for f in (front if lvl else [-1]):
                for _ in range(k):
                    base = sc[f] if f >= 0 else 0.0
                    drop = float(torch.rand(1, generator=g)) * 2
                    tok.append(int(torch.randint(0, 500, (1,), generator=g)))
                    sc.append(base - (round(drop) if ties else drop))
                    par.append(f)
                    new.append(len(tok) - 1)
            front = sorted(new, key=lambda i: -sc[i])[:k]
        toks.append(tok), scores.append(sc), parents.append(par)
    return (torch.tensor(toks), torch.tensor(scores, dtype=torch.float32), torch.tensor(parents),
            torch.arange(100, 100 + B))


@pytest.mark.parametrize("num_nodes", [0, 1, 5, 12, 1000])
@pytest.mark.parametrize("ties", [False, True])
def test_select_matches_reference(device, num_nodes, ties):
    tokens, scores, parents, roots = _candidates(ties=ties)
    got = ops.select_tree_nodes(tokens.to(device), scores.to(device), parents.to(device), roots.to(device), num_nodes)
    want = ref.select_tree_nodes(tokens, scores, parents, roots, num_nodes)
    M = min(num_nodes, tokens.shape[1])
    assert got[0].shape == (3, M + 1) and torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    # a valid tree: the root first, every parent an earlier node
    par = got[1].cpu()
    assert (par[:, 0] == -1).all() and all(0 <= int(par[b, i]) < i for b in range(3) for i in range(1, M + 1))


def test_select_ranks_ties_by_index_and_nan_last(device):
    tokens = torch.arange(6)[None] + 10
    scores = torch.tensor([[-1.0, float("nan"), -0.5, -1.0, -0.5, -3.0]])
    parents = torch.full((1, 6), -1)
    got = ops.select_tree_nodes(tokens.to(device), scores.to(device), parents.to(device), torch.tensor([7]).to(device),
                                4)
    # the best four: -0.5 (2), -0.5 (4), -1.0 (0), -1.0 (3); then in candidate order
    assert got[0].cpu().tolist() == [[7, 10, 12, 13, 14]] and got[1].cpu().tolist() == [[-1, 0, 0, 0, 0]]
    got = ops.select_tree_nodes(tokens.to(device), scores.to(device), parents.to(device), torch.tensor([7]).to(device),
                                6)
    assert got[0].cpu().tolist() == [[7, 10, 11, 12, 13, 14, 15]]  # NaN ranks last but is kept when all are


def test_select_bad_parent(device):
    tokens, scores, parents, roots = _candidates()
    parents[1, 4] = 20  # a later candidate
    with pytest.raises(ValueError, match=r"parents\[1, 4\] = 20: candidate 4 is kept but its parent is not"):
        ops.select_tree_nodes(tokens.to(device), scores.to(device), parents.to(device), roots.to(device), 30)
    with pytest.raises(ValueError, match=r"parents\[1, 4\] = 20: candidate 4 is kept but its parent is not"):
        ref.select_tree_nodes(tokens, scores, parents, roots, 30)
    got = ops.select_tree_nodes(tokens.to(device), scores.to(device), parents.to(device), roots.to(device), 30,
                                validate=False)
    assert (got[0][1] == -1).all() and (got[1][1] == -1).all()
    good = ops.select_tree_nodes(tokens[:1], scores[:1], parents[:1], roots[:1], 30)
    assert torch.equal(got[0][0].cpu(), good[0][0]) and torch.equal(got[1][0].cpu(), good[1][0])
    with pytest.raises(ValueError, match=r"num_nodes must be >= 0"):
        ops.select_tree_nodes(tokens.to(device), scores.to(device), parents.to(device), roots.to(device), -1)
