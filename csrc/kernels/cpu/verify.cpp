// Verification of draft trees on the CPU: greedy, lossless rejection sampling, and Medusa typical acceptance.
//
// Each row walks its tree from the root and reads only the logits rows of nodes it visits, so a step that
// accepts L tokens reads L + 1 vocabulary rows, not N.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "row_ops.h"

namespace specdec::cpu {
namespace {

// Children of `node` in sibling order are the later nodes whose parent is `node` (trees are small; a scan is
// cheaper than building lists).
inline int64_t next_child(const int64_t* parents, int64_t num_nodes, int64_t node, int64_t after) {
  for (int64_t c = std::max(after + 1, node + 1); c < num_nodes; ++c) {
    if (parents[c] == node) return c;
  }
  return -1;
}

template <typename T>
const T* logits_row(const T* logits, int64_t stride_b, int64_t stride_n, int64_t b, int64_t node) {
  return logits + b * stride_b + node * stride_n;
}

}  // namespace

template <typename T>
void VerifyTreeGreedy(const VerifyTreeGreedyParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t N = p.num_nodes, V = p.vocab;
  Scratch& scratch = thread_scratch(V);
  std::vector<int64_t> path(N);
  for (int64_t b = row_begin; b < row_end; ++b) {
    const int64_t* parents = p.parents + b * N;
    const int64_t* tokens = p.tokens + b * N;
    RowStatus* status = &p.out.status[b];
    *status = {kOk, 0, 0};
    write_invalid_row(p.out, b, N);
    if (!tree_row_valid(parents, tokens, N, V, status)) continue;
    int64_t node = 0, length = 0, best = -1;
    path[0] = 0;
    bool ok = true;
    while (true) {
      const RowScan scan = scan_logits(logits_row(p.logits, p.logits_stride_b, p.logits_stride_n, b, node), V,
                                       scratch.x.data());
      if (logits_row_invalid(scan, node, status)) {
        ok = false;
        break;
      }
      best = scan.argmax;
      int64_t child = -1;
      for (int64_t c = next_child(parents, N, node, node); c != -1; c = next_child(parents, N, node, c)) {
        if (tokens[c] == best) {
          child = c;
          break;
        }
      }
      if (child == -1) break;
      node = child;
      path[++length] = node;
    }
    if (ok) write_verification(p.out, b, N, path.data(), length, best);
  }
}

template <typename T>
void VerifyTreeSampling(const VerifyTreeSamplingParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t N = p.num_nodes, V = p.vocab;
  Scratch& scratch = thread_scratch(V);
  std::vector<int64_t> path(N);
  for (int64_t b = row_begin; b < row_end; ++b) {
    const int64_t* parents = p.parents + b * N;
    const int64_t* tokens = p.tokens + b * N;
    const float* uniforms = p.uniforms + b * N;
    const float temperature = effective_temperature(p.sampling.temperature[b]);
    const int64_t top_k = p.sampling.top_k[b];
    const float top_p = p.sampling.top_p[b];
    RowStatus* status = &p.out.status[b];
    *status = {kOk, 0, 0};
    write_invalid_row(p.out, b, N);
    if (sampling_params_invalid(temperature, top_k, top_p, true, status)) continue;
    if (uniforms_invalid(uniforms, N, true, status)) continue;
    if (!tree_row_valid(parents, tokens, N, V, status)) continue;

    float* target = scratch.target.data();
    // The residual r: for deterministic drafts it is `target` with rejected tokens zeroed in place; with draft
    // probabilities it lives in the row's workspace.
    float* residual_buffer = p.draft_probs ? p.workspace + b * V : nullptr;
    int64_t node = 0, length = 0;
    path[0] = 0;
    float* r = target;
    double r_sum = 0.0;
    bool ok = true;
    while (ok) {
      float* x = scratch.x.data();
      const RowScan scan = scan_logits(logits_row(p.logits, p.logits_stride_b, p.logits_stride_n, b, node), V, x);
      if (logits_row_invalid(scan, node, status)) {
        ok = false;
        break;
      }
      const double target_sum = filtered_weights(x, scan, V, temperature, top_k, top_p, target, scratch);
      r = target;
      r_sum = target_sum;
      bool residual_is_target = true;  // r aliases target (deterministic drafts zero entries of it in place)
      const float* q = p.draft_probs ? p.draft_probs + b * p.draft_stride_b + node * p.draft_stride_n : nullptr;
      int64_t accepted_child = -1;
      for (int64_t c = next_child(parents, N, node, node); c != -1; c = next_child(parents, N, node, c)) {
        const int64_t token = tokens[c];
        const float qx = q ? q[token] : 1.0f;
        if (!(qx >= 0.0f)) {
          *status = {kBadDraftProb, node, token};
          ok = false;
          break;
        }
        if (static_cast<double>(uniforms[c]) * qx * r_sum < static_cast<double>(r[token])) {
          accepted_child = c;
          break;
        }
        if (q == nullptr) {
          r_sum -= r[token];
          r[token] = 0.0f;
          if (r_sum <= 1e-6 * target_sum) r_sum = sum_of(r, V);  // guard against cancellation drift
        } else {
          if (residual_is_target) {
            std::copy(target, target + V, residual_buffer);
            r = residual_buffer;
            residual_is_target = false;
          }
          subtract_clamped(r, q, V, static_cast<float>(r_sum));
          r_sum = sum_of(r, V);
        }
        if (!(r_sum > 0.0)) {
          // Only rounding can empty the residual: fall back to the target distribution (re-filter, since
          // deterministic drafts zeroed the target in place).
          const RowScan again = scan_logits(logits_row(p.logits, p.logits_stride_b, p.logits_stride_n, b, node), V,
                                            x);
          r_sum = filtered_weights(x, again, V, temperature, top_k, top_p, target, scratch);
          r = target;
          residual_is_target = true;
        }
      }
      if (!ok || accepted_child == -1) break;
      node = accepted_child;
      path[++length] = node;
    }
    if (!ok) continue;
    const int64_t next = inverse_cdf(r, V, r_sum, uniforms[0]);
    write_verification(p.out, b, N, path.data(), length, next);
  }
}

template <typename T>
void VerifyTreeTypical(const VerifyTreeTypicalParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t N = p.num_nodes, V = p.vocab;
  Scratch& scratch = thread_scratch(V);
  std::vector<int64_t> path(N), depth(N);
  std::vector<char> acceptable(N);
  std::vector<double> threshold(N);
  for (int64_t b = row_begin; b < row_end; ++b) {
    const int64_t* parents = p.parents + b * N;
    const int64_t* tokens = p.tokens + b * N;
    const float temperature = effective_temperature(p.temperature[b]);
    RowStatus* status = &p.out.status[b];
    *status = {kOk, 0, 0};
    write_invalid_row(p.out, b, N);
    if (sampling_params_invalid(temperature, 0, 1.0f, false, status)) continue;
    if (uniforms_invalid(p.uniforms + b, 1, false, status)) continue;
    if (!tree_row_valid(parents, tokens, N, V, status)) continue;

    // Evaluates node u's distribution into scratch.target; returns its sum and sets threshold[u].
    float* w = scratch.target.data();
    float* x = scratch.x.data();
    int64_t loaded = -1;  // the node whose weights are in `w`
    double loaded_sum = 0.0;
    const auto load = [&](int64_t u) -> bool {
      if (loaded == u) return true;
      const RowScan scan = scan_logits(logits_row(p.logits, p.logits_stride_b, p.logits_stride_n, b, u), V, x);
      if (logits_row_invalid(scan, u, status)) return false;
      loaded_sum = filtered_weights(x, scan, V, temperature, 0, 1.0f, w, scratch);
      // Entropy of p = w / Z: H = log Z - sum(w * log w) / Z, with log w = (logits - max) / T (0 where w = 0).
      double weighted_log = 0.0;
      if (temperature > 0.0f) {
        for (int64_t t = 0; t < V; ++t) {
          if (w[t] > 0.0f) weighted_log += static_cast<double>(w[t]) * ((x[t] - scan.max) / temperature);
        }
      }
      const double entropy = temperature > 0.0f ? std::log(loaded_sum) - weighted_log / loaded_sum : 0.0;
      threshold[u] = std::min(p.posterior_threshold, p.posterior_alpha * std::exp(-entropy));
      loaded = u;
      return true;
    };

    std::fill(acceptable.begin(), acceptable.end(), 0);
    acceptable[0] = 1;
    depth[0] = 0;
    bool ok = true;
    // Nodes in index order; children of one parent are usually contiguous, so each parent row loads once.
    for (int64_t c = 1; c < N && ok; ++c) {
      const int64_t u = parents[c];
      depth[c] = depth[u] + 1;
      if (!acceptable[u]) continue;
      if (!load(u)) {
        ok = false;
        break;
      }
      acceptable[c] = static_cast<double>(w[tokens[c]]) / loaded_sum > threshold[u];
    }
    if (!ok) continue;
    int64_t last = 0;
    for (int64_t i = 1; i < N; ++i) {
      if (acceptable[i] && depth[i] > depth[last]) last = i;
    }
    if (!load(last)) continue;
    const int64_t next = inverse_cdf(w, V, loaded_sum, p.uniforms[b]);
    int64_t length = depth[last];
    for (int64_t node = last, i = length; node != -1; node = parents[node], --i) path[i] = node;
    write_verification(p.out, b, N, path.data(), length, next);
  }
}

#define SPECDEC_INSTANTIATE(T)                                                                      \
  template void VerifyTreeGreedy<T>(const VerifyTreeGreedyParams<T>&, int64_t, int64_t);          \
  template void VerifyTreeSampling<T>(const VerifyTreeSamplingParams<T>&, int64_t, int64_t);      \
  template void VerifyTreeTypical<T>(const VerifyTreeTypicalParams<T>&, int64_t, int64_t);
SPECDEC_INSTANTIATE(float)
SPECDEC_INSTANTIATE(f16)
SPECDEC_INSTANTIATE(bf16)
#undef SPECDEC_INSTANTIATE

}  // namespace specdec::cpu
