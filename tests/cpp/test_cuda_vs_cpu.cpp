// Runs every CUDA launcher on the same inputs as the CPU kernels and compares: integer outputs and status exactly,
// float outputs within a tolerance. Exits 77 (ctest SKIP_RETURN_CODE) when no CUDA device is present.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "bench_common.h"
#include "check.h"

using namespace bench;
using namespace specdec;

namespace {

bool same_status(const std::vector<RowStatus>& a, const std::vector<RowStatus>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].code != b[i].code || (a[i].code != kOk && (a[i].node != b[i].node || a[i].value != b[i].value)))
      return false;
  return true;
}

void check_close(const std::vector<float>& a, const std::vector<float>& b, double atol, double rtol) {
  CHECK_EQ(a.size(), b.size());
  int bad = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const bool both_inf = std::isinf(a[i]) && std::isinf(b[i]) && (a[i] > 0) == (b[i] > 0);
    if (!both_inf && !(std::fabs(a[i] - b[i]) <= atol + rtol * std::fabs(b[i])) && ++bad <= 3)
      CHECK_NEAR(a[i], b[i], atol + rtol * std::fabs(b[i]));
  }
  CHECK_EQ(bad, 0);
}

// Planted trees with some invalid rows mixed in (bad parent, bad token, NaN logits on the path).
Planted planted_with_errors(int64_t B, int64_t N, int64_t V, uint64_t seed) {
  Planted d = make_planted(B, N, V, seed);
  if (B >= 4) {
    d.parents[1 * N + N - 1] = N - 1;
    d.tokens[2 * N + 1] = V + 5;
    d.logits[(3 * N + 0) * V + V / 2] = std::nanf("");
  }
  return d;
}

template <typename T>
void compare_verify(int64_t B, int64_t N, int64_t V) {
  const Planted d = planted_with_errors(B, N, V, 77 + N);
  const std::vector<T> logits = convert<T>(d.logits);
  Rng rng(9);
  std::vector<float> uniforms(B * N), temperature(B), top_p(B), draft(B * N * V), ws(B * V);
  std::vector<int64_t> top_k(B);
  for (auto& u : uniforms) u = rng.uniform();
  for (int64_t b = 0; b < B; ++b) {
    temperature[b] = b % 4 == 0 ? 0.0f : 0.6f + 0.1f * (b % 5);
    top_k[b] = b % 3 == 0 ? 0 : 20;
    top_p[b] = b % 2 ? 0.9f : 1.0f;
  }
  for (int64_t r = 0; r < B * N; ++r) {
    double s = 0;
    for (int64_t t = 0; t < V; ++t) s += draft[r * V + t] = rng.uniform();
    for (int64_t t = 0; t < V; ++t) draft[r * V + t] = static_cast<float>(draft[r * V + t] / s);
  }
  DevBuf<T> dl(logits);
  DevBuf<int64_t> dtok(d.tokens), dpar(d.parents), dtopk(top_k);
  DevBuf<float> du(uniforms), dtemp(temperature), dtopp(top_p), ddraft(draft), dws(B * V);
  struct Out {
    std::vector<int64_t> acc, len, next;
    std::vector<RowStatus> st;
  };
  auto host_out = [&] { return Out{std::vector<int64_t>(B * N), std::vector<int64_t>(B), std::vector<int64_t>(B),
                                   std::vector<RowStatus>(B)}; };
  auto compare = [&](Out& h, DevBuf<int64_t>& acc, DevBuf<int64_t>& len, DevBuf<int64_t>& nxt,
                     DevBuf<RowStatus>& st, const char* what) {
    BENCH_CUDA_CHECK(cudaDeviceSynchronize());
    const bool ok = acc.get() == h.acc && len.get() == h.len && nxt.get() == h.next && same_status(st.get(), h.st);
    if (!ok) std::fprintf(stderr, "  mismatch: %s (%s, B=%lld N=%lld V=%lld)\n", what, dtype_name<T>(),
                          static_cast<long long>(B), static_cast<long long>(N), static_cast<long long>(V));
    CHECK(ok);
  };
  DevBuf<int64_t> dacc(B * N), dlen(B), dnext(B);
  DevBuf<RowStatus> dst(B);
  {
    Out h = host_out();
    VerifyTreeGreedyParams<T> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                                .tokens = d.tokens.data(), .parents = d.parents.data(), .batch = B, .num_nodes = N,
                                .vocab = V,
                                .out = {.accepted = h.acc.data(), .accept_len = h.len.data(),
                                        .next_token = h.next.data(), .status = h.st.data()}};
    cpu::VerifyTreeGreedy(p, 0, B);
    VerifyTreeGreedyParams<T> q{.logits = dl.p, .logits_stride_b = N * V, .logits_stride_n = V, .tokens = dtok.p,
                                .parents = dpar.p, .batch = B, .num_nodes = N, .vocab = V,
                                .out = {.accepted = dacc.p, .accept_len = dlen.p, .next_token = dnext.p,
                                        .status = dst.p}};
    cuda::LaunchVerifyTreeGreedy(q, nullptr);
    compare(h, dacc, dlen, dnext, dst, "verify_tree_greedy");
  }
  for (bool with_draft : {false, true}) {
    Out h = host_out();
    VerifyTreeSamplingParams<T> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                                  .draft_probs = with_draft ? draft.data() : nullptr, .draft_stride_b = N * V,
                                  .draft_stride_n = V, .tokens = d.tokens.data(), .parents = d.parents.data(),
                                  .uniforms = uniforms.data(),
                                  .sampling = {.temperature = temperature.data(), .top_k = top_k.data(),
                                               .top_p = top_p.data()},
                                  .batch = B, .num_nodes = N, .vocab = V, .workspace = ws.data(),
                                  .out = {.accepted = h.acc.data(), .accept_len = h.len.data(),
                                          .next_token = h.next.data(), .status = h.st.data()}};
    cpu::VerifyTreeSampling(p, 0, B);
    VerifyTreeSamplingParams<T> q{.logits = dl.p, .logits_stride_b = N * V, .logits_stride_n = V,
                                  .draft_probs = with_draft ? ddraft.p : nullptr, .draft_stride_b = N * V,
                                  .draft_stride_n = V, .tokens = dtok.p, .parents = dpar.p, .uniforms = du.p,
                                  .sampling = {.temperature = dtemp.p, .top_k = dtopk.p, .top_p = dtopp.p}, .batch = B,
                                  .num_nodes = N, .vocab = V, .workspace = dws.p,
                                  .out = {.accepted = dacc.p, .accept_len = dlen.p, .next_token = dnext.p,
                                          .status = dst.p}};
    cuda::LaunchVerifyTreeSampling(q, nullptr);
    compare(h, dacc, dlen, dnext, dst, with_draft ? "verify_tree_sampling (draft_probs)" : "verify_tree_sampling");
  }
  {
    Out h = host_out();
    VerifyTreeTypicalParams<T> p{.logits = logits.data(), .logits_stride_b = N * V, .logits_stride_n = V,
                                 .tokens = d.tokens.data(), .parents = d.parents.data(), .uniforms = uniforms.data(),
                                 .temperature = temperature.data(), .posterior_threshold = 0.09f,
                                 .posterior_alpha = 0.3f, .batch = B, .num_nodes = N, .vocab = V,
                                 .out = {.accepted = h.acc.data(), .accept_len = h.len.data(),
                                         .next_token = h.next.data(), .status = h.st.data()}};
    cpu::VerifyTreeTypical(p, 0, B);
    VerifyTreeTypicalParams<T> q{.logits = dl.p, .logits_stride_b = N * V, .logits_stride_n = V, .tokens = dtok.p,
                                 .parents = dpar.p, .uniforms = du.p, .temperature = dtemp.p,
                                 .posterior_threshold = 0.09f, .posterior_alpha = 0.3f, .batch = B, .num_nodes = N,
                                 .vocab = V,
                                 .out = {.accepted = dacc.p, .accept_len = dlen.p, .next_token = dnext.p,
                                         .status = dst.p}};
    cuda::LaunchVerifyTreeTypical(q, nullptr);
    compare(h, dacc, dlen, dnext, dst, "verify_tree_typical");
  }
}

template <typename T>
void compare_sampling(int64_t R, int64_t V) {
  Rng rng(21 + R + V);
  std::vector<float> lf(R * V), uniforms(R), temperature(R), top_p(R);
  std::vector<int64_t> top_k(R);
  for (auto& x : lf) x = rng.uniform() * 6.0f - 3.0f;
  for (int64_t r = 0; r < R; ++r) {
    lf[r * V + rng.below(V)] = 5.0f;  // a clear maximum per row
    uniforms[r] = rng.uniform();
    temperature[r] = r % 5 == 0 ? 0.0f : 0.5f + 0.25f * (r % 4);
    top_k[r] = r % 3 == 0 ? 0 : (r % 3 == 1 ? 1 : 40);
    top_p[r] = r % 2 ? 0.8f : 1.0f;
  }
  if (R >= 3) {
    lf[1 * V + 3] = std::nanf("");
    temperature[2] = -1.0f;
  }
  const std::vector<T> logits = convert<T>(lf);
  std::vector<int64_t> tokens(R);
  std::vector<float> probs(R * V);
  std::vector<RowStatus> st(R);
  SampleTokensParams<T> p{.logits = logits.data(), .logits_stride_r = V, .uniforms = uniforms.data(),
                          .sampling = {.temperature = temperature.data(), .top_k = top_k.data(), .top_p = top_p.data()},
                          .rows = R, .vocab = V, .tokens = tokens.data(), .probs = probs.data(), .status = st.data()};
  cpu::SampleTokens(p, 0, R);
  DevBuf<T> dl(logits);
  DevBuf<float> du(uniforms), dtemp(temperature), dtopp(top_p), dprobs(R * V);
  DevBuf<int64_t> dtopk(top_k), dtok(R);
  DevBuf<RowStatus> dst(R);
  SampleTokensParams<T> q{.logits = dl.p, .logits_stride_r = V, .uniforms = du.p,
                          .sampling = {.temperature = dtemp.p, .top_k = dtopk.p, .top_p = dtopp.p}, .rows = R,
                          .vocab = V, .tokens = dtok.p, .probs = dprobs.p, .status = dst.p};
  cuda::LaunchSampleTokens(q, nullptr);
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(same_status(dst.get(), st));
  CHECK_VEC(dtok.get(), tokens);
  check_close(dprobs.get(), probs, 1e-6, 1e-4);

  // expand_tree_step on the same values viewed as [B, F, V].
  const int64_t F = R >= 4 ? 4 : 1, B = R / F, K = 8, S = 6;
  std::vector<float> scores(B * F);
  for (auto& s : scores) s = -rng.uniform();
  std::vector<int64_t> ct(B * F * K), sel(B * S);
  std::vector<float> cs(B * F * K);
  std::vector<RowStatus> est(B);
  ExpandTreeStepParams<T> e{.logits = logits.data(), .logits_stride_b = F * V, .logits_stride_f = V,
                            .parent_scores = scores.data(), .batch = B, .frontier = F, .vocab = V, .top_k = K,
                            .num_select = S, .cand_tokens = ct.data(), .cand_scores = cs.data(), .selected = sel.data(),
                            .status = est.data()};
  cpu::ExpandTreeStep(e, 0, B);
  DevBuf<float> dscores(scores), dcs(B * F * K);
  DevBuf<int64_t> dct(B * F * K), dsel(B * S);
  DevBuf<RowStatus> dest(B);
  ExpandTreeStepParams<T> g{.logits = dl.p, .logits_stride_b = F * V, .logits_stride_f = V, .parent_scores = dscores.p,
                            .batch = B, .frontier = F, .vocab = V, .top_k = K, .num_select = S, .cand_tokens = dct.p,
                            .cand_scores = dcs.p, .selected = dsel.p, .status = dest.p};
  cuda::LaunchExpandTreeStep(g, nullptr);
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(same_status(dest.get(), est));
  CHECK_VEC(dct.get(), ct);
  CHECK_VEC(dsel.get(), sel);
  check_close(dcs.get(), cs, 1e-5, 1e-5);
}

void compare_trees(int64_t B, int64_t N) {
  Rng rng(31 + B + N);
  std::vector<int64_t> parents(B * N), prefix(B);
  for (int64_t b = 0; b < B; ++b) {
    parents[b * N] = -1;
    prefix[b] = rng.below(100);
    for (int64_t i = 1; i < N; ++i) parents[b * N + i] = rng.below(i);
  }
  if (B >= 3 && N >= 3) {
    parents[1 * N] = 0;
    parents[2 * N + 2] = 2;
  }
  std::vector<int64_t> depth(B * N), pos(B * N), fc(B * N), ns(B * N), paths(B * N * N), leaves(B);
  std::vector<RowStatus> st(B);
  BuildTreeParams p{.parents = parents.data(), .prefix_lens = prefix.data(), .batch = B, .num_nodes = N,
                    .depth = depth.data(), .position_ids = pos.data(), .first_child = fc.data(),
                    .next_sibling = ns.data(), .retrieve_paths = paths.data(), .num_leaves = leaves.data(),
                    .status = st.data()};
  cpu::BuildTree(p, 0, B);
  DevBuf<int64_t> dpar(parents), dpre(prefix), ddep(B * N), dpos(B * N), dfc(B * N), dns(B * N), dpaths(B * N * N),
      dlv(B);
  DevBuf<RowStatus> dst(B);
  BuildTreeParams q{.parents = dpar.p, .prefix_lens = dpre.p, .batch = B, .num_nodes = N, .depth = ddep.p,
                    .position_ids = dpos.p, .first_child = dfc.p, .next_sibling = dns.p, .retrieve_paths = dpaths.p,
                    .num_leaves = dlv.p, .status = dst.p};
  cuda::LaunchBuildTree(q, nullptr);
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(same_status(dst.get(), st));
  CHECK_VEC(ddep.get(), depth);
  CHECK_VEC(dpos.get(), pos);
  CHECK_VEC(dfc.get(), fc);
  CHECK_VEC(dns.get(), ns);
  CHECK_VEC(dlv.get(), leaves);
  CHECK(dpaths.get() == paths);

  const int64_t W = packed_mask_words(N);
  std::vector<uint8_t> dense(B * N * N);
  std::vector<int32_t> words(B * N * W);
  TreeMaskParams m{.parents = parents.data(), .batch = B, .num_nodes = N,
                   .dense = reinterpret_cast<bool*>(dense.data()), .packed = words.data(), .status = st.data()};
  cpu::TreeAncestorMask(m, 0, B);
  DevBuf<uint8_t> ddense(dense.size());
  DevBuf<int32_t> dwords(words.size());
  TreeMaskParams g{.parents = dpar.p, .batch = B, .num_nodes = N, .dense = reinterpret_cast<bool*>(ddense.p),
                   .packed = dwords.p, .status = dst.p};
  cuda::LaunchTreeAncestorMask(g, nullptr);
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(same_status(dst.get(), st));
  CHECK(ddense.get() == dense);
  CHECK(dwords.get() == words);
}


// Tree attention: CPU and CUDA on the same inputs (GQA, ragged prefixes, one invalid row, packed or dense mask);
// float outputs within a tolerance (different summation orders and exp implementations), statuses exactly.
template <typename T>
void compare_attention(int64_t B, int64_t H, int64_t Hkv, int64_t N, int64_t D, int64_t S, bool packed) {
  Rng rng(101 + N + D + S);
  std::vector<float> qf(B * H * N * D), kf(B * Hkv * S * D), vf(B * Hkv * S * D);
  for (auto& x : qf) x = rng.uniform() * 4 - 2;
  for (auto& x : kf) x = rng.uniform() * 4 - 2;
  for (auto& x : vf) x = rng.uniform() * 4 - 2;
  const std::vector<T> q = convert<T>(qf), k = convert<T>(kf), v = convert<T>(vf);
  std::vector<int64_t> prefix(B), parents(B * N);
  for (int64_t b = 0; b < B; ++b) {
    prefix[b] = b == 1 ? S : rng.below(S - N + 1);  // row 1 invalid when B > 1
    parents[b * N] = -1;
    for (int64_t i = 1; i < N; ++i) parents[b * N + i] = rng.below(i);
  }
  const int64_t W = packed_mask_words(N);
  std::vector<uint8_t> dense(B * N * N);
  std::vector<int32_t> words(B * N * W);
  std::vector<RowStatus> mst(B);
  TreeMaskParams m{.parents = parents.data(), .batch = B, .num_nodes = N,
                   .dense = reinterpret_cast<bool*>(dense.data()), .packed = words.data(), .status = mst.data()};
  cpu::TreeAncestorMask(m, 0, B);
  std::vector<T> out(B * H * N * D);
  std::vector<RowStatus> st(B);
  auto params = [&](const T* qp, const T* kp, const T* vp, const int64_t* pl, const bool* dm, const int32_t* pm,
                    T* o, float* ws, int64_t wsn, RowStatus* sp) {
    return TreeAttentionParams<T>{.q = qp, .q_stride_b = H * N * D, .q_stride_h = N * D, .q_stride_n = D, .k = kp,
                                  .k_stride_b = Hkv * S * D, .k_stride_h = S * D, .k_stride_s = D, .v = vp,
                                  .v_stride_b = Hkv * S * D, .v_stride_h = S * D, .v_stride_s = D, .prefix_lens = pl,
                                  .mask_dense = packed ? nullptr : dm, .mask_packed = packed ? pm : nullptr, .batch = B,
                                  .num_heads = H, .num_kv_heads = Hkv, .num_nodes = N, .num_tree_keys = N,
                                  .head_dim = D, .seq_len = S, .scale = 0.1f, .out = o, .workspace = ws,
                                  .workspace_floats = wsn, .status = sp};
  };
  cpu::TreeAttention(params(q.data(), k.data(), v.data(), prefix.data(), reinterpret_cast<bool*>(dense.data()),
                            words.data(), out.data(), nullptr, 0, st.data()),
                     0, B * Hkv);
  DevBuf<T> dq(q), dk(k), dv(v), dout(out.size());
  DevBuf<int64_t> dpre(prefix);
  DevBuf<uint8_t> ddense(dense);
  DevBuf<int32_t> dwords(words);
  DevBuf<RowStatus> dst(B);
  const int64_t wsn = cuda::TreeAttentionWorkspaceFloats(B, H, Hkv, N, D, S);
  DevBuf<float> ws(wsn);
  cuda::LaunchTreeAttention<T>(params(dq.p, dk.p, dv.p, dpre.p, reinterpret_cast<bool*>(ddense.p), dwords.p, dout.p,
                                      ws.p, wsn, dst.p),
                               nullptr);
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(same_status(dst.get(), st));
  std::vector<float> a(out.size()), c(out.size());
  const std::vector<T> got = dout.get();
  for (size_t i = 0; i < out.size(); ++i) a[i] = specdec::to_float(got[i]), c[i] = specdec::to_float(out[i]);
  const double tol = std::is_same_v<T, float> ? 2e-5 : std::is_same_v<T, f16> ? 2e-3 : 1.6e-2;
  check_close(a, c, tol, tol);
}

// Compaction of several float / bf16 caches with overlapping moves: CUDA and CPU give identical bytes.
template <typename T>
void compare_compact(int64_t caches, int64_t B, int64_t O, int64_t S, int64_t I, int64_t L) {
  Rng rng(7 + caches + I);
  std::vector<std::vector<T>> host(caches);
  for (auto& c : host) {
    std::vector<float> f(B * O * S * I);
    for (auto& x : f) x = rng.uniform();
    c = convert<T>(f);
  }
  std::vector<int64_t> src(B * L), dst(B), len(B);
  for (int64_t b = 0; b < B; ++b) {
    len[b] = rng.below(L + 1);
    dst[b] = rng.below(S - L);
    for (int64_t i = 0; i < L; ++i) src[b * L + i] = std::min<int64_t>(S - 1, dst[b] + rng.below(2 * L) - L / 2 + 1);
    for (int64_t i = 0; i < L; ++i) src[b * L + i] = std::max<int64_t>(0, src[b * L + i]);
  }
  if (B > 2) src[2 * L] = S;  // row 2 invalid when lengths[2] > 0
  std::vector<std::unique_ptr<DevBuf<T>>> dev;
  for (auto& c : host) dev.push_back(std::make_unique<DevBuf<T>>(c));
  CompactKvParams p{};
  p.num_caches = caches;
  p.batch = B;
  p.outer = O;
  p.seq_len = S;
  p.inner_bytes = I * static_cast<int64_t>(sizeof(T));
  p.src_positions = src.data();
  p.max_len = L;
  p.dst_start = dst.data();
  p.lengths = len.data();
  p.write_status = true;
  std::vector<RowStatus> st(B);
  p.status = st.data();
  for (int64_t c = 0; c < caches; ++c) p.caches[c] = host[c].data();
  cpu::CompactKv(p, 0, caches * B);
  DevBuf<int64_t> dsrc(src), ddst(dst), dlen(len);
  DevBuf<RowStatus> dstat(B);
  CompactKvParams g = p;
  for (int64_t c = 0; c < caches; ++c) g.caches[c] = dev[c]->p;
  g.src_positions = dsrc.p;
  g.dst_start = ddst.p;
  g.lengths = dlen.p;
  g.status = dstat.p;
  cuda::LaunchCompactKv(g, nullptr);
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(same_status(dstat.get(), st));
  for (int64_t c = 0; c < caches; ++c) {
    const std::vector<T> a = dev[c]->get();
    CHECK(std::memcmp(a.data(), host[c].data(), a.size() * sizeof(T)) == 0);
  }
}

// The recurrent tree ops (float): random trees, row 1 invalid (a bad parent for the tree ops, a bad path node for
// the commits); outputs, committed states and statuses against the CPU kernels.
std::vector<float> uniform_vec(Rng& rng, int64_t n, float lo, float hi) {
  std::vector<float> v(n);
  for (auto& x : v) x = lo + (hi - lo) * rng.uniform();
  return v;
}

// Random trees (chains when `chain`: the kernels' prefill path), row 1 with a bad parent.
std::vector<int64_t> recurrent_trees(Rng& rng, int64_t B, int64_t N, bool chain) {
  std::vector<int64_t> par(B * N, -1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 1; i < N; ++i) par[b * N + i] = chain ? i - 1 : rng.below(i);
  if (B > 1 && N > 2) par[1 * N + 2] = 2;  // not an earlier node
  return par;
}

// Accepted paths: row b follows node N - 1's root path for up to L nodes; row 1 (if any) holds node N.
void recurrent_paths(const std::vector<int64_t>& par, int64_t B, int64_t N, int64_t L, std::vector<int64_t>& path,
                     std::vector<int64_t>& lengths) {
  path.assign(B * L, -1);
  lengths.assign(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> up;
    for (int64_t j = N - 1; j >= 0 && (b != 1 || j == N - 1); j = (b == 1 ? -1 : par[b * N + j])) up.push_back(j);
    const int64_t n = std::min<int64_t>(L, static_cast<int64_t>(up.size()));
    for (int64_t t = 0; t < n; ++t) path[b * L + t] = up[up.size() - 1 - t];
    lengths[b] = n;
  }
  if (B > 1) path[1 * L] = N;
}

void compare_recurrent(int64_t B, int64_t H, int64_t N, int64_t Dk, int64_t Dv, int64_t C, int64_t K,
                       bool chain = false) {
  Rng rng(31 + N + Dk);
  std::vector<int64_t> par = recurrent_trees(rng, B, N, chain), path, lengths;
  for (int64_t b = 0; b < B; ++b)  // (the paths follow valid parents)
    for (int64_t i = 1; i < N; ++i)
      if (par[b * N + i] < 0 || par[b * N + i] >= i) par[b * N + i] = i - 1;
  const std::vector<int64_t> bad_par = recurrent_trees(rng, B, N, chain);
  const int64_t L = 5;
  recurrent_paths(par, B, N, L, path, lengths);
  const std::vector<float> q = uniform_vec(rng, B * H * N * Dk, -0.3f, 0.3f);
  const std::vector<float> k = uniform_vec(rng, B * H * N * Dk, -0.3f, 0.3f);
  const std::vector<float> v = uniform_vec(rng, B * H * N * Dv, -1.0f, 1.0f);
  const std::vector<float> state = uniform_vec(rng, B * H * Dk * Dv, -1.0f, 1.0f);
  const std::vector<float> g = uniform_vec(rng, B * H * N, -0.5f, 0.0f), beta = uniform_vec(rng, B * H * N, 0.0f, 1.0f);
  const std::vector<float> decay = uniform_vec(rng, H, -0.3f, 0.0f), A = uniform_vec(rng, H, -1.0f, -0.1f);
  const std::vector<float> D = uniform_vec(rng, H, -1.0f, 1.0f);
  const std::vector<float> x = uniform_vec(rng, B * C * N, -1.0f, 1.0f);
  const std::vector<float> conv = uniform_vec(rng, B * C * (K - 1), -1.0f, 1.0f);
  const std::vector<float> w = uniform_vec(rng, C * K, -1.0f, 1.0f), bias = uniform_vec(rng, C, -1.0f, 1.0f);
  DevBuf<float> dq(q), dk(k), dv(v), dstate(state), dg(g), dbeta(beta), ddecay(decay), dA(A), dD(D), dx(x), dconv(conv),
      dw(w), dbias(bias);
  DevBuf<int64_t> dbad(bad_par), dpath(path), dlen(lengths);
  DevBuf<RowStatus> dstat(B);
  std::vector<RowStatus> st(B);
  const int64_t nd = H * N * Dk, nv = H * N * Dv, sd = H * Dk * Dv;
  auto check_out = [&](const DevBuf<float>& dout, const std::vector<float>& out) {
    BENCH_CUDA_CHECK(cudaDeviceSynchronize());
    check_close(dout.get(), out, 1e-4, 1e-4);
    CHECK(same_status(dstat.get(), st));
  };
  {  // Lightning
    std::vector<float> out(B * nv);
    DevBuf<float> dout(out.size());
    TreeLinearAttentionParams<float> p{.q = q.data(), .q_stride_b = nd, .q_stride_h = N * Dk, .q_stride_n = Dk,
                                       .k = k.data(), .k_stride_b = nd, .k_stride_h = N * Dk, .k_stride_n = Dk,
                                       .v = v.data(), .v_stride_b = nv, .v_stride_h = N * Dv, .v_stride_n = Dv,
                                       .state = state.data(), .state_stride_b = sd, .state_stride_h = Dk * Dv,
                                       .state_stride_k = Dv, .log_decay = decay.data(), .parents = bad_par.data(),
                                       .batch = B, .num_heads = H, .num_nodes = N, .key_dim = Dk, .value_dim = Dv,
                                       .out = out.data(), .status = st.data()};
    cpu::TreeLinearAttention<float>(p, 0, B * H);
    auto gp = p;
    gp.q = dq.p, gp.k = dk.p, gp.v = dv.p, gp.state = dstate.p, gp.log_decay = ddecay.p, gp.parents = dbad.p;
    gp.out = dout.p, gp.status = dstat.p;
    cuda::LaunchTreeLinearAttention<float>(gp, nullptr);
    check_out(dout, out);
    std::vector<float> s = state;
    DevBuf<float> ds(state);
    CommitLinearStateParams<float> c{.state = s.data(), .state_stride_b = sd, .state_stride_h = Dk * Dv,
                                     .state_stride_k = Dv, .k = k.data(), .k_stride_b = nd, .k_stride_h = N * Dk,
                                     .k_stride_n = Dk, .v = v.data(), .v_stride_b = nv, .v_stride_h = N * Dv,
                                     .v_stride_n = Dv, .log_decay = decay.data(), .path = path.data(),
                                     .lengths = lengths.data(), .batch = B, .num_heads = H, .num_nodes = N,
                                     .max_len = L, .key_dim = Dk, .value_dim = Dv, .status = st.data()};
    cpu::CommitLinearState<float>(c, 0, B * H);
    auto gc = c;
    gc.state = ds.p, gc.k = dk.p, gc.v = dv.p, gc.log_decay = ddecay.p, gc.path = dpath.p, gc.lengths = dlen.p;
    gc.status = dstat.p;
    cuda::LaunchCommitLinearState<float>(gc, nullptr);
    check_out(ds, s);
  }
  {  // conv1d
    std::vector<float> out(B * C * N);
    DevBuf<float> dout(out.size());
    TreeCausalConv1dParams<float> p{.x = x.data(), .x_stride_b = C * N, .x_stride_c = N, .x_stride_n = 1,
                                    .conv_state = conv.data(), .conv_stride_b = C * (K - 1), .conv_stride_c = K - 1,
                                    .conv_stride_w = 1, .weight = w.data(), .bias = bias.data(),
                                    .parents = bad_par.data(), .batch = B, .channels = C, .num_nodes = N, .width = K,
                                    .silu = true, .out = out.data(), .status = st.data()};
    cpu::TreeCausalConv1d<float>(p, 0, B * conv_channel_blocks(C));
    auto gp = p;
    gp.x = dx.p, gp.conv_state = dconv.p, gp.weight = dw.p, gp.bias = dbias.p, gp.parents = dbad.p;
    gp.out = dout.p, gp.status = dstat.p;
    cuda::LaunchTreeCausalConv1d<float>(gp, nullptr);
    check_out(dout, out);
    std::vector<float> s = conv;
    DevBuf<float> ds(conv);
    CommitConvStateParams<float> c{.conv_state = s.data(), .conv_stride_b = C * (K - 1), .conv_stride_c = K - 1,
                                   .conv_stride_w = 1, .x = x.data(), .x_stride_b = C * N, .x_stride_c = N,
                                   .x_stride_n = 1, .path = path.data(), .lengths = lengths.data(), .batch = B,
                                   .channels = C, .num_nodes = N, .max_len = L, .window = K - 1, .status = st.data()};
    cpu::CommitConvState<float>(c, 0, B * conv_channel_blocks(C));
    auto gc = c;
    gc.conv_state = ds.p, gc.x = dx.p, gc.path = dpath.p, gc.lengths = dlen.p, gc.status = dstat.p;
    cuda::LaunchCommitConvState<float>(gc, nullptr);
    check_out(ds, s);
  }
  {  // Gated DeltaNet (g, beta [B, H, N])
    std::vector<float> out(B * nv);
    DevBuf<float> dout(out.size());
    TreeGatedDeltaParams<float> p{
        .q = q.data(), .q_stride_b = nd, .q_stride_h = N * Dk, .q_stride_n = Dk, .k = k.data(), .k_stride_b = nd,
        .k_stride_h = N * Dk, .k_stride_n = Dk, .v = v.data(), .v_stride_b = nv, .v_stride_h = N * Dv,
        .v_stride_n = Dv, .g = g.data(), .beta = beta.data(), .gate_stride_b = H * N, .gate_stride_h = N,
        .gate_stride_n = 1, .beta_stride_b = H * N, .beta_stride_h = N, .beta_stride_n = 1, .state = state.data(),
        .state_stride_b = sd, .state_stride_h = Dk * Dv, .state_stride_k = Dv, .parents = bad_par.data(),
        .batch = B, .num_heads = H, .num_nodes = N, .key_dim = Dk, .value_dim = Dv, .out = out.data(),
        .status = st.data()};
    cpu::TreeGatedDelta<float>(p, 0, B * H);
    auto gp = p;
    gp.q = dq.p, gp.k = dk.p, gp.v = dv.p, gp.g = dg.p, gp.beta = dbeta.p, gp.state = dstate.p;
    gp.parents = dbad.p, gp.out = dout.p, gp.status = dstat.p;
    cuda::LaunchTreeGatedDelta<float>(gp, nullptr);
    check_out(dout, out);
    std::vector<float> s = state;
    DevBuf<float> ds(state);
    CommitGatedDeltaParams<float> c{
        .state = s.data(), .state_stride_b = sd, .state_stride_h = Dk * Dv, .state_stride_k = Dv, .k = k.data(),
        .k_stride_b = nd, .k_stride_h = N * Dk, .k_stride_n = Dk, .v = v.data(), .v_stride_b = nv,
        .v_stride_h = N * Dv, .v_stride_n = Dv, .g = g.data(), .beta = beta.data(), .gate_stride_b = H * N,
        .gate_stride_h = N, .gate_stride_n = 1, .beta_stride_b = H * N, .beta_stride_h = N, .beta_stride_n = 1,
        .path = path.data(), .lengths = lengths.data(), .batch = B, .num_heads = H, .num_nodes = N, .max_len = L,
        .key_dim = Dk, .value_dim = Dv, .status = st.data()};
    cpu::CommitGatedDelta<float>(c, 0, B * H);
    auto gc = c;
    gc.state = ds.p, gc.k = dk.p, gc.v = dv.p, gc.g = dg.p, gc.beta = dbeta.p, gc.path = dpath.p;
    gc.lengths = dlen.p, gc.status = dstat.p;
    cuda::LaunchCommitGatedDelta<float>(gc, nullptr);
    check_out(ds, s);
  }
  {  // Mamba-2: x = v [B, H, N, P = Dv], B = C = k [B, H, N, Ds = Dk], state [B, H, P, Ds], dt = beta
    std::vector<float> out(B * nv);
    DevBuf<float> dout(out.size());
    TreeSelectiveStateParams<float> p{
        .x = v.data(), .x_stride_b = nv, .x_stride_h = N * Dv, .x_stride_n = Dv, .dt = beta.data(),
        .dt_stride_b = H * N, .dt_stride_h = N, .dt_stride_n = 1, .A = A.data(), .Bm = k.data(), .bm_stride_b = nd,
        .bm_stride_h = N * Dk, .bm_stride_n = Dk, .Cm = q.data(), .cm_stride_b = nd, .cm_stride_h = N * Dk,
        .cm_stride_n = Dk, .D = D.data(), .state = state.data(), .state_stride_b = sd, .state_stride_h = Dk * Dv,
        .state_stride_p = Dk, .parents = bad_par.data(), .batch = B, .num_heads = H, .num_nodes = N,
        .head_dim = Dv, .state_dim = Dk, .out = out.data(), .status = st.data()};
    cpu::TreeSelectiveState<float>(p, 0, B * H);
    auto gp = p;
    gp.x = dv.p, gp.dt = dbeta.p, gp.A = dA.p, gp.Bm = dk.p, gp.Cm = dq.p, gp.D = dD.p, gp.state = dstate.p;
    gp.parents = dbad.p, gp.out = dout.p, gp.status = dstat.p;
    cuda::LaunchTreeSelectiveState<float>(gp, nullptr);
    check_out(dout, out);
    std::vector<float> s = state;
    DevBuf<float> ds(state);
    CommitSelectiveStateParams<float> c{
        .state = s.data(), .state_stride_b = sd, .state_stride_h = Dk * Dv, .state_stride_p = Dk, .x = v.data(),
        .x_stride_b = nv, .x_stride_h = N * Dv, .x_stride_n = Dv, .dt = beta.data(), .dt_stride_b = H * N,
        .dt_stride_h = N, .dt_stride_n = 1, .A = A.data(), .Bm = k.data(), .bm_stride_b = nd,
        .bm_stride_h = N * Dk, .bm_stride_n = Dk, .path = path.data(), .lengths = lengths.data(), .batch = B,
        .num_heads = H, .num_nodes = N, .max_len = L, .head_dim = Dv, .state_dim = Dk, .status = st.data()};
    cpu::CommitSelectiveState<float>(c, 0, B * H);
    auto gc = c;
    gc.state = ds.p, gc.x = dv.p, gc.dt = dbeta.p, gc.A = dA.p, gc.Bm = dk.p, gc.path = dpath.p;
    gc.lengths = dlen.p, gc.status = dstat.p;
    cuda::LaunchCommitSelectiveState<float>(gc, nullptr);
    check_out(ds, s);
  }
}

}  // namespace

TEST_CASE("cuda == cpu: tree_attention (every head dim, GQA, long prefix, packed and dense masks)") {
  compare_attention<float>(3, 4, 2, 9, 64, 150, false);
  compare_attention<float>(2, 4, 1, 26, 80, 300, true);
  compare_attention<bf16>(2, 8, 2, 64, 96, 500, true);
  compare_attention<f16>(3, 4, 4, 5, 128, 1000, false);
  compare_attention<bf16>(1, 8, 2, 64, 128, 33000, true);  // many splits
  compare_attention<float>(2, 2, 1, 40, 256, 700, false);
}

TEST_CASE("cuda == cpu: compact_kv (HF and flat layouts, overlaps, odd row sizes)") {
  compare_compact<bf16>(64, 3, 8, 64, 128, 8);
  compare_compact<float>(5, 4, 1, 40, 24, 12);
  compare_compact<bf16>(3, 3, 2, 30, 3, 6);  // 6-byte rows: 2-byte copy units
}

TEST_CASE("cuda == cpu: build_tree and tree_ancestor_mask") {
  for (int64_t N : {1, 7, 32, 33, 64, 100}) compare_trees(5, N);
}

TEST_CASE("cuda == cpu: verification (greedy, sampling, typical), planted trees with invalid rows") {
  compare_verify<float>(6, 16, 1000);
  compare_verify<float>(8, 64, 32000);
  compare_verify<bf16>(8, 64, 32000);
  compare_verify<f16>(4, 8, 50000);
  compare_verify<float>(1, 1, 7);  // root only
}

TEST_CASE("cuda == cpu: sample_tokens and expand_tree_step") {
  compare_sampling<float>(16, 1000);
  compare_sampling<float>(8, 32000);
  compare_sampling<bf16>(8, 128000);
  compare_sampling<f16>(4, 5000);
}

TEST_CASE("cuda == cpu: the recurrent tree ops and their commits (invalid rows included)") {
  compare_recurrent(3, 2, 9, 8, 6, 70, 4);
  compare_recurrent(2, 4, 33, 64, 64, 300, 2);
  compare_recurrent(1, 1, 1, 128, 128, 5, 1);  // root only, a 64 KiB shared-memory state
  compare_recurrent(3, 2, 200, 16, 32, 40, 4, true);  // chains (prefills): one block runs each row in order
}

int main(int, char** argv) {
  if (!cuda_device_available()) {
    std::printf("SKIP: no CUDA device present (test_cuda_vs_cpu needs a GPU)\n");
    return 77;
  }
  std::printf("device: %s\n", cuda_device_name().c_str());
  return check::run_all(argv[0]);
}
