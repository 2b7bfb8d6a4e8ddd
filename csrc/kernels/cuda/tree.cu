// Tree topology kernels: build_tree and tree_ancestor_mask. One block per batch row; threads own nodes.
// Validation comes first (root, then the first node whose parent is not earlier); an invalid row gets sentinels.
// Parents are earlier nodes, so every ancestor walk terminates after at most depth steps.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels.cuh"
#include "launch_check.cuh"
#include "row_checks.cuh"

namespace specdec::cuda {
namespace {

using namespace detail;

constexpr int kBlock = 256;

// Phase 1 (per node): depth by walking to the root, first child / next sibling by scanning later nodes; the
// path matrix is pre-filled with -1. Phase 2 (chunked block scan over nodes): each leaf gets its rank among
// leaves and writes its root-to-leaf path into that row.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) build_tree_kernel(BuildTreeParams p) {
  const int64_t b = blockIdx.x, n = p.num_nodes;
  const int64_t* par = p.parents + b * n;
  int64_t* depth = p.depth + b * n;
  int64_t* pos = p.position_ids + b * n;
  int64_t* first_child = p.first_child + b * n;
  int64_t* next_sibling = p.next_sibling + b * n;
  int64_t* paths = p.retrieve_paths + b * n * n;
  const RowStatus st = check_tree_row<BLOCK>(par, n);
  for (int64_t e = threadIdx.x; e < n * n; e += BLOCK) paths[e] = -1;
  if (st.code != kOk) {
    for (int64_t i = threadIdx.x; i < n; i += BLOCK) {
      depth[i] = -1;
      pos[i] = -1;
      first_child[i] = -1;
      next_sibling[i] = -1;
    }
    if (threadIdx.x == 0) {
      p.num_leaves[b] = 0;
      p.status[b] = st;
    }
    return;
  }
  const int64_t prefix = p.prefix_lens[b];
  for (int64_t i = threadIdx.x; i < n; i += BLOCK) {
    int64_t d = 0;
    for (int64_t a = i; a != 0; a = par[a]) ++d;
    depth[i] = d;
    pos[i] = prefix + d;
    int64_t fc = -1;
    for (int64_t c = i + 1; c < n; ++c) {
      if (par[c] == i) {
        fc = c;
        break;
      }
    }
    first_child[i] = fc;
    int64_t ns = -1;
    if (i > 0) {
      const int64_t mine = par[i];
      for (int64_t c = i + 1; c < n; ++c) {
        if (par[c] == mine) {
          ns = c;
          break;
        }
      }
    }
    next_sibling[i] = ns;
  }
  __syncthreads();  // -1 fill and phase-1 outputs visible to the whole block
  int64_t leaves = 0;
  for (int64_t base = 0; base < n; base += BLOCK) {
    const int64_t i = base + threadIdx.x;
    const bool leaf = i < n && first_child[i] == -1;
    int64_t total;
    const int64_t rank = leaves + block_exclusive_scan<BLOCK>(static_cast<int64_t>(leaf ? 1 : 0), &total);
    if (leaf) {
      int64_t* path = paths + rank * n;
      int64_t node = i;
      for (int64_t d = depth[i]; d >= 0; --d) {
        path[d] = node;
        node = node > 0 ? par[node] : -1;
      }
    }
    leaves += total;
  }
  if (threadIdx.x == 0) {
    p.num_leaves[b] = leaves;
    p.status[b] = st;
  }
}

// mask row i = node i and its ancestors. The row block is zero-filled cooperatively (coalesced), then each
// thread sets the bits of the rows it owns (no other thread writes them, so no atomics are needed).
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) tree_mask_kernel(TreeMaskParams p) {
  const int64_t b = blockIdx.x, n = p.num_nodes, words = (n + 31) / 32;  // packed_mask_words() is host-only
  const int64_t* par = p.parents + b * n;
  const RowStatus st = check_tree_row<BLOCK>(par, n);
  bool* dense = p.dense != nullptr ? p.dense + b * n * n : nullptr;
  int32_t* packed = p.packed != nullptr ? p.packed + b * n * words : nullptr;
  if (dense != nullptr) {
    for (int64_t e = threadIdx.x; e < n * n; e += BLOCK) dense[e] = false;
  }
  if (packed != nullptr) {
    for (int64_t e = threadIdx.x; e < n * words; e += BLOCK) packed[e] = 0;
  }
  if (threadIdx.x == 0) p.status[b] = st;
  if (st.code != kOk) return;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += BLOCK) {
    int64_t a = i;
    while (true) {
      if (dense != nullptr) dense[i * n + a] = true;
      if (packed != nullptr) {
        int32_t* word = packed + i * words + a / 32;
        *word = static_cast<int32_t>(static_cast<uint32_t>(*word) | (1u << (a % 32)));
      }
      if (a == 0) break;
      a = par[a];
    }
  }
}

}  // namespace

void LaunchBuildTree(const BuildTreeParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_nodes <= 0) return;
  build_tree_kernel<kBlock><<<static_cast<unsigned>(p.batch), kBlock, 0, stream>>>(p);
  check_launch("build_tree");
}

void LaunchTreeAncestorMask(const TreeMaskParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_nodes <= 0) return;
  tree_mask_kernel<kBlock><<<static_cast<unsigned>(p.batch), kBlock, 0, stream>>>(p);
  check_launch("tree_ancestor_mask");
}

}  // namespace specdec::cuda
