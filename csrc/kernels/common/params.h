// Argument bundles for every kernel, shared by the CPU and CUDA implementations (no torch dependency).
//
// Conventions (see docs/ARCHITECTURE.md):
//  * B = batch rows, N = tree nodes per row, V = vocabulary size, F = frontier nodes, K = selected nodes.
//  * A tree is `parents[B, N]` (int64): node 0 is the root (parent -1), every other node's parent is an earlier
//    node. Children of a node are visited in increasing node index ("sibling order").
//  * Index tensors are contiguous int64. Float matrices ([.., V]) have unit stride in V and arbitrary row
//    strides, given in elements.
//  * Every kernel writes one RowStatus per batch row; an invalid row gets sentinel outputs (see status.h).
//  * Validation order within a row (the first failure is the one reported): sampling parameters (temperature,
//    then top_p); the tree (node 0, then nodes 1.. in order); draft tokens (nodes 1..N-1 in order); then each
//    logits row when the algorithm first reads it (NaN / +inf: value = first offending vocabulary index; else all
//    -inf); draft_probs at a drafted token when that child is tested. Logits rows never read are not checked.
#pragma once

#include <cstdint>

#include "dtype.h"
#include "status.h"

namespace specdec {

// ---------------------------------------------------------------------------------------------------------------
// Tree construction.

struct BuildTreeParams {
  const int64_t* parents;      // [B, N]
  const int64_t* prefix_lens;  // [B]: tokens already in the KV cache before the root
  int64_t batch;
  int64_t num_nodes;
  int64_t* depth;           // [B, N]: root 0
  int64_t* position_ids;    // [B, N]: prefix_lens[b] + depth
  int64_t* first_child;     // [B, N]: lowest-index child or -1
  int64_t* next_sibling;    // [B, N]: next higher-index child of the same parent or -1
  int64_t* retrieve_paths;  // [B, N, N]: row l < num_leaves[b] = root-to-leaf path of the l-th leaf (leaves in
                            // increasing node order), padded with -1; rows >= num_leaves[b] are all -1
  int64_t* num_leaves;      // [B]
  RowStatus* status;        // [B]
};

struct TreeMaskParams {
  const int64_t* parents;  // [B, N]
  int64_t batch;
  int64_t num_nodes;
  bool* dense;        // [B, N, N] or nullptr: dense[b, i, j] = node j is node i or one of its ancestors
  int32_t* packed;    // [B, N, W] or nullptr, W = ceil(N / 32): bit (j % 32) of word j / 32, least significant
                      // bit first (so a little-endian uint8 view is FlashInfer's "little" bit order)
  RowStatus* status;  // [B]
};

SPECDEC_HD int64_t packed_mask_words(int64_t num_nodes) { return (num_nodes + 31) / 32; }

// ---------------------------------------------------------------------------------------------------------------
// Sampling parameters, one per batch row (float32 / int64 / float32, contiguous [B]).
//   temperature[b] < 1e-5 -> the row's target distribution is one-hot on the first argmax (greedy);
//   top_k[b] <= 0 or >= V -> no top-k;   top_p[b] == 1 -> no top-p.
// Filtering order: x = logits / temperature; keep x >= (k-th largest x); w = exp(x - max x) on kept tokens;
// then keep x >= x_m where m is the first position, in descending-x order, at which the running sum of w reaches
// top_p * sum(w) (all kept tokens stay if rounding leaves it short). Ties at either threshold are kept.
// Probabilities are w / sum(w) over the kept set.
// Weights w are float32, but every SUM of weights (normalisers, top-p running sums, inverse-CDF running sums, the
// acceptance test u * q(x) * sum(r) < r(x)) is accumulated and compared in float64: float32 accumulation over a
// 32k vocabulary drifts by ~1e-4 relative, enough to move a top-p cut or a sampled token between implementations.
// Temperatures in [0, 1e-5) are greedy (vLLM's sampling epsilon): dividing finite logits by a smaller temperature
// can overflow float32. Negative and NaN temperatures are kept as they are, so validation still rejects them.
constexpr float kGreedyTemperature = 1e-5f;
SPECDEC_HD float effective_temperature(float t) { return t >= 0.0f && t < kGreedyTemperature ? 0.0f : t; }

struct SamplingParams {
  const float* temperature;  // [B]
  const int64_t* top_k;      // [B]
  const float* top_p;        // [B]
};

// ---------------------------------------------------------------------------------------------------------------
// Verification. Outputs are shared by all three verifiers:
//   accepted[B, N]: accepted[b, 0..accept_len[b]] are the node indices of the accepted root-to-node path (starting
//                   with the root 0); the rest is -1.
//   accept_len[B]:  number of accepted draft tokens (the root is not counted).
//   next_token[B]:  the token emitted after the accepted path: the correction, or the bonus token when the path
//                   ends at a leaf. A step therefore emits accept_len + 1 tokens.

struct VerifyOutputs {
  int64_t* accepted;    // [B, N]
  int64_t* accept_len;  // [B]
  int64_t* next_token;  // [B]
  RowStatus* status;    // [B]
};

template <typename T>
struct VerifyTreeGreedyParams {
  const T* logits;  // [B, N, V] (row strides below, unit stride in V)
  int64_t logits_stride_b;
  int64_t logits_stride_n;
  const int64_t* tokens;   // [B, N]; tokens[b, 0] (the root) is not read
  const int64_t* parents;  // [B, N]
  int64_t batch;
  int64_t num_nodes;
  int64_t vocab;
  VerifyOutputs out;
};

// Lossless recursive rejection sampling over the tree (SpecInfer multi-draft; a chain is a width-1 tree).
// At node u with target distribution p_u, residual r = p_u. For each child c of u in sibling order with token x:
//   accept iff uniforms[b, c] * q(x) < r(x), where q = draft_probs[b, u, :] (drafts sampled i.i.d. from q), or
//   q = 1 when draft_probs is null (deterministic drafts, e.g. top-k);
//   on rejection r <- normalise(max(r - q, 0)) (with q = one-hot(x) when draft_probs is null). If that residual is
//   all zero (possible only through rounding) r falls back to p_u.
// Accepting moves to c and repeats. When no child is accepted (or u is a leaf), next_token is drawn from r by
// inverse CDF over increasing token ids with uniforms[b, 0]: the first t whose running sum of r exceeds
// uniforms[b, 0] * sum(r) (the last token with r > 0 if rounding leaves none).
template <typename T>
struct VerifyTreeSamplingParams {
  const T* logits;  // [B, N, V]
  int64_t logits_stride_b;
  int64_t logits_stride_n;
  const float* draft_probs;  // [B, N, V] float32 or nullptr; row u = distribution u's children were drafted from
  int64_t draft_stride_b;
  int64_t draft_stride_n;
  const int64_t* tokens;   // [B, N]
  const int64_t* parents;  // [B, N]
  const float* uniforms;   // [B, N] in [0, 1): column c >= 1 tests node c, column 0 draws next_token
  SamplingParams sampling;
  int64_t batch;
  int64_t num_nodes;
  int64_t vocab;
  float* workspace;  // [B, V] float32 scratch (the residual), used only when draft_probs is set
  VerifyOutputs out;
};

// Medusa typical acceptance (lossy). p_u = softmax(logits[b, u] / temperature[b]) (one-hot argmax at T = 0),
// H_u its entropy. Node c with parent u and token x is acceptable iff p_u(x) > min(posterior_threshold,
// posterior_alpha * exp(-H_u)). The accepted path ends at the deepest node whose whole root path is acceptable
// (ties: lowest node index). next_token is drawn from p at that node by inverse CDF with uniforms[b].
template <typename T>
struct VerifyTreeTypicalParams {
  const T* logits;  // [B, N, V]
  int64_t logits_stride_b;
  int64_t logits_stride_n;
  const int64_t* tokens;   // [B, N]
  const int64_t* parents;  // [B, N]
  const float* uniforms;     // [B]
  const float* temperature;  // [B]
  double posterior_threshold;  // float64, like the Python floats the caller passes
  double posterior_alpha;
  int64_t batch;
  int64_t num_nodes;
  int64_t vocab;
  VerifyOutputs out;
};

// ---------------------------------------------------------------------------------------------------------------
// Fused draft sampling.

// One token per row from the filtered distribution (SamplingParams), by inverse CDF with uniforms[r], plus the
// distribution itself (float32, zero outside the kept set) for lossless verification.
template <typename T>
struct SampleTokensParams {
  const T* logits;  // [R, V]
  int64_t logits_stride_r;
  const float* uniforms;  // [R]
  SamplingParams sampling;  // [R] each
  int64_t rows;
  int64_t vocab;
  int64_t* tokens;    // [R]
  float* probs;       // [R, V] contiguous
  RowStatus* status;  // [R]
};

// One EAGLE-2 dynamic-tree expansion step. For frontier node f of row b: lp = log_softmax(logits[b, f]); its
// top_k tokens by lp (descending, ties: lower token id) become candidates with score parent_scores[b, f] + lp.
// Then the num_select best of the F * top_k candidates (descending score, ties: lower flat index f * top_k + j).
template <typename T>
struct ExpandTreeStepParams {
  const T* logits;  // [B, F, V]
  int64_t logits_stride_b;
  int64_t logits_stride_f;
  const float* parent_scores;  // [B, F]
  int64_t batch;
  int64_t frontier;
  int64_t vocab;
  int64_t top_k;
  int64_t num_select;
  int64_t* cand_tokens;  // [B, F, top_k]
  float* cand_scores;    // [B, F, top_k]
  int64_t* selected;     // [B, num_select]: flat candidate indices f * top_k + j
  RowStatus* status;     // [B]
};

}  // namespace specdec
