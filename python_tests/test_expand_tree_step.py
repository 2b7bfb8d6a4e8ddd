"""expand_tree_step (EAGLE-2 dynamic-tree expansion) vs the reference and an independent float64 computation."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close_lowp, assert_raises_exactly, expected_error, make_gen, on, ops, ref, strided_rows

# (B, F, V, top_k, num_select)
CASES = [(1, 1, 7, 1, 1), (3, 5, 7, 7, 35), (7, 26, 7, 3, 10), (7, 64, 7, 2, 128), (1, 64, 111, 4, 60),
         (3, 26, 111, 8, 1), (7, 5, 111, 111, 300), (3, 1, 32000, 10, 10), (3, 5, 32000, 4, 7), (7, 26, 32000, 1, 26),
         (1, 64, 32000, 3, 100)]
# cand_scores = parent score + log_softmax: float32 log-sum-exp over up to 32000 terms.
S_ATOL, S_RTOL = 2e-5, 1e-6


def make_case(B, F, V, seed):
    gen = make_gen(seed)
    logits = torch.randn(B, F, V, generator=gen) * 2
    parent_scores = -torch.rand(B, F, generator=gen) * 5
    return logits, parent_scores


def run_ref(logits, parent_scores, top_k, num_select, validate=True):
    return ref.expand_tree_step(logits.cpu(), parent_scores.cpu(), top_k, num_select, validate)


@pytest.mark.parametrize("B,F,V,top_k,num_select", CASES)
def test_matches_reference(device, dtype, B, F, V, top_k, num_select):
    logits, parent_scores = make_case(B, F, V, seed=B * 100003 + F * 1009 + V)
    x = logits.to(dtype)
    toks, scores, sel = ops.expand_tree_step(*on(device, x, parent_scores), top_k, num_select)
    assert toks.shape == (B, F, top_k) and toks.dtype == torch.int64 and toks.device.type == device
    assert scores.shape == (B, F, top_k) and scores.dtype == torch.float32 and scores.device.type == device
    assert sel.shape == (B, num_select) and sel.dtype == torch.int64 and sel.device.type == device
    want_toks, want_scores, want_sel = run_ref(x, parent_scores, top_k, num_select)
    assert torch.equal(toks.cpu(), want_toks), "cand_tokens differ"
    _, scores_f32, _ = run_ref(logits, parent_scores, top_k, num_select)
    # Low precision: the float32 reference on unrounded logits may rank other tokens; compare where tokens agree.
    same = ref.expand_tree_step(logits, parent_scores, top_k, num_select)[0] == want_toks
    ref_f32_here = torch.where(same, scores_f32, want_scores)
    assert_close_lowp(scores, want_scores, ref_f32_here, atol=S_ATOL, rtol=S_RTOL, name="cand_scores")
    _check_selected(sel.cpu(), scores.cpu(), want_sel)


def _check_selected(sel, scores, want_sel):
    """selected equals the reference, except that candidates whose scores are within rounding of each other may be
    ranked either way: then the kernel's own scores must justify its order (best first, ties: lower index)."""
    if torch.equal(sel, want_sel):
        return
    B = sel.shape[0]
    flat = scores.reshape(B, -1)
    for b in range(B):
        if torch.equal(sel[b], want_sel[b]):
            continue
        mine = torch.sort(flat[b], descending=True, stable=True).indices[: sel.shape[1]]
        assert torch.equal(sel[b], mine), f"row {b}: selected is not the best candidates by the op's own scores"
        gap = (flat[b][sel[b]] - flat[b][want_sel[b]]).abs().max()
        assert float(gap) <= 2 * S_ATOL, f"row {b}: selected differs from the reference beyond rounding"


def test_independent_float64(device):
    """cand_tokens / cand_scores / selected from their definitions, computed here in float64."""
    B, F, V, k, S = 3, 6, 50, 5, 12
    logits, parent_scores = make_case(B, F, V, seed=1)
    toks, scores, sel = (t.cpu() for t in ops.expand_tree_step(*on(device, logits, parent_scores), k, S))
    lp = torch.log_softmax(logits.double(), -1)
    want_toks = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    assert torch.equal(toks, want_toks)
    want_scores = parent_scores.double()[..., None] + torch.gather(lp, -1, want_toks)
    torch.testing.assert_close(scores.double(), want_scores, atol=1e-5, rtol=1e-6)
    want_sel = torch.sort(want_scores.reshape(B, -1), dim=-1, descending=True, stable=True).indices[:, :S]
    assert torch.equal(sel, want_sel)
    # The next frontier: parents of the selected candidates, and their tokens.
    assert torch.equal(toks.reshape(B, -1).gather(1, sel), want_toks.reshape(B, -1).gather(1, want_sel))
    assert bool(((sel // k) < F).all())


def test_ties(device, dtype):
    """Equal logits: lower token id first; equal scores: lower flat index first."""
    B, F, V = 1, 3, 10
    logits = torch.zeros(B, F, V)
    logits[0, 0, [7, 2, 5]] = 1.0
    logits[0, 1] = logits[0, 0]
    logits[0, 2, 9] = 3.0
    parent_scores = torch.tensor([[-1.0, -1.0, -30.0]])
    toks, scores, sel = (t.cpu() for t in ops.expand_tree_step(*on(device, logits.to(dtype), parent_scores), 4, 6))
    assert toks[0, 0].tolist() == [2, 5, 7, 0] and toks[0, 1].tolist() == [2, 5, 7, 0]
    assert toks[0, 2].tolist() == [9, 0, 1, 2]
    assert sel[0].tolist() == [0, 1, 2, 4, 5, 6]
    want = run_ref(logits.to(dtype), parent_scores, 4, 6)
    assert torch.equal(toks, want[0]) and torch.equal(sel, want[2])


def test_neg_inf_logits(device):
    """-inf logits are valid (masked tokens) as long as one token is finite: their candidates score -inf and rank
    last (ties between them: lower index)."""
    logits = torch.randn(2, 3, 9, generator=make_gen(2))
    logits[0, 1, 2:] = -math.inf
    logits[1, :, 1:] = -math.inf
    parent_scores = torch.zeros(2, 3)
    got = [t.cpu() for t in ops.expand_tree_step(*on(device, logits, parent_scores), 4, 12)]
    want = run_ref(logits, parent_scores, 4, 12)
    assert torch.equal(got[0][:, :, :2], want[0][:, :, :2]) and torch.equal(got[0][0, [0, 2]], want[0][0, [0, 2]])
    torch.testing.assert_close(got[1], want[1], atol=S_ATOL, rtol=S_RTOL)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("layout", ["gap", "transposed"])
def test_strided_logits(device, dtype, layout):
    logits, parent_scores = make_case(3, 26, 111, seed=3)
    x = logits.to(dtype).to(device)
    a = ops.expand_tree_step(x, parent_scores.to(device), 5, 20)
    b = ops.expand_tree_step(strided_rows(x, layout), parent_scores.to(device), 5, 20)
    for s, t in zip(a, b):
        assert torch.equal(s, t)
    strided_scores = torch.empty(26, 3, device=device).t().copy_(parent_scores)  # non-contiguous [3, 26]
    assert not strided_scores.is_contiguous()
    c = ops.expand_tree_step(x, strided_scores, 5, 20)
    for s, t in zip(a, c):
        assert torch.equal(s, t)


# ---------------------------------------------------------------------------------------------------------------
# Validation.

BAD = {
    "nan": (lambda x: x.__setitem__((1, 2, 5), math.nan), "expand_tree_step: logits[1, 2, 5] is NaN or +inf"),
    "inf_before_nan": (lambda x: (x.__setitem__((1, 2, 5), math.nan), x.__setitem__((1, 2, 1), math.inf)),
                       "expand_tree_step: logits[1, 2, 1] is NaN or +inf"),
    "all_neg_inf": (lambda x: x.__setitem__((1, 3), -math.inf),
                    "expand_tree_step: logits[1, 3] is -inf everywhere: no token can be chosen"),
    "first_frontier_row_first": (lambda x: (x.__setitem__((1, 3), -math.inf), x.__setitem__((1, 1, 0), math.nan)),
                                 "expand_tree_step: logits[1, 1, 0] is NaN or +inf"),
}


def _bad(case):
    logits, parent_scores = make_case(3, 4, 13, seed=7)
    BAD[case][0](logits)
    return logits, parent_scores, BAD[case][1]


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_error(device, dtype, case):
    logits, parent_scores, msg = _bad(case)
    x = logits.to(dtype)
    assert expected_error(run_ref, x, parent_scores, 3, 5) == msg
    assert_raises_exactly(msg, ops.expand_tree_step, *on(device, x, parent_scores), 3, 5)


@pytest.mark.parametrize("case", sorted(BAD))
def test_no_validate_sentinels(device, dtype, case):
    logits, parent_scores, _ = _bad(case)
    x = logits.to(dtype)
    toks, scores, sel = (t.cpu() for t in ops.expand_tree_step(*on(device, x, parent_scores), 3, 5, validate=False))
    assert bool((toks[1] == -1).all()) and bool((scores[1] == -math.inf).all()) and bool((sel[1] == -1).all())
    want = run_ref(x, parent_scores, 3, 5, validate=False)
    assert torch.equal(toks, want[0]) and torch.equal(sel, want[2])
    torch.testing.assert_close(scores, want[1], atol=S_ATOL, rtol=S_RTOL)
    good = torch.tensor([0, 2])
    alone = run_ref(x[good], parent_scores[good], 3, 5)
    assert torch.equal(toks[good], alone[0]) and torch.equal(sel[good], alone[2])
