"""EAGLE draft networks (EAGLE-1 and EAGLE-3), written with plain torch in the official key layout.

EAGLE-1 (:class:`Eagle1Model`, E ``cnets1.Model``): the draft's input at position t is the embedding of token t + 1
and the target's feature at t (its last hidden state, after the final norm); ``fc`` maps ``cat(embed, feature)``
``[2H] -> [H]`` (bias optional), then one Llama decoder layer *without* ``input_layernorm`` predicts the feature at
t + 1, which goes through the *target's* ``lm_head``. Keys::

    fc.weight [H, 2H]   fc.bias [H] (optional)   embed_tokens.weight [V, H] (optional; else the target's)
    layers.0.self_attn.{q,k,v,o}_proj.weight   layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight

EAGLE-3 (:class:`Eagle3Model`, E ``cnets.Model``): target features are three layers' residual-stream inputs
(default layers ``[2, L // 2, L - 3]``) concatenated ``[3 H_t]`` and mapped by ``fc`` to ``[H]``; later draft steps
feed back the layer's own (pre-norm) output instead. The decoder layer normalises the hidden state
(``hidden_norm``) and the token embedding (``input_layernorm``) and attends over ``cat(embed, hidden)`` ``[2H]``;
``norm`` + ``lm_head`` give logits over a draft vocabulary, mapped to target ids by ``target = draft + d2t[draft]``
(``t2d`` marks the target ids in the draft vocabulary). ``embed_tokens`` is taken from the target. Keys::

    fc.weight [H, 3 H_t]   midlayer.self_attn.{q,k,v}_proj.weight [nH*hd | nKV*hd, 2H]   midlayer.self_attn.o_proj
    midlayer.mlp.*   midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight   norm.weight
    lm_head.weight [Vd, H]   d2t [Vd] int64   t2d [V] bool   (d2t / t2d absent when Vd == V)

Both modules take an explicit attention mask and, optionally, a :class:`EagleKVCache` with explicit write slots, so
a drafter can run chains and trees through them (see :mod:`specdec_ext.drafters.eagle`). Load published checkpoints
with :func:`specdec_ext.models.checkpoints.load_eagle`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdec_ext.models.config import text_config
from specdec_ext.models.draft_layer import NATIVE_LAYER_MAX_ROWS, DraftLayer
from specdec_ext.models.fast_linear import Linear, module_linear
from specdec_ext.models.quantized import fused_product, linear_dtype
from specdec_ext.models.kv_cache import copy_rows, flat_row_index

__all__ = ["NATIVE_LAYER_MAX_ROWS", "Eagle1Model", "Eagle3Model", "EagleConfig", "EagleKVCache", "Rotary",
           "apply_rotary", "default_eagle3_layers", "layer_operands", "native_layer"]


def default_eagle3_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose residual-stream inputs feed EAGLE-3: ``(2, L // 2, L - 3)`` (vLLM, EAGLE)."""
    L = int(num_target_layers)
    if L < 4:
        raise ValueError(f"EAGLE-3 reads the inputs of target layers [2, L//2, L-3], which needs L >= 4 decoder "
                         f"layers; the target has {L} (pass aux_layers explicitly)")
    return (2, L // 2, L - 3)


@dataclass
class EagleConfig:
    """The fields of an EAGLE ``config.json`` (a LlamaConfig) the draft networks use."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    draft_vocab_size: int | None = None  # EAGLE-3
    target_hidden_size: int | None = None  # EAGLE-3 (default hidden_size)
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3 target layers (eagle_config.eagle_aux_hidden_state_layer_ids)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size

    @classmethod
    def for_target(cls, target, draft_vocab_size: int | None = None, aux_layers=None) -> "EagleConfig":
        """One decoder layer of ``target``'s shape (its hidden and MLP sizes, heads, norm eps and RoPE; default RoPE
        recorded as none), with an EAGLE-3 draft vocabulary and feature layers when given."""
        t = text_config(target.config)
        rope = getattr(t, "rope_scaling", None) or getattr(t, "rope_parameters", None)
        theta = getattr(t, "rope_theta", None) or (rope or {}).get("rope_theta") or 10000.0
        if rope and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        return cls(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                   num_attention_heads=t.num_attention_heads,
                   num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
                   vocab_size=t.vocab_size, head_dim=getattr(t, "head_dim", None),
                   rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope,
                   draft_vocab_size=draft_vocab_size, aux_layers=tuple(aux_layers) if aux_layers else None)

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        need = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"]
        missing = [k for k in need if d.get(k) is None]
        if missing:
            raise ValueError(f"EAGLE config.json lacks {missing}")
        rope = d.get("rope_scaling") or d.get("rope_parameters")
        theta = d.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_attention_heads=d["num_attention_heads"],
                   num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                   vocab_size=d["vocab_size"], head_dim=d.get("head_dim"), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope_theta=float(theta), rope_scaling=rope, draft_vocab_size=d.get("draft_vocab_size"),
                   target_hidden_size=d.get("target_hidden_size"), aux_layers=tuple(aux) if aux else None,
                   extra=dict(d))

    def to_dict(self, version: int) -> dict:
        out = dict(self.extra)
        out.update(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                   num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                   vocab_size=self.vocab_size, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                   rope_theta=self.rope_theta, num_hidden_layers=1, model_type="llama",
                   architectures=["LlamaForCausalLM" if version == 1 else "LlamaForCausalLMEagle3"])
        if self.rope_scaling:
            out["rope_scaling"] = self.rope_scaling
        if version == 3:
            out["draft_vocab_size"] = self.draft_vocab_size
            out["target_hidden_size"] = self.target_hidden_size
            if self.aux_layers is not None:
                out["eagle_config"] = {"use_aux_hidden_state": True,
                                       "eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}
        return out


def _inv_freq(cfg: EagleConfig) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        inv = torch.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"EAGLE draft: rope scaling type {kind!r} is not supported (default, linear, llama3)")
    return inv.float()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_product(x, (self.gate_proj, self.up_proj)).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class EagleKVCache:
    """The draft layer's K/V: ``k``, ``v`` ``[B, nKV, S, hd]``. Entries are written at explicit slots; what is
    valid is the drafter's business (it passes masks)."""

    def __init__(self, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k`` / ``v`` ``[B, nKV, T, hd]`` at ``slots[B, T]`` (in ``[0, max_len)``), one row index for both."""
        B, H, S, _ = self.k.shape
        index = flat_row_index(B, H, S, slots)
        copy_rows(self.k, index, k)
        copy_rows(self.v, index, v)


class Rotary(nn.Module):
    """RoPE tables: :meth:`forward` gives ``(cos, signed_sin)`` ``[B, 1, T, hd]`` (float32) for ``pos[B, T]``, and
    :func:`apply_rotary` rotates with them. ``signed_sin`` carries rotate-half's sign (``-sin`` on the first half),
    so the rotation is one ``roll`` instead of a split, a negation and a concatenation. A drafter computes the
    tables once per tree, when a level first needs them, and hands each level its slice (``rotary=`` of the draft's
    forward)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        hd = cfg.head_dim
        self._config = cfg
        self.register_buffer("inv_freq", _inv_freq(cfg), persistent=False)
        self.register_buffer("sign", torch.cat([-torch.ones(hd // 2), torch.ones(hd - hd // 2)]), persistent=False)

    def _apply(self, fn, recurse=True):
        # The frequencies stay float32 when the module is cast (``.to(torch.bfloat16)``): rounded to bfloat16 they
        # are off by up to 2^-9 of their value (4e-4 for the family's draft: 0.2 radians of rotation at position
        # 500), away from the rotations the draft was trained with.
        super()._apply(fn, recurse)
        self.inv_freq = _inv_freq(self._config).to(self.inv_freq.device)
        self.sign = self.sign.to(device=self.inv_freq.device, dtype=torch.float32)
        return self

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), -1)[:, None]  # [B, 1, T, hd]
        return emb.cos(), emb.sin() * self.sign


def apply_rotary(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on ``x[B, heads, T, hd]`` with :class:`Rotary` tables (computed in float32, returned in x's dtype)."""
    cos, signed_sin = rotary
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * signed_sin).to(x.dtype)


class Attention(nn.Module):
    """Llama attention with RoPE (input width ``in_dim``: H for EAGLE-1, 2H for EAGLE-3) and an explicit mask."""

    def __init__(self, cfg: EagleConfig, in_dim: int, bias: bool = False):
        super().__init__()
        nH, nKV, hd, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.nH, self.nKV, self.hd = nH, nKV, hd
        self.q_proj = Linear(in_dim, nH * hd, bias=bias)
        self.k_proj = Linear(in_dim, nKV * hd, bias=bias)
        self.v_proj = Linear(in_dim, nKV * hd, bias=bias)
        self.o_proj = Linear(nH * hd, H, bias=False)
        self.rotary = Rotary(cfg)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None = None,
                cache: EagleKVCache | None = None, write_slots: torch.Tensor | None = None,
                kv_len: int | None = None, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x[B, T, in_dim]``, ``position_ids[B, T]``. Without ``cache``: attention among the T inputs under
        ``mask[B, T, T]`` (default causal). With ``cache``: the inputs' K/V are written at ``write_slots[B, T]``
        and the queries attend to cache slots ``[0, kv_len)`` under ``mask[B, T, kv_len]`` (True = attend).
        ``rotary``: the :class:`Rotary` tables of ``position_ids`` when the caller has them (any shape that
        broadcasts to ``[B, 1, T, hd]``), or a function that returns them (called only on this path: a forward
        through :func:`specdec_ext.ops.draft_decoder_layer` computes its own)."""
        B, T, _ = x.shape
        nH, nKV = self.nH, self.nKV
        qkv = fused_product(x, (self.q_proj, self.k_proj, self.v_proj)).view(B, T, nH + 2 * nKV, self.hd)
        qkv = qkv.transpose(1, 2)  # [B, heads, T, hd]: nH query heads, then nKV key heads, then nKV value heads
        if rotary is None:
            rotary = self.rotary(position_ids)
        elif callable(rotary):
            rotary = rotary()
        qk = apply_rotary(qkv[:, : nH + nKV], rotary)
        q, k, v = qk[:, :nH], qk[:, nH:], qkv[:, nH + nKV:]
        if cache is not None:
            cache.write(write_slots, k, v)
            S = cache.max_len if kv_len is None else kv_len
            k, v = cache.k[:, :, :S], cache.v[:, :, :S]
        elif mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None].expand(B, T, T)
        # Grouped-query attention without copying K/V per query head: the rep query heads of a K/V head become
        # rep * T query rows of one group (head h = group * rep + r, as repeat_interleave would pair them).
        rep = self.nH // self.nKV
        S = k.shape[2]
        q = q.reshape(B, self.nKV, rep * T, self.hd)
        mask = mask[:, None] if rep == 1 else mask[:, None].expand(B, rep, T, S).reshape(B, 1, rep * T, S)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        return self.o_proj(o.view(B, self.nH, T, self.hd).transpose(1, 2).reshape(B, T, self.nH * self.hd))


def native_layer(layer: "Eagle1Layer | Eagle3Layer", h: torch.Tensor, position_ids: torch.Tensor, attn: dict,
                 embeds: torch.Tensor | None = None) -> torch.Tensor | None:
    """The decoder layer ``layer`` (EAGLE-1's; EAGLE-3's when ``embeds`` is given) as one
    :func:`specdec_ext.ops.draft_decoder_layer` call over its packed weights, or None where the module's own path
    runs: no cache, mask or write slots, a call the op does not take (:meth:`DraftLayer.takes`) or a layer it may
    not run (:meth:`DraftLayer.of`), gradients. Inside a drafting step the layer was ~35 small framework ops around
    four few-row products, two thirds of its time; the op is one call."""
    cache, mask, slots, kv_len = attn.get("cache"), attn.get("mask"), attn.get("write_slots"), attn.get("kv_len")
    B, T, _ = h.shape
    if cache is None or mask is None or slots is None or not DraftLayer.takes(B * T, mask, kv_len) \
            or (embeds is not None and embeds.dtype is not h.dtype):
        return None
    if torch.is_grad_enabled() and (h.requires_grad or (embeds is not None and embeds.requires_grad)
                                    or any(p.requires_grad for p in layer.parameters())):
        return None  # (the op has no autograd)
    op = layer.draft_layer(h.dtype, h.device, cache.k.dtype)
    if op is None:
        return None
    x = h if embeds is None else torch.cat((embeds, h), -1)
    return op(x, h, position_ids, cache.k, cache.v, slots, mask)


def layer_operands(layer: nn.Module, dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype,
                   input_norm_weight: torch.Tensor | None = None, input_norm_segments: int = 1) -> DraftLayer | None:
    """The op's operands of an EAGLE decoder layer (its attention's heads and RoPE, its post-attention norm's eps)."""
    sa = layer._modules["self_attn"]
    return DraftLayer.of(layer, dtype=dtype, device=device, cache_dtype=cache_dtype, num_heads=sa.nH,
                         eps=layer._modules["post_attention_layernorm"].eps, inv_freq=sa._modules["rotary"].inv_freq,
                         input_norm_weight=input_norm_weight, input_norm_segments=input_norm_segments)


class Eagle1Layer(nn.Module):
    """Llama decoder layer 0 of EAGLE-1: no ``input_layernorm``."""

    def __init__(self, cfg: EagleConfig, attention_bias: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, cfg.hidden_size, attention_bias)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def draft_layer(self, dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype) -> DraftLayer | None:
        """This layer's operands of :func:`specdec_ext.ops.draft_decoder_layer` (None where it may not run it)."""
        return layer_operands(self, dtype, device, cache_dtype)

    def forward(self, h, position_ids, **attn):
        out = native_layer(self, h, position_ids, attn)
        if out is not None:
            return out
        h = h + self.self_attn(h, position_ids, **attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Model(nn.Module):
    """EAGLE-1 draft (see the module doc). ``fc_bias``: Vicuna drafts have ``fc.bias``; ``with_embeddings``: an own
    ``embed_tokens`` (else the drafter uses the target's)."""

    version = 1

    def __init__(self, cfg: EagleConfig, fc_bias: bool = True, with_embeddings: bool = False,
                 attention_bias: bool = False):
        super().__init__()
        H = cfg.hidden_size
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if with_embeddings else None
        self.fc = Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList([Eagle1Layer(cfg, attention_bias)])

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def rotary(self) -> Rotary:
        """The draft layer's RoPE tables (:class:`Rotary`)."""
        return self.layers[0].self_attn.rotary

    @property
    def feature_size(self) -> int:
        """Width of the target features this draft reads per position."""
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                from_target: bool = True, **attn) -> torch.Tensor:
        """``hidden[B, T, H]`` (target features or the draft's own predictions; EAGLE-1 treats both alike),
        ``embeds[B, T, H]`` (embeddings of the next tokens) -> predicted features ``[B, T, H]``."""
        dt = linear_dtype(self.fc)
        x = self.fc(torch.cat((embeds.to(dt), hidden.to(dt)), -1))
        return self.layers[0](x, position_ids, **attn)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Target-vocabulary logits of predicted features through the target's ``lm_head``."""
        if lm_head is None:
            raise ValueError("Eagle1Model.logits: EAGLE-1 uses the target's lm_head; pass it")
        return module_linear(lm_head, hidden.to(linear_dtype(lm_head) or lm_head.weight.dtype))

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: attention over ``cat(input_layernorm(embed), hidden_norm(h))`` ``[2H]``."""

    def __init__(self, cfg: EagleConfig, attention_bias: bool = False):
        super().__init__()
        H = cfg.hidden_size
        self.self_attn = Attention(cfg, 2 * H, attention_bias)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)

    def draft_layer(self, dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype) -> DraftLayer | None:
        """This layer's operands of :func:`specdec_ext.ops.draft_decoder_layer`: its two input norms as the op's
        input norm over two segments (``[2H]``, the embedding half first); None where it may not run it, or where
        their eps differ from the post-attention norm's (the op has one eps)."""
        mods = self._modules
        first, second, norm = mods["input_layernorm"], mods["hidden_norm"], mods["post_attention_layernorm"]
        if not first.eps == second.eps == norm.eps:
            return None
        return layer_operands(self, dtype, device, cache_dtype,
                              torch.cat((first._parameters["weight"], second._parameters["weight"])), 2)

    def forward(self, h, embeds, position_ids, **attn):
        out = native_layer(self, h, position_ids, attn, embeds=embeds)
        if out is not None:
            return out
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(h)), -1)
        h = h + self.self_attn(x, position_ids, **attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    """EAGLE-3 draft (see the module doc). ``d2t`` / ``t2d`` are buffers (None when the draft vocabulary is the
    target's); ``aux_layers``: the target's hidden-state indices that feed ``fc`` (None: decided from the target)."""

    version = 3

    def __init__(self, cfg: EagleConfig, attention_bias: bool = False):
        super().__init__()
        H, Ht = cfg.hidden_size, cfg.target_hidden_size
        self.config = cfg
        self.embed_tokens = None
        self.fc = Linear(3 * Ht, H, bias=False)
        self.midlayer = Eagle3Layer(cfg, attention_bias)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = Linear(H, cfg.draft_vocab_size, bias=False)
        if cfg.draft_vocab_size != cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None
            self.t2d = None
        self.aux_layers = cfg.aux_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def rotary(self) -> Rotary:
        """The draft layer's RoPE tables (:class:`Rotary`)."""
        return self.midlayer.self_attn.rotary

    @property
    def feature_size(self) -> int:
        return 3 * self.config.target_hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    @torch.no_grad()
    def set_vocab_map(self, draft_to_target: torch.Tensor) -> "Eagle3Model":
        """Sets ``d2t`` / ``t2d`` from the target id of every draft id (``[Vd]``, distinct, increasing)."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.int64)
        if self.d2t is None:
            raise ValueError("Eagle3Model.set_vocab_map: the draft vocabulary is the target's (no d2t)")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True
        return self

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                from_target: bool = True, **attn) -> torch.Tensor:
        """``hidden``: target features ``[B, T, 3 H_t]`` (``from_target``, through ``fc``) or the draft's own
        outputs ``[B, T, H]``; ``embeds[B, T, H]`` -> the layer's pre-norm outputs ``[B, T, H]``."""
        dt = linear_dtype(self.fc)
        h = self.fc(hidden.to(dt)) if from_target else hidden.to(dt)
        return self.midlayer(h, embeds.to(dt), position_ids, **attn)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., Vd]`` (``lm_head`` ignored: EAGLE-3 has its own)."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (``id + d2t[id]``)."""
        return ids if self.d2t is None else ids + self.d2t[ids]
