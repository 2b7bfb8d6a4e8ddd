"""specdec_ext.Engine, sampling: each request of a mixed batch follows the target distribution under its settings.

* Lossless per request: one engine decodes thousands of requests (each with its own seed) of four sampling settings
  (temperature / top-k / top-p) on two prompts, interleaved at random, with greedy requests mixed in, arriving at two
  steps into an engine of fewer rows than requests (a queue, rows joining mid-generation). For every setting, the
  first three tokens of its requests are compared with the target's exact distribution (the tiny V = 8 target run on
  every continuation; the temperature / top-k / top-p transform written here in plain PyTorch from the documented
  rule, not taken from the ops): a chi-square test on the joint distribution of the first two tokens and on the
  marginal of the third. Plain decoding, the draft-model drafter (sampled drafts with their probabilities) and EAGLE
  (deterministic top-k tree drafts). Greedy requests equal Hugging Face's greedy decoding exactly.
  Thresholds as in test_generate_sampling: each test rejects at p < 1e-3 (8 per drafter: at most 0.8% false alarms
  per drafter over independent seeds); seeds are fixed, so the outcome is deterministic.
* A seeded request gives the same tokens alone and beside other requests (greedy, sampled, seeded or not, other
  settings and budgets, joining at other steps, so it changes rows): plain decoding, the draft model (sampled
  chains), EAGLE-2 trees (raw scores, ``calibrate=False``: calibrated scores learn from every row the drafter
  served, by design) and n-gram chains padded to a neighbour's longer chain (engine/verify.py, "Padding"); near
  its end beside rows with more budget left (engine/engine.py, "Budget").
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

import test_generate_sampling as sampling_t  # noqa: E402

from specdec_ext import Engine, RequestSettings  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, NgramDrafter, pad_trees  # noqa: E402
from specdec_ext.engine.verify import Verifier  # noqa: E402
from specdec_ext.models.eagle import Eagle1Model, EagleConfig  # noqa: E402
from specdec_ext.state import DecodeState, DraftTree, SamplingParams  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = sampling_t.V  # 8
NEW = 3
PROMPTS = ([3, 1, 4, 1, 5], [2, 7, 1, 7, 2, 7])
SETTINGS = {  # name: (prompt index, temperature, top_k, top_p)
    "T1": (0, 1.0, 0, 1.0),
    "T0.8-k5-p0.9": (0, 0.8, 5, 0.9),
    "T1.5-k3": (1, 1.5, 3, 1.0),
    "T0.6-p0.7": (1, 0.6, 0, 0.7),
}
PER_SETTING = 2000
GREEDY_PER_PROMPT = 40

_MODELS: dict = {}


def models():
    """The V = 8 target of test_generate_sampling and a draft close to it (cached: every test reads the same)."""
    if not _MODELS:
        _MODELS["target"] = sampling_t.tiny(21)
        _MODELS["draft"] = sampling_t.tiny(21, noise=0.3)
        torch.manual_seed(3)
        _MODELS["eagle"] = Eagle1Model(EagleConfig(hidden_size=32, intermediate_size=64, num_attention_heads=1,
                                                   num_key_value_heads=1, vocab_size=V, head_dim=64)).eval()
    return _MODELS


def make_drafter(kind: str, calibrate: bool = True):
    m = models()
    if kind == "plain":
        return None
    if kind == "draft":  # sampled chain drafts, with their probabilities
        return DraftModelDrafter(m["draft"], num_draft_tokens=3)
    if kind == "eagle":  # EAGLE-2 dynamic tree of deterministic top-k drafts
        return EagleDrafter(m["eagle"], depth=2, top_k=2, total_tokens=4, calibrate=calibrate)
    if kind == "ngram":
        return NgramDrafter(num_pred_tokens=3, max_ngram_size=2)
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------------------------
# The exact distributions, from the target's own logits.


def filtered_probs(logits: torch.Tensor, T: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution of each row of ``logits[R, V]`` (float64): softmax(logits / T) over the top-k
    logits (ties at the k-th kept), then over the smallest descending-probability prefix whose mass reaches top_p
    (ties at its last logit kept) -- the rule of docs/ARCHITECTURE.md, restated without the ops."""
    x = logits.double()
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[-1]:
        keep &= x >= x.topk(top_k, -1).values[:, -1:]
    p = torch.softmax(torch.where(keep, x / T, torch.tensor(float("-inf"), dtype=x.dtype)), -1)
    if top_p < 1:
        sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each position
        last = (before < top_p).sum(-1, keepdim=True) - 1  # the position whose running sum reaches top_p
        threshold = x.gather(-1, order.gather(-1, last))
        keep &= x >= threshold
        p = torch.where(keep, p, torch.zeros((), dtype=p.dtype))
    return p / p.sum(-1, keepdim=True)


def hf_logits(model, seqs: torch.Tensor) -> torch.Tensor:
    """The last position's logits of ``seqs`` by the model's Hugging Face forward with SDPA attention (the engine
    switches the model to its own attention implementation; this reference does not use it)."""
    saved = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model(seqs).logits[:, -1].float()
    finally:
        model.set_attn_implementation(saved)


def exact_distributions(model, prompt: list[int], T: float, top_k: int, top_p: float):
    """p(t1, t2) ``[V, V]`` and p(t3) ``[V]`` after ``prompt``, by running the target on every continuation."""
    P = torch.tensor(prompt)
    t = torch.arange(V)
    p1 = filtered_probs(hf_logits(model, P[None]), T, top_k, top_p)[0]
    p2 = filtered_probs(hf_logits(model, torch.cat([P.expand(V, -1), t[:, None]], 1)), T, top_k, top_p)
    joint = p1[:, None] * p2
    pairs = torch.cartesian_prod(t, t)
    p3 = filtered_probs(hf_logits(model, torch.cat([P.expand(V * V, -1), pairs], 1)), T, top_k, top_p)
    return joint, (joint.reshape(-1, 1) * p3).sum(0)


def smoothed(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` mixed with 0.1% of the uniform distribution: full support, so that chi_square_p may judge counts that
    fall outside ``probs``' own support (the power check: a wrong distribution must be rejected, not refused)."""
    probs = probs.flatten()
    return 0.999 * probs + 0.001 / probs.numel()


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(hf_logits(model, torch.tensor([seq])).argmax()))
    return seq[len(prompt):]


def test_filtered_probs_follows_the_rule():
    """The test's own transform, on a hand-worked row (so the chi-square references rest on something checked)."""
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    torch.testing.assert_close(filtered_probs(logits, 1.0, 0, 1.0), torch.tensor([[0.1, 0.4, 0.2, 0.3]],
                                                                                 dtype=torch.float64))
    torch.testing.assert_close(filtered_probs(logits, 1.0, 2, 1.0), torch.tensor([[0, 4 / 7, 0, 3 / 7]],
                                                                                 dtype=torch.float64))
    # top_p = 0.69: 0.4 + 0.3 reaches it, 0.2 is dropped; 0.71 needs the 0.2 as well
    torch.testing.assert_close(filtered_probs(logits, 1.0, 0, 0.69), torch.tensor([[0, 4 / 7, 0, 3 / 7]],
                                                                                 dtype=torch.float64))
    torch.testing.assert_close(filtered_probs(logits, 1.0, 0, 0.71), torch.tensor([[0, 4 / 9, 2 / 9, 3 / 9]],
                                                                                  dtype=torch.float64))
    t2 = torch.tensor([[0.1, 0.4, 0.2, 0.3]]) ** 0.5
    torch.testing.assert_close(filtered_probs(logits, 2.0, 0, 1.0), (t2 / t2.sum()).double())


# ---------------------------------------------------------------------------------------------------------------
# Lossless per request.


def requests_in_random_order() -> list[tuple[str, int]]:
    """``(setting name or "greedy", prompt index)`` for every request, shuffled (seeded)."""
    reqs = [(name, SETTINGS[name][0]) for name in SETTINGS for _ in range(PER_SETTING)]
    reqs += [("greedy", i) for i in range(len(PROMPTS)) for _ in range(GREEDY_PER_PROMPT)]
    order = torch.randperm(len(reqs), generator=torch.Generator().manual_seed(5)).tolist()
    return [reqs[i] for i in order]


@pytest.mark.parametrize("kind", ["plain", "draft", "eagle"])
def test_every_request_follows_the_target_distribution(kind):
    target = models()["target"]
    exact = {name: exact_distributions(target, PROMPTS[i], T, k, p) for name, (i, T, k, p) in SETTINGS.items()}
    greedy = [greedy_reference(target, p, NEW) for p in PROMPTS]
    reqs = requests_in_random_order()
    seed0 = {"plain": 100_000, "draft": 200_000, "eagle": 300_000}[kind]
    half = len(reqs) // 2
    tokens: dict[int, list[int]] = {}
    kinds: dict[int, tuple[str, int]] = {}
    with Engine(target, make_drafter(kind), max_batch=3000, max_len=32, eos_token_id=[]) as engine:
        def add(batch):
            for j, (name, i) in batch:
                if name == "greedy":
                    s = RequestSettings(max_new_tokens=NEW)
                else:
                    _, T, k, p = SETTINGS[name]
                    s = RequestSettings(max_new_tokens=NEW, temperature=T, top_k=k, top_p=p, seed=seed0 + j)
                kinds[engine.add_request(PROMPTS[i], s)] = (name, i)

        add(enumerate(reqs[:half]))  # half now, half after a step: they join rows that are mid-generation
        steps = 0
        while engine.has_unfinished() or steps == 0:
            for rid, new, reason in engine.step():
                tokens.setdefault(rid, []).extend(new)
                assert reason in (None, "length"), reason
            if steps == 0:
                add((j + half, r) for j, r in enumerate(reqs[half:]))
            steps += 1
        stats = engine.stats
    assert len(tokens) == len(reqs) and all(len(t) == NEW for t in tokens.values())
    assert stats.batch_size == 3000 and stats.joins >= 3  # a full batch, and requests joining as rows left
    for rid, (name, i) in kinds.items():
        if name == "greedy":
            assert tokens[rid] == greedy[i], (kind, rid, i)
    failures, power = [], []
    for name, (joint, third) in exact.items():
        new = torch.tensor([tokens[rid] for rid, (n, _) in kinds.items() if n == name])
        assert new.shape == (PER_SETTING, NEW)
        pairs = torch.bincount(new[:, 0] * V + new[:, 1], minlength=V * V)
        p_pair = sampling_t.chi_square_p(pairs, joint)
        p_third = sampling_t.chi_square_p(torch.bincount(new[:, 2], minlength=V), third)
        if not (p_pair > 1e-3 and p_third > 1e-3):
            failures.append((name, p_pair, p_third))
        # power: the other setting of the same prompt (a row sampled with its neighbour's settings) is rejected
        other = next(o for o in SETTINGS if o != name and SETTINGS[o][0] == SETTINGS[name][0])
        power.append((name, other, sampling_t.chi_square_p(pairs, smoothed(exact[other][0]))))
    assert not failures, (kind, failures)
    assert all(p < 1e-6 for *_, p in power), (kind, power)
    if kind != "plain":  # not vacuous: drafts were accepted, and some rejected (the residual was sampled)
        assert stats.accept_hist[0] > 0 and sum(stats.accept_hist[1:]) > len(reqs) // 10, stats.accept_hist


# ---------------------------------------------------------------------------------------------------------------
# A seeded request and its batch.


SEEDED = [  # (prompt, settings) of requests whose tokens are compared alone and in a batch
    ([3, 1, 4, 1, 5], dict(temperature=1.0, seed=11)),
    ([2, 7, 1, 7, 2, 7], dict(temperature=0.8, top_k=5, top_p=0.9, seed=12)),
    ([6, 5, 4], dict(temperature=1.5, top_k=3, seed=13)),
    ([1, 2], dict(temperature=0.6, top_p=0.7, seed=14)),
]


def run(engine: Engine, arrivals: dict[int, list[tuple]]) -> dict:
    """Steps ``engine``; before step s adds ``arrivals[s]`` (``(key, prompt, RequestSettings)``); each key's
    tokens."""
    tokens, keys, s = {}, {}, 0
    while s <= max(arrivals) or engine.has_unfinished():
        for key, prompt, settings in arrivals.get(s, []):
            keys[engine.add_request(prompt, settings)] = key
        for rid, new, _ in engine.step():
            tokens.setdefault(keys[rid], []).extend(new)
        s += 1
        assert s < 500
    return tokens


def alone(kind: str, budget: int) -> dict:
    """Each SEEDED request's tokens decoded alone (a fresh engine and drafter each)."""
    out = {}
    for key, (prompt, kw) in enumerate(SEEDED):
        with Engine(models()["target"], make_drafter(kind, calibrate=False), max_batch=8, max_len=128,
                    eos_token_id=[]) as e:
            out[key] = run(e, {0: [(key, prompt, RequestSettings(max_new_tokens=budget, **kw))]})[key]
    return out


def in_a_batch(kind: str, budget: int, neighbours: dict[int, list[tuple]], keys) -> dict:
    """The SEEDED requests ``keys`` decoded together with ``neighbours``, request k arriving at step k (so rows
    move as others leave): their tokens."""
    arrivals = {s: list(v) for s, v in neighbours.items()}
    for key in keys:
        prompt, kw = SEEDED[key]
        arrivals.setdefault(key, []).append((key, prompt, RequestSettings(max_new_tokens=budget, **kw)))
    with Engine(models()["target"], make_drafter(kind, calibrate=False), max_batch=6, max_len=128,
                eos_token_id=[]) as e:
        tokens = run(e, arrivals)
    return {k: tokens[k] for k in keys}


def short_neighbours(budget: int) -> dict[int, list[tuple]]:
    """Greedy, sampled unseeded, seeded and generator-driven requests of other prompts and settings, with budgets
    of at most ``budget`` tokens, joining at steps 0 .. 3."""
    return {0: [("g0", [4, 4, 4, 4], RequestSettings(max_new_tokens=budget)),
                ("s0", [5, 3, 5, 3, 5], RequestSettings(max_new_tokens=budget - 2, temperature=1.2, seed=99))],
            1: [("s1", [7], RequestSettings(max_new_tokens=budget, temperature=0.9, top_k=4))],
            2: [("g1", [1, 6, 1, 6], RequestSettings(max_new_tokens=2))],
            3: [("s2", [2, 2, 3], RequestSettings(max_new_tokens=budget - 1, temperature=0.7, top_p=0.8,
                                                  generator=torch.Generator().manual_seed(5)))]}


def test_seeded_request_is_independent_of_its_batch_plain():
    want = alone("plain", 24)
    assert all(len(t) == 24 for t in want.values())
    assert len({tuple(t) for t in want.values()}) == len(SEEDED)  # (the requests are not all alike)
    assert in_a_batch("plain", 24, short_neighbours(24), range(len(SEEDED))) == want


def test_seeded_request_is_independent_of_its_batch_eagle():
    """EAGLE, each tested request (40 tokens) alone beside neighbours of at most 6 tokens, then all of them
    together, arriving at steps 0 .. 3 (equal budgets, so each ends beside rows with more budget left)."""
    want = alone("eagle", 40)
    assert all(len(t) == 40 for t in want.values())
    for key in range(len(SEEDED)):
        assert in_a_batch("eagle", 40, short_neighbours(6), [key]) == {key: want[key]}, key
    assert in_a_batch("eagle", 40, short_neighbours(6), range(len(SEEDED))) == want


@pytest.mark.parametrize("kind", ["eagle", "draft"])
def test_seeded_request_beside_a_longer_request(kind):
    """The tested requests (8 tokens) beside greedy and sampled requests of 40 tokens that arrive with them: the
    tested requests end while their neighbours still draft deep trees."""
    long = {0: [("g0", [4, 4, 4, 4], RequestSettings(max_new_tokens=40)),
                ("s0", [5, 3, 5], RequestSettings(max_new_tokens=40, temperature=1.0, seed=7))]}
    want = alone(kind, 8)
    assert all(len(t) == 8 for t in want.values())
    assert in_a_batch(kind, 8, long, range(len(SEEDED))) == want


def test_seeded_request_beside_repetitive_prompts_ngram():
    """Neighbours with repetitive prompts (long n-gram matches, so the batch's chains are padded to theirs) of 8
    tokens, joining at step 0."""
    rep = {0: [(f"r{i}", [3, 5, 6] * (4 + i), RequestSettings(max_new_tokens=8)) for i in range(2)]}
    want = alone("ngram", 40)
    got = {}
    for key in want:
        got[key] = in_a_batch("ngram", 40, rep, [key])[key]
    assert got == want


def sampled_rows(seeds: list[int]) -> DecodeState:
    """A state of one-token prompts sampled at temperature 1, row b drawing from a generator seeded ``seeds[b]``."""
    n = len(seeds)
    return DecodeState.of_prompts([[1]] * n, 8, V, sampling=SamplingParams.rows([1.0] * n, [0] * n, [1.0] * n, "cpu"),
                                  generators=[torch.Generator().manual_seed(x) for x in seeds])


def test_padded_chains_are_verified_as_their_own_chains():
    """The verification's cut of padded rows (engine/verify.py) against the trees they stand for, over many seeds:
    in a batch of two 4-node chains padded past depths 1 and 2 (``row_depth`` / ``row_nodes``), each row is
    verified as its own 2- or 3-node chain alone, with the same uniforms (equal seeds)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, V) * 2
    drafts = logits.argmax(-1)  # likely drafts, so that whole chains are often accepted
    tokens = torch.stack([torch.tensor([1, drafts[0, 0], drafts[0, 0], drafts[0, 0]]),
                          torch.cat([torch.tensor([3]), drafts[1, :3]])])
    chain = torch.arange(-1, 3).expand(2, 4).contiguous()
    verifier = Verifier("exact", 4)

    reached = [0, 0]
    for seed in range(0, 600, 2):
        both = verifier(logits, DraftTree(tokens, chain, row_depth=[1, 2], row_nodes=[2, 3]), sampled_rows([seed, seed + 1]))
        for b, n in ((0, 2), (1, 3)):
            own = verifier(logits[b:b + 1, :n], DraftTree(tokens[b:b + 1, :n], chain[b:b + 1, :n]),
                           sampled_rows([seed + b]))
            assert both.accept_len[b] == own.accept_len[0] and both.next_token[b] == own.next_token[0], (seed, b)
            assert both.accepted[b, :n].tolist() == own.accepted[0].tolist() and (both.accepted[b, n:] == -1).all()
            reached[b] += int(own.accept_len[0] == n - 1)
    assert min(reached) > 50, reached  # (the cut was exercised: each row's whole own chain was often accepted)


def test_padded_trees_are_verified_as_their_own_trees():
    """``pad_trees``: rows of 4 and 6 nodes (trees with siblings) share N = 6; the smaller gets padding under its
    deepest node, and each row is verified as its own tree alone, with the same uniforms, over many seeds; the
    padding is marked (``row_depth`` / ``row_nodes``)."""
    torch.manual_seed(1)
    logits = torch.randn(2, 6, V) * 2
    top = logits.topk(2, -1).indices  # likely drafts: each node's two best children
    small = ([1, int(top[0, 0, 0]), int(top[0, 0, 1]), int(top[0, 1, 0])], [-1, 0, 0, 1])
    large = ([3, int(top[1, 0, 0]), int(top[1, 0, 1]), int(top[1, 1, 0]), int(top[1, 1, 1]), int(top[1, 3, 0])],
             [-1, 0, 0, 1, 1, 3])
    both_tree = pad_trees([small, large], "cpu")
    assert both_tree.row_depth == [2, 3] and both_tree.row_nodes == [4, 6]
    assert both_tree.parents[0].tolist() == [-1, 0, 0, 1, 3, 4]  # (a chain under the deepest node, node 3)
    verifier = Verifier("exact", 6)

    deepest = 0
    for seed in range(0, 600, 2):
        both = verifier(logits, both_tree, sampled_rows([seed, seed + 1]))
        for b, own_tree in ((0, small), (1, large)):
            n = len(own_tree[0])
            one = pad_trees([own_tree], "cpu")
            own = verifier(logits[b:b + 1, :n], one, sampled_rows([seed + b]))
            assert both.accept_len[b] == own.accept_len[0] and both.next_token[b] == own.next_token[0], (seed, b)
            assert both.accepted[b, :n].tolist() == own.accepted[0].tolist() and (both.accepted[b, n:] == -1).all()
        deepest += int(own.accept_len[0] == 3) + int(both.accept_len[0] == 2)
    assert deepest > 30  # (walks reached the small tree's deepest node, where the padding hangs)
