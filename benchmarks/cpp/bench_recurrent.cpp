// The input-dependent recurrent tree ops (Gated DeltaNet, Mamba-2): our depth-first pass (N steps, one state per
// depth) against replaying every node's root-to-node path from the saved state (sum_i (d_i + 1) steps: the other
// kernel choice, written here with the commit kernels on a scratch state), side by side, one thread; then, with
// CUDA, every recurrent op's CUDA kernel against the CPU kernel (checked, then timed). Shapes of a ~15M-parameter
// hybrid: H = 4 / 8 heads of 64 x 64 states, an EAGLE-2-like tree of N = 32 nodes in 6 levels, B = 1 / 4.
// Bytes: the saved states and the nodes' inputs read once, B*H*(R*C + N*(inputs per node))*4.
#include "bench_common.h"

using namespace bench;
using namespace specdec;

namespace {

constexpr int64_t kD = 64;

std::vector<float> randn(Rng& rng, int64_t n, float scale) {
  std::vector<float> v(n);
  for (auto& x : v) x = (rng.uniform() * 2.0f - 1.0f) * scale;
  return v;
}

// 6 levels of equal width below the root, each node's parent among the first 3 nodes of the level above.
std::vector<int64_t> eagle_tree(Rng& rng, int64_t B, int64_t N) {
  const int64_t width = (N - 1 + 5) / 6;
  std::vector<int64_t> par(B * N, -1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 1; i < N; ++i) {
      const int64_t level = (i - 1) / width;
      par[b * N + i] = level == 0 ? 0 : 1 + (level - 1) * width + rng.below(std::min<int64_t>(3, width));
    }
  return par;
}

std::vector<int64_t> root_path(const int64_t* par, int64_t i) {
  std::vector<int64_t> up;
  for (int64_t j = i; j >= 0; j = par[j]) up.push_back(j);
  return std::vector<int64_t>(up.rbegin(), up.rend());
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t e = 0; e < a.size(); ++e) m = std::max(m, static_cast<double>(std::fabs(a[e] - b[e])));
  return m;
}

bool run_delta(const Args& a, int64_t B, int64_t H, int64_t N) {
  Rng rng(7 + B + H + N);
  const int64_t D = kD;
  const std::vector<float> q = randn(rng, B * H * N * D, 0.125f), k = randn(rng, B * H * N * D, 0.125f);
  const std::vector<float> v = randn(rng, B * H * N * D, 1.0f), state = randn(rng, B * H * D * D, 1.0f);
  std::vector<float> g = randn(rng, B * H * N, 0.3f), beta = randn(rng, B * H * N, 1.0f);
  for (auto& x : g) x = -std::fabs(x);
  for (auto& x : beta) x = std::fabs(x);
  const std::vector<int64_t> parents = eagle_tree(rng, B, N);
  std::vector<float> out(B * H * N * D), replay_out(B * H * N * D);
  std::vector<RowStatus> status(B);
  TreeGatedDeltaParams<float> p{
      .q = q.data(), .q_stride_b = H * N * D, .q_stride_h = N * D, .q_stride_n = D, .k = k.data(),
      .k_stride_b = H * N * D, .k_stride_h = N * D, .k_stride_n = D, .v = v.data(), .v_stride_b = H * N * D,
      .v_stride_h = N * D, .v_stride_n = D, .g = g.data(), .beta = beta.data(), .gate_stride_b = H * N,
      .gate_stride_h = N, .gate_stride_n = 1, .beta_stride_b = H * N, .beta_stride_h = N, .beta_stride_n = 1,
      .state = state.data(), .state_stride_b = H * D * D, .state_stride_h = D * D, .state_stride_k = D,
      .parents = parents.data(), .batch = B, .num_heads = H, .num_nodes = N, .key_dim = D, .value_dim = D,
      .out = out.data(), .status = status.data()};
  // Replay: per node, the commit kernel over its root path on a copy of the saved state, then o = S^T q.
  std::vector<int64_t> paths(B * N * N, -1), lengths(B), steps_total(1, 0);
  std::vector<float> scratch(B * H * D * D);
  auto replay = [&] {
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t b = 0; b < B; ++b) {
        const std::vector<int64_t> path = root_path(&parents[b * N], i);
        std::copy(path.begin(), path.end(), paths.begin() + b * N);
        lengths[b] = static_cast<int64_t>(path.size());
      }
      std::copy(state.begin(), state.end(), scratch.begin());
      CommitGatedDeltaParams<float> c{
          .state = scratch.data(), .state_stride_b = H * D * D, .state_stride_h = D * D, .state_stride_k = D,
          .k = k.data(), .k_stride_b = H * N * D, .k_stride_h = N * D, .k_stride_n = D, .v = v.data(),
          .v_stride_b = H * N * D, .v_stride_h = N * D, .v_stride_n = D, .g = g.data(), .beta = beta.data(),
          .gate_stride_b = H * N, .gate_stride_h = N, .gate_stride_n = 1, .beta_stride_b = H * N,
          .beta_stride_h = N, .beta_stride_n = 1, .path = paths.data(), .lengths = lengths.data(), .batch = B,
          .num_heads = H, .num_nodes = N, .max_len = N, .key_dim = D, .value_dim = D, .status = status.data()};
      cpu::CommitGatedDelta<float>(c, 0, B * H);
      for (int64_t bh = 0; bh < B * H; ++bh)
        for (int64_t e = 0; e < D; ++e) {
          float o = 0.0f;
          for (int64_t x = 0; x < D; ++x) o += scratch[bh * D * D + x * D + e] * q[(bh * N + i) * D + x];
          replay_out[(bh * N + i) * D + e] = o;
        }
    }
  };
  cpu::TreeGatedDelta<float>(p, 0, B * H);
  replay();
  if (max_abs_diff(out, replay_out) > 1e-3) {
    std::fprintf(stderr, "tree_gated_delta_rule: depth-first and replay differ by %g\n", max_abs_diff(out, replay_out));
    return false;
  }
  int64_t steps = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i) steps += static_cast<int64_t>(root_path(&parents[b * N], i).size());
  const std::string shape = shape_str({{"B", B}, {"H", H}, {"N", N}, {"D", D}});
  const double bytes = 4.0 * B * H * (D * D + N * (3 * D + 2));
  const std::string formula = "B*H*(D*D+N*(3D+2))*4";
  const double ms_dfs = host_median_ms([&] { cpu::TreeGatedDelta<float>(p, 0, B * H); }, a.repeats);
  const double ms_replay = host_median_ms(replay, a.repeats);
  print_row("tree_gated_delta_rule", shape, "f32", "cpu depth-first", ms_dfs, bytes, formula);
  print_row("tree_gated_delta_rule", shape, "f32", "cpu replay", ms_replay, bytes, formula);
  std::printf("# depth-first: %lld steps, replay: %lld steps; replay / depth-first time = %.2fx (1 thread, same run)\n",
              static_cast<long long>(B * N), static_cast<long long>(steps), ms_replay / ms_dfs);
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<float> dq(q), dk(k), dv(v), dg(g), dbeta(beta), dstate(state), dout(out.size());
    DevBuf<int64_t> dpar(parents);
    DevBuf<RowStatus> dstat(B);
    TreeGatedDeltaParams<float> gp = p;
    gp.q = dq.p, gp.k = dk.p, gp.v = dv.p, gp.g = dg.p, gp.beta = dbeta.p, gp.state = dstate.p;
    gp.parents = dpar.p, gp.out = dout.p, gp.status = dstat.p;
    cuda_run_once([&] { cuda::LaunchTreeGatedDelta<float>(gp, nullptr); });
    if (max_abs_diff(dout.get(), out) > 1e-3) {
      std::fprintf(stderr, "tree_gated_delta_rule cuda differs from cpu by %g\n", max_abs_diff(dout.get(), out));
      return false;
    }
    time_cuda(a, "tree_gated_delta_rule", shape, "f32", bytes, formula,
              [&] { cuda::LaunchTreeGatedDelta<float>(gp, nullptr); });
  }
#endif
  return true;
}

bool run_ssd(const Args& a, int64_t B, int64_t H, int64_t N) {
  Rng rng(11 + B + H + N);
  const int64_t P = kD, Ds = kD;
  const std::vector<float> x = randn(rng, B * H * N * P, 1.0f), Bm = randn(rng, B * H * N * Ds, 0.125f);
  const std::vector<float> Cm = randn(rng, B * H * N * Ds, 0.125f), state = randn(rng, B * H * P * Ds, 1.0f);
  std::vector<float> dt = randn(rng, B * H * N, 1.0f), A = randn(rng, H, 1.0f), Dskip = randn(rng, H, 1.0f);
  for (auto& t : dt) t = std::fabs(t);
  for (auto& t : A) t = -std::fabs(t) - 0.1f;
  const std::vector<int64_t> parents = eagle_tree(rng, B, N);
  std::vector<float> out(B * H * N * P);
  std::vector<RowStatus> status(B);
  TreeSelectiveStateParams<float> p{
      .x = x.data(), .x_stride_b = H * N * P, .x_stride_h = N * P, .x_stride_n = P, .dt = dt.data(),
      .dt_stride_b = H * N, .dt_stride_h = N, .dt_stride_n = 1, .A = A.data(), .Bm = Bm.data(),
      .bm_stride_b = H * N * Ds, .bm_stride_h = N * Ds, .bm_stride_n = Ds, .Cm = Cm.data(),
      .cm_stride_b = H * N * Ds, .cm_stride_h = N * Ds, .cm_stride_n = Ds, .D = Dskip.data(),
      .state = state.data(), .state_stride_b = H * P * Ds, .state_stride_h = P * Ds, .state_stride_p = Ds,
      .parents = parents.data(), .batch = B, .num_heads = H, .num_nodes = N, .head_dim = P, .state_dim = Ds,
      .out = out.data(), .status = status.data()};
  cpu::TreeSelectiveState<float>(p, 0, B * H);
  const std::string shape = shape_str({{"B", B}, {"H", H}, {"N", N}, {"P", P}});
  const double bytes = 4.0 * B * H * (P * Ds + N * (P + 2 * Ds + 1));
  const std::string formula = "B*H*(P*Ds+N*(P+2Ds+1))*4";
  print_row("tree_selective_state", shape, "f32", "cpu depth-first",
            host_median_ms([&] { cpu::TreeSelectiveState<float>(p, 0, B * H); }, a.repeats), bytes, formula);
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<float> dx(x), ddt(dt), dA(A), dB(Bm), dC(Cm), dD(Dskip), dstate(state), dout(out.size());
    DevBuf<int64_t> dpar(parents);
    DevBuf<RowStatus> dstat(B);
    TreeSelectiveStateParams<float> gp = p;
    gp.x = dx.p, gp.dt = ddt.p, gp.A = dA.p, gp.Bm = dB.p, gp.Cm = dC.p, gp.D = dD.p, gp.state = dstate.p;
    gp.parents = dpar.p, gp.out = dout.p, gp.status = dstat.p;
    cuda_run_once([&] { cuda::LaunchTreeSelectiveState<float>(gp, nullptr); });
    if (max_abs_diff(dout.get(), out) > 1e-3) {
      std::fprintf(stderr, "tree_selective_state cuda differs from cpu by %g\n", max_abs_diff(dout.get(), out));
      return false;
    }
    time_cuda(a, "tree_selective_state", shape, "f32", bytes, formula,
              [&] { cuda::LaunchTreeSelectiveState<float>(gp, nullptr); });
  }
#endif
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  if (a.smoke) return exit_status(run_delta(a, 1, 2, 8) && run_ssd(a, 1, 2, 8), "bench_recurrent checks");
  bool ok = run_delta(a, 1, 4, 32) && run_ssd(a, 1, 4, 32);
  ok = ok && run_delta(a, 4, 8, 32) && run_ssd(a, 4, 8, 32);
  if (!a.quick) ok = ok && run_delta(a, 1, 8, 64) && run_ssd(a, 1, 8, 64);
  return exit_status(ok, "bench_recurrent checks");
}
