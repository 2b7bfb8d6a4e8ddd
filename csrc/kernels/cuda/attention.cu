// Tree attention (flash-decoding style) and KV-cache compaction on CUDA (semantics: common/params.h).
//
// Tree attention. The keys of row b are its prefix followed by its Nk tree keys (total prefix + Nk <= S), cut into
// `splits` chunks of `chunk` keys. The partial kernel's grid is (split, kv head, row x query tile): a block holds
// kQueryTile of the M = G * N queries of one kv head (G = H / Hkv query heads x N nodes), each warp kQueriesPerWarp
// of them, and walks its chunk in smem tiles of kKeyTile keys (K and V converted to float32 once per block). Lane j
// computes the scores of key j for the warp's queries; an online softmax (base 2: scores pre-multiplied by
// scale * log2(e)) keeps each query's running max, sum and accumulator (lane owns dims lane + 32 k). Each block
// writes its unnormalised (max, sum, acc) per query to the float32 workspace; the combine kernel merges the splits
// of each (row, head, node) and writes the output, plus the row status. Splits are chosen from the shape and the
// SM count so that a single row with a long prefix still fills the GPU.
//
// Compaction: one block per (cache, row, outer index). The row's positions are copied column chunk by column
// chunk through shared memory: all reads of a chunk, a barrier, then all writes, so overlapping source and
// destination positions see the old values (snapshot semantics). Every cache of the call is one launch.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "block_utils.cuh"
#include "kernels.cuh"
#include "launch_check.cuh"

namespace specdec::cuda {
namespace {

using namespace detail;

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("specdec_ext CUDA: ") + what + ": " +
                                                 cudaGetErrorString(e));
}

// ---------------------------------------------------------------------------------------------------------------
// Tree attention.

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kQueriesPerWarp = 4;
constexpr int kQueryTile = kWarps * kQueriesPerWarp;  // queries per block
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kMinKeysPerSplit = 256;

__host__ __device__ constexpr int key_tile(int64_t d) { return d <= 128 ? 32 : 16; }  // keeps K + V + Q tiles near 48-64 KB

template <int D>
constexpr size_t attention_smem_bytes() {
  return sizeof(float) * (static_cast<size_t>(key_tile(D)) * (D + 1) + static_cast<size_t>(key_tile(D)) * D +
                          static_cast<size_t>(kQueryTile) * D);
}

struct SplitPlan {
  int64_t splits;
  int64_t chunk;  // keys per split, a multiple of the key tile
  int64_t query_tiles;
};

int sm_count() {
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return std::max(sms, 1);
}

// The same plan for the workspace size and the launch: enough blocks for ~4 waves of the SMs, at least
// kMinKeysPerSplit keys per split.
SplitPlan plan_splits(int64_t B, int64_t H, int64_t Hkv, int64_t N, int64_t D, int64_t S) {
  const int64_t M = (H / Hkv) * N, kt = key_tile(D);
  SplitPlan plan{};
  plan.query_tiles = (M + kQueryTile - 1) / kQueryTile;
  const int64_t base = B * Hkv * plan.query_tiles;
  const int64_t target = 4 * static_cast<int64_t>(sm_count());
  const int64_t max_splits = std::max<int64_t>(1, (S + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  const int64_t want = std::min(max_splits, std::max<int64_t>(1, (target + base - 1) / base));
  const int64_t per = (S + want - 1) / want;
  plan.chunk = std::max<int64_t>(kt, (per + kt - 1) / kt * kt);
  plan.splits = (S + plan.chunk - 1) / plan.chunk;
  return plan;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ bool row_prefix_ok(const TreeAttentionParams<T>& p, int64_t b, int64_t* prefix) {
  *prefix = p.prefix_lens[b];
  return *prefix >= 0 && *prefix <= p.seq_len - p.num_tree_keys;
}

// Loads keys [t0, t0 + keys) of K and V into the float tiles. kVec: rows are 16-byte aligned (checked by the
// launcher), so each thread reads 16-byte vectors (D is a multiple of 8 for every supported head dim).
template <bool kVec, typename T, int D>
__device__ __forceinline__ void load_kv_tile(const T* kbase, int64_t k_stride, const T* vbase, int64_t v_stride,
                                             int64_t t0, int keys, float* ks, float* vs) {
  if constexpr (kVec) {
    constexpr int kN = Vec16<T>::kN, kPerRow = D / kN;
    for (int e = threadIdx.x; e < keys * kPerRow; e += kThreads) {
      const int j = e / kPerRow, d = (e % kPerRow) * kN;
      float kx[kN], vx[kN];
      unpack16(__ldg(reinterpret_cast<const uint4*>(kbase + (t0 + j) * k_stride + d)), kx, kbase);
      unpack16(__ldg(reinterpret_cast<const uint4*>(vbase + (t0 + j) * v_stride + d)), vx, vbase);
#pragma unroll
      for (int x = 0; x < kN; ++x) {
        ks[j * (D + 1) + d + x] = kx[x];
        vs[j * D + d + x] = vx[x];
      }
    }
  } else {
    for (int e = threadIdx.x; e < keys * D; e += kThreads) {
      const int j = e / D, d = e % D;
      ks[j * (D + 1) + d] = to_float(kbase[(t0 + j) * k_stride + d]);
      vs[j * D + d] = to_float(vbase[(t0 + j) * v_stride + d]);
    }
  }
}

template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(kThreads) tree_attention_partial_kernel(TreeAttentionParams<T> p, int64_t splits,
                                                                          int64_t chunk, int64_t query_tiles) {
  constexpr int KT = key_tile(D);
  constexpr int DPL = (D + 31) / 32;  // dims per lane
  extern __shared__ float smem[];
  float* ks = smem;                    // [KT][D + 1] (padded: lane j reads row j without bank conflicts)
  float* vs = ks + KT * (D + 1);       // [KT][D]
  float* qs = vs + KT * D;             // [kQueryTile][D], scaled by scale * log2(e)

  const int64_t split = blockIdx.x, kvh = blockIdx.y;
  const int64_t b = blockIdx.z / query_tiles, qt = blockIdx.z % query_tiles;
  const int64_t N = p.num_nodes, G = p.num_heads / p.num_kv_heads, M = G * N;
  int64_t prefix = 0;
  if (!row_prefix_ok(p, b, &prefix)) return;  // the combine kernel writes zeros and the status
  const int64_t total = prefix + p.num_tree_keys, start = split * chunk;
  if (start >= total) return;  // the combine kernel reads only splits that start before `total`
  const int64_t end = min(total, start + chunk);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float qscale = p.scale * kLog2e;
  for (int e = threadIdx.x; e < kQueryTile * D; e += kThreads) {
    const int r = e / D, d = e % D;
    const int64_t m = qt * kQueryTile + r;
    float x = 0.0f;
    if (m < M) {
      const int64_t h = kvh * G + m / N, i = m % N;
      x = to_float(p.q[b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n + d]) * qscale;
    }
    qs[r * D + d] = x;
  }

  int64_t node[kQueriesPerWarp];
  bool valid[kQueriesPerWarp];
  float run_max[kQueriesPerWarp], run_sum[kQueriesPerWarp], acc[kQueriesPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kQueriesPerWarp; ++r) {
    const int64_t m = qt * kQueryTile + warp * kQueriesPerWarp + r;
    valid[r] = m < M;
    node[r] = m % N;
    run_max[r] = neg_inf();
    run_sum[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[r][k] = 0.0f;
  }

  const T* kbase = p.k + b * p.k_stride_b + kvh * p.k_stride_h;
  const T* vbase = p.v + b * p.v_stride_b + kvh * p.v_stride_h;
  for (int64_t t0 = start; t0 < end; t0 += KT) {
    const int keys = static_cast<int>(min(static_cast<int64_t>(KT), end - t0));
    __syncthreads();  // previous tile fully consumed (and, on the first pass, qs written)
    load_kv_tile<kVec, T, D>(kbase, p.k_stride_s, vbase, p.v_stride_s, t0, keys, ks, vs);
    __syncthreads();

    // Scores of key `lane` for the warp's queries (base-2 logits), masked.
    float s[kQueriesPerWarp];
#pragma unroll
    for (int r = 0; r < kQueriesPerWarp; ++r) s[r] = 0.0f;
    if (lane < keys) {
      const float* kr = ks + lane * (D + 1);
      const float* q0 = qs + (warp * kQueriesPerWarp) * D;
#pragma unroll 8
      for (int d = 0; d < D; ++d) {
        const float kv = kr[d];
#pragma unroll
        for (int r = 0; r < kQueriesPerWarp; ++r) s[r] = fmaf(q0[r * D + d], kv, s[r]);
      }
    }
    const int64_t t = t0 + lane;
#pragma unroll
    for (int r = 0; r < kQueriesPerWarp; ++r) {
      bool visible = lane < keys && valid[r];
      if (visible && t >= prefix) visible = tree_mask_allows(p, b, node[r], t - prefix);
      if (!visible) s[r] = neg_inf();
    }

    // Online softmax update (warp-uniform control flow: every lane computes the same m_new).
    float pr[kQueriesPerWarp];
#pragma unroll
    for (int r = 0; r < kQueriesPerWarp; ++r) {
      const float m_new = fmaxf(run_max[r], warp_max(s[r]));
      if (m_new == neg_inf()) {
        pr[r] = 0.0f;
        continue;
      }
      const float alpha = exp2f(run_max[r] - m_new);  // 0 when run_max was -inf
      pr[r] = exp2f(s[r] - m_new);                     // 0 for masked keys
      run_sum[r] = run_sum[r] * alpha + warp_sum(pr[r]);
      run_max[r] = m_new;
#pragma unroll
      for (int k = 0; k < DPL; ++k) acc[r][k] *= alpha;
    }
    // acc += P V: lane owns dims lane + 32 k.
    for (int j = 0; j < keys; ++j) {
      float vj[DPL];
#pragma unroll
      for (int k = 0; k < DPL; ++k) {
        const int d = lane + 32 * k;
        vj[k] = d < D ? vs[j * D + d] : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < kQueriesPerWarp; ++r) {
        const float pj = __shfl_sync(kFullMask, pr[r], j);
#pragma unroll
        for (int k = 0; k < DPL; ++k) acc[r][k] = fmaf(pj, vj[k], acc[r][k]);
      }
    }
  }

  // Partials: acc [splits, B, H, N, D] then (max, sum) [splits, B, H, N, 2].
  const int64_t H = p.num_heads;
  const int64_t rows_total = p.batch * H * N;
#pragma unroll
  for (int r = 0; r < kQueriesPerWarp; ++r) {
    if (!valid[r]) continue;
    const int64_t m = qt * kQueryTile + warp * kQueriesPerWarp + r;
    const int64_t h = kvh * G + m / N, i = m % N;
    const int64_t row = (split * p.batch + b) * H * N + h * N + i;
    float* out = p.workspace + row * D;
#pragma unroll
    for (int k = 0; k < DPL; ++k) {
      const int d = lane + 32 * k;
      if (d < D) out[d] = acc[r][k];
    }
  }
  // (max, sum) pairs live after all acc partials: offset splits * rows_total * D.
  if (lane == 0) {
    float* ml = p.workspace + splits * rows_total * D;
#pragma unroll
    for (int r = 0; r < kQueriesPerWarp; ++r) {
      if (!valid[r]) continue;
      const int64_t m = qt * kQueryTile + warp * kQueriesPerWarp + r;
      const int64_t h = kvh * G + m / N, i = m % N;
      const int64_t row = (split * p.batch + b) * H * N + h * N + i;
      ml[2 * row] = run_max[r];
      ml[2 * row + 1] = run_sum[r];
    }
  }
}

constexpr int kCombineThreads = 128;

// One block per (b, h, i): merges the splits that start before prefix + Nk; writes the status of row b (from the
// block of h = 0, i = 0).
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) tree_attention_combine_kernel(TreeAttentionParams<T> p,
                                                                                 int64_t splits, int64_t chunk) {
  const int64_t N = p.num_nodes, H = p.num_heads, D = p.head_dim;
  const int64_t idx = blockIdx.x;  // (b * H + h) * N + i
  const int64_t b = idx / (H * N);
  int64_t prefix = 0;
  const bool ok = row_prefix_ok(p, b, &prefix);
  if (idx % (H * N) == 0 && threadIdx.x == 0)
    p.status[b] = ok ? RowStatus{kOk, 0, 0} : RowStatus{kBadPrefixLen, 0, prefix};
  T* out = p.out + idx * D;
  if (!ok) {
    for (int64_t d = threadIdx.x; d < D; d += kCombineThreads) out[d] = from_float_rn<T>(0.0f);
    return;
  }
  const int64_t rows_total = p.batch * H * N;
  const int64_t used = min(splits, (prefix + p.num_tree_keys + chunk - 1) / chunk);
  const float* ml = p.workspace + splits * rows_total * D;
  float gmax = neg_inf();
  for (int64_t s = 0; s < used; ++s) gmax = fmaxf(gmax, ml[2 * (s * rows_total + idx)]);
  float total = 0.0f;
  for (int64_t s = 0; s < used; ++s) {
    const float m = ml[2 * (s * rows_total + idx)];
    if (m != neg_inf()) total += ml[2 * (s * rows_total + idx) + 1] * exp2f(m - gmax);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += kCombineThreads) {
    float x = 0.0f;
    for (int64_t s = 0; s < used; ++s) {
      const float m = ml[2 * (s * rows_total + idx)];
      if (m != neg_inf()) x += p.workspace[(s * rows_total + idx) * D + d] * exp2f(m - gmax);
    }
    out[d] = from_float_rn<T>(x * inv);
  }
}

template <typename T, int D>
void launch_tree_attention(const TreeAttentionParams<T>& p, cudaStream_t stream) {
  const SplitPlan plan = plan_splits(p.batch, p.num_heads, p.num_kv_heads, p.num_nodes, D, p.seq_len);
  const int64_t rows_total = p.batch * p.num_heads * p.num_nodes;
  if (p.workspace == nullptr || p.workspace_floats < plan.splits * rows_total * (D + 2))
    throw std::runtime_error("specdec_ext CUDA: tree_attention workspace too small");
  if (p.num_kv_heads > 65535 || p.batch * plan.query_tiles > 65535 || plan.splits > 0x7fffffff)
    throw std::invalid_argument(
        "specdec_ext CUDA: tree_attention grid too large (B * query tiles <= 65535)");
  constexpr size_t smem = attention_smem_bytes<D>();
  // 16-byte loads when every K / V row starts 16-byte aligned.
  const auto aligned = [](const void* ptr, int64_t sb, int64_t sh, int64_t ss) {
    const int64_t e = static_cast<int64_t>(sizeof(T));
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (sb * e) % 16 == 0 && (sh * e) % 16 == 0 &&
           (ss * e) % 16 == 0;
  };
  const bool vec = aligned(p.k, p.k_stride_b, p.k_stride_h, p.k_stride_s) &&
                   aligned(p.v, p.v_stride_b, p.v_stride_h, p.v_stride_s);
  auto kernel = vec ? tree_attention_partial_kernel<T, D, true> : tree_attention_partial_kernel<T, D, false>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
             "cudaFuncSetAttribute(tree_attention)");
  const dim3 grid(static_cast<unsigned>(plan.splits), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(p.batch * plan.query_tiles));
  kernel<<<grid, kThreads, smem, stream>>>(p, plan.splits, plan.chunk, plan.query_tiles);
  check_launch("tree_attention (partial)");
  tree_attention_combine_kernel<T><<<static_cast<unsigned>(rows_total), kCombineThreads, 0, stream>>>(
      p, plan.splits, plan.chunk);
  check_launch("tree_attention (combine)");
}

// ---------------------------------------------------------------------------------------------------------------
// Compaction.

constexpr int kCompactThreads = 256;
constexpr int64_t kCompactSmemBytes = 32 * 1024;

template <typename U>
__global__ void __launch_bounds__(kCompactThreads) compact_kv_kernel(CompactKvParams p) {
  __shared__ __align__(16) unsigned char snap_bytes[kCompactSmemBytes];
  __shared__ RowStatus st_shared;
  U* snap = reinterpret_cast<U*>(snap_bytes);
  const int64_t c = blockIdx.x, b = blockIdx.y, o = blockIdx.z;
  if (threadIdx.x == 0) {
    st_shared = compact_kv_row_status(p, b);
    if (c == 0 && o == 0 && p.write_status) p.status[b] = st_shared;
  }
  __syncthreads();
  if (st_shared.code != kOk) return;
  const int64_t len = p.lengths[b], dst = p.dst_start[b];
  if (len == 0) return;
  const int64_t* src = p.src_positions + b * p.max_len;
  const int64_t units = p.inner_bytes / static_cast<int64_t>(sizeof(U));  // per position
  U* base = reinterpret_cast<U*>(static_cast<unsigned char*>(p.caches[c]) +
                                 (b * p.outer + o) * p.seq_len * p.inner_bytes);
  const int64_t per_chunk = kCompactSmemBytes / static_cast<int64_t>(sizeof(U)) / len;  // >= 1 (launcher)
  const int64_t cols = max(static_cast<int64_t>(1), min(units, per_chunk));
  for (int64_t c0 = 0; c0 < units; c0 += cols) {
    const int64_t w = min(cols, units - c0);
    for (int64_t e = threadIdx.x; e < len * w; e += kCompactThreads) {
      const int64_t i = e / w, k = e % w, s = src[i];
      if (s != dst + i) snap[e] = base[s * units + c0 + k];
    }
    __syncthreads();  // every read of this column chunk happens before any write of it
    for (int64_t e = threadIdx.x; e < len * w; e += kCompactThreads) {
      const int64_t i = e / w, k = e % w;
      if (src[i] != dst + i) base[(dst + i) * units + c0 + k] = snap[e];
    }
    __syncthreads();  // the snapshot buffer is reused by the next chunk
  }
}

}  // namespace

int64_t TreeAttentionWorkspaceFloats(int64_t B, int64_t H, int64_t Hkv, int64_t N, int64_t D, int64_t S) {
  const SplitPlan plan = plan_splits(B, H, Hkv, N, D, S);
  return plan.splits * B * H * N * (D + 2);
}

template <typename T>
void LaunchTreeAttention(const TreeAttentionParams<T>& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_heads <= 0 || p.num_nodes <= 0) return;
  switch (p.head_dim) {
    case 64:
      return launch_tree_attention<T, 64>(p, stream);
    case 80:
      return launch_tree_attention<T, 80>(p, stream);
    case 96:
      return launch_tree_attention<T, 96>(p, stream);
    case 128:
      return launch_tree_attention<T, 128>(p, stream);
    case 256:
      return launch_tree_attention<T, 256>(p, stream);
    default:
      throw std::invalid_argument("specdec_ext CUDA: tree_attention: unsupported head dim " +
                                  std::to_string(p.head_dim));
  }
}

void LaunchCompactKv(const CompactKvParams& p, cudaStream_t stream) {
  if (p.num_caches <= 0 || p.batch <= 0 || p.outer <= 0) return;
  if (p.batch > 65535 || p.outer > 65535)
    throw std::invalid_argument(
        "specdec_ext CUDA: compact_kv supports B <= 65535 and outer dims <= 65535");
  // The widest copy unit dividing the row and aligned in every cache; the snapshot must hold one unit per position.
  uintptr_t align = 16;
  for (int64_t c = 0; c < p.num_caches; ++c) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p.caches[c]);
    while (align > 1 && (a % align != 0 || p.inner_bytes % static_cast<int64_t>(align) != 0)) align /= 2;
  }
  while (align > 1 && p.max_len * static_cast<int64_t>(align) > kCompactSmemBytes) align /= 2;
  if (p.max_len > kCompactSmemBytes)
    throw std::invalid_argument(
        "specdec_ext CUDA: compact_kv supports at most 32768 positions per row (L)");
  const dim3 grid(static_cast<unsigned>(p.num_caches), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(p.outer));
  switch (align) {
    case 16:
      compact_kv_kernel<uint4><<<grid, kCompactThreads, 0, stream>>>(p);
      break;
    case 8:
      compact_kv_kernel<uint2><<<grid, kCompactThreads, 0, stream>>>(p);
      break;
    case 4:
      compact_kv_kernel<uint32_t><<<grid, kCompactThreads, 0, stream>>>(p);
      break;
    case 2:
      compact_kv_kernel<uint16_t><<<grid, kCompactThreads, 0, stream>>>(p);
      break;
    default:
      compact_kv_kernel<uint8_t><<<grid, kCompactThreads, 0, stream>>>(p);
  }
  check_launch("compact_kv");
}

template void LaunchTreeAttention<float>(const TreeAttentionParams<float>&, cudaStream_t);
template void LaunchTreeAttention<f16>(const TreeAttentionParams<f16>&, cudaStream_t);
template void LaunchTreeAttention<bf16>(const TreeAttentionParams<bf16>&, cudaStream_t);

}  // namespace specdec::cuda
