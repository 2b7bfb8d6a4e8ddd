"""The recurrent tree ops (Lightning linear attention, the tree causal conv1d, and their commits) against their
plain-PyTorch specs in ``specdec_ext.ops.reference`` (the specs themselves are tested against Hugging Face's modules
and a brute-force recurrence in test_hybrid_*.py): random trees of every shape, chains as width-1 trees, batch > 1,
strided inputs, ragged accepted lengths (0 included), float32 / float16 / bfloat16 inputs over float32 states; bad
inputs raise the spec's own messages, and validate=False leaves invalid rows at their sentinels."""

from __future__ import annotations

import pytest
import torch

from helpers import make_gen, random_parents, root_path
from specdec_ext import ops
from specdec_ext.ops import reference as ref

KINDS = ["random", "deep", "wide", "chain", "star"]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a view with padded rows (the last dimension stays contiguous): the kernels read strides."""
    pad = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    pad[..., :t.shape[-1]] = t
    return pad[..., :t.shape[-1]]


def _linear_inputs(device, dtype, B=3, H=2, N=9, Dk=8, Dv=12, kind="random", seed=0):
    gen = make_gen(seed)
    q = torch.randn(B, H, N, Dk, generator=gen).to(device=device, dtype=dtype)
    k = (torch.randn(B, H, N, Dk, generator=gen) * 0.5).to(device=device, dtype=dtype)
    v = torch.randn(B, H, N, Dv, generator=gen).to(device=device, dtype=dtype)
    state = torch.randn(B, H, Dk, Dv, generator=gen).to(device)
    log_decay = -torch.rand(H, generator=gen).to(device) * 0.5
    log_decay[0] = 0.0  # (a = 1: no decay)
    return q, k, v, state, log_decay, random_parents(B, N, gen, kind).to(device)


def _deepest_paths(parents: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first ``lengths[b]`` nodes of the path to its deepest node (clipped to that path), -1 padded."""
    B, N = parents.shape
    path = torch.full((B, N), -1, dtype=torch.int64)
    got = []
    for b in range(B):
        prow = parents[b].tolist()
        nodes = root_path(prow, max(range(N), key=lambda i: (len(root_path(prow, i)), i)))[:lengths[b]]
        path[b, :len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
        got.append(len(nodes))
    return path.to(parents.device), torch.tensor(got, device=parents.device)


@pytest.mark.parametrize("kind", KINDS)
def test_tree_linear_attention_equals_the_spec(device, dtype, kind):
    q, k, v, state, log_decay, parents = _linear_inputs(device, dtype, kind=kind)
    want = ref.tree_linear_attention(q, k, v, state, log_decay, parents)
    got = ops.tree_linear_attention(_strided(q), _strided(k), _strided(v), _strided(state), log_decay, parents)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
def test_commit_linear_state_equals_the_spec(device, dtype, kind):
    q, k, v, state, log_decay, parents = _linear_inputs(device, dtype, kind=kind, seed=1)
    path, lengths = _deepest_paths(parents, [0, 3, 9])
    want = state.clone()
    ref.commit_linear_state(want, k, v, log_decay, path, lengths)
    got = _strided(state.clone())
    ops.commit_linear_state(got, k, v, log_decay, path, lengths)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got[0], state[0])  # length 0: untouched


def test_linear_chain_is_a_width_one_tree(device):
    """A chain through the op equals the recurrence run token by token through commits of one node each."""
    q, k, v, state, log_decay, _ = _linear_inputs(device, torch.float32, N=7)
    B, H, N, _ = q.shape
    got = ops.tree_linear_attention(q, k, v, state, log_decay, ops.chain_parents(B, N, device))
    running = state.clone()
    for i in range(N):
        one = ops.tree_linear_attention(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], running, log_decay,
                                        ops.chain_parents(B, 1, device))
        torch.testing.assert_close(got[:, :, i:i + 1], one, atol=1e-4, rtol=1e-4)
        ops.commit_linear_state(running, k[:, :, i:i + 1], v[:, :, i:i + 1], log_decay,
                                torch.zeros(B, 1, dtype=torch.int64, device=device), 1)


def test_linear_bad_inputs_raise_the_spec_messages(device):
    q, k, v, state, log_decay, parents = _linear_inputs(device, torch.float32, B=2, N=5)
    bad_tree = parents.clone()
    bad_tree[1, 3] = 4
    bad_decay = log_decay.clone()
    bad_decay[1] = float("nan")
    for args in ((q, k, v, state, log_decay, bad_tree), (q, k, v, state, bad_decay, parents)):
        with pytest.raises(ValueError) as want:
            ref.tree_linear_attention(*args)
        with pytest.raises(ValueError) as got:
            ops.tree_linear_attention(*args)
        assert str(got.value) == str(want.value)
    out = ops.tree_linear_attention(q, k, v, state, log_decay, bad_tree, validate=False)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # an invalid row's sentinel
    torch.testing.assert_close(out[0], ref.tree_linear_attention(q, k, v, state, log_decay, parents)[0])
    with pytest.raises(ValueError, match=r"tree_linear_attention: state must have shape \[B, H, Dk, Dv\]"):
        ops.tree_linear_attention(q, k, v, state[:, :, :, :3], log_decay, parents)
    with pytest.raises(ValueError, match=r"tree_linear_attention: state must be Float, got Double"):
        ops.tree_linear_attention(q, k, v, state.double(), log_decay, parents)
    with pytest.raises(ValueError, match=r"tree_linear_attention: log_decay must have shape \[H\] = \[2\]"):
        ops.tree_linear_attention(q, k, v, state, log_decay[:1], parents)
    with pytest.raises(ValueError, match=r"tree_linear_attention: k must have q's dtype"):
        ops.tree_linear_attention(q, k.double(), v, state, log_decay, parents)
    # commits: the lowest invalid row raises after the valid rows are committed; invalid rows stay untouched
    path = torch.tensor([[0, 1, -1, -1, -1], [0, 7, -1, -1, -1]], device=device)
    for lengths in (torch.tensor([2, 2]), torch.tensor([2, 6])):
        want, got = state.clone(), state.clone()
        with pytest.raises(ValueError) as want_err:
            ref.commit_linear_state(want, k, v, log_decay, path, lengths.to(device))
        with pytest.raises(ValueError) as got_err:
            ops.commit_linear_state(got, k, v, log_decay, path, lengths.to(device))
        assert str(got_err.value) == str(want_err.value)
        assert torch.equal(got[1], state[1])
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match=r"commit_linear_state: state and k share memory"):
        ops.commit_linear_state(state, state[..., :8], state, log_decay, path, 0)  # (N = Dk = 8 nodes)


def _conv_inputs(device, dtype, B=3, C=70, N=9, K=4, kind="random", seed=0, bias=True):
    gen = make_gen(seed)
    x = torch.randn(B, N, C, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)  # (the models' layout)
    conv_state = torch.randn(B, C, K - 1, generator=gen).to(device)
    weight = torch.randn(C, K, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(C, generator=gen).to(device=device, dtype=dtype) if bias else None
    return x, conv_state, weight, b, random_parents(B, N, gen, kind).to(device)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K,activation,bias", [(4, "silu", True), (2, None, False), (1, "silu", False),
                                               (6, None, True)])
def test_tree_causal_conv1d_equals_the_spec(device, dtype, kind, K, activation, bias):
    x, conv_state, weight, b, parents = _conv_inputs(device, dtype, K=K, kind=kind, bias=bias)
    want = ref.tree_causal_conv1d(x, conv_state, weight, b, parents, activation)
    got = ops.tree_causal_conv1d(x, conv_state, weight, b, parents, activation)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", [1, 2, 4])
def test_commit_conv_state_equals_the_spec(device, dtype, kind, K):
    x, conv_state, _, _, parents = _conv_inputs(device, dtype, K=K, kind=kind, seed=2)
    path, lengths = _deepest_paths(parents, [0, 1, 9])
    want = conv_state.clone()
    ref.commit_conv_state(want, x, path, lengths)
    got = conv_state.clone().transpose(1, 2).contiguous().transpose(1, 2)  # (strided in C)
    ops.commit_conv_state(got, x, path, lengths)
    assert torch.equal(got, want)  # a copy of values: exact


def test_conv_bad_inputs_raise_the_spec_messages(device):
    x, conv_state, weight, b, parents = _conv_inputs(device, torch.float32, B=2, N=5)
    bad_tree = parents.clone()
    bad_tree[0, 0] = 0
    with pytest.raises(ValueError) as want:
        ref.tree_causal_conv1d(x, conv_state, weight, b, bad_tree, "silu")
    with pytest.raises(ValueError) as got:
        ops.tree_causal_conv1d(x, conv_state, weight, b, bad_tree, "silu")
    assert str(got.value) == str(want.value)
    out = ops.tree_causal_conv1d(x, conv_state, weight, b, bad_tree, "silu", validate=False)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    with pytest.raises(ValueError, match=r"tree_causal_conv1d: activation must be 'silu' or None, got 'gelu'"):
        ops.tree_causal_conv1d(x, conv_state, weight, b, parents, "gelu")
    with pytest.raises(ValueError, match=r"tree_causal_conv1d: conv_state must have shape \[B, C, K - 1\]"):
        ops.tree_causal_conv1d(x, conv_state[:, :, :2], weight, b, parents)
    with pytest.raises(ValueError, match=r"tree_causal_conv1d: weight must have x's dtype"):
        ops.tree_causal_conv1d(x, conv_state, weight.double(), b, parents)
    with pytest.raises(ValueError, match=r"tree_causal_conv1d: bias must have shape \[C\]"):
        ops.tree_causal_conv1d(x, conv_state, weight, b[:3], parents)
    path = torch.tensor([[0, 1, 2], [0, 9, -1]], device=device)
    for lengths in (torch.tensor([3, 2]), torch.tensor([-1, 1])):
        want_s, got_s = conv_state.clone(), conv_state.clone()
        with pytest.raises(ValueError) as want_err:
            ref.commit_conv_state(want_s, x, path, lengths.to(device))
        with pytest.raises(ValueError) as got_err:
            ops.commit_conv_state(got_s, x, path, lengths.to(device))
        assert str(got_err.value) == str(want_err.value)
        assert torch.equal(got_s, want_s)


def _delta_inputs(device, dtype, B=3, H=2, N=9, Dk=8, Dv=6, kind="random", seed=0):
    gen = make_gen(seed)
    q = torch.nn.functional.normalize(torch.randn(B, N, H, Dk, generator=gen), dim=-1) * Dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, N, H, Dk, generator=gen), dim=-1)
    v = torch.randn(B, N, H, Dv, generator=gen)
    g = -torch.rand(B, N, H, generator=gen) * 0.5
    beta = torch.rand(B, N, H, generator=gen)
    # the models' layout: [B, N, H, ...] transposed to [B, H, N, ...] (strided in N)
    q, k, v = (t.to(device=device, dtype=dtype).transpose(1, 2) for t in (q, k, v))
    g, beta = (t.to(device).transpose(1, 2) for t in (g, beta))
    state = torch.randn(B, H, Dk, Dv, generator=gen).to(device)
    return q, k, v, g, beta, state, random_parents(B, N, gen, kind).to(device)


@pytest.mark.parametrize("kind", KINDS)
def test_tree_gated_delta_rule_equals_the_spec(device, dtype, kind):
    q, k, v, g, beta, state, parents = _delta_inputs(device, dtype, kind=kind)
    want = ref.tree_gated_delta_rule(q, k, v, g, beta, state, parents)
    got = ops.tree_gated_delta_rule(q, k, v, g, beta, _strided(state), parents)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
def test_commit_gated_delta_state_equals_the_spec(device, dtype, kind):
    q, k, v, g, beta, state, parents = _delta_inputs(device, dtype, kind=kind, seed=1)
    path, lengths = _deepest_paths(parents, [2, 0, 9])
    want = state.clone()
    ref.commit_gated_delta_state(want, k, v, g, beta, path, lengths)
    got = _strided(state.clone())
    ops.commit_gated_delta_state(got, k, v, g, beta, path, lengths)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got[1], state[1])


def _ssd_inputs(device, dtype, B=3, H=4, N=9, P=6, Ds=5, kind="random", seed=0):
    gen = make_gen(seed)
    x = torch.randn(B, N, H, P, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    dt = torch.nn.functional.softplus(torch.randn(B, N, H, generator=gen)).to(device).transpose(1, 2)
    A = -torch.rand(H, generator=gen).to(device) - 0.1
    Bm = torch.randn(B, H, N, Ds, generator=gen).to(device=device, dtype=dtype)
    Cm = torch.randn(B, H, N, Ds, generator=gen).to(device=device, dtype=dtype)
    D = torch.randn(H, generator=gen).to(device)
    state = torch.randn(B, H, P, Ds, generator=gen).to(device)
    return x, dt, A, Bm, Cm, D, state, random_parents(B, N, gen, kind).to(device)


@pytest.mark.parametrize("kind", KINDS)
def test_tree_selective_state_equals_the_spec(device, dtype, kind):
    x, dt, A, Bm, Cm, D, state, parents = _ssd_inputs(device, dtype, kind=kind)
    want = ref.tree_selective_state(x, dt, A, Bm, Cm, D, state, parents)
    got = ops.tree_selective_state(x, dt, A, _strided(Bm), Cm, D, _strided(state), parents)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
def test_commit_selective_state_equals_the_spec(device, dtype, kind):
    x, dt, A, Bm, Cm, D, state, parents = _ssd_inputs(device, dtype, kind=kind, seed=1)
    path, lengths = _deepest_paths(parents, [9, 1, 0])
    want = state.clone()
    ref.commit_selective_state(want, x, dt, A, Bm, path, lengths)
    got = state.clone()
    ops.commit_selective_state(got, x, dt, A, Bm, path, lengths)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got[2], state[2])


def test_recurrence_chain_is_a_width_one_tree(device):
    """A chain through the tree ops equals one-node trees run token by token, each committed before the next."""
    q, k, v, g, beta, state, _ = _delta_inputs(device, torch.float32, N=6)
    x, dt, A, Bm, Cm, D, sstate, _ = _ssd_inputs(device, torch.float32, N=6)
    B, N = q.shape[0], q.shape[2]
    chain = ops.chain_parents(B, N, device)
    got = ops.tree_gated_delta_rule(q, k, v, g, beta, state, chain)
    got_ssd = ops.tree_selective_state(x, dt, A, Bm, Cm, D, sstate, chain)
    one, first = ops.chain_parents(B, 1, device), torch.zeros(B, 1, dtype=torch.int64, device=device)
    for i in range(N):
        s = slice(i, i + 1)
        step = ops.tree_gated_delta_rule(q[:, :, s], k[:, :, s], v[:, :, s], g[:, :, s], beta[:, :, s], state, one)
        torch.testing.assert_close(got[:, :, s], step, atol=1e-5, rtol=1e-5)
        ops.commit_gated_delta_state(state, k[:, :, s], v[:, :, s], g[:, :, s], beta[:, :, s], first, 1)
        step = ops.tree_selective_state(x[:, :, s], dt[:, :, s], A, Bm[:, :, s], Cm[:, :, s], D, sstate, one)
        torch.testing.assert_close(got_ssd[:, :, s], step, atol=1e-5, rtol=1e-5)
        ops.commit_selective_state(sstate, x[:, :, s], dt[:, :, s], A, Bm[:, :, s], first, 1)


def test_recurrence_bad_inputs_raise_the_spec_messages(device):
    q, k, v, g, beta, state, parents = _delta_inputs(device, torch.float32, B=2, N=5)
    x, dt, A, Bm, Cm, D, sstate, _ = _ssd_inputs(device, torch.float32, B=2, N=5)
    bad = parents.clone()
    bad[1, 2] = -1
    for spec, op, args in (
            (ref.tree_gated_delta_rule, ops.tree_gated_delta_rule, (q, k, v, g, beta, state, bad)),
            (ref.tree_selective_state, ops.tree_selective_state, (x, dt, A, Bm, Cm, D, sstate, bad))):
        with pytest.raises(ValueError) as want:
            spec(*args)
        with pytest.raises(ValueError) as got:
            op(*args)
        assert str(got.value) == str(want.value)
        out = op(*args, validate=False)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[0], spec(*args[:-1], parents)[0])
    path = torch.tensor([[0, 1, 2], [0, 5, -1]], device=device)
    for lengths in (torch.tensor([3, 2]), torch.tensor([4, 1])):
        for spec, op, s0, args in (
                (ref.commit_gated_delta_state, ops.commit_gated_delta_state, state, (k, v, g, beta)),
                (ref.commit_selective_state, ops.commit_selective_state, sstate, (x, dt, A, Bm))):
            want_s, got_s = s0.clone(), s0.clone()
            with pytest.raises(ValueError) as want_err:
                spec(want_s, *args, path, lengths.to(device))
            with pytest.raises(ValueError) as got_err:
                op(got_s, *args, path, lengths.to(device))
            assert str(got_err.value) == str(want_err.value)
            torch.testing.assert_close(got_s, want_s)
    with pytest.raises(ValueError, match=r"tree_gated_delta_rule: g must be Float, got Double"):
        ops.tree_gated_delta_rule(q, k, v, g.double(), beta, state, parents)
    with pytest.raises(ValueError, match=r"tree_gated_delta_rule: state must have shape \[B, H, Dk, Dv\]"):
        ops.tree_gated_delta_rule(q, k, v, g, beta, state.transpose(2, 3), parents)
    with pytest.raises(ValueError, match=r"tree_selective_state: A must have shape \[H\]"):
        ops.tree_selective_state(x, dt, A[:2], Bm, Cm, D, sstate, parents)
    with pytest.raises(ValueError, match=r"tree_selective_state: Cm must have x's dtype"):
        ops.tree_selective_state(x, dt, A, Bm, Cm.double(), D, sstate, parents)
    with pytest.raises(ValueError, match=r"commit_selective_state: state and dt share memory"):
        ops.commit_selective_state(sstate, x, sstate[:, :, :5, 0], A, Bm, path, 0)  # (dt [B, H, N = 5] over state)


@pytest.mark.parametrize("bad", [2**63 - 1, -2**63, -1])
def test_indices_at_the_int64_ends_are_row_errors(device, bad):
    """Parents, path nodes and lengths at the int64 ends (and -1): the spec's error, word for word, and nothing
    read or written out of bounds (invalid rows keep their sentinels)."""
    q, k, v, state, log_decay, parents = _linear_inputs(device, torch.float32, B=2, N=5)
    x, conv_state, weight, b, _ = _conv_inputs(device, torch.float32, B=2, N=5)
    bad_tree = parents.clone()
    bad_tree[1, 4] = bad
    path = torch.tensor([[0, 1, 2], [0, bad, 1]], device=device)
    lengths = torch.tensor([2, 2], device=device)
    calls = [
        (ref.tree_linear_attention, ops.tree_linear_attention, (q, k, v, state, log_decay, bad_tree), None),
        (ref.tree_causal_conv1d, ops.tree_causal_conv1d, (x, conv_state, weight, b, bad_tree), None),
        (ref.commit_linear_state, ops.commit_linear_state, (None, k, v, log_decay, path, lengths), state),
        (ref.commit_conv_state, ops.commit_conv_state, (None, x, path, lengths), conv_state),
        (ref.commit_conv_state, ops.commit_conv_state, (None, x, path, torch.tensor([1, bad], device=device)),
         conv_state),
    ]
    for spec, op, args, target in calls:
        if target is not None:
            want_t, got_t = target.clone(), target.clone()
            spec_args, op_args = (want_t, *args[1:]), (got_t, *args[1:])
        else:
            spec_args = op_args = args
        with pytest.raises(ValueError) as want:
            spec(*spec_args)
        with pytest.raises(ValueError) as got:
            op(*op_args)
        assert str(got.value) == str(want.value)
        if target is not None:
            assert torch.equal(got_t[1], target[1])  # the invalid row is untouched


def test_long_chains_equal_the_spec(device):
    """A prefill-length chain (257 nodes) through the delta-rule and Mamba-2 tree ops (the CPU kernels keep two live
    states for it, the CUDA ones run it in one block in order) equals the spec."""
    q, k, v, g, beta, state, _ = _delta_inputs(device, torch.float32, B=2, N=257, Dk=8, Dv=4)
    x, dt, A, Bm, Cm, D, sstate, _ = _ssd_inputs(device, torch.float32, B=2, N=257, P=4, Ds=8)
    chain = ops.chain_parents(2, 257, device)
    torch.testing.assert_close(ops.tree_gated_delta_rule(q, k, v, g, beta, state, chain),
                               ref.tree_gated_delta_rule(q, k, v, g, beta, state, chain), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.tree_selective_state(x, dt, A, Bm, Cm, D, sstate, chain),
                               ref.tree_selective_state(x, dt, A, Bm, Cm, D, sstate, chain), atol=1e-4, rtol=1e-4)
