// sample_tokens: random logits (uniform in [-2, 2) plus a few larger ones), two parameter sets: T = 0.8,
// top_k = 50, top_p = 0.9 ("filtered") and T = 1 with no filter ("plain"). Bytes = R * V * sizeof(T) (logits
// read) + R * V * 4 (probs written).
#include "bench_common.h"

using namespace bench;
using namespace specdec;

template <typename T>
static bool run_shape(const Args& a, int64_t R, int64_t V, bool filtered, bool cpu) {
  Rng rng(5 + R + V);
  std::vector<float> lf(R * V);
  for (auto& x : lf) x = rng.uniform() * 4.0f - 2.0f;
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < 20; ++j) lf[r * V + rng.below(V)] = 4.0f + rng.uniform() * 4.0f;
  const std::vector<T> logits = convert<T>(lf);
  std::vector<float> uniforms(R), temperature(R, filtered ? 0.8f : 1.0f), top_p(R, filtered ? 0.9f : 1.0f);
  std::vector<int64_t> top_k(R, filtered ? 50 : 0), tokens(R);
  for (auto& u : uniforms) u = rng.uniform();
  std::vector<float> probs(R * V);
  std::vector<RowStatus> status(R);
  SampleTokensParams<T> p{.logits = logits.data(), .logits_stride_r = V, .uniforms = uniforms.data(),
                          .sampling = {.temperature = temperature.data(), .top_k = top_k.data(), .top_p = top_p.data()},
                          .rows = R, .vocab = V, .tokens = tokens.data(), .probs = probs.data(),
                          .status = status.data()};
  const std::string shape = shape_str({{"R", R}, {"V", V}}) + (filtered ? ",T=.8,k=50,p=.9" : ",T=1");
  const double bytes = static_cast<double>(R) * V * (sizeof(T) + 4);
  const std::string formula = "R*V*(" + std::to_string(sizeof(T)) + "+4)";
  auto check = [&](const std::vector<int64_t>& tok, const std::vector<float>& pr, const std::vector<RowStatus>& st,
                   const char* what) {
    for (int64_t r = 0; r < R; ++r) {
      double sum = 0;
      int64_t kept = 0;
      for (int64_t t = 0; t < V; ++t) {
        sum += pr[r * V + t];
        kept += pr[r * V + t] > 0;
      }
      const bool ok = st[r].code == kOk && tok[r] >= 0 && tok[r] < V && pr[r * V + tok[r]] > 0 &&
                      std::fabs(sum - 1.0) < 1e-3 && (!filtered || kept <= 50);
      if (!ok) {
        std::fprintf(stderr, "%s: row %lld: status %lld token %lld sum %.6f kept %lld\n", what,
                     static_cast<long long>(r), static_cast<long long>(st[r].code), static_cast<long long>(tok[r]),
                     sum, static_cast<long long>(kept));
        return false;
      }
    }
    return true;
  };
  cpu::SampleTokens(p, 0, R);
  if (!check(tokens, probs, status, "cpu")) return false;
  if (cpu)
    time_cpu(a, "sample_tokens", shape, dtype_name<T>(), R, bytes, formula,
             [&](int64_t r0, int64_t r1) { cpu::SampleTokens(p, r0, r1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<T> dl(logits);
    DevBuf<float> du(uniforms), dtemp(temperature), dtopp(top_p), dprobs(R * V);
    DevBuf<int64_t> dtopk(top_k), dtok(R);
    DevBuf<RowStatus> dst(R);
    SampleTokensParams<T> q{.logits = dl.p, .logits_stride_r = V, .uniforms = du.p,
                            .sampling = {.temperature = dtemp.p, .top_k = dtopk.p, .top_p = dtopp.p}, .rows = R,
                            .vocab = V, .tokens = dtok.p, .probs = dprobs.p, .status = dst.p};
    cuda_run_once([&] { cuda::LaunchSampleTokens(q, nullptr); });
    const auto gtok = dtok.get();
    if (!check(gtok, dprobs.get(), dst.get(), "cuda")) return false;
    int64_t same = 0;
    for (int64_t r = 0; r < R; ++r) same += gtok[r] == tokens[r];
    std::printf("# %s: cuda tokens equal to cpu tokens in %lld / %lld rows\n", shape.c_str(),
                static_cast<long long>(same), static_cast<long long>(R));
    time_cuda(a, "sample_tokens", shape, dtype_name<T>(), bytes, formula,
              [&] { cuda::LaunchSampleTokens(q, nullptr); });
  }
#endif
  return true;
}

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  bool ok = true;
  if (a.smoke) {
    ok &= run_shape<float>(a, 4, 1000, true, true);
    ok &= run_shape<bf16>(a, 4, 1000, false, true);
  } else {
    for (bool filtered : {true, false}) {
      ok &= run_shape<float>(a, 64, 32000, filtered, a.cpu);
      ok &= run_shape<float>(a, 8, 32000, filtered, a.cpu);
      ok &= run_shape<float>(a, 1, 128000, filtered, a.cpu);
    }
    ok &= run_shape<bf16>(a, 64, 32000, true, a.cpu);
    if (use_cuda(a)) {
      ok &= run_shape<float>(a, 64, 128000, true, false);
      ok &= run_shape<float>(a, 512, 32000, true, false);
    }
  }
  return exit_status(ok, "output sanity check");
}
