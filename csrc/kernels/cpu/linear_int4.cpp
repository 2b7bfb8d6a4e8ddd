// Weight-only int4 linear layers (layout and semantics: common/params.h, "Weight-only int4").
//
// Why: where packed_linear_int8 already runs at memory speed (large matrices, a few rows), half its bytes is what is
// left to gain. The dot products are int8's (4 K-values per 32-bit lane, exact integer sums, so every path, the
// CUDA kernel and the reference give the same bits, whatever the row blocking): a packed byte holds one lane's
// values of two K-quads (low and high nibble), unpacked by one AND, and one shift and AND, per vector of bytes and
// shared by every row of a tile; each group's sums are multiplied by their 6-bit multiplier as they join the
// output's sum.
// Paths: AVX-512 VNNI (vpdpbusd: the unsigned nibbles by the signed input bytes), AVX2 (vpmaddubsw + vpmaddwd) and a
// portable loop; PackedLinearInt4Path() says which one runs.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "linear_tiles.h"

namespace specdec::cpu {
namespace {

using namespace intlinear;  // NOLINT(build/namespaces): the shared tiling, epilogue and CPU checks

constexpr int64_t kPanel = kLinearPanel, kGroup = kLinearInt4Group, kOctet = kLinearInt4Octet;
constexpr int64_t kOctetBytes = kPanel * 4;  // one K-octet of a panel: 32 lanes of 4 bytes
constexpr int64_t kOctets = kGroup / kOctet;  // K-octets per group

// Bytes of one panel's stream.
inline int64_t panel_bytes(int64_t Kp) { return Kp / kOctet * kOctetBytes; }

// 4 bytes of a row's input as one 32-bit lane.
inline int32_t load_quad(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

template <typename T>
void generic_panels(const PackedLinearInt4Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  const int64_t Kp = linear_int4_padded_k(p.in_features), G = Kp / kGroup;
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint8_t* w = p.packed + panel * panel_bytes(Kp);
    const uint8_t* mult = p.group_scales + panel * G * kPanel;
    for (int64_t m = 0; m < p.rows; ++m) {
      const int8_t* x = p.qx + m * Kp;
      int32_t acc[kPanel] = {};
      for (int64_t g = 0; g < G; ++g) {
        int32_t part[kPanel] = {};
        for (int64_t o = g * kOctets; o < (g + 1) * kOctets; ++o) {
          const uint8_t* wo = w + o * kOctetBytes;
          const int8_t* xo = x + o * kOctet;
          for (int64_t j = 0; j < kPanel; ++j)
            for (int64_t e = 0; e < 4; ++e) {
              const int32_t b = wo[j * 4 + e];
              part[j] += (b & 15) * int32_t{xo[e]} + (b >> 4) * int32_t{xo[4 + e]};
            }
        }
        const int32_t offset = p.x_offsets[m * G + g];
        for (int64_t j = 0; j < kPanel; ++j) acc[j] += (part[j] - offset) * int32_t{mult[g * kPanel + j]};
      }
      store_panel(p, m, panel, acc);
    }
  }
}

template <typename T>
using Int4TileFn = void (*)(const PackedLinearInt4Params<T>&, int64_t, int64_t);

#ifdef SPECDEC_INTLINEAR_X86
// Prefetch distance in bytes along a panel's stream.
constexpr int64_t kPrefetchBytes = 2048;

// AVX2 tile: one row of one panel (4 vectors of 8 sums for the output, 4 for the group: the 16 registers allow no
// more). vpmaddubsw takes the unsigned nibbles by the signed inputs; a pair sum is at most 2 * 15 * 127, and the two
// nibbles' pair sums together fit 16 bits.
template <typename T>
SPECDEC_AVX2_FN void tile_avx2(const PackedLinearInt4Params<T>& p, int64_t m, int64_t panel) {
  const int64_t Kp = linear_int4_padded_k(p.in_features), G = Kp / kGroup;
  const int8_t* x = p.qx + m * Kp;
  const uint8_t* w = p.packed + panel * panel_bytes(Kp);
  const uint8_t* mult = p.group_scales + panel * G * kPanel;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256i acc[4];
  SPECDEC_UNROLL for (int v = 0; v < 4; ++v) acc[v] = _mm256_setzero_si256();
  for (int64_t g = 0; g < G; ++g) {
    __m256i part[4];
    SPECDEC_UNROLL for (int v = 0; v < 4; ++v) part[v] = _mm256_setzero_si256();
    SPECDEC_UNROLL for (int o = 0; o < kOctets; ++o) {
      const int64_t octet = g * kOctets + o;
      const uint8_t* wo = w + octet * kOctetBytes;
      _mm_prefetch(reinterpret_cast<const char*>(wo) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wo) + kPrefetchBytes + 64, _MM_HINT_T0);
      const __m256i xl = _mm256_set1_epi32(load_quad(x + octet * kOctet));
      const __m256i xh = _mm256_set1_epi32(load_quad(x + octet * kOctet + 4));
      SPECDEC_UNROLL for (int v = 0; v < 4; ++v) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 32 * v));
        const __m256i lo = _mm256_and_si256(wv, low), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
        part[v] = _mm256_add_epi32(part[v], _mm256_madd_epi16(pairs, ones));
      }
    }
    const __m256i offset = _mm256_set1_epi32(p.x_offsets[m * G + g]);
    SPECDEC_UNROLL for (int v = 0; v < 4; ++v) {
      const __m256i mv = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mult + g * kPanel + 8 * v)));
      acc[v] = _mm256_add_epi32(acc[v], _mm256_mullo_epi32(_mm256_sub_epi32(part[v], offset), mv));
    }
  }
  alignas(32) int32_t out[kPanel];
  SPECDEC_UNROLL for (int v = 0; v < 4; ++v) _mm256_store_si256(reinterpret_cast<__m256i*>(out + 8 * v), acc[v]);
  leave_vector_state_clean();
  store_panel(p, m, panel, out);
}

// AVX-512 VNNI tile: MR rows x NP panels, 2 vectors of 16 sums per panel and row for the output and 2 for the
// group; vpdpbusd adds 4 products of the unsigned nibbles by the signed input bytes per lane.
template <typename T, int MR, int NP>
SPECDEC_VNNI_FN void tile_vnni(const PackedLinearInt4Params<T>& p, int64_t m0, int64_t panel) {
  const int64_t Kp = linear_int4_padded_k(p.in_features), G = Kp / kGroup, stride = panel_bytes(Kp);
  const int8_t* x = p.qx + m0 * Kp;
  const uint8_t* w = p.packed + panel * stride;
  const uint8_t* mult = p.group_scales + panel * G * kPanel;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512i acc[MR][2 * NP];
  SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
    SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    __m512i part[MR][2 * NP];
    SPECDEC_UNROLL for (int m = 0; m < MR; ++m)
      SPECDEC_UNROLL for (int v = 0; v < 2 * NP; ++v) part[m][v] = _mm512_setzero_si512();
    SPECDEC_UNROLL for (int o = 0; o < kOctets; ++o) {
      const int64_t octet = g * kOctets + o;
      __m512i xl[MR], xh[MR];
      SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
        xl[m] = _mm512_set1_epi32(load_quad(x + m * Kp + octet * kOctet));
        xh[m] = _mm512_set1_epi32(load_quad(x + m * Kp + octet * kOctet + 4));
      }
      SPECDEC_UNROLL for (int q = 0; q < NP; ++q) {
        const uint8_t* wo = w + q * stride + octet * kOctetBytes;
        _mm_prefetch(reinterpret_cast<const char*>(wo) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wo) + kPrefetchBytes + 64, _MM_HINT_T0);
        SPECDEC_UNROLL for (int v = 0; v < 2; ++v) {
          const __m512i wv = _mm512_loadu_si512(wo + 64 * v);
          const __m512i lo = _mm512_and_si512(wv, low), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
          SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
            part[m][2 * q + v] = _mm512_dpbusd_epi32(part[m][2 * q + v], lo, xl[m]);
            part[m][2 * q + v] = _mm512_dpbusd_epi32(part[m][2 * q + v], hi, xh[m]);
          }
        }
      }
    }
    SPECDEC_UNROLL for (int q = 0; q < NP; ++q)
      SPECDEC_UNROLL for (int v = 0; v < 2; ++v) {
        const __m512i mv = _mm512_maskz_cvtepu8_epi32(  // (maskz: GCC 12 warns on the unmasked form)
            __mmask16{0xffff},
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(mult + q * G * kPanel + g * kPanel + 16 * v)));
        SPECDEC_UNROLL for (int m = 0; m < MR; ++m) {
          const __m512i offset = _mm512_set1_epi32(p.x_offsets[(m0 + m) * G + g]);
          acc[m][2 * q + v] = _mm512_add_epi32(
              acc[m][2 * q + v], _mm512_mullo_epi32(_mm512_sub_epi32(part[m][2 * q + v], offset), mv));
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

// Tile tables (index r - 1: the tile of r rows). AVX-512 has 32 registers: up to 2 rows of two panels, 4 rows of
// one (8 output sums, 8 group sums and 8 input vectors); AVX2 one row of one panel.
template <typename T, int NP, int... MR>
constexpr std::array<Int4TileFn<T>, sizeof...(MR)> vnni_tiles(std::integer_sequence<int, MR...>) {
  return {&tile_vnni<T, MR + 1, NP>...};
}

template <typename T>
void avx2_panels(const PackedLinearInt4Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  static constexpr std::array<Int4TileFn<T>, 0> two{};
  static constexpr std::array<Int4TileFn<T>, 1> one{&tile_avx2<T>};
  tiled_panels(p, panel_begin, panel_end, two, one);
}

template <typename T>
void vnni_panels(const PackedLinearInt4Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  static constexpr auto two = vnni_tiles<T, 2>(std::make_integer_sequence<int, 2>{});
  static constexpr auto one = vnni_tiles<T, 1>(std::make_integer_sequence<int, 4>{});
  tiled_panels(p, panel_begin, panel_end, two, one);
}
#endif  // SPECDEC_INTLINEAR_X86

template <typename T>
void run(Path path, const PackedLinearInt4Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  if (p.rows <= 0 || panel_begin >= panel_end) return;
#ifdef SPECDEC_INTLINEAR_X86
  if (path == Path::kAvx512Vnni) return vnni_panels(p, panel_begin, panel_end);
  if (path == Path::kAvx2) return avx2_panels(p, panel_begin, panel_end);
#endif
  generic_panels(p, panel_begin, panel_end);
}

}  // namespace

template <typename T>
void PackLinearWeightInt4(const PackLinearInt4Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  const int64_t N = p.out_features, K = p.in_features, Kp = linear_int4_padded_k(K), G = Kp / kGroup;
  std::vector<float> group_amax(static_cast<size_t>(G));
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    uint8_t* dst = p.packed + panel * panel_bytes(Kp);
    uint8_t* mult = p.group_scales + panel * G * kPanel;
    std::memset(dst, 0x88, static_cast<size_t>(panel_bytes(Kp)));  // q = 0 in both nibbles
    std::memset(mult, 0, static_cast<size_t>(G * kPanel));
    const int64_t n0 = panel * kPanel, valid = std::min(kPanel, N - n0);
    for (int64_t j = 0; j < valid; ++j) {
      const T* src = p.weight + (n0 + j) * K;
      float amax = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        float a = 0.0f;
        for (int64_t k = g * kGroup; k < std::min(K, (g + 1) * kGroup); ++k)
          a = std::max(a, std::fabs(to_float(src[k])));
        group_amax[g] = a;
        amax = std::max(amax, a);
      }
      if (amax < kInt4TinyAmax) {
        p.scales[n0 + j] = 0.0f;
        continue;
      }
      const float scale = int4_row_scale(amax);
      p.scales[n0 + j] = scale;
      for (int64_t g = 0; g < G; ++g) {
        const int m = int4_group_multiplier(group_amax[g], amax);
        mult[g * kPanel + j] = static_cast<uint8_t>(m);
        for (int64_t k = g * kGroup; k < std::min(K, (g + 1) * kGroup); ++k) {
          const int64_t r = k % kOctet, shift = r < 4 ? 0 : 4;
          uint8_t& b = dst[((k / kOctet) * kPanel + j) * 4 + r % 4];
          const int u = int4_quantize(to_float(src[k]), scale, m) + 8;
          b = static_cast<uint8_t>((b & (0xf0 >> shift)) | (u << shift));
        }
      }
    }
  }
}

template <typename T>
void LinearInt4Offsets(const PackedLinearInt4Params<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t Kp = linear_int4_padded_k(p.in_features), G = Kp / kGroup;
  for (int64_t m = row_begin; m < row_end; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* x = p.qx + m * Kp + g * kGroup;
      int32_t sum = 0;
      for (int64_t k = 0; k < kGroup; ++k) sum += x[k];
      p.x_offsets[m * G + g] = 8 * sum;
    }
}

const char* PackedLinearInt4Path() { return kPathNames[static_cast<int>(best_path())]; }

template <typename T>
bool PackedLinearInt4Using(const char* path, const PackedLinearInt4Params<T>& p, int64_t panel_begin,
                           int64_t panel_end) {
  return run_named_path(path, [&](Path chosen) { run(chosen, p, panel_begin, panel_end); });
}

template <typename T>
void PackedLinearInt4(const PackedLinearInt4Params<T>& p, int64_t panel_begin, int64_t panel_end) {
  run(best_path(), p, panel_begin, panel_end);
}

#define SPECDEC_INSTANTIATE_LINEAR_INT4(T)                                                                   \
  template void PackLinearWeightInt4<T>(const PackLinearInt4Params<T>&, int64_t, int64_t);                  \
  template void LinearInt4Offsets<T>(const PackedLinearInt4Params<T>&, int64_t, int64_t);                   \
  template bool PackedLinearInt4Using<T>(const char*, const PackedLinearInt4Params<T>&, int64_t, int64_t);  \
  template void PackedLinearInt4<T>(const PackedLinearInt4Params<T>&, int64_t, int64_t);
SPECDEC_INSTANTIATE_LINEAR_INT4(float)
SPECDEC_INSTANTIATE_LINEAR_INT4(f16)
SPECDEC_INSTANTIATE_LINEAR_INT4(bf16)
#undef SPECDEC_INSTANTIATE_LINEAR_INT4

}  // namespace specdec::cpu
