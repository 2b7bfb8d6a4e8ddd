// Helpers shared by the C++ tests: exact float -> f16/bf16 for exactly representable values, verification runners.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/kernels.h"

namespace testutil {

using specdec::bf16;
using specdec::f16;

// A seeded PRNG (splitmix64) for test data: normalish() in [-2, 2), below(n) in [0, n), vec(n) normalish values.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 7) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float normalish() { return static_cast<float>((next() >> 40) * (1.0 / 16777216.0)) * 4.0f - 2.0f; }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  std::vector<float> vec(int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = normalish();
    return v;
  }
};

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Exact for values representable in the target type (the tests only use such values); truncates otherwise.
inline bf16 to_bf16(float f) { return bf16{static_cast<uint16_t>(bits_of(f) >> 16)}; }

inline f16 to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return f16{static_cast<uint16_t>(sign | 0x7e00u)};
  if (std::isinf(f)) return f16{static_cast<uint16_t>(sign | 0x7c00u)};
  if (f == 0.0f) return f16{sign};
  const int e = static_cast<int>((u >> 23) & 0xff) - 127;
  const uint32_t m = u & 0x7fffffu;
  if (e < -14) {  // subnormal half: value = m' * 2^-24
    const uint32_t mm = static_cast<uint32_t>(std::ldexp(std::fabs(f), 24));
    return f16{static_cast<uint16_t>(sign | mm)};
  }
  return f16{static_cast<uint16_t>(sign | ((e + 15) << 10) | (m >> 13))};
}

template <typename T>
T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline f16 from_float<f16>(float f) {
  return to_f16(f);
}
template <>
inline bf16 from_float<bf16>(float f) {
  return to_bf16(f);
}

template <typename T>
std::vector<T> convert(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_float<T>(v[i]);
  return out;
}

struct VerifyResult {
  std::vector<int64_t> accepted, accept_len, next_token;
  std::vector<specdec::RowStatus> status;
  VerifyResult(int64_t B, int64_t N)
      : accepted(B * N, 7777), accept_len(B, 7777), next_token(B, 7777), status(B, specdec::RowStatus{99, 99, 99}) {}
  specdec::VerifyOutputs outputs() {
    return specdec::VerifyOutputs{.accepted = accepted.data(), .accept_len = accept_len.data(),
                                  .next_token = next_token.data(), .status = status.data()};
  }
  std::vector<int64_t> path(int64_t b, int64_t N) const {
    return std::vector<int64_t>(accepted.begin() + b * N, accepted.begin() + (b + 1) * N);
  }
};

inline std::vector<int64_t> pad(std::vector<int64_t> v, int64_t n) {
  v.resize(n, -1);
  return v;
}

}  // namespace testutil
