// Meta backend: the glue's argument checks with no kernel behind them, registered as the Meta kernels of the
// specdec_ext_checks library (registry.cpp).
//
// A call with a meta tensor among its arguments goes to the op's fake (specdec_ext/ops/fakes.py), which computes
// only output shapes. The fake first calls the same op in specdec_ext_checks, which runs `<op>_impl<MetaBackend>`:
// every shape, dtype, device and scalar check the CPU and CUDA backends run, word for word, so meta calls are refused
// exactly where real ones are (and meta mixed with CPU or CUDA tensors fails the glue's same-device checks). Data
// checks need data: raise_on_bad_status skips a meta status.
#include <torch/library.h>

#include "op_glue.h"

namespace specdec::glue {
namespace {

struct MetaBackend {
  static constexpr bool kExpandNeedsNodeStatus = false;
  static void build_tree(const BuildTreeParams&) {}
  static void tree_ancestor_mask(const TreeMaskParams&) {}
  static void advance_tree_frontier(const AdvanceTreeFrontierParams&) {}
  static void select_tree_nodes(const SelectTreeNodesParams&) {}
  template <typename T>
  static void verify_tree_greedy(const VerifyTreeGreedyParams<T>&) {}
  template <typename T>
  static void verify_tree_sampling(const VerifyTreeSamplingParams<T>&) {}
  template <typename T>
  static void verify_tree_typical(const VerifyTreeTypicalParams<T>&) {}
  template <typename T>
  static void sample_tokens(const SampleTokensParams<T>&) {}
  template <typename T>
  static void expand_tree_step(const ExpandTreeStepParams<T>&) {}
  static int64_t tree_attention_workspace_floats(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) { return 0; }
  template <typename T>
  static void tree_attention(const TreeAttentionParams<T>&) {}
  static void compact_kv(const CompactKvParams&) {}
  template <typename T>
  static void pack_linear_weight(const PackLinearWeightParams<T>&) {}
  template <typename T>
  static void packed_linear(const PackedLinearParams<T>&) {}
  template <typename T>
  static void quantize_rows_int8(const QuantizeRowsInt8Params<T>&) {}
  template <typename T>
  static void pack_linear_weight_int8(const PackLinearInt8Params<T>&) {}
  template <typename T>
  static void packed_linear_int8(const PackedLinearInt8Params<T>&) {}
  template <typename T>
  static void pack_linear_weight_int4(const PackLinearInt4Params<T>&) {}
  template <typename T>
  static void packed_linear_int4(const PackedLinearInt4Params<T>&) {}
  template <typename T>
  static void draft_decoder_layer(const DraftLayerParams<T>&, const TreeAttentionParams<T>&) {}
};

struct MetaRecurrentBackend {
  template <typename T>
  static void tree_linear_attention(const TreeLinearAttentionParams<T>&) {}
  template <typename T>
  static void commit_linear_state(const CommitLinearStateParams<T>&) {}
  template <typename T>
  static void tree_causal_conv1d(const TreeCausalConv1dParams<T>&) {}
  template <typename T>
  static void commit_conv_state(const CommitConvStateParams<T>&) {}
  template <typename T>
  static void tree_gated_delta_rule(const TreeGatedDeltaParams<T>&) {}
  template <typename T>
  static void commit_gated_delta_state(const CommitGatedDeltaParams<T>&) {}
  template <typename T>
  static void tree_selective_state(const TreeSelectiveStateParams<T>&) {}
  template <typename T>
  static void commit_selective_state(const CommitSelectiveStateParams<T>&) {}
};

}  // namespace

SPECDEC_REGISTER_BACKEND(specdec_ext_checks, Meta, MetaBackend)
SPECDEC_REGISTER_RECURRENT(specdec_ext_checks, Meta, MetaRecurrentBackend)

}  // namespace specdec::glue
