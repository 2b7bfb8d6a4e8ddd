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
#include <vector>

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

template <typename T>
void zero_group_outputs(const TreeAttentionParams<T>& p, int64_t b, int64_t kvh) {
  const int64_t G = p.num_heads / p.num_kv_heads, N = p.num_nodes, D = p.head_dim;
  for (int64_t g = 0; g < G; ++g) {
    T* o = p.out + ((b * p.num_heads + kvh * G + g) * N) * D;
    for (int64_t x = 0; x < N * D; ++x) o[x] = from_float_rn<T>(0.0f);
  }
}

}  // namespace

template <typename T>
void TreeAttention(const TreeAttentionParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / Hkv, N = p.num_nodes, D = p.head_dim;
  const int64_t M = G * N, rows = (M + kRowTile - 1) / kRowTile * kRowTile;
  std::vector<float> q(rows * D, 0.0f), acc(rows * D), kt(D * kKeyBlock), v(kKeyBlock * D), s(rows * kKeyBlock);
  std::vector<float> mx(rows), sum(rows);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / Hkv, kvh = task % Hkv;
    const int64_t prefix = p.prefix_lens[b];
    const bool bad = prefix < 0 || prefix > p.seq_len - N;
    if (kvh == 0) p.status[b] = bad ? RowStatus{kBadPrefixLen, 0, prefix} : RowStatus{kOk, 0, 0};
    if (bad) {
      zero_group_outputs(p, b, kvh);
      continue;
    }
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
        const T* kr = kbase + (t0 + j) * p.k_stride_s;
        const T* vr = vbase + (t0 + j) * p.v_stride_s;
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyBlock + j] = to_float(kr[d]);
        for (int64_t d = 0; d < D; ++d) v[j * D + d] = to_float(vr[d]);
      }
      for (int64_t j = keys; j < kKeyBlock; ++j)
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyBlock + j] = 0.0f;
      scores(q.data(), rows, D, kt.data(), s.data());
      // Mask: padding keys, and tree keys the node may not see.
      const int64_t tree_from = std::max<int64_t>(prefix - t0, 0);  // first tree key of the block
      for (int64_t m = 0; m < M; ++m) {
        float* sr = s.data() + m * kKeyBlock;
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
          float* a = acc.data() + m * D;
          for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        }
      }
      for (int64_t m = M; m < rows; ++m)
        for (int64_t j = 0; j < kKeyBlock; ++j) s[m * kKeyBlock + j] = 0.0f;
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
