"""NaN and infinities where the kernels once disagreed with the specification (found by the fuzz suite and the
sanitizer run): each case against the plain-PyTorch reference, on CPU (and CUDA where there is one)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_gen, ops, random_parents
from specdec_ext.ops import reference as ref

NAN = math.nan


def _attention_case(device, dtype=torch.float32, B=2, H=2, Hkv=1, N=4, D=64, S=12, prefix=(3, 6)):
    gen = make_gen(7)
    parents = random_parents(B, N, gen)
    q = torch.randn(B, H, N, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    mask = ops.tree_ancestor_mask(parents)
    return [t.to(device) for t in (q, k, v)] + [torch.tensor(prefix, device=device), mask.to(device)]


def _both(q, k, v, prefix, mask):
    got = ops.tree_attention(q, k, v, prefix, mask)
    want = ref.tree_attention(q.cpu(), k.cpu(), v.cpu(), prefix.cpu(), mask.cpu(), q.shape[-1] ** -0.5)
    return got.cpu().float(), want.float()


def _assert_same_nan_and_close(got, want, atol=1e-5):
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=atol, rtol=1e-5)


def test_a_masked_tree_key_with_nan_k_changes_nothing(device):
    """A tree key a node does not see scores exactly -inf whatever its K holds (the mask was once added to the
    score, and NaN + -inf is NaN). The node's output is finite and equal to the reference's."""
    q, k, v, prefix, mask = _attention_case(device)
    b, i, j = 0, 0, mask.shape[-1] - 1  # the root never sees the last node
    assert not bool(mask[b, i, j])
    before, _ = _both(q, k, v, prefix, mask)
    k[b, :, int(prefix[b]) + j] = NAN
    got, want = _both(q, k, v, prefix, mask)
    assert not bool(got[b, :, i].isnan().any())
    torch.testing.assert_close(got[b, :, i], before[b, :, i], atol=1e-6, rtol=1e-6)
    _assert_same_nan_and_close(got, want)


def test_a_nan_query_gives_nan_as_the_reference_does(device):
    """NaN in a visible score reaches the output (it used to go through exp of NaN, an undefined float-to-int cast in
    the CPU kernel's exp), and only that query's."""
    q, k, v, prefix, mask = _attention_case(device)
    q[1, 0, 2, 5] = NAN
    got, want = _both(q, k, v, prefix, mask)
    assert bool(got[1, 0, 2].isnan().all()) and int(got.isnan().sum()) == got.shape[-1]
    _assert_same_nan_and_close(got, want)


def test_a_query_that_sees_nothing_gets_zeros_even_beside_nan_values(device):
    """With an empty prefix and a mask in which node 1 sees no key, its output is zeros although a V row in the sum
    (of a key node 1 does not see) is NaN: 0 * NaN must not reach it."""
    q, k, v, prefix, mask = _attention_case(device, prefix=(0, 0))
    mask[0, 1] = False
    v[0, :, 0] = NAN  # node 0's value: seen by node 0 (its output is NaN), not by node 1
    got, want = _both(q, k, v, prefix, mask)
    assert bool((got[0, :, 1] == 0).all())
    _assert_same_nan_and_close(got, want)


@pytest.mark.parametrize("K", [21, 22])
def test_packed_linear_ignores_the_k_padding_whatever_it_holds(device, K):
    """bfloat16 weights are packed in K-pairs; past an odd K the pair's second half is padding. A packed weight whose
    padding holds NaN gives the reference's product (the padding was multiplied by a zero input: 0 * NaN)."""
    gen = make_gen(3)
    w = torch.randn(37, K, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, K, generator=gen).to(torch.bfloat16)
    packed = ops.pack_linear_weight(w)
    if K % 2:
        assert packed.shape[1] * packed.shape[3] == K + 1
        packed[:, -1, :, 1] = NAN  # the padding element of every output row, the marker rows' included
    got = ops.packed_linear(x.to(device), packed.to(device), None, 37).cpu()
    want = ref.packed_linear(x, packed, None, 37)
    assert not bool(got.isnan().any())
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_expand_tree_step_ranks_nan_first_whatever_its_sign(device):
    """Candidate scores are parent score + log p: a NaN parent score (of either sign bit) makes NaN candidates,
    which rank first, lower index first, as torch.sort does in the reference (the CPU kernel ranked a NaN with the
    sign bit set last)."""
    gen = make_gen(5)
    logits = torch.randn(1, 3, 11, generator=gen)
    parent_scores = torch.tensor([[-1.0, -NAN, NAN]])
    assert math.copysign(1.0, float(parent_scores[0, 1])) == -1.0
    got = ops.expand_tree_step(logits.to(device), parent_scores.to(device), 2, 5)
    want = ref.expand_tree_step(logits, parent_scores, 2, 5)
    assert got[2].cpu().tolist() == want[2].tolist()
    assert got[2][0, :4].cpu().tolist() == [2, 3, 4, 5]  # nodes 1 and 2's candidates, by flat index


def test_compact_kv_with_an_empty_last_dimension(device):
    """A cache whose last dimension is 0 holds nothing to move: no copy (a null data pointer reached memcpy), and
    the lengths are still checked."""
    caches = [torch.empty(2, 3, 10, 0, device=device) for _ in range(2)]
    src = torch.tensor([[4, 5], [7, 9]], device=device)
    ops.compact_kv(caches, src, torch.tensor([2, 3], device=device), torch.tensor([2, 1], device=device))
    with pytest.raises(ValueError, match="compact_kv"):
        ops.compact_kv(caches, src, torch.tensor([2, 3], device=device), torch.tensor([3, 1], device=device))


def test_a_query_whose_every_visible_score_is_minus_inf_gets_zeros(device):
    """q = +inf in a dimension where every key is negative: every score the query sees is -inf, so it has no weight
    anywhere, the case of a query that sees nothing (zeros), in the kernels and the reference alike."""
    q, k, v, prefix, mask = _attention_case(device)
    k[0, :, :, 7] = -k[0, :, :, 7].abs() - 0.5
    q[0, :, 0, 7] = math.inf
    got, want = _both(q, k, v, prefix, mask)
    assert bool((got[0, :, 0] == 0).all())
    _assert_same_nan_and_close(got, want)
