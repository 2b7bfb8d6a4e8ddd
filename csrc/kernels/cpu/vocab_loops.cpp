#include "vocab_loops.h"

#include <cmath>

#include "../common/dtype.h"
#include "fast_exp.h"

namespace specdec::cpu {
namespace {

// The loop bodies, written once. `#pragma omp simd` plus -fno-trapping-math lets them vectorise; inlined into the
// two wrappers below, they are vectorised for each wrapper's target.
inline FloatRowScan scan_floats_impl(const float* row, float* out, int64_t n) {
  float m = neg_inf();
  int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
  for (int64_t t = 0; t < n; ++t) {
    const float v = row[t];
    out[t] = v;
    bad |= (v != v) | (v == -neg_inf());
    m = v > m ? v : m;
  }
  return {m, bad != 0};
}

inline void divide_by_impl(float* x, int64_t n, float divisor) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) x[t] = x[t] / divisor;
}


inline void exp_weights_impl(const float* x, float* w, int64_t n, float m, float threshold) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) {
    const float e = exp_nonpositive(x[t] - m);  // unconditional, so the select vectorises
    w[t] = x[t] >= threshold ? e : 0.0f;
  }
}

inline void scaled_exp_weights_impl(const float* x, float* w, int64_t n, float m, float temperature,
                                    float threshold) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) {
    const float e = exp_nonpositive((x[t] - m) / temperature);
    w[t] = x[t] >= threshold ? e : 0.0f;
  }
}

inline void zero_below_impl(const float* x, float* w, int64_t n, float cut) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) w[t] = x[t] >= cut ? w[t] : 0.0f;
}

inline void subtract_clamped_impl(float* r, const float* q, int64_t n, float scale) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) {
    const float v = r[t] - q[t] * scale;
    r[t] = v < 0.0f ? 0.0f : v;  // keeps NaN (as the reference's clamp), so a NaN residual falls back to p_u
  }
}

template <typename T>
inline void swiglu_impl(const T* gate, const T* up, T* act, int64_t n) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) {
    const float g = to_float(gate[t]);
    const float e = exp_nonpositive(g >= 0.0f ? -g : g);  // exp(-g) for g >= 0, exp(g) below
    const float silu = (g >= 0.0f ? g : g * e) / (1.0f + e);
    act[t] = from_float_rn<T>(to_float(from_float_rn<T>(silu)) * to_float(up[t]));
  }
}

template <typename T>
inline void rms_norm_row_impl(const T* x, const T* w, T* y, int64_t n, float eps) {
  float lane[16] = {};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = to_float(x[t + j]);
      lane[j] += v * v;
    }
  for (int j = 0; t < n; ++t, ++j) {
    const float v = to_float(x[t]);
    lane[j] += v * v;
  }
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  const float inv = 1.0f / std::sqrt(lane[0] / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] = from_float_rn<T>(to_float(w[i]) * to_float(from_float_rn<T>(to_float(x[i]) * inv)));
}

inline double sum_of_impl(const float* w, int64_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    for (int j = 0; j < 8; ++j) lane[j] += static_cast<double>(w[t + j]);
  }
  for (int j = 0; t < n; ++t, ++j) lane[j] += static_cast<double>(w[t]);
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

#if defined(__x86_64__) && defined(__GNUC__)
#define SPECDEC_HAVE_AVX2_CLONES 1
#define SPECDEC_AVX2 __attribute__((target("avx2")))
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

}  // namespace

// Each public function: an AVX2 clone and a baseline clone of the same body, chosen at run time.
#ifdef SPECDEC_HAVE_AVX2_CLONES
#define SPECDEC_VOCAB_LOOP(ret, name, params, args)                  \
  namespace {                                                        \
  SPECDEC_AVX2 ret name##_avx2 params { return name##_impl args; }   \
  ret name##_base params { return name##_impl args; }                \
  }                                                                  \
  ret name params { return cpu_has_avx2() ? name##_avx2 args : name##_base args; }
#else
#define SPECDEC_VOCAB_LOOP(ret, name, params, args) \
  ret name params { return name##_impl args; }
#endif

SPECDEC_VOCAB_LOOP(FloatRowScan, scan_floats, (const float* row, float* out, int64_t n), (row, out, n))
SPECDEC_VOCAB_LOOP(void, divide_by, (float* x, int64_t n, float divisor), (x, n, divisor))
SPECDEC_VOCAB_LOOP(void, exp_weights, (const float* x, float* w, int64_t n, float m, float threshold),
                   (x, w, n, m, threshold))
SPECDEC_VOCAB_LOOP(void, scaled_exp_weights,
                   (const float* x, float* w, int64_t n, float m, float temperature, float threshold),
                   (x, w, n, m, temperature, threshold))
SPECDEC_VOCAB_LOOP(void, zero_below, (const float* x, float* w, int64_t n, float cut), (x, w, n, cut))
SPECDEC_VOCAB_LOOP(void, subtract_clamped, (float* r, const float* q, int64_t n, float scale), (r, q, n, scale))
SPECDEC_VOCAB_LOOP(double, sum_of, (const float* w, int64_t n), (w, n))
SPECDEC_VOCAB_LOOP(void, rms_norm_row, (const float* x, const float* w, float* y, int64_t n, float eps),
                   (x, w, y, n, eps))
SPECDEC_VOCAB_LOOP(void, rms_norm_row, (const f16* x, const f16* w, f16* y, int64_t n, float eps), (x, w, y, n, eps))
SPECDEC_VOCAB_LOOP(void, rms_norm_row, (const bf16* x, const bf16* w, bf16* y, int64_t n, float eps),
                   (x, w, y, n, eps))
SPECDEC_VOCAB_LOOP(void, swiglu, (const float* gate, const float* up, float* act, int64_t n), (gate, up, act, n))
SPECDEC_VOCAB_LOOP(void, swiglu, (const f16* gate, const f16* up, f16* act, int64_t n), (gate, up, act, n))
SPECDEC_VOCAB_LOOP(void, swiglu, (const bf16* gate, const bf16* up, bf16* act, int64_t n), (gate, up, act, n))

}  // namespace specdec::cpu
