// Glue of draft_decoder_layer (included by op_glue.h): checks, one workspace for the stages' buffers, dtype
// dispatch, Backend call (Backend::draft_decoder_layer runs the stages of DraftLayerParams in order), status report.
// Each of the four weights is float (pack_linear_weight), int8 (pack_linear_weight_int8, with its scales) or int4
// (pack_linear_weight_int4, with its scales and group scales).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <optional>
#include <utility>
#include <vector>

#include "../kernels/common/dtype.h"
#include "../kernels/common/params.h"
#include "checks.h"

namespace specdec::glue {

// A packed weight for out_features x in_features of x's dtype and device (pack_linear_weight's output).
inline void check_packed_weight(const char* op, const char* name, const at::Tensor& w, const at::Tensor& x,
                                int64_t N, int64_t K, const char* what) {
  SPECDEC_CHECK(w.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ", x.scalar_type(),
                ", got ", w.scalar_type());
  check_same_device(op, name, w, x, "x");
  const std::vector<int64_t> want = packed_linear_shape(op, x.scalar_type(), N, K);
  SPECDEC_CHECK(w.sizes().equals(want) && w.is_contiguous(), op, ": ", name,
                " must be pack_linear_weight's output for ", what, " = [", N, ", ", K, "], of shape ",
                at::IntArrayRef(want), ", got ", shape_str(w), w.is_contiguous() ? "" : " (not contiguous)");
  check_packed_rows(op, name, w, N, std::string("the first dimension of ") + what);
}

// One product's checked weight: pack_linear_weight's output (scales undefined), pack_linear_weight_int8's with its
// scales, or pack_linear_weight_int4's with its scales and group scales (contiguous).
struct LayerWeight {
  at::Tensor packed, scales, group_scales;
  template <typename U>
  DraftLayerWeight<U> operand() const {
    if (!scales.defined()) return {.packed = float_ptr<U>(packed)};
    if (!group_scales.defined())
      return {.packed_int8 = const_data<int8_t>(packed), .scales = const_data<float>(scales)};
    return {.packed_int4 = const_data<uint8_t>(packed), .group_scales = const_data<uint8_t>(group_scales),
            .scales = const_data<float>(scales)};
  }
};

// A weight for out_features x in_features: pack_linear_weight's output of x's dtype; with `scales`
// pack_linear_weight_int8's (int8, with float32 [N] scales); with `scales` and `group_scales`
// pack_linear_weight_int4's, for in_features of whole groups of 32 (the layer quantises its rows unpadded).
inline LayerWeight checked_layer_weight(const char* op, const char* name, const char* scales_name,
                                        const char* group_scales_name, const at::Tensor& w,
                                        const std::optional<at::Tensor>& scales,
                                        const std::optional<at::Tensor>& group_scales, const at::Tensor& x,
                                        int64_t N, int64_t K, const char* what) {
  if (!scales.has_value()) {
    SPECDEC_CHECK(!group_scales.has_value(), op, ": ", group_scales_name, " is given without ", scales_name,
                  " (an int4 weight needs both)");
    check_packed_weight(op, name, w, x, N, K, what);
    return {w, at::Tensor(), at::Tensor()};
  }
  const bool int4 = group_scales.has_value();
  const std::string in_features = std::string("the in_features of ") + what;
  if (int4) {
    check_int4_in_features(op, in_features.c_str(), K);
    SPECDEC_CHECK(K % kLinearInt4Group == 0, op, ": ", in_features, " must be a multiple of ", kLinearInt4Group,
                  " for an int4 weight (", name, " with ", group_scales_name, "), got ", K);
  } else {
    check_int8_in_features(op, in_features.c_str(), K);
  }
  check_dtype(op, name, w, int4 ? at::kByte : at::kChar);
  check_same_device(op, name, w, x, "x");
  const std::vector<int64_t> want = int4 ? packed_linear_int4_shape(N, K) : packed_linear_int8_shape(N, K);
  const char* packer = int4 ? "pack_linear_weight_int4" : "pack_linear_weight_int8";
  SPECDEC_CHECK(w.sizes().equals(want) && w.is_contiguous(), op, ": ", name, " (with ", scales_name, ") must be ",
                packer, "'s output for ", what, " = [", N, ", ", K, "], of shape ", at::IntArrayRef(want), ", got ",
                shape_str(w), w.is_contiguous() ? "" : " (not contiguous)");
  check_dtype(op, scales_name, *scales, at::kFloat);
  check_same_device(op, scales_name, *scales, x, "x");
  SPECDEC_CHECK(scales->dim() == 1 && scales->size(0) == N, op, ": ", scales_name, " must have shape [", N,
                "] (the first dimension of ", what, "), got ", shape_str(*scales));
  if (!int4) return {w, scales->contiguous(), at::Tensor()};
  check_dtype(op, group_scales_name, *group_scales, at::kByte);
  check_same_device(op, group_scales_name, *group_scales, x, "x");
  const std::vector<int64_t> want_groups = int4_group_scales_shape(N, K);
  SPECDEC_CHECK(group_scales->sizes().equals(want_groups) && group_scales->is_contiguous(), op, ": ",
                group_scales_name, " must be pack_linear_weight_int4's group scales for ", what, " = [", N, ", ", K,
                "], of shape ", at::IntArrayRef(want_groups), ", got ", shape_str(*group_scales),
                group_scales->is_contiguous() ? "" : " (not contiguous)");
  return {w, scales->contiguous(), *group_scales};
}

// A [n] vector of x's dtype and device, returned contiguous.
inline at::Tensor checked_weight_vector(const char* op, const char* name, const at::Tensor& t, int64_t n,
                                        const at::Tensor& x) {
  check_dtype(op, name, t, x.scalar_type());
  check_same_device(op, name, t, x, "x");
  SPECDEC_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", name, " must have shape [", n, "], got ", shape_str(t));
  return t.contiguous();
}

template <class Backend>
at::Tensor draft_decoder_layer_impl(const at::Tensor& x_in, const std::optional<at::Tensor>& input_norm_weight_in,
                                    int64_t input_norm_segments, const at::Tensor& residual_in,
                                    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias_in,
                                    const at::Tensor& o_weight, const at::Tensor& norm_weight_in,
                                    const at::Tensor& gate_up_weight, const at::Tensor& down_weight,
                                    const at::Tensor& position_ids_in, const at::Tensor& inv_freq_in,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& write_slots_in, const at::Tensor& mask_in, int64_t num_heads,
                                    int64_t intermediate_size, double eps,
                                    const std::optional<at::Tensor>& qkv_scales,
                                    const std::optional<at::Tensor>& o_scales,
                                    const std::optional<at::Tensor>& gate_up_scales,
                                    const std::optional<at::Tensor>& down_scales,
                                    const std::optional<at::Tensor>& qkv_group_scales,
                                    const std::optional<at::Tensor>& o_group_scales,
                                    const std::optional<at::Tensor>& gate_up_group_scales,
                                    const std::optional<at::Tensor>& down_group_scales, bool validate) {
  constexpr const char* op = "draft_decoder_layer";
  check_dim(op, "x", x_in, 3, "[B, T, Din]");
  check_float(op, "x", x_in);
  const int64_t B = x_in.size(0), T = x_in.size(1), Din = x_in.size(2);
  SPECDEC_CHECK(B >= 1 && T >= 1 && Din >= 1, op, ": x must be non-empty [B, T, Din], got ", shape_str(x_in));
  check_dim(op, "residual", residual_in, 3, "[B, T, H]");
  check_dtype(op, "residual", residual_in, x_in.scalar_type());
  check_same_device(op, "residual", residual_in, x_in, "x");
  const int64_t H = residual_in.size(2);
  SPECDEC_CHECK(residual_in.size(0) == B && residual_in.size(1) == T && H >= 1, op,
                ": residual must have shape [B, T, H] with x's B = ", B, " and T = ", T, ", got ",
                shape_str(residual_in));
  check_dim(op, "k_cache", k_cache, 4, "[B, nKV, S, D]");
  check_dtype(op, "k_cache", k_cache, x_in.scalar_type());
  check_same_device(op, "k_cache", k_cache, x_in, "x");
  SPECDEC_CHECK(k_cache.is_contiguous(), op, ": k_cache must be contiguous");
  check_same_device(op, "v_cache", v_cache, k_cache, "k_cache");
  SPECDEC_CHECK(v_cache.sizes().equals(k_cache.sizes()) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
                op, ": v_cache must be a contiguous tensor of k_cache's shape ", shape_str(k_cache), " and dtype, got ",
                shape_str(v_cache), " ", v_cache.scalar_type());
  const int64_t nKV = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  SPECDEC_CHECK(k_cache.size(0) == B && nKV >= 1 && S >= 1, op, ": k_cache must have shape [B, nKV, S, D] with B = ",
                B, ", got ", shape_str(k_cache));
  SPECDEC_CHECK(tree_attention_head_dim_supported(D), op, ": head dim D = ", D,
                " (k_cache's last dimension) is not supported (supported: 64, 80, 96, 128, 256)");
  SPECDEC_CHECK(num_heads >= 1 && num_heads % nKV == 0, op, ": num_heads must be a positive multiple of the number of ",
                "key/value heads nKV = ", nKV, " (k_cache's dimension 1), got ", num_heads);
  SPECDEC_CHECK(intermediate_size >= 1, op, ": intermediate_size must be >= 1, got ", intermediate_size);
  SPECDEC_CHECK(eps >= 0 && std::isfinite(eps), op, ": eps must be a finite number >= 0, got ", eps);
  // Sizes from the scalar arguments, overflow-checked: the weights' shape checks below then bound them.
  const int64_t heads_d = checked_mul(op, "num_heads * D", num_heads, D);
  const int64_t Q = checked_add(op, "(num_heads + 2 nKV) * D", heads_d, 2 * nKV * D);
  const int64_t I2 = checked_mul(op, "2 * intermediate_size", 2, intermediate_size);
  const LayerWeight weights[4] = {
      checked_layer_weight(op, "qkv_weight", "qkv_scales", "qkv_group_scales", qkv_weight, qkv_scales,
                           qkv_group_scales, x_in, Q, Din, "[(num_heads + 2 nKV) D, Din]"),
      checked_layer_weight(op, "o_weight", "o_scales", "o_group_scales", o_weight, o_scales, o_group_scales, x_in,
                           H, heads_d, "[H, num_heads D]"),
      checked_layer_weight(op, "gate_up_weight", "gate_up_scales", "gate_up_group_scales", gate_up_weight,
                           gate_up_scales, gate_up_group_scales, x_in, I2, H, "[2 intermediate_size, H]"),
      checked_layer_weight(op, "down_weight", "down_scales", "down_group_scales", down_weight, down_scales,
                           down_group_scales, x_in, H, intermediate_size, "[H, intermediate_size]")};
  bool any_quantised = false, any_int4 = false;
  for (const LayerWeight& w : weights) {
    any_quantised = any_quantised || w.scales.defined();
    any_int4 = any_int4 || w.group_scales.defined();
  }
  at::Tensor qkv_bias, input_norm_weight;
  if (qkv_bias_in.has_value()) qkv_bias = checked_weight_vector(op, "qkv_bias", *qkv_bias_in, Q, x_in);
  if (input_norm_weight_in.has_value()) {
    input_norm_weight = checked_weight_vector(op, "input_norm_weight", *input_norm_weight_in, Din, x_in);
    SPECDEC_CHECK(input_norm_segments >= 1 && Din % input_norm_segments == 0, op,
                  ": input_norm_segments must be >= 1 and divide Din = ", Din, ", got ", input_norm_segments);
  }
  const at::Tensor norm_weight = checked_weight_vector(op, "norm_weight", norm_weight_in, H, x_in);
  check_dtype(op, "inv_freq", inv_freq_in, at::kFloat);
  check_same_device(op, "inv_freq", inv_freq_in, x_in, "x");
  SPECDEC_CHECK(inv_freq_in.dim() == 1 && inv_freq_in.size(0) == D / 2, op, ": inv_freq must have shape [D / 2] = [",
                D / 2, "], got ", shape_str(inv_freq_in));
  const at::Tensor inv_freq = inv_freq_in.contiguous();
  const at::Tensor position_ids = checked_index_matrix(op, "position_ids", position_ids_in, B, T, x_in, "x");
  const at::Tensor write_slots = checked_index_matrix(op, "write_slots", write_slots_in, B, T, x_in, "x");
  check_dtype(op, "mask", mask_in, at::kBool);
  check_same_device(op, "mask", mask_in, x_in, "x");
  check_dim(op, "mask", mask_in, 3, "[B, T, kv_len]");
  const int64_t kv_len = mask_in.size(2);
  SPECDEC_CHECK(mask_in.size(0) == B && mask_in.size(1) == T && kv_len >= 1 && kv_len <= S, op,
                ": mask must have shape [B, T, kv_len] with B = ", B, ", T = ", T, " and 1 <= kv_len <= S = ", S,
                " (the cache's positions), got ", shape_str(mask_in));
  const at::Tensor mask = mask_in.contiguous(), x = x_in.contiguous(), residual = residual_in.contiguous();
  // The caches are written in place: neither may alias the other or any input the layer reads.
  check_no_overlap(op, "k_cache", k_cache, "v_cache", v_cache);
  const std::pair<const char*, const at::Tensor*> inputs[] = {
      {"x", &x_in}, {"residual", &residual_in}, {"qkv_weight", &qkv_weight}, {"o_weight", &o_weight},
      {"norm_weight", &norm_weight_in}, {"gate_up_weight", &gate_up_weight}, {"down_weight", &down_weight},
      {"position_ids", &position_ids_in}, {"inv_freq", &inv_freq_in}, {"write_slots", &write_slots_in},
      {"mask", &mask_in}, {"qkv_bias", &qkv_bias}, {"input_norm_weight", &input_norm_weight},
      {"qkv_scales", &weights[0].scales}, {"o_scales", &weights[1].scales},
      {"gate_up_scales", &weights[2].scales}, {"down_scales", &weights[3].scales},
      {"qkv_group_scales", &weights[0].group_scales}, {"o_group_scales", &weights[1].group_scales},
      {"gate_up_group_scales", &weights[2].group_scales}, {"down_group_scales", &weights[3].group_scales}};
  for (const auto& [name, t] : inputs) {
    if (!t->defined()) continue;
    check_no_overlap(op, "k_cache", k_cache, name, *t);
    check_no_overlap(op, "v_cache", v_cache, name, *t);
  }

  c10::OptionalDeviceGuard guard(x.device());
  const int64_t rows = B * T, I = intermediate_size;
  // The stages' buffers in one allocation: normed_input, qkv, heads, attn, h1, normed, gate_up, act, down.
  auto rows_times = [&](int64_t width) { return checked_mul(op, "a stage buffer's size", rows, width); };
  const std::vector<int64_t> sizes = {input_norm_weight.defined() ? rows_times(Din) : 0,
                                      rows_times(Q),
                                      rows_times(heads_d),
                                      rows_times(heads_d),
                                      rows_times(H),
                                      rows_times(H),
                                      rows_times(I2),
                                      rows_times(I),
                                      rows_times(H)};
  int64_t total = 0;
  for (int64_t n : sizes) total = checked_add(op, "the stage buffers' size", total, n);
  at::Tensor buffers = at::empty({total}, x.options());
  // An int8 or int4 product's input rows quantised (the widest of the four inputs), their scales, and with an int4
  // weight their group offsets.
  at::Tensor qx, qx_scales, qx_offsets;
  const int64_t widest = std::max({Din, heads_d, H, I});
  if (any_quantised) {
    qx = at::empty({rows_times(linear_int8_padded_k(widest))}, x.options().dtype(at::kChar));
    qx_scales = at::empty({rows}, x.options().dtype(at::kFloat));
  }
  if (any_int4) qx_offsets = at::empty({rows_times(linear_int4_padded_k(widest) / kLinearInt4Group)},
                                       x.options().dtype(at::kInt));
  at::Tensor out = at::empty({B, T, H}, x.options());
  at::Tensor status = new_status(2 * B, x);  // rows [0, B): the layer's; [B, 2B): the attention's (always ok)
  at::Tensor zero_prefix = at::zeros({B}, x.options().dtype(at::kLong));
  const int64_t ws_floats = Backend::tree_attention_workspace_floats(B, num_heads, nKV, T, D, S);
  at::Tensor attn_ws;
  if (ws_floats > 0) attn_ws = at::empty({ws_floats}, x.options().dtype(at::kFloat));
  SPECDEC_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    using U = scalar_t;
    U* base = reinterpret_cast<U*>(mutable_data(buffers));
    U* parts[9];
    for (size_t i = 0; i < sizes.size(); ++i) {
      parts[i] = base;
      base += sizes[i];
    }
    auto ptr = [](const at::Tensor& t) -> const U* { return t.defined() ? float_ptr<U>(t) : nullptr; };
    DraftLayerParams<U> p{.qkv_weight = weights[0].operand<U>(),
                          .o_weight = weights[1].operand<U>(),
                          .gate_up_weight = weights[2].operand<U>(),
                          .down_weight = weights[3].operand<U>(),
                          .x = float_ptr<U>(x),
                          .input_norm_weight = ptr(input_norm_weight),
                          .input_norm_segments = input_norm_segments,
                          .residual = float_ptr<U>(residual),
                          .qkv_bias = ptr(qkv_bias),
                          .norm_weight = float_ptr<U>(norm_weight),
                          .eps = static_cast<float>(eps),
                          .position_ids = const_data<int64_t>(position_ids),
                          .inv_freq = const_data<float>(inv_freq),
                          .k_cache = reinterpret_cast<U*>(mutable_data(k_cache)),
                          .v_cache = reinterpret_cast<U*>(mutable_data(v_cache)),
                          .write_slots = const_data<int64_t>(write_slots),
                          .batch = B,
                          .tokens = T,
                          .in_features = Din,
                          .hidden = H,
                          .intermediate = I,
                          .num_heads = num_heads,
                          .num_kv_heads = nKV,
                          .head_dim = D,
                          .seq_len = S,
                          .normed_input = input_norm_weight.defined() ? parts[0] : nullptr,
                          .qkv = parts[1],
                          .heads = parts[2],
                          .attn = parts[3],
                          .h1 = parts[4],
                          .normed = parts[5],
                          .gate_up = parts[6],
                          .act = parts[7],
                          .down = parts[8],
                          .qx = qx.defined() ? mutable_data<int8_t>(qx) : nullptr,
                          .qx_scales = qx.defined() ? mutable_data<float>(qx_scales) : nullptr,
                          .qx_offsets = qx_offsets.defined() ? mutable_data<int32_t>(qx_offsets) : nullptr,
                          .out = reinterpret_cast<U*>(mutable_data(out)),
                          .status = status_ptr(status)};
    const TreeAttentionParams<U> a = draft_layer_attention(
        p, const_data<bool>(mask), kv_len, const_data<int64_t>(zero_prefix),
        attn_ws.defined() ? mutable_data<float>(attn_ws) : nullptr, ws_floats, status_ptr(status) + B);
    Backend::draft_decoder_layer(p, a);
  });
  if (validate) raise_on_bad_status(op, status.narrow(0, 0, B));
  return out;
}

}  // namespace specdec::glue
