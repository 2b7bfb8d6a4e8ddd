"""The draft-model drafter's catch-up after deferred prefills, with rows that joined at different times.

An :class:`~specdec_ext.adaptive.AdaptiveDrafter` asks its inner drafter to defer the prefill of rows that join
a batch decoding plainly and skips the draft's forwards on plain steps; the first speculative step then catches every row up on what its draft
cache lacks: the whole prompt for a row that just joined, a few tokens for a row that was drafting. Each row must
write its own lag only. The engine here gets exactly the positions its requests need (prompt + budget + the tree,
no slack), so that an up-to-date row writing another row's lag after its context overflows the draft cache. Every
request must equal Hugging Face's greedy decoding of it alone, and (the draft models' chains) every chain proposed
must be what the draft's own Hugging Face forward over the row's context gives: a catch-up that read its logits at
the wrong position would still decode exactly, only slower.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import test_generate_batch as batch_t  # noqa: E402
import test_generate_greedy as greedy_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from test_drafter_parallel import parallel_chain, parallel_copy  # noqa: E402

from specdec_ext import AdaptiveDrafter, Engine, RequestSettings  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, ParallelDraftDrafter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (prompt length, budget) of four requests. The first drafts alone until its context is long, then after a plain step
# the second (a long prompt) and third join; a plain step follows, then speculative ones: lags of ~3, ~30 and ~17 tokens at one
# catch-up, where writing the longest lag after the first row's context would overflow its draft cache (the second
# row's prompt exceeds the first row's remaining budget by more than the tree). The fourth joins into another plain
# stretch.
REQUESTS = [(6, 30), (28, 6), (15, 10), (9, 12)]


def _drafter(kind: str, model):
    if kind == "chain_ops":  # the CPU's op calls where they apply
        return DraftModelDrafter(greedy_t.perturbed_copy(model), num_draft_tokens=4)
    if kind == "chain_hf":  # the Hugging Face forward throughout
        return DraftModelDrafter(greedy_t.perturbed_copy(model), num_draft_tokens=4, packed_linears=False)
    if kind == "parallel":  # a parallel draft: the catch-up forward carries the mask tokens after each row's lag
        return ParallelDraftDrafter(parallel_copy(model))
    if kind == "tree":
        return greedy_t.make_drafter("tree", model)
    if kind == "dynamic":
        return greedy_t.make_drafter("dynamic", model)
    return batch_t.case(kind)[1]


def _reference_chain(draft, context: list[int], k: int, vocab: int) -> list[int]:
    """The chain of k drafts after ``context`` by the draft's own Hugging Face forward: its greedy continuation, or
    (a parallel draft) the argmax at the context's last position and at each of k - 1 mask tokens after it."""
    if getattr(draft.config, "pard_token", None) is not None:
        return parallel_chain(draft, context, k, vocab)
    with torch.no_grad():
        chain = []
        for _ in range(k):
            chain.append(int(draft(input_ids=torch.tensor([context + chain])).logits[0, -1, :vocab].argmax()))
        return chain


def _record_catch_ups(drafter, chains: bool, vocab: int) -> list:
    """Wraps ``drafter.propose`` to record, at each speculative call, every row's lag (context tokens its draft
    cache lacks), the longest row's valid prefix and the draft cache's positions; with ``chains``, checks each
    row's proposed chain against :func:`_reference_chain`."""
    seen: list = []
    propose = drafter.propose

    def spy(state, max_depth, max_nodes):
        lags = [len(t) - v for t, v in zip(state.host_tokens, drafter.valid)]
        tree = propose(state, max_depth, max_nodes)
        if max_depth > 0:
            seen.append((lags, max(drafter.valid), drafter.cache.max_len))
        k = tree.tokens.shape[1] - 1
        if chains and k > 0:
            for b, ctx in enumerate(state.host_tokens):
                assert tree.tokens[b, 1:].tolist() == _reference_chain(drafter.model, list(ctx), k, vocab), (b, lags)
        return tree
    drafter.propose = spy
    return seen


@pytest.mark.parametrize("kind", ["chain_ops", "chain_hf", "parallel", "tree", "dynamic", "eagle2_tree"])
def test_rows_catch_up_on_their_own_lag_in_an_exactly_sized_engine(kind):
    if kind.startswith("eagle"):
        m, _, _ = batch_t.case(kind)
    else:
        m = greedy_t.target("llama")
    inner = _drafter(kind, m)
    prompts = [greedy_t.prompt_of(n, 70 + n) for n, _ in REQUESTS]
    budgets = [b for _, b in REQUESTS]
    max_len = max(len(p) + b for p, b in zip(prompts, budgets)) + inner.max_nodes  # no slack
    ad = AdaptiveDrafter(inner)
    assert ad.defers_prefill
    ad._plain_leads = lambda B: False  # (every row joins the inner drafter: its catch-ups are the point here)
    catch_ups = _record_catch_ups(inner, kind in ("chain_ops", "chain_hf", "parallel"), m.config.vocab_size)
    tokens, ids = {}, {}
    with Engine(m, ad, max_batch=4, max_len=max_len, eos_token_id=[]) as engine:
        def add(*keys):
            for key in keys:
                ids[engine.add_request(prompts[key], RequestSettings(max_new_tokens=budgets[key]))] = key

        def step(mode: str, times: int = 1):  # speculative ("fixed": the drafter's whole depth) or plain ("off")
            ad.choose = (lambda B, max_depth, budgets=None: (min(ad.max_depth, max_depth), False)) \
                if mode == "fixed" else (lambda B, max_depth, budgets=None: (0, False))
            for _ in range(times):
                for rid, new, _ in engine.step():
                    tokens.setdefault(ids[rid], []).extend(new)
                assert ad.steps_total < 100

        add(0)
        while len(tokens.get(0, [])) < 19:
            step("fixed")
        step("off", 4)  # (rows are deferred only into a batch settled on plain steps: four in a row)
        add(1, 2)
        step("off")
        step("fixed", 3)
        step("off", 4)
        add(3)
        step("off", 2)
        while engine.has_unfinished():
            step("fixed")
    for key, p in enumerate(prompts):
        assert tokens[key] == hf_greedy(m, p, budgets[key]), (kind, key)
    assert 0 in ad.history and max(ad.history) > 0, ad.history
    # not vacuous: a catch-up where rows lagged differently and (the draft model's cache) the longest lag written
    # after the longest valid prefix would not have fit
    assert any(len(set(lags)) > 1 and (kind.startswith("eagle") or valid + max(lags) > positions)
               for lags, valid, positions in catch_ups), catch_ups
