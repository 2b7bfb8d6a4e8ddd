// Linear layers over a packed weight (layout and semantics: common/params.h). One thread per output element, one
// float32 accumulation over k in order, as on the CPU: a row's result does not depend on the other rows. A warp
// covers one 32-output panel, so its weight reads are coalesced and x is broadcast. This is the reference GPU
// path for the op (cuBLAS is faster for large products on a GPU; the op exists for the few-row products of
// decoding on CPUs, and the CUDA kernel keeps it device-agnostic).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <stdexcept>

#include "block_utils.cuh"
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

// Weight-only int8 (params.h): a block per row finds the row's largest magnitude, then quantises it.
constexpr int kInt8RowThreads = 256;

template <typename T>
__device__ Int8RowScale block_row_scale(const T* v, int64_t K) {
  float amax = 0.0f;
  int finite = 1;
  for (int64_t k = threadIdx.x; k < K; k += kInt8RowThreads) {
    const float a = fabsf(to_float(v[k]));
    finite &= a <= 3.40282347e38f;  // (false for inf and NaN)
    amax = a > amax ? a : amax;
  }
  amax = detail::block_allreduce<kInt8RowThreads>(amax, detail::MaxOp{});
  finite = detail::block_allreduce<kInt8RowThreads>(finite, detail::MinOp{});
  return int8_row_scale(amax, finite != 0);
}

template <typename T>
__global__ void __launch_bounds__(kInt8RowThreads) quantize_rows_int8_kernel(QuantizeRowsInt8Params<T> p) {
  const int64_t m = blockIdx.x, K = p.in_features, Kp = linear_int8_padded_k(K);
  const T* x = p.x + m * K;
  const Int8RowScale s = block_row_scale(x, K);
  if (threadIdx.x == 0) p.scales[m] = s.scale;
  for (int64_t k = threadIdx.x; k < Kp; k += kInt8RowThreads)
    p.q[m * Kp + k] = k < K ? int8_quantize(to_float(x[k]), s.inverse) : int8_t{0};
}

// One block per packed row n < ceil(N / 32) * 32 (rows n >= N are zero padding).
template <typename T>
__global__ void __launch_bounds__(kInt8RowThreads) pack_linear_weight_int8_kernel(PackLinearInt8Params<T> p) {
  const int64_t n = blockIdx.x, K = p.in_features, KQ = linear_int8_padded_k(K) / kLinearInt8Quad;
  int8_t* dst = p.packed + (n / kLinearPanel) * KQ * kLinearPanel * kLinearInt8Quad + (n % kLinearPanel) * 4;
  if (n >= p.out_features) {
    for (int64_t k = threadIdx.x; k < KQ * kLinearInt8Quad; k += kInt8RowThreads)
      dst[(k / 4) * kLinearPanel * 4 + k % 4] = 0;
    return;
  }
  const T* src = p.weight + n * K;
  const Int8RowScale s = block_row_scale(src, K);
  if (threadIdx.x == 0) p.scales[n] = s.scale;
  for (int64_t k = threadIdx.x; k < KQ * kLinearInt8Quad; k += kInt8RowThreads)
    dst[(k / 4) * kLinearPanel * 4 + k % 4] = k < K ? int8_quantize(to_float(src[k]), s.inverse) : int8_t{0};
}

// One thread per output element, as packed_linear_kernel: a warp reads one panel's K-quad (128 contiguous bytes);
// dp4a adds the 4 products of a K-quad (exact integers, so the sum matches the CPU's bit for bit).
template <typename T>
__global__ void __launch_bounds__(kLinearPanel* kRowsPerBlock) packed_linear_int8_kernel(PackedLinearInt8Params<T> p) {
  const int64_t Kp = linear_int8_padded_k(p.in_features), KQ = Kp / kLinearInt8Quad, N = p.out_features;
  const int64_t n = blockIdx.x * kLinearPanel + threadIdx.x;
  if (n >= N) return;
  const int32_t* w = reinterpret_cast<const int32_t*>(p.packed) + blockIdx.x * KQ * kLinearPanel + threadIdx.x;
  const float sw = p.w_scales[n], bias = p.bias != nullptr ? to_float(p.bias[n]) : 0.0f;
  for (int64_t m = blockIdx.y * static_cast<int64_t>(kRowsPerBlock) + threadIdx.y; m < p.rows;
       m += static_cast<int64_t>(gridDim.y) * kRowsPerBlock) {
    const int32_t* x = reinterpret_cast<const int32_t*>(p.qx + m * Kp);
    int32_t acc = 0;
    for (int64_t kq = 0; kq < KQ; ++kq) acc = __dp4a(x[kq], w[kq * kLinearPanel], acc);
    p.y[m * N + n] = from_float_rn<T>(int8_dequantize(acc, p.x_scales[m], sw, bias));
  }
}

// Weight-only int4 (params.h): one block per packed row n < ceil(N / 32) * 32; a thread owns whole groups (their
// bytes and multipliers), after the block has found the row's largest magnitude.
template <typename T>
__global__ void __launch_bounds__(kInt8RowThreads) pack_linear_weight_int4_kernel(PackLinearInt4Params<T> p) {
  const int64_t n = blockIdx.x, K = p.in_features, Kp = linear_int4_padded_k(K), G = Kp / kLinearInt4Group;
  constexpr int64_t kOctetBytes = kLinearPanel * 4, kOctets = kLinearInt4Group / kLinearInt4Octet;
  uint8_t* dst = p.packed + (n / kLinearPanel) * (Kp / kLinearInt4Octet) * kOctetBytes + (n % kLinearPanel) * 4;
  uint8_t* mult = p.group_scales + (n / kLinearPanel) * G * kLinearPanel + n % kLinearPanel;
  const T* src = p.weight + n * K;
  const bool real = n < p.out_features;
  float amax = 0.0f;
  if (real)
    for (int64_t k = threadIdx.x; k < K; k += kInt8RowThreads) amax = fmaxf(amax, fabsf(to_float(src[k])));
  amax = detail::block_allreduce<kInt8RowThreads>(amax, detail::MaxOp{});
  const bool zero = !real || amax < kInt4TinyAmax;
  const float scale = zero ? 0.0f : int4_row_scale(amax);
  if (real && threadIdx.x == 0) p.scales[n] = scale;
  for (int64_t g = threadIdx.x; g < G; g += kInt8RowThreads) {
    const int64_t k0 = g * kLinearInt4Group, k1 = min(K, k0 + kLinearInt4Group);
    float group_amax = 0.0f;
    for (int64_t k = k0; k < k1 && !zero; ++k) group_amax = fmaxf(group_amax, fabsf(to_float(src[k])));
    const int m = zero ? 0 : int4_group_multiplier(group_amax, amax);
    mult[g * kLinearPanel] = static_cast<uint8_t>(m);
    for (int64_t o = g * kOctets; o < (g + 1) * kOctets; ++o)
      for (int64_t e = 0; e < 4; ++e) {
        const int64_t k_lo = o * kLinearInt4Octet + e, k_hi = k_lo + 4;
        const int lo = zero || k_lo >= K ? 0 : int4_quantize(to_float(src[k_lo]), scale, m);
        const int hi = zero || k_hi >= K ? 0 : int4_quantize(to_float(src[k_hi]), scale, m);
        dst[o * kOctetBytes + e] = static_cast<uint8_t>((lo + 8) | ((hi + 8) << 4));
      }
  }
}

// The product's first stage: x_offsets[m, g] = 8 * sum of row m's group g of qx (a thread each).
template <typename T>
__global__ void linear_int4_offsets_kernel(PackedLinearInt4Params<T> p, int64_t total) {
  const int64_t Kp = linear_int4_padded_k(p.in_features), G = Kp / kLinearInt4Group;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int8_t* x = p.qx + (i / G) * Kp + (i % G) * kLinearInt4Group;
    int32_t sum = 0;
    for (int64_t k = 0; k < kLinearInt4Group; ++k) sum += x[k];
    p.x_offsets[i] = 8 * sum;
  }
}

// One thread per output element, as packed_linear_int8_kernel: a warp reads one panel's K-octet (128 contiguous
// bytes), a lane's word holds its K-quads 2o (low nibbles) and 2o + 1 (high nibbles): 0..15 as signed bytes, so
// dp4a's signed form adds their products exactly.
template <typename T>
__global__ void __launch_bounds__(kLinearPanel* kRowsPerBlock) packed_linear_int4_kernel(PackedLinearInt4Params<T> p) {
  const int64_t Kp = linear_int4_padded_k(p.in_features), G = Kp / kLinearInt4Group, N = p.out_features;
  constexpr int64_t kOctets = kLinearInt4Group / kLinearInt4Octet;
  const int64_t n = blockIdx.x * kLinearPanel + threadIdx.x;
  if (n >= N) return;
  const int32_t* w = reinterpret_cast<const int32_t*>(p.packed) + blockIdx.x * (Kp / kLinearInt4Octet) * kLinearPanel +
                     threadIdx.x;
  const uint8_t* mult = p.group_scales + blockIdx.x * G * kLinearPanel + threadIdx.x;
  const float sw = p.w_scales[n], bias = p.bias != nullptr ? to_float(p.bias[n]) : 0.0f;
  for (int64_t m = blockIdx.y * static_cast<int64_t>(kRowsPerBlock) + threadIdx.y; m < p.rows;
       m += static_cast<int64_t>(gridDim.y) * kRowsPerBlock) {
    const int32_t* x = reinterpret_cast<const int32_t*>(p.qx + m * Kp);
    int32_t acc = 0;
    for (int64_t g = 0; g < G; ++g) {
      int32_t part = 0;
      for (int64_t o = g * kOctets; o < (g + 1) * kOctets; ++o) {
        const int32_t word = w[o * kLinearPanel];
        part = __dp4a(word & 0x0f0f0f0f, x[2 * o], part);
        part = __dp4a((word >> 4) & 0x0f0f0f0f, x[2 * o + 1], part);
      }
      acc += (part - p.x_offsets[m * G + g]) * static_cast<int32_t>(mult[g * kLinearPanel]);
    }
    p.y[m * N + n] = from_float_rn<T>(int8_dequantize(acc, p.x_scales[m], sw, bias));
  }
}

// The products' launch shape: a block per output panel and block of kRowsPerBlock rows (grid-stride beyond).
dim3 product_grid(int64_t rows, int64_t out_features) {
  const int64_t panels = (out_features + kLinearPanel - 1) / kLinearPanel;
  const int64_t row_blocks = std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, kMaxGridY);
  return dim3(static_cast<unsigned>(panels), static_cast<unsigned>(row_blocks));
}
dim3 product_block() { return dim3(kLinearPanel, kRowsPerBlock); }

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
  packed_linear_kernel<T><<<product_grid(p.rows, p.out_features), product_block(), 0, stream>>>(p);
  check_launch("packed_linear");
}

template <typename T>
void LaunchQuantizeRowsInt8(const QuantizeRowsInt8Params<T>& p, cudaStream_t stream) {
  if (p.rows <= 0) return;
  if (p.rows > INT32_MAX) throw std::invalid_argument("quantize_rows_int8: more than 2^31 - 1 rows");
  quantize_rows_int8_kernel<T><<<static_cast<unsigned>(p.rows), kInt8RowThreads, 0, stream>>>(p);
  check_launch("packed_linear_int8 (quantize rows)");
}

template <typename T>
void LaunchPackLinearWeightInt8(const PackLinearInt8Params<T>& p, cudaStream_t stream) {
  const int64_t padded_rows = (p.out_features + kLinearPanel - 1) / kLinearPanel * kLinearPanel;
  if (padded_rows <= 0) return;
  if (padded_rows > INT32_MAX) throw std::invalid_argument("pack_linear_weight_int8: more than 2^31 - 32 rows");
  pack_linear_weight_int8_kernel<T><<<static_cast<unsigned>(padded_rows), kInt8RowThreads, 0, stream>>>(p);
  check_launch("pack_linear_weight_int8");
}

template <typename T>
void LaunchPackedLinearInt8(const PackedLinearInt8Params<T>& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.out_features <= 0) return;
  packed_linear_int8_kernel<T><<<product_grid(p.rows, p.out_features), product_block(), 0, stream>>>(p);
  check_launch("packed_linear_int8");
}

template <typename T>
void LaunchPackLinearWeightInt4(const PackLinearInt4Params<T>& p, cudaStream_t stream) {
  const int64_t padded_rows = (p.out_features + kLinearPanel - 1) / kLinearPanel * kLinearPanel;
  if (padded_rows <= 0) return;
  if (padded_rows > INT32_MAX) throw std::invalid_argument("pack_linear_weight_int4: more than 2^31 - 32 rows");
  pack_linear_weight_int4_kernel<T><<<static_cast<unsigned>(padded_rows), kInt8RowThreads, 0, stream>>>(p);
  check_launch("pack_linear_weight_int4");
}

template <typename T>
void LaunchPackedLinearInt4(const PackedLinearInt4Params<T>& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.out_features <= 0) return;
  const int64_t total = p.rows * (linear_int4_padded_k(p.in_features) / kLinearInt4Group);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, int64_t{1} << 20);
  linear_int4_offsets_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, total);
  check_launch("packed_linear_int4 (offsets)");
  packed_linear_int4_kernel<T><<<product_grid(p.rows, p.out_features), product_block(), 0, stream>>>(p);
  check_launch("packed_linear_int4");
}

#define SPECDEC_INSTANTIATE_LINEAR(T)                                                        \
  template void LaunchPackLinearWeight<T>(const PackLinearWeightParams<T>&, cudaStream_t);   \
  template void LaunchPackedLinear<T>(const PackedLinearParams<T>&, cudaStream_t);           \
  template void LaunchQuantizeRowsInt8<T>(const QuantizeRowsInt8Params<T>&, cudaStream_t);   \
  template void LaunchPackLinearWeightInt8<T>(const PackLinearInt8Params<T>&, cudaStream_t); \
  template void LaunchPackedLinearInt8<T>(const PackedLinearInt8Params<T>&, cudaStream_t); \
  template void LaunchPackLinearWeightInt4<T>(const PackLinearInt4Params<T>&, cudaStream_t); \
  template void LaunchPackedLinearInt4<T>(const PackedLinearInt4Params<T>&, cudaStream_t);
SPECDEC_INSTANTIATE_LINEAR(float)
SPECDEC_INSTANTIATE_LINEAR(f16)
SPECDEC_INSTANTIATE_LINEAR(bf16)
#undef SPECDEC_INSTANTIATE_LINEAR

}  // namespace specdec::cuda
