"""EAGLE drafter: EAGLE-1 / EAGLE-3 draft networks with EAGLE-2 dynamic trees.

Features. The draft autoregresses over target features: its input at position t is (the embedding of token t + 1,
the target's feature at t) and its output there yields the logits of token t + 2 (EAGLE-1: the predicted feature
through the target's ``lm_head``; EAGLE-3: ``norm`` + its own ``lm_head`` over the draft vocabulary, mapped to target
ids with ``d2t``). EAGLE-1 reads the target's last hidden state (``hidden_state_layers = (-1,)``, after the final
norm), EAGLE-3 the residual-stream inputs of three target layers (default ``(2, L // 2, L - 3)``), concatenated.
The drafter keeps every context position's target feature (from the prefill and from the accepted tree nodes).

Draft cache. The draft layer has its own :class:`~specdec_ext.models.eagle.EagleKVCache`; ``valid[b]`` entries
(positions ``0 .. valid[b] - 1``) were computed from real target features. Each :meth:`propose` first *catches up*:
one chain forward over the positions ``valid[b] .. n - 2`` (n = context length; the last one pairs the feature
before the root with the root token), which also gives the root's predicted feature. Tree nodes are then written
after the valid prefix and discarded at the next step (rolling back is setting ``valid``): the next catch-up
recomputes the accepted positions from the target's real features.

Dynamic tree (EAGLE-2): :func:`specdec_ext.drafters.dynamic_tree.grow_dynamic_tree`, each level one draft
forward on the ``top_k`` frontier nodes (their features: the predicted features of their parents) at the tree
slots after the valid prefix; ``depth`` levels at most (fewer when the loop's budget is shorter). ``top_k = 1``
gives a chain of ``depth`` tokens. ``propose`` does no host synchronisation.

Calibrated scores (``calibrate=True``, the default): :class:`~specdec_ext.drafters.dynamic_tree.ScoreCalibration`
(the scale on the draft logits that ranks candidates, learned online from whether the root's best child is
accepted). The scale is kept across generations (keep one drafter across requests, as with
:class:`~specdec_ext.adaptive.AdaptiveDrafter`); ``calibrate=False`` keeps EAGLE-2's raw scores (scale 1); chains
(``top_k = 1``) have nothing to rank and skip it. Sampled outputs are exact whatever the scale, but which uniforms a
step consumes depends on the tree, so the same seed repeats the same tokens only from the same calibration state
(:meth:`reset_calibration`).

Static tree (EAGLE-1's original mode, ``choices=``): a Medusa-style choices list (e.g.
:data:`~specdec_ext.drafters.trees.MC_SIM_7B_63`, EAGLE-1's ``mc_sim_7b_63``); node ``(i, j)`` is the j-th best
child of the i-th best child of the root, each level drafted by one forward over the previous level's nodes.

Speed: on CPUs the draft network runs as direct op calls (:class:`~specdec_ext.models.eagle_step.EagleStepOps`),
looked up at a generation's first :meth:`propose` and kept until the next :meth:`begin`; where they do not apply
(hooks, gradients, CUDA, ...) the modules run. A draft whose weights change in the middle of a generation drafts
with them from the next one; the outputs are exact either way (drafts are only proposals).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec_ext.drafters.base import check_vocab, to_device
from specdec_ext.drafters.dynamic_tree import (CalibratedScores, ScoreCalibration, check_tree_shape, grow_dynamic_tree,
                                               max_tree_nodes)
from specdec_ext.drafters.shapes import eagle_tree_shape
from specdec_ext.drafters.trees import StaticTree, static_tree
from specdec_ext.models.checkpoints import load_eagle
from specdec_ext.models.config import text_config
from specdec_ext.models.draft_vocab import VocabRows, read_draft_vocab
from specdec_ext.models.eagle import Eagle1Model, Eagle3Model, EagleKVCache, default_eagle3_layers
from specdec_ext.models.eagle_step import EagleStepOps
from specdec_ext.models.kv_cache import append_batch_rows, grow_batch_rows, keep_batch_rows, write_rows
from specdec_ext.models.quantized import check_draft_quant, linear_dtype, quantize_weights
from specdec_ext.state import DecodeState, DraftTree, StepResult, plain_tree

__all__ = ["EagleDrafter"]


class EagleDrafter(CalibratedScores):
    """EAGLE drafting with ``model`` (:class:`Eagle1Model` or :class:`Eagle3Model`) on EAGLE-2 dynamic trees.

    ``depth`` (levels below the root: the deepest draft token), ``top_k`` (children scored per frontier node and
    frontier width), ``total_tokens`` (draft tokens per tree, root excluded; EAGLE's ``total_token``). Defaults are
    EAGLE-2's ``total_token=60, depth=7, top_k=10``: EAGLE's ``depth`` counts the expansions *after* the root's
    children (``topK_genrate`` runs ``depth`` draft steps after the first), so its trees reach ``depth + 1`` levels;
    here ``depth`` is the tree depth itself, 8 by default (EAGLE ``depth = d`` is ``depth = d + 1`` here). ``target``: for EAGLE-3 without explicit ``aux_layers``, the target whose layer count decides the
    default feature layers ``(2, L // 2, L - 3)``. ``calibrate`` / ``calibration_rate``: online calibration of the
    tree's scores (module doc); :attr:`score_scale` is the current scale. ``draft_vocab`` (EAGLE-1): the target
    token ids drafts may use (``[Vs]``, e.g. the most frequent tokens of the training data): the draft's logits are
    computed over these only (FR-Spec), which saves most of the vocabulary projection on a large vocabulary; a target
    token outside them is simply never drafted (lossless). ``draft_quant="int8"``: the draft network (``model``,
    quantised in place) and its draft-vocabulary rows run on int8 weights
    (:func:`~specdec_ext.models.quantized.quantize_weights`); the target's embeddings and ``lm_head`` stay as they
    are.
    """

    defers_prefill = True
    serves_row_subsets = True

    @property
    def max_depth(self) -> int:
        """The deepest tree this drafter builds (its ``depth``)."""
        return self.depth

    @property
    def vocab_head(self) -> nn.Module | None:
        """The draft-vocabulary rows of the target's ``lm_head`` this drafter holds (``draft_vocab``; built at the
        first generation), or None."""
        return self._lm_sub

    def __init__(self, model: nn.Module, depth: int = 8, top_k: int = 10, total_tokens: int = 60,
                 target: nn.Module | None = None, aux_layers=None, choices=None, calibrate: bool = True,
                 calibration_rate: float = 0.2, draft_vocab=None, draft_quant: str | None = None):
        if not isinstance(model, (Eagle1Model, Eagle3Model)):
            raise TypeError(f"EagleDrafter: model must be an Eagle1Model or Eagle3Model, got {type(model).__name__} "
                            "(load published drafts with specdec_ext.models.checkpoints.load_eagle)")
        check_tree_shape("EagleDrafter", depth, top_k, total_tokens)
        if top_k > model.draft_vocab_size:
            raise ValueError(f"EagleDrafter: top_k = {top_k} exceeds the draft vocabulary ({model.draft_vocab_size})")
        self.calibration = ScoreCalibration(calibration_rate, "EagleDrafter")
        self.draft_vocab = None
        if draft_vocab is not None:
            ids = torch.as_tensor(draft_vocab)
            if model.version != 1:
                raise ValueError("EagleDrafter: draft_vocab restricts EAGLE-1 drafts; an EAGLE-3 draft has its own "
                                 "draft vocabulary (d2t)")
            V = model.config.vocab_size
            if (ids.dim() != 1 or ids.is_floating_point() or ids.numel() < max(top_k, 1)
                    or bool(((ids < 0) | (ids >= V)).any()) or ids.unique().numel() != ids.numel()):
                raise ValueError(f"EagleDrafter: draft_vocab must be a 1-D tensor of distinct target token ids in "
                                 f"[0, {V}) with at least top_k = {top_k} of them, got {ids.dtype} of shape "
                                 f"{tuple(ids.shape)}")
            self.draft_vocab = ids.to(torch.int64).sort().values
        self._vocab_ids = self._lm_sub = None  # built in begin
        self.draft_quant = check_draft_quant("EagleDrafter", draft_quant)
        self._rows = None if self.draft_vocab is None else VocabRows(self.draft_vocab, self.draft_quant)
        self.model = model.eval() if self.draft_quant is None else quantize_weights(model.eval(), self.draft_quant)
        self.calibrate = bool(calibrate)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.max_nodes = max_tree_nodes(depth, top_k, total_tokens)
        self.static: StaticTree | None = None
        if choices is not None:
            tree = choices if isinstance(choices, StaticTree) else static_tree(choices)
            if tree.top_k > model.draft_vocab_size:
                raise ValueError(f"EagleDrafter: the tree uses rank {tree.top_k - 1} but the draft vocabulary has "
                                 f"{model.draft_vocab_size} ids")
            self.static = tree
            self.depth, self.top_k, self.total_tokens = tree.max_depth, tree.top_k, tree.num_nodes - 1
            self.max_nodes = tree.num_nodes
        if self.draft_vocab is not None and self.top_k > self.draft_vocab.numel():
            raise ValueError(f"EagleDrafter: the tree uses {self.top_k} candidates per node but draft_vocab has "
                             f"{self.draft_vocab.numel()} ids")
        if model.version == 1:
            self.hidden_state_layers: tuple[int, ...] = (-1,)
        else:
            layers = aux_layers if aux_layers is not None else model.aux_layers
            if layers is None:
                if target is None:
                    raise ValueError("EagleDrafter: an EAGLE-3 draft needs its target feature layers: pass target= "
                                     "(default layers (2, L//2, L-3)) or aux_layers=")
                layers = default_eagle3_layers(text_config(target.config).num_hidden_layers)
            layers = tuple(int(x) for x in layers)
            if len(layers) != 3:
                raise ValueError(f"EagleDrafter: EAGLE-3 reads three target layers, got aux_layers = {layers}")
            self.hidden_state_layers = layers
        self.cache: EagleKVCache | None = None
        # the draft network as op calls for this generation (None: the modules), built at its first propose
        self._ops: EagleStepOps | None = None
        self._ops_built = False
        self.forwards = 0

    @classmethod
    def from_pretrained(cls, path, target: nn.Module, depth: int | None = None, top_k: int | None = None,
                        total_tokens: int | None = None, dtype: torch.dtype | None = None, device=None,
                        draft_quant: str | None = None, draft_vocab="file") -> "EagleDrafter":
        """An official EAGLE-1 or EAGLE-3 checkpoint directory (``config.json`` + ``pytorch_model.bin`` or
        ``model.safetensors``), checked against ``target`` and moved to its dtype / device unless given.
        ``depth`` / ``top_k`` / ``total_tokens``: each None takes the EAGLE-2 tree the library decodes with where
        the draft runs (:func:`~specdec_ext.drafters.shapes.drafter_shape` of ``eagle2`` / ``eagle3``: on a CPU the
        measured small trees, elsewhere the constructor's published ones).
        ``draft_vocab``: ``"file"`` (default) drafts an EAGLE-1 checkpoint over the FR-Spec ids of its
        ``draft_vocab.json`` when it has one (``specdec train-eagle`` writes it), else over the whole vocabulary;
        None the whole vocabulary; ids as for the constructor."""
        model = load_eagle(path, target=target, dtype=dtype, device=device)
        shape = eagle_tree_shape(model.version, next(model.parameters()).device.type)  # (missing: the constructor's)
        given = {"depth": depth, "top_k": top_k, "total_tokens": total_tokens}
        shape.update({k: v for k, v in given.items() if v is not None})
        if isinstance(draft_vocab, str):
            if draft_vocab != "file":
                raise ValueError(f"EagleDrafter.from_pretrained: draft_vocab must be 'file', None or token ids, got "
                                 f"{draft_vocab!r}")
            draft_vocab = read_draft_vocab(path, "EagleDrafter.from_pretrained") if model.version == 1 else None
        return cls(model, **shape, target=target, draft_quant=draft_quant, draft_vocab=draft_vocab)

    # ---- start of a generation ------------------------------------------------------------------------------
    def begin(self, target: nn.Module, state: DecodeState, prefill_hidden_states=None, *,
              defer_prefill: bool = False) -> None:
        """Checks the pair, allocates the draft cache, keeps the prompt's target features and runs the draft over
        them (``defer_prefill``: not now; the first speculative :meth:`propose` catches up on them)."""
        m = self.model
        cfg = text_config(target.config)
        H = getattr(cfg, "hidden_size", None)
        name = f"EagleDrafter (EAGLE-{m.version})"
        want_h = m.hidden_size if m.version == 1 else m.config.target_hidden_size
        if H is not None and H != want_h:
            raise ValueError(f"{name}: the draft was built for a target hidden size of {want_h} but the target's "
                             f"hidden_size is {H}; this draft belongs to another model")
        check_vocab(name, m.config.vocab_size, state.vocab_size)
        if m.version == 3:
            L = getattr(cfg, "num_hidden_layers", None)
            if L is not None and any(not 0 <= i <= L for i in self.hidden_state_layers):
                raise ValueError(f"{name}: feature layers {self.hidden_state_layers} are outside the target's "
                                 f"hidden states [0, {L}]")
        p = next(q for q in m.parameters() if q.is_floating_point())
        if p.device != state.device:
            raise ValueError(f"{name}: the draft is on {p.device} but the target on {state.device}; put both on one "
                             "device")
        embed = m.embed_tokens if m.embed_tokens is not None else target.get_input_embeddings()
        shape = None if embed is None else [getattr(embed, "num_embeddings", None), getattr(embed, "embedding_dim",
                                                                                           None)]
        if shape != [m.config.vocab_size, m.hidden_size]:
            got = shape
            raise ValueError(f"{name}: token embeddings of shape [{m.config.vocab_size}, {m.hidden_size}] needed "
                             f"(the target's input embeddings are {got})")
        self._embed = embed
        self._lm_head = None
        if m.version == 1:
            lm = target.get_output_embeddings()
            if lm is None or lm.weight.shape[-1] != m.hidden_size:
                raise ValueError(f"{name}: EAGLE-1 uses the target's lm_head, which "
                                 f"{'is missing' if lm is None else f'takes {lm.weight.shape[-1]} features'}; the "
                                 f"draft predicts {m.hidden_size}")
            self._lm_head = lm
        if self._rows is not None:  # its lm_head rows: copied once per lm_head weight (packed once with them), in
            # the draft's dtype (a bfloat16 draft for a float32 target reads half)
            self._vocab_ids, self._lm_sub = self._rows.of(self._lm_head, p.dtype, state.device)
        self._tree_slots = max((self.depth - 1) * self.top_k, self.max_nodes)
        self.cache, self.feats, self.valid = None, None, []
        self.forwards = 0
        self._ops, self._ops_built = None, False  # (the prompt's catch-up below is long: the modules' path)
        self.add_rows(target, state, prefill_hidden_states, defer_prefill=defer_prefill)

    def add_rows(self, target: nn.Module, rows: DecodeState, prefill_hidden_states=None, *,
                 defer_prefill: bool = False) -> None:
        """The joining rows' draft cache and target features, and the draft's prefill over their prompts (the
        modules' path, into their own cache), then appended to the running rows'. Rows with no prefill to run now
        (deferred, or prompts too short) are zeroed where they join the running buffers instead."""
        p = next(q for q in self.model.parameters() if q.is_floating_point())
        B, dev = rows.batch_size, rows.device
        f = None if prefill_hidden_states is None else torch.cat([h.to(p.dtype) for h in prefill_hidden_states], -1)
        # The draft's own prefill runs now (the rows' prefill) over every prompt position but the last, which the
        # first propose's catch-up reads to predict the root's feature. Left to that propose, a whole prompt's
        # forward would be billed to a decoding step.
        prefill_now = f is not None and max(rows.prompt_lens) >= 3 and not defer_prefill
        if self.cache is not None and not prefill_now and self.feats.shape[1] == rows.max_len + 1:
            self.cache.k, self.cache.v = grow_batch_rows(self.cache.k, B), grow_batch_rows(self.cache.v, B)
            self.feats = grow_batch_rows(self.feats, B)
            if f is not None:
                self.feats[-B:, : f.shape[1]] = f  # [B, P_max - 1, Hf]
            self.valid = self.valid + [0] * B
            return
        running = (self.cache, self.feats, self.valid, self._ops)
        S = rows.max_len + self._tree_slots + 2  # the last slot takes padding writes, never read
        c = self.model.config
        self.cache = EagleKVCache(B, c.num_key_value_heads, S, c.head_dim, p.dtype, dev)
        self.feats = torch.zeros(B, rows.max_len + 1, self.model.feature_size, dtype=p.dtype, device=dev)
        self._positions = torch.arange(S, device=dev)
        self.valid, self._ops = [0] * B, None
        if f is not None:
            self.feats[:, : f.shape[1]] = f
            if prefill_now:
                self._catch_up(rows, hold=1)
        if running[0] is not None:  # (the running cache object stays: the step ops read its tensors)
            cache, feats, valid, self._ops = running
            cache.k, cache.v = append_batch_rows(cache.k, self.cache.k), append_batch_rows(cache.v, self.cache.v)
            self.cache, self.feats, self.valid = cache, append_batch_rows(feats, self.feats), valid + self.valid

    def _draft(self, hidden: torch.Tensor, ids: torch.Tensor, position_ids: torch.Tensor, **kw) -> torch.Tensor:
        """The draft network's predicted features (see :meth:`EagleStepOps.forward` for the arguments): this step's
        op calls when it has them, else the modules."""
        self.forwards += 1
        if self._ops is not None:
            return self._ops.forward(hidden, ids, position_ids, **kw)
        return self.model(hidden, self._embed_ids(ids), position_ids, cache=self.cache, **kw)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., Vd]``: over the draft vocabulary (EAGLE-3), ``draft_vocab`` or the whole target
        vocabulary (EAGLE-1)."""
        if self._ops is not None:
            logits = self._ops.logits(hidden)
            if logits is not None:
                return logits
        if self._lm_sub is None:
            return self.model.logits(hidden, self._lm_head)
        return self._lm_sub(hidden.to(linear_dtype(self._lm_sub)))

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Indices into :meth:`_logits`' last dimension -> target token ids."""
        return self.model.to_target_ids(ids) if self._vocab_ids is None else self._vocab_ids[ids]

    def _features(self, hidden_states) -> torch.Tensor:
        if len(hidden_states) == 1:  # (EAGLE-1: no concatenation, which would copy)
            return hidden_states[0].to(self.feats.dtype)
        return torch.cat([h.to(self.feats.dtype) for h in hidden_states], -1)

    def _embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        e = self._embed
        if type(e) is nn.Embedding and e.max_norm is None and not (e._forward_hooks or e._forward_pre_hooks):
            return F.embedding(ids, e.weight)  # (a plain table: the lookup without the module call, ~15 us a level)
        return e(ids)  # anything else (a scaled embedding, hooks) as the target defines it

    # ---- drafting ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _catch_up(self, state: DecodeState, hold: int = 0):
        """One chain forward over each row's positions ``valid .. n - 2 - hold``; returns the last position's
        predicted hidden ``[B, H]`` (with ``hold`` 0: the root's), its position ``[B]`` and the new valid lengths
        ``[B]`` (which it also keeps on the host)."""
        B, dev = state.batch_size, state.device
        lengths = [len(t) - hold for t in state.host_tokens]
        start = [min(v, max(n - 2, 0)) for v, n in zip(self.valid, lengths)]
        count = [max(n - 1 - s, 1) for s, n in zip(start, lengths)]
        valid = [max(0, min(s + c, n - 1)) for s, c, n in zip(start, count, lengths)]
        if start.count(start[0]) == B and count.count(count[0]) == B and start[0] + count[0] < min(lengths) + hold:
            return self._catch_up_aligned(state, start[0], count[0], valid)
        T = max(count)
        j = torch.arange(T, device=dev)
        start_t, count_t, valid_t = to_device([start, count, valid], dev)  # (one host-to-device copy)
        pos = start_t[:, None] + j  # [B, T]
        tok = state.tokens.gather(1, (pos + 1).clamp(max=state.max_len - 1))
        tok = torch.where(pos + 1 < state.lengths[:, None], tok, state.last_tokens[:, None])
        feat = self.feats.gather(1, pos.clamp(max=self.feats.shape[1] - 1)[:, :, None].expand(
            B, T, self.feats.shape[-1]))
        S = self.cache.max_len
        slots = torch.where(j < count_t[:, None], pos, S - 1)
        kv_len = max(s + c for s, c in zip(start, count))
        mask = torch.arange(kv_len, device=dev)[None, None, :] <= pos[:, :, None]
        out = self._draft(feat, tok, pos, from_target=True, mask=mask, write_slots=slots, kv_len=kv_len)
        root_h = out.gather(1, (count_t - 1)[:, None, None].expand(B, 1, out.shape[-1]))[:, 0]
        self.valid = valid
        return root_h, start_t + count_t - 1, valid_t

    def _catch_up_aligned(self, state: DecodeState, start: int, count: int, valid: list[int]):
        """:meth:`_catch_up` when every row catches up on the same positions ``start .. start + count - 1``, all
        inside its context (one row, or rows in step): the positions, tokens and features are slices, with no
        gathers and no padding. A step at batch 1 takes this path; it saves ~20 small ops."""
        B, dev, end = state.batch_size, state.device, start + count
        pos = self._positions[start:end].expand(B, count)
        mask = self._positions[:end][None, None, :] <= pos[:, :, None]
        out = self._draft(self.feats[:, start:end], state.tokens[:, start + 1: end + 1], pos, from_target=True,
                          mask=mask, write_slots=pos, kv_len=end)
        self.valid = valid
        return out[:, -1], pos[:, -1], to_device(valid, dev)

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        B, dev = state.batch_size, state.device
        root = state.last_tokens
        depth = min(self.depth, int(max_depth))
        total = min(self.total_tokens, int(max_nodes) - 1)  # draft tokens this step
        if depth <= 0 or total <= 0:
            return plain_tree(root)
        m = self.model
        if not self._ops_built:
            lm = self._lm_sub if self._lm_sub is not None else self._lm_head if m.version == 1 else m.lm_head
            self._ops, self._ops_built = EagleStepOps.build(m, self.cache, self._embed_ids, lm), True
        root_h, root_pos, valid = self._catch_up(state)
        if self.static is not None:
            return self._propose_static(state, self.static.cut(depth, total + 1), root, root_h, root_pos, valid)
        # a budget of one token per level (or less) is spent on a chain (EAGLE-1's): its frontier of one node costs
        # 1 / top_k of the tree's draft forwards
        k = self.top_k if total > depth else 1
        depth = min(depth, total)
        calibration = self.calibration if self.calibrate and k > 1 else None  # a chain has nothing to rank
        kv_len = max(self.valid) + (depth - 1) * k
        H = root_h.shape[-1]
        last_h = [root_h[:, None].expand(B, k, H)]  # the previous level's predicted features (the root's at first)
        # every level's positions at once (level d's nodes all sit at position root + d)
        level_pos = root_pos[:, None] + torch.arange(1, max(depth, 2), device=dev)
        tables = []  # their RoPE tables, made by the first level that needs them (not the op's path: it makes its own)

        def level_rotary(d):
            if not tables:
                tables.extend(m.rotary(level_pos))
            return tables[0][:, :, d - 1: d], tables[1][:, :, d - 1: d]

        def level(d, tok, parent, mask, slots):
            front_h = last_h[0] if d == 1 else last_h[0].gather(1, parent[:, :, None].expand(B, k, H))
            pos = level_pos[:, d - 1: d].expand(B, k)
            last_h[0] = self._draft(front_h, tok, pos, from_target=False, mask=mask, write_slots=slots, kv_len=kv_len,
                                    rotary=lambda: level_rotary(d))
            return self._logits(last_h[0])

        return grow_dynamic_tree(root, self._logits(root_h), level, depth=depth, top_k=k,
                                 total_tokens=total, valid=valid, kv_len=kv_len,
                                 target_ids=self._target_ids, calibration=calibration)

    @torch.no_grad()
    def _propose_static(self, state: DecodeState, tree: StaticTree, root, root_h, root_pos, valid) -> DraftTree:
        B, dev, m, k, N = state.batch_size, state.device, self.model, tree.top_k, tree.num_nodes
        if N == 1:
            return plain_tree(root)
        tokens = torch.zeros(B, N, dtype=torch.int64, device=dev)
        tokens[:, 0] = root
        hid = root_h.new_zeros(B, N, root_h.shape[-1])
        hid[:, 0] = root_h
        top = torch.zeros(B, N, k, dtype=torch.int64, device=dev)  # [:, i]: node i's top-k children (target ids)
        top[:, 0] = self._target_ids(self._logits(root_h).topk(k, dim=-1).indices)
        anc = tree.ancestors_tensor(dev)[:, 1:]  # ancestors-or-self among the non-root nodes (their K/V slots)
        kv_len = max(self.valid) + N - 1
        rel = torch.arange(kv_len, device=dev)[None, :] - valid[:, None]
        in_tree = (rel >= 0) & (rel < N - 1)
        rel_c = rel.clamp(0, N - 2)
        for d, (idx, par, rk) in enumerate(tree.level_tensors(dev), 1):
            tokens[:, idx] = top[:, par, rk]
            if d == tree.max_depth:
                break
            mask = anc[idx][:, rel_c].permute(1, 0, 2) & in_tree[:, None, :]
            mask = mask | (rel < 0)[:, None, :]
            pos = (root_pos + d)[:, None].expand(B, idx.numel())
            h = self._draft(hid[:, par], tokens[:, idx], pos, from_target=False, mask=mask,
                            write_slots=valid[:, None] + idx - 1, kv_len=kv_len)
            hid[:, idx] = h
            top[:, idx] = self._target_ids(self._logits(h).topk(k, dim=-1).indices)
        return DraftTree(tokens, tree.parents_tensor(B, dev), None, tree.tables(B, dev))

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        if result.hidden_states is None:
            raise ValueError("EagleDrafter.observe: the step's hidden states are missing (the loop must run the "
                             f"target with output_hidden_states for hidden_state_layers = {self.hidden_state_layers})")
        self.calibration.update(result)
        if state.batch_size == 1:  # (one row: slices instead of the gather and the scattered write below)
            a = result.appended[0]
            end = len(state.host_tokens[0]) - 1
            if a == 1:  # (the root alone, node 0: a plain step, or every draft rejected)
                rows = [h[0, :1] for h in result.hidden_states]
            elif a:
                idx = result.accepted[0, :a]
                rows = [h[0].index_select(0, idx) for h in result.hidden_states]
            else:
                return
            self.feats[0, end - a: end].copy_(rows[0] if len(rows) == 1 else torch.cat(rows, -1))
            return
        hs = self._features(result.hidden_states)  # [B, N, Hf]
        B, N, Hf = hs.shape
        if N == 1 and all(a == 1 for a in result.appended):  # a plain step: each row's root feature, one write
            self.feats.index_put_((torch.arange(B, device=state.device), state.lengths - 2), hs[:, 0])
            return
        g = hs.gather(1, result.accepted.clamp(min=0)[:, :, None].expand(B, N, Hf))
        # the accepted path's features go to positions old - 1 + j, j < appended (old: the context length before the
        # step); the rest to the last slot, never read
        appended = to_device(result.appended, state.device)
        j = torch.arange(N, device=state.device)
        idx = torch.where(j < appended[:, None], (state.lengths - appended - 1)[:, None] + j, self.feats.shape[1] - 1)
        write_rows(self.feats[:, None], idx, g[:, None])

    def retire(self, keep: torch.Tensor) -> None:
        """Keeps the rows ``keep`` of the draft cache, the target features and the valid lengths (in place: only the
        rows that change slot move, :func:`~specdec_ext.models.kv_cache.keep_batch_rows`)."""
        if self.cache is None:
            return
        rows = keep.tolist()
        self.cache.k, self.cache.v, self.feats = (keep_batch_rows(t, rows) for t in (self.cache.k, self.cache.v,
                                                                                    self.feats))
        self.valid = [self.valid[i] for i in rows]
