"""Input generators and comparison helpers shared by the test files (imported as ``helpers``)."""

from __future__ import annotations

import math

import pytest
import torch

import specdec_ext
from specdec_ext import ops
from specdec_ext.ops import reference as ref

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA variant skipped: no GPU available (torch.cuda.is_available() is False)"
    if not specdec_ext.built_with_cuda():
        return "CUDA variant skipped: specdec_ext was built without its CUDA kernels (SPECDEC_CUDA=0 or no nvcc)"
    return None


CUDA_SKIP_REASON = _cuda_skip_reason()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda",
                 marks=pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")),
]


# ---------------------------------------------------------------------------------------------------------------
# Randomness.


def make_gen(seed: int) -> torch.Generator:
    """A seeded CPU generator (all random inputs are drawn on CPU, then moved, so CPU and CUDA see equal data)."""
    return torch.Generator().manual_seed(seed)


def randint(gen: torch.Generator, low: int, high: int) -> int:
    """An integer in [low, high)."""
    return int(torch.randint(low, high, (1,), generator=gen))


# ---------------------------------------------------------------------------------------------------------------
# Trees.


def random_parents(B: int, N: int, gen: torch.Generator, kind: str = "random") -> torch.Tensor:
    """``parents[B, N]`` int64 (CPU): node 0 is the root (-1), every other node's parent is an earlier node.

    kind: "random" (uniform earlier parent), "deep" (parent among the last 3 nodes: long paths), "wide" (parent
    among the first 3 nodes: many siblings), "chain", "star" (every node a child of the root).
    """
    parents = torch.empty(B, N, dtype=torch.int64)
    parents[:, 0] = -1
    for i in range(1, N):
        if kind == "random":
            p = torch.randint(0, i, (B,), generator=gen)
        elif kind == "deep":
            p = (i - 1 - torch.randint(0, min(i, 3), (B,), generator=gen)).clamp(min=0)
        elif kind == "wide":
            p = torch.randint(0, min(i, 3), (B,), generator=gen)
        elif kind == "chain":
            p = torch.full((B,), i - 1, dtype=torch.int64)
        elif kind == "star":
            p = torch.zeros(B, dtype=torch.int64)
        else:
            raise ValueError(kind)
        parents[:, i] = p
    return parents


def children_of(parents_row: list[int], node: int) -> list[int]:
    return [c for c in range(len(parents_row)) if parents_row[c] == node]


def root_path(parents_row: list[int], node: int) -> list[int]:
    """Root-to-node path by walking parents."""
    path = []
    while node != -1:
        path.append(node)
        node = parents_row[node]
    return path[::-1]


def random_tokens(B: int, N: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """Draft tokens ``[B, N]`` in [0, V); column 0 (the root) is set to -1 on purpose: kernels must not read it."""
    tokens = torch.randint(0, V, (B, N), generator=gen)
    tokens[:, 0] = -1
    return tokens


def distinct_sibling_tokens(parents: torch.Tensor, V: int, gen: torch.Generator) -> torch.Tensor:
    """Draft tokens where siblings never share a token (needs V >= the widest fan-out)."""
    B, N = parents.shape
    tokens = torch.full((B, N), -1, dtype=torch.int64)
    for b in range(B):
        prow = parents[b].tolist()
        for u in range(N):
            kids = children_of(prow, u)
            if kids:
                assert len(kids) <= V
                perm = torch.randperm(V, generator=gen)[: len(kids)]
                tokens[b, kids] = perm
    return tokens


def random_logits(B: int, N: int, V: int, gen: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    """float32 logits ``[B, N, V]`` (CPU)."""
    return torch.randn(B, N, V, generator=gen) * scale


def random_leaf_path(parents_row: list[int], gen: torch.Generator, deepest: bool = False) -> list[int]:
    """A random root-to-leaf path (the path to the first deepest leaf with ``deepest``)."""
    N = len(parents_row)
    leaves = [i for i in range(N) if not children_of(parents_row, i)]
    if deepest:
        leaf = max(leaves, key=lambda i: (len(root_path(parents_row, i)), -i))
    else:
        leaf = leaves[randint(gen, 0, len(leaves))]
    return root_path(parents_row, leaf)


def plant_path(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, gen: torch.Generator,
               boost: float = 3.0, rows=None, deepest: bool = False) -> dict[int, list[int]]:
    """Plants an accepted path in place: along a random root-to-leaf path of each chosen row, the logit of the
    child's token at its parent is set to ``max + boost`` (so it is the strict argmax, and for large boosts it holds
    almost all the probability mass). Returns {row: planted path}."""
    B = logits.shape[0]
    planted = {}
    for b in range(B) if rows is None else rows:
        path = random_leaf_path(parents[b].tolist(), gen, deepest)
        for u, c in zip(path, path[1:]):
            logits[b, u, tokens[b, c]] = logits[b, u].max() + boost
        planted[b] = path
    return planted


# ---------------------------------------------------------------------------------------------------------------
# Layout helpers.


def strided_rows(x: torch.Tensor, kind: str = "gap") -> torch.Tensor:
    """A view equal to ``x`` whose rows (all dims but the last) are not contiguous, with unit last-dim stride."""
    if kind == "gap":
        # Every other row of a padded buffer: row strides skip whole rows and the padding after each row.
        shape = list(x.shape)
        big = torch.full(shape[:-2] + [2 * shape[-2], shape[-1] + 3], float("nan"), dtype=x.dtype, device=x.device)
        view = big[..., ::2, : shape[-1]]
        view.copy_(x)
    elif kind == "transposed":
        # The first two dims swapped in memory (3-D only).
        view = x.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        raise ValueError(kind)
    assert not view.is_contiguous() and view.stride(-1) == 1
    assert torch.equal(view.isnan(), x.isnan()) and torch.equal(view.nan_to_num(), x.nan_to_num())
    return view


def on(device: str, *tensors):
    return tuple(None if t is None else t.to(device) for t in tensors)


def cpu(*tensors):
    return tuple(t.cpu() for t in tensors)


def assert_equal_tuples(got, want, names=None):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        name = names[i] if names else str(i)
        g = g.cpu()
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(g, w), f"{name} differs:\n got  {g}\n want {w}"


def assert_close_lowp(got: torch.Tensor, ref_lowp: torch.Tensor, ref_f32: torch.Tensor, atol: float, rtol: float,
                      name: str = "output"):
    """Float output check for an op run on low-precision inputs.

    (1) Kernel and reference read the same (rounded) input values and both accumulate in float32, so they agree to
        float32 accuracy: |got - ref_lowp| <= atol + rtol * |ref_lowp|.
    (2) The kernel's error against the float32 reference (run on the unrounded inputs) is at most twice the
        reference's own low-precision error, plus atol.
    Infinite entries must match exactly.
    """
    got = got.cpu().float()
    torch.testing.assert_close(got, ref_lowp.float(), atol=atol, rtol=rtol, equal_nan=False,
                               msg=lambda m: f"{name} vs reference on the same inputs: {m}")
    finite = torch.isfinite(ref_f32)
    assert torch.equal(torch.isfinite(got), finite) or not torch.equal(torch.isfinite(ref_lowp), finite), name
    both = finite & torch.isfinite(got) & torch.isfinite(ref_lowp)
    err = (got - ref_f32).abs()[both]
    ref_err = (ref_lowp.float() - ref_f32).abs()[both]
    bad = err > 2 * ref_err + atol + rtol * ref_f32.abs()[both]
    assert not bool(bad.any()), (f"{name}: error vs the float32 reference exceeds 2x the reference's own "
                                 f"low-precision error at {int(bad.sum())} entries (max err {float(err.max())}, "
                                 f"max ref err {float(ref_err.max())})")


def per_row(value, B: int, dtype: torch.dtype) -> torch.Tensor:
    """The [B] CPU tensor the reference expects for a sampling parameter."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).cpu().expand(B).contiguous() if value.dim() == 0 else value.to(dtype).cpu()
    return torch.full((B,), value, dtype=dtype)


def expected_error(fn, *args, **kwargs) -> str:
    """The reference's ValueError message for these arguments (the test fails if the reference accepts them)."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def assert_raises_exactly(message: str, fn, *args, **kwargs):
    """``fn`` raises ValueError whose text is exactly ``message`` (first line; C++ may append nothing else)."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    text = str(info.value)
    assert text.splitlines()[0] == message, f"message differs:\n got  {text!r}\n want {message!r}"


# ---------------------------------------------------------------------------------------------------------------
# Sampled tokens.

# Inverse-CDF draws compare a running sum of up to V = 32000 float32 weights with u * (their total). Two correct
# float32 implementations that sum in different orders may disagree on a draw whose u lies within their rounding
# error of a CDF boundary. Accurate float32 summation (pairwise, or float64 accumulation) has relative error
# ~1e-7..1e-6 at this size, so a draw may differ from the reference only when moving u by U_TOL = 2e-6 (about 30
# float32 ulps at 1.0) changes the reference's own draw. Everything else must match exactly.
U_TOL = 2e-6
U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


def shifted_uniforms(u: torch.Tensor, delta: float) -> torch.Tensor:
    return (u.double() + delta).clamp(0.0, U_MAX).to(u.dtype)


def assert_draws_match(got: torch.Tensor, want: torch.Tensor, redraw, name: str = "next_token"):
    """``got`` equals the reference draws ``want`` except, possibly, where the reference's draw itself changes when
    its uniform moves by U_TOL; there ``got`` must lie between the reference draws at u - U_TOL and u + U_TOL
    (inverse CDF is monotone in u). ``redraw(delta)`` returns the reference draws with every uniform shifted."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, name
    bad = (got != want).nonzero().flatten()
    if bad.numel() == 0:
        return
    lo, hi = redraw(-U_TOL), redraw(+U_TOL)
    for b in bad.tolist():
        assert int(lo[b]) <= int(got[b]) <= int(hi[b]), (
            f"{name}[{b}] = {int(got[b])}, reference {int(want[b])}: not explained by rounding (the reference draws "
            f"{int(lo[b])}..{int(hi[b])} for u within {U_TOL} of the given uniform)")


def assert_verification_matches(got, want, redraw):
    """Verification outputs: the accepted path and its length exactly, next_token as a draw (assert_draws_match).
    ``redraw(delta)`` reruns the reference with the next-token uniform shifted by delta and returns next_token."""
    assert_equal_tuples(got[:2], want[:2], ["accepted", "accept_len"])
    assert_draws_match(got[2], want[2], redraw)


def record_valid_at_propose(drafter) -> list:
    """Wraps ``drafter.propose`` to record a copy of ``drafter.valid`` (the context each row's draft cache holds)
    at every call; returns the list the records go to."""
    seen: list = []
    propose = drafter.propose

    def spy(state, max_depth, max_nodes):
        seen.append(list(drafter.valid))
        return propose(state, max_depth, max_nodes)
    drafter.propose = spy
    return seen
