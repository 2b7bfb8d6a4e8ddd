// CUDA kernel launchers: raw device pointers (no torch), enqueued on `stream`, no host synchronisation.
// Semantics: common/params.h; executable specification: specdec_ext/ops/reference.py. Every launcher handles
// B >= 1 and any N, V the CPU kernels handle, and never reads or writes out of bounds whatever the data. Sizes
// beyond a launcher's grid limits throw std::invalid_argument (the glue raises it as a ValueError); CUDA runtime
// failures throw std::runtime_error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/dtype.h"
#include "../common/params.h"

namespace specdec::cuda {

void LaunchBuildTree(const BuildTreeParams& p, cudaStream_t stream);
void LaunchTreeAncestorMask(const TreeMaskParams& p, cudaStream_t stream);
void LaunchAdvanceTreeFrontier(const AdvanceTreeFrontierParams& p, cudaStream_t stream);
void LaunchSelectTreeNodes(const SelectTreeNodesParams& p, cudaStream_t stream);

// T is float, f16 or bf16 (explicitly instantiated in the .cu files).
template <typename T>
void LaunchVerifyTreeGreedy(const VerifyTreeGreedyParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchVerifyTreeSampling(const VerifyTreeSamplingParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchVerifyTreeTypical(const VerifyTreeTypicalParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchSampleTokens(const SampleTokensParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchExpandTreeStep(const ExpandTreeStepParams<T>& p, cudaStream_t stream);

// Tree attention, flash-decoding style: a partial kernel over (key split, kv head, row x query tile) writes
// (max, sum, acc) per split into p.workspace, then a combine kernel normalises. The workspace size (float32
// elements, allocated by the caller on the device) depends on the shape and on the device's SM count.
int64_t TreeAttentionWorkspaceFloats(int64_t B, int64_t H, int64_t Hkv, int64_t N, int64_t D, int64_t S);
template <typename T>
void LaunchTreeAttention(const TreeAttentionParams<T>& p, cudaStream_t stream);
// All p.num_caches caches in one launch.
void LaunchCompactKv(const CompactKvParams& p, cudaStream_t stream);

// Linear layers over a packed weight (PackLinearWeightParams / PackedLinearParams layout).
template <typename T>
void LaunchPackLinearWeight(const PackLinearWeightParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchPackedLinear(const PackedLinearParams<T>& p, cudaStream_t stream);
// Weight-only int8 linear layers (PackedLinearInt8Params): quantise the input rows, then the product.
template <typename T>
void LaunchQuantizeRowsInt8(const QuantizeRowsInt8Params<T>& p, cudaStream_t stream);
template <typename T>
void LaunchPackLinearWeightInt8(const PackLinearInt8Params<T>& p, cudaStream_t stream);
template <typename T>
void LaunchPackedLinearInt8(const PackedLinearInt8Params<T>& p, cudaStream_t stream);
// Weight-only int4 linear layers (PackedLinearInt4Params): the input rows quantised by LaunchQuantizeRowsInt8 over
// whole groups, then the product (its x_offsets stage first).
template <typename T>
void LaunchPackLinearWeightInt4(const PackLinearInt4Params<T>& p, cudaStream_t stream);
template <typename T>
void LaunchPackedLinearInt4(const PackedLinearInt4Params<T>& p, cudaStream_t stream);

// The elementwise stages of draft_decoder_layer (DraftLayerParams), launched in the order of the CPU stages
// (csrc/kernels/cpu/kernels.h); RopeCache writes p.status.
template <typename T>
void LaunchDraftLayerInputNorm(const DraftLayerParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchDraftLayerRopeCache(const DraftLayerParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchDraftLayerGatherHeads(const DraftLayerParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchDraftLayerAddNorm(const DraftLayerParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchDraftLayerSwiGlu(const DraftLayerParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchDraftLayerResidual(const DraftLayerParams<T>& p, cudaStream_t stream);

// The recurrent tree ops (recurrent_params.h; csrc/kernels/cuda/recurrent.cu). A state too large for one block's
// shared memory (tree_gated_delta_rule: Dk * Dv floats; tree_selective_state: P * Ds) throws std::invalid_argument.
template <typename T>
void LaunchTreeLinearAttention(const TreeLinearAttentionParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchCommitLinearState(const CommitLinearStateParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchTreeCausalConv1d(const TreeCausalConv1dParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchCommitConvState(const CommitConvStateParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchTreeGatedDelta(const TreeGatedDeltaParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchCommitGatedDelta(const CommitGatedDeltaParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchTreeSelectiveState(const TreeSelectiveStateParams<T>& p, cudaStream_t stream);
template <typename T>
void LaunchCommitSelectiveState(const CommitSelectiveStateParams<T>& p, cudaStream_t stream);

}  // namespace specdec::cuda
