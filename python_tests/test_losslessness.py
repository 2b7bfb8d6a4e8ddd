"""Distributional tests: speculative verification must emit tokens distributed exactly as the (filtered) target.

Each test batches B = 20,000 independent verifications in one op call on a small vocabulary and compares the
empirical distribution of the emitted tokens with the exact target distribution, computed here in float64 by our
own softmax / top-k / top-p code (not the reference's). Comparison: Pearson chi-square goodness of fit (cells with
expected count < 5 merged); a test fails when p < ALPHA = 1e-4, i.e. a false alarm rate of 1e-4 per check for a
correct kernel. Seeds are fixed, so the outcome is deterministic. Tokens with target probability 0 must never be
emitted (exact check).

Emitted tokens of one step: the accepted drafts, then next_token. For a chain drafted with q the first token must
follow p(. | prefix) and, when the first draft was accepted, the second must follow p(. | prefix, first token).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from helpers import make_gen, on, ops

ALPHA = 1e-4
B = 20_000
V = 6
# (temperature, top_k, top_p) applied inside the op; None means plain softmax.
PARAMS = [(1.0, 0, 1.0), (0.8, 5, 0.9), (1.3, 4, 0.75)]
PARAM_IDS = ["plain", "T0.8-k5-p0.9", "T1.3-k4-p0.75"]


# ---------------------------------------------------------------------------------------------------------------
# The exact target, written independently of specdec_ext.ops.reference.


def target_dist(logits_row, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T) restricted to the top_k largest, then to the smallest prefix (in descending order) whose
    mass reaches top_p, renormalised. float64."""
    x = np.asarray(logits_row, dtype=np.float64) / temperature
    n = x.size
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(n, dtype=bool)
    keep[order[: top_k if 0 < top_k < n else n]] = True
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        sorted_p = p[order]
        cum = np.cumsum(sorted_p)
        m = int(np.searchsorted(cum, top_p * cum[-1]))  # first index with cum >= top_p
        # The cut must not sit within rounding of top_p, or float32 kernels could legitimately disagree.
        assert abs(cum[m] - top_p) > 1e-4 and (m == 0 or abs(cum[m - 1] - top_p) > 1e-4)
        keep2 = np.zeros(n, dtype=bool)
        keep2[order[: m + 1]] = True
        p = np.where(keep2, p, 0.0)
        p /= p.sum()
    return p


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square over cells of one group (same total); cells with expected < 5 are merged into one.
    Returns (statistic, degrees of freedom) contributions."""
    small = expected < 5
    obs = list(observed[~small])
    exp = list(expected[~small])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.array(obs, dtype=np.float64), np.array(exp, dtype=np.float64)
    if exp.size <= 1:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), exp.size - 1


def assert_follows(samples: np.ndarray, probs: np.ndarray, what: str):
    """``samples`` (ints) are i.i.d. draws from ``probs``."""
    n = samples.size
    assert n > 1000, f"{what}: too few samples ({n}) for a meaningful test"
    counts = np.bincount(samples, minlength=probs.size)
    assert counts.size == probs.size, f"{what}: token out of range"
    assert counts[probs == 0].sum() == 0, f"{what}: emitted tokens of target probability 0: {counts} vs {probs}"
    stat, dof = chi2_pvalue(counts[probs > 0], n * probs[probs > 0])
    p = stats.chi2.sf(stat, dof) if dof else 1.0
    assert p >= ALPHA, f"{what}: chi-square p = {p:.2e} (stat {stat:.1f}, dof {dof}); counts {counts}, expected " \
                       f"{np.round(n * probs, 1)}"


def assert_conditional_follows(first: np.ndarray, second: np.ndarray, cond_probs: dict, what: str):
    """Pairs (first, second): for every value a of first, second | first = a follows cond_probs[a]. One pooled
    chi-square over all groups (each group's total is conditioned on)."""
    stat, dof = 0.0, 0
    for a in np.unique(first):
        sel = second[first == a]
        probs = cond_probs[int(a)]
        counts = np.bincount(sel, minlength=probs.size)
        assert counts[probs == 0].sum() == 0, f"{what}: after {a}, emitted tokens of target probability 0"
        s, d = chi2_pvalue(counts[probs > 0], sel.size * probs[probs > 0])
        stat, dof = stat + s, dof + d
    assert dof >= 1, f"{what}: too few populated cells"
    p = stats.chi2.sf(stat, dof)
    assert p >= ALPHA, f"{what}: pooled chi-square p = {p:.2e} (stat {stat:.1f}, dof {dof})"


def emitted(tokens: torch.Tensor, out) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First emitted token per row, second emitted token (valid where accept_len >= 1), and accept_len."""
    accepted, accept_len, next_token = (t.cpu() for t in out)
    rows = torch.arange(tokens.shape[0])
    n1 = accepted[:, 1].clamp(min=0)
    first = torch.where(accept_len >= 1, tokens[rows, n1], next_token)
    n2 = accepted[:, 2].clamp(min=0) if accepted.shape[1] > 2 else torch.zeros_like(n1)
    second = torch.where(accept_len >= 2, tokens[rows, n2], next_token)
    return first.numpy(), second.numpy(), accept_len.numpy()


def sample(q: torch.Tensor, gen: torch.Generator, num: int = 1) -> torch.Tensor:
    """``num`` i.i.d. draws per row of q [R, V] (by the test, not by the op)."""
    return torch.multinomial(q, num, replacement=True, generator=gen)


def random_tables(seed: int):
    """Target logits for the root (L0), after one token (L1[a]), after two (L2[a, b]); drafter distributions at
    the root (q0) and after one token (Q1[a]), each with a token the drafter never proposes."""
    gen = make_gen(seed)
    L0 = torch.randn(V, generator=gen) * 1.5
    L1 = torch.randn(V, V, generator=gen) * 1.5
    L2 = torch.randn(V, V, V, generator=gen) * 1.5
    q0 = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    q0[V - 1] = 0
    Q1 = torch.softmax(torch.randn(V, V, generator=gen) * 1.5, -1)
    Q1[:, 0] = 0
    return L0, L1, L2, q0 / q0.sum(), Q1 / Q1.sum(-1, keepdim=True)


def run_sampling(device, logits, tokens, parents, q, params, seed):
    T, k, p = params
    u = torch.rand(tokens.shape, generator=make_gen(seed))
    return ops.verify_tree_sampling(*on(device, logits, tokens, parents, u), draft_probs=on(device, q)[0],
                                    temperature=T, top_k=k, top_p=p)


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
def test_chain_with_draft_probs(device, params):
    L0, L1, L2, q0, Q1 = random_tables(1)
    gen = make_gen(2)
    d1 = sample(q0.expand(B, V), gen)[:, 0]
    d2 = sample(Q1[d1], gen)[:, 0]
    tokens = torch.stack([torch.full((B,), -1), d1, d2], 1)
    logits = torch.stack([L0.expand(B, V), L1[d1], L2[d1, d2]], 1)
    q = torch.stack([q0.expand(B, V), Q1[d1], torch.full((B, V), 1.0 / V)], 1)
    out = run_sampling(device, logits, tokens, ops.chain_parents(B, 3), q, params, seed=3)
    first, second, alen = emitted(tokens, out)
    p0 = target_dist(L0, *params)
    assert_follows(first, p0, "first token")
    assert_conditional_follows(first[alen >= 1], second[alen >= 1],
                               {a: target_dist(L1[a], *params) for a in range(V)}, "second token | first")
    # The first draft is accepted with probability sum_x min(p0(x), q0(x)) (standard speculative sampling).
    rate = float(np.minimum(p0, q0.double().numpy()).sum())
    test = stats.binomtest(int((alen >= 1).sum()), B, rate)
    assert test.pvalue >= ALPHA, f"acceptance of the first draft: {(alen >= 1).mean():.4f} vs {rate:.4f}"


def _multi_draft_tree(gen, L0, L1, L2, q0, Q1, deterministic: bool):
    """Root with 3 children, each with 2 children (N = 10). Sampled: children i.i.d. from q (with replacement, so
    siblings may repeat). Deterministic: the top-3 / top-2 tokens of the drafter distribution."""
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]).expand(B, 10).contiguous()
    if deterministic:
        c = torch.argsort(q0, descending=True, stable=True)[:3].expand(B, 3)
    else:
        c = sample(q0.expand(B, V), gen, 3)
    g = []
    for j in range(3):
        qj = Q1[c[:, j]]
        g.append(torch.argsort(qj, dim=-1, descending=True, stable=True)[:, :2] if deterministic else sample(qj, gen, 2))
    tokens = torch.cat([torch.full((B, 1), -1), c, *g], 1)
    logits = torch.stack([L0.expand(B, V)] + [L1[c[:, j]] for j in range(3)] +
                         [L2[c[:, j], g[j][:, i]] for j in range(3) for i in range(2)], 1)
    q = torch.stack([q0.expand(B, V)] + [Q1[c[:, j]] for j in range(3)] + [torch.full((B, V), 1.0 / V)] * 6, 1)
    return tokens, parents, logits, None if deterministic else q


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled_siblings", "top_k_siblings"])
@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
def test_tree(device, params, deterministic):
    L0, L1, L2, q0, Q1 = random_tables(4)
    tokens, parents, logits, q = _multi_draft_tree(make_gen(5), L0, L1, L2, q0, Q1, deterministic)
    out = run_sampling(device, logits, tokens, parents, q, params, seed=6)
    first, second, alen = emitted(tokens, out)
    assert_follows(first, target_dist(L0, *params), "first token")
    assert_conditional_follows(first[alen >= 1], second[alen >= 1],
                               {a: target_dist(L1[a], *params) for a in range(V)}, "second token | first")
    # The accepted path is a root path of the tree.
    accepted = out[0].cpu()
    ok = accepted[:, 1] >= 1
    assert bool(((accepted[ok, 1] >= 1) & (accepted[ok, 1] <= 3)).all())
    two = alen >= 2
    assert bool((parents[0][accepted[torch.from_numpy(two), 2]] == accepted[torch.from_numpy(two), 1]).all())


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
def test_draft_equals_target_accepts_everything(device, params):
    """q = the exact target at every node: every draft is accepted, and the bonus token follows the last target.
    (Uniforms are scaled by 0.999: u * q(x) < p(x) must not hinge on float32 rounding of q versus the op's p.)"""
    N = 4
    gen = make_gen(7)
    L0, L1, L2, _, _ = random_tables(8)
    P0 = torch.from_numpy(target_dist(L0, *params)).float()
    d1 = sample(P0.expand(B, V), gen)[:, 0]
    P1 = torch.stack([torch.from_numpy(target_dist(L1[a], *params)).float() for a in range(V)])
    d2 = sample(P1[d1], gen)[:, 0]
    P2 = torch.stack([torch.stack([torch.from_numpy(target_dist(L2[a, b], *params)).float() for b in range(V)])
                      for a in range(V)])
    d3 = sample(P2[d1, d2], gen)[:, 0]
    L3 = torch.randn(V, generator=gen)
    tokens = torch.stack([torch.full((B,), -1), d1, d2, d3], 1)
    logits = torch.stack([L0.expand(B, V), L1[d1], L2[d1, d2], L3.expand(B, V)], 1)
    q = torch.stack([P0.expand(B, V), P1[d1], P2[d1, d2], torch.full((B, V), 1.0 / V)], 1)
    T, k, p = params
    u = torch.rand(B, N, generator=gen) * 0.999
    out = ops.verify_tree_sampling(*on(device, logits, tokens, ops.chain_parents(B, N), u), draft_probs=q.to(device),
                                   temperature=T, top_k=k, top_p=p)
    alen = out.accept_len.cpu()
    assert bool((alen == N - 1).all()), f"{int((alen != N - 1).sum())} rows rejected a draft drawn from the target"
    assert torch.equal(out.accepted.cpu(), torch.arange(N).expand(B, N))
    assert_follows(out.next_token.cpu().numpy(), target_dist(L3, *params), "bonus token")


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft_probs", "no_draft_probs"])
def test_disjoint_supports_accept_nothing(device, deterministic):
    """The drafter only proposes tokens the target gives probability 0: nothing is accepted, and next_token follows
    the target (the residual max(p - q, 0) is p itself)."""
    gen = make_gen(9)
    L0 = torch.randn(V, generator=gen)
    L0[3:] = -float("inf")
    q0 = torch.zeros(V)
    q0[3:] = torch.tensor([0.5, 0.3, 0.2])
    N = 4  # three siblings under the root
    parents = torch.tensor([-1, 0, 0, 0]).expand(B, N).contiguous()
    drafts = (torch.tensor([3, 4, 5]).expand(B, 3) if deterministic else sample(q0.expand(B, V), gen, 3))
    tokens = torch.cat([torch.full((B, 1), -1), drafts], 1)
    logits = torch.cat([L0.expand(B, 1, V), torch.randn(B, 3, V, generator=gen)], 1)
    q = None if deterministic else torch.cat([q0.expand(B, 1, V), torch.full((B, 3, V), 1.0 / V)], 1)
    out = run_sampling(device, logits, tokens, parents, q, (1.0, 0, 1.0), seed=10)
    assert bool((out.accept_len == 0).all())
    assert_follows(out.next_token.cpu().numpy(), target_dist(L0, 1.0, 0, 1.0), "next token")


@pytest.mark.parametrize("params", PARAMS + [(0.6, 2, 1.0)], ids=PARAM_IDS + ["T0.6-k2"])
def test_sample_tokens_distribution(device, params):
    Vs = 8
    logits = torch.randn(Vs, generator=make_gen(11)) * 1.5
    T, k, p = params
    u = torch.rand(B, generator=make_gen(12))
    tokens, probs = ops.sample_tokens(*on(device, logits.expand(B, Vs).contiguous(), u), temperature=T, top_k=k,
                                      top_p=p)
    probs = probs.cpu()
    assert bool((probs == probs[0]).all()), "identical rows must get identical distributions"
    want = target_dist(logits, *params)
    np.testing.assert_allclose(probs[0].double().numpy(), want, atol=1e-6)
    assert_follows(tokens.cpu().numpy(), want, "sampled token")
    assert_follows(tokens.cpu().numpy(), probs[0].double().numpy() / probs[0].double().sum().item(),
                   "sampled token vs returned probs")


def test_sample_tokens_feeds_verification(device):
    """End to end: drafts and their draft_probs from sample_tokens (drafter params), verified against a target with
    other params: the first emitted token follows the target."""
    gen = make_gen(13)
    Ld = torch.randn(V, generator=gen) * 1.5
    Lt = torch.randn(V, generator=gen) * 1.5
    d, q0 = ops.sample_tokens(*on(device, Ld.expand(B, V).contiguous(), torch.rand(B, generator=gen)),
                              temperature=1.2, top_k=4)
    tokens = torch.stack([torch.full((B,), -1), d.cpu()], 1)
    logits = torch.stack([Lt.expand(B, V), torch.randn(B, V, generator=gen)], 1)
    q = torch.stack([q0.cpu(), torch.full((B, V), 1.0 / V)], 1)
    out = run_sampling(device, logits, tokens, ops.chain_parents(B, 2), q, (0.9, 0, 0.9), seed=14)
    first, _, _ = emitted(tokens, out)
    assert_follows(first, target_dist(Lt, 0.9, 0, 0.9), "first token")
