// TreeAttention and CompactKv CPU kernels: against a plain double-precision attention written here, mask layouts,
// GQA, strided caches, per-row prefixes, invalid rows; compaction with overlapping moves and every status code.
#include <cmath>
#include <cstdint>
#include <vector>

#include "check.h"
#include "cpu/kernels.h"
#include "test_util.h"

using namespace specdec;
using testutil::from_float;

namespace {

using testutil::Rng;

struct AttnCase {
  int64_t B, H, Hkv, N, D, S;
  std::vector<int64_t> prefix;
  std::vector<float> q, k, v;  // q [B, H, N, D]; k, v [B, Hkv, S, D] (contiguous here)
  std::vector<uint8_t> mask;   // [B, N, N]: random ancestor-like masks (diagonal set)
};

AttnCase make_case(int64_t B, int64_t H, int64_t Hkv, int64_t N, int64_t D, int64_t S, uint64_t seed) {
  Rng rng(seed);
  AttnCase c{B, H, Hkv, N, D, S, std::vector<int64_t>(B), {}, {}, {}, {}};
  for (int64_t b = 0; b < B; ++b) c.prefix[b] = rng.below(S - N + 1);
  c.q.resize(B * H * N * D);
  c.k.resize(B * Hkv * S * D);
  c.v.resize(B * Hkv * S * D);
  for (auto& x : c.q) x = rng.normalish();
  for (auto& x : c.k) x = rng.normalish();
  for (auto& x : c.v) x = rng.normalish();
  c.mask.assign(B * N * N, 0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> parent(N, -1);
    for (int64_t i = 1; i < N; ++i) parent[i] = rng.below(i);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t a = i; a != -1; a = parent[a]) c.mask[(b * N + i) * N + a] = 1;
  }
  return c;
}

std::vector<int32_t> pack(const std::vector<uint8_t>& dense, int64_t B, int64_t N) {
  const int64_t W = packed_mask_words(N);
  std::vector<int32_t> words(B * N * W, 0);
  for (int64_t r = 0; r < B * N; ++r)
    for (int64_t j = 0; j < N; ++j)
      if (dense[r * N + j]) words[r * W + j / 32] = static_cast<int32_t>(static_cast<uint32_t>(words[r * W + j / 32]) |
                                                                        (1u << (j % 32)));
  return words;
}

// Plain attention in double over the (already rounded) float inputs.
std::vector<double> naive(const AttnCase& c, float scale) {
  const int64_t G = c.H / c.Hkv;
  std::vector<double> out(c.B * c.H * c.N * c.D, 0.0);
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t P = c.prefix[b];
    if (P < 0 || P > c.S - c.N) continue;
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.N; ++i) {
        const float* q = c.q.data() + ((b * c.H + h) * c.N + i) * c.D;
        std::vector<double> s(P + c.N, -INFINITY);
        double mx = -INFINITY;
        for (int64_t t = 0; t < P + c.N; ++t) {
          if (t >= P && !c.mask[(b * c.N + i) * c.N + (t - P)]) continue;
          const float* k = c.k.data() + ((b * c.Hkv + h / G) * c.S + t) * c.D;
          double d = 0;
          for (int64_t x = 0; x < c.D; ++x) d += static_cast<double>(q[x]) * k[x];
          s[t] = d * scale;
          mx = std::max(mx, s[t]);
        }
        if (mx == -INFINITY) continue;
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - mx));
        double* o = out.data() + ((b * c.H + h) * c.N + i) * c.D;
        for (int64_t t = 0; t < P + c.N; ++t) {
          if (s[t] == 0) continue;
          const float* v = c.v.data() + ((b * c.Hkv + h / G) * c.S + t) * c.D;
          for (int64_t x = 0; x < c.D; ++x) o[x] += s[t] / sum * v[x];
        }
      }
  }
  return out;
}

template <typename T>
std::vector<float> run(const AttnCase& c, float scale, bool packed, std::vector<RowStatus>* status = nullptr) {
  const std::vector<T> q = testutil::convert<T>(c.q), k = testutil::convert<T>(c.k), v = testutil::convert<T>(c.v);
  const std::vector<int32_t> words = pack(c.mask, c.B, c.N);
  std::vector<T> out(c.B * c.H * c.N * c.D, from_float<T>(7.0f));
  std::vector<RowStatus> st(c.B, RowStatus{99, 99, 99});
  TreeAttentionParams<T> p{.q = q.data(), .q_stride_b = c.H * c.N * c.D, .q_stride_h = c.N * c.D, .q_stride_n = c.D,
                           .k = k.data(), .k_stride_b = c.Hkv * c.S * c.D, .k_stride_h = c.S * c.D, .k_stride_s = c.D,
                           .v = v.data(), .v_stride_b = c.Hkv * c.S * c.D, .v_stride_h = c.S * c.D, .v_stride_s = c.D,
                           .prefix_lens = c.prefix.data(),
                           .mask_dense = packed ? nullptr : reinterpret_cast<const bool*>(c.mask.data()),
                           .mask_packed = packed ? words.data() : nullptr, .batch = c.B, .num_heads = c.H,
                           .num_kv_heads = c.Hkv, .num_nodes = c.N, .num_tree_keys = c.N, .head_dim = c.D,
                           .seq_len = c.S, .scale = scale, .out = out.data(), .workspace = nullptr,
                           .workspace_floats = 0, .status = st.data()};
  // Two task ranges, as a parallel caller would split them.
  const int64_t tasks = c.B * c.Hkv;
  cpu::TreeAttention(p, 0, tasks / 2);
  cpu::TreeAttention(p, tasks / 2, tasks);
  if (status) *status = st;
  std::vector<float> f(out.size());
  for (size_t i = 0; i < out.size(); ++i) f[i] = to_float(out[i]);
  return f;
}

double max_err(const std::vector<float>& got, const std::vector<double>& want) {
  double e = 0;
  for (size_t i = 0; i < got.size(); ++i) e = std::max(e, std::fabs(got[i] - want[i]));
  return e;
}

// Inputs rounded to T first, so the naive reference sees exactly what the kernel reads.
template <typename T>
AttnCase rounded(AttnCase c) {
  for (auto* vec : {&c.q, &c.k, &c.v})
    for (auto& x : *vec) x = to_float(from_float<T>(x));
  return c;
}

}  // namespace

TEST_CASE("tree attention (float) equals plain attention: every head dim, GQA, ragged prefixes") {
  const int64_t dims[] = {64, 80, 96, 128, 256};
  for (int64_t D : dims) {
    const AttnCase c = make_case(3, 4, 2, 9, D, 150, 11 + D);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    std::vector<RowStatus> st;
    const std::vector<float> got = run<float>(c, scale, false, &st);
    CHECK(max_err(got, naive(c, scale)) < 2e-5);
    for (auto& s : st) CHECK_EQ(s.code, int64_t{kOk});
    CHECK(run<float>(c, scale, true) == got);  // packed mask: identical
  }
  const AttnCase mha = make_case(2, 3, 3, 70, 64, 300, 5);  // N > 64 (three mask words), MHA
  CHECK(max_err(run<float>(mha, 0.125f, true), naive(mha, 0.125f)) < 2e-5);
}

TEST_CASE("tree attention (bf16, f16) equals plain attention on the rounded inputs") {
  const AttnCase c = make_case(2, 8, 2, 26, 128, 400, 3);
  CHECK(max_err(run<bf16>(rounded<bf16>(c), 0.09f, false), naive(rounded<bf16>(c), 0.09f)) < 1e-2);
  CHECK(max_err(run<f16>(rounded<f16>(c), 0.09f, true), naive(rounded<f16>(c), 0.09f)) < 2e-3);
}

TEST_CASE("tree attention: prefix 0, empty mask rows, invalid prefix rows") {
  AttnCase c = make_case(3, 2, 1, 5, 64, 20, 9);
  c.prefix = {0, -1, 16};  // row 1 invalid (negative), row 2 invalid (16 + 5 > 20)
  for (int64_t j = 0; j < 5; ++j) c.mask[(0 * 5 + 3) * 5 + j] = 0;  // row 0, node 3 sees nothing
  std::vector<RowStatus> st;
  const std::vector<float> got = run<float>(c, 0.125f, false, &st);
  CHECK_EQ(st[0].code, int64_t{kOk});
  CHECK_EQ(st[1].code, int64_t{kBadPrefixLen});
  CHECK_EQ(st[1].value, int64_t{-1});
  CHECK_EQ(st[2].code, int64_t{kBadPrefixLen});
  CHECK_EQ(st[2].value, int64_t{16});
  CHECK(max_err(got, naive(c, 0.125f)) < 2e-5);  // naive: zeros for invalid rows and for node 3 of row 0
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t d = 0; d < 64; ++d) CHECK_EQ(got[((0 * 2 + h) * 5 + 3) * 64 + d], 0.0f);
}

// ---------------------------------------------------------------------------------------------------------------
// CompactKv.

namespace {

struct Compact {
  int64_t B, O, S, I;  // caches [B, O, S, I] float
  std::vector<std::vector<float>> caches;
  std::vector<int64_t> src, dst, len;
  int64_t L;
};

Compact make_compact(int64_t n, int64_t B, int64_t O, int64_t S, int64_t I, int64_t L) {
  Compact c{B, O, S, I, {}, std::vector<int64_t>(B * L, 0), std::vector<int64_t>(B, 0), std::vector<int64_t>(B, 0), L};
  for (int64_t k = 0; k < n; ++k) {
    std::vector<float> x(B * O * S * I);
    for (size_t e = 0; e < x.size(); ++e) x[e] = static_cast<float>(k * 1000000 + e);
    c.caches.push_back(x);
  }
  return c;
}

std::vector<RowStatus> run_compact(Compact& c, bool write_status = true) {
  CompactKvParams p{};
  p.num_caches = static_cast<int64_t>(c.caches.size());
  for (int64_t k = 0; k < p.num_caches; ++k) p.caches[k] = c.caches[k].data();
  p.batch = c.B;
  p.outer = c.O;
  p.seq_len = c.S;
  p.inner_bytes = c.I * 4;
  p.src_positions = c.src.data();
  p.max_len = c.L;
  p.dst_start = c.dst.data();
  p.lengths = c.len.data();
  p.write_status = write_status;
  std::vector<RowStatus> st(c.B, RowStatus{99, 99, 99});
  p.status = st.data();
  const int64_t tasks = p.num_caches * c.B;
  cpu::CompactKv(p, 0, tasks / 3);
  cpu::CompactKv(p, tasks / 3, tasks);
  return st;
}

// The expected caches: clone, then copy row by row from the clone.
std::vector<std::vector<float>> expected(const Compact& c, const std::vector<bool>& valid) {
  auto out = c.caches;
  for (size_t k = 0; k < out.size(); ++k)
    for (int64_t b = 0; b < c.B; ++b) {
      if (!valid[b]) continue;
      for (int64_t o = 0; o < c.O; ++o)
        for (int64_t i = 0; i < c.len[b]; ++i)
          for (int64_t x = 0; x < c.I; ++x)
            out[k][((b * c.O + o) * c.S + c.dst[b] + i) * c.I + x] =
                c.caches[k][((b * c.O + o) * c.S + c.src[b * c.L + i]) * c.I + x];
    }
  return out;
}

}  // namespace

TEST_CASE("compact_kv: overlapping moves (shifts, reversal, duplicates), ragged lengths, several caches") {
  Compact c = make_compact(3, 4, 2, 32, 5, 6);
  const int64_t src[4][6] = {{11, 12, 13, 14, 15, 16}, {9, 10, 11, 12, 13, 14}, {15, 14, 13, 12, 11, 10},
                             {3, 3, 20, 20, 4, 0}};
  const int64_t dst[4] = {10, 10, 10, 2}, len[4] = {6, 6, 6, 4};
  for (int64_t b = 0; b < 4; ++b) {
    for (int64_t i = 0; i < 6; ++i) c.src[b * 6 + i] = src[b][i];
    c.dst[b] = dst[b];
    c.len[b] = len[b];
  }
  const auto want = expected(c, {true, true, true, true});
  const auto st = run_compact(c);
  for (auto& s : st) CHECK_EQ(s.code, int64_t{kOk});
  for (size_t k = 0; k < want.size(); ++k) CHECK(c.caches[k] == want[k]);
}

TEST_CASE("compact_kv: status codes, invalid rows untouched, write_status") {
  Compact c = make_compact(2, 5, 1, 16, 3, 3);
  for (int64_t b = 0; b < 5; ++b) {
    for (int64_t i = 0; i < 3; ++i) c.src[b * 3 + i] = 5 + i;
    c.dst[b] = 1;
    c.len[b] = 3;
  }
  c.len[1] = 4;              // > L
  c.dst[2] = 14;             // 14 + 3 > 16
  c.src[3 * 3 + 1] = 16;     // out of range
  c.len[4] = 1;
  c.src[4 * 3 + 2] = -7;     // past lengths[4]: not read
  const auto want = expected(c, {true, false, false, false, true});
  const auto st = run_compact(c);
  CHECK_EQ(st[0].code, int64_t{kOk});
  CHECK_EQ(st[1].code, int64_t{kBadLength});
  CHECK_EQ(st[1].value, int64_t{4});
  CHECK_EQ(st[2].code, int64_t{kBadDstStart});
  CHECK_EQ(st[2].value, int64_t{14});
  CHECK_EQ(st[3].code, int64_t{kBadSrcPosition});
  CHECK_EQ(st[3].node, int64_t{1});
  CHECK_EQ(st[3].value, int64_t{16});
  CHECK_EQ(st[4].code, int64_t{kOk});
  for (size_t k = 0; k < want.size(); ++k) CHECK(c.caches[k] == want[k]);
  const auto untouched = run_compact(c, false);
  CHECK_EQ(untouched[0].code, int64_t{99});
}

SPECDEC_TEST_MAIN
