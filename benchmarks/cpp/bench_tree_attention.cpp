// tree_attention: GQA 32/8, D = 128, random trees, every row with prefix P (the cache holds P + N positions).
// Bytes = K and V read once: 2 * B * Hkv * (P + N) * D * sizeof(T). Before timing, node 0 of head 0 of row 0 is
// checked against a plain double-precision attention (and the CUDA output against the CPU output).
#include <cmath>
#include <type_traits>

#include "bench_common.h"

using namespace bench;
using namespace specdec;

namespace {

constexpr int64_t kH = 32, kHkv = 8, kD = 128;

struct Inputs {
  int64_t B, N, P, S;
  std::vector<float> q, k, v;
  std::vector<int64_t> prefix;
  std::vector<int32_t> mask;  // packed [B, N, W]
};

Inputs make_inputs(int64_t B, int64_t N, int64_t P, uint64_t seed) {
  Inputs in{B, N, P, P + N, {}, {}, {}, std::vector<int64_t>(B, P), {}};
  Rng rng(seed);
  in.q.resize(B * kH * N * kD);
  in.k.resize(B * kHkv * in.S * kD);
  in.v.resize(in.k.size());
  for (auto* vec : {&in.q, &in.k, &in.v})
    for (auto& x : *vec) x = rng.uniform() * 2.0f - 1.0f;
  std::vector<int64_t> parents(B * N);
  for (int64_t b = 0; b < B; ++b) {
    parents[b * N] = -1;
    for (int64_t i = 1; i < N; ++i) parents[b * N + i] = rng.below(i);
  }
  in.mask.resize(B * N * packed_mask_words(N));
  std::vector<RowStatus> st(B);
  TreeMaskParams m{.parents = parents.data(), .batch = B, .num_nodes = N, .dense = nullptr, .packed = in.mask.data(),
                   .status = st.data()};
  cpu::TreeAncestorMask(m, 0, B);
  return in;
}

// Node 0 (sees the prefix and itself) of head 0, row 0, in double.
std::vector<double> naive_node0(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                int64_t S, int64_t P, float scale) {
  std::vector<double> s(P + 1), out(kD, 0.0);
  double mx = -INFINITY, sum = 0;
  for (int64_t t = 0; t <= P; ++t) {
    double d = 0;
    for (int64_t x = 0; x < kD; ++x) d += static_cast<double>(q[x]) * k[t * kD + x];
    s[t] = d * scale;
    mx = std::max(mx, s[t]);
  }
  for (auto& x : s) sum += (x = std::exp(x - mx));
  for (int64_t t = 0; t <= P; ++t)
    for (int64_t x = 0; x < kD; ++x) out[x] += s[t] / sum * v[t * kD + x];
  (void)S;
  return out;
}

template <typename T>
bool run_shape(const Args& a, int64_t B, int64_t N, int64_t P) {
  const Inputs in = make_inputs(B, N, P, 77 + B + N + P);
  const std::vector<T> q = convert<T>(in.q), k = convert<T>(in.k), v = convert<T>(in.v);
  std::vector<T> out(B * kH * N * kD);
  std::vector<RowStatus> status(B);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  const int64_t S = in.S;
  auto params = [&](const T* qp, const T* kp, const T* vp, const int64_t* pl, const int32_t* mp, T* o, float* ws,
                    int64_t wsn, RowStatus* st) {
    return TreeAttentionParams<T>{.q = qp, .q_stride_b = kH * N * kD, .q_stride_h = N * kD, .q_stride_n = kD, .k = kp,
                                  .k_stride_b = kHkv * S * kD, .k_stride_h = S * kD, .k_stride_s = kD, .v = vp,
                                  .v_stride_b = kHkv * S * kD, .v_stride_h = S * kD, .v_stride_s = kD,
                                  .prefix_lens = pl, .mask_dense = nullptr, .mask_packed = mp, .batch = B,
                                  .num_heads = kH, .num_kv_heads = kHkv, .num_nodes = N, .num_tree_keys = N,
                                  .head_dim = kD, .seq_len = S, .scale = scale, .out = o, .workspace = ws,
                                  .workspace_floats = wsn, .status = st};
  };
  const TreeAttentionParams<T> p =
      params(q.data(), k.data(), v.data(), in.prefix.data(), in.mask.data(), out.data(), nullptr, 0, status.data());
  cpu::TreeAttention(p, 0, B * kHkv);
  // Check against the rounded inputs the kernel read.
  std::vector<float> q0(kD), k0(S * kD), v0(S * kD);
  for (int64_t x = 0; x < kD; ++x) q0[x] = to_float(q[x]);
  for (int64_t e = 0; e < S * kD; ++e) k0[e] = to_float(k[e]), v0[e] = to_float(v[e]);
  const std::vector<double> want = naive_node0(q0, k0, v0, S, P, scale);
  const double tol = std::is_same_v<T, float> ? 1e-4 : 2e-2;
  for (int64_t x = 0; x < kD; ++x) {
    if (!(std::fabs(to_float(out[x]) - want[x]) <= tol) || status[0].code != kOk) {
      std::fprintf(stderr, "tree_attention cpu: output[0, 0, 0, %lld] = %g, expected %g\n",
                   static_cast<long long>(x), to_float(out[x]), want[x]);
      return false;
    }
  }
  const std::string shape = shape_str({{"B", B}, {"N", N}, {"P", P}, {"H", kH}, {"Hkv", kHkv}, {"D", kD}});
  const double bytes = 2.0 * B * kHkv * S * kD * sizeof(T);
  const std::string formula = "2*B*Hkv*(P+N)*D*" + std::to_string(sizeof(T));
  if (a.cpu) time_cpu(a, "tree_attention", shape, dtype_name<T>(), B * kHkv, bytes, formula,
                      [&](int64_t b0, int64_t b1) { cpu::TreeAttention(p, b0, b1); });
#if defined(SPECDEC_WITH_CUDA)
  if (use_cuda(a)) {
    DevBuf<T> dq(q), dk(k), dv(v), dout(out.size());
    DevBuf<int64_t> dpre(in.prefix);
    DevBuf<int32_t> dmask(in.mask);
    DevBuf<RowStatus> dst(B);
    const int64_t wsn = cuda::TreeAttentionWorkspaceFloats(B, kH, kHkv, N, kD, S);
    DevBuf<float> ws(wsn);
    const TreeAttentionParams<T> g = params(dq.p, dk.p, dv.p, dpre.p, dmask.p, dout.p, ws.p, wsn, dst.p);
    cuda_run_once([&] { cuda::LaunchTreeAttention<T>(g, nullptr); });
    const std::vector<T> got = dout.get();
    for (size_t e = 0; e < got.size(); ++e) {
      if (!(std::fabs(to_float(got[e]) - to_float(out[e])) <= tol)) {
        std::fprintf(stderr, "tree_attention cuda: output %zu = %g, cpu %g\n", e, to_float(got[e]),
                     to_float(out[e]));
        return false;
      }
    }
    time_cuda(a, "tree_attention", shape, dtype_name<T>(), bytes, formula,
              [&] { cuda::LaunchTreeAttention<T>(g, nullptr); });
  }
#endif
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  print_header();
  bool ok = true;
  if (a.smoke) {
    ok &= run_shape<float>(a, 2, 5, 40);
    ok &= run_shape<bf16>(a, 1, 26, 100);
    return ok ? 0 : 1;
  }
  // (B, N, P): N in {1, 8, 26, 64}, B in {1, 8, 32}, prefixes 128..32k (the long ones in full mode).
  const int64_t quick[][3] = {{1, 8, 1024}, {1, 64, 1024}, {8, 26, 1024}};
  const int64_t full[][3] = {{1, 1, 4096},  {1, 8, 128},   {1, 8, 1024},  {1, 26, 1024}, {1, 64, 1024},
                             {1, 64, 4096}, {1, 64, 32768}, {8, 26, 1024}, {8, 64, 128},  {32, 8, 128},
                             {32, 1, 1024}};
  if (a.quick) {
    for (auto& s : quick) ok &= run_shape<bf16>(a, s[0], s[1], s[2]);
    ok &= run_shape<float>(a, 1, 64, 1024);
  } else {
    for (auto& s : full) ok &= run_shape<bf16>(a, s[0], s[1], s[2]);
    ok &= run_shape<float>(a, 1, 64, 1024);
    ok &= run_shape<f16>(a, 1, 64, 1024);
  }
  return ok ? 0 : 1;
}
