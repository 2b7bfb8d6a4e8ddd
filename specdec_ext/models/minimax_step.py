"""A Hugging Face MiniMax hybrid (Lightning attention beside softmax attention) run as direct calls over a
:class:`~specdec_ext.models.hybrid_cache.HybridCache`: the target's verification forward without the module tree.

A one-token MiniMax step through Hugging Face's modules spends about as long in framework work (decorated forwards,
the mask builders, the attention and experts dispatch, per-layer kwargs) as in its products. :class:`MiniMaxStepOps`
runs the same computation as the kernel route of :func:`~specdec_ext.models.tree_forward` does, call for call: the
embedding; per layer the input RMSNorm, then either the softmax attention (fused q/k/v product, the model's own RoPE,
the cache write, :func:`specdec_ext.ops.tree_attention`, the o product) or the Lightning layer
(:func:`~specdec_ext.models.linear_layers.lightning_tree_forward`), MiniMax's weighted residual
(``residual * alpha + out * beta``, the residual being the normed input), the post-attention RMSNorm, the
mixture-of-experts block (packed experts: :func:`~specdec_ext.models.fast_linear.pack_linears`; a block of one
expert without its router, whose weight for it is exactly 1) and its weighted residual; the final norm and the
vocabulary product. The same operations on the same operands in the same order, so its logits and hidden states are
bit for bit those of the module route (tested), and plain and speculative decoding through either route give the
same tokens.

:meth:`MiniMaxStepOps.build` returns None (the modules run) unless the model is a MiniMax causal LM over a
``HybridCache`` with default RoPE, SiLU experts, no forward hooks on any module (transformers' own output capturing
aside), in eval mode without gradients, and the cache's linear layers are the model's Lightning layers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.minimax.modeling_minimax import (MiniMaxAttention, MiniMaxLightningAttention,
                                                          apply_rotary_pos_emb)

from specdec_ext import ops
from specdec_ext.models.fast_linear import fused_linear, module_linear
from specdec_ext.models.hybrid_cache import HybridCache
from specdec_ext.models.linear_layers import TreeLightningAttention, lightning_tree_forward
from specdec_ext.models.llama_step import HiddenStates, StepOutput, op_route_allowed, rope_is_default
from specdec_ext.state import ShallowStates

__all__ = ["MiniMaxStepOps"]


def _attention(module: MiniMaxAttention, cache: HybridCache, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               prefix: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """MiniMax's softmax attention over the tree nodes ``x [B, N, hidden]`` (the module's forward under the kernel
    route, without its dispatch)."""
    B, N, _ = x.shape
    D = module.head_dim
    H, Hkv = module.config.num_attention_heads, module.config.num_key_value_heads
    qkv = fused_linear(x, (module.q_proj, module.k_proj, module.v_proj))
    q, k, v = (t.view(B, N, -1, D).transpose(1, 2) for t in torch.split(qkv, (H * D, Hkv * D, Hkv * D), dim=-1))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys, values = cache.update(k, v, module.layer_idx)
    # (validation reads a status back: on CUDA a device sync per layer, as in the kernel route's attention function)
    out = ops.tree_attention(q, keys, values, prefix, tree_mask, scale=module.scaling,
                             validate=q.device.type == "cpu")
    return module_linear(module.o_proj, out.transpose(1, 2).reshape(B, N, H * D))


def _weighted_sum(residual: torch.Tensor, alpha, out: torch.Tensor, beta) -> torch.Tensor:
    """MiniMax's ``residual * alpha + out * beta``; with both factors 1 (the usual config) the sum alone, which
    is the same bits without two elementwise calls."""
    return residual + out if alpha == 1 and beta == 1 else residual * alpha + out * beta


def _single_expert_routing(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What the router of a one-expert block answers for every row: expert 0 with weight exactly 1.0 (the softmax
    of one logit), so the experts run with it without the router's calls: ``(index [rows, 1], weights [rows, 1])``,
    made once per forward for all layers."""
    return (torch.zeros(rows, 1, dtype=torch.int64, device=device),
            torch.ones(rows, 1, dtype=torch.float32, device=device))


def _mlp(mlp: nn.Module, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The mixture-of-experts block over ``x``: its own forward, or its experts with ``routing`` given."""
    if routing is None:
        return mlp.forward(x)
    return mlp.experts(x.reshape(-1, x.shape[-1]), *routing).reshape(x.shape)


class MiniMaxStepOps:
    """The model as direct calls (see the module doc). Build with :meth:`build`; it serves the model and the cache
    object it was built with (:meth:`on` serves another cache of the same model)."""

    def __init__(self, model: nn.Module, cache: HybridCache):
        self.model, self.cache = model, cache
        base = model.model
        self._embed, self._rotary, self._norm = base.embed_tokens, base.rotary_emb, base.norm
        self._layers = tuple(base.layers)
        self.vocab_size = base.embed_tokens.num_embeddings
        cfg = model.config
        self._one_expert = cfg.num_local_experts == 1 and cfg.num_experts_per_tok == 1

    @classmethod
    def build(cls, model: nn.Module, cache) -> "MiniMaxStepOps | None":
        """The route for ``model`` over ``cache``, or None where the modules must run (module doc)."""
        cfg = getattr(model, "config", None)
        if getattr(cfg, "model_type", None) != "minimax" or not isinstance(cache, HybridCache) \
                or not op_route_allowed(model) or not rope_is_default(cfg) or cfg.hidden_act != "silu":
            return None
        base = getattr(model, "model", None)
        if base is None or getattr(model, "lm_head", None) is None \
                or getattr(base.rotary_emb, "attention_scaling", 1.0) != 1.0:
            return None
        linear = [i for i, layer in enumerate(base.layers)
                  if isinstance(layer.self_attn, (MiniMaxLightningAttention, TreeLightningAttention))]
        if linear != list(cache.linear_layers) \
                or any(type(layer.self_attn) not in (MiniMaxAttention, MiniMaxLightningAttention,
                                                      TreeLightningAttention) for layer in base.layers):
            return None
        return cls(model, cache)

    def on(self, cache) -> "MiniMaxStepOps | None":
        """The same route over ``cache`` (another cache of the same model: a prefill's own), or None where it
        cannot serve it."""
        if cache is self.cache:
            return self
        return MiniMaxStepOps(self.model, cache) if isinstance(cache, HybridCache) \
            and cache.linear_layers == self.cache.linear_layers else None

    def verify(self, tokens: torch.Tensor, prefix: torch.Tensor, tree_mask: torch.Tensor, chain: bool,
               position_ids: torch.Tensor, *, hidden_states: bool | tuple[int, ...] = False, logits_to_keep: int = 0,
               validate: bool = True, shallow: ShallowStates | None = None) -> StepOutput:
        """The tree forward of ``tokens [B, N]`` rooted after ``prefix [B]`` (the cache's committed lengths) with
        ancestor mask ``tree_mask`` at ``position_ids [B, N]``: the nodes' K/V written at ``prefix + j``, the
        Lightning layers' node inputs recorded for the commit (:meth:`HybridCache.tree_step`). The cache's
        lengths are left at ``prefix``, as the op route leaves them. ``shallow`` is not used: every layer runs
        (a hybrid's linear layers take the whole tree in their tree step)."""
        cache = self.cache
        h = self._embed.forward(tokens)
        states = HiddenStates.of(hidden_states, len(self._layers) + 1)
        if states is not None:
            states.put(0, h)
        cos, sin = self._rotary.forward(h, position_ids)
        routing = _single_expert_routing(tokens.numel(), tokens.device) if self._one_expert else None
        with cache.tree_step(tokens, prefix, tree_mask, chain, validate=validate):
            for i, layer in enumerate(self._layers):
                x = layer.input_layernorm.forward(h)
                attn = layer.self_attn
                if isinstance(attn, MiniMaxLightningAttention):
                    out, _ = lightning_tree_forward(attn, cache, x)
                else:
                    out = _attention(attn, cache, x, cos, sin, prefix, tree_mask)
                h = _weighted_sum(x, layer.attn_alpha_factor, out, layer.attn_beta_factor)
                x = layer.post_attention_layernorm.forward(h)
                h = _weighted_sum(x, layer.mlp_alpha_factor, _mlp(layer.mlp, x, routing), layer.mlp_beta_factor)
                if states is not None:
                    states.put(i + 1, h)
        cache.rewind(prefix, validate=False)  # (the attention layers' cache writes moved the lengths)
        h = self._norm.forward(h)
        if states is not None:
            states.put(len(self._layers), h)
        logits = module_linear(self.model.lm_head, h[:, -logits_to_keep:] if logits_to_keep > 0 else h)
        return StepOutput(logits, states.as_tuple() if states is not None else None)
