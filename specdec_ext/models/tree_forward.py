"""The verification forward: one model call over a whole draft tree per row.

``tree_forward(model, cache, tokens, parents, prefix_lens)`` runs the N tree nodes of each row at positions
``prefix_lens + depth`` (``ops.build_tree``), each node attending to the row's cached prefix and to its own ancestors
(``ops.tree_ancestor_mask``), and returns logits ``[B, N, V]``: row i of a row's logits is what the model predicts
after the root-to-node-i path. A tree that carries its :class:`~specdec_ext.state.TreeTables` (a static tree's,
made once) hands those two in; otherwise they are derived from ``parents`` here. Three routes, the same results to
the dtype's rounding:

* the direct calls (``step_ops``, :func:`~specdec_ext.models.step_ops.build_step_ops` of the model, which the
  engine builds): for a Llama-family target on a CPU one ``draft_decoder_layer`` op per layer, the tree as one bool
  mask over the cache slots in use; for a MiniMax hybrid the kernel route's own calls without the module tree; no
  module forward at all (the model must also be set to ``"specdec_tree"``);
* the kernel: the model is set to ``"specdec_tree"`` (:func:`~specdec_ext.models.attention.use_tree_attention`);
  the metadata travels as forward kwargs (and a context variable) to the attention function, which calls
  ``ops.tree_attention``. The model's ``attention_mask`` argument is then a zero-stride placeholder (no [B, N, S]
  mask is materialised) that the attention function ignores.
* the fallback (any model, any attention implementation): an additive 4-D mask ``[B, 1, N, S]`` (0 where a node may
  attend, the dtype's minimum elsewhere) over the cache's S positions, handed to the model.

Afterwards the cache is rewound to ``prefix_lens``: the nodes' K/V stay at ``prefix_lens[b] + j`` for
``TreeKVCache.accept``.

A hybrid model's :class:`~specdec_ext.models.hybrid_cache.HybridCache` works the same way: the model's linear
layers are switched to their tree form once (:func:`~specdec_ext.models.linear_layers.prepare`) and, inside the
cache's ``tree_step``, read the tree from the cache and record their nodes' keys and values there for ``accept``.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from specdec_ext import ops
from specdec_ext.models.attention import (PREFIX_LENS_KWARG, TREE_MASK_KWARG, additive_attention_mask,
                                          is_tree_attention, tree_attention_mask, tree_metadata)
from specdec_ext.models.config import row_tensor, text_config
from specdec_ext.models.hybrid_cache import HybridCache
from specdec_ext.models.kv_cache import TreeKVCache
from specdec_ext.models.linear_layers import prepare as prepare_linear_layers
from specdec_ext.models.step_ops import StepOps
from specdec_ext.state import ShallowStates, TreeTables


_CACHE_KWARG: dict[type, str] = {}


def _cache_kwarg(model) -> str:
    """transformers 5.24 spells the cache argument ``cache`` (``past_key_values`` is deprecated); older ones
    ``past_key_values``. Looked up once per model class (``inspect.signature`` costs tens of microseconds, on
    every forward of a decoding loop)."""
    name = _CACHE_KWARG.get(type(model))
    if name is None:
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        name = _CACHE_KWARG[type(model)] = "cache" if "cache" in params else "past_key_values"
    return name


# Model types whose forward refuses, under use_cache=True, any cache but its own class (MiniMax: "MiniMax uses cache
# of its own"): they run with use_cache=False, under which their layers still use the cache they are given (checked
# in transformers 5.24). Every other model keeps use_cache=True.
OWN_CACHE_MODEL_TYPES = frozenset({"minimax"})


def _use_cache(model) -> bool:
    return getattr(text_config(model.config), "model_type", None) not in OWN_CACHE_MODEL_TYPES


def _model_dtype(model, cache: TreeKVCache) -> torch.dtype:
    try:
        return next(p.dtype for p in model.parameters() if p.is_floating_point())
    except StopIteration:
        return cache.dtype


def _check_tables(tables: TreeTables, B: int, N: int, device: torch.device) -> None:
    depth, mask, W = tables.depth, tables.mask, (N + 31) // 32
    depth_ok = depth.dtype == torch.int64 and depth.shape in ((N,), (1, N), (B, N))
    mask_ok = (mask.dtype, tuple(mask.shape)) in ((torch.bool, (B, N, N)), (torch.int32, (B, N, W)))
    if not (depth_ok and mask_ok and depth.device == device and mask.device == device):
        raise ValueError(f"tree_forward: tables must be a tree's TreeTables for B = {B}, N = {N} on {device}: depth "
                         f"int64 [B, N] (or [N]) and mask bool [B, N, N] or int32 [B, N, {W}]; got depth "
                         f"{depth.dtype} {tuple(depth.shape)} on {depth.device}, mask {mask.dtype} "
                         f"{tuple(mask.shape)} on {mask.device}")


_OP_MODEL_KWARGS = frozenset({"output_hidden_states", "logits_to_keep"})


def _check_token_ids(tokens: torch.Tensor, vocab: int) -> None:
    # (the modules' embedding checks its ids; an int8 table's op-path lookup does not)
    if bool(((tokens < 0) | (tokens >= vocab)).any()):
        raise ValueError(f"tree_forward: tokens must be token ids in [0, {vocab}), got values in "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")


@torch.no_grad()  # a KV cache is inference state: writing K/V that require grad into it would fail in place
def tree_forward(model, cache: TreeKVCache, tokens: torch.Tensor, parents: torch.Tensor | None,
                 prefix_lens: torch.Tensor | int | None = None, *, use_kernel: bool | None = None,
                 packed: bool = True, validate: bool = True, return_outputs: bool = False,
                 tables: TreeTables | None = None, step_ops: StepOps | None = None,
                 shallow: ShallowStates | None = None, hidden_layers: tuple[int, ...] | None = None,
                 **model_kwargs) -> torch.Tensor:
    """Verification forward of a draft tree per row; returns logits ``[B, N, V]``.

    ``tokens[B, N]`` / ``parents[B, N]`` (int64; node 0 the root, parents earlier than children; ``None``: a chain,
    whose positions are computed directly — no ``build_tree``, whose ``[B, N, N]`` paths would cost O(N^2) memory
    on a long prompt); ``prefix_lens``
    (number or ``[B]``; default: the cache's lengths) tokens of each row already in ``cache`` before the root.
    Anything the cache holds at or beyond ``prefix_lens[b]`` is overwritten. ``use_kernel``: None = the kernel when
    the model is set to ``"specdec_tree"``, else the 4-D mask fallback. ``packed``: bit-packed tree mask for the
    kernel. ``tables``: the tree's :class:`~specdec_ext.state.TreeTables` on the cache's device (``TreeTables.of``,
    which checks the tree, or a static tree's): nothing is then derived from ``parents`` and the mask goes in the
    form the tables hold. ``validate``: check the tree (or the tables' shapes) and that ``prefix_lens[b] + N <=
    max_len`` (one host sync).
    Extra ``model_kwargs`` go to the model's forward (e.g. ``output_hidden_states=True``); with
    ``return_outputs`` the model's whole output (logits, hidden states) is returned instead of the logits.
    ``step_ops``: the model as direct calls (:func:`~specdec_ext.models.step_ops.build_step_ops`, built for it by
    the caller, who answers for its weights being the model's): the kernel route then runs them instead of the
    model's modules, for trees of at most :func:`extend_kernel_max_tokens` nodes whose only model kwargs are
    ``output_hidden_states`` and ``logits_to_keep``. ``shallow``: the nodes' states after the model's first
    layers, whose K/V are already in the cache (:class:`~specdec_ext.state.ShallowStates`): the op route starts
    there; the module route runs every layer, writing the same K/V again. ``hidden_layers``: with
    ``output_hidden_states``, the entries of the hidden-state tuple the caller reads (a drafter's
    ``hidden_state_layers``): the op route keeps only those (the rest None), the module route returns every one.
    """
    chain = parents is None
    if tokens.dim() != 2 or (not chain and parents.shape != tokens.shape):
        raise ValueError(f"tree_forward: tokens and parents must both have shape [B, N], got tokens "
                         f"{tuple(tokens.shape)} and parents {None if chain else tuple(parents.shape)}")
    if chain:  # (the tree mask still needs parents)
        parents = ops.chain_parents(tokens.shape[0], tokens.shape[1], device=tokens.device)
    if not isinstance(cache, TreeKVCache):
        raise TypeError(f"tree_forward: cache must be a TreeKVCache, got {type(cache).__name__}")
    B, N = tokens.shape
    if cache.batch_size != B:
        raise ValueError(f"tree_forward: tokens has batch size {B} but the cache was built for batch_size = "
                         f"{cache.batch_size}")
    device = cache.device
    tokens = tokens.to(device)
    parents = parents.to(device=device, dtype=torch.int64)
    prefix = (cache.lengths if prefix_lens is None  # (a number or 0-d tensor comes back expanded: made dense once)
              else row_tensor(prefix_lens, B, device, "prefix_lens", "tree_forward").contiguous())
    if validate:
        bad = (prefix < 0) | (prefix + N > cache.max_len)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"tree_forward: the tree does not fit in the cache: prefix_lens[{b}] = {int(prefix[b])} "
                             f"plus N = {N} tree nodes exceeds the cache's max_len = {cache.max_len} (need 0 <= "
                             "prefix_lens[b] <= max_len - N)")
        window = cache.sliding_window
        if window is not None and int((prefix + N).max()) > window:
            raise NotImplementedError(f"tree_forward: prefix_lens + N exceeds the model's sliding window ({window}); "
                                      "sliding-window masks are not applied by tree verification")
    use_kernel = is_tree_attention(model) if use_kernel is None else use_kernel
    if use_kernel and not is_tree_attention(model):
        raise ValueError("tree_forward: use_kernel=True needs the model set to 'specdec_tree' "
                         "(specdec_ext.models.use_tree_attention(model))")
    packed = packed and use_kernel  # (the 4-D mask is built from the dense one)
    if tables is None and chain:  # (depths 0 .. N - 1 without build_tree)
        tables = TreeTables(torch.arange(N, device=device), ops.tree_ancestor_mask(parents, packed, validate=False))
    elif tables is None:
        tables = TreeTables.of(parents, packed, validate=validate)
    elif validate:
        _check_tables(tables, B, N, device)
    position_ids = prefix[:, None] + tables.depth
    cache.rewind(prefix, validate=validate)
    hybrid = isinstance(cache, HybridCache)
    op_calls = (step_ops.on(cache) if step_ops is not None and use_kernel
                and N <= extend_kernel_max_tokens(device) and model_kwargs.keys() <= _OP_MODEL_KWARGS else None)
    if op_calls is not None:
        if validate:
            _check_token_ids(tokens, op_calls.vocab_size)
        wanted = bool(model_kwargs.get("output_hidden_states"))
        out = op_calls.verify(tokens, prefix, tables.mask, chain, position_ids,
                              hidden_states=tuple(hidden_layers) if wanted and hidden_layers is not None else wanted,
                              logits_to_keep=int(model_kwargs.get("logits_to_keep") or 0), validate=validate,
                              shallow=shallow)
        return out if return_outputs else out.logits  # (the routes leave the lengths where the rewind above set them)
    kwargs = dict(model_kwargs)
    kwargs[_cache_kwarg(model)] = cache
    tree_mask = tables.mask
    use_cache = _use_cache(model)
    # (a hybrid's linear layers read the tree from the cache, inside its tree_step)
    step = (cache.tree_step(tokens, prefix, tree_mask, chain, validate=validate) if hybrid
            else contextlib.nullcontext())
    if hybrid:
        prepare_linear_layers(model, cache)
    with step:
        if use_kernel:
            placeholder = torch.ones((), dtype=torch.bool, device=device).expand(B, 1, N, cache.max_len)
            kwargs[PREFIX_LENS_KWARG] = prefix
            kwargs[TREE_MASK_KWARG] = tree_mask
            with tree_metadata(prefix, tree_mask):
                out = model(input_ids=tokens, attention_mask=placeholder, position_ids=position_ids,
                            use_cache=use_cache, **kwargs)
        else:
            mask = tree_attention_mask(prefix, tree_mask, cache.max_len, dtype=_model_dtype(model, cache))
            out = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids, use_cache=use_cache,
                        **kwargs)
    cache.rewind(prefix, validate=False)  # (the lengths the forward started from)
    return out if return_outputs else out.logits


@torch.no_grad()
def masked_forward(model, cache: TreeKVCache, tokens: torch.Tensor, position_ids: torch.Tensor,
                   write_at: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One forward under an explicit attention mask: ``tokens[B, T]`` at ``position_ids[B, T]``, their K/V written
    at ``write_at[b] + j``, token j of row b attending to the cache positions s with ``mask[b, j, s]`` (bool ``[B, T,
    kv_len]``, ``kv_len <= max_len``; positions beyond ``kv_len`` are masked). For trees whose nodes are fed level
    by level (a drafter's dynamic tree), which :func:`tree_forward`'s contiguous layout cannot express. Goes through
    the 4-D mask (the model's SDPA); the cache's lengths are left at ``write_at``. Returns logits ``[B, T, V]``."""
    B, T = tokens.shape
    S = cache.max_len
    if isinstance(cache, HybridCache):
        raise ValueError("masked_forward: a HybridCache's linear layers verify a tree in one tree_forward (nodes fed "
                         "level by level would need per-node states)")
    if mask.shape[:2] != (B, T) or mask.shape[2] > S:
        raise ValueError(f"masked_forward: mask must have shape [B={B}, T={T}, kv_len <= {S}], got "
                         f"{tuple(mask.shape)}")
    additive = additive_attention_mask(mask, S, _model_dtype(model, cache))
    cache.rewind(write_at, validate=False)
    out = model(input_ids=tokens, attention_mask=additive, position_ids=position_ids, use_cache=_use_cache(model),
                **{_cache_kwarg(model): cache})
    cache.rewind(write_at, validate=False)
    return out.logits


# Chunks longer than this go through the 4-D mask (SDPA) rather than the tree kernel, which is built for trees. On
# CPUs the kernel keeps ahead of SDPA's causal attention up to ~256 tokens (the family's target on 1 thread: a
# 127-token prefill 44 vs 50-57 ms in float32, 27 vs 32 ms in bfloat16; 256 tokens 93-100 vs 95-105 ms; even at 384);
# elsewhere 64 (not measured on a GPU, where SDPA's long-query kernels are the safer choice).
EXTEND_KERNEL_MAX_TOKENS = 64
EXTEND_KERNEL_MAX_TOKENS_CPU = 256


def extend_kernel_max_tokens(device: torch.device | str) -> int:
    """The longest chunk that :func:`extend` (and a prefill) sends through the tree kernel on ``device``."""
    return EXTEND_KERNEL_MAX_TOKENS_CPU if torch.device(device).type == "cpu" else EXTEND_KERNEL_MAX_TOKENS


@torch.no_grad()
def extend(model, cache: TreeKVCache, tokens: torch.Tensor, num_tokens: torch.Tensor | int | None = None,
           **kwargs) -> torch.Tensor:
    """Appends ``tokens[B, T]`` (right-padded; row b's first ``num_tokens[b]``, default T) to every row of the cache
    and commits them: prefill of prompts of different lengths, or a plain decoding step. Returns logits
    ``[B, T, V]`` (row b's are meaningful up to ``num_tokens[b]``). A chain through :func:`tree_forward`; chunks of
    more than :func:`extend_kernel_max_tokens` tokens take the 4-D mask route unless ``use_kernel`` is given."""
    if tokens.dim() != 2:
        raise ValueError(f"extend: tokens must have shape [B, T], got {tuple(tokens.shape)}")
    B, T = tokens.shape
    if T > extend_kernel_max_tokens(cache.device):
        kwargs.setdefault("use_kernel", False)
    prefix = cache.lengths
    logits = tree_forward(model, cache, tokens, None, prefix, **kwargs)
    n = row_tensor(T if num_tokens is None else num_tokens, B, cache.device, "num_tokens", "extend")
    if bool(((n < 0) | (n > T)).any()):
        raise ValueError(f"extend: num_tokens must be in [0, T = {T}], got {n.tolist()}")
    cache.rewind(prefix + n)
    return logits
