// Glue of the weight-only int4 linear ops (included by op_glue.h): pack_linear_weight_int4 and packed_linear_int4.
// Same pattern as the int8 ops (op_glue_linear_int8.h): checks, output allocation, dtype dispatch, Backend calls.
// The product's input rows are quantised by packed_linear_int8's stage, over x zero-padded to whole groups.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../kernels/common/dtype.h"
#include "../kernels/common/params.h"
#include "checks.h"

namespace specdec::glue {

inline void check_int4_in_features(const char* op, const char* what, int64_t K) {
  SPECDEC_CHECK(K >= 1 && K <= kLinearInt4MaxK, op, ": ", what, " must be in [1, ", kLinearInt4MaxK,
                "] (the int32 sums of 63 * 7 * 127 K), got ", K);
}

// The packed int4 layouts for N x K (common/params.h): packed [ceil(N / 32), Kp / 8, 32, 4] and group_scales
// [ceil(N / 32), Kp / 32, 32], Kp = ceil(K / 32) * 32.
inline std::vector<int64_t> packed_linear_int4_shape(int64_t N, int64_t K) {
  return {ceil_div(N, kLinearPanel), linear_int4_padded_k(K) / kLinearInt4Octet, kLinearPanel, 4};
}
inline std::vector<int64_t> int4_group_scales_shape(int64_t N, int64_t K) {
  return {ceil_div(N, kLinearPanel), linear_int4_padded_k(K) / kLinearInt4Group, kLinearPanel};
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_linear_weight_int4_impl(const at::Tensor& weight_in) {
  constexpr const char* op = "pack_linear_weight_int4";
  check_dim(op, "weight", weight_in, 2, "[out_features, in_features]");
  check_float(op, "weight", weight_in);
  const int64_t N = weight_in.size(0), K = weight_in.size(1);
  SPECDEC_CHECK(N >= 1, op, ": weight must be non-empty [out_features, in_features], got ", shape_str(weight_in));
  check_int4_in_features(op, "weight's in_features", K);
  const at::Tensor weight = weight_in.contiguous();
  c10::OptionalDeviceGuard guard(weight.device());
  // (packing is done once per weight: reading this flag back from a device is affordable here)
  SPECDEC_CHECK(weight.is_meta() || at::isfinite(weight).all().item<bool>(), op,
                ": weight must be finite (an output channel holding inf or NaN has no int4 scale)");
  at::Tensor packed = at::empty(packed_linear_int4_shape(N, K), weight.options().dtype(at::kByte));
  at::Tensor group_scales = at::empty(int4_group_scales_shape(N, K), weight.options().dtype(at::kByte));
  at::Tensor scales = at::empty({N}, weight.options().dtype(at::kFloat));
  SPECDEC_DISPATCH_FLOAT(weight.scalar_type(), op, [&] {
    PackLinearInt4Params<scalar_t> p{.weight = float_ptr<scalar_t>(weight),
                                     .out_features = N,
                                     .in_features = K,
                                     .packed = mutable_data<uint8_t>(packed),
                                     .group_scales = mutable_data<uint8_t>(group_scales),
                                     .scales = mutable_data<float>(scales)};
    Backend::pack_linear_weight_int4(p);
  });
  return {packed, group_scales, scales};
}

template <class Backend>
at::Tensor packed_linear_int4_impl(const at::Tensor& x_in, const at::Tensor& packed_weight,
                                   const at::Tensor& group_scales, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& bias_in) {
  constexpr const char* op = "packed_linear_int4";
  SPECDEC_CHECK(x_in.dim() >= 1, op, ": x must have shape [..., in_features], got a scalar");
  check_float(op, "x", x_in);
  const int64_t K = x_in.size(-1);
  check_int4_in_features(op, "x's last dimension (in_features)", K);
  check_dtype(op, "scales", scales, at::kFloat);
  check_same_device(op, "scales", scales, x_in, "x");
  check_dim(op, "scales", scales, 1, "[out_features]");
  const int64_t N = scales.size(0);
  SPECDEC_CHECK(N >= 1, op, ": scales must be non-empty [out_features], got ", shape_str(scales));
  for (const auto& [name, t, want, layout] :
       {std::tuple{"packed_weight", &packed_weight, packed_linear_int4_shape(N, K),
                   "ceil(in_features / 32) * 4, 32, 4"},
        std::tuple{"group_scales", &group_scales, int4_group_scales_shape(N, K), "ceil(in_features / 32), 32"}}) {
    check_dtype(op, name, *t, at::kByte);
    check_same_device(op, name, *t, x_in, "x");
    SPECDEC_CHECK(t->sizes().equals(want), op, ": ", name, " must have shape [ceil(out_features / 32), ", layout,
                  "] = ", at::IntArrayRef(want), " for out_features = ", N, " (scales' length) and in_features = ", K,
                  " (x's last dimension) (pack_linear_weight_int4's output), got ", shape_str(*t));
    SPECDEC_CHECK(t->is_contiguous(), op, ": ", name, " must be contiguous (pack_linear_weight_int4's output)");
  }
  const at::Tensor bias = checked_linear_bias(op, bias_in, x_in, N);
  const at::Tensor w_scales = scales.contiguous();
  const LinearRows rows = linear_rows(x_in, K, N);
  const int64_t M = rows.rows, Kp = linear_int4_padded_k(K);
  c10::OptionalDeviceGuard guard(rows.x.device());
  at::Tensor y = at::empty({M, N}, rows.x.options());
  if (M > 0) {
    // whole groups of inputs: zero columns change neither a row's int8 scale nor its sums
    const at::Tensor x = Kp == K ? rows.x : at::constant_pad_nd(rows.x, {0, Kp - K}).contiguous();
    at::Tensor qx = at::empty({M, Kp}, x.options().dtype(at::kChar));
    at::Tensor x_scales = at::empty({M}, x.options().dtype(at::kFloat));
    at::Tensor x_offsets = at::empty({M, Kp / kLinearInt4Group}, x.options().dtype(at::kInt));
    SPECDEC_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
      QuantizeRowsInt8Params<scalar_t> q{.x = float_ptr<scalar_t>(x),
                                         .rows = M,
                                         .in_features = Kp,
                                         .q = mutable_data<int8_t>(qx),
                                         .scales = mutable_data<float>(x_scales)};
      Backend::quantize_rows_int8(q);
      PackedLinearInt4Params<scalar_t> p{.qx = const_data<int8_t>(qx),
                                         .x_scales = const_data<float>(x_scales),
                                         .x_offsets = mutable_data<int32_t>(x_offsets),
                                         .rows = M,
                                         .in_features = K,
                                         .out_features = N,
                                         .packed = const_data<uint8_t>(packed_weight),
                                         .group_scales = const_data<uint8_t>(group_scales),
                                         .w_scales = const_data<float>(w_scales),
                                         .bias = bias.defined() ? float_ptr<scalar_t>(bias) : nullptr,
                                         .y = reinterpret_cast<scalar_t*>(mutable_data(y))};
      Backend::packed_linear_int4(p);
    });
  }
  return y.view(rows.out_sizes);
}

}  // namespace specdec::glue
