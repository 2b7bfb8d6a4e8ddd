// CPU kernels: plain C++ over raw pointers (no torch). Each processes the batch rows [row_begin, row_end), so
// callers parallelise over rows (the glue uses at::parallel_for; the C++ tests and benchmarks call it directly).
// Semantics: common/params.h; executable specification: specdec_ext/ops/reference.py.
#pragma once

#include <cstdint>

#include "../common/dtype.h"
#include "../common/params.h"

// Fully unrolls a loop over a register tile's rows or vectors (compile-time bounds). Without it GCC keeps a tile's
// accumulator array in memory as well and stores every accumulator to the stack on every K step, which made the
// store port the bound of the AVX2 products (2-3x slower at 3-12 rows; docs/ARCHITECTURE.md).
#define SPECDEC_UNROLL _Pragma("GCC unroll 64")

namespace specdec::cpu {

void BuildTree(const BuildTreeParams& p, int64_t row_begin, int64_t row_end);
void TreeAncestorMask(const TreeMaskParams& p, int64_t row_begin, int64_t row_end);
void AdvanceTreeFrontier(const AdvanceTreeFrontierParams& p, int64_t row_begin, int64_t row_end);
void SelectTreeNodes(const SelectTreeNodesParams& p, int64_t row_begin, int64_t row_end);

// T is float, f16 or bf16.
template <typename T>
void VerifyTreeGreedy(const VerifyTreeGreedyParams<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void VerifyTreeSampling(const VerifyTreeSamplingParams<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void VerifyTreeTypical(const VerifyTreeTypicalParams<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void SampleTokens(const SampleTokensParams<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void ExpandTreeStep(const ExpandTreeStepParams<T>& p, int64_t row_begin, int64_t row_end);
// The same step in two phases, so that small batches can spread frontier nodes over threads: first nodes
// [node_begin, node_end) of the flattened B * F (fills p.node_status), then rows (reads p.node_status).
template <typename T>
void ExpandTreeStepNodes(const ExpandTreeStepParams<T>& p, int64_t node_begin, int64_t node_end);
template <typename T>
void ExpandTreeStepSelect(const ExpandTreeStepParams<T>& p, int64_t row_begin, int64_t row_end);

// Tasks instead of rows: tree attention runs task t = b * Hkv + kv_head for t in [task_begin, task_end) (the
// task with kv_head 0 writes row b's status); compaction runs task t = cache * B + b (cache 0 writes the status
// when p.write_status).
template <typename T>
void TreeAttention(const TreeAttentionParams<T>& p, int64_t task_begin, int64_t task_end);
void CompactKv(const CompactKvParams& p, int64_t task_begin, int64_t task_end);

// Linear layers over a packed weight (PackedLinearParams): output panels [panel_begin, panel_end) of 32 features,
// so callers may split panels over threads. T is float, f16 or bf16.
template <typename T>
void PackLinearWeight(const PackLinearWeightParams<T>& p, int64_t panel_begin, int64_t panel_end);
template <typename T>
void PackedLinear(const PackedLinearParams<T>& p, int64_t panel_begin, int64_t panel_end);
// The code path PackedLinear<T> takes on this CPU: "avx512" (float), "avx512_bf16" (bf16), "avx2" or "generic".
template <typename T>
const char* PackedLinearPath();

// Weight-only int8 linear layers (PackedLinearInt8Params): rows [row_begin, row_end) quantised, then output panels
// [panel_begin, panel_end) of 32 features of the product of the quantised rows. T is float, f16 or bf16.
template <typename T>
void QuantizeRowsInt8(const QuantizeRowsInt8Params<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void PackLinearWeightInt8(const PackLinearInt8Params<T>& p, int64_t panel_begin, int64_t panel_end);
template <typename T>
void PackedLinearInt8(const PackedLinearInt8Params<T>& p, int64_t panel_begin, int64_t panel_end);
// The code path PackedLinearInt8 takes on this CPU: "avx512_vnni", "avx2" or "generic".
const char* PackedLinearInt8Path();
// Runs the named path (for tests comparing paths); false, running nothing, where this CPU lacks it.
template <typename T>
bool PackedLinearInt8Using(const char* path, const PackedLinearInt8Params<T>& p, int64_t panel_begin,
                           int64_t panel_end);

// Weight-only int4 linear layers (PackedLinearInt4Params): output panels [panel_begin, panel_end) packed; the
// product's first stage (x_offsets of rows [row_begin, row_end)), then its output panels. T is float, f16 or bf16.
template <typename T>
void PackLinearWeightInt4(const PackLinearInt4Params<T>& p, int64_t panel_begin, int64_t panel_end);
template <typename T>
void LinearInt4Offsets(const PackedLinearInt4Params<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void PackedLinearInt4(const PackedLinearInt4Params<T>& p, int64_t panel_begin, int64_t panel_end);
// The code path PackedLinearInt4 takes on this CPU: "avx512_vnni", "avx2" or "generic".
const char* PackedLinearInt4Path();
// Runs the named path (for tests comparing paths); false, running nothing, where this CPU lacks it.
template <typename T>
bool PackedLinearInt4Using(const char* path, const PackedLinearInt4Params<T>& p, int64_t panel_begin,
                           int64_t panel_end);

// The elementwise stages of draft_decoder_layer (DraftLayerParams), in the order the backend runs them between
// the products and the attention: rows r = b * T + t in [row_begin, row_end), except DraftLayerRopeCache (batch
// rows b, which writes p.status[b]).
template <typename T>
void DraftLayerInputNorm(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void DraftLayerRopeCache(const DraftLayerParams<T>& p, int64_t b_begin, int64_t b_end);
template <typename T>
void DraftLayerGatherHeads(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void DraftLayerAddNorm(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void DraftLayerSwiGlu(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end);
template <typename T>
void DraftLayerResidual(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end);

// The recurrent tree ops (recurrent_params.h): tasks as documented there (rows x heads, or rows x channel blocks).
template <typename T>
void TreeLinearAttention(const TreeLinearAttentionParams<T>& p, int64_t task_begin, int64_t task_end);
template <typename T>
void CommitLinearState(const CommitLinearStateParams<T>& p, int64_t task_begin, int64_t task_end);
template <typename T>
void TreeCausalConv1d(const TreeCausalConv1dParams<T>& p, int64_t task_begin, int64_t task_end);
template <typename T>
void CommitConvState(const CommitConvStateParams<T>& p, int64_t task_begin, int64_t task_end);
template <typename T>
void TreeGatedDelta(const TreeGatedDeltaParams<T>& p, int64_t task_begin, int64_t task_end);
template <typename T>
void CommitGatedDelta(const CommitGatedDeltaParams<T>& p, int64_t task_begin, int64_t task_end);
template <typename T>
void TreeSelectiveState(const TreeSelectiveStateParams<T>& p, int64_t task_begin, int64_t task_end);
template <typename T>
void CommitSelectiveState(const CommitSelectiveStateParams<T>& p, int64_t task_begin, int64_t task_end);

}  // namespace specdec::cpu
