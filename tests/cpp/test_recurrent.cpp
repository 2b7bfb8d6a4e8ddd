// The recurrent tree ops' CPU kernels (recurrent_params.h) against plain double-precision recurrences written here:
// every node's output equals its root-to-node path run step by step from the saved state; commits equal the
// accepted path run step by step; ragged lengths, batch > 1, bf16 inputs, and every status code (invalid rows get
// zero outputs or stay untouched).
#include <cmath>
#include <cstdint>
#include <vector>

#include "check.h"
#include "cpu/kernels.h"
#include "test_util.h"

using namespace specdec;

namespace {

using testutil::Rng;

std::vector<int64_t> random_trees(Rng& rng, int64_t B, int64_t N) {
  std::vector<int64_t> par(B * N);
  for (int64_t b = 0; b < B; ++b) {
    par[b * N] = -1;
    for (int64_t i = 1; i < N; ++i) par[b * N + i] = rng.below(i);
  }
  return par;
}

std::vector<int64_t> path_to(const int64_t* par, int64_t i) {
  std::vector<int64_t> up;
  for (int64_t j = i; j >= 0; j = par[j]) up.push_back(j);
  return std::vector<int64_t>(up.rbegin(), up.rend());
}

struct Linear {
  int64_t B = 2, H = 3, N = 9, Dk = 5, Dv = 6;
  std::vector<float> q, k, v, state, log_decay;
  std::vector<int64_t> parents;
  explicit Linear(uint64_t seed) {
    Rng rng(seed);
    q = rng.vec(B * H * N * Dk);
    k = rng.vec(B * H * N * Dk);
    v = rng.vec(B * H * N * Dv);
    state = rng.vec(B * H * Dk * Dv);
    log_decay = {0.0f, -0.05f, -0.7f};
    parents = random_trees(rng, B, N);
  }
  // S <- a S + k_j^T v_j in double
  void step(std::vector<double>& S, int64_t b, int64_t h, int64_t j) const {
    const double a = std::exp(static_cast<double>(log_decay[h]));
    for (int64_t x = 0; x < Dk; ++x)
      for (int64_t y = 0; y < Dv; ++y)
        S[x * Dv + y] = a * S[x * Dv + y] + static_cast<double>(k[((b * H + h) * N + j) * Dk + x]) *
                                                 v[((b * H + h) * N + j) * Dv + y];
  }
  std::vector<double> saved(int64_t b, int64_t h) const {
    return std::vector<double>(state.begin() + (b * H + h) * Dk * Dv, state.begin() + (b * H + h + 1) * Dk * Dv);
  }
  template <typename T>
  TreeLinearAttentionParams<T> params(const std::vector<T>& qt, const std::vector<T>& kt, const std::vector<T>& vt,
                                      std::vector<T>& out, std::vector<RowStatus>& status) const {
    return {.q = qt.data(), .q_stride_b = H * N * Dk, .q_stride_h = N * Dk, .q_stride_n = Dk,
            .k = kt.data(), .k_stride_b = H * N * Dk, .k_stride_h = N * Dk, .k_stride_n = Dk,
            .v = vt.data(), .v_stride_b = H * N * Dv, .v_stride_h = N * Dv, .v_stride_n = Dv,
            .state = state.data(), .state_stride_b = H * Dk * Dv, .state_stride_h = Dk * Dv, .state_stride_k = Dv,
            .log_decay = log_decay.data(), .parents = parents.data(), .batch = B, .num_heads = H, .num_nodes = N,
            .key_dim = Dk, .value_dim = Dv, .out = out.data(), .status = status.data()};
  }
};

template <typename T>
void check_tree_linear_attention(double tol) {
  Linear c(11);
  const auto qt = testutil::convert<T>(c.q), kt = testutil::convert<T>(c.k), vt = testutil::convert<T>(c.v);
  for (size_t e = 0; e < c.q.size(); ++e) c.q[e] = to_float(qt[e]);  // the recurrence reads the rounded inputs
  for (size_t e = 0; e < c.k.size(); ++e) c.k[e] = to_float(kt[e]);
  for (size_t e = 0; e < c.v.size(); ++e) c.v[e] = to_float(vt[e]);
  std::vector<T> out(c.B * c.H * c.N * c.Dv);
  std::vector<RowStatus> status(c.B, RowStatus{99, 99, 99});
  const auto p = c.params<T>(qt, kt, vt, out, status);
  cpu::TreeLinearAttention<T>(p, 0, c.B * c.H);
  for (int64_t b = 0; b < c.B; ++b) {
    CHECK_EQ(status[b].code, int64_t{kOk});
    for (int64_t h = 0; h < c.H; ++h) {
      for (int64_t i = 0; i < c.N; ++i) {
        std::vector<double> S = c.saved(b, h);
        for (int64_t j : path_to(&c.parents[b * c.N], i)) c.step(S, b, h, j);
        for (int64_t y = 0; y < c.Dv; ++y) {
          double want = 0;
          for (int64_t x = 0; x < c.Dk; ++x) want += c.q[((b * c.H + h) * c.N + i) * c.Dk + x] * S[x * c.Dv + y];
          CHECK_NEAR(to_float(out[((b * c.H + h) * c.N + i) * c.Dv + y]), want, tol * (1 + std::fabs(want)));
        }
      }
    }
  }
}

TEST_CASE("TreeLinearAttention equals the recurrence along every path (float, bf16)") {
  check_tree_linear_attention<float>(1e-5);
  check_tree_linear_attention<bf16>(1e-2);  // (the output rounds to bf16)
}

TEST_CASE("TreeLinearAttention: an invalid tree or decay zeroes the row and reports it") {
  Linear c(12);
  c.parents[1 * c.N + 4] = 6;
  std::vector<float> out(c.B * c.H * c.N * c.Dv, 5.0f);
  std::vector<RowStatus> status(c.B, RowStatus{99, 99, 99});
  cpu::TreeLinearAttention<float>(c.params<float>(c.q, c.k, c.v, out, status), 0, c.B * c.H);
  CHECK_EQ(status[0].code, int64_t{kOk});
  CHECK_EQ(status[1].code, int64_t{kParentNotEarlier});
  CHECK_EQ(status[1].node, int64_t{4});
  CHECK_EQ(status[1].value, int64_t{6});
  for (int64_t e = c.H * c.N * c.Dv; e < 2 * c.H * c.N * c.Dv; ++e) CHECK_EQ(out[e], 0.0f);
  c.parents[1 * c.N + 4] = 0;
  c.log_decay[2] = 0.25f;
  cpu::TreeLinearAttention<float>(c.params<float>(c.q, c.k, c.v, out, status), 0, c.B * c.H);
  CHECK_EQ(status[0].code, int64_t{kBadLogDecay});
  CHECK_EQ(status[0].node, int64_t{2});
  c.log_decay[2] = NAN;
  cpu::TreeLinearAttention<float>(c.params<float>(c.q, c.k, c.v, out, status), 0, c.B * c.H);
  CHECK_EQ(status[1].code, int64_t{kBadLogDecay});
}

TEST_CASE("CommitLinearState equals the recurrence along ragged accepted paths; invalid rows stay untouched") {
  Linear c(13);
  const int64_t L = 4;
  // row 0 accepts the path to node N - 1 (clipped to L), row 1 nothing
  std::vector<int64_t> full = path_to(&c.parents[0], c.N - 1), path(c.B * L, -1);
  const int64_t n0 = std::min<int64_t>(L, static_cast<int64_t>(full.size()));
  for (int64_t t = 0; t < n0; ++t) path[t] = full[t];
  std::vector<int64_t> lengths = {n0, 0};
  std::vector<float> state = c.state;
  std::vector<RowStatus> status(c.B, RowStatus{99, 99, 99});
  auto params = [&] {
    return CommitLinearStateParams<float>{
        .state = state.data(), .state_stride_b = c.H * c.Dk * c.Dv, .state_stride_h = c.Dk * c.Dv,
        .state_stride_k = c.Dv, .k = c.k.data(), .k_stride_b = c.H * c.N * c.Dk, .k_stride_h = c.N * c.Dk,
        .k_stride_n = c.Dk, .v = c.v.data(), .v_stride_b = c.H * c.N * c.Dv, .v_stride_h = c.N * c.Dv,
        .v_stride_n = c.Dv, .log_decay = c.log_decay.data(), .path = path.data(), .lengths = lengths.data(),
        .batch = c.B, .num_heads = c.H, .num_nodes = c.N, .max_len = L, .key_dim = c.Dk, .value_dim = c.Dv,
        .status = status.data()};
  };
  cpu::CommitLinearState<float>(params(), 0, c.B * c.H);
  for (int64_t h = 0; h < c.H; ++h) {
    std::vector<double> S = c.saved(0, h);
    for (int64_t t = 0; t < n0; ++t) c.step(S, 0, h, path[t]);
    for (int64_t e = 0; e < c.Dk * c.Dv; ++e)
      CHECK_NEAR(state[h * c.Dk * c.Dv + e], S[e], 1e-5 * (1 + std::fabs(S[e])));
  }
  for (int64_t e = c.H * c.Dk * c.Dv; e < 2 * c.H * c.Dk * c.Dv; ++e) CHECK_EQ(state[e], c.state[e]);
  CHECK_EQ(status[0].code, int64_t{kOk});
  CHECK_EQ(status[1].code, int64_t{kOk});
  // a bad length, then a bad path node: reported, the row untouched
  const std::vector<float> before = state;
  lengths = {L + 1, 1};
  path[L] = c.N;
  cpu::CommitLinearState<float>(params(), 0, c.B * c.H);
  CHECK_EQ(status[0].code, int64_t{kBadLength});
  CHECK_EQ(status[0].value, L + 1);
  CHECK_EQ(status[1].code, int64_t{kBadPathNode});
  CHECK_EQ(status[1].node, int64_t{0});
  CHECK_EQ(status[1].value, c.N);
  CHECK_VEC(state, before);
}

struct Conv {
  int64_t B = 2, C = 70, N = 8, K = 4;  // C > kConvChannelBlock: two channel blocks
  std::vector<float> x, conv, weight, bias;
  std::vector<int64_t> parents;
  explicit Conv(uint64_t seed) {
    Rng rng(seed);
    x = rng.vec(B * C * N);
    conv = rng.vec(B * C * (K - 1));
    weight = rng.vec(C * K);
    bias = rng.vec(C);
    parents = random_trees(rng, B, N);
  }
  // the window of node i, oldest first, in double
  std::vector<double> window(int64_t b, int64_t c, int64_t i) const {
    std::vector<double> seq(conv.begin() + (b * C + c) * (K - 1), conv.begin() + (b * C + c + 1) * (K - 1));
    for (int64_t j : path_to(&parents[b * N], i)) seq.push_back(x[(b * C + c) * N + j]);
    return std::vector<double>(seq.end() - K, seq.end());
  }
};

TEST_CASE("TreeCausalConv1d equals the window sums along every path, with and without bias and silu") {
  const Conv c(21);
  for (bool silu : {false, true}) {
    std::vector<float> out(c.B * c.C * c.N);
    std::vector<RowStatus> status(c.B, RowStatus{99, 99, 99});
    TreeCausalConv1dParams<float> p{.x = c.x.data(), .x_stride_b = c.C * c.N, .x_stride_c = c.N, .x_stride_n = 1,
                                    .conv_state = c.conv.data(), .conv_stride_b = c.C * (c.K - 1),
                                    .conv_stride_c = c.K - 1, .conv_stride_w = 1, .weight = c.weight.data(),
                                    .bias = silu ? c.bias.data() : nullptr, .parents = c.parents.data(),
                                    .batch = c.B, .channels = c.C, .num_nodes = c.N, .width = c.K, .silu = silu,
                                    .out = out.data(), .status = status.data()};
    cpu::TreeCausalConv1d<float>(p, 0, c.B * conv_channel_blocks(c.C));
    for (int64_t b = 0; b < c.B; ++b) {
      CHECK_EQ(status[b].code, int64_t{kOk});
      for (int64_t ch = 0; ch < c.C; ++ch) {
        for (int64_t i = 0; i < c.N; ++i) {
          const std::vector<double> w = c.window(b, ch, i);
          double want = silu ? c.bias[ch] : 0.0;
          for (int64_t t = 0; t < c.K; ++t) want += c.weight[ch * c.K + t] * w[t];
          if (silu) want = want / (1 + std::exp(-want));
          CHECK_NEAR(out[(b * c.C + ch) * c.N + i], want, 1e-5);
        }
      }
    }
  }
}

TEST_CASE("CommitConvState shifts the window along ragged paths; invalid rows stay untouched") {
  const Conv c(22);
  const int64_t L = 5, W = c.K - 1;
  std::vector<int64_t> full = path_to(&c.parents[c.N], c.N - 1), path(c.B * L, -1);
  const int64_t n1 = std::min<int64_t>(L, static_cast<int64_t>(full.size()));
  for (int64_t t = 0; t < n1; ++t) path[L + t] = full[t];
  path[0] = 0;
  for (int64_t n0 : {int64_t{0}, int64_t{1}}) {
    std::vector<int64_t> lengths = {n0, n1};
    std::vector<float> conv = c.conv;
    std::vector<RowStatus> status(c.B, RowStatus{99, 99, 99});
    CommitConvStateParams<float> p{.conv_state = conv.data(), .conv_stride_b = c.C * W, .conv_stride_c = W,
                                   .conv_stride_w = 1, .x = c.x.data(), .x_stride_b = c.C * c.N, .x_stride_c = c.N,
                                   .x_stride_n = 1, .path = path.data(), .lengths = lengths.data(), .batch = c.B,
                                   .channels = c.C, .num_nodes = c.N, .max_len = L, .window = W,
                                   .status = status.data()};
    cpu::CommitConvState<float>(p, 0, c.B * conv_channel_blocks(c.C));
    for (int64_t b = 0; b < c.B; ++b) {
      CHECK_EQ(status[b].code, int64_t{kOk});
      for (int64_t ch = 0; ch < c.C; ++ch) {
        std::vector<float> seq(c.conv.begin() + (b * c.C + ch) * W, c.conv.begin() + (b * c.C + ch + 1) * W);
        for (int64_t t = 0; t < lengths[b]; ++t) seq.push_back(c.x[(b * c.C + ch) * c.N + path[b * L + t]]);
        for (int64_t w = 0; w < W; ++w) CHECK_EQ(conv[(b * c.C + ch) * W + w], seq[seq.size() - W + w]);
      }
    }
    lengths = {-1, n1};
    path[L] = -5;
    const std::vector<float> before = conv;
    cpu::CommitConvState<float>(p, 0, c.B * conv_channel_blocks(c.C));
    CHECK_EQ(status[0].code, int64_t{kBadLength});
    CHECK_EQ(status[1].code, int64_t{kBadPathNode});
    CHECK_EQ(status[1].value, int64_t{-5});
    CHECK_VEC(conv, before);
    path[L] = full[0];
  }
}

// Gated delta rule and Mamba-2: per path in double, against the tree kernels (depth-first with a slot per depth) and
// the commits.
struct Delta {
  int64_t B = 2, H = 2, N = 10, Dk = 6, Dv = 5;
  std::vector<float> q, k, v, g, beta, state;
  std::vector<int64_t> parents;
  explicit Delta(uint64_t seed) {
    Rng rng(seed);
    q = rng.vec(B * H * N * Dk);
    k = rng.vec(B * H * N * Dk);
    v = rng.vec(B * H * N * Dv);
    g = rng.vec(B * H * N);
    beta = rng.vec(B * H * N);
    for (auto& x : g) x = -0.25f * std::fabs(x);
    for (auto& x : beta) x = 0.5f * std::fabs(x);  // (in [0, 1), as a sigmoid's)
    state = rng.vec(B * H * Dk * Dv);
    parents = random_trees(rng, B, N);
  }
  void step(std::vector<double>& S, int64_t b, int64_t h, int64_t j) const {
    const int64_t n = (b * H + h) * N + j;
    const double decay = std::exp(static_cast<double>(g[n]));
    for (int64_t y = 0; y < Dv; ++y) {
      double u = 0;
      for (int64_t x = 0; x < Dk; ++x) u += decay * S[x * Dv + y] * k[n * Dk + x];
      const double delta = beta[n] * (v[n * Dv + y] - u);
      for (int64_t x = 0; x < Dk; ++x) S[x * Dv + y] = decay * S[x * Dv + y] + k[n * Dk + x] * delta;
    }
  }
};

TEST_CASE("TreeGatedDelta and CommitGatedDelta equal the delta rule along every path") {
  const Delta c(31);
  std::vector<float> out(c.B * c.H * c.N * c.Dv);
  std::vector<RowStatus> status(c.B, RowStatus{99, 99, 99});
  const int64_t sN = 1, sH = c.N, sB = c.H * c.N;  // gates [B, H, N]
  TreeGatedDeltaParams<float> p{
      .q = c.q.data(), .q_stride_b = c.H * c.N * c.Dk, .q_stride_h = c.N * c.Dk, .q_stride_n = c.Dk,
      .k = c.k.data(), .k_stride_b = c.H * c.N * c.Dk, .k_stride_h = c.N * c.Dk, .k_stride_n = c.Dk,
      .v = c.v.data(), .v_stride_b = c.H * c.N * c.Dv, .v_stride_h = c.N * c.Dv, .v_stride_n = c.Dv,
      .g = c.g.data(), .beta = c.beta.data(), .gate_stride_b = sB, .gate_stride_h = sH, .gate_stride_n = sN,
      .beta_stride_b = sB, .beta_stride_h = sH, .beta_stride_n = sN, .state = c.state.data(),
      .state_stride_b = c.H * c.Dk * c.Dv, .state_stride_h = c.Dk * c.Dv, .state_stride_k = c.Dv,
      .parents = c.parents.data(), .batch = c.B, .num_heads = c.H, .num_nodes = c.N, .key_dim = c.Dk,
      .value_dim = c.Dv, .out = out.data(), .status = status.data()};
  cpu::TreeGatedDelta<float>(p, 0, c.B * c.H);
  for (int64_t b = 0; b < c.B; ++b) {
    CHECK_EQ(status[b].code, int64_t{kOk});
    for (int64_t h = 0; h < c.H; ++h) {
      for (int64_t i = 0; i < c.N; ++i) {
        std::vector<double> S(c.state.begin() + (b * c.H + h) * c.Dk * c.Dv,
                              c.state.begin() + (b * c.H + h + 1) * c.Dk * c.Dv);
        for (int64_t j : path_to(&c.parents[b * c.N], i)) c.step(S, b, h, j);
        const int64_t n = (b * c.H + h) * c.N + i;
        for (int64_t y = 0; y < c.Dv; ++y) {
          double want = 0;
          for (int64_t x = 0; x < c.Dk; ++x) want += S[x * c.Dv + y] * c.q[n * c.Dk + x];
          CHECK_NEAR(out[n * c.Dv + y], want, 1e-5 * (1 + std::fabs(want)));
        }
      }
    }
  }
  // commit row 0 along the path to its last node (L = N), row 1 nothing; then a bad path node in row 1
  std::vector<int64_t> full = path_to(&c.parents[0], c.N - 1), path(c.B * c.N, -1);
  for (size_t t = 0; t < full.size(); ++t) path[t] = full[t];
  std::vector<int64_t> lengths = {static_cast<int64_t>(full.size()), 0};
  std::vector<float> state = c.state;
  CommitGatedDeltaParams<float> cp{
      .state = state.data(), .state_stride_b = c.H * c.Dk * c.Dv, .state_stride_h = c.Dk * c.Dv,
      .state_stride_k = c.Dv, .k = c.k.data(), .k_stride_b = c.H * c.N * c.Dk, .k_stride_h = c.N * c.Dk,
      .k_stride_n = c.Dk, .v = c.v.data(), .v_stride_b = c.H * c.N * c.Dv, .v_stride_h = c.N * c.Dv,
      .v_stride_n = c.Dv, .g = c.g.data(), .beta = c.beta.data(), .gate_stride_b = sB, .gate_stride_h = sH,
      .gate_stride_n = sN, .beta_stride_b = sB, .beta_stride_h = sH, .beta_stride_n = sN, .path = path.data(),
      .lengths = lengths.data(), .batch = c.B, .num_heads = c.H, .num_nodes = c.N, .max_len = c.N,
      .key_dim = c.Dk, .value_dim = c.Dv, .status = status.data()};
  cpu::CommitGatedDelta<float>(cp, 0, c.B * c.H);
  for (int64_t h = 0; h < c.H; ++h) {
    std::vector<double> S(c.state.begin() + h * c.Dk * c.Dv, c.state.begin() + (h + 1) * c.Dk * c.Dv);
    for (int64_t j : full) c.step(S, 0, h, j);
    for (int64_t e = 0; e < c.Dk * c.Dv; ++e)
      CHECK_NEAR(state[h * c.Dk * c.Dv + e], S[e], 1e-5 * (1 + std::fabs(S[e])));
  }
  for (int64_t e = c.H * c.Dk * c.Dv; e < 2 * c.H * c.Dk * c.Dv; ++e) CHECK_EQ(state[e], c.state[e]);
  lengths = {0, 1};
  path[c.N] = -1;
  const std::vector<float> before = state;
  cpu::CommitGatedDelta<float>(cp, 0, c.B * c.H);
  CHECK_EQ(status[1].code, int64_t{kBadPathNode});
  CHECK_VEC(state, before);
}

TEST_CASE("TreeSelectiveState and CommitSelectiveState equal the Mamba-2 recurrence along every path") {
  const int64_t B = 2, H = 3, N = 9, P = 4, Ds = 5;
  Rng rng(41);
  const std::vector<float> x = rng.vec(B * H * N * P), Bm = rng.vec(B * H * N * Ds), Cm = rng.vec(B * H * N * Ds);
  std::vector<float> dt = rng.vec(B * H * N), A = {-0.5f, -1.0f, -0.1f}, D = {0.5f, -1.0f, 2.0f};
  for (auto& t : dt) t = 0.5f * std::fabs(t);
  const std::vector<float> state = rng.vec(B * H * P * Ds);
  std::vector<int64_t> parents = random_trees(rng, B, N);
  parents[1 * N + 3] = 3;  // row 1 invalid: zero outputs, status
  auto run_path = [&](int64_t b, int64_t h, const std::vector<int64_t>& nodes) {
    std::vector<double> S(state.begin() + (b * H + h) * P * Ds, state.begin() + (b * H + h + 1) * P * Ds);
    for (int64_t j : nodes) {
      const int64_t n = (b * H + h) * N + j;
      const double decay = std::exp(static_cast<double>(dt[n]) * A[h]);
      for (int64_t r = 0; r < P; ++r)
        for (int64_t s = 0; s < Ds; ++s)
          S[r * Ds + s] = decay * S[r * Ds + s] + static_cast<double>(dt[n]) * x[n * P + r] * Bm[n * Ds + s];
    }
    return S;
  };
  std::vector<float> out(B * H * N * P, 7.0f);
  std::vector<RowStatus> status(B, RowStatus{99, 99, 99});
  TreeSelectiveStateParams<float> p{
      .x = x.data(), .x_stride_b = H * N * P, .x_stride_h = N * P, .x_stride_n = P, .dt = dt.data(),
      .dt_stride_b = H * N, .dt_stride_h = N, .dt_stride_n = 1, .A = A.data(), .Bm = Bm.data(),
      .bm_stride_b = H * N * Ds, .bm_stride_h = N * Ds, .bm_stride_n = Ds, .Cm = Cm.data(),
      .cm_stride_b = H * N * Ds, .cm_stride_h = N * Ds, .cm_stride_n = Ds, .D = D.data(), .state = state.data(),
      .state_stride_b = H * P * Ds, .state_stride_h = P * Ds, .state_stride_p = Ds, .parents = parents.data(),
      .batch = B, .num_heads = H, .num_nodes = N, .head_dim = P, .state_dim = Ds, .out = out.data(),
      .status = status.data()};
  cpu::TreeSelectiveState<float>(p, 0, B * H);
  CHECK_EQ(status[0].code, int64_t{kOk});
  CHECK_EQ(status[1].code, int64_t{kParentNotEarlier});
  CHECK_EQ(status[1].node, int64_t{3});
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < N; ++i) {
      const std::vector<double> S = run_path(0, h, path_to(&parents[0], i));
      const int64_t n = h * N + i;
      for (int64_t r = 0; r < P; ++r) {
        double want = D[h] * x[n * P + r];
        for (int64_t s = 0; s < Ds; ++s) want += S[r * Ds + s] * Cm[n * Ds + s];
        CHECK_NEAR(out[n * P + r], want, 1e-5 * (1 + std::fabs(want)));
      }
    }
  }
  for (int64_t e = H * N * P; e < 2 * H * N * P; ++e) CHECK_EQ(out[e], 0.0f);
  const std::vector<int64_t> full = path_to(&parents[0], N - 1);
  std::vector<int64_t> path(B * N, -1), lengths = {static_cast<int64_t>(full.size()), 2};
  for (size_t t = 0; t < full.size(); ++t) path[t] = full[t];
  path[N] = 0;
  path[N + 1] = 2;
  std::vector<float> committed = state;
  CommitSelectiveStateParams<float> cp{
      .state = committed.data(), .state_stride_b = H * P * Ds, .state_stride_h = P * Ds, .state_stride_p = Ds,
      .x = x.data(), .x_stride_b = H * N * P, .x_stride_h = N * P, .x_stride_n = P, .dt = dt.data(),
      .dt_stride_b = H * N, .dt_stride_h = N, .dt_stride_n = 1, .A = A.data(), .Bm = Bm.data(),
      .bm_stride_b = H * N * Ds, .bm_stride_h = N * Ds, .bm_stride_n = Ds, .path = path.data(),
      .lengths = lengths.data(), .batch = B, .num_heads = H, .num_nodes = N, .max_len = N, .head_dim = P,
      .state_dim = Ds, .status = status.data()};
  cpu::CommitSelectiveState<float>(cp, 0, B * H);
  for (int64_t b = 0; b < B; ++b) {
    CHECK_EQ(status[b].code, int64_t{kOk});
    for (int64_t h = 0; h < H; ++h) {
      const std::vector<int64_t> nodes(path.begin() + b * N, path.begin() + b * N + lengths[b]);
      const std::vector<double> S = run_path(b, h, nodes);
      for (int64_t e = 0; e < P * Ds; ++e)
        CHECK_NEAR(committed[(b * H + h) * P * Ds + e], S[e], 1e-5 * (1 + std::fabs(S[e])));
    }
  }
}

}  // namespace

SPECDEC_TEST_MAIN
