"""Loaders for drafter checkpoints in their official published formats: Medusa-1 here, EAGLE-1/3 further down.

Medusa-1 (e.g. ``FasterDecoding/medusa-vicuna-7b-v1.3``): a directory with ``config.json`` (``medusa_num_heads``,
``medusa_num_layers``, ``base_model_name_or_path``) and ``medusa_lm_head.pt`` (``torch.save`` of the heads'
``nn.ModuleList`` state dict) or ``medusa_lm_head.safetensors``. Keys, with H the hidden size, V the vocabulary, L
the ResBlocks per head and h the head::

    {h}.{l}.linear.weight  [H, H]      l < L
    {h}.{l}.linear.bias    [H]
    {h}.{L}.weight         [V, H]      the head's own lm_head (no bias); absent in legacy heads

The published configs' head count is not reliable (Medusa's own loader overrides it), so the number of heads and
of ResBlocks are inferred from the keys; a config that disagrees gives a warning. Files are read with
:mod:`specdec_ext.models.safe_files` (weights-only ``torch.load``, safetensors, JSON objects): no code is executed,
and unreadable files give errors naming them. Shapes are checked key by key, and against
the target when one is given (hidden size, vocabulary), with errors naming the key and both shapes.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import torch

from specdec_ext.models.config import text_config
from specdec_ext.models.eagle import Eagle1Model, Eagle3Model, EagleConfig, default_eagle3_layers
from specdec_ext.models.fast_linear import bfloat16_is_fast
from specdec_ext.models.medusa import MedusaHeads
from specdec_ext.models.safe_files import read_json, read_state_dict

__all__ = ["MEDUSA_CONFIG", "MEDUSA_WEIGHTS", "load_medusa", "load_medusa_state_dict", "medusa_heads_from_state_dict",
           "save_medusa"]

MEDUSA_CONFIG = "config.json"
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")

_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _weights_file(path: str) -> str:
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_medusa: {path!r} is neither a Medusa checkpoint directory nor a weights file "
                                "(checkpoints are read from disk only; download them first)")
    for name in MEDUSA_WEIGHTS:
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return f
    raise FileNotFoundError(f"load_medusa: {path!r} holds neither {MEDUSA_WEIGHTS[1]} nor {MEDUSA_WEIGHTS[0]} (the "
                            "Medusa-1 head weights)")


def load_medusa_state_dict(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, str]:
    """``(state_dict, config, weights_file)`` of a Medusa-1 checkpoint directory (or a weights file; then the
    ``config.json`` beside it is read when present). Tensors on the CPU as stored."""
    path = os.fspath(path)
    wfile = _weights_file(path)
    cfg_file = os.path.join(os.path.dirname(wfile), MEDUSA_CONFIG)
    config = read_json(cfg_file, "load_medusa") if os.path.isfile(cfg_file) else {}
    return read_state_dict(wfile, "load_medusa"), config, wfile


def medusa_heads_from_state_dict(sd: dict[str, torch.Tensor], config: dict | None = None,
                                 source: str = "state dict") -> MedusaHeads:
    """:class:`MedusaHeads` holding an official-layout state dict (head and ResBlock counts inferred from the keys,
    every shape checked; ``source`` names the file in errors)."""
    config = config or {}
    if sd and all(k.startswith("medusa_head.") for k in sd):  # heads saved inside a full (Medusa-2 style) model
        sd = {k[len("medusa_head."):]: v for k, v in sd.items()}
    if not sd:
        raise ValueError(f"load_medusa: {source} is empty (no Medusa head weights)")
    heads: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for key, t in sd.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"load_medusa: unexpected key {key!r} in {source} (Medusa-1 keys are '{{h}}.{{l}}.linear."
                             "weight', '{h}.{l}.linear.bias' and '{h}.{L}.weight')")
        heads.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = t
    K = len(heads)
    if sorted(heads) != list(range(K)):
        raise ValueError(f"load_medusa: {source} has heads {sorted(heads)}; head indices must be 0..{K - 1}")
    first = heads[0].get(0, {}).get("linear.weight", heads[0].get(0, {}).get("weight"))
    if first is None or first.dim() != 2:
        raise ValueError(f"load_medusa: {source} lacks '0.0.linear.weight' (a 2-D [H, H] tensor)")
    H = first.shape[1]
    layouts = []
    for h in range(K):
        mods = heads[h]
        n = len(mods)
        if sorted(mods) != list(range(n)):
            raise ValueError(f"load_medusa: head {h} in {source} has modules {sorted(mods)}; indices must be "
                             f"0..{n - 1}")
        blocks = [i for i in range(n) if "weight" not in mods[i]]
        own = [i for i in range(n) if "weight" in mods[i]]
        if own and (own != [n - 1] or set(mods[n - 1]) != {"weight"}):
            raise ValueError(f"load_medusa: head {h} in {source}: only its last module may be an lm_head "
                             f"('{h}.{n - 1}.weight'); got modules {own} with a bare 'weight'")
        for i in blocks:
            for name in ("linear.weight", "linear.bias"):
                if name not in mods[i]:
                    raise ValueError(f"load_medusa: {source} lacks key '{h}.{i}.{name}'")
            if set(mods[i]) != {"linear.weight", "linear.bias"}:
                raise ValueError(f"load_medusa: head {h} module {i} in {source} mixes ResBlock and lm_head keys")
        layouts.append((len(blocks), bool(own)))
    if len(set(layouts)) != 1:
        raise ValueError(f"load_medusa: the heads in {source} differ in layout ((ResBlocks, own lm_head) per head: "
                         f"{layouts}); all heads must be alike")
    L, has_lm = layouts[0]
    V = None
    if has_lm:
        lm = heads[0][L]["weight"]
        if lm.dim() != 2:
            raise ValueError(f"load_medusa: key '0.{L}.weight' in {source} has shape {list(lm.shape)}, expected "
                             f"[V, {H}] (the head's lm_head)")
        V = lm.shape[0]
    for h in range(K):
        for i in range(L):
            for name, want in (("linear.weight", (H, H)), ("linear.bias", (H,))):
                got = tuple(heads[h][i][name].shape)
                if got != want:
                    raise ValueError(f"load_medusa: key '{h}.{i}.{name}' in {source} has shape {list(got)}, "
                                     f"expected {list(want)} (hidden size {H} from '0.0.linear.weight')")
        if has_lm:
            got = tuple(heads[h][L]["weight"].shape)
            if got != (V, H):
                raise ValueError(f"load_medusa: key '{h}.{L}.weight' in {source} has shape {list(got)}, expected "
                                 f"[{V}, {H}] (vocabulary {V} from '0.{L}.weight', hidden size {H})")
    cfg_heads, cfg_layers = config.get("medusa_num_heads"), config.get("medusa_num_layers")
    if cfg_heads is not None and cfg_heads != K:
        warnings.warn(f"load_medusa: config.json says medusa_num_heads = {cfg_heads} but {source} holds {K} heads; "
                      f"using {K} (the published configs are known to be wrong here)", stacklevel=3)
    if cfg_layers is not None and cfg_layers != L:
        warnings.warn(f"load_medusa: config.json says medusa_num_layers = {cfg_layers} but {source} holds {L} "
                      f"ResBlocks per head; using {L}", stacklevel=3)
    dtype = first.dtype if first.is_floating_point() else torch.float32
    heads_mod = MedusaHeads(K, H, V, L).to(dtype)
    heads_mod.heads.load_state_dict(sd, strict=True)
    heads_mod.config = dict(config)
    heads_mod.source = source
    return heads_mod


def load_medusa(path: str | os.PathLike, target: torch.nn.Module | None = None, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> MedusaHeads:
    """Medusa-1 heads from an official checkpoint directory (or weights file) as :class:`MedusaHeads`.

    ``target`` (an HF causal LM): check that the heads fit it (hidden size; the heads' vocabulary, or for legacy
    heads the target's ``lm_head``) and, unless ``dtype`` / ``device`` are given, move the heads to its dtype and
    device. The checkpoint's ``config.json`` is kept as ``heads.config``.
    """
    sd, config, wfile = load_medusa_state_dict(path)
    heads = medusa_heads_from_state_dict(sd, config, repr(wfile))
    if target is not None:
        cfg = text_config(target.config)
        H, V = getattr(cfg, "hidden_size", None), getattr(cfg, "vocab_size", None)
        base = config.get("base_model_name_or_path")
        built = f" (built for {base!r})" if base else ""
        if H is not None and H != heads.hidden_size:
            raise ValueError(f"load_medusa: the heads in {wfile!r}{built} have hidden size {heads.hidden_size} (key "
                             f"'0.0.linear.weight' has shape [{heads.hidden_size}, {heads.hidden_size}]) but the "
                             f"target's hidden_size is {H}")
        if heads.has_lm_head and V is not None and V != heads.vocab_size:
            raise ValueError(f"load_medusa: the heads in {wfile!r}{built} have a vocabulary of {heads.vocab_size} "
                             f"(key '0.{heads.num_layers}.weight' has shape [{heads.vocab_size}, "
                             f"{heads.hidden_size}]) but the target's vocab_size is {V}")
        if not heads.has_lm_head:
            lm = target.get_output_embeddings()
            if lm is None or lm.weight.shape[-1] != heads.hidden_size:
                raise ValueError(f"load_medusa: the legacy heads in {wfile!r} reuse the target's lm_head, which "
                                 f"{'is missing' if lm is None else f'takes {lm.weight.shape[-1]} features'}; "
                                 f"the heads produce {heads.hidden_size}")
        p = next(q for q in target.parameters() if q.is_floating_point())
        dtype = p.dtype if dtype is None else dtype
        device = p.device if device is None else device
    if dtype is not None or device is not None:
        heads = heads.to(device=device, dtype=dtype)
    return heads.eval()


def save_medusa(heads: MedusaHeads, path: str | os.PathLike, base_model_name_or_path: str = "",
                safetensors: bool = False) -> str:
    """Writes ``heads`` as an official Medusa-1 checkpoint directory (``config.json`` + ``medusa_lm_head.pt``, or
    ``.safetensors``); returns the weights file."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, MEDUSA_CONFIG), "w") as f:
        json.dump({"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
                   "base_model_name_or_path": base_model_name_or_path}, f, indent=2)
    sd = {k: v.detach().cpu().contiguous() for k, v in heads.heads.state_dict().items()}
    if safetensors:
        from safetensors.torch import save_file

        out = os.path.join(path, MEDUSA_WEIGHTS[0])
        save_file(sd, out)
    else:
        out = os.path.join(path, MEDUSA_WEIGHTS[1])
        torch.save(sd, out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-1 and EAGLE-3 drafts (anchors section 5.4 / 5.5): ``config.json`` (a LlamaConfig, ``num_hidden_layers: 1``)
# plus ``pytorch_model.bin`` or ``model.safetensors``. The layout (EAGLE-1 ``layers.0.*`` without
# ``input_layernorm``, ``fc`` [H, 2H] with optional bias; EAGLE-3 ``midlayer.*`` with 2H attention inputs, ``fc``
# [H, 3 H_t], ``norm``, ``lm_head`` [Vd, H], ``d2t`` / ``t2d``) decides the version; every key's shape is checked
# against the config and, with a target, against the target (hidden size, vocabulary), naming the key.

EAGLE_CONFIG = "config.json"
EAGLE_WEIGHTS = ("pytorch_model.bin", "model.safetensors")

__all__ += ["EAGLE_CONFIG", "EAGLE_DTYPES", "EAGLE_WEIGHTS", "eagle_from_state_dict", "load_eagle",
            "load_eagle_state_dict", "resolve_eagle_dtype", "save_eagle"]


def load_eagle_state_dict(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, str]:
    """``(state_dict, config, weights_file)`` of an EAGLE checkpoint directory (``pytorch_model.bin``, else
    ``model.safetensors``) or weights file (its directory's ``config.json`` is read). Tensors on the CPU."""
    path = os.fspath(path)
    if os.path.isfile(path):
        wfile = path
    elif os.path.isdir(path):
        found = [os.path.join(path, n) for n in EAGLE_WEIGHTS if os.path.isfile(os.path.join(path, n))]
        if not found:
            raise FileNotFoundError(f"load_eagle: {path!r} holds neither {EAGLE_WEIGHTS[0]} nor {EAGLE_WEIGHTS[1]} "
                                    "(the EAGLE draft weights)")
        wfile = found[0]
    else:
        raise FileNotFoundError(f"load_eagle: {path!r} is neither an EAGLE checkpoint directory nor a weights file "
                                "(checkpoints are read from disk only; download them first)")
    cfg_file = os.path.join(os.path.dirname(wfile), EAGLE_CONFIG)
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"load_eagle: {cfg_file!r} is missing (EAGLE drafts need their config.json)")
    return read_state_dict(wfile, "load_eagle"), read_json(cfg_file, "load_eagle"), wfile


def _check_keys(sd: dict, expected: dict, optional: set, source: str) -> None:
    missing = [k for k in expected if k not in sd and k not in optional]
    if missing:
        raise ValueError(f"load_eagle: {source} lacks key(s) {missing}")
    extra = [k for k in sd if k not in expected]
    if extra:
        raise ValueError(f"load_eagle: unexpected key(s) {extra} in {source}")
    for k, want in expected.items():
        if k in sd and tuple(sd[k].shape) != tuple(want):
            raise ValueError(f"load_eagle: key {k!r} in {source} has shape {list(sd[k].shape)}, expected "
                             f"{list(want)} (from config.json)")


_EAGLE_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "head_dim", "draft_vocab_size", "target_hidden_size")


def _eagle_config(d: dict, source: str) -> EagleConfig:
    """``EagleConfig.from_dict(d)`` with the fields that size tensors checked first (positive integers)."""
    for k in _EAGLE_INTS:
        v = d.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"load_eagle: config.json of {source}: {k!r} must be a positive integer, got {v!r}")
    for k in ("rms_norm_eps", "rope_theta"):
        v = d.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ValueError(f"load_eagle: config.json of {source}: {k!r} must be a positive number, got {v!r}")
    ec = d.get("eagle_config")
    aux = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
    if ec is not None and not isinstance(ec, dict) or aux is not None and (
            not isinstance(aux, list) or len(aux) != 3
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in aux)):
        raise ValueError(f"load_eagle: config.json of {source}: 'eagle_config' must be an object whose "
                         f"'eagle_aux_hidden_state_layer_ids' lists three layer indices >= 0, got {ec!r}")
    try:
        return EagleConfig.from_dict(d)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"load_eagle: config.json of {source}: {e}") from None


def eagle_from_state_dict(sd: dict[str, torch.Tensor], config: dict, source: str = "state dict"):
    """An :class:`Eagle1Model` or :class:`Eagle3Model` holding an official-layout state dict (version from the keys,
    every shape checked against ``config``)."""
    if not sd:
        raise ValueError(f"load_eagle: {source} is empty (no EAGLE draft weights)")
    v3 = any(k.startswith("midlayer.") for k in sd) or "d2t" in sd or "lm_head.weight" in sd
    if v3 and not any(k.startswith("midlayer.") for k in sd):  # vLLM's renaming midlayer. -> layers.0.
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): t for k, t in sd.items()}
    if "fc.weight" not in sd or sd["fc.weight"].dim() != 2:
        raise ValueError(f"load_eagle: {source} lacks 'fc.weight' (a 2-D tensor)")
    d = dict(config)
    if v3 and d.get("target_hidden_size") is None and sd["fc.weight"].shape[1] % 3 == 0:
        d["target_hidden_size"] = sd["fc.weight"].shape[1] // 3
    if v3 and d.get("draft_vocab_size") is None and "lm_head.weight" in sd:
        d["draft_vocab_size"] = sd["lm_head.weight"].shape[0]
    cfg = _eagle_config(d, source)
    H, I, V, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    pre = "midlayer." if v3 else "layers.0."
    a_in = 2 * H if v3 else H
    exp = {f"{pre}self_attn.q_proj.weight": (q_out, a_in), f"{pre}self_attn.k_proj.weight": (kv_out, a_in),
           f"{pre}self_attn.v_proj.weight": (kv_out, a_in), f"{pre}self_attn.o_proj.weight": (H, q_out),
           f"{pre}mlp.gate_proj.weight": (I, H), f"{pre}mlp.up_proj.weight": (I, H),
           f"{pre}mlp.down_proj.weight": (H, I), f"{pre}post_attention_layernorm.weight": (H,),
           "embed_tokens.weight": (V, H)}
    optional = {"embed_tokens.weight"}
    attn_bias = f"{pre}self_attn.q_proj.bias" in sd
    if attn_bias:
        exp.update({f"{pre}self_attn.q_proj.bias": (q_out,), f"{pre}self_attn.k_proj.bias": (kv_out,),
                    f"{pre}self_attn.v_proj.bias": (kv_out,)})
    if v3:
        exp.update({"fc.weight": (H, 3 * cfg.target_hidden_size), f"{pre}hidden_norm.weight": (H,),
                    f"{pre}input_layernorm.weight": (H,), "norm.weight": (H,), "lm_head.weight": (Vd, H)})
        if Vd != V:
            exp.update({"d2t": (Vd,), "t2d": (V,)})
        else:  # the EAGLE repo deletes them when the vocabularies agree; identity maps are ignored
            sd = {k: t for k, t in sd.items() if k not in ("d2t", "t2d")}
    else:
        exp.update({"fc.weight": (H, 2 * H), "fc.bias": (H,)})
        optional.add("fc.bias")
        if f"{pre}input_layernorm.weight" in sd:
            raise ValueError(f"load_eagle: unexpected key '{pre}input_layernorm.weight' in {source}: EAGLE-1's layer 0 "
                             "has no input_layernorm")
    _check_keys(sd, exp, optional, source)
    if v3:
        model = Eagle3Model(cfg, attention_bias=attn_bias)
        if Vd != V:
            d2t = sd["d2t"].to(torch.int64)
            ids = d2t + torch.arange(Vd)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
                raise ValueError(f"load_eagle: 'd2t' in {source} maps draft ids outside the vocabulary [0, {V})")
            sd = {**sd, "d2t": d2t, "t2d": sd["t2d"].to(torch.bool)}
    else:
        model = Eagle1Model(cfg, fc_bias="fc.bias" in sd, attention_bias=attn_bias)
        cfg_bias = config.get("bias", True)
        if bool(cfg_bias) != ("fc.bias" in sd):
            warnings.warn(f"load_eagle: config.json says bias = {cfg_bias} but {source} "
                          f"{'has' if 'fc.bias' in sd else 'lacks'} 'fc.bias'; following the weights", stacklevel=3)
    if "embed_tokens.weight" in sd:
        model.embed_tokens = torch.nn.Embedding(V, H)
    dtype = sd["fc.weight"].dtype if sd["fc.weight"].is_floating_point() else torch.float32
    model = model.to(dtype)
    model.load_state_dict(sd, strict=True)
    model.source = source
    model.checkpoint_config = dict(config)
    return model


EAGLE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_eagle_dtype(eagle_dtype, dtype: torch.dtype, device="cpu") -> torch.dtype:
    """The dtype to run an EAGLE draft in, for a target in ``dtype`` on ``device``: ``None`` = ``dtype``;
    ``"auto"`` = bfloat16 for a float32 target where bfloat16 products are fast
    (:func:`~specdec_ext.models.fast_linear.bfloat16_is_fast`: a draft level then reads half the bytes), else
    ``dtype``; or a floating dtype (or its name). The draft's dtype changes its proposals only, never the output."""
    if eagle_dtype is None:
        return dtype
    if isinstance(eagle_dtype, str) and eagle_dtype == "auto":
        return torch.bfloat16 if dtype == torch.float32 and bfloat16_is_fast(device) else dtype
    if isinstance(eagle_dtype, str) and eagle_dtype in EAGLE_DTYPES:
        return getattr(torch, eagle_dtype)
    if isinstance(eagle_dtype, torch.dtype) and eagle_dtype.is_floating_point:
        return eagle_dtype
    raise ValueError(f"eagle_dtype must be None, 'auto', a floating dtype or one of {', '.join(EAGLE_DTYPES[1:])}, "
                     f"got {eagle_dtype!r}")


def load_eagle(path: str | os.PathLike, target: torch.nn.Module | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None):
    """An EAGLE-1 (:class:`Eagle1Model`) or EAGLE-3 (:class:`Eagle3Model`) draft from an official checkpoint
    directory (``config.json`` + ``pytorch_model.bin`` / ``model.safetensors``).

    ``target`` (an HF causal LM): check that the draft fits it (hidden size from ``fc.weight``; vocabulary from the
    config, ``embed_tokens`` and ``t2d``), set EAGLE-3's feature layers (config ``eagle_config`` or
    ``(2, L // 2, L - 3)``), and, unless ``dtype`` / ``device`` are given, move the draft to its dtype and device."""
    sd, config, wfile = load_eagle_state_dict(path)
    model = eagle_from_state_dict(sd, config, repr(wfile))
    if target is not None:
        tcfg = text_config(target.config)
        Ht, Vt = getattr(tcfg, "hidden_size", None), getattr(tcfg, "vocab_size", None)
        c = model.config
        base = config.get("base_model_name_or_path")
        built = f" (built for {base!r})" if base else ""
        if model.version == 1:
            if Ht is not None and Ht != c.hidden_size:
                raise ValueError(f"load_eagle: the EAGLE-1 draft in {wfile!r}{built} has hidden size {c.hidden_size} "
                                 f"(key 'fc.weight' has shape {list(model.fc.weight.shape)}) but the target's "
                                 f"hidden_size is {Ht}")
        elif Ht is not None and Ht != c.target_hidden_size:
            raise ValueError(f"load_eagle: the EAGLE-3 draft in {wfile!r}{built} reads target features of hidden size "
                             f"{c.target_hidden_size} (key 'fc.weight' has shape {list(model.fc.weight.shape)} = "
                             f"[H, 3 * {c.target_hidden_size}]) but the target's hidden_size is {Ht}")
        if Vt is not None and Vt != c.vocab_size:
            what = "'t2d' and config vocab_size" if getattr(model, "t2d", None) is not None else "config vocab_size"
            raise ValueError(f"load_eagle: the draft in {wfile!r}{built} has a vocabulary of {c.vocab_size} ({what}) "
                             f"but the target's vocab_size is {Vt}")
        if model.embed_tokens is None:
            emb = target.get_input_embeddings()
            if emb is None or tuple(emb.weight.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(f"load_eagle: the draft in {wfile!r} takes its token embeddings from the target, "
                                 f"whose input embeddings are {None if emb is None else list(emb.weight.shape)}; "
                                 f"[{c.vocab_size}, {c.hidden_size}] needed")
        if model.version == 3 and model.aux_layers is None:
            model.aux_layers = default_eagle3_layers(tcfg.num_hidden_layers)
        if model.version == 3 and max(model.aux_layers) > tcfg.num_hidden_layers:
            raise ValueError(f"load_eagle: the EAGLE-3 draft in {wfile!r}{built} fuses target layers "
                             f"{list(model.aux_layers)} (config eagle_aux_hidden_state_layer_ids) but the target has "
                             f"{tcfg.num_hidden_layers} layers (indices 0..{tcfg.num_hidden_layers})")
        p = next(q for q in target.parameters() if q.is_floating_point())
        dtype = p.dtype if dtype is None else dtype
        device = p.device if device is None else device
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model.eval()


def save_eagle(model, path: str | os.PathLike, base_model_name_or_path: str = "", safetensors: bool = False) -> str:
    """Writes an :class:`Eagle1Model` / :class:`Eagle3Model` as an official checkpoint directory (``config.json`` +
    ``pytorch_model.bin``, or ``model.safetensors``); returns the weights file. EAGLE-3 never saves
    ``embed_tokens`` (taken from the target)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = model.config.to_dict(model.version)
    if model.version == 1:
        cfg["bias"] = model.fc.bias is not None
    if getattr(model, "aux_layers", None) is not None:
        cfg["eagle_config"] = {"use_aux_hidden_state": True,
                               "eagle_aux_hidden_state_layer_ids": list(model.aux_layers)}
    if base_model_name_or_path:
        cfg["base_model_name_or_path"] = base_model_name_or_path
    with open(os.path.join(path, EAGLE_CONFIG), "w") as f:
        json.dump(cfg, f, indent=2)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.version == 3:
        sd.pop("embed_tokens.weight", None)
    out = os.path.join(path, EAGLE_WEIGHTS[1] if safetensors else EAGLE_WEIGHTS[0])
    if safetensors:
        from safetensors.torch import save_file

        save_file(sd, out)
    else:
        torch.save(sd, out)
    return out
