// Glue of the attention-side ops (included by op_glue.h): tree_attention and compact_kv. Same pattern as the
// other ops: checks (checks.h), output / workspace allocation, dtype dispatch, Backend call, status report.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../kernels/common/dtype.h"
#include "../kernels/common/params.h"
#include "checks.h"

namespace specdec::glue {

// A K/V cache [B, Hkv, S, D] of q's dtype and device, unit stride in D.
inline void check_kv_cache(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  check_dim(op, name, t, 4, "[B, Hkv, S, D]");
  SPECDEC_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype ", q.scalar_type(), ", got ",
                t.scalar_type());
  check_same_device(op, name, t, q, "q");
  check_unit_last_stride(op, name, t);
}

template <class Backend>
at::Tensor tree_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& prefix_lens_in, const at::Tensor& tree_mask_in, double scale,
                               bool validate) {
  constexpr const char* op = "tree_attention";
  check_dim(op, "q", q, 4, "[B, H, N, D]");
  check_float(op, "q", q);
  check_unit_last_stride(op, "q", q);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  SPECDEC_CHECK(B >= 1 && H >= 1 && N >= 1, op, ": q must be non-empty [B, H, N, D], got ", shape_str(q));
  SPECDEC_CHECK(tree_attention_head_dim_supported(D), op, ": head dim D = ", D,
                " is not supported (supported: 64, 80, 96, 128, 256)");
  check_kv_cache(op, "k_cache", k_cache, q);
  check_kv_cache(op, "v_cache", v_cache, q);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  SPECDEC_CHECK(k_cache.size(0) == B && k_cache.size(3) == D && Hkv >= 1, op,
                ": k_cache must have shape [B, Hkv, S, D] with q's B = ", B, " and D = ", D, ", got ",
                shape_str(k_cache));
  SPECDEC_CHECK(v_cache.sizes().equals(k_cache.sizes()), op, ": v_cache must have k_cache's shape ",
                shape_str(k_cache), ", got ", shape_str(v_cache));
  SPECDEC_CHECK(H % Hkv == 0, op, ": the number of query heads H = ", H,
                " must be a multiple of the number of key/value heads Hkv = ", Hkv);
  SPECDEC_CHECK(S >= N, op, ": the cache holds S = ", S, " positions, fewer than the N = ", N,
                " tree nodes it must hold after the prefix");
  SPECDEC_CHECK(std::isfinite(scale), op, ": scale must be a finite number, got ", scale);
  const at::Tensor prefix_lens = checked_row_vector(op, "prefix_lens", prefix_lens_in, B, at::kLong, q, "q");
  check_same_device(op, "tree_mask", tree_mask_in, q, "q");
  const bool packed = tree_mask_in.scalar_type() == at::kInt;
  SPECDEC_CHECK(packed || tree_mask_in.scalar_type() == at::kBool, op,
                ": tree_mask must be bool [B, N, N] (dense) or int32 [B, N, ceil(N/32)] (bit-packed), got ",
                tree_mask_in.scalar_type());
  if (packed) {
    check_shape(op, "tree_mask", tree_mask_in, {B, N, packed_mask_words(N)}, "[B, N, ceil(N/32)]");
  } else {
    check_shape(op, "tree_mask", tree_mask_in, {B, N, N}, "[B, N, N]");
  }
  const at::Tensor tree_mask = tree_mask_in.contiguous();
  c10::OptionalDeviceGuard guard(q.device());
  at::Tensor out = at::empty({B, H, N, D}, q.options());
  const int64_t ws_floats = Backend::tree_attention_workspace_floats(B, H, Hkv, N, D, S);
  at::Tensor workspace;
  if (ws_floats > 0) workspace = at::empty({ws_floats}, q.options().dtype(at::kFloat));
  at::Tensor status = new_status(B, q);
  SPECDEC_DISPATCH_FLOAT(q.scalar_type(), op, [&] {
    TreeAttentionParams<scalar_t> p{.q = float_ptr<scalar_t>(q),
                                    .q_stride_b = q.stride(0),
                                    .q_stride_h = q.stride(1),
                                    .q_stride_n = q.stride(2),
                                    .k = float_ptr<scalar_t>(k_cache),
                                    .k_stride_b = k_cache.stride(0),
                                    .k_stride_h = k_cache.stride(1),
                                    .k_stride_s = k_cache.stride(2),
                                    .v = float_ptr<scalar_t>(v_cache),
                                    .v_stride_b = v_cache.stride(0),
                                    .v_stride_h = v_cache.stride(1),
                                    .v_stride_s = v_cache.stride(2),
                                    .prefix_lens = const_data<int64_t>(prefix_lens),
                                    .mask_dense = packed ? nullptr : const_data<bool>(tree_mask),
                                    .mask_packed = packed ? const_data<int32_t>(tree_mask) : nullptr,
                                    .batch = B,
                                    .num_heads = H,
                                    .num_kv_heads = Hkv,
                                    .num_nodes = N,
                                    .num_tree_keys = N,
                                    .head_dim = D,
                                    .seq_len = S,
                                    .scale = static_cast<float>(scale),
                                    .out = reinterpret_cast<scalar_t*>(mutable_data(out)),
                                    .workspace = workspace.defined() ? mutable_data<float>(workspace) : nullptr,
                                    .workspace_floats = ws_floats,
                                    .status = status_ptr(status)};
    Backend::tree_attention(p);
  });
  if (validate) raise_on_bad_status(op, status);
  return out;
}

// No two caches share memory: the same tensor twice (or overlapping views) would be moved twice, the second
// move reading rows the first already wrote. Spans sorted by (space, start): one overlaps an earlier one of its
// space iff it starts before the furthest end so far in that space.
inline void check_caches_disjoint(const char* op, at::TensorList caches) {
  std::vector<std::pair<std::tuple<const void*, uintptr_t, uintptr_t>, size_t>> spans;
  for (size_t c = 0; c < caches.size(); ++c) {
    const auto s = memory_span(caches[c]);
    spans.push_back({{s.space, s.first, s.last}, c});
  }
  std::sort(spans.begin(), spans.end());
  const void* space = nullptr;
  uintptr_t end = 0;
  size_t owner = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const auto [at, first, last] = spans[i].first;
    if (first == last) continue;  // (empty caches hold nothing)
    if (at != space) {  // (a new space: nothing before it can overlap)
      space = at;
      end = 0;
    }
    if (end > first) {
      const size_t a = std::min(owner, spans[i].second), b = std::max(owner, spans[i].second);
      SPECDEC_CHECK(false, op, ": caches[", a, "] and caches[", b, "] share memory (the same tensor, or overlapping "
                    "views of one storage); every cache is moved in place once, so they must be distinct");
    }
    if (last > end) {
      end = last;
      owner = spans[i].second;
    }
  }
}

template <class Backend>
void compact_kv_impl(at::TensorList caches, const at::Tensor& src_positions_in, const at::Tensor& dst_start_in,
                     const at::Tensor& lengths_in, int64_t seq_dim, bool validate) {
  constexpr const char* op = "compact_kv";
  SPECDEC_CHECK(!caches.empty(), op, ": caches must hold at least one tensor");
  const at::Tensor& c0 = caches[0];
  SPECDEC_CHECK(c0.dim() >= 2, op, ": caches[0] must have at least 2 dimensions [B, ..., S, ...], got shape ",
                shape_str(c0));
  SPECDEC_CHECK(seq_dim >= 1 && seq_dim < c0.dim(), op, ": seq_dim must be in [1, ", c0.dim() - 1, "], got ", seq_dim);
  SPECDEC_CHECK(c0.is_floating_point(), op, ": caches must be floating point tensors, got ", c0.scalar_type());
  for (size_t c = 0; c < caches.size(); ++c) {
    const at::Tensor& t = caches[c];
    SPECDEC_CHECK(t.sizes().equals(c0.sizes()) && t.scalar_type() == c0.scalar_type() && t.device() == c0.device(),
                  op, ": every cache must have caches[0]'s shape ", shape_str(c0), ", dtype ", c0.scalar_type(),
                  " and device ", c0.device(), "; caches[", c, "] has ", shape_str(t), ", ", t.scalar_type(), ", ",
                  t.device());
    SPECDEC_CHECK(t.is_contiguous(), op, ": caches[", c, "] must be contiguous");
  }
  check_caches_disjoint(op, caches);
  const int64_t B = c0.size(0), S = c0.size(seq_dim);
  SPECDEC_CHECK(B >= 1, op, ": caches must have B >= 1 rows, got shape ", shape_str(c0));
  check_dtype(op, "src_positions", src_positions_in, at::kLong);
  check_same_device(op, "src_positions", src_positions_in, c0, "caches");
  check_dim(op, "src_positions", src_positions_in, 2, "[B, L]");
  SPECDEC_CHECK(src_positions_in.size(0) == B, op, ": src_positions must have shape [B, L] with B = ", B, ", got ",
                shape_str(src_positions_in));
  const int64_t L = src_positions_in.size(1);
  SPECDEC_CHECK(L <= 32768, op, ": src_positions may hold at most 32768 positions per row (L), got ", L);
  const at::Tensor src_positions = src_positions_in.contiguous();
  const at::Tensor dst_start = checked_row_vector(op, "dst_start", dst_start_in, B, at::kLong, c0, "caches");
  const at::Tensor lengths = checked_row_vector(op, "lengths", lengths_in, B, at::kLong, c0, "caches");
  for (size_t c = 0; c < caches.size(); ++c) {
    const std::string name = "caches[" + std::to_string(c) + "]";
    check_no_overlap(op, name.c_str(), caches[c], "src_positions", src_positions_in);
    check_no_overlap(op, name.c_str(), caches[c], "dst_start", dst_start_in);
    check_no_overlap(op, name.c_str(), caches[c], "lengths", lengths_in);
  }
  int64_t outer = 1, inner = 1;
  for (int64_t d = 1; d < seq_dim; ++d) outer *= c0.size(d);
  for (int64_t d = seq_dim + 1; d < c0.dim(); ++d) inner *= c0.size(d);
  c10::OptionalDeviceGuard guard(c0.device());
  at::Tensor status = new_status(B, c0);
  const int64_t n = static_cast<int64_t>(caches.size());
  for (int64_t first = 0; first < n; first += CompactKvParams::kMaxCaches) {
    CompactKvParams p{};
    p.num_caches = std::min<int64_t>(CompactKvParams::kMaxCaches, n - first);
    for (int64_t c = 0; c < p.num_caches; ++c) p.caches[c] = mutable_data(caches[first + c]);
    p.batch = B;
    p.outer = outer;
    p.seq_len = S;
    p.inner_bytes = inner * static_cast<int64_t>(c0.element_size());
    p.src_positions = const_data<int64_t>(src_positions);
    p.max_len = L;
    p.dst_start = const_data<int64_t>(dst_start);
    p.lengths = const_data<int64_t>(lengths);
    p.write_status = first == 0;
    p.status = status_ptr(status);
    Backend::compact_kv(p);
  }
  if (validate) raise_on_bad_status(op, status);
}

}  // namespace specdec::glue
