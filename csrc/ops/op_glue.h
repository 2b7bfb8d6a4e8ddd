// Thin glue shared by both backends: argument checks, output allocation, dtype dispatch and status reporting.
//
// Each op is written once as `<op>_impl<Backend>(...)`. A backend is a struct with one static template per kernel
// (`Backend::verify_tree_greedy(params)` etc.) that runs it: CpuBackend (ops_cpu.cpp) parallelises rows with
// at::parallel_for, CudaBackend (ops_cuda.cu) launches on the current stream. The backends register these
// functions for their dispatch key; MetaBackend (ops_meta.cpp) runs nothing, so that the checks alone run on meta
// tensors (registry.cpp, specdec_ext_checks).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../kernels/common/dtype.h"
#include "../kernels/common/params.h"
#include "checks.h"

namespace specdec::glue {

using at::Tensor;

// Runs `body` with `scalar_t` set to the kernel storage type (float, f16 or bf16) of `dtype`.
#define SPECDEC_DISPATCH_FLOAT(dtype, op, ...)                                   \
  [&] {                                                                          \
    switch (dtype) {                                                             \
      case at::kFloat: {                                                         \
        using scalar_t = float;                                                  \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case at::kHalf: {                                                          \
        using scalar_t = ::specdec::f16;                                         \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case at::kBFloat16: {                                                      \
        using scalar_t = ::specdec::bf16;                                        \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      default:                                                                   \
        SPECDEC_CHECK(false, op, ": unsupported float dtype ", dtype);           \
    }                                                                            \
  }()

template <typename T>
const T* float_ptr(const Tensor& t) {
  return reinterpret_cast<const T*>(const_data(t));
}

// parents [B, N] (and optionally tokens [B, N]): int64, on `ref`'s device; returned contiguous.
inline Tensor checked_index_matrix(const char* op, const char* name, const Tensor& t, int64_t B, int64_t N,
                                   const Tensor& ref, const char* ref_name) {
  check_dtype(op, name, t, at::kLong);
  check_same_device(op, name, t, ref, ref_name);
  check_shape(op, name, t, {B, N}, "[B, N]");
  return t.contiguous();
}

// A per-row parameter vector [B] of `dtype`, returned contiguous.
inline Tensor checked_row_vector(const char* op, const char* name, const Tensor& t, int64_t B, at::ScalarType dtype,
                                 const Tensor& ref, const char* ref_name) {
  check_dtype(op, name, t, dtype);
  check_same_device(op, name, t, ref, ref_name);
  check_shape(op, name, t, {B}, "[B]");
  return t.contiguous();
}

inline void check_tree_args(const char* op, const Tensor& parents) {
  check_dim(op, "parents", parents, 2, "[B, N]");
  check_dtype(op, "parents", parents, at::kLong);
  SPECDEC_CHECK(parents.size(0) >= 1 && parents.size(1) >= 1, op, ": parents must be non-empty [B, N], got ",
                shape_str(parents));
}

// Tree topology -------------------------------------------------------------------------------------------------

template <class Backend>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_tree_impl(const Tensor& parents_in,
                                                                           const Tensor& prefix_lens_in,
                                                                           bool validate) {
  constexpr const char* op = "build_tree";
  check_tree_args(op, parents_in);
  const int64_t B = parents_in.size(0), N = parents_in.size(1);
  const Tensor parents = parents_in.contiguous();
  const Tensor prefix_lens = checked_row_vector(op, "prefix_lens", prefix_lens_in, B, at::kLong, parents, "parents");
  c10::OptionalDeviceGuard guard(parents.device());
  auto opts = parents.options();
  Tensor depth = at::empty({B, N}, opts), position_ids = at::empty({B, N}, opts);
  Tensor first_child = at::empty({B, N}, opts), next_sibling = at::empty({B, N}, opts);
  Tensor paths = at::empty({B, N, N}, opts), num_leaves = at::empty({B}, opts);
  Tensor status = new_status(B, parents);
  BuildTreeParams p{.parents = const_data<int64_t>(parents),
                    .prefix_lens = const_data<int64_t>(prefix_lens),
                    .batch = B,
                    .num_nodes = N,
                    .depth = mutable_data<int64_t>(depth),
                    .position_ids = mutable_data<int64_t>(position_ids),
                    .first_child = mutable_data<int64_t>(first_child),
                    .next_sibling = mutable_data<int64_t>(next_sibling),
                    .retrieve_paths = mutable_data<int64_t>(paths),
                    .num_leaves = mutable_data<int64_t>(num_leaves),
                    .status = status_ptr(status)};
  Backend::build_tree(p);
  if (validate) raise_on_bad_status(op, status);
  return {depth, position_ids, first_child, next_sibling, paths, num_leaves};
}

template <class Backend>
Tensor tree_ancestor_mask_impl(const Tensor& parents_in, bool packed, bool validate) {
  constexpr const char* op = "tree_ancestor_mask";
  check_tree_args(op, parents_in);
  const int64_t B = parents_in.size(0), N = parents_in.size(1);
  const Tensor parents = parents_in.contiguous();
  c10::OptionalDeviceGuard guard(parents.device());
  Tensor mask = packed ? at::empty({B, N, packed_mask_words(N)}, parents.options().dtype(at::kInt))
                       : at::empty({B, N, N}, parents.options().dtype(at::kBool));
  Tensor status = new_status(B, parents);
  TreeMaskParams p{.parents = const_data<int64_t>(parents),
                   .batch = B,
                   .num_nodes = N,
                   .dense = packed ? nullptr : mutable_data<bool>(mask),
                   .packed = packed ? mutable_data<int32_t>(mask) : nullptr,
                   .status = status_ptr(status)};
  Backend::tree_ancestor_mask(p);
  if (validate) raise_on_bad_status(op, status);
  return mask;
}

// Dynamic-tree bookkeeping ----------------------------------------------------------------------------------------

template <class Backend>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> advance_tree_frontier_impl(const Tensor& cand_tokens_in,
                                                                              const Tensor& cand_scores_in,
                                                                              const Tensor& selected_in,
                                                                              const Tensor& ancestors_in,
                                                                              int64_t self_column,
                                                                              const Tensor& column_in,
                                                                              bool validate) {
  constexpr const char* op = "advance_tree_frontier";
  check_dim(op, "cand_tokens", cand_tokens_in, 3, "[B, F, K]");
  check_dtype(op, "cand_tokens", cand_tokens_in, at::kLong);
  const int64_t B = cand_tokens_in.size(0), F = cand_tokens_in.size(1), K = cand_tokens_in.size(2);
  SPECDEC_CHECK(B >= 1 && F >= 1 && K >= 1, op, ": cand_tokens must be non-empty [B, F, K], got ",
                shape_str(cand_tokens_in));
  check_dtype(op, "cand_scores", cand_scores_in, at::kFloat);
  check_same_device(op, "cand_scores", cand_scores_in, cand_tokens_in, "cand_tokens");
  check_shape(op, "cand_scores", cand_scores_in, {B, F, K}, "[B, F, K]");
  check_dtype(op, "selected", selected_in, at::kLong);
  check_same_device(op, "selected", selected_in, cand_tokens_in, "cand_tokens");
  check_dim(op, "selected", selected_in, 2, "[B, S]");
  const int64_t S = selected_in.size(1);
  SPECDEC_CHECK(selected_in.size(0) == B && S >= 1, op, ": selected must have shape [B, S] with B = ", B,
                " and S >= 1, got ", shape_str(selected_in));
  check_dtype(op, "ancestors", ancestors_in, at::kBool);
  check_same_device(op, "ancestors", ancestors_in, cand_tokens_in, "cand_tokens");
  check_dim(op, "ancestors", ancestors_in, 3, "[B, F, C]");
  const int64_t C = ancestors_in.size(2);
  SPECDEC_CHECK(ancestors_in.size(0) == B && ancestors_in.size(1) == F && C >= 1, op,
                ": ancestors must have shape [B, F, C] with B = ", B, ", F = ", F, " and C >= 1, got ",
                shape_str(ancestors_in));
  // (self_column <= C - S, not self_column + S <= C: the sum wraps for self_column near 2^63)
  SPECDEC_CHECK(S <= C && self_column >= 0 && self_column <= C - S, op, ": self_column must be in [0, C - S] = [0, ",
                C - S, "] (the new frontier's own columns self_column .. self_column + S - 1), got ", self_column);
  check_dtype(op, "column", column_in, at::kLong);
  check_same_device(op, "column", column_in, cand_tokens_in, "cand_tokens");
  check_dim(op, "column", column_in, 2, "[B, L]");
  const int64_t L = column_in.size(1);
  SPECDEC_CHECK(column_in.size(0) == B, op, ": column must have shape [B, L] with B = ", B, ", got ",
                shape_str(column_in));
  const Tensor cand_tokens = cand_tokens_in.contiguous(), cand_scores = cand_scores_in.contiguous();
  const Tensor selected = selected_in.contiguous(), ancestors = ancestors_in.contiguous();
  const Tensor column = column_in.contiguous();
  c10::OptionalDeviceGuard guard(cand_tokens.device());
  auto opts = cand_tokens.options();
  Tensor tokens = at::empty({B, S}, opts), parents = at::empty({B, S}, opts);
  Tensor scores = at::empty({B, S}, opts.dtype(at::kFloat));
  Tensor ancestors_out = at::empty({B, S, C}, opts.dtype(at::kBool));
  Tensor mask = at::empty({B, S, L}, opts.dtype(at::kBool));
  Tensor status = new_status(B, cand_tokens);
  AdvanceTreeFrontierParams p{.cand_tokens = const_data<int64_t>(cand_tokens),
                              .cand_scores = const_data<float>(cand_scores),
                              .selected = const_data<int64_t>(selected),
                              .ancestors = const_data<bool>(ancestors),
                              .column = const_data<int64_t>(column),
                              .batch = B,
                              .frontier = F,
                              .top_k = K,
                              .num_select = S,
                              .columns = C,
                              .self_column = self_column,
                              .positions = L,
                              .tokens = mutable_data<int64_t>(tokens),
                              .scores = mutable_data<float>(scores),
                              .parents = mutable_data<int64_t>(parents),
                              .ancestors_out = mutable_data<bool>(ancestors_out),
                              .mask = mutable_data<bool>(mask),
                              .status = status_ptr(status)};
  Backend::advance_tree_frontier(p);
  if (validate) raise_on_bad_status(op, status);
  return {tokens, scores, parents, ancestors_out, mask};
}

template <class Backend>
std::tuple<Tensor, Tensor> select_tree_nodes_impl(const Tensor& tokens_in, const Tensor& scores_in,
                                                  const Tensor& parents_in, const Tensor& roots_in, int64_t num_nodes,
                                                  bool validate) {
  constexpr const char* op = "select_tree_nodes";
  check_dim(op, "tokens", tokens_in, 2, "[B, C]");
  check_dtype(op, "tokens", tokens_in, at::kLong);
  const int64_t B = tokens_in.size(0), C = tokens_in.size(1);
  SPECDEC_CHECK(B >= 1, op, ": tokens must have shape [B, C] with B >= 1, got ", shape_str(tokens_in));
  check_dtype(op, "scores", scores_in, at::kFloat);
  check_same_device(op, "scores", scores_in, tokens_in, "tokens");
  check_shape(op, "scores", scores_in, {B, C}, "[B, C]");
  const Tensor parents = checked_index_matrix(op, "parents", parents_in, B, C, tokens_in, "tokens");
  const Tensor roots = checked_row_vector(op, "roots", roots_in, B, at::kLong, tokens_in, "tokens");
  SPECDEC_CHECK(num_nodes >= 0, op, ": num_nodes must be >= 0, got ", num_nodes);
  const int64_t M = std::min(num_nodes, C);
  const Tensor tokens = tokens_in.contiguous(), scores = scores_in.contiguous();
  c10::OptionalDeviceGuard guard(tokens.device());
  Tensor tree_tokens = at::empty({B, M + 1}, tokens.options()), tree_parents = at::empty({B, M + 1}, tokens.options());
  Tensor scratch = at::empty({B, 2 * std::max<int64_t>(C, 1)}, tokens.options());
  Tensor status = new_status(B, tokens);
  SelectTreeNodesParams p{.tokens = const_data<int64_t>(tokens),
                          .scores = const_data<float>(scores),
                          .parents = const_data<int64_t>(parents),
                          .roots = const_data<int64_t>(roots),
                          .batch = B,
                          .candidates = C,
                          .num_nodes = M,
                          .tree_tokens = mutable_data<int64_t>(tree_tokens),
                          .tree_parents = mutable_data<int64_t>(tree_parents),
                          .scratch = mutable_data<int64_t>(scratch),
                          .status = status_ptr(status)};
  Backend::select_tree_nodes(p);
  if (validate) raise_on_bad_status(op, status);
  return {tree_tokens, tree_parents};
}

// Verification --------------------------------------------------------------------------------------------------

struct VerifyArgs {
  Tensor tokens, parents;
  int64_t B, N, V;
  Tensor accepted, accept_len, next_token, status;

  VerifyOutputs outputs() {
    return {.accepted = mutable_data<int64_t>(accepted),
            .accept_len = mutable_data<int64_t>(accept_len),
            .next_token = mutable_data<int64_t>(next_token),
            .status = status_ptr(status)};
  }
  std::tuple<Tensor, Tensor, Tensor> result() const { return {accepted, accept_len, next_token}; }
};

inline VerifyArgs check_verify_args(const char* op, const Tensor& logits, const Tensor& tokens,
                                    const Tensor& parents) {
  check_dim(op, "logits", logits, 3, "[B, N, V]");
  check_float(op, "logits", logits);
  check_unit_last_stride(op, "logits", logits);
  const int64_t B = logits.size(0), N = logits.size(1), V = logits.size(2);
  SPECDEC_CHECK(B >= 1 && N >= 1 && V >= 1, op, ": logits must be non-empty [B, N, V], got ", shape_str(logits));
  VerifyArgs a;
  a.B = B;
  a.N = N;
  a.V = V;
  a.tokens = checked_index_matrix(op, "tokens", tokens, B, N, logits, "logits");
  a.parents = checked_index_matrix(op, "parents", parents, B, N, logits, "logits");
  auto opts = logits.options().dtype(at::kLong);
  a.accepted = at::empty({B, N}, opts);
  a.accept_len = at::empty({B}, opts);
  a.next_token = at::empty({B}, opts);
  a.status = new_status(B, logits);
  return a;
}

template <class Backend>
std::tuple<Tensor, Tensor, Tensor> verify_tree_greedy_impl(const Tensor& logits, const Tensor& tokens,
                                                           const Tensor& parents, bool validate) {
  constexpr const char* op = "verify_tree_greedy";
  VerifyArgs a = check_verify_args(op, logits, tokens, parents);
  c10::OptionalDeviceGuard guard(logits.device());
  SPECDEC_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    VerifyTreeGreedyParams<scalar_t> p{.logits = float_ptr<scalar_t>(logits),
                                       .logits_stride_b = logits.stride(0),
                                       .logits_stride_n = logits.stride(1),
                                       .tokens = const_data<int64_t>(a.tokens),
                                       .parents = const_data<int64_t>(a.parents),
                                       .batch = a.B,
                                       .num_nodes = a.N,
                                       .vocab = a.V,
                                       .out = a.outputs()};
    Backend::verify_tree_greedy(p);
  });
  if (validate) raise_on_bad_status(op, a.status);
  return a.result();
}

inline SamplingParams checked_sampling(const char* op, Tensor& temperature, Tensor& top_k, Tensor& top_p, int64_t B,
                                       const Tensor& ref) {
  temperature = checked_row_vector(op, "temperature", temperature, B, at::kFloat, ref, "logits");
  top_k = checked_row_vector(op, "top_k", top_k, B, at::kLong, ref, "logits");
  top_p = checked_row_vector(op, "top_p", top_p, B, at::kFloat, ref, "logits");
  return {.temperature = const_data<float>(temperature),
          .top_k = const_data<int64_t>(top_k),
          .top_p = const_data<float>(top_p)};
}

template <class Backend>
std::tuple<Tensor, Tensor, Tensor> verify_tree_sampling_impl(const Tensor& logits, const Tensor& tokens,
                                                             const Tensor& parents,
                                                             const std::optional<Tensor>& draft_probs,
                                                             const Tensor& uniforms_in, const Tensor& temperature_in,
                                                             const Tensor& top_k_in, const Tensor& top_p_in,
                                                             bool validate) {
  constexpr const char* op = "verify_tree_sampling";
  VerifyArgs a = check_verify_args(op, logits, tokens, parents);
  Tensor temperature = temperature_in, top_k = top_k_in, top_p = top_p_in;
  const SamplingParams sampling = checked_sampling(op, temperature, top_k, top_p, a.B, logits);
  check_dtype(op, "uniforms", uniforms_in, at::kFloat);
  check_same_device(op, "uniforms", uniforms_in, logits, "logits");
  check_shape(op, "uniforms", uniforms_in, {a.B, a.N}, "[B, N]");
  const Tensor uniforms = uniforms_in.contiguous();
  const float* q = nullptr;
  int64_t q_stride_b = 0, q_stride_n = 0;
  Tensor workspace;
  if (draft_probs.has_value()) {
    const Tensor& d = *draft_probs;
    check_dtype(op, "draft_probs", d, at::kFloat);
    check_same_device(op, "draft_probs", d, logits, "logits");
    check_shape(op, "draft_probs", d, {a.B, a.N, a.V}, "[B, N, V]");
    check_unit_last_stride(op, "draft_probs", d);
    q = const_data<float>(d);
    q_stride_b = d.stride(0);
    q_stride_n = d.stride(1);
    workspace = at::empty({a.B, a.V}, logits.options().dtype(at::kFloat));
  }
  c10::OptionalDeviceGuard guard(logits.device());
  SPECDEC_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    VerifyTreeSamplingParams<scalar_t> p{.logits = float_ptr<scalar_t>(logits),
                                         .logits_stride_b = logits.stride(0),
                                         .logits_stride_n = logits.stride(1),
                                         .draft_probs = q,
                                         .draft_stride_b = q_stride_b,
                                         .draft_stride_n = q_stride_n,
                                         .tokens = const_data<int64_t>(a.tokens),
                                         .parents = const_data<int64_t>(a.parents),
                                         .uniforms = const_data<float>(uniforms),
                                         .sampling = sampling,
                                         .batch = a.B,
                                         .num_nodes = a.N,
                                         .vocab = a.V,
                                         .workspace = workspace.defined() ? mutable_data<float>(workspace) : nullptr,
                                         .out = a.outputs()};
    Backend::verify_tree_sampling(p);
  });
  if (validate) raise_on_bad_status(op, a.status);
  return a.result();
}

template <class Backend>
std::tuple<Tensor, Tensor, Tensor> verify_tree_typical_impl(const Tensor& logits, const Tensor& tokens,
                                                            const Tensor& parents, const Tensor& uniforms_in,
                                                            const Tensor& temperature_in, double posterior_threshold,
                                                            double posterior_alpha, bool validate) {
  constexpr const char* op = "verify_tree_typical";
  VerifyArgs a = check_verify_args(op, logits, tokens, parents);
  const Tensor uniforms = checked_row_vector(op, "uniforms", uniforms_in, a.B, at::kFloat, logits, "logits");
  const Tensor temperature =
      checked_row_vector(op, "temperature", temperature_in, a.B, at::kFloat, logits, "logits");
  SPECDEC_CHECK(posterior_threshold >= 0 && posterior_threshold <= 1, op,
                ": posterior_threshold must be in [0, 1], got ", posterior_threshold);
  SPECDEC_CHECK(posterior_alpha >= 0 && posterior_alpha <= 1, op, ": posterior_alpha must be in [0, 1], got ",
                posterior_alpha);
  c10::OptionalDeviceGuard guard(logits.device());
  SPECDEC_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    VerifyTreeTypicalParams<scalar_t> p{.logits = float_ptr<scalar_t>(logits),
                                        .logits_stride_b = logits.stride(0),
                                        .logits_stride_n = logits.stride(1),
                                        .tokens = const_data<int64_t>(a.tokens),
                                        .parents = const_data<int64_t>(a.parents),
                                        .uniforms = const_data<float>(uniforms),
                                        .temperature = const_data<float>(temperature),
                                        .posterior_threshold = posterior_threshold,
                                        .posterior_alpha = posterior_alpha,
                                        .batch = a.B,
                                        .num_nodes = a.N,
                                        .vocab = a.V,
                                        .out = a.outputs()};
    Backend::verify_tree_typical(p);
  });
  if (validate) raise_on_bad_status(op, a.status);
  return a.result();
}

// Draft sampling ------------------------------------------------------------------------------------------------

template <class Backend>
std::tuple<Tensor, Tensor> sample_tokens_impl(const Tensor& logits, const Tensor& uniforms_in,
                                              const Tensor& temperature_in, const Tensor& top_k_in,
                                              const Tensor& top_p_in, bool validate) {
  constexpr const char* op = "sample_tokens";
  check_dim(op, "logits", logits, 2, "[R, V]");
  check_float(op, "logits", logits);
  check_unit_last_stride(op, "logits", logits);
  const int64_t R = logits.size(0), V = logits.size(1);
  SPECDEC_CHECK(R >= 1 && V >= 1, op, ": logits must be non-empty [R, V], got ", shape_str(logits));
  const Tensor uniforms = checked_row_vector(op, "uniforms", uniforms_in, R, at::kFloat, logits, "logits");
  Tensor temperature = temperature_in, top_k = top_k_in, top_p = top_p_in;
  const SamplingParams sampling = checked_sampling(op, temperature, top_k, top_p, R, logits);
  c10::OptionalDeviceGuard guard(logits.device());
  Tensor tokens = at::empty({R}, logits.options().dtype(at::kLong));
  Tensor probs = at::empty({R, V}, logits.options().dtype(at::kFloat));
  Tensor status = new_status(R, logits);
  SPECDEC_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    SampleTokensParams<scalar_t> p{.logits = float_ptr<scalar_t>(logits),
                                   .logits_stride_r = logits.stride(0),
                                   .uniforms = const_data<float>(uniforms),
                                   .sampling = sampling,
                                   .rows = R,
                                   .vocab = V,
                                   .tokens = mutable_data<int64_t>(tokens),
                                   .probs = mutable_data<float>(probs),
                                   .status = status_ptr(status)};
    Backend::sample_tokens(p);
  });
  if (validate) raise_on_bad_status(op, status);
  return {tokens, probs};
}

template <class Backend>
std::tuple<Tensor, Tensor, Tensor> expand_tree_step_impl(const Tensor& logits, const Tensor& parent_scores_in,
                                                         int64_t top_k, int64_t num_select, bool validate) {
  constexpr const char* op = "expand_tree_step";
  check_dim(op, "logits", logits, 3, "[B, F, V]");
  check_float(op, "logits", logits);
  check_unit_last_stride(op, "logits", logits);
  const int64_t B = logits.size(0), F = logits.size(1), V = logits.size(2);
  SPECDEC_CHECK(B >= 1 && F >= 1 && V >= 1, op, ": logits must be non-empty [B, F, V], got ", shape_str(logits));
  check_dtype(op, "parent_scores", parent_scores_in, at::kFloat);
  check_same_device(op, "parent_scores", parent_scores_in, logits, "logits");
  check_shape(op, "parent_scores", parent_scores_in, {B, F}, "[B, F]");
  SPECDEC_CHECK(top_k >= 1 && top_k <= V, op, ": top_k must be in [1, V = ", V, "], got ", top_k);
  SPECDEC_CHECK(num_select >= 1 && num_select <= F * top_k, op, ": num_select must be in [1, F * top_k = ",
                F * top_k, "], got ", num_select);
  const Tensor parent_scores = parent_scores_in.contiguous();
  c10::OptionalDeviceGuard guard(logits.device());
  Tensor cand_tokens = at::empty({B, F, top_k}, logits.options().dtype(at::kLong));
  Tensor cand_scores = at::empty({B, F, top_k}, logits.options().dtype(at::kFloat));
  Tensor selected = at::empty({B, num_select}, logits.options().dtype(at::kLong));
  Tensor status = new_status(B, logits);
  // Per-node scratch only for backends that expand frontier nodes in a separate phase (the CPU's): no allocation
  // in the CUDA backend's EAGLE-2 hot path.
  Tensor node_status;
  if (Backend::kExpandNeedsNodeStatus) node_status = new_status(B * F, logits);
  SPECDEC_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    ExpandTreeStepParams<scalar_t> p{.logits = float_ptr<scalar_t>(logits),
                                     .logits_stride_b = logits.stride(0),
                                     .logits_stride_f = logits.stride(1),
                                     .parent_scores = const_data<float>(parent_scores),
                                     .batch = B,
                                     .frontier = F,
                                     .vocab = V,
                                     .top_k = top_k,
                                     .num_select = num_select,
                                     .cand_tokens = mutable_data<int64_t>(cand_tokens),
                                     .cand_scores = mutable_data<float>(cand_scores),
                                     .selected = mutable_data<int64_t>(selected),
                                     .status = status_ptr(status),
                                     .node_status = node_status.defined() ? status_ptr(node_status) : nullptr};
    Backend::expand_tree_step(p);
  });
  if (validate) raise_on_bad_status(op, status);
  return {cand_tokens, cand_scores, selected};
}

// Linear layers over a packed weight --------------------------------------------------------------------------------

// The packed layout's shape for weight[N, K] of `dtype` (common/params.h): [ceil(N / 32), ceil(K / P), 32, P].
inline std::vector<int64_t> packed_linear_shape(const char* op, at::ScalarType dtype, int64_t N, int64_t K) {
  const int64_t P = SPECDEC_DISPATCH_FLOAT(dtype, op, [&] { return linear_pack_pair<scalar_t>(); });
  return {ceil_div(N, kLinearPanel), ceil_div(K, P), kLinearPanel, P};
}

// The output features a packed weight (pack_linear_weight's output, shape already checked) holds: the first
// padding row of its last panel, found by the marker in the first column (params.h); every row when the panel is
// full. -1 for a weight on a device: reading it back would synchronise, so that check is the CPU's only.
inline int64_t packed_rows_held(const Tensor& w) {
  if (!w.device().is_cpu()) return -1;
  const int64_t panels = w.size(0), es = static_cast<int64_t>(w.element_size());
  const uint32_t pad =
      SPECDEC_DISPATCH_FLOAT(w.scalar_type(), "packed_linear", [&] { return LinearPad<scalar_t>::bits; });
  const auto* last = static_cast<const unsigned char*>(w.const_data_ptr()) + (panels - 1) * w.stride(0) * es;
  for (int64_t lane = 0; lane < kLinearPanel; ++lane) {
    const unsigned char* e = last + lane * w.stride(2) * es;  // [panels - 1][0][lane][0]
    uint32_t bits = 0;
    if (es == 4) {
      std::memcpy(&bits, e, 4);
    } else {
      uint16_t b16 = 0;
      std::memcpy(&b16, e, 2);
      bits = b16;
    }
    if (bits == pad) return (panels - 1) * kLinearPanel + lane;
  }
  return panels * kLinearPanel;
}

// `w` (shape-checked pack_linear_weight output) holds exactly N output features.
inline void check_packed_rows(const char* op, const char* name, const Tensor& w, int64_t N, const std::string& what) {
  const int64_t held = packed_rows_held(w);
  SPECDEC_CHECK(held < 0 || held == N, op, ": ", name, " holds ", held, " output features (pack_linear_weight's ",
                "output for a weight of ", held, " rows) but ", what, " = ", N);
}

template <class Backend>
Tensor pack_linear_weight_impl(const Tensor& weight_in) {
  constexpr const char* op = "pack_linear_weight";
  check_dim(op, "weight", weight_in, 2, "[out_features, in_features]");
  check_float(op, "weight", weight_in);
  const int64_t N = weight_in.size(0), K = weight_in.size(1);
  SPECDEC_CHECK(N >= 1 && K >= 1, op, ": weight must be non-empty [out_features, in_features], got ",
                shape_str(weight_in));
  const Tensor weight = weight_in.contiguous();
  c10::OptionalDeviceGuard guard(weight.device());
  Tensor packed = at::empty(packed_linear_shape(op, weight.scalar_type(), N, K), weight.options());
  SPECDEC_DISPATCH_FLOAT(weight.scalar_type(), op, [&] {
    PackLinearWeightParams<scalar_t> p{.weight = float_ptr<scalar_t>(weight),
                                       .out_features = N,
                                       .in_features = K,
                                       .packed = reinterpret_cast<scalar_t*>(mutable_data(packed))};
    Backend::pack_linear_weight(p);
  });
  return packed;
}

// A linear product's optional bias: [out_features] of x's dtype and device, returned contiguous (undefined if absent).
inline Tensor checked_linear_bias(const char* op, const std::optional<Tensor>& bias_in, const Tensor& x, int64_t N) {
  if (!bias_in.has_value()) return Tensor();
  const Tensor& bias = *bias_in;
  check_dtype(op, "bias", bias, x.scalar_type());
  check_same_device(op, "bias", bias, x, "x");
  check_shape(op, "bias", bias, {N}, "[out_features]");
  return bias.contiguous();
}

// x[..., K] as a linear product's M contiguous rows [M, K], and the output's sizes [..., N].
struct LinearRows {
  Tensor x;
  int64_t rows;
  std::vector<int64_t> out_sizes;
};
inline LinearRows linear_rows(const Tensor& x_in, int64_t K, int64_t N) {
  const int64_t M = x_in.numel() / K;
  std::vector<int64_t> out_sizes(x_in.sizes().begin(), x_in.sizes().end());
  out_sizes.back() = N;
  return {x_in.reshape({M, K}).contiguous(), M, std::move(out_sizes)};
}

template <class Backend>
Tensor packed_linear_impl(const Tensor& x_in, const Tensor& packed_weight, const std::optional<Tensor>& bias_in,
                          int64_t out_features) {
  constexpr const char* op = "packed_linear";
  SPECDEC_CHECK(x_in.dim() >= 1, op, ": x must have shape [..., in_features], got a scalar");
  check_float(op, "x", x_in);
  const int64_t K = x_in.size(-1), N = out_features;
  SPECDEC_CHECK(K >= 1, op, ": x must have in_features >= 1 in its last dimension, got shape ", shape_str(x_in));
  SPECDEC_CHECK(N >= 1, op, ": out_features must be >= 1, got ", N);
  SPECDEC_CHECK(packed_weight.scalar_type() == x_in.scalar_type(), op, ": packed_weight must have x's dtype ",
                x_in.scalar_type(), ", got ", packed_weight.scalar_type());
  check_same_device(op, "packed_weight", packed_weight, x_in, "x");
  const std::vector<int64_t> want = packed_linear_shape(op, x_in.scalar_type(), N, K);
  SPECDEC_CHECK(packed_weight.sizes().equals(want), op, ": packed_weight must have shape [ceil(out_features / 32), "
                "ceil(in_features / P), 32, P] = ", at::IntArrayRef(want), " for out_features = ", N,
                ", in_features = ", K, " (x's last dimension) and ", x_in.scalar_type(),
                " (pack_linear_weight's output), got ", shape_str(packed_weight));
  SPECDEC_CHECK(packed_weight.is_contiguous(), op, ": packed_weight must be contiguous (pack_linear_weight's output)");
  check_packed_rows(op, "packed_weight", packed_weight, N, "out_features");
  const Tensor bias = checked_linear_bias(op, bias_in, x_in, N);
  const LinearRows rows = linear_rows(x_in, K, N);
  const Tensor& x = rows.x;
  const int64_t M = rows.rows;
  c10::OptionalDeviceGuard guard(x.device());
  Tensor y = at::empty({M, N}, x.options());
  if (M > 0) {
    SPECDEC_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
      PackedLinearParams<scalar_t> p{.x = float_ptr<scalar_t>(x),
                                     .rows = M,
                                     .in_features = K,
                                     .out_features = N,
                                     .packed = float_ptr<scalar_t>(packed_weight),
                                     .bias = bias.defined() ? float_ptr<scalar_t>(bias) : nullptr,
                                     .y = reinterpret_cast<scalar_t*>(mutable_data(y))};
      Backend::packed_linear(p);
    });
  }
  return y.view(rows.out_sizes);
}

// Registers every op's implementation for one dispatch key of one library (registry.cpp):
// `SPECDEC_REGISTER_BACKEND(specdec_ext, CPU, CpuBackend)`.
#define SPECDEC_REGISTER_BACKEND(LIBRARY, KEY, BACKEND)                                               \
  TORCH_LIBRARY_IMPL(LIBRARY, KEY, m) {                                                               \
    m.impl("build_tree", &::specdec::glue::build_tree_impl<BACKEND>);                                 \
    m.impl("tree_ancestor_mask", &::specdec::glue::tree_ancestor_mask_impl<BACKEND>);                 \
    m.impl("advance_tree_frontier", &::specdec::glue::advance_tree_frontier_impl<BACKEND>);           \
    m.impl("select_tree_nodes", &::specdec::glue::select_tree_nodes_impl<BACKEND>);                   \
    m.impl("verify_tree_greedy", &::specdec::glue::verify_tree_greedy_impl<BACKEND>);                 \
    m.impl("verify_tree_sampling", &::specdec::glue::verify_tree_sampling_impl<BACKEND>);             \
    m.impl("verify_tree_typical", &::specdec::glue::verify_tree_typical_impl<BACKEND>);               \
    m.impl("sample_tokens", &::specdec::glue::sample_tokens_impl<BACKEND>);                           \
    m.impl("expand_tree_step", &::specdec::glue::expand_tree_step_impl<BACKEND>);                     \
    m.impl("tree_attention", &::specdec::glue::tree_attention_impl<BACKEND>);                         \
    m.impl("compact_kv", &::specdec::glue::compact_kv_impl<BACKEND>);                                 \
    m.impl("pack_linear_weight", &::specdec::glue::pack_linear_weight_impl<BACKEND>);                 \
    m.impl("packed_linear", &::specdec::glue::packed_linear_impl<BACKEND>);                           \
    m.impl("pack_linear_weight_int8", &::specdec::glue::pack_linear_weight_int8_impl<BACKEND>);       \
    m.impl("packed_linear_int8", &::specdec::glue::packed_linear_int8_impl<BACKEND>);                 \
    m.impl("pack_linear_weight_int4", &::specdec::glue::pack_linear_weight_int4_impl<BACKEND>);       \
    m.impl("packed_linear_int4", &::specdec::glue::packed_linear_int4_impl<BACKEND>);                 \
    m.impl("draft_decoder_layer", &::specdec::glue::draft_decoder_layer_impl<BACKEND>);               \
  }

}  // namespace specdec::glue

// tree_attention and compact_kv, draft_decoder_layer, and the int8 and int4 linear ops (use the helpers above).
#include "op_glue_attention.h"    // NOLINT(build/include_order)
#include "op_glue_linear_int8.h"  // NOLINT(build/include_order)
#include "op_glue_linear_int4.h"  // NOLINT(build/include_order)
#include "op_glue_draft_layer.h"  // NOLINT(build/include_order)
#include "op_glue_recurrent.h"    // NOLINT(build/include_order)  (the recurrent tree ops)
