// Scalar types shared by the CPU and CUDA kernels, with no torch dependency.
//
// Half-precision inputs cross the glue boundary as 16-bit storage types (`f16`, `bf16`). Kernels read them
// through `to_float`, so every kernel template is written once for `float`, `f16` and `bf16` and always
// accumulates in float32.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPECDEC_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#define SPECDEC_HD inline
#endif

namespace specdec {

// IEEE binary16, stored as raw bits (layout-compatible with at::Half and __half).
struct f16 {
  uint16_t bits;
};
// bfloat16, stored as raw bits (layout-compatible with at::BFloat16 and __nv_bfloat16).
struct bf16 {
  uint16_t bits;
};

SPECDEC_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif defined(__has_builtin) && __has_builtin(__builtin_bit_cast)
  return __builtin_bit_cast(float, u);  // unlike memcpy, keeps vocabulary loops vectorisable
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

SPECDEC_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#elif defined(__has_builtin) && __has_builtin(__builtin_bit_cast)
  return __builtin_bit_cast(uint32_t, f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

SPECDEC_HD float to_float(float x) { return x; }

SPECDEC_HD float to_float(bf16 x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }

SPECDEC_HD float to_float(f16 x) {
#if defined(__CUDA_ARCH__)
  __half_raw raw;
  raw.x = x.bits;
  return __half2float(__half(raw));
#else
  // Exact binary16 -> binary32 conversion, branch-free so vocabulary loops vectorise: place exponent and mantissa
  // in float position and multiply by 2^112 to move the exponent bias from 15 to 127 (exact for normals and
  // subnormals, since scaling by a power of two is exact); infinities and NaN are patched by a select.
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t magnitude = static_cast<uint32_t>(x.bits & 0x7fffu) << 13;
  const float scaled = bits_to_float(magnitude) * bits_to_float(0x77800000u);  // 0x77800000 = 2^112
  const uint32_t finite = float_to_bits(scaled);
  const uint32_t special = 0x7f800000u | (magnitude & 0x007fe000u);  // inf or NaN with its payload
  return bits_to_float(sign | (magnitude >= 0x0f800000u ? special : finite));
#endif
}

// Maps a float to an unsigned key with the same order (NaN excluded): larger float <=> larger key.
// Used by radix selection (top-k / top-p thresholds) on both devices.
SPECDEC_HD uint32_t order_key(float f) {
  const uint32_t u = float_to_bits(f == 0.0f ? 0.0f : f);  // -0.0 and +0.0 compare equal, so share a key
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

SPECDEC_HD float key_to_float(uint32_t key) {
  return bits_to_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

SPECDEC_HD bool is_nan(float f) { return f != f; }
SPECDEC_HD bool is_pos_inf(float f) { return f == bits_to_float(0x7f800000u); }
SPECDEC_HD float neg_inf() { return bits_to_float(0xff800000u); }

// float -> storage type, rounding to nearest even (NaN stays NaN, overflow goes to inf), for kernels that write
// half-precision outputs. Host and device give identical bits.
SPECDEC_HD uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

SPECDEC_HD uint16_t float_to_f16_bits(float f) {
  uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return static_cast<uint16_t>(sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf (65520 and up)
  if (u < 0x38800000u) {
    // Subnormal or zero half: adding 0.5f aligns the mantissa so the float addition rounds (to nearest even) at
    // the half's last subnormal bit.
    const float t = bits_to_float(u) + 0.5f;
    return static_cast<uint16_t>(sign | (float_to_bits(t) - 0x3f000000u));
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000000u + 0xfffu + odd;  // rebias the exponent (-112 << 23, mod 2^32) and round to nearest even
  return static_cast<uint16_t>(sign | (u >> 13));
}

template <typename T>
SPECDEC_HD T from_float_rn(float f);
template <>
SPECDEC_HD float from_float_rn<float>(float f) {
  return f;
}
template <>
SPECDEC_HD bf16 from_float_rn<bf16>(float f) {
  return bf16{float_to_bf16_bits(f)};
}
template <>
SPECDEC_HD f16 from_float_rn<f16>(float f) {
  return f16{float_to_f16_bits(f)};
}

}  // namespace specdec
