// Fused draft sampling on the CPU: one token per row with temperature / top-k / top-p, and one EAGLE-2
// dynamic-tree expansion step (per-node top-k, cumulative scores, global top-k).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels.h"
#include "row_ops.h"

namespace specdec::cpu {
namespace {

// Order of candidates everywhere: larger value first, then lower index. A total order even with NaN, so sorting
// never misbehaves on bad data: NaN of either sign ranks first, as in torch.sort and the CUDA kernel's score_key.
inline uint32_t rank_key(float v) { return is_nan(v) ? 0xffffffffu : order_key(v); }

inline bool before(float a, int64_t ia, float b, int64_t ib) {
  const uint32_t ka = rank_key(a), kb = rank_key(b);
  return ka != kb ? ka > kb : ia < ib;
}

// Indices of the k largest x[0..n), best first (ties: lower index first). `nan_free` enables skipping whole blocks
// by their maximum (validated logits); candidate scores may hold NaN (from NaN parent scores), ranked first.
void top_k_indices(const float* x, int64_t n, int64_t k, int64_t* out, std::vector<int64_t>& buffer,
                   bool nan_free) {
  if (k <= 64) {
    float value[64] = {};
    int64_t filled = 0;
    for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
      const int64_t t1 = std::min(n, t0 + kBlock);
      // Scanning in increasing t, a later equal value never passes an earlier one, so only a strictly larger
      // block maximum can change a full list.
      if (nan_free && filled == k && !(block_max(x, t0, t1) > value[k - 1])) continue;
      for (int64_t t = t0; t < t1; ++t) {
        const float v = x[t];
        if (filled == k && !before(v, t, value[k - 1], out[k - 1])) continue;
        int64_t pos = filled < k ? filled++ : k - 1;
        while (pos > 0 && before(v, t, value[pos - 1], out[pos - 1])) {
          value[pos] = value[pos - 1];
          out[pos] = out[pos - 1];
          --pos;
        }
        value[pos] = v;
        out[pos] = t;
      }
    }
    return;
  }
  buffer.resize(n);
  std::iota(buffer.begin(), buffer.end(), int64_t{0});
  std::partial_sort(buffer.begin(), buffer.begin() + k, buffer.end(),
                    [x](int64_t a, int64_t b) { return before(x[a], a, x[b], b); });
  std::copy(buffer.begin(), buffer.begin() + k, out);
}

}  // namespace

template <typename T>
void SampleTokens(const SampleTokensParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t V = p.vocab;
  Scratch& scratch = thread_scratch(V);
  for (int64_t r = row_begin; r < row_end; ++r) {
    float* probs = p.probs + r * V;
    RowStatus* status = &p.status[r];
    *status = {kOk, 0, 0};
    p.tokens[r] = -1;
    const float temperature = effective_temperature(p.sampling.temperature[r]);
    const float top_p = p.sampling.top_p[r];
    float* x = scratch.x.data();
    bool ok = !sampling_params_invalid(temperature, p.sampling.top_k[r], top_p, true, status) &&
              !uniforms_invalid(p.uniforms + r, 1, false, status);
    RowScan scan;
    if (ok) {
      scan = scan_logits(p.logits + r * p.logits_stride_r, V, x);
      ok = !logits_row_invalid(scan, -1, status);  // node -1: a 2-D logits matrix
    }
    if (!ok) {
      std::fill(probs, probs + V, 0.0f);
      continue;
    }
    const double total = filtered_weights(x, scan, V, temperature, p.sampling.top_k[r], top_p, probs, scratch);
    p.tokens[r] = inverse_cdf(probs, V, total, p.uniforms[r]);
    divide_by(probs, V, static_cast<float>(total));
  }
}

namespace {

// Phase 1 for frontier node f of row b: candidates and scores, or the status of a bad logits row.
template <typename T>
RowStatus expand_node(const ExpandTreeStepParams<T>& p, int64_t b, int64_t f, Scratch& scratch,
                      std::vector<int64_t>& buffer) {
  const int64_t F = p.frontier, V = p.vocab, K = p.top_k;
  int64_t* cand_tokens = p.cand_tokens + (b * F + f) * K;
  float* cand_scores = p.cand_scores + (b * F + f) * K;
  float* x = scratch.x.data();
  const RowScan scan = scan_logits(p.logits + b * p.logits_stride_b + f * p.logits_stride_f, V, x);
  RowStatus status{kOk, 0, 0};
  if (logits_row_invalid(scan, f, &status)) return status;
  const float m = scan.max;
  float* e = scratch.target.data();
  exp_weights(x, e, V, m, neg_inf());
  const float log_z = static_cast<float>(std::log(sum_of(e, V)));
  top_k_indices(x, V, K, cand_tokens, buffer, /*nan_free=*/true);
  const float parent = p.parent_scores[b * F + f];
  for (int64_t j = 0; j < K; ++j) cand_scores[j] = parent + ((x[cand_tokens[j]] - m) - log_z);
  return status;
}

// Phase 2 for row b, given its nodes' statuses: the first failing node's status and sentinels, or the selection.
template <typename T>
void expand_select(const ExpandTreeStepParams<T>& p, int64_t b, const RowStatus* node_status,
                   std::vector<int64_t>& buffer) {
  const int64_t F = p.frontier, K = p.top_k;
  int64_t* cand_tokens = p.cand_tokens + b * F * K;
  float* cand_scores = p.cand_scores + b * F * K;
  int64_t* selected = p.selected + b * p.num_select;
  p.status[b] = {kOk, 0, 0};
  for (int64_t f = 0; f < F; ++f) {
    if (node_status[f].code == kOk) continue;
    p.status[b] = node_status[f];
    std::fill(cand_tokens, cand_tokens + F * K, int64_t{-1});
    std::fill(cand_scores, cand_scores + F * K, neg_inf());
    std::fill(selected, selected + p.num_select, int64_t{-1});
    return;
  }
  top_k_indices(cand_scores, F * K, p.num_select, selected, buffer, /*nan_free=*/false);
}

}  // namespace

template <typename T>
void ExpandTreeStepNodes(const ExpandTreeStepParams<T>& p, int64_t node_begin, int64_t node_end) {
  Scratch& scratch = thread_scratch(p.vocab);
  std::vector<int64_t> buffer;
  for (int64_t i = node_begin; i < node_end; ++i) {
    p.node_status[i] = expand_node(p, i / p.frontier, i % p.frontier, scratch, buffer);
  }
}

template <typename T>
void ExpandTreeStepSelect(const ExpandTreeStepParams<T>& p, int64_t row_begin, int64_t row_end) {
  std::vector<int64_t> buffer;
  for (int64_t b = row_begin; b < row_end; ++b) expand_select(p, b, p.node_status + b * p.frontier, buffer);
}

template <typename T>
void ExpandTreeStep(const ExpandTreeStepParams<T>& p, int64_t row_begin, int64_t row_end) {
  Scratch& scratch = thread_scratch(p.vocab);
  std::vector<int64_t> buffer;
  std::vector<RowStatus> node_status(p.frontier);
  for (int64_t b = row_begin; b < row_end; ++b) {
    for (int64_t f = 0; f < p.frontier; ++f) {
      node_status[f] = expand_node(p, b, f, scratch, buffer);
      if (node_status[f].code != kOk) break;  // later nodes are not needed: the row is invalid
    }
    expand_select(p, b, node_status.data(), buffer);
  }
}

#define SPECDEC_INSTANTIATE(T)                                                                \
  template void SampleTokens<T>(const SampleTokensParams<T>&, int64_t, int64_t);            \
  template void ExpandTreeStep<T>(const ExpandTreeStepParams<T>&, int64_t, int64_t);        \
  template void ExpandTreeStepNodes<T>(const ExpandTreeStepParams<T>&, int64_t, int64_t);   \
  template void ExpandTreeStepSelect<T>(const ExpandTreeStepParams<T>&, int64_t, int64_t);
SPECDEC_INSTANTIATE(float)
SPECDEC_INSTANTIATE(f16)
SPECDEC_INSTANTIATE(bf16)
#undef SPECDEC_INSTANTIATE

}  // namespace specdec::cpu
