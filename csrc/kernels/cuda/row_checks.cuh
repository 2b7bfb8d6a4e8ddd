// Per-row validation of trees, draft tokens and sampling parameters (params.h order), plus the shared writer of
// verification outputs. All helpers are block-collective (call from every thread) and return uniform results.
#pragma once

#include "block_utils.cuh"

namespace specdec::cuda::detail {

__device__ __forceinline__ RowStatus ok_status() { return RowStatus{kOk, 0, 0}; }

// parents[0] == -1 and 0 <= parents[i] < i for i >= 1; the first failure in node order.
template <int BLOCK>
__device__ RowStatus check_tree_row(const int64_t* par, int64_t n) {
  const int64_t root = par[0];
  if (root != -1) return RowStatus{kRootNotMinusOne, 0, root};
  int64_t bad = kNoIndex;
  for (int64_t i = 1 + threadIdx.x; i < n; i += BLOCK) {
    const int64_t q = par[i];
    if ((q < 0 || q >= i) && i < bad) bad = i;
  }
  bad = block_allreduce<BLOCK>(bad, MinOp{});
  if (bad != kNoIndex) return RowStatus{kParentNotEarlier, bad, par[bad]};
  return ok_status();
}

// 0 <= tokens[i] < vocab for nodes 1..n-1 (the root's token is not read).
template <int BLOCK>
__device__ RowStatus check_tokens_row(const int64_t* tok, int64_t n, int64_t vocab) {
  int64_t bad = kNoIndex;
  for (int64_t i = 1 + threadIdx.x; i < n; i += BLOCK) {
    const int64_t t = tok[i];
    if ((t < 0 || t >= vocab) && i < bad) bad = i;
  }
  bad = block_allreduce<BLOCK>(bad, MinOp{});
  if (bad != kNoIndex) return RowStatus{kTokenOutOfRange, bad, tok[bad]};
  return ok_status();
}

// temperature finite and >= 0, then (with `filters`) top_k >= 0 and top_p in (0, 1] (params.h order). Scalar: same
// result on every thread.
__device__ __forceinline__ RowStatus check_sampling_row(float temperature, int64_t top_k, float top_p,
                                                        bool filters) {
  if (!(temperature >= 0.0f) || is_pos_inf(temperature)) return RowStatus{kBadTemperature, 0, 0};
  if (filters && top_k < 0) return RowStatus{kBadTopK, 0, top_k};
  if (filters && !(top_p > 0.0f && top_p <= 1.0f)) return RowStatus{kBadTopP, 0, 0};
  return ok_status();
}

// A [B] vector's uniform u in [0, 1) (NaN fails). Scalar.
__device__ __forceinline__ RowStatus check_uniform(float u) {
  return u >= 0.0f && u < 1.0f ? ok_status() : RowStatus{kBadUniform, -1, 0};
}

// Uniforms u[0..n) of a [B, N] row in [0, 1); the first failing column. Block-collective.
template <int BLOCK>
__device__ RowStatus check_uniforms_row(const float* u, int64_t n) {
  int64_t bad = kNoIndex;
  for (int64_t c = threadIdx.x; c < n; c += BLOCK) {
    if (!(u[c] >= 0.0f && u[c] < 1.0f) && c < bad) bad = c;
  }
  bad = block_allreduce<BLOCK>(bad, MinOp{});
  if (bad != kNoIndex) return RowStatus{kBadUniform, bad, 0};
  return ok_status();
}

// Writes row b of the verification outputs. On success the accepted path is root .. `last` (`len` nodes,
// recovered through parents), else sentinels. Starts with a barrier so `accepted` may have served as scratch.
template <int BLOCK>
__device__ void write_verify_row(const VerifyOutputs& out, int64_t b, int64_t n, const int64_t* par,
                                 const RowStatus& st, int64_t last, int64_t len, int64_t next_token) {
  __syncthreads();
  int64_t* acc = out.accepted + b * n;
  const bool ok = st.code == kOk;
  for (int64_t i = (ok ? len : 0) + threadIdx.x; i < n; i += BLOCK) acc[i] = -1;
  if (threadIdx.x == 0) {
    if (ok) {
      int64_t node = last;
      for (int64_t pos = len - 1; pos >= 0; --pos) {
        acc[pos] = node;
        node = node > 0 ? par[node] : -1;
      }
    }
    out.accept_len[b] = ok ? len - 1 : 0;
    out.next_token[b] = ok ? next_token : -1;
    out.status[b] = st;
  }
}

}  // namespace specdec::cuda::detail
