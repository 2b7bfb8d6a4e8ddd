"""Adaptive speculation (specdec_ext.adaptive.AdaptiveDrafter).

* Greedy output through :func:`generate` equals plain greedy decoding for every drafter kind (n-gram, draft model
  chain and top-k tree, Medusa, EAGLE-1 dynamic tree, EAGLE-3), while the wrapper switches depths often (depth 0 =
  plain steps included), in "adapt", "off" and "fixed" modes.
* The decisions, with a fake clock and a fake drafter driven by a fake loop (deterministic given the timings):
  steep target cost -> no speculation; flat cost and full acceptance -> the deepest depth; acceptance dropping
  mid-stream -> none within a bounded number of steps; acceptance recovering -> deep again (exploration); the batch
  shrinking (retire) -> deeper; pinned modes never move.
* Depth-0 steps keep drafters' caches in sync (a draft model identical to the target accepts everything).
* Bad arguments are errors naming the argument.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext import AdaptiveDrafter  # noqa: E402
from specdec_ext.adaptive import CostCurve  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter, NgramDrafter  # noqa: E402
from specdec_ext.drafters.base import DecodeState, DraftTree, StepResult  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------------------------
# Greedy equality through generate, every drafter kind.

_MODELS: dict = {}


def target(layers: int = 2):
    if layers not in _MODELS:
        _MODELS[layers] = make_model("llama", seed=11, num_hidden_layers=layers)
    return _MODELS[layers]


def perturbed_copy(model, scale: float = 1e-3, seed: int = 0):
    d = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return d


def make_inner(kind: str):
    """(target, inner drafter) of each kind."""
    if kind == "ngram":
        return target(), NgramDrafter(num_pred_tokens=4, max_ngram_size=3)
    if kind == "draft":
        return target(), DraftModelDrafter(perturbed_copy(target()), num_draft_tokens=4)
    if kind == "draft-tree":
        return target(), DraftModelDrafter(perturbed_copy(target(), 3e-3), num_draft_tokens=3, tree_width=2)
    if kind == "draft-dynamic":
        return target(), DraftModelDrafter(perturbed_copy(target(), 3e-3), num_draft_tokens=3, tree_width=2,
                                           total_tokens=5)
    if kind == "medusa":
        from test_drafter_medusa import random_heads

        return target(), MedusaDrafter(random_heads())
    if kind == "medusa-dynamic":
        from test_drafter_medusa import random_heads

        return target(), MedusaDrafter(random_heads(), dynamic=True, max_nodes=10)
    from test_drafter_eagle import L_TARGET, random_draft

    if kind == "eagle1":
        return target(L_TARGET), EagleDrafter(random_draft(1), depth=4, top_k=3, total_tokens=12)
    return target(L_TARGET), EagleDrafter(random_draft(3), target=target(L_TARGET), depth=3, top_k=2,
                                          total_tokens=6)


def prompts_of(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in (9, 1, 5):
        base = torch.randint(3, V, (max(1, (n + 1) // 2),), generator=gen).tolist()
        out.append((base * 2)[:n])  # repetitive: the n-gram drafter finds matches
    return out


def random_prompt() -> torch.Tensor:
    """Not repetitive (on a repetitive greedy cycle stale draft-cache entries can coincide with the right ones)."""
    return torch.randint(3, V, (7,), generator=torch.Generator().manual_seed(0))


KINDS = ["ngram", "draft", "draft-tree", "draft-dynamic", "medusa", "medusa-dynamic", "eagle1", "eagle3"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_while_switching_depths(kind):
    tgt, inner = make_inner(kind)
    prompts = prompts_of(1)
    want, _ = generate(tgt, None, prompts, max_new_tokens=20, eos_token_id=[])
    ad = AdaptiveDrafter(inner, explore_every=2)  # explores every other step: many depth changes
    for _ in range(2):  # a second generation with what the first one learned
        got, stats = generate(tgt, ad, prompts, max_new_tokens=20, eos_token_id=[])
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        assert stats.target_forwards == stats.steps
    assert 0 in ad.depth_hist and len(ad.depth_hist) >= 2, ad.depth_hist
    # one prompt alone too (batch 1), the row with the one-token prompt included
    for p in prompts[:2]:
        want1, _ = generate(tgt, None, torch.tensor(p), max_new_tokens=12, eos_token_id=[])
        got1, _ = generate(tgt, AdaptiveDrafter(make_inner(kind)[1], explore_every=3), torch.tensor(p),
                           max_new_tokens=12, eos_token_id=[])
        assert got1.tolist() == want1.tolist()


@pytest.mark.parametrize("mode,depth", [("off", None), ("fixed", 2), ("fixed", 0)])
def test_pinned_modes_through_generate(mode, depth):
    tgt, inner = make_inner("draft")
    prompts = prompts_of(2)
    want, _ = generate(tgt, None, prompts, max_new_tokens=15, eos_token_id=[])
    ad = AdaptiveDrafter(inner, mode=mode, depth=depth)
    got, stats = generate(tgt, ad, prompts, max_new_tokens=15, eos_token_id=[])
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    pinned = depth or 0
    assert set(ad.history[:-1]) == {pinned} and ad.history[-1] <= pinned, ad.history  # the budget caps the last
    if pinned == 0:
        assert stats.steps == 15 and stats.mean_accepted_length == 1.0


def test_draft_model_identical_to_target_accepts_everything_across_plain_steps():
    """Depth-0 steps between speculative ones keep the draft model's cache right: an identical draft model still
    accepts every draft."""
    tgt = target()
    ad = AdaptiveDrafter(DraftModelDrafter(copy.deepcopy(tgt), num_draft_tokens=3), mode="fixed", depth=3)
    pinned_choose = ad.choose
    calls = []

    def alternate(B, max_depth, budgets=None):
        calls.append(1)
        return (0, False) if len(calls) % 2 == 0 else pinned_choose(B, max_depth)

    ad.choose = alternate
    prompt = random_prompt()
    want, _ = generate(tgt, None, prompt, max_new_tokens=30, eos_token_id=[])
    got, stats = generate(tgt, ad, prompt, max_new_tokens=30, eos_token_id=[])
    assert got.tolist() == want.tolist()
    spec_steps = ad.history.count(3)
    assert spec_steps >= 3 and ad.history.count(0) >= 3
    # every speculative step accepted all of its drafts (the last one may have been cut by the budget)
    assert stats.accept_hist[3] >= spec_steps - 1, (stats.accept_hist, ad.history)


def test_draft_model_drafter_depth_zero_keeps_its_cache_in_sync():
    tgt = target()
    inner = DraftModelDrafter(copy.deepcopy(tgt), num_draft_tokens=3)

    class Alternate:
        max_nodes, max_depth, hidden_state_layers, forwards, defers_prefill = inner.max_nodes, 3, (), 0, False
        serves_row_subsets = True

        def __init__(self):
            self.i, self.acc = 0, []

        def begin(self, *a):
            inner.begin(*a)

        def add_rows(self, *a):
            inner.add_rows(*a)

        def retire(self, keep):
            inner.retire(keep)

        def propose(self, state, max_depth, max_nodes):
            self.i += 1
            self.d = 0 if self.i % 2 == 0 else min(3, max_depth)
            return inner.propose(state, self.d, max_nodes)

        def observe(self, state, tree, result):
            if self.d == 3:
                self.acc.append(int(result.accept_len[0]))
            inner.observe(state, tree, result)

    alt = Alternate()
    generate(tgt, alt, random_prompt(), max_new_tokens=30, eos_token_id=[])
    assert alt.acc and all(a == 3 for a in alt.acc), alt.acc


@pytest.mark.parametrize("kind", ["draft", "eagle1"])
def test_deferred_prefill_is_caught_up_on_at_the_first_speculative_step(kind):
    """The wrapper asks drafters with their own network to defer their prompt prefill: a generation kept plain
    runs no draft forward at all, and one that speculates after plain steps catches up on the prompt and those
    steps (greedy output unchanged, and an exact draft model still accepts every draft)."""
    tgt, inner = make_inner(kind)
    ad = AdaptiveDrafter(inner, mode="off")
    assert ad.defers_prefill
    prompts = prompts_of(3)
    want, _ = generate(tgt, None, prompts, max_new_tokens=12, eos_token_id=[])
    got, stats = generate(tgt, ad, prompts, max_new_tokens=12, eos_token_id=[])
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert inner.forwards == 0 and stats.draft_forwards == 0
    begun = make_inner(kind)[1]  # undeferred, the drafter's own begin prefills the prompts
    generate(tgt, AdaptiveDrafter(begun, mode="fixed", depth=0), prompts, max_new_tokens=3, eos_token_id=[])
    assert begun.forwards == 1
    if kind == "draft":  # an exact draft model: after 5 plain steps, every draft of the deferred catch-up is right
        exact = AdaptiveDrafter(DraftModelDrafter(copy.deepcopy(tgt), num_draft_tokens=3), mode="fixed", depth=3)
        exact.defers_prefill = True  # (fixed mode does not defer by itself)
        exact.choose = lambda B, max_depth, budgets=None, n=iter(range(10 ** 6)): (
            0 if next(n) < 5 else min(3, max_depth), False)
        prompt = random_prompt()
        want1, _ = generate(tgt, None, prompt, max_new_tokens=20, eos_token_id=[])
        got1, stats1 = generate(tgt, exact, prompt, max_new_tokens=20, eos_token_id=[])
        assert got1.tolist() == want1.tolist()
        spec = exact.history.count(3)  # (the last step may be capped by the budget, or cut by it)
        assert spec >= 3 and stats1.accept_hist[3] >= spec - 1, (stats1.accept_hist, exact.history)


def test_fixed_mode_does_not_defer_and_plain_drafters_have_nothing_to_defer():
    assert not AdaptiveDrafter(make_inner("draft")[1], mode="fixed", depth=2).defers_prefill
    assert not AdaptiveDrafter(make_inner("ngram")[1]).defers_prefill


# ---------------------------------------------------------------------------------------------------------------
# Decisions under a fake clock and a fake loop.


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeChain:
    """A chain drafter (depth ``D``) whose propose costs ``draft_time(d)`` seconds on the fake clock."""

    hidden_state_layers = ()
    forwards = 0
    defers_prefill = False
    serves_row_subsets = True

    def __init__(self, clock: FakeClock, D: int = 6, draft_time=lambda d: 0.0):
        self.clock, self.num_pred_tokens, self.max_nodes, self.draft_time = clock, D, D + 1, draft_time
        self.max_depth = D
        self.retired = []

    def begin(self, target, state, prefill_hidden_states=None):
        pass

    def add_rows(self, target, rows, prefill_hidden_states=None):
        pass

    def propose(self, state, max_depth, max_nodes):
        d = min(self.num_pred_tokens, max_depth, max_nodes - 1)
        self.clock.t += self.draft_time(d)
        B = state.batch_size
        return DraftTree(torch.zeros(B, d + 1, dtype=torch.int64),
                         torch.arange(-1, d, dtype=torch.int64).expand(B, d + 1).contiguous())

    def observe(self, state, tree, result):
        pass

    def retire(self, keep):
        self.retired.append(keep.tolist())


def fake_state(B: int) -> DecodeState:
    return DecodeState.of_prompts([[0]] * B, max_len=4, vocab_size=V)


def fake_run(ad: AdaptiveDrafter, clock: FakeClock, steps: int, B: int, target_time, accept, state=None,
             start: int = 0, max_depth: int = 1000) -> DecodeState:
    """Drives ``ad`` like the decode loop: ``target_time(tokens in flight)`` seconds per verification;
    ``accept(step, row, depth)`` = drafts accepted; ``max_depth`` the loop's depth bound (the budget left - 1)."""
    if state is None:
        state = fake_state(B)
        ad.begin(None, state)
    for s in range(start, start + steps):
        tree = ad.propose(state, max_depth, ad.max_nodes)
        d = tree.num_nodes - 1
        clock.t += target_time(state.batch_size * tree.num_nodes)
        lens = [min(accept(s, b, d), d) for b in range(state.batch_size)]
        for b, L in enumerate(lens):
            state.host_tokens[b].extend([0] * (L + 1))
        Bn, N = tree.tokens.shape
        ad.observe(state, tree, StepResult(torch.zeros(Bn, N, dtype=torch.int64), torch.tensor(lens),
                                           torch.zeros(Bn, dtype=torch.int64), [L + 1 for L in lens],
                                           host_accept_len=lens))
    return state


def steady(p: float):
    """Acceptance where each next depth is accepted with frequency p, spread evenly over rows and steps (a
    low-discrepancy sequence): every few steps' outcomes say p, for tests whose margins are a few percent."""
    def accept(step, row, depth):
        k, n = step * 64 + row, 0
        while n < 16 and (k * 0.6180339887 + n * 0.4142135624) % 1.0 < p:
            n += 1
        return n

    return accept


def geometric(p: float, seed: int = 0):
    """Acceptance where each next depth is accepted with probability p (seeded, deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    table = {}

    def accept(step, row, depth):
        key = (step, row)
        if key not in table:
            u = torch.rand(16, generator=gen).tolist()
            n = 0
            while n < 16 and u[n] < p:
                n += 1
            table[key] = n
        return table[key]

    return accept


def test_steep_target_cost_chooses_no_speculation():
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=6), explore_every=0, clock=clock)
    fake_run(ad, clock, 40, B=8, target_time=lambda x: 1e-3 * x, accept=geometric(0.7))  # every token costs
    assert ad.history[-30:] == [0] * 30, ad.history


def test_flat_cost_and_full_acceptance_choose_the_deepest():
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=6, draft_time=lambda d: 1e-4 * d), explore_every=0, clock=clock)
    fake_run(ad, clock, 30, B=4, target_time=lambda x: 0.01, accept=lambda s, b, d: d)
    assert ad.history[-20:] == [6] * 20, ad.history
    assert ad.expected_tokens(6) > 6.5


def test_acceptance_dropping_mid_stream_switches_to_none_within_bounded_steps():
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=6, draft_time=lambda d: 0.002 * d), clock=clock)  # default exploration
    cost = lambda x: 0.01 + 0.0025 * (x / 4 - 1)  # noqa: E731 - B = 4 rows; each extra node per row: +25%
    good_then_bad = lambda s, b, d: d if s < 40 else 0  # noqa: E731
    fake_run(ad, clock, 80, B=4, target_time=cost, accept=good_then_bad)
    h = ad.history
    assert h[30:40].count(6) >= 9 and min(h[30:40]) >= 5, h  # deep while drafts are accepted (one exploration)
    first_none = next(i for i in range(40, 80) if h[i] == 0)
    assert first_none - 40 <= 15, h
    assert all(d <= h[40] for d in h[41:first_none]), h  # only ever shallower on the way
    late = h[first_none:]
    assert late.count(0) >= len(late) - len(late) // ad.explore_every - 1, h  # none, but for exploration steps


def test_acceptance_recovering_is_found_by_exploration():
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=6, draft_time=lambda d: 0.002 * d), explore_every=8, clock=clock)
    cost = lambda x: 0.01 + 0.0025 * (x / 4 - 1)  # noqa: E731
    bad_then_good = lambda s, b, d: 0 if s < 30 else d  # noqa: E731
    fake_run(ad, clock, 80, B=4, target_time=cost, accept=bad_then_good)
    h = ad.history
    assert h[20:30].count(0) >= 8, h
    assert h[-10:].count(6) >= 8, h


def test_batch_shrinking_makes_speculation_pay():
    """Cost flat up to 64 tokens in flight, then linear: at 64 rows speculation costs, at 4 rows it is free."""
    clock = FakeClock()
    inner = FakeChain(clock, D=4)
    ad = AdaptiveDrafter(inner, explore_every=0, clock=clock)
    cost = lambda x: 0.01 * max(1.0, x / 64)  # noqa: E731
    acc = geometric(0.6)
    state = fake_run(ad, clock, 25, B=64, target_time=cost, accept=acc)
    assert ad.history[-15:] == [0] * 15, ad.history
    keep = torch.arange(4)
    ad.retire(keep)  # rows finished and left the batch
    assert inner.retired == [keep.tolist()]
    small = fake_state(4)
    small.host_tokens = [state.host_tokens[b] for b in range(4)]
    fake_run(ad, clock, 25, B=4, target_time=cost, accept=acc, state=small, start=25)
    assert ad.history[-10:] == [4] * 10, ad.history


def test_a_drained_batch_leaves_plain_steps_despite_the_lag():
    """A drafter that catches up on plain steps (1 ms per lagging token and row): at 64 rows plain decoding wins and
    the lag grows; once rows retire down to 4, catching up on ~40 tokens of 4 rows costs 0.16 s, earned back over
    the ~50 steps left, so speculation resumes. (The catch-up measured at 64 rows, unscaled, would say 2.6 s.)"""
    clock = FakeClock()
    inner = FakeCatchUp(clock, 1e-3, D=4, draft_time=lambda d: 1e-3 * d)
    ad = AdaptiveDrafter(inner, explore_every=8, clock=clock)
    cost = lambda x: 0.01 * max(1.0, x / 64)  # noqa: E731
    acc = geometric(0.7)
    fake_run(ad, clock, 20, B=4, target_time=cost, accept=acc)  # costs and acceptance at 4 rows: deep drafting
    assert ad.history[-5:] == [4] * 5, ad.history
    ad.catchup = {64: 1e-3}  # as measured at 64 rows (per lagging token and row); nothing measured at 4
    state = fake_state(64)
    ad.begin(None, state)
    state = fake_run(ad, clock, 40, B=64, target_time=cost, accept=acc, state=state)
    assert ad._lag >= 30 and ad.history[-30:].count(0) >= 28, ad.history
    ad.retire(torch.arange(4))
    small = fake_state(4)
    small.host_tokens = [state.host_tokens[b] for b in range(4)]
    n = len(ad.history)
    for s in range(30):  # the loop's budget: 150 tokens left (for the longest row)
        tree = ad.propose(small, 149 - 2 * s, ad.max_nodes)
        d = tree.num_nodes - 1
        clock.t += cost(4 * tree.num_nodes)
        lens = [min(acc(100 + s, b, d), d) for b in range(4)]
        for b, L in enumerate(lens):
            small.host_tokens[b].extend([0] * (L + 1))
        ad.observe(small, tree, StepResult(torch.zeros(4, d + 1, dtype=torch.int64), torch.tensor(lens),
                                           torch.zeros(4, dtype=torch.int64), [L + 1 for L in lens],
                                           host_accept_len=lens))
    assert ad.history[n:n + 3].count(0) <= 1 and ad.history[-10:].count(0) == 0, ad.history[n:]


def test_exploration_backs_off_while_the_choice_holds():
    """Explorations come every ``explore_every`` steps, then twice, four times as far apart while they do not move
    the choice (up to ``explore_backoff`` times); across generations too; a batch size 2x away restarts the base
    rate, a row more or less (continuous batching's drift) does not."""
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=4), explore_every=8, explore_backoff=4, clock=clock)
    steep = lambda x: 1e-3 * x  # noqa: E731 - every token costs: plain decoding wins, exploring never pays
    seen = []
    for _ in range(4):  # four generations of 50 steps (a server's requests), one drafter
        fake_run(ad, clock, 50, B=8, target_time=steep, accept=geometric(0.7))
        seen += ad.history
    assert seen.count(0) >= 190, seen
    at = [i for i, d in enumerate(seen) if d == 1 and i >= 3]  # exploration steps (after the probes 1, 0, 1)
    assert [b - a for a, b in zip(at, at[1:])] == [16, 32, 32, 32, 32, 32], at  # not every 8th step (25 of them)
    explored = ad.explorations
    assert explored == len(at) and ad._explore_gap == 32
    fake_run(ad, clock, 10, B=7, target_time=steep, accept=geometric(0.7))  # a row fewer: the rate holds
    assert ad._explore_gap == 32 and ad.explorations == explored, (ad._explore_gap, ad.explorations)
    fake_run(ad, clock, 10, B=2, target_time=steep, accept=geometric(0.7))  # a quarter of the rows: restarted
    assert ad._explore_gap == 16 and ad.explorations == explored + 1, (ad._explore_gap, ad.explorations)
    plain = AdaptiveDrafter(FakeChain(clock, D=4), explore_every=8, explore_backoff=1, clock=clock)
    fake_run(plain, clock, 200, B=8, target_time=steep, accept=geometric(0.7))
    assert plain.explorations >= 22, plain.explorations  # no backoff: every 8th step


def test_a_wobbling_argmax_does_not_postpone_explorations():
    """Between two close depths the argmax changes every step or two. Each change restarts the base rate, not the
    count since the last exploration: explorations still come every ``explore_every`` steps (a count restarted at
    each change never reached one: none in 150 steps at eight rows on the family)."""
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=4), explore_every=8, clock=clock)
    calls = iter(range(10 ** 6))
    ad._argmax = lambda B, limit, budgets: (2 + next(calls) % 2, False)  # 2, 3, 2, 3, ...
    fake_run(ad, clock, 99, B=8, target_time=lambda x: 0.01, accept=geometric(0.7))
    assert ad.explorations >= 10, (ad.explorations, ad.history)  # every 8th step but a plain run's (steps 3 .. 98)
    assert ad.history[3:].count(0) == 6, ad.history  # one run of plain steps among the neighbours tried


@pytest.mark.parametrize("slope,plain_best", [(3e-4, True), (2e-4, False)])
def test_a_plain_step_measured_slow_after_the_prefill_is_measured_again(slope, plain_best):
    """A batch's first steps after its prefill run slow (here 1.7x for six steps), and the probes' plain step is one
    of them. At 8 rows with 0.6 acceptance plain decoding is ~6% ahead of the best depth at the steeper cost (a token
    in flight 0.3 ms), depth 1 ~7% ahead of plain decoding at the flatter one. The slow plain sample priced plain
    steps at 1.7x for good: the wrapper drafted 2 deep to the end. Explorations try a run of plain steps, which
    prices them apart: it settles on plain steps where they are faster, and keeps drafting where they are not."""
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=4, draft_time=lambda d: 5e-4 * d), clock=clock)
    steps = iter(range(10 ** 6))

    def target_time(x):  # plain decoding at 8 rows: 4.2 ms
        return (4.2e-3 + slope * (x - 8)) * (1.7 if next(steps) < 6 else 1.0)

    fake_run(ad, clock, 200, B=8, target_time=target_time, accept=steady(0.6))
    tail = ad.history[100:]
    if plain_best:
        assert tail.count(0) >= 90, ad.history
        assert ad.predicted_step_time(8, 0) == pytest.approx(4.2e-3, rel=0.01)
    else:
        assert tail.count(0) <= 6 and tail.count(1) >= 90, ad.history  # (at most one exploration's plain run)


def test_a_plain_step_at_a_batch_size_not_measured_is_priced_from_the_target_curve_scaled_to_plain_steps():
    """Plain steps were priced at one and two rows; the target's curve over tokens in flight comes mostly from
    speculative steps, whose tokens cost more than as many rows' single tokens (their trees' verification: on the
    family, EAGLE-2's steps at one and two rows priced a plain step at 8 rows 28% over its measured cost). At 8 rows
    the plain step is the curve at 8 tokens scaled by plain / curve at 2 rows, the nearest batch size measured; with
    the curve as it is, speculation would have been chosen where plain decoding is ahead."""
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=4), explore_every=0, prior_accept=0.5, clock=clock)
    for _ in range(2):  # (a point's first measurement stands in until its second)
        ad.plain_cost.add(1, 3.8e-3)
        ad.plain_cost.add(2, 4.1e-3)
        for x in (1, 2, 4, 8, 16, 24, 32, 40):
            ad.target_cost.add(x, 4.6e-3 if x == 1 else 5e-3 + 0.25e-3 * x)
    scaled = 7.0e-3 * 4.1 / 5.5
    assert ad.predicted_step_time(8, 0) == pytest.approx(scaled)
    assert ad.predicted_step_time(2, 0) == pytest.approx(4.1e-3)  # (measured: as it is)
    assert ad.best_step(8, 4) == (0, False)
    spec = max(ad.score(8, d) for d in range(1, 5))
    assert 1 / 7.0e-3 < spec < 1 / scaled  # (unscaled, depth 1 would have been chosen)
    assert ad.predicted_step_time(1, 0) == pytest.approx(3.8e-3)
    ad.plain_cost = type(ad.plain_cost)(ad.cost_alpha)  # before any plain step was priced: the curve as it is
    assert ad.predicted_step_time(8, 0) == pytest.approx(7.0e-3)


def test_a_retried_depth_weighs_old_outcomes_by_their_age():
    """Counts decay per row-step since the depth was last tried, down to the weight of ``_KEEP`` outcomes: a depth
    that failed long ago and succeeds when explored again is believed within a few steps (the recovery is not
    outvoted by stale failures), and one step after a gap does not replace what many steps measured (at one row an
    exploration is one sample: judged on it alone, one unlucky step kept the best depth off for a whole run)."""
    from specdec_ext.adaptive import _KEEP

    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=2), mode="fixed", depth=1, clock=clock)
    fake_run(ad, clock, 5, B=4, target_time=lambda x: 0.01, accept=lambda s, b, d: 0)  # depth 1 fails 5 times
    assert ad.conditional_acceptance(1) < 0.1
    ad.mode = "off"
    fake_run(ad, clock, 30, B=4, target_time=lambda x: 0.01, accept=lambda s, b, d: 0)  # 30 plain steps
    assert ad.conditional_acceptance(1) < 0.1  # an untried depth holds its estimate
    ad.mode = "fixed"
    fake_run(ad, clock, 1, B=4, target_time=lambda x: 0.01, accept=lambda s, b, d: d)  # one step: all accepted
    acc = ad.acceptance[False]
    assert acc.n[1] == pytest.approx(_KEEP + 4) and acc.s[1] == pytest.approx(4)  # 0.97 ** 120 would keep ~0.4
    fake_run(ad, clock, 3, B=4, target_time=lambda x: 0.01, accept=lambda s, b, d: d)  # three more
    assert ad.conditional_acceptance(1) > 0.6  # believed within a few steps
    # a depth tried every step decays by ``decay`` per row of the step
    n, s_ = ad.acceptance[False].n[1], ad.acceptance[False].s[1]
    fake_run(ad, clock, 1, B=4, target_time=lambda x: 0.01, accept=lambda s, b, d: 0)
    acc = ad.acceptance[False]
    assert acc.n[1] == pytest.approx(0.97 ** 4 * n + 4) and acc.s[1] == pytest.approx(0.97 ** 4 * s_)
    # one row: 40 successes, then one failure after a gap of 10 plain steps keeps the estimate high
    one = AdaptiveDrafter(FakeChain(clock, D=2), mode="fixed", depth=1, clock=clock)
    fake_run(one, clock, 40, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: d)
    one.mode = "off"
    fake_run(one, clock, 10, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: 0)
    one.mode = "fixed"
    fake_run(one, clock, 1, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: 0)
    assert one.conditional_acceptance(1) > 0.9, one.conditional_acceptance(1)
    # ... and after 200 plain steps (0.97 ** 200: nothing of the past left), one failure leaves it near 0.8
    one.mode = "off"
    fake_run(one, clock, 200, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: 0)
    one.mode = "fixed"
    fake_run(one, clock, 1, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: 0)
    assert one.conditional_acceptance(1) > 0.75, one.conditional_acceptance(1)


def test_draft_cost_at_a_new_batch_size_borrows_the_shape_of_a_measured_one():
    """Drafting costs B x depth. At 4 rows every depth was measured; at 32 rows the first steps measure one deep
    depth. Its one point must not price a plain step like a deep one (a flat curve): scaled by the ratio of what the
    two batch sizes measured there, the shape of 4 rows' curve says plain decoding is cheap, and it is chosen."""
    clock = FakeClock()
    draft = FakeChain(clock, D=6)
    ad = AdaptiveDrafter(draft, explore_every=0, clock=clock)
    state = fake_state(4)
    ad.begin(None, state)
    B_now = {"B": 4}
    draft.draft_time = lambda d: 1e-3 * B_now["B"] * d
    fake_run(ad, clock, 20, B=4, target_time=lambda x: 0.01, accept=lambda s, b, d: d, state=state)
    assert ad.history[-5:] == [6] * 5 and all(ad.draft_cost[4, False].covers(d) for d in range(7))
    for x in (32, 64, 128, 256):  # the target's cost is known (flat) up to 256 tokens in flight
        ad.target_cost.add(x, 0.01)
    B_now["B"] = 32
    fake_run(ad, clock, 10, B=32, target_time=lambda x: 0.01, accept=lambda s, b, d: d)
    # true scores at 32 rows: depth 0 1 / 0.01 = 100 tokens/s per row, depth 6 7 / (0.01 + 0.192) = 35
    assert ad.history[0] == 6 and ad.history[-5:] == [0] * 5, ad.history  # one deep step, then plain
    assert ad._draft_time(32, 3) == pytest.approx(0.096, rel=0.01)


class FakeCatchUp(FakeChain):
    """A chain drafter that, like a draft model, skips its forwards on plain steps and catches up on them at the next
    speculative step: ``catch_up`` seconds per skipped step and row."""

    def __init__(self, clock, catch_up: float, **kw):
        super().__init__(clock, **kw)
        self.catch_up, self.lag = catch_up, 0

    def begin(self, target, state, prefill_hidden_states=None):
        self.lag = 0

    def propose(self, state, max_depth, max_nodes):
        d = min(self.num_pred_tokens, max_depth, max_nodes - 1)
        if d > 0:
            self.clock.t += self.lag * self.catch_up * state.batch_size
            self.lag = 0
        else:
            self.lag += 1
        return super().propose(state, max_depth, max_nodes)


def test_exploring_out_of_plain_steps_is_skipped_where_the_catch_up_costs_more_than_the_budget():
    """At 8 rows every token costs (plain decoding wins) and a speculative step after k plain steps costs the drafter
    k x 8 ms of catch-up (as much as the k plain steps themselves). Catch-up time is not taken for the depth's own
    draft cost; once measured, explorations out of plain steps stop (with the budget off, they go on)."""
    out = {}
    for budget in (0.05, float("inf")):
        clock = FakeClock()
        ad = AdaptiveDrafter(FakeCatchUp(clock, 1e-3, D=4, draft_time=lambda d: 1e-3 * d), explore_every=8,
                             explore_backoff=1, catchup_budget=budget, clock=clock)
        fake_run(ad, clock, 20, B=2, target_time=lambda x: 0.01, accept=lambda s, b, d: d)  # steady deep drafting
        assert [d for d in ad.history[-12:] if d][-5:] == [4] * 5, ad.history  # (explorations try plain runs)
        before = ad.explorations
        for g in range(4):
            fake_run(ad, clock, 50, B=8, target_time=lambda x: 1e-3 * x, accept=geometric(0.7))
            assert g == 0 or ad.history.count(0) >= (45 if budget < 1 else 40), ad.history
        out[budget] = ad.explorations - before
        if budget < 1:
            assert ad.catchup[8] == pytest.approx(1e-3, rel=0.25), ad.catchup  # per lagging token and row
            assert ad._draft_time(8, 1) < 2e-3  # the depth's own cost, not the catch-up
    assert out[0.05] <= 2 and out[float("inf")] >= 20, out


def test_an_exploration_does_not_pay_a_long_catch_up_where_speculation_only_might_pay():
    """A new batch of 16 rows whose 100-token prompts the drafter deferred: depth 1 scores above plain decoding
    before any catch-up, but catching up costs 200 ms (100 tokens x 2 ms for 16 rows, the cap), far above 5% of the
    eight plain steps to the next exploration (~4.6 ms). With ~40 tokens left, the argmax keeps plain steps
    (the charge outweighs the gain) and explorations out of them are skipped: no step pays the catch-up (with the
    budget off, explorations do)."""
    out = {}
    for budget in (0.05, float("inf")):
        clock = FakeClock()
        drafter = FakeCatchUp(clock, 2e-4, D=4, draft_time=lambda d: 1e-3 * d)
        ad = AdaptiveDrafter(drafter, explore_every=8, explore_backoff=1, catchup_budget=budget, clock=clock)
        fake_run(ad, clock, 20, B=2, target_time=lambda x: 0.01 + 1e-4 * x, accept=geometric(0.4))
        state = fake_state(16)
        for t in state.host_tokens:
            t.extend([0] * 100)
        ad.begin(None, state)
        ad._lag, drafter.lag = 100, 100
        ad.catchup[16] = 2e-4  # per lagging token and row
        before = ad.explorations
        fake_run(ad, clock, 40, B=16, target_time=lambda x: 0.01 + 1e-4 * x, accept=geometric(0.4), state=state,
                 max_depth=39)
        assert ad._catchup_at(16) == pytest.approx(2e-3, rel=0.05)
        out[budget] = (ad.explorations - before, sum(1 for d in ad.history if d > 0))
    assert out[0.05] == (0, 0), out
    assert out[float("inf")][0] >= 1 and out[float("inf")][1] >= 1, out


def test_leaving_a_run_of_plain_steps_is_charged_the_catch_up():
    """Deep drafting pays here, but after 200 plain steps with a catch-up of 8 ms per plain step (the estimate of
    50 ms capped at twice a depth-1 step's 4 ms of drafting), the first speculative step would cost 1.6 s; spread
    over ``explore_every`` steps (or the steps left, when more) that outweighs the gain: plain stays, unless the
    generation has long enough to go to earn it back."""
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=4, draft_time=lambda d: 4e-3 * d), explore_every=16, clock=clock)
    fake_run(ad, clock, 20, B=8, target_time=lambda x: 0.01 + 1e-4 * x, accept=lambda s, b, d: d)
    assert [d for d in ad.history[-12:] if d][-5:].count(4) >= 4, ad.history  # (explorations: plain runs, depth 3)
    ad.catchup[8] = 0.05 / 8  # per token and row: 50 ms per lagging token at 8 rows, above the cap
    assert ad._catchup_at(8) == pytest.approx(8e-3, rel=0.05)
    assert ad.best_step(8, 4) == (4, False)  # not in a plain run: nothing to catch up on
    ad._lag = 200
    assert ad.best_step(8, 4) == (0, False)
    assert ad.best_step(8, 4, budgets=[60] * 8) == (0, False)  # 12 deep steps left: the catch-up is not earned back
    # 2000 tokens left, ~400 deep steps: 4 ms of catch-up per step, and deep drafting still pays
    assert ad.best_step(8, 4, budgets=[2000] * 8) == (4, False)
    ad._lag = 1  # one plain step behind: 50 ms / 16 per step, deep drafting still pays
    assert ad.best_step(8, 4) == (4, False)


def test_tokens_past_a_rows_budget_are_not_counted():
    """A step's tokens past a row's budget are cut: what a row emits at depth d is its expected tokens at depth
    min(d, budget - 1), averaged over the rows (against a sum over the rows). Deep drafting pays for this batch
    with long budgets; with seven of its eight rows one token from their end it would earn a fraction of its cost,
    and plain decoding is chosen."""
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=6, draft_time=lambda d: 1e-3 * d), explore_every=0, clock=clock)
    fake_run(ad, clock, 30, B=8, target_time=lambda x: 0.01 + 2e-4 * x, accept=steady(0.8))
    budgets = [1, 2, 3, 5, 9, 40, 7, 1]
    for d in range(7):
        want = sum(ad.expected_tokens(min(d, r - 1)) for r in budgets) / len(budgets)
        assert ad.emitted_tokens(d, budgets) == pytest.approx(want), d
        assert ad.emitted_tokens(d, None) == ad.expected_tokens(d)
    assert ad.emitted_tokens(6, budgets) < 0.75 * ad.expected_tokens(6)
    assert ad.best_step(8, 6, [100] * 8)[0] >= 3, ad.history
    assert ad.best_step(8, 6, [1] * 7 + [100]) == (0, False)


def test_a_draining_batch_spreads_the_catch_up_over_its_budgets():
    """The catch-up charge is spread over the steps the rows' budgets last (``DecodeState.budgets``, their mean over
    E[tokens]), not over ``explore_every``: 8 rows 40 plain steps behind, 0.2 ms of catch-up per lagging token and
    row (64 ms), deep drafting 1.8x plain decoding. With 100 tokens a row left it leaves plain steps (the catch-up
    spread over ~20 steps); with 6 left (a batch about to drain), it stays plain; with the budgets unknown, the
    spread is ``explore_every`` (16) steps and it leaves."""
    picks = {}
    for budget in (100, 6, None):
        clock = FakeClock()
        ad = AdaptiveDrafter(FakeChain(clock, D=4, draft_time=lambda d: 1e-3 * d), explore_every=16, clock=clock)
        fake_run(ad, clock, 20, B=8, target_time=lambda x: 0.01 + 1e-4 * x, accept=lambda s, b, d: d)
        assert [d for d in ad.history[-10:] if d][-3:].count(4) >= 2, ad.history  # (explorations: plain runs, depth 3)
        ad.catchup[8] = 2e-4
        ad._lag, ad._since_explore = 40, 0
        state = DecodeState.of_prompts([[0] * 48] * 8, max_len=64, vocab_size=V,
                                       budgets=None if budget is None else [budget] * 8)
        ad.propose(state, 4, ad.max_nodes)
        picks[budget] = ad.history[-1]
    assert picks[100] == 4 and picks[6] == 0 and picks[None] == 4, picks


class FakeDeferred(FakeCatchUp):
    """FakeCatchUp that defers its prompt prefill when asked (the prompt then joins the first catch-up)."""

    defers_prefill = True
    serves_row_subsets = True

    def begin(self, target, state, prefill_hidden_states=None, *, defer_prefill=False):
        self.lag = max(state.prompt_lens) - 1 if defer_prefill else 0
        if not defer_prefill:
            self.clock.t += self.catch_up * state.batch_size * (max(state.prompt_lens) - 1)


def test_a_deferred_prefill_is_a_lag_of_the_prompt_and_its_catch_up_is_measured_per_token():
    """With the prefill deferred, a generation starts with a lag of the prompt (- 1) tokens; the first speculative
    step's catch-up, measured per lagging token, is kept apart from the depth's own cost. At 16 rows, where plain
    decoding wins, later generations then never leave plain decoding (so never pay the prompt's catch-up)."""
    clock = FakeClock()
    inner = FakeDeferred(clock, 1e-3, D=4, draft_time=lambda d: 1e-3 * d)
    ad = AdaptiveDrafter(inner, explore_every=8, clock=clock)
    assert ad.defers_prefill
    fake_run(ad, clock, 20, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: d)  # 1 row: deep drafting pays
    assert ad.history[-5:] == [4] * 5 and ad._draft_time(1, 4) == pytest.approx(4e-3, rel=0.05)

    def prompt_state(B: int, P: int) -> DecodeState:
        st = fake_state(B)
        st.prompt_lens, st.host_tokens = [P] * B, [[0] * P for _ in range(B)]
        return st

    st = prompt_state(1, 33)
    ad.begin(None, st)
    assert ad._lag == 32
    fake_run(ad, clock, 5, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: d, state=st)
    assert ad.history[0] > 0  # 32 ms of catch-up over 8 steps: drafting still pays at one row
    assert ad.catchup[1] == pytest.approx(1e-3, rel=0.05)  # per lagging token (and row)
    assert ad._draft_time(1, 4) == pytest.approx(4e-3, rel=0.05)  # untouched by the catch-up
    for _ in range(3):  # 16 rows: a target cost that grows steeply with the tokens in flight
        st = prompt_state(16, 33)
        ad.begin(None, st)
        fake_run(ad, clock, 40, B=16, target_time=lambda x: 2e-3 * x, accept=geometric(0.6), state=st)
    st = prompt_state(16, 33)
    ad.begin(None, st)
    lag_before = inner.lag
    fake_run(ad, clock, 40, B=16, target_time=lambda x: 2e-3 * x, accept=geometric(0.6), state=st)
    assert set(ad.history) == {0} and inner.lag == lag_before + 40, ad.history


def test_rows_joining_a_speculating_batch_are_prefilled_at_once():
    """Rows that join while the batch has settled on plain steps are deferred (the prefill may never be needed); rows
    that join while it speculates, or between plain steps that follow speculative ones, are prefilled at once:
    deferred, they would be caught up on at the next speculative step in one forward padded to their lag over every
    row."""
    asked = []

    class Recording(FakeDeferred):
        def add_rows(self, target, rows, prefill_hidden_states=None, *, defer_prefill=False):
            asked.append(defer_prefill)

    clock = FakeClock()
    ad = AdaptiveDrafter(Recording(clock, 1e-3, D=4, draft_time=lambda d: 1e-3 * d), explore_every=8, clock=clock)
    ad.begin(None, fake_state(1), defer_prefill=False)  # (the wrapper defers whatever its caller asks)
    assert ad._lag == 0 and ad.inner.lag == 0  # (a 1-token prompt: nothing to defer)
    joining = fake_state(1)
    joining.prompt_lens, joining.host_tokens = [9], [[0] * 9]
    ad.add_rows(None, joining)  # no step yet: the batch is not speculating
    assert asked == [True] and ad._lag == 8
    fake_run(ad, clock, 12, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: d)  # 1 row: drafting pays
    assert ad.history[-1] > 0 and ad._lag == 0
    ad.add_rows(None, joining)
    assert asked == [True, False] and ad._lag == 0
    ad.choose = lambda B, max_depth, budgets=None: (0, False)  # plain steps from now on
    state = fake_run(ad, clock, 3, B=1, target_time=lambda x: 0.01, accept=lambda s, b, d: d, start=12)
    ad.add_rows(None, joining)  # three plain steps: not settled yet
    assert asked == [True, False, False] and ad._lag == 3
    state.append(copy.deepcopy(joining))  # (the loop's state takes the row too)
    fake_run(ad, clock, 1, B=2, target_time=lambda x: 0.01, accept=lambda s, b, d: d, state=state, start=15)
    ad.add_rows(None, joining)  # the fourth: settled
    assert asked == [True, False, False, True] and ad._lag >= 8


def test_draft_prefills_of_rows_joining_a_speculating_batch_count_against_speculating():
    """At 12 rows one step of drafting pays by ~7% on the target and draft costs alone (0.85 acceptance; 10 ms + 2 ms
    a token per forward, 1 ms a draft level). A row joins before every step; joining a speculating batch costs the
    inner drafter 10 ms of prefill, joining a plain one nothing (deferred). The wrapper books the joins' cost per
    speculative step (``join_cost``) and settles on plain decoding; with free joins it keeps drafting."""
    class JoinCosting(FakeChain):
        defers_prefill = True
        serves_row_subsets = True

        def __init__(self, clock, join: float, **kw):
            super().__init__(clock, **kw)
            self.join = join

        def begin(self, target, state, prefill_hidden_states=None, *, defer_prefill=False):
            pass

        def add_rows(self, target, rows, prefill_hidden_states=None, *, defer_prefill=False):
            if not defer_prefill:
                self.clock.t += self.join

    tails = {}
    for join in (0.0, 0.01):
        clock = FakeClock()
        ad = AdaptiveDrafter(JoinCosting(clock, join, D=4, draft_time=lambda d: 1e-3 * d), explore_every=8,
                             clock=clock)
        state = fake_state(12)
        ad.begin(None, state)
        for s in range(80):
            ad.add_rows(None, fake_state(1))
            ad.retire(torch.arange(12))  # (it leaves at once: the batch stays at 12 rows)
            fake_run(ad, clock, 1, B=12, target_time=lambda x: 0.01 + 2e-3 * x, accept=steady(0.85),
                     state=state, start=s)
        tails[join] = ad.history[-30:]
        if join:
            assert ad.join_cost == pytest.approx(join, rel=0.3), ad.join_cost
    assert tails[0.0].count(0) <= 10 and tails[0.01].count(0) >= 24, tails


def test_optimism_keeps_one_row_from_settling_on_a_depth_after_one_unlucky_step():
    """At one row each step is one sample: a single failure at depth 3 pulls its estimate to 0.35, below what depth
    3 needs to pay (~0.68), and without optimism only rare explorations could lift it (the drafter settles at depth
    2). With one standard error of optimism on measured depths (from their row-steps so far: it fades as they
    accumulate) it keeps trying depth 3 and 4 until they are known, and mostly takes the best depth (4: acceptance
    0.8 per depth, drafting 2 ms per depth on a 9.5 ms target step)."""
    hists = {}
    for optimism in (0.0, 1.0):
        clock = FakeClock()
        inner = FakeCatchUp(clock, 2e-4, D=4, draft_time=lambda d: (1.5e-3 + 2e-3 * d) if d else 1e-4)
        ad = AdaptiveDrafter(inner, optimism=optimism, clock=clock)
        for g in range(6):  # six requests of 40 steps, one drafter
            fake_run(ad, clock, 40, B=1, target_time=lambda x: 9.5e-3 + 0.5e-3 * (x - 1),
                     accept=geometric(0.8, 300 + g))
        hists[optimism] = dict(ad.depth_hist)
    assert hists[0.0].get(2, 0) > 150, hists  # stuck one depth short
    h = hists[1.0]
    assert h.get(4, 0) > 100 and h[4] == max(h.values()), hists  # the best depth, most of the time


def test_pinned_modes_and_budget_cap():
    clock = FakeClock()
    steep = lambda x: 1e-3 * x  # noqa: E731
    fixed = AdaptiveDrafter(FakeChain(clock, D=6), mode="fixed", depth=5, clock=clock)
    fake_run(fixed, clock, 20, B=8, target_time=steep, accept=lambda s, b, d: 0)
    assert fixed.history == [5] * 20
    off = AdaptiveDrafter(FakeChain(clock, D=6), mode="off", clock=clock)
    fake_run(off, clock, 20, B=8, target_time=lambda x: 0.01, accept=lambda s, b, d: d)
    assert off.history == [0] * 20
    assert fixed.choose(8, 2) == (2, False) and fixed.choose(8, 0) == (0, False)  # the loop's budget caps the depth
    capped = AdaptiveDrafter(FakeChain(clock, D=6), depth=3, explore_every=0, clock=clock)  # adapt within 0..3
    fake_run(capped, clock, 20, B=2, target_time=lambda x: 0.01, accept=lambda s, b, d: d)
    assert max(capped.history) == 3 and capped.history[-5:] == [3] * 5


def test_deterministic_given_the_timings():
    runs = []
    for _ in range(2):
        clock = FakeClock()
        ad = AdaptiveDrafter(FakeChain(clock, D=5, draft_time=lambda d: 0.001 * d), clock=clock)
        fake_run(ad, clock, 60, B=3, target_time=lambda x: 0.01 + 0.0005 * x ** 1.5, accept=geometric(0.6, 3))
        runs.append(list(ad.history))
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_acceptance_counts_the_verification_not_the_emission():
    """Row 1 hit EOS inside its accepted run (1 token appended) and row 2 its budget: both were verified at every
    depth they drafted, so their accept lengths count like row 0's; row 3 failed at depth 2."""
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=3), mode="fixed", depth=3, clock=clock)
    state = fake_state(4)
    ad.begin(None, state)
    tree = ad.propose(state, 10, ad.max_nodes)
    state.done[1] = state.done[2] = True
    for b, a in enumerate([4, 1, 2, 2]):
        state.host_tokens[b].extend([0] * a)
    ad.observe(state, tree, StepResult(torch.zeros(4, 4, dtype=torch.int64), torch.tensor([3, 3, 3, 1]),
                                       torch.zeros(4, dtype=torch.int64), [4, 1, 2, 2], host_accept_len=[3, 3, 3, 1]))
    assert ad.acceptance[False].n[1:] == [4.0, 4.0, 3.0] and ad.acceptance[False].s[1:] == [4.0, 3.0, 3.0]


def test_cost_curve():
    c = CostCurve(alpha=0.5)
    assert c.predict(3) is None
    c.add(10, 1.0)
    assert c.predict(1) == 1.0 and c.predict(100) == 1.0  # one point: flat
    c.add(20, 3.0)
    assert c.predict(15) == pytest.approx(2.0) and c.predict(30) == pytest.approx(5.0)
    assert c.predict(5) == pytest.approx(0.0)  # extrapolated down, never below 0
    c.add(30, 2.0)  # a violator: pooled with 20 (non-decreasing fit)
    assert c.predict(20) == pytest.approx(2.5) and c.predict(30) == pytest.approx(2.5)
    c.add(10, 3.0)  # the first measurement (first-shape effects) is replaced by the second
    assert c.points[10][0] == pytest.approx(3.0)
    c.add(10, 5.0)  # then a moving average: (3 + 5) / 2 at the second kept sample
    assert c.points[10][0] == pytest.approx(4.0)
    c.add(10, 1.0)  # weight alpha on the newest from there
    assert c.points[10][0] == pytest.approx(2.5)


# ---------------------------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="always"), "mode must be one of"),
    (dict(mode="fixed"), "mode='fixed' needs depth"),
    (dict(mode="fixed", depth=-1), "depth must be an integer >= 0"),
    (dict(depth=2.5), "depth must be an integer"),
    (dict(depth=7), r"depth = 7 exceeds the inner drafter's depth \(6\)"),
    (dict(mode="off", depth=3), "mode='off' takes no depth"),
    (dict(decay=1.0), r"decay must be a number in \(0"),
    (dict(decay=0), "decay must be"),
    (dict(explore_every=-1), "explore_every must be an integer >= 0"),
    (dict(explore_backoff=0), "explore_backoff must be an integer >= 1"),
    (dict(prior_accept=1.5), r"prior_accept must be a number in \[0"),
    (dict(prior_weight=0), "prior_weight must be"),
    (dict(cost_alpha=0), "cost_alpha must be"),
    (dict(catchup_budget=-1), "catchup_budget must be"),
    (dict(optimism=-0.5), "optimism must be"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveDrafter(FakeChain(FakeClock(), D=6), **kwargs)


def test_bad_inner_and_clock():
    with pytest.raises(ValueError, match="AdaptiveDrafter: inner: drafter must be a drafter"):
        AdaptiveDrafter(object())
    no_nodes = FakeChain(FakeClock())
    no_nodes.max_nodes = 0
    with pytest.raises(ValueError, match="AdaptiveDrafter: inner: drafter.max_nodes must be an integer >= 1"):
        AdaptiveDrafter(no_nodes)
    with pytest.raises(TypeError, match="clock must be a function"):
        AdaptiveDrafter(FakeChain(FakeClock()), clock=3.0)


# ---------------------------------------------------------------------------------------------------------------
# The batch sweep (specdec_ext.bench.batch_sweep), tiny and fast.


def test_batch_sweep_runs_and_reports():
    import json

    from specdec_ext.bench.batch_sweep import format_table, run_batch_sweep

    tgt = target()
    gen = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(3, V, (4,), generator=gen).tolist() * 3) for _ in range(3)]
    res = run_batch_sweep(tgt, lambda: NgramDrafter(num_pred_tokens=3), prompts, [1, 3], 6, [1, 3], repeats=1,
                          prompt_len=12, log=None)
    json.dumps(res)  # JSON-able
    assert [r["batch_size"] for r in res["rows"]] == [1, 3] and res["fixed_depths"] == [1, 3]
    for r in res["rows"]:
        assert set(r["fixed_tokens_per_s"]) == {"1", "3"} and r["plain_tokens_per_s"] > 0
        assert r["outputs_match_plain"] and sum(r["adaptive_depth_hist"].values()) >= 1
        t = {c: v[0] for c, v in r["all_tokens_per_s"].items()}  # one round: the paired ratios are that round's
        assert r["adaptive_vs_best"] == pytest.approx(
            t["adaptive"] / max(t["plain"], t[f"fixed:{r['best_fixed_depth']}"]))
        assert r["adaptive_vs_all"] == pytest.approx(t["adaptive"] / max(t["plain"], t["fixed:1"], t["fixed:3"]))
    assert res["summary"]["all_outputs_match_plain"] and "beats both" in format_table(res)
    named = run_batch_sweep(tgt, lambda name: NgramDrafter(num_pred_tokens=2), prompts, [2], 4, None, repeats=1,
                            drafter_names=["ngram"], log=None)
    assert named["drafter"] == "ngram" and named["fixed_depths"] == [1, 2]
    with pytest.raises(ValueError, match="fixed_depths"):
        run_batch_sweep(tgt, lambda: NgramDrafter(num_pred_tokens=2), prompts, [1], 4, [5], log=None)


def test_an_inflated_catch_up_estimate_does_not_keep_plain_steps_for_good():
    """Deep drafting pays at 8 rows, but the catch-up estimate says 1 s per lagging token and row (one bad
    measurement) while the drafter is in a run of plain steps. Charged as it stands, it would keep plain steps (and
    make every exploration out of them too dear), so nothing would ever measure it again. It is capped at twice a
    depth-1 step's drafting (reading one more token a row costs no more than that step): the argmax leaves plain
    steps, the real catch-up is measured, and deep drafting goes on."""
    clock = FakeClock()
    drafter = FakeCatchUp(clock, 1e-4, D=4, draft_time=lambda d: 1e-3 * d)
    ad = AdaptiveDrafter(drafter, explore_every=8, explore_backoff=1, clock=clock)
    state = fake_run(ad, clock, 20, B=8, target_time=lambda x: 0.01 + 1e-5 * x, accept=lambda s, b, d: d)
    assert [d for d in ad.history[-12:] if d][-5:].count(4) >= 4, ad.history  # (explorations: plain runs, depth 3)
    ad.catchup[8] = 1.0
    ad._lag, drafter.lag = 5, 5
    assert ad._catchup_at(8) == pytest.approx(2e-3, rel=0.05)  # 8 s a lagging token as measured; capped
    assert ad.best_step(8, 4) == (4, False)
    fake_run(ad, clock, 30, B=8, target_time=lambda x: 0.01 + 1e-5 * x, accept=lambda s, b, d: d, state=state,
             start=20)
    tail = ad.history[-20:]  # deep (explorations every 8 steps try depth 3 or a plain step)
    assert tail.count(0) <= 1 and tail.count(4) >= 17 and ad.catchup[8] < 0.9, (ad.history, ad.catchup)


@pytest.mark.parametrize("kind", ["ngram", "draft", "eagle2_tree"])
def test_adaptive_in_an_engine_with_rows_joining_and_leaving(kind):
    """The wrapper forwards add_rows / retire to its inner drafter (its prefill deferred where it can): requests
    that join a running batch at different steps and leave at different steps each equal HF's greedy decoding of
    their prompt alone, while the wrapper switches depths."""
    import test_engine as engine_t
    import test_generate_batch as batch_t
    from hf_reference import hf_greedy

    from specdec_ext import Engine

    m, inner, prompts = batch_t.case(kind)
    ad = AdaptiveDrafter(inner, explore_every=2)
    budgets = [12 - 3 * (b % 3) for b in range(len(prompts))]
    arrivals = engine_t.staggered(prompts, budgets, 3)  # (3 at the start, then one a step)
    with Engine(m, ad, max_batch=3, max_len=128, eos_token_id=[]) as engine:
        tokens, reasons, _ = engine_t.run(engine, arrivals)
        stats = engine.stats
    for b, p in enumerate(prompts):
        assert tokens[b] == hf_greedy(m, p, budgets[b]), (kind, b)
        assert reasons[b] == "length"
    assert stats.joins >= 3 and stats.retirements >= 3 and len(set(ad.history)) > 1, ad.history


class FakeTree(FakeChain):
    """A drafter whose trees are twice as wide as a chain (a sibling beside every chain node: ``2 d + 1`` nodes at
    depth d) and cost twice its draft time, where a chain (a budget of one node per depth) costs ``draft_time``."""

    def __init__(self, clock: FakeClock, D: int = 6, draft_time=lambda d, B: 0.0):
        super().__init__(clock, D)
        self.max_nodes = 2 * D + 1
        self.tree_draft_time = draft_time

    def propose(self, state, max_depth, max_nodes):
        B = state.batch_size
        d = min(self.num_pred_tokens, max_depth)
        if max_nodes < 2 * d + 1:  # the budget: a chain
            d = min(d, max_nodes - 1)
            self.clock.t += self.tree_draft_time(d, B)
            return DraftTree(torch.zeros(B, d + 1, dtype=torch.int64),
                             torch.arange(-1, d, dtype=torch.int64).expand(B, d + 1).contiguous())
        self.clock.t += 2 * self.tree_draft_time(d, B)
        parents = [-1] + list(range(d)) + list(range(d))  # the chain 0..d, then a sibling of each chain node
        return DraftTree(torch.zeros(B, 2 * d + 1, dtype=torch.int64),
                         torch.tensor(parents, dtype=torch.int64).expand(B, 2 * d + 1).contiguous())


def test_a_wide_drafter_drafts_trees_at_one_row_and_chains_at_eight():
    """The shape is part of the choice: with draft time growing with the rows and every verified token costing, the
    wide tree (it accepts 5 drafts a step, the chain 2) wins at one row (by ~65%) and its chain (half the draft and
    verification work) at eight (by ~25%, both ahead of plain decoding); the argmax finds each from the measured
    costs and acceptance."""
    clock = FakeClock()
    ad = AdaptiveDrafter(FakeTree(clock, D=6, draft_time=lambda d, B: 2.5e-4 * d * B), clock=clock)
    assert ad.shapes == (False, True)
    shapes = []

    def run(steps, B, start):
        state = fake_state(B)
        ad.begin(None, state)
        for s in range(start, start + steps):
            tree = ad.propose(state, 1000, ad.max_nodes)
            N = tree.num_nodes
            chain = bool((tree.parents[0, 1:] == torch.arange(N - 1)).all())
            d = N - 1 if chain else (N - 1) // 2
            shapes.append((d, chain and d > 0))
            clock.t += 0.01 + 2e-4 * B * N
            lens = [min(2 if chain else 5, d)] * B
            for b, L in enumerate(lens):
                state.host_tokens[b].extend([0] * (L + 1))
            ad.observe(state, tree, StepResult(torch.zeros(B, N, dtype=torch.int64), torch.tensor(lens),
                                               torch.zeros(B, dtype=torch.int64), [L + 1 for L in lens],
                                               host_accept_len=lens))

    run(150, 1, 0)
    tail = shapes[-40:]
    assert sum(d >= 4 and not chain for d, chain in tail) >= 30, tail  # deep trees at one row
    run(200, 8, 1000)
    tail = shapes[-60:]
    assert sum(chain and d >= 2 for d, chain in tail) >= 45, tail  # chains at eight, not plain steps
    assert sum(ad.chain_hist.values()) == sum(chain for _, chain in shapes)
    assert ad.conditional_acceptance(3, chain=True) < 0.5 < ad.conditional_acceptance(3)  # one table per shape


def test_a_clear_choice_stands_for_a_few_steps_and_a_close_call_is_worked_out_every_step():
    """The argmax is worked out afresh every ``_HOLD`` steps while its answer leads the runner-up's score by
    ``_HOLD_LEAD`` (and at once when the batch size changes); an answer within that lead is worked out every step."""
    from specdec_ext import adaptive as A

    def counted(ad):
        calls = []
        ranked = ad._ranked

        def spy(*args):
            calls.append(args[0])
            return ranked(*args)
        ad._ranked = spy
        return calls

    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=4), explore_every=0, clock=clock)
    steep = lambda x: 1e-3 * x  # noqa: E731 - every token costs and drafts are mostly rejected: plain leads by far
    state = fake_run(ad, clock, 12, B=8, target_time=steep, accept=geometric(0.3))
    calls = counted(ad)
    fake_run(ad, clock, 20, B=8, target_time=steep, accept=geometric(0.3), state=state, start=12)
    assert ad.history[-20:] == [0] * 20 and len(calls) == 20 // A._HOLD, (ad.history, calls)
    small = fake_state(4)
    fake_run(ad, clock, 1, B=4, target_time=steep, accept=geometric(0.3), state=small, start=32)
    assert calls[-1] == 4  # (a new batch size: worked out at once)

    clock = FakeClock()
    ad = AdaptiveDrafter(FakeChain(clock, D=4), explore_every=0, clock=clock)
    # a close call: depth 1 yields 1.5 tokens for 1.5x plain's time, the same score as a plain step
    tie = lambda x: 1e-3 * (1.0 if x <= 8 else 1.5)  # noqa: E731
    state = fake_run(ad, clock, 12, B=8, target_time=tie, accept=lambda s, b, d: int(b % 2 == 0 and d > 0))
    calls = counted(ad)
    fake_run(ad, clock, 10, B=8, target_time=tie, accept=lambda s, b, d: int(b % 2 == 0 and d > 0), state=state,
             start=12)
    assert len(calls) == 10, calls


# ---------------------------------------------------------------------------------------------------------------
# Detached rows: rows that join where plain steps lead clearly, and end soon, never reach the inner drafter.


class Recording(FakeChain):
    """A chain drafter that records the rows each call hands it."""

    def __init__(self, clock: FakeClock, D: int = 4):
        super().__init__(clock, D)
        self.calls = []

    def begin(self, target, state, prefill_hidden_states=None, *, defer_prefill=False):
        self.calls.append(("begin", state.batch_size))

    def add_rows(self, target, rows, prefill_hidden_states=None, *, defer_prefill=False):
        self.calls.append(("add_rows", rows.batch_size, list(rows.budgets or [])))

    def propose(self, state, max_depth, max_nodes):
        self.calls.append(("propose", state.batch_size))
        self.rows_seen = list(state.budgets or [])
        return super().propose(state, max_depth, max_nodes)

    def observe(self, state, tree, result):
        self.calls.append(("observe", state.batch_size, result.accepted.shape[0], len(result.appended)))


def budgeted_state(budgets: list[int]) -> DecodeState:
    return DecodeState.of_prompts([[0]] * len(budgets), max_len=4, vocab_size=V, budgets=budgets)


def test_rows_joining_where_plain_steps_lead_clearly_and_ending_soon_are_left_detached():
    """Every token costs (plain leads at any size): of two rows joining a settled batch, the one with 40 tokens left
    stays out of the inner drafter and the one with 1,000 joins it. A speculative step then drafts the nine attached
    rows only (the detached one takes its root alone, marked for verification as 0 deep), their outcomes alone are
    counted, and a retirement reaches the inner drafter as its own rows' keep."""
    clock = FakeClock()
    inner = Recording(clock)
    ad = AdaptiveDrafter(inner, explore_every=0, clock=clock)
    state = budgeted_state([1000] * 8)
    ad.begin(None, state)  # (no cost known yet: every row attached)
    fake_run(ad, clock, 20, B=8, target_time=lambda x: 1e-3 * x, accept=geometric(0.5), state=state)
    assert ad.history[-10:] == [0] * 10 and ad._plain_leads(10)
    joining = budgeted_state([40, 1000])
    ad.add_rows(None, joining)
    state.append(joining)
    assert inner.calls[-1] == ("add_rows", 1, [1000]) and ad.attached == [True] * 8 + [False, True]
    ad.choose = lambda B, max_depth, budgets=None: (3, False)  # a speculative step
    before = ad.acceptance[False].tot[1]
    tree = ad.propose(state, 10, ad.max_nodes)
    assert inner.calls[-1] == ("propose", 9) and tree.tokens.shape == (10, 4)
    assert tree.row_depth[8] == 0 and tree.row_nodes[8] == 1 and tree.row_depth[9] == 3 and tree.row_nodes[9] == 4
    assert tree.tokens[8].tolist() == [0] * 4 and tree.parents[8].tolist() == [-1, 0, 1, 2]
    lens = [2] * 8 + [0, 2]
    ad.observe(state, tree, StepResult(torch.zeros(10, 4, dtype=torch.int64), torch.tensor(lens),
                                       torch.zeros(10, dtype=torch.int64), [L + 1 for L in lens],
                                       host_accept_len=lens))
    assert inner.calls[-1] == ("observe", 9, 9, 9) and ad.acceptance[False].tot[1] == before + 9
    ad.retire(torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 8]))  # row 7 finished; the last row takes its slot
    assert inner.retired[-1] == [0, 1, 2, 3, 4, 5, 6, 8] and ad.attached == [True] * 8 + [False]
    # the inner drafter's rows leave as the engine's do (a freed slot taken from its end), whatever the batch's
    # order, and every call hands it its rows in its own order
    state.keep_rows(torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 8]))
    state.budgets = [100 + b for b in range(9)]  # (row ids, read back from what the inner drafter is handed)
    ad.retire(torch.tensor([0, 8, 2, 3, 4, 5, 6, 7]))  # row 1 finished; the detached row takes its slot
    state.keep_rows(torch.tensor([0, 8, 2, 3, 4, 5, 6, 7]))
    assert inner.retired[-1] == [0, 7, 2, 3, 4, 5, 6]  # (its row 7 to its slot 1: one move)
    ad.retire(torch.tensor([0, 2, 3, 4, 5, 6, 7]))  # the detached row leaves: every row attached, out of order
    state.keep_rows(torch.tensor([0, 2, 3, 4, 5, 6, 7]))
    assert inner.retired[-1] == [0, 7, 2, 3, 4, 5, 6] and ad.attached == [True] * 7
    tree = ad.propose(state, 10, ad.max_nodes)
    assert inner.rows_seen == [100, 107, 102, 103, 104, 105, 106] and tree.row_nodes == [4] * 7


def test_attached_rows_ending_soon_are_let_go_once_plain_steps_have_lasted():
    """Rows that joined a small batch where speculation led (attached), in a batch filled with detached rows to a size
    where plain steps lead: while the argmax answers speculative steps nothing is let go; once it has answered plain
    steps for ``_SHED_AFTER`` steps, the attached rows whose budget ends within the horizon leave the inner drafter
    (its own rows' keep), and the one with a long budget stays and is drafted alone."""
    from specdec_ext import adaptive as A

    clock = FakeClock()
    inner = Recording(clock)
    ad = AdaptiveDrafter(inner, explore_every=0, clock=clock)
    ad._plain_leads = detaching_after(4)
    answer = [(2, False)]
    ad._argmax = lambda B, limit, budgets: answer[0]
    state = budgeted_state([50, 1000, 30])
    ad.begin(None, state)
    joining = budgeted_state([40] * 4)  # (detached: plain leads at 7 rows)
    ad.add_rows(None, joining)
    state.append(joining)

    def run(steps):
        fake_run(ad, clock, steps, B=7, target_time=lambda x: 1e-3, accept=lambda s, b, d: 0, state=state)

    run(20)
    assert inner.retired == [] and ad.attached == [True] * 3 + [False] * 4 and ad.history[-1] == 2
    answer[0] = (0, False)
    run(A._SHED_AFTER - 1)
    assert inner.retired == [] and ad.history[-1] == 0
    run(1)
    assert inner.retired == [[1]] and ad.attached == [False, True] + [False] * 5
    answer[0] = (2, False)
    tree = ad.propose(state, 10, ad.max_nodes)
    assert inner.calls[-1] == ("propose", 1) and inner.rows_seen == [1000]
    assert tree.row_depth == [0, 2] + [0] * 5 and tree.row_nodes == [1, 3] + [1] * 5
    ad.retire(torch.tensor([1, 3]))  # (the batch's rows leave: the inner drafter keeps its one row)
    assert inner.retired == [[1]] and ad.attached == [True, False]


def test_off_mode_never_hands_rows_to_the_inner_drafter():
    """Pinned to plain steps, the wrapper is plain decoding: its inner drafter sees no row, no step (and where the
    inner drafter cannot serve row subsets, it carries it as before)."""
    clock = FakeClock()
    inner = Recording(clock)
    off = AdaptiveDrafter(inner, mode="off", clock=clock)
    state = budgeted_state([40] * 3)
    off.begin(None, state)
    joining = budgeted_state([5000])
    off.add_rows(None, joining)
    state.append(joining)
    fake_run(off, clock, 5, B=4, target_time=lambda x: 0.01, accept=lambda s, b, d: d, state=state)
    off.retire(torch.tensor([0, 3, 2]))
    assert inner.calls == [] and inner.retired == [] and off.history == [0] * 5 and off.forwards == 0
    whole = Recording(clock)
    whole.serves_row_subsets = False
    AdaptiveDrafter(whole, mode="off", clock=clock).begin(None, budgeted_state([40]))
    assert whole.calls == [("begin", 1)]


def detaching_after(first: int):
    """An AdaptiveDrafter._plain_leads stand-in: plain leads once ``first`` rows are in the batch (the real test
    is above; here it makes rows that join later stay detached whatever the timings)."""
    return lambda B: B > first


@pytest.mark.parametrize("kind", ["draft", "eagle2_tree"])
def test_detached_rows_beside_speculating_rows_decode_as_plain_decoding(kind):
    """Requests that join detached share speculative steps with attached ones: every request's tokens equal HF's
    greedy decoding of its prompt alone, and speculative steps ran with detached rows in the batch."""
    import test_engine as engine_t
    import test_generate_batch as batch_t
    from hf_reference import hf_greedy

    from specdec_ext import Engine

    m, inner, prompts = batch_t.case(kind)
    ad = AdaptiveDrafter(inner, explore_every=2)
    ad._plain_leads = detaching_after(2)
    mixed = []
    propose = ad.propose

    def recording(state, max_depth, max_nodes):
        tree = propose(state, max_depth, max_nodes)
        mixed.append(ad._subset is not None and tree.num_nodes > 1)
        return tree

    ad.propose = recording
    budgets = [12 - 3 * (b % 3) for b in range(len(prompts))]
    arrivals = engine_t.staggered(prompts, budgets, 2)  # (2 at the start, then one a step)
    with Engine(m, ad, max_batch=4, max_len=128, eos_token_id=[]) as engine:
        tokens, reasons, _ = engine_t.run(engine, arrivals)
    for b, p in enumerate(prompts):
        assert tokens[b] == hf_greedy(m, p, budgets[b]), (kind, b)
    assert any(mixed) and False in ad.attached + [False], (mixed, ad.history)


def test_a_detached_sampled_row_draws_what_a_plain_step_draws():
    """A seeded sampled request left detached among speculating rows emits the tokens it emits where every step is
    plain ("off"): its padded tree is cut at its root, where verification draws with the step's first uniform as a
    plain step does."""
    import test_generate_batch as batch_t

    from specdec_ext import Engine

    def sampled(mode):
        m, inner, prompts = batch_t.case("draft")
        ad = AdaptiveDrafter(inner, mode=mode, explore_every=2)
        ad._plain_leads = detaching_after(1)
        with Engine(m, ad, max_batch=3, max_len=128, eos_token_id=[]) as engine:
            greedy = engine.add_request(prompts[0], max_new_tokens=30)
            out = {greedy: []}
            for r, new, _ in engine.step():  # (the greedy row first, attached: it drafts)
                out[r].extend(new)
            rid = engine.add_request(prompts[2], max_new_tokens=20, temperature=0.9, seed=7)
            out[rid] = []
            while engine.has_unfinished():
                for r, new, _ in engine.step():
                    out[r].extend(new)
                if len(ad.attached) == 2:
                    assert ad.attached == [mode == "adapt", False]
        return out[rid], ad

    off_tokens, _ = sampled("off")
    mixed_tokens, ad = sampled("adapt")
    assert mixed_tokens == off_tokens and any(d > 0 for d in ad.history), ad.history
