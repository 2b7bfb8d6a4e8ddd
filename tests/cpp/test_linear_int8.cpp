// QuantizeRowsInt8 / PackLinearWeightInt8 / PackedLinearInt8 (cpu/linear_int8.cpp): the quantisation against its
// formula (params.h), the packed layout against its index formula, the product against an integer loop over the
// unpacked weights with the specified float epilogue, bit for bit, on every path this CPU has, for every row count
// 1-29 (each tile shape and row blocking), with N and K that are not multiples of the panel or the K-quad.
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

// The quantisation of one row, written out from params.h.
void quantize_row(const std::vector<float>& v, std::vector<int8_t>& q, float& scale) {
  float amax = 0.0f;
  bool finite = true;
  for (float f : v) {
    finite &= std::isfinite(f);
    amax = std::max(amax, std::fabs(f));
  }
  q.assign(v.size(), 0);
  if (!finite) {
    scale = NAN;
    return;
  }
  if (amax < std::ldexp(1.0f, -120)) {
    scale = 0.0f;
    return;
  }
  scale = amax / 127.0f;
  const float inverse = 127.0f / amax;
  for (size_t k = 0; k < v.size(); ++k)
    q[k] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(v[k] * inverse))));
}

template <typename T>
std::vector<float> as_floats(const std::vector<T>& v, int64_t begin, int64_t count) {
  std::vector<float> out(count);
  for (int64_t i = 0; i < count; ++i) out[i] = to_float(v[begin + i]);
  return out;
}

template <typename T>
void check_shape(int64_t N, int64_t K, bool with_bias) {
  uint32_t seed = static_cast<uint32_t>(N * 131 + K);
  const int64_t Kp = linear_int8_padded_k(K), KQ = Kp / 4, NP = (N + 31) / 32, max_rows = 29;
  std::vector<T> w(N * K), bias(with_bias ? N : 0), x(max_rows * K);
  for (auto& v : w) v = from_float_rn<T>(uniform(seed));
  for (auto& v : bias) v = from_float_rn<T>(uniform(seed));
  for (auto& v : x) v = from_float_rn<T>(uniform(seed) * 3.0f);
  if (max_rows * K > 4) x[2 * K + K / 2] = from_float_rn<T>(0.0f);

  // packing: scales and layout, padding zero
  std::vector<int8_t> packed(NP * KQ * 128, int8_t{99});  // garbage: the kernel writes every byte
  std::vector<float> w_scales(N, -1.0f);
  cpu::PackLinearWeightInt8(PackLinearInt8Params<T>{.weight = w.data(), .out_features = N, .in_features = K,
                                                    .packed = packed.data(), .scales = w_scales.data()},
                            0, NP);
  std::vector<std::vector<int8_t>> qw(N);
  int64_t pack_errors = 0;
  for (int64_t n = 0; n < N; ++n) {
    float scale = 0;
    quantize_row(as_floats(w, n * K, K), qw[n], scale);
    pack_errors += !same_bits(scale, w_scales[n]);
  }
  for (int64_t n = 0; n < NP * 32; ++n)
    for (int64_t k = 0; k < Kp; ++k) {
      const int8_t want = n < N && k < K ? qw[n][k] : int8_t{0};
      pack_errors += packed[((n / 32) * KQ + k / 4) * 128 + (n % 32) * 4 + k % 4] != want;
    }
  CHECK_EQ(pack_errors, 0);

  // input rows
  std::vector<int8_t> qx(max_rows * Kp, int8_t{99});
  std::vector<float> x_scales(max_rows, -1.0f);
  cpu::QuantizeRowsInt8(QuantizeRowsInt8Params<T>{.x = x.data(), .rows = max_rows, .in_features = K, .q = qx.data(),
                                                  .scales = x_scales.data()},
                        0, max_rows);
  int64_t quantize_errors = 0;
  for (int64_t m = 0; m < max_rows; ++m) {
    std::vector<int8_t> q;
    float scale = 0;
    quantize_row(as_floats(x, m * K, K), q, scale);
    quantize_errors += !same_bits(scale, x_scales[m]);
    for (int64_t k = 0; k < Kp; ++k) quantize_errors += qx[m * Kp + k] != (k < K ? q[k] : int8_t{0});
  }
  CHECK_EQ(quantize_errors, 0);

  // the product: integer sums of the unpacked operands, then the epilogue as specified
  std::vector<T> want(max_rows * N);
  for (int64_t m = 0; m < max_rows; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += int64_t{qx[m * Kp + k]} * qw[n][k];
      const volatile float t = x_scales[m] * w_scales[n];  // (volatile: each product rounded, never fused)
      const volatile float u = static_cast<float>(acc) * t;
      want[m * N + n] = from_float_rn<T>(u + (with_bias ? to_float(bias[n]) : 0.0f));
    }
  for (const char* path : {"generic", "avx2", "avx512_vnni"}) {
    int64_t errors = 0;
    bool ran = true;
    for (int64_t M = 1; M <= max_rows && ran; ++M) {
      for (int64_t m0 : {int64_t{0}, max_rows - M}) {
        std::vector<T> y(M * N, from_float_rn<T>(-77.0f));
        const PackedLinearInt8Params<T> p{.qx = qx.data() + m0 * Kp, .x_scales = x_scales.data() + m0, .rows = M,
                                          .in_features = K, .out_features = N, .packed = packed.data(),
                                          .w_scales = w_scales.data(), .bias = with_bias ? bias.data() : nullptr,
                                          .y = y.data()};
        ran = cpu::PackedLinearInt8Using(path, p, 0, NP);
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
    CHECK_EQ(errors, 0);
  }
}

}  // namespace

TEST_CASE("packed linear int8: float32") {
  std::printf("  (PackedLinearInt8Path: %s)\n", cpu::PackedLinearInt8Path());
  for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 32}, {37, 21}, {1, 1}, {100, 65}, {96, 7}, {130, 300}}) {
    check_shape<float>(N, K, true);
    check_shape<float>(N, K, false);
  }
}

TEST_CASE("packed linear int8: bfloat16") {
  for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 32}, {37, 21}, {100, 65}, {96, 7}}) {
    check_shape<bf16>(N, K, true);
    check_shape<bf16>(N, K, false);
  }
}

TEST_CASE("packed linear int8: non-finite and tiny rows") {
  const int64_t K = 9;
  std::vector<float> x = {1, 2, INFINITY, 4, 5, 6, 7, 8, 9};
  x.resize(3 * K, 1e-38f);  // row 1: below 2^-120
  x[2 * K + 4] = NAN;
  std::vector<int8_t> q(3 * linear_int8_padded_k(K), int8_t{5});
  std::vector<float> s(3, 1.0f);
  cpu::QuantizeRowsInt8(QuantizeRowsInt8Params<float>{.x = x.data(), .rows = 3, .in_features = K, .q = q.data(),
                                                      .scales = s.data()},
                        0, 3);
  CHECK(std::isnan(s[0]) && s[1] == 0.0f && std::isnan(s[2]));
  int64_t nonzero = 0;
  for (int8_t v : q) nonzero += v != 0;
  CHECK_EQ(nonzero, 0);
}

SPECDEC_TEST_MAIN
