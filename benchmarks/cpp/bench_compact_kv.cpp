// compact_kv: every layer's K and V ([B, Hkv=8, S, D=128], HF layout) compacted in one call: A accepted positions
// of a 64-node tree after prefix S/2 move to S/2 .. S/2+A-1. Bytes = 2 * caches * B * Hkv * A * D * sizeof(T) (each
// moved position read and written). Checked against a plain copy first. Goal (CUDA): 32 layers, A = 8, under 20 us.
#include <memory>

#include "bench_common.h"

using namespace bench;
using namespace specdec;

namespace {

constexpr int64_t kHkv = 8, kD = 128;

bool run_shape(const Args& a, int64_t layers, int64_t B, int64_t A, int64_t S) {
  using T = bf16;
  const int64_t n = 2 * layers, elems = B * kHkv * S * kD;
  Rng rng(5 + layers + B + A);
  std::vector<std::vector<T>> caches(n, std::vector<T>(elems));
  for (auto& c : caches)
    for (auto& x : c) x = T{static_cast<uint16_t>(rng.next())};
  const int64_t P = S / 2;
  std::vector<int64_t> src(B * A), dst(B, P), len(B, A);
  for (int64_t b = 0; b < B; ++b) {
    int64_t pos = P;
    for (int64_t i = 0; i < A; ++i) src[b * A + i] = (pos += 1 + rng.below(3));  // increasing, never in place
  }
  std::vector<std::vector<T>> want = caches;
  for (auto& c : want)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < kHkv; ++h)
        for (int64_t i = 0; i < A; ++i)
          std::memcpy(&c[((b * kHkv + h) * S + P + i) * kD], &c[((b * kHkv + h) * S + src[b * A + i]) * kD],
                      kD * sizeof(T));  // increasing sources after their destinations: in-order copy is exact
  std::vector<RowStatus> status(B);
  CompactKvParams p{};
  p.num_caches = n;
  for (int64_t c = 0; c < n; ++c) p.caches[c] = caches[c].data();
  p.batch = B;
  p.outer = kHkv;
  p.seq_len = S;
  p.inner_bytes = kD * sizeof(T);
  p.src_positions = src.data();
  p.max_len = A;
  p.dst_start = dst.data();
  p.lengths = len.data();
  p.write_status = true;
  p.status = status.data();
  const std::vector<std::vector<T>> before = caches;
  cpu::CompactKv(p, 0, n * B);
  for (int64_t c = 0; c < n; ++c) {
    if (std::memcmp(caches[c].data(), want[c].data(), elems * sizeof(T)) != 0) {
      std::fprintf(stderr, "compact_kv cpu: cache %lld differs from the expected copy\n", static_cast<long long>(c));
      return false;
    }
  }
  const std::string shape = shape_str({{"caches", n}, {"B", B}, {"A", A}, {"S", S}});
  const double bytes = 2.0 * n * B * kHkv * A * kD * sizeof(T);
  const std::string formula = "2*caches*B*Hkv*A*D*2";
  // Repeated calls move already-moved data again: the same work each time.
  if (a.cpu) time_cpu(a, "compact_kv", shape, "bf16", n * B, bytes, formula,
                      [&](int64_t t0, int64_t t1) { cpu::CompactKv(p, t0, t1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    std::vector<std::unique_ptr<DevBuf<T>>> dev;
    for (auto& c : before) dev.push_back(std::make_unique<DevBuf<T>>(c));
    DevBuf<int64_t> dsrc(src), ddst(dst), dlen(len);
    DevBuf<RowStatus> dstat(B);
    CompactKvParams g = p;
    for (int64_t c = 0; c < n; ++c) g.caches[c] = dev[c]->p;
    g.src_positions = dsrc.p;
    g.dst_start = ddst.p;
    g.lengths = dlen.p;
    g.status = dstat.p;
    cuda_run_once([&] { cuda::LaunchCompactKv(g, nullptr); });
    for (int64_t c = 0; c < n; ++c) {
      const std::vector<T> got = dev[c]->get();
      if (std::memcmp(got.data(), want[c].data(), elems * sizeof(T)) != 0) {
        std::fprintf(stderr, "compact_kv cuda: cache %lld differs\n", static_cast<long long>(c));
        return false;
      }
    }
    time_cuda(a, "compact_kv", shape, "bf16", bytes, formula, [&] { cuda::LaunchCompactKv(g, nullptr); });
  }
#endif
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  bool ok = true;
  if (a.smoke) return run_shape(a, 2, 2, 4, 64) ? 0 : 1;
  ok &= run_shape(a, 32, 1, 8, 2048);
  ok &= run_shape(a, 32, 8, 8, 512);
  if (!a.quick) ok &= run_shape(a, 32, 32, 4, 256);
  return ok ? 0 : 1;
}
