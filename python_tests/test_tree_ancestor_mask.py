"""tree_ancestor_mask: dense and bit-packed masks vs the reference and a brute-force walk of the parents."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_raises_exactly, expected_error, make_gen, ops, random_parents, ref, root_path

SHAPES = [(B, N) for B in (1, 3, 7) for N in (1, 5, 26, 64)] + [(2, 31), (2, 32), (2, 33), (1, 100)]


def _brute_dense(parents: torch.Tensor) -> torch.Tensor:
    B, N = parents.shape
    dense = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        prow = parents[b].tolist()
        for i in range(N):
            dense[b, i, root_path(prow, i)] = True
    return dense


def _unpack(words: torch.Tensor, N: int) -> torch.Tensor:
    """Bits of int32 words [B, N, W] (bit j % 32 of word j // 32, LSB first) as bool [B, N, N]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w.unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten(-2)[..., :N].bool()


@pytest.mark.parametrize("kind", ["random", "deep"])
@pytest.mark.parametrize("B,N", SHAPES)
def test_matches_reference(device, B, N, kind):
    parents = random_parents(B, N, make_gen(B * 131 + N), kind)
    dense = ops.tree_ancestor_mask(parents.to(device))
    packed = ops.tree_ancestor_mask(parents.to(device), packed=True)
    assert dense.dtype == torch.bool and dense.shape == (B, N, N) and dense.device.type == device
    assert packed.dtype == torch.int32 and packed.shape == (B, N, (N + 31) // 32) and packed.device.type == device
    want_dense = ref.tree_ancestor_mask(parents)
    assert torch.equal(dense.cpu(), want_dense)
    assert torch.equal(packed.cpu(), ref.tree_ancestor_mask(parents, packed=True))
    # Independent checks: brute force, and the packed bits are the dense mask.
    assert torch.equal(dense.cpu(), _brute_dense(parents))
    assert torch.equal(_unpack(packed.cpu(), N), dense.cpu())


def test_packed_bit_layout(device):
    """A 40-node chain: node i's ancestors are 0..i, so word 0 is all ones from node 31 on and bit 31 is the sign bit;
    the little-endian uint8 view is FlashInfer's bitorder='little' layout."""
    N = 40
    packed = ops.tree_ancestor_mask(ops.chain_parents(1, N, device=device), packed=True).cpu()
    assert packed[0, 0].tolist() == [1, 0]
    assert packed[0, 5].tolist() == [0b111111, 0]
    assert packed[0, 31].tolist() == [-1, 0]
    assert packed[0, 39].tolist() == [-1, 0xFF]
    as_bytes = packed[0].contiguous().view(torch.uint8)  # [N, 8]
    import numpy as np
    want = np.packbits(_brute_dense(ops.chain_parents(1, N)).numpy()[0], axis=-1, bitorder="little")
    assert torch.equal(as_bytes[:, :5], torch.from_numpy(want))
    assert bool((as_bytes[:, 5:] == 0).all())


@pytest.mark.parametrize("packed", [False, True])
def test_validation(device, packed):
    parents = random_parents(3, 7, make_gen(5))
    parents[2, 4] = 6
    msg = ("tree_ancestor_mask: parents[2, 4] = 6 is not an earlier node: expected 0 <= parent < 4 "
           "(nodes are topologically ordered and only node 0 is a root)")
    assert expected_error(ref.tree_ancestor_mask, parents, packed) == msg
    assert_raises_exactly(msg, ops.tree_ancestor_mask, parents.to(device), packed)
    parents[1, 0] = 3
    msg = "tree_ancestor_mask: parents[1, 0] must be -1 (node 0 is the root), got 3"
    assert expected_error(ref.tree_ancestor_mask, parents, packed) == msg
    assert_raises_exactly(msg, ops.tree_ancestor_mask, parents.to(device), packed)


@pytest.mark.parametrize("packed", [False, True])
def test_no_validate_sentinels(device, packed):
    parents = random_parents(3, 40, make_gen(6))
    parents[1, 20] = 25
    got = ops.tree_ancestor_mask(parents.to(device), packed, validate=False).cpu()
    assert torch.equal(got, ref.tree_ancestor_mask(parents, packed, validate=False))
    assert not bool(got[1].bool().any())  # false mask for the bad row
    good = torch.tensor([0, 2])
    assert torch.equal(got[good], ref.tree_ancestor_mask(parents[good], packed))
