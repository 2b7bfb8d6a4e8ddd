// Row-level building blocks of the CPU kernels: reading a logits row, the filtered target distribution
// (temperature / top-k / top-p), inverse-CDF sampling and validation helpers.
//
// The loops over the vocabulary are written so that GCC/Clang vectorise them (`#pragma omp simd`, branch-free
// bodies, an inline exp), because one verification step reads several full vocabulary rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/dtype.h"
#include "../common/params.h"
#include "../common/status.h"

namespace specdec::cpu {

// exp(x) for x <= 0 (every use here subtracts the row maximum first); exact 0 below -87.3 (float underflow), so
// -inf logits get weight 0. Cephes-style range reduction and a degree-6 polynomial: within 2 ulp of expf, and
// inline + branch-free so that vocabulary loops vectorise.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.3f ? -87.3f : x;
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;  // ln2 split in two for an exact reduction
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const int32_t exponent = static_cast<int32_t>(n) + 127;
  const float scale = bits_to_float(static_cast<uint32_t>(exponent) << 23);
  return x < -87.3f ? 0.0f : poly * scale;
}

// Per-thread scratch: a few vocabulary-sized float buffers, reused across rows and calls.
struct Scratch {
  std::vector<float> x;       // scaled logits of the current node
  std::vector<float> target;  // filtered target weights of the current node
  std::vector<float> work;    // residual / selection scratch
  std::vector<std::pair<float, int32_t>> pairs;

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

// Converts one logits row to float32 (`out`), finds its maximum and first argmax, and detects NaN / +inf.
template <typename T>
RowScan scan_logits(const T* row, int64_t vocab, float* out) {
  float m = neg_inf();
  int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
  for (int64_t t = 0; t < vocab; ++t) {
    const float v = to_float(row[t]);
    out[t] = v;
    bad |= (v != v) | (v == -neg_inf());
    m = v > m ? v : m;
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
  for (int64_t t = 0; t < vocab; ++t) {
    if (out[t] == m) {
      s.argmax = t;
      break;
    }
  }
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
    float top[64];
    int64_t filled = 0;
    for (int64_t t = 0; t < n; ++t) {
      const float v = x[t];
      if (filled == k && !(v > top[k - 1])) continue;
      int64_t pos = filled < k ? filled++ : k - 1;
      while (pos > 0 && top[pos - 1] < v) {
        top[pos] = top[pos - 1];
        --pos;
      }
      top[pos] = v;
    }
    return top[k - 1];
  }
  buffer.assign(x, x + n);
  std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<float>());
  return buffer[k - 1];
}

// Validates one row's sampling parameters (temperature, then top_p). top_p is skipped when `check_top_p` is false.
inline bool sampling_params_invalid(float temperature, float top_p, bool check_top_p, RowStatus* status) {
  if (!(temperature >= 0.0f)) {
    *status = {kBadTemperature, 0, 0};
    return true;
  }
  if (check_top_p && !(top_p > 0.0f && top_p <= 1.0f)) {
    *status = {kBadTopP, 0, 0};
    return true;
  }
  return false;
}

// Fills w[0..V) with the filtered, unnormalised target weights of a logits row (see SamplingParams in params.h)
// and returns their sum. `scan` must come from scan_logits on the same row (x holds the raw logits as float32,
// and is overwritten with the scaled logits).
inline double filtered_weights(float* x, const RowScan& scan, int64_t vocab, float temperature, int64_t top_k,
                               float top_p, float* w, Scratch& scratch) {
  if (temperature == 0.0f) {
    std::fill(w, w + vocab, 0.0f);
    w[scan.argmax] = 1.0f;
    return 1.0;
  }
  // Scale; division (not a reciprocal multiply) so the result is bit-identical to the reference.
#pragma omp simd
  for (int64_t t = 0; t < vocab; ++t) x[t] = x[t] / temperature;
  const float m = scan.max / temperature;
  float threshold = neg_inf();
  const bool use_top_k = top_k > 0 && top_k < vocab;
  if (use_top_k) threshold = kth_largest(x, vocab, top_k, scratch.work);
  float z = 0.0f;
#pragma omp simd reduction(+ : z)
  for (int64_t t = 0; t < vocab; ++t) {
    const float v = x[t] >= threshold ? exp_nonpositive(x[t] - m) : 0.0f;
    w[t] = v;
    z += v;
  }
  if (top_p < 1.0f) {
    // Visit kept tokens in descending x until the running mass reaches top_p * z. Sort progressively larger
    // prefixes (most distributions reach top_p within a few hundred tokens).
    auto& pairs = scratch.pairs;
    pairs.clear();
    for (int64_t t = 0; t < vocab; ++t) {
      if (x[t] >= threshold) pairs.emplace_back(x[t], static_cast<int32_t>(t));
    }
    const float goal = top_p * z;
    const auto by_x_desc = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
      return a.first > b.first;
    };
    const int64_t n = static_cast<int64_t>(pairs.size());
    float cut = n > 0 ? pairs[0].first : threshold;
    bool found = false;
    int64_t sorted = 0;
    double running = 0.0;
    for (int64_t chunk = 256; !found && sorted < n; chunk *= 4) {
      const int64_t upto = std::min(n, sorted + chunk);
      std::partial_sort(pairs.begin() + sorted, pairs.begin() + upto, pairs.end(), by_x_desc);
      for (int64_t i = sorted; i < upto; ++i) {
        running += w[pairs[i].second];
        if (static_cast<float>(running) >= goal) {
          cut = pairs[i].first;
          found = true;
          break;
        }
      }
      sorted = upto;
    }
    if (!found && n > 0) cut = pairs[n - 1].first;  // rounding left the sum short: keep every kept token
    if (cut > threshold) {
      z = 0.0f;
#pragma omp simd reduction(+ : z)
      for (int64_t t = 0; t < vocab; ++t) {
        const float v = x[t] >= cut ? w[t] : 0.0f;
        w[t] = v;
        z += v;
      }
    }
  }
  return z;
}

// Inverse CDF: the first token whose running sum of w exceeds u * total; the last token with w > 0 if rounding
// leaves none; -1 when w is all zero.
inline int64_t inverse_cdf(const float* w, int64_t vocab, double total, float u) {
  const double goal = static_cast<double>(u) * total;
  double running = 0.0;
  int64_t last_positive = -1;
  for (int64_t t = 0; t < vocab; ++t) {
    if (w[t] > 0.0f) {
      running += w[t];
      last_positive = t;
      if (static_cast<float>(running) > goal) return t;
    }
  }
  return last_positive;
}

inline double sum_of(const float* w, int64_t vocab) {
  float z = 0.0f;
#pragma omp simd reduction(+ : z)
  for (int64_t t = 0; t < vocab; ++t) z += w[t];
  return z;
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
