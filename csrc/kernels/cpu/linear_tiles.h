// What the weight-only integer products (linear_int8.cpp, linear_int4.cpp) share: run-time CPU feature checks, the
// float epilogue of a panel's int32 sums, and the tiling of output panels by row blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SPECDEC_INTLINEAR_X86 1
#define SPECDEC_AVX2_FN __attribute__((target("avx2")))
#define SPECDEC_VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif

namespace specdec::cpu::intlinear {

#ifdef SPECDEC_INTLINEAR_X86
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

inline bool cpu_has_avx512_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return has;
}

// vzeroupper before calling scalar code from a 256/512-bit function: GCC inserts none before these calls or at
// these functions' returns, and the dirty upper halves then slowed the scalar code that ran next (measured: the
// draft layer's float32 SwiGLU stage after an int8 product, ~0.28 ms a call instead of ~0.01).
SPECDEC_AVX2_FN inline void leave_vector_state_clean() { _mm256_zeroupper(); }
#endif

// The code paths of an integer product, fastest last; `kPathNames` in the same order.
enum class Path { kGeneric, kAvx2, kAvx512Vnni };
inline constexpr const char* kPathNames[] = {"generic", "avx2", "avx512_vnni"};

inline bool available(Path path) {
#ifdef SPECDEC_INTLINEAR_X86
  if (path == Path::kAvx2) return cpu_has_avx2();
  if (path == Path::kAvx512Vnni) return cpu_has_avx512_vnni();
#endif
  return path == Path::kGeneric;
}

inline Path best_path() {
  static const Path best = available(Path::kAvx512Vnni) ? Path::kAvx512Vnni
                           : available(Path::kAvx2)     ? Path::kAvx2
                                                        : Path::kGeneric;
  return best;
}

// Runs run(path) for the path named `name` (kPathNames) and returns true; false, running nothing, where the name is
// unknown or this CPU lacks the path (for tests comparing paths).
template <typename Run>
bool run_named_path(const char* name, Run run) {
  for (int i = 0; i < 3; ++i)
    if (std::strcmp(name, kPathNames[i]) == 0) {
      if (!available(static_cast<Path>(i))) return false;
      run(static_cast<Path>(i));
      return true;
    }
  return false;
}

// y[m, n0 .. n0 + 32) of one panel from its 32 int32 sums (outputs n >= N are padding, never stored). Params: an
// int8 or int4 product's (the same epilogue fields).
template <typename Params>
void store_panel(const Params& p, int64_t m, int64_t panel, const int32_t* acc) {
  using T = std::remove_pointer_t<decltype(p.y)>;
  const int64_t N = p.out_features, n0 = panel * kLinearPanel, valid = std::min(kLinearPanel, N - n0);
  const float sx = p.x_scales[m];
  T* y = p.y + m * N + n0;
  for (int64_t j = 0; j < valid; ++j) {
    const float bias = p.bias != nullptr ? to_float(p.bias[n0 + j]) : 0.0f;
    y[j] = from_float_rn<T>(int8_dequantize(acc[j], sx, p.w_scales[n0 + j], bias));
  }
}

// Row blocks: at most `max_rows` rows each, sizes as equal as possible.
inline int64_t row_block(int64_t m0, int64_t M, int64_t max_rows) {
  const int64_t left = M - m0, blocks = (left + max_rows - 1) / max_rows;
  return (left + blocks - 1) / blocks;
}

// Tiles over panels [panel_begin, panel_end): up to two.size() rows take two panels per tile (more independent sums
// at few rows), more rows one panel per tile in balanced blocks of up to one.size() rows; two.size() <= one.size().
// A tile is tile(p, first row, first panel).
template <typename Params, typename TwoTiles, typename OneTiles>
void tiled_panels(const Params& p, int64_t panel_begin, int64_t panel_end, const TwoTiles& two, const OneTiles& one) {
  const int64_t M = p.rows, max_two = static_cast<int64_t>(two.size()), max_one = static_cast<int64_t>(one.size());
  int64_t panel = panel_begin;
  if (M <= max_two) {
    for (; panel + 2 <= panel_end; panel += 2) two[M - 1](p, 0, panel);
  }
  for (; panel < panel_end; ++panel) {
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t mr = row_block(m0, M, max_one);
      one[mr - 1](p, m0, panel);
      m0 += mr;
    }
  }
}

}  // namespace specdec::cpu::intlinear
