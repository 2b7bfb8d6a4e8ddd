// Tree construction on the CPU: topology (depth, positions, child lists, retrieve paths) and ancestor masks.
#include <algorithm>

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
    if (!tree_row_valid(parents, nullptr, N, 0, &p.status[b])) {
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

}  // namespace specdec::cpu
