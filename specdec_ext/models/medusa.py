"""The Medusa-1 network: K heads on a target's last hidden state (the drafting is
:class:`specdec_ext.drafters.MedusaDrafter`; published checkpoints load with
:func:`specdec_ext.models.checkpoints.load_medusa`).

Head h is ``L`` ResBlocks (``x = x + SiLU(W x + b)``) and its own ``lm_head`` ``[V, H]`` (no bias), or, in the legacy
variant, ResBlocks only with the target's ``lm_head`` reused. :class:`MedusaHeads` keeps the official module layout,
so its ``heads.state_dict()`` uses the official keys (``{h}.{l}.linear.weight``, ``{h}.{l}.linear.bias``,
``{h}.{L}.weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from specdec_ext.models.fast_linear import Linear, module_linear
from specdec_ext.models.quantized import linear_device, linear_dtype

__all__ = ["MedusaHeads", "ResBlock"]


class ResBlock(nn.Module):
    """Medusa's residual block: ``x + SiLU(linear(x))`` (official key names ``linear.weight`` / ``linear.bias``)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads of ``num_layers`` ResBlocks each, with their own ``lm_head`` ``[vocab_size, H]``,
    or without (``vocab_size=None``: legacy heads that reuse the target's ``lm_head``).

    ``self.heads`` is laid out as Medusa's ``nn.ModuleList`` (head h = ``nn.Sequential(ResBlock * L, Linear)``), so
    ``self.heads.state_dict()`` has the official keys. ResBlocks start as identities (zero weights, as Medusa) and
    a head's ``lm_head`` as zeros; load weights or copy the target's ``lm_head`` (:meth:`init_lm_heads_from`).
    """

    def __init__(self, num_heads: int, hidden_size: int, vocab_size: int | None = None, num_layers: int = 1):
        super().__init__()
        if num_heads < 1 or hidden_size < 1 or num_layers < 0 or (vocab_size is not None and vocab_size < 1):
            raise ValueError(f"MedusaHeads: need num_heads >= 1, hidden_size >= 1, num_layers >= 0, vocab_size >= 1 "
                             f"or None; got {num_heads}, {hidden_size}, {num_layers}, {vocab_size}")
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        heads = []
        for _ in range(num_heads):
            mods: list[nn.Module] = [ResBlock(hidden_size) for _ in range(num_layers)]
            if vocab_size is not None:
                mods.append(Linear(hidden_size, vocab_size, bias=False))
            heads.append(nn.Sequential(*mods))
        self.heads = nn.ModuleList(heads)
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the heads compute in (their linear layers', float or int8; float32 for heads without any)."""
        layer = self._first_linear()
        return torch.float32 if layer is None else linear_dtype(layer)

    @property
    def device(self) -> torch.device:
        layer = self._first_linear()
        return torch.device("cpu") if layer is None else linear_device(layer)

    def _first_linear(self) -> nn.Module | None:
        return next((m for m in self.heads.modules() if linear_dtype(m) is not None), None)

    @property
    def has_lm_head(self) -> bool:
        """True: every head has its own ``lm_head``; False: legacy heads (the target's ``lm_head`` is reused)."""
        return self.vocab_size is not None

    @torch.no_grad()
    def init_lm_heads_from(self, lm_head: nn.Module) -> "MedusaHeads":
        """Copies a target's ``lm_head`` weight into every head's own ``lm_head`` (Medusa's initialisation)."""
        if not self.has_lm_head:
            raise ValueError("MedusaHeads.init_lm_heads_from: legacy heads have no lm_head of their own")
        for head in self.heads:
            head[-1].weight.copy_(lm_head.weight)
        return self

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None,
                num_heads: int | None = None) -> torch.Tensor:
        """Logits ``[..., num_heads, V]`` of the first ``num_heads`` heads (default all) on ``hidden[..., H]``.
        ``lm_head``: the target's, required by legacy heads (ignored otherwise)."""
        k = self.num_heads if num_heads is None else num_heads
        if not 0 < k <= self.num_heads:
            raise ValueError(f"MedusaHeads: num_heads must be in [1, {self.num_heads}], got {k}")
        if not self.has_lm_head and lm_head is None:
            raise ValueError("MedusaHeads: legacy heads (no lm_head of their own) need the target's lm_head")
        out = torch.stack([head(hidden) for head in self.heads[:k]], -2)
        if self.has_lm_head:
            return out
        # legacy heads: one vocabulary projection for all heads (k rows cost about what one does)
        return module_linear(lm_head, out.to(linear_dtype(lm_head) or lm_head.weight.dtype))
