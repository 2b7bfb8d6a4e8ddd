"""The parallel draft (PARD) drafter and its training batches.

Checked against independent references:
- every chain the drafter proposes is the argmax, at each position, of the draft model's own Hugging Face forward over
  the row's whole context followed by ``k - 1`` mask tokens (no cache), for rows of different lengths in one batch,
  across steps (the catch-up), on the CPU's op calls and on the Hugging Face forward;
- greedy output equals Hugging Face's ``generate`` for chains and dynamic trees, on two architectures, with one draft
  forward per speculative step;
- the COD batch equals a brute-force construction from its definition (entries, positions, sources, attention), and
  the model's logits on it equal each entry's own forward over its visible tokens;
- train_draft_lm(parallel=K) records the mask token, loss falls, and the trained draft accepts more than the draft
  it started from; the command line trains, saves and decodes one.
(Sampling: test_generate_sampling's chi-square test covers the chain and the tree; rows joining and leaving:
test_drafter_draft_model_catchup.)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import test_generate_greedy as greedy_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402

from specdec_ext.drafters import ParallelDraftDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.train.parallel_batch import parallel_batch, retention_rates  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def parallel_copy(model, k: int = 4, scale: float = 1e-3):
    """A perturbed copy of ``model`` with one more vocabulary row, recorded as the mask token (an untrained
    parallel draft: its first position is a good draft, the masks' are what they are)."""
    d = greedy_t.perturbed_copy(model, scale=scale)
    V = d.config.vocab_size
    d.resize_token_embeddings(V + 1, mean_resizing=False)
    d.config.pard_token, d.config.pard_num_tokens = V, k
    return d


def parallel_chain(draft, context: list[int], k: int, vocab: int) -> list[int]:
    """The parallel draft's chain after ``context`` by its own Hugging Face forward: the argmax (over the target's
    ``vocab`` ids) at the context's last position and at each of k - 1 mask tokens after it."""
    with torch.no_grad():
        logits = draft(input_ids=torch.tensor([context + [draft.config.pard_token] * (k - 1)])).logits
    return logits[0, len(context) - 1:, :vocab].argmax(-1).tolist()


def record_proposals(drafter):
    seen = []
    propose = drafter.propose

    def spy(state, max_depth, max_nodes):
        tree = propose(state, max_depth, max_nodes)
        seen.append(([list(t) for t in state.host_tokens], tree.tokens.clone()))
        return tree
    drafter.propose = spy
    return seen


@pytest.mark.parametrize("packed", [True, False])
def test_chains_are_the_argmax_of_a_forward_over_context_and_masks(packed):
    model = greedy_t.target("llama")
    draft = parallel_copy(model)
    drafter = ParallelDraftDrafter(draft, packed_linears=packed)
    seen = record_proposals(drafter)
    prompts = [greedy_t.prompt_of(n, 40 + n) for n in (3, 9, 14)]
    generate(model, drafter, [torch.tensor(p) for p in prompts], max_new_tokens=12, eos_token_id=[])
    assert len(seen) >= 3
    assert max(tokens.shape[1] for _, tokens in seen) == 5  # full chains (shorter ones: the budget's end)
    for contexts, tokens in seen:
        k = tokens.shape[1] - 1
        if k == 0:  # a plain step (no room left for drafts)
            continue
        for b, ctx in enumerate(contexts):
            assert tokens[b, 0].item() == ctx[-1]
            assert tokens[b, 1:].tolist() == parallel_chain(draft, ctx, k, model.config.vocab_size), (b, len(ctx))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("shape", [{}, {"tree_width": 2, "total_tokens": 6}])
def test_greedy_equals_hf_generate_with_one_draft_forward_a_step(family, shape):
    model = greedy_t.target(family)
    drafter = ParallelDraftDrafter(parallel_copy(model), **shape)
    seen = record_proposals(drafter)
    accepted = []
    for plen, max_new, seed in [(1, 9, 0), (6, 1, 1), (11, 24, 2), (4, 13, 3)]:
        prompt = greedy_t.prompt_of(plen, seed)
        seen.clear()
        got, stats = greedy_t.run_and_check(model, drafter, prompt, max_new)
        assert got == hf_greedy(model, prompt, max_new), (plen, max_new, seed)
        # one forward a speculative step (prompts of more than one token: one more, the prefill of the draft cache)
        speculative = sum(tokens.shape[1] > 1 for _, tokens in seen)
        assert drafter.forwards == speculative + (1 if plen > 1 else 0) and speculative >= stats.steps - 1
        accepted.append(stats.mean_accepted_length)
    assert max(accepted) > 1.5, accepted  # drafts beyond the first position were accepted


def test_mixed_batch_of_greedy_and_seeded_rows_keeps_greedy_rows_exact():
    from specdec_ext import Engine, RequestSettings

    model = greedy_t.target("llama")
    prompts = [greedy_t.prompt_of(n, 60 + n) for n in (5, 8)]
    with Engine(model, ParallelDraftDrafter(parallel_copy(model)), max_batch=2, eos_token_id=[]) as engine:
        greedy = engine.add_request(prompts[0], RequestSettings(max_new_tokens=14))
        engine.add_request(prompts[1], RequestSettings(max_new_tokens=14, temperature=0.9, seed=3))
        out: dict = {}
        while engine.has_unfinished():
            for rid, toks, _ in engine.step():
                out.setdefault(rid, []).extend(toks)
    assert out[greedy] == hf_greedy(model, prompts[0], 14)


def test_bad_arguments_name_what_is_wrong():
    model = greedy_t.target("llama")
    plain_copy = greedy_t.perturbed_copy(model)
    with pytest.raises(ValueError, match="records no pard_token"):
        ParallelDraftDrafter(plain_copy)
    draft = parallel_copy(model)
    with pytest.raises(ValueError, match="tree_width = 2 needs total_tokens"):
        ParallelDraftDrafter(draft, tree_width=2)
    with pytest.raises(ValueError, match=r"mask_token_id must be an id of the draft's vocabulary \[0, "):
        ParallelDraftDrafter(draft, mask_token_id=draft.config.vocab_size)
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1"):
        ParallelDraftDrafter(draft, num_draft_tokens=0)
    with pytest.raises(ValueError, match="mask_token_id 3 is a target token"):
        generate(model, ParallelDraftDrafter(draft, mask_token_id=3), torch.tensor([3, 4, 5]), max_new_tokens=2)
    other = greedy_t.target("qwen3")
    if other.config.vocab_size != model.config.vocab_size:
        with pytest.raises(ValueError, match="the draft's vocabulary"):
            generate(other, ParallelDraftDrafter(draft), torch.tensor([3, 4, 5]), max_new_tokens=2)


def _brute_force_batch(toks, n, K, mask_id, u, rates):
    """Entries of one row built straight from the definition: each real position, then for each anchor its masks
    1 .. J (J: the rates above the anchor's uniform, at most what stays inside the window)."""
    entries = [(toks[i], i, i, 0) for i in range(n)]  # (id, position, anchor, level)
    for a in range(n):
        J = min(sum(1 for r in rates if u[a] < r), max(n - 2 - a, 0))
        entries += [(mask_id, a + j, a, j) for j in range(1, J + 1)]
    S = len(entries)
    attn = torch.zeros(S, S, dtype=torch.bool)
    for e, (_, pe, ae, le) in enumerate(entries):
        for f, (_, pf, af, lf) in enumerate(entries):
            attn[e, f] = (lf == 0 and pf <= ae) or (lf > 0 and af == ae and lf <= le)
    source = [p if p + 1 < n else -1 for _, p, _, _ in entries]
    return entries, attn, source


def test_cod_batch_equals_its_definition_and_each_entry_sees_what_inference_shows():
    g = torch.Generator().manual_seed(5)
    model = parallel_copy(greedy_t.target("llama"))
    mask_id, K = model.config.pard_token, 5
    toks = torch.randint(3, 60, (3, 12), generator=g)
    valid = torch.ones(3, 12, dtype=torch.bool)
    valid[1, 9:] = False
    valid[2, 4:] = False
    rates = retention_rates(K, 0.6, 0.2).tolist()
    pb = parallel_batch(toks, valid, K, mask_id, 0.6, 0.2, generator=torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(9)  # the same uniforms, row by row
    for b in range(3):
        n = int(valid[b].sum())
        u = torch.rand(n, generator=gen).tolist()
        entries, attn, source = _brute_force_batch(toks[b].tolist(), n, K, mask_id, u, rates)
        S = len(entries)
        assert pb.input_ids[b, :S].tolist() == [e[0] for e in entries]
        assert pb.position_ids[b, :S].tolist() == [e[1] for e in entries]
        assert pb.source[b, :S].tolist() == source and (pb.source[b, S:] == -1).all()
        assert torch.equal(pb.attention[b, 0, :S, :S], attn)
        assert not pb.attention[b, 0, :S, S:].any()
    assert int((pb.input_ids == mask_id).logical_and(pb.source >= 0).sum()) > 6  # masks were kept

    # the packed forward gives every mask entry the logits of the inference forward (context + its masks)
    from specdec_ext.train.draft_lm import _additive

    with torch.no_grad():
        packed = model(input_ids=pb.input_ids, position_ids=pb.position_ids,
                       attention_mask=_additive(pb.attention, torch.float32)).logits
        checked = 0
        for b in range(3):
            n = int(valid[b].sum())  # (the first n entries are the real tokens, in order)
            for s in range(n, pb.input_ids.shape[1]):
                if pb.source[b, s] < 0:
                    continue
                anchor = int(pb.attention[b, 0, s, :n].nonzero().max())  # the last real token it sees
                j = int(pb.position_ids[b, s]) - anchor
                ids = torch.tensor([toks[b, : anchor + 1].tolist() + [mask_id] * j])
                want = model(input_ids=ids).logits[0, -1]
                torch.testing.assert_close(packed[b, s], want, atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked > 6


def test_retention_rates_and_bad_training_arguments():
    assert retention_rates(5, 0.5, 0.1).tolist() == pytest.approx([0.5, 0.25, 0.125, 0.1])
    from specdec_ext.train import TrainConfig, train_draft_lm

    model = greedy_t.target("llama")
    for kw, match in (({"parallel": 0}, "parallel must be an integer >= 1"),
                      ({"parallel": 3, "retention": 0.0}, r"retention must be a number in \(0, 1\]"),
                      ({"parallel": 3, "min_retention": 1.5}, r"min_retention must be a number in \(0, 1\]")):
        with pytest.raises(ValueError, match=match):
            train_draft_lm(model, [[3, 4, 5, 6]], TrainConfig(steps=1, progress=False), **kw)
