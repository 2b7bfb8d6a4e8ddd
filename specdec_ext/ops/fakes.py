"""Fake (meta) implementations: output shapes and dtypes of every op, for torch.compile and opcheck.

The dispatcher also runs these for real tensors when any argument is on the meta device (Meta outranks CPU and
CUDA), where they are the only code that sees the call. So each fake first runs the C++ glue's own argument checks
(``_checks``: the op of the same name in the ``specdec_ext_checks`` library, csrc/ops/ops_meta.cpp): a meta call is
refused exactly where a CPU or CUDA call is, with the same message, and meta mixed with other devices fails the
glue's same-device checks instead of returning fresh uninitialised tensors as results.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor


def _checks(op: str, *args) -> None:
    """The glue's own argument checks for this call (csrc/ops/ops_meta.cpp, the ``specdec_ext_checks`` library):
    shapes, dtypes, devices and scalars, with the CPU and CUDA backends' error texts. For meta tensors only: under
    torch.compile the fakes see FakeTensors, whose shapes may be symbolic and whose (absent) data the C++ glue cannot
    even point at; their real inputs meet the same checks when the compiled code runs."""
    tensors = [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(x, torch.Tensor)]
    if not any(isinstance(t, FakeTensor) for t in tensors):
        getattr(torch.ops.specdec_ext_checks, op)(*args)


def _long(like: torch.Tensor, *shape: int) -> torch.Tensor:
    return like.new_empty(shape, dtype=torch.int64)


@torch.library.register_fake("specdec_ext::build_tree")
def _build_tree(parents, prefix_lens, validate=True):
    _checks("build_tree", parents, prefix_lens, validate)
    B, N = parents.shape
    return (_long(parents, B, N), _long(parents, B, N), _long(parents, B, N), _long(parents, B, N),
            _long(parents, B, N, N), _long(parents, B))


@torch.library.register_fake("specdec_ext::tree_ancestor_mask")
def _tree_ancestor_mask(parents, packed=False, validate=True):
    _checks("tree_ancestor_mask", parents, packed, validate)
    B, N = parents.shape
    if packed:
        return parents.new_empty((B, N, (N + 31) // 32), dtype=torch.int32)
    return parents.new_empty((B, N, N), dtype=torch.bool)


def _verification(logits):
    B, N = logits.shape[0], logits.shape[1]
    return _long(logits, B, N), _long(logits, B), _long(logits, B)


@torch.library.register_fake("specdec_ext::verify_tree_greedy")
def _verify_tree_greedy(logits, tokens, parents, validate=True):
    _checks("verify_tree_greedy", logits, tokens, parents, validate)
    return _verification(logits)


@torch.library.register_fake("specdec_ext::verify_tree_sampling")
def _verify_tree_sampling(logits, tokens, parents, draft_probs, uniforms, temperature, top_k, top_p, validate=True):
    _checks("verify_tree_sampling", logits, tokens, parents, draft_probs, uniforms, temperature, top_k, top_p,
            validate)
    return _verification(logits)


@torch.library.register_fake("specdec_ext::verify_tree_typical")
def _verify_tree_typical(logits, tokens, parents, uniforms, temperature, posterior_threshold, posterior_alpha,
                         validate=True):
    _checks("verify_tree_typical", logits, tokens, parents, uniforms, temperature, posterior_threshold,
            posterior_alpha, validate)
    return _verification(logits)


@torch.library.register_fake("specdec_ext::sample_tokens")
def _sample_tokens(logits, uniforms, temperature, top_k, top_p, validate=True):
    _checks("sample_tokens", logits, uniforms, temperature, top_k, top_p, validate)
    R, V = logits.shape
    return _long(logits, R), logits.new_empty((R, V), dtype=torch.float32)


@torch.library.register_fake("specdec_ext::expand_tree_step")
def _expand_tree_step(logits, parent_scores, top_k, num_select, validate=True):
    _checks("expand_tree_step", logits, parent_scores, top_k, num_select, validate)
    B, F = logits.shape[0], logits.shape[1]
    return (_long(logits, B, F, top_k), logits.new_empty((B, F, top_k), dtype=torch.float32),
            _long(logits, B, num_select))


@torch.library.register_fake("specdec_ext::tree_attention")
def _tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale, validate=True):
    _checks("tree_attention", q, k_cache, v_cache, prefix_lens, tree_mask, scale, validate)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("specdec_ext::compact_kv")
def _compact_kv(caches, src_positions, dst_start, lengths, seq_dim, validate=True):
    _checks("compact_kv", caches, src_positions, dst_start, lengths, seq_dim, validate)
    return None


def _packed_linear_shape(dtype, N: int, K: int) -> tuple[int, int, int, int]:
    P = 1 if dtype == torch.float32 else 2
    return (N + 31) // 32, (K + P - 1) // P, 32, P


@torch.library.register_fake("specdec_ext::pack_linear_weight")
def _pack_linear_weight(weight):
    _checks("pack_linear_weight", weight)
    N, K = weight.shape
    return weight.new_empty(_packed_linear_shape(weight.dtype, N, K))


@torch.library.register_fake("specdec_ext::packed_linear")
def _packed_linear(x, packed_weight, bias, out_features):
    _checks("packed_linear", x, packed_weight, bias, out_features)
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("specdec_ext::pack_linear_weight_int8")
def _pack_linear_weight_int8(weight):
    _checks("pack_linear_weight_int8", weight)
    N, K = weight.shape
    return (weight.new_empty(((N + 31) // 32, (K + 3) // 4, 32, 4), dtype=torch.int8),
            weight.new_empty((N,), dtype=torch.float32))


@torch.library.register_fake("specdec_ext::packed_linear_int8")
def _packed_linear_int8(x, packed_weight, scales, bias):
    _checks("packed_linear_int8", x, packed_weight, scales, bias)
    return x.new_empty((*x.shape[:-1], scales.shape[0]))


@torch.library.register_fake("specdec_ext::pack_linear_weight_int4")
def _pack_linear_weight_int4(weight):
    _checks("pack_linear_weight_int4", weight)
    N, K = weight.shape
    NP, G = (N + 31) // 32, (K + 31) // 32
    return (weight.new_empty((NP, 4 * G, 32, 4), dtype=torch.uint8),
            weight.new_empty((NP, G, 32), dtype=torch.uint8), weight.new_empty((N,), dtype=torch.float32))


@torch.library.register_fake("specdec_ext::packed_linear_int4")
def _packed_linear_int4(x, packed_weight, group_scales, scales, bias):
    _checks("packed_linear_int4", x, packed_weight, group_scales, scales, bias)
    return x.new_empty((*x.shape[:-1], scales.shape[0]))


@torch.library.register_fake("specdec_ext::draft_decoder_layer")
def _draft_decoder_layer(x, input_norm_weight, input_norm_segments, residual, qkv_weight, qkv_bias, o_weight,
                         norm_weight, gate_up_weight, down_weight, position_ids, inv_freq, k_cache, v_cache,
                         write_slots, mask, num_heads, intermediate_size, eps, qkv_scales=None, o_scales=None,
                         gate_up_scales=None, down_scales=None, qkv_group_scales=None, o_group_scales=None,
                         gate_up_group_scales=None, down_group_scales=None, validate=True):
    _checks("draft_decoder_layer", x, input_norm_weight, input_norm_segments, residual, qkv_weight, qkv_bias,
            o_weight, norm_weight, gate_up_weight, down_weight, position_ids, inv_freq, k_cache, v_cache,
            write_slots, mask, num_heads, intermediate_size, eps, qkv_scales, o_scales, gate_up_scales, down_scales,
            qkv_group_scales, o_group_scales, gate_up_group_scales, down_group_scales, validate)
    return residual.new_empty(residual.shape)


@torch.library.register_fake("specdec_ext::advance_tree_frontier")
def _advance_tree_frontier(cand_tokens, cand_scores, selected, ancestors, self_column, column, validate=True):
    _checks("advance_tree_frontier", cand_tokens, cand_scores, selected, ancestors, self_column, column, validate)
    B, S = selected.shape
    C, L = ancestors.shape[-1], column.shape[-1]
    return (_long(selected, B, S), cand_scores.new_empty((B, S)), _long(selected, B, S),
            ancestors.new_empty((B, S, C)), ancestors.new_empty((B, S, L)))


@torch.library.register_fake("specdec_ext::select_tree_nodes")
def _select_tree_nodes(tokens, scores, parents, roots, num_nodes, validate=True):
    _checks("select_tree_nodes", tokens, scores, parents, roots, num_nodes, validate)
    B, C = tokens.shape
    M = min(num_nodes, C)
    return _long(tokens, B, M + 1), _long(tokens, B, M + 1)


# The recurrent tree ops (csrc/ops/op_glue_recurrent.h).


@torch.library.register_fake("specdec_ext::tree_linear_attention")
def _tree_linear_attention(q, k, v, state, log_decay, parents, validate=True):
    _checks("tree_linear_attention", q, k, v, state, log_decay, parents, validate)
    return q.new_empty((*q.shape[:3], v.shape[-1]))


@torch.library.register_fake("specdec_ext::commit_linear_state")
def _commit_linear_state(state, k, v, log_decay, path, lengths, validate=True):
    _checks("commit_linear_state", state, k, v, log_decay, path, lengths, validate)
    return None


@torch.library.register_fake("specdec_ext::tree_causal_conv1d")
def _tree_causal_conv1d(x, conv_state, weight, bias, parents, activation=None, validate=True):
    _checks("tree_causal_conv1d", x, conv_state, weight, bias, parents, activation, validate)
    return x.new_empty(x.shape)


@torch.library.register_fake("specdec_ext::commit_conv_state")
def _commit_conv_state(conv_state, x, path, lengths, validate=True):
    _checks("commit_conv_state", conv_state, x, path, lengths, validate)
    return None


@torch.library.register_fake("specdec_ext::tree_gated_delta_rule")
def _tree_gated_delta_rule(q, k, v, g, beta, state, parents, validate=True):
    _checks("tree_gated_delta_rule", q, k, v, g, beta, state, parents, validate)
    return v.new_empty(v.shape)


@torch.library.register_fake("specdec_ext::commit_gated_delta_state")
def _commit_gated_delta_state(state, k, v, g, beta, path, lengths, validate=True):
    _checks("commit_gated_delta_state", state, k, v, g, beta, path, lengths, validate)
    return None


@torch.library.register_fake("specdec_ext::tree_selective_state")
def _tree_selective_state(x, dt, A, Bm, Cm, D, state, parents, validate=True):
    _checks("tree_selective_state", x, dt, A, Bm, Cm, D, state, parents, validate)
    return x.new_empty(x.shape)


@torch.library.register_fake("specdec_ext::commit_selective_state")
def _commit_selective_state(state, x, dt, A, Bm, path, lengths, validate=True):
    _checks("commit_selective_state", state, x, dt, A, Bm, path, lengths, validate)
    return None
