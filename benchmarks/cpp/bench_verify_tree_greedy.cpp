// verify_tree_greedy: planted trees (2-4 accepted tokens per row). Bytes = logits rows on the accepted paths
// (sum over rows of (accept_len + 1) * V * sizeof(T)): the only rows greedy verification reads.
#include "bench_common.h"

using namespace bench;
using namespace specdec;

template <typename T>
static bool run_shape(const Args& a, int64_t B, int64_t N, int64_t V, bool cpu) {
  const Planted d = make_planted(B, N, V, 1234 + B + N + V);
  const std::vector<T> logits = convert<T>(d.logits);
  std::vector<int64_t> accepted(B * N), accept_len(B), next_token(B);
  std::vector<RowStatus> status(B);
  VerifyTreeGreedyParams<T> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                              .tokens = d.tokens.data(), .parents = d.parents.data(), .batch = B, .num_nodes = N,
                              .vocab = V,
                              .out = {.accepted = accepted.data(), .accept_len = accept_len.data(),
                                      .next_token = next_token.data(), .status = status.data()}};
  const std::string shape = shape_str({{"B", B}, {"N", N}, {"V", V}});
  const double bytes = static_cast<double>(d.rows_on_paths()) * V * sizeof(T);
  const std::string formula = "(accept_len+1)*V*" + std::to_string(sizeof(T)) + " summed over rows";
  cpu::VerifyTreeGreedy(p, 0, B);
  if (!check_planted(d, accepted.data(), accept_len.data(), next_token.data(), status.data(), "cpu")) return false;
  std::printf("# %s: accepted tokens per row = %.2f (planted)\n", shape.c_str(),
              static_cast<double>(d.rows_on_paths() - B) / B);
  if (cpu)
    time_cpu(a, "verify_tree_greedy", shape, dtype_name<T>(), B, bytes, formula,
             [&](int64_t b0, int64_t b1) { cpu::VerifyTreeGreedy(p, b0, b1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<T> dl(logits);
    DevBuf<int64_t> dt(d.tokens), dp(d.parents), dacc(B * N), dlen(B), dnext(B);
    DevBuf<RowStatus> dst(B);
    VerifyTreeGreedyParams<T> q{.logits = dl.p, .logits_stride_b = N * V, .logits_stride_n = V, .tokens = dt.p,
                                .parents = dp.p, .batch = B, .num_nodes = N, .vocab = V,
                                .out = {.accepted = dacc.p, .accept_len = dlen.p, .next_token = dnext.p,
                                        .status = dst.p}};
    cuda_run_once([&] { cuda::LaunchVerifyTreeGreedy(q, nullptr); });
    if (!check_planted(d, dacc.get().data(), dlen.get().data(), dnext.get().data(), dst.get().data(), "cuda"))
      return false;
    time_cuda(a, "verify_tree_greedy", shape, dtype_name<T>(), bytes, formula,
              [&] { cuda::LaunchVerifyTreeGreedy(q, nullptr); });
  }
#endif
  return true;
}

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  bool ok = true;
  if (a.smoke) {
    ok &= run_shape<float>(a, 3, 8, 1000, true);
    ok &= run_shape<bf16>(a, 3, 16, 1000, true);
  } else {
    ok &= run_shape<float>(a, 8, 64, 32000, a.cpu);
    ok &= run_shape<bf16>(a, 8, 64, 32000, a.cpu);
    ok &= run_shape<float>(a, 1, 64, 128000, a.cpu);
    if (use_cuda(a)) ok &= run_shape<float>(a, 64, 8, 128000, false);
  }
  return exit_status(ok, "output does not match the planted answer");
}
