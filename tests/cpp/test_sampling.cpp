// sample_tokens and expand_tree_step on hand-made logits; expected values worked out by hand or in double.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "check.h"
#include "test_util.h"

using namespace specdec;
using namespace testutil;
using V64 = std::vector<int64_t>;
using VF = std::vector<float>;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

VF logp(std::initializer_list<double> probs) {
  VF out;
  for (double p : probs) out.push_back(static_cast<float>(std::log(p)));
  return out;
}

struct SampleRun {
  int64_t R, V, stride;
  VF logits;
  VF uniforms, temperature, top_p;
  V64 top_k;
  V64 tokens;
  VF probs;
  std::vector<RowStatus> status;

  template <typename T = float>
  void run() {
    tokens.assign(R, 7777);
    probs.assign(R * V, 1234.0f);
    status.assign(R, RowStatus{99, 99, 99});
    const auto data = convert<T>(logits);
    SampleTokensParams<T> p{.logits = data.data(), .logits_stride_r = stride, .uniforms = uniforms.data(),
                            .sampling = {.temperature = temperature.data(), .top_k = top_k.data(),
                                         .top_p = top_p.data()},
                            .rows = R, .vocab = V, .tokens = tokens.data(), .probs = probs.data(),
                            .status = status.data()};
    cpu::SampleTokens(p, 0, R);
  }
  VF row(int64_t r) const { return VF(probs.begin() + r * V, probs.begin() + (r + 1) * V); }
};

// R rows, all holding `row` (stride V + 1, the pad holds 50.0, which would win if read).
SampleRun make(int64_t R, const VF& row) {
  const int64_t V = static_cast<int64_t>(row.size());
  SampleRun s{R, V, V + 1, {}, VF(R, 0.5f), VF(R, 1.0f), VF(R, 1.0f), V64(R, 0), {}, {}, {}};
  for (int64_t r = 0; r < R; ++r) {
    s.logits.insert(s.logits.end(), row.begin(), row.end());
    s.logits.push_back(50.0f);
  }
  return s;
}

void expect_probs(const VF& got, const std::vector<double>& want, double tol = 2e-6) {
  CHECK_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) CHECK_NEAR(got[i], want[i], tol);
}

}  // namespace

TEST_CASE("sample_tokens: top_k = 1 is the argmax with one-hot probs") {
  const VF row = {0.5f, -1.0f, 2.75f, 2.5f, -3.0f, 1.0f};
  auto s = make(3, row);
  s.top_k = {1, 1, 1};
  s.uniforms = {0.0f, 0.5f, 0.999f};
  s.temperature = {1.0f, 0.3f, 2.0f};
  s.run();
  for (int r = 0; r < 3; ++r) {
    CHECK_EQ(s.status[r].code, int64_t{kOk});
    CHECK_EQ(s.tokens[r], 2);
    expect_probs(s.row(r), {0, 0, 1, 0, 0, 0}, 0.0);
  }
  s.run<bf16>();
  CHECK_EQ(s.tokens[1], 2);
  s.run<f16>();
  CHECK_EQ(s.tokens[2], 2);
}

TEST_CASE("sample_tokens: temperature 0 is greedy (first argmax)") {
  auto s = make(2, {1.0f, 3.0f, 3.0f, 0.0f});
  s.temperature = {0.0f, 0.0f};
  s.uniforms = {0.1f, 0.9f};
  s.run();
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(s.tokens[r], 1);
    expect_probs(s.row(r), {0, 1, 0, 0}, 0.0);
  }
}

TEST_CASE("sample_tokens: ties at the top-k threshold are kept") {
  auto s = make(2, {1.0f, 3.0f, 3.0f, 0.0f});
  s.top_k = {1, 1};
  s.uniforms = {0.3f, 0.7f};
  s.run();
  CHECK_EQ(s.tokens[0], 1);
  CHECK_EQ(s.tokens[1], 2);
  expect_probs(s.row(0), {0, 0.5, 0.5, 0});
}

TEST_CASE("sample_tokens: inverse CDF with hand-computed filters") {
  // p = [.1 .2 .3 .4].
  auto s = make(8, logp({.1, .2, .3, .4}));
  s.uniforms = {0.5f, 0.05f, 0.5f, 0.2f, 0.9f, 0.5f, 0.4f, 0.5f};
  s.top_p = {1.0f, 1.0f, 0.5f, 0.5f, 1.0f, 1.0f, 1.0f, 0.3f};
  s.top_k = {0, 4, 0, 0, 2, 0, 0, 0};
  s.temperature = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.5f, 0.5f, 1.0f};
  s.run();
  // r0: no filter: cum .1 .3 .6 > .5 -> 2.       r1: top_k = V is no filter; .05 -> 0.
  // r2: top_p .5: descending .4, .7 >= .5 -> keep {3, 2}: [0 0 3/7 4/7]; .5 -> 3.   r3: .2 -> 2.
  // r4: top_k 2 keeps {2, 3}; .9 -> 3.
  // r5: T = .5: p^2 = [1 4 9 16]/30; .5 -> 15: cum 1 5 14 30 -> 3.   r6: .4 -> 12 -> 2.
  // r7: top_p .3: .4 >= .3 at the first position -> only token 3.
  CHECK_VEC(s.tokens, (V64{2, 0, 3, 2, 3, 3, 2, 3}));
  for (int r = 0; r < 8; ++r) CHECK_EQ(s.status[r].code, int64_t{kOk});
  expect_probs(s.row(0), {.1, .2, .3, .4});
  expect_probs(s.row(1), {.1, .2, .3, .4});
  expect_probs(s.row(2), {0, 0, 3.0 / 7, 4.0 / 7});
  expect_probs(s.row(4), {0, 0, 3.0 / 7, 4.0 / 7});
  expect_probs(s.row(5), {1.0 / 30, 4.0 / 30, 9.0 / 30, 16.0 / 30});
  expect_probs(s.row(7), {0, 0, 0, 1});
}

TEST_CASE("sample_tokens: -inf logits get zero probability; a u near 1 picks the last kept token") {
  auto s = make(2, {-kInf, 0.0f, -kInf, 0.0f, -kInf});
  s.uniforms = {0.25f, 0.9999999f};
  s.run();
  CHECK_EQ(s.tokens[0], 1);
  CHECK_EQ(s.tokens[1], 3);
  expect_probs(s.row(0), {0, 0.5, 0, 0.5, 0}, 0.0);
}

TEST_CASE("sample_tokens: invalid rows give status, token -1 and zero probs") {
  auto s = make(7, logp({.1, .2, .3, .4}));
  s.temperature[0] = -1.0f;
  s.top_p[0] = 0.0f;  // temperature is reported first
  s.temperature[1] = kNaN;
  s.top_p[2] = 0.0f;
  s.top_p[3] = kNaN;
  s.logits[4 * 5 + 2] = kNaN;
  s.logits[5 * 5 + 1] = kInf;
  for (int t = 0; t < 4; ++t) s.logits[6 * 5 + t] = -kInf;
  s.run();
  const V64 codes = {kBadTemperature, kBadTemperature, kBadTopP, kBadTopP, kNonFiniteLogits, kNonFiniteLogits,
                     kNoValidToken};
  const V64 values = {0, 0, 0, 0, 2, 1, -1};
  for (int r = 0; r < 7; ++r) {
    CHECK_EQ(s.status[r].code, codes[r]);
    CHECK_EQ(s.status[r].value, values[r]);
    CHECK_EQ(s.tokens[r], -1);
    expect_probs(s.row(r), {0, 0, 0, 0}, 0.0);
  }
  // reference.py reports logits errors of sample_tokens with node -1 (a 2-D matrix) and parameter errors with 0.
  CHECK_EQ(s.status[0].node, 0);
  CHECK_EQ(s.status[4].node, -1);
  CHECK_EQ(s.status[6].node, -1);
}

// ---------------------------------------------------------------------------------------------------------------

namespace {

struct ExpandRun {
  int64_t B, F, V, K, S;
  VF logits, parent_scores;
  V64 cand_tokens, selected;
  VF cand_scores;
  std::vector<RowStatus> status;
  void run() {
    cand_tokens.assign(B * F * K, 7777);
    cand_scores.assign(B * F * K, 1234.0f);
    selected.assign(B * S, 7777);
    status.assign(B, RowStatus{99, 99, 99});
    ExpandTreeStepParams<float> p{.logits = logits.data(), .logits_stride_b = F * V, .logits_stride_f = V,
                                  .parent_scores = parent_scores.data(), .batch = B, .frontier = F, .vocab = V,
                                  .top_k = K, .num_select = S, .cand_tokens = cand_tokens.data(),
                                  .cand_scores = cand_scores.data(), .selected = selected.data(),
                                  .status = status.data()};
    cpu::ExpandTreeStep(p, 0, B);
  }
};

double lse(const VF& row) {
  double s = 0;
  for (float x : row) s += std::exp(static_cast<double>(x));
  return std::log(s);
}

}  // namespace

TEST_CASE("expand_tree_step: hand-made frontier") {
  // f0 = [0 2 1 1 0]: top-2 tokens 1, 2 (2 and 3 tie: lower id). f1 = [3 0 0 0 0]: top-2 tokens 0, 1.
  const VF f0 = {0, 2, 1, 1, 0}, f1 = {3, 0, 0, 0, 0};
  ExpandRun e{1, 2, 5, 2, 3, {}, {-0.5f, -1.0f}, {}, {}, {}, {}};
  e.logits = f0;
  e.logits.insert(e.logits.end(), f1.begin(), f1.end());
  e.run();
  CHECK_EQ(e.status[0].code, int64_t{kOk});
  CHECK_VEC(e.cand_tokens, (V64{1, 2, 0, 1}));
  const double s00 = -0.5 + 2 - lse(f0), s01 = -0.5 + 1 - lse(f0), s10 = -1.0 + 3 - lse(f1), s11 = -1.0 - lse(f1);
  CHECK_NEAR(e.cand_scores[0], s00, 1e-5);
  CHECK_NEAR(e.cand_scores[1], s01, 1e-5);
  CHECK_NEAR(e.cand_scores[2], s10, 1e-5);
  CHECK_NEAR(e.cand_scores[3], s11, 1e-5);
  // s10 = -1.18165 > s00 = -1.19634 > s01 = -2.19634 > s11.
  CHECK_VEC(e.selected, (V64{2, 0, 1}));
}

TEST_CASE("expand_tree_step: ties between candidates go to the lower flat index") {
  const VF row = {0, 1, 2, 3};
  ExpandRun e{2, 2, 4, 2, 3, {}, {0.0f, 0.0f, -0.5f, 0.0f}, {}, {}, {}, {}};
  for (int i = 0; i < 4; ++i) e.logits.insert(e.logits.end(), row.begin(), row.end());
  e.run();
  CHECK_VEC(e.cand_tokens, (V64{3, 2, 3, 2, 3, 2, 3, 2}));
  // Row 0: identical frontier nodes: flat 0 ties 2, 1 ties 3 -> 0, 2, 1. Row 1: f0 is .5 lower (lp(2) = lp(3) - 1) -> 2 (lp3),
  // 0 (lp3 - .5), 3 (lp3 - 1).
  CHECK_VEC(e.selected, (V64{0, 2, 1, 2, 0, 3}));
  CHECK_EQ(e.cand_scores[0], e.cand_scores[2]);
}

TEST_CASE("expand_tree_step: invalid logits give sentinels for the whole row") {
  ExpandRun e{2, 2, 4, 2, 2, {}, {0.0f, 0.0f, 0.0f, 0.0f}, {}, {}, {}, {}};
  e.logits = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, kNaN, 2, 3};
  e.run();
  CHECK_EQ(e.status[0].code, int64_t{kOk});
  CHECK_EQ(e.status[1].code, int64_t{kNonFiniteLogits});
  CHECK_EQ(e.status[1].node, 1);
  CHECK_EQ(e.status[1].value, 1);
  CHECK_VEC(V64(e.cand_tokens.begin() + 4, e.cand_tokens.end()), V64(4, -1));
  for (int i = 4; i < 8; ++i) CHECK(std::isinf(e.cand_scores[i]) && e.cand_scores[i] < 0);
  CHECK_VEC(V64(e.selected.begin() + 2, e.selected.end()), V64(2, -1));
  CHECK_VEC(V64(e.selected.begin(), e.selected.begin() + 2), (V64{0, 2}));
}

SPECDEC_TEST_MAIN
