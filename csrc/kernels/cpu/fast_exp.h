// A vectorisable exp for the CPU kernels.
#pragma once

#include <cstdint>

#include "../common/dtype.h"

namespace specdec::cpu {

// exp(x) for x <= 0 (every use here subtracts the row maximum first); exact 0 below -87.3 (float underflow), so
// -inf logits get weight 0. Cephes-style range reduction and a degree-6 polynomial: within 2 ulp of expf, and
// inline + branch-free so that vocabulary loops vectorise. NaN in, NaN out: both comparisons are false for NaN,
// which takes the clamp (so that the integer cast below stays defined) and then returns x itself.
inline float exp_nonpositive(float x) {
  const float clamped = x >= -87.3f ? x : -87.3f;
  // n = nearest integer to x / ln2, by the float "magic number" trick (exact for |x / ln2| < 2^22): no floor() call
  // and no select that would make the compiler evaluate the polynomial twice.
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = clamped - n * 0.693359375f;  // ln2 split in two for an exact reduction
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const int32_t exponent = static_cast<int32_t>(n) + 127;
  const float scale = bits_to_float(static_cast<uint32_t>(exponent) << 23);
  return x >= -87.3f ? poly * scale : (x < -87.3f ? 0.0f : x);
}

}  // namespace specdec::cpu
