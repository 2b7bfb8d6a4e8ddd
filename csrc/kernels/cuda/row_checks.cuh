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

// temperature >= 0 (not NaN), then (when checked) top_p in (0, 1]. Scalar: same result on every thread.
__device__ __forceinline__ RowStatus check_sampling_row(float temperature, bool check_top_p, float top_p) {
  if (!(temperature >= 0.0f)) return RowStatus{kBadTemperature, 0, 0};
  if (check_top_p && !(top_p > 0.0f && top_p <= 1.0f)) return RowStatus{kBadTopP, 0, 0};
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
