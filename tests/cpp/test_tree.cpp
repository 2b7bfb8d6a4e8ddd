// build_tree and tree_ancestor_mask on small hand-made trees, and the dynamic-tree bookkeeping
// (advance_tree_frontier, select_tree_nodes) on hand-made candidates; expected values written out by hand.
#include <cstdint>
#include <vector>

#include "check.h"
#include "cpu/kernels.h"

using namespace specdec;
using V64 = std::vector<int64_t>;

namespace {

struct TreeOut {
  int64_t B, N;
  V64 depth, pos, first_child, next_sibling, paths, num_leaves;
  std::vector<RowStatus> status;
  V64 row(const V64& v, int64_t b) const { return V64(v.begin() + b * N, v.begin() + (b + 1) * N); }
  V64 path(int64_t b, int64_t l) const {
    const auto* p = paths.data() + (b * N + l) * N;
    return V64(p, p + N);
  }
};

TreeOut run_build_tree(const V64& parents, const V64& prefix, int64_t B, int64_t N) {
  TreeOut o{B, N, V64(B * N, 7777), V64(B * N, 7777), V64(B * N, 7777), V64(B * N, 7777), V64(B * N * N, 7777),
            V64(B, 7777), std::vector<RowStatus>(B, RowStatus{99, 99, 99})};
  BuildTreeParams p{.parents = parents.data(), .prefix_lens = prefix.data(), .batch = B, .num_nodes = N,
                    .depth = o.depth.data(), .position_ids = o.pos.data(), .first_child = o.first_child.data(),
                    .next_sibling = o.next_sibling.data(), .retrieve_paths = o.paths.data(),
                    .num_leaves = o.num_leaves.data(), .status = o.status.data()};
  cpu::BuildTree(p, 0, B);
  return o;
}

V64 pad(V64 v, int64_t n) {
  v.resize(n, -1);
  return v;
}

//   0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}, 3 -> {6}
const V64 kTree = {-1, 0, 0, 1, 1, 2, 3};
// Children out of order with other subtrees: 0 -> {1, 3, 6}, 1 -> {2, 4}, 3 -> {5}.
const V64 kInterleaved = {-1, 0, 1, 0, 1, 3, 0};
const V64 kChain = {-1, 0, 1, 2, 3, 4, 5};

}  // namespace

TEST_CASE("build_tree: hand-made trees") {
  V64 parents = kTree;
  parents.insert(parents.end(), kInterleaved.begin(), kInterleaved.end());
  parents.insert(parents.end(), kChain.begin(), kChain.end());
  const V64 prefix = {10, 3, 0};
  auto o = run_build_tree(parents, prefix, 3, 7);
  for (int b = 0; b < 3; ++b) CHECK_EQ(o.status[b].code, int64_t{kOk});

  CHECK_VEC(o.row(o.depth, 0), (V64{0, 1, 1, 2, 2, 2, 3}));
  CHECK_VEC(o.row(o.pos, 0), (V64{10, 11, 11, 12, 12, 12, 13}));
  CHECK_VEC(o.row(o.first_child, 0), (V64{1, 3, 5, 6, -1, -1, -1}));
  CHECK_VEC(o.row(o.next_sibling, 0), (V64{-1, 2, -1, 4, -1, -1, -1}));
  CHECK_EQ(o.num_leaves[0], 3);  // leaves 4, 5, 6
  CHECK_VEC(o.path(0, 0), pad({0, 1, 4}, 7));
  CHECK_VEC(o.path(0, 1), pad({0, 2, 5}, 7));
  CHECK_VEC(o.path(0, 2), pad({0, 1, 3, 6}, 7));
  for (int l = 3; l < 7; ++l) CHECK_VEC(o.path(0, l), V64(7, -1));

  CHECK_VEC(o.row(o.depth, 1), (V64{0, 1, 2, 1, 2, 2, 1}));
  CHECK_VEC(o.row(o.pos, 1), (V64{3, 4, 5, 4, 5, 5, 4}));
  CHECK_VEC(o.row(o.first_child, 1), (V64{1, 2, -1, 5, -1, -1, -1}));
  CHECK_VEC(o.row(o.next_sibling, 1), (V64{-1, 3, 4, 6, -1, -1, -1}));
  CHECK_EQ(o.num_leaves[1], 4);  // leaves 2, 4, 5, 6
  CHECK_VEC(o.path(1, 0), pad({0, 1, 2}, 7));
  CHECK_VEC(o.path(1, 1), pad({0, 1, 4}, 7));
  CHECK_VEC(o.path(1, 2), pad({0, 3, 5}, 7));
  CHECK_VEC(o.path(1, 3), pad({0, 6}, 7));
  for (int l = 4; l < 7; ++l) CHECK_VEC(o.path(1, l), V64(7, -1));

  CHECK_VEC(o.row(o.depth, 2), (V64{0, 1, 2, 3, 4, 5, 6}));
  CHECK_VEC(o.row(o.pos, 2), (V64{0, 1, 2, 3, 4, 5, 6}));
  CHECK_VEC(o.row(o.first_child, 2), (V64{1, 2, 3, 4, 5, 6, -1}));
  CHECK_VEC(o.row(o.next_sibling, 2), V64(7, -1));
  CHECK_EQ(o.num_leaves[2], 1);
  CHECK_VEC(o.path(2, 0), (V64{0, 1, 2, 3, 4, 5, 6}));
  for (int l = 1; l < 7; ++l) CHECK_VEC(o.path(2, l), V64(7, -1));
}

TEST_CASE("build_tree: row range and root-only tree") {
  // Only rows [1, 2) are processed; rows 0 and 2 keep their poison values.
  const V64 parents = {-1, -1, -1};
  const V64 prefix = {5, 6, 7};
  TreeOut o{3, 1, V64(3, 7777), V64(3, 7777), V64(3, 7777), V64(3, 7777), V64(3, 7777), V64(3, 7777),
            std::vector<RowStatus>(3, RowStatus{99, 99, 99})};
  BuildTreeParams p{.parents = parents.data(), .prefix_lens = prefix.data(), .batch = 3, .num_nodes = 1,
                    .depth = o.depth.data(), .position_ids = o.pos.data(), .first_child = o.first_child.data(),
                    .next_sibling = o.next_sibling.data(), .retrieve_paths = o.paths.data(),
                    .num_leaves = o.num_leaves.data(), .status = o.status.data()};
  cpu::BuildTree(p, 1, 2);
  CHECK_EQ(o.status[1].code, int64_t{kOk});
  CHECK_EQ(o.depth[1], 0);
  CHECK_EQ(o.pos[1], 6);
  CHECK_EQ(o.first_child[1], -1);
  CHECK_EQ(o.next_sibling[1], -1);
  CHECK_EQ(o.paths[1], 0);
  CHECK_EQ(o.num_leaves[1], 1);
  CHECK_EQ(o.depth[0], 7777);
  CHECK_EQ(o.depth[2], 7777);
  CHECK_EQ(o.status[0].code, 99);
  CHECK_EQ(o.status[2].code, 99);
}

TEST_CASE("build_tree: invalid trees give status codes and sentinels") {
  const int64_t N = 5;
  const V64 parents = {
      -1, 0, 0, 1, 2,   // valid
      5,  0, 0, 1, 2,   // root parent not -1
      -1, 0, 2, 1, 2,   // node 2's parent is itself
      -1, 0, 1, -1, 9,  // node 3's parent is -1 (first failure), node 4 is also bad
      -1, 0, 1, 2, 4,   // last node's parent is itself
  };
  const int64_t B = 5;
  auto o = run_build_tree(parents, V64(B, 2), B, N);
  CHECK_EQ(o.status[0].code, int64_t{kOk});
  CHECK_EQ(o.status[1].code, int64_t{kRootNotMinusOne});
  CHECK_EQ(o.status[1].node, 0);
  CHECK_EQ(o.status[1].value, 5);
  CHECK_EQ(o.status[2].code, int64_t{kParentNotEarlier});
  CHECK_EQ(o.status[2].node, 2);
  CHECK_EQ(o.status[2].value, 2);
  CHECK_EQ(o.status[3].code, int64_t{kParentNotEarlier});
  CHECK_EQ(o.status[3].node, 3);
  CHECK_EQ(o.status[3].value, -1);
  CHECK_EQ(o.status[4].code, int64_t{kParentNotEarlier});
  CHECK_EQ(o.status[4].node, 4);
  CHECK_EQ(o.status[4].value, 4);
  for (int b = 1; b < B; ++b) {
    CHECK_EQ(o.num_leaves[b], 0);
    CHECK_VEC(o.row(o.first_child, b), V64(N, -1));
    CHECK_VEC(o.row(o.next_sibling, b), V64(N, -1));
    CHECK_VEC(o.row(o.depth, b), V64(N, -1));         // reference.py: -1 for invalid rows
    CHECK_VEC(o.row(o.pos, b), V64(N, -1));
    for (int l = 0; l < N; ++l) CHECK_VEC(o.path(b, l), V64(N, -1));
  }
  // The valid row is unaffected by its invalid neighbours.
  CHECK_VEC(o.row(o.depth, 0), (V64{0, 1, 1, 2, 2}));
  CHECK_EQ(o.num_leaves[0], 2);
}

// ---------------------------------------------------------------------------------------------------------------

namespace {

struct MaskOut {
  std::vector<uint8_t> dense;  // bool storage
  std::vector<int32_t> packed;
  std::vector<RowStatus> status;
};

MaskOut run_mask(const V64& parents, int64_t B, int64_t N, bool want_dense, bool want_packed) {
  const int64_t W = packed_mask_words(N);
  MaskOut o{std::vector<uint8_t>(B * N * N, 0x55), std::vector<int32_t>(B * N * W, 0x5a5a5a5a),
            std::vector<RowStatus>(B, RowStatus{99, 99, 99})};
  static_assert(sizeof(bool) == 1, "bool must be one byte");
  TreeMaskParams p{.parents = parents.data(), .batch = B, .num_nodes = N,
                   .dense = want_dense ? reinterpret_cast<bool*>(o.dense.data()) : nullptr,
                   .packed = want_packed ? o.packed.data() : nullptr, .status = o.status.data()};
  cpu::TreeAncestorMask(p, 0, B);
  return o;
}

}  // namespace

TEST_CASE("tree_ancestor_mask: dense and packed on a hand-made tree") {
  auto o = run_mask(kTree, 1, 7, true, true);
  CHECK_EQ(o.status[0].code, int64_t{kOk});
  // Ancestor-or-self sets: 0:{0} 1:{0,1} 2:{0,2} 3:{0,1,3} 4:{0,1,4} 5:{0,2,5} 6:{0,1,3,6}.
  const std::vector<std::vector<int>> expected_rows = {{1, 0, 0, 0, 0, 0, 0}, {1, 1, 0, 0, 0, 0, 0},
                                                       {1, 0, 1, 0, 0, 0, 0}, {1, 1, 0, 1, 0, 0, 0},
                                                       {1, 1, 0, 0, 1, 0, 0}, {1, 0, 1, 0, 0, 1, 0},
                                                       {1, 1, 0, 1, 0, 0, 1}};
  for (int i = 0; i < 7; ++i) {
    std::vector<int> got(o.dense.begin() + i * 7, o.dense.begin() + (i + 1) * 7);
    CHECK_VEC(got, expected_rows[i]);
  }
  CHECK_VEC(o.packed, (std::vector<int32_t>{1, 3, 5, 11, 19, 37, 75}));
}

TEST_CASE("tree_ancestor_mask: 40-node chain uses two words and the sign bit") {
  const int64_t N = 40;
  V64 parents(N);
  for (int64_t i = 0; i < N; ++i) parents[i] = i - 1;
  auto o = run_mask(parents, 1, N, false, true);
  CHECK_EQ(o.status[0].code, int64_t{kOk});
  for (int64_t i = 0; i < N; ++i) {
    // Node i: bits 0..i set.
    const uint32_t w0 = i >= 31 ? 0xffffffffu : ((1u << (i + 1)) - 1u);
    const uint32_t w1 = i >= 32 ? ((1u << (i - 31)) - 1u) : 0u;
    CHECK_EQ(static_cast<uint32_t>(o.packed[i * 2 + 0]), w0);
    CHECK_EQ(static_cast<uint32_t>(o.packed[i * 2 + 1]), w1);
  }
  CHECK_EQ(o.packed[31 * 2], -1);
  // The dense buffer was not requested and must be untouched.
  CHECK_EQ(o.dense[0], 0x55);
}

TEST_CASE("tree_ancestor_mask: dense only, and invalid rows are all false") {
  const V64 parents = {-1, 0, 0, 1, /* bad */ -1, 0, 3, 1, /* bad root */ 0, 0, 1, 2};
  auto o = run_mask(parents, 3, 4, true, true);
  CHECK_EQ(o.status[0].code, int64_t{kOk});
  CHECK_EQ(o.status[1].code, int64_t{kParentNotEarlier});
  CHECK_EQ(o.status[1].node, 2);
  CHECK_EQ(o.status[1].value, 3);
  CHECK_EQ(o.status[2].code, int64_t{kRootNotMinusOne});
  CHECK_EQ(o.status[2].value, 0);
  const std::vector<int> row0 = {1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1, 1, 0, 1};
  CHECK_VEC(std::vector<int>(o.dense.begin(), o.dense.begin() + 16), row0);
  for (int b = 1; b < 3; ++b) {
    CHECK_VEC(std::vector<int>(o.dense.begin() + b * 16, o.dense.begin() + (b + 1) * 16), std::vector<int>(16, 0));
    CHECK_VEC(std::vector<int32_t>(o.packed.begin() + b * 4, o.packed.begin() + (b + 1) * 4),
              std::vector<int32_t>(4, 0));
  }
  auto d = run_mask(parents, 3, 4, true, false);
  CHECK_VEC(std::vector<int>(d.dense.begin(), d.dense.begin() + 16), row0);
  CHECK_EQ(d.packed[0], 0x5a5a5a5a);
}

TEST_CASE("advance_tree_frontier: tokens, parents, ancestor rows and masks by hand") {
  // one row, F = 2 frontier nodes, K = 2 candidates each, S = 2 selected; C = 6 columns, L = 5 positions
  const V64 cand_tokens = {10, 11, 20, 21};
  const std::vector<float> cand_scores = {-0.5f, -1.0f, -0.2f, -3.0f};
  const V64 selected = {2, 0};  // node 1's first child, node 0's first child
  const bool anc[] = {true, true, false, false, false, false,   // node 0: prefix + slot 0
                      true, false, true, false, false, false};  // node 1: prefix + slot 1
  const V64 column = {0, 0, 1, 2, 5};  // two prefix positions, slots 0 and 1, one position beyond the tree
  V64 tokens(2), parents(2);
  std::vector<float> scores(2);
  bool anc_out[12], mask[10];
  RowStatus st{99, 99, 99};
  AdvanceTreeFrontierParams p{.cand_tokens = cand_tokens.data(), .cand_scores = cand_scores.data(),
                              .selected = selected.data(), .ancestors = anc, .column = column.data(), .batch = 1,
                              .frontier = 2, .top_k = 2, .num_select = 2, .columns = 6, .self_column = 3,
                              .positions = 5, .tokens = tokens.data(), .scores = scores.data(),
                              .parents = parents.data(), .ancestors_out = anc_out, .mask = mask, .status = &st};
  cpu::AdvanceTreeFrontier(p, 0, 1);
  CHECK_EQ(st.code, int64_t{kOk});
  CHECK_VEC(tokens, (V64{20, 10}));
  CHECK_VEC(parents, (V64{1, 0}));
  CHECK_EQ(scores[0], -0.2f);
  CHECK_EQ(scores[1], -0.5f);
  // new node 0 (child of 1): its parent's row plus column 3; new node 1 (child of 0): plus column 4
  CHECK_VEC(std::vector<int>(anc_out, anc_out + 6), (std::vector<int>{1, 0, 1, 1, 0, 0}));
  CHECK_VEC(std::vector<int>(anc_out + 6, anc_out + 12), (std::vector<int>{1, 1, 0, 0, 1, 0}));
  CHECK_VEC(std::vector<int>(mask, mask + 5), (std::vector<int>{1, 1, 0, 1, 0}));
  CHECK_VEC(std::vector<int>(mask + 5, mask + 10), (std::vector<int>{1, 1, 1, 0, 0}));
  const V64 bad_column = {0, 0, 1, 6, 5};
  p.column = bad_column.data();
  cpu::AdvanceTreeFrontier(p, 0, 1);
  CHECK_EQ(st.code, int64_t{kBadColumn});
  CHECK_EQ(st.node, 3);
  CHECK_EQ(st.value, 6);
  CHECK_VEC(std::vector<int>(mask, mask + 10), std::vector<int>(10, 0));
}

TEST_CASE("select_tree_nodes: the best candidates in candidate order, ties to the lower index") {
  // candidates: 0, 1 under the root; 2, 3 under 0; 4 under 1; scores with a tie between 1 and 2
  const V64 tokens = {50, 51, 52, 53, 54};
  const std::vector<float> scores = {-0.1f, -0.7f, -0.7f, -0.9f, -2.0f};
  const V64 parents = {-1, -1, 0, 0, 1};
  const V64 roots = {9};
  V64 tree_tokens(4), tree_parents(4), scratch(10);
  RowStatus st{99, 99, 99};
  SelectTreeNodesParams p{.tokens = tokens.data(), .scores = scores.data(), .parents = parents.data(),
                          .roots = roots.data(), .batch = 1, .candidates = 5, .num_nodes = 3,
                          .tree_tokens = tree_tokens.data(), .tree_parents = tree_parents.data(),
                          .scratch = scratch.data(), .status = &st};
  cpu::SelectTreeNodes(p, 0, 1);
  CHECK_EQ(st.code, int64_t{kOk});
  CHECK_VEC(tree_tokens, (V64{9, 50, 51, 52}));  // candidates 0, 1, 2 (1 before 2 on the tie)
  CHECK_VEC(tree_parents, (V64{-1, 0, 0, 1}));
  const V64 bad_parents = {-1, -1, 3, 0, 1};  // candidate 2's parent is later
  p.parents = bad_parents.data();
  cpu::SelectTreeNodes(p, 0, 1);
  CHECK_EQ(st.code, int64_t{kBadCandidateParent});
  CHECK_EQ(st.node, 2);
  CHECK_EQ(st.value, 3);
  CHECK_VEC(tree_tokens, V64(4, -1));
}

SPECDEC_TEST_MAIN
