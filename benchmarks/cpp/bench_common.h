// Shared pieces of the C++ benchmarks (and of tests/cpp/test_cuda_vs_cpu.cpp): a fast PRNG, planted draft trees
// whose verification accepts a known path, host timing (median of repeats), row-parallel execution (OpenMP when
// available), CUDA buffers and cudaEvent timing when built with CUDA.
//
// Every benchmark checks its output against the planted answer before timing and prints one line per
// (shape, implementation): median ms, and GB/s from an explicit byte formula printed next to it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "common/dtype.h"
#include "common/params.h"
#include "cpu/kernels.h"

#if defined(SPECDEC_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "cuda/kernels.cuh"
#endif

namespace bench {

using specdec::bf16;
using specdec::f16;

// ---------------------------------------------------------------------------------------------------------------
// Random numbers (splitmix64).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

template <typename T>
T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline bf16 from_float<bf16>(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}
template <>
inline f16 from_float<f16>(float f) {  // normal range only, truncating (benchmark data)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const int e = static_cast<int>((u >> 23) & 0xff) - 127;
  if (f == 0.0f || e < -14) return f16{sign};
  if (e > 15) return f16{static_cast<uint16_t>(sign | 0x7bffu)};
  return f16{static_cast<uint16_t>(sign | ((e + 15) << 10) | ((u & 0x7fffffu) >> 13))};
}

template <typename T>
const char* dtype_name();
template <>
inline const char* dtype_name<float>() {
  return "fp32";
}
template <>
inline const char* dtype_name<bf16>() {
  return "bf16";
}
template <>
inline const char* dtype_name<f16>() {
  return "fp16";
}

// ---------------------------------------------------------------------------------------------------------------
// Planted trees. Tree shape: binary heap (parent of i is (i - 1) / 2), so N = 64 has depth 6 and N = 8 depth 3.
// Logits are uniform in [-2, 2); along a planted root path of length L (2..4, capped by the depth) the parent's
// row gets logit `kPlanted` at the child's token, and the path's last node gets it at a token no child drafted.
// So greedy / sampling (T <= 1, uniforms < 0.9) / typical verification accept exactly that path (p(planted) >
// 0.999 at V <= 128000), and the next token is the last node's planted token.
constexpr float kPlanted = 20.0f;

struct Planted {
  int64_t B = 0, N = 0, V = 0;
  std::vector<int64_t> parents, tokens;  // [B, N]
  std::vector<float> logits;             // [B, N, V]
  std::vector<std::vector<int64_t>> path;  // per row, root first
  std::vector<int64_t> next_token;         // per row
  int64_t rows_on_paths() const {
    int64_t r = 0;
    for (auto& p : path) r += static_cast<int64_t>(p.size());
    return r;
  }
};

inline Planted make_planted(int64_t B, int64_t N, int64_t V, uint64_t seed) {
  Planted d;
  d.B = B, d.N = N, d.V = V;
  Rng rng(seed);
  d.parents.resize(B * N);
  d.tokens.resize(B * N);
  d.logits.resize(B * N * V);
  for (auto& x : d.logits) x = rng.uniform() * 4.0f - 2.0f;
  for (int64_t b = 0; b < B; ++b) {
    int64_t* par = d.parents.data() + b * N;
    int64_t* tok = d.tokens.data() + b * N;
    par[0] = -1;
    tok[0] = rng.below(V);
    for (int64_t i = 1; i < N; ++i) {
      par[i] = (i - 1) / 2;
      do {
        tok[i] = rng.below(V);
      } while (i % 2 == 0 && tok[i] == tok[i - 1]);  // distinct sibling tokens
    }
    const int64_t want = 2 + b % 3;
    std::vector<int64_t> path = {0};
    int64_t u = 0;
    while (static_cast<int64_t>(path.size()) - 1 < want) {
      std::vector<int64_t> kids;
      for (int64_t c = 2 * u + 1; c <= 2 * u + 2 && c < N; ++c) kids.push_back(c);
      if (kids.empty()) break;
      const int64_t c = kids[rng.below(static_cast<int64_t>(kids.size()))];
      d.logits[(b * N + u) * V + tok[c]] = kPlanted;
      path.push_back(c);
      u = c;
    }
    int64_t t;
    bool clash;
    do {
      t = rng.below(V);
      clash = false;
      for (int64_t c = 2 * u + 1; c <= 2 * u + 2 && c < N; ++c) clash |= tok[c] == t;
    } while (clash);
    d.logits[(b * N + u) * V + t] = kPlanted;
    d.path.push_back(path);
    d.next_token.push_back(t);
  }
  return d;
}

template <typename T>
std::vector<T> convert(const std::vector<float>& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    std::vector<T> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = from_float<T>(v[i]);
    return out;
  }
}

// Checks verification outputs against the planted paths; prints the first mismatch. Returns true when all match.
inline bool check_planted(const Planted& d, const int64_t* accepted, const int64_t* accept_len,
                          const int64_t* next_token, const specdec::RowStatus* status, const char* what) {
  for (int64_t b = 0; b < d.B; ++b) {
    bool ok = status[b].code == specdec::kOk && accept_len[b] == static_cast<int64_t>(d.path[b].size()) - 1 &&
              next_token[b] == d.next_token[b];
    for (int64_t i = 0; ok && i < d.N; ++i) {
      const int64_t want = i < static_cast<int64_t>(d.path[b].size()) ? d.path[b][i] : -1;
      ok = accepted[b * d.N + i] == want;
    }
    if (!ok) {
      std::fprintf(stderr, "%s: row %lld: status %lld, accept_len %lld (planted %lld), next %lld (planted %lld)\n",
                   what, static_cast<long long>(b), static_cast<long long>(status[b].code),
                   static_cast<long long>(accept_len[b]), static_cast<long long>(d.path[b].size() - 1),
                   static_cast<long long>(next_token[b]), static_cast<long long>(d.next_token[b]));
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// Arguments and timing.
struct Args {
  bool quick = false;
  bool smoke = false;  // tiny shapes, one repeat: checks only (run by ctest)
  bool cpu = true;
  bool cuda = true;
  int threads = 0;  // 0: all hardware threads
  int repeats = 0;  // 0: default per mode
};

inline Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--quick") a.quick = true;
    else if (s == "--smoke") a.smoke = true;
    else if (s == "--no-cpu") a.cpu = false;
    else if (s == "--no-cuda") a.cuda = false;
    else if (s == "--threads" && i + 1 < argc) a.threads = std::atoi(argv[++i]);
    else if (s == "--repeats" && i + 1 < argc) a.repeats = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--smoke] [--no-cpu] [--no-cuda] [--threads T] [--repeats R]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  if (a.repeats <= 0) a.repeats = a.smoke ? 1 : a.quick ? 10 : 50;
  return a;
}

inline int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
}

// Runs fn(row_begin, row_end) over [0, rows) on `threads` threads (contiguous chunks, like at::parallel_for).
template <typename F>
void parallel_rows(int64_t rows, int threads, F&& fn) {
  threads = static_cast<int>(std::min<int64_t>(std::max(1, threads), rows));
  if (threads <= 1) {
    fn(int64_t{0}, rows);
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t begin = rows * t / n, end = rows * (t + 1) / n;
    if (begin < end) fn(begin, end);
  }
#else
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = rows * t / threads, end = rows * (t + 1) / threads;
    pool.emplace_back([&, begin, end] { fn(begin, end); });
  }
  for (auto& th : pool) th.join();
#endif
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median wall time (ms) of fn() over `repeats` calls after `warmup` calls.
template <typename F>
double host_median_ms(F&& fn, int repeats, int warmup = 2) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return median(ms);
}

// Mean ms per call of `first` and `second`, timed in alternating blocks of calls long enough to average over
// scheduler time slices (`block_ms` of `first`'s median call), so that drift in the machine lands on both.
template <typename F, typename G>
std::pair<double, double> alternating_ms(int repeats, F&& first, G&& second, double block_ms = 30.0) {
  const double one_ms = host_median_ms(first, 3);
  const int per_block = static_cast<int>(std::clamp(block_ms / std::max(one_ms, 1e-3), 4.0, 20000.0));
  double total[2] = {0, 0};
  int calls = 0;
  for (int block = 0; block < std::max(2, repeats / 5); ++block) {
    for (int t = 0; t < 2; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < per_block; ++i) t == 0 ? first() : second();
      total[t] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    calls += per_block;
  }
  return {total[0] / calls, total[1] / calls};
}

inline void print_header() {
  std::printf("%-22s %-30s %-5s %-14s %10s %9s  %s\n", "op", "shape", "dtype", "impl", "median_ms", "GB/s", "bytes");
}

inline void print_row(const char* op, const std::string& shape, const char* dtype, const std::string& impl, double ms,
                      double bytes, const std::string& byte_formula) {
  std::printf("%-22s %-30s %-5s %-14s %10.4f %9.2f  %s\n", op, shape.c_str(), dtype, impl.c_str(), ms,
              bytes / (ms * 1e-3) / 1e9, byte_formula.c_str());
  std::fflush(stdout);
}

// Times kernel(row_begin, row_end) over all rows on one thread, then row-parallel on all threads (when > 1).
template <typename F>
void time_cpu(const Args& a, const char* op, const std::string& shape, const char* dtype, int64_t rows, double bytes,
              const std::string& formula, F&& kernel) {
  const double ms1 = host_median_ms([&] { kernel(int64_t{0}, rows); }, a.repeats);
  print_row(op, shape, dtype, "cpu 1 thread", ms1, bytes, formula);
  const int nt = a.threads > 0 ? a.threads : max_threads();
  if (nt > 1 && rows > 1) {
    const double msn = host_median_ms([&] { parallel_rows(rows, nt, kernel); }, a.repeats);
    print_row(op, shape, dtype, "cpu " + std::to_string(nt) + " threads", msn, bytes, formula);
  }
}

inline std::string shape_str(std::initializer_list<std::pair<const char*, int64_t>> dims) {
  std::string s;
  for (auto& d : dims) s += (s.empty() ? "" : ",") + std::string(d.first) + "=" + std::to_string(d.second);
  return s;
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA.
#if defined(SPECDEC_WITH_CUDA)
#define BENCH_CUDA_CHECK(expr)                                                                          \
  do {                                                                                                  \
    cudaError_t err_ = (expr);                                                                          \
    if (err_ != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_));     \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)

inline bool cuda_device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

inline std::string cuda_device_name() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "?";
  return prop.name;
}

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(size_t count) : n(count) {
    BENCH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(1, n) * sizeof(T)));
  }
  explicit DevBuf(const std::vector<T>& h) : DevBuf(h.size()) {
    if (n) BENCH_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n) BENCH_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Median device time (ms) of one launch, from a cudaEvent pair around each of `repeats` launches.
template <typename F>
double cuda_median_ms(F&& launch, int repeats, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) launch();
  BENCH_CUDA_CHECK(cudaGetLastError());
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  BENCH_CUDA_CHECK(cudaEventCreate(&a));
  BENCH_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    BENCH_CUDA_CHECK(cudaEventRecord(a));
    launch();
    BENCH_CUDA_CHECK(cudaEventRecord(b));
    BENCH_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    BENCH_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  BENCH_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ms);
}

// Runs launch() once and waits for it: the run whose outputs a benchmark checks before it times the kernel.
template <typename F>
void cuda_run_once(F&& launch) {
  launch();
  BENCH_CUDA_CHECK(cudaGetLastError());
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
}

// Times launch() with cudaEvents (cuda_median_ms over a.repeats launches) and prints its row as impl "cuda".
template <typename F>
void time_cuda(const Args& a, const char* op, const std::string& shape, const char* dtype, double bytes,
               const std::string& formula, F&& launch) {
  print_row(op, shape, dtype, "cuda", cuda_median_ms(launch, a.repeats), bytes, formula);
}
#endif

inline bool use_cuda(const Args& a) {
#if defined(SPECDEC_WITH_CUDA)
  if (!a.cuda) return false;
  static const bool available = cuda_device_available();
  static bool said = false;
  if (!said) {
    said = true;
    if (available) std::printf("# CUDA device: %s\n", cuda_device_name().c_str());
    else std::printf("# built with CUDA, but no CUDA device: CPU only\n");
  }
  return available;
#else
  (void)a;
  return false;
#endif
}

// main's result: 0 when every check passed, else 1 after one line on stderr saying which check failed.
inline int exit_status(bool ok, const char* failed_check) {
  if (!ok) std::fprintf(stderr, "FAILED: %s\n", failed_check);
  return ok ? 0 : 1;
}

}  // namespace bench
