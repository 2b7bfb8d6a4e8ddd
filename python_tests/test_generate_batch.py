"""specdec_ext.generate with B > 1: rows that finish are retired, and everything stays exact.

* Greedy, every drafter (plain, n-gram, draft model chain and top-2 tree, Medusa, EAGLE-1 chain, EAGLE-2 dynamic
  tree, EAGLE-3): prompts of different lengths (one of a single token), an EOS id that some rows emit early and
  others never (so rows finish at different steps, by EOS or by the budget): each row equals its prompt decoded
  alone by Hugging Face's plain greedy ``generate``, in the caller's row order.
* Rows that finish stop costing compute: hooks on the target (and on the drafter's network) record the batch
  dimension of every forward; after each step the rows still generating are read from the state the drafter
  observes, and every later forward must have exactly that many rows. ``DecodeStats.row_steps`` is the sum of the
  step batches, and the drafts keep being accepted after the compactions.
* Sampling with retirement: the chi-square test of test_generate_sampling (exact target distribution of the first
  generated tokens, p < 1e-3 per test) on rows that share the batch with filler rows, most of which end at their
  first token (EOS), so the batch shrinks under the tested rows.
* A third-party drafter without ``add_rows`` / ``retire`` is refused with a ValueError naming them.
* ``TreeKVCache.keep_rows`` and ``DecodeState.keep_rows`` select rows (unit checks).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
stats_mod = pytest.importorskip("scipy.stats")

import test_drafter_eagle as eagle_t  # noqa: E402
import test_drafter_medusa as medusa_t  # noqa: E402
import test_generate_greedy as greedy_t  # noqa: E402
import test_generate_sampling as sampling_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402

from specdec_ext.drafters import (DecodeState, DraftModelDrafter, EagleDrafter, MedusaDrafter,  # noqa: E402
                                  SamplingParams, ngram_lookup)
from specdec_ext.drafters.base import pad_chains  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models import TreeKVCache  # noqa: E402
from specdec_ext.ops.reference import filtered_weights  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


NEW = 20  # token budget of the greedy batches


# ---------------------------------------------------------------------------------------------------------------
# Recording what the target and the drafter compute.


def _batch_of(args, kwargs) -> int:
    x = kwargs.get("input_ids") if "input_ids" in kwargs else args[0]
    return int(x.shape[0])


class Timeline:
    """Events in order: ("target", rows) and ("draft", rows) per forward, ("observe", rows still generating after
    the step, rows in the step) per step. Hooks on ``target`` and on ``draft_module`` (the drafter's network, if
    any); ``observe`` of ``drafter`` is wrapped."""

    def __init__(self, target, drafter=None, draft_module=None):
        self.events: list[tuple] = []
        self.handles = [target.register_forward_pre_hook(
            lambda m, a, k: self.events.append(("target", _batch_of(a, k))), with_kwargs=True)]
        if draft_module is not None:
            self.handles.append(draft_module.register_forward_pre_hook(
                lambda m, a, k: self.events.append(("draft", _batch_of(a, k))), with_kwargs=True))
        if drafter is not None:
            inner = drafter.observe

            def observe(state, tree, result):
                self.events.append(("observe", sum(not d for d in state.done), state.batch_size))
                inner(state, tree, result)

            drafter.observe = observe

    def close(self):
        for h in self.handles:
            h.remove()

    def target_batches(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "target"]

    def check_live_rows_only(self, B: int) -> None:
        """Every forward after a step has as many rows as were still generating after that step."""
        live = B
        for e in self.events:
            if e[0] == "observe":
                assert e[2] == live, self.events  # the step ran on the live rows
                live = e[1]
            else:
                assert e[1] == live, (e, live, self.events)


def draft_module(drafter):
    if isinstance(drafter, DraftModelDrafter) or isinstance(drafter, EagleDrafter):
        return drafter.model
    if isinstance(drafter, MedusaDrafter):
        return drafter.heads
    return None


# ---------------------------------------------------------------------------------------------------------------
# The greedy cases: (target, drafter, prompts) per drafter kind.


def eagle_case(name: str):
    version, kw = eagle_t.CASES[name]
    m = eagle_t.target()
    return m, EagleDrafter(eagle_t.trained_draft(version), target=m, **kw), eagle_t.PROMPTS


def case(kind: str):
    """(target, a fresh drafter, prompts of different lengths, one of a single token)."""
    if kind in ("plain", "ngram", "draft", "tree"):
        m = greedy_t.target("llama")
        prompts = [greedy_t.prompt_of(n, 40 + n) for n in (7, 1, 12, 4, 9, 15)]
        return m, greedy_t.make_drafter(kind, m), prompts
    if kind == "medusa":
        m = medusa_t.target()
        m, drafter, prompts = m, MedusaDrafter(medusa_t.trained_heads(True)), medusa_t.PROMPTS
    else:
        m, drafter, prompts = eagle_case(kind)
    return m, drafter, list(prompts) + [[prompts[0][0]]]


KINDS = ["plain", "ngram", "draft", "tree", "medusa", "eagle1_chain", "eagle2_tree", "eagle3_tree"]


def pick_eos(refs: list[list[int]]) -> int:
    """A token that some row emits early and some row never emits, with rows finishing at >= 3 different
    positions (EOS at different places, or the budget)."""
    for pos in range(1, 8):
        for r in refs:
            t = r[pos]
            if t in r[:pos]:
                continue
            ends = [o.index(t) + 1 if t in o else len(o) for o in refs]
            if len(set(ends)) >= 3 and max(ends) == NEW:
                return t
    raise AssertionError("no suitable EOS id in the references")


def cut(ref: list[int], eos: int) -> list[int]:
    return ref[: ref.index(eos) + 1] if eos in ref else ref


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_rows_equal_single_prompt_decoding(kind):
    m, drafter, prompts = case(kind)
    refs = [hf_greedy(m, p, NEW) for p in prompts]
    eos = pick_eos(refs)
    want = [cut(r, eos) for r in refs]
    tl = Timeline(m, drafter, draft_module(drafter))
    try:
        outs, stats = generate(m, drafter, prompts, max_new_tokens=NEW, eos_token_id=eos)
    finally:
        tl.close()
    for b, (p, o, w) in enumerate(zip(prompts, outs, want)):
        assert o.tolist() == p + w, (kind, b)
    assert stats.new_tokens == sum(len(w) for w in want)
    # rows finished at different steps and were retired; every forward after a finish ran on the live rows only
    assert stats.retirements >= 2, stats.retirements
    if drafter is not None:
        tl.check_live_rows_only(len(prompts))
    batches = tl.target_batches()
    assert stats.row_steps == sum(batches[1:]) and batches[0] == len(prompts)  # [0]: the prefill
    if drafter is None:  # plain decoding: row b takes part in exactly len(w) steps
        assert batches[1:] == [sum(len(w) > s for w in want) for s in range(max(len(w) for w in want))]
        return
    assert stats.mean_accepted_length > 1.2, stats.mean_accepted_length  # drafts were accepted


@pytest.mark.parametrize("kind", ["plain", "draft", "medusa", "eagle2_tree"])
def test_a_budget_per_row(kind):
    """``max_new_tokens`` as one budget per prompt: each row stops at its own budget (inside an accepted run or
    not), equal to that prompt decoded alone with that budget; rows retire as their budgets run out."""
    m, drafter, prompts = case(kind)
    budgets = [NEW - 3 * (b % 5) for b in range(len(prompts))]  # different budgets, the full one included
    refs = [hf_greedy(m, p, NEW) for p in prompts]
    outs, stats = generate(m, drafter, prompts, max_new_tokens=budgets, eos_token_id=[])
    for b, (p, o, r, n) in enumerate(zip(prompts, outs, refs, budgets)):
        assert o.tolist() == p + r[:n], (kind, b)
    assert stats.new_tokens == sum(budgets) and stats.retirements >= 1
    with pytest.raises(ValueError, match="max_new_tokens has 2 entries for"):
        generate(m, None, prompts, max_new_tokens=[4, 5], eos_token_id=[])
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate(m, None, prompts, max_new_tokens=[4] * (len(prompts) - 1) + [0], eos_token_id=[])
    with pytest.raises(ValueError, match="a prompt plus its max_new_tokens needs"):
        generate(m, None, prompts, max_new_tokens=[10 ** 6] * len(prompts), eos_token_id=[])


@pytest.mark.parametrize("kind", ["ngram", "draft", "tree", "medusa", "eagle1_chain", "eagle2_tree", "eagle3_tree"])
def test_finished_rows_stop_costing_compute(kind):
    """Target and drafter forwards shrink with the live rows, and the drafter's per-row state survives the
    compactions: the output equals HF's greedy decoding of each prompt and the drafts keep being accepted (a row
    handed another row's draft state would accept next to nothing)."""
    m, drafter, prompts = case(kind)
    refs = [hf_greedy(m, p, NEW) for p in prompts]
    eos = pick_eos(refs)
    tl = Timeline(m, drafter, draft_module(drafter))
    try:
        outs, stats = generate(m, drafter, prompts, max_new_tokens=NEW, eos_token_id=eos)
    finally:
        tl.close()
    assert [o[len(p):].tolist() for p, o in zip(prompts, outs)] == [cut(r, eos) for r in refs]
    tl.check_live_rows_only(len(prompts))
    if draft_module(drafter) is not None:
        drafts = [e[1] for e in tl.events if e[0] == "draft"]
        assert min(drafts) < len(prompts) and drafts == sorted(drafts, reverse=True), drafts  # the drafter shrinks
    assert stats.mean_accepted_length > 1.2 and stats.retirements >= 1
    assert min(tl.target_batches()[1:]) < len(prompts)
    assert stats.row_steps == sum(tl.target_batches()[1:])  # row_steps counts live rows only


# ---------------------------------------------------------------------------------------------------------------
# A third-party drafter without the whole protocol.


class NoRetireDrafter:
    """Prompt lookup over the host context, with begin / propose / observe but no way to add or retire rows."""

    max_nodes = 5
    max_depth = 4
    hidden_state_layers = ()
    forwards = 0
    defers_prefill = False
    serves_row_subsets = True

    def begin(self, target, state, prefill_hidden_states=None):
        raise AssertionError("never reached: the drafter is refused before the generation starts")

    def propose(self, state, max_depth, max_nodes):
        chains = [ngram_lookup(ctx, 3, min(4, max_depth, max_nodes - 1)) for ctx in state.host_tokens]
        return pad_chains(chains, [ctx[-1] for ctx in state.host_tokens], state.device)

    def observe(self, state, tree, result):
        pass


def test_drafter_without_add_rows_or_retire_is_refused_naming_them():
    """Rows join and leave every batch, so add_rows and retire are required: a drafter without them is a ValueError
    naming what is missing, before anything runs."""
    m = greedy_t.target("llama")
    prompts = [greedy_t.prompt_of(n, 40 + n) for n in (7, 1, 12)]
    with pytest.raises(ValueError, match=r"generate: drafter must be a drafter .*got NoRetireDrafter without "
                                         r"add_rows, retire$"):
        generate(m, NoRetireDrafter(), prompts, max_new_tokens=NEW, eos_token_id=[])
    drafter = NoRetireDrafter()
    drafter.add_rows = lambda target, rows, prefill_hidden_states=None: None
    with pytest.raises(ValueError, match=r"without retire$"):
        generate(m, drafter, prompts, max_new_tokens=NEW, eos_token_id=[])


# ---------------------------------------------------------------------------------------------------------------
# Sampling: lossless for rows that share the batch with rows retiring early.

EOS = 0
FILLER = [6, 6, 6]  # the target's first token after it is EOS (0) with probability ~0.45


@torch.no_grad()
def exact_with_eos(model, T: float):
    """Distribution of (t1, t2) and of t3 after PROMPT, where a sequence ends after EOS and the output is padded
    with EOS: cell (EOS, EOS) of the pair holds p(t1 = EOS), and t3 = EOS also counts every earlier end."""
    V, P = sampling_t.V, sampling_t.PROMPT

    def probs(seqs):
        logits = model(seqs).logits[:, -1].float()
        w = torch.stack([filtered_weights(row, T, 0, 1.0) for row in logits]).double()
        return w / w.sum(-1, keepdim=True)

    p1 = probs(torch.tensor([P]))[0]
    t = torch.arange(V)
    p2 = probs(torch.cat([torch.tensor(P).expand(V, -1), t[:, None]], 1))
    joint = p1[:, None] * p2
    joint[EOS] = 0
    joint[EOS, EOS] = p1[EOS]
    pairs = torch.cartesian_prod(t, t)
    p3 = probs(torch.cat([torch.tensor(P).expand(V * V, -1), pairs], 1)).reshape(V, V, V)
    going = torch.ones(V, V, dtype=torch.bool)
    going[EOS, :] = False
    going[:, EOS] = False
    third = (joint[:, :, None] * p3 * going[:, :, None]).sum((0, 1))
    third[EOS] += float(joint[~going].sum())
    return joint, third


def test_sampling_is_lossless_while_rows_retire():
    tgt, draft = sampling_t.tiny(21), sampling_t.tiny(21, noise=0.3)
    V, P = sampling_t.V, sampling_t.PROMPT
    joint, third = exact_with_eos(tgt, 1.0)
    tested, filler = 4000, 2000
    prompts = [P if i % 3 else FILLER for i in range(tested + filler)]  # every third row a filler
    drafter = DraftModelDrafter(draft, num_draft_tokens=3)
    tl = Timeline(tgt, drafter)
    try:
        outs, stats = generate(tgt, drafter, prompts, max_new_tokens=3, eos_token_id=EOS, temperature=1.0,
                               generator=torch.Generator().manual_seed(11))
    finally:
        tl.close()
    rows = [o[len(p):] for p, o in zip(prompts, outs)]
    new = torch.stack([torch.cat([r, torch.full((3 - len(r),), EOS)]) for i, r in enumerate(rows) if i % 3])
    assert new.shape == (tested, 3)
    p_pair = sampling_t.chi_square_p(torch.bincount(new[:, 0] * V + new[:, 1], minlength=V * V), joint)
    p_third = sampling_t.chi_square_p(torch.bincount(new[:, 2], minlength=V), third)
    assert p_pair > 1e-3 and p_third > 1e-3, (p_pair, p_third)
    # the batch really shrank under the tested rows: many fillers ended at their first token
    ended_first = sum(1 for i, r in enumerate(rows) if i % 3 == 0 and len(r) == 1)
    assert ended_first > filler // 4
    batches = tl.target_batches()
    assert stats.retirements >= 1 and batches[2] < batches[1] == tested + filler
    tl.check_live_rows_only(tested + filler)
    assert sum(stats.accept_hist[1:]) > tested // 10 and stats.accept_hist[0] > 0  # drafts accepted and rejected


# ---------------------------------------------------------------------------------------------------------------
# Unit checks of the compaction.


def test_tree_kv_cache_keep_rows():
    m = greedy_t.target("llama")
    cache = TreeKVCache(m.config, 4, 16)
    gen = torch.Generator().manual_seed(0)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen))
    cache.rewind(torch.tensor([3, 5, 7, 9]))
    before = cache.storage.clone()
    cache.keep_rows(torch.tensor([1, 3]))
    assert cache.batch_size == 2 and cache.lengths.tolist() == [5, 9]
    assert torch.equal(cache.storage, before[:, :, [1, 3]])
    for l, layer in enumerate(cache.layers):  # the layers see the new storage and lengths
        assert layer.keys.data_ptr() == cache.storage[l, 0].data_ptr() and layer.batch_size == 2
        assert layer.lengths.tolist() == [5, 9]
    k = torch.ones(2, before.shape[3], 1, before.shape[5])
    cache.layers[0].update(k, 2 * k)
    assert cache.storage[0, 0, 0, :, 5].eq(1).all() and cache.storage[0, 1, 1, :, 9].eq(2).all()
    assert cache.layers[1].lengths.tolist() == [5, 9] and cache.layers[0].lengths.tolist() == [6, 10]
    with pytest.raises(ValueError, match=r"must be distinct and in \[0, 2\)"):
        cache.keep_rows(torch.tensor([2]))
    with pytest.raises(ValueError, match="must be distinct"):
        cache.keep_rows(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="1-D tensor"):
        cache.keep_rows(torch.tensor([[0]], dtype=torch.int64))
    # any order, in place: the loop's order [0, 5, 2, 3, 4] (row 1 finished) moves row 5 alone; a reversed one moves
    # rows across each other; the storage is never reallocated
    big = TreeKVCache(m.config, 6, 8)
    big.storage.copy_(torch.randn(big.storage.shape, generator=gen))
    big.rewind(torch.arange(1, 7))
    ptr, before = big.storage.data_ptr(), big.storage.clone()
    for keep in ([0, 5, 2, 3, 4], [4, 3, 1, 0], [2, 0]):
        big.keep_rows(torch.tensor(keep))
        before = before[:, :, keep]
        assert torch.equal(big.storage, before) and big.storage.data_ptr() == ptr
    assert big.lengths.tolist() == [6, 5] and big.batch_size == 2  # rows 5 and 4 of the first six


def test_decode_state_keep_rows():
    buf = torch.arange(12).reshape(3, 4)
    state = DecodeState(tokens=buf, lengths=torch.tensor([2, 3, 4]), host_tokens=[[0, 1], [4, 5, 6], [8, 9, 10, 11]],
                        prompt_lens=[1, 2, 3], done=[False, True, False], max_len=4,
                        sampling=SamplingParams.greedy_rows_of(3), generators=[None] * 3, vocab_size=16)
    state.keep_rows(torch.tensor([0, 2]))
    assert state.tokens.tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]] and state.lengths.tolist() == [2, 4]
    assert state.host_tokens == [[0, 1], [8, 9, 10, 11]] and state.prompt_lens == [1, 3]
    assert state.done == [False, False] and state.batch_size == 2
    assert state.last_tokens.tolist() == [1, 11]
