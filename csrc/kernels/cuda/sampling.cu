// Fused draft sampling: sample_tokens (filtered distribution + inverse-CDF draw) and expand_tree_step (EAGLE-2
// per-node top-k with log-probabilities, then per-row selection). Semantics: params.h / reference.py.
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

constexpr int kBlock = 512;
constexpr int kUnroll = 4;
constexpr int64_t kSortSmem = 2048;  // top-k lists up to this size are sorted in shared memory

// sample_tokens ---------------------------------------------------------------------------------------------------
// One block per row: validation + max (1 pass), filter thresholds (0-6 passes), sum (1 pass), then one pass that
// writes probs = w / sum(w) and draws the token by inverse CDF.

template <int BLOCK, typename T>
__global__ void __launch_bounds__(BLOCK) sample_tokens_kernel(SampleTokensParams<T> p) {
  __shared__ FilterScratch scratch;
  const int64_t r = blockIdx.x, vocab = p.vocab;
  const T* row = p.logits + r * p.logits_stride_r;
  float* probs = p.probs + r * vocab;
  const float temperature = effective_temperature(p.sampling.temperature[r]);
  const float top_p = p.sampling.top_p[r];
  RowStatus st = check_sampling_row(temperature, p.sampling.top_k[r], top_p, true);
  if (st.code == kOk) st = check_uniform(p.uniforms[r]);
  RowStats s{};
  if (st.code == kOk) {
    s = row_stats<BLOCK, kUnroll>(row, vocab);
    logits_row_ok(s, -1, &st);  // node -1: a 2-D logits matrix (the row is the batch row)
  }
  if (st.code != kOk) {
    for (int64_t i = threadIdx.x; i < vocab; i += BLOCK) probs[i] = 0.0f;
    if (threadIdx.x == 0) {
      p.tokens[r] = -1;
      p.status[r] = st;
    }
    return;
  }
  const Filter f = make_filter<BLOCK, kUnroll>(row, vocab, s, temperature, p.sampling.top_k[r], top_p, scratch);
  const double total = filter_sum<BLOCK, kUnroll>(row, vocab, f).sum;
  const float sum = static_cast<float>(total);  // probs = w / float(sum), as the reference divides
  const int64_t token = inverse_cdf<BLOCK, true>(
      [&](int64_t i) {
        const float w = filter_weight(f, to_float(row[i]), i);
        probs[i] = w / sum;
        return w;
      },
      vocab, static_cast<double>(p.uniforms[r]) * total);
  if (threadIdx.x == 0) {
    p.tokens[r] = token;
    p.status[r] = ok_status();
  }
}

// Sorted top-k by key ---------------------------------------------------------------------------------------------

// Ascending order of this composite = key descending, then index ascending.
__device__ __forceinline__ uint64_t compose(uint32_t key, int64_t index) {
  return (static_cast<uint64_t>(~key) << 32) | static_cast<uint64_t>(static_cast<uint32_t>(index));
}

// Sorts buf[0, m) ascending in place with a bitonic network padded to a power of two. Only "ascending"
// comparators are used (the first step of each merge compares mirrored positions), so the virtual +inf padding
// never moves and comparators touching it are skipped. buf may be shared or global memory (block-private).
template <int BLOCK>
__device__ void block_bitonic_sort(uint64_t* buf, int64_t m) {
  int64_t size_p2 = 1;
  while (size_p2 < m) size_p2 <<= 1;
  const int64_t half_total = size_p2 / 2;
  for (int64_t size = 2; size <= size_p2; size <<= 1) {
    for (int64_t stride = size / 2; stride > 0; stride >>= 1) {
      const bool mirror = stride == size / 2;
      __syncthreads();
      for (int64_t t = threadIdx.x; t < half_total; t += BLOCK) {
        int64_t i, j;
        if (mirror) {
          const int64_t blk = t / stride, pos = t % stride;
          i = blk * size + pos;
          j = blk * size + size - 1 - pos;
        } else {
          i = (t / stride) * 2 * stride + (t % stride);
          j = i + stride;
        }
        if (j < m) {
          const uint64_t a = buf[i], c = buf[j];
          if (a > c) {
            buf[i] = c;
            buf[j] = a;
          }
        }
      }
    }
  }
  __syncthreads();
}

// Writes to out[0, k) the indices of the k largest keys among [0, n) (1 <= k <= n < 2^32), ordered by key
// descending, then index ascending -- a stable descending sort's first k. key_of(i) is evaluated per pass.
// Passes: 3 (radix threshold) + 1 (gather keys above it) + an early-exit ordered pass for ties at it.
template <int BLOCK, typename KeyFn>
__device__ void block_topk_sorted(KeyFn&& key_of, int64_t n, int64_t k, int64_t* out, RadixHist<uint32_t>& hist,
                                  uint64_t* sort_smem) {
  __shared__ unsigned long long s_count;
  uint32_t kth = 0;  // keys >= kth are candidates
  if (k < n) {
    bool reached;
    kth = radix_select_desc<BLOCK, uint32_t>(
        [&](auto&& emit) {
          for (int64_t i = threadIdx.x; i < n; i += BLOCK) emit(key_of(i), 1u);
        },
        [&] { return static_cast<uint32_t>(k); }, hist, &reached);
  }
  uint64_t* buf = k <= kSortSmem ? sort_smem : reinterpret_cast<uint64_t*>(out);
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  // Keys strictly above the threshold: fewer than k of them, any order (the sort orders them).
  for (int64_t i = threadIdx.x; i < n; i += BLOCK) {
    const uint32_t key = key_of(i);
    if (key > kth) buf[atomicAdd(&s_count, 1ull)] = compose(key, i);
  }
  __syncthreads();
  const int64_t above = static_cast<int64_t>(s_count);
  const int64_t need = k - above;  // >= 1: ties at the threshold, lowest indices first
  constexpr int kItems = 8;
  constexpr int64_t kChunk = static_cast<int64_t>(BLOCK) * kItems;
  int64_t taken = 0;
  for (int64_t base = 0; base < n && taken < need; base += kChunk) {
    const int64_t first = base + static_cast<int64_t>(threadIdx.x) * kItems;
    unsigned flags = 0;
    int local = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (first + j < n && key_of(first + j) == kth) {
        flags |= 1u << j;
        ++local;
      }
    }
    int total;
    int slot = block_exclusive_scan<BLOCK>(local, &total);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (flags & (1u << j)) {
        if (taken + slot < need) buf[above + taken + slot] = compose(kth, first + j);
        ++slot;
      }
    }
    taken += total;
  }
  block_bitonic_sort<BLOCK>(buf, k);
  for (int64_t j = threadIdx.x; j < k; j += BLOCK) {
    out[j] = static_cast<int64_t>(buf[j] & 0xffffffffull);  // same thread reads then writes slot j
  }
  __syncthreads();
}

// expand_tree_step -------------------------------------------------------------------------------------------------
// Kernel 1, one block per (b, f): validation + max (1 pass), log-sum-exp (1 pass), sorted top_k (4-5 passes),
// scores. A failing (b, f) leaves its status encoded in cand_tokens[b, f, 0] (< -1; valid tokens are >= 0):
//   -2: all -inf (kNoValidToken);   -3 - i: NaN / +inf at vocabulary index i (kNonFiniteLogits).
// Kernel 2, one block per b: the row's first failing f (the reference's order) or the num_select best of the
// F * top_k candidates (radix select on the score keys, NaN ranked highest like torch.sort).

template <int BLOCK, typename T>
__global__ void __launch_bounds__(BLOCK) expand_candidates_kernel(ExpandTreeStepParams<T> p) {
  __shared__ RadixHist<uint32_t> hist;
  __shared__ uint64_t sort_smem[kSortSmem];
  const int64_t bf = blockIdx.x, b = bf / p.frontier, f = bf % p.frontier, vocab = p.vocab, k = p.top_k;
  const T* row = p.logits + b * p.logits_stride_b + f * p.logits_stride_f;
  int64_t* tokens = p.cand_tokens + bf * k;
  float* scores = p.cand_scores + bf * k;
  const RowStats s = row_stats<BLOCK, kUnroll>(row, vocab);
  RowStatus st;
  if (!logits_row_ok(s, f, &st)) {
    if (threadIdx.x == 0) tokens[0] = st.code == kNoValidToken ? -2 : -3 - st.value;
    return;
  }
  const float max_x = s.max;
  double sum = 0.0;
  for_each_in_row<BLOCK, kUnroll>(row, vocab,
                                  [&](float x, int64_t) { sum += static_cast<double>(expf(x - max_x)); });
  sum = block_allreduce<BLOCK>(sum, SumOp{});
  const float log_sum = logf(static_cast<float>(sum));
  block_topk_sorted<BLOCK>([&](int64_t i) { return order_key(to_float(row[i])); }, vocab, k, tokens, hist,
                           sort_smem);
  const float parent = p.parent_scores[bf];
  for (int64_t j = threadIdx.x; j < k; j += BLOCK) {
    const float x = to_float(row[tokens[j]]);
    scores[j] = parent + ((x - max_x) - log_sum);  // log_softmax as (x - max) - log(sum exp(x - max))
  }
}

__device__ __forceinline__ uint32_t score_key(float s) { return is_nan(s) ? 0xffffffffu : order_key(s); }

template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) expand_select_kernel(ExpandTreeStepParams<float> p) {
  __shared__ RadixHist<uint32_t> hist;
  __shared__ uint64_t sort_smem[kSortSmem];
  const int64_t b = blockIdx.x, nf = p.frontier, k = p.top_k, m = nf * k;
  int64_t* tokens = p.cand_tokens + b * m;
  float* scores = p.cand_scores + b * m;
  int64_t* selected = p.selected + b * p.num_select;
  int64_t bad_f = kNoIndex;
  for (int64_t f = threadIdx.x; f < nf; f += BLOCK) {
    if (tokens[f * k] < -1 && f < bad_f) bad_f = f;
  }
  bad_f = block_allreduce<BLOCK>(bad_f, MinOp{});
  if (bad_f != kNoIndex) {
    const int64_t code = tokens[bad_f * k];
    __syncthreads();  // every thread has read the code before the row is overwritten
    for (int64_t i = threadIdx.x; i < m; i += BLOCK) {
      tokens[i] = -1;
      scores[i] = neg_inf();
    }
    for (int64_t i = threadIdx.x; i < p.num_select; i += BLOCK) selected[i] = -1;
    if (threadIdx.x == 0) {
      p.status[b] = code == -2 ? RowStatus{kNoValidToken, bad_f, -1} : RowStatus{kNonFiniteLogits, bad_f, -3 - code};
    }
    return;
  }
  block_topk_sorted<BLOCK>([&](int64_t i) { return score_key(scores[i]); }, m, p.num_select, selected, hist,
                           sort_smem);
  if (threadIdx.x == 0) p.status[b] = ok_status();
}

}  // namespace

template <typename T>
void LaunchSampleTokens(const SampleTokensParams<T>& p, cudaStream_t stream) {
  if (p.rows <= 0) return;
  sample_tokens_kernel<kBlock, T><<<static_cast<unsigned>(p.rows), kBlock, 0, stream>>>(p);
  check_launch("sample_tokens");
}

template <typename T>
void LaunchExpandTreeStep(const ExpandTreeStepParams<T>& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.frontier <= 0) return;
  if (p.top_k < 1 || p.top_k > p.vocab || p.num_select < 1 || p.num_select > p.frontier * p.top_k) {
    throw std::invalid_argument("specdec_ext CUDA: expand_tree_step needs 1 <= top_k <= V and "
                                "1 <= num_select <= F * top_k");
  }
  if (p.batch * p.frontier > INT32_MAX || p.vocab > UINT32_MAX || p.frontier * p.top_k > UINT32_MAX) {
    throw std::invalid_argument("specdec_ext CUDA: expand_tree_step sizes too large (B * F < 2^31, V and "
                                "F * top_k < 2^32)");
  }
  expand_candidates_kernel<kBlock, T><<<static_cast<unsigned>(p.batch * p.frontier), kBlock, 0, stream>>>(p);
  check_launch("expand_tree_step (candidates)");
  ExpandTreeStepParams<float> sel{.logits = nullptr,
                                  .logits_stride_b = 0,
                                  .logits_stride_f = 0,
                                  .parent_scores = p.parent_scores,
                                  .batch = p.batch,
                                  .frontier = p.frontier,
                                  .vocab = p.vocab,
                                  .top_k = p.top_k,
                                  .num_select = p.num_select,
                                  .cand_tokens = p.cand_tokens,
                                  .cand_scores = p.cand_scores,
                                  .selected = p.selected,
                                  .status = p.status};
  expand_select_kernel<kBlock><<<static_cast<unsigned>(p.batch), kBlock, 0, stream>>>(sel);
  check_launch("expand_tree_step (select)");
}

#define SPECDEC_INSTANTIATE_SAMPLING(T)                                                       \
  template void LaunchSampleTokens<T>(const SampleTokensParams<T>&, cudaStream_t);          \
  template void LaunchExpandTreeStep<T>(const ExpandTreeStepParams<T>&, cudaStream_t);
SPECDEC_INSTANTIATE_SAMPLING(float)
SPECDEC_INSTANTIATE_SAMPLING(specdec::f16)
SPECDEC_INSTANTIATE_SAMPLING(specdec::bf16)
#undef SPECDEC_INSTANTIATE_SAMPLING

}  // namespace specdec::cuda
