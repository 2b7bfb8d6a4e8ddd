// Tree attention and KV-cache compaction on CPU (semantics: common/params.h).
//
// TreeAttention: one task = (batch row, kv head). All G = H / Hkv query heads of the kv head and all N tree nodes
// (M = G * N queries) are processed together, so every K/V row is read (and converted to float32) once per task.
// Keys are taken in blocks of kKeyBlock: scores S = Q K^T for the block (register-blocked 4 queries x 16 keys),
// the tree mask for keys past the prefix, an online (flash-style) softmax update, then acc += P V (4 queries x 16
// dims). The two inner products are compiled for the baseline ISA, for AVX2 + FMA and for AVX-512 + FMA and chosen
// at run time, like the vocabulary loops. Unlike those, the clones may differ in the last bits (FMA contraction):
// attention outputs are compared with a tolerance, and FMA doubles the arithmetic throughput of these loops.
#include <algorithm>
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

constexpr int64_t kKeyBlock = 64;  // keys per block (multiple of kKeyTile)
constexpr int64_t kKeyTile = 32;   // keys per score micro-tile
constexpr int64_t kRowTile = 6;    // queries per micro-tile
constexpr int64_t kDimTile = 16;   // head dims per P.V micro-tile (every supported D is a multiple of 16)

// S[m, j] = sum_d Q[m, d] * Kt[d, j] for m < rows (a multiple of kRowTile; Q rows padded with zeros) and j <
// kKeyBlock. Kt is [D, kKeyBlock].
__attribute__((always_inline)) inline void scores_impl(const float* q, int64_t rows, int64_t dim, const float* kt, float* s) {
  for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
    const float* q0 = q + m0 * dim;
    for (int64_t j0 = 0; j0 < kKeyBlock; j0 += kKeyTile) {
      float a[kRowTile][kKeyTile] = {};
      for (int64_t d = 0; d < dim; ++d) {
        const float* kr = kt + d * kKeyBlock + j0;
        for (int64_t r = 0; r < kRowTile; ++r) {
          const float qv = q0[r * dim + d];
#pragma omp simd
          for (int64_t c = 0; c < kKeyTile; ++c) a[r][c] += qv * kr[c];
        }
      }
      for (int64_t r = 0; r < kRowTile; ++r)
        for (int64_t c = 0; c < kKeyTile; ++c) s[(m0 + r) * kKeyBlock + j0 + c] = a[r][c];
    }
  }
}

// acc[m, :] += sum_{j < keys} P[m, j] * V[j, :] for m < rows (multiple of kRowTile). V is [kKeyBlock, D].
__attribute__((always_inline)) inline void accumulate_pv_impl(const float* p, int64_t rows, int64_t keys, const float* v, int64_t dim,
                               float* acc) {
  for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
    for (int64_t d0 = 0; d0 < dim; d0 += kDimTile) {
      float a[kRowTile][kDimTile];
      for (int64_t r = 0; r < kRowTile; ++r)
        for (int64_t c = 0; c < kDimTile; ++c) a[r][c] = acc[(m0 + r) * dim + d0 + c];
      for (int64_t j = 0; j < keys; ++j) {
        const float* vr = v + j * dim + d0;
        for (int64_t r = 0; r < kRowTile; ++r) {
          const float pv = p[(m0 + r) * kKeyBlock + j];
#pragma omp simd
          for (int64_t c = 0; c < kDimTile; ++c) a[r][c] += pv * vr[c];
        }
      }
      for (int64_t r = 0; r < kRowTile; ++r)
        for (int64_t c = 0; c < kDimTile; ++c) acc[(m0 + r) * dim + d0 + c] = a[r][c];
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void scores_avx512(const float* q, int64_t rows, int64_t dim,
                                                                        const float* kt, float* s) {
  scores_impl(q, rows, dim, kt, s);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void accumulate_pv_avx512(const float* p, int64_t rows,
                                                                               int64_t keys, const float* v,
                                                                               int64_t dim, float* acc) {
  accumulate_pv_impl(p, rows, keys, v, dim, acc);
}
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, int64_t rows, int64_t dim, const float* kt,
                                                 float* s) {
  scores_impl(q, rows, dim, kt, s);
}
void scores_base(const float* q, int64_t rows, int64_t dim, const float* kt, float* s) {
  scores_impl(q, rows, dim, kt, s);
}
__attribute__((target("avx2,fma"))) void accumulate_pv_avx2(const float* p, int64_t rows, int64_t keys, const float* v,
                                                        int64_t dim, float* acc) {
  accumulate_pv_impl(p, rows, keys, v, dim, acc);
}
void accumulate_pv_base(const float* p, int64_t rows, int64_t keys, const float* v, int64_t dim, float* acc) {
  accumulate_pv_impl(p, rows, keys, v, dim, acc);
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
void scores(const float* q, int64_t rows, int64_t dim, const float* kt, float* s) {
  if (has_avx512()) return scores_avx512(q, rows, dim, kt, s);
  has_avx2() ? scores_avx2(q, rows, dim, kt, s) : scores_base(q, rows, dim, kt, s);
}
void accumulate_pv(const float* p, int64_t rows, int64_t keys, const float* v, int64_t dim, float* acc) {
  if (has_avx512()) return accumulate_pv_avx512(p, rows, keys, v, dim, acc);
  has_avx2() ? accumulate_pv_avx2(p, rows, keys, v, dim, acc) : accumulate_pv_base(p, rows, keys, v, dim, acc);
}
#else
void scores(const float* q, int64_t rows, int64_t dim, const float* kt, float* s) {
  scores_impl(q, rows, dim, kt, s);
}
void accumulate_pv(const float* p, int64_t rows, int64_t keys, const float* v, int64_t dim, float* acc) {
  accumulate_pv_impl(p, rows, keys, v, dim, acc);
}
#endif

// The mask and online-softmax step of one key block [t0, t0 + keys): masks padding keys and the tree keys node i
// may not see, updates each query's running max and sum, rescales its accumulator, and leaves the weights
// P = exp(s - max) in `s` (zeros for padding rows m >= M).
template <typename T>
__attribute__((always_inline)) inline void softmax_block(const TreeAttentionParams<T>& p, int64_t b, int64_t prefix,
                                                         int64_t t0, int64_t keys, int64_t M, int64_t rows,
                                                         float* s, float* mx, float* sum, float* acc) {
  const int64_t N = p.num_nodes, D = p.head_dim;
  const int64_t tree_from = std::max<int64_t>(prefix - t0, 0);  // first tree key of the block
  for (int64_t m = 0; m < M; ++m) {
    float* sr = s + m * kKeyBlock;
    const int64_t i = m % N;
    for (int64_t j = tree_from; j < keys; ++j)
      if (!tree_mask_allows(p, b, i, t0 + j - prefix)) sr[j] = neg_inf();
    for (int64_t j = keys; j < kKeyBlock; ++j) sr[j] = neg_inf();
    float bm = neg_inf();
    for (int64_t j = 0; j < keys; ++j) bm = std::max(bm, sr[j]);
    const float m_new = std::max(mx[m], bm);
    if (m_new == neg_inf()) {  // nothing visible yet: P = 0, state unchanged
      for (int64_t j = 0; j < kKeyBlock; ++j) sr[j] = 0.0f;
      continue;
    }
    const float alpha = exp_nonpositive(mx[m] - m_new);  // 0 when mx was -inf
    float l = 0.0f;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const float e = exp_nonpositive(sr[j] - m_new);
      sr[j] = e;
      l += e;
    }
    sum[m] = sum[m] * alpha + l;
    mx[m] = m_new;
    if (alpha != 1.0f) {
      float* a = acc + m * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
    }
  }
  for (int64_t m = M; m < rows; ++m)
    for (int64_t j = 0; j < kKeyBlock; ++j) s[m * kKeyBlock + j] = 0.0f;
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
// S = Q K^T from the bf16 inputs as they are (products exact, float32 sums, then * scale), and acc += P V with P
// rounded to bf16 (as flash-attention does on GPUs; the sums of P stay float32). Twice the arithmetic rate of the
// float32 FMA path. Layouts: Q and K as pairs of bf16 along D (their natural memory order, read as uint32), K
// transposed to [D / 2][kKeyBlock] pairs, V interleaved to [kKeyBlock / 2][D] pairs of consecutive keys.
#define SPECDEC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

bool has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return has;
}

struct Bf16Work {
  std::vector<uint32_t> q, kt, v, pp;  // [rows][D/2], [D/2][KB], [KB/2][D], [rows][KB/2]
  std::vector<float> s, acc, mx, sum;
};

template <int NV>  // NV vectors of 16 dims
SPECDEC_BF16_TARGET inline void pv_tile_bf16(const uint32_t* pp, const uint32_t* vp, int64_t pairs, int64_t dim,
                                             int64_t d0, float* acc) {
  __m512 a[kRowTile][NV];
  for (int r = 0; r < kRowTile; ++r)
    for (int k = 0; k < NV; ++k) a[r][k] = _mm512_loadu_ps(acc + r * dim + d0 + 16 * k);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512i v[NV];
    for (int k = 0; k < NV; ++k) v[k] = _mm512_loadu_si512(vp + jp * dim + d0 + 16 * k);
    for (int r = 0; r < kRowTile; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(pp[r * (kKeyBlock / 2) + jp]));
      for (int k = 0; k < NV; ++k) a[r][k] = _mm512_dpbf16_ps(a[r][k], (__m512bh)pb, (__m512bh)v[k]);
    }
  }
  for (int r = 0; r < kRowTile; ++r)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + r * dim + d0 + 16 * k, a[r][k]);
}

SPECDEC_BF16_TARGET void tree_attention_bf16_task(const TreeAttentionParams<bf16>& p, int64_t b, int64_t kvh,
                                                  int64_t prefix, Bf16Work& w) {
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / Hkv, N = p.num_nodes, D = p.head_dim, D2 = D / 2;
  const int64_t M = G * N, rows = (M + kRowTile - 1) / kRowTile * kRowTile;
  w.q.assign(rows * D2, 0u);
  w.kt.resize(D2 * kKeyBlock);
  w.v.resize(kKeyBlock / 2 * D);
  w.pp.resize(rows * kKeyBlock / 2);
  w.s.resize(rows * kKeyBlock);
  w.acc.assign(rows * D, 0.0f);
  w.mx.assign(rows, neg_inf());
  w.sum.assign(rows, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const bf16* src = p.q + b * p.q_stride_b + (kvh * G + m / N) * p.q_stride_h + (m % N) * p.q_stride_n;
    std::memcpy(w.q.data() + m * D2, src, D * sizeof(bf16));
  }
  const bf16* kbase = p.k + b * p.k_stride_b + kvh * p.k_stride_h;
  const bf16* vbase = p.v + b * p.v_stride_b + kvh * p.v_stride_h;
  const int64_t total = prefix + N;
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t t0 = 0; t0 < total; t0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, total - t0);
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      if (j < keys) {
        uint32_t kw[128];
        std::memcpy(kw, kbase + (t0 + j) * p.k_stride_s, D * sizeof(bf16));
        for (int64_t x = 0; x < D2; ++x) w.kt[x * kKeyBlock + j] = kw[x];
      } else {
        for (int64_t x = 0; x < D2; ++x) w.kt[x * kKeyBlock + j] = 0u;
      }
    }
    for (int64_t jp = 0; jp < kKeyBlock / 2; ++jp) {
      const int64_t j = 2 * jp;
      const uint16_t* v0 = j < keys ? &vbase[(t0 + j) * p.v_stride_s].bits : nullptr;
      const uint16_t* v1 = j + 1 < keys ? &vbase[(t0 + j + 1) * p.v_stride_s].bits : nullptr;
      uint32_t* out = w.v.data() + jp * D;
      for (int64_t d = 0; d < D; ++d)
        out[d] = (v0 ? v0[d] : 0u) | (static_cast<uint32_t>(v1 ? v1[d] : 0u) << 16);
    }
    // Scores.
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
          _mm512_storeu_ps(w.s.data() + (m0 + r) * kKeyBlock + j0, _mm512_mul_ps(a[r][0], scale));
          _mm512_storeu_ps(w.s.data() + (m0 + r) * kKeyBlock + j0 + 16, _mm512_mul_ps(a[r][1], scale));
        }
      }
    }
    softmax_block(p, b, prefix, t0, keys, M, rows, w.s.data(), w.mx.data(), w.sum.data(), w.acc.data());
    // P to bf16 pairs of consecutive keys (round to nearest even).
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j0 = 0; j0 < kKeyBlock; j0 += 32) {
        const float* sr = w.s.data() + m * kKeyBlock + j0;
        const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + 16), _mm512_loadu_ps(sr));
        _mm512_storeu_si512(w.pp.data() + m * (kKeyBlock / 2) + j0 / 2, (__m512i)h);
      }
    const int64_t pairs = (keys + 1) / 2;
    for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
      const uint32_t* pp = w.pp.data() + m0 * (kKeyBlock / 2);
      float* acc = w.acc.data() + m0 * D;
      int64_t d0 = 0;
      for (; d0 + 32 <= D; d0 += 32) pv_tile_bf16<2>(pp, w.v.data(), pairs, D, d0, acc);
      if (d0 < D) pv_tile_bf16<1>(pp, w.v.data(), pairs, D, d0, acc);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    bf16* o = p.out + ((b * p.num_heads + kvh * G + m / N) * N + m % N) * D;
    const float inv = w.sum[m] > 0.0f ? 1.0f / w.sum[m] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = from_float_rn<bf16>(w.acc[m * D + d] * inv);
  }
}
#else
bool has_avx512_bf16() { return false; }
#endif

}  // namespace

template <typename T>
void TreeAttention(const TreeAttentionParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / Hkv, N = p.num_nodes, D = p.head_dim;
  const int64_t M = G * N, rows = (M + kRowTile - 1) / kRowTile * kRowTile;
  std::vector<float> q(rows * D, 0.0f), acc(rows * D), kt(D * kKeyBlock), v(kKeyBlock * D), s(rows * kKeyBlock);
  std::vector<float> mx(rows), sum(rows), krow(D);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / Hkv, kvh = task % Hkv;
    const int64_t prefix = p.prefix_lens[b];
    const bool bad = prefix < 0 || prefix > p.seq_len - N;
    if (kvh == 0) p.status[b] = bad ? RowStatus{kBadPrefixLen, 0, prefix} : RowStatus{kOk, 0, 0};
    if (bad) {
      zero_group_outputs(p, b, kvh);
      continue;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    if constexpr (std::is_same_v<T, bf16>) {
      if (has_avx512_bf16()) {
        static thread_local Bf16Work work;
        tree_attention_bf16_task(p, b, kvh, prefix, work);
        continue;
      }
    }
#endif
    // Queries of the group, as float32, pre-multiplied by the softmax scale.
    for (int64_t m = 0; m < M; ++m) {
      const int64_t g = m / N, i = m % N;
      const T* src = p.q + b * p.q_stride_b + (kvh * G + g) * p.q_stride_h + i * p.q_stride_n;
      for (int64_t d = 0; d < D; ++d) q[m * D + d] = to_float(src[d]) * p.scale;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(mx.begin(), mx.end(), neg_inf());
    std::fill(sum.begin(), sum.end(), 0.0f);
    const T* kbase = p.k + b * p.k_stride_b + kvh * p.k_stride_h;
    const T* vbase = p.v + b * p.v_stride_b + kvh * p.v_stride_h;
    const int64_t total = prefix + N;
    for (int64_t t0 = 0; t0 < total; t0 += kKeyBlock) {
      const int64_t keys = std::min(kKeyBlock, total - t0);
      for (int64_t j = 0; j < keys; ++j) {
        load_row(kbase + (t0 + j) * p.k_stride_s, krow.data(), D);
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyBlock + j] = krow[d];
        load_row(vbase + (t0 + j) * p.v_stride_s, v.data() + j * D, D);
      }
      for (int64_t j = keys; j < kKeyBlock; ++j)
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyBlock + j] = 0.0f;
      scores(q.data(), rows, D, kt.data(), s.data());
      softmax_block(p, b, prefix, t0, keys, M, rows, s.data(), mx.data(), sum.data(), acc.data());
      accumulate_pv(s.data(), rows, keys, v.data(), D, acc.data());
    }
    for (int64_t m = 0; m < M; ++m) {
      const int64_t g = m / N, i = m % N;
      T* o = p.out + ((b * p.num_heads + kvh * G + g) * N + i) * D;
      const float inv = sum[m] > 0.0f ? 1.0f / sum[m] : 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] = from_float_rn<T>(acc[m * D + d] * inv);
    }
  }
}

void CompactKv(const CompactKvParams& p, int64_t task_begin, int64_t task_end) {
  std::vector<unsigned char> snapshot;
  const int64_t row = p.inner_bytes;
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t c = task / p.batch, b = task % p.batch;
    const RowStatus st = compact_kv_row_status(p, b);
    if (c == 0 && p.write_status) p.status[b] = st;
    if (st.code != kOk) continue;
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
