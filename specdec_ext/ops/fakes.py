"""Fake (meta) implementations: output shapes and dtypes of every op, for torch.compile and opcheck.

The dispatcher also runs these for real tensors when any argument is on the meta device (Meta outranks CPU and
CUDA), so each fake first checks that all its tensors share one device: a meta tensor among CPU ones would
otherwise return fresh uninitialised tensors as results. The error is the C++ glue's (csrc/ops/checks.h).
"""

from __future__ import annotations

import torch


def _one_device(op: str, **tensors) -> None:
    """All given tensors (None skipped; lists: each element) on the device of the first one, else ValueError."""
    ref_name = ref = None
    for name, t in tensors.items():
        items = [(f"{name}[{i}]", x) for i, x in enumerate(t)] if isinstance(t, (list, tuple)) else [(name, t)]
        for item_name, x in items:
            if x is None:
                continue
            if ref is None:
                ref_name, ref = item_name, x
            elif x.device != ref.device:
                raise ValueError(f"{op}: {item_name} is on {x.device} but {ref_name} is on {ref.device}; all tensors "
                                 "must be on one device")


_DTYPE_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.bool: "Bool", torch.float32: "Float"}


def _expect(op: str, name: str, t: torch.Tensor, dim: int, layout: str, dtype: torch.dtype | None = None) -> None:
    """The glue's rank and dtype checks (csrc/ops/checks.h), for calls whose tensors are all meta: the fake is then
    the only code that sees them, and must refuse what the kernels refuse."""
    if t.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D {layout}, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {_DTYPE_NAMES.get(dtype, dtype)}, got {t.dtype}")


def _long(like: torch.Tensor, *shape: int) -> torch.Tensor:
    return like.new_empty(shape, dtype=torch.int64)


@torch.library.register_fake("specdec_ext::build_tree")
def _build_tree(parents, prefix_lens, validate=True):
    _one_device("build_tree", parents=parents, prefix_lens=prefix_lens)
    B, N = parents.shape
    return (_long(parents, B, N), _long(parents, B, N), _long(parents, B, N), _long(parents, B, N),
            _long(parents, B, N, N), _long(parents, B))


@torch.library.register_fake("specdec_ext::tree_ancestor_mask")
def _tree_ancestor_mask(parents, packed=False, validate=True):
    _expect("tree_ancestor_mask", "parents", parents, 2, "[B, N]", torch.int64)
    B, N = parents.shape
    if packed:
        return parents.new_empty((B, N, (N + 31) // 32), dtype=torch.int32)
    return parents.new_empty((B, N, N), dtype=torch.bool)


def _verification(logits):
    B, N = logits.shape[0], logits.shape[1]
    return _long(logits, B, N), _long(logits, B), _long(logits, B)


@torch.library.register_fake("specdec_ext::verify_tree_greedy")
def _verify_tree_greedy(logits, tokens, parents, validate=True):
    _one_device("verify_tree_greedy", logits=logits, tokens=tokens, parents=parents)
    return _verification(logits)


@torch.library.register_fake("specdec_ext::verify_tree_sampling")
def _verify_tree_sampling(logits, tokens, parents, draft_probs, uniforms, temperature, top_k, top_p, validate=True):
    _one_device("verify_tree_sampling", logits=logits, tokens=tokens, parents=parents, draft_probs=draft_probs,
                uniforms=uniforms, temperature=temperature, top_k=top_k, top_p=top_p)
    return _verification(logits)


@torch.library.register_fake("specdec_ext::verify_tree_typical")
def _verify_tree_typical(logits, tokens, parents, uniforms, temperature, posterior_threshold, posterior_alpha,
                         validate=True):
    _one_device("verify_tree_typical", logits=logits, tokens=tokens, parents=parents, uniforms=uniforms,
                temperature=temperature)
    return _verification(logits)


@torch.library.register_fake("specdec_ext::sample_tokens")
def _sample_tokens(logits, uniforms, temperature, top_k, top_p, validate=True):
    _one_device("sample_tokens", logits=logits, uniforms=uniforms, temperature=temperature, top_k=top_k,
                top_p=top_p)
    R, V = logits.shape
    return _long(logits, R), logits.new_empty((R, V), dtype=torch.float32)


@torch.library.register_fake("specdec_ext::expand_tree_step")
def _expand_tree_step(logits, parent_scores, top_k, num_select, validate=True):
    _one_device("expand_tree_step", logits=logits, parent_scores=parent_scores)
    B, F = logits.shape[0], logits.shape[1]
    return (_long(logits, B, F, top_k), logits.new_empty((B, F, top_k), dtype=torch.float32),
            _long(logits, B, num_select))


@torch.library.register_fake("specdec_ext::tree_attention")
def _tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale, validate=True):
    _one_device("tree_attention", q=q, k_cache=k_cache, v_cache=v_cache, prefix_lens=prefix_lens,
                tree_mask=tree_mask)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("specdec_ext::compact_kv")
def _compact_kv(caches, src_positions, dst_start, lengths, seq_dim, validate=True):
    _one_device("compact_kv", caches=caches, src_positions=src_positions, dst_start=dst_start, lengths=lengths)
    return None


def _packed_linear_shape(dtype, N: int, K: int) -> tuple[int, int, int, int]:
    P = 1 if dtype == torch.float32 else 2
    return (N + 31) // 32, (K + P - 1) // P, 32, P


@torch.library.register_fake("specdec_ext::pack_linear_weight")
def _pack_linear_weight(weight):
    _expect("pack_linear_weight", "weight", weight, 2, "[out_features, in_features]")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"pack_linear_weight: weight must be a floating tensor, got {weight.dtype}")
    N, K = weight.shape
    return weight.new_empty(_packed_linear_shape(weight.dtype, N, K))


@torch.library.register_fake("specdec_ext::packed_linear")
def _packed_linear(x, packed_weight, bias, out_features):
    _one_device("packed_linear", x=x, packed_weight=packed_weight, bias=bias)
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("specdec_ext::draft_decoder_layer")
def _draft_decoder_layer(x, input_norm_weight, input_norm_segments, residual, qkv_weight, qkv_bias, o_weight,
                         norm_weight, gate_up_weight, down_weight, position_ids, inv_freq, k_cache, v_cache,
                         write_slots, mask, num_heads, intermediate_size, eps, validate=True):
    _one_device("draft_decoder_layer", x=x, input_norm_weight=input_norm_weight, residual=residual,
                qkv_weight=qkv_weight, qkv_bias=qkv_bias, o_weight=o_weight, norm_weight=norm_weight,
                gate_up_weight=gate_up_weight, down_weight=down_weight, position_ids=position_ids,
                inv_freq=inv_freq, k_cache=k_cache, v_cache=v_cache, write_slots=write_slots, mask=mask)
    return residual.new_empty(residual.shape)


@torch.library.register_fake("specdec_ext::advance_tree_frontier")
def _advance_tree_frontier(cand_tokens, cand_scores, selected, ancestors, self_column, column, validate=True):
    _one_device("advance_tree_frontier", cand_tokens=cand_tokens, cand_scores=cand_scores, selected=selected,
                ancestors=ancestors, column=column)
    op = "advance_tree_frontier"
    _expect(op, "cand_tokens", cand_tokens, 3, "[B, F, K]", torch.int64)
    _expect(op, "cand_scores", cand_scores, 3, "[B, F, K]", torch.float32)
    _expect(op, "selected", selected, 2, "[B, S]", torch.int64)
    _expect(op, "ancestors", ancestors, 3, "[B, F, C]", torch.bool)
    _expect(op, "column", column, 2, "[B, L]", torch.int64)
    B, S = selected.shape
    C, L = ancestors.shape[-1], column.shape[-1]
    return (_long(selected, B, S), cand_scores.new_empty((B, S)), _long(selected, B, S),
            ancestors.new_empty((B, S, C)), ancestors.new_empty((B, S, L)))


@torch.library.register_fake("specdec_ext::select_tree_nodes")
def _select_tree_nodes(tokens, scores, parents, roots, num_nodes, validate=True):
    _one_device("select_tree_nodes", tokens=tokens, scores=scores, parents=parents, roots=roots)
    B, C = tokens.shape
    M = min(num_nodes, C)
    return _long(tokens, B, M + 1), _long(tokens, B, M + 1)
