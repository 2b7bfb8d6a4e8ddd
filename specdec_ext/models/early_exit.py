"""The early-exit adapter of self-speculation (Kangaroo style): one decoder layer that turns the target's residual
stream after its first ``exit_layer`` decoder layers into something the target's own final norm and LM head read as
the next token's logits.

The draft of a token at position t is ``lm_head(norm(adapter(h_L[<= t])))`` where ``h_L`` is the target's hidden
state after layer ``exit_layer`` (Hugging Face's ``hidden_states[exit_layer]``). ``h_L`` is computed by the
target's own shallow layers over the target's own KV cache, so it is exact: the adapter never sees a feature it
has to guess (EAGLE's draft predicts its next feature; this one is handed it), and training reads the same
features it meets when drafting (no exposure bias). Only the adapter trains (``specdec train-self-spec``,
:mod:`specdec_ext.train.early_exit`).

:class:`EarlyExitAdapter` is a Llama decoder layer with its own K/V over the context
(:class:`~specdec_ext.models.eagle.EagleKVCache`), in the EAGLE draft layer's module layout, so that on CPUs it
runs as one :func:`specdec_ext.ops.draft_decoder_layer` call like the EAGLE layers.

Format (a directory; safetensors and JSON only, nothing in it is run):

* ``config.json``: ``{"specdec_format": "early-exit-adapter", "format_version": 1, "exit_layer": L,
  "target_num_layers": N, "target_hidden_size": H, "vocab_size": V}`` plus the layer's shape
  (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``; the target's);
* ``adapter.safetensors``: ``input_layernorm.weight [H]``, ``self_attn.{q,k,v}_proj.weight [heads * hd, H]``,
  ``self_attn.o_proj.weight [H, nH * hd]``, ``post_attention_layernorm.weight [H]``,
  ``mlp.{gate,up}_proj.weight [I, H]``, ``mlp.down_proj.weight [H, I]``.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from specdec_ext.models.config import text_config
from specdec_ext.models.draft_layer import DraftLayer
from specdec_ext.models.eagle import MLP, Attention, EagleConfig, RMSNorm, layer_operands, native_layer
from specdec_ext.models.safe_files import read_json, read_safetensors

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FORMAT", "ADAPTER_WEIGHTS", "EarlyExitAdapter", "check_adapter_target",
           "load_early_exit", "save_early_exit"]

ADAPTER_FORMAT = "early-exit-adapter"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "config.json", "adapter.safetensors"
_WHO = "load_early_exit"


class EarlyExitAdapter(nn.Module):
    """A Llama decoder layer (input norm, attention with RoPE, post-attention norm, SwiGLU MLP) over its own K/V.
    ``exit_layer``: how many target decoder layers run before it; ``target_num_layers``: the target's layer count
    (both checked against a target when drafting starts)."""

    def __init__(self, cfg: EagleConfig, exit_layer: int, target_num_layers: int):
        super().__init__()
        H = cfg.hidden_size
        self.config, self.exit_layer, self.target_num_layers = cfg, int(exit_layer), int(target_num_layers)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    @classmethod
    def from_target_layer(cls, target, exit_layer: int, source_layer: int | None = None) -> "EarlyExitAdapter":
        """An adapter after ``exit_layer`` target layers, initialised (float32) as a copy of the target's decoder
        layer ``source_layer`` (default ``exit_layer``): before any training it drafts as the target with its
        layers ``exit_layer ..`` but that one skipped, the natural place to start."""
        cfg = EagleConfig.for_target(target)
        layers = target.model.layers
        N = len(layers)
        if not 1 <= exit_layer < N:
            raise ValueError(f"EarlyExitAdapter: exit_layer must be in [1, {N - 1}] (the target has {N} decoder "
                             f"layers), got {exit_layer}")
        source = exit_layer if source_layer is None else source_layer
        if not exit_layer <= source < N:
            raise ValueError(f"EarlyExitAdapter: source_layer must be in [{exit_layer}, {N - 1}] (a layer the draft "
                             f"skips), got {source_layer}")
        adapter = cls(cfg, exit_layer, N)
        src = layers[source].state_dict()
        missing = set(adapter.state_dict()) - set(src)
        if missing:
            raise ValueError(f"EarlyExitAdapter: target layer {source} lacks {sorted(missing)} (not a Llama decoder "
                             "layer)")
        adapter.load_state_dict({k: src[k].float() for k in adapter.state_dict()}, strict=True)
        return adapter

    def draft_layer(self, dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype) -> DraftLayer | None:
        """This layer's operands of :func:`specdec_ext.ops.draft_decoder_layer` (None where it may not run it, or
        where the norms' eps differ: the op has one)."""
        if self.input_layernorm.eps != self.post_attention_layernorm.eps:
            return None
        return layer_operands(self, dtype, device, cache_dtype, self.input_layernorm.weight)

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor, **attn) -> torch.Tensor:
        """``h[B, T, H]`` at ``position_ids[B, T]``; ``attn``: as :class:`~specdec_ext.models.eagle.Attention`'s
        (``mask``, ``cache``, ``write_slots``, ``kv_len``). One op call where it qualifies, else the modules."""
        out = native_layer(self, h, position_ids, attn)
        if out is not None:
            return out
        h = h + self.self_attn(self.input_layernorm(h), position_ids, **attn)
        return h + self.mlp(self.post_attention_layernorm(h))


def save_early_exit(adapter: EarlyExitAdapter, path: str | os.PathLike, base_model_name_or_path: str = "",
                    dtype: torch.dtype | None = None) -> str:
    """Writes ``adapter`` in the directory format of the module doc (weights in ``dtype``, default theirs);
    returns the weights file."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    c = adapter.config
    cfg = {"specdec_format": ADAPTER_FORMAT, "format_version": 1, "exit_layer": adapter.exit_layer,
           "target_num_layers": adapter.target_num_layers, "target_hidden_size": c.hidden_size,
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "rope_scaling": c.rope_scaling}
    if base_model_name_or_path:
        cfg["base_model_name_or_path"] = base_model_name_or_path
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(cfg, f, indent=2)
    sd = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in adapter.state_dict().items()}
    out = os.path.join(path, ADAPTER_WEIGHTS)
    save_file(sd, out)
    return out


def _int_field(cfg: dict, key: str, source: str, low: int = 1) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{_WHO}: {source} field {key!r} must be an integer >= {low}, got {v!r}")
    return v


def load_early_exit(path: str | os.PathLike, target=None, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> EarlyExitAdapter:
    """The adapter saved in ``path`` (:func:`save_early_exit`), in ``dtype`` (default: the target's, else float32)
    on ``device`` (default: the target's, else the CPU). ``target``: checked now (its layer count, hidden size and
    vocabulary must be the adapter's), a ValueError naming the file otherwise."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    cfg = read_json(cfg_path, _WHO)
    if cfg.get("specdec_format") != ADAPTER_FORMAT:
        raise ValueError(f"{_WHO}: {cfg_path!r} is not an early-exit adapter (its specdec_format is "
                         f"{cfg.get('specdec_format')!r}, expected {ADAPTER_FORMAT!r}; train one with specdec "
                         "train-self-spec)")
    if cfg.get("format_version") != 1:
        raise ValueError(f"{_WHO}: {cfg_path!r} has format_version {cfg.get('format_version')!r}; this library "
                         "reads version 1")
    ints = {k: _int_field(cfg, k, cfg_path) for k in ("exit_layer", "target_num_layers", "hidden_size",
                                                      "intermediate_size", "num_attention_heads",
                                                      "num_key_value_heads", "head_dim", "vocab_size")}
    if ints["exit_layer"] >= ints["target_num_layers"]:
        raise ValueError(f"{_WHO}: {cfg_path!r} has exit_layer {ints['exit_layer']} but the target has only "
                         f"{ints['target_num_layers']} layers")
    if ints["num_attention_heads"] % ints["num_key_value_heads"]:
        raise ValueError(f"{_WHO}: {cfg_path!r}: num_attention_heads must be a multiple of num_key_value_heads")
    eps, theta = cfg.get("rms_norm_eps", 1e-6), cfg.get("rope_theta", 10000.0)
    for key, v in (("rms_norm_eps", eps), ("rope_theta", theta)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{_WHO}: {cfg_path!r} field {key!r} must be a positive number, got {v!r}")
    rope = cfg.get("rope_scaling")
    if rope is not None and not isinstance(rope, dict):
        raise ValueError(f"{_WHO}: {cfg_path!r} field 'rope_scaling' must be an object or null, got {rope!r}")
    layer = EagleConfig(hidden_size=ints["hidden_size"], intermediate_size=ints["intermediate_size"],
                        num_attention_heads=ints["num_attention_heads"],
                        num_key_value_heads=ints["num_key_value_heads"], vocab_size=ints["vocab_size"],
                        head_dim=ints["head_dim"], rms_norm_eps=float(eps), rope_theta=float(theta),
                        rope_scaling=rope)
    if target is not None:
        check_adapter_target(ints["exit_layer"], ints["target_num_layers"], layer, target, cfg_path)
    adapter = EarlyExitAdapter(layer, ints["exit_layer"], ints["target_num_layers"])
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{_WHO}: {weights!r} is missing")
    sd = read_safetensors(weights, _WHO)
    want = adapter.state_dict()
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    bad = [k for k in want if k in sd and tuple(sd[k].shape) != tuple(want[k].shape)]
    if missing or extra or bad:
        raise ValueError(f"{_WHO}: {weights!r} does not match its config: missing {missing}, unexpected {extra}, "
                         f"wrong shape {[(k, tuple(sd[k].shape), tuple(want[k].shape)) for k in bad]}")
    if any(not v.is_floating_point() for v in sd.values()):
        raise ValueError(f"{_WHO}: {weights!r} holds non-float tensors")
    adapter.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    if dtype is None or device is None:
        p = next((q for q in target.parameters() if q.is_floating_point()), None) if target is not None else None
        dtype = dtype or (p.dtype if p is not None else torch.float32)
        device = device or (p.device if p is not None else "cpu")
    return adapter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_adapter_target(exit_layer: int, target_num_layers: int, layer: EagleConfig, target, source: str) -> None:
    """A ValueError naming ``source`` unless ``target`` is the model the adapter was trained for."""
    t = text_config(target.config)
    got = (getattr(t, "num_hidden_layers", None), getattr(t, "hidden_size", None), getattr(t, "vocab_size", None))
    want = (target_num_layers, layer.hidden_size, layer.vocab_size)
    if got != want:
        raise ValueError(f"{source}: the adapter was trained for a target of {want[0]} layers, hidden size {want[1]} "
                         f"and {want[2]} tokens; this target has {got[0]}, {got[1]} and {got[2]}")
    if not 1 <= exit_layer < target_num_layers:
        raise ValueError(f"{source}: exit_layer {exit_layer} is outside [1, {target_num_layers - 1}]")
