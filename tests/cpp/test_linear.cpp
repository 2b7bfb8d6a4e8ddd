// PackLinearWeight / PackedLinear (cpu/linear.cpp): the packed layout against its index formula, products against
// a double-precision loop, and row independence (row m of an M-row product equals row m alone, bit for bit) for
// every tile shape, in float32 and bfloat16, with N and K that are not multiples of the panel or the K-pair.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "check.h"
#include "cpu/kernels.h"

using namespace specdec;

namespace {

uint32_t lcg(uint32_t& s) { return s = s * 1664525u + 1013904223u; }
float uniform(uint32_t& s) { return static_cast<float>(lcg(s) >> 8) / 16777216.0f * 2.0f - 1.0f; }

template <typename T>
T make(float f) {
  return from_float_rn<T>(f);
}

template <typename T>
std::vector<T> pack(const std::vector<T>& w, int64_t N, int64_t K) {
  constexpr int64_t P = linear_pack_pair<T>();
  const int64_t NP = (N + 31) / 32, KP = (K + P - 1) / P;
  std::vector<T> packed(NP * KP * 32 * P, make<T>(123.0f));  // garbage: the kernel writes every element
  PackLinearWeightParams<T> p{.weight = w.data(), .out_features = N, .in_features = K, .packed = packed.data()};
  cpu::PackLinearWeight(p, 0, NP);
  return packed;
}

template <typename T>
std::vector<T> product(const std::vector<T>& x, int64_t M, const std::vector<T>& packed, const std::vector<T>& bias,
                       int64_t N, int64_t K) {
  std::vector<T> y(M * N, make<T>(-77.0f));
  PackedLinearParams<T> p{.x = x.data(), .rows = M, .in_features = K, .out_features = N, .packed = packed.data(),
                          .bias = bias.empty() ? nullptr : bias.data(), .y = y.data()};
  cpu::PackedLinear(p, 0, (N + 31) / 32);
  return y;
}

template <typename T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <typename T>
void check_shape(int64_t N, int64_t K, bool with_bias) {
  constexpr int64_t P = linear_pack_pair<T>();
  uint32_t seed = static_cast<uint32_t>(N * 131 + K);
  std::vector<T> w(N * K), bias(with_bias ? N : 0);
  for (auto& v : w) v = make<T>(uniform(seed));
  for (auto& v : bias) v = make<T>(uniform(seed));
  const std::vector<T> packed = pack(w, N, K);
  const int64_t KP = (K + P - 1) / P;
  int64_t layout_errors = 0;
  for (int64_t panel = 0; panel < (N + 31) / 32; ++panel)
    for (int64_t kp = 0; kp < KP; ++kp)
      for (int64_t j = 0; j < 32; ++j)
        for (int64_t q = 0; q < P; ++q) {
          const int64_t n = panel * 32 + j, k = kp * P + q;
          // padding: k >= K zero, rows n >= N the marker that records N (params.h LinearPad)
          const T want = n >= N ? linear_pad_value<T>() : k < K ? w[n * K + k] : make<T>(0.0f);
          layout_errors += !same_bits(packed[((panel * KP + kp) * 32 + j) * P + q], want);
        }
  CHECK_EQ(layout_errors, 0);

  const int64_t max_rows = 29;
  std::vector<T> x(max_rows * K);
  for (auto& v : x) v = make<T>(uniform(seed));
  std::vector<T> alone(max_rows * N);
  for (int64_t m = 0; m < max_rows; ++m) {
    const std::vector<T> xm(x.begin() + m * K, x.begin() + (m + 1) * K);
    const std::vector<T> ym = product(xm, 1, packed, bias, N, K);
    std::copy(ym.begin(), ym.end(), alone.begin() + m * N);
  }
  // against double precision: float32 accumulation error, plus one rounding to T
  const double rounding = sizeof(T) == 2 ? 1.0 / 128 : 0.0;
  int64_t value_errors = 0;
  for (int64_t m = 0; m < max_rows; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double want = with_bias ? to_float(bias[n]) : 0.0, magnitude = std::fabs(want);
      for (int64_t k = 0; k < K; ++k) {
        const double t = static_cast<double>(to_float(x[m * K + k])) * to_float(w[n * K + k]);
        want += t;
        magnitude += std::fabs(t);
      }
      const double got = to_float(alone[m * N + n]);
      value_errors += std::fabs(got - want) > 1e-6 * magnitude + rounding * std::fabs(want) + 1e-30;
    }
  CHECK_EQ(value_errors, 0);
  // every row count (each tile shape and row blocking) gives each row the bits it gets alone
  int64_t batch_errors = 0;
  for (int64_t M = 1; M <= max_rows; ++M) {
    const std::vector<T> y = product(std::vector<T>(x.begin(), x.begin() + M * K), M, packed, bias, N, K);
    for (int64_t i = 0; i < M * N; ++i) batch_errors += !same_bits(y[i], alone[i]);
  }
  CHECK_EQ(batch_errors, 0);
}

}  // namespace

TEST_CASE("packed linear: float32") {
  for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 32}, {37, 21}, {1, 1}, {100, 65}, {96, 7}}) {
    check_shape<float>(N, K, true);
    check_shape<float>(N, K, false);
  }
}

TEST_CASE("packed linear: bfloat16") {
  for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 32}, {37, 21}, {1, 1}, {100, 65}, {96, 7}}) {
    check_shape<bf16>(N, K, true);
    check_shape<bf16>(N, K, false);
  }
}

TEST_CASE("packed linear: float16 (portable path)") {
  check_shape<f16>(37, 21, true);
  check_shape<f16>(64, 33, false);
}

SPECDEC_TEST_MAIN
