// Row-level building blocks of the CPU kernels: reading a logits row, the filtered target distribution
// (temperature / top-k / top-p), inverse-CDF sampling and validation helpers.
//
// The loops over the vocabulary are written so that GCC/Clang vectorise them (`#pragma omp simd`, branch-free
// bodies, an inline exp), because one verification step reads several full vocabulary rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/dtype.h"
#include "../common/params.h"
#include "../common/status.h"
#include "fast_exp.h"
#include "vocab_loops.h"

namespace specdec::cpu {


// Per-thread scratch: a few vocabulary-sized float buffers, reused across rows and calls.
struct Scratch {
  std::vector<float> x;       // scaled logits of the current node
  std::vector<float> target;  // filtered target weights of the current node
  std::vector<float> work;    // residual / selection scratch
  std::vector<std::pair<float, int32_t>> pairs;
  std::vector<double> bucket_mass;

  void reserve(int64_t vocab) {
    if (static_cast<int64_t>(x.size()) < vocab) {
      x.resize(vocab);
      target.resize(vocab);
      work.resize(vocab);
    }
  }
};

inline Scratch& thread_scratch(int64_t vocab) {
  thread_local Scratch scratch;
  scratch.reserve(vocab);
  return scratch;
}

struct RowScan {
  float max = 0.0f;
  int64_t argmax = -1;  // first index of the maximum
  int64_t bad = -1;     // first index holding NaN or +inf, or -1
};

// Vocabulary loops work in blocks of kBlock elements: a vectorised test over the block decides whether the scalar
// work inside it (finding an index, inserting into a top-k list) is needed at all.
constexpr int64_t kBlock = 32;

// First t with x[t] == value, or -1.
inline int64_t first_equal(const float* x, int64_t n, float value) {
  for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
    const int64_t t1 = std::min(n, t0 + kBlock);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t t = t0; t < t1; ++t) hit |= x[t] == value;
    if (!hit) continue;
    for (int64_t t = t0; t < t1; ++t) {
      if (x[t] == value) return t;
    }
  }
  return -1;
}

// Largest of x[t0..t1) (NaN-free input).
inline float block_max(const float* x, int64_t t0, int64_t t1) {
  float m = neg_inf();
#pragma omp simd reduction(max : m)
  for (int64_t t = t0; t < t1; ++t) m = x[t] > m ? x[t] : m;
  return m;
}

// Converts one logits row to float32 (`out`), finds its maximum and first argmax, and detects NaN / +inf.
template <typename T>
RowScan scan_logits(const T* row, int64_t vocab, float* out) {
  float m = neg_inf();
  int bad = 0;
  if constexpr (std::is_same_v<T, float>) {
    const FloatRowScan scan = scan_floats(row, out, vocab);
    m = scan.max;
    bad = scan.bad;
  } else {
#pragma omp simd reduction(max : m) reduction(| : bad)
    for (int64_t t = 0; t < vocab; ++t) {
      const float v = to_float(row[t]);
      out[t] = v;
      bad |= (v != v) | (v == -neg_inf());
      m = v > m ? v : m;
    }
  }
  RowScan s;
  s.max = m;
  if (bad) {
    for (int64_t t = 0; t < vocab; ++t) {
      if (is_nan(out[t]) || is_pos_inf(out[t])) {
        s.bad = t;
        break;
      }
    }
    return s;
  }
  s.argmax = first_equal(out, vocab, m);
  return s;
}

// Status of a scanned row: NaN/+inf first, then "all -inf".
inline bool logits_row_invalid(const RowScan& s, int64_t node, RowStatus* status) {
  if (s.bad >= 0) {
    *status = {kNonFiniteLogits, node, s.bad};
    return true;
  }
  if (s.max == neg_inf()) {
    *status = {kNoValidToken, node, -1};
    return true;
  }
  return false;
}

// The k-th largest value of x[0..n) (1 <= k <= n). Small k: one pass keeping the k largest in a sorted buffer;
// large k: nth_element on a copy.
inline float kth_largest(const float* x, int64_t n, int64_t k, std::vector<float>& buffer) {
  if (k <= 64) {
    float top[64] = {};
    int64_t filled = 0;
    for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
      const int64_t t1 = std::min(n, t0 + kBlock);
      if (filled == k && !(block_max(x, t0, t1) > top[k - 1])) continue;  // nothing here enters the list
      for (int64_t t = t0; t < t1; ++t) {
        const float v = x[t];
        if (filled == k && !(v > top[k - 1])) continue;
        int64_t pos = filled < k ? filled++ : k - 1;
        while (pos > 0 && top[pos - 1] < v) {
          top[pos] = top[pos - 1];
          --pos;
        }
        top[pos] = v;
      }
    }
    return top[k - 1];
  }
  buffer.assign(x, x + n);
  std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<float>());
  return buffer[k - 1];
}

// Validates one row's sampling parameters (params.h order: temperature, then top_k, then top_p); top_k and top_p
// are skipped when `filters` is false (typical acceptance has neither).
inline bool sampling_params_invalid(float temperature, int64_t top_k, float top_p, bool filters,
                                    RowStatus* status) {
  if (!(temperature >= 0.0f) || is_pos_inf(temperature)) {  // (NaN fails the comparison)
    *status = {kBadTemperature, 0, 0};
    return true;
  }
  if (filters && top_k < 0) {
    *status = {kBadTopK, 0, top_k};
    return true;
  }
  if (filters && !(top_p > 0.0f && top_p <= 1.0f)) {
    *status = {kBadTopP, 0, 0};
    return true;
  }
  return false;
}

// Validates uniforms u[0..n) in [0, 1) (NaN fails). `column_status`: the status names the column (a [B, N]
// matrix); otherwise node -1 (a [B] vector, n = 1).
inline bool uniforms_invalid(const float* u, int64_t n, bool column_status, RowStatus* status) {
  for (int64_t c = 0; c < n; ++c) {
    if (!(u[c] >= 0.0f && u[c] < 1.0f)) {
      *status = {kBadUniform, column_status ? c : -1, 0};
      return true;
    }
  }
  return false;
}


// The top-p cut: x_m for the first position m, in descending-x order over kept tokens (x >= threshold), at which
// the running sum of w reaches `goal`; the smallest kept x if rounding leaves the sum short. Instead of sorting
// the vocabulary, tokens are bucketed by the top 12 bits of their order key (sign, exponent, 3 mantissa bits);
// whole buckets are summed from the top, and only the bucket where the running mass crosses `goal` is sorted.
inline float top_p_cut(const float* x, const float* w, int64_t vocab, float threshold, double goal,
                       Scratch& scratch) {
  constexpr int kBits = 12;
  constexpr int kBuckets = 1 << kBits;
  std::vector<double>& mass = scratch.bucket_mass;
  mass.assign(kBuckets, 0.0);
  float smallest_kept = -neg_inf();
  for (int64_t t = 0; t < vocab; ++t) {
    if (x[t] >= threshold) {
      mass[order_key(x[t]) >> (32 - kBits)] += w[t];
      smallest_kept = x[t] < smallest_kept ? x[t] : smallest_kept;
    }
  }
  double running = 0.0;
  for (int bucket = kBuckets - 1; bucket >= 0; --bucket) {
    if (mass[bucket] == 0.0 || running + mass[bucket] < goal) {
      running += mass[bucket];
      continue;
    }
    auto& pairs = scratch.pairs;
    pairs.clear();
    for (int64_t t = 0; t < vocab; ++t) {
      if (x[t] >= threshold && static_cast<int>(order_key(x[t]) >> (32 - kBits)) == bucket) {
        pairs.emplace_back(x[t], static_cast<int32_t>(t));
      }
    }
    std::sort(pairs.begin(), pairs.end(),
              [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) { return a.first > b.first; });
    for (const auto& [value, token] : pairs) {
      running += w[token];
      if (running >= goal) return value;
    }
  }
  return smallest_kept;
}

// Fills w[0..V) with the filtered, unnormalised target weights of a logits row (see SamplingParams in params.h)
// and returns their sum. `scan` must come from scan_logits on the same row (x: its logits as float32, unchanged).
inline double filtered_weights(float* x, const RowScan& scan, int64_t vocab, float temperature, int64_t top_k,
                               float top_p, float* w, Scratch& scratch) {
  if (temperature == 0.0f) {
    std::fill(w, w + vocab, 0.0f);
    w[scan.argmax] = 1.0f;
    return 1.0;
  }
  // Thresholds rank the logits themselves (params.h); weights exp((logits - max) / temperature) never overflow.
  float threshold = neg_inf();
  const bool use_top_k = top_k > 0 && top_k < vocab;
  if (use_top_k) threshold = kth_largest(x, vocab, top_k, scratch.work);
  scaled_exp_weights(x, w, vocab, scan.max, temperature, threshold);
  double z = sum_of(w, vocab);
  if (top_p < 1.0f) {
    const float cut = top_p_cut(x, w, vocab, threshold, static_cast<double>(top_p) * z, scratch);
    if (cut > threshold) {
      zero_below(x, w, vocab, cut);
      z = sum_of(w, vocab);
    }
  }
  return z;
}

// Inverse CDF: the first token whose running sum of w exceeds u * total; the last token with w > 0 if rounding
// leaves none; -1 when w is all zero.
inline int64_t inverse_cdf(const float* w, int64_t vocab, double total, float u) {
  const double goal = static_cast<double>(u) * total;
  // Whole chunks are summed with vector code; the chunk where the running sum crosses `goal` is rescanned.
  constexpr int64_t kChunk = 256;
  double running = 0.0;
  int64_t t0 = 0;
  for (; t0 < vocab; t0 += kChunk) {
    const int64_t t1 = std::min(vocab, t0 + kChunk);
    const double chunk = sum_of(w + t0, t1 - t0);
    if (running + chunk > goal) break;
    running += chunk;
  }
  for (int64_t t = t0; t < vocab; ++t) {
    running += w[t];
    if (w[t] > 0.0f && running > goal) return t;
  }
  for (int64_t t = vocab - 1; t >= 0; --t) {
    if (w[t] > 0.0f) return t;  // rounding left the running sum short of the goal
  }
  return -1;
}


// Tree validation (node 0 is the root, every other parent an earlier node), then draft tokens in [0, vocab) when
// `tokens` is given. Returns false and fills `status` on the first failure.
inline bool tree_row_valid(const int64_t* parents, const int64_t* tokens, int64_t num_nodes, int64_t vocab,
                           RowStatus* status) {
  if (parents[0] != -1) {
    *status = {kRootNotMinusOne, 0, parents[0]};
    return false;
  }
  for (int64_t i = 1; i < num_nodes; ++i) {
    if (parents[i] < 0 || parents[i] >= i) {
      *status = {kParentNotEarlier, i, parents[i]};
      return false;
    }
  }
  if (tokens != nullptr) {
    for (int64_t i = 1; i < num_nodes; ++i) {
      if (tokens[i] < 0 || tokens[i] >= vocab) {
        *status = {kTokenOutOfRange, i, tokens[i]};
        return false;
      }
    }
  }
  return true;
}

// Writes the accepted path (root first, `length` draft tokens after it) and the next token of one row.
inline void write_verification(const VerifyOutputs& out, int64_t b, int64_t num_nodes, const int64_t* path,
                               int64_t length, int64_t next_token) {
  int64_t* accepted = out.accepted + b * num_nodes;
  for (int64_t i = 0; i < num_nodes; ++i) accepted[i] = i <= length ? path[i] : -1;
  out.accept_len[b] = length;
  out.next_token[b] = next_token;
}

// Sentinel outputs of a row that has not (or not successfully) been verified.
inline void write_invalid_row(const VerifyOutputs& out, int64_t b, int64_t num_nodes) {
  std::fill(out.accepted + b * num_nodes, out.accepted + (b + 1) * num_nodes, int64_t{-1});
  out.accept_len[b] = 0;
  out.next_token[b] = -1;
}

}  // namespace specdec::cpu
