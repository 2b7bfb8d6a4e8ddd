// CPU backend: runs the torch-free CPU kernels over batch rows in parallel (at::parallel_for).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../kernels/cpu/kernels.h"
#include "op_glue.h"

namespace specdec::glue {
namespace {

// Rows are independent; grain 1 because a single row can be a whole vocabulary pass per tree level.
template <typename Params, typename Kernel>
void for_rows(const Params& p, int64_t rows, Kernel kernel) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) { kernel(p, begin, end); });
}

struct CpuBackend {
  static void build_tree(const BuildTreeParams& p) { for_rows(p, p.batch, cpu::BuildTree); }
  static void tree_ancestor_mask(const TreeMaskParams& p) { for_rows(p, p.batch, cpu::TreeAncestorMask); }
  template <typename T>
  static void verify_tree_greedy(const VerifyTreeGreedyParams<T>& p) {
    for_rows(p, p.batch, cpu::VerifyTreeGreedy<T>);
  }
  template <typename T>
  static void verify_tree_sampling(const VerifyTreeSamplingParams<T>& p) {
    for_rows(p, p.batch, cpu::VerifyTreeSampling<T>);
  }
  template <typename T>
  static void verify_tree_typical(const VerifyTreeTypicalParams<T>& p) {
    for_rows(p, p.batch, cpu::VerifyTreeTypical<T>);
  }
  template <typename T>
  static void sample_tokens(const SampleTokensParams<T>& p) {
    for_rows(p, p.rows, cpu::SampleTokens<T>);
  }
  template <typename T>
  static void expand_tree_step(const ExpandTreeStepParams<T>& p) {
    for_rows(p, p.batch, cpu::ExpandTreeStep<T>);
  }
};

}  // namespace

SPECDEC_REGISTER_BACKEND(CPU, CpuBackend)

}  // namespace specdec::glue
