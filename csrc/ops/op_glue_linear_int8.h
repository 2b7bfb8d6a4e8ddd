// Glue of the weight-only int8 linear ops (included by op_glue.h): pack_linear_weight_int8 and packed_linear_int8.
// Same pattern as the other ops: checks (checks.h and op_glue.h's linear helpers), output allocation, dtype
// dispatch, Backend calls. The product
// runs in two Backend steps: the input rows quantised into a scratch tensor, then the integer product.
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

inline void check_int8_in_features(const char* op, const char* what, int64_t K) {
  SPECDEC_CHECK(K >= 1 && K <= kLinearInt8MaxK, op, ": ", what, " must be in [1, ", kLinearInt8MaxK,
                "] (the int32 sums of 127^2 K), got ", K);
}

// The packed int8 layout's shape for N x K (common/params.h): [ceil(N / 32), ceil(K / 4), 32, 4].
inline std::vector<int64_t> packed_linear_int8_shape(int64_t N, int64_t K) {
  return {ceil_div(N, kLinearPanel), ceil_div(K, kLinearInt8Quad), kLinearPanel, kLinearInt8Quad};
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor> pack_linear_weight_int8_impl(const at::Tensor& weight_in) {
  constexpr const char* op = "pack_linear_weight_int8";
  check_dim(op, "weight", weight_in, 2, "[out_features, in_features]");
  check_float(op, "weight", weight_in);
  const int64_t N = weight_in.size(0), K = weight_in.size(1);
  SPECDEC_CHECK(N >= 1, op, ": weight must be non-empty [out_features, in_features], got ", shape_str(weight_in));
  check_int8_in_features(op, "weight's in_features", K);
  const at::Tensor weight = weight_in.contiguous();
  c10::OptionalDeviceGuard guard(weight.device());
  // (packing is done once per weight: reading this flag back from a device is affordable here)
  SPECDEC_CHECK(weight.is_meta() || at::isfinite(weight).all().item<bool>(), op,
                ": weight must be finite (an output channel holding inf or NaN has no int8 scale)");
  at::Tensor packed = at::empty(packed_linear_int8_shape(N, K), weight.options().dtype(at::kChar));
  at::Tensor scales = at::empty({N}, weight.options().dtype(at::kFloat));
  SPECDEC_DISPATCH_FLOAT(weight.scalar_type(), op, [&] {
    PackLinearInt8Params<scalar_t> p{.weight = float_ptr<scalar_t>(weight),
                                     .out_features = N,
                                     .in_features = K,
                                     .packed = mutable_data<int8_t>(packed),
                                     .scales = mutable_data<float>(scales)};
    Backend::pack_linear_weight_int8(p);
  });
  return {packed, scales};
}

template <class Backend>
at::Tensor packed_linear_int8_impl(const at::Tensor& x_in, const at::Tensor& packed_weight, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& bias_in) {
  constexpr const char* op = "packed_linear_int8";
  SPECDEC_CHECK(x_in.dim() >= 1, op, ": x must have shape [..., in_features], got a scalar");
  check_float(op, "x", x_in);
  const int64_t K = x_in.size(-1);
  check_int8_in_features(op, "x's last dimension (in_features)", K);
  check_dtype(op, "scales", scales, at::kFloat);
  check_same_device(op, "scales", scales, x_in, "x");
  check_dim(op, "scales", scales, 1, "[out_features]");
  const int64_t N = scales.size(0);
  SPECDEC_CHECK(N >= 1, op, ": scales must be non-empty [out_features], got ", shape_str(scales));
  check_dtype(op, "packed_weight", packed_weight, at::kChar);
  check_same_device(op, "packed_weight", packed_weight, x_in, "x");
  const std::vector<int64_t> want = packed_linear_int8_shape(N, K);
  SPECDEC_CHECK(packed_weight.sizes().equals(want), op, ": packed_weight must have shape [ceil(out_features / 32), "
                "ceil(in_features / 4), 32, 4] = ", at::IntArrayRef(want), " for out_features = ", N,
                " (scales' length) and in_features = ", K, " (x's last dimension) (pack_linear_weight_int8's output), "
                "got ", shape_str(packed_weight));
  SPECDEC_CHECK(packed_weight.is_contiguous(), op,
                ": packed_weight must be contiguous (pack_linear_weight_int8's output)");
  const at::Tensor bias = checked_linear_bias(op, bias_in, x_in, N);
  const at::Tensor w_scales = scales.contiguous();
  const LinearRows rows = linear_rows(x_in, K, N);
  const at::Tensor& x = rows.x;
  const int64_t M = rows.rows, Kp = linear_int8_padded_k(K);
  c10::OptionalDeviceGuard guard(x.device());
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0) {
    at::Tensor qx = at::empty({M, Kp}, x.options().dtype(at::kChar));
    at::Tensor x_scales = at::empty({M}, x.options().dtype(at::kFloat));
    SPECDEC_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
      QuantizeRowsInt8Params<scalar_t> q{.x = float_ptr<scalar_t>(x),
                                         .rows = M,
                                         .in_features = K,
                                         .q = mutable_data<int8_t>(qx),
                                         .scales = mutable_data<float>(x_scales)};
      Backend::quantize_rows_int8(q);
      PackedLinearInt8Params<scalar_t> p{.qx = const_data<int8_t>(qx),
                                         .x_scales = const_data<float>(x_scales),
                                         .rows = M,
                                         .in_features = K,
                                         .out_features = N,
                                         .packed = const_data<int8_t>(packed_weight),
                                         .w_scales = const_data<float>(w_scales),
                                         .bias = bias.defined() ? float_ptr<scalar_t>(bias) : nullptr,
                                         .y = reinterpret_cast<scalar_t*>(mutable_data(y))};
      Backend::packed_linear_int8(p);
    });
  }
  return y.view(rows.out_sizes);
}

}  // namespace specdec::glue
