// Linear layers over a packed weight (layout and semantics: common/params.h). One thread per output element, one
// float32 accumulation over k in order, as on the CPU: a row's result does not depend on the other rows. A warp
// covers one 32-output panel, so its weight reads are coalesced and x is broadcast. This is the reference GPU
// path for the op (cuBLAS is faster for large products on a GPU; the op exists for the few-row products of
// decoding on CPUs, and the CUDA kernel keeps it device-agnostic).
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels.cuh"
#include "launch_check.cuh"

namespace specdec::cuda {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int64_t kMaxGridY = 65535;

template <typename T>
__global__ void pack_linear_weight_kernel(PackLinearWeightParams<T> p, int64_t total) {
  constexpr int64_t P = linear_pack_pair<T>();
  const int64_t KP = (p.in_features + P - 1) / P;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // i = ((panel * KP + kp) * 32 + lane) * P + j
    const int64_t j = i % P, lane = (i / P) % kLinearPanel, kp = (i / (P * kLinearPanel)) % KP;
    const int64_t panel = i / (P * kLinearPanel * KP);
    const int64_t n = panel * kLinearPanel + lane, k = kp * P + j;
    // padding: k >= K zero, rows n >= N the marker (params.h)
    p.packed[i] = n >= p.out_features    ? linear_pad_value<T>()
                  : k < p.in_features ? p.weight[n * p.in_features + k]
                                      : from_float_rn<T>(0.0f);
  }
}

template <typename T>
__global__ void __launch_bounds__(kLinearPanel* kRowsPerBlock) packed_linear_kernel(PackedLinearParams<T> p) {
  constexpr int64_t P = linear_pack_pair<T>();
  const int64_t K = p.in_features, N = p.out_features, KP = (K + P - 1) / P;
  const int64_t n = blockIdx.x * kLinearPanel + threadIdx.x;
  if (n >= N) return;
  const T* w = p.packed + blockIdx.x * KP * kLinearPanel * P + threadIdx.x * P;
  const float bias = p.bias != nullptr ? to_float(p.bias[n]) : 0.0f;
  for (int64_t m = blockIdx.y * static_cast<int64_t>(kRowsPerBlock) + threadIdx.y; m < p.rows;
       m += static_cast<int64_t>(gridDim.y) * kRowsPerBlock) {
    const T* x = p.x + m * K;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) acc = fmaf(to_float(x[k]), to_float(w[(k / P) * kLinearPanel * P + k % P]), acc);
    p.y[m * N + n] = from_float_rn<T>(acc + bias);
  }
}

}  // namespace

template <typename T>
void LaunchPackLinearWeight(const PackLinearWeightParams<T>& p, cudaStream_t stream) {
  constexpr int64_t P = linear_pack_pair<T>();
  const int64_t panels = (p.out_features + kLinearPanel - 1) / kLinearPanel;
  const int64_t total = panels * ((p.in_features + P - 1) / P) * kLinearPanel * P;
  if (total <= 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, int64_t{1} << 20);
  pack_linear_weight_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, total);
  check_launch("pack_linear_weight");
}

template <typename T>
void LaunchPackedLinear(const PackedLinearParams<T>& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.out_features <= 0) return;
  const int64_t panels = (p.out_features + kLinearPanel - 1) / kLinearPanel;
  const int64_t row_blocks = std::min<int64_t>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock, kMaxGridY);
  const dim3 grid(static_cast<unsigned>(panels), static_cast<unsigned>(row_blocks));
  const dim3 block(kLinearPanel, kRowsPerBlock);
  packed_linear_kernel<T><<<grid, block, 0, stream>>>(p);
  check_launch("packed_linear");
}

#define SPECDEC_INSTANTIATE_LINEAR(T)                                                          \
  template void LaunchPackLinearWeight<T>(const PackLinearWeightParams<T>&, cudaStream_t);   \
  template void LaunchPackedLinear<T>(const PackedLinearParams<T>&, cudaStream_t);
SPECDEC_INSTANTIATE_LINEAR(float)
SPECDEC_INSTANTIATE_LINEAR(f16)
SPECDEC_INSTANTIATE_LINEAR(bf16)
#undef SPECDEC_INSTANTIATE_LINEAR

}  // namespace specdec::cuda
