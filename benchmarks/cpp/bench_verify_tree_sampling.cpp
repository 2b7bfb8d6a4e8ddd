// verify_tree_sampling: planted trees (2-4 accepted tokens per row), T = 0.8, top_k = 50, top_p = 0.9, uniforms in
// [0.05, 0.9). Two draft modes: deterministic drafts (draft_probs = null) and i.i.d. drafts (draft_probs given).
// Bytes = logits rows on the accepted paths ((accept_len + 1) * V * sizeof(T) per row), plus, with draft_probs,
// the same number of draft_probs rows (* V * 4): the rows the algorithm must read.
#include "bench_common.h"

using namespace bench;
using namespace specdec;

template <typename T>
static bool run_shape(const Args& a, int64_t B, int64_t N, int64_t V, bool with_draft, bool cpu) {
  const Planted d = make_planted(B, N, V, 99 + B + N + V);
  const std::vector<T> logits = convert<T>(d.logits);
  Rng rng(7);
  std::vector<float> uniforms(B * N), temperature(B, 0.8f), top_p(B, 0.9f), draft, workspace(B * V);
  std::vector<int64_t> top_k(B, 50);
  for (auto& u : uniforms) u = 0.05f + 0.85f * rng.uniform();
  if (with_draft) {  // a normalised random distribution per row
    draft.resize(B * N * V);
    for (int64_t r = 0; r < B * N; ++r) {
      double s = 0;
      for (int64_t t = 0; t < V; ++t) s += draft[r * V + t] = rng.uniform();
      for (int64_t t = 0; t < V; ++t) draft[r * V + t] = static_cast<float>(draft[r * V + t] / s);
    }
  }
  std::vector<int64_t> accepted(B * N), accept_len(B), next_token(B);
  std::vector<RowStatus> status(B);
  VerifyTreeSamplingParams<T> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                                .draft_probs = with_draft ? draft.data() : nullptr, .draft_stride_b = N * V,
                                .draft_stride_n = V, .tokens = d.tokens.data(), .parents = d.parents.data(),
                                .uniforms = uniforms.data(),
                                .sampling = {.temperature = temperature.data(), .top_k = top_k.data(),
                                             .top_p = top_p.data()},
                                .batch = B, .num_nodes = N, .vocab = V, .workspace = workspace.data(),
                                .out = {.accepted = accepted.data(), .accept_len = accept_len.data(),
                                        .next_token = next_token.data(), .status = status.data()}};
  const std::string shape = shape_str({{"B", B}, {"N", N}, {"V", V}}) + (with_draft ? ",q" : ",q=none");
  const double bytes = static_cast<double>(d.rows_on_paths()) * V * (sizeof(T) + (with_draft ? 4 : 0));
  const std::string formula = "(accept_len+1)*V*(" + std::to_string(sizeof(T)) + (with_draft ? "+4" : "") + ")";
  cpu::VerifyTreeSampling(p, 0, B);
  if (!check_planted(d, accepted.data(), accept_len.data(), next_token.data(), status.data(), "cpu")) return false;
  if (cpu)
    time_cpu(a, "verify_tree_sampling", shape, dtype_name<T>(), B, bytes, formula,
             [&](int64_t b0, int64_t b1) { cpu::VerifyTreeSampling(p, b0, b1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<T> dl(logits);
    DevBuf<float> dq(draft), du(uniforms), dtemp(temperature), dtopp(top_p), dws(B * V);
    DevBuf<int64_t> dt(d.tokens), dp(d.parents), dtopk(top_k), dacc(B * N), dlen(B), dnext(B);
    DevBuf<RowStatus> dst(B);
    VerifyTreeSamplingParams<T> q{.logits = dl.p, .logits_stride_b = N * V, .logits_stride_n = V,
                                  .draft_probs = with_draft ? dq.p : nullptr, .draft_stride_b = N * V,
                                  .draft_stride_n = V, .tokens = dt.p, .parents = dp.p, .uniforms = du.p,
                                  .sampling = {.temperature = dtemp.p, .top_k = dtopk.p, .top_p = dtopp.p}, .batch = B,
                                  .num_nodes = N, .vocab = V, .workspace = dws.p,
                                  .out = {.accepted = dacc.p, .accept_len = dlen.p, .next_token = dnext.p,
                                          .status = dst.p}};
    cuda_run_once([&] { cuda::LaunchVerifyTreeSampling(q, nullptr); });
    if (!check_planted(d, dacc.get().data(), dlen.get().data(), dnext.get().data(), dst.get().data(), "cuda"))
      return false;
    time_cuda(a, "verify_tree_sampling", shape, dtype_name<T>(), bytes, formula,
              [&] { cuda::LaunchVerifyTreeSampling(q, nullptr); });
  }
#endif
  return true;
}

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  bool ok = true;
  if (a.smoke) {
    ok &= run_shape<float>(a, 3, 8, 1000, false, true);
    ok &= run_shape<bf16>(a, 3, 16, 1000, true, true);
  } else {
    ok &= run_shape<float>(a, 8, 64, 32000, false, a.cpu);
    ok &= run_shape<float>(a, 8, 64, 32000, true, a.cpu);
    ok &= run_shape<bf16>(a, 8, 64, 32000, false, a.cpu);
    ok &= run_shape<float>(a, 1, 64, 128000, false, a.cpu);
    if (use_cuda(a)) ok &= run_shape<float>(a, 64, 8, 128000, false, false);
  }
  return exit_status(ok, "output does not match the planted answer");
}
