// verify_tree_typical: planted trees (2-4 accepted tokens per row), T = 0.7, threshold 0.09, alpha 0.3.
// Bytes = (accept_len + 1) * V * sizeof(T) per row: on planted data only the accepted path's nodes pass the typical
// rule, so exactly the rows on that path are read (the parents of tested nodes, plus the last node).
#include "bench_common.h"

using namespace bench;
using namespace specdec;

template <typename T>
static bool run_shape(const Args& a, int64_t B, int64_t N, int64_t V, bool cpu) {
  const Planted d = make_planted(B, N, V, 4321 + B + N + V);
  const std::vector<T> logits = convert<T>(d.logits);
  Rng rng(11);
  std::vector<float> uniforms(B), temperature(B, 0.7f);
  for (auto& u : uniforms) u = 0.05f + 0.85f * rng.uniform();
  std::vector<int64_t> accepted(B * N), accept_len(B), next_token(B);
  std::vector<RowStatus> status(B);
  VerifyTreeTypicalParams<T> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                               .tokens = d.tokens.data(), .parents = d.parents.data(), .uniforms = uniforms.data(),
                               .temperature = temperature.data(), .posterior_threshold = 0.09f, .posterior_alpha = 0.3f,
                               .batch = B, .num_nodes = N, .vocab = V,
                               .out = {.accepted = accepted.data(), .accept_len = accept_len.data(),
                                       .next_token = next_token.data(), .status = status.data()}};
  const std::string shape = shape_str({{"B", B}, {"N", N}, {"V", V}});
  const double bytes = static_cast<double>(d.rows_on_paths()) * V * sizeof(T);
  const std::string formula = "(accept_len+1)*V*" + std::to_string(sizeof(T));
  cpu::VerifyTreeTypical(p, 0, B);
  if (!check_planted(d, accepted.data(), accept_len.data(), next_token.data(), status.data(), "cpu")) return false;
  if (cpu)
    time_cpu(a, "verify_tree_typical", shape, dtype_name<T>(), B, bytes, formula,
             [&](int64_t b0, int64_t b1) { cpu::VerifyTreeTypical(p, b0, b1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<T> dl(logits);
    DevBuf<float> du(uniforms), dtemp(temperature);
    DevBuf<int64_t> dt(d.tokens), dp(d.parents), dacc(B * N), dlen(B), dnext(B);
    DevBuf<RowStatus> dst(B);
    VerifyTreeTypicalParams<T> q{.logits = dl.p, .logits_stride_b = N * V, .logits_stride_n = V, .tokens = dt.p,
                                 .parents = dp.p, .uniforms = du.p, .temperature = dtemp.p,
                                 .posterior_threshold = 0.09f, .posterior_alpha = 0.3f, .batch = B, .num_nodes = N,
                                 .vocab = V,
                                 .out = {.accepted = dacc.p, .accept_len = dlen.p, .next_token = dnext.p,
                                         .status = dst.p}};
    cuda_run_once([&] { cuda::LaunchVerifyTreeTypical(q, nullptr); });
    if (!check_planted(d, dacc.get().data(), dlen.get().data(), dnext.get().data(), dst.get().data(), "cuda"))
      return false;
    time_cuda(a, "verify_tree_typical", shape, dtype_name<T>(), bytes, formula,
              [&] { cuda::LaunchVerifyTreeTypical(q, nullptr); });
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
    ok &= run_shape<float>(a, 1, 64, 128000, a.cpu);
    if (use_cuda(a)) ok &= run_shape<float>(a, 64, 8, 128000, false);
  }
  return exit_status(ok, "output does not match the planted answer");
}
