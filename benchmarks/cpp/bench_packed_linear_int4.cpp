// packed_linear_int4 against packed_linear_int8 on one thread, kernels only (no torch): the product of M rows by the
// same N x K weight in int4 and in int8 (each with its input rows quantised per call, as the ops do), timed in
// alternating blocks, and the ratio. The weights cycle through copies of >= 96 MB each (beyond the last-level
// cache), so that they stream from memory as in decoding.
// Checked first: the int4 result against the float64 product within the two quantisations' bound.
#include "bench_common.h"

using namespace bench;
using namespace specdec;

namespace {

bool run_case(const Args& a, int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + kLinearPanel - 1) / kLinearPanel, K8 = linear_int8_padded_k(K);
  const int64_t Kp = linear_int4_padded_k(K), G = Kp / kLinearInt4Group;
  const int64_t int8_bytes = panels * K8 * kLinearPanel + 4 * N;
  const int64_t int4_bytes = panels * (Kp / 2 + G) * kLinearPanel + 4 * N;
  const int64_t int8_copies = a.smoke ? 1 : std::max<int64_t>(2, (int64_t{96} << 20) / int8_bytes);
  const int64_t int4_copies = a.smoke ? 1 : std::max<int64_t>(2, (int64_t{96} << 20) / int4_bytes);
  Rng rng(M * 131 + N * 7 + K);
  std::vector<float> w(N * K), x(M * Kp, 0.0f), y8(M * N), y4(M * N), s8(N), s4(N), x_scales(M), x4_scales(M);
  for (auto& v : w) v = (rng.uniform() * 2.0f - 1.0f) / std::sqrt(static_cast<float>(K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x[m * Kp + k] = rng.uniform() * 2.0f - 1.0f;  // (rows zero-padded to Kp)
  std::vector<std::vector<int8_t>> packed8(int8_copies, std::vector<int8_t>(panels * K8 * kLinearPanel));
  for (auto& pk : packed8)
    cpu::PackLinearWeightInt8(PackLinearInt8Params<float>{.weight = w.data(), .out_features = N, .in_features = K,
                                                          .packed = pk.data(), .scales = s8.data()},
                              0, panels);
  std::vector<std::vector<uint8_t>> packed4(int4_copies, std::vector<uint8_t>(panels * Kp / 2 * kLinearPanel));
  std::vector<uint8_t> mult(panels * G * kLinearPanel);
  for (auto& pk : packed4)
    cpu::PackLinearWeightInt4(PackLinearInt4Params<float>{.weight = w.data(), .out_features = N, .in_features = K,
                                                          .packed = pk.data(), .group_scales = mult.data(),
                                                          .scales = s4.data()},
                              0, panels);
  // int8 reads x[m] at stride K: its own unpadded copy
  std::vector<float> x8(M * K);
  for (int64_t m = 0; m < M; ++m) std::copy(x.begin() + m * Kp, x.begin() + m * Kp + K, x8.begin() + m * K);
  std::vector<int8_t> qx8(M * K8), qx4(M * Kp);
  std::vector<int32_t> offsets(M * G);
  const QuantizeRowsInt8Params<float> q8{.x = x8.data(), .rows = M, .in_features = K, .q = qx8.data(),
                                         .scales = x_scales.data()};
  const QuantizeRowsInt8Params<float> q4{.x = x.data(), .rows = M, .in_features = Kp, .q = qx4.data(),
                                         .scales = x4_scales.data()};
  PackedLinearInt8Params<float> p8{.qx = qx8.data(), .x_scales = x_scales.data(), .rows = M, .in_features = K,
                                   .out_features = N, .packed = packed8[0].data(), .w_scales = s8.data(),
                                   .bias = nullptr, .y = y8.data()};
  PackedLinearInt4Params<float> p4{.qx = qx4.data(), .x_scales = x4_scales.data(), .x_offsets = offsets.data(),
                                   .rows = M, .in_features = K, .out_features = N, .packed = packed4[0].data(),
                                   .group_scales = mult.data(), .w_scales = s4.data(), .bias = nullptr,
                                   .y = y4.data()};
  auto call_int4_once = [&] {
    cpu::QuantizeRowsInt8(q4, 0, M);
    cpu::LinearInt4Offsets(p4, 0, M);
    cpu::PackedLinearInt4(p4, 0, panels);
  };
  call_int4_once();
  for (int64_t m = 0; m < M; ++m) {  // |error| <= sum_k |x| dw + |w| dx + dx dw (half steps dx, dw of each group)
    const double dx = x4_scales[m] / 2;
    for (int64_t n = 0; n < N; ++n) {
      double exact = 0, bound = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double dw = static_cast<double>(s4[n]) * mult[((n / 32) * G + k / 32) * 32 + n % 32] / 2;
        exact += static_cast<double>(x[m * Kp + k]) * w[n * K + k];
        bound += std::fabs(x[m * Kp + k]) * dw + std::fabs(w[n * K + k]) * dx + dx * dw;
      }
      if (std::fabs(y4[m * N + n] - exact) > bound * 1.0001 + 1e-6) {
        std::fprintf(stderr, "int4 error beyond its bound at row %lld col %lld: %g vs %g (bound %g)\n",
                     static_cast<long long>(m), static_cast<long long>(n), y4[m * N + n], exact, bound);
        return false;
      }
    }
  }
  if (a.smoke) return true;
  size_t next8 = 0, next4 = 0;
  auto call_int8 = [&] {
    p8.packed = packed8[next8++ % packed8.size()].data();
    cpu::QuantizeRowsInt8(q8, 0, M);
    cpu::PackedLinearInt8(p8, 0, panels);
  };
  auto call_int4 = [&] {
    p4.packed = packed4[next4++ % packed4.size()].data();
    call_int4_once();
  };
  const auto [ms_int8, ms_int4] = alternating_ms(a.repeats, call_int8, call_int4);
  std::printf("%5lld %5lld %5lld %12.4f %12.4f %8.2fx %10.2f %10.2f\n", static_cast<long long>(M),
              static_cast<long long>(N), static_cast<long long>(K), ms_int8, ms_int4, ms_int8 / ms_int4,
              int8_bytes / ms_int8 / 1e6, int4_bytes / ms_int4 / 1e6);
  std::fflush(stdout);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  std::printf("# packed_linear_int4 path %s, packed_linear_int8 path %s; 1 thread; weights streamed\n",
              cpu::PackedLinearInt4Path(), cpu::PackedLinearInt8Path());
  std::printf("%5s %5s %5s %12s %12s %9s %10s %10s\n", "M", "N", "K", "int8_ms", "int4_ms", "ratio", "int8_GB/s",
              "int4_GB/s");
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      a.smoke ? std::vector<std::pair<int64_t, int64_t>>{{40, 33}}
      : a.quick ? std::vector<std::pair<int64_t, int64_t>>{{1024, 384}, {4096, 384}, {4096, 4096}}
                : std::vector<std::pair<int64_t, int64_t>>{{384, 384}, {1024, 384}, {384, 1024}, {512, 256},
                                                           {4096, 256}, {4096, 384}, {4096, 4096}, {11008, 4096}};
  const std::vector<int64_t> rows = a.smoke ? std::vector<int64_t>{1, 5} : std::vector<int64_t>{1, 2, 3, 4, 9, 16};
  bool ok = true;
  for (auto [N, K] : shapes)
    for (int64_t M : rows) ok &= run_case(a, M, N, K);
  return ok ? 0 : 1;
}
