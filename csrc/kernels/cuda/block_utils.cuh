// Block-wide building blocks shared by the CUDA kernels (one thread block works on one vocabulary row):
// reductions and scans that return the same value to every thread, a vectorised row reader, row statistics
// (validation + first argmax), radix selection and inverse-CDF sampling.
//
// Conventions: every helper here must be called by ALL threads of the block with the same arguments (they
// contain __syncthreads); results are returned to every thread, so callers can keep control flow uniform.
// BLOCK is the block size, a multiple of 32 and at most 1024.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"
#include "../common/status.h"

namespace specdec::cuda::detail {

constexpr int64_t kNoIndex = INT64_MAX;  // "no such index" in min-reductions
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------------------------
// Reductions and scans (deterministic: fixed combination order, so every run gives identical floats).

struct MaxOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a > b ? a : b; }
};
struct MinOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a < b ? a : b; }
};
struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};

// Reduces `v` over the block with `op` (associative, commutative); every thread gets the result.
template <int BLOCK, typename V, typename Op>
__device__ __forceinline__ V block_allreduce(V v, Op op) {
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "BLOCK must be a multiple of 32, at most 1024");
  __shared__ V partial[BLOCK / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // the previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  V r = partial[0];
#pragma unroll
  for (int w = 1; w < BLOCK / 32; ++w) r = op(r, partial[w]);
  return r;
}

// (value, index) pair for "first argmax": larger value wins, equal values keep the lower index. NaN excluded.
struct ArgMax {
  float value;
  int64_t index;
};
__device__ __forceinline__ ArgMax argmax_combine(ArgMax a, ArgMax b) {
  if (a.value > b.value) return a;
  if (b.value > a.value) return b;
  return a.index <= b.index ? a : b;
}

template <int BLOCK>
__device__ __forceinline__ ArgMax block_allreduce_argmax(ArgMax v) {
  __shared__ float part_v[BLOCK / 32];
  __shared__ int64_t part_i[BLOCK / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax other{__shfl_xor_sync(kFullMask, v.value, o), __shfl_xor_sync(kFullMask, v.index, o)};
    v = argmax_combine(v, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    part_v[warp] = v.value;
    part_i[warp] = v.index;
  }
  __syncthreads();
  ArgMax r{part_v[0], part_i[0]};
#pragma unroll
  for (int w = 1; w < BLOCK / 32; ++w) r = argmax_combine(r, ArgMax{part_v[w], part_i[w]});
  return r;
}

// Exclusive prefix sum over threads in threadIdx order; `*total` gets the block total (every thread).
template <int BLOCK, typename V>
__device__ __forceinline__ V block_exclusive_scan(V v, V* total) {
  __shared__ V warp_total[BLOCK / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  V incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const V n = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += n;
  }
  V excl = __shfl_up_sync(kFullMask, incl, 1);
  if (lane == 0) excl = V(0);
  __syncthreads();
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  V prefix = V(0), sum = V(0);
#pragma unroll
  for (int w = 0; w < BLOCK / 32; ++w) {
    if (w == warp) prefix = sum;
    sum += warp_total[w];
  }
  *total = sum;
  return prefix + excl;
}

// ---------------------------------------------------------------------------------------------------------------
// Row reading.

// 16-byte vector of T unpacked to floats.
template <typename T>
struct Vec16 {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));
};

__device__ __forceinline__ void unpack16(const uint4& raw, float (&out)[4], const float*) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}
template <typename H>
__device__ __forceinline__ void unpack16(const uint4& raw, float (&out)[8], const H*) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = to_float(H{static_cast<uint16_t>(w[j] & 0xffffu)});
    out[2 * j + 1] = to_float(H{static_cast<uint16_t>(w[j] >> 16)});
  }
}

// Read-only (non-coherent cache) loads for inputs; plain loads for buffers the kernel itself writes.
template <bool kReadOnly>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  if constexpr (kReadOnly) {
    return __ldg(p);
  } else {
    return *p;
  }
}

// Calls f(value_as_float, index) exactly once for every index in [0, n) of `row`, spread over the block's
// threads in no particular order. The aligned body uses 16-byte loads, UNROLL of them in flight per thread
// (memory-level parallelism is what one block per row needs to approach copy bandwidth).
template <int BLOCK, int UNROLL, bool kReadOnly = true, typename T, typename F>
__device__ __forceinline__ void for_each_in_row(const T* row, int64_t n, F&& f) {
  constexpr int kVec = Vec16<T>::kN;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row);
  int64_t head = static_cast<int64_t>(((16u - (addr & 15u)) & 15u) / sizeof(T));
  if (addr % sizeof(T) != 0) head = n;  // misaligned element pointer (never from torch): scalar path only
  if (head > n) head = n;
  for (int64_t i = threadIdx.x; i < head; i += BLOCK) f(to_float(row[i]), i);
  const int64_t nvec = (n - head) / kVec;
  const uint4* vrow = reinterpret_cast<const uint4*>(row + head);
  int64_t v = threadIdx.x;
  for (; v + static_cast<int64_t>(UNROLL - 1) * BLOCK < nvec; v += static_cast<int64_t>(UNROLL) * BLOCK) {
    uint4 raw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) raw[u] = load16<kReadOnly>(vrow + v + u * BLOCK);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float vals[kVec];
      unpack16(raw[u], vals, row);
      const int64_t base = head + (v + u * BLOCK) * kVec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(vals[j], base + j);
    }
  }
  for (; v < nvec; v += BLOCK) {
    float vals[kVec];
    unpack16(load16<kReadOnly>(vrow + v), vals, row);
#pragma unroll
    for (int j = 0; j < kVec; ++j) f(vals[j], head + v * kVec + j);
  }
  for (int64_t i = head + nvec * kVec + threadIdx.x; i < n; i += BLOCK) f(to_float(row[i]), i);
}

// ---------------------------------------------------------------------------------------------------------------
// Row statistics: validation and first argmax in one pass.

struct RowStats {
  float max;        // largest finite-or--inf value (-inf when all are -inf)
  int64_t argmax;   // first index holding `max`
  int64_t bad;      // first NaN / +inf index, or kNoIndex
};

template <int BLOCK, int UNROLL, typename T>
__device__ __forceinline__ RowStats row_stats(const T* row, int64_t n) {
  ArgMax best{neg_inf(), kNoIndex};
  int64_t bad = kNoIndex;
  for_each_in_row<BLOCK, UNROLL>(row, n, [&](float x, int64_t i) {
    if (is_nan(x) || is_pos_inf(x)) {
      bad = i < bad ? i : bad;
    } else {
      best = argmax_combine(best, ArgMax{x, i});
    }
  });
  const ArgMax b = block_allreduce_argmax<BLOCK>(best);
  const int64_t first_bad = block_allreduce<BLOCK>(bad, MinOp{});
  return RowStats{b.value, b.index, first_bad};
}

// Status of a logits row from its stats (params.h order: NaN/+inf first, then all -inf). Returns true if valid.
__device__ __forceinline__ bool logits_row_ok(const RowStats& s, int64_t node, RowStatus* st) {
  if (s.bad != kNoIndex) {
    *st = RowStatus{kNonFiniteLogits, node, s.bad};
    return false;
  }
  if (s.max == neg_inf()) {
    *st = RowStatus{kNoValidToken, node, -1};
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// Radix selection of a threshold key in descending key order.
//
// Finds the key K such that, with weight(K') summed over the emitted (key, weight) pairs,
//   weight(keys > K) < target <= weight(keys >= K),
// i.e. the key of the element at which the running weight in descending-key order first reaches `target`.
// With unit weights and target k this is the k-th largest key (ties counted). Zero weights are ignored, so K is
// always the key of an element with positive weight. If the total weight falls short of the target (float
// rounding), K is the smallest key with positive weight ("keep everything"); `*reached` reports which.
// Three passes over the data (11 + 11 + 10 bits). `for_each(emit)` must call emit(key, weight) for every element.
// `get_target()` is called once by all threads after the first pass (so it may finish a reduction that the
// first pass accumulated, e.g. a total to scale).
template <typename W>
struct RadixHist {
  W bins[2048];
};

template <int BLOCK, typename W, typename ForEach, typename GetTarget>
__device__ uint32_t radix_select_desc(ForEach&& for_each, GetTarget&& get_target, RadixHist<W>& hist,
                                      bool* reached) {
  static_assert(BLOCK <= 1024, "each thread owns >= 1 bin");
  uint32_t prefix = 0, prefix_mask = 0;
  W above = W(0), target = W(0);
  bool hit_all = true;
  __shared__ W s_above;
#pragma unroll 1
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
    const int nbins = level == 2 ? 1024 : 2048;
    for (int i = threadIdx.x; i < nbins; i += BLOCK) hist.bins[i] = W(0);
    __syncthreads();
    const uint32_t pm = prefix_mask, pf = prefix;
    const uint32_t digit_mask = static_cast<uint32_t>(nbins - 1);
    for_each([&](uint32_t key, W w) {
      if (w > W(0) && (key & pm) == pf) atomicAdd(&hist.bins[(key >> shift) & digit_mask], w);
    });
    __syncthreads();
    if (level == 0) target = get_target();
    // Thread t owns bins [hi - per, hi), hi = nbins - t * per: lower threads own higher keys, so an exclusive
    // scan over threads gives the weight above each thread's bins.
    const int per = nbins / BLOCK;
    const int hi = nbins - static_cast<int>(threadIdx.x) * per;
    W local = W(0);
    for (int j = 1; j <= per; ++j) local += hist.bins[hi - j];
    W total;
    const W excl = block_exclusive_scan<BLOCK>(local, &total);
    W running = above + excl;
    int hit = -1, low = INT32_MAX;
    W hit_above = W(0), low_above = W(0);
    for (int j = 1; j <= per; ++j) {
      const int bin = hi - j;
      const W h = hist.bins[bin];
      const W before = running;
      running += h;
      if (h > W(0)) {
        if (hit < 0 && running >= target) {
          hit = bin;
          hit_above = before;
        }
        low = bin;
        low_above = before;
      }
    }
    const int best_hit = block_allreduce<BLOCK>(hit, MaxOp{});
    const int lowest = block_allreduce<BLOCK>(low, MinOp{});
    if (best_hit < 0 && lowest == INT32_MAX) {
      // Nothing with positive weight in the bucket (cannot happen for a valid row): keep everything.
      *reached = false;
      return 0u;
    }
    const int chosen = best_hit >= 0 ? best_hit : lowest;
    if (best_hit < 0) hit_all = false;
    // The owner of `chosen` has hit == best_hit (its highest hit) or low == lowest (its lowest positive bin).
    if (chosen >= hi - per && chosen < hi) s_above = best_hit >= 0 ? hit_above : low_above;
    __syncthreads();
    above = s_above;
    prefix |= static_cast<uint32_t>(chosen) << shift;
    prefix_mask |= digit_mask << shift;
  }
  *reached = hit_all;
  return prefix;
}

// ---------------------------------------------------------------------------------------------------------------
// Inverse-CDF sampling in increasing index order.
//
// Returns the first i whose running sum of value(i) exceeds `target` (running sum and comparison in float64, as
// params.h specifies), or, if none does,
// the last i with value(i) > 0 (or -1). value(i) is called once per index in ascending chunks; with
// kFullPass the scan visits every index even after the hit (callers that write a side output per index).
template <int BLOCK, bool kFullPass, typename ValueFn>
__device__ int64_t inverse_cdf(ValueFn&& value, int64_t n, double target) {
  constexpr int kItems = 4;  // contiguous items per thread per chunk
  constexpr int64_t kChunk = static_cast<int64_t>(BLOCK) * kItems;
  double carry = 0.0;
  int64_t found = kNoIndex, last_pos = -1;
#pragma unroll 1
  for (int64_t base = 0; base < n; base += kChunk) {
    const int64_t first = base + static_cast<int64_t>(threadIdx.x) * kItems;
    float vals[kItems];
    double local = 0.0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      vals[j] = first + j < n ? value(first + j) : 0.0f;
      local += static_cast<double>(vals[j]);
    }
    double total;
    double running = carry + block_exclusive_scan<BLOCK>(local, &total);
    int64_t mine = kNoIndex;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      running += static_cast<double>(vals[j]);
      if (first + j < n) {
        if (vals[j] > 0.0f) last_pos = first + j;
        if (mine == kNoIndex && running > target) mine = first + j;
      }
    }
    carry += total;
    if (found == kNoIndex) {
      found = block_allreduce<BLOCK>(mine, MinOp{});
      if (!kFullPass && found != kNoIndex) return found;
    }
  }
  if (found != kNoIndex) return found;
  return block_allreduce<BLOCK>(last_pos, MaxOp{});
}

}  // namespace specdec::cuda::detail
