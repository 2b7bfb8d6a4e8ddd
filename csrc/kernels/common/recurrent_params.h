// Argument bundles of the recurrent (hybrid-target) tree ops, shared by the CPU and CUDA kernels (no torch). Included
// by params.h; conventions as there. Executable specification: the end of specdec_ext/ops/reference.py.
//
// Every op reads a draft tree per row, `parents[B, N]` (node 0 the root, every other parent an earlier node), or an
// accepted path `path[B, L]` with `lengths[B]` (nodes path[b, t] for t < lengths[b], root first). Per-node tensors
// are [B, H, N, ...] with strides (b, h, n) in elements and a unit last stride; states are float32 [B, H, Dk, Dv]
// (or [B, H, P, Ds]) with strides (b, h, row) and a unit last stride. Commits run in place on the states and take
// several layers at once as more heads ([B, layers * H, ...] views). A tree op's invalid row (kRootNotMinusOne,
// kParentNotEarlier, kBadLogDecay) gets zero outputs; a commit's invalid row (kBadLogDecay, kBadLength,
// kBadPathNode) is left untouched.
#pragma once

#include <cstdint>

#include "dtype.h"
#include "status.h"

namespace specdec {

// Lightning / Simple GLA (fixed per-head decay a = exp(log_decay[h]), finite and <= 0), one parallel pass:
//   o_i = a^(d_i + 1) q_i S + sum_{j ancestor-or-self of i} a^(d_i - d_j) (q_i . k_j) v_j,   d = depth (root 0),
// q_i S the row vector times the saved state [Dk, Dv]; float32 accumulation, out [B, H, N, Dv] contiguous in T.
// Tasks t = b * H + h (the task with h = 0 writes row b's status).
template <typename T>
struct TreeLinearAttentionParams {
  const T* q;  // [B, H, N, Dk]
  int64_t q_stride_b, q_stride_h, q_stride_n;
  const T* k;  // [B, H, N, Dk]
  int64_t k_stride_b, k_stride_h, k_stride_n;
  const T* v;  // [B, H, N, Dv]
  int64_t v_stride_b, v_stride_h, v_stride_n;
  const float* state;  // [B, H, Dk, Dv]
  int64_t state_stride_b, state_stride_h, state_stride_k;
  const float* log_decay;  // [H]
  const int64_t* parents;  // [B, N] contiguous
  int64_t batch, num_heads, num_nodes, key_dim, value_dim;
  T* out;             // [B, H, N, Dv] contiguous
  RowStatus* status;  // [B]
};

// state[b, h] <- a^n state[b, h] + sum_{t < n} a^(n - 1 - t) k[b, h, p_t]^T v[b, h, p_t],  n = lengths[b],
// p_t = path[b, t]. Tasks t = b * H + h (h = 0 writes the status).
template <typename T>
struct CommitLinearStateParams {
  float* state;  // [B, H, Dk, Dv], in place
  int64_t state_stride_b, state_stride_h, state_stride_k;
  const T* k;  // [B, H, N, Dk]
  int64_t k_stride_b, k_stride_h, k_stride_n;
  const T* v;  // [B, H, N, Dv]
  int64_t v_stride_b, v_stride_h, v_stride_n;
  const float* log_decay;  // [H]
  const int64_t* path;     // [B, L] contiguous
  const int64_t* lengths;  // [B]
  int64_t batch, num_heads, num_nodes, max_len, key_dim, value_dim;
  RowStatus* status;  // [B]
};

// Depthwise causal convolution of width K over a tree: node i's window is its K - 1 nearest ancestors' inputs, then
// its own (oldest first), the saved inputs conv_state[b, c, :] (oldest first) standing in above the root;
//   out[b, c, i] = act(sum_t weight[c, t] window[t] + bias[c]),   act = silu or none.
// Tasks t = b * channel_blocks + block of kConvChannelBlock channels (block 0 writes row b's status).
constexpr int64_t kConvChannelBlock = 64;
template <typename T>
struct TreeCausalConv1dParams {
  const T* x;  // [B, C, N], any strides
  int64_t x_stride_b, x_stride_c, x_stride_n;
  const float* conv_state;  // [B, C, K - 1], any strides
  int64_t conv_stride_b, conv_stride_c, conv_stride_w;
  const T* weight;         // [C, K] contiguous
  const T* bias;           // [C] or nullptr
  const int64_t* parents;  // [B, N] contiguous
  int64_t batch, channels, num_nodes, width;  // width = K
  bool silu;
  T* out;             // [B, C, N] contiguous
  RowStatus* status;  // [B]
};

// conv_state[b] <- the last K - 1 of (conv_state[b], x[b, :, path[b, t]] for t < lengths[b]), in place.
// Tasks t = b * channel_blocks + block (block 0 writes the status).
template <typename T>
struct CommitConvStateParams {
  float* conv_state;  // [B, C, K - 1], any strides
  int64_t conv_stride_b, conv_stride_c, conv_stride_w;
  const T* x;  // [B, C, N], any strides
  int64_t x_stride_b, x_stride_c, x_stride_n;
  const int64_t* path;     // [B, L] contiguous
  const int64_t* lengths;  // [B]
  int64_t batch, channels, num_nodes, max_len, window;  // window = K - 1
  RowStatus* status;                                    // [B]
};

// Gated DeltaNet (Qwen3-Next, Qwen3.5) over a tree: node i's state is one delta-rule step from its parent's (the
// root's from the saved state), S <- exp(g_i) S, then S <- S + k_i (beta_i (v_i - S^T k_i))^T, and o_i = S_i^T q_i.
// g and beta [B, H, N] float32 with strides (b, h, n). Tasks t = b * H + h (h = 0 writes the status).
template <typename T>
struct TreeGatedDeltaParams {
  const T* q;  // [B, H, N, Dk]
  int64_t q_stride_b, q_stride_h, q_stride_n;
  const T* k;  // [B, H, N, Dk]
  int64_t k_stride_b, k_stride_h, k_stride_n;
  const T* v;  // [B, H, N, Dv]
  int64_t v_stride_b, v_stride_h, v_stride_n;
  const float* g;  // [B, H, N]
  const float* beta;
  int64_t gate_stride_b, gate_stride_h, gate_stride_n;  // (g's; beta's below)
  int64_t beta_stride_b, beta_stride_h, beta_stride_n;
  const float* state;  // [B, H, Dk, Dv]
  int64_t state_stride_b, state_stride_h, state_stride_k;
  const int64_t* parents;  // [B, N] contiguous
  int64_t batch, num_heads, num_nodes, key_dim, value_dim;
  T* out;             // [B, H, N, Dv] contiguous
  RowStatus* status;  // [B]
};

// state[b, h] advances by the delta-rule step through path[b, :lengths[b]], in place.
template <typename T>
struct CommitGatedDeltaParams {
  float* state;  // [B, H, Dk, Dv]
  int64_t state_stride_b, state_stride_h, state_stride_k;
  const T* k;
  int64_t k_stride_b, k_stride_h, k_stride_n;
  const T* v;
  int64_t v_stride_b, v_stride_h, v_stride_n;
  const float* g;
  const float* beta;
  int64_t gate_stride_b, gate_stride_h, gate_stride_n;
  int64_t beta_stride_b, beta_stride_h, beta_stride_n;
  const int64_t* path;     // [B, L] contiguous
  const int64_t* lengths;  // [B]
  int64_t batch, num_heads, num_nodes, max_len, key_dim, value_dim;
  RowStatus* status;  // [B]
};

// Mamba-2 (SSD) over a tree: node i's state is one step from its parent's, S <- exp(dt_i A_h) S + dt_i x_i B_i^T
// (S [P, Ds]), and y_i = S_i C_i + D_h x_i. dt [B, H, N] float32 with strides (b, h, n); A, D [H] float32.
template <typename T>
struct TreeSelectiveStateParams {
  const T* x;  // [B, H, N, P]
  int64_t x_stride_b, x_stride_h, x_stride_n;
  const float* dt;  // [B, H, N]
  int64_t dt_stride_b, dt_stride_h, dt_stride_n;
  const float* A;  // [H]
  const T* Bm;     // [B, H, N, Ds]
  int64_t bm_stride_b, bm_stride_h, bm_stride_n;
  const T* Cm;  // [B, H, N, Ds]
  int64_t cm_stride_b, cm_stride_h, cm_stride_n;
  const float* D;      // [H]
  const float* state;  // [B, H, P, Ds]
  int64_t state_stride_b, state_stride_h, state_stride_p;
  const int64_t* parents;  // [B, N] contiguous
  int64_t batch, num_heads, num_nodes, head_dim, state_dim;
  T* out;             // [B, H, N, P] contiguous
  RowStatus* status;  // [B]
};

template <typename T>
struct CommitSelectiveStateParams {
  float* state;  // [B, H, P, Ds]
  int64_t state_stride_b, state_stride_h, state_stride_p;
  const T* x;
  int64_t x_stride_b, x_stride_h, x_stride_n;
  const float* dt;
  int64_t dt_stride_b, dt_stride_h, dt_stride_n;
  const float* A;
  const T* Bm;
  int64_t bm_stride_b, bm_stride_h, bm_stride_n;
  const int64_t* path;     // [B, L] contiguous
  const int64_t* lengths;  // [B]
  int64_t batch, num_heads, num_nodes, max_len, head_dim, state_dim;
  RowStatus* status;  // [B]
};

SPECDEC_HD int64_t conv_channel_blocks(int64_t channels) {
  return channels / kConvChannelBlock + (channels % kConvChannelBlock != 0 ? 1 : 0);
}

// Row checks shared by both devices (kOk or the first failure, in the order listed).

// parents[0] == -1, then 0 <= parents[i] < i in node order.
SPECDEC_HD RowStatus recurrent_tree_status(const int64_t* parents, int64_t num_nodes) {
  if (parents[0] != -1) return RowStatus{kRootNotMinusOne, 0, parents[0]};
  for (int64_t i = 1; i < num_nodes; ++i) {
    if (parents[i] < 0 || parents[i] >= i) return RowStatus{kParentNotEarlier, i, parents[i]};
  }
  return RowStatus{kOk, 0, 0};
}

// Every head's log decay finite and <= 0 (NaN fails both comparisons).
SPECDEC_HD RowStatus log_decay_status(const float* log_decay, int64_t heads) {
  for (int64_t h = 0; h < heads; ++h) {
    const float x = log_decay[h];
    if (!(x <= 0.0f && x >= -3.402823466e38f)) return RowStatus{kBadLogDecay, h, 0};
  }
  return RowStatus{kOk, 0, 0};
}

// 0 <= lengths[b] <= L, then path[b, t] in [0, N) for t < lengths[b].
SPECDEC_HD RowStatus commit_path_status(const int64_t* path, const int64_t* lengths, int64_t b, int64_t max_len,
                                        int64_t num_nodes) {
  const int64_t n = lengths[b];
  if (n < 0 || n > max_len) return RowStatus{kBadLength, 0, n};
  for (int64_t t = 0; t < n; ++t) {
    const int64_t j = path[b * max_len + t];
    if (j < 0 || j >= num_nodes) return RowStatus{kBadPathNode, t, j};
  }
  return RowStatus{kOk, 0, 0};
}

}  // namespace specdec
