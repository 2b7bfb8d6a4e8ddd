// The filtered target distribution of one logits row (params.h SamplingParams), evaluated on the fly:
// weight(i) = exp((l_i - max l) / temperature) for kept tokens, 0 otherwise (<= 1: no overflow at any temperature);
// one-hot on the first argmax at temperature 0. Thresholds rank the logits l themselves (the order of l / T
// without its rounding ties) and come from radix selection (no sort):
//   top-k: keep key(l) >= key of the k-th largest l (count-weighted selection, ties kept);
//   top-p: keep key(l) >= key at which the descending running mass reaches top_p * sum(w) (mass-weighted).
// Both thresholds combine into one minimum key because the top-p key is always >= the top-k key.
#pragma once

#include "block_utils.cuh"

namespace specdec::cuda::detail {

struct Filter {
  float temperature;  // 0 -> one-hot on `argmax`
  float max_logit;    // the row's largest logit
  int64_t argmax;     // first argmax of the logits
  uint32_t min_key;   // keep iff order_key(logit) >= min_key (0 keeps everything)
};

// (logit - max) / temperature <= 0, the log-weight: two rounded operations (a true division), as the reference.
__device__ __forceinline__ float scaled_logit(const Filter& f, float logit) {
  return __fdiv_rn(__fsub_rn(logit, f.max_logit), f.temperature);
}

__device__ __forceinline__ float filter_weight(const Filter& f, float logit, int64_t i) {
  if (f.temperature == 0.0f) return i == f.argmax ? 1.0f : 0.0f;
  if (order_key(logit) < f.min_key) return 0.0f;
  return expf(scaled_logit(f, logit));
}

// Shared-memory scratch for the two radix selections.
struct FilterScratch {
  RadixHist<uint32_t> counts;
  RadixHist<double> mass;  // float64 masses: params.h sums weights in float64
};

// Builds the filter of a validated row (stats from row_stats). top_k <= 0 or >= V: no top-k; top_p >= 1: no
// top-p. Up to 6 passes over the row (3 per active threshold), none at temperature 0.
template <int BLOCK, int UNROLL, typename T>
__device__ Filter make_filter(const T* row, int64_t vocab, const RowStats& s, float temperature, int64_t top_k,
                              float top_p, FilterScratch& scratch) {
  Filter f{temperature, s.max, s.argmax, 0u};
  if (temperature == 0.0f) return f;
  if (top_k > 0 && top_k < vocab) {
    bool reached;
    f.min_key = radix_select_desc<BLOCK, uint32_t>(
        [&](auto&& emit) {
          for_each_in_row<BLOCK, UNROLL>(row, vocab,
                                         [&](float l, int64_t) { emit(order_key(l), 1u); });
        },
        [&] { return static_cast<uint32_t>(top_k); }, scratch.counts, &reached);
  }
  if (top_p < 1.0f) {
    const uint32_t k_key = f.min_key;
    double mass = 0.0;  // sum(w) over the top-k set, accumulated during the first pass
    bool reached;
    const uint32_t p_key = radix_select_desc<BLOCK, double>(
        [&](auto&& emit) {
          for_each_in_row<BLOCK, UNROLL>(row, vocab, [&](float l, int64_t) {
            const uint32_t key = order_key(l);
            const float w = key >= k_key ? expf(scaled_logit(f, l)) : 0.0f;
            mass += static_cast<double>(w);
            emit(key, static_cast<double>(w));
          });
        },
        [&] {
          const double total = block_allreduce<BLOCK>(mass, SumOp{});
          return static_cast<double>(top_p) * total;
        },
        scratch.mass, &reached);
    // Not reached only through rounding: the reference then keeps every kept token, and p_key is the smallest
    // key with positive weight, which drops only zero-weight tokens -- the same distribution.
    f.min_key = p_key > k_key ? p_key : k_key;
  }
  return f;
}

// sum(weight) in double and the number of tokens with positive weight: one pass (none at temperature 0).
struct WeightSum {
  double sum;
  int64_t positive;
};

template <int BLOCK, int UNROLL, typename T>
__device__ WeightSum filter_sum(const T* row, int64_t vocab, const Filter& f) {
  if (f.temperature == 0.0f) return WeightSum{1.0, 1};
  double sum = 0.0;
  int64_t positive = 0;
  for_each_in_row<BLOCK, UNROLL>(row, vocab, [&](float l, int64_t i) {
    const float w = filter_weight(f, l, i);
    sum += static_cast<double>(w);
    positive += w > 0.0f ? 1 : 0;
  });
  return WeightSum{block_allreduce<BLOCK>(sum, SumOp{}), block_allreduce<BLOCK>(positive, SumOp{})};
}

}  // namespace specdec::cuda::detail
