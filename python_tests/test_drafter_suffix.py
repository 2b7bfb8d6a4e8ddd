"""The suffix drafter (specdec_ext/drafters/suffix.py) and its index (drafters/suffix_index.py).

* Its trees against a brute-force reference written here from the module doc: the longest context suffix found by
  scanning every document and the row's own context, the continuation counts of that pattern, the estimated
  probability of a draft path = (occurrences continuing with it) / (occurrences), the most probable paths kept
  (at most ``floor(spec_factor * match)``, none below ``min_prob``); random corpora over a small vocabulary (many
  repeats), snapshots included. The occurrence cap keeps the latest ones.
* Memory: the corpus never holds more live tokens than its budget, evicts the oldest documents first, compacts the
  evicted tokens away, and a row keeps reading the corpus as it was when it joined.
* Across requests, through the engine: a request repeating an earlier one gets long drafts and accepts them.
* Exactness: greedy through generate() and the engine (rows joining and leaving, repeated prompts, inside
  AdaptiveDrafter) equals Hugging Face's greedy decoding; sampled requests follow the target's distribution
  (chi-square, test_engine_sampling's references); a seeded request's tokens do not depend on its batch, even when
  its neighbours' outputs (same prompt) enter the corpus while it runs.
* Bad arguments: a ValueError naming the argument.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

import test_engine_sampling as es  # noqa: E402
import test_generate_greedy as greedy_t  # noqa: E402
import test_generate_sampling as sampling_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402

from specdec_ext import Engine, RequestSettings  # noqa: E402
from specdec_ext.adaptive import AdaptiveDrafter  # noqa: E402
from specdec_ext.drafters import SuffixDrafter  # noqa: E402
from specdec_ext.drafters.suffix_index import SEP  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.state import DecodeState  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------------------------
# Driving the drafter by hand: rows that join, take tokens and leave.


def serve_rows(drafter: SuffixDrafter, requests: list[tuple[list[int], list[int]]]) -> None:
    """Each ``(prompt, output)`` as a row that joins alone, emits its output and leaves."""
    for prompt, output in requests:
        st = DecodeState.of_prompts([prompt], 4096, 1000)
        drafter.begin(None, st)
        st.host_tokens[0].extend(output)
        drafter.observe(st, None, None)
        drafter.retire(torch.zeros(0, dtype=torch.int64))


def paths_of(tree, b: int = 0) -> dict[tuple[int, ...], int]:
    """Row b's own nodes as token paths from the root (root excluded): {path: node}."""
    n = tree.row_nodes[b] if tree.row_nodes else tree.num_nodes
    toks, pars = tree.tokens[b, :n].tolist(), tree.parents[b, :n].tolist()
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, n):
        assert 0 <= pars[i] < i
        paths.append(paths[pars[i]] + (toks[i],))
    assert len(set(paths)) == n  # no two siblings with one token
    return {p: i for i, p in enumerate(paths) if i}


def reference_tree(docs: list[list[int]], ctx: list[int], max_pattern: int, min_match: int, spec_factor: float,
                   min_prob: float, max_nodes: int, depth: int) -> tuple[int, dict[tuple[int, ...], float]]:
    """The match length and every draft path's probability that the module doc prescribes, by scanning: the
    longest suffix of ``ctx`` found in ``docs`` or in ``ctx`` ending before its last token; each occurrence's
    continuation (to its document's end, or the context's); ``{path: share of occurrences continuing with it}``
    for every path of at most ``depth`` tokens at or above ``min_prob``, and the budget it is cut to."""
    L = len(ctx)
    for m in range(min(max_pattern, L), min_match - 1, -1):
        pat = ctx[L - m:]
        conts = [d[e + 1:] for d in docs for e in range(m - 1, len(d)) if d[e - m + 1:e + 1] == pat]
        conts += [ctx[e + 1:] for e in range(m - 1, L - 1) if ctx[e - m + 1:e + 1] == pat]
        if conts:
            break
    else:
        return 0, {}
    probs = {}
    for c in conts:
        for k in range(1, min(depth, len(c)) + 1):
            probs[tuple(c[:k])] = probs.get(tuple(c[:k]), 0) + 1
    probs = {p: n / len(conts) for p, n in probs.items() if n / len(conts) >= min_prob}
    return min(max_nodes - 1, math.floor(spec_factor * m)), probs


def check_against_reference(tree, budget: int, probs: dict, b: int = 0) -> None:
    got = paths_of(tree, b)
    assert all(p[:-1] in got or len(p) == 1 for p in got)  # a tree: every path's parent is there
    assert all(p in probs for p in got), (set(got) - set(probs))
    want = sorted(probs.values(), reverse=True)[:budget]  # the most probable paths (ties: any of them)
    assert sorted((probs[p] for p in got), reverse=True) == pytest.approx(want)


@pytest.mark.parametrize("seed", range(40))
def test_trees_equal_the_brute_force_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 3 + seed % 4  # small vocabularies: patterns repeat, trees branch
    kw = dict(max_pattern=[3, 6, 16][seed % 3], min_match=1 + seed % 2, spec_factor=[0.5, 1.0, 2.5][seed % 3],
              min_prob=[0.0, 0.1, 0.3][seed % 3], max_nodes=[4, 9, 17][(seed // 3) % 3])
    depth = [2, 5, 12][(seed // 2) % 3]
    drafter = SuffixDrafter(max_depth=depth, corpus_tokens=10 ** 6, max_occurrences=10 ** 6, **kw)
    requests, docs = [], []
    for _ in range(1 + seed % 5):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        out = torch.randint(0, vocab, (int(torch.randint(0, 20, (1,), generator=gen)),), generator=gen).tolist()
        requests.append((prompt, out))
        if out:  # (the prompt's last max_pattern tokens lead into the output)
            docs.append(prompt[max(len(prompt) - kw["max_pattern"], 0):] + out)
    serve_rows(drafter, requests)
    ctxs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 5, 17, 40)]
    st = DecodeState.of_prompts(ctxs, 128, 1000)
    drafter.begin(None, st)
    tree = drafter.propose(st, depth, drafter.max_nodes)
    assert tree.draft_probs is None and tree.tokens[:, 0].tolist() == [c[-1] for c in ctxs]
    for b, ctx in enumerate(ctxs):
        budget, probs = reference_tree(docs, ctx, depth=depth, **kw)
        check_against_reference(tree, budget, probs, b)


def test_trees_on_a_growing_context_equal_the_reference():
    """The row's own index follows its context as tokens arrive (observe), across steps."""
    gen = torch.Generator().manual_seed(7)
    drafter = SuffixDrafter(max_depth=6, max_nodes=9, spec_factor=2.0, min_prob=0.05)
    ctx = torch.randint(0, 3, (4,), generator=gen).tolist()
    st = DecodeState.of_prompts([ctx], 256, 1000)
    drafter.begin(None, st)
    grown = 0
    for _ in range(30):
        tree = drafter.propose(st, 6, drafter.max_nodes)
        budget, probs = reference_tree([], st.host_tokens[0], 16, 1, 2.0, 0.05, 9, 6)
        check_against_reference(tree, budget, probs)
        grown += len(paths_of(tree)) > 0
        st.host_tokens[0].extend(torch.randint(0, 3, (3,), generator=gen).tolist())
        drafter.observe(st, tree, None)
    assert grown > 20  # (not vacuous: most steps drafted)


def test_occurrence_cap_keeps_the_latest():
    """Five documents continue one pattern five ways; with max_occurrences=2 only the two latest are read."""
    drafter = SuffixDrafter(max_depth=3, max_nodes=9, spec_factor=4.0, min_prob=0.0, max_occurrences=2)
    serve_rows(drafter, [([1, 2, 3], [10 + i, 20 + i]) for i in range(5)])
    st = DecodeState.of_prompts([[9, 1, 2, 3]], 64, 1000)
    drafter.begin(None, st)
    got = set(paths_of(drafter.propose(st, 3, drafter.max_nodes)))
    assert got == {(13,), (13, 23), (14,), (14, 24)}


def test_no_match_is_a_plain_step_and_depth_zero_drafts_nothing():
    drafter = SuffixDrafter()
    serve_rows(drafter, [([1, 2, 3], [4, 5, 6])])
    st = DecodeState.of_prompts([[7, 8], [0, 1, 2, 3]], 64, 1000)  # no match; a 3-token match: 3 drafts
    drafter.begin(None, st)
    tree = drafter.propose(st, 8, drafter.max_nodes)
    assert tree.row_nodes == [1, 4] and list(paths_of(tree, 1)) == [(4,), (4, 5), (4, 5, 6)]
    assert drafter.propose(st, 0, drafter.max_nodes).num_nodes == 1


# ---------------------------------------------------------------------------------------------------------------
# Memory: budget, eviction order, compaction, snapshots.


def live_documents(drafter: SuffixDrafter) -> list[list[int]]:
    c = drafter.corpus
    return [[c.token(p) for p in range(s, e)] for s, e in c.docs]


def test_memory_bound_and_oldest_evicted_first():
    budget = 100
    drafter = SuffixDrafter(corpus_tokens=budget, max_pattern=4)
    added = []
    for i in range(300):
        prompt, out = [1000 + i, 2000 + i], [3000 + i] * (5 + i % 13)
        serve_rows(drafter, [(prompt, out)])
        added.append(prompt + out)
        c = drafter.corpus
        assert c.live_tokens <= budget
        live = live_documents(drafter)
        assert live == added[len(added) - len(live):]  # the newest documents, in order: the oldest went first
        assert sum(map(len, live)) + len(added[len(added) - len(live) - 1]) > budget or len(live) == len(added)
        assert len(c.tokens) <= 2 * (budget + len(live)) + 1024 + 20  # evicted tokens are compacted away
        assert all(p >= c.base for lst in c.keys.values() for p in lst)
    assert drafter.corpus.base > 0  # (compaction happened)
    # an evicted document is gone for new rows: the first request's text proposes nothing any more
    st = DecodeState.of_prompts([[1000, 2000]], 64, 10_000)
    drafter.begin(None, st)
    assert drafter.propose(st, 8, drafter.max_nodes).num_nodes == 1
    with pytest.raises(ValueError, match="corpus_tokens"):
        SuffixDrafter(corpus_tokens=-1)


def test_a_row_reads_the_corpus_as_it_joined():
    """A row that joined before a document entered does not see it; one that joined before a document was evicted
    still does (its tokens survive compaction while the row runs), and they go once it leaves."""
    drafter = SuffixDrafter(corpus_tokens=30, max_pattern=4)
    serve_rows(drafter, [([1, 2, 3], [4, 5, 6, 7])])
    st = DecodeState.of_prompts([[9, 2, 3]], 64, 10_000)
    drafter.begin(None, st)  # this row's view: the document above
    before = paths_of(drafter.propose(st, 8, drafter.max_nodes))
    assert (4, 5) in before
    for i in range(200):  # other rows come and go: the first document is evicted, then compacted for others
        rows = DecodeState.of_prompts([[500 + i, 2, 3]], 64, 10_000)
        drafter.add_rows(None, rows)
        st.append(rows)
        st.host_tokens[1].extend([600 + i] * 20)
        drafter.observe(st, None, None)
        drafter.retire(torch.tensor([0]))
        st.keep_rows(torch.tensor([0]))
    assert drafter.corpus.live_tokens <= 30 and [1, 2, 3] not in live_documents(drafter)
    assert paths_of(drafter.propose(st, 8, drafter.max_nodes)) == before  # the same view: nothing new, nothing lost
    drafter.retire(torch.zeros(0, dtype=torch.int64))
    fresh = DecodeState.of_prompts([[9, 2, 3]], 64, 10_000)
    drafter.begin(None, fresh)
    assert (4,) not in paths_of(drafter.propose(fresh, 8, drafter.max_nodes))
    assert len(drafter.corpus.tokens) < 1024 + 2 * 60  # the pinned tokens were compacted away after it left


def test_separators_bound_matches_and_continuations():
    """A match never spans two documents and a continuation stops at its document's end."""
    drafter = SuffixDrafter(max_depth=8, spec_factor=8.0, min_prob=0.0, max_pattern=4)
    serve_rows(drafter, [([5], [1, 2]), ([3], [4, 6, 6, 6])])  # corpus: 5 1 2 | 3 4 6 6 6 |
    assert drafter.corpus.tokens == [5, 1, 2, SEP, 3, 4, 6, 6, 6, SEP]
    assert (2, 3) not in drafter.corpus.keys and not any(SEP in key for key in drafter.corpus.keys)
    st = DecodeState.of_prompts([[1, 2, 3]], 64, 1000)  # "2 3" spans the separator: only "3" matches
    drafter.begin(None, st)  # its 8 drafts stop at the document's end
    assert set(paths_of(drafter.propose(st, 8, drafter.max_nodes))) == {(4,), (4, 6), (4, 6, 6), (4, 6, 6, 6)}
    st = DecodeState.of_prompts([[5, 1, 2]], 64, 1000)  # matches "5 1 2" at the end of a document: no draft
    drafter.begin(None, st)
    assert drafter.propose(st, 8, drafter.max_nodes).num_nodes == 1


# ---------------------------------------------------------------------------------------------------------------
# Across requests, through the engine.


def test_a_repeated_request_is_drafted_from_the_earlier_output():
    m = greedy_t.target("llama")
    prompt = torch.randperm(90, generator=torch.Generator().manual_seed(3))[:20].add(3).tolist()  # no repeats
    want = hf_greedy(m, prompt, 40)
    drafter = SuffixDrafter()
    steps = []
    with Engine(m, drafter, max_batch=2, max_len=128, eos_token_id=[]) as engine:
        for _ in range(2):
            rid = engine.add_request(prompt, RequestSettings(max_new_tokens=40))
            before, tokens = engine.stats.steps, []
            while engine.has_unfinished():
                for r, new, _ in engine.step():
                    assert r == rid
                    tokens += new
            assert tokens == want
            steps.append(engine.stats.steps - before)
    assert steps[1] <= math.ceil(40 / (drafter.max_depth + 1)) + 1 < steps[0], steps  # full-depth drafts accepted


def test_generate_greedy_equals_hf_and_reuses_earlier_calls():
    m = greedy_t.target("llama")
    drafter = SuffixDrafter(max_depth=6, max_nodes=9)
    lengths = []
    for plen, new, seed in [(1, 9, 0), (6, 1, 1), (11, 24, 2), (4, 13, 3), (11, 24, 2)]:
        prompt = greedy_t.prompt_of(plen, seed)
        got, stats = greedy_t.run_and_check(m, drafter, prompt, new)
        assert got == hf_greedy(m, prompt, new), (plen, new, seed)
        lengths.append(stats.mean_accepted_length)
    assert lengths[-1] > 4 and lengths[-1] > lengths[2], lengths  # the repeated call drafts from the first one


@pytest.mark.parametrize("adaptive", [False, True], ids=["suffix", "adaptive"])
def test_engine_rows_joining_and_leaving_equal_hf_greedy(adaptive):
    """Requests (some prompts repeated, so later ones draft from earlier outputs) arrive at different steps into
    an engine of three rows, some with an early stop token: each equals HF's greedy decoding alone."""
    m = greedy_t.target("llama")
    base = [greedy_t.prompt_of(n, 40 + n) for n in (7, 1, 12, 4, 9, 15)]
    prompts = base + [base[0], base[2], base[5], base[2]]
    new = 16
    refs = [hf_greedy(m, p, new) for p in prompts]
    budgets = [new - 3 * (b % 4) for b in range(len(prompts))]
    stops = {b: refs[b][4] for b in range(0, len(prompts), 3) if refs[b][4] not in refs[b][:4]}
    arrivals = {}
    for b, p in enumerate(prompts):  # four at the start (one queued), then one a step
        stop = (stops[b],) if b in stops else ()
        arrivals.setdefault(0 if b < 4 else b - 3, []).append(
            (b, p, RequestSettings(max_new_tokens=budgets[b], stop_token_ids=stop)))
    inner = SuffixDrafter(max_depth=6, max_nodes=9)
    with Engine(m, AdaptiveDrafter(inner) if adaptive else inner, max_batch=3, max_len=128, eos_token_id=[]) as e:
        tokens = es.run(e, arrivals)
        stats = e.stats
    for b, r in enumerate(refs):
        w = r[: budgets[b]]
        if b in stops:
            w = w[: w.index(stops[b]) + 1]
        assert tokens[b] == w, (adaptive, b)
    assert stats.retirements >= 3 and stats.mean_accepted_length > 1.2, stats.mean_accepted_length
    assert inner.corpus.live_tokens > 0


# ---------------------------------------------------------------------------------------------------------------
# Sampling.


def test_sampled_requests_follow_the_target_distribution():
    """test_engine_sampling's workload (two prompts, four settings, greedy requests mixed in, half joining after
    a step) through one suffix drafter: rows that join later draft from the earlier requests' outputs."""
    target = es.models()["target"]
    reqs = es.requests_in_random_order()
    half = len(reqs) // 2
    tokens, kinds = {}, {}
    with Engine(target, SuffixDrafter(max_depth=3, max_nodes=5, spec_factor=2.0, min_prob=0.0), max_batch=3000,
                max_len=32, eos_token_id=[]) as engine:
        def add(batch):
            for j, (name, i) in batch:
                _, T, k, p = es.SETTINGS.get(name, (0, 0.0, 0, 1.0))
                s = RequestSettings(max_new_tokens=es.NEW, temperature=T, top_k=k, top_p=p,
                                    seed=None if name == "greedy" else 400_000 + j)
                kinds[engine.add_request(es.PROMPTS[i], s)] = (name, i)

        add(enumerate(reqs[:half]))
        steps = 0
        while engine.has_unfinished() or steps == 0:
            for rid, new, _ in engine.step():
                tokens.setdefault(rid, []).extend(new)
            if steps == 0:
                add((j + half, r) for j, r in enumerate(reqs[half:]))
            steps += 1
        stats = engine.stats
    greedy = [es.greedy_reference(target, p, es.NEW) for p in es.PROMPTS]
    assert all(tokens[rid] == greedy[i] for rid, (name, i) in kinds.items() if name == "greedy")
    failures = []
    for name, (i, T, k, p) in es.SETTINGS.items():
        joint, third = es.exact_distributions(target, es.PROMPTS[i], T, k, p)
        new = torch.tensor([tokens[rid] for rid, (n, _) in kinds.items() if n == name])
        p_pair = sampling_t.chi_square_p(torch.bincount(new[:, 0] * es.V + new[:, 1], minlength=es.V ** 2), joint)
        p_third = sampling_t.chi_square_p(torch.bincount(new[:, 2], minlength=es.V), third)
        if not (p_pair > 1e-3 and p_third > 1e-3):
            failures.append((name, p_pair, p_third))
    assert not failures, failures
    assert stats.accept_hist[0] > 0 and sum(stats.accept_hist[1:]) > len(reqs) // 10, stats.accept_hist


def test_seeded_request_is_independent_of_its_batch():
    """Each seeded request of test_engine_sampling alone, then beside neighbours with the same prompts (greedy and
    sampled, short, so their outputs enter the corpus while it runs) and others joining later, through copies of
    one warm drafter: the same tokens."""
    warm = SuffixDrafter(max_depth=3, max_nodes=6, spec_factor=2.0, min_prob=0.0)
    with Engine(es.models()["target"], warm, max_batch=8, max_len=128, eos_token_id=[]) as e:
        es.run(e, {0: [(j, p, RequestSettings(max_new_tokens=12, temperature=1.0, seed=j))
                       for j, (p, _) in enumerate(es.SEEDED)]})

    def decode(arrivals):
        with Engine(es.models()["target"], copy.deepcopy(warm), max_batch=6, max_len=128, eos_token_id=[]) as e:
            tokens = es.run(e, arrivals)
            return tokens, e.stats

    settings = [RequestSettings(max_new_tokens=30, **kw) for _, kw in es.SEEDED]
    want = {k: decode({0: [(k, p, settings[k])]})[0][k] for k, (p, _) in enumerate(es.SEEDED)}
    for k, (p, _) in enumerate(es.SEEDED):
        arrivals = {0: [(k, p, settings[k]), ("g", p, RequestSettings(max_new_tokens=3)),
                        ("s", p, RequestSettings(max_new_tokens=2, temperature=1.0, seed=99))],
                    2: [("t", p, RequestSettings(max_new_tokens=4, temperature=0.7))],
                    3: [("u", [5, 3, 5, 3], RequestSettings(max_new_tokens=30, temperature=1.2, seed=5))]}
        tokens, stats = decode(arrivals)
        assert tokens[k] == want[k], k
        assert sum(stats.accept_hist[1:]) > 0  # (drafts were accepted: the trees took part)


# ---------------------------------------------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize("name, value", [("max_depth", 0), ("max_nodes", 1), ("max_pattern", 0), ("min_match", 0),
                                         ("spec_factor", 0.0), ("spec_factor", float("nan")), ("min_prob", 1.5),
                                         ("min_prob", -0.1), ("corpus_tokens", -5), ("max_occurrences", 0),
                                         ("max_depth", 2.5), ("max_nodes", True), ("spec_factor", "2")])
def test_bad_arguments_name_the_argument(name, value):
    with pytest.raises(ValueError, match=f"SuffixDrafter: {name} must be"):
        SuffixDrafter(**{name: value})


def test_min_match_above_max_pattern_is_refused():
    with pytest.raises(ValueError, match="min_match must be <= max_pattern"):
        SuffixDrafter(max_pattern=3, min_match=4)
