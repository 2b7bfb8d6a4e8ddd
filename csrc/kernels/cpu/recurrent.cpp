// CPU kernels of the recurrent tree ops (recurrent_params.h): Lightning linear attention in one parallel pass over
// the tree and its commit, the tree causal conv1d and its commit, the Gated DeltaNet and Mamba-2 recurrences over
// the tree and their commits. Float32 accumulation; inputs float, f16 or bf16.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace specdec::cpu {

namespace {

// Node depths (root 0) of a valid tree.
void tree_depths(const int64_t* parents, int64_t N, std::vector<int64_t>& depth) {
  depth.assign(static_cast<size_t>(N), 0);
  for (int64_t i = 1; i < N; ++i) depth[i] = depth[parents[i]] + 1;
}

template <typename T>
void load_row(const T* src, int64_t n, float* dst) {
  for (int64_t e = 0; e < n; ++e) dst[e] = to_float(src[e]);
}


// Each task (b, h) reads the saved state once for all N nodes (q_i S, row k of S at a time), then walks each node's
// ancestors for the decay-weighted intra-tree terms: N Dk Dv + sum_i depth_i (Dk + Dv) multiply-adds, no per-node
// state.
template <typename T>
void TreeLinearAttentionTasks(const TreeLinearAttentionParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t N = p.num_nodes, Dk = p.key_dim, Dv = p.value_dim;
  std::vector<int64_t> depth;
  std::vector<float> acc(static_cast<size_t>(N * Dv)), qs(static_cast<size_t>(N * Dk)), ks(static_cast<size_t>(N * Dk));
  std::vector<float> vs(static_cast<size_t>(N * Dv));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / p.num_heads, h = task % p.num_heads;
    const int64_t* par = p.parents + b * N;
    RowStatus st = log_decay_status(p.log_decay, p.num_heads);
    if (st.code == kOk) st = recurrent_tree_status(par, N);
    if (h == 0) p.status[b] = st;
    T* out = p.out + (b * p.num_heads + h) * N * Dv;
    if (st.code != kOk) {
      for (int64_t e = 0; e < N * Dv; ++e) out[e] = from_float_rn<T>(0.0f);
      continue;
    }
    tree_depths(par, N, depth);
    for (int64_t i = 0; i < N; ++i) {
      load_row(p.q + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n, Dk, &qs[i * Dk]);
      load_row(p.k + b * p.k_stride_b + h * p.k_stride_h + i * p.k_stride_n, Dk, &ks[i * Dk]);
      load_row(p.v + b * p.v_stride_b + h * p.v_stride_h + i * p.v_stride_n, Dv, &vs[i * Dv]);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    const float* S = p.state + b * p.state_stride_b + h * p.state_stride_h;
    for (int64_t kk = 0; kk < Dk; ++kk) {
      const float* srow = S + kk * p.state_stride_k;
      for (int64_t i = 0; i < N; ++i) {
        const float qk = qs[i * Dk + kk];
        float* a = &acc[i * Dv];
        for (int64_t e = 0; e < Dv; ++e) a[e] += qk * srow[e];
      }
    }
    const float log_a = p.log_decay[h];
    for (int64_t i = 0; i < N; ++i) {
      float* a = &acc[i * Dv];
      const float inter = std::exp(log_a * static_cast<float>(depth[i] + 1));
      for (int64_t e = 0; e < Dv; ++e) a[e] *= inter;
      for (int64_t j = i; j >= 0; j = par[j]) {
        float dot = 0.0f;
        for (int64_t kk = 0; kk < Dk; ++kk) dot += qs[i * Dk + kk] * ks[j * Dk + kk];
        const float w = std::exp(log_a * static_cast<float>(depth[i] - depth[j])) * dot;
        for (int64_t e = 0; e < Dv; ++e) a[e] += w * vs[j * Dv + e];
      }
      for (int64_t e = 0; e < Dv; ++e) out[i * Dv + e] = from_float_rn<T>(a[e]);
    }
  }
}

template <typename T>
void CommitLinearStateTasks(const CommitLinearStateParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t L = p.max_len, Dk = p.key_dim, Dv = p.value_dim;
  std::vector<float> w(static_cast<size_t>(std::max<int64_t>(L, 1))), vs(static_cast<size_t>(L * Dv));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / p.num_heads, h = task % p.num_heads;
    RowStatus st = log_decay_status(p.log_decay, p.num_heads);
    if (st.code == kOk) st = commit_path_status(p.path, p.lengths, b, L, p.num_nodes);
    if (h == 0) p.status[b] = st;
    const int64_t n = p.lengths[b];
    if (st.code != kOk || n == 0) continue;
    const int64_t* path = p.path + b * L;
    const float log_a = p.log_decay[h];
    const float keep = std::exp(log_a * static_cast<float>(n));
    for (int64_t t = 0; t < n; ++t) {
      w[t] = std::exp(log_a * static_cast<float>(n - 1 - t));
      load_row(p.v + b * p.v_stride_b + h * p.v_stride_h + path[t] * p.v_stride_n, Dv, &vs[t * Dv]);
    }
    const T* kb = p.k + b * p.k_stride_b + h * p.k_stride_h;
    float* S = p.state + b * p.state_stride_b + h * p.state_stride_h;
    for (int64_t kk = 0; kk < Dk; ++kk) {
      float* srow = S + kk * p.state_stride_k;
      for (int64_t e = 0; e < Dv; ++e) srow[e] *= keep;
      for (int64_t t = 0; t < n; ++t) {
        const float c = w[t] * to_float(kb[path[t] * p.k_stride_n + kk]);
        const float* vt = &vs[t * Dv];
        for (int64_t e = 0; e < Dv; ++e) srow[e] += c * vt[e];
      }
    }
  }
}

// Each task (b, channel block): node i's window is found once (its K - 1 nearest ancestors), then every channel of
// the block sums its K taps.
template <typename T>
void TreeCausalConv1dTasks(const TreeCausalConv1dParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t N = p.num_nodes, K = p.width, C = p.channels, blocks = conv_channel_blocks(C);
  std::vector<int64_t> window(static_cast<size_t>(K));  // node per tap, oldest first; -(1 + w) = saved input w
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / blocks, c0 = (task % blocks) * kConvChannelBlock;
    const int64_t c1 = std::min(C, c0 + kConvChannelBlock);
    const int64_t* par = p.parents + b * N;
    const RowStatus st = recurrent_tree_status(par, N);
    if (c0 == 0) p.status[b] = st;
    T* out = p.out + b * C * N;
    if (st.code != kOk) {
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t i = 0; i < N; ++i) out[c * N + i] = from_float_rn<T>(0.0f);
      continue;
    }
    const T* xb = p.x + b * p.x_stride_b;
    const float* sb = p.conv_state + b * p.conv_stride_b;
    for (int64_t i = 0; i < N; ++i) {
      int64_t node = i, taps = 0;  // taps from the newest: the node, then its ancestors up to the root
      for (int64_t t = K - 1; t >= 0 && node >= 0; --t, ++taps) {
        window[t] = node;
        node = par[node];
      }
      const int64_t missing = K - taps;  // the oldest taps read saved inputs conv_state[..., K - 1 - missing + t]
      for (int64_t t = 0; t < missing; ++t) window[t] = -1 - (K - 1 - missing + t);
      for (int64_t c = c0; c < c1; ++c) {
        const T* wc = p.weight + c * K;
        float sum = 0.0f;
        for (int64_t t = 0; t < K; ++t) {
          const int64_t src = window[t];
          const float xv = src >= 0 ? to_float(xb[c * p.x_stride_c + src * p.x_stride_n])
                                    : sb[c * p.conv_stride_c + (-1 - src) * p.conv_stride_w];
          sum += to_float(wc[t]) * xv;
        }
        if (p.bias != nullptr) sum += to_float(p.bias[c]);
        if (p.silu) sum = sum / (1.0f + std::exp(-sum));
        out[c * N + i] = from_float_rn<T>(sum);
      }
    }
  }
}

template <typename T>
void CommitConvStateTasks(const CommitConvStateParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t W = p.window, L = p.max_len, blocks = conv_channel_blocks(p.channels);
  std::vector<float> next(static_cast<size_t>(W));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / blocks, c0 = (task % blocks) * kConvChannelBlock;
    const int64_t c1 = std::min(p.channels, c0 + kConvChannelBlock);
    const RowStatus st = commit_path_status(p.path, p.lengths, b, L, p.num_nodes);
    if (c0 == 0) p.status[b] = st;
    const int64_t n = p.lengths[b];
    if (st.code != kOk || n == 0 || W == 0) continue;
    const int64_t* path = p.path + b * L;
    for (int64_t c = c0; c < c1; ++c) {
      float* s = p.conv_state + b * p.conv_stride_b + c * p.conv_stride_c;
      const T* x = p.x + b * p.x_stride_b + c * p.x_stride_c;
      // the sequence (old window, path inputs) has W + n entries; the new window is its last W
      for (int64_t w = 0; w < W; ++w) {
        const int64_t e = n + w;  // index into the sequence
        next[w] = e < W ? s[e * p.conv_stride_w] : to_float(x[path[e - W] * p.x_stride_n]);
      }
      for (int64_t w = 0; w < W; ++w) s[w * p.conv_stride_w] = next[w];
    }
  }
}

// The input-dependent recurrences (Gated DeltaNet, Mamba-2) over a tree. Nodes run in depth-first preorder, each
// node's state one step from its parent's (the saved state for the root), a parent's state kept only until its last
// child has stepped from it. So a tree costs N steps (as level by level) while holding at most (max depth + 1)
// states, 2 for a chain: replaying each root-to-node path instead costs sum_i (d_i + 1)
// steps (4x more on 32-node EAGLE-2-like trees, 8-11x the time at 1 thread: benchmarks/cpp/bench_recurrent.cpp).


// Depth-first preorder (children in increasing index) of a valid tree, and the depths.
void preorder(const int64_t* par, int64_t N, std::vector<int64_t>& order, std::vector<int64_t>& depth,
              std::vector<int64_t>& scratch) {
  scratch.assign(static_cast<size_t>(2 * N), -1);  // first_child, next_sibling
  int64_t* first = scratch.data();
  int64_t* next = first + N;
  for (int64_t i = N - 1; i >= 1; --i) {
    next[i] = first[par[i]];
    first[par[i]] = i;
  }
  tree_depths(par, N, depth);
  order.clear();
  std::vector<int64_t> stack = {0};
  while (!stack.empty()) {
    const int64_t u = stack.back();
    stack.pop_back();
    order.push_back(u);
    // push children so that the lowest index pops first
    const size_t mark = stack.size();
    for (int64_t c = first[u]; c >= 0; c = next[c]) stack.push_back(c);
    std::reverse(stack.begin() + static_cast<std::ptrdiff_t>(mark), stack.end());
  }
}

// One gated delta-rule step from S_in (row stride in_stride) into S_out (row stride out_stride; may alias S_in):
// S_out = exp(g) S_in + k (beta (v - exp(g) S_in^T k))^T; with q, also o = S_out^T q. u: Dv floats of scratch.
void delta_step(const float* S_in, int64_t in_stride, float* S_out, int64_t out_stride, const float* k,
                const float* v, float g, float beta, const float* q, float* o, float* u, int64_t Dk, int64_t Dv) {
  const float decay = std::exp(g);
  for (int64_t e = 0; e < Dv; ++e) u[e] = 0.0f;
  for (int64_t kk = 0; kk < Dk; ++kk) {
    const float* row = S_in + kk * in_stride;
    const float kv = k[kk];
    for (int64_t e = 0; e < Dv; ++e) u[e] += row[e] * kv;
  }
  for (int64_t e = 0; e < Dv; ++e) u[e] = beta * (v[e] - decay * u[e]);  // delta
  if (o != nullptr)
    for (int64_t e = 0; e < Dv; ++e) o[e] = 0.0f;
  for (int64_t kk = 0; kk < Dk; ++kk) {
    const float* row = S_in + kk * in_stride;
    float* dst = S_out + kk * out_stride;
    const float kv = k[kk];
    for (int64_t e = 0; e < Dv; ++e) dst[e] = decay * row[e] + kv * u[e];
    if (o != nullptr) {
      const float qv = q[kk];
      for (int64_t e = 0; e < Dv; ++e) o[e] += dst[e] * qv;
    }
  }
}

// One Mamba-2 step: S_out = exp(dt A) S_in + dt x B^T (S [P, Ds]; S_out may alias S_in); with C, also
// y = S_out C + D x.
void ssd_step(const float* S_in, int64_t in_stride, float* S_out, int64_t out_stride, const float* x,
              const float* Bm, float dt, float A, const float* Cm, float D, float* y, int64_t P, int64_t Ds) {
  const float decay = std::exp(dt * A);
  for (int64_t pp = 0; pp < P; ++pp) {
    const float* row = S_in + pp * in_stride;
    float* dst = S_out + pp * out_stride;
    const float dx = dt * x[pp];
    for (int64_t s = 0; s < Ds; ++s) dst[s] = decay * row[s] + dx * Bm[s];
    if (y != nullptr) {  // (eight partial sums: a single running sum would not vectorise)
      float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      int64_t s = 0;
      for (; s + 8 <= Ds; s += 8)
        for (int64_t l = 0; l < 8; ++l) acc[l] += dst[s + l] * Cm[s + l];
      for (; s < Ds; ++s) acc[0] += dst[s] * Cm[s];
      y[pp] = (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + D * x[pp];
    }
  }
}



// The depth-first driver of both input-dependent tree ops, for task (b, h): checks row b's tree (writing the status
// when `report`), zeroes an invalid row's N x out_cols outputs, else calls step(i, from, from_stride, to) for every
// node in preorder: one step from the parent's state (`from`: the saved state for the root) into a slot `to` (rows x
// cols, row stride cols) that holds node i's state, which step also reads node i's output from. A slot is released
// once its node's last child has stepped from it (a leaf's at once), so only the states a later node still needs
// are live: 2 for a chain (a long prefill), a few for a draft tree; a dry run over the preorder sizes the slots.
struct PreorderScratch {
  std::vector<int64_t> order, depth, children, pending, slot_of, free_slots;
  std::vector<float> slots;
};

// Runs the slot bookkeeping over the preorder: visit(i, parent slot or -1, node slot) per node; returns the peak
// number of live slots.
template <typename Visit>
int64_t assign_slots(const int64_t* par, int64_t N, PreorderScratch& s, Visit&& visit) {
  s.pending.assign(static_cast<size_t>(N), 0);
  for (int64_t i = 1; i < N; ++i) ++s.pending[par[i]];
  s.slot_of.assign(static_cast<size_t>(N), -1);
  s.free_slots.clear();
  int64_t used = 0;
  for (const int64_t i : s.order) {
    int64_t slot;
    if (s.free_slots.empty()) {
      slot = used++;
    } else {
      slot = s.free_slots.back();
      s.free_slots.pop_back();
    }
    s.slot_of[i] = slot;
    const int64_t parent = par[i];
    visit(i, parent >= 0 ? s.slot_of[parent] : int64_t{-1}, slot);
    if (parent >= 0 && --s.pending[parent] == 0) s.free_slots.push_back(s.slot_of[parent]);
    if (s.pending[i] == 0) s.free_slots.push_back(slot);
  }
  return used;
}

template <typename T, typename Step>
void tree_in_preorder(const int64_t* par, int64_t N, int64_t rows, int64_t cols, const float* saved,
                      int64_t saved_stride, bool report, RowStatus* status, T* out, int64_t out_cols,
                      PreorderScratch& s, Step&& step) {
  const RowStatus st = recurrent_tree_status(par, N);
  if (report) *status = st;
  if (st.code != kOk) {
    for (int64_t e = 0; e < N * out_cols; ++e) out[e] = from_float_rn<T>(0.0f);
    return;
  }
  preorder(par, N, s.order, s.depth, s.children);
  const int64_t live = assign_slots(par, N, s, [](int64_t, int64_t, int64_t) {});
  s.slots.resize(static_cast<size_t>(live * rows * cols));
  const int64_t size = rows * cols;
  assign_slots(par, N, s, [&](int64_t i, int64_t from_slot, int64_t slot) {
    step(i, from_slot < 0 ? saved : &s.slots[from_slot * size], from_slot < 0 ? saved_stride : cols,
         &s.slots[slot * size]);
  });
}


template <typename T>
void TreeGatedDeltaTasks(const TreeGatedDeltaParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t N = p.num_nodes, Dk = p.key_dim, Dv = p.value_dim;
  PreorderScratch scratch;
  std::vector<float> qs(static_cast<size_t>(Dk)), ks(static_cast<size_t>(Dk)), vs(static_cast<size_t>(Dv));
  std::vector<float> o(static_cast<size_t>(Dv)), u(static_cast<size_t>(Dv));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / p.num_heads, h = task % p.num_heads;
    T* out = p.out + (b * p.num_heads + h) * N * Dv;
    tree_in_preorder(p.parents + b * N, N, Dk, Dv, p.state + b * p.state_stride_b + h * p.state_stride_h,
                     p.state_stride_k, h == 0, p.status + b, out, Dv, scratch,
                     [&](int64_t i, const float* from, int64_t from_stride, float* to) {
                       load_row(p.q + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n, Dk, qs.data());
                       load_row(p.k + b * p.k_stride_b + h * p.k_stride_h + i * p.k_stride_n, Dk, ks.data());
                       load_row(p.v + b * p.v_stride_b + h * p.v_stride_h + i * p.v_stride_n, Dv, vs.data());
                       delta_step(from, from_stride, to, Dv, ks.data(), vs.data(),
                                  p.g[b * p.gate_stride_b + h * p.gate_stride_h + i * p.gate_stride_n],
                                  p.beta[b * p.beta_stride_b + h * p.beta_stride_h + i * p.beta_stride_n],
                                  qs.data(), o.data(), u.data(), Dk, Dv);
                       for (int64_t e = 0; e < Dv; ++e) out[i * Dv + e] = from_float_rn<T>(o[e]);
                     });
  }
}

template <typename T>
void CommitGatedDeltaTasks(const CommitGatedDeltaParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t L = p.max_len, Dk = p.key_dim, Dv = p.value_dim;
  std::vector<float> ks(static_cast<size_t>(Dk)), vs(static_cast<size_t>(Dv)), u(static_cast<size_t>(Dv));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / p.num_heads, h = task % p.num_heads;
    const RowStatus st = commit_path_status(p.path, p.lengths, b, L, p.num_nodes);
    if (h == 0) p.status[b] = st;
    if (st.code != kOk) continue;
    float* S = p.state + b * p.state_stride_b + h * p.state_stride_h;
    for (int64_t t = 0; t < p.lengths[b]; ++t) {
      const int64_t j = p.path[b * L + t];
      load_row(p.k + b * p.k_stride_b + h * p.k_stride_h + j * p.k_stride_n, Dk, ks.data());
      load_row(p.v + b * p.v_stride_b + h * p.v_stride_h + j * p.v_stride_n, Dv, vs.data());
      delta_step(S, p.state_stride_k, S, p.state_stride_k, ks.data(), vs.data(),
                 p.g[b * p.gate_stride_b + h * p.gate_stride_h + j * p.gate_stride_n],
                 p.beta[b * p.beta_stride_b + h * p.beta_stride_h + j * p.beta_stride_n], nullptr, nullptr, u.data(),
                 Dk, Dv);
    }
  }
}

template <typename T>
void TreeSelectiveStateTasks(const TreeSelectiveStateParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t N = p.num_nodes, P = p.head_dim, Ds = p.state_dim;
  PreorderScratch scratch;
  std::vector<float> xs(static_cast<size_t>(P)), bs(static_cast<size_t>(Ds)), cs(static_cast<size_t>(Ds));
  std::vector<float> y(static_cast<size_t>(P));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / p.num_heads, h = task % p.num_heads;
    T* out = p.out + (b * p.num_heads + h) * N * P;
    tree_in_preorder(p.parents + b * N, N, P, Ds, p.state + b * p.state_stride_b + h * p.state_stride_h,
                     p.state_stride_p, h == 0, p.status + b, out, P, scratch,
                     [&](int64_t i, const float* from, int64_t from_stride, float* to) {
                       load_row(p.x + b * p.x_stride_b + h * p.x_stride_h + i * p.x_stride_n, P, xs.data());
                       load_row(p.Bm + b * p.bm_stride_b + h * p.bm_stride_h + i * p.bm_stride_n, Ds, bs.data());
                       load_row(p.Cm + b * p.cm_stride_b + h * p.cm_stride_h + i * p.cm_stride_n, Ds, cs.data());
                       ssd_step(from, from_stride, to, Ds, xs.data(), bs.data(),
                                p.dt[b * p.dt_stride_b + h * p.dt_stride_h + i * p.dt_stride_n], p.A[h], cs.data(),
                                p.D[h], y.data(), P, Ds);
                       for (int64_t e = 0; e < P; ++e) out[i * P + e] = from_float_rn<T>(y[e]);
                     });
  }
}

template <typename T>
void CommitSelectiveStateTasks(const CommitSelectiveStateParams<T>& p, int64_t task_begin, int64_t task_end) {
  const int64_t L = p.max_len, P = p.head_dim, Ds = p.state_dim;
  std::vector<float> xs(static_cast<size_t>(P)), bs(static_cast<size_t>(Ds));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / p.num_heads, h = task % p.num_heads;
    const RowStatus st = commit_path_status(p.path, p.lengths, b, L, p.num_nodes);
    if (h == 0) p.status[b] = st;
    if (st.code != kOk) continue;
    float* S = p.state + b * p.state_stride_b + h * p.state_stride_h;
    for (int64_t t = 0; t < p.lengths[b]; ++t) {
      const int64_t j = p.path[b * L + t];
      load_row(p.x + b * p.x_stride_b + h * p.x_stride_h + j * p.x_stride_n, P, xs.data());
      load_row(p.Bm + b * p.bm_stride_b + h * p.bm_stride_h + j * p.bm_stride_n, Ds, bs.data());
      ssd_step(S, p.state_stride_p, S, p.state_stride_p, xs.data(), bs.data(),
               p.dt[b * p.dt_stride_b + h * p.dt_stride_h + j * p.dt_stride_n], p.A[h], nullptr, 0.0f, nullptr, P,
               Ds);
    }
  }
}

// Every kernel runs its tasks through run_vectorised: on x86-64 CPUs with AVX2 and FMA the whole task loop is
// compiled for them (flatten inlines the helpers into the AVX2 function), else for the baseline ISA: the state
// updates are short float loops that the compiler vectorises 8 wide instead of 4.
#if defined(__x86_64__) && defined(__GNUC__)
template <typename F>
__attribute__((target("avx2,fma"), flatten)) void run_avx2(const F& tasks) {
  tasks();
}
bool recurrent_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

template <typename F>
void run_vectorised(const F& tasks) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (recurrent_has_avx2()) {
    run_avx2(tasks);
    return;
  }
#endif
  tasks();
}

}  // namespace

template <typename T>
void TreeLinearAttention(const TreeLinearAttentionParams<T>& p, int64_t task_begin, int64_t task_end) {
  run_vectorised([&] { TreeLinearAttentionTasks(p, task_begin, task_end); });
}
template <typename T>
void CommitLinearState(const CommitLinearStateParams<T>& p, int64_t task_begin, int64_t task_end) {
  run_vectorised([&] { CommitLinearStateTasks(p, task_begin, task_end); });
}
template <typename T>
void TreeCausalConv1d(const TreeCausalConv1dParams<T>& p, int64_t task_begin, int64_t task_end) {
  run_vectorised([&] { TreeCausalConv1dTasks(p, task_begin, task_end); });
}
template <typename T>
void CommitConvState(const CommitConvStateParams<T>& p, int64_t task_begin, int64_t task_end) {
  run_vectorised([&] { CommitConvStateTasks(p, task_begin, task_end); });
}
template <typename T>
void TreeGatedDelta(const TreeGatedDeltaParams<T>& p, int64_t task_begin, int64_t task_end) {
  run_vectorised([&] { TreeGatedDeltaTasks(p, task_begin, task_end); });
}
template <typename T>
void CommitGatedDelta(const CommitGatedDeltaParams<T>& p, int64_t task_begin, int64_t task_end) {
  run_vectorised([&] { CommitGatedDeltaTasks(p, task_begin, task_end); });
}
template <typename T>
void TreeSelectiveState(const TreeSelectiveStateParams<T>& p, int64_t task_begin, int64_t task_end) {
  run_vectorised([&] { TreeSelectiveStateTasks(p, task_begin, task_end); });
}
template <typename T>
void CommitSelectiveState(const CommitSelectiveStateParams<T>& p, int64_t task_begin, int64_t task_end) {
  run_vectorised([&] { CommitSelectiveStateTasks(p, task_begin, task_end); });
}

#define SPECDEC_INSTANTIATE_RECURRENT(T)                                                                   \
  template void TreeLinearAttention<T>(const TreeLinearAttentionParams<T>&, int64_t, int64_t);           \
  template void CommitLinearState<T>(const CommitLinearStateParams<T>&, int64_t, int64_t);               \
  template void TreeCausalConv1d<T>(const TreeCausalConv1dParams<T>&, int64_t, int64_t);                 \
  template void CommitConvState<T>(const CommitConvStateParams<T>&, int64_t, int64_t);                 \
  template void TreeGatedDelta<T>(const TreeGatedDeltaParams<T>&, int64_t, int64_t);                   \
  template void CommitGatedDelta<T>(const CommitGatedDeltaParams<T>&, int64_t, int64_t);               \
  template void TreeSelectiveState<T>(const TreeSelectiveStateParams<T>&, int64_t, int64_t);           \
  template void CommitSelectiveState<T>(const CommitSelectiveStateParams<T>&, int64_t, int64_t);
SPECDEC_INSTANTIATE_RECURRENT(float)
SPECDEC_INSTANTIATE_RECURRENT(f16)
SPECDEC_INSTANTIATE_RECURRENT(bf16)
#undef SPECDEC_INSTANTIATE_RECURRENT

}  // namespace specdec::cpu
