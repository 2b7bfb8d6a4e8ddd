"""build_tree: kernel vs reference, plus brute-force checks of every output and validation behaviour."""

from __future__ import annotations

import pytest
import torch

from helpers import (assert_equal_tuples, assert_raises_exactly, children_of, cpu, expected_error, make_gen, on, ops,
                     random_parents, ref, root_path)

NAMES = ["depth", "position_ids", "first_child", "next_sibling", "retrieve_paths", "num_leaves"]
SHAPES = [(B, N) for B in (1, 3, 7) for N in (1, 5, 26, 64)]


def _ref(parents, prefix):
    return ref.build_tree(parents.cpu(), prefix.cpu())


@pytest.mark.parametrize("kind", ["random", "deep", "wide"])
@pytest.mark.parametrize("B,N", SHAPES)
def test_matches_reference(device, B, N, kind):
    gen = make_gen(1000 * B + N)
    parents = random_parents(B, N, gen, kind)
    prefix = torch.randint(0, 500, (B,), generator=gen)
    got = ops.build_tree(*on(device, parents, prefix))
    assert isinstance(got, ops.TreeInfo)
    assert all(t.device.type == device for t in got)
    assert_equal_tuples(got, _ref(parents, prefix), NAMES)


@pytest.mark.parametrize("B,N", [(1, 1), (3, 5), (7, 26), (3, 64)])
def test_brute_force(device, B, N):
    """Independent of the reference: every output recomputed from its definition."""
    gen = make_gen(7 + N)
    parents = random_parents(B, N, gen, "random")
    prefix = torch.randint(0, 100, (B,), generator=gen)
    info = ops.TreeInfo(*cpu(*ops.build_tree(*on(device, parents, prefix))))
    for b in range(B):
        prow = parents[b].tolist()
        depth = [len(root_path(prow, i)) - 1 for i in range(N)]
        assert info.depth[b].tolist() == depth
        assert info.position_ids[b].tolist() == [int(prefix[b]) + d for d in depth]
        # first_child / next_sibling enumerate each node's children in increasing order.
        for u in range(N):
            enumerated, c = [], int(info.first_child[b, u])
            while c != -1:
                enumerated.append(c)
                assert len(enumerated) <= N, "sibling list does not terminate"
                c = int(info.next_sibling[b, c])
            assert enumerated == children_of(prow, u)
        # The root has no siblings.
        assert int(info.next_sibling[b, 0]) == -1
        leaves = [i for i in range(N) if not children_of(prow, i)]
        assert int(info.num_leaves[b]) == len(leaves)
        for slot in range(N):
            path = [x for x in info.retrieve_paths[b, slot].tolist()]
            if slot < len(leaves):
                k = len(root_path(prow, leaves[slot]))
                assert path[:k] == root_path(prow, leaves[slot])
                assert path[k:] == [-1] * (N - k)
                # The path ends at a leaf, and consecutive entries are parent -> child.
                assert not children_of(prow, path[k - 1])
                assert all(prow[c] == p for p, c in zip(path[: k - 1], path[1:k]))
            else:
                assert path == [-1] * N


def test_int_prefix_and_default(device):
    gen = make_gen(3)
    parents = random_parents(3, 9, gen).to(device)
    d0 = ops.build_tree(parents)
    d5 = ops.build_tree(parents, 5)
    dt = ops.build_tree(parents, torch.tensor(5, device=device))
    assert torch.equal(d0.position_ids, d0.depth)
    assert torch.equal(d5.position_ids, d0.depth + 5)
    assert_equal_tuples(dt, cpu(*d5), NAMES)


@pytest.mark.parametrize("L", [1, 2, 17])
def test_chain(device, L):
    parents = ops.chain_parents(3, L, device=device)
    assert parents.dtype == torch.int64 and parents.is_contiguous() and parents.device.type == device
    assert parents.cpu().tolist() == [[-1] + list(range(L - 1))] * 3
    info = ops.build_tree(parents, torch.tensor([0, 4, 9], device=device))
    assert info.depth.cpu().tolist() == [list(range(L))] * 3
    assert info.num_leaves.cpu().tolist() == [1, 1, 1]
    assert info.retrieve_paths[:, 0].cpu().tolist() == [list(range(L))] * 3
    assert bool((info.retrieve_paths[:, 1:] == -1).all())
    assert info.first_child.cpu().tolist() == [list(range(1, L)) + [-1]] * 3
    assert bool((info.next_sibling == -1).all())


# ---------------------------------------------------------------------------------------------------------------
# Validation.

BAD_TREES = {
    # name: (row, node, value) to write into a valid random tree of 6 nodes, and the expected message
    "root_zero": (0, 0, "build_tree: parents[1, 0] must be -1 (node 0 is the root), got 0"),
    "root_minus_two": (0, -2, "build_tree: parents[1, 0] must be -1 (node 0 is the root), got -2"),
    "self_parent": (3, 3, "build_tree: parents[1, 3] = 3 is not an earlier node: expected 0 <= parent < 3 "
                          "(nodes are topologically ordered and only node 0 is a root)"),
    "later_parent": (2, 5, "build_tree: parents[1, 2] = 5 is not an earlier node: expected 0 <= parent < 2 "
                           "(nodes are topologically ordered and only node 0 is a root)"),
    "second_root": (4, -1, "build_tree: parents[1, 4] = -1 is not an earlier node: expected 0 <= parent < 4 "
                           "(nodes are topologically ordered and only node 0 is a root)"),
    "huge_parent": (1, 2**40, f"build_tree: parents[1, 1] = {2**40} is not an earlier node: expected 0 <= parent < "
                              "1 (nodes are topologically ordered and only node 0 is a root)"),
}


def _bad_tree(case):
    node, value, msg = BAD_TREES[case]
    parents = random_parents(3, 6, make_gen(11), "random")
    parents[1, node] = value
    return parents, msg


@pytest.mark.parametrize("case", sorted(BAD_TREES))
def test_validation_error(device, case):
    parents, msg = _bad_tree(case)
    prefix = torch.zeros(3, dtype=torch.int64)
    # The reference raises this exact message, and so does the kernel.
    assert expected_error(ref.build_tree, parents, prefix) == msg
    assert_raises_exactly(msg, ops.build_tree, *on(device, parents, prefix))


def test_first_error_reported(device):
    """Lowest failing row first; within a row the root before the other nodes, then nodes in order."""
    parents = random_parents(4, 6, make_gen(2), "random")
    parents[2, 0] = 7
    parents[2, 3] = 9
    parents[3, 0] = 1
    parents[1, 5] = 5
    parents[1, 4] = 4
    msg = expected_error(ref.build_tree, parents, torch.zeros(4, dtype=torch.int64))
    assert msg.startswith("build_tree: parents[1, 4] = 4 ")
    assert_raises_exactly(msg, ops.build_tree, parents.to(device))


@pytest.mark.parametrize("case", sorted(BAD_TREES))
def test_no_validate_sentinels(device, case):
    parents, _ = _bad_tree(case)
    prefix = torch.tensor([3, 4, 5])
    got = cpu(*ops.build_tree(*on(device, parents, prefix), validate=False))
    want = ref.build_tree(parents, prefix, validate=False)
    assert_equal_tuples(got, want, NAMES)
    # The bad row holds sentinels; the good rows are what they would be on their own.
    info = ops.TreeInfo(*got)
    for t in info[:5]:
        assert bool((t[1] == -1).all())
    assert int(info.num_leaves[1]) == 0
    good = torch.tensor([0, 2])
    alone = ref.build_tree(parents[good], prefix[good])
    assert_equal_tuples(tuple(t[good] for t in got), alone, NAMES)
