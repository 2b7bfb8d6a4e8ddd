// CUDA backend: runs the torch-free CUDA kernel launchers on the current stream (csrc/kernels/cuda/kernels.cuh).
// The glue (op_glue.h) has already set the device guard, checked arguments and allocated outputs; launchers
// check their own launch errors.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <stdexcept>

#include "../kernels/cuda/kernels.cuh"
#include "op_glue.h"

namespace specdec::glue {
namespace {

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Runs a launcher; its std::invalid_argument (sizes beyond the kernel's grid limits) is an argument error, raised
// as ValueError like every other (checks.h).
template <typename Launch>
void launch(Launch&& run) {
  try {
    run();
  } catch (const std::invalid_argument& e) {
    SPECDEC_CHECK(false, e.what());
  }
}

struct CudaBackend {
  static constexpr bool kExpandNeedsNodeStatus = false;
  static void build_tree(const BuildTreeParams& p) { launch([&] { cuda::LaunchBuildTree(p, current_stream()); }); }
  static void tree_ancestor_mask(const TreeMaskParams& p) {
    launch([&] { cuda::LaunchTreeAncestorMask(p, current_stream()); });
  }
  static void advance_tree_frontier(const AdvanceTreeFrontierParams& p) {
    launch([&] { cuda::LaunchAdvanceTreeFrontier(p, current_stream()); });
  }
  static void select_tree_nodes(const SelectTreeNodesParams& p) {
    launch([&] { cuda::LaunchSelectTreeNodes(p, current_stream()); });
  }
  template <typename T>
  static void verify_tree_greedy(const VerifyTreeGreedyParams<T>& p) {
    launch([&] { cuda::LaunchVerifyTreeGreedy<T>(p, current_stream()); });
  }
  template <typename T>
  static void verify_tree_sampling(const VerifyTreeSamplingParams<T>& p) {
    launch([&] { cuda::LaunchVerifyTreeSampling<T>(p, current_stream()); });
  }
  template <typename T>
  static void verify_tree_typical(const VerifyTreeTypicalParams<T>& p) {
    launch([&] { cuda::LaunchVerifyTreeTypical<T>(p, current_stream()); });
  }
  template <typename T>
  static void sample_tokens(const SampleTokensParams<T>& p) {
    launch([&] { cuda::LaunchSampleTokens<T>(p, current_stream()); });
  }
  template <typename T>
  static void expand_tree_step(const ExpandTreeStepParams<T>& p) {
    launch([&] { cuda::LaunchExpandTreeStep<T>(p, current_stream()); });
  }
  static int64_t tree_attention_workspace_floats(int64_t B, int64_t H, int64_t Hkv, int64_t N, int64_t D,
                                                 int64_t S) {
    return cuda::TreeAttentionWorkspaceFloats(B, H, Hkv, N, D, S);
  }
  template <typename T>
  static void tree_attention(const TreeAttentionParams<T>& p) {
    launch([&] { cuda::LaunchTreeAttention<T>(p, current_stream()); });
  }
  static void compact_kv(const CompactKvParams& p) { launch([&] { cuda::LaunchCompactKv(p, current_stream()); }); }
  template <typename T>
  static void pack_linear_weight(const PackLinearWeightParams<T>& p) {
    launch([&] { cuda::LaunchPackLinearWeight<T>(p, current_stream()); });
  }
  template <typename T>
  static void packed_linear(const PackedLinearParams<T>& p) {
    launch([&] { cuda::LaunchPackedLinear<T>(p, current_stream()); });
  }
  template <typename T>
  static void quantize_rows_int8(const QuantizeRowsInt8Params<T>& p) {
    launch([&] { cuda::LaunchQuantizeRowsInt8<T>(p, current_stream()); });
  }
  template <typename T>
  static void pack_linear_weight_int8(const PackLinearInt8Params<T>& p) {
    launch([&] { cuda::LaunchPackLinearWeightInt8<T>(p, current_stream()); });
  }
  template <typename T>
  static void packed_linear_int8(const PackedLinearInt8Params<T>& p) {
    launch([&] { cuda::LaunchPackedLinearInt8<T>(p, current_stream()); });
  }
  template <typename T>
  static void pack_linear_weight_int4(const PackLinearInt4Params<T>& p) {
    launch([&] { cuda::LaunchPackLinearWeightInt4<T>(p, current_stream()); });
  }
  template <typename T>
  static void packed_linear_int4(const PackedLinearInt4Params<T>& p) {
    launch([&] { cuda::LaunchPackedLinearInt4<T>(p, current_stream()); });
  }
  // One of a draft layer's products: packed_linear's kernel, or packed_linear_int8's (_int4's) for an int8 (int4)
  // weight.
  template <typename T>
  static void launch_draft_layer_linear(const DraftLayerParams<T>& p, DraftLayerProduct which, cudaStream_t s) {
    const DraftLayerWeight<T>& w = draft_layer_weight(p, which);
    if (w.packed_int8 == nullptr && w.packed_int4 == nullptr)
      return cuda::LaunchPackedLinear<T>(draft_layer_product(p, which), s);
    cuda::LaunchQuantizeRowsInt8<T>(draft_layer_quantize(p, which), s);
    if (w.packed_int8 != nullptr) return cuda::LaunchPackedLinearInt8<T>(draft_layer_product_int8(p, which), s);
    cuda::LaunchPackedLinearInt4<T>(draft_layer_product_int4(p, which), s);
  }
  // The stages of DraftLayerParams in order on the current stream (the products through packed_linear's kernels or
  // packed_linear_int8's, the attention through tree_attention's).
  template <typename T>
  static void draft_decoder_layer(const DraftLayerParams<T>& p, const TreeAttentionParams<T>& attention) {
    const cudaStream_t s = current_stream();
    launch([&] {
      if (p.input_norm_weight != nullptr) cuda::LaunchDraftLayerInputNorm<T>(p, s);
      launch_draft_layer_linear(p, kDraftQkv, s);
      cuda::LaunchDraftLayerRopeCache<T>(p, s);
      cuda::LaunchTreeAttention<T>(attention, s);
      cuda::LaunchDraftLayerGatherHeads<T>(p, s);
      launch_draft_layer_linear(p, kDraftO, s);
      cuda::LaunchDraftLayerAddNorm<T>(p, s);
      launch_draft_layer_linear(p, kDraftGateUp, s);
      cuda::LaunchDraftLayerSwiGlu<T>(p, s);
      launch_draft_layer_linear(p, kDraftDown, s);
      cuda::LaunchDraftLayerResidual<T>(p, s);
    });
  }
};

// The recurrent tree ops (op_glue_recurrent.h), on the current stream.
struct CudaRecurrentBackend {
  template <typename T>
  static void tree_linear_attention(const TreeLinearAttentionParams<T>& p) {
    launch([&] { cuda::LaunchTreeLinearAttention<T>(p, current_stream()); });
  }
  template <typename T>
  static void commit_linear_state(const CommitLinearStateParams<T>& p) {
    launch([&] { cuda::LaunchCommitLinearState<T>(p, current_stream()); });
  }
  template <typename T>
  static void tree_causal_conv1d(const TreeCausalConv1dParams<T>& p) {
    launch([&] { cuda::LaunchTreeCausalConv1d<T>(p, current_stream()); });
  }
  template <typename T>
  static void commit_conv_state(const CommitConvStateParams<T>& p) {
    launch([&] { cuda::LaunchCommitConvState<T>(p, current_stream()); });
  }
  template <typename T>
  static void tree_gated_delta_rule(const TreeGatedDeltaParams<T>& p) {
    launch([&] { cuda::LaunchTreeGatedDelta<T>(p, current_stream()); });
  }
  template <typename T>
  static void commit_gated_delta_state(const CommitGatedDeltaParams<T>& p) {
    launch([&] { cuda::LaunchCommitGatedDelta<T>(p, current_stream()); });
  }
  template <typename T>
  static void tree_selective_state(const TreeSelectiveStateParams<T>& p) {
    launch([&] { cuda::LaunchTreeSelectiveState<T>(p, current_stream()); });
  }
  template <typename T>
  static void commit_selective_state(const CommitSelectiveStateParams<T>& p) {
    launch([&] { cuda::LaunchCommitSelectiveState<T>(p, current_stream()); });
  }
};

}  // namespace

SPECDEC_REGISTER_BACKEND(specdec_ext, CUDA, CudaBackend)
SPECDEC_REGISTER_RECURRENT(specdec_ext, CUDA, CudaRecurrentBackend)

}  // namespace specdec::glue
