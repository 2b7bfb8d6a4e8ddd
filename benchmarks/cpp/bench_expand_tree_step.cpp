// expand_tree_step (EAGLE-2): random logits, top_k = 10 per frontier node, num_select = 10.
// Bytes = B * F * V * sizeof(T) (every frontier row is read once).
#include "bench_common.h"

using namespace bench;
using namespace specdec;

template <typename T>
static bool run_shape(const Args& a, int64_t B, int64_t F, int64_t V, int64_t K, int64_t S, bool cpu) {
  Rng rng(17 + B + F + V);
  std::vector<float> lf(B * F * V), scores(B * F);
  for (auto& x : lf) x = rng.uniform() * 8.0f - 4.0f;
  for (auto& s : scores) s = -3.0f * rng.uniform();
  const std::vector<T> logits = convert<T>(lf);
  std::vector<int64_t> cand_tokens(B * F * K), selected(B * S);
  std::vector<float> cand_scores(B * F * K);
  std::vector<RowStatus> status(B);
  ExpandTreeStepParams<T> p{.logits = logits.data(), .logits_stride_b = F * V, .logits_stride_f = V,
                            .parent_scores = scores.data(), .batch = B, .frontier = F, .vocab = V, .top_k = K,
                            .num_select = S, .cand_tokens = cand_tokens.data(), .cand_scores = cand_scores.data(),
                            .selected = selected.data(), .status = status.data()};
  const std::string shape = shape_str({{"B", B}, {"F", F}, {"V", V}, {"k", K}, {"S", S}});
  const double bytes = static_cast<double>(B) * F * V * sizeof(T);
  const std::string formula = "B*F*V*" + std::to_string(sizeof(T));
  // Sanity: each node's first candidate is its row's first argmax (of the values the kernel sees); selections are
  // distinct, in range, with non-increasing scores.
  std::vector<float> seen(lf.size());
  for (size_t i = 0; i < lf.size(); ++i) seen[i] = to_float(logits[i]);
  auto check = [&](const std::vector<int64_t>& ct, const std::vector<float>& cs, const std::vector<int64_t>& sel,
                   const std::vector<RowStatus>& st, const char* what) {
    for (int64_t b = 0; b < B; ++b) {
      bool ok = st[b].code == kOk;
      for (int64_t f = 0; ok && f < F; ++f) {
        const float* row = seen.data() + (b * F + f) * V;
        ok = ct[(b * F + f) * K] == std::max_element(row, row + V) - row;
      }
      for (int64_t j = 0; ok && j < S; ++j) {
        const int64_t s = sel[b * S + j];
        ok = s >= 0 && s < F * K && (j == 0 || cs[b * F * K + s] <= cs[b * F * K + sel[b * S + j - 1]]);
        for (int64_t i = 0; ok && i < j; ++i) ok = sel[b * S + i] != s;
      }
      if (!ok) {
        std::fprintf(stderr, "%s: row %lld fails the sanity check\n", what, static_cast<long long>(b));
        return false;
      }
    }
    return true;
  };
  cpu::ExpandTreeStep(p, 0, B);
  if (!check(cand_tokens, cand_scores, selected, status, "cpu")) return false;
  if (cpu)
    time_cpu(a, "expand_tree_step", shape, dtype_name<T>(), B, bytes, formula,
             [&](int64_t b0, int64_t b1) { cpu::ExpandTreeStep(p, b0, b1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<T> dl(logits);
    DevBuf<float> dscores(scores), dcs(B * F * K);
    DevBuf<int64_t> dct(B * F * K), dsel(B * S);
    DevBuf<RowStatus> dst(B);
    ExpandTreeStepParams<T> q{.logits = dl.p, .logits_stride_b = F * V, .logits_stride_f = V,
                              .parent_scores = dscores.p, .batch = B, .frontier = F, .vocab = V, .top_k = K,
                              .num_select = S, .cand_tokens = dct.p, .cand_scores = dcs.p, .selected = dsel.p,
                              .status = dst.p};
    cuda_run_once([&] { cuda::LaunchExpandTreeStep(q, nullptr); });
    if (!check(dct.get(), dcs.get(), dsel.get(), dst.get(), "cuda")) return false;
    time_cuda(a, "expand_tree_step", shape, dtype_name<T>(), bytes, formula,
              [&] { cuda::LaunchExpandTreeStep(q, nullptr); });
  }
#endif
  return true;
}

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  bool ok = true;
  if (a.smoke) {
    ok &= run_shape<float>(a, 2, 3, 1000, 4, 5, true);
    ok &= run_shape<bf16>(a, 2, 3, 1000, 4, 5, true);
  } else {
    ok &= run_shape<float>(a, 8, 10, 32000, 10, 10, a.cpu);
    ok &= run_shape<float>(a, 1, 10, 128000, 10, 10, a.cpu);
    ok &= run_shape<bf16>(a, 8, 10, 32000, 10, 10, a.cpu);
    if (use_cuda(a)) ok &= run_shape<float>(a, 64, 10, 128000, 10, 10, false);
  }
  return exit_status(ok, "output sanity check");
}
