"""Malformed arguments (shapes, dtypes, devices, layouts, ranges, index values at the int64 ends): a clear ValueError
naming the op and the argument (docs/ARCHITECTURE.md, "Errors"); data errors word for word the reference's."""

from __future__ import annotations

import pytest
import torch

from helpers import (CUDA_SKIP_REASON, assert_raises_exactly, expected_error, make_gen, on, ops, random_parents,
                     random_tokens, ref)

B, N, V = 2, 5, 11


def _x(device="cpu"):
    gen = make_gen(0)
    d = dict(parents=random_parents(B, N, gen), tokens=random_tokens(B, N, V, gen),
             logits=torch.randn(B, N, V, generator=gen), u=torch.rand(B, N, generator=gen),
             q=torch.softmax(torch.randn(B, N, V, generator=gen), -1), scores=torch.zeros(B, N))
    return {k: v.to(device) for k, v in d.items()}


def _greedy(x, **over):
    a = {**x, **over}
    return ops.verify_tree_greedy(a["logits"], a["tokens"], a["parents"])


def _sampling(x, **over):
    a = {**x, **over}
    kw = {k: a[k] for k in ("temperature", "top_k", "top_p") if k in a}
    return ops.verify_tree_sampling(a["logits"], a["tokens"], a["parents"], a["u"], a.get("q"), **kw)


def _typical(x, **over):
    a = {**x, **over}
    return ops.verify_tree_typical(a["logits"], a["tokens"], a["parents"], a.get("u1", a["u"][:, 0].contiguous()),
                                   a.get("temperature", 0.7), a.get("thr", 0.09), a.get("alpha", 0.3))


# (id, callable, exception type, regex the message must match)
CASES = [
    # shapes
    ("parents_1d", lambda x: ops.build_tree(x["parents"][0]), ValueError,
     r"build_tree: parents must have 2 dimensions"),
    ("parents_3d_mask", lambda x: ops.tree_ancestor_mask(x["parents"][None]), ValueError,
     r"parents must have 2 dimensions"),
    ("prefix_wrong_shape", lambda x: ops.build_tree(x["parents"], torch.zeros(3, dtype=torch.int64)), ValueError,
     r"prefix_lens must be a number or a tensor of shape \[2\]"),
    ("logits_2d", lambda x: _greedy(x, logits=x["logits"][0]), ValueError, r"logits must have 3 dimensions"),
    ("tokens_wrong_shape", lambda x: _greedy(x, tokens=x["tokens"][:, :4]), ValueError,
     r"tokens must have shape \[B, N\]"),
    ("parents_wrong_shape", lambda x: _greedy(x, parents=x["parents"][:1]), ValueError,
     r"parents must have shape \[B, N\]"),
    ("uniforms_wrong_shape", lambda x: _sampling(x, u=x["u"][:, :3]), ValueError,
     r"uniforms must have shape \[B, N\]"),
    ("draft_probs_wrong_shape", lambda x: _sampling(x, q=x["q"][:, :, :5]), ValueError,
     r"draft_probs must have shape \[B, N, V\]"),
    ("typical_uniforms_2d", lambda x: _typical(x, u1=x["u"]), ValueError, r"uniforms must have shape \[B\]"),
    ("parent_scores_wrong_shape", lambda x: ops.expand_tree_step(x["logits"], x["scores"][:, :2], 2, 2),
     ValueError, r"parent_scores must have shape \[B, F\]"),
    ("sample_logits_3d", lambda x: ops.sample_tokens(x["logits"], x["u"][:, 0]), ValueError,
     r"logits must have 2 dimensions"),
    ("sample_uniforms_wrong_shape", lambda x: ops.sample_tokens(x["logits"][0], x["u"][0, :2]), ValueError,
     r"uniforms must have shape \[B\]"),
    # dtypes
    ("int32_tokens", lambda x: _greedy(x, tokens=x["tokens"].int()), ValueError, r"tokens must be Long"),
    ("int32_parents", lambda x: ops.build_tree(x["parents"].int()), ValueError, r"parents must be Long"),
    ("float_parents_mask", lambda x: ops.tree_ancestor_mask(x["parents"].float()), ValueError,
     r"parents must be Long"),
    ("float64_logits", lambda x: _greedy(x, logits=x["logits"].double()), ValueError,
     r"logits must be float32, float16 or bfloat16, got Double"),
    ("int_logits_sample", lambda x: ops.sample_tokens(x["logits"][0].long(), x["u"][0]), ValueError,
     r"logits must be float32, float16 or bfloat16"),
    ("float64_uniforms", lambda x: _sampling(x, u=x["u"].double()), ValueError, r"uniforms must be Float"),
    ("float16_draft_probs", lambda x: _sampling(x, q=x["q"].half()), ValueError, r"draft_probs must be Float"),
    ("float64_parent_scores", lambda x: ops.expand_tree_step(x["logits"], x["scores"].double(), 2, 2),
     ValueError, r"parent_scores must be Float"),
    # layouts
    ("logits_vocab_stride", lambda x: _greedy(x, logits=torch.randn(B, N, 2 * V)[..., ::2]), ValueError,
     r"logits must have unit stride in its last dimension"),
    ("draft_probs_vocab_stride", lambda x: _sampling(x, q=torch.rand(B, N, 2 * V)[..., ::2]), ValueError,
     r"draft_probs must have unit stride in its last dimension"),
    ("sample_logits_vocab_stride", lambda x: ops.sample_tokens(x["logits"][:, 0].t().contiguous().t(),
                                                                x["u"][0]), ValueError,
     r"logits must have unit stride in its last dimension"),
    ("expand_logits_vocab_stride", lambda x: ops.expand_tree_step(x["logits"].transpose(1, 2).contiguous()
                                                                  .transpose(1, 2), x["scores"], 2, 2),
     ValueError, r"logits must have unit stride in its last dimension"),
    # empty tensors
    ("empty_batch_tree", lambda x: ops.build_tree(torch.empty(0, 4, dtype=torch.int64)), ValueError,
     r"parents must be non-empty"),
    ("empty_nodes_mask", lambda x: ops.tree_ancestor_mask(torch.empty(3, 0, dtype=torch.int64)), ValueError,
     r"parents must be non-empty"),
    ("empty_nodes_greedy", lambda x: ops.verify_tree_greedy(torch.empty(2, 0, V), torch.empty(2, 0).long(),
                                                            torch.empty(2, 0).long()), ValueError,
     r"logits must be non-empty"),
    ("empty_vocab_sampling", lambda x: _sampling({**x, "q": None}, logits=torch.empty(B, N, 0)), ValueError,
     r"logits must be non-empty"),
    ("empty_rows_sample", lambda x: ops.sample_tokens(torch.empty(0, V), torch.empty(0)), ValueError,
     r"logits must be non-empty"),
    ("empty_frontier_expand", lambda x: ops.expand_tree_step(torch.empty(B, 0, V), torch.empty(B, 0), 2, 1),
     ValueError, r"logits must be non-empty"),
    # ranges of non-tensor arguments
    ("expand_top_k_zero", lambda x: ops.expand_tree_step(x["logits"], x["scores"], 0, 1), ValueError,
     r"top_k must be in \[1, V = 11\], got 0"),
    ("expand_top_k_too_big", lambda x: ops.expand_tree_step(x["logits"], x["scores"], V + 1, 1), ValueError,
     r"top_k must be in \[1, V = 11\], got 12"),
    ("expand_num_select_zero", lambda x: ops.expand_tree_step(x["logits"], x["scores"], 2, 0), ValueError,
     r"num_select must be in \[1, F \* top_k = 10\], got 0"),
    ("expand_num_select_too_big", lambda x: ops.expand_tree_step(x["logits"], x["scores"], 2, 11), ValueError,
     r"num_select must be in \[1, F \* top_k = 10\], got 11"),
    ("typical_threshold_range", lambda x: _typical(x, thr=1.5), ValueError, r"posterior_threshold must be in"),
    ("typical_alpha_range", lambda x: _typical(x, alpha=-0.1), ValueError, r"posterior_alpha must be in"),
    # Python-level wrapper errors (_per_row)
    ("temperature_wrong_shape", lambda x: _sampling(x, temperature=torch.ones(3)), ValueError,
     r"temperature must be a number or a tensor of shape \[2\], got \(3,\)"),
    ("top_k_wrong_shape", lambda x: _sampling(x, top_k=torch.zeros(2, 1, dtype=torch.int64)), ValueError,
     r"top_k must be a number or a tensor of shape \[2\]"),
    ("top_p_bool", lambda x: _sampling(x, top_p=True), TypeError, r"top_p must be a number or a tensor, got bool"),
    ("temperature_str", lambda x: ops.sample_tokens(x["logits"][0], x["u"][0], temperature="1.0"), TypeError,
     r"temperature must be a number or a tensor, got str"),
    ("typical_temperature_shape", lambda x: _typical(x, temperature=torch.ones(5)), ValueError,
     r"temperature must be a number or a tensor of shape \[2\]"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_argument(case):
    _, fn, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        fn(_x())


def test_messages_name_the_op():
    with pytest.raises(ValueError, match=r"^verify_tree_sampling: draft_probs must be Float"):
        _sampling(_x(), q=_x()["q"].double())


def test_non_contiguous_index_tensors_are_made_contiguous():
    """Index and parameter tensors of any layout give the same result as their contiguous copies."""
    x = _x()
    strided = lambda t: torch.empty(*t.shape[::-1], dtype=t.dtype).t().copy_(t)  # noqa: E731  (transposed layout)
    p, t, u = strided(x["parents"]), strided(x["tokens"]), strided(x["u"])
    assert not (p.is_contiguous() or t.is_contiguous() or u.is_contiguous())
    for a, b in zip(ops.build_tree(p, torch.tensor([3, 4])[::1]), ops.build_tree(x["parents"], torch.tensor([3, 4]))):
        assert torch.equal(a, b)
    assert torch.equal(ops.tree_ancestor_mask(p, packed=True), ops.tree_ancestor_mask(x["parents"], packed=True))
    for a, b in zip(ops.verify_tree_greedy(x["logits"], t, p), _greedy(x)):
        assert torch.equal(a, b)
    params = dict(temperature=torch.tensor([0.7, 0.0, 1.0, 9.0])[::2], top_k=torch.tensor([3, 0, 0, 0])[::2],
                  top_p=torch.tensor([0.9, 0.0, 0.8, 0.0])[::2])
    a = ops.verify_tree_sampling(x["logits"], t, p, u, x["q"], **params)
    b = ops.verify_tree_sampling(x["logits"], x["tokens"], x["parents"], x["u"], x["q"],
                                 **{k: v.contiguous() for k, v in params.items()})
    for s, r in zip(a, b):
        assert torch.equal(s, r)
    u1 = x["u"][:, ::2][:, 1]  # stride 3
    assert not u1.is_contiguous()
    for s, r in zip(ops.sample_tokens(x["logits"][:, 0], u1, **params), ops.sample_tokens(
            x["logits"][:, 0], u1.contiguous(), **{k: v.contiguous() for k, v in params.items()})):
        assert torch.equal(s, r)


@pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")
@pytest.mark.parametrize("moved", ["tokens", "parents", "u", "q"])
def test_wrong_device(moved):
    x = _x("cuda")
    x[moved] = x[moved].cpu()
    name = {"u": "uniforms", "q": "draft_probs"}.get(moved, moved)
    with pytest.raises(ValueError, match=rf"{name} is on cpu but logits is on cuda"):
        _sampling(x, temperature=torch.ones(2, device="cuda"), top_k=torch.zeros(2, dtype=torch.long, device="cuda"),
                  top_p=torch.ones(2, device="cuda"))


@pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")
def test_wrong_device_prefix_and_params():
    x = _x("cuda")
    with pytest.raises(ValueError, match=r"prefix_lens is on cpu but parents is on cuda"):
        torch.ops.specdec_ext.build_tree(x["parents"], torch.zeros(2, dtype=torch.long), True)
    with pytest.raises(ValueError, match=r"temperature is on cpu but logits is on cuda"):
        torch.ops.specdec_ext.sample_tokens(x["logits"][:, 0], x["u"][:, 0].contiguous(), torch.ones(2),
                                            torch.zeros(2, dtype=torch.long, device="cuda"),
                                            torch.ones(2, device="cuda"), True)


def test_raw_op_dtype_of_parameters():
    """Calling torch.ops directly bypasses the wrappers' conversions: parameter dtypes are checked by name."""
    x = _x()
    with pytest.raises(ValueError, match=r"top_k must be Long"):
        torch.ops.specdec_ext.sample_tokens(x["logits"][:, 0], x["u"][:, 0].contiguous(), torch.ones(2),
                                            torch.zeros(2), torch.ones(2), True)
    with pytest.raises(ValueError, match=r"prefix_lens must be Long"):
        torch.ops.specdec_ext.build_tree(x["parents"], torch.zeros(2), True)
    with pytest.raises(ValueError, match=r"temperature must be Float"):
        torch.ops.specdec_ext.verify_tree_typical(x["logits"], x["tokens"], x["parents"], x["u"][:, 0].contiguous(),
                                                  torch.ones(2, dtype=torch.float64), 0.09, 0.3, True)


# ---------------------------------------------------------------------------------------------------------------
# Index and size arguments at the ends of int64 (issue 19: `self_column + S <= C` wrapped for self_column near
# 2^63 and the kernel wrote out of bounds). Data errors must be the reference's message, word for word.

I64_MAX, I64_MIN = 2**63 - 1, -2**63
EXTREMES = [I64_MAX, I64_MAX - 1, I64_MIN, I64_MIN + 1, -1]


def _same_error(device, op_fn, ref_fn, *args):
    """The op raises exactly the reference's ValueError for these (CPU) arguments."""
    message = expected_error(ref_fn, *args)
    assert_raises_exactly(message, op_fn, *(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
    return message


@pytest.mark.parametrize("prefix", [I64_MAX, I64_MAX - 3, I64_MIN, -1])
def test_build_tree_prefix_lens_out_of_range(device, prefix):
    parents = torch.tensor([[-1, 0, 1, 1, 0]])  # N = 5: prefix may be at most 2^63 - 5
    message = _same_error(device, torch.ops.specdec_ext.build_tree, ref.build_tree, parents, torch.tensor([prefix]),
                          True)
    assert f"prefix_lens[0] = {prefix} is out of range" in message


def test_build_tree_largest_prefix_fits(device):
    parents = torch.tensor([[-1, 0, 1, 2, 3]])  # a chain: the last position id is prefix + 4
    prefix = torch.tensor([I64_MAX - 4])
    got = ops.build_tree(parents.to(device), prefix.to(device))
    want = ref.build_tree(parents, prefix)
    assert torch.equal(got.position_ids.cpu(), want[1]) and int(got.position_ids.max()) == I64_MAX


@pytest.mark.parametrize("bad", EXTREMES)
def test_tree_and_token_indices_at_the_ends(device, bad):
    gen = make_gen(1)
    parents = torch.tensor([[-1, 0, 1, 0]])
    logits = torch.randn(1, 4, 6, generator=gen)
    bad_parents = parents.clone()
    bad_parents[0, 2] = bad
    _same_error(device, torch.ops.specdec_ext.build_tree, ref.build_tree, bad_parents, torch.zeros(1).long(), True)
    _same_error(device, torch.ops.specdec_ext.tree_ancestor_mask, ref.tree_ancestor_mask, bad_parents, False, True)
    tokens = torch.tensor([[0, 1, bad, 2]])
    _same_error(device, torch.ops.specdec_ext.verify_tree_greedy, ref.verify_tree_greedy, logits, tokens, parents,
                True)
    _same_error(device, torch.ops.specdec_ext.verify_tree_greedy, ref.verify_tree_greedy, logits,
                torch.tensor([[0, 1, 2, 3]]), bad_parents, True)


def _sampling_args(B=2, N=3, V=7, seed=2):
    gen = make_gen(seed)
    return dict(logits=torch.randn(B, N, V, generator=gen), tokens=torch.randint(0, V, (B, N), generator=gen),
                parents=torch.tensor([[-1, 0, 0]] * B), u=torch.rand(B, N, generator=gen),
                T=torch.full((B,), 0.8), k=torch.zeros(B, dtype=torch.long), p=torch.ones(B))


@pytest.mark.parametrize("top_k", [-1, -5, I64_MIN])
def test_negative_top_k_is_an_error_not_off(device, top_k):
    """generate refuses top_k < 0; so do the ops (it used to mean "no top-k")."""
    a = _sampling_args()
    a["k"][1] = top_k
    message = _same_error(device, torch.ops.specdec_ext.verify_tree_sampling, ref.verify_tree_sampling, a["logits"],
                          a["tokens"], a["parents"], None, a["u"], a["T"], a["k"], a["p"], True)
    assert message == f"verify_tree_sampling: top_k[1] = {top_k} must be >= 0 (0 = no top-k)"
    _same_error(device, torch.ops.specdec_ext.sample_tokens, ref.sample_tokens, a["logits"][:, 0], a["u"][:, 0],
                a["T"], a["k"], a["p"], True)


def test_top_k_int64_max_is_no_top_k(device):
    a = _sampling_args()
    big = ops.verify_tree_sampling(*on(device, a["logits"], a["tokens"], a["parents"], a["u"]), top_k=I64_MAX)
    off = ops.verify_tree_sampling(*on(device, a["logits"], a["tokens"], a["parents"], a["u"]), top_k=0)
    assert all(torch.equal(x, y) for x, y in zip(big, off))


@pytest.mark.parametrize("u", [1.0, 1.5, -1e-9, float("nan"), float("inf")])
def test_uniforms_outside_0_1_are_errors(device, u):
    """Uniforms are documented as [0, 1) (torch.rand): 1.0 used to be taken."""
    a = _sampling_args()
    a["u"][1, 2] = u
    message = _same_error(device, torch.ops.specdec_ext.verify_tree_sampling, ref.verify_tree_sampling, a["logits"],
                          a["tokens"], a["parents"], None, a["u"], a["T"], a["k"], a["p"], True)
    assert message == "verify_tree_sampling: uniforms[1, 2] must be in [0, 1) (a torch.rand draw)"
    u1 = a["u"][:, 2].contiguous()
    message = _same_error(device, torch.ops.specdec_ext.sample_tokens, ref.sample_tokens, a["logits"][:, 0], u1,
                          a["T"], a["k"], a["p"], True)
    assert message == "sample_tokens: uniforms[1] must be in [0, 1) (a torch.rand draw)"
    _same_error(device, torch.ops.specdec_ext.verify_tree_typical, ref.verify_tree_typical, a["logits"], a["tokens"],
                a["parents"], u1, a["T"], 0.09, 0.3, True)


@pytest.mark.parametrize("top_k, num_select", [(I64_MAX, 1), (I64_MIN, 1), (2, I64_MAX), (2, I64_MIN),
                                                (2**62, 2**62)])
def test_expand_tree_step_sizes_at_the_ends(top_k, num_select):
    a = _sampling_args()
    with pytest.raises(ValueError, match=r"expand_tree_step: (top_k|num_select) must be in \[1, "):
        ops.expand_tree_step(a["logits"], torch.zeros(2, 3), top_k, num_select)


@pytest.mark.parametrize("self_column", [I64_MAX, I64_MAX - 2, I64_MIN, -1, 11])
def test_advance_tree_frontier_self_column_at_the_ends(self_column):
    """The reported segfault: self_column + S wrapped below C for self_column near 2^63."""
    gen = make_gen(3)
    B, F, K, S, C, L = 2, 3, 2, 3, 13, 5
    args = (torch.randint(0, 50, (B, F, K), generator=gen), torch.randn(B, F, K, generator=gen),
            torch.tensor([[0, 5, 2], [1, 3, 4]]), torch.rand(B, F, C, generator=gen) < 0.5)
    with pytest.raises(ValueError, match=r"advance_tree_frontier: self_column must be in \[0, C - S\] = \[0, 10\]"):
        ops.advance_tree_frontier(*args, self_column, torch.randint(0, C, (B, L), generator=gen))


@pytest.mark.parametrize("bad", EXTREMES)
def test_advance_tree_frontier_indices_at_the_ends(device, bad):
    gen = make_gen(4)
    B, F, K, S, C, L = 2, 3, 2, 3, 13, 5
    cand = (torch.randint(0, 50, (B, F, K), generator=gen), torch.randn(B, F, K, generator=gen))
    selected, column = torch.tensor([[0, 5, 2], [1, 3, 4]]), torch.randint(0, C, (B, L), generator=gen)
    ancestors = torch.rand(B, F, C, generator=gen) < 0.5
    op, fn = torch.ops.specdec_ext.advance_tree_frontier, ref.advance_tree_frontier
    bad_selected = selected.clone()
    bad_selected[1, 1] = bad
    _same_error(device, op, fn, *cand, bad_selected, ancestors, 2, column, True)
    bad_column = column.clone()
    bad_column[0, 3] = bad
    _same_error(device, op, fn, *cand, selected, ancestors, 2, bad_column, True)


@pytest.mark.parametrize("bad", [b for b in EXTREMES if b != -1])  # (-1: a candidate under the root)
def test_select_tree_nodes_at_the_ends(device, bad):
    tokens, scores = torch.tensor([[5, 6, 7]]), torch.tensor([[-1.0, -2.0, -3.0]])
    parents, roots = torch.tensor([[-1, 0, bad]]), torch.tensor([9])
    _same_error(device, torch.ops.specdec_ext.select_tree_nodes, ref.select_tree_nodes, tokens, scores, parents,
                roots, 3, True)
    ok = torch.tensor([[-1, 0, 1]])
    got = ops.select_tree_nodes(*on(device, tokens, scores, ok, roots), I64_MAX)  # M = min(num_nodes, C)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, ref.select_tree_nodes(tokens, scores, ok, roots, I64_MAX)))
    with pytest.raises(ValueError, match=r"num_nodes must be >= 0"):
        ops.select_tree_nodes(tokens, scores, ok, roots, I64_MIN)


@pytest.mark.parametrize("prefix", [I64_MAX, I64_MAX - 1, I64_MIN, -1])
def test_tree_attention_prefix_at_the_ends(device, prefix):
    gen = make_gen(5)
    q, k = torch.randn(1, 2, 3, 64, generator=gen), torch.randn(1, 2, 8, 64, generator=gen)
    mask = ref.tree_ancestor_mask(torch.tensor([[-1, 0, 0]]))
    _same_error(device, torch.ops.specdec_ext.tree_attention, ref.tree_attention, q, k, k.clone(),
                torch.tensor([prefix]), mask, 0.125, True)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -float("inf")])
def test_tree_attention_scale_must_be_finite(scale):
    q, k = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match=r"tree_attention: scale must be a finite number"):
        ops.tree_attention(q, k, k, 0, ops.tree_ancestor_mask(torch.tensor([[-1, 0, 0]])), scale=scale)


@pytest.mark.parametrize("which, bad", [(w, b) for w in ("src", "dst", "len") for b in EXTREMES])
def test_compact_kv_indices_at_the_ends(device, which, bad):
    cache = torch.randn(2, 2, 6, 4)
    src, dst, n = torch.tensor([[3, 4], [5, 1]]), torch.tensor([0, 1]), torch.tensor([2, 2])
    {"src": lambda: src.__setitem__((1, 1), bad), "dst": lambda: dst.__setitem__(1, bad),
     "len": lambda: n.__setitem__(1, bad)}[which]()
    got = cache.clone().to(device)
    want = cache.clone()
    message = expected_error(ref.compact_kv, [want], src, dst, n, 2)
    assert_raises_exactly(message, torch.ops.specdec_ext.compact_kv, [got], *on(device, src, dst, n), 2, True)
    assert torch.equal(got[1].cpu(), cache[1])  # the bad row is untouched


@pytest.mark.parametrize("seq_dim", [I64_MAX, I64_MIN, 0, 4])
def test_compact_kv_seq_dim_at_the_ends(seq_dim):
    with pytest.raises(ValueError, match=r"seq_dim must be in \[1, 3\]"):
        ops.compact_kv([torch.zeros(2, 2, 6, 4)], torch.zeros(2, 1, dtype=torch.long), 0, 1, seq_dim)


def test_python_integers_beyond_int64_are_value_errors():
    a = _sampling_args()
    with pytest.raises(ValueError, match=r"top_k = 9223372036854775808 does not fit int64"):
        ops.verify_tree_sampling(a["logits"], a["tokens"], a["parents"], a["u"], top_k=2**63)
    with pytest.raises(ValueError, match=r"build_tree: prefix_lens = -9223372036854775809 does not fit int64"):
        ops.build_tree(a["parents"], -2**63 - 1)
    with pytest.raises(ValueError, match=r"num_select = 9223372036854775808 does not fit int64"):
        ops.expand_tree_step(a["logits"], torch.zeros(2, 3), 1, 2**63)
    with pytest.raises(ValueError, match=r"top_k must be an integer, got 2.5"):
        ops.sample_tokens(a["logits"][:, 0], a["u"][:, 0], top_k=2.5)
    with pytest.raises(ValueError, match=r"prefix_lens must be an integer tensor, got torch.float32"):
        ops.build_tree(a["parents"], torch.tensor([1.5, 2.0]))
