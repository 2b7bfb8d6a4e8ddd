// PackLinearWeightInt4 / LinearInt4Offsets / PackedLinearInt4 (cpu/linear_int4.cpp): the quantisation against its
// formula (params.h, written out here), the packed layout and group multipliers against their index formulas, the
// product against an integer loop over the unpacked weights with the specified float epilogue, bit for bit, on every
// path this CPU has, for every row count 1-21 (each tile shape and row blocking), with N and K that are not multiples
// of the panel, the group or the K-octet.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "check.h"
#include "cpu/kernels.h"

using namespace specdec;

namespace {

uint32_t lcg(uint32_t& s) { return s = s * 1664525u + 1013904223u; }
float uniform(uint32_t& s) { return static_cast<float>(lcg(s) >> 8) / 16777216.0f * 2.0f - 1.0f; }

template <typename T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// One weight row's (q, multipliers, scale), written out from params.h (volatile: each operation rounded).
void quantize_weight_row(const std::vector<float>& w, int64_t G, std::vector<int>& q, std::vector<int>& m,
                         float& scale) {
  const int64_t K = static_cast<int64_t>(w.size());
  std::vector<float> group_amax(G, 0.0f);
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) group_amax[k / 32] = std::max(group_amax[k / 32], std::fabs(w[k]));
  for (float a : group_amax) amax = std::max(amax, a);
  q.assign(K, 0);
  m.assign(G, 0);
  scale = 0.0f;
  if (amax < std::ldexp(1.0f, -100)) return;
  const volatile float s = amax / 441.0f, inv63 = 63.0f / amax;
  scale = s;
  for (int64_t g = 0; g < G; ++g) {
    const volatile float r = group_amax[g] * inv63;
    m[g] = static_cast<int>(std::fmin(63.0f, std::fmax(1.0f, std::ceil(r))));
  }
  for (int64_t k = 0; k < K; ++k) {
    const volatile float step = s * static_cast<float>(m[k / 32]);
    const volatile float ratio = w[k] / step;
    q[k] = static_cast<int>(std::fmin(7.0f, std::fmax(-7.0f, std::nearbyint(ratio))));
  }
}

template <typename T>
void check_shape(int64_t N, int64_t K, bool with_bias) {
  uint32_t seed = static_cast<uint32_t>(N * 131 + K);
  const int64_t Kp = linear_int4_padded_k(K), G = Kp / 32, NP = (N + 31) / 32, max_rows = 21;
  std::vector<T> w(N * K), bias(with_bias ? N : 0), x(max_rows * Kp, from_float_rn<T>(0.0f));
  for (int64_t i = 0; i < N * K; ++i) w[i] = from_float_rn<T>(uniform(seed) * (i % K < 32 ? 4.0f : 1.0f));
  for (auto& v : bias) v = from_float_rn<T>(uniform(seed));
  for (int64_t m = 0; m < max_rows; ++m)
    for (int64_t k = 0; k < K; ++k) x[m * Kp + k] = from_float_rn<T>(uniform(seed) * 3.0f);  // zero-padded to Kp

  // packing: scales, multipliers and layout (u = q + 8, 8 in the padding; multiplier 0 in the padding)
  std::vector<uint8_t> packed(NP * Kp * 16, uint8_t{99}), mult(NP * G * 32, uint8_t{99});
  std::vector<float> w_scales(N, -1.0f);
  cpu::PackLinearWeightInt4(PackLinearInt4Params<T>{.weight = w.data(), .out_features = N, .in_features = K,
                                                    .packed = packed.data(), .group_scales = mult.data(),
                                                    .scales = w_scales.data()},
                            0, NP);
  std::vector<std::vector<int>> qw(N), mw(N);
  int64_t pack_errors = 0;
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> row(K);
    for (int64_t k = 0; k < K; ++k) row[k] = to_float(w[n * K + k]);
    float scale = 0;
    quantize_weight_row(row, G, qw[n], mw[n], scale);
    pack_errors += !same_bits(scale, w_scales[n]);
  }
  for (int64_t n = 0; n < NP * 32; ++n) {
    for (int64_t k = 0; k < Kp; ++k) {
      const int want = n < N && k < K ? qw[n][k] + 8 : 8;
      const uint8_t byte = packed[((n / 32) * (Kp / 8) + k / 8) * 128 + (n % 32) * 4 + k % 4];
      pack_errors += ((k % 8 < 4 ? byte : byte >> 4) & 15) != want;
    }
    for (int64_t g = 0; g < G; ++g) pack_errors += mult[((n / 32) * G + g) * 32 + n % 32] != (n < N ? mw[n][g] : 0);
  }
  CHECK_EQ(pack_errors, 0);

  // input rows, quantised as packed_linear_int8's over Kp columns
  std::vector<int8_t> qx(max_rows * Kp, int8_t{99});
  std::vector<float> x_scales(max_rows, -1.0f);
  cpu::QuantizeRowsInt8(QuantizeRowsInt8Params<T>{.x = x.data(), .rows = max_rows, .in_features = Kp,
                                                  .q = qx.data(), .scales = x_scales.data()},
                        0, max_rows);

  // the product: integer sums of the unpacked operands, then the epilogue as specified
  std::vector<T> want(max_rows * N);
  for (int64_t m = 0; m < max_rows; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += int64_t{qx[m * Kp + k]} * qw[n][k] * mw[n][k / 32];
      const volatile float t = x_scales[m] * w_scales[n];
      const volatile float u = static_cast<float>(acc) * t;
      want[m * N + n] = from_float_rn<T>(u + (with_bias ? to_float(bias[n]) : 0.0f));
    }
  for (const char* path : {"generic", "avx2", "avx512_vnni"}) {
    int64_t errors = 0, offset_errors = 0;
    bool ran = true;
    for (int64_t M = 1; M <= max_rows && ran; ++M) {
      for (int64_t m0 : {int64_t{0}, max_rows - M}) {
        std::vector<T> y(M * N, from_float_rn<T>(-77.0f));
        std::vector<int32_t> offsets(M * G, -1);
        const PackedLinearInt4Params<T> p{.qx = qx.data() + m0 * Kp, .x_scales = x_scales.data() + m0,
                                          .x_offsets = offsets.data(), .rows = M, .in_features = K,
                                          .out_features = N, .packed = packed.data(), .group_scales = mult.data(),
                                          .w_scales = w_scales.data(), .bias = with_bias ? bias.data() : nullptr,
                                          .y = y.data()};
        cpu::LinearInt4Offsets(p, 0, M);
        for (int64_t i = 0; i < M * G; ++i) {
          int32_t sum = 0;
          for (int64_t k = 0; k < 32; ++k) sum += qx[(m0 + i / G) * Kp + (i % G) * 32 + k];
          offset_errors += offsets[i] != 8 * sum;
        }
        ran = cpu::PackedLinearInt4Using(path, p, 0, NP);
        if (!ran) break;
        for (int64_t i = 0; i < M * N; ++i) errors += !same_bits(y[i], want[m0 * N + i]);
      }
    }
    if (!ran) {
      static bool said = false;  // (once per path is enough)
      if (!said) std::printf("  (path %s: not on this CPU, not run)\n", path);
      said = true;
      continue;
    }
    CHECK_EQ(offset_errors, 0);
    CHECK_EQ(errors, 0);
  }
}

}  // namespace

TEST_CASE("packed linear int4: float32") {
  std::printf("  (PackedLinearInt4Path: %s)\n", cpu::PackedLinearInt4Path());
  for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 32}, {37, 21}, {1, 1}, {100, 65}, {96, 7}, {130, 300}}) {
    check_shape<float>(N, K, true);
    check_shape<float>(N, K, false);
  }
}

TEST_CASE("packed linear int4: bfloat16 and float16") {
  for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 32}, {37, 21}, {100, 65}, {96, 7}}) {
    check_shape<bf16>(N, K, true);
    check_shape<f16>(N, K, false);
  }
}

TEST_CASE("packed linear int4: a tiny row packs as zeros") {
  const int64_t N = 2, K = 40;
  std::vector<float> w(N * K, 1e-35f);  // row 0: below 2^-100
  for (int64_t k = 0; k < K; ++k) w[K + k] = 0.01f * static_cast<float>(k - 20);
  std::vector<uint8_t> packed(linear_int4_padded_k(K) * 16, 0), mult(2 * 32, 7);
  std::vector<float> s(N, 1.0f);
  cpu::PackLinearWeightInt4(PackLinearInt4Params<float>{.weight = w.data(), .out_features = N, .in_features = K,
                                                        .packed = packed.data(), .group_scales = mult.data(),
                                                        .scales = s.data()},
                            0, 1);
  CHECK(s[0] == 0.0f && s[1] > 0.0f);
  CHECK(mult[0] == 0 && mult[32] == 0 && mult[1] >= 1 && mult[33] >= 1);
  int64_t not_zero_nibble = 0;
  for (int64_t o = 0; o < linear_int4_padded_k(K) / 8; ++o)
    for (int64_t e = 0; e < 4; ++e) not_zero_nibble += packed[o * 128 + e] != 0x88;
  CHECK_EQ(not_zero_nibble, 0);
}

SPECDEC_TEST_MAIN
