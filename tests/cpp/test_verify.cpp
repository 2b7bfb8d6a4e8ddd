// verify_tree_greedy / _sampling / _typical on hand-made logits; expected results worked out by hand (comments).
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

// ---------------------------------------------------------------------------------------------------------------
// Greedy data: the tree 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}, 3 -> {6}; V = 6. Each logits row holds small distinct
// values (t * 0.25 - 1) with one planted maximum 4.0; rows are padded (stride_n = V + 2, stride_b adds 3) with
// 100.0, which would win any argmax that read past the row.
constexpr int64_t kB = 5, kN = 7, kV = 6, kSN = kV + 2, kSB = kN * kSN + 3;
const V64 kParents = {-1, 0, 0, 1, 1, 2, 3};

struct GreedyCase {
  VF logits = VF(kB * kSB, 100.0f);
  V64 parents, tokens;
  GreedyCase() {
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t n = 0; n < kN; ++n)
        for (int64_t t = 0; t < kV; ++t) at(b, n, t) = t * 0.25f - 1.0f;
    for (int64_t b = 0; b < kB; ++b) parents.insert(parents.end(), kParents.begin(), kParents.end());
    tokens = {0, 3, 2, 5, 1, 4, 0,   // b0: argmax 2 -> node 2, argmax 4 -> node 5 (leaf), tie 1/2 -> next 1
              0, 3, 2, 5, 1, 4, 0,   // b1: argmax 3 -> node 1, argmax 0 -> no child -> next 0
              0, 3, 2, 5, 1, 4, 0,   // b2: argmax 5 -> rejected at the root -> next 5
              0, 3, 2, 5, 1, 4, 0,   // b3: 3 -> node 1, 5 -> node 3, 0 -> node 6 (leaf), next 4
              0, 2, 2, 5, 1, 4, 0};  // b4: siblings 1, 2 share token 2: the first (node 1) wins; 1 -> node 4; next 3
    plant(0, 0, 2);
    plant(0, 2, 4);
    plant(0, 5, 1);
    plant(0, 5, 2);  // tie: first maximum (1) wins
    for (int64_t t = 0; t < kV; ++t) at(0, 3, t) = kNaN;  // never read: must not be checked
    plant(1, 0, 3);
    plant(1, 1, 0);
    plant(2, 0, 5);
    plant(3, 0, 3);
    plant(3, 1, 5);
    plant(3, 3, 0);
    plant(3, 6, 4);
    plant(4, 0, 2);
    plant(4, 1, 1);
    plant(4, 4, 3);
  }
  float& at(int64_t b, int64_t n, int64_t t) { return logits[b * kSB + n * kSN + t]; }
  void plant(int64_t b, int64_t n, int64_t t) { at(b, n, t) = 4.0f; }
};

const std::vector<V64> kGreedyPaths = {{0, 2, 5}, {0, 1}, {0}, {0, 1, 3, 6}, {0, 1, 4}};
const V64 kGreedyNext = {1, 0, 5, 4, 3};

void expect_greedy(const VerifyResult& r, int64_t rows = kB) {
  for (int64_t b = 0; b < rows; ++b) {
    CHECK_EQ(r.status[b].code, int64_t{kOk});
    CHECK_VEC(r.path(b, kN), pad(kGreedyPaths[b], kN));
    CHECK_EQ(r.accept_len[b], static_cast<int64_t>(kGreedyPaths[b].size()) - 1);
    CHECK_EQ(r.next_token[b], kGreedyNext[b]);
  }
}

template <typename T>
VerifyResult run_greedy(const VF& logits, const V64& tokens, const V64& parents, int64_t B = kB) {
  const auto data = convert<T>(logits);
  VerifyResult r(B, kN);
  VerifyTreeGreedyParams<T> p{.logits = data.data(), .logits_stride_b = kSB, .logits_stride_n = kSN,
                              .tokens = tokens.data(), .parents = parents.data(), .batch = B, .num_nodes = kN,
                              .vocab = kV, .out = r.outputs()};
  cpu::VerifyTreeGreedy(p, 0, B);
  return r;
}

void expect_invalid(const VerifyResult& r, int64_t b, int64_t code, int64_t node, int64_t value) {
  CHECK_EQ(r.status[b].code, code);
  CHECK_EQ(r.status[b].node, node);
  CHECK_EQ(r.status[b].value, value);
  CHECK_VEC(r.path(b, kN), V64(kN, -1));
  CHECK_EQ(r.accept_len[b], 0);
  CHECK_EQ(r.next_token[b], -1);
}

}  // namespace

TEST_CASE("verify_tree_greedy: hand-made logits, float / f16 / bf16, strided rows") {
  GreedyCase c;
  expect_greedy(run_greedy<float>(c.logits, c.tokens, c.parents));
  // NaN cannot go through the exact converters' callers unchanged for b0 row 3 (it stays NaN): fine.
  expect_greedy(run_greedy<f16>(c.logits, c.tokens, c.parents));
  expect_greedy(run_greedy<bf16>(c.logits, c.tokens, c.parents));
}

TEST_CASE("verify_tree_greedy: row range") {
  GreedyCase c;
  const auto data = c.logits;
  VerifyResult r(kB, kN);
  VerifyTreeGreedyParams<float> p{.logits = data.data(), .logits_stride_b = kSB, .logits_stride_n = kSN,
                                  .tokens = c.tokens.data(), .parents = c.parents.data(), .batch = kB, .num_nodes = kN,
                                  .vocab = kV, .out = r.outputs()};
  cpu::VerifyTreeGreedy(p, 2, 4);
  CHECK_EQ(r.accept_len[0], 7777);
  CHECK_EQ(r.accept_len[4], 7777);
  CHECK_EQ(r.status[1].code, 99);
  for (int64_t b = 2; b < 4; ++b) {
    CHECK_VEC(r.path(b, kN), pad(kGreedyPaths[b], kN));
    CHECK_EQ(r.next_token[b], kGreedyNext[b]);
  }
}

TEST_CASE("verify_tree_greedy: invalid trees, tokens and logits") {
  GreedyCase c;
  c.parents[1 * kN + 3] = 3;            // b1: node 3 parent itself
  c.tokens[1 * kN + 2] = kV;            //     and a bad token: the tree is reported first
  c.tokens[2 * kN + 4] = kV;            // b2: token out of range at node 4 (never visited: still reported)
  c.tokens[2 * kN + 6] = -3;            //     and node 6: node 4 comes first
  c.at(3, 1, 2) = kInf;                 // b3: +inf in row 1 (visited) at index 2
  c.at(3, 1, 4) = kNaN;                 //     and NaN later: the first index is reported
  for (int64_t t = 0; t < kV; ++t) c.at(4, 0, t) = -kInf;  // b4: all -inf at the root
  auto r = run_greedy<float>(c.logits, c.tokens, c.parents);
  CHECK_EQ(r.status[0].code, int64_t{kOk});
  CHECK_VEC(r.path(0, kN), pad(kGreedyPaths[0], kN));
  expect_invalid(r, 1, kParentNotEarlier, 3, 3);
  expect_invalid(r, 2, kTokenOutOfRange, 4, kV);
  expect_invalid(r, 3, kNonFiniteLogits, 1, 2);
  expect_invalid(r, 4, kNoValidToken, 0, -1);

  GreedyCase d;
  d.parents[0] = 0;  // b0 root
  d.at(1, 0, 0) = kNaN;  // b1: NaN at index 0 of the root row
  auto s = run_greedy<bf16>(d.logits, d.tokens, d.parents);
  expect_invalid(s, 0, kRootNotMinusOne, 0, 0);
  expect_invalid(s, 1, kNonFiniteLogits, 0, 0);
  CHECK_EQ(s.status[2].code, int64_t{kOk});
}

// ---------------------------------------------------------------------------------------------------------------
// Sampling verification.

namespace {

struct SamplingRun {
  int64_t B, N, V;
  VF logits;  // contiguous [B, N, V]
  V64 tokens, parents;
  VF uniforms;                   // [B, N]
  VF draft;                      // [B, N, V] or empty
  VF temperature, top_p;
  V64 top_k;

  VerifyResult run() const {
    VerifyResult r(B, N);
    VF workspace(B * V, 1234.0f);
    VerifyTreeSamplingParams<float> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                                      .draft_probs = draft.empty() ? nullptr : draft.data(), .draft_stride_b = N * V,
                                      .draft_stride_n = V, .tokens = tokens.data(), .parents = parents.data(),
                                      .uniforms = uniforms.data(),
                                      .sampling = {.temperature = temperature.data(), .top_k = top_k.data(),
                                                   .top_p = top_p.data()},
                                      .batch = B, .num_nodes = N, .vocab = V, .workspace = workspace.data(),
                                      .out = r.outputs()};
    cpu::VerifyTreeSampling(p, 0, B);
    return r;
  }
};

VF logp(std::initializer_list<double> probs) {
  VF out;
  for (double p : probs) out.push_back(static_cast<float>(std::log(p)));
  return out;
}

SamplingRun make_run(int64_t B, int64_t N, int64_t V, const V64& parents_row, const V64& tokens_row,
                     const std::vector<VF>& logits_rows) {
  SamplingRun s{B, N, V, {}, {}, {}, VF(B * N, 0.5f), {}, VF(B, 1.0f), VF(B, 1.0f), V64(B, 0)};
  for (int64_t b = 0; b < B; ++b) {
    s.parents.insert(s.parents.end(), parents_row.begin(), parents_row.end());
    s.tokens.insert(s.tokens.end(), tokens_row.begin(), tokens_row.end());
    for (const auto& row : logits_rows) s.logits.insert(s.logits.end(), row.begin(), row.end());
  }
  return s;
}

}  // namespace

TEST_CASE("verify_tree_sampling: temperature 0 equals greedy (with and without draft_probs)") {
  GreedyCase c;
  SamplingRun s{kB, kN, kV, {}, c.tokens, c.parents, {}, {}, VF(kB, 0.0f), VF(kB, 1.0f), V64(kB, 0)};
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t n = 0; n < kN; ++n)
      for (int64_t t = 0; t < kV; ++t) s.logits.push_back(c.at(b, n, t));
  for (int64_t i = 0; i < kB * kN; ++i) s.uniforms.push_back(static_cast<float>((i * 37 % 97) / 97.0));
  expect_greedy(s.run());
  s.draft.assign(kB * kN * kV, 1.0f / kV);
  expect_greedy(s.run());
  // top_k = 1 at temperature 1 is greedy too when the argmax is unique; b0's final row has a tie (tokens 1 and 2,
  // both kept), where uniforms[b, 0] < 0.5 picks token 1.
  s.draft.clear();
  s.temperature.assign(kB, 1.0f);
  s.top_k.assign(kB, 1);
  for (int64_t b = 0; b < kB; ++b) s.uniforms[b * kN] = 0.25f;
  expect_greedy(s.run());
}

TEST_CASE("verify_tree_sampling: chain, deterministic drafts, uniforms worked by hand") {
  // Chain 0 -> 1 -> 2, tokens 3, 1. p0 = [.1 .2 .3 .4], p1 = [.5 .25 .125 .125], p2 = [.4 .3 .2 .1].
  auto s = make_run(4, 3, 4, {-1, 0, 1}, {0, 3, 1},
                    {logp({.1, .2, .3, .4}), logp({.5, .25, .125, .125}), logp({.4, .3, .2, .1})});
  s.uniforms = {
      0.7f, 0.3f, 0.5f,   // node 1: .3 < .4 accept; node 2: .5 < .25 no -> r = [.5 0 .125 .125]/.75, u0*.75=.525 -> 2
      0.5f, 0.3f, 0.5f,   // same, u0 = .5 -> .375 -> token 0
      0.7f, 0.45f, 0.5f,  // node 1: .45 < .4 no -> r = [.1 .2 .3 0]/.6 -> .7 -> token 2
      0.5f, 0.1f, 0.2f,   // node 1 accepted, node 2: .2 < .25 accepted (leaf) -> p2, .5 -> token 1
  };
  auto r = s.run();
  const std::vector<V64> paths = {{0, 1}, {0, 1}, {0}, {0, 1, 2}};
  const V64 next = {2, 0, 2, 1};
  for (int b = 0; b < 4; ++b) {
    CHECK_EQ(r.status[b].code, int64_t{kOk});
    CHECK_VEC(r.path(b, 3), pad(paths[b], 3));
    CHECK_EQ(r.accept_len[b], static_cast<int64_t>(paths[b].size()) - 1);
    CHECK_EQ(r.next_token[b], next[b]);
  }
}

TEST_CASE("verify_tree_sampling: siblings with draft_probs, residuals worked by hand") {
  // Root children 1, 2, 3 with tokens 0, 1, 2; p0 = [.1 .2 .3 .4]; q0 = [.4 .3 .2 .1]; leaves' rows:
  // p1 = [.1 .1 .1 .7], p3 = [.4 .3 .2 .1].
  const VF q0 = {.4f, .3f, .2f, .1f};
  auto s = make_run(3, 4, 4, {-1, 0, 0, 0}, {0, 0, 1, 2},
                    {logp({.1, .2, .3, .4}), logp({.1, .1, .1, .7}), logp({.25, .25, .25, .25}),
                     logp({.4, .3, .2, .1})});
  for (int64_t b = 0; b < 3; ++b) {
    s.draft.insert(s.draft.end(), q0.begin(), q0.end());
    for (int n = 1; n < 4; ++n) s.draft.insert(s.draft.end(), {.25f, .25f, .25f, .25f});
  }
  s.uniforms = {
      0.3f, 0.5f, 0.9f, 0.5f,  // c1: .5*.4 < .1 no -> r=[0 0 .1 .3]; c2: r(1)=0 no -> r=[0 0 .05 .65];
                               // c3: .5*.2=.1 < 1/14 no -> r=[0 0 0 .83] -> token 3 whatever u0
      0.5f, 0.5f, 0.9f, 0.2f,  // as above but c3: .2*.2=.04 < 1/14 accepted (leaf) -> p3, .5 -> token 1
      0.25f, 0.2f, 0.9f, 0.9f, // c1: .2*.4=.08 < .1 accepted (leaf) -> p1, .25 -> token 2
  };
  auto r = s.run();
  const std::vector<V64> paths = {{0}, {0, 3}, {0, 1}};
  const V64 next = {3, 1, 2};
  for (int b = 0; b < 3; ++b) {
    CHECK_EQ(r.status[b].code, int64_t{kOk});
    CHECK_VEC(r.path(b, 4), pad(paths[b], 4));
    CHECK_EQ(r.accept_len[b], static_cast<int64_t>(paths[b].size()) - 1);
    CHECK_EQ(r.next_token[b], next[b]);
  }
  // Deterministic drafts (no draft_probs), row 0's uniforms: c1: .5 < .1 no -> r=[0 .2 .3 .4];
  // c2: .9 < .2/.9 no -> r=[0 0 .3 .4]; c3: .5 < .3/.7 no -> r=[0 0 0 .4] -> token 3. Row 1: c3: .2 < .43 accepted.
  s.draft.clear();
  auto d = s.run();
  CHECK_VEC(d.path(0, 4), pad({0}, 4));
  CHECK_EQ(d.next_token[0], 3);
  CHECK_VEC(d.path(1, 4), pad({0, 3}, 4));
  CHECK_EQ(d.next_token[1], 1);
}

TEST_CASE("verify_tree_sampling: temperature and top-p shape the target") {
  // Root with one child (token 3), p0 = [.1 .2 .3 .4]. Temperature 0.5: p ~ p^2 = [1 4 9 16]/30, so the child is
  // accepted iff u1 < 16/30 = .533. top_p = 0.5 keeps {3, 2} ([.3 .4]/.7): accepted iff u1 < 4/7 = .571.
  auto s = make_run(4, 2, 4, {-1, 0}, {0, 3}, {logp({.1, .2, .3, .4}), logp({.1, .2, .3, .4})});
  s.temperature = {0.5f, 0.5f, 1.0f, 1.0f};
  s.top_p = {1.0f, 1.0f, 0.5f, 0.5f};
  s.uniforms = {0.4f, 0.5f,    // T=.5: accepted (leaf) -> p^2 at node 1: u0*30 = 12: 1, 5, 14 -> token 2
                0.5f, 0.55f,   // T=.5: rejected -> r = [1 4 9 0]/14: 7 -> 1, 5, 14 -> token 2
                0.5f, 0.56f,   // top_p: accepted -> node 1 kept {2,3}: [3/7 4/7], .5 -> token 3
                0.2f, 0.58f};  // top_p: rejected -> r = {2}: token 2
  auto r = s.run();
  const std::vector<V64> paths = {{0, 1}, {0}, {0, 1}, {0}};
  const V64 next = {2, 2, 3, 2};
  for (int b = 0; b < 4; ++b) {
    CHECK_EQ(r.status[b].code, int64_t{kOk});
    CHECK_VEC(r.path(b, 2), pad(paths[b], 2));
    CHECK_EQ(r.next_token[b], next[b]);
  }
}

TEST_CASE("verify_tree_sampling: invalid parameters, trees, tokens, draft_probs") {
  auto s = make_run(6, 3, 4, {-1, 0, 0}, {0, 1, 2}, {logp({.1, .2, .3, .4}), logp({.1, .2, .3, .4}),
                                                    logp({.1, .2, .3, .4})});
  s.temperature[0] = -1.0f;
  s.parents[0 * 3 + 2] = 5;  // the temperature is reported before the tree
  s.temperature[1] = kNaN;
  s.top_p[2] = 0.0f;
  s.top_p[3] = 1.5f;
  s.temperature[3] = 2.0f;
  s.parents[4 * 3 + 2] = 2;
  s.tokens[4 * 3 + 1] = 9;  // the tree is reported before the tokens
  s.tokens[5 * 3 + 2] = 4;
  auto r = s.run();
  auto expect = [&](int64_t b, int64_t code, int64_t node, int64_t value) {
    CHECK_EQ(r.status[b].code, code);
    CHECK_EQ(r.status[b].node, node);
    CHECK_EQ(r.status[b].value, value);
    CHECK_VEC(r.path(b, 3), V64(3, -1));
    CHECK_EQ(r.accept_len[b], 0);
    CHECK_EQ(r.next_token[b], -1);
  };
  expect(0, kBadTemperature, 0, 0);
  expect(1, kBadTemperature, 0, 0);
  expect(2, kBadTopP, 0, 0);
  expect(3, kBadTopP, 0, 0);
  expect(4, kParentNotEarlier, 2, 2);
  expect(5, kTokenOutOfRange, 2, 4);

  // Bad draft probability at the first tested child's token (node 1, token 1), NaN or negative.
  auto q = make_run(3, 3, 4, {-1, 0, 0}, {0, 1, 2}, {logp({.1, .2, .3, .4}), logp({.1, .2, .3, .4}),
                                                    logp({.1, .2, .3, .4})});
  q.draft.assign(3 * 3 * 4, 0.25f);
  q.draft[0 * 12 + 1] = kNaN;
  q.draft[1 * 12 + 1] = -0.5f;
  q.draft[2 * 12 + 3] = -0.5f;  // row 2: token 3 is drafted by no child: never read, so valid
  auto rq = q.run();
  CHECK_EQ(rq.status[0].code, int64_t{kBadDraftProb});
  CHECK_EQ(rq.status[0].node, 0);
  CHECK_EQ(rq.status[0].value, 1);
  CHECK_EQ(rq.status[1].code, int64_t{kBadDraftProb});
  CHECK_EQ(rq.status[1].value, 1);
  CHECK_EQ(rq.next_token[1], -1);
  CHECK_EQ(rq.status[2].code, int64_t{kOk});
}

// ---------------------------------------------------------------------------------------------------------------
// Typical acceptance.

namespace {

VerifyResult run_typical(const VF& logits, const V64& tokens, const V64& parents, const VF& uniforms, const VF& temp,
                         float threshold, float alpha, int64_t B, int64_t N, int64_t V, int64_t sb, int64_t sn) {
  VerifyResult r(B, N);
  VerifyTreeTypicalParams<float> p{.logits = logits.data(), .logits_stride_b = sb, .logits_stride_n = sn,
                                   .tokens = tokens.data(), .parents = parents.data(), .uniforms = uniforms.data(),
                                   .temperature = temp.data(), .posterior_threshold = threshold,
                                   .posterior_alpha = alpha, .batch = B, .num_nodes = N, .vocab = V,
                                   .out = r.outputs()};
  cpu::VerifyTreeTypical(p, 0, B);
  return r;
}

}  // namespace

TEST_CASE("verify_tree_typical: hand-computed thresholds") {
  // parents 0 -> {1, 2}, 1 -> {3}, 2 -> {4}. threshold .2, alpha .3, T = 1.
  // p0 = [.7 .1 .1 .1]: H = .9404, .3 * exp(-H) = .1171 -> threshold .1171: token 1 (.1) fails, token 0 (.7) passes.
  // p1 = p2 = uniform: threshold min(.2, .3 * .25) = .075: token 0 (.25) passes.
  // Row 0: tokens 1, 0, 0, 0: node 1 fails, node 2 passes, node 4 passes -> path 0, 2, 4; p4 = [.1 .2 .3 .4],
  //        u = .5 -> token 2.
  // Row 1: tokens 0, 0, 0, 0: nodes 1-4 all pass; 3 and 4 are the deepest: lowest index 3; p3 = [.4 .3 .2 .1],
  //        u = .5 -> token 1.
  // Row 2: as row 0 with T = 0 (one-hot argmax, entropy 0): node 2 passes (argmax 0), row 2's argmax is 0 ->
  //        node 4 passes; next = argmax of row 4 = 3.
  const int64_t B = 3, N = 5, V = 4;
  std::vector<VF> rows = {logp({.7, .1, .1, .1}), logp({.25, .25, .25, .25}), logp({.25, .25, .25, .25}),
                          logp({.4, .3, .2, .1}), logp({.1, .2, .3, .4})};
  VF logits;
  for (int64_t b = 0; b < B; ++b)
    for (auto& row : rows) logits.insert(logits.end(), row.begin(), row.end());
  const V64 parents_row = {-1, 0, 0, 1, 2};
  V64 parents;
  for (int64_t b = 0; b < B; ++b) parents.insert(parents.end(), parents_row.begin(), parents_row.end());
  const V64 tokens = {0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0};
  auto r = run_typical(logits, tokens, parents, {0.5f, 0.5f, 0.5f}, {1.0f, 1.0f, 0.0f}, 0.2f, 0.3f, B, N, V, N * V,
                       V);
  const std::vector<V64> paths = {{0, 2, 4}, {0, 1, 3}, {0, 2, 4}};
  const V64 next = {2, 1, 3};
  for (int b = 0; b < B; ++b) {
    CHECK_EQ(r.status[b].code, int64_t{kOk});
    CHECK_VEC(r.path(b, N), pad(paths[b], N));
    CHECK_EQ(r.accept_len[b], 2);
    CHECK_EQ(r.next_token[b], next[b]);
  }
  // u = .05 at row 0 -> token 0 of p4.
  auto s = run_typical(logits, tokens, parents, {0.05f, 0.5f, 0.5f}, {1.0f, 1.0f, 0.0f}, 0.2f, 0.3f, B, N, V, N * V,
                       V);
  CHECK_EQ(s.next_token[0], 0);
}

TEST_CASE("verify_tree_typical: temperature 0 equals greedy on trees with distinct sibling tokens") {
  GreedyCase c;
  auto r = run_typical(c.logits, c.tokens, c.parents, VF(kB, 0.3f), VF(kB, 0.0f), 0.09f, 0.3f, kB, kN, kV, kSB, kSN);
  expect_greedy(r, 4);  // b4 has two siblings with the same token
}

TEST_CASE("verify_tree_typical: invalid rows") {
  GreedyCase c;
  for (int64_t t = 0; t < kV; ++t) c.at(2, 0, t) = -kInf;
  c.at(3, 0, 5) = kNaN;
  c.tokens[4 * kN + 5] = -1;
  VF temp(kB, 0.7f);
  temp[1] = -0.5f;
  auto r = run_typical(c.logits, c.tokens, c.parents, VF(kB, 0.3f), temp, 0.09f, 0.3f, kB, kN, kV, kSB, kSN);
  CHECK_EQ(r.status[0].code, int64_t{kOk});
  expect_invalid(r, 1, kBadTemperature, 0, 0);
  expect_invalid(r, 2, kNoValidToken, 0, -1);
  expect_invalid(r, 3, kNonFiniteLogits, 0, 5);
  expect_invalid(r, 4, kTokenOutOfRange, 5, -1);
}

SPECDEC_TEST_MAIN
