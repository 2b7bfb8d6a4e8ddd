"""specdec_ext.Engine: requests join and leave a running batch between steps, and everything stays exact.

* Every drafter (plain, n-gram, draft model chain and top-2 tree, Medusa, EAGLE-1 chain, EAGLE-2 / EAGLE-3 trees):
  requests of different lengths and budgets arrive at different steps into an engine of fewer rows than requests
  (a queue longer than the batch), some with a stop token that they emit early (inside an accepted run): each
  request's tokens equal Hugging Face's greedy decoding of its prompt alone, cut at its stop token or budget.
* A seeded sampled request gives the same tokens alone and beside other (greedy and sampled) requests.
* Abort: a running request leaves before the next step's work and its row goes to the next queued request; a
  queued one never runs. Both are reported once, with reason "abort".
* Stop strings spanning token boundaries (a word-level tokenizer over the tiny vocabulary): the request ends with
  "stop" at the token that completes the string.
* Bad input: a ValueError naming the argument.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import test_generate_batch as batch_t  # noqa: E402
import test_generate_greedy as greedy_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from test_hf_tree_attention import V  # noqa: E402

from specdec_ext import Engine, RequestSettings  # noqa: E402
from specdec_ext.engine import TokenStream  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 16


def staggered(prompts: list[list[int]], budgets: list[int], first: int) -> dict[int, list[tuple]]:
    """:func:`run`'s arrivals: the first ``first`` requests before step 0, then one before each step, each request
    ``(its index, its prompt, greedy RequestSettings of its budget)``."""
    arrivals: dict[int, list[tuple]] = {}
    for b, p in enumerate(prompts):
        arrivals.setdefault(max(0, b - first + 1), []).append((b, p, RequestSettings(max_new_tokens=budgets[b])))
    return arrivals


def run(engine: Engine, arrivals: dict[int, list[tuple]]) -> tuple[dict, dict, dict]:
    """Steps ``engine``; before step s, adds the requests ``arrivals[s]`` (``(key, prompt, settings)``). Returns
    each key's tokens, finish reason and the events' order check (one event per request and step, the last one
    with the reason)."""
    tokens, reasons, ids = {}, {}, {}
    s = 0
    while s <= max(arrivals) or engine.has_unfinished():
        for key, prompt, settings in arrivals.get(s, []):
            ids[engine.add_request(prompt, settings)] = key
        for rid, new, reason in engine.step():
            key = ids[rid]
            assert key not in reasons, (key, "event after its finish")
            tokens.setdefault(key, []).extend(new)
            if reason is not None:
                reasons[key] = reason
        s += 1
        assert s < 500
    return tokens, reasons, ids


@pytest.mark.parametrize("kind", batch_t.KINDS)
def test_requests_joining_and_leaving_equal_decoding_alone(kind):
    m, drafter, prompts = batch_t.case(kind)
    refs = [hf_greedy(m, p, NEW) for p in prompts]
    budgets = [NEW - 3 * (b % 4) for b in range(len(prompts))]
    stops = {b: refs[b][4] for b in range(0, len(prompts), 3) if refs[b][4] not in refs[b][:4]}  # early stops
    want = {}
    for b, r in enumerate(refs):
        w = r[: budgets[b]]
        if b in stops:
            w = w[: w.index(stops[b]) + 1]
        want[b] = w
    arrivals = {}
    for b, p in enumerate(prompts):  # four at the start (one queued), then one a step
        s = 0 if b < 4 else b - 3
        arrivals.setdefault(s, []).append((b, p, RequestSettings(max_new_tokens=budgets[b],
                                                                 stop_token_ids=(stops[b],) if b in stops else ())))
    with Engine(m, drafter, max_batch=3, max_len=128, eos_token_id=[]) as engine:
        tokens, reasons, _ = run(engine, arrivals)
        stats = engine.stats
    for b in range(len(prompts)):
        assert tokens[b] == want[b], (kind, b)
        assert reasons[b] == ("stop" if b in stops and len(want[b]) <= budgets[b] and want[b][-1] == stops[b]
                              else "length"), (kind, b)
    assert stats.batch_size == 3 and stats.joins >= 3 and stats.retirements >= 3
    assert stats.new_tokens == sum(len(w) for w in want.values())
    if drafter is not None:
        assert stats.mean_accepted_length > 1.2, stats.mean_accepted_length
    assert not engine.requests and engine.state is None  # everything left


@pytest.mark.parametrize("kind", ["plain", "draft", "medusa", "eagle2_tree"])
def test_a_long_prompt_joining_short_ones_is_prefilled_apart(kind, monkeypatch):
    """One join, a prefill forward per group (the long prompt alone; PREFILL_SMALL lowered so that the tiny prompts
    count), the drafter given every group's rows; each request decodes as it does alone."""
    import specdec_ext.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "PREFILL_SMALL", 0)
    m, drafter, prompts = batch_t.case(kind)
    long = [t for p in prompts for t in p][:40]
    prompts = [long, *[p for p in prompts if len(p) < 10]]  # the long one arrives first
    assert len(prompts) >= 3
    refs = [hf_greedy(m, p, NEW) for p in prompts]
    with Engine(m, drafter, max_batch=len(prompts), eos_token_id=[]) as e:
        tokens = run(e, {0: [(i, p, RequestSettings(max_new_tokens=NEW)) for i, p in enumerate(prompts)]})[0]
        T = [len(p) - 1 for p in prompts]
        forwards = sum(max(T[i] for i in g) > 0 for g in scheduler.prefill_groups(T))  # (1-token prompts: none)
        assert e.stats.joins == 1 and e.stats.prefill_forwards == forwards >= 2
    assert [tokens[i] for i in range(len(prompts))] == [r[:NEW] for r in refs]


def test_seeded_sampled_request_is_independent_of_its_batch():
    m = greedy_t.target("llama")
    prompt = greedy_t.prompt_of(9, 3)
    sampled = RequestSettings(max_new_tokens=NEW, temperature=0.9, top_k=20, seed=1234)

    def alone():
        with Engine(m, max_batch=4, max_len=64, eos_token_id=[]) as e:
            return run(e, {0: [("x", prompt, sampled)]})[0]["x"]

    first = alone()
    assert first == alone()
    others = {0: [("g", greedy_t.prompt_of(5, 1), RequestSettings(max_new_tokens=NEW)),
                  ("s", greedy_t.prompt_of(12, 2), RequestSettings(max_new_tokens=5, temperature=1.0, seed=7))],
              2: [("x", prompt, sampled)],
              4: [("t", greedy_t.prompt_of(3, 4), RequestSettings(max_new_tokens=NEW, temperature=0.5))]}
    with Engine(m, max_batch=4, max_len=64, eos_token_id=[]) as e:
        tokens = run(e, others)[0]
    assert tokens["x"] == first
    assert tokens["g"] == hf_greedy(m, greedy_t.prompt_of(5, 1), NEW)  # the greedy row beside sampled rows


def test_the_decode_state_carries_each_rows_budget_left():
    """``DecodeState.budgets`` (what the adaptive drafter spreads its catch-up over) is each running request's
    budget left after every step, through joins and departures."""
    m = greedy_t.target("llama")
    with Engine(m, max_batch=3, max_len=64, eos_token_id=[]) as e:
        ids = [e.add_request(greedy_t.prompt_of(4 + i, i), RequestSettings(max_new_tokens=n))
               for i, n in enumerate((3, 9, 6, 5))]  # the fourth waits for a row
        emitted = dict.fromkeys(ids, 0)
        budget = dict(zip(ids, (3, 9, 6, 5)))
        while e.has_unfinished():
            for rid, new, _ in e.step():
                emitted[rid] += len(new)
            if e.state is not None:
                running = [r.id for r in e.scheduler.running]
                assert e.state.budgets == [budget[r] - emitted[r] for r in running]
        assert emitted == budget


def test_abort_frees_the_row_for_the_next_queued_request():
    m = greedy_t.target("llama")
    prompts = [greedy_t.prompt_of(n, n) for n in (4, 6, 8, 5)]
    with Engine(m, max_batch=2, max_len=64, eos_token_id=[]) as e:
        a, b, c, d = (e.add_request(p, max_new_tokens=NEW) for p in prompts)
        e.step()
        e.step()
        assert [r.id for r in e.scheduler.running] == [a, b]
        e.abort(a)
        e.abort(d)  # still queued
        events = e.step()
        assert (a, [], "abort") in events and (d, [], "abort") in events
        assert [r.id for r in e.scheduler.running] == [b, c]  # c joined before this step's work
        assert {rid for rid, new, _ in events if new} == {b, c}
        e.abort(a)  # finished already: nothing to do
        tokens, reasons = {}, {}
        while e.has_unfinished():
            for rid, new, reason in e.step():
                assert rid in (b, c)
                tokens.setdefault(rid, []).extend(new)
                reasons[rid] = reason
        assert reasons == {b: "length", c: "length"}
    assert tokens[c][-3:] == hf_greedy(m, prompts[2], NEW)[-3:]
    assert len(tokens[c]) == NEW - 1  # (its first token came in the abort's step)


def word_tokenizer():
    pytest.importorskip("tokenizers")
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab={f"w{i}": i for i in range(V)},
                                                               unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_stop_string_across_token_boundaries(kind):
    m = greedy_t.target("llama")
    tok = word_tokenizer()
    prompt = greedy_t.prompt_of(8, 5)
    ref = hf_greedy(m, prompt, NEW)
    text = tok.decode(ref)
    words = text.split(" ")
    start = len(" ".join(words[:3])) + 2  # inside word 3 ...
    stop = text[start: start + len(words[3]) + 1]  # ... to the space before word 4
    assert len(stop) >= 2 and stop in text
    cut = text.index(stop)
    n = len(tok.decode(ref[:3]).split(" ")) + 1  # tokens up to the one that completes the stop string
    while stop not in tok.decode(ref[:n]):
        n += 1
    with Engine(m, greedy_t.make_drafter(kind, m), max_batch=2, max_len=64, eos_token_id=[], tokenizer=tok) as e:
        rid = e.add_request(prompt, max_new_tokens=NEW, stop=[stop, "w999"])
        other = e.add_request(prompt, max_new_tokens=NEW)  # the same tokens, no stop string
        out, pieces, reasons = {}, {}, {}
        while e.has_unfinished():
            for r, new, reason in e.step():
                out.setdefault(r, []).extend(new)
                pieces.setdefault(r, []).append(e.take_text(r))
                reasons[r] = reason
        with pytest.raises(ValueError, match="take_text: request_id 0 is neither unfinished"):
            e.take_text(rid)  # (ended two steps ago)
    assert reasons == {rid: "stop", other: "length"}
    assert out[rid] == ref[:n] and out[other] == ref
    assert "".join(pieces[rid]) == " " + text[:cut]  # (the prompt's last word before it: a space)
    assert "".join(pieces[other]) == " " + text
    # text handed out is never taken back: every step's text so far is a prefix of the final text
    assert all((" " + text[:cut]).startswith("".join(pieces[rid][:i])) for i in range(len(pieces[rid])))
    assert sum(1 for p in pieces[rid] if p) > 1  # (the text came over several steps)


def test_take_text_needs_a_tokenizer_and_reports_an_abort():
    m = greedy_t.target("llama")
    with pytest.raises(ValueError, match="Engine: tokenizer must have a decode"):
        Engine(m, max_len=64, tokenizer=object())
    with Engine(m, max_batch=2, max_len=64, eos_token_id=[]) as e:
        rid = e.add_request(greedy_t.prompt_of(6, 1), max_new_tokens=4)
        e.step()
        with pytest.raises(ValueError, match="the engine has no tokenizer"):
            e.take_text(rid)
    tok = word_tokenizer()
    with Engine(m, max_batch=2, max_len=64, eos_token_id=[], tokenizer=tok) as e:
        rid = e.add_request(greedy_t.prompt_of(6, 1), max_new_tokens=8)
        (_, first, _), = e.step()
        seen = e.take_text(rid)
        e.abort(rid)
        assert e.step() == [(rid, [], "abort")]
        assert seen == " " + tok.decode(first) and e.take_text(rid) == ""  # (nothing was held back)
        with pytest.raises(ValueError, match="take_text: request_id 7"):
            e.take_text(7)


def test_bad_input_names_the_argument():
    m = greedy_t.target("llama")
    with pytest.raises(ValueError, match="max_batch"):
        Engine(m, max_batch=0, max_len=64)
    with pytest.raises(ValueError, match="max_len"):
        Engine(m, max_len=1)
    with pytest.raises(ValueError, match="drafter"):
        Engine(m, object(), max_len=64)
    with Engine(m, max_batch=2, max_len=32, eos_token_id=[]) as e:
        with pytest.raises(ValueError, match="prompt_ids is empty"):
            e.add_request([])
        with pytest.raises(ValueError, match="prompt_ids"):
            e.add_request(torch.ones(2, 3, dtype=torch.int64))
        with pytest.raises(ValueError, match="vocabulary"):
            e.add_request([1, V])
        with pytest.raises(ValueError, match="max_len = 32"):
            e.add_request(list(range(1, 30)), max_new_tokens=4)
        with pytest.raises(ValueError, match="temperature"):
            e.add_request([1, 2], temperature=-1)
        with pytest.raises(ValueError, match="tokenizer"):
            e.add_request([1, 2], max_new_tokens=4, stop=["x"])
        with pytest.raises(ValueError, match="request_id"):
            e.abort(0)
        with pytest.raises(ValueError, match="request_id"):
            TokenStream(e, 5)
        assert not e.has_unfinished() and e.step() == []
