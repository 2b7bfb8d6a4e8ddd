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
//    then top_k, then top_p); the row's uniforms (columns in order); the tree (node 0, then nodes 1.. in order);
//    draft tokens (nodes 1..N-1 in order); then each
//    logits row when the algorithm first reads it (NaN / +inf: value = first offending vocabulary index; else all
//    -inf); draft_probs at a drafted token when that child is tested. Logits rows never read are not checked.
#pragma once

#include <cmath>
#include <cstdint>

#include "dtype.h"
#include "status.h"

namespace specdec {

// ---------------------------------------------------------------------------------------------------------------
// Tree construction.

// A row with prefix_lens[b] < 0, or so large that a position id prefix_lens[b] + depth could exceed INT64_MAX
// (prefix_lens[b] > INT64_MAX - (N - 1)), gets kBadTreePrefixLen (checked before the tree) and the sentinels of an
// invalid tree.
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

// build_tree's prefix_lens[b] check (both devices): 0 <= prefix <= INT64_MAX - (N - 1), so that prefix + depth
// (depth <= N - 1) cannot overflow.
SPECDEC_HD bool build_tree_prefix_valid(int64_t prefix, int64_t num_nodes, RowStatus* status) {
  if (prefix >= 0 && prefix <= INT64_MAX - (num_nodes - 1)) return true;
  *status = RowStatus{kBadTreePrefixLen, 0, prefix};
  return false;
}

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

// Dynamic-tree bookkeeping (EAGLE-2 growth, specdec_ext/drafters/dynamic_tree.py), so that a tree level costs one op
// between expand_tree_step and the drafter's network instead of ~10 small ones.
//
// advance_tree_frontier: the next frontier from expand_tree_step's selection. For row b and new frontier node s with
// selected[b, s] = f * K + j: tokens[b, s] = cand_tokens[b, f, j], scores[b, s] = cand_scores[b, f, j],
// parents[b, s] = f; its ancestor row ancestors_out[b, s, c] = ancestors[b, f, c] || c == self_column + s (a
// table column per tree slot); and its attention mask over L cache positions, mask[b, s, l] =
// ancestors_out[b, s, column[b, l]]. A row with a selected index outside [0, F K) (kBadSelected, node = s) or a
// column outside [0, C) (kBadColumn, node = l) gets zero / false outputs.
struct AdvanceTreeFrontierParams {
  const int64_t* cand_tokens;  // [B, F, K]
  const float* cand_scores;    // [B, F, K]
  const int64_t* selected;     // [B, S]
  const bool* ancestors;       // [B, F, C]
  const int64_t* column;       // [B, L]
  int64_t batch, frontier, top_k, num_select, columns, self_column, positions;  // B, F, K, S, C, (< C - S + 1), L
  int64_t* tokens;      // [B, S]
  float* scores;        // [B, S]
  int64_t* parents;     // [B, S]
  bool* ancestors_out;  // [B, S, C]
  bool* mask;           // [B, S, L]
  RowStatus* status;    // [B]
};

// select_tree_nodes: a tree of the M = min(num_nodes, C) best of C candidates. Row b: candidates ranked by score
// descending, ties to the lower index (NaN ranks as -inf), the first M kept, in candidate order as nodes 1 .. M;
// node 0 is roots[b]. Node i's token is its candidate's token; its parent is node 0 when the candidate's parent is
// -1, else the node of candidate parents[b, c], which must be kept and earlier than c (a candidate's parent scores at
// least as high and comes first, so this holds for trees grown by expand_tree_step); otherwise the row gets
// kBadCandidateParent (node = c, value = its parent) and -1 everywhere. `scratch` [B, 2 C] int64 is workspace.
struct SelectTreeNodesParams {
  const int64_t* tokens;   // [B, C]
  const float* scores;     // [B, C]
  const int64_t* parents;  // [B, C]: candidate index of the parent, -1 = the root
  const int64_t* roots;    // [B]
  int64_t batch, candidates, num_nodes;  // B, C, M
  int64_t* tree_tokens;   // [B, M + 1]
  int64_t* tree_parents;  // [B, M + 1]
  int64_t* scratch;       // [B, 2 C]
  RowStatus* status;      // [B]
};

// Candidate a ranks before candidate b (select_tree_nodes' order).
SPECDEC_HD bool ranks_before(float score_a, int64_t a, float score_b, int64_t b) {
  const float x = is_nan(score_a) ? neg_inf() : score_a, y = is_nan(score_b) ? neg_inf() : score_b;
  return x > y || (x == y && a < b);
}

// ---------------------------------------------------------------------------------------------------------------
// Sampling parameters, one per batch row (float32 / int64 / float32, contiguous [B]). The valid ranges are those
// of specdec_ext.generate: temperature finite and >= 0, top_k >= 0, top_p in (0, 1]; anything else (NaN, +inf,
// top_k = -1) is a row error (kBadTemperature, kBadTopK, kBadTopP), never a silent "off".
//   temperature[b] < 1e-5 -> the row's target distribution is one-hot on the first argmax (greedy);
//   top_k[b] == 0 or >= V -> no top-k;   top_p[b] == 1 -> no top-p.
// Uniforms (every op's randomness) must lie in [0, 1), the range of torch.rand (kBadUniform otherwise).
// Filtering order, with l = the row's logits (as float32): keep l >= (k-th largest l); w = exp((l - max l) /
// temperature) on kept tokens (<= 1: no finite logit overflows float32 at any temperature, where l / temperature
// would for |l| > 3.4e38 temperature); then keep l >= l_m where m is the first position, in descending-l order, at
// which the running sum of w reaches top_p * sum(w) (all kept tokens stay if rounding leaves it short). Ties at
// either threshold are kept. Rankings use l itself: the order of l / temperature, without the ties its rounding
// makes. Probabilities are w / sum(w) over the kept set.
// Weights w are float32, but every SUM of weights (normalisers, top-p running sums, inverse-CDF running sums, the
// acceptance test u * q(x) * sum(r) < r(x)) is accumulated and compared in float64: float32 accumulation over a
// 32k vocabulary drifts by ~1e-4 relative, enough to move a top-p cut or a sampled token between implementations.
// Temperatures in [0, 1e-5) are greedy (vLLM's sampling epsilon, and SamplingParams.greedy in Python). Negative,
// NaN and infinite temperatures are kept as they are, so validation still rejects them.
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
//   all zero (possible only through rounding) or NaN (a NaN in draft_probs away from the drafted tokens: max keeps
//   NaN) r falls back to p_u.
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
// Then the num_select best of the F * top_k candidates (descending score, ties: lower flat index f * top_k + j;
// a NaN score, from a NaN parent score, ranks first whatever its sign, as in torch.sort).
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
  RowStatus* node_status = nullptr;  // [B, F] scratch for the CPU's two-phase form (may be null otherwise)
};

// ---------------------------------------------------------------------------------------------------------------
// Attention over a draft tree, and KV-cache compaction.

// Head dimensions tree_attention supports (the CUDA kernel is templated on them).
SPECDEC_HD bool tree_attention_head_dim_supported(int64_t d) {
  return d == 64 || d == 80 || d == 96 || d == 128 || d == 256;
}

// Query m = g * N + i of kv head k is query head h = k * G + g (G = H / Hkv) at tree node i. Node i of row b attends
// to cache positions [0, prefix_lens[b]) and to prefix_lens[b] + j for every tree key j < Nk with mask(b, i, j)
// (the tree's K/V are already in the cache at prefix_lens[b] + j). out = softmax(scale * q . k) v over those
// positions, accumulated in float32; a query that attends to nothing (no visible key, or a score of -inf for each)
// gets zeros. Masked keys get a score of exactly
// -inf (weight 0) whatever their K holds; NaN in a visible score, or in any V row the sum runs over, gives NaN (as
// the product P V does in plain PyTorch). A row with prefix_lens[b] < 0 or
// prefix_lens[b] + Nk > S gets kBadPrefixLen and zero outputs. The tree_attention op has one key per node (Nk = N:
// the nodes attend among themselves); draft_decoder_layer passes prefix 0 and its whole mask as Nk keys (queries
// at some of the mask's slots).
template <typename T>
struct TreeAttentionParams {
  const T* q;  // [B, H, N, D], unit stride in D
  int64_t q_stride_b, q_stride_h, q_stride_n;
  const T* k;  // [B, Hkv, S, D], unit stride in D
  int64_t k_stride_b, k_stride_h, k_stride_s;
  const T* v;  // [B, Hkv, S, D], unit stride in D
  int64_t v_stride_b, v_stride_h, v_stride_s;
  const int64_t* prefix_lens;  // [B]
  const bool* mask_dense;      // [B, N, Nk] contiguous, or nullptr
  const int32_t* mask_packed;  // [B, N, ceil(Nk / 32)] contiguous (TreeMaskParams layout), or nullptr
  int64_t batch;
  int64_t num_heads;     // H
  int64_t num_kv_heads;  // Hkv (H % Hkv == 0)
  int64_t num_nodes;     // N (queries per head)
  int64_t num_tree_keys;  // Nk (keys after the prefix)
  int64_t head_dim;      // D
  int64_t seq_len;       // S
  float scale;
  T* out;              // [B, H, N, D] contiguous
  float* workspace;    // CUDA: split partials (size from the launcher); CPU: unused (nullptr)
  int64_t workspace_floats;
  RowStatus* status;  // [B]
};

// Whether tree key j is visible to node i in row b (either mask layout).
template <typename T>
SPECDEC_HD bool tree_mask_allows(const TreeAttentionParams<T>& p, int64_t b, int64_t i, int64_t j) {
  if (p.mask_dense != nullptr) return p.mask_dense[(b * p.num_nodes + i) * p.num_tree_keys + j];
  const int64_t w = packed_mask_words(p.num_tree_keys);
  const uint32_t word = static_cast<uint32_t>(p.mask_packed[(b * p.num_nodes + i) * w + (j >> 5)]);
  return (word >> (j & 31)) & 1u;
}

// ---------------------------------------------------------------------------------------------------------------
// Linear layers over a packed weight (the few-row products of decoding, drafting and verification).
//
// weight[N, K] (out_features N, in_features K) is packed once into panels of kLinearPanel output features:
//   packed[ceil(N / 32), ceil(K / P), 32, P], packed[n / 32][k / P][n % 32][k % P] = weight[n][k],
// with P = linear_pack_pair<T>() = 1 for float32 and 2 for 16-bit types (pairs along K: the operand order of
// AVX512-BF16's dot product). A panel is one contiguous stream of K * 32 weights, read once per block of rows.
// Padding: k >= K (odd K, 16-bit) is zero; the rows n >= N of the last panel hold the marker LinearPad<T>::bits
// instead, because the shape gives N only to within 32: the marker tells which rows the weight holds, so a wrong
// out_features is refused (the CPU glue reads the last panel's first column; a device tensor is not read back),
// where zero rows would have been extra zero outputs. Padding outputs are computed and never stored.
// y[M, N] = x[M, K] @ weight^T + bias: every output element is one float32 accumulation over k = 0, 1, .., K - 1
// in order (plus bias, then one rounding to T), whatever M and however rows are blocked, so a row's result does
// not depend on the other rows in the call (decoding one token and verifying many give the same bits).
constexpr int64_t kLinearPanel = 32;

template <typename T>
constexpr int64_t linear_pack_pair() {
  return sizeof(T) == 2 ? 2 : 1;
}

// The padding rows' marker: a fixed value near the type's largest finite one, which no trained weight holds (one
// whose first column held exactly this value in its last panel would be counted as padding). Finite, so packed
// weights still compare equal to themselves (torch.equal, opcheck).
template <typename T>
struct LinearPad;
template <>
struct LinearPad<float> {
  static constexpr uint32_t bits = 0x7F7FDEC5u;  // 3.40e38
};
template <>
struct LinearPad<bf16> {
  static constexpr uint32_t bits = 0x7F7Du;  // 3.36e38
};
template <>
struct LinearPad<f16> {
  static constexpr uint32_t bits = 0x7BDDu;  // 64416
};

template <typename T>
SPECDEC_HD T linear_pad_value() {
  if constexpr (sizeof(T) == 4) {
    return bits_to_float(LinearPad<T>::bits);
  } else {
    return T{static_cast<uint16_t>(LinearPad<T>::bits)};
  }
}

template <typename T>
struct PackLinearWeightParams {
  const T* weight;  // [N, K] contiguous
  int64_t out_features;  // N
  int64_t in_features;   // K
  T* packed;             // [ceil(N / 32), ceil(K / P), 32, P]
};

template <typename T>
struct PackedLinearParams {
  const T* x;  // [M, K] contiguous
  int64_t rows;          // M
  int64_t in_features;   // K
  int64_t out_features;  // N
  const T* packed;       // PackLinearWeightParams layout
  const T* bias;         // [N] or nullptr
  T* y;                  // [M, N] contiguous
};

// ---------------------------------------------------------------------------------------------------------------
// Weight-only int8 linear layers (packed_linear_int8), for drafters: a quarter of the float32 weight's bytes.
//
// Quantisation of a row v[K] (a weight's output channel at packing, an input row at each product), symmetric:
//   amax = max_k |v[k]|, scale = amax / 127, q[k] = clamp(rint(v[k] * (127 / amax)), -127, 127)  (float32, RNE);
// amax < 2^-120 (127 / amax would overflow) gives scale 0 and q = 0; a row holding inf or NaN gives scale NaN and
// q = 0 (an input row's outputs are then NaN; a weight must be finite, the glue refuses it).
// The product is exact integer arithmetic, so every path (and the reference) gives the same bits:
//   acc[m, n] = sum_k qx[m, k] qw[n, k] (int32; |acc| <= 127^2 K, hence K <= kLinearInt8MaxK)
//   y[m, n]   = T(float(acc) * (sx[m] * sw[n]) + bias[n])  (float32: two products, then the sum, each rounded)
// Layout: packed[ceil(N / 32), ceil(K / 4), 32, 4] int8, packed[n / 32][k / 4][n % 32][k % 4] = qw[n][k], zero
// where k >= K or n >= N (a panel is one stream; a 32-bit lane is the 4 K-values of a dot-product instruction);
// scales[N] float32. The quantised input rows qx[M, ceil(K / 4) * 4] are zero-padded the same way.
constexpr int64_t kLinearInt8Quad = 4;
constexpr int64_t kLinearInt8MaxK = 131072;  // 127^2 * 131072 < 2^31
constexpr float kInt8TinyAmax = 0x1p-120f;  // (127 / amax is finite above it)

SPECDEC_HD int64_t linear_int8_padded_k(int64_t K) { return (K + kLinearInt8Quad - 1) / kLinearInt8Quad * 4; }

// (scale, 127 / amax) of a row whose largest magnitude is `amax` and which is finite iff `finite`.
struct Int8RowScale {
  float scale, inverse;
};
SPECDEC_HD Int8RowScale int8_row_scale(float amax, bool finite) {
  if (!finite) return {bits_to_float(0x7fc00000u), 0.0f};
  if (amax < kInt8TinyAmax) return {0.0f, 0.0f};
  return {amax / 127.0f, 127.0f / amax};
}

// q of one value, given its row's 127 / amax (0 for a zero, tiny or non-finite row: q = 0 then, inf or NaN included).
SPECDEC_HD int8_t int8_quantize(float v, float inverse) {
  if (inverse == 0.0f) return 0;
  const float r = rintf(v * inverse);  // (current rounding mode: to nearest even)
  return static_cast<int8_t>(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
}

// y = T(float(acc) * (sx * sw) + bias), in that order (no fused multiply-add: cpu/linear_int8.cpp is built with
// -ffp-contract=off for this, and CUDA uses the _rn intrinsics).
SPECDEC_HD float int8_dequantize(int32_t acc, float sx, float sw, float bias) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(__int2float_rn(acc), __fmul_rn(sx, sw)), bias);
#else
  return static_cast<float>(acc) * (sx * sw) + bias;
#endif
}

// Quantises rows: each of x's M rows -> q (zero-padded to ceil(K / 4) * 4 columns) and its scale.
template <typename T>
struct QuantizeRowsInt8Params {
  const T* x;            // [M, K] contiguous
  int64_t rows;          // M
  int64_t in_features;   // K
  int8_t* q;             // [M, ceil(K / 4) * 4]
  float* scales;         // [M]
};

template <typename T>
struct PackLinearInt8Params {
  const T* weight;       // [N, K] contiguous, finite
  int64_t out_features;  // N
  int64_t in_features;   // K
  int8_t* packed;        // [ceil(N / 32), ceil(K / 4), 32, 4]
  float* scales;         // [N]
};

template <typename T>
struct PackedLinearInt8Params {
  const int8_t* qx;        // [M, ceil(K / 4) * 4] (QuantizeRowsInt8Params.q)
  const float* x_scales;   // [M]
  int64_t rows;            // M
  int64_t in_features;     // K
  int64_t out_features;    // N
  const int8_t* packed;    // PackLinearInt8Params layout
  const float* w_scales;   // [N]
  const T* bias;           // [N] or nullptr
  T* y;                    // [M, N] contiguous
};

// ---------------------------------------------------------------------------------------------------------------
// Weight-only int4 linear layers (packed_linear_int4): 4.25 bits a weight, half of int8's bytes, for products bound
// by reading their weights. Group scales in two levels (as llama.cpp's k-quants): a float32 scale per output channel
// and a 6-bit integer multiplier per group of 32 K-values, so that the whole sum stays exact integer arithmetic and
// every path (and the reference) gives the same bits, as packed_linear_int8 does.
//
// Quantisation of a weight row w[K] (float32 operations, each rounded; RNE), groups g of kLinearInt4Group K-values:
//   amax_g = max_{k in g} |w[k]|, amax = max_g amax_g; amax < kInt4TinyAmax gives scale 0, m_g = 0, q = 0; else
//   scale = amax / 441 (= 7 * 63), m_g = clamp(ceil(amax_g * (63 / amax)), 1, 63), step_g = scale * m_g,
//   q[k] = clamp(rint(w[k] / step_g), -7, 7)
// The input rows are quantised as packed_linear_int8's (QuantizeRowsInt8Params, zero-padded to Kp columns). Then
//   acc[m, n] = sum_g m_g[n] sum_{k in g} qx[m, k] q[n, k]  (int32: |acc| <= 63 * 7 * 127 * Kp < 2^31 for Kp <= 32768)
//   y[m, n]   = T(float(acc) * (sx[m] * scale[n]) + bias[n])  (int8_dequantize)
// Layout (Kp = ceil(K / 32) * 32; u = q + 8 in [1, 15], 8 where k >= K):
//   packed[ceil(N / 32), Kp / 8, 32, 4] uint8: byte [n / 32][o][n % 32][e] = u[n][8o + e] | u[n][8o + 4 + e] << 4,
//     so a 32-bit lane's low nibbles are K-quad 2o and its high nibbles K-quad 2o + 1 of output n;
//   group_scales[ceil(N / 32), Kp / 32, 32] uint8 = m_g[n] (0 where n >= N); scales[N] float32.
// Kernels sum u * qx (unsigned by signed bytes: the dot-product instructions' operand kinds) and take off the
// offset 8 * sum_{k in g} qx[m, k] per row and group (x_offsets, computed once per call).
constexpr int64_t kLinearInt4Group = 32;
constexpr int64_t kLinearInt4Octet = 8;  // K-values of one 32-bit lane of packed bytes
constexpr int64_t kLinearInt4MaxK = 32768;
constexpr int kInt4MaxMultiplier = 63;
constexpr float kInt4TinyAmax = 0x1p-100f;  // (every step_g is a normal float above it)

SPECDEC_HD int64_t linear_int4_padded_k(int64_t K) {
  return (K + kLinearInt4Group - 1) / kLinearInt4Group * kLinearInt4Group;
}

// m_g of a group whose largest magnitude is `group_amax`, in a row whose largest is `amax` (>= kInt4TinyAmax).
SPECDEC_HD int int4_group_multiplier(float group_amax, float amax) {
#if defined(__CUDA_ARCH__)
  const float r = ceilf(__fmul_rn(group_amax, __fdiv_rn(63.0f, amax)));
#else
  const float r = ceilf(group_amax * (63.0f / amax));
#endif
  return r < 1.0f ? 1 : (r > 63.0f ? 63 : static_cast<int>(r));
}

// The row scale amax / 441.
SPECDEC_HD float int4_row_scale(float amax) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(amax, 441.0f);
#else
  return amax / 441.0f;
#endif
}

// q of one weight value in a group of multiplier m (row scale `scale` > 0).
SPECDEC_HD int int4_quantize(float w, float scale, int m) {
#if defined(__CUDA_ARCH__)
  const float r = rintf(__fdiv_rn(w, __fmul_rn(scale, static_cast<float>(m))));
#else
  const float r = rintf(w / (scale * static_cast<float>(m)));
#endif
  return r > 7.0f ? 7 : (r < -7.0f ? -7 : static_cast<int>(r));
}

template <typename T>
struct PackLinearInt4Params {
  const T* weight;         // [N, K] contiguous, finite
  int64_t out_features;    // N
  int64_t in_features;     // K
  uint8_t* packed;         // [ceil(N / 32), Kp / 8, 32, 4]
  uint8_t* group_scales;   // [ceil(N / 32), Kp / 32, 32]
  float* scales;           // [N]
};

template <typename T>
struct PackedLinearInt4Params {
  const int8_t* qx;            // [M, Kp] (QuantizeRowsInt8Params.q of x zero-padded to Kp columns)
  const float* x_scales;       // [M]
  int32_t* x_offsets;          // [M, Kp / 32] scratch: 8 * each group's sum of qx (the product's first stage)
  int64_t rows;                // M
  int64_t in_features;         // K
  int64_t out_features;        // N
  const uint8_t* packed;       // PackLinearInt4Params layout
  const uint8_t* group_scales;
  const float* w_scales;       // [N]
  const T* bias;               // [N] or nullptr
  T* y;                        // [M, N] contiguous
};

// ---------------------------------------------------------------------------------------------------------------
// A drafter's decoder layer (draft_decoder_layer): one Llama decoder layer over T new positions of each of B rows,
// with its own KV cache written at explicit slots (an EAGLE draft's chains and tree levels). Rows r = b * T + t.
// Widths: Din (attention input), H (hidden), I (intermediate); nH query and nKV key/value heads of D dims, Q = (nH
// + 2 nKV) D. Products are packed_linear's (one float32 accumulation per element, rounded to T) or, for a weight
// packed as int8, packed_linear_int8's; every other intermediate is rounded to T where torch rounds a module's T
// tensors:
//   a    = x, or with input_norm: each of the `input_norm_segments` equal segments of x RMS-normalised on its own
//          (torch's RMSNorm: w * T(x * rsqrt(mean(x^2) + eps)))                               [rows, Din]
//   qkv  = a Wqkv^T + bqkv: nH query heads, then nKV key heads, then nKV value heads             [rows, Q]
//   q, k = RoPE (rotate-half) at position_ids[b, t], angles position * inv_freq[i] in float32
//   k_cache / v_cache[b, g, write_slots[b, t]] = the key / value of kv head g (a row's duplicate slots keep one)
//   o    = softmax(q . k / sqrt(D)) v over cache slots s < kv_len with mask[b, t, s]; query head h reads kv head
//          h / (nH / nKV) (TreeAttention with prefix 0 and Nk = kv_len)                        [rows, nH D]
//   h1   = residual + o Wo^T
//   out  = h1 + Wdown^T (silu(g) * u), (g | u) = RMSNorm(h1; norm_weight) Wgu^T                    [rows, H]
// A row b with a write slot outside [0, S) gets kBadWriteSlot (node = t) and writes none of its slots.
constexpr int64_t kMaxDraftHeadDim = 256;  // (tree attention's head dims: 64, 80, 96, 128, 256)

// One product's weight: packed by pack_linear_weight (`packed`), or by pack_linear_weight_int8 (`packed_int8` and
// its per-output-channel `scales`; the product is then packed_linear_int8's, its input rows quantised into the
// layer's qx buffer first). Exactly one of `packed` and `packed_int8` is set.
template <typename T>
struct DraftLayerWeight {
  const T* packed = nullptr;
  const int8_t* packed_int8 = nullptr;
  const uint8_t* packed_int4 = nullptr;
  const uint8_t* group_scales = nullptr;  // with packed_int4
  const float* scales = nullptr;  // [N], with packed_int8 or packed_int4
};

template <typename T>
struct DraftLayerParams {
  // Wqkv [Q, Din], Wo [H, nH D], Wgu [2I, H] (gate rows, then up rows), Wdown [H, I]; each float, int8 or int4.
  DraftLayerWeight<T> qkv_weight, o_weight, gate_up_weight, down_weight;
  const T* x;                  // [rows, Din] contiguous
  const T* input_norm_weight;  // [Din] or nullptr
  int64_t input_norm_segments;
  const T* residual;           // [rows, H] contiguous
  const T* qkv_bias;           // [Q] or nullptr
  const T* norm_weight;        // [H] (post-attention RMSNorm)
  float eps;
  const int64_t* position_ids;  // [B, T] contiguous
  const float* inv_freq;        // [D / 2]
  T* k_cache;                   // [B, nKV, S, D] contiguous
  T* v_cache;
  const int64_t* write_slots;  // [B, T] contiguous
  int64_t batch, tokens, in_features, hidden, intermediate, num_heads, num_kv_heads, head_dim, seq_len;
  // Buffers between the stages (contiguous): normed_input [rows, Din] (with input_norm), qkv [rows, Q],
  // heads [B, nH, T, D] (the attention's output), attn [rows, nH D], h1 [rows, H], normed [rows, H],
  // gate_up [rows, 2I], act [rows, I], down [rows, H].
  T *normed_input, *qkv, *heads, *attn, *h1, *normed, *gate_up, *act, *down;
  // With an int8 or int4 weight: one product's input rows quantised, [rows, ceil(max K / 4) * 4] and [rows] (else
  // nullptr); with an int4 weight also their group offsets, [rows, max K / 32] (else nullptr).
  int8_t* qx;
  float* qx_scales;
  int32_t* qx_offsets;
  T* out;             // [rows, H]
  RowStatus* status;  // [B]
};

// The four products of a draft layer: packed_linear calls, or for an int8 (int4) weight the two stages of
// packed_linear_int8 (packed_linear_int4): draft_layer_quantize, then draft_layer_product_int8 (_int4). An int4
// weight's in_features are whole groups (the glue checks), so its input rows need no padding.
enum DraftLayerProduct { kDraftQkv, kDraftO, kDraftGateUp, kDraftDown };

template <typename T>
const DraftLayerWeight<T>& draft_layer_weight(const DraftLayerParams<T>& p, DraftLayerProduct which) {
  switch (which) {
    case kDraftQkv: return p.qkv_weight;
    case kDraftO: return p.o_weight;
    case kDraftGateUp: return p.gate_up_weight;
    default: return p.down_weight;
  }
}

template <typename T>
PackedLinearParams<T> draft_layer_product(const DraftLayerParams<T>& p, DraftLayerProduct which) {
  const int64_t rows = p.batch * p.tokens, D = p.head_dim, Q = (p.num_heads + 2 * p.num_kv_heads) * D;
  const T* packed = draft_layer_weight(p, which).packed;
  switch (which) {
    case kDraftQkv:
      return {.x = p.input_norm_weight != nullptr ? p.normed_input : p.x, .rows = rows,
              .in_features = p.in_features, .out_features = Q, .packed = packed, .bias = p.qkv_bias,
              .y = p.qkv};
    case kDraftO:
      return {.x = p.attn, .rows = rows, .in_features = p.num_heads * D, .out_features = p.hidden,
              .packed = packed, .bias = nullptr, .y = p.h1};
    case kDraftGateUp:
      return {.x = p.normed, .rows = rows, .in_features = p.hidden, .out_features = 2 * p.intermediate,
              .packed = packed, .bias = nullptr, .y = p.gate_up};
    default:
      return {.x = p.act, .rows = rows, .in_features = p.intermediate, .out_features = p.hidden,
              .packed = packed, .bias = nullptr, .y = p.down};
  }
}

template <typename T>
QuantizeRowsInt8Params<T> draft_layer_quantize(const DraftLayerParams<T>& p, DraftLayerProduct which) {
  const PackedLinearParams<T> f = draft_layer_product(p, which);
  return {.x = f.x, .rows = f.rows, .in_features = f.in_features, .q = p.qx, .scales = p.qx_scales};
}

template <typename T>
PackedLinearInt8Params<T> draft_layer_product_int8(const DraftLayerParams<T>& p, DraftLayerProduct which) {
  const PackedLinearParams<T> f = draft_layer_product(p, which);
  const DraftLayerWeight<T>& w = draft_layer_weight(p, which);
  return {.qx = p.qx, .x_scales = p.qx_scales, .rows = f.rows, .in_features = f.in_features,
          .out_features = f.out_features, .packed = w.packed_int8, .w_scales = w.scales, .bias = f.bias, .y = f.y};
}

template <typename T>
PackedLinearInt4Params<T> draft_layer_product_int4(const DraftLayerParams<T>& p, DraftLayerProduct which) {
  const PackedLinearParams<T> f = draft_layer_product(p, which);
  const DraftLayerWeight<T>& w = draft_layer_weight(p, which);
  return {.qx = p.qx, .x_scales = p.qx_scales, .x_offsets = p.qx_offsets, .rows = f.rows,
          .in_features = f.in_features, .out_features = f.out_features, .packed = w.packed_int4,
          .group_scales = w.group_scales, .w_scales = w.scales, .bias = f.bias, .y = f.y};
}

// The layer's attention as tree attention: the T new positions of a row are its nodes, prefix 0 (`zero_prefix`:
// B zeros) and all kv_len masked slots are tree keys; queries are read from the qkv buffer (after RoPE).
template <typename T>
TreeAttentionParams<T> draft_layer_attention(const DraftLayerParams<T>& p, const bool* mask, int64_t kv_len,
                                             const int64_t* zero_prefix, float* workspace, int64_t workspace_floats,
                                             RowStatus* status) {
  const int64_t D = p.head_dim, Q = (p.num_heads + 2 * p.num_kv_heads) * D, S = p.seq_len;
  return {.q = p.qkv, .q_stride_b = p.tokens * Q, .q_stride_h = D, .q_stride_n = Q,
          .k = p.k_cache, .k_stride_b = p.num_kv_heads * S * D, .k_stride_h = S * D, .k_stride_s = D,
          .v = p.v_cache, .v_stride_b = p.num_kv_heads * S * D, .v_stride_h = S * D, .v_stride_s = D,
          .prefix_lens = zero_prefix, .mask_dense = mask, .mask_packed = nullptr,
          .batch = p.batch, .num_heads = p.num_heads, .num_kv_heads = p.num_kv_heads, .num_nodes = p.tokens,
          .num_tree_keys = kv_len, .head_dim = D, .seq_len = S,
          .scale = 1.0f / std::sqrt(static_cast<float>(D)), .out = p.heads, .workspace = workspace,
          .workspace_floats = workspace_floats, .status = status};
}

// compact_kv: for every cache c, row b and i < lengths[b]:
//   cache_c[b, ..., dst_start[b] + i, ...] = OLD cache_c[b, ..., src_positions[b, i], ...]
// (all reads of a row happen before its writes, so overlapping source and destination ranges are fine; the glue
// refuses caches that share memory, and index tensors over a cache's memory, which would be moved twice). Each
// cache is contiguous and viewed as [B, outer, S, inner] bytes-wise: outer = the dims between batch and the
// sequence dim (Hkv for the HF layout [B, Hkv, S, D], 1 for a flat [B, S, F]), inner = elem_size * the dims after.
// A row fails (and is left untouched in every cache) when lengths[b] is not in [0, L] (kBadLength), dst_start[b]
// < 0 or dst_start[b] + lengths[b] > S (kBadDstStart), or some src_positions[b, i < lengths[b]] is not in [0, S)
// (kBadSrcPosition, the first such i). Caches are passed by value, kMaxCaches per call (the glue splits longer
// lists); `write_status` is set for the call holding the first cache only.
struct CompactKvParams {
  static constexpr int kMaxCaches = 128;
  void* caches[kMaxCaches];
  int64_t num_caches;  // <= kMaxCaches
  int64_t batch;
  int64_t outer;
  int64_t seq_len;      // S
  int64_t inner_bytes;  // bytes of one (b, outer, position) slice
  const int64_t* src_positions;  // [B, L]
  int64_t max_len;               // L
  const int64_t* dst_start;      // [B]
  const int64_t* lengths;        // [B]
  bool write_status;
  RowStatus* status;  // [B]
};

// The status of one compact_kv row (kOk or the first failure), shared by both devices.
SPECDEC_HD RowStatus compact_kv_row_status(const CompactKvParams& p, int64_t b) {
  const int64_t len = p.lengths[b], dst = p.dst_start[b];
  if (len < 0 || len > p.max_len) return RowStatus{kBadLength, 0, len};
  if (dst < 0 || dst > p.seq_len - len) return RowStatus{kBadDstStart, 0, dst};
  for (int64_t i = 0; i < len; ++i) {
    const int64_t s = p.src_positions[b * p.max_len + i];
    if (s < 0 || s >= p.seq_len) return RowStatus{kBadSrcPosition, i, s};
  }
  return RowStatus{kOk, 0, 0};
}

}  // namespace specdec

// The recurrent (hybrid-target) tree ops' parameters.
#include "recurrent_params.h"  // NOLINT(build/include_order)
