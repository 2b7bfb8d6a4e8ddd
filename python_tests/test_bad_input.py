"""Malformed arguments (shapes, dtypes, devices, layouts, ranges): a clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

from helpers import CUDA_SKIP_REASON, make_gen, ops, random_parents, random_tokens

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
    ("parents_1d", lambda x: ops.build_tree(x["parents"][0]), ValueError, r"build_tree: parents must have 2 dimensions"),
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
