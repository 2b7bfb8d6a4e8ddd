"""verify_tree_greedy vs the reference on odd shapes and every float dtype, layouts, ties, validation."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import (assert_equal_tuples, assert_raises_exactly, cpu, expected_error, make_gen, on, ops,
                     plant_path, random_logits, random_parents, random_tokens, ref, strided_rows)

NAMES = ["accepted", "accept_len", "next_token"]
# (B, N, V): every B, N and V value appears, large vocabularies with fewer nodes to keep the reference quick.
SHAPES = [(1, 1, 7), (3, 5, 7), (7, 26, 7), (7, 64, 7), (1, 64, 111), (3, 26, 111), (7, 5, 111), (3, 1, 111),
          (3, 5, 32000), (7, 26, 32000), (1, 64, 32000)]


def make_case(B, N, V, seed, kind="random", plant=True):
    gen = make_gen(seed)
    parents = random_parents(B, N, gen, kind)
    tokens = random_tokens(B, N, V, gen)
    logits = random_logits(B, N, V, gen)
    if plant and N > 1:
        plant_path(logits, tokens, parents, gen, boost=3.0, rows=range(0, B, 2) if B > 1 else [0])
    return logits, tokens, parents


@pytest.mark.parametrize("kind", ["random", "deep"])
@pytest.mark.parametrize("B,N,V", SHAPES)
def test_matches_reference(device, dtype, B, N, V, kind):
    logits, tokens, parents = make_case(B, N, V, seed=B * 7919 + N * 31 + V, kind=kind)
    x = logits.to(dtype)
    want = ref.verify_tree_greedy(x, tokens, parents)
    got = ops.verify_tree_greedy(*on(device, x, tokens, parents))
    assert isinstance(got, ops.Verification)
    assert all(t.device.type == device for t in got)
    assert_equal_tuples(got, want, NAMES)
    if N >= 26 and kind == "deep":
        assert int(want[1].max()) >= 2, "the planted path should make the reference accept several nodes"
    elif N > 1:
        assert int(want[1].max()) >= 1, "the planted path should make the reference accept a node"


@pytest.mark.parametrize("layout", ["gap", "transposed"])
@pytest.mark.parametrize("B,N,V", [(3, 26, 111), (7, 5, 32000)])
def test_strided_logits(device, dtype, B, N, V, layout):
    logits, tokens, parents = make_case(B, N, V, seed=N + V, kind="deep")
    x = logits.to(dtype).to(device)
    want = cpu(*ops.verify_tree_greedy(x, *on(device, tokens, parents)))
    got = ops.verify_tree_greedy(strided_rows(x, layout), *on(device, tokens, parents))
    assert_equal_tuples(got, want, NAMES)
    assert_equal_tuples(got, ref.verify_tree_greedy(x.cpu(), tokens, parents), NAMES)


def test_ties_first_argmax(device, dtype):
    """Ties at the maximum go to the lowest token id; the first matching child in sibling order wins."""
    V = 8
    parents = torch.tensor([[-1, 0, 0, 0, 2, 2, 1]])
    tokens = torch.tensor([[-1, 5, 3, 3, 6, 1, 3]])
    logits = torch.zeros(1, 7, V)
    logits[0, 0, [3, 5]] = 4.0      # tie between 3 and 5: argmax 3 -> node 2 (first child with token 3, not node 3)
    logits[0, 2, [1, 6, 7]] = 2.0   # tie between 1, 6, 7: argmax 1 -> node 5 (a leaf)
    logits[0, 5, :] = -1.0          # all equal: argmax 0 is the bonus token
    got = cpu(*ops.verify_tree_greedy(*on(device, logits.to(dtype), tokens, parents)))
    assert got[0].tolist() == [[0, 2, 5, -1, -1, -1, -1]]
    assert got[1].tolist() == [2] and got[2].tolist() == [0]
    assert_equal_tuples(got, ref.verify_tree_greedy(logits.to(dtype), tokens, parents), NAMES)


def _chain_greedy(logits, tokens):
    """Independent chain verification: accept while the draft equals the argmax of the previous position."""
    B, N, _ = logits.shape
    out = []
    for b in range(B):
        n = 0
        while n + 1 < N and int(tokens[b, n + 1]) == int(torch.argmax(logits[b, n].float())):
            n += 1
        out.append((n, int(torch.argmax(logits[b, n].float()))))
    return out


@pytest.mark.parametrize("N,V", [(1, 7), (6, 111), (26, 7)])
def test_chain(device, dtype, N, V):
    gen = make_gen(N * V)
    B = 7
    parents = ops.chain_parents(B, N)
    # Drafts copy the target argmax for a random number of steps, then a random token.
    logits = torch.randn(B, N, V, generator=gen) * 3
    logits = logits.to(dtype).float()  # values exactly representable in dtype, with distinct maxima
    tokens = torch.randint(0, V, (B, N), generator=gen)
    for b in range(B):
        keep = int(torch.randint(0, N, (1,), generator=gen))
        for i in range(1, keep + 1):
            tokens[b, i] = int(torch.argmax(logits[b, i - 1]))
    got = cpu(*ops.verify_tree_greedy(*on(device, logits.to(dtype), tokens, parents)))
    for b, (n, nxt) in enumerate(_chain_greedy(logits, tokens)):
        assert got[1][b] == n
        assert got[0][b].tolist() == list(range(n + 1)) + [-1] * (N - n - 1)
        assert got[2][b] == nxt


# ---------------------------------------------------------------------------------------------------------------
# Validation.


def _valid(B=3, N=6, V=11, seed=0):
    logits, tokens, parents = make_case(B, N, V, seed, kind="deep")
    return logits, tokens, parents


def _set_nan_on_root(logits, tokens, parents):
    logits[1, 0, 4] = math.nan
    logits[1, 0, 2] = math.inf  # the first offending vocabulary index is reported: 2


BAD = {
    "bad_root": (lambda l, t, p: p.__setitem__((1, 0), 0),
                 "verify_tree_greedy: parents[1, 0] must be -1 (node 0 is the root), got 0"),
    "parent_not_earlier": (lambda l, t, p: p.__setitem__((1, 3), 3),
                           "verify_tree_greedy: parents[1, 3] = 3 is not an earlier node: expected 0 <= parent < 3 "
                           "(nodes are topologically ordered and only node 0 is a root)"),
    "token_negative": (lambda l, t, p: t.__setitem__((1, 2), -1),
                       "verify_tree_greedy: tokens[1, 2] = -1 is out of range for the vocabulary"),
    "token_too_large": (lambda l, t, p: t.__setitem__((1, 5), 11),
                        "verify_tree_greedy: tokens[1, 5] = 11 is out of range for the vocabulary"),
    "nan_logits": (_set_nan_on_root, "verify_tree_greedy: logits[1, 0, 2] is NaN or +inf"),
    "nan_only": (lambda l, t, p: l.__setitem__((1, 0, 7), math.nan),
                 "verify_tree_greedy: logits[1, 0, 7] is NaN or +inf"),
    "all_neg_inf": (lambda l, t, p: l.__setitem__((1, 0), -math.inf),
                    "verify_tree_greedy: logits[1, 0] is -inf everywhere: no token can be chosen"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_error(device, dtype, case):
    logits, tokens, parents = _valid()
    BAD[case][0](logits, tokens, parents)
    msg = BAD[case][1]
    x = logits.to(dtype)
    assert expected_error(ref.verify_tree_greedy, x, tokens, parents) == msg
    assert_raises_exactly(msg, ops.verify_tree_greedy, *on(device, x, tokens, parents))


@pytest.mark.parametrize("case", sorted(BAD))
def test_no_validate_sentinels(device, dtype, case):
    logits, tokens, parents = _valid()
    BAD[case][0](logits, tokens, parents)
    x = logits.to(dtype)
    got = cpu(*ops.verify_tree_greedy(*on(device, x, tokens, parents), validate=False))
    assert_equal_tuples(got, ref.verify_tree_greedy(x, tokens, parents, validate=False), NAMES)
    assert got[0][1].tolist() == [-1] * 6 and int(got[1][1]) == 0 and int(got[2][1]) == -1
    good = torch.tensor([0, 2])
    assert_equal_tuples(tuple(t[good] for t in got), ref.verify_tree_greedy(x[good], tokens[good], parents[good]),
                        NAMES)
    assert int(got[1][0]) >= 1, "row 0 has a planted path"


def test_logits_on_deeper_path_and_unread_rows(device):
    """Only logits rows the algorithm reads are checked: NaN off the accepted path is not an error; NaN at a node
    of the path is reported with that node."""
    logits, tokens, parents = make_case(2, 8, 13, seed=4, kind="chain")
    logits[:, :, :] = torch.randn(2, 8, 13, generator=make_gen(1))
    # Row 0 accepts nodes 1 and 2, rejects 3.
    for i in (1, 2):
        tokens[0, i] = int(torch.argmax(logits[0, i - 1]))
    tokens[0, 3] = (int(torch.argmax(logits[0, 2])) + 1) % 13
    logits[0, 5, 0] = math.nan  # never read
    logits[0, 7, :] = -math.inf  # never read
    got = cpu(*ops.verify_tree_greedy(*on(device, logits, tokens, parents)))
    assert_equal_tuples(got, ref.verify_tree_greedy(logits, tokens, parents), NAMES)
    assert int(got[1][0]) == 2
    logits[0, 2, 9] = math.inf  # read: the last accepted node
    msg = "verify_tree_greedy: logits[0, 2, 9] is NaN or +inf"
    assert expected_error(ref.verify_tree_greedy, logits, tokens, parents) == msg
    assert_raises_exactly(msg, ops.verify_tree_greedy, *on(device, logits, tokens, parents))


def test_validation_order(device):
    """Within a row: tree, then tokens, then logits (when read); across rows: the lowest failing row."""
    logits, tokens, parents = _valid(B=4)
    logits[1, 0, :] = -math.inf          # row 1: logits only
    logits[2, 0, 0] = math.nan           # row 2: tokens are checked before logits
    tokens[2, 4] = 99
    parents[3, 2] = 5                    # row 3: the tree is checked before tokens
    tokens[3, 1] = -5
    cases = [(slice(0, 4), "verify_tree_greedy: logits[1, 0] is -inf everywhere: no token can be chosen"),
             (slice(2, 4), "verify_tree_greedy: tokens[0, 4] = 99 is out of range for the vocabulary"),
             (slice(3, 4), "verify_tree_greedy: parents[0, 2] = 5 is not an earlier node: expected 0 <= parent < 2 "
                           "(nodes are topologically ordered and only node 0 is a root)")]
    for rows, msg in cases:
        args = (logits[rows], tokens[rows], parents[rows])
        assert expected_error(ref.verify_tree_greedy, *args) == msg
        assert_raises_exactly(msg, ops.verify_tree_greedy, *on(device, *args))


def test_root_token_not_read(device):
    """tokens[b, 0] is not a draft: any value there (even out of range) is ignored."""
    logits, tokens, parents = make_case(3, 5, 9, seed=8)
    a = cpu(*ops.verify_tree_greedy(*on(device, logits, tokens, parents)))
    tokens[:, 0] = torch.tensor([-7, 9, 10**9])
    b = ops.verify_tree_greedy(*on(device, logits, tokens, parents))
    assert_equal_tuples(b, a, NAMES)
