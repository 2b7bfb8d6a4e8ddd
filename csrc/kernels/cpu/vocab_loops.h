// The loops over a vocabulary row that dominate the CPU kernels' time (and the draft layer's SwiGLU and RMSNorm
// rows, which dominated its elementwise time at many rows), compiled twice — for the baseline x86-64 ISA (SSE2)
// and for AVX2 — and dispatched once per call on the CPU's features. Both versions compute bit-identical
// results: AVX2 only widens the vectors (no FMA contraction, no reassociation). Non-x86 builds get the portable
// version alone.
#pragma once

#include <cstdint>

#include "../common/dtype.h"

namespace specdec::cpu {

struct FloatRowScan {
  float max;  // maximum (ignoring NaN); -inf for an all -inf row
  bool bad;   // some element is NaN or +inf
};

// out[t] = row[t]; returns the maximum and whether any element is NaN / +inf.
FloatRowScan scan_floats(const float* row, float* out, int64_t n);
// x[t] = x[t] / divisor (a true division, bit-identical to the reference).
void divide_by(float* x, int64_t n, float divisor);
// w[t] = x[t] >= threshold ? exp(x[t] - m) : 0 (x[t] <= m).
void exp_weights(const float* x, float* w, int64_t n, float m, float threshold);
// w[t] = x[t] >= threshold ? exp((x[t] - m) / temperature) : 0 (x[t] <= m; subtraction and a true division, two
// rounded float operations as the reference).
void scaled_exp_weights(const float* x, float* w, int64_t n, float m, float temperature, float threshold);
// w[t] = x[t] >= cut ? w[t] : 0.
void zero_below(const float* x, float* w, int64_t n, float cut);
// r[t] = max(r[t] - q[t] * scale, 0) (two rounded float operations, as the reference; NaN stays NaN).
void subtract_clamped(float* r, const float* q, int64_t n, float scale);
// act[t] = T(T(silu(gate[t])) * up[t]), silu(g) = g / (1 + exp(-g)) in float as torch's module computes it in T
// (exp within 2 ulp of expf, evaluated on -|g| so that it never overflows).
void swiglu(const float* gate, const float* up, float* act, int64_t n);
void swiglu(const f16* gate, const f16* up, f16* act, int64_t n);
void swiglu(const bf16* gate, const bf16* up, bf16* act, int64_t n);
// y[t] = T(w[t] * T(x[t] * inv)), inv = 1 / sqrt(sum(x^2) / n + eps): torch's RMSNorm module in T. The sum of
// squares in float32 over 16 fixed lanes (t mod 16), then the lanes pairwise: one order on every ISA, whatever the
// row count.
void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps);
void rms_norm_row(const f16* x, const f16* w, f16* y, int64_t n, float eps);
void rms_norm_row(const bf16* x, const bf16* w, bf16* y, int64_t n, float eps);
// Sum in float64 over eight fixed lanes (t mod 8), then the lanes pairwise: a fixed order on every ISA.
double sum_of(const float* w, int64_t n);

}  // namespace specdec::cpu
