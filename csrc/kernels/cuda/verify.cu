// Tree verification kernels (greedy, lossless rejection sampling, Medusa typical acceptance).
//
// One block per batch row. The tree walk is sequential and identical on every thread (trees are small; parents
// and tokens are broadcast reads); each vocabulary pass over a visited node's logits row is block-parallel.
// Only the logits rows the walk visits are read (and validated). Semantics: params.h / reference.py.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "filter.cuh"
#include "kernels.cuh"
#include "launch_check.cuh"
#include "row_checks.cuh"

namespace specdec::cuda {
namespace {

using namespace detail;

constexpr int kGreedyBlock = 1024;  // greedy is one pass per node: maximise loads in flight
constexpr int kBlock = 512;
constexpr int kUnroll = 4;
constexpr int kMaxRemovedCached = 256;  // deterministic drafts: removed tokens kept in shared memory

// Greedy ---------------------------------------------------------------------------------------------------------

template <int BLOCK, typename T>
__global__ void __launch_bounds__(BLOCK) verify_greedy_kernel(VerifyTreeGreedyParams<T> p) {
  const int64_t b = blockIdx.x, n = p.num_nodes, vocab = p.vocab;
  const int64_t* par = p.parents + b * n;
  const int64_t* tok = p.tokens + b * n;
  RowStatus st = check_tree_row<BLOCK>(par, n);
  if (st.code == kOk) st = check_tokens_row<BLOCK>(tok, n, vocab);
  int64_t node = 0, len = 1, next = -1;
  if (st.code == kOk) {
    while (true) {
      const T* row = p.logits + b * p.logits_stride_b + node * p.logits_stride_n;
      const RowStats s = row_stats<BLOCK, kUnroll>(row, vocab);
      if (!logits_row_ok(s, node, &st)) break;
      int64_t child = -1;
      for (int64_t c = node + 1; c < n; ++c) {
        if (par[c] == node && tok[c] == s.argmax) {
          child = c;
          break;
        }
      }
      if (child < 0) {
        next = s.argmax;
        break;
      }
      node = child;
      ++len;
    }
  }
  write_verify_row<BLOCK>(p.out, b, n, par, st, node, len, next);
}

// Rejection sampling ---------------------------------------------------------------------------------------------
//
// Residual r at the current node u (kept unnormalised, with its float sum as the reference's r.sum()):
//  * draft_probs set: r starts as the target weights (computed from the logits on the fly) and is materialised
//    in workspace[b, :] at the first rejection (one pass per rejection: r <- max(r - q * sum(r), 0)).
//  * deterministic drafts: r = target with the tokens of rejected siblings zeroed. They are exactly the children
//    of u after `reset_after` that were rejected, so no storage is needed during the walk; the sum is tracked in
//    double by subtraction, re-summed by one pass when cancellation threatens (<= 1e-6 of the target sum, as the
//    CPU kernel), and the positive count decides the all-zero fallback exactly.

template <int BLOCK, typename T>
__global__ void __launch_bounds__(BLOCK) verify_sampling_kernel(VerifyTreeSamplingParams<T> p) {
  __shared__ FilterScratch scratch;
  __shared__ int64_t s_removed[kMaxRemovedCached];
  __shared__ int s_num_removed;
  const int64_t b = blockIdx.x, n = p.num_nodes, vocab = p.vocab;
  const int64_t* par = p.parents + b * n;
  const int64_t* tok = p.tokens + b * n;
  const float* uni = p.uniforms + b * n;
  const float temperature = effective_temperature(p.sampling.temperature[b]);
  const int64_t top_k = p.sampling.top_k[b];
  const float top_p = p.sampling.top_p[b];
  const bool has_q = p.draft_probs != nullptr;
  float* ws = has_q ? p.workspace + b * vocab : nullptr;

  RowStatus st = check_sampling_row(temperature, top_k, top_p, true);
  if (st.code == kOk) st = check_uniforms_row<BLOCK>(uni, n);
  if (st.code == kOk) st = check_tree_row<BLOCK>(par, n);
  if (st.code == kOk) st = check_tokens_row<BLOCK>(tok, n, vocab);
  int64_t node = 0, len = 1, next = -1;
  while (st.code == kOk) {
    const T* row = p.logits + b * p.logits_stride_b + node * p.logits_stride_n;
    const RowStats s = row_stats<BLOCK, kUnroll>(row, vocab);
    if (!logits_row_ok(s, node, &st)) break;
    const Filter f = make_filter<BLOCK, kUnroll>(row, vocab, s, temperature, top_k, top_p, scratch);
    const WeightSum target = filter_sum<BLOCK, kUnroll>(row, vocab, f);
    const float* q = has_q ? p.draft_probs + b * p.draft_stride_b + node * p.draft_stride_n : nullptr;

    double r_sum = target.sum;
    int64_t r_positive = target.positive;
    bool r_in_ws = false;
    int64_t reset_after = node;
    int64_t moved = -1;
    for (int64_t c = node + 1; c < n; ++c) {
      if (par[c] != node) continue;
      const int64_t x = tok[c];  // validated: in [0, vocab)
      const float qx = has_q ? q[x] : 1.0f;
      if (!(qx >= 0.0f)) {
        st = RowStatus{kBadDraftProb, node, x};
        break;
      }
      float rx;
      if (r_in_ws) {
        rx = ws[x];
      } else {
        rx = filter_weight(f, to_float(row[x]), x);
        if (!has_q) {
          for (int64_t e = reset_after + 1; e < c; ++e) {
            if (par[e] == node && tok[e] == x) {
              rx = 0.0f;  // already removed by an earlier rejected sibling
              break;
            }
          }
        }
      }
      const float rs = static_cast<float>(r_sum);
      // u * q(x) * sum(r) < r(x) in float64 (params.h), sum(r) being the float64 sum.
      if (static_cast<double>(uni[c]) * static_cast<double>(qx) * r_sum < static_cast<double>(rx)) {
        moved = c;
        break;
      }
      if (!has_q) {
        if (rx > 0.0f) {
          r_sum -= static_cast<double>(rx);
          --r_positive;
        }
        if (r_positive == 0) {  // residual all zero: fall back to the target
          r_sum = target.sum;
          r_positive = target.positive;
          reset_after = c;
        } else if (r_sum <= 1e-6 * target.sum) {
          // Cancellation guard (as the CPU kernel): after removing most of the mass, the running difference can
          // be far off the true residual sum, even <= 0 while positive weights remain (which would accept a
          // token with r(x) = 0, or make inverse_cdf pick a zero-weight token). Re-sum the residual exactly:
          // target weights minus the tokens of the siblings rejected since `reset_after` (c included).
          double acc = 0.0;
          for (int64_t i = threadIdx.x; i < vocab; i += BLOCK) {
            float w = filter_weight(f, to_float(row[i]), i);
            if (w > 0.0f) {
              for (int64_t e = reset_after + 1; e <= c; ++e) {
                if (par[e] == node && tok[e] == i) {
                  w = 0.0f;
                  break;
                }
              }
            }
            acc += static_cast<double>(w);
          }
          r_sum = block_allreduce<BLOCK>(acc, SumOp{});
        }
      } else {
        // Barrier: every thread has read ws[x] for this child's test above before any thread overwrites ws
        // below (without it a slow thread could test against the updated residual and diverge).
        __syncthreads();
        double acc = 0.0;
        for (int64_t i = threadIdx.x; i < vocab; i += BLOCK) {
          const float rv = r_in_ws ? ws[i] : filter_weight(f, to_float(row[i]), i);
          // No FMA contraction: r - q * sum(r) rounded like the reference's two float32 operations.
          float v = __fsub_rn(rv, __fmul_rn(q[i], rs));
          v = v < 0.0f ? 0.0f : v;  // clamp(min=0) keeps NaN, so a NaN residual falls back below
          ws[i] = v;
          acc += static_cast<double>(v);
        }
        r_sum = block_allreduce<BLOCK>(acc, SumOp{});  // also orders the ws writes before later reads
        r_in_ws = true;
        if (!(r_sum > 0.0)) {
          r_sum = target.sum;
          r_in_ws = false;
        }
      }
    }
    if (st.code != kOk) break;
    if (moved >= 0) {
      node = moved;
      ++len;
      continue;
    }
    // No child accepted: draw next_token from r.
    if (!has_q) {
      if (threadIdx.x == 0) {
        int count = 0;
        for (int64_t c = reset_after + 1; c < n; ++c) {
          if (par[c] != node) continue;
          if (count < kMaxRemovedCached) s_removed[count] = tok[c];
          ++count;
        }
        s_num_removed = count <= kMaxRemovedCached ? count : -1;  // -1: too many, search the tree instead
      }
      __syncthreads();
    }
    const int num_removed = has_q ? 0 : s_num_removed;
    const double target_mass = static_cast<double>(uni[0]) * r_sum;
    next = inverse_cdf<BLOCK, false>(
        [&](int64_t i) -> float {
          if (r_in_ws) return ws[i];
          float w = filter_weight(f, to_float(row[i]), i);
          if (w > 0.0f && num_removed > 0) {
            for (int j = 0; j < num_removed; ++j) {
              if (s_removed[j] == i) return 0.0f;
            }
          } else if (w > 0.0f && num_removed < 0) {
            for (int64_t c = reset_after + 1; c < n; ++c) {
              if (par[c] == node && tok[c] == i) return 0.0f;
            }
          }
          return w;
        },
        vocab, target_mass);
    break;
  }
  write_verify_row<BLOCK>(p.out, b, n, par, st, node, len, next);
}

// Typical acceptance ---------------------------------------------------------------------------------------------
//
// p_u = softmax(x / T) at node u, threshold = min(posterior_threshold, alpha * exp(-H(p_u))). Nodes are processed
// by parent u in increasing order so each distribution is computed once; `accepted[b, :]` serves as scratch
// holding depth(c) for acceptable nodes and -1 otherwise. The reference validates a parent's logits row when it
// reaches that parent's first child, so the error it reports is the failing row with the smallest first child:
// failures are ranked by that key and rows whose first child comes later are skipped.

struct TypicalDist {
  Filter f;
  double sum;  // float64 sum of w
  double thr;  // acceptance threshold on p(x)
};

template <int BLOCK, typename T>
__device__ TypicalDist typical_dist(const T* row, int64_t vocab, const RowStats& s, float temperature,
                                    double posterior_threshold, double posterior_alpha) {
  TypicalDist d;
  d.f = Filter{temperature, s.max, s.argmax, 0u};
  if (temperature == 0.0f) {
    d.sum = 1.0;
    d.thr = fmin(posterior_threshold, posterior_alpha);
    return d;
  }
  // H = -sum p log p = log S - sum(w * z) / S, with z = (l - max) / T and w = exp(z): one pass for both sums.
  double sw = 0.0, swx = 0.0;
  for_each_in_row<BLOCK, kUnroll>(row, vocab, [&](float l, int64_t) {
    const float z = scaled_logit(d.f, l);
    const float w = expf(z);
    sw += static_cast<double>(w);
    if (w > 0.0f) swx += static_cast<double>(w) * static_cast<double>(z);
  });
  sw = block_allreduce<BLOCK>(sw, SumOp{});
  swx = block_allreduce<BLOCK>(swx, SumOp{});
  const double entropy = log(sw) - swx / sw;
  d.sum = sw;
  d.thr = fmin(posterior_threshold, posterior_alpha * exp(-entropy));
  return d;
}

template <int BLOCK, typename T>
__global__ void __launch_bounds__(BLOCK) verify_typical_kernel(VerifyTreeTypicalParams<T> p) {
  const int64_t b = blockIdx.x, n = p.num_nodes, vocab = p.vocab;
  const int64_t* par = p.parents + b * n;
  const int64_t* tok = p.tokens + b * n;
  int64_t* depth_of = p.out.accepted + b * n;  // scratch until write_verify_row
  const float temperature = effective_temperature(p.temperature[b]);
  const T* logits_b = p.logits + b * p.logits_stride_b;

  RowStatus st = check_sampling_row(temperature, 0, 1.0f, false);
  if (st.code == kOk) st = check_uniform(p.uniforms[b]);
  if (st.code == kOk) st = check_tree_row<BLOCK>(par, n);
  if (st.code == kOk) st = check_tokens_row<BLOCK>(tok, n, vocab);
  int64_t best = 0, best_depth = 0, len = 1, next = -1;
  if (st.code == kOk) {
    for (int64_t i = threadIdx.x; i < n; i += BLOCK) depth_of[i] = i == 0 ? 0 : -1;
    __syncthreads();
    RowStatus err = ok_status();
    int64_t err_key = kNoIndex;  // first child of the failing row (the reference's order)
    int64_t cached = -1;
    TypicalDist cached_dist{};
    for (int64_t u = 0; u < n; ++u) {
      const int64_t du = depth_of[u];
      if (du < 0) continue;
      int64_t first = -1;
      for (int64_t c = u + 1; c < n; ++c) {
        if (par[c] == u) {
          first = c;
          break;
        }
      }
      if (first < 0 || first >= err_key) continue;
      const T* row = logits_b + u * p.logits_stride_n;
      const RowStats s = row_stats<BLOCK, kUnroll>(row, vocab);
      RowStatus row_st;
      if (!logits_row_ok(s, u, &row_st)) {
        err = row_st;
        err_key = first;
        continue;
      }
      const TypicalDist d = typical_dist<BLOCK>(row, vocab, s, temperature, p.posterior_threshold,
                                                p.posterior_alpha);
      for (int64_t c = first; c < n; ++c) {
        if (par[c] != u) continue;
        const int64_t x = tok[c];
        const double px = static_cast<double>(filter_weight(d.f, to_float(row[x]), x)) / d.sum;
        if (px > d.thr) {
          if (threadIdx.x == 0) depth_of[c] = du + 1;
          if (du + 1 > best_depth || (du + 1 == best_depth && c < best)) {
            best = c;
            best_depth = du + 1;
          }
        }
      }
      __syncthreads();  // depth_of writes visible before later parents read them
      if (best == u) {
        cached = u;
        cached_dist = d;
      }
    }
    st = err;
    if (st.code == kOk) {
      const T* row = logits_b + best * p.logits_stride_n;
      TypicalDist d = cached_dist;
      if (cached != best) {
        const RowStats s = row_stats<BLOCK, kUnroll>(row, vocab);
        if (logits_row_ok(s, best, &st)) {
          d = typical_dist<BLOCK>(row, vocab, s, temperature, p.posterior_threshold, p.posterior_alpha);
        }
      }
      if (st.code == kOk) {
        // next_token ~ p = w / S by inverse CDF: running sum of w against u * S, both in float64 (equal to the
        // reference's cumsum(p) > u * sum(p) up to float64 rounding).
        next = inverse_cdf<BLOCK, false>([&](int64_t i) { return filter_weight(d.f, to_float(row[i]), i); }, vocab,
                                         static_cast<double>(p.uniforms[b]) * d.sum);
        len = best_depth + 1;
      }
    }
  }
  write_verify_row<BLOCK>(p.out, b, n, par, st, best, len, next);
}

}  // namespace

template <typename T>
void LaunchVerifyTreeGreedy(const VerifyTreeGreedyParams<T>& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  verify_greedy_kernel<kGreedyBlock, T><<<static_cast<unsigned>(p.batch), kGreedyBlock, 0, stream>>>(p);
  check_launch("verify_tree_greedy");
}

template <typename T>
void LaunchVerifyTreeSampling(const VerifyTreeSamplingParams<T>& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  if (p.draft_probs != nullptr && p.workspace == nullptr) {
    throw std::runtime_error("specdec_ext CUDA: verify_tree_sampling needs a [B, V] workspace with draft_probs");
  }
  verify_sampling_kernel<kBlock, T><<<static_cast<unsigned>(p.batch), kBlock, 0, stream>>>(p);
  check_launch("verify_tree_sampling");
}

template <typename T>
void LaunchVerifyTreeTypical(const VerifyTreeTypicalParams<T>& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  verify_typical_kernel<kBlock, T><<<static_cast<unsigned>(p.batch), kBlock, 0, stream>>>(p);
  check_launch("verify_tree_typical");
}

#define SPECDEC_INSTANTIATE_VERIFY(T)                                                              \
  template void LaunchVerifyTreeGreedy<T>(const VerifyTreeGreedyParams<T>&, cudaStream_t);       \
  template void LaunchVerifyTreeSampling<T>(const VerifyTreeSamplingParams<T>&, cudaStream_t);   \
  template void LaunchVerifyTreeTypical<T>(const VerifyTreeTypicalParams<T>&, cudaStream_t);
SPECDEC_INSTANTIATE_VERIFY(float)
SPECDEC_INSTANTIATE_VERIFY(specdec::f16)
SPECDEC_INSTANTIATE_VERIFY(specdec::bf16)
#undef SPECDEC_INSTANTIATE_VERIFY

}  // namespace specdec::cuda
