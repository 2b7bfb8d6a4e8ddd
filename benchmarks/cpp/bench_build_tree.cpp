// build_tree: binary-heap-shaped and random trees. Bytes = B*N*8 (parents) + B*8 (prefix) + 4*B*N*8 (depth,
// positions, first child, next sibling) + B*N*N*8 (retrieve paths) + B*8 (leaf counts): all outputs are written.
#include "bench_common.h"

using namespace bench;
using namespace specdec;

static bool run_shape(const Args& a, int64_t B, int64_t N, bool random_tree, bool cpu) {
  Rng rng(3 + B + N);
  std::vector<int64_t> parents(B * N), prefix(B);
  for (int64_t b = 0; b < B; ++b) {
    parents[b * N] = -1;
    prefix[b] = rng.below(1000);
    for (int64_t i = 1; i < N; ++i) parents[b * N + i] = random_tree ? rng.below(i) : (i - 1) / 2;
  }
  std::vector<int64_t> depth(B * N), pos(B * N), fc(B * N), ns(B * N), paths(B * N * N), leaves(B);
  std::vector<RowStatus> status(B);
  BuildTreeParams p{.parents = parents.data(), .prefix_lens = prefix.data(), .batch = B, .num_nodes = N,
                    .depth = depth.data(), .position_ids = pos.data(), .first_child = fc.data(),
                    .next_sibling = ns.data(), .retrieve_paths = paths.data(), .num_leaves = leaves.data(),
                    .status = status.data()};
  const std::string shape = shape_str({{"B", B}, {"N", N}}) + (random_tree ? ",random" : ",heap");
  const double bytes = 8.0 * (B * N + B + 4 * B * N + B * N * N + B);
  const std::string formula = "8*(5*B*N+B*N*N+2*B)";
  auto check = [&](const std::vector<int64_t>& dep, const std::vector<int64_t>& lv,
                   const std::vector<RowStatus>& st, const char* what) {
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int64_t> d(N, 0);
      std::vector<bool> has_child(N, false);
      for (int64_t i = 1; i < N; ++i) {
        d[i] = d[parents[b * N + i]] + 1;
        has_child[parents[b * N + i]] = true;
      }
      int64_t nl = 0;
      for (int64_t i = 0; i < N; ++i) nl += !has_child[i];
      bool ok = st[b].code == kOk && lv[b] == nl;
      for (int64_t i = 0; ok && i < N; ++i) ok = dep[b * N + i] == d[i];
      if (!ok) {
        std::fprintf(stderr, "%s: row %lld fails the sanity check\n", what, static_cast<long long>(b));
        return false;
      }
    }
    return true;
  };
  cpu::BuildTree(p, 0, B);
  if (!check(depth, leaves, status, "cpu")) return false;
  if (cpu)
    time_cpu(a, "build_tree", shape, "i64", B, bytes, formula,
             [&](int64_t b0, int64_t b1) { cpu::BuildTree(p, b0, b1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<int64_t> dpar(parents), dpre(prefix), ddep(B * N), dpos(B * N), dfc(B * N), dns(B * N),
        dpaths(B * N * N), dlv(B);
    DevBuf<RowStatus> dst(B);
    BuildTreeParams q{.parents = dpar.p, .prefix_lens = dpre.p, .batch = B, .num_nodes = N, .depth = ddep.p,
                      .position_ids = dpos.p, .first_child = dfc.p, .next_sibling = dns.p, .retrieve_paths = dpaths.p,
                      .num_leaves = dlv.p, .status = dst.p};
    cuda_run_once([&] { cuda::LaunchBuildTree(q, nullptr); });
    if (!check(ddep.get(), dlv.get(), dst.get(), "cuda")) return false;
    if (dpaths.get() != paths || dfc.get() != fc || dns.get() != ns || dpos.get() != pos) {
      std::fprintf(stderr, "cuda: build_tree outputs differ from the cpu kernel\n");
      return false;
    }
    time_cuda(a, "build_tree", shape, "i64", bytes, formula, [&] { cuda::LaunchBuildTree(q, nullptr); });
  }
#endif
  return true;
}

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  bool ok = true;
  if (a.smoke) {
    ok &= run_shape(a, 3, 9, false, true);
    ok &= run_shape(a, 3, 40, true, true);
  } else {
    for (bool random_tree : {false, true}) {
      ok &= run_shape(a, 8, 64, random_tree, a.cpu);
      ok &= run_shape(a, 64, 64, random_tree, a.cpu);
    }
    ok &= run_shape(a, 8, 256, true, a.cpu);
  }
  return exit_status(ok, "output sanity check");
}
