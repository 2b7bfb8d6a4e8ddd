// CPU backend: runs the torch-free CPU kernels over batch rows in parallel (at::parallel_for).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "../kernels/cpu/kernels.h"
#include "op_glue.h"
#include "split_guard.h"

namespace specdec::glue {
namespace {

// Rows are independent. A parallel region costs tens of microseconds, so rows are only split across threads when
// each thread gets at least ~64k elements of work (`work_per_row` estimates one row's), and only while split
// regions pay on this machine now (split_guard.h: beside a busy process they can cost milliseconds).
template <typename Params, typename Kernel>
void for_rows(const Params& p, int64_t rows, int64_t work_per_row, Kernel kernel,
              int64_t min_work_per_thread = int64_t{1} << 16) {
  const int64_t grain = std::max<int64_t>(1, min_work_per_thread / std::max<int64_t>(1, work_per_row));
  // (at::parallel_for's own test for running inline, first: such calls are neither timed nor guarded)
  if (rows <= grain || rows <= 1 || at::get_num_threads() <= 1 || at::in_parallel_region() ||
      !split_guard().allowed()) {
    if (rows > 0) kernel(p, 0, rows);
    return;
  }
  std::atomic<int64_t> work_ns{0};
  const int64_t start = SplitGuard::now_ns();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const int64_t t0 = SplitGuard::now_ns();
    kernel(p, begin, end);
    work_ns.fetch_add(SplitGuard::now_ns() - t0, std::memory_order_relaxed);
  });
  const int64_t end = SplitGuard::now_ns();
  split_guard().record(work_ns.load(), end - start, end);
}

struct CpuBackend {
  static constexpr bool kExpandNeedsNodeStatus = true;  // expand_tree_step runs nodes, then rows
  static void build_tree(const BuildTreeParams& p) {
    for_rows(p, p.batch, p.num_nodes * p.num_nodes, cpu::BuildTree);
  }
  static void tree_ancestor_mask(const TreeMaskParams& p) {
    for_rows(p, p.batch, p.num_nodes * p.num_nodes, cpu::TreeAncestorMask);
  }
  static void advance_tree_frontier(const AdvanceTreeFrontierParams& p) {
    for_rows(p, p.batch, p.num_select * (p.columns + p.positions), cpu::AdvanceTreeFrontier);
  }
  static void select_tree_nodes(const SelectTreeNodesParams& p) {
    for_rows(p, p.batch, 8 * p.candidates, cpu::SelectTreeNodes);
  }
  template <typename T>
  static void verify_tree_greedy(const VerifyTreeGreedyParams<T>& p) {
    for_rows(p, p.batch, p.vocab, cpu::VerifyTreeGreedy<T>);
  }
  template <typename T>
  static void verify_tree_sampling(const VerifyTreeSamplingParams<T>& p) {
    for_rows(p, p.batch, 4 * p.vocab, cpu::VerifyTreeSampling<T>);
  }
  template <typename T>
  static void verify_tree_typical(const VerifyTreeTypicalParams<T>& p) {
    for_rows(p, p.batch, 4 * p.vocab, cpu::VerifyTreeTypical<T>);
  }
  template <typename T>
  static void sample_tokens(const SampleTokensParams<T>& p) {
    for_rows(p, p.rows, 4 * p.vocab, cpu::SampleTokens<T>);
  }
  template <typename T>
  static void expand_tree_step(const ExpandTreeStepParams<T>& p) {
    // Frontier nodes in parallel (EAGLE-2 runs at B = 1 with ~10 nodes), then each row's selection.
    for_rows(p, p.batch * p.frontier, 2 * p.vocab, cpu::ExpandTreeStepNodes<T>);
    for_rows(p, p.batch, p.frontier * p.top_k, cpu::ExpandTreeStepSelect<T>);
  }
  // Tasks are (row, kv head) pairs that each read one kv head's whole cache prefix: one task per thread chunk.
  static int64_t tree_attention_workspace_floats(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) { return 0; }
  template <typename T>
  static void tree_attention(const TreeAttentionParams<T>& p) {
    // Work from the rows' actual prefixes (host memory on this backend), not the cache capacity: a one-token
    // decoding step over a short prefix is tens of microseconds and must not pay for a parallel region.
    int64_t longest = 0;
    for (int64_t b = 0; b < p.batch; ++b) longest = std::max(longest, p.prefix_lens[b]);
    const int64_t G = p.num_heads / p.num_kv_heads;
    const int64_t flops = 4 * G * p.num_nodes * (std::min(longest, p.seq_len) + p.num_tree_keys) * p.head_dim;
    for_rows(p, p.batch * p.num_kv_heads, flops, cpu::TreeAttention<T>, /*min_work_per_thread=*/int64_t{1} << 21);
  }
  static void compact_kv(const CompactKvParams& p) {
    for_rows(p, p.num_caches * p.batch, std::max<int64_t>(1, p.outer * p.max_len * p.inner_bytes / 4),
             cpu::CompactKv);
  }
  // Panels of 32 output features are independent; threads only for products of >= ~256k multiply-adds each.
  template <typename T>
  static void pack_linear_weight(const PackLinearWeightParams<T>& p) {
    for_rows(p, (p.out_features + kLinearPanel - 1) / kLinearPanel, kLinearPanel * p.in_features,
             cpu::PackLinearWeight<T>);
  }
  template <typename T>
  static void packed_linear(const PackedLinearParams<T>& p) {
    for_rows(p, (p.out_features + kLinearPanel - 1) / kLinearPanel, kLinearPanel * p.in_features * p.rows,
             cpu::PackedLinear<T>, /*min_work_per_thread=*/int64_t{1} << 18);
  }
  template <typename T>
  static void quantize_rows_int8(const QuantizeRowsInt8Params<T>& p) {
    for_rows(p, p.rows, 4 * p.in_features, cpu::QuantizeRowsInt8<T>);
  }
  template <typename T>
  static void pack_linear_weight_int8(const PackLinearInt8Params<T>& p) {
    for_rows(p, (p.out_features + kLinearPanel - 1) / kLinearPanel, 4 * kLinearPanel * p.in_features,
             cpu::PackLinearWeightInt8<T>);
  }
  // (int8 multiply-adds cost a fraction of float32 ones: threads only for products 4x larger than packed_linear's)
  template <typename T>
  static void packed_linear_int8(const PackedLinearInt8Params<T>& p) {
    for_rows(p, (p.out_features + kLinearPanel - 1) / kLinearPanel, kLinearPanel * p.in_features * p.rows,
             cpu::PackedLinearInt8<T>, /*min_work_per_thread=*/int64_t{1} << 20);
  }
  template <typename T>
  static void pack_linear_weight_int4(const PackLinearInt4Params<T>& p) {
    for_rows(p, (p.out_features + kLinearPanel - 1) / kLinearPanel, 8 * kLinearPanel * p.in_features,
             cpu::PackLinearWeightInt4<T>);
  }
  // (as packed_linear_int8: the same dot products, half the bytes)
  template <typename T>
  static void packed_linear_int4(const PackedLinearInt4Params<T>& p) {
    for_rows(p, p.rows, p.in_features, cpu::LinearInt4Offsets<T>);
    for_rows(p, (p.out_features + kLinearPanel - 1) / kLinearPanel, kLinearPanel * p.in_features * p.rows,
             cpu::PackedLinearInt4<T>, /*min_work_per_thread=*/int64_t{1} << 20);
  }
  // One of a draft layer's products: packed_linear, or packed_linear_int8's (_int4's) two stages for an int8
  // (int4) weight.
  template <typename T>
  static void draft_layer_linear(const DraftLayerParams<T>& p, DraftLayerProduct which) {
    const DraftLayerWeight<T>& w = draft_layer_weight(p, which);
    if (w.packed_int8 == nullptr && w.packed_int4 == nullptr) return packed_linear(draft_layer_product(p, which));
    quantize_rows_int8(draft_layer_quantize(p, which));
    if (w.packed_int8 != nullptr) return packed_linear_int8(draft_layer_product_int8(p, which));
    packed_linear_int4(draft_layer_product_int4(p, which));
  }
  // The stages of DraftLayerParams in order; the products and the attention as packed_linear (or
  // packed_linear_int8) and tree_attention.
  template <typename T>
  static void draft_decoder_layer(const DraftLayerParams<T>& p, const TreeAttentionParams<T>& attention) {
    const int64_t rows = p.batch * p.tokens, H = p.hidden;
    if (p.input_norm_weight != nullptr) for_rows(p, rows, 4 * p.in_features, cpu::DraftLayerInputNorm<T>);
    draft_layer_linear(p, kDraftQkv);
    for_rows(p, p.batch, 8 * p.tokens * (p.num_heads + 2 * p.num_kv_heads) * p.head_dim,
             cpu::DraftLayerRopeCache<T>);
    tree_attention(attention);
    for_rows(p, rows, p.num_heads * p.head_dim, cpu::DraftLayerGatherHeads<T>);
    draft_layer_linear(p, kDraftO);
    for_rows(p, rows, 8 * H, cpu::DraftLayerAddNorm<T>);
    draft_layer_linear(p, kDraftGateUp);
    for_rows(p, rows, 8 * p.intermediate, cpu::DraftLayerSwiGlu<T>);
    draft_layer_linear(p, kDraftDown);
    for_rows(p, rows, 2 * H, cpu::DraftLayerResidual<T>);
  }
};

// The recurrent tree ops (op_glue_recurrent.h): tasks are (row, head) pairs or (row, channel block) pairs.
struct CpuRecurrentBackend {
  template <typename T>
  static void tree_linear_attention(const TreeLinearAttentionParams<T>& p) {
    const int64_t N = p.num_nodes;
    for_rows(p, p.batch * p.num_heads, N * (p.key_dim * p.value_dim + 4 * (p.key_dim + p.value_dim)),
             cpu::TreeLinearAttention<T>);
  }
  template <typename T>
  static void commit_linear_state(const CommitLinearStateParams<T>& p) {
    for_rows(p, p.batch * p.num_heads, p.max_len * p.key_dim * p.value_dim, cpu::CommitLinearState<T>);
  }
  template <typename T>
  static void tree_causal_conv1d(const TreeCausalConv1dParams<T>& p) {
    for_rows(p, p.batch * conv_channel_blocks(p.channels), kConvChannelBlock * p.num_nodes * p.width,
             cpu::TreeCausalConv1d<T>);
  }
  template <typename T>
  static void commit_conv_state(const CommitConvStateParams<T>& p) {
    for_rows(p, p.batch * conv_channel_blocks(p.channels), kConvChannelBlock * (p.window + 1),
             cpu::CommitConvState<T>);
  }
  template <typename T>
  static void tree_gated_delta_rule(const TreeGatedDeltaParams<T>& p) {
    for_rows(p, p.batch * p.num_heads, 4 * p.num_nodes * p.key_dim * p.value_dim, cpu::TreeGatedDelta<T>);
  }
  template <typename T>
  static void commit_gated_delta_state(const CommitGatedDeltaParams<T>& p) {
    for_rows(p, p.batch * p.num_heads, 3 * p.max_len * p.key_dim * p.value_dim, cpu::CommitGatedDelta<T>);
  }
  template <typename T>
  static void tree_selective_state(const TreeSelectiveStateParams<T>& p) {
    for_rows(p, p.batch * p.num_heads, 4 * p.num_nodes * p.head_dim * p.state_dim, cpu::TreeSelectiveState<T>);
  }
  template <typename T>
  static void commit_selective_state(const CommitSelectiveStateParams<T>& p) {
    for_rows(p, p.batch * p.num_heads, 2 * p.max_len * p.head_dim * p.state_dim, cpu::CommitSelectiveState<T>);
  }
};

}  // namespace

SPECDEC_REGISTER_BACKEND(specdec_ext, CPU, CpuBackend)
SPECDEC_REGISTER_RECURRENT(specdec_ext, CPU, CpuRecurrentBackend)

}  // namespace specdec::glue
