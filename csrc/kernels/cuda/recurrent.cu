// CUDA kernels of the recurrent tree ops (recurrent_params.h), all in one translation unit.
//
// Row checks run once per block on thread 0 (recurrent_tree_status / commit_path_status / log_decay_status, shared
// with the CPU kernels, sequential over N or L) and are broadcast through shared memory before any data-dependent
// index is used, so an invalid row never walks a bad parent pointer or reads outside its tensors.
//  * tree_linear_attention: one block per (row, head, node); threads own output columns; the node's ancestors are
//    walked per thread (the decay-weighted dot products are recomputed per thread: depth * Dk each, no reduction).
//  * tree_gated_delta_rule / tree_selective_state: one block per (row, head, node) replays the node's root-to-node
//    path from the saved state in shared memory, threads owning state columns (delta rule) or rows (Mamba-2): the
//    nodes run in parallel instead of level by level, at sum_i (d_i + 1) steps, with no per-node state in global
//    memory (the CPU kernels instead run N steps in depth-first order on one core: recurrent.cpp). A chain row (a
//    prefill) runs in order in one block instead, N steps.
//  * commits: one block per (row, head) steps the state in place in global memory, threads owning its columns or
//    rows; the conv ops: one thread per (row, channel).
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels.cuh"
#include "launch_check.cuh"

namespace specdec::cuda {
namespace {

constexpr int kThreads = 128;

void check_cuda_call(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("specdec_ext CUDA: ") + what + ": " + cudaGetErrorString(e));
}

void check_grid(int64_t blocks, const char* op) {
  if (blocks > 0x7fffffff)
    throw std::invalid_argument(std::string("specdec_ext CUDA: ") + op + ": more than 2^31 - 1 blocks");
}

// Opts `kernel` in to `bytes` of dynamic shared memory (above 48 KiB), or throws std::invalid_argument when the
// device has fewer.
template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes, const char* op) {
  int device = 0, limit = 0;
  check_cuda_call(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda_call(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                  "cudaDeviceGetAttribute");
  if (bytes > static_cast<size_t>(limit))
    throw std::invalid_argument(std::string("specdec_ext CUDA: ") + op + ": the state needs " +
                                std::to_string(bytes) + " bytes of shared memory, the device has " +
                                std::to_string(limit));
  check_cuda_call(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
                  "cudaFuncSetAttribute");
}

__device__ __forceinline__ float fexp(float x) { return expf(x); }

// Thread 0 checks the tree (and, with a decay, every head's decay) and writes the status when `report`; every
// thread gets the result.
__device__ bool row_tree_ok(const int64_t* par, int64_t N, const float* log_decay, int64_t heads, bool report,
                            RowStatus* status) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    RowStatus st = log_decay != nullptr ? log_decay_status(log_decay, heads) : RowStatus{kOk, 0, 0};
    if (st.code == kOk) st = recurrent_tree_status(par, N);
    if (report) *status = st;
    ok = st.code == kOk;
  }
  __syncthreads();
  return ok != 0;
}

__device__ bool row_path_ok(const int64_t* path, const int64_t* lengths, int64_t b, int64_t L, int64_t N,
                            const float* log_decay, int64_t heads, bool report, RowStatus* status) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    RowStatus st = log_decay != nullptr ? log_decay_status(log_decay, heads) : RowStatus{kOk, 0, 0};
    if (st.code == kOk) st = commit_path_status(path, lengths, b, L, N);
    if (report) *status = st;
    ok = st.code == kOk;
  }
  __syncthreads();
  return ok != 0;
}

// Whether row's valid tree is a chain (parents[i] = i - 1): a prefill or a chain draft, whose nodes one block then
// runs in order (N steps) instead of one block per node replaying its path (N (N + 1) / 2 steps).
__device__ bool row_is_chain(const int64_t* par, int64_t N) {
  __shared__ int chain;
  if (threadIdx.x == 0) {
    int c = 1;
    for (int64_t i = 1; i < N && c; ++i) c = par[i] == i - 1;
    chain = c;
  }
  __syncthreads();
  return chain != 0;
}

// Depth of node i of a valid tree.
__device__ __forceinline__ int64_t node_depth(const int64_t* par, int64_t i) {
  int64_t d = 0;
  for (int64_t j = i; j > 0; j = par[j]) ++d;
  return d;
}

// Thread 0 writes node i's root-to-node path (root first) into `path` and returns its length to every thread.
__device__ int64_t root_path(const int64_t* par, int64_t i, int64_t* path) {
  __shared__ int64_t len;
  if (threadIdx.x == 0) {
    const int64_t d = node_depth(par, i);
    int64_t j = i;
    for (int64_t t = d; t >= 0; --t) {
      path[t] = j;
      j = par[j];
    }
    len = d + 1;
  }
  __syncthreads();
  return len;
}

// ---------------------------------------------------------------------------------------------------------------
// Lightning linear attention. Dynamic shared memory: q_i (Dk floats).

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_linear_attention_kernel(TreeLinearAttentionParams<T> p) {
  extern __shared__ float smem[];
  const int64_t N = p.num_nodes, Dk = p.key_dim, Dv = p.value_dim;
  const int64_t task = blockIdx.x / N, i = blockIdx.x % N;
  const int64_t b = task / p.num_heads, h = task % p.num_heads;
  const int64_t* par = p.parents + b * N;
  T* out = p.out + ((b * p.num_heads + h) * N + i) * Dv;
  if (!row_tree_ok(par, N, p.log_decay, p.num_heads, h == 0 && i == 0, p.status + b)) {
    for (int64_t e = threadIdx.x; e < Dv; e += blockDim.x) out[e] = from_float_rn<T>(0.0f);
    return;
  }
  float* q = smem;
  const T* qg = p.q + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n;
  for (int64_t x = threadIdx.x; x < Dk; x += blockDim.x) q[x] = to_float(qg[x]);
  __syncthreads();
  const float log_a = p.log_decay[h];
  const int64_t d = node_depth(par, i);
  const float* S = p.state + b * p.state_stride_b + h * p.state_stride_h;
  const T* kb = p.k + b * p.k_stride_b + h * p.k_stride_h;
  const T* vb = p.v + b * p.v_stride_b + h * p.v_stride_h;
  for (int64_t e = threadIdx.x; e < Dv; e += blockDim.x) {
    float inter = 0.0f;
    for (int64_t x = 0; x < Dk; ++x) inter += q[x] * S[x * p.state_stride_k + e];
    float acc = fexp(log_a * static_cast<float>(d + 1)) * inter;
    int64_t dj = d;
    for (int64_t j = i; j >= 0; j = par[j], --dj) {
      float dot = 0.0f;
      for (int64_t x = 0; x < Dk; ++x) dot += q[x] * to_float(kb[j * p.k_stride_n + x]);
      acc += fexp(log_a * static_cast<float>(d - dj)) * dot * to_float(vb[j * p.v_stride_n + e]);
    }
    out[e] = from_float_rn<T>(acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) commit_linear_state_kernel(CommitLinearStateParams<T> p) {
  const int64_t b = blockIdx.x / p.num_heads, h = blockIdx.x % p.num_heads, L = p.max_len;
  if (!row_path_ok(p.path, p.lengths, b, L, p.num_nodes, p.log_decay, p.num_heads, h == 0, p.status + b)) return;
  const int64_t n = p.lengths[b], Dk = p.key_dim, Dv = p.value_dim;
  if (n == 0) return;
  const int64_t* path = p.path + b * L;
  const float log_a = p.log_decay[h];
  const float keep = fexp(log_a * static_cast<float>(n));
  const T* kb = p.k + b * p.k_stride_b + h * p.k_stride_h;
  const T* vb = p.v + b * p.v_stride_b + h * p.v_stride_h;
  float* S = p.state + b * p.state_stride_b + h * p.state_stride_h;
  for (int64_t e = threadIdx.x; e < Dk * Dv; e += blockDim.x) {  // each element read and written by one thread
    const int64_t x = e / Dv, y = e % Dv;
    float s = keep * S[x * p.state_stride_k + y];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j = path[t];
      s += fexp(log_a * static_cast<float>(n - 1 - t)) * to_float(kb[j * p.k_stride_n + x]) *
           to_float(vb[j * p.v_stride_n + y]);
    }
    S[x * p.state_stride_k + y] = s;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Tree causal conv1d and its commit: blocks (row, channel block), one thread per channel.

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_causal_conv1d_kernel(TreeCausalConv1dParams<T> p) {
  const int64_t blocks = (p.channels + kThreads - 1) / kThreads;
  const int64_t b = blockIdx.x / blocks, c = (blockIdx.x % blocks) * kThreads + threadIdx.x;
  const int64_t N = p.num_nodes, K = p.width, C = p.channels;
  const int64_t* par = p.parents + b * N;
  const bool ok = row_tree_ok(par, N, nullptr, 0, blockIdx.x % blocks == 0, p.status + b);
  if (c >= C) return;
  T* out = p.out + (b * C + c) * N;
  if (!ok) {
    for (int64_t i = 0; i < N; ++i) out[i] = from_float_rn<T>(0.0f);
    return;
  }
  const T* x = p.x + b * p.x_stride_b + c * p.x_stride_c;
  const float* saved = p.conv_state + b * p.conv_stride_b + c * p.conv_stride_c;
  const T* w = p.weight + c * K;
  const float bias = p.bias != nullptr ? to_float(p.bias[c]) : 0.0f;
  for (int64_t i = 0; i < N; ++i) {
    float sum = bias;
    int64_t node = i, t = K - 1;
    for (; t >= 0 && node >= 0; --t, node = par[node]) sum += to_float(w[t]) * to_float(x[node * p.x_stride_n]);
    // the oldest taps 0..t read the saved inputs: tap s reads conv_state[..., (K - 1) - (t + 1) + s]
    for (int64_t s = t; s >= 0; --s) sum += to_float(w[s]) * saved[(K - 2 - (t - s)) * p.conv_stride_w];
    if (p.silu) sum = sum / (1.0f + fexp(-sum));
    out[i] = from_float_rn<T>(sum);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) commit_conv_state_kernel(CommitConvStateParams<T> p) {
  const int64_t blocks = (p.channels + kThreads - 1) / kThreads, L = p.max_len, W = p.window;
  const int64_t b = blockIdx.x / blocks, c = (blockIdx.x % blocks) * kThreads + threadIdx.x;
  const bool ok = row_path_ok(p.path, p.lengths, b, L, p.num_nodes, nullptr, 0, blockIdx.x % blocks == 0,
                              p.status + b);
  if (!ok || c >= p.channels) return;
  const int64_t n = p.lengths[b];
  if (n == 0) return;
  const int64_t* path = p.path + b * L;
  float* s = p.conv_state + b * p.conv_stride_b + c * p.conv_stride_c;
  const T* x = p.x + b * p.x_stride_b + c * p.x_stride_c;
  // new s[w] = sequence[n + w] of (old window, path inputs); in increasing w it only reads entries not yet written
  for (int64_t w = 0; w < W; ++w) {
    const int64_t e = n + w;
    s[w * p.conv_stride_w] = e < W ? s[e * p.conv_stride_w] : to_float(x[path[e - W] * p.x_stride_n]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Gated delta rule. Shared memory: path (N int64), then the state [Dk, Dv] and k (Dk floats), q (Dk floats).

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_gated_delta_kernel(TreeGatedDeltaParams<T> p) {
  extern __shared__ int64_t smem64[];
  const int64_t N = p.num_nodes, Dk = p.key_dim, Dv = p.value_dim;
  const int64_t task = blockIdx.x / N, i = blockIdx.x % N;
  const int64_t b = task / p.num_heads, h = task % p.num_heads;
  const int64_t* par = p.parents + b * N;
  T* out = p.out + ((b * p.num_heads + h) * N + i) * Dv;
  if (!row_tree_ok(par, N, nullptr, 0, h == 0 && i == 0, p.status + b)) {
    for (int64_t e = threadIdx.x; e < Dv; e += blockDim.x) out[e] = from_float_rn<T>(0.0f);
    return;
  }
  // a chain row: block 0 runs every node in order, writing each output as it goes; the other blocks have no work
  const bool chain = row_is_chain(par, N);
  if (chain && i > 0) return;
  int64_t* path = smem64;
  float* S = reinterpret_cast<float*>(smem64 + N);
  float* ks = S + Dk * Dv;
  float* qs = ks + Dk;
  const int64_t len = chain ? N : root_path(par, i, path);
  const float* saved = p.state + b * p.state_stride_b + h * p.state_stride_h;
  for (int64_t e = threadIdx.x; e < Dk * Dv; e += blockDim.x) S[e] = saved[(e / Dv) * p.state_stride_k + e % Dv];
  const T* qb = p.q + b * p.q_stride_b + h * p.q_stride_h;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t j = chain ? t : path[t];
    const int64_t qnode = chain ? j : i;  // (the query whose output this block writes)
    __syncthreads();  // (the previous step's reads of ks and qs are done; S is loaded)
    const T* kg = p.k + b * p.k_stride_b + h * p.k_stride_h + j * p.k_stride_n;
    for (int64_t x = threadIdx.x; x < Dk; x += blockDim.x) {
      ks[x] = to_float(kg[x]);
      if (chain || t == 0) qs[x] = to_float(qb[qnode * p.q_stride_n + x]);
    }
    __syncthreads();
    const float decay = fexp(p.g[b * p.gate_stride_b + h * p.gate_stride_h + j * p.gate_stride_n]);
    const float beta = p.beta[b * p.beta_stride_b + h * p.beta_stride_h + j * p.beta_stride_n];
    const T* vg = p.v + b * p.v_stride_b + h * p.v_stride_h + j * p.v_stride_n;
    const bool emit = chain || t == len - 1;
    T* o_row = p.out + ((b * p.num_heads + h) * N + qnode) * Dv;
    for (int64_t e = threadIdx.x; e < Dv; e += blockDim.x) {  // thread owns column e of S
      float u = 0.0f;
      for (int64_t x = 0; x < Dk; ++x) u += S[x * Dv + e] * ks[x];
      const float delta = beta * (to_float(vg[e]) - decay * u);
      float o = 0.0f;
      for (int64_t x = 0; x < Dk; ++x) {
        const float next = decay * S[x * Dv + e] + ks[x] * delta;
        S[x * Dv + e] = next;
        o += next * qs[x];
      }
      if (emit) o_row[e] = from_float_rn<T>(o);
    }
  }
}

// Shared memory: k (Dk floats).
template <typename T>
__global__ void __launch_bounds__(kThreads) commit_gated_delta_kernel(CommitGatedDeltaParams<T> p) {
  extern __shared__ float ks[];
  const int64_t b = blockIdx.x / p.num_heads, h = blockIdx.x % p.num_heads, L = p.max_len;
  if (!row_path_ok(p.path, p.lengths, b, L, p.num_nodes, nullptr, 0, h == 0, p.status + b)) return;
  const int64_t n = p.lengths[b], Dk = p.key_dim, Dv = p.value_dim;
  float* S = p.state + b * p.state_stride_b + h * p.state_stride_h;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t j = p.path[b * L + t];
    __syncthreads();
    const T* kg = p.k + b * p.k_stride_b + h * p.k_stride_h + j * p.k_stride_n;
    for (int64_t x = threadIdx.x; x < Dk; x += blockDim.x) ks[x] = to_float(kg[x]);
    __syncthreads();
    const float decay = fexp(p.g[b * p.gate_stride_b + h * p.gate_stride_h + j * p.gate_stride_n]);
    const float beta = p.beta[b * p.beta_stride_b + h * p.beta_stride_h + j * p.beta_stride_n];
    const T* vg = p.v + b * p.v_stride_b + h * p.v_stride_h + j * p.v_stride_n;
    for (int64_t e = threadIdx.x; e < Dv; e += blockDim.x) {
      float u = 0.0f;
      for (int64_t x = 0; x < Dk; ++x) u += S[x * p.state_stride_k + e] * ks[x];
      const float delta = beta * (to_float(vg[e]) - decay * u);
      for (int64_t x = 0; x < Dk; ++x) {
        float& s = S[x * p.state_stride_k + e];
        s = decay * s + ks[x] * delta;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Mamba-2 selective state. Shared memory: path (N int64), then the state [P, Ds], B (Ds floats), C (Ds floats).

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_selective_state_kernel(TreeSelectiveStateParams<T> p) {
  extern __shared__ int64_t smem64[];
  const int64_t N = p.num_nodes, P = p.head_dim, Ds = p.state_dim;
  const int64_t task = blockIdx.x / N, i = blockIdx.x % N;
  const int64_t b = task / p.num_heads, h = task % p.num_heads;
  const int64_t* par = p.parents + b * N;
  T* out = p.out + ((b * p.num_heads + h) * N + i) * P;
  if (!row_tree_ok(par, N, nullptr, 0, h == 0 && i == 0, p.status + b)) {
    for (int64_t e = threadIdx.x; e < P; e += blockDim.x) out[e] = from_float_rn<T>(0.0f);
    return;
  }
  const bool chain = row_is_chain(par, N);  // (as in tree_gated_delta_kernel)
  if (chain && i > 0) return;
  int64_t* path = smem64;
  float* S = reinterpret_cast<float*>(smem64 + N);
  float* bs = S + P * Ds;
  float* cs = bs + Ds;
  const int64_t len = chain ? N : root_path(par, i, path);
  const float* saved = p.state + b * p.state_stride_b + h * p.state_stride_h;
  for (int64_t e = threadIdx.x; e < P * Ds; e += blockDim.x) S[e] = saved[(e / Ds) * p.state_stride_p + e % Ds];
  const T* cb = p.Cm + b * p.cm_stride_b + h * p.cm_stride_h;
  const float A = p.A[h], Dh = p.D[h];
  for (int64_t t = 0; t < len; ++t) {
    const int64_t j = chain ? t : path[t];
    const int64_t qnode = chain ? j : i;
    __syncthreads();
    const T* bg = p.Bm + b * p.bm_stride_b + h * p.bm_stride_h + j * p.bm_stride_n;
    for (int64_t s = threadIdx.x; s < Ds; s += blockDim.x) {
      bs[s] = to_float(bg[s]);
      if (chain || t == 0) cs[s] = to_float(cb[qnode * p.cm_stride_n + s]);
    }
    __syncthreads();
    const float dt = p.dt[b * p.dt_stride_b + h * p.dt_stride_h + j * p.dt_stride_n];
    const float decay = fexp(dt * A);
    const T* xg = p.x + b * p.x_stride_b + h * p.x_stride_h + j * p.x_stride_n;
    const T* xq = p.x + b * p.x_stride_b + h * p.x_stride_h + qnode * p.x_stride_n;
    const bool emit = chain || t == len - 1;
    T* y_row = p.out + ((b * p.num_heads + h) * N + qnode) * P;
    for (int64_t r = threadIdx.x; r < P; r += blockDim.x) {  // thread owns row r of S
      const float dx = dt * to_float(xg[r]);
      float y = 0.0f;
      for (int64_t s = 0; s < Ds; ++s) {
        const float next = decay * S[r * Ds + s] + dx * bs[s];
        S[r * Ds + s] = next;
        y += next * cs[s];
      }
      if (emit) y_row[r] = from_float_rn<T>(y + Dh * to_float(xq[r]));
    }
  }
}

// Shared memory: B (Ds floats).
template <typename T>
__global__ void __launch_bounds__(kThreads) commit_selective_state_kernel(CommitSelectiveStateParams<T> p) {
  extern __shared__ float bs[];
  const int64_t b = blockIdx.x / p.num_heads, h = blockIdx.x % p.num_heads, L = p.max_len;
  if (!row_path_ok(p.path, p.lengths, b, L, p.num_nodes, nullptr, 0, h == 0, p.status + b)) return;
  const int64_t n = p.lengths[b], P = p.head_dim, Ds = p.state_dim;
  float* S = p.state + b * p.state_stride_b + h * p.state_stride_h;
  const float A = p.A[h];
  for (int64_t t = 0; t < n; ++t) {
    const int64_t j = p.path[b * L + t];
    __syncthreads();
    const T* bg = p.Bm + b * p.bm_stride_b + h * p.bm_stride_h + j * p.bm_stride_n;
    for (int64_t s = threadIdx.x; s < Ds; s += blockDim.x) bs[s] = to_float(bg[s]);
    __syncthreads();
    const float dt = p.dt[b * p.dt_stride_b + h * p.dt_stride_h + j * p.dt_stride_n];
    const float decay = fexp(dt * A);
    const T* xg = p.x + b * p.x_stride_b + h * p.x_stride_h + j * p.x_stride_n;
    for (int64_t r = threadIdx.x; r < P; r += blockDim.x) {
      const float dx = dt * to_float(xg[r]);
      for (int64_t s = 0; s < Ds; ++s) S[r * p.state_stride_p + s] = decay * S[r * p.state_stride_p + s] + dx * bs[s];
    }
  }
}

}  // namespace

template <typename T>
void LaunchTreeLinearAttention(const TreeLinearAttentionParams<T>& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.num_heads * p.num_nodes;
  check_grid(blocks, "tree_linear_attention");
  const size_t smem = sizeof(float) * static_cast<size_t>(p.key_dim);
  set_smem(tree_linear_attention_kernel<T>, smem, "tree_linear_attention");
  tree_linear_attention_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  check_launch("tree_linear_attention");
}

template <typename T>
void LaunchCommitLinearState(const CommitLinearStateParams<T>& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.num_heads;
  check_grid(blocks, "commit_linear_state");
  commit_linear_state_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  check_launch("commit_linear_state");
}

template <typename T>
void LaunchTreeCausalConv1d(const TreeCausalConv1dParams<T>& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * ((p.channels + kThreads - 1) / kThreads);
  check_grid(blocks, "tree_causal_conv1d");
  tree_causal_conv1d_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  check_launch("tree_causal_conv1d");
}

template <typename T>
void LaunchCommitConvState(const CommitConvStateParams<T>& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * ((p.channels + kThreads - 1) / kThreads);
  check_grid(blocks, "commit_conv_state");
  commit_conv_state_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  check_launch("commit_conv_state");
}

template <typename T>
void LaunchTreeGatedDelta(const TreeGatedDeltaParams<T>& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.num_heads * p.num_nodes;
  check_grid(blocks, "tree_gated_delta_rule");
  const size_t smem = sizeof(int64_t) * static_cast<size_t>(p.num_nodes) +
                      sizeof(float) * static_cast<size_t>(p.key_dim * p.value_dim + 2 * p.key_dim);
  set_smem(tree_gated_delta_kernel<T>, smem, "tree_gated_delta_rule");
  tree_gated_delta_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  check_launch("tree_gated_delta_rule");
}

template <typename T>
void LaunchCommitGatedDelta(const CommitGatedDeltaParams<T>& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.num_heads;
  check_grid(blocks, "commit_gated_delta_state");
  const size_t smem = sizeof(float) * static_cast<size_t>(p.key_dim);
  set_smem(commit_gated_delta_kernel<T>, smem, "commit_gated_delta_state");
  commit_gated_delta_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  check_launch("commit_gated_delta_state");
}

template <typename T>
void LaunchTreeSelectiveState(const TreeSelectiveStateParams<T>& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.num_heads * p.num_nodes;
  check_grid(blocks, "tree_selective_state");
  const size_t smem = sizeof(int64_t) * static_cast<size_t>(p.num_nodes) +
                      sizeof(float) * static_cast<size_t>(p.head_dim * p.state_dim + 2 * p.state_dim);
  set_smem(tree_selective_state_kernel<T>, smem, "tree_selective_state");
  tree_selective_state_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  check_launch("tree_selective_state");
}

template <typename T>
void LaunchCommitSelectiveState(const CommitSelectiveStateParams<T>& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.num_heads;
  check_grid(blocks, "commit_selective_state");
  const size_t smem = sizeof(float) * static_cast<size_t>(p.state_dim);
  set_smem(commit_selective_state_kernel<T>, smem, "commit_selective_state");
  commit_selective_state_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  check_launch("commit_selective_state");
}

#define SPECDEC_INSTANTIATE_RECURRENT_LAUNCHERS(T)                                                     \
  template void LaunchTreeLinearAttention<T>(const TreeLinearAttentionParams<T>&, cudaStream_t);     \
  template void LaunchCommitLinearState<T>(const CommitLinearStateParams<T>&, cudaStream_t);         \
  template void LaunchTreeCausalConv1d<T>(const TreeCausalConv1dParams<T>&, cudaStream_t);           \
  template void LaunchCommitConvState<T>(const CommitConvStateParams<T>&, cudaStream_t);             \
  template void LaunchTreeGatedDelta<T>(const TreeGatedDeltaParams<T>&, cudaStream_t);               \
  template void LaunchCommitGatedDelta<T>(const CommitGatedDeltaParams<T>&, cudaStream_t);           \
  template void LaunchTreeSelectiveState<T>(const TreeSelectiveStateParams<T>&, cudaStream_t);       \
  template void LaunchCommitSelectiveState<T>(const CommitSelectiveStateParams<T>&, cudaStream_t);
SPECDEC_INSTANTIATE_RECURRENT_LAUNCHERS(float)
SPECDEC_INSTANTIATE_RECURRENT_LAUNCHERS(f16)
SPECDEC_INSTANTIATE_RECURRENT_LAUNCHERS(bf16)
#undef SPECDEC_INSTANTIATE_RECURRENT_LAUNCHERS

}  // namespace specdec::cuda
