// Tree construction on the CPU: topology (depth, positions, child lists, retrieve paths), ancestor masks, and the
// dynamic-tree bookkeeping of EAGLE-2 growth (the next frontier, the final selection).
#include <algorithm>
#include <numeric>

#include "kernels.h"
#include "row_ops.h"

namespace specdec::cpu {

void BuildTree(const BuildTreeParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t N = p.num_nodes;
  for (int64_t b = row_begin; b < row_end; ++b) {
    const int64_t* parents = p.parents + b * N;
    int64_t* depth = p.depth + b * N;
    int64_t* position_ids = p.position_ids + b * N;
    int64_t* first_child = p.first_child + b * N;
    int64_t* next_sibling = p.next_sibling + b * N;
    int64_t* paths = p.retrieve_paths + b * N * N;
    std::fill(first_child, first_child + N, -1);
    std::fill(next_sibling, next_sibling + N, -1);
    std::fill(paths, paths + N * N, -1);
    p.status[b] = {kOk, 0, 0};
    if (!build_tree_prefix_valid(p.prefix_lens[b], N, &p.status[b]) ||
        !tree_row_valid(parents, nullptr, N, 0, &p.status[b])) {
      std::fill(depth, depth + N, -1);
      std::fill(position_ids, position_ids + N, -1);
      p.num_leaves[b] = 0;
      continue;
    }
    depth[0] = 0;
    for (int64_t i = 1; i < N; ++i) depth[i] = depth[parents[i]] + 1;
    for (int64_t i = 0; i < N; ++i) position_ids[i] = p.prefix_lens[b] + depth[i];
    // Children in increasing index: walking nodes backwards and pushing each in front of its parent's list.
    for (int64_t i = N - 1; i >= 1; --i) {
      next_sibling[i] = first_child[parents[i]];
      first_child[parents[i]] = i;
    }
    int64_t leaves = 0;
    for (int64_t i = 0; i < N; ++i) {
      if (first_child[i] != -1) continue;
      int64_t* path = paths + leaves * N;
      for (int64_t node = i; node != -1; node = parents[node]) path[depth[node]] = node;
      ++leaves;
    }
    p.num_leaves[b] = leaves;
  }
}

void TreeAncestorMask(const TreeMaskParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t N = p.num_nodes;
  const int64_t W = packed_mask_words(N);
  for (int64_t b = row_begin; b < row_end; ++b) {
    const int64_t* parents = p.parents + b * N;
    bool* dense = p.dense ? p.dense + b * N * N : nullptr;
    int32_t* packed = p.packed ? p.packed + b * N * W : nullptr;
    if (dense) std::fill(dense, dense + N * N, false);
    if (packed) std::fill(packed, packed + N * W, 0);
    p.status[b] = {kOk, 0, 0};
    if (!tree_row_valid(parents, nullptr, N, 0, &p.status[b])) continue;
    // Row i = row parents[i] plus bit i (parents come first, so their rows are complete).
    for (int64_t i = 0; i < N; ++i) {
      const int64_t parent = parents[i];
      if (dense) {
        if (parent >= 0) std::copy(dense + parent * N, dense + parent * N + N, dense + i * N);
        dense[i * N + i] = true;
      }
      if (packed) {
        if (parent >= 0) std::copy(packed + parent * W, packed + parent * W + W, packed + i * W);
        packed[i * W + i / 32] = static_cast<int32_t>(static_cast<uint32_t>(packed[i * W + i / 32]) |
                                                      (1u << (i % 32)));
      }
    }
  }
}

void AdvanceTreeFrontier(const AdvanceTreeFrontierParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t F = p.frontier, K = p.top_k, S = p.num_select, C = p.columns, L = p.positions;
  for (int64_t b = row_begin; b < row_end; ++b) {
    const int64_t* sel = p.selected + b * S;
    const int64_t* column = p.column + b * L;
    RowStatus st{kOk, 0, 0};
    for (int64_t s = 0; s < S && st.code == kOk; ++s)
      if (sel[s] < 0 || sel[s] >= F * K) st = RowStatus{kBadSelected, s, sel[s]};
    for (int64_t l = 0; l < L && st.code == kOk; ++l)
      if (column[l] < 0 || column[l] >= C) st = RowStatus{kBadColumn, l, column[l]};
    p.status[b] = st;
    bool* anc_out = p.ancestors_out + b * S * C;
    bool* mask = p.mask + b * S * L;
    if (st.code != kOk) {
      std::fill(p.tokens + b * S, p.tokens + (b + 1) * S, 0);
      std::fill(p.scores + b * S, p.scores + (b + 1) * S, 0.0f);
      std::fill(p.parents + b * S, p.parents + (b + 1) * S, 0);
      std::fill(anc_out, anc_out + S * C, false);
      std::fill(mask, mask + S * L, false);
      continue;
    }
    for (int64_t s = 0; s < S; ++s) {
      const int64_t f = sel[s] / K;
      p.tokens[b * S + s] = p.cand_tokens[b * F * K + sel[s]];
      p.scores[b * S + s] = p.cand_scores[b * F * K + sel[s]];
      p.parents[b * S + s] = f;
      bool* row = anc_out + s * C;
      std::copy(p.ancestors + (b * F + f) * C, p.ancestors + (b * F + f + 1) * C, row);
      row[p.self_column + s] = true;
      for (int64_t l = 0; l < L; ++l) mask[s * L + l] = row[column[l]];
    }
  }
}

void SelectTreeNodes(const SelectTreeNodesParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t C = p.candidates, M = p.num_nodes;
  for (int64_t b = row_begin; b < row_end; ++b) {
    const float* score = p.scores + b * C;
    const int64_t* parent = p.parents + b * C;
    int64_t* order = p.scratch + b * 2 * C;  // candidates by rank, then the kept ones in candidate order
    int64_t* node_of = order + C;             // candidate -> node (0: not kept)
    std::iota(order, order + C, int64_t{0});
    std::stable_sort(order, order + C, [&](int64_t x, int64_t y) { return ranks_before(score[x], x, score[y], y); });
    std::sort(order, order + M);
    std::fill(node_of, node_of + C, 0);
    for (int64_t i = 0; i < M; ++i) node_of[order[i]] = i + 1;
    int64_t* tokens = p.tree_tokens + b * (M + 1);
    int64_t* parents = p.tree_parents + b * (M + 1);
    RowStatus st{kOk, 0, 0};
    tokens[0] = p.roots[b];
    parents[0] = -1;
    for (int64_t i = 0; i < M && st.code == kOk; ++i) {
      const int64_t c = order[i], up = parent[c];
      if (up != -1 && (up < 0 || up >= c || node_of[up] == 0)) {
        st = RowStatus{kBadCandidateParent, c, up};
        break;
      }
      tokens[i + 1] = p.tokens[b * C + c];
      parents[i + 1] = up == -1 ? 0 : node_of[up];
    }
    p.status[b] = st;
    if (st.code != kOk) {
      std::fill(tokens, tokens + M + 1, -1);
      std::fill(parents, parents + M + 1, -1);
    }
  }
}

}  // namespace specdec::cpu
