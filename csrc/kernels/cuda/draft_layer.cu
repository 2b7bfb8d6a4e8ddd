// The elementwise stages of a drafter's decoder layer on CUDA (semantics: DraftLayerParams in common/params.h);
// the CUDA backend (csrc/ops/ops_cuda.cu) runs them in order between the packed_linear products and the tree
// attention, all on one stream. Each stage rounds to T exactly where the CPU stages do (csrc/kernels/cpu/
// draft_layer.cpp); sums (the RMSNorm's) are block reductions, so the last bits may differ from the CPU's.
#include <cuda_runtime.h>

#include <algorithm>

#include "block_utils.cuh"
#include "kernels.cuh"
#include "launch_check.cuh"

namespace specdec::cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float rounded(float x) {
  return to_float(from_float_rn<T>(x));
}

// torch's RMSNorm module in T for one row of n values; every thread of the block calls it.
template <typename T>
__device__ void rms_norm_row(const T* x, const T* w, int64_t n, float eps, T* y) {
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kNormThreads) {
    const float v = to_float(x[i]);
    ss += v * v;
  }
  ss = detail::block_allreduce<kNormThreads>(ss, detail::SumOp{});
  const float inv = rsqrtf(ss / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += kNormThreads)
    y[i] = from_float_rn<T>(to_float(w[i]) * rounded<T>(to_float(x[i]) * inv));
}

// One block per (row, segment).
template <typename T>
__global__ void __launch_bounds__(kNormThreads) input_norm_kernel(DraftLayerParams<T> p) {
  const int64_t r = blockIdx.x, s = blockIdx.y, seg = p.in_features / p.input_norm_segments;
  const int64_t at = r * p.in_features + s * seg;
  rms_norm_row(p.x + at, p.input_norm_weight + s * seg, seg, p.eps, p.normed_input + at);
}

// One block per batch row: its status first (every thread reads it after the barrier), then one thread per
// (t, head, i < D / 2) pair of RoPE, and the K/V copies into the cache.
template <typename T>
__global__ void __launch_bounds__(kThreads) rope_cache_kernel(DraftLayerParams<T> p) {
  __shared__ bool ok;
  const int64_t b = blockIdx.x, T_ = p.tokens, D = p.head_dim, half = D / 2;
  const int64_t nH = p.num_heads, nKV = p.num_kv_heads, Q = (nH + 2 * nKV) * D, S = p.seq_len;
  if (threadIdx.x == 0) {
    RowStatus st{kOk, 0, 0};
    for (int64_t t = 0; t < T_ && st.code == kOk; ++t) {
      const int64_t slot = p.write_slots[b * T_ + t];
      if (slot < 0 || slot >= S) st = RowStatus{kBadWriteSlot, t, slot};
    }
    p.status[b] = st;
    ok = st.code == kOk;
  }
  __syncthreads();
  const int64_t pairs = T_ * (nH + nKV) * half;
  for (int64_t e = threadIdx.x; e < pairs; e += kThreads) {
    const int64_t i = e % half, h = (e / half) % (nH + nKV), t = e / (half * (nH + nKV));
    T* x = p.qkv + (b * T_ + t) * Q + h * D;
    const float a = static_cast<float>(p.position_ids[b * T_ + t]) * p.inv_freq[i];
    float s, c;
    sincosf(a, &s, &c);
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const T y1 = from_float_rn<T>(x1 * c - x2 * s), y2 = from_float_rn<T>(x2 * c + x1 * s);
    x[i] = y1;
    x[i + half] = y2;
    if (ok && h >= nH) {  // a key head: into the cache, with its value head's pair
      const int64_t g = h - nH, at = ((b * nKV + g) * S + p.write_slots[b * T_ + t]) * D;
      const T* v = p.qkv + (b * T_ + t) * Q + (nH + nKV + g) * D;
      p.k_cache[at + i] = y1;
      p.k_cache[at + i + half] = y2;
      p.v_cache[at + i] = v[i];
      p.v_cache[at + i + half] = v[i + half];
    }
  }
}

template <typename T>
__global__ void gather_heads_kernel(DraftLayerParams<T> p, int64_t total) {
  const int64_t D = p.head_dim, nH = p.num_heads, T_ = p.tokens;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = e % D, h = (e / D) % nH, r = e / (D * nH), b = r / T_, t = r % T_;
    p.attn[e] = p.heads[((b * nH + h) * T_ + t) * D + d];
  }
}

// One block per row: h1 = residual + o, then the post-attention RMSNorm.
template <typename T>
__global__ void __launch_bounds__(kNormThreads) add_norm_kernel(DraftLayerParams<T> p) {
  const int64_t r = blockIdx.x, H = p.hidden;
  T* h1 = p.h1 + r * H;
  const T* res = p.residual + r * H;
  for (int64_t i = threadIdx.x; i < H; i += kNormThreads) h1[i] = from_float_rn<T>(to_float(res[i]) + to_float(h1[i]));
  __syncthreads();
  rms_norm_row(h1, p.norm_weight, H, p.eps, p.normed + r * H);
}

template <typename T>
__global__ void swiglu_kernel(DraftLayerParams<T> p, int64_t total) {
  const int64_t I = p.intermediate;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / I, i = e % I;
    const float g = to_float(p.gate_up[r * 2 * I + i]);
    p.act[e] = from_float_rn<T>(rounded<T>(g / (1.0f + expf(-g))) * to_float(p.gate_up[r * 2 * I + I + i]));
  }
}

template <typename T>
__global__ void residual_kernel(DraftLayerParams<T> p, int64_t total) {
  const int64_t H = p.hidden;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool ok = p.status[(e / H) / p.tokens].code == kOk;
    p.out[e] = ok ? from_float_rn<T>(to_float(p.h1[e]) + to_float(p.down[e])) : from_float_rn<T>(0.0f);
  }
}

unsigned grid_for(int64_t total) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, 4096)));
}

}  // namespace

template <typename T>
void LaunchDraftLayerInputNorm(const DraftLayerParams<T>& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.batch * p.tokens), static_cast<unsigned>(p.input_norm_segments));
  input_norm_kernel<T><<<grid, kNormThreads, 0, stream>>>(p);
  check_launch("draft_decoder_layer (input norm)");
}

template <typename T>
void LaunchDraftLayerRopeCache(const DraftLayerParams<T>& p, cudaStream_t stream) {
  rope_cache_kernel<T><<<static_cast<unsigned>(p.batch), kThreads, 0, stream>>>(p);
  check_launch("draft_decoder_layer (rope and cache)");
}

template <typename T>
void LaunchDraftLayerGatherHeads(const DraftLayerParams<T>& p, cudaStream_t stream) {
  const int64_t total = p.batch * p.tokens * p.num_heads * p.head_dim;
  gather_heads_kernel<T><<<grid_for(total), kThreads, 0, stream>>>(p, total);
  check_launch("draft_decoder_layer (heads)");
}

template <typename T>
void LaunchDraftLayerAddNorm(const DraftLayerParams<T>& p, cudaStream_t stream) {
  add_norm_kernel<T><<<static_cast<unsigned>(p.batch * p.tokens), kNormThreads, 0, stream>>>(p);
  check_launch("draft_decoder_layer (norm)");
}

template <typename T>
void LaunchDraftLayerSwiGlu(const DraftLayerParams<T>& p, cudaStream_t stream) {
  const int64_t total = p.batch * p.tokens * p.intermediate;
  swiglu_kernel<T><<<grid_for(total), kThreads, 0, stream>>>(p, total);
  check_launch("draft_decoder_layer (swiglu)");
}

template <typename T>
void LaunchDraftLayerResidual(const DraftLayerParams<T>& p, cudaStream_t stream) {
  const int64_t total = p.batch * p.tokens * p.hidden;
  residual_kernel<T><<<grid_for(total), kThreads, 0, stream>>>(p, total);
  check_launch("draft_decoder_layer (residual)");
}

#define SPECDEC_INSTANTIATE_DRAFT_LAYER(T)                                                          \
  template void LaunchDraftLayerInputNorm<T>(const DraftLayerParams<T>&, cudaStream_t);   \
  template void LaunchDraftLayerRopeCache<T>(const DraftLayerParams<T>&, cudaStream_t);   \
  template void LaunchDraftLayerGatherHeads<T>(const DraftLayerParams<T>&, cudaStream_t); \
  template void LaunchDraftLayerAddNorm<T>(const DraftLayerParams<T>&, cudaStream_t);     \
  template void LaunchDraftLayerSwiGlu<T>(const DraftLayerParams<T>&, cudaStream_t);      \
  template void LaunchDraftLayerResidual<T>(const DraftLayerParams<T>&, cudaStream_t);
SPECDEC_INSTANTIATE_DRAFT_LAYER(float)
SPECDEC_INSTANTIATE_DRAFT_LAYER(f16)
SPECDEC_INSTANTIATE_DRAFT_LAYER(bf16)
#undef SPECDEC_INSTANTIATE_DRAFT_LAYER

}  // namespace specdec::cuda
