// tree_ancestor_mask: dense bool [B, N, N] and packed int32 [B, N, ceil(N/32)] masks of random trees.
// Bytes = B*N*8 (parents) + B*N*N (dense) or B*N*W*4 (packed).
#include "bench_common.h"

using namespace bench;
using namespace specdec;

static bool run_shape(const Args& a, int64_t B, int64_t N, bool packed, bool cpu) {
  Rng rng(13 + B + N);
  std::vector<int64_t> parents(B * N);
  for (int64_t b = 0; b < B; ++b) {
    parents[b * N] = -1;
    for (int64_t i = 1; i < N; ++i) parents[b * N + i] = rng.below(i);
  }
  const int64_t W = packed_mask_words(N);
  std::vector<uint8_t> dense(packed ? 0 : B * N * N);
  std::vector<int32_t> words(packed ? B * N * W : 0);
  std::vector<RowStatus> status(B);
  TreeMaskParams p{.parents = parents.data(), .batch = B, .num_nodes = N,
                   .dense = packed ? nullptr : reinterpret_cast<bool*>(dense.data()),
                   .packed = packed ? words.data() : nullptr, .status = status.data()};
  const std::string shape = shape_str({{"B", B}, {"N", N}}) + (packed ? ",packed" : ",dense");
  const double bytes = 8.0 * B * N + (packed ? 4.0 * B * N * W : 1.0 * B * N * N);
  const std::string formula = packed ? "8*B*N+4*B*N*ceil(N/32)" : "8*B*N+B*N*N";
  // Sanity: bit (i, j) set iff j is i or an ancestor of i.
  auto check = [&](const std::vector<uint8_t>& dn, const std::vector<int32_t>& wd, const std::vector<RowStatus>& st,
                   const char* what) {
    for (int64_t b = 0; b < B; ++b) {
      bool ok = st[b].code == kOk;
      for (int64_t i = 0; ok && i < N; ++i) {
        std::vector<bool> anc(N, false);
        for (int64_t u = i; u != -1; u = parents[b * N + u]) anc[u] = true;
        for (int64_t j = 0; ok && j < N; ++j) {
          const bool bit = packed ? ((static_cast<uint32_t>(wd[(b * N + i) * W + j / 32]) >> (j % 32)) & 1u) != 0
                                  : dn[(b * N + i) * N + j] != 0;
          ok = bit == anc[j];
        }
      }
      if (!ok) {
        std::fprintf(stderr, "%s: row %lld fails the sanity check\n", what, static_cast<long long>(b));
        return false;
      }
    }
    return true;
  };
  cpu::TreeAncestorMask(p, 0, B);
  if (!check(dense, words, status, "cpu")) return false;
  if (cpu)
    time_cpu(a, "tree_ancestor_mask", shape, "i64", B, bytes, formula,
             [&](int64_t b0, int64_t b1) { cpu::TreeAncestorMask(p, b0, b1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<int64_t> dpar(parents);
    DevBuf<uint8_t> ddense(dense.size());
    DevBuf<int32_t> dwords(words.size());
    DevBuf<RowStatus> dst(B);
    TreeMaskParams q{.parents = dpar.p, .batch = B, .num_nodes = N,
                     .dense = packed ? nullptr : reinterpret_cast<bool*>(ddense.p),
                     .packed = packed ? dwords.p : nullptr, .status = dst.p};
    cuda_run_once([&] { cuda::LaunchTreeAncestorMask(q, nullptr); });
    if (!check(ddense.get(), dwords.get(), dst.get(), "cuda")) return false;
    time_cuda(a, "tree_ancestor_mask", shape, "i64", bytes, formula, [&] { cuda::LaunchTreeAncestorMask(q, nullptr); });
  }
#endif
  return true;
}

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  bool ok = true;
  if (a.smoke) {
    ok &= run_shape(a, 3, 40, false, true);
    ok &= run_shape(a, 3, 40, true, true);
  } else {
    for (bool packed : {false, true}) {
      ok &= run_shape(a, 8, 64, packed, a.cpu);
      ok &= run_shape(a, 64, 64, packed, a.cpu);
      ok &= run_shape(a, 8, 256, packed, a.cpu);
    }
  }
  return exit_status(ok, "output sanity check");
}
