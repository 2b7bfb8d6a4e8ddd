// Weight-only int8 linear layers for the few-row products of drafting (layout and semantics: common/params.h).
//
// Why int8 inputs too: a drafter's products are bound by reading its weights, and int8 weights are a quarter of the
// float32 bytes; converting each int8 weight to float32 before a multiply-add costs 3 instructions per 8 weights
// and row (slower than these dot products at 1-4 rows: docs/ARCHITECTURE.md). Quantising the few input rows once
// per call lets the integer dot products multiply 4 K-values per lane, and integer sums are exact, so every path
// here, the CUDA kernel and the reference give the same bits, whatever the row blocking.
// Paths: AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd) and a portable loop; PackedLinearInt8Path() says
// which one runs.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "linear_tiles.h"

namespace specdec::cpu {
namespace {

using namespace intlinear;  // NOLINT(build/namespaces): the shared tiling, epilogue and CPU checks

constexpr int64_t kPanel = kLinearPanel, kQuad = kLinearInt8Quad;
constexpr int64_t kPanelQuadBytes = kPanel * kQuad;  // one K-quad of a panel: 32 lanes of 4 int8

// The quantisation scale of v[0 .. K) (params.h).
template <typename T>
Int8RowScale row_scale(const T* v, int64_t K) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < K; ++k) {
    const float a = std::fabs(to_float(v[k]));
    finite &= a <= 3.40282347e38f;  // (false for inf and NaN)
    amax = a > amax ? a : amax;
  }
  return int8_row_scale(amax, finite);
}

template <typename T>
void generic_panels(const PackedLinearInt8Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  const int64_t Kp = linear_int8_padded_k(p.in_features), KQ = Kp / kQuad;
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const int8_t* w = p.packed + panel * KQ * kPanelQuadBytes;
    for (int64_t m = 0; m < p.rows; ++m) {
      const int8_t* x = p.qx + m * Kp;
      int32_t acc[kPanel] = {};
      for (int64_t kq = 0; kq < KQ; ++kq) {
        const int8_t* wk = w + kq * kPanelQuadBytes;
        for (int64_t j = 0; j < kPanel; ++j)
          for (int64_t e = 0; e < kQuad; ++e) acc[j] += int32_t{x[kq * kQuad + e]} * int32_t{wk[j * kQuad + e]};
      }
      store_panel(p, m, panel, acc);
    }
  }
}

template <typename T>
using Int8TileFn = void (*)(const PackedLinearInt8Params<T>&, int64_t, int64_t);

#ifdef SPECDEC_INTLINEAR_X86
// Prefetch distance in bytes along a panel's stream.
constexpr int64_t kPrefetchBytes = 2048;

// Prefetches K-quad kq's 128 bytes kPrefetchBytes ahead in each of NP panels' streams.
template <int NP>
inline void prefetch_quads(const int8_t* w, int64_t stride, int64_t kq) {
  SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
    const char* wk = reinterpret_cast<const char*>(w + q * stride + kq * kPanelQuadBytes);
    _mm_prefetch(wk + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(wk + kPrefetchBytes + 64, _MM_HINT_T0);
  }
}

// The 4 int8 inputs of K-quad kq of a row, as one 32-bit lane.
inline int32_t quad(const int8_t* x, int64_t kq) {
  int32_t v;
  std::memcpy(&v, x + kq * kQuad, sizeof(v));
  return v;
}

// 8 inputs of a row as float32 (bfloat16: a 16-bit shift), lanes >= `valid` zero.
template <typename T>
SPECDEC_AVX2_FN inline __m256 load8(const T* v, int64_t valid) {
  if constexpr (std::is_same_v<T, float>) {
    if (valid >= 8) return _mm256_loadu_ps(v);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(v, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lane));
  } else {
    alignas(16) uint16_t raw[8] = {};
    std::memcpy(raw, v, sizeof(uint16_t) * static_cast<size_t>(std::min<int64_t>(valid, 8)));
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(raw)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

// quantize_row for float32 and bfloat16 rows: the same operations as the scalar loop, 8 values at a time (max and
// the finiteness test are exact; q = rint(v * inverse) rounds to nearest even like rintf).
template <typename T>
SPECDEC_AVX2_FN float quantize_row_avx2(const T* v, int64_t K, int8_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 largest = _mm256_set1_ps(3.40282347e38f);
  __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 a = _mm256_and_ps(load8(v + k, K - k), magnitude);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, largest, _CMP_LE_OQ));  // (false for inf and NaN)
    amax = _mm256_max_ps(amax, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = 0.0f;
  for (float f : lanes) m = f > m ? f : m;
  const Int8RowScale s = int8_row_scale(m, _mm256_movemask_ps(finite) == 0xff);
  const int64_t Kp = linear_int8_padded_k(K);
  if (s.inverse == 0.0f) {
    leave_vector_state_clean();
    std::memset(q, 0, static_cast<size_t>(Kp));
    return s.scale;
  }
  const __m256 inverse = _mm256_set1_ps(s.inverse), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(load8(v + k, 8), inverse), _MM_FROUND_TO_NEAREST_INT |
                                     _MM_FROUND_NO_EXC);
    const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(i16, i16));
  }
  leave_vector_state_clean();
  for (; k < K; ++k) q[k] = int8_quantize(to_float(v[k]), s.inverse);
  for (; k < Kp; ++k) q[k] = 0;
  return s.scale;
}

// AVX2 tile: MR rows x NP panels, 4 vectors of 8 int32 sums per panel and row. vpmaddubsw multiplies unsigned by
// signed bytes, so the input's sign moves onto the weight (vpsignb) and |x| is the unsigned operand; a pair sum is
// at most 2 * 127^2 < 2^15 (no saturation: both sides are in [-127, 127]).
template <typename T, int MR, int NP>
SPECDEC_AVX2_FN void tile_avx2(const PackedLinearInt8Params<T>& p, int64_t m0, int64_t panel) {
  const int64_t Kp = linear_int8_padded_k(p.in_features), KQ = Kp / kQuad, stride = KQ * kPanelQuadBytes;
  const int8_t* x = p.qx + m0 * Kp;
  const int8_t* w = p.packed + panel * stride;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MR][4 * NP];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int v = 0; v < 4 * NP; ++v) acc[m][v] = _mm256_setzero_si256();
  for (int64_t kq = 0; kq < KQ; ++kq) {
    prefetch_quads<NP>(w, stride, kq);
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
      const __m256i xb = _mm256_set1_epi32(quad(x + m * Kp, kq)), ax = _mm256_abs_epi8(xb);
      SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
        const int8_t* wk = w + q * stride + kq * kPanelQuadBytes;
        SPECDEC_UNROLL for (int v = 0; v < 4; ++v) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32 * v));
          const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xb));
          acc[m][4 * q + v] = _mm256_add_epi32(acc[m][4 * q + v], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
  }
  alignas(32) int32_t out[MR][NP][kPanel];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int q = 0; q < NP; ++q)
      SPECDEC_UNROLL for (int v = 0; v < 4; ++v)
        _mm256_store_si256(reinterpret_cast<__m256i*>(out[m][q] + 8 * v), acc[m][4 * q + v]);
  leave_vector_state_clean();
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int q = 0; q < NP; ++q) store_panel(p, m0 + m, panel + q, out[m][q]);
}

// AVX-512 VNNI tile: 2 vectors of 16 int32 sums per panel and row; vpdpbusd adds 4 products of unsigned by signed
// bytes per lane (|x| and the weight with x's sign, negated under a mask: AVX-512 has no vpsignb).
template <typename T, int MR, int NP>
SPECDEC_VNNI_FN void tile_vnni(const PackedLinearInt8Params<T>& p, int64_t m0, int64_t panel) {
  const int64_t Kp = linear_int8_padded_k(p.in_features), KQ = Kp / kQuad, stride = KQ * kPanelQuadBytes;
  const int8_t* x = p.qx + m0 * Kp;
  const int8_t* w = p.packed + panel * stride;
  const __m512i zero = _mm512_setzero_si512();
  __m512i acc[MR][2 * NP];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) acc[m][v] = zero;
  for (int64_t kq = 0; kq < KQ; ++kq) {
    prefetch_quads<NP>(w, stride, kq);
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
      const __m512i xb = _mm512_set1_epi32(quad(x + m * Kp, kq)), ax = _mm512_abs_epi8(xb);
      const __mmask64 negative = _mm512_movepi8_mask(xb);
      SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
        const int8_t* wk = w + q * stride + kq * kPanelQuadBytes;
        SPECDEC_UNROLL for (int v = 0; v < 2; ++v) {
          const __m512i wv = _mm512_loadu_si512(wk + 64 * v);
          const __m512i signed_w = _mm512_mask_sub_epi8(wv, negative, zero, wv);
          acc[m][2 * q + v] = _mm512_dpbusd_epi32(acc[m][2 * q + v], ax, signed_w);
        }
      }
    }
  }
  alignas(64) int32_t out[MR][NP][kPanel];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int q = 0; q < NP; ++q)
      SPECDEC_UNROLL for (int v = 0; v < 2; ++v) _mm512_store_si512(out[m][q] + 16 * v, acc[m][2 * q + v]);
  leave_vector_state_clean();
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int q = 0; q < NP; ++q) store_panel(p, m0 + m, panel + q, out[m][q]);
}

// Tile tables: index r - 1 is the tile of r rows. AVX2 has 16 vector registers: 2 rows of one panel or 1 row of
// two (8 sums + the operands); AVX-512 has 32: up to 4 rows of two panels, 8 rows of one (16 sums).
template <typename T, int NP, int... MR>
constexpr std::array<Int8TileFn<T>, sizeof...(MR)> avx2_tiles(std::integer_sequence<int, MR...>) {
  return {&tile_avx2<T, MR + 1, NP>...};
}
template <typename T, int NP, int... MR>
constexpr std::array<Int8TileFn<T>, sizeof...(MR)> vnni_tiles(std::integer_sequence<int, MR...>) {
  return {&tile_vnni<T, MR + 1, NP>...};
}

template <typename T>
void avx2_panels(const PackedLinearInt8Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  static constexpr auto two = avx2_tiles<T, 2>(std::make_integer_sequence<int, 1>{});
  static constexpr auto one = avx2_tiles<T, 1>(std::make_integer_sequence<int, 2>{});
  tiled_panels(p, panel_begin, panel_end, two, one);
}

template <typename T>
void vnni_panels(const PackedLinearInt8Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  static constexpr auto two = vnni_tiles<T, 2>(std::make_integer_sequence<int, 4>{});
  static constexpr auto one = vnni_tiles<T, 1>(std::make_integer_sequence<int, 8>{});
  tiled_panels(p, panel_begin, panel_end, two, one);
}
#endif  // SPECDEC_INTLINEAR_X86

template <typename T>
void run(Path path, const PackedLinearInt8Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  if (p.rows <= 0 || panel_begin >= panel_end) return;
#ifdef SPECDEC_INTLINEAR_X86
  if (path == Path::kAvx512Vnni) return vnni_panels(p, panel_begin, panel_end);
  if (path == Path::kAvx2) return avx2_panels(p, panel_begin, panel_end);
#endif
  generic_panels(p, panel_begin, panel_end);
}

}  // namespace

template <typename T>
void QuantizeRowsInt8(const QuantizeRowsInt8Params<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t K = p.in_features, Kp = linear_int8_padded_k(K);
#ifdef SPECDEC_INTLINEAR_X86
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    if (cpu_has_avx2()) {
      for (int64_t m = row_begin; m < row_end; ++m) p.scales[m] = quantize_row_avx2(p.x + m * K, K, p.q + m * Kp);
      return;
    }
  }
#endif
  for (int64_t m = row_begin; m < row_end; ++m) {
    const T* x = p.x + m * K;
    const Int8RowScale s = row_scale(x, K);
    p.scales[m] = s.scale;
    int8_t* q = p.q + m * Kp;
    for (int64_t k = 0; k < K; ++k) q[k] = int8_quantize(to_float(x[k]), s.inverse);
    for (int64_t k = K; k < Kp; ++k) q[k] = 0;
  }
}

template <typename T>
void PackLinearWeightInt8(const PackLinearInt8Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  const int64_t N = p.out_features, K = p.in_features, KQ = linear_int8_padded_k(K) / kQuad;
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    int8_t* dst = p.packed + panel * KQ * kPanelQuadBytes;
    std::memset(dst, 0, static_cast<size_t>(KQ * kPanelQuadBytes));
    const int64_t n0 = panel * kPanel, valid = std::min(kPanel, N - n0);
    for (int64_t j = 0; j < valid; ++j) {
      const T* src = p.weight + (n0 + j) * K;
      const Int8RowScale s = row_scale(src, K);
      p.scales[n0 + j] = s.scale;
      for (int64_t k = 0; k < K; ++k)
        dst[((k / kQuad) * kPanel + j) * kQuad + k % kQuad] = int8_quantize(to_float(src[k]), s.inverse);
    }
  }
}

const char* PackedLinearInt8Path() { return kPathNames[static_cast<int>(best_path())]; }

template <typename T>
bool PackedLinearInt8Using(const char* path, const PackedLinearInt8Params<T>& p, int64_t panel_begin,
                           int64_t panel_end) {
  return run_named_path(path, [&](Path chosen) { run(chosen, p, panel_begin, panel_end); });
}

template <typename T>
void PackedLinearInt8(const PackedLinearInt8Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  run(best_path(), p, panel_begin, panel_end);
}

#define SPECDEC_INSTANTIATE_LINEAR_INT8(T)                                                                   \
  template void QuantizeRowsInt8<T>(const QuantizeRowsInt8Params<T>&, int64_t, int64_t);                    \
  template void PackLinearWeightInt8<T>(const PackLinearInt8Params<T>&, int64_t, int64_t);                  \
  template bool PackedLinearInt8Using<T>(const char*, const PackedLinearInt8Params<T>&, int64_t, int64_t);  \
  template void PackedLinearInt8<T>(const PackedLinearInt8Params<T>&, int64_t, int64_t);
SPECDEC_INSTANTIATE_LINEAR_INT8(float)
SPECDEC_INSTANTIATE_LINEAR_INT8(f16)
SPECDEC_INSTANTIATE_LINEAR_INT8(bf16)
#undef SPECDEC_INSTANTIATE_LINEAR_INT8

}  // namespace specdec::cpu
