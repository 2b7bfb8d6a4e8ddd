// Glue of the recurrent tree ops (included by op_glue.h): Lightning linear attention, the tree causal conv1d, the
// Gated DeltaNet and Mamba-2 recurrences, and their commits. Same pattern as the other ops: checks (checks.h),
// output allocation, dtype dispatch, Backend call, status report. A backend for these ops is a struct with one
// static template per kernel (CPU: ops_cpu.cpp, CUDA: ops_cuda.cu, Meta: ops_meta.cpp), registered by
// SPECDEC_REGISTER_RECURRENT.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>
#include <string>

#include "../kernels/common/dtype.h"
#include "../kernels/common/params.h"
#include "checks.h"

namespace specdec::glue {

// A per-node tensor [B, H, N, D] of `ref`'s dtype and device, unit stride in D; returns D.
inline int64_t check_node_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                                 const char* ref_name, int64_t B, int64_t H, int64_t N, const char* layout) {
  check_dim(op, name, t, 4, layout);
  SPECDEC_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have ", ref_name, "'s dtype ",
                ref.scalar_type(), ", got ", t.scalar_type());
  check_same_device(op, name, t, ref, ref_name);
  SPECDEC_CHECK(t.size(0) == B && t.size(1) == H && t.size(2) == N && t.size(3) >= 1, op, ": ", name,
                " must have shape ", layout, " with B = ", B, ", H = ", H, ", N = ", N, " and a non-empty last "
                "dimension, got ", shape_str(t));
  check_unit_last_stride(op, name, t);
  return t.size(3);
}

// A float32 state [B, H, R, C] on `ref`'s device with unit stride in C.
inline void check_state(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                        const char* ref_name, std::initializer_list<int64_t> sizes, const char* layout) {
  check_dtype(op, name, t, at::kFloat);
  check_same_device(op, name, t, ref, ref_name);
  check_shape(op, name, t, sizes, layout);
  check_unit_last_stride(op, name, t);
}

// log_decay [H] float32 on `ref`'s device, returned contiguous.
inline at::Tensor checked_log_decay(const char* op, const at::Tensor& t, int64_t H, const at::Tensor& ref,
                                    const char* ref_name) {
  check_dtype(op, "log_decay", t, at::kFloat);
  check_same_device(op, "log_decay", t, ref, ref_name);
  SPECDEC_CHECK(t.dim() == 1 && t.size(0) == H, op, ": log_decay must have shape [H] = [", H,
                "] (one decay per head), got ", shape_str(t));
  return t.contiguous();
}

// An accepted path [B, L] int64 and lengths [B] int64 on `ref`'s device, returned contiguous.
inline std::pair<at::Tensor, at::Tensor> checked_path(const char* op, const at::Tensor& path, const at::Tensor& lengths,
                                                      int64_t B, const at::Tensor& ref, const char* ref_name) {
  check_dtype(op, "path", path, at::kLong);
  check_same_device(op, "path", path, ref, ref_name);
  check_dim(op, "path", path, 2, "[B, L]");
  SPECDEC_CHECK(path.size(0) == B, op, ": path must have shape [B, L] with B = ", B, ", got ", shape_str(path));
  return {path.contiguous(), checked_row_vector(op, "lengths", lengths, B, at::kLong, ref, ref_name)};
}

template <class Backend>
at::Tensor tree_linear_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& state, const at::Tensor& log_decay_in,
                                      const at::Tensor& parents_in, bool validate) {
  constexpr const char* op = "tree_linear_attention";
  check_dim(op, "q", q, 4, "[B, H, N, Dk]");
  check_float(op, "q", q);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2);
  SPECDEC_CHECK(B >= 1 && H >= 1 && N >= 1, op, ": q must be non-empty [B, H, N, Dk], got ", shape_str(q));
  const int64_t Dk = check_node_tensor(op, "q", q, q, "q", B, H, N, "[B, H, N, Dk]");
  SPECDEC_CHECK(check_node_tensor(op, "k", k, q, "q", B, H, N, "[B, H, N, Dk]") == Dk, op,
                ": k must have q's shape ", shape_str(q), ", got ", shape_str(k));
  const int64_t Dv = check_node_tensor(op, "v", v, q, "q", B, H, N, "[B, H, N, Dv]");
  check_state(op, "state", state, q, "q", {B, H, Dk, Dv}, "[B, H, Dk, Dv]");
  const at::Tensor log_decay = checked_log_decay(op, log_decay_in, H, q, "q");
  const at::Tensor parents = checked_index_matrix(op, "parents", parents_in, B, N, q, "q");
  c10::OptionalDeviceGuard guard(q.device());
  at::Tensor out = at::empty({B, H, N, Dv}, q.options());
  at::Tensor status = new_status(B, q);
  SPECDEC_DISPATCH_FLOAT(q.scalar_type(), op, [&] {
    TreeLinearAttentionParams<scalar_t> p{.q = float_ptr<scalar_t>(q),
                                          .q_stride_b = q.stride(0),
                                          .q_stride_h = q.stride(1),
                                          .q_stride_n = q.stride(2),
                                          .k = float_ptr<scalar_t>(k),
                                          .k_stride_b = k.stride(0),
                                          .k_stride_h = k.stride(1),
                                          .k_stride_n = k.stride(2),
                                          .v = float_ptr<scalar_t>(v),
                                          .v_stride_b = v.stride(0),
                                          .v_stride_h = v.stride(1),
                                          .v_stride_n = v.stride(2),
                                          .state = const_data<float>(state),
                                          .state_stride_b = state.stride(0),
                                          .state_stride_h = state.stride(1),
                                          .state_stride_k = state.stride(2),
                                          .log_decay = const_data<float>(log_decay),
                                          .parents = const_data<int64_t>(parents),
                                          .batch = B,
                                          .num_heads = H,
                                          .num_nodes = N,
                                          .key_dim = Dk,
                                          .value_dim = Dv,
                                          .out = reinterpret_cast<scalar_t*>(mutable_data(out)),
                                          .status = status_ptr(status)};
    Backend::tree_linear_attention(p);
  });
  if (validate) raise_on_bad_status(op, status);
  return out;
}

template <class Backend>
void commit_linear_state_impl(const at::Tensor& state, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& log_decay_in, const at::Tensor& path_in, const at::Tensor& lengths_in,
                              bool validate) {
  constexpr const char* op = "commit_linear_state";
  check_dim(op, "state", state, 4, "[B, H, Dk, Dv]");
  const int64_t B = state.size(0), H = state.size(1), Dk = state.size(2), Dv = state.size(3);
  SPECDEC_CHECK(B >= 1 && H >= 1 && Dk >= 1 && Dv >= 1, op, ": state must be non-empty [B, H, Dk, Dv], got ",
                shape_str(state));
  check_dtype(op, "state", state, at::kFloat);
  check_unit_last_stride(op, "state", state);
  check_dim(op, "k", k, 4, "[B, H, N, Dk]");
  check_float(op, "k", k);
  const int64_t N = k.size(2);
  SPECDEC_CHECK(N >= 1, op, ": k must hold N >= 1 nodes [B, H, N, Dk], got ", shape_str(k));
  SPECDEC_CHECK(check_node_tensor(op, "k", k, k, "k", B, H, N, "[B, H, N, Dk]") == Dk, op,
                ": k must have shape [B, H, N, Dk] with state's Dk = ", Dk, ", got ", shape_str(k));
  check_same_device(op, "k", k, state, "state");
  SPECDEC_CHECK(check_node_tensor(op, "v", v, k, "k", B, H, N, "[B, H, N, Dv]") == Dv, op,
                ": v must have shape [B, H, N, Dv] with state's Dv = ", Dv, ", got ", shape_str(v));
  const at::Tensor log_decay = checked_log_decay(op, log_decay_in, H, state, "state");
  const auto [path, lengths] = checked_path(op, path_in, lengths_in, B, state, "state");
  check_no_overlap(op, "state", state, "k", k);
  check_no_overlap(op, "state", state, "v", v);
  check_no_overlap(op, "state", state, "log_decay", log_decay_in);
  check_no_overlap(op, "state", state, "path", path_in);
  check_no_overlap(op, "state", state, "lengths", lengths_in);
  c10::OptionalDeviceGuard guard(state.device());
  at::Tensor status = new_status(B, state);
  SPECDEC_DISPATCH_FLOAT(k.scalar_type(), op, [&] {
    CommitLinearStateParams<scalar_t> p{.state = mutable_data<float>(state),
                                        .state_stride_b = state.stride(0),
                                        .state_stride_h = state.stride(1),
                                        .state_stride_k = state.stride(2),
                                        .k = float_ptr<scalar_t>(k),
                                        .k_stride_b = k.stride(0),
                                        .k_stride_h = k.stride(1),
                                        .k_stride_n = k.stride(2),
                                        .v = float_ptr<scalar_t>(v),
                                        .v_stride_b = v.stride(0),
                                        .v_stride_h = v.stride(1),
                                        .v_stride_n = v.stride(2),
                                        .log_decay = const_data<float>(log_decay),
                                        .path = const_data<int64_t>(path),
                                        .lengths = const_data<int64_t>(lengths),
                                        .batch = B,
                                        .num_heads = H,
                                        .num_nodes = N,
                                        .max_len = path.size(1),
                                        .key_dim = Dk,
                                        .value_dim = Dv,
                                        .status = status_ptr(status)};
    Backend::commit_linear_state(p);
  });
  if (validate) raise_on_bad_status(op, status);
}

template <class Backend>
at::Tensor tree_causal_conv1d_impl(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight_in,
                                   const std::optional<at::Tensor>& bias_in, const at::Tensor& parents_in,
                                   const std::optional<std::string>& activation, bool validate) {
  constexpr const char* op = "tree_causal_conv1d";
  check_dim(op, "x", x, 3, "[B, C, N]");
  check_float(op, "x", x);
  const int64_t B = x.size(0), C = x.size(1), N = x.size(2);
  SPECDEC_CHECK(B >= 1 && C >= 1 && N >= 1, op, ": x must be non-empty [B, C, N], got ", shape_str(x));
  SPECDEC_CHECK(x.scalar_type() == weight_in.scalar_type(), op, ": weight must have x's dtype ", x.scalar_type(),
                ", got ", weight_in.scalar_type());
  check_same_device(op, "weight", weight_in, x, "x");
  check_dim(op, "weight", weight_in, 2, "[C, K]");
  const int64_t K = weight_in.size(1);
  SPECDEC_CHECK(weight_in.size(0) == C && K >= 1, op, ": weight must have shape [C, K] with x's C = ", C,
                " and K >= 1, got ", shape_str(weight_in));
  check_dtype(op, "conv_state", conv_state, at::kFloat);
  check_same_device(op, "conv_state", conv_state, x, "x");
  check_shape(op, "conv_state", conv_state, {B, C, K - 1}, "[B, C, K - 1]");
  at::Tensor bias;
  if (bias_in.has_value()) {
    SPECDEC_CHECK(bias_in->scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ", x.scalar_type(),
                  ", got ", bias_in->scalar_type());
    check_same_device(op, "bias", *bias_in, x, "x");
    check_shape(op, "bias", *bias_in, {C}, "[C]");
    bias = bias_in->contiguous();
  }
  const bool silu = activation.has_value() && *activation == "silu";
  SPECDEC_CHECK(!activation.has_value() || silu, op, ": activation must be 'silu' or None, got '",
                activation.value_or(""), "'");
  const at::Tensor parents = checked_index_matrix(op, "parents", parents_in, B, N, x, "x");
  const at::Tensor weight = weight_in.contiguous();
  c10::OptionalDeviceGuard guard(x.device());
  at::Tensor out = at::empty({B, C, N}, x.options());
  at::Tensor status = new_status(B, x);
  SPECDEC_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    TreeCausalConv1dParams<scalar_t> p{.x = float_ptr<scalar_t>(x),
                                       .x_stride_b = x.stride(0),
                                       .x_stride_c = x.stride(1),
                                       .x_stride_n = x.stride(2),
                                       .conv_state = const_data<float>(conv_state),
                                       .conv_stride_b = conv_state.stride(0),
                                       .conv_stride_c = conv_state.stride(1),
                                       .conv_stride_w = conv_state.stride(2),
                                       .weight = float_ptr<scalar_t>(weight),
                                       .bias = bias.defined() ? float_ptr<scalar_t>(bias) : nullptr,
                                       .parents = const_data<int64_t>(parents),
                                       .batch = B,
                                       .channels = C,
                                       .num_nodes = N,
                                       .width = K,
                                       .silu = silu,
                                       .out = reinterpret_cast<scalar_t*>(mutable_data(out)),
                                       .status = status_ptr(status)};
    Backend::tree_causal_conv1d(p);
  });
  if (validate) raise_on_bad_status(op, status);
  return out;
}

template <class Backend>
void commit_conv_state_impl(const at::Tensor& conv_state, const at::Tensor& x, const at::Tensor& path_in,
                            const at::Tensor& lengths_in, bool validate) {
  constexpr const char* op = "commit_conv_state";
  check_dim(op, "conv_state", conv_state, 3, "[B, C, K - 1]");
  check_dtype(op, "conv_state", conv_state, at::kFloat);
  const int64_t B = conv_state.size(0), C = conv_state.size(1), W = conv_state.size(2);
  SPECDEC_CHECK(B >= 1 && C >= 1, op, ": conv_state must have B >= 1 rows and C >= 1 channels [B, C, K - 1], got ",
                shape_str(conv_state));
  check_dim(op, "x", x, 3, "[B, C, N]");
  check_float(op, "x", x);
  check_same_device(op, "x", x, conv_state, "conv_state");
  const int64_t N = x.size(2);
  SPECDEC_CHECK(x.size(0) == B && x.size(1) == C && N >= 1, op, ": x must have shape [B, C, N] with conv_state's B = ",
                B, ", C = ", C, " and N >= 1, got ", shape_str(x));
  const auto [path, lengths] = checked_path(op, path_in, lengths_in, B, conv_state, "conv_state");
  check_no_overlap(op, "conv_state", conv_state, "x", x);
  check_no_overlap(op, "conv_state", conv_state, "path", path_in);
  check_no_overlap(op, "conv_state", conv_state, "lengths", lengths_in);
  c10::OptionalDeviceGuard guard(conv_state.device());
  at::Tensor status = new_status(B, conv_state);
  SPECDEC_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    CommitConvStateParams<scalar_t> p{.conv_state = mutable_data<float>(conv_state),
                                      .conv_stride_b = conv_state.stride(0),
                                      .conv_stride_c = conv_state.stride(1),
                                      .conv_stride_w = conv_state.stride(2),
                                      .x = float_ptr<scalar_t>(x),
                                      .x_stride_b = x.stride(0),
                                      .x_stride_c = x.stride(1),
                                      .x_stride_n = x.stride(2),
                                      .path = const_data<int64_t>(path),
                                      .lengths = const_data<int64_t>(lengths),
                                      .batch = B,
                                      .channels = C,
                                      .num_nodes = N,
                                      .max_len = path.size(1),
                                      .window = W,
                                      .status = status_ptr(status)};
    Backend::commit_conv_state(p);
  });
  if (validate) raise_on_bad_status(op, status);
}

// A per-node gate [B, H, N] float32 on `ref`'s device (any strides).
inline void check_gate(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                       const char* ref_name, int64_t B, int64_t H, int64_t N) {
  check_dtype(op, name, t, at::kFloat);
  check_same_device(op, name, t, ref, ref_name);
  check_shape(op, name, t, {B, H, N}, "[B, H, N]");
}

// A per-head parameter [H] float32 on `ref`'s device, returned contiguous.
inline at::Tensor checked_head_vector(const char* op, const char* name, const at::Tensor& t, int64_t H,
                                      const at::Tensor& ref, const char* ref_name) {
  check_dtype(op, name, t, at::kFloat);
  check_same_device(op, name, t, ref, ref_name);
  check_shape(op, name, t, {H}, "[H]");
  return t.contiguous();
}

template <class Backend>
at::Tensor tree_gated_delta_rule_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                      const at::Tensor& parents_in, bool validate) {
  constexpr const char* op = "tree_gated_delta_rule";
  check_dim(op, "v", v, 4, "[B, H, N, Dv]");
  check_float(op, "v", v);
  const int64_t B = v.size(0), H = v.size(1), N = v.size(2);
  SPECDEC_CHECK(B >= 1 && H >= 1 && N >= 1, op, ": v must be non-empty [B, H, N, Dv], got ", shape_str(v));
  const int64_t Dv = check_node_tensor(op, "v", v, v, "v", B, H, N, "[B, H, N, Dv]");
  const int64_t Dk = check_node_tensor(op, "q", q, v, "v", B, H, N, "[B, H, N, Dk]");
  SPECDEC_CHECK(check_node_tensor(op, "k", k, v, "v", B, H, N, "[B, H, N, Dk]") == Dk, op,
                ": k must have q's shape ", shape_str(q), ", got ", shape_str(k));
  check_gate(op, "g", g, v, "v", B, H, N);
  check_gate(op, "beta", beta, v, "v", B, H, N);
  check_state(op, "state", state, v, "v", {B, H, Dk, Dv}, "[B, H, Dk, Dv]");
  const at::Tensor parents = checked_index_matrix(op, "parents", parents_in, B, N, v, "v");
  c10::OptionalDeviceGuard guard(v.device());
  at::Tensor out = at::empty({B, H, N, Dv}, v.options());
  at::Tensor status = new_status(B, v);
  SPECDEC_DISPATCH_FLOAT(v.scalar_type(), op, [&] {
    TreeGatedDeltaParams<scalar_t> p{.q = float_ptr<scalar_t>(q),
                                     .q_stride_b = q.stride(0),
                                     .q_stride_h = q.stride(1),
                                     .q_stride_n = q.stride(2),
                                     .k = float_ptr<scalar_t>(k),
                                     .k_stride_b = k.stride(0),
                                     .k_stride_h = k.stride(1),
                                     .k_stride_n = k.stride(2),
                                     .v = float_ptr<scalar_t>(v),
                                     .v_stride_b = v.stride(0),
                                     .v_stride_h = v.stride(1),
                                     .v_stride_n = v.stride(2),
                                     .g = const_data<float>(g),
                                     .beta = const_data<float>(beta),
                                     .gate_stride_b = g.stride(0),
                                     .gate_stride_h = g.stride(1),
                                     .gate_stride_n = g.stride(2),
                                     .beta_stride_b = beta.stride(0),
                                     .beta_stride_h = beta.stride(1),
                                     .beta_stride_n = beta.stride(2),
                                     .state = const_data<float>(state),
                                     .state_stride_b = state.stride(0),
                                     .state_stride_h = state.stride(1),
                                     .state_stride_k = state.stride(2),
                                     .parents = const_data<int64_t>(parents),
                                     .batch = B,
                                     .num_heads = H,
                                     .num_nodes = N,
                                     .key_dim = Dk,
                                     .value_dim = Dv,
                                     .out = reinterpret_cast<scalar_t*>(mutable_data(out)),
                                     .status = status_ptr(status)};
    Backend::tree_gated_delta_rule(p);
  });
  if (validate) raise_on_bad_status(op, status);
  return out;
}

// state [B, H, R, C] float32 to be written in place (unit last stride); returns its sizes' B and H.
inline std::pair<int64_t, int64_t> check_commit_state(const char* op, const at::Tensor& state, const char* layout) {
  check_dim(op, "state", state, 4, layout);
  check_dtype(op, "state", state, at::kFloat);
  SPECDEC_CHECK(state.size(0) >= 1 && state.size(1) >= 1 && state.size(2) >= 1 && state.size(3) >= 1, op,
                ": state must be non-empty ", layout, ", got ", shape_str(state));
  check_unit_last_stride(op, "state", state);
  return {state.size(0), state.size(1)};
}

template <class Backend>
void commit_gated_delta_state_impl(const at::Tensor& state, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& g, const at::Tensor& beta, const at::Tensor& path_in,
                                   const at::Tensor& lengths_in, bool validate) {
  constexpr const char* op = "commit_gated_delta_state";
  const auto [B, H] = check_commit_state(op, state, "[B, H, Dk, Dv]");
  const int64_t Dk = state.size(2), Dv = state.size(3);
  check_dim(op, "k", k, 4, "[B, H, N, Dk]");
  check_float(op, "k", k);
  check_same_device(op, "k", k, state, "state");
  const int64_t N = k.size(2);
  SPECDEC_CHECK(N >= 1, op, ": k must hold N >= 1 nodes [B, H, N, Dk], got ", shape_str(k));
  SPECDEC_CHECK(check_node_tensor(op, "k", k, k, "k", B, H, N, "[B, H, N, Dk]") == Dk, op,
                ": k must have shape [B, H, N, Dk] with state's Dk = ", Dk, ", got ", shape_str(k));
  SPECDEC_CHECK(check_node_tensor(op, "v", v, k, "k", B, H, N, "[B, H, N, Dv]") == Dv, op,
                ": v must have shape [B, H, N, Dv] with state's Dv = ", Dv, ", got ", shape_str(v));
  check_gate(op, "g", g, state, "state", B, H, N);
  check_gate(op, "beta", beta, state, "state", B, H, N);
  const auto [path, lengths] = checked_path(op, path_in, lengths_in, B, state, "state");
  check_no_overlap(op, "state", state, "k", k);
  check_no_overlap(op, "state", state, "v", v);
  check_no_overlap(op, "state", state, "g", g);
  check_no_overlap(op, "state", state, "beta", beta);
  check_no_overlap(op, "state", state, "path", path_in);
  check_no_overlap(op, "state", state, "lengths", lengths_in);
  c10::OptionalDeviceGuard guard(state.device());
  at::Tensor status = new_status(B, state);
  SPECDEC_DISPATCH_FLOAT(k.scalar_type(), op, [&] {
    CommitGatedDeltaParams<scalar_t> p{.state = mutable_data<float>(state),
                                       .state_stride_b = state.stride(0),
                                       .state_stride_h = state.stride(1),
                                       .state_stride_k = state.stride(2),
                                       .k = float_ptr<scalar_t>(k),
                                       .k_stride_b = k.stride(0),
                                       .k_stride_h = k.stride(1),
                                       .k_stride_n = k.stride(2),
                                       .v = float_ptr<scalar_t>(v),
                                       .v_stride_b = v.stride(0),
                                       .v_stride_h = v.stride(1),
                                       .v_stride_n = v.stride(2),
                                       .g = const_data<float>(g),
                                       .beta = const_data<float>(beta),
                                       .gate_stride_b = g.stride(0),
                                       .gate_stride_h = g.stride(1),
                                       .gate_stride_n = g.stride(2),
                                       .beta_stride_b = beta.stride(0),
                                       .beta_stride_h = beta.stride(1),
                                       .beta_stride_n = beta.stride(2),
                                       .path = const_data<int64_t>(path),
                                       .lengths = const_data<int64_t>(lengths),
                                       .batch = B,
                                       .num_heads = H,
                                       .num_nodes = N,
                                       .max_len = path.size(1),
                                       .key_dim = Dk,
                                       .value_dim = Dv,
                                       .status = status_ptr(status)};
    Backend::commit_gated_delta_state(p);
  });
  if (validate) raise_on_bad_status(op, status);
}

template <class Backend>
at::Tensor tree_selective_state_impl(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A_in,
                                     const at::Tensor& Bm, const at::Tensor& Cm, const at::Tensor& D_in,
                                     const at::Tensor& state, const at::Tensor& parents_in, bool validate) {
  constexpr const char* op = "tree_selective_state";
  check_dim(op, "x", x, 4, "[B, H, N, P]");
  check_float(op, "x", x);
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2);
  SPECDEC_CHECK(B >= 1 && H >= 1 && N >= 1, op, ": x must be non-empty [B, H, N, P], got ", shape_str(x));
  const int64_t P = check_node_tensor(op, "x", x, x, "x", B, H, N, "[B, H, N, P]");
  const int64_t Ds = check_node_tensor(op, "Bm", Bm, x, "x", B, H, N, "[B, H, N, Ds]");
  SPECDEC_CHECK(check_node_tensor(op, "Cm", Cm, x, "x", B, H, N, "[B, H, N, Ds]") == Ds, op,
                ": Cm must have Bm's shape ", shape_str(Bm), ", got ", shape_str(Cm));
  check_gate(op, "dt", dt, x, "x", B, H, N);
  const at::Tensor A = checked_head_vector(op, "A", A_in, H, x, "x");
  const at::Tensor D = checked_head_vector(op, "D", D_in, H, x, "x");
  check_state(op, "state", state, x, "x", {B, H, P, Ds}, "[B, H, P, Ds]");
  const at::Tensor parents = checked_index_matrix(op, "parents", parents_in, B, N, x, "x");
  c10::OptionalDeviceGuard guard(x.device());
  at::Tensor out = at::empty({B, H, N, P}, x.options());
  at::Tensor status = new_status(B, x);
  SPECDEC_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    TreeSelectiveStateParams<scalar_t> p{.x = float_ptr<scalar_t>(x),
                                         .x_stride_b = x.stride(0),
                                         .x_stride_h = x.stride(1),
                                         .x_stride_n = x.stride(2),
                                         .dt = const_data<float>(dt),
                                         .dt_stride_b = dt.stride(0),
                                         .dt_stride_h = dt.stride(1),
                                         .dt_stride_n = dt.stride(2),
                                         .A = const_data<float>(A),
                                         .Bm = float_ptr<scalar_t>(Bm),
                                         .bm_stride_b = Bm.stride(0),
                                         .bm_stride_h = Bm.stride(1),
                                         .bm_stride_n = Bm.stride(2),
                                         .Cm = float_ptr<scalar_t>(Cm),
                                         .cm_stride_b = Cm.stride(0),
                                         .cm_stride_h = Cm.stride(1),
                                         .cm_stride_n = Cm.stride(2),
                                         .D = const_data<float>(D),
                                         .state = const_data<float>(state),
                                         .state_stride_b = state.stride(0),
                                         .state_stride_h = state.stride(1),
                                         .state_stride_p = state.stride(2),
                                         .parents = const_data<int64_t>(parents),
                                         .batch = B,
                                         .num_heads = H,
                                         .num_nodes = N,
                                         .head_dim = P,
                                         .state_dim = Ds,
                                         .out = reinterpret_cast<scalar_t*>(mutable_data(out)),
                                         .status = status_ptr(status)};
    Backend::tree_selective_state(p);
  });
  if (validate) raise_on_bad_status(op, status);
  return out;
}

template <class Backend>
void commit_selective_state_impl(const at::Tensor& state, const at::Tensor& x, const at::Tensor& dt,
                                 const at::Tensor& A_in, const at::Tensor& Bm, const at::Tensor& path_in,
                                 const at::Tensor& lengths_in, bool validate) {
  constexpr const char* op = "commit_selective_state";
  const auto [B, H] = check_commit_state(op, state, "[B, H, P, Ds]");
  const int64_t P = state.size(2), Ds = state.size(3);
  check_dim(op, "x", x, 4, "[B, H, N, P]");
  check_float(op, "x", x);
  check_same_device(op, "x", x, state, "state");
  const int64_t N = x.size(2);
  SPECDEC_CHECK(N >= 1, op, ": x must hold N >= 1 nodes [B, H, N, P], got ", shape_str(x));
  SPECDEC_CHECK(check_node_tensor(op, "x", x, x, "x", B, H, N, "[B, H, N, P]") == P, op,
                ": x must have shape [B, H, N, P] with state's P = ", P, ", got ", shape_str(x));
  SPECDEC_CHECK(check_node_tensor(op, "Bm", Bm, x, "x", B, H, N, "[B, H, N, Ds]") == Ds, op,
                ": Bm must have shape [B, H, N, Ds] with state's Ds = ", Ds, ", got ", shape_str(Bm));
  check_gate(op, "dt", dt, state, "state", B, H, N);
  const at::Tensor A = checked_head_vector(op, "A", A_in, H, state, "state");
  const auto [path, lengths] = checked_path(op, path_in, lengths_in, B, state, "state");
  check_no_overlap(op, "state", state, "x", x);
  check_no_overlap(op, "state", state, "dt", dt);
  check_no_overlap(op, "state", state, "A", A_in);
  check_no_overlap(op, "state", state, "Bm", Bm);
  check_no_overlap(op, "state", state, "path", path_in);
  check_no_overlap(op, "state", state, "lengths", lengths_in);
  c10::OptionalDeviceGuard guard(state.device());
  at::Tensor status = new_status(B, state);
  SPECDEC_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    CommitSelectiveStateParams<scalar_t> p{.state = mutable_data<float>(state),
                                           .state_stride_b = state.stride(0),
                                           .state_stride_h = state.stride(1),
                                           .state_stride_p = state.stride(2),
                                           .x = float_ptr<scalar_t>(x),
                                           .x_stride_b = x.stride(0),
                                           .x_stride_h = x.stride(1),
                                           .x_stride_n = x.stride(2),
                                           .dt = const_data<float>(dt),
                                           .dt_stride_b = dt.stride(0),
                                           .dt_stride_h = dt.stride(1),
                                           .dt_stride_n = dt.stride(2),
                                           .A = const_data<float>(A),
                                           .Bm = float_ptr<scalar_t>(Bm),
                                           .bm_stride_b = Bm.stride(0),
                                           .bm_stride_h = Bm.stride(1),
                                           .bm_stride_n = Bm.stride(2),
                                           .path = const_data<int64_t>(path),
                                           .lengths = const_data<int64_t>(lengths),
                                           .batch = B,
                                           .num_heads = H,
                                           .num_nodes = N,
                                           .max_len = path.size(1),
                                           .head_dim = P,
                                           .state_dim = Ds,
                                           .status = status_ptr(status)};
    Backend::commit_selective_state(p);
  });
  if (validate) raise_on_bad_status(op, status);
}

// Registers the recurrent ops' implementations for one dispatch key of one library, beside
// SPECDEC_REGISTER_BACKEND: `SPECDEC_REGISTER_RECURRENT(specdec_ext, CPU, CpuRecurrentBackend)`.
#define SPECDEC_REGISTER_RECURRENT(LIBRARY, KEY, BACKEND)                                             \
  TORCH_LIBRARY_IMPL(LIBRARY, KEY, m) {                                                               \
    m.impl("tree_linear_attention", &::specdec::glue::tree_linear_attention_impl<BACKEND>);           \
    m.impl("commit_linear_state", &::specdec::glue::commit_linear_state_impl<BACKEND>);               \
    m.impl("tree_causal_conv1d", &::specdec::glue::tree_causal_conv1d_impl<BACKEND>);                 \
    m.impl("commit_conv_state", &::specdec::glue::commit_conv_state_impl<BACKEND>);                   \
    m.impl("tree_gated_delta_rule", &::specdec::glue::tree_gated_delta_rule_impl<BACKEND>);           \
    m.impl("commit_gated_delta_state", &::specdec::glue::commit_gated_delta_state_impl<BACKEND>);     \
    m.impl("tree_selective_state", &::specdec::glue::tree_selective_state_impl<BACKEND>);             \
    m.impl("commit_selective_state", &::specdec::glue::commit_selective_state_impl<BACKEND>);         \
  }

}  // namespace specdec::glue
