"""Property-based tests (hypothesis): random trees, tokens and distributions; structural invariants of every
verifier's output, and agreement with the reference on small inputs."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_draws_match, assert_equal_tuples, ops, per_row, ref, shifted_uniforms

SETTINGS = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow], database=None,
                    derandomize=True)


@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    N = draw(st.integers(1, 12))
    V = draw(st.integers(2, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(1, N):
        parents[:, i] = torch.randint(0, i, (B,), generator=gen)
    tokens = torch.randint(0, V, (B, N), generator=gen)
    scale = draw(st.sampled_from([0.5, 2.0, 8.0]))
    logits = torch.randn(B, N, V, generator=gen) * scale
    if draw(st.booleans()):  # make the drafts likely: copy the target argmax into some children
        for b in range(B):
            for c in range(1, N):
                if bool(torch.rand(1, generator=gen) < 0.6):
                    tokens[b, c] = int(logits[b, int(parents[b, c])].argmax())
    if draw(st.booleans()):  # masked tokens (-inf), keeping one finite token per row
        mask = torch.rand(B, N, V, generator=gen) < 0.3
        mask[..., 0] = False
        logits = logits.masked_fill(mask, float("-inf"))
    q = torch.softmax(torch.randn(B, N, V, generator=gen) * scale, -1) if draw(st.booleans()) else None
    uniforms = torch.rand(B, N, generator=gen)
    temperature = draw(st.sampled_from([0.0, 0.5, 1.0, 1.7]))
    top_k = draw(st.integers(0, V + 1))
    top_p = draw(st.sampled_from([1.0, 0.95, 0.6, 0.2]))
    return dict(logits=logits, tokens=tokens, parents=parents, q=q, uniforms=uniforms, temperature=temperature,
                top_k=top_k, top_p=top_p)


def check_structure(out, parents, V):
    accepted, accept_len, next_token = out
    B, N = parents.shape
    assert accepted.shape == (B, N) and accept_len.shape == (B,) and next_token.shape == (B,)
    for b in range(B):
        n = int(accept_len[b])
        row = accepted[b].tolist()
        assert 0 <= n < N
        assert n == sum(1 for x in row if x != -1) - 1, "accept_len must count the non -1 entries (root excluded)"
        assert row[0] == 0 and all(x == -1 for x in row[n + 1:])
        for i in range(1, n + 1):
            assert 0 < row[i] < N
            assert int(parents[b, row[i]]) == row[i - 1], "accepted path must be a root-to-node path"
        assert 0 <= int(next_token[b]) < V


@SETTINGS
@given(problems())
def test_sampling_properties(pb):
    B, N, V = pb["logits"].shape
    out = ops.verify_tree_sampling(pb["logits"], pb["tokens"], pb["parents"], pb["uniforms"], pb["q"],
                                   pb["temperature"], pb["top_k"], pb["top_p"])
    check_structure(out, pb["parents"], V)
    args = (pb["logits"], pb["tokens"], pb["parents"], pb["q"])
    params = (per_row(pb["temperature"], B, torch.float32), per_row(pb["top_k"], B, torch.int64),
              per_row(pb["top_p"], B, torch.float32))
    want = ref.verify_tree_sampling(*args, pb["uniforms"], *params)
    assert_equal_tuples(out[:2], want[:2], ["accepted", "accept_len"])

    def redraw(d):
        u = pb["uniforms"].clone()
        u[:, 0] = shifted_uniforms(u[:, 0], d)
        return ref.verify_tree_sampling(*args, u, *params)[2]

    assert_draws_match(out[2], want[2], redraw)
    # Accepted drafts are tokens the target can emit (non-zero filtered probability at their parent).
    for b in range(B):
        for i in range(1, int(out.accept_len[b]) + 1):
            node, par = int(out.accepted[b, i]), int(out.accepted[b, i - 1])
            w = ref.filtered_weights(pb["logits"][b, par], pb["temperature"], pb["top_k"], pb["top_p"])
            assert float(w[int(pb["tokens"][b, node])]) > 0


@SETTINGS
@given(problems())
def test_greedy_properties(pb):
    V = pb["logits"].shape[2]
    out = ops.verify_tree_greedy(pb["logits"], pb["tokens"], pb["parents"])
    check_structure(out, pb["parents"], V)
    assert_equal_tuples(out, ref.verify_tree_greedy(pb["logits"], pb["tokens"], pb["parents"]))
    # Every accepted token is the argmax at its parent, and next_token is the argmax at the last node.
    for b in range(out.accepted.shape[0]):
        n = int(out.accept_len[b])
        for i in range(1, n + 1):
            par = int(out.accepted[b, i - 1])
            assert int(pb["tokens"][b, int(out.accepted[b, i])]) == int(pb["logits"][b, par].argmax())
        assert int(out.next_token[b]) == int(pb["logits"][b, int(out.accepted[b, n])].argmax())


@SETTINGS
@given(problems(), st.sampled_from([(0.09, 0.3), (0.3, 0.5), (0.0, 0.0)]))
def test_typical_properties(pb, thr_alpha):
    B, N, V = pb["logits"].shape
    u = pb["uniforms"][:, 0].contiguous()
    out = ops.verify_tree_typical(pb["logits"], pb["tokens"], pb["parents"], u, pb["temperature"], *thr_alpha)
    check_structure(out, pb["parents"], V)
    T = per_row(pb["temperature"], B, torch.float32)
    want = ref.verify_tree_typical(pb["logits"], pb["tokens"], pb["parents"], u, T, *thr_alpha)
    assert_equal_tuples(out[:2], want[:2], ["accepted", "accept_len"])
    assert_draws_match(out[2], want[2], lambda d: ref.verify_tree_typical(
        pb["logits"], pb["tokens"], pb["parents"], shifted_uniforms(u, d), T, *thr_alpha)[2])


@SETTINGS
@given(problems())
def test_tree_properties(pb):
    parents = pb["parents"]
    B, N = parents.shape
    info = ops.build_tree(parents, 3)
    assert_equal_tuples(info, ref.build_tree(parents, torch.full((B,), 3)))
    mask = ops.tree_ancestor_mask(parents)
    # mask[i, j] iff j is on i's root path; i's row has depth + 1 ones; the diagonal is set.
    assert torch.equal(mask.sum(-1), info.depth + 1)
    assert bool(mask.diagonal(dim1=1, dim2=2).all())
    # Leaves are the nodes that are nobody's parent.
    is_parent = torch.zeros(B, N, dtype=torch.bool)
    for b in range(B):
        is_parent[b, parents[b, 1:]] = True
    assert torch.equal(info.num_leaves, (~is_parent).sum(1))
    assert torch.equal(info.first_child == -1, ~is_parent)
