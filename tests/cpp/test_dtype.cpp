// dtype.h: exact f16 / bf16 -> float conversion (every f16 bit pattern against an independent formula, and a list
// of special patterns), and the order-preserving keys used by radix selection.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "check.h"
#include "common/dtype.h"

using namespace specdec;

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Independent binary16 decoding through ldexp (double), rounded to float (exact: every f16 is a float).
double f16_value(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  if (e == 0x1f) return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), -24);
  return sign * std::ldexp(static_cast<double>(1024 + m), e - 25);
}

}  // namespace

TEST_CASE("f16: all 65536 bit patterns") {
  int mismatches = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = to_float(f16{static_cast<uint16_t>(h)});
    const double want = f16_value(static_cast<uint16_t>(h));
    bool ok;
    if (std::isnan(want)) {
      ok = std::isnan(got) && ((bits(got) >> 31) == (h >> 15));
    } else {
      ok = bits(got) == bits(static_cast<float>(want));  // also distinguishes -0.0 from +0.0
    }
    if (!ok && ++mismatches <= 5) CHECK_EQ(h, 0xffffffffu);  // report the first few patterns
  }
  CHECK_EQ(mismatches, 0);
}

TEST_CASE("f16: special patterns") {
  struct Case {
    uint16_t h;
    uint32_t f;
  };
  const std::vector<Case> cases = {
      {0x0000, 0x00000000}, {0x8000, 0x80000000},  // +-0
      {0x3c00, 0x3f800000}, {0xc000, 0xc0000000},  // 1, -2
      {0x7bff, 0x477fe000},                        // 65504 (max)
      {0x0400, 0x38800000},                        // 2^-14 (min normal)
      {0x0001, 0x33800000}, {0x8001, 0xb3800000},  // +-2^-24 (min subnormal)
      {0x03ff, 0x387fc000},                        // max subnormal 1023 * 2^-24
      {0x0200, 0x38000000},                        // 2^-15
      {0x3555, 0x3eaaa000},                        // 0.333251953125
      {0x7c00, 0x7f800000}, {0xfc00, 0xff800000},  // +-inf
  };
  for (const auto& c : cases) CHECK_EQ(bits(to_float(f16{c.h})), c.f);
  CHECK(std::isnan(to_float(f16{0x7e00})));
  CHECK(std::isnan(to_float(f16{0x7c01})));
  CHECK(std::isnan(to_float(f16{0xfe00})));
}

TEST_CASE("bf16: bit patterns incl. subnormals, inf and nan") {
  const std::vector<uint16_t> patterns = {0x0000, 0x8000, 0x3f80, 0xc000, 0x7f7f, 0xff7f, 0x0080,
                                          0x0001, 0x8001, 0x007f, 0x7f80, 0xff80, 0x3eab};
  for (uint16_t h : patterns) CHECK_EQ(bits(to_float(bf16{h})), static_cast<uint32_t>(h) << 16);
  CHECK_EQ(to_float(bf16{0x0001}), std::ldexp(1.0f, -133));  // float subnormal
  CHECK(std::isnan(to_float(bf16{0x7fc0})));
  CHECK(std::isnan(to_float(bf16{0xffc1})));
  CHECK(std::isinf(to_float(bf16{0x7f80})));
}

TEST_CASE("order_key: monotone, +-0 share a key, round trip") {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> ascending = {-inf, -3.4e38f, -1.0f, -1e-30f, -1e-45f, 0.0f, 1e-45f, 1e-30f,
                                        1.0f, 2.0f,     3.4e38f, inf};
  for (size_t i = 1; i < ascending.size(); ++i) CHECK(order_key(ascending[i - 1]) < order_key(ascending[i]));
  CHECK_EQ(order_key(-0.0f), order_key(0.0f));
  for (float f : ascending) CHECK_EQ(bits(key_to_float(order_key(f))), bits(f));
  CHECK(is_nan(std::numeric_limits<float>::quiet_NaN()));
  CHECK(!is_nan(inf));
  CHECK(is_pos_inf(inf));
  CHECK(!is_pos_inf(-inf));
  CHECK_EQ(bits(neg_inf()), 0xff800000u);
}

SPECDEC_TEST_MAIN
