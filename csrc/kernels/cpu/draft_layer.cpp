// The elementwise stages of a drafter's decoder layer on CPU (semantics: DraftLayerParams in common/params.h). The
// products are PackedLinear and the attention TreeAttention; the CPU backend (csrc/ops/ops_cpu.cpp) runs the
// stages in order. Why a layer op at all: an EAGLE draft runs its one layer on ~10 rows per tree level, where
// each product takes ~20-40 us and the ~35 framework ops around them (views, RoPE, cache writes, masks, norms)
// cost ~10 us each, so the layer was two thirds overhead.
#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "vocab_loops.h"

namespace specdec::cpu {

template <typename T>
void DraftLayerInputNorm(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t seg = p.in_features / p.input_norm_segments;
  for (int64_t r = row_begin; r < row_end; ++r)
    for (int64_t s = 0; s < p.input_norm_segments; ++s)
      rms_norm_row(p.x + r * p.in_features + s * seg, p.input_norm_weight + s * seg,
                   p.normed_input + r * p.in_features + s * seg, seg, p.eps);
}

template <typename T>
void DraftLayerRopeCache(const DraftLayerParams<T>& p, int64_t b_begin, int64_t b_end) {
  const int64_t T_ = p.tokens, D = p.head_dim, half = D / 2, nH = p.num_heads, nKV = p.num_kv_heads;
  const int64_t Q = (nH + 2 * nKV) * D, S = p.seq_len;
  float cos_t[kMaxDraftHeadDim / 2], sin_t[kMaxDraftHeadDim / 2];
  for (int64_t b = b_begin; b < b_end; ++b) {
    RowStatus st{kOk, 0, 0};
    for (int64_t t = 0; t < T_ && st.code == kOk; ++t) {
      const int64_t slot = p.write_slots[b * T_ + t];
      if (slot < 0 || slot >= S) st = RowStatus{kBadWriteSlot, t, slot};
    }
    p.status[b] = st;
    for (int64_t t = 0; t < T_; ++t) {
      T* row = p.qkv + (b * T_ + t) * Q;
      const float pos = static_cast<float>(p.position_ids[b * T_ + t]);
      for (int64_t i = 0; i < half; ++i) {
        const float a = pos * p.inv_freq[i];
        cos_t[i] = std::cos(a);
        sin_t[i] = std::sin(a);
      }
      for (int64_t h = 0; h < nH + nKV; ++h) {  // query heads, then key heads
        T* x = row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          x[i] = from_float_rn<T>(x1 * cos_t[i] - x2 * sin_t[i]);
          x[i + half] = from_float_rn<T>(x2 * cos_t[i] + x1 * sin_t[i]);
        }
      }
      if (st.code != kOk) continue;
      const int64_t slot = p.write_slots[b * T_ + t];
      for (int64_t g = 0; g < nKV; ++g) {
        const int64_t at = ((b * nKV + g) * S + slot) * D;
        std::copy(row + (nH + g) * D, row + (nH + g + 1) * D, p.k_cache + at);
        std::copy(row + (nH + nKV + g) * D, row + (nH + nKV + g + 1) * D, p.v_cache + at);
      }
    }
  }
}

template <typename T>
void DraftLayerGatherHeads(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t T_ = p.tokens, D = p.head_dim, nH = p.num_heads;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t b = r / T_, t = r % T_;
    for (int64_t h = 0; h < nH; ++h) {
      const T* src = p.heads + ((b * nH + h) * T_ + t) * D;
      std::copy(src, src + D, p.attn + r * nH * D + h * D);
    }
  }
}

template <typename T>
void DraftLayerAddNorm(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t H = p.hidden;
  for (int64_t r = row_begin; r < row_end; ++r) {
    T* h1 = p.h1 + r * H;  // holds o Wo^T; becomes residual + o Wo^T
    const T* res = p.residual + r * H;
    for (int64_t i = 0; i < H; ++i) h1[i] = from_float_rn<T>(to_float(res[i]) + to_float(h1[i]));
    rms_norm_row(h1, p.norm_weight, p.normed + r * H, H, p.eps);
  }
}

template <typename T>
void DraftLayerSwiGlu(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t I = p.intermediate;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* gu = p.gate_up + r * 2 * I;
    swiglu(gu, gu + I, p.act + r * I, I);  // (vocab_loops: vectorised, one clone per ISA)
  }
}

template <typename T>
void DraftLayerResidual(const DraftLayerParams<T>& p, int64_t row_begin, int64_t row_end) {
  const int64_t H = p.hidden;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const bool ok = p.status[r / p.tokens].code == kOk;
    for (int64_t i = 0; i < H; ++i)
      p.out[r * H + i] = ok ? from_float_rn<T>(to_float(p.h1[r * H + i]) + to_float(p.down[r * H + i]))
                            : from_float_rn<T>(0.0f);
  }
}

#define SPECDEC_INSTANTIATE_DRAFT_LAYER(T)                                                     \
  template void DraftLayerInputNorm<T>(const DraftLayerParams<T>&, int64_t, int64_t);   \
  template void DraftLayerRopeCache<T>(const DraftLayerParams<T>&, int64_t, int64_t);   \
  template void DraftLayerGatherHeads<T>(const DraftLayerParams<T>&, int64_t, int64_t); \
  template void DraftLayerAddNorm<T>(const DraftLayerParams<T>&, int64_t, int64_t);     \
  template void DraftLayerSwiGlu<T>(const DraftLayerParams<T>&, int64_t, int64_t);      \
  template void DraftLayerResidual<T>(const DraftLayerParams<T>&, int64_t, int64_t);
SPECDEC_INSTANTIATE_DRAFT_LAYER(float)
SPECDEC_INSTANTIATE_DRAFT_LAYER(f16)
SPECDEC_INSTANTIATE_DRAFT_LAYER(bf16)

}  // namespace specdec::cpu
