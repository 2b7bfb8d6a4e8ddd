// Linear layers over a packed weight, for the few-row products of decoding (layout and semantics: common/params.h).
//
// Why a kernel of our own: decoding multiplies 1 row, verification 2-16 rows, by every weight of the model. On the
// development CPU (AVX-512, 1 thread) aten's float32 product of 5-16 rows cost 1.6-2x its one-row product (MKL
// switches from a streaming GEMV to a GEMM that re-lays out the weight on each call), and its bfloat16 one-row
// product streamed weights at a third of DRAM bandwidth. Here the weight is laid out once so that each panel of
// 32 outputs is one sequential stream, and a tile keeps all its rows' accumulators in registers: each weight is
// loaded once per block of up to 12 rows, and the product of a few rows costs about what streaming the weight
// costs, as on a GPU. Paths: AVX-512F (float32), AVX512-BF16 (bfloat16 dot products of K-pairs), AVX2 + FMA (both
// dtypes, for x86-64 CPUs without those) and a portable loop for other CPUs and float16; PackedLinearPath<T>() says
// which one runs.
#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SPECDEC_LINEAR_X86 1
#endif

namespace specdec::cpu {
namespace {

constexpr int64_t kPanel = kLinearPanel;

template <typename T>
int64_t packed_k(int64_t K) {
  return (K + linear_pack_pair<T>() - 1) / linear_pack_pair<T>();
}

// Row blocks: at most `max_rows` rows each, sizes as equal as possible (13 rows: 7 + 6, not 12 + 1).
inline int64_t row_block(int64_t m0, int64_t M, int64_t max_rows) {
  const int64_t left = M - m0, blocks = (left + max_rows - 1) / max_rows;
  return (left + blocks - 1) / blocks;
}

// Portable path: one panel, up to 4 rows per tile, one float accumulator per output element.
template <typename T>
void generic_panels(const PackedLinearParams<T>& p, int64_t panel_begin, int64_t panel_end) {
  constexpr int64_t P = linear_pack_pair<T>();
  const int64_t K = p.in_features, KP = packed_k<T>(K), N = p.out_features;
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const T* w = p.packed + panel * KP * kPanel * P;
    const int64_t n0 = panel * kPanel, valid = std::min(kPanel, N - n0);
    for (int64_t m0 = 0; m0 < p.rows; m0 += 4) {
      const int64_t mr = std::min<int64_t>(4, p.rows - m0);
      float acc[4][kPanel] = {};
      for (int64_t k = 0; k < K; ++k) {
        const T* wk = w + (k / P) * kPanel * P + k % P;
        for (int64_t m = 0; m < mr; ++m) {
          const float xv = to_float(p.x[(m0 + m) * K + k]);
          for (int64_t j = 0; j < kPanel; ++j) acc[m][j] += xv * to_float(wk[j * P]);
        }
      }
      for (int64_t m = 0; m < mr; ++m)
        for (int64_t j = 0; j < valid; ++j)
          p.y[(m0 + m) * N + n0 + j] =
              from_float_rn<T>(acc[m][j] + (p.bias != nullptr ? to_float(p.bias[n0 + j]) : 0.0f));
    }
  }
}

#ifdef SPECDEC_LINEAR_X86
#define SPECDEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define SPECDEC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

// Lanes [0, valid) of a 16-lane vector (valid may be <= 0 or >= 16).
SPECDEC_AVX512 inline __mmask16 lanes(int64_t valid) {
  return valid >= 16 ? static_cast<__mmask16>(0xffff)
                     : static_cast<__mmask16>(valid <= 0 ? 0 : (1u << valid) - 1u);
}

// Prefetch distance in bytes along a panel's stream (the hardware prefetcher alone left bandwidth unused).
constexpr int64_t kPrefetchBytes = 2048;

// float32 tile: MR rows x NP panels (2 * NP vectors of 16 outputs per row; MR * 2 * NP accumulators).
template <int MR, int NP>
SPECDEC_AVX512 void tile_f32(const PackedLinearParams<float>& p, int64_t m0, int64_t panel) {
  const int64_t K = p.in_features, N = p.out_features, stride = K * kPanel;
  const float* x = p.x + m0 * K;
  const float* w = p.packed + panel * stride;
  __m512 acc[MR][2 * NP];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[2 * NP];
    SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
      const float* wk = w + q * stride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes + 64, _MM_HINT_T0);
      wv[2 * q] = _mm512_loadu_ps(wk);
      wv[2 * q + 1] = _mm512_loadu_ps(wk + 16);
    }
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * K + k]);
      SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm512_fmadd_ps(xm, wv[v], acc[m][v]);
    }
  }
  SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) {
    const int64_t n = panel * kPanel + v * 16;
    const __mmask16 mask = lanes(N - n);
    if (mask == 0) continue;
    const __m512 b = p.bias != nullptr ? _mm512_maskz_loadu_ps(mask, p.bias + n) : _mm512_setzero_ps();
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
      _mm512_mask_storeu_ps(p.y + (m0 + m) * N + n, mask, _mm512_add_ps(acc[m][v], b));
  }
}

// bfloat16 tile: each step multiplies a K-pair of every row by the pair of 32 outputs with one dot product per
// 16 outputs (float32 accumulation); the result is rounded to bfloat16 once, to nearest even.
template <int MR, int NP>
SPECDEC_AVX512_BF16 void tile_bf16(const PackedLinearParams<bf16>& p, int64_t m0, int64_t panel) {
  const int64_t K = p.in_features, N = p.out_features, KP = packed_k<bf16>(K), stride = KP * kPanel * 2;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(p.x) + m0 * K;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(p.packed) + panel * stride;
  __m512 acc[MR][2 * NP];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t full_pairs = K / 2;
  for (int64_t kp = 0; kp < KP; ++kp) {
    // Past an odd K the pair's high half is the packing's padding: it must not reach the sum, whatever it holds
    // (0 * NaN would), so it is masked out of the weights as well as the inputs.
    const __m512i pair_mask = _mm512_set1_epi32(kp < full_pairs ? -1 : 0xffff);
    __m512bh wv[2 * NP];
    SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
      const uint16_t* wk = w + q * stride + kp * kPanel * 2;
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes + 64, _MM_HINT_T0);
      wv[2 * q] = reinterpret_cast<__m512bh>(_mm512_and_si512(_mm512_loadu_si512(wk), pair_mask));
      wv[2 * q + 1] = reinterpret_cast<__m512bh>(_mm512_and_si512(_mm512_loadu_si512(wk + 32), pair_mask));
    }
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
      uint32_t pair;  // x[2 kp] in the low half, x[2 kp + 1] (or 0 past an odd K) in the high half
      if (kp < full_pairs) {
        std::memcpy(&pair, x + m * K + 2 * kp, sizeof(pair));
      } else {
        pair = x[m * K + 2 * kp];
      }
      const __m512bh xm = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xm, wv[v]);
    }
  }
  SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) {
    const int64_t n = panel * kPanel + v * 16;
    const __mmask16 mask = lanes(N - n);
    if (mask == 0) continue;
    __m512 b = _mm512_setzero_ps();
    if (p.bias != nullptr) {  // bfloat16 -> float32 is a 16-bit shift
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(p.bias) + n);
      // (maskz forms: GCC 12 warns about the plain forms' undefined pass-through operand)
      b = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, raw), 16));
    }
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][v], b));
      _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(p.y) + (m0 + m) * N + n, mask,
                               reinterpret_cast<__m256i>(rounded));
    }
  }
}

// Tile shapes. Up to 4 rows take two panels at once (enough independent accumulation chains to hide the FMA
// latency at one row); 5-12 rows take one (24 accumulators + 2 weight vectors fit the 32 vector registers).
constexpr int kMaxRowsTwoPanels = 4, kMaxRows = 12;

template <typename T, int NP>
using TileFn = void (*)(const PackedLinearParams<T>&, int64_t, int64_t);

template <typename T, int NP, int... MR>
constexpr auto make_tiles(std::integer_sequence<int, MR...>) {
  if constexpr (std::is_same_v<T, float>) {
    return std::array<TileFn<T, NP>, sizeof...(MR)>{&tile_f32<MR + 1, NP>...};
  } else {
    return std::array<TileFn<T, NP>, sizeof...(MR)>{&tile_bf16<MR + 1, NP>...};
  }
}

template <typename T>
void vector_panels(const PackedLinearParams<T>& p, int64_t panel_begin, int64_t panel_end) {
  static constexpr auto two = make_tiles<T, 2>(std::make_integer_sequence<int, kMaxRowsTwoPanels>{});
  static constexpr auto one = make_tiles<T, 1>(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t M = p.rows;
  if (M <= kMaxRowsTwoPanels) {
    int64_t panel = panel_begin;
    for (; panel + 2 <= panel_end; panel += 2) two[M - 1](p, 0, panel);
    if (panel < panel_end) one[M - 1](p, 0, panel);
    return;
  }
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t mr = row_block(m0, M, kMaxRows);
      one[mr - 1](p, m0, panel);
      m0 += mr;
    }
  }
}

// AVX2 + FMA (x86-64 CPUs without AVX-512, e.g. AMD Zen 1-3, Intel before Ice Lake): 16 vector registers of 8 floats,
// so a panel of 32 outputs is 4 accumulators per row. One row takes two panels at once (8 independent chains hide
// the FMA latency); more rows take one panel and up to 3 rows (12 accumulators + the broadcast + a weight vector).
#define SPECDEC_AVX2 __attribute__((target("avx2,fma")))

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// Rounds `acc + bias` (bias may be null) of one 8-output group to T and stores the first `valid` (1..8) of them.
template <typename T>
SPECDEC_AVX2 inline void store8(T* y, const T* bias, __m256 acc, int64_t valid) {
  alignas(32) float v[8];
  _mm256_store_ps(v, acc);
  for (int64_t j = 0; j < valid; ++j) y[j] = from_float_rn<T>(v[j] + (bias != nullptr ? to_float(bias[j]) : 0.0f));
}

template <>
SPECDEC_AVX2 inline void store8<float>(float* y, const float* bias, __m256 acc, int64_t valid) {
  if (valid == 8) {
    _mm256_storeu_ps(y, bias != nullptr ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc);
    return;
  }
  alignas(32) float v[8];
  _mm256_store_ps(v, acc);
  for (int64_t j = 0; j < valid; ++j) y[j] = v[j] + (bias != nullptr ? bias[j] : 0.0f);
}

// What a tile prefetches. A panel's K-step is 128 bytes (32 float32 outputs, or 32 bfloat16 K-pairs). With several
// row blocks per panel only the first would read it from memory and the others from L2, leaving memory idle while
// they compute. So the panel's B row blocks together prefetch the next panel into L2, spread evenly over their
// B * K steps (`next`: one of its K-steps every B steps, from step `step` on), and none streams ahead (`ahead`).
// One row block streams its own panel ahead, as the AVX-512 tiles do.
struct PanelPrefetch {
  bool ahead = true;
  const char* next = nullptr;
  int64_t blocks = 1, step = 0;  // (step: where this block's share of the next panel begins, in its K-steps)

  SPECDEC_AVX2 inline void next_step(int64_t k) {
    if (next == nullptr || (step + k) % blocks != 0) return;
    const char* line = next + (step + k) / blocks * 128;
    _mm_prefetch(line, _MM_HINT_T1);
    _mm_prefetch(line + 64, _MM_HINT_T1);
  }
};

// float32 tile: MR rows x NP panels, acc = fma(x[m, k], w[k, n], acc) for k = 0 .. K - 1 (the AVX-512 path's order,
// so both give the same bits).
template <int MR, int NP>
SPECDEC_AVX2 void tile_f32_avx2(const PackedLinearParams<float>& p, int64_t m0, int64_t panel, PanelPrefetch pf) {
  const int64_t K = p.in_features, N = p.out_features, stride = K * kPanel;
  const float* x = p.x + m0 * K;
  const float* w = p.packed + panel * stride;
  __m256 acc[MR][4 * NP];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int v = 0; v < 4 * NP; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (pf.ahead) {
      SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
        const float* wk = w + q * stride + k * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes + 64, _MM_HINT_T0);
      }
    }
    pf.next_step(k);
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
      const __m256 xm = _mm256_broadcast_ss(x + m * K + k);
      SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
        const float* wk = w + q * stride + k * kPanel;
        SPECDEC_UNROLL for (int v = 0; v < 4; ++v)
          acc[m][4 * q + v] = _mm256_fmadd_ps(xm, _mm256_loadu_ps(wk + 8 * v), acc[m][4 * q + v]);
      }
    }
  }
  SPECDEC_UNROLL for (int v = 0; v < 4 * NP; ++v) {
    const int64_t n = panel * kPanel + v * 8, valid = std::min<int64_t>(8, N - n);
    if (valid <= 0) continue;
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
      store8(p.y + (m0 + m) * N + n, p.bias != nullptr ? p.bias + n : nullptr, acc[m][v], valid);
  }
}

// bfloat16 tile. A packed K-pair of 8 outputs is 8 32-bit lanes (w[2 kp] in the low half, w[2 kp + 1] in the high
// half), so `lane << 16` and `lane & 0xffff0000` are the two weights as floats. Each step adds the odd product, then
// the even one: the products of two bfloat16 values are exact in float32, so this rounds as AVX512-BF16's dot
// product does (odd element first), and the two paths agree apart from its flushing of denormals.
template <int MR, int NP>
SPECDEC_AVX2 void tile_bf16_avx2(const PackedLinearParams<bf16>& p, int64_t m0, int64_t panel, PanelPrefetch pf) {
  const int64_t K = p.in_features, N = p.out_features, KP = packed_k<bf16>(K), stride = KP * kPanel * 2;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(p.x) + m0 * K;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(p.packed) + panel * stride;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[MR][4 * NP];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int v = 0; v < 4 * NP; ++v) acc[m][v] = _mm256_setzero_ps();
  const int64_t full_pairs = K / 2;
  for (int64_t kp = 0; kp < KP; ++kp) {
    if (pf.ahead) {
      SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
        const uint16_t* wk = w + q * stride + kp * kPanel * 2;
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes + 64, _MM_HINT_T0);
      }
    }
    pf.next_step(kp);
    // past an odd K the pair's high half is padding: masked out of the weights too (0 * NaN would reach the sum)
    const __m256i odd = kp < full_pairs ? high : _mm256_setzero_si256();
    __m256 xe[MR], xo[MR];
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
      const uint32_t lo = x[m * K + 2 * kp], hi = kp < full_pairs ? x[m * K + 2 * kp + 1] : 0u;
      xe[m] = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(lo << 16)));
      xo[m] = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(hi << 16)));
    }
    SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
      const uint16_t* wk = w + q * stride + kp * kPanel * 2;
      SPECDEC_UNROLL for (int v = 0; v < 4; ++v) {
        const __m256i lanes8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16 * v));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(lanes8, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(lanes8, odd));
        SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
          acc[m][4 * q + v] = _mm256_fmadd_ps(xo[m], wo, acc[m][4 * q + v]);
          acc[m][4 * q + v] = _mm256_fmadd_ps(xe[m], we, acc[m][4 * q + v]);
        }
      }
    }
  }
  SPECDEC_UNROLL for (int v = 0; v < 4 * NP; ++v) {
    const int64_t n = panel * kPanel + v * 8, valid = std::min<int64_t>(8, N - n);
    if (valid <= 0) continue;
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
      store8(p.y + (m0 + m) * N + n, p.bias != nullptr ? p.bias + n : nullptr, acc[m][v], valid);
  }
}

constexpr int kMaxRowsAvx2 = 3;

template <typename T>
using TileFnAvx2 = void (*)(const PackedLinearParams<T>&, int64_t, int64_t, PanelPrefetch);

template <typename T, int... MR>
constexpr auto make_tiles_avx2(std::integer_sequence<int, MR...>) {
  if constexpr (std::is_same_v<T, float>) {
    return std::array<TileFnAvx2<T>, sizeof...(MR)>{&tile_f32_avx2<MR + 1, 1>...};
  } else {
    return std::array<TileFnAvx2<T>, sizeof...(MR)>{&tile_bf16_avx2<MR + 1, 1>...};
  }
}

template <typename T>
void avx2_panels(const PackedLinearParams<T>& p, int64_t panel_begin, int64_t panel_end) {
  static constexpr auto one = make_tiles_avx2<T>(std::make_integer_sequence<int, kMaxRowsAvx2>{});
  const int64_t M = p.rows;
  int64_t panel = panel_begin;
  if (M == 1) {
    for (; panel + 2 <= panel_end; panel += 2) {
      if constexpr (std::is_same_v<T, float>) {
        tile_f32_avx2<1, 2>(p, 0, panel, PanelPrefetch{});
      } else {
        tile_bf16_avx2<1, 2>(p, 0, panel, PanelPrefetch{});
      }
    }
  }
  const int64_t steps = packed_k<T>(p.in_features), panel_bytes = steps * 128;
  const int64_t blocks = (M + kMaxRowsAvx2 - 1) / kMaxRowsAvx2;  // (row_block's count)
  for (; panel < panel_end; ++panel) {
    const char* next = blocks > 1 && panel + 1 < panel_end
                           ? reinterpret_cast<const char*>(p.packed) + (panel + 1) * panel_bytes
                           : nullptr;
    int64_t b = 0;
    for (int64_t m0 = 0; m0 < M; ++b) {
      const int64_t mr = row_block(m0, M, kMaxRowsAvx2);
      one[mr - 1](p, m0, panel, PanelPrefetch{blocks == 1, next, blocks, b * steps});
      m0 += mr;
    }
  }
}
#endif  // SPECDEC_LINEAR_X86

}  // namespace

template <typename T>
void PackLinearWeight(const PackLinearWeightParams<T>& p, int64_t panel_begin, int64_t panel_end) {
  constexpr int64_t P = linear_pack_pair<T>();
  const int64_t N = p.out_features, K = p.in_features, KP = packed_k<T>(K);
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    T* dst = p.packed + panel * KP * kPanel * P;
    std::memset(static_cast<void*>(dst), 0, sizeof(T) * KP * kPanel * P);
    const int64_t n0 = panel * kPanel, valid = std::min(kPanel, N - n0);
    for (int64_t j = 0; j < valid; ++j) {
      const T* src = p.weight + (n0 + j) * K;
      for (int64_t k = 0; k < K; ++k) dst[((k / P) * kPanel + j) * P + k % P] = src[k];
    }
    for (int64_t j = valid; j < kPanel; ++j)  // padding rows: the marker (params.h)
      for (int64_t e = 0; e < KP * P; ++e) dst[((e / P) * kPanel + j) * P + e % P] = linear_pad_value<T>();
  }
}

template <typename T>
const char* PackedLinearPath() {
#ifdef SPECDEC_LINEAR_X86
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx512()) return "avx512";
  } else if constexpr (std::is_same_v<T, bf16>) {
    if (cpu_has_avx512_bf16()) return "avx512_bf16";
  }
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    if (cpu_has_avx2()) return "avx2";
  }
#endif
  return "generic";
}

template <typename T>
void PackedLinear(const PackedLinearParams<T>& p, int64_t panel_begin, int64_t panel_end) {
  if (p.rows <= 0 || panel_begin >= panel_end) return;
#ifdef SPECDEC_LINEAR_X86
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    if (std::is_same_v<T, float> ? cpu_has_avx512() : cpu_has_avx512_bf16()) {
      vector_panels(p, panel_begin, panel_end);
      return;
    }
    if (cpu_has_avx2()) {
      avx2_panels(p, panel_begin, panel_end);
      return;
    }
  }
#endif
  generic_panels(p, panel_begin, panel_end);
}

#define SPECDEC_INSTANTIATE_LINEAR(T)                                                             \
  template void PackLinearWeight<T>(const PackLinearWeightParams<T>&, int64_t, int64_t);         \
  template void PackedLinear<T>(const PackedLinearParams<T>&, int64_t, int64_t);                 \
  template const char* PackedLinearPath<T>();
SPECDEC_INSTANTIATE_LINEAR(float)
SPECDEC_INSTANTIATE_LINEAR(f16)
SPECDEC_INSTANTIATE_LINEAR(bf16)
#undef SPECDEC_INSTANTIATE_LINEAR

}  // namespace specdec::cpu
