"""The specs of input-gated recurrences over trees, against Hugging Face's own step-by-step functions.

``reference.tree_gated_delta_rule`` / ``commit_gated_delta_state`` (Gated DeltaNet: Qwen3-Next, Qwen3.5) against
transformers' ``torch_recurrent_gated_delta_rule``, ``reference.tree_selective_state`` / ``commit_selective_state``
(Mamba-2: Bamba) against Bamba's ``mamba2_selective_state_update``, each run along every root-to-node path from the
saved state (outputs and final states), and ``reference.tree_causal_conv1d`` / ``commit_conv_state`` against
transformers' ``causal_conv1d_update`` along the same paths (the saved window standing in above the root). Trees of
every shape, rows of different accepted lengths (0 included).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")

from helpers import random_parents, root_path  # noqa: E402

from specdec_ext.ops import reference as ref  # noqa: E402

B, H, N, DK, DV, C, K = 3, 2, 9, 8, 6, 5, 4


def inputs(seed: int, kind: str):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, N, DK, generator=gen), torch.randn(B, H, N, DK, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True)  # (the layer l2-normalises keys: the delta rule stays bounded)
    v = torch.randn(B, H, N, DV, generator=gen)
    g = -torch.rand(B, H, N, generator=gen)
    beta = torch.rand(B, H, N, generator=gen)
    state = torch.randn(B, H, DK, DV, generator=gen)
    return q, k, v, g, beta, state, random_parents(B, N, gen, kind)


def check_every_path(got: torch.Tensor, parents: torch.Tensor, reference) -> None:
    """``got[B, C, N, ...]`` at every root-to-leaf path's nodes equals ``reference(b, path)`` (HF run along it)."""
    for b in range(parents.shape[0]):
        prow = parents[b].tolist()
        for leaf in (i for i in range(len(prow)) if i not in prow):
            path = root_path(prow, leaf)
            torch.testing.assert_close(got[b, :, path], reference(b, path), atol=1e-5, rtol=1e-5)


def deepest_paths(parents: torch.Tensor, takes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(path[B, N], lengths[B])``: row b accepts the first ``takes[b]`` nodes of its deepest root path (all of it
    when ``takes[b]`` is larger), -1 padded."""
    path = torch.full(parents.shape, -1, dtype=torch.int64)
    lengths = torch.zeros(parents.shape[0], dtype=torch.int64)
    for b, take in enumerate(takes):
        prow = parents[b].tolist()
        nodes = root_path(prow, max(range(len(prow)), key=lambda i: len(root_path(prow, i))))[:take]
        path[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
        lengths[b] = len(nodes)
    return path, lengths


def hf_rule(q, k, v, g, beta, state, b: int, nodes: list[int]):
    """HF's recurrent rule over row b's ``nodes`` from ``state[b]``: (outputs [H, T, Dv], final state)."""
    def seq(t):  # [B, H, N, ...] -> HF's [1, T, H, ...]
        return t[b:b + 1, :, nodes].transpose(1, 2)
    out, final = qwen3_next.torch_recurrent_gated_delta_rule(seq(q), seq(k), seq(v), g=seq(g), beta=seq(beta),
                                                             initial_state=state[b:b + 1],
                                                             output_final_state=True)
    return out[0].transpose(0, 1), final[0]


@pytest.mark.parametrize("kind", ["random", "deep", "wide", "chain", "star"])
def test_tree_gated_delta_rule_equals_hf_along_every_path(kind):
    q, k, v, g, beta, state, parents = inputs(3, kind)
    got = ref.tree_gated_delta_rule(q * DK ** -0.5, k, v, g, beta, state, parents)  # (HF scales q itself)
    check_every_path(got, parents, lambda b, path: hf_rule(q, k, v, g, beta, state, b, path)[0])
    # the commit: each row's state after its own accepted path (lengths 0, 1 and the deepest path)
    path, lengths = deepest_paths(parents, (0, 1, N))
    committed = state.clone()
    ref.commit_gated_delta_state(committed, k, v, g, beta, path, lengths)
    assert torch.equal(committed[0], state[0])
    for b in (1, 2):
        _, want = hf_rule(q, k, v, g, beta, state, b, path[b, : int(lengths[b])].tolist())
        torch.testing.assert_close(committed[b], want, atol=1e-5, rtol=1e-5)


def hf_conv(x, conv_state, weight, bias, b: int, nodes: list[int]):
    """HF's causal_conv1d_update over row b's ``nodes`` from the saved window: (outputs [C, T], new window)."""
    window = conv_state[b:b + 1].clone()
    out = qwen3_next.causal_conv1d_update(x[b:b + 1, :, nodes], window, weight, bias, "silu")
    return out[0], window[0]


@pytest.mark.parametrize("kind", ["random", "deep", "chain", "star"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tree_causal_conv1d_equals_hf_along_every_path(kind, with_bias):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, C, N, generator=gen)
    conv_state = torch.randn(B, C, K - 1, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen) if with_bias else None
    parents = random_parents(B, N, gen, kind)
    got = ref.tree_causal_conv1d(x, conv_state, weight, bias, parents, "silu")
    check_every_path(got, parents, lambda b, path: hf_conv(x, conv_state, weight, bias, b, path)[0])
    path, lengths = deepest_paths(parents, (0, 2, N))
    committed = conv_state.clone()
    ref.commit_conv_state(committed, x, path, lengths)
    assert torch.equal(committed[0], conv_state[0])
    for b in (1, 2):
        _, want = hf_conv(x, conv_state, weight, bias, b, path[b, : int(lengths[b])].tolist())
        torch.testing.assert_close(committed[b], want)


def test_deltanet_spec_bad_input_names_the_argument():
    q, k, v, g, beta, state, parents = inputs(1, "random")
    bad = parents.clone()
    bad[1, 4] = 6
    with pytest.raises(ValueError, match=r"tree_gated_delta_rule: parents\[1, 4\] = 6 is not an earlier node"):
        ref.tree_gated_delta_rule(q, k, v, g, beta, state, bad)
    with pytest.raises(ValueError, match=r"commit_gated_delta_state: lengths\[0\] = 10 is out of range"):
        ref.commit_gated_delta_state(state.clone(), k, v, g, beta, torch.zeros(B, N, dtype=torch.int64),
                                     torch.tensor([10, 0, 0]))
    x = torch.randn(B, C, N)
    with pytest.raises(ValueError, match="activation must be 'silu' or None"):
        ref.tree_causal_conv1d(x, torch.zeros(B, C, K - 1), torch.ones(C, K), None, parents, "gelu")
    before = torch.zeros(B, C, K - 1)
    with pytest.raises(ValueError, match=r"commit_conv_state: path\[2, 0\] = 9 is out of range \[0, N\)"):
        ref.commit_conv_state(before, x, torch.full((B, N), 9), torch.tensor([0, 0, 1]))
    assert not before.any()


def hf_ssd(x, dt, A, Bg, Cg, D, state, b: int, nodes: list[int]):
    """Bamba's selective state update over row b's ``nodes`` (one token at a time, its per-group B and C) from
    ``state[b]``: (outputs [H, T, P], final state)."""
    S = state[b:b + 1].clone()
    H, P, Ds = S.shape[1:]
    # (shaped as BambaMixer hands them over: dt and D per head dim, A per head dim and state entry)
    A_, D_ = A[:, None, None].expand(H, P, Ds), D[:, None].expand(H, P)
    outs = [bamba.mamba2_selective_state_update(S, x[b:b + 1, :, j], dt[b:b + 1, :, j, None].expand(1, H, P), A_,
                                                Bg[b:b + 1, :, j], Cg[b:b + 1, :, j], D_)[0] for j in nodes]
    return torch.stack(outs, 1), S[0]


@pytest.mark.parametrize("kind", ["random", "deep", "wide", "chain", "star"])
def test_tree_selective_state_equals_hf_along_every_path(kind):
    gen = torch.Generator().manual_seed(9)
    H, P, Ds, G = 4, 6, 5, 2
    x = torch.randn(B, H, N, P, generator=gen)
    dt = torch.rand(B, H, N, generator=gen)  # (after the softplus: positive)
    A = -torch.rand(H, generator=gen) - 0.1
    Bg, Cg = torch.randn(B, G, N, Ds, generator=gen), torch.randn(B, G, N, Ds, generator=gen)
    D = torch.randn(H, generator=gen)
    state = torch.randn(B, H, P, Ds, generator=gen)
    parents = random_parents(B, N, gen, kind)
    Bm, Cm = Bg.repeat_interleave(H // G, dim=1), Cg.repeat_interleave(H // G, dim=1)  # (consecutive heads a group)
    got = ref.tree_selective_state(x, dt, A, Bm, Cm, D, state, parents)
    check_every_path(got, parents, lambda b, path: hf_ssd(x, dt, A, Bg, Cg, D, state, b, path)[0])
    path, lengths = deepest_paths(parents, (0, 1, N))
    committed = state.clone()
    ref.commit_selective_state(committed, x, dt, A, Bm, path, lengths)
    assert torch.equal(committed[0], state[0])
    for b in (1, 2):
        _, want = hf_ssd(x, dt, A, Bg, Cg, D, state, b, path[b, : int(lengths[b])].tolist())
        torch.testing.assert_close(committed[b], want, atol=1e-5, rtol=1e-5)
