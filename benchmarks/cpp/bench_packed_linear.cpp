// packed_linear: where splitting a product's panels over two threads pays, on an idle machine and beside a busy
// process (--busy forks one that spins until this benchmark exits). The op's glue (csrc/ops/ops_cpu.cpp) splits a
// product only when every thread gets enough multiply-adds; this measures that crossover.
//
// Each case: one product of M rows by an N x K weight; the weights cycle through copies of >= 64 MB, so that they
// stream from memory as in decoding. Timed: the kernel over all panels on the calling thread ("1 thread") and the
// panels split in two contiguous halves over an OpenMP region of 2 threads ("2 threads", as at::parallel_for does),
// in alternating blocks; the mean per call (a late thread shows in the mean, not in the median) and the ratio.
// Checked first: every output against a float64 product within float32 accumulation error.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_common.h"

using namespace bench;
using namespace specdec;

namespace {

template <typename T>
bool check(const std::vector<T>& x, const std::vector<T>& w, const std::vector<T>& y, int64_t M, int64_t N,
           int64_t K) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double t = static_cast<double>(to_float(x[m * K + k])) * to_float(w[n * K + k]);
        ref += t;
        mag += std::fabs(t);
      }
      const double got = to_float(y[m * N + n]);
      const double tol = 1e-5 * mag + (sizeof(T) == 2 ? 8e-3 * std::fabs(ref) : 0) + 1e-6;
      if (std::fabs(got - ref) > tol) {
        std::fprintf(stderr, "mismatch at row %lld col %lld: %g vs %g\n", static_cast<long long>(m),
                     static_cast<long long>(n), got, ref);
        return false;
      }
    }
  return true;
}

template <typename T>
bool run_case(const Args& a, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t P = linear_pack_pair<T>();
  const int64_t panels = (N + kLinearPanel - 1) / kLinearPanel, KP = (K + P - 1) / P;
  const int64_t packed_elems = panels * KP * kLinearPanel * P;
  const int64_t copies = std::max<int64_t>(2, (int64_t{64} << 20) / static_cast<int64_t>(packed_elems * sizeof(T)));
  Rng rng(M * 131 + N * 7 + K);
  std::vector<float> wf(N * K), xf(M * K);
  for (auto& v : wf) v = (rng.uniform() * 2.0f - 1.0f) / std::sqrt(static_cast<float>(K));
  for (auto& v : xf) v = rng.uniform() * 2.0f - 1.0f;
  const std::vector<T> w = convert<T>(wf), x = convert<T>(xf);
  std::vector<std::vector<T>> packed(a.smoke ? 1 : copies, std::vector<T>(packed_elems));
  for (auto& pk : packed) {
    cpu::PackLinearWeight(
        PackLinearWeightParams<T>{.weight = w.data(), .out_features = N, .in_features = K, .packed = pk.data()}, 0,
        panels);
  }
  std::vector<T> y(M * N);
  PackedLinearParams<T> p{.x = x.data(), .rows = M, .in_features = K, .out_features = N, .packed = packed[0].data(),
                          .bias = nullptr, .y = y.data()};
  cpu::PackedLinear(p, 0, panels);
  if (!check(x, w, y, M, N, K)) return false;
  if (a.smoke) return true;
  size_t next = 0;
  auto call = [&](int threads) {
    p.packed = packed[next++ % packed.size()].data();
    parallel_rows(panels, threads, [&](int64_t b, int64_t e) { cpu::PackedLinear(p, b, e); });
  };
  // Blocks of calls long enough to average over scheduler time slices (~50 ms), alternating 1 and 2 threads.
  const auto [ms1, ms2] = alternating_ms(a.repeats, [&] { call(1); }, [&] { call(2); }, 50.0);
  std::printf("%-9s %5lld %5lld %5lld %10.3f %10.4f %10.4f %8.2fx\n", dtype_name<T>(), static_cast<long long>(M),
              static_cast<long long>(N), static_cast<long long>(K), static_cast<double>(M * N * K) / 1e6, ms1, ms2,
              ms1 / ms2);
  std::fflush(stdout);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // (--busy is ours; the shared parser takes the rest)
  bool busy = false;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--busy") busy = true;
    else rest.push_back(argv[i]);
  }
  const Args a = parse_args(static_cast<int>(rest.size()), rest.data());
  pid_t competitor = -1;
  if (busy && !a.smoke) {
    const pid_t parent = getpid();
    competitor = fork();
    if (competitor == 0) {
      while (getppid() == parent) {
      }
      _exit(0);
    }
  }
  std::printf("# packed_linear path: float32 %s, bfloat16 %s; %s\n", cpu::PackedLinearPath<float>(),
              cpu::PackedLinearPath<bf16>(), busy ? "beside a busy process" : "no competitor started");
  std::printf("%-9s %5s %5s %5s %10s %10s %10s %9s\n", "dtype", "M", "N", "K", "M*N*K/1e6", "1thr_ms", "2thr_ms",
              "speedup");
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      a.smoke ? std::vector<std::pair<int64_t, int64_t>>{{40, 33}}
      : a.quick ? std::vector<std::pair<int64_t, int64_t>>{{128, 384}, {1024, 384}, {2048, 2048}}
                : std::vector<std::pair<int64_t, int64_t>>{{128, 384}, {384, 384}, {1024, 384}, {4096, 384},
                                                           {2048, 2048}, {5632, 2048}, {32000, 2048}};
  const std::vector<int64_t> rows = a.smoke ? std::vector<int64_t>{1, 5} : std::vector<int64_t>{1, 5, 9};
  bool ok = true;
  for (auto [N, K] : shapes)
    for (int64_t M : rows) {
      ok &= run_case<float>(a, M, N, K);
      ok &= run_case<bf16>(a, M, N, K);
    }
  if (competitor > 0) {
    kill(competitor, SIGKILL);
    waitpid(competitor, nullptr, 0);
  }
  return ok ? 0 : 1;
}
