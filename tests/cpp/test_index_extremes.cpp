// Every kernel's data checks on index and size values at the ends of int64 (issue 19: a check written `a + b <= c`
// wraps near 2^63 and passes): each such value must give the row's status code and sentinel outputs, never an
// access out of bounds. Run under AddressSanitizer this also proves nothing is touched outside the buffers.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "check.h"
#include "cpu/kernels.h"
#include "test_util.h"

using namespace specdec;
using V64 = std::vector<int64_t>;

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
const V64 kExtremes = {kMax, kMax - 1, kMin, kMin + 1, -1};

}  // namespace

TEST_CASE("build_tree: prefix_lens up to INT64_MAX - (N - 1) fit, beyond and negative fail") {
  const int64_t N = 3;
  const V64 parents = {-1, 0, 1};
  const V64 prefixes = {kMax - (N - 1), kMax - (N - 2), kMax, kMin, -1, 0};
  const V64 want = {kOk, kBadTreePrefixLen, kBadTreePrefixLen, kBadTreePrefixLen, kBadTreePrefixLen, kOk};
  for (size_t i = 0; i < prefixes.size(); ++i) {
    V64 depth(N), pos(N), first(N), next(N), paths(N * N), leaves(1);
    RowStatus st{99, 99, 99};
    BuildTreeParams p{.parents = parents.data(), .prefix_lens = &prefixes[i], .batch = 1, .num_nodes = N,
                      .depth = depth.data(), .position_ids = pos.data(), .first_child = first.data(),
                      .next_sibling = next.data(), .retrieve_paths = paths.data(), .num_leaves = leaves.data(),
                      .status = &st};
    cpu::BuildTree(p, 0, 1);
    CHECK_EQ(st.code, want[i]);
    if (want[i] == kOk) {
      CHECK_VEC(pos, (V64{prefixes[i], prefixes[i] + 1, prefixes[i] + 2}));
    } else {
      CHECK_EQ(st.value, prefixes[i]);
      CHECK_VEC(pos, V64(N, -1));
      CHECK_VEC(depth, V64(N, -1));
      CHECK_EQ(leaves[0], 0);
    }
  }
}

TEST_CASE("tree topology and verification: parents and tokens at the int64 ends") {
  const int64_t N = 3, V = 4;
  for (int64_t bad : kExtremes) {
    const V64 parents = {-1, 0, bad};
    V64 depth(N), pos(N), first(N), next(N), paths(N * N), leaves(1);
    const int64_t prefix = 0;
    RowStatus st{99, 99, 99};
    BuildTreeParams p{.parents = parents.data(), .prefix_lens = &prefix, .batch = 1, .num_nodes = N,
                      .depth = depth.data(), .position_ids = pos.data(), .first_child = first.data(),
                      .next_sibling = next.data(), .retrieve_paths = paths.data(), .num_leaves = leaves.data(),
                      .status = &st};
    cpu::BuildTree(p, 0, 1);
    CHECK_EQ(st.code, int64_t{kParentNotEarlier});
    CHECK_EQ(st.value, bad);
    bool dense[N * N];
    TreeMaskParams m{.parents = parents.data(), .batch = 1, .num_nodes = N, .dense = dense, .packed = nullptr,
                     .status = &st};
    cpu::TreeAncestorMask(m, 0, 1);
    CHECK_EQ(st.code, int64_t{kParentNotEarlier});

    const std::vector<float> logits(N * V, 0.0f);
    const V64 chain = {-1, 0, 1}, tokens = {0, 1, bad};
    testutil::VerifyResult r(1, N);
    VerifyTreeGreedyParams<float> g{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                                    .tokens = tokens.data(), .parents = chain.data(), .batch = 1, .num_nodes = N,
                                    .vocab = V, .out = r.outputs()};
    cpu::VerifyTreeGreedy(g, 0, 1);
    CHECK_EQ(r.status[0].code, int64_t{kTokenOutOfRange});
    CHECK_EQ(r.status[0].value, bad);
    CHECK_EQ(r.next_token[0], -1);
  }
}

TEST_CASE("verify_tree_sampling / sample_tokens: top_k at the int64 ends, uniforms outside [0, 1)") {
  const int64_t N = 2, V = 4;
  const std::vector<float> logits = {0.1f, 0.4f, 0.2f, 0.3f, 0.1f, 0.4f, 0.2f, 0.3f};
  const V64 parents = {-1, 0}, tokens = {0, 1};
  const float temperature = 1.0f, top_p = 1.0f;
  // top_k >= V (INT64_MAX included) is "no top-k"; any negative top_k is an error, not "off".
  for (int64_t k : kExtremes) {
    const std::vector<float> u = {0.5f, 0.5f};
    testutil::VerifyResult r(1, N);
    VerifyTreeSamplingParams<float> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                                      .draft_probs = nullptr, .draft_stride_b = 0, .draft_stride_n = 0,
                                      .tokens = tokens.data(), .parents = parents.data(), .uniforms = u.data(),
                                      .sampling = {.temperature = &temperature, .top_k = &k, .top_p = &top_p},
                                      .batch = 1, .num_nodes = N, .vocab = V, .workspace = nullptr, .out = r.outputs()};
    cpu::VerifyTreeSampling(p, 0, 1);
    CHECK_EQ(r.status[0].code, k >= 0 ? int64_t{kOk} : int64_t{kBadTopK});
    if (k < 0) CHECK_EQ(r.status[0].value, k);
    std::vector<float> probs(V);
    int64_t token = 7777;
    RowStatus st{99, 99, 99};
    SampleTokensParams<float> s{.logits = logits.data(), .logits_stride_r = V, .uniforms = u.data(),
                                .sampling = {.temperature = &temperature, .top_k = &k, .top_p = &top_p}, .rows = 1,
                                .vocab = V, .tokens = &token, .probs = probs.data(), .status = &st};
    cpu::SampleTokens(s, 0, 1);
    CHECK_EQ(st.code, k >= 0 ? int64_t{kOk} : int64_t{kBadTopK});
    CHECK(k >= 0 ? token >= 0 && token < V : token == -1);
  }
  const int64_t k = 0;
  for (float bad : {1.0f, -0.0f - 1e-7f, std::nanf(""), INFINITY, -INFINITY}) {
    const std::vector<float> u = {0.5f, bad};
    testutil::VerifyResult r(1, N);
    VerifyTreeSamplingParams<float> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                                      .draft_probs = nullptr, .draft_stride_b = 0, .draft_stride_n = 0,
                                      .tokens = tokens.data(), .parents = parents.data(), .uniforms = u.data(),
                                      .sampling = {.temperature = &temperature, .top_k = &k, .top_p = &top_p},
                                      .batch = 1, .num_nodes = N, .vocab = V, .workspace = nullptr, .out = r.outputs()};
    cpu::VerifyTreeSampling(p, 0, 1);
    CHECK_EQ(r.status[0].code, int64_t{kBadUniform});
    CHECK_EQ(r.status[0].node, 1);
    std::vector<float> probs(V);
    int64_t token = 7777;
    RowStatus st{99, 99, 99};
    SampleTokensParams<float> s{.logits = logits.data(), .logits_stride_r = V, .uniforms = &u[1],
                                .sampling = {.temperature = &temperature, .top_k = &k, .top_p = &top_p}, .rows = 1,
                                .vocab = V, .tokens = &token, .probs = probs.data(), .status = &st};
    cpu::SampleTokens(s, 0, 1);
    CHECK_EQ(st.code, int64_t{kBadUniform});
    CHECK_EQ(st.node, -1);
    CHECK_EQ(token, -1);
  }
}

TEST_CASE("sampling: +inf temperature is an error; huge logits over a small temperature do not overflow") {
  const int64_t V = 4, k = 0;
  const float top_p = 1.0f, u = 0.3f;
  std::vector<float> probs(V);
  int64_t token = 7777;
  RowStatus st{99, 99, 99};
  const std::vector<float> plain = {0.0f, 1.0f, 2.0f, -INFINITY};
  const float inf = INFINITY;
  SampleTokensParams<float> s{.logits = plain.data(), .logits_stride_r = V, .uniforms = &u,
                              .sampling = {.temperature = &inf, .top_k = &k, .top_p = &top_p}, .rows = 1, .vocab = V,
                              .tokens = &token, .probs = probs.data(), .status = &st};
  cpu::SampleTokens(s, 0, 1);
  CHECK_EQ(st.code, int64_t{kBadTemperature});
  // logits / 1e-3 would be +inf for 3e38: (logits - max) / T keeps the max token's weight at exp(0) = 1.
  const std::vector<float> huge = {3e38f, 1e38f, -3e38f, 2.9e38f};
  const float small = 1e-3f;
  s.logits = huge.data();
  s.sampling.temperature = &small;
  cpu::SampleTokens(s, 0, 1);
  CHECK_EQ(st.code, int64_t{kOk});
  CHECK_EQ(token, 0);
  CHECK_VEC(probs, (std::vector<float>{1.0f, 0.0f, 0.0f, 0.0f}));
}

TEST_CASE("tree_attention: prefix_lens at the int64 ends fail without reading the cache") {
  const int64_t H = 1, N = 2, D = 64, S = 4;
  std::vector<float> q(H * N * D, 1.0f), k(S * D, 1.0f), v(S * D, 1.0f), out(H * N * D, 7.0f);
  const bool mask[N * N] = {true, false, true, true};
  for (int64_t prefix : V64{kMax, kMax - 1, kMin, -1, S - N + 1}) {
    RowStatus st{99, 99, 99};
    TreeAttentionParams<float> p{.q = q.data(), .q_stride_b = H * N * D, .q_stride_h = N * D, .q_stride_n = D,
                                 .k = k.data(), .k_stride_b = S * D, .k_stride_h = S * D, .k_stride_s = D,
                                 .v = v.data(), .v_stride_b = S * D, .v_stride_h = S * D, .v_stride_s = D,
                                 .prefix_lens = &prefix, .mask_dense = mask, .mask_packed = nullptr, .batch = 1,
                                 .num_heads = H, .num_kv_heads = 1, .num_nodes = N, .num_tree_keys = N, .head_dim = D,
                                 .seq_len = S, .scale = 0.125f, .out = out.data(), .workspace = nullptr,
                                 .workspace_floats = 0, .status = &st};
    cpu::TreeAttention(p, 0, 1);
    CHECK_EQ(st.code, int64_t{kBadPrefixLen});
    CHECK_EQ(st.value, prefix);
    CHECK_VEC(out, std::vector<float>(H * N * D, 0.0f));
  }
}

TEST_CASE("compact_kv: lengths, dst_start and src_positions at the int64 ends leave the cache untouched") {
  const int64_t S = 4, L = 2;
  struct Case {
    V64 src;
    int64_t dst, len, code;
  };
  const std::vector<Case> cases = {
      {{0, 1}, 0, kMax, kBadLength},    {{0, 1}, 0, kMin, kBadLength},        {{0, 1}, kMax, 1, kBadDstStart},
      {{0, 1}, kMax - 1, 2, kBadDstStart}, {{0, 1}, kMin, 1, kBadDstStart}, {{kMax, 1}, 0, 2, kBadSrcPosition},
      {{0, kMin}, 0, 2, kBadSrcPosition}, {{0, -1}, 0, 2, kBadSrcPosition}, {{3, 2}, 1, 2, kOk}};
  for (const Case& c : cases) {
    std::vector<float> cache = {10, 11, 12, 13};
    CompactKvParams p{};
    p.num_caches = 1;
    p.caches[0] = cache.data();
    p.batch = 1;
    p.outer = 1;
    p.seq_len = S;
    p.inner_bytes = 4;
    p.src_positions = c.src.data();
    p.max_len = L;
    p.dst_start = &c.dst;
    p.lengths = &c.len;
    p.write_status = true;
    RowStatus st{99, 99, 99};
    p.status = &st;
    cpu::CompactKv(p, 0, 1);
    CHECK_EQ(st.code, c.code);
    const std::vector<float> want = c.code == kOk ? std::vector<float>{10, 13, 12, 13} : std::vector<float>{10, 11, 12, 13};
    CHECK_VEC(cache, want);
  }
}

TEST_CASE("advance_tree_frontier / select_tree_nodes: indices at the int64 ends") {
  const V64 cand_tokens = {1, 2, 3, 4};
  const std::vector<float> cand_scores = {-1, -2, -3, -4};
  const bool anc[2 * 3] = {true, false, false, true, true, false};
  for (int64_t bad : kExtremes) {
    for (int which = 0; which < 2; ++which) {
      const V64 selected = {which == 0 ? bad : 0}, column = {0, which == 1 ? bad : 1};
      V64 tokens(1, 7), parents(1, 7);
      std::vector<float> scores(1, 7.0f);
      bool anc_out[3], mask[2];
      RowStatus st{99, 99, 99};
      AdvanceTreeFrontierParams p{.cand_tokens = cand_tokens.data(), .cand_scores = cand_scores.data(),
                                  .selected = selected.data(), .ancestors = anc, .column = column.data(), .batch = 1,
                                  .frontier = 2, .top_k = 2, .num_select = 1, .columns = 3, .self_column = 2,
                                  .positions = 2, .tokens = tokens.data(), .scores = scores.data(),
                                  .parents = parents.data(), .ancestors_out = anc_out, .mask = mask, .status = &st};
      cpu::AdvanceTreeFrontier(p, 0, 1);
      CHECK_EQ(st.code, which == 0 ? int64_t{kBadSelected} : int64_t{kBadColumn});
      CHECK_EQ(st.value, bad);
      CHECK_VEC(tokens, V64{0});
    }
    if (bad == -1) continue;  // (-1: a candidate under the root, valid)
    const V64 tok = {5, 6}, par = {-1, bad}, roots = {9};
    const std::vector<float> sc = {-1.0f, -2.0f};
    V64 tree_tokens(3), tree_parents(3), scratch(4);
    RowStatus st{99, 99, 99};
    SelectTreeNodesParams s{.tokens = tok.data(), .scores = sc.data(), .parents = par.data(), .roots = roots.data(),
                            .batch = 1, .candidates = 2, .num_nodes = 2, .tree_tokens = tree_tokens.data(),
                            .tree_parents = tree_parents.data(), .scratch = scratch.data(), .status = &st};
    cpu::SelectTreeNodes(s, 0, 1);
    CHECK_EQ(st.code, int64_t{kBadCandidateParent});
    CHECK_EQ(st.value, bad);
    CHECK_VEC(tree_tokens, V64(3, -1));
  }
}

TEST_CASE("draft_decoder_layer: write slots at the int64 ends write nothing") {
  const int64_t T = 1, nH = 1, nKV = 1, D = 64, S = 3, Q = (nH + 2 * nKV) * D;
  std::vector<float> qkv(T * Q, 1.0f), k_cache(S * D, 5.0f), v_cache(S * D, 5.0f), inv_freq(D / 2, 0.0f);
  const V64 positions = {0};
  for (int64_t bad : V64{kMax, kMin, -1, S}) {
    const V64 slots = {bad};
    RowStatus st{99, 99, 99};
    DraftLayerParams<float> p{};
    p.qkv = qkv.data();
    p.position_ids = positions.data();
    p.inv_freq = inv_freq.data();
    p.k_cache = k_cache.data();
    p.v_cache = v_cache.data();
    p.write_slots = slots.data();
    p.batch = 1;
    p.tokens = T;
    p.num_heads = nH;
    p.num_kv_heads = nKV;
    p.head_dim = D;
    p.seq_len = S;
    p.status = &st;
    cpu::DraftLayerRopeCache(p, 0, 1);
    CHECK_EQ(st.code, int64_t{kBadWriteSlot});
    CHECK_EQ(st.value, bad);
    CHECK_VEC(k_cache, std::vector<float>(S * D, 5.0f));
    CHECK_VEC(v_cache, std::vector<float>(S * D, 5.0f));
  }
}

SPECDEC_TEST_MAIN
