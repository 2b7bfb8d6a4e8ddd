"""compact_kv vs the reference: both cache layouts, every float dtype, ragged lengths, overlapping and reversed
moves, many caches (more than one launch), validation and bad arguments."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_raises_exactly, expected_error, make_gen, ops, ref

ALL_FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ALL_IDS = ["f32", "f16", "bf16", "f64"]


def make_caches(n, shape, dtype, seed, device):
    gen = make_gen(seed)
    return [torch.randn(*shape, generator=gen).to(dtype).to(device) for _ in range(n)]


def run_both(caches, src, dst, lengths, seq_dim, validate=True):
    """Runs the op on `caches` (in place) and the reference on CPU clones; returns the reference result."""
    want = [c.cpu().clone() for c in caches]
    ref.compact_kv(want, src.cpu(), dst.cpu(), lengths.cpu(), seq_dim, validate=False)
    dev = caches[0].device
    ops.compact_kv(caches, src.to(dev), dst.to(dev), lengths.to(dev), seq_dim, validate=validate)
    return want


def assert_caches_equal(got, want):
    for c, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.cpu(), w), f"cache {c} differs"


def accepted_paths(B, L, S, gen):
    """Typical use: rows with a prefix P, a tree in [P, P + N), an accepted path of tree positions (ragged)."""
    src = torch.zeros(B, L, dtype=torch.int64)
    dst = torch.zeros(B, dtype=torch.int64)
    lengths = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        P = int(torch.randint(0, S - 2 * L, (1,), generator=gen))
        n = int(torch.randint(0, L + 1, (1,), generator=gen))
        path = sorted(torch.randperm(2 * L, generator=gen)[:n].tolist())
        src[b, :n] = P + torch.tensor(path, dtype=torch.int64)
        src[b, n:] = int(torch.randint(0, S, (1,), generator=gen))  # padding past lengths[b]: never read
        dst[b], lengths[b] = P, n
    return src, dst, lengths


@pytest.mark.parametrize("dtype", ALL_FLOATS, ids=ALL_IDS)
@pytest.mark.parametrize("layout", ["hf", "flat"])
def test_matches_reference(device, dtype, layout):
    B, L, S = 5, 8, 64
    shape, seq_dim = ((B, 3, S, 40), 2) if layout == "hf" else ((B, S, 24), 1)
    caches = make_caches(4, shape, dtype, seed=1, device=device)
    src, dst, lengths = accepted_paths(B, L, S, make_gen(2))
    lengths[0] = 0
    want = run_both(caches, src, dst, lengths, seq_dim)
    assert_caches_equal(caches, want)
    assert any(not torch.equal(c.cpu(), w) for c, w in zip(make_caches(4, shape, dtype, 1, "cpu"), want))


@pytest.mark.parametrize("case", ["shift_left", "shift_right", "reversed", "duplicates", "swap", "identity"])
def test_overlapping_moves(device, case):
    """Snapshot semantics: every destination gets the OLD value of its source, however the ranges overlap."""
    B, L, S = 2, 12, 40
    if case == "shift_left":  # dst = src - 1
        src = torch.arange(11, 11 + L).expand(B, L)
        dst = torch.tensor([10, 10])
    elif case == "shift_right":  # dst = src + 1
        src = torch.arange(10, 10 + L).expand(B, L)
        dst = torch.tensor([11, 11])
    elif case == "reversed":  # the same range, reversed
        src = torch.arange(10 + L - 1, 9, -1).expand(B, L)
        dst = torch.tensor([10, 10])
    elif case == "duplicates":  # one source to several destinations, overlapping them
        src = torch.tensor([[12] * L, [5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10]])
        dst = torch.tensor([10, 4])
    elif case == "swap":  # two halves exchanged
        half = torch.cat([torch.arange(16, 22), torch.arange(10, 16)])
        src = half.expand(B, L)
        dst = torch.tensor([10, 10])
    else:
        src = torch.arange(10, 10 + L).expand(B, L)
        dst = torch.tensor([10, 10])
    src = src.contiguous()
    lengths = torch.tensor([L, L - 3])
    for shape, seq_dim in [((B, 2, S, 8), 2), ((B, S, 6), 1)]:
        caches = make_caches(2, shape, torch.float32, seed=3, device=device)
        old = [c.cpu().clone() for c in caches]
        want = run_both(caches, src, dst, lengths, seq_dim)
        assert_caches_equal(caches, want)
        # Independent check of the semantics on one row (no reference involved).
        for c, o in zip(caches, old):
            for i in range(int(lengths[1])):
                got = c[1].select(seq_dim - 1, int(dst[1]) + i).cpu()
                assert torch.equal(got, o[1].select(seq_dim - 1, int(src[1, i])))


def test_many_caches_and_odd_rows(device):
    """More caches than one launch holds (128), and a row size that is not a multiple of 16 bytes (f16, 3 dims)."""
    B, L, S = 3, 5, 30
    caches = make_caches(131, (B, 2, S, 3), torch.float16, seed=4, device=device)
    src, dst, lengths = accepted_paths(B, L, S, make_gen(5))
    want = run_both(caches, src, dst, lengths, 2)
    assert_caches_equal(caches, want)


def test_unaligned_views(device):
    """Caches that are contiguous views starting at an odd element offset (no 16-byte alignment)."""
    B, L, S = 2, 4, 20
    base = torch.randn(1 + B * S * 7, generator=make_gen(6)).to(torch.bfloat16).to(device)
    cache = base[1:].view(B, S, 7)
    src, dst, lengths = accepted_paths(B, L, S, make_gen(7))
    want = run_both([cache], src, dst, lengths, 1)
    assert_caches_equal([cache], want)


@pytest.mark.parametrize("what", ["src_high", "src_negative", "dst_negative", "dst_too_far", "length_negative",
                                  "length_too_long"])
def test_bad_positions(device, what):
    B, L, S = 3, 4, 16
    src = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    dst = torch.tensor([0, 2, 4])
    lengths = torch.tensor([4, 4, 2])
    if what == "src_high":
        src[1, 2] = S
    elif what == "src_negative":
        src[1, 0] = -1
    elif what == "dst_negative":
        dst[1] = -2
    elif what == "dst_too_far":
        dst[1] = S - 3
    elif what == "length_negative":
        lengths[1] = -1
    else:
        lengths[1] = L + 1
    src[2, 3] = 99  # past lengths[2]: never read, so not an error
    caches = make_caches(2, (B, 2, S, 8), torch.float32, seed=8, device=device)
    msg = expected_error(ref.compact_kv, [c.cpu().clone() for c in caches], src, dst, lengths, 2)
    name = {"src": "src_positions[1", "dst": "dst_start[1]", "len": "lengths[1]"}[what[:3]]
    assert name in msg
    got = [c.clone() for c in caches]
    assert_raises_exactly(msg, ops.compact_kv, got, *(t.to(device) for t in (src, dst, lengths)), 2)
    # Valid rows moved, the invalid row untouched (with or without validation).
    want = run_both(caches, src, dst, lengths, 2, validate=False)
    assert_caches_equal(caches, want)
    assert_caches_equal(got, want)


def test_bad_arguments():
    c = torch.zeros(2, 3, 10, 4)
    src, dst, n = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.ones(2,
                                                                                                      dtype=torch.int64)
    op = torch.ops.specdec_ext.compact_kv
    with pytest.raises(ValueError, match="caches must hold at least one tensor"):
        op([], src, dst, n, 2)
    with pytest.raises(ValueError, match=r"seq_dim must be in \[1, 3\]"):
        op([c], src, dst, n, 0)
    with pytest.raises(ValueError, match=r"every cache must have caches\[0\]'s shape"):
        op([c, torch.zeros(2, 3, 11, 4)], src, dst, n, 2)
    with pytest.raises(ValueError, match=r"every cache must have caches\[0\]'s shape"):
        op([c, c.half()], src, dst, n, 2)
    with pytest.raises(ValueError, match=r"caches\[0\] must be contiguous"):
        op([c.transpose(1, 2)], src, dst, n, 1)
    with pytest.raises(ValueError, match="caches must be floating point"):
        op([c.long()], src, dst, n, 2)
    with pytest.raises(ValueError, match=r"src_positions must have shape \[B, L\]"):
        op([c], src[:1], dst, n, 2)
    with pytest.raises(ValueError, match="src_positions must be Long"):
        op([c], src.int(), dst, n, 2)
    with pytest.raises(ValueError, match=r"lengths must have shape \[B\]"):
        op([c], src, dst, n[:1], 2)
    with pytest.raises(ValueError, match="dst_start must be Long"):
        op([c], src, dst.float(), n, 2)


def test_aliased_caches_are_refused():
    """The same tensor twice (or overlapping views of one storage) would be moved twice, the second move reading
    rows the first already wrote: refused. Disjoint views of one storage (K and V halves of one buffer) are fine."""
    B, H, S, D = 2, 3, 10, 4
    src = torch.tensor([[4, 5, 6], [7, 8, 9]])
    dst, n = torch.tensor([1, 2]), torch.tensor([3, 2])
    c = torch.randn(B, H, S, D)
    message = expected_error(ref.compact_kv, [c, c], src, dst, n, 2)  # the reference refuses it too
    assert_raises_exactly(message, ops.compact_kv, [c, c], src, dst, n)
    assert message.startswith("compact_kv: caches[0] and caches[1] share memory")
    flat = torch.randn(2 * c.numel())
    overlapping = [flat[: c.numel()].view(c.shape), flat[c.numel() // 2: c.numel() // 2 + c.numel()].view(c.shape)]
    with pytest.raises(ValueError, match=r"caches\[0\] and caches\[1\] share memory"):
        ops.compact_kv(overlapping, src, dst, n)
    other = torch.randn(B, H, S, D)
    with pytest.raises(ValueError, match=r"caches\[0\] and caches\[2\] share memory"):
        ops.compact_kv([c, other, c], src, dst, n)
    halves = [flat[: c.numel()].view(c.shape), flat[c.numel():].view(c.shape)]
    want = [h.clone() for h in halves]
    ref.compact_kv(want, src, dst, n, 2)
    ops.compact_kv(halves, src, dst, n)
    assert_caches_equal(halves, want)
    # An index tensor that views a cache's memory is refused too (the cache is written while it is read).
    c64 = torch.zeros(B, H, S, D, dtype=torch.float64)
    src_view = c64.view(torch.int64).view(-1)[: 2 * 3].view(2, 3)
    with pytest.raises(ValueError, match=r"caches\[0\] and src_positions share memory"):
        ops.compact_kv([c64], src_view, dst, n)
    # Meta tensors (the fake's checks) are refused where real ones are: a meta tensor has no data pointer, its
    # storage and offset say where it lies.
    meta = torch.empty(2 * c.numel(), device="meta")
    m_src, m_dst, m_n = (t.to("meta") for t in (src, dst, n))
    m_c = meta[: c.numel()].view(c.shape)
    for caches in ([m_c, m_c], [m_c, meta[c.numel() // 2: c.numel() // 2 + c.numel()].view(c.shape)]):
        with pytest.raises(ValueError, match=r"caches\[0\] and caches\[1\] share memory"):
            ops.compact_kv(caches, m_src, m_dst, m_n)
    ops.compact_kv([m_c, meta[c.numel():].view(c.shape)], m_src, m_dst, m_n)  # disjoint halves of one storage
    ops.compact_kv([m_c, torch.empty(c.shape, device="meta")], m_src, m_dst, m_n)  # two storages
