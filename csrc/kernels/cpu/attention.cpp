// Tree attention and KV-cache compaction on CPU (semantics: common/params.h).
//
// TreeAttention: one task = (batch row, kv head). All G = H / Hkv query heads of the kv head and all N tree nodes
// (M = G * N queries) are processed together, so every K/V row is read (and converted to float32) once per task;
// at M = 4 * 64 a task is compute-bound, so the float32 path is built around two register-tiled FMA micro-kernels
// and keeps everything else off the critical path. Keys are taken in blocks of kKeyBlock:
// - Scores are computed transposed, S^T = K Q^T. The queries (pre-scaled, padded with zero queries to a multiple of
//   16) are stored once per task in panels of W = vector-width queries, [D][W] each; a tile of 8 keys x 2 panels
//   broadcasts K[j, d] and loads a panel row, so K is read in place from a float32 cache: no transpose, no copy.
// - Right after a panel's scores, while they are in L1, the tree mask (a precomputed 0 / -inf bias on the tree
//   keys) and the queries' maxima (a row of S^T is a vector of queries). S^T of all keys is kept: the softmax has
//   two passes, not online, so that a tree node gets exactly the bits one-token decoding of its path gets (see
//   "Softmax in two passes" below).
// - Second pass, per block: P^T = exp(S^T - max) in place and the running sums, then acc += P V: a tile of 4
//   queries x 64 dims broadcasts P^T[j, m] and loads V rows in place.
// The task body is written once over GCC vector types and compiled for AVX-512 (zmm, 16 accumulators per tile),
// AVX2 + FMA (ymm, 8) and the baseline ISA (xmm, 8), chosen at run time like the vocabulary loops. Unlike those,
// the clones may differ in the last bits (FMA contraction): attention outputs are compared with a tolerance, and
// FMA doubles the arithmetic throughput. On Zen4 both micro-kernels run at ~95% of the FMA peak in place; the
// softmax (~6%) is most of the rest. float16 and bfloat16 caches are converted to float32 once per block, except
// bfloat16 on CPUs with AVX512-BF16, which has its own path (below: scores at twice the float32 rate, K^T built by
// register transposes).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "fast_exp.h"
#include "kernels.h"

namespace specdec::cpu {
namespace {

constexpr int64_t kKeyBlock = 64;  // keys per block (a multiple of every KeyTile below)
constexpr int64_t kRowTile = 6;    // queries per micro-tile of the bfloat16 path
constexpr int64_t kQueryPad = 16;  // the float32 path pads the M queries to a multiple of the widest vector

// GCC vector types: the micro-kernels below are written once over a vector type V and compiled, inside the ISA
// clones, for zmm (AVX-512), ymm (AVX2) or xmm (baseline SSE2). `a += s * v` with a scalar s broadcasts s (one
// vbroadcastss per tile row); with FMA enabled GCC contracts it into one vfmadd (checked in the disassembly).
// Fixed-size arrays of V in fully unrolled loops live in registers.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

// Unaligned loads and stores (by reference: a vector passed by value outside its ISA's clone draws -Wpsabi).
template <typename V>
__attribute__((always_inline)) inline void load(V& v, const float* p) {
  std::memcpy(&v, p, sizeof(V));
}
template <typename V>
__attribute__((always_inline)) inline void store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

// Register tiles per ISA. Scores: KeyTile keys x QueryVecs vectors of queries (accumulators: their product).
// P.V: RowTile queries x DimVecs vectors of head dims. AVX-512 has 32 registers: 16 accumulators each, which keeps
// both loops limited by FMA throughput rather than by loads or FMA latency (measured in L1: 98-99% of the FMA peak
// on Zen4); AVX2 and SSE2 have 16 registers: 8 accumulators each.
struct Avx512Tiles {
  using V = f32x16;
  static constexpr int KeyTile = 8, QueryVecs = 2, RowTile = 4, DimVecs = 4;
};
struct Avx2Tiles {
  using V = f32x8;
  static constexpr int KeyTile = 4, QueryVecs = 2, RowTile = 4, DimVecs = 2;
};
struct BaseTiles {
  using V = f32x4;
  static constexpr int KeyTile = 4, QueryVecs = 2, RowTile = 4, DimVecs = 2;
};

// S^T[j, m] = sum_d K[j, d] * Q[m, d] for KT keys (rows of k, `k_stride` apart: the cache itself for float32) and
// NQ * W queries. Q is stored in panels of W queries, [D][W] each, so one load gives W queries' d-th values and
// the keys are broadcast: K is read in place, never transposed.
template <typename V, int KT, int NQ>
__attribute__((always_inline)) inline void scores_tile(const float* qpanels, int64_t dim, const float* k,
                                                       int64_t k_stride, float* st, int64_t st_stride) {
  constexpr int W = sizeof(V) / sizeof(float);
  V a[KT][NQ] = {};
  for (int64_t d = 0; d < dim; ++d) {
    V q[NQ];
    for (int n = 0; n < NQ; ++n) load(q[n], qpanels + (n * dim + d) * W);
    for (int r = 0; r < KT; ++r) {
      const float kv = k[r * k_stride + d];
      for (int n = 0; n < NQ; ++n) a[r][n] += kv * q[n];
    }
  }
  for (int r = 0; r < KT; ++r)
    for (int n = 0; n < NQ; ++n) store(st + r * st_stride + n * W, a[r][n]);
}

// acc[m, :] += sum_{j < keys} P^T[j, m] * V[j, :] for RT queries and NV * W dims, key by key.
template <typename V, int RT, int NV>
__attribute__((always_inline)) inline void pv_tile(const float* pt, int64_t pt_stride, int64_t keys, const float* v,
                                                   int64_t v_stride, float* acc, int64_t dim) {
  constexpr int W = sizeof(V) / sizeof(float);
  V a[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int n = 0; n < NV; ++n) load(a[r][n], acc + r * dim + n * W);
  for (int64_t j = 0; j < keys; ++j) {
    V vv[NV];
    for (int n = 0; n < NV; ++n) load(vv[n], v + j * v_stride + n * W);
    for (int r = 0; r < RT; ++r) {
      const float pj = pt[j * pt_stride + r];
      for (int n = 0; n < NV; ++n) a[r][n] += pj * vv[n];
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int n = 0; n < NV; ++n) store(acc + r * dim + n * W, a[r][n]);
}

// acc += P V for queries m < M (a multiple of RT, or padding rows past it) and dims d0..: tiles of
// NV vectors of dims, then (D not a multiple of the tile) fewer. Queries run innermost, so the V columns of a dim
// tile stay in L1 while every query tile uses them.
template <typename V, int RT, int NV>
__attribute__((always_inline)) inline void pv_block(const float* pt, int64_t pt_stride, int64_t M, int64_t keys,
                                                    const float* v, int64_t v_stride, float* acc, int64_t dim,
                                                    int64_t d0) {
  constexpr int W = sizeof(V) / sizeof(float);
  for (; d0 + NV * W <= dim; d0 += NV * W)
    for (int64_t m0 = 0; m0 < M; m0 += RT)
      pv_tile<V, RT, NV>(pt + m0, pt_stride, keys, v + d0, v_stride, acc + m0 * dim + d0, dim);
  if constexpr (NV > 1)
    if (d0 < dim) pv_block<V, RT, NV - 1>(pt, pt_stride, M, keys, v, v_stride, acc, dim, d0);
}

// One K or V row (D values) as float32.
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const bf16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = bits_to_float(static_cast<uint32_t>(src[d].bits) << 16);
}
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx,f16c"))) void load_row_f16c(const f16* src, float* dst, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
  for (; d < n; ++d) dst[d] = to_float(src[d]);
}
inline void load_row(const f16* src, float* dst, int64_t n) {
  static const bool f16c = __builtin_cpu_supports("f16c");  // exact conversion, like to_float
  if (f16c) return load_row_f16c(src, dst, n);
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}
#else
inline void load_row(const f16* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}
#endif

// Prefetches rows [r0, r1) of a K or V cache (D values of T, `stride` apart) into L2, so that a key block's rows
// arrive while the previous phase computes instead of stalling the first micro-tile that reads them.
template <typename T>
__attribute__((always_inline)) inline void prefetch_rows(const T* base, int64_t stride, int64_t r0, int64_t r1,
                                                         int64_t dim) {
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = reinterpret_cast<const char*>(base + r * stride);
    for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(row + off, 0, 2);
  }
}

// A float buffer whose data starts on a cache line (no vector load straddles two lines).
struct AlignedFloats {
  std::vector<float> raw;
  float* data = nullptr;
  float* get(int64_t n) {
    raw.resize(n + 16);
    data = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63});
    return data;
  }
};

struct Work {
  AlignedFloats qt, st, acc, bias, kbuf, vbuf;
  std::vector<float> mx, sum;
};

// Softmax in two passes over all of a task's keys, not online: first every score and each query's maximum, then
// P = exp(S - max) with the running sums and acc += P V accumulated key by key in slot order. Why: a tree node
// must get exactly the bits that decoding its path one token at a time gets (greedy output identical to plain
// decoding, also where two logits nearly tie), and there its ancestors sit at consecutive slots while in the tree
// they are scattered among masked siblings. Masked keys add exact zeros to the sums and to acc, and with one
// maximum per query no block boundary rescales anything, so the result depends only on the visible keys in order.
// (An online softmax rescales at block boundaries, and which block an ancestor falls in depends on its slot.)

// Pass 1 for the QW queries of a panel over one key block (st: the panel's column of S^T, rows `st_stride` apart;
// tree keys from row tree_from get the mask bias, 0 or -inf): the mask, then the running maxima. Vectorised across
// queries.
template <int QW>
__attribute__((always_inline)) inline void mask_max_panel(float* st, int64_t st_stride, int64_t keys,
                                                          int64_t tree_from, const float* bias, float* mx) {
  for (int64_t j = tree_from; j < keys; ++j) {
    float* s = st + j * st_stride;
    const float* bj = bias + (j - tree_from) * st_stride;
    // a select, not s + bias: a masked key must get exactly -inf even when its score is NaN (NaN + -inf is NaN)
#pragma omp simd
    for (int c = 0; c < QW; ++c) s[c] = bj[c] < 0.0f ? bj[c] : s[c];
  }
  for (int64_t j = 0; j < keys; ++j) {
    const float* s = st + j * st_stride;
#pragma omp simd
    for (int c = 0; c < QW; ++c) mx[c] = std::max(mx[c], s[c]);
  }
}

// Pass 2 for the QW queries of a panel over one key block: P = exp(S - max) in place (0 for masked keys, and for
// every key of a query that sees none) and the sums, each query's accumulated key by key.
template <int QW>
__attribute__((always_inline)) inline void exp_sum_panel(float* st, int64_t st_stride, int64_t keys,
                                                         const float* mx, float* sum) {
  float mu[QW];
  for (int c = 0; c < QW; ++c) mu[c] = mx[c] == neg_inf() ? 0.0f : mx[c];
  for (int64_t j = 0; j < keys; ++j) {
    float* s = st + j * st_stride;
#pragma omp simd
    for (int c = 0; c < QW; ++c) {
      const float e = exp_nonpositive(s[c] - mu[c]);
      s[c] = e;
      sum[c] += e;
    }
  }
}

// One task of the float32 path (float32 and float16 inputs; bfloat16 without AVX512-BF16), tiles from Tiles.
template <typename T, typename Tiles>
__attribute__((always_inline)) inline void tree_attention_task(const TreeAttentionParams<T>& p, int64_t b,
                                                               int64_t kvh, int64_t prefix, int64_t Nk, Work& w) {
  using V = typename Tiles::V;
  constexpr int W = sizeof(V) / sizeof(float), KT = Tiles::KeyTile, NQ = Tiles::QueryVecs, RT = Tiles::RowTile;
  static_assert(kKeyBlock % KT == 0 && kQueryPad % W == 0 && kQueryPad % RT == 0, "tile shapes");
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / Hkv, N = p.num_nodes, D = p.head_dim;
  const int64_t M = G * N, Mp = (M + kQueryPad - 1) / kQueryPad * kQueryPad;
  float* qt = w.qt.get(Mp * D);
  float* acc = w.acc.get(Mp * D);
  w.mx.assign(Mp, neg_inf());
  w.sum.assign(Mp, 0.0f);
  // Queries pre-multiplied by the softmax scale, in panels of W: qt[(m / W) * D * W + d * W + m % W]. Padding
  // queries are zeros; their scores are finite and their outputs never written.
  std::fill(qt, qt + Mp * D, 0.0f);
  std::fill(acc, acc + Mp * D, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const T* src = p.q + b * p.q_stride_b + (kvh * G + m / N) * p.q_stride_h + (m % N) * p.q_stride_n;
    float* dst = qt + (m / W) * D * W + m % W;
    for (int64_t d = 0; d < D; ++d) dst[d * W] = to_float(src[d]) * p.scale;
  }
  // The tree mask as an additive bias for the tree keys: bias[jj * Mp + m] = 0 where node m % N sees node jj, else
  // -inf (padding queries see everything).
  float* bias = w.bias.get(Nk * Mp);
  for (int64_t jj = 0; jj < Nk; ++jj) {
    float* row = bias + jj * Mp;
    for (int64_t m = 0; m < Mp; ++m) row[m] = 0.0f;
    for (int64_t i = 0; i < N; ++i)
      if (!tree_mask_allows(p, b, i, jj))
        for (int64_t g = 0; g < G; ++g) row[g * N + i] = neg_inf();
  }
  const T* kbase = p.k + b * p.k_stride_b + kvh * p.k_stride_h;
  const T* vbase = p.v + b * p.v_stride_b + kvh * p.v_stride_h;
  const int64_t total = prefix + Nk;
  // S^T of every key, [blocks * kKeyBlock][Mp] (the two-pass softmax above).
  float* st = w.st.get((total + kKeyBlock - 1) / kKeyBlock * kKeyBlock * Mp);
  float* mx = w.mx.data();
  float* sum = w.sum.data();
  // Pass 1: scores, mask, maxima; one panel of NQ * W queries (then W at the end) at a time.
  for (int64_t t0 = 0; t0 < total; t0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, total - t0);
    const int64_t key_tiles = (keys + KT - 1) / KT * KT;
    // K rows: a float32 cache is read where it is, unless the score tiles would run past the last key; other
    // types are converted to float32 once per block (zero rows pad the last score tile).
    const float* k = nullptr;
    int64_t k_stride = D;
    if constexpr (std::is_same_v<T, float>) {
      if (key_tiles == keys) {
        k = kbase + t0 * p.k_stride_s;
        k_stride = p.k_stride_s;
      }
    }
    if (k == nullptr) {
      float* kb = w.kbuf.get(kKeyBlock * D);
      for (int64_t j = 0; j < keys; ++j) load_row(kbase + (t0 + j) * p.k_stride_s, kb + j * D, D);
      std::fill(kb + keys * D, kb + key_tiles * D, 0.0f);
      k = kb;
    }
    prefetch_rows(kbase, p.k_stride_s, t0 + kKeyBlock, std::min(t0 + 2 * kKeyBlock, total), D);
    float* sb = st + t0 * Mp;
    const int64_t tree_from = std::max<int64_t>(prefix - t0, 0);  // first tree key of the block
    const float* bias_b = bias + (t0 + tree_from - prefix) * Mp;
    int64_t q0 = 0;
    for (; q0 + NQ * W <= Mp; q0 += NQ * W) {
      for (int64_t j0 = 0; j0 < key_tiles; j0 += KT)
        scores_tile<V, KT, NQ>(qt + q0 * D, D, k + j0 * k_stride, k_stride, sb + j0 * Mp + q0, Mp);
      mask_max_panel<NQ * W>(sb + q0, Mp, keys, tree_from, bias_b + q0, mx + q0);
    }
    for (; q0 < Mp; q0 += W) {
      for (int64_t j0 = 0; j0 < key_tiles; j0 += KT)
        scores_tile<V, KT, 1>(qt + q0 * D, D, k + j0 * k_stride, k_stride, sb + j0 * Mp + q0, Mp);
      mask_max_panel<W>(sb + q0, Mp, keys, tree_from, bias_b + q0, mx + q0);
    }
  }
  // Pass 2: P, sums, and acc += P V in tiles of RT queries x NV * W dims (nothing is ever rescaled).
  for (int64_t t0 = 0; t0 < total; t0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, total - t0);
    const float* v = nullptr;
    int64_t v_stride = D;
    if constexpr (std::is_same_v<T, float>) {
      v = vbase + t0 * p.v_stride_s;
      v_stride = p.v_stride_s;
    } else {
      float* vb = w.vbuf.get(kKeyBlock * D);
      for (int64_t j = 0; j < keys; ++j) load_row(vbase + (t0 + j) * p.v_stride_s, vb + j * D, D);
      v = vb;
    }
    prefetch_rows(vbase, p.v_stride_s, t0 + kKeyBlock, std::min(t0 + 2 * kKeyBlock, total), D);
    float* sb = st + t0 * Mp;
    int64_t q0 = 0;
    for (; q0 + NQ * W <= Mp; q0 += NQ * W) exp_sum_panel<NQ * W>(sb + q0, Mp, keys, mx + q0, sum + q0);
    for (; q0 < Mp; q0 += W) exp_sum_panel<W>(sb + q0, Mp, keys, mx + q0, sum + q0);
    pv_block<V, RT, Tiles::DimVecs>(sb, Mp, M, keys, v, v_stride, acc, D, 0);
  }
  for (int64_t m = 0; m < M; ++m) {
    T* o = p.out + ((b * p.num_heads + kvh * G + m / N) * N + m % N) * D;
    // sum == 0: the query sees no key, and gets zeros even if a V row it did not see holds NaN (acc has 0 * NaN)
    const bool sees = sum[m] != 0.0f;
    const float inv = sees ? 1.0f / sum[m] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = from_float_rn<T>(sees ? acc[m * D + d] * inv : 0.0f);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename T>
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void tree_attention_task_avx512(
    const TreeAttentionParams<T>& p, int64_t b, int64_t kvh, int64_t prefix, int64_t Nk, Work& w) {
  tree_attention_task<T, Avx512Tiles>(p, b, kvh, prefix, Nk, w);
}
template <typename T>
__attribute__((target("avx2,fma"))) void tree_attention_task_avx2(const TreeAttentionParams<T>& p, int64_t b,
                                                                  int64_t kvh, int64_t prefix, int64_t Nk, Work& w) {
  tree_attention_task<T, Avx2Tiles>(p, b, kvh, prefix, Nk, w);
}
bool has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("fma");
  return has;
}
#endif
template <typename T>
void tree_attention_task_base(const TreeAttentionParams<T>& p, int64_t b, int64_t kvh, int64_t prefix, int64_t Nk,
                              Work& w) {
  tree_attention_task<T, BaseTiles>(p, b, kvh, prefix, Nk, w);
}

template <typename T>
void zero_group_outputs(const TreeAttentionParams<T>& p, int64_t b, int64_t kvh) {
  const int64_t G = p.num_heads / p.num_kv_heads, N = p.num_nodes, D = p.head_dim;
  for (int64_t g = 0; g < G; ++g) {
    T* o = p.out + ((b * p.num_heads + kvh * G + g) * N) * D;
    for (int64_t x = 0; x < N * D; ++x) o[x] = from_float_rn<T>(0.0f);
  }
}


#if defined(__x86_64__) && defined(__GNUC__)
// bfloat16 inputs on CPUs with AVX512-BF16 (vdpbf16ps: 32 bf16 products summed in pairs into 16 float32 lanes):
// S = Q K^T from the bf16 inputs as they are (products exact, float32 sums, then * scale): twice the arithmetic
// rate of the float32 FMA path. acc += P V with P rounded to bf16 (as flash-attention does on GPUs; the sums of P
// stay float32), one key per bf16 pair (the two-pass softmax's exactness). Layouts: Q and K as pairs of bf16 along
// D (their natural memory order, read as uint32), K transposed to [D / 2][kKeyBlock] pairs, V as [kKeyBlock][D]
// (v, 0) pairs.
#define SPECDEC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

bool has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return has;
}

// Pass 1 of the two-pass softmax (see the float32 path) for one key block [t0, t0 + keys): masks the tree keys
// node i may not see and the padding keys, and updates each query's maximum. `s` holds the block's scores of
// query m at s[m * ld + j].
template <typename T>
__attribute__((always_inline)) inline void mask_max_block(const TreeAttentionParams<T>& p, int64_t b, int64_t prefix,
                                                          int64_t t0, int64_t keys, int64_t M, float* s, int64_t ld,
                                                          float* mx) {
  const int64_t N = p.num_nodes;
  const int64_t tree_from = std::max<int64_t>(prefix - t0, 0);  // first tree key of the block
  for (int64_t m = 0; m < M; ++m) {
    float* sr = s + m * ld;
    const int64_t i = m % N;
    for (int64_t j = tree_from; j < keys; ++j)
      if (!tree_mask_allows(p, b, i, t0 + j - prefix)) sr[j] = neg_inf();
    for (int64_t j = keys; j < kKeyBlock; ++j) sr[j] = neg_inf();
    float bm = mx[m];
    for (int64_t j = 0; j < keys; ++j) bm = std::max(bm, sr[j]);
    mx[m] = bm;
  }
}

// Pass 2 for one key block: P = exp(s - max) in place (0 for masked keys and for queries that see no key) and the
// sums, accumulated key by key (not a SIMD reduction, whose lanes would depend on the keys' slots).
__attribute__((always_inline)) inline void exp_sum_block(int64_t M, int64_t rows, float* s, int64_t ld,
                                                         const float* mx, float* sum) {
  for (int64_t m = 0; m < M; ++m) {
    float* sr = s + m * ld;
    const float mu = mx[m] == neg_inf() ? 0.0f : mx[m];
    float l = sum[m];
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const float e = exp_nonpositive(sr[j] - mu);
      sr[j] = e;
      l += e;
    }
    sum[m] = l;
  }
  for (int64_t m = M; m < rows; ++m)
    for (int64_t j = 0; j < kKeyBlock; ++j) s[m * ld + j] = 0.0f;
}

// K^T for 16 keys: rows `k + i * stride` (i < n; zeros for the rest), bf16 pairs x0 .. x0 + 15 of each, stored
// as kt[x * kKeyBlock + i]: a 16 x 16 transpose of 32-bit pairs in registers (interleave 32-bit, then 64-bit
// elements within 128-bit lanes, then the lanes), instead of 16 scalar stores per pair. Data movement only.
// (GCC 12's unpack intrinsics pass _mm512_undefined_epi32() as their unused merge source: a false
// -Wmaybe-uninitialized.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
SPECDEC_BF16_TARGET inline void transpose_keys16(const bf16* k, int64_t stride, int64_t n, int64_t x0,
                                                 uint32_t* kt) {
  __m512i r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = i < n ? _mm512_loadu_si512(k + i * stride + 2 * x0) : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {  // t[i] lane l: r_i[4l], r_{i+1}[4l], r_i[4l+1], r_{i+1}[4l+1]; t[i+1]: +2
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + e] lane l: r_i .. r_{i+3} at pair 4l + e
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // pair 4l + e of the 16 keys: lane l of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512i a0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), a1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i b0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i b1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    _mm512_storeu_si512(kt + (x0 + e) * kKeyBlock, _mm512_shuffle_i32x4(a0, b0, 0x88));
    _mm512_storeu_si512(kt + (x0 + 4 + e) * kKeyBlock, _mm512_shuffle_i32x4(a0, b0, 0xDD));
    _mm512_storeu_si512(kt + (x0 + 8 + e) * kKeyBlock, _mm512_shuffle_i32x4(a1, b1, 0x88));
    _mm512_storeu_si512(kt + (x0 + 12 + e) * kKeyBlock, _mm512_shuffle_i32x4(a1, b1, 0xDD));
  }
}
#pragma GCC diagnostic pop

struct Bf16Work {
  std::vector<uint32_t> q, kt, v, pp;  // [rows][D/2], [D/2][KB], [KB][D], [rows][KB]
  std::vector<float> s, acc, mx, sum;  // s: [rows][blocks * KB], the scores of every key
};

// acc += P V for kRowTile queries and NV vectors of 16 dims, one key per bf16 pair (its partner is zero), so each
// product is added on its own, key by key: pairing consecutive keys would group a tree node's ancestors
// differently from decoding them one at a time (see the float32 path).
template <int NV>
SPECDEC_BF16_TARGET inline void pv_tile_bf16(const uint32_t* pp, const uint32_t* vp, int64_t keys, int64_t dim,
                                             int64_t d0, float* acc) {
  __m512 a[kRowTile][NV];
  for (int r = 0; r < kRowTile; ++r)
    for (int k = 0; k < NV; ++k) a[r][k] = _mm512_loadu_ps(acc + r * dim + d0 + 16 * k);
  for (int64_t jp = 0; jp < keys; ++jp) {
    __m512i v[NV];
    for (int k = 0; k < NV; ++k) v[k] = _mm512_loadu_si512(vp + jp * dim + d0 + 16 * k);
    for (int r = 0; r < kRowTile; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(pp[r * kKeyBlock + jp]));
      for (int k = 0; k < NV; ++k) a[r][k] = _mm512_dpbf16_ps(a[r][k], (__m512bh)pb, (__m512bh)v[k]);
    }
  }
  for (int r = 0; r < kRowTile; ++r)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + r * dim + d0 + 16 * k, a[r][k]);
}

SPECDEC_BF16_TARGET void tree_attention_bf16_task(const TreeAttentionParams<bf16>& p, int64_t b, int64_t kvh,
                                                  int64_t prefix, int64_t Nk, Bf16Work& w) {
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / Hkv, N = p.num_nodes, D = p.head_dim, D2 = D / 2;
  const int64_t M = G * N, rows = (M + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t total = prefix + Nk;
  const int64_t ld = (total + kKeyBlock - 1) / kKeyBlock * kKeyBlock;  // scores of every key, per query
  w.q.assign(rows * D2, 0u);
  w.kt.resize(D2 * kKeyBlock);
  w.v.resize(kKeyBlock * D);
  w.pp.resize(rows * kKeyBlock);
  w.s.resize(rows * ld);
  w.acc.assign(rows * D, 0.0f);
  w.mx.assign(rows, neg_inf());
  w.sum.assign(rows, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const bf16* src = p.q + b * p.q_stride_b + (kvh * G + m / N) * p.q_stride_h + (m % N) * p.q_stride_n;
    std::memcpy(w.q.data() + m * D2, src, D * sizeof(bf16));
  }
  const bf16* kbase = p.k + b * p.k_stride_b + kvh * p.k_stride_h;
  const bf16* vbase = p.v + b * p.v_stride_b + kvh * p.v_stride_h;
  const __m512 scale = _mm512_set1_ps(p.scale);
  // Pass 1 (the two-pass softmax of the float32 path): scores, mask, maxima. The cache rows of the next block (the
  // V rows of the first block after the last K block) are prefetched while this block computes.
  prefetch_rows(kbase, p.k_stride_s, 0, std::min(kKeyBlock, total), D);
  for (int64_t t0 = 0; t0 < total; t0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, total - t0);
    if (t0 + kKeyBlock < total)
      prefetch_rows(kbase, p.k_stride_s, t0 + kKeyBlock, std::min(t0 + 2 * kKeyBlock, total), D);
    else
      prefetch_rows(vbase, p.v_stride_s, 0, std::min(kKeyBlock, total), D);
    for (int64_t j0 = 0; j0 < kKeyBlock; j0 += 16) {  // K^T, 16 keys x 16 pairs at a time (zeros past the keys)
      const int64_t n = std::clamp<int64_t>(keys - j0, 0, 16);
      const bf16* k = n > 0 ? kbase + (t0 + j0) * p.k_stride_s : nullptr;
      int64_t x0 = 0;
      for (; x0 + 16 <= D2; x0 += 16) transpose_keys16(k, p.k_stride_s, n, x0, w.kt.data() + j0);
      for (int64_t j = 0; j < 16; ++j)  // (D = 80: the last 8 pairs one by one)
        for (int64_t x = x0; x < D2; ++x) {
          uint32_t pair = 0u;
          if (j < n) std::memcpy(&pair, k + j * p.k_stride_s + 2 * x, sizeof(pair));
          w.kt[x * kKeyBlock + j0 + j] = pair;
        }
    }
    float* sb = w.s.data() + t0;
    for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
      for (int64_t j0 = 0; j0 < kKeyBlock; j0 += 32) {
        __m512 a[kRowTile][2];
        for (int r = 0; r < kRowTile; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int64_t x = 0; x < D2; ++x) {
          const __m512i k0 = _mm512_loadu_si512(w.kt.data() + x * kKeyBlock + j0);
          const __m512i k1 = _mm512_loadu_si512(w.kt.data() + x * kKeyBlock + j0 + 16);
          for (int r = 0; r < kRowTile; ++r) {
            const __m512i qb = _mm512_set1_epi32(static_cast<int>(w.q[(m0 + r) * D2 + x]));
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)qb, (__m512bh)k0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)qb, (__m512bh)k1);
          }
        }
        for (int r = 0; r < kRowTile; ++r) {
          _mm512_storeu_ps(sb + (m0 + r) * ld + j0, _mm512_mul_ps(a[r][0], scale));
          _mm512_storeu_ps(sb + (m0 + r) * ld + j0 + 16, _mm512_mul_ps(a[r][1], scale));
        }
      }
    }
    mask_max_block(p, b, prefix, t0, keys, M, sb, ld, w.mx.data());
  }
  // Pass 2: P (rounded to bf16, as flash-attention does on GPUs; the sums stay float32), sums, acc += P V.
  for (int64_t t0 = 0; t0 < total; t0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, total - t0);
    prefetch_rows(vbase, p.v_stride_s, t0 + kKeyBlock, std::min(t0 + 2 * kKeyBlock, total), D);
    for (int64_t j = 0; j < keys; ++j) {  // V rows as (v, 0) bf16 pairs
      const uint16_t* vr = &vbase[(t0 + j) * p.v_stride_s].bits;
      uint32_t* out = w.v.data() + j * D;
      for (int64_t d = 0; d < D; ++d) out[d] = vr[d];
    }
    float* sb = w.s.data() + t0;
    exp_sum_block(M, rows, sb, ld, w.mx.data(), w.sum.data());
    for (int64_t m = 0; m < rows; ++m)  // P as (p, 0) bf16 pairs (round to nearest even)
      for (int64_t j0 = 0; j0 < kKeyBlock; j0 += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(sb + m * ld + j0));
        _mm512_storeu_si512(w.pp.data() + m * kKeyBlock + j0, _mm512_cvtepu16_epi32((__m256i)h));
      }
    for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
      const uint32_t* pp = w.pp.data() + m0 * kKeyBlock;
      float* acc = w.acc.data() + m0 * D;
      int64_t d0 = 0;
      for (; d0 + 32 <= D; d0 += 32) pv_tile_bf16<2>(pp, w.v.data(), keys, D, d0, acc);
      if (d0 < D) pv_tile_bf16<1>(pp, w.v.data(), keys, D, d0, acc);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    bf16* o = p.out + ((b * p.num_heads + kvh * G + m / N) * N + m % N) * D;
    const bool sees = w.sum[m] != 0.0f;  // (as in tree_attention_task)
    const float inv = sees ? 1.0f / w.sum[m] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = from_float_rn<bf16>(sees ? w.acc[m * D + d] * inv : 0.0f);
  }
}
#else
bool has_avx512_bf16() { return false; }
#endif

// The tree keys row b's nodes may see: 1 + the last one any node sees (0: none). The keys after it are masked for
// every query and would add exact zeros, so a task stops there: a row of a batch whose mask spans a much longer row
// (a layer op's [B, T, kv_len] mask, kv_len the batch's longest) attends over its own keys only.
template <typename T>
int64_t seen_tree_keys(const TreeAttentionParams<T>& p, int64_t b) {
  for (int64_t j = p.num_tree_keys; j > 0; --j)
    for (int64_t i = 0; i < p.num_nodes; ++i)
      if (tree_mask_allows(p, b, i, j - 1)) return j;
  return 0;
}

}  // namespace

template <typename T>
void TreeAttention(const TreeAttentionParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t Hkv = p.num_kv_heads, Nk = p.num_tree_keys;
  static thread_local Work work;
  int64_t seen_row = -1, seen = 0;  // seen_tree_keys of seen_row: a row's tasks (its kv heads) are consecutive
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / Hkv, kvh = task % Hkv;
    const int64_t prefix = p.prefix_lens[b];
    const bool bad = prefix < 0 || prefix > p.seq_len - Nk;
    if (kvh == 0) p.status[b] = bad ? RowStatus{kBadPrefixLen, 0, prefix} : RowStatus{kOk, 0, 0};
    if (bad) {
      zero_group_outputs(p, b, kvh);
      continue;
    }
    if (b != seen_row) {
      seen = seen_tree_keys(p, b);
      seen_row = b;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    if constexpr (std::is_same_v<T, bf16>) {
      if (has_avx512_bf16()) {
        static thread_local Bf16Work bf16_work;
        tree_attention_bf16_task(p, b, kvh, prefix, seen, bf16_work);
        continue;
      }
    }
    if (has_avx512()) {
      tree_attention_task_avx512(p, b, kvh, prefix, seen, work);
      continue;
    }
    if (has_avx2()) {
      tree_attention_task_avx2(p, b, kvh, prefix, seen, work);
      continue;
    }
#endif
    tree_attention_task_base(p, b, kvh, prefix, seen, work);
  }
}

void CompactKv(const CompactKvParams& p, int64_t task_begin, int64_t task_end) {
  std::vector<unsigned char> snapshot;
  const int64_t row = p.inner_bytes;
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t c = task / p.batch, b = task % p.batch;
    const RowStatus st = compact_kv_row_status(p, b);
    if (c == 0 && p.write_status) p.status[b] = st;
    if (st.code != kOk || row == 0) continue;  // row == 0: an empty last dim, nothing to move (and no data pointer)
    const int64_t len = p.lengths[b], dst = p.dst_start[b];
    const int64_t* src = p.src_positions + b * p.max_len;
    snapshot.resize(static_cast<size_t>(len * row));
    for (int64_t o = 0; o < p.outer; ++o) {
      unsigned char* base = static_cast<unsigned char*>(p.caches[c]) + (b * p.outer + o) * p.seq_len * row;
      // Reads first (into the snapshot), then writes. A position already in place (src = dst + i) is skipped: no
      // other i writes it, so copying it would not change anything.
      for (int64_t i = 0; i < len; ++i)
        if (src[i] != dst + i) std::memcpy(snapshot.data() + i * row, base + src[i] * row, row);
      for (int64_t i = 0; i < len; ++i)
        if (src[i] != dst + i) std::memcpy(base + (dst + i) * row, snapshot.data() + i * row, row);
    }
  }
}

template void TreeAttention<float>(const TreeAttentionParams<float>&, int64_t, int64_t);
template void TreeAttention<f16>(const TreeAttentionParams<f16>&, int64_t, int64_t);
template void TreeAttention<bf16>(const TreeAttentionParams<bf16>&, int64_t, int64_t);

}  // namespace specdec::cpu
