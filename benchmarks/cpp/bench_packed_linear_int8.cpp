// packed_linear_int8 against packed_linear (float32) on one thread, kernels only (no torch): the int8 product of M
// rows (its input rows quantised, then the integer product) and the float32 packed product of the same rows by
// the same N x K weight, timed in alternating blocks, and the ratio. The weights cycle through copies of >= 96 MB
// each (beyond the last-level cache), so that they stream from memory as in decoding.
// Checked first: the int8 result against the float64 product within the two quantisations' bound.
#include "bench_common.h"

using namespace bench;
using namespace specdec;

namespace {

bool run_case(const Args& a, int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + kLinearPanel - 1) / kLinearPanel, Kp = linear_int8_padded_k(K);
  const int64_t float_bytes = panels * K * kLinearPanel * 4, int8_bytes = panels * Kp * kLinearPanel + 4 * N;
  const int64_t float_copies = a.smoke ? 1 : std::max<int64_t>(2, (int64_t{96} << 20) / float_bytes);
  const int64_t int8_copies = a.smoke ? 1 : std::max<int64_t>(2, (int64_t{96} << 20) / int8_bytes);
  Rng rng(M * 131 + N * 7 + K);
  std::vector<float> w(N * K), x(M * K), y(M * N), y8(M * N), w_scales(N), x_scales(M);
  for (auto& v : w) v = (rng.uniform() * 2.0f - 1.0f) / std::sqrt(static_cast<float>(K));
  for (auto& v : x) v = rng.uniform() * 2.0f - 1.0f;
  std::vector<std::vector<float>> packed(float_copies, std::vector<float>(panels * K * kLinearPanel));
  for (auto& pk : packed)
    cpu::PackLinearWeight(PackLinearWeightParams<float>{.weight = w.data(), .out_features = N, .in_features = K,
                                                        .packed = pk.data()},
                          0, panels);
  std::vector<std::vector<int8_t>> packed8(int8_copies, std::vector<int8_t>(panels * Kp * kLinearPanel));
  for (auto& pk : packed8)
    cpu::PackLinearWeightInt8(PackLinearInt8Params<float>{.weight = w.data(), .out_features = N, .in_features = K,
                                                          .packed = pk.data(), .scales = w_scales.data()},
                              0, panels);
  std::vector<int8_t> qx(M * Kp);
  PackedLinearParams<float> p{.x = x.data(), .rows = M, .in_features = K, .out_features = N,
                              .packed = packed[0].data(), .bias = nullptr, .y = y.data()};
  const QuantizeRowsInt8Params<float> q{.x = x.data(), .rows = M, .in_features = K, .q = qx.data(),
                                        .scales = x_scales.data()};
  PackedLinearInt8Params<float> p8{.qx = qx.data(), .x_scales = x_scales.data(), .rows = M, .in_features = K,
                                   .out_features = N, .packed = packed8[0].data(), .w_scales = w_scales.data(),
                                   .bias = nullptr, .y = y8.data()};
  cpu::QuantizeRowsInt8(q, 0, M);
  cpu::PackedLinearInt8(p8, 0, panels);
  for (int64_t m = 0; m < M; ++m) {  // |error| <= sum_k |x| dw + |w| dx + dx dw (half steps dx, dw)
    const double dx = x_scales[m] / 2;
    for (int64_t n = 0; n < N; ++n) {
      double exact = 0, bound = 0;
      const double dw = w_scales[n] / 2;
      for (int64_t k = 0; k < K; ++k) {
        exact += static_cast<double>(x[m * K + k]) * w[n * K + k];
        bound += std::fabs(x[m * K + k]) * dw + std::fabs(w[n * K + k]) * dx + dx * dw;
      }
      if (std::fabs(y8[m * N + n] - exact) > bound * 1.0001 + 1e-6) {
        std::fprintf(stderr, "int8 error beyond its bound at row %lld col %lld: %g vs %g (bound %g)\n",
                     static_cast<long long>(m), static_cast<long long>(n), y8[m * N + n], exact, bound);
        return false;
      }
    }
  }
  if (a.smoke) return true;
  size_t next = 0, next8 = 0;
  auto call_float = [&] {
    p.packed = packed[next++ % packed.size()].data();
    cpu::PackedLinear(p, 0, panels);
  };
  auto call_int8 = [&] {
    p8.packed = packed8[next8++ % packed8.size()].data();
    cpu::QuantizeRowsInt8(q, 0, M);
    cpu::PackedLinearInt8(p8, 0, panels);
  };
  const auto [ms_float, ms_int8] = alternating_ms(a.repeats, call_float, call_int8);
  std::printf("%5lld %5lld %5lld %12.4f %12.4f %8.2fx %10.2f %10.2f\n", static_cast<long long>(M),
              static_cast<long long>(N), static_cast<long long>(K), ms_float, ms_int8, ms_float / ms_int8,
              float_bytes / ms_float / 1e6, int8_bytes / ms_int8 / 1e6);
  std::fflush(stdout);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  std::printf("# packed_linear_int8 path %s, packed_linear float32 path %s; 1 thread; weights streamed\n",
              cpu::PackedLinearInt8Path(), cpu::PackedLinearPath<float>());
  std::printf("%5s %5s %5s %12s %12s %9s %10s %10s\n", "M", "N", "K", "float32_ms", "int8_ms", "ratio", "f32_GB/s",
              "int8_GB/s");
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      a.smoke ? std::vector<std::pair<int64_t, int64_t>>{{40, 33}}
      : a.quick ? std::vector<std::pair<int64_t, int64_t>>{{1024, 384}, {4096, 384}, {4096, 4096}}
                : std::vector<std::pair<int64_t, int64_t>>{{384, 384}, {1024, 384}, {384, 1024}, {512, 256},
                                                           {4096, 256}, {4096, 384}, {4096, 4096}};
  const std::vector<int64_t> rows = a.smoke ? std::vector<int64_t>{1, 5} : std::vector<int64_t>{1, 2, 3, 4, 9, 16};
  bool ok = true;
  for (auto [N, K] : shapes)
    for (int64_t M : rows) ok &= run_case(a, M, N, K);
  return ok ? 0 : 1;
}
