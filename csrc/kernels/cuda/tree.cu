// Tree topology kernels: build_tree and tree_ancestor_mask, and the dynamic-tree bookkeeping (advance_tree_frontier,
// select_tree_nodes). One block per batch row (advance: per row and frontier node); threads own nodes.
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
  const int64_t prefix = p.prefix_lens[b];
  RowStatus st = ok_status();
  // (prefix is the same on every thread, so the block-collective tree check runs on all of them or none)
  if (build_tree_prefix_valid(prefix, n, &st)) st = check_tree_row<BLOCK>(par, n);
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

// One block per (row, new frontier node): every block checks its row (the selection and the columns: small), the
// node's block 0 writes the status; threads own table columns, then cache positions.
__global__ void __launch_bounds__(kBlock) advance_frontier_kernel(AdvanceTreeFrontierParams p) {
  __shared__ int bad;
  const int64_t b = blockIdx.x, s = blockIdx.y, F = p.frontier, K = p.top_k, S = p.num_select;
  const int64_t C = p.columns, L = p.positions;
  const int64_t* sel = p.selected + b * S;
  const int64_t* column = p.column + b * L;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < S; i += kBlock)
    if (sel[i] < 0 || sel[i] >= F * K) atomicOr(&bad, 1);
  for (int64_t l = threadIdx.x; l < L; l += kBlock)
    if (column[l] < 0 || column[l] >= C) atomicOr(&bad, 1);
  __syncthreads();
  if (s == 0 && threadIdx.x == 0) {  // the first offending index, as the CPU kernel reports it
    RowStatus st{kOk, 0, 0};
    for (int64_t i = 0; i < S && st.code == kOk; ++i)
      if (sel[i] < 0 || sel[i] >= F * K) st = RowStatus{kBadSelected, i, sel[i]};
    for (int64_t l = 0; l < L && st.code == kOk; ++l)
      if (column[l] < 0 || column[l] >= C) st = RowStatus{kBadColumn, l, column[l]};
    p.status[b] = st;
  }
  bool* row = p.ancestors_out + (b * S + s) * C;
  bool* mask = p.mask + (b * S + s) * L;
  if (bad) {
    if (threadIdx.x == 0) {
      p.tokens[b * S + s] = 0;
      p.scores[b * S + s] = 0.0f;
      p.parents[b * S + s] = 0;
    }
    for (int64_t c = threadIdx.x; c < C; c += kBlock) row[c] = false;
    for (int64_t l = threadIdx.x; l < L; l += kBlock) mask[l] = false;
    return;
  }
  const int64_t f = sel[s] / K;
  if (threadIdx.x == 0) {
    p.tokens[b * S + s] = p.cand_tokens[b * F * K + sel[s]];
    p.scores[b * S + s] = p.cand_scores[b * F * K + sel[s]];
    p.parents[b * S + s] = f;
  }
  const bool* src = p.ancestors + (b * F + f) * C;
  for (int64_t c = threadIdx.x; c < C; c += kBlock) row[c] = src[c] || c == p.self_column + s;
  // (the mask reads the new row from the source row, not from `row`: no barrier needed between the two loops)
  for (int64_t l = threadIdx.x; l < L; l += kBlock) mask[l] = src[column[l]] || column[l] == p.self_column + s;
}

// One block per row. Ranks in parallel (a candidate's rank = how many rank before it), the kept ones' nodes by
// counting kept candidates before them, then each kept candidate writes its node; the first (lowest) candidate
// with a bad parent is found with atomicMin and the row is filled with -1 afterwards.
__global__ void __launch_bounds__(kBlock) select_nodes_kernel(SelectTreeNodesParams p) {
  __shared__ unsigned long long first_bad;
  const int64_t b = blockIdx.x, C = p.candidates, M = p.num_nodes;
  const float* score = p.scores + b * C;
  const int64_t* parent = p.parents + b * C;
  int64_t* rank = p.scratch + b * 2 * C;
  int64_t* node_of = rank + C;
  if (threadIdx.x == 0) first_bad = ~0ull;
  for (int64_t c = threadIdx.x; c < C; c += kBlock) {
    int64_t r = 0;
    for (int64_t o = 0; o < C; ++o) r += ranks_before(score[o], o, score[c], c);
    rank[c] = r;
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += kBlock) {
    int64_t n = 0;
    if (rank[c] < M) {
      n = 1;
      for (int64_t o = 0; o < c; ++o) n += rank[o] < M;
    }
    node_of[c] = n;  // 0: not kept
  }
  __syncthreads();
  int64_t* tokens = p.tree_tokens + b * (M + 1);
  int64_t* parents = p.tree_parents + b * (M + 1);
  for (int64_t c = threadIdx.x; c < C; c += kBlock) {
    const int64_t n = node_of[c], up = parent[c];
    if (n == 0) continue;
    if (up != -1 && (up < 0 || up >= c || node_of[up] == 0)) {
      atomicMin(&first_bad, static_cast<unsigned long long>(c));
      continue;
    }
    tokens[n] = p.tokens[b * C + c];
    parents[n] = up == -1 ? 0 : node_of[up];
  }
  __syncthreads();
  if (first_bad == ~0ull) {
    if (threadIdx.x == 0) {
      tokens[0] = p.roots[b];
      parents[0] = -1;
      p.status[b] = RowStatus{kOk, 0, 0};
    }
    return;
  }
  const int64_t c = static_cast<int64_t>(first_bad);
  if (threadIdx.x == 0) p.status[b] = RowStatus{kBadCandidateParent, c, parent[c]};
  for (int64_t i = threadIdx.x; i <= M; i += kBlock) {
    tokens[i] = -1;
    parents[i] = -1;
  }
}

}  // namespace

void LaunchAdvanceTreeFrontier(const AdvanceTreeFrontierParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_select <= 0) return;
  if (p.num_select > 65535)
    throw std::invalid_argument("specdec_ext CUDA: advance_tree_frontier needs S <= 65535");
  advance_frontier_kernel<<<dim3(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_select)), kBlock, 0,
                            stream>>>(p);
  check_launch("advance_tree_frontier");
}

void LaunchSelectTreeNodes(const SelectTreeNodesParams& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  select_nodes_kernel<<<static_cast<unsigned>(p.batch), kBlock, 0, stream>>>(p);
  check_launch("select_tree_nodes");
}

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
