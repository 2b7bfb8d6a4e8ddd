"""Adaptive speculation: a drafter wrapper that picks each step's draft depth (or no speculation) from an online
cost model, to maximise expected tokens per second.

::

    drafter = AdaptiveDrafter(EagleDrafter.from_pretrained(...))          # mode="adapt" (default)
    drafter = AdaptiveDrafter(inner, mode="off")                           # pinned: plain decoding steps
    drafter = AdaptiveDrafter(inner, mode="fixed", depth=3)                # pinned: depth 3 every step
    tokens, stats = generate(target, drafter, prompts, max_new_tokens=128)
    drafter.depth_hist                                                     # {depth: steps}

The model. Each step, for the batch's ``B`` rows, the wrapper chooses the depth ``d`` in ``{0, 1, ..., D}`` (0: a
plain decoding step) maximising::

    E[tokens per row-step | d] / (t_target(B * N(d)) + t_draft(B, d) + t_join [d > 0])

* ``E[tokens | d] = 1 + sum_{i <= d} c_1 * ... * c_i``, ``c_i`` the conditional acceptance of depth i given depth
  i - 1 (:class:`DepthAcceptance`): decayed counts of the rows' verification outcomes, the decay clocked in
  row-steps so that the counts hold about ``1 / (1 - decay)`` outcomes at any batch size, applied when a depth is
  tried again but keeping ``_KEEP`` outcomes of its past (at one row an exploration is one sample); a weak prior
  makes an untried depth worth one try, never better than the measured depths above it.
* ``E[tokens per row-step | d]``: the mean over the rows of ``E[tokens | min(d, r - 1)]``, r the row's budget left
  (:meth:`emitted_tokens`): a step's tokens past a row's budget are verified and cut.
* ``t_target(x)``: the target's step as a function of tokens in flight ``x = B * N(d)`` (:class:`CostCurve`). A
  plain step is priced from a curve of its own over B (``plain_cost``), booked only from plain steps after
  ``_SETTLED`` in a row: a step costs what the steps before it left behind, and a plain step between speculative
  ones runs slower than one in a run of them. Beyond the batch sizes it measured, ``t_target(B)`` scaled by the
  two curves' ratio at the nearest one measured (a tree's tokens in flight cost more than as many rows' single
  tokens).
* ``t_draft(B, d)``: the inner drafter's propose + observe time, a curve over depths per batch size; where B has
  measured too few depths, the curve of the nearest batch size that did, scaled to B's measurements.
* ``t_join``: the inner drafter's prefill of rows that join while the batch speculates (a plain batch defers it),
  per speculative step.
* ``N(d)``: tree nodes at depth d as the inner drafter builds them (chains: ``d + 1``).

Times come from the wrapper's ``clock`` (default ``time.perf_counter``; tests inject one): propose and observe are
draft time, the span between them the target's step. The first step of a generation adds nothing to the curves
(first-shape effects). No change to the decode loop is needed.

The schedule (``mode="adapt"``). Depth 1, 0, 1 first (two target costs measured), then the argmax, climbing at most
one depth past the largest tokens in flight measured (beyond them a cost is an extrapolation). A clear answer
(``_HOLD_LEAD`` ahead of the runner-up) stands for ``_HOLD`` steps while the batch size, the depth bound and the lag's
presence hold (working it out is ~1-3% of a CPU step); close calls are worked out every step. The argmax adds
``optimism`` standard errors to measured acceptance (not decayed, so the bonus fades), so that at one row one unlucky
step does not settle the choice a depth short. Explorations try the argmax's neighbour in turn (one deeper, the
other shape, plain steps, one shallower; out of plain steps, depth 1) every ``explore_every`` steps, backing off to
``explore_backoff`` times that while the argmax holds, back to the base rate when it changes or the batch size moves
2x; a changing argmax does not restart the count (between close depths it changes every few steps). The plain turn
is a run of ``_SETTLED`` + 2 plain steps where none was priced in the last ``_PLAIN_SPACING * explore_every`` steps.

Plain steps and the lag. On a plain step the inner drafter is still asked (``propose(state, 0)``, a 1-node tree) and
observes the result; a drafter with its own model skips its forwards and catches up at the next speculative step.
While the batch has settled on plain steps (a new batch, or ``_SETTLED`` plain steps in a row) the wrapper defers the
inner drafter's prefill of joining rows (``defer_prefill=True`` where its ``defers_prefill`` says it can; not in
``"fixed"`` mode), so a generation that stays plain never pays for the draft's pass over the prompts; rows joining a
speculating batch are prefilled at once (caught up later, one join would pad every row's catch-up to its length).
The *lag* is the context tokens per row the drafter has not read. Catch-up time is booked apart from the depth's
steady cost, per lagging token and row (``catchup``, capped at twice a depth-1 step's drafting: one inflated
measurement must not keep plain steps for good). Leaving a lag is charged its catch-up spread over the steps the
rows' budgets would last at that depth; an exploration out of a lag is skipped where its catch-up exceeds
``catchup_budget`` of the plain steps until the next exploration.

Detached rows. Where the inner drafter can serve some of the batch's rows (``serves_row_subsets``), a row that joins
where the argmax at the batch's size with it is a plain step, and whose budget ends within ``_DETACH_HORIZON`` tokens,
is left detached: the inner drafter never holds it (no draft prefill, no feature writes, no cache rows to move when rows
leave). A speculative step drafts for the attached rows only (a state of those rows, in the inner drafter's order); the
detached ones take their root with padding under it, marked 0 deep, so that verification gives them a plain step's
token, greedy or seeded; the cost model counts them one token a step, and while fewer than half the rows are attached no
exploration runs (it would pay the whole batch's tree for a few rows' outcomes). The same rule lets attached rows go
(:meth:`_shed`): once the argmax has answered plain steps for ``_SHED_AFTER`` steps, attached rows whose budget ends
within the horizon leave the inner drafter where the argmax at the batch's size is a plain step, so that rows which
joined a small batch do not keep a filled one mixed to their end (a load that rises and falls within those steps keeps
them, to draft them when it falls). The price: a row detached at high load stays plain if the load drops before it
ends (at most ``_DETACH_HORIZON`` tokens). Rows with longer or unknown budgets join as before (deferred, caught up on),
so a long request admitted at high load is still drafted once the batch drains.
``"off"`` attaches no row (plain decoding, the inner drafter idle); ``"fixed"`` every row.

Tree or chain. An inner drafter whose trees are wider than a chain (``max_nodes > max_depth + 1``: EAGLE-2, Medusa,
suffix trees) offers a chain at every depth too, asked for as a node budget of one per depth; each shape has its own
acceptance, node counts and draft costs (the target's costs are shared), and the argmax runs over both (a wide tree
pays at one or two rows, its chain at more). ``chain_hist`` counts the chain steps.

Measurements behind these choices: docs/ARCHITECTURE.md, "Adaptive speculation".
"""

from __future__ import annotations

import bisect
import time

import torch

from specdec_ext.drafters.base import check_drafter
from specdec_ext.state import DecodeState, DraftTree, StepResult, plain_tree

__all__ = ["AdaptiveDrafter", "CostCurve", "DepthAcceptance"]

MODES = ("adapt", "off", "fixed")
# plain steps in a row after which the batch has settled on them: joining rows' draft prefill is deferred (see
# _defer), and a plain step's cost is the plain steps' own (see plain_cost)
_SETTLED = 4
_PLAIN_SPACING = 16  # explore_every's between explorations' runs of plain steps (a run every 256 steps: ~2% of them)
_KEEP = 8.0  # outcomes of a depth's past its acceptance keeps however long the gap before it is tried again
_HOLD = 4  # steps a clear argmax answers for while the batch size, the depth bound and the lag's presence hold
_HOLD_LEAD = 1.05  # clear: its score at least this much over the runner-up's (one sample a step moves scores ~1%)
# rows left detached (see "Detached rows" in the module doc): those that join where the argmax is a plain step, and
# whose budget ends within this many tokens (what a detached row loses if the load drops at once)
_DETACH_HORIZON = 64
_LEADS_FOR = 16  # steps an answer of _plain_leads stands for its batch size
_SHED_AFTER = 16  # steps of plain answers after which attached rows are let go (see _shed)


class DepthAcceptance:
    """One tree shape's acceptance per depth i (the module doc's counts): ``n[i]`` decayed row-steps that drafted
    depth i with depth i - 1 accepted, ``s[i]`` how many of them accepted depth i, ``tot[i]`` the row-steps not
    decayed, ``at[i]`` the row-step clock at the last update."""

    def __init__(self, max_depth: int):
        self.n = [0.0] * (max_depth + 1)
        self.s = [0.0] * (max_depth + 1)
        self.tot = [0.0] * (max_depth + 1)
        self.at = [0] * (max_depth + 1)

    def add(self, i: int, drafted: int, accepted: int, now: int, decay: float) -> None:
        """A step's outcome at depth i, decayed per row-step since the depth's last update (``now``: row-steps so
        far; lazily: an untried depth holds its estimate), but keeping the weight of at least ``_KEEP`` outcomes of
        its past: a depth tried again after a long gap (an exploration at one row) is not judged on that one step."""
        f = decay ** max(1, now - self.at[i])
        if self.n[i] > _KEEP:
            f = max(f, _KEEP / self.n[i])
        self.n[i] = f * self.n[i] + drafted
        self.s[i] = f * self.s[i] + accepted
        self.at[i] = now
        self.tot[i] += drafted

    def conditional(self, prior_accept: float, weight: float, optimism: float = 0.0,
                    priors: list[float] | None = None) -> list[float]:
        """``[i]``: the estimated P(depth i accepted | depth i - 1 accepted) (index 0 unused). The prior of depth i
        is ``priors[i]`` when given, else ``prior_accept``, or the estimate of depth i - 1 when that is higher (a
        drafter that keeps its drafts at depth i - 1 is expected to keep them one deeper as well, until measured).
        ``optimism``: measured depths get that many standard errors on top (``sqrt(c (1 - c) / n)``, n their
        row-steps so far + the prior's)."""
        out, prev = [1.0], prior_accept
        for i in range(1, len(self.n)):
            prior = priors[i] if priors is not None else max(prior_accept, prev) if i > 1 else prior_accept
            prev = (self.s[i] + weight * prior) / (self.n[i] + weight)
            if optimism and self.tot[i] > 0:
                out.append(min(1.0, prev + optimism * (prev * (1.0 - prev) / (self.tot[i] + weight)) ** 0.5))
            else:
                out.append(prev)
        return out


class CostCurve:
    """A decayed, non-decreasing, piecewise-linear curve y(x) learned from measurements.

    Each measured x keeps an exponential moving average of its y (the first measurements are averaged plainly,
    then weight ``alpha`` on the newest); a point's first measurement stands in until its second replaces it: the
    first run of a shape, and a batch's first steps after its prefill, run slow (plain steps at eight rows on the
    family: 7.9, 6.9, 6.3, 5.3, 4.9, then 4.2 ms), and one such sample, at a point seldom measured again, priced
    it for good. Prediction uses the isotonic (non-decreasing) fit of those means
    (pool-adjacent-violators, weighted by sample counts), linear between measured points, extrapolated with the
    slope over the whole measured range (>= 0; flat with one point; robust where neighbouring points are close and
    noisy), never below 0.
    """

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.points: dict[float, list[float]] = {}  # x -> [mean y, count]
        self._first: set[float] = set()  # points whose one measurement is their first (the next replaces it)
        self._fit: tuple[list[float], list[float]] | None = None
        self._lo, self._hi = float("inf"), float("-inf")  # the measured range

    def __len__(self) -> int:
        return len(self.points)

    def add(self, x: float, y: float) -> None:
        p = self.points.get(x)
        if p is None:
            self.points[x] = [float(y), 1.0]
            self._first.add(x)
            self._lo, self._hi = min(self._lo, x), max(self._hi, x)
        elif x in self._first:
            self._first.discard(x)
            p[0] = float(y)
        else:
            p[1] += 1.0
            p[0] += max(1.0 / p[1], self.alpha) * (y - p[0])
        self._fit = None

    def measured(self, x: float) -> bool:
        return x in self.points

    def nearest_end(self, x: float) -> float:
        """The end of the measured range nearest ``x`` (the lowest measured x where ``x`` lies below the range, else
        the highest)."""
        return self._lo if x < self._lo else self._hi

    def covers(self, x: float) -> bool:
        """Whether x was measured or lies between measured points (a prediction there is an interpolation)."""
        return self._lo <= x <= self._hi and (x in self.points or len(self.points) > 1)

    def _fitted(self) -> tuple[list[float], list[float]]:
        if self._fit is None:
            xs = sorted(self.points)
            cap = 1.0 / self.alpha  # weights stop growing where the moving average stops averaging
            blocks: list[list[float]] = []  # [mean, weight, n_points]
            for x in xs:
                y, n = self.points[x]
                blocks.append([y, min(n, cap), 1])
                while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                    y2, w2, k2 = blocks.pop()
                    y1, w1, k1 = blocks.pop()
                    blocks.append([(y1 * w1 + y2 * w2) / (w1 + w2), w1 + w2, k1 + k2])
            ys = [b[0] for b in blocks for _ in range(int(b[2]))]
            self._fit = (xs, ys)
        return self._fit

    def predict(self, x: float) -> float | None:
        if not self.points:
            return None
        xs, ys = self._fitted()
        if len(xs) == 1:
            return ys[0]
        i = bisect.bisect_left(xs, x)
        if i < len(xs) and xs[i] == x:
            return ys[i]
        if 0 < i < len(xs):
            j, k = i - 1, i
        else:  # outside the measured range: the slope over the whole range (neighbouring points can be noisy)
            j, k = 0, len(xs) - 1
        slope = max((ys[k] - ys[j]) / (xs[k] - xs[j]), 0.0)
        base = j if i < len(xs) else k
        return max(ys[base] + slope * (x - xs[base]), 0.0)


def _caps(budgets: list[int] | None, max_depth: int) -> list[int] | None:
    """``[k]``: the rows whose budget stops their emission at depth k (``budget - 1``; rows past ``max_depth``
    count at it), or None where the budgets are not known."""
    if not budgets:
        return None
    caps = [0] * (max_depth + 1)
    for r in budgets:
        caps[min(max(r - 1, 0), max_depth)] += 1
    return caps


def _within_budgets(expected: list[float], caps: list[int] | None) -> list[float]:
    """``[d]``: ``expected[min(d, k)]`` averaged over rows by their cap k (:func:`_caps`; None: ``expected``)."""
    if caps is None:
        return expected
    rows, out, below, n_below = sum(caps), [], 0.0, 0
    for d, e in enumerate(expected):
        out.append((below + (rows - n_below) * e) / rows)
        below, n_below = below + caps[d] * e, n_below + caps[d]
    return out


def _ends_soon(budget: int | None) -> bool:
    """Whether a row with ``budget`` tokens left (None: not known) may be left detached: it ends within
    ``_DETACH_HORIZON`` tokens."""
    return budget is not None and budget <= _DETACH_HORIZON


def _in_batch(tree: DraftTree, rows: list[int], roots: torch.Tensor) -> DraftTree:
    """``tree`` (the trees of the batch's rows ``rows``, in order) as the whole batch's: every other row its root
    with a chain of padding under it (``row_depth`` 0, which verification ignores: a plain step for that row, its
    random stream as in one; where the tree carries draft probabilities, the padding's are one-hot on its token)."""
    B, N = roots.shape[0], tree.num_nodes
    if N == 1:
        return plain_tree(roots)
    dev = roots.device
    index = torch.tensor(rows, dtype=torch.int64, device=dev)
    tokens = roots[:, None].expand(B, N).clone().index_copy_(0, index, tree.tokens)
    parents = torch.arange(-1, N - 1, device=dev).expand(B, N).clone().index_copy_(0, index, tree.parents)
    probs = None
    if tree.draft_probs is not None:
        V = tree.draft_probs.shape[-1]
        probs = torch.zeros(B, N, V, dtype=tree.draft_probs.dtype, device=dev)
        probs.scatter_(2, roots[:, None, None].expand(B, N, 1), 1.0).index_copy_(0, index, tree.draft_probs)
    depth, nodes = [0] * B, [1] * B
    for j, i in enumerate(rows):
        depth[i] = tree.row_depth[j] if tree.row_depth is not None else N - 1
        nodes[i] = tree.row_nodes[j] if tree.row_nodes is not None else N
    return DraftTree(tokens, parents, probs, row_depth=depth, row_nodes=nodes)


def _check_number(name: str, value, low: float, high: float, low_open: bool = False, high_open: bool = False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise ValueError(f"AdaptiveDrafter: {name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")


class AdaptiveDrafter:
    """Wraps any drafter and chooses each step's depth (see the module doc).

    ``mode``: ``"adapt"`` (default: the cost model decides; ``depth`` optionally caps the depths considered),
    ``"off"`` (every step a plain decoding step) or ``"fixed"`` (every step ``depth`` deep; ``depth`` required).
    ``depth`` may not exceed the inner drafter's own depth. ``decay``: decay of the acceptance counts per row-step
    (0.97: about the last 33 outcomes of a depth matter, whatever the batch size). ``explore_every``: steps between exploration steps (0 = never);
    ``explore_backoff``: how far that gap may grow (times ``explore_every``) while the choice holds.
    ``catchup_budget``: explorations out of plain steps are skipped where the drafter's catch-up on the lag exceeds
    this share of the plain steps until the next exploration (``inf``: never skipped). ``optimism``: standard errors added to measured acceptance
    in the choice (0: the plain estimate).
    ``prior_accept`` / ``prior_weight``: the prior of each depth's conditional acceptance and its weight in
    row-steps. ``cost_alpha``: weight of the newest timing in the cost curves' moving averages. ``clock``: a
    function returning seconds (default ``time.perf_counter``).

    After a generation: ``depth_hist`` ({depth: steps}, all generations), ``chain_hist`` (the same, of the steps
    that drafted a chain of a wider drafter), ``history`` (this generation's depths), ``explorations`` (exploration
    steps, all generations), ``expected_tokens(d, chain)``, ``predicted_step_time(B, d, chain)``.
    """

    def __init__(self, inner, mode: str = "adapt", depth: int | None = None, *, decay: float = 0.97,
                 explore_every: int = 16, explore_backoff: int = 4, prior_accept: float = 0.7,
                 prior_weight: float = 1.0, cost_alpha: float = 0.2, catchup_budget: float = 0.05,
                 optimism: float = 1.0, clock=None):
        check_drafter("AdaptiveDrafter: inner", inner)
        if mode not in MODES:
            raise ValueError(f"AdaptiveDrafter: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        inner_depth = inner.max_depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
            raise ValueError(f"AdaptiveDrafter: depth must be an integer >= 0, got {depth!r}")
        if depth is not None and depth > inner_depth:
            raise ValueError(f"AdaptiveDrafter: depth = {depth} exceeds the inner drafter's depth ({inner_depth}); "
                             "build the inner drafter deeper")
        if mode == "fixed" and depth is None:
            raise ValueError("AdaptiveDrafter: mode='fixed' needs depth (the pinned draft depth)")
        if mode == "off" and depth not in (None, 0):
            raise ValueError(f"AdaptiveDrafter: mode='off' takes no depth (got depth={depth!r}); it never speculates")
        _check_number("decay", decay, 0.0, 1.0, low_open=True, high_open=True)
        if isinstance(explore_every, bool) or not isinstance(explore_every, int) or explore_every < 0:
            raise ValueError(f"AdaptiveDrafter: explore_every must be an integer >= 0 (0 = never), got "
                             f"{explore_every!r}")
        if isinstance(explore_backoff, bool) or not isinstance(explore_backoff, int) or explore_backoff < 1:
            raise ValueError(f"AdaptiveDrafter: explore_backoff must be an integer >= 1 (1 = no backoff), got "
                             f"{explore_backoff!r}")
        _check_number("prior_accept", prior_accept, 0.0, 1.0)
        _check_number("prior_weight", prior_weight, 0.0, float("inf"), low_open=True, high_open=True)
        _check_number("cost_alpha", cost_alpha, 0.0, 1.0, low_open=True)
        _check_number("catchup_budget", catchup_budget, 0.0, float("inf"))  # inf: never skip
        _check_number("optimism", optimism, 0.0, 10.0)
        if clock is not None and not callable(clock):
            raise TypeError(f"AdaptiveDrafter: clock must be a function returning seconds, got {clock!r}")
        self.inner = inner
        self.mode = mode
        # pinned depths speculate from the first step: the prefill costs the same then, and "fixed" stays the inner
        # drafter as it is. (As the protocol's member: its begin / add_rows defer the inner drafter's prefill.)
        self.defers_prefill = bool(inner.defers_prefill) and mode != "fixed"
        self.serves_row_subsets = bool(inner.serves_row_subsets)
        # whether rows may join without the inner drafter (a pinned depth drafts every row as the inner drafter would)
        self._detaches = self.serves_row_subsets and mode != "fixed"
        self.max_depth = inner_depth if depth is None else depth  # deepest depth considered
        if mode == "off":
            self.max_depth = 0
        # the shapes the argmax chooses from: the inner drafter's trees, and chains where its trees are wider
        self.shapes = (False, True) if mode == "adapt" and int(inner.max_nodes) > inner_depth + 1 else (False,)
        self.decay = float(decay)
        self.explore_every = explore_every
        self.explore_backoff = explore_backoff
        self.prior_accept = float(prior_accept)
        self.prior_weight = float(prior_weight)
        self.cost_alpha = float(cost_alpha)
        self.catchup_budget = float(catchup_budget)
        self.optimism = float(optimism)
        self.clock = clock or time.perf_counter
        self.reset()

    # ---- the protocol ---------------------------------------------------------------------------------------------
    @property
    def max_nodes(self) -> int:
        return int(self.inner.max_nodes)

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        return tuple(self.inner.hidden_state_layers)

    @property
    def forwards(self) -> int:
        return self._forwards_before + (int(self.inner.forwards) if self._n_attached else 0)

    def reset(self) -> None:
        """Forget everything learned (acceptance, costs, node counts, histograms)."""
        D = self.max_depth
        self.acceptance = {chain: DepthAcceptance(D) for chain in (False, True)}  # per shape (chain?)
        self.target_cost = CostCurve(self.cost_alpha)  # x = tokens in flight -> seconds
        self.plain_cost = CostCurve(self.cost_alpha)  # x = batch rows -> seconds, of plain steps in a run of them
        self._plain_run = 0  # plain steps in a row so far
        self._spec_chosen_at = 0  # steps_total when the argmax last answered a speculative step (see _shed)
        self._plain_left = 0  # plain steps an exploration still asks for
        self._plain_at = None  # steps_total when a plain step's cost was last booked in plain_cost
        self.draft_cost: dict[tuple[int, bool], CostCurve] = {}  # (batch rows, chain?) -> (depth -> seconds)
        self.nodes: dict[tuple[int, bool], float] = {}  # (depth, chain?) -> mean tree nodes
        self.catchup: dict[int, float] = {}  # batch rows -> draft seconds per lagging token and row (caught up on)
        self._lag = 0
        self.join_cost = 0.0  # seconds per speculative step of the inner drafter's prefill of joining rows
        self._join_s = 0.0  # ... accumulated since the last step
        self.depth_hist: dict[int, int] = {}
        self.chain_hist: dict[int, int] = {}
        self.history: list[int] = []
        self.steps_total = 0
        self.row_steps_total = 0  # the acceptance counts' clock (see DepthAcceptance.add)
        self._pending = None
        self._since_explore = 0  # steps since the last exploration step (across generations)
        self._explore_gap = self.explore_every  # steps between explorations now (grows while the choice holds)
        self._explore_turn = 0  # which neighbour the next exploration tries (deeper, other shape, shallower, ...)
        self._last_best: tuple[int, bool] | None = None  # the argmax (depth, chain?) of the last step
        self._held: tuple | None = None  # ((B, limit, lagging?), argmax, steps it still answers for)
        self._base_rows = 0  # the batch rows when the exploration rate last restarted
        self.explorations = 0
        self._set_slots([])
        self._forwards_before = 0  # the inner drafter's forwards this generation, before its last begin
        self._subset: tuple[list[int], DraftTree] | None = None  # a step's attached rows and their tree, when some
        self._leads: dict[int, tuple[int, bool]] = {}  # batch rows -> (steps_total, _plain_leads' answer then)

    def begin(self, target: torch.nn.Module, state: DecodeState, prefill_hidden_states=None, *,
              defer_prefill: bool = False) -> None:
        """A new batch: its rows join as in :meth:`add_rows` (the inner drafter begins with those it holds)."""
        self._lag = 0
        self.history = []  # (before _defer: a new batch is not speculating yet)
        self._set_slots([])
        self._forwards_before = 0
        self._join(target, state, prefill_hidden_states)
        self._gen_step = 0
        self._pending = None
        self._held = None

    def add_rows(self, target: torch.nn.Module, rows: DecodeState, prefill_hidden_states=None, *,
                 defer_prefill: bool = False) -> None:
        """The joining rows go to the inner drafter (its prefill deferred as the module doc says), except those
        left detached (:meth:`_attaching`). A prefill that runs now (the batch speculates) is timed: joins are a
        cost of speculating (:attr:`join_cost`)."""
        self._join(target, rows, prefill_hidden_states)

    def _join(self, target: torch.nn.Module, rows: DecodeState, hidden) -> None:
        attach = self._attaching(rows)
        keep = [i for i, a in enumerate(attach) if a]
        held = self._n_attached
        slot = iter(range(held, held + len(keep)))  # (they join as its last rows)
        self._set_slots(self._slots + [next(slot) if a else -1 for a in attach])
        if not keep:
            return
        if len(keep) < len(attach):
            index = torch.tensor(keep, dtype=torch.int64, device=rows.device)
            rows = rows.rows_of(keep)
            hidden = None if hidden is None else tuple(h.index_select(0, index) for h in hidden)
        kw = self._defer(rows)
        if not held:  # (the inner drafter holds no row: its rows start a batch of its own)
            self.inner.begin(target, rows, hidden, **kw)
        else:
            t0 = self.clock()
            self.inner.add_rows(target, rows, hidden, **kw)
            if not kw:
                self._join_s += self.clock() - t0

    def _set_slots(self, slots: list[int]) -> None:
        """Per batch row, its row in the inner drafter (-1: detached), and what follows from them: how many rows
        the inner drafter holds, and whether calls pass through as they are (every row attached, row i its row i)."""
        self._slots = slots
        self._n_attached = sum(x >= 0 for x in slots)
        self._direct = slots == list(range(len(slots)))

    def _attaching(self, rows: DecodeState) -> list[bool]:
        """Which of the joining ``rows`` the inner drafter takes. All of them, but where rows may be left detached
        (an inner drafter that serves row subsets, not a pinned depth): none in ``"off"`` mode; in ``"adapt"`` those
        whose budget ends within ``_DETACH_HORIZON`` tokens where the argmax at the batch's size with them is a plain
        step (:meth:`_plain_leads`)."""
        n = rows.batch_size
        if not self._detaches:
            return [True] * n
        if self.mode == "off":
            return [False] * n
        budgets = rows.budgets or [None] * n
        if not any(map(_ends_soon, budgets)) or not self._plain_leads(len(self._slots) + n):
            return [True] * n
        return [not _ends_soon(b) for b in budgets]

    def _plain_leads(self, B: int) -> bool:
        """Whether the argmax at B rows is a plain step (:meth:`best_step`, its costs as now: the lag's catch-up
        included; False while a cost is unknown). Worked out once per B every ``_LEADS_FOR`` steps (at high load
        rows join every step, and each answer walks every depth's cost)."""
        known = self._leads.get(B)
        if known is not None and self.steps_total - known[0] < _LEADS_FOR:
            return known[1]
        leads = self.best_step(B, self.max_depth) == (0, False)
        self._leads[B] = (self.steps_total, leads)
        return leads

    def _defer(self, rows: DecodeState) -> dict:
        """The inner drafter's ``defer_prefill`` keyword for ``rows``, and the lag it leaves: context tokens per row
        the inner drafter has not read (it catches up on them when it next drafts). The wrapper defers where it can
        (``defers_prefill``), whatever its caller asks, where the batch has settled on plain steps (a new batch, or
        the last ``_SETTLED`` steps all plain). Elsewhere the batch speculates or soon will, and deferred rows would
        be caught up on at its next speculative step, in one forward padded to their lag over every row of the
        batch (a join of one row at 8 rows cost that step ~4x the joining row's own prefill; a plain step between
        speculative ones, ~8x): they are prefilled at once."""
        recent = self.history[-_SETTLED:]
        if not self.defers_prefill or (recent and (len(recent) < _SETTLED or any(recent))):
            return {}
        self._lag = max(self._lag, max(rows.prompt_lens) - 1)
        return {"defer_prefill": True}

    def retire(self, keep: torch.Tensor) -> None:
        """Rows leave the batch (``keep``: int64 indices of the rows that stay); the inner drafter's rows among them
        leave it. The next steps see the new batch size through the state, and the cost model through the tokens in
        flight."""
        rows = keep.tolist()
        if self._direct:  # (every row attached, in the batch's order: the engine's keep as it is)
            self._inner_keep(rows, keep, list(range(len(rows))))
        else:
            self._compact([self._slots[i] for i in rows])

    def _compact(self, slots: list[int]) -> None:
        """The batch's rows' slots once some of the inner drafter's rows were let go (absent from ``slots``, or
        turned -1): they leave it as the engine's rows do, each slot freed below the survivors' count taken by a
        survivor from its end, so that its caches move as few rows as possible."""
        alive = sorted(x for x in slots if x >= 0)
        m = len(alive)
        taken = set(alive)
        holes = iter(j for j in range(m) if j not in taken)
        moved = {x: next(holes) for x in alive if x >= m}
        inner_rows = list(range(m))
        for x, j in moved.items():
            inner_rows[j] = x
        self._inner_keep(inner_rows, None, [moved.get(x, x) for x in slots])

    def _inner_keep(self, inner_rows: list[int], keep: torch.Tensor | None, slots: list[int]) -> None:
        """The inner drafter keeps its rows ``inner_rows`` (``keep``: the same as a tensor, or None), and the batch's
        rows take ``slots``."""
        if self._n_attached and inner_rows != list(range(self._n_attached)):
            if not inner_rows:  # (its next rows begin a batch of its own, counting its forwards afresh)
                self._forwards_before += int(self.inner.forwards)
            self.inner.retire(keep if keep is not None else torch.tensor(inner_rows, dtype=torch.int64))
        self._set_slots(slots)
        if not inner_rows:
            self._lag = 0  # (no row the inner drafter would catch up on)

    def _shed(self, budgets: list[int] | None) -> None:
        """Once the argmax has answered plain steps for ``_SHED_AFTER`` steps, lets go of the attached rows that would
        be left detached if they joined now (:meth:`_attaching`): whose budget ends within ``_DETACH_HORIZON`` tokens
        where the argmax at the batch's size is a plain step. Rows that joined a small batch which then filled would
        otherwise keep its plain steps mixed (the inner drafter's calls on a subset of the rows) to their end; a load
        that rises and falls within those steps keeps them, to draft when it falls."""
        B = len(self._slots)
        if not budgets or self.steps_total - self._spec_chosen_at < _SHED_AFTER:
            return
        going = [i for i, x in enumerate(self._slots) if x >= 0 and _ends_soon(budgets[i])]
        if going and self._plain_leads(B):
            slots = list(self._slots)
            for i in going:
                slots[i] = -1
            self._compact(slots)

    @property
    def attached(self) -> list[bool]:
        """Per batch row: whether the inner drafter holds it (see "Detached rows" in the module doc)."""
        return [x >= 0 for x in self._slots]

    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        B = state.batch_size
        if self._lag:  # (no row lags by more than its context: rows that ran up a long lag may have left)
            self._lag = min(self._lag, max(len(t) for t in state.host_tokens) - 1)
        self._subset = None
        if self._detaches and self._n_attached:
            self._shed(state.budgets)
        if not self._direct and not self._n_attached:  # (no row to draft for: a plain step, nothing to choose)
            d, chain = 0, False
            t0 = t1 = self.clock()
            tree = plain_tree(state.last_tokens)
        else:
            budgets = state.budgets
            if not self._direct:  # a detached row emits one token at any depth
                budgets = [r if x >= 0 else 1 for r, x in zip(budgets or [None] * B, self._slots)]
            d, chain = self.choose(B, max_depth, budgets)
            # (the draft time is the inner drafter's alone: the argmax is paid whatever it answers, and a clear
            # answer that stands costs nothing, so timing it in made a close call's depth look dearer than a clear
            # one's)
            t0 = self.clock()
            nodes = min(max_nodes, d + 1) if chain else max_nodes
            if self._direct:
                tree = self.inner.propose(state, d, nodes)
            else:
                rows = [0] * self._n_attached  # the batch row of each inner row, in the inner drafter's order
                for i, x in enumerate(self._slots):
                    if x >= 0:
                        rows[x] = i
                sub = self.inner.propose(state.rows_of(rows), d, nodes)
                self._subset = (rows, sub)
                tree = _in_batch(sub, rows, state.last_tokens)
            t1 = self.clock()
        self._pending = (B, d, chain, tree.num_nodes, t0, t1)
        self.history.append(d)
        self.depth_hist[d] = self.depth_hist.get(d, 0) + 1
        if chain:
            self.chain_hist[d] = self.chain_hist.get(d, 0) + 1
        self.steps_total += 1
        self.row_steps_total += B
        return tree

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult) -> None:
        t2 = self.clock()
        lens = result.host_accept_len
        if self._subset is not None:
            rows, sub = self._subset
            self.inner.observe(state.rows_of(rows), sub, result.rows_of(rows))
            lens = [lens[i] for i in rows]  # (a detached row's walk was cut at its root: not an outcome)
        elif self._direct:
            self.inner.observe(state, tree, result)
        t3 = self.clock()
        if self._pending is None:
            return
        B, d, chain, N, t0, t1 = self._pending
        self._pending = None
        # node counts at this depth and shape
        if d > 0:
            old = self.nodes.get((d, chain))
            self.nodes[d, chain] = float(N) if old is None else old + 0.5 * (N - old)
        # joins since the last step, while speculating: their draft prefill ran at once (a plain batch defers it)
        joined, self._join_s = self._join_s, 0.0
        if d > 0 and len(self.history) > 1 and self.history[-2] > 0:
            self.join_cost += self.cost_alpha * (joined - self.join_cost)
        # timings (the generation's first step adds nothing to the curves: first-shape effects)
        lag, self._lag = self._lag, (self._lag + 1 if d == 0 and self._n_attached else 0)
        dt = (t1 - t0) + (t3 - t2)
        if d > 0 and lag > 0:  # the drafter caught up on `lag` tokens: not this depth's steady cost
            if any(c.covers(d) for (_, ch), c in self.draft_cost.items() if ch == chain):  # (the excess over it,
                excess = max(0.0, dt - self._draft_time(B, d, chain)) / (lag * B)  # when known: per token and row)
                old = self.catchup.get(B)
                self.catchup[B] = excess if old is None else old + self.cost_alpha * (excess - old)
        elif self._gen_step > 0:
            key = (B, chain and d > 0)
            if key not in self.draft_cost:
                self.draft_cost[key] = CostCurve(self.cost_alpha)
            self.draft_cost[key].add(d, dt)
        if self._gen_step > 0:
            self.target_cost.add(B * N, t2 - t1)
            if d == 0 and self._plain_run >= _SETTLED:
                self.plain_cost.add(B, t2 - t1)
                self._plain_at = self.steps_total
        self._plain_run = self._plain_run + 1 if d == 0 else 0
        self._gen_step += 1
        # acceptance: each row's verification outcome (``host_accept_len``), finished rows included: a row that
        # reached its budget or a stop inside the step was cut after its verification, and leaving it out drops the
        # steps that accepted the most (the last one of a request; at one row it took 4% off E[tokens] at depth 6).
        # Depths past the tree's (a chain cut short: no n-gram match, an unsure draft model) were not drafted: no
        # outcome either.
        d = min(d, N - 1)
        if d > 0:
            elig = [0] * (d + 1)
            succ = [0] * (d + 1)
            for L in lens:
                L = min(L, d)
                for i in range(1, min(L + 1, d) + 1):  # depths 1 .. L + 1 were reached (depth i needs i - 1 accepted)
                    elig[i] += 1
                    if L >= i:
                        succ[i] += 1
            acc = self.acceptance[chain]
            for i in range(1, d + 1):
                if elig[i]:
                    acc.add(i, elig[i], succ[i], self.row_steps_total, self.decay)

    # ---- the model ------------------------------------------------------------------------------------------------
    def conditional_acceptance(self, i: int, chain: bool = False) -> float:
        """Estimated P(depth i accepted | depth i - 1 accepted) for the shape (``chain``: the chain of a wider
        drafter)."""
        return self._conditional(0.0, chain)[i]

    def _conditional(self, optimism: float = 0.0, chain: bool = False) -> list[float]:
        """``[i]``: the shape's estimated conditional acceptance of depth i (:meth:`DepthAcceptance.conditional`);
        a chain's prior is the tree's estimate."""
        tree = self.acceptance[False].conditional(self.prior_accept, self.prior_weight, 0.0 if chain else optimism)
        if not chain:
            return tree
        return self.acceptance[True].conditional(self.prior_accept, self.prior_weight, optimism, priors=tree)

    def expected_tokens(self, d: int, optimism: float = 0.0, chain: bool = False) -> float:
        """Estimated tokens per row-step at depth d: ``1 + sum_{i <= d} P(accept >= i)`` (``optimism``: see
        ``_conditional``)."""
        return self._expected(optimism, chain)[d]

    def _expected(self, optimism: float, chain: bool) -> list[float]:
        """``[d]``: :meth:`expected_tokens` at every depth 0..max_depth, from one pass over the conditionals."""
        out, e, p = [1.0], 1.0, 1.0
        for c in self._conditional(optimism, chain)[1:]:
            p *= c
            e += p
            out.append(e)
        return out

    def nodes_at(self, d: int, chain: bool = False) -> float:
        """Tree nodes at depth d: measured, else ``d + 1`` kept between the shape's measured neighbours' counts."""
        if d == 0:
            return 1.0
        n = self.nodes.get((d, chain))
        if n is not None:
            return n
        same = {k: v for (k, ch), v in self.nodes.items() if ch == chain}
        lo = max((v for k, v in same.items() if k < d), default=1.0)
        hi = min((v for k, v in same.items() if k > d), default=float(d + 1 if chain else self.max_nodes))
        return min(max(float(d + 1), lo), max(hi, lo), float(self.max_nodes))

    def _draft_time(self, B: int, d: int, chain: bool = False) -> float:
        """Draft seconds at depth d with B rows (:meth:`_draft_curve`)."""
        return self._draft_curve(B, chain and d > 0)(d)

    def _draft_curve(self, B: int, chain: bool):
        """Draft seconds as a function of depth with B rows, for one shape. From B's own curve at the depths it
        measured or lies between; else the shape of the nearest batch size (by ratio) that covers the depth, scaled
        by what B measured at the depths both measured (one measured depth says how expensive drafting is at B, not
        how it grows with depth: a flat extrapolation from it would price a plain step like a deep one). A plain
        step is the same step in both shapes: booked under the tree's. (One call per step and shape: the argmax
        asks every depth, and the scale of a reference curve is worked out once.)"""
        curves = {b: c for (b, ch), c in self.draft_cost.items() if ch == chain}
        own = curves.get(B)
        scales: dict[int, float | None] = {}

        def scale(ref: int) -> float | None:  # own / ref over the depths both measured (None: none; nan: ref's 0)
            if ref not in scales:
                common = [k for k in own.points if k > 0 and curves[ref].covers(k)]  # (depth 0: near-zero, noisy)
                num = sum(own.predict(k) or 0.0 for k in common)
                den = sum(curves[ref].predict(k) or 0.0 for k in common)
                scales[ref] = None if not common else num / den if den > 0 else float("nan")
            return scales[ref]

        def at(d: int) -> float:
            if d == 0 and chain:
                return self._draft_time(B, 0)  # (the argmax never asks: a plain step is priced under the tree's)
            if own is not None and own.covers(d):
                return own.predict(d) or 0.0
            others = [b for b, c in curves.items() if b != B and c.covers(d)]
            if not others:
                return (own.predict(d) if own is not None else None) or 0.0
            ref = min(others, key=lambda b: (max(b / B, B / b), b))
            t_ref = curves[ref].predict(d) or 0.0
            f = scale(ref) if own is not None else None
            if f is None:
                return t_ref
            return t_ref * f if f == f else (own.predict(d) or 0.0)
        return at

    def predicted_step_time(self, B: int, d: int, chain: bool = False) -> float | None:
        """Predicted seconds of one step at depth d (and shape) with B rows (None before any timing): the target's
        and the drafter's, and for d > 0 the draft prefills of the rows that join a speculating batch, per step."""
        return self._step_time(B, d, chain, self._draft_curve(B, chain and d > 0))

    def _step_time(self, B: int, d: int, chain: bool, draft) -> float | None:
        """:meth:`predicted_step_time` with the shape's draft curve at B (:meth:`_draft_curve`) given."""
        t = self._plain_time(B) if d == 0 else self.target_cost.predict(B * self.nodes_at(d, chain))
        if t is None:
            return None
        return t + draft(d) + (self.join_cost if d > 0 else 0.0)

    def _plain_time(self, B: int) -> float | None:
        """The target's seconds of a plain step at B rows: ``plain_cost`` where it covers B; beyond the batch sizes it
        measured, the target curve at B tokens in flight scaled by what the two say at the nearest one measured (a
        speculative step's tokens cost more than as many rows' single tokens: its tree's verification), as the draft
        curves borrow a measured shape; the target curve as it is before any plain step was priced."""
        plain, target = self.plain_cost, self.target_cost
        if plain.covers(B):
            return plain.predict(B)
        t = target.predict(B)
        if t is None or not len(plain):
            return t
        ref = plain.nearest_end(B)
        t_ref = target.predict(ref)
        return t * plain.predict(ref) / t_ref if t_ref else t

    def score(self, B: int, d: int, optimism: float = 0.0, chain: bool = False) -> float | None:
        """Expected tokens per second per row at depth d and shape (None before any timing)."""
        t = self.predicted_step_time(B, d, chain)
        if t is None:
            return None
        return self.expected_tokens(d, optimism, chain) / max(t, 1e-12)

    def best_step(self, B: int, limit: int, budgets: list[int] | None = None) -> tuple[int, bool]:
        """The (depth, chain?) with the best score among depths 0..limit and the shapes, each shape going at most
        one depth past the largest tokens in flight measured so far (costs beyond it are extrapolated: climb one
        step at a time instead of jumping). ``budgets``: the tokens each row may still emit (None: unknown; see
        :meth:`emitted_tokens`)."""
        return self._ranked(B, limit, budgets)[0]

    def emitted_tokens(self, d: int, budgets: list[int] | None, optimism: float = 0.0, chain: bool = False) -> float:
        """Estimated tokens a row emits at depth d, on average over rows with ``budgets`` tokens left: each row's
        :meth:`expected_tokens` at depth ``min(d, budget - 1)``, since the verification's tokens past a row's budget
        are cut (``budgets`` None: not known, no cut)."""
        return self._emitted(optimism, chain, _caps(budgets, self.max_depth))[d]

    def _emitted(self, optimism: float, chain: bool, caps: list[int] | None) -> list[float]:
        """``[d]``: :meth:`emitted_tokens` at every depth, for rows whose caps :func:`_caps` counted."""
        return _within_budgets(self._expected(optimism, chain), caps)

    def _ranked(self, B: int, limit: int, budgets: list[int] | None) -> tuple[tuple[int, bool], float]:
        """:meth:`best_step`'s answer and its lead: its score over the runner-up's (inf without one; 1 where the
        answer is a climb's step past the measured costs, or no cost is known yet)."""
        best, best_s, best_beyond, second_s = (0, False), None, False, 0.0
        max_x = max(self.target_cost.points, default=0.0)
        c = self._catchup_at(B) if self._lag > 0 else None
        catchup = c * self._lag if c else 0.0
        climbing = set(self.shapes)
        caps = _caps(budgets, self.max_depth)
        remaining = sum(budgets) / len(budgets) if budgets else None
        expected = {chain: self._emitted(self.optimism, chain, caps) for chain in self.shapes}  # (once per step)
        draft = {chain: self._draft_curve(B, chain) for chain in self.shapes}
        for d in range(0, limit + 1):
            for chain in (self.shapes if d > 0 else (False,)):
                if chain not in climbing:
                    continue
                t = self._step_time(B, d, chain, draft[chain])
                if t is None:
                    return (min(1, limit), False), 1.0
                e = expected[chain][d]
                if d > 0 and catchup:
                    # leaving plain decoding costs the drafter's catch-up on the lag once, spread over the steps that
                    # depth would take to spend the rows' budgets (in a draining batch a few; unknown budgets:
                    # ``explore_every``)
                    steps = max(remaining / e, 1.0) if remaining is not None else max(self.explore_every, 1)
                    s = e / (t + catchup / steps)
                else:
                    s = e / max(t, 1e-12)  # (= score(B, d, optimism, chain) where the budgets are not known)
                beyond = B * self.nodes_at(d, chain) > max_x
                if best_s is None or s > best_s * (1 + 1e-9):
                    best, best_s, best_beyond, second_s = (d, chain), s, beyond, (best_s or 0.0)
                else:
                    second_s = max(second_s, s)
                if beyond:
                    climbing.discard(chain)
            if not climbing:
                break
        if best_beyond:  # (a climb's step: the next argmax may climb on)
            return best, 1.0
        return best, (best_s / second_s if second_s > 0 else float("inf"))

    def choose(self, B: int, max_depth: int, budgets: list[int] | None = None) -> tuple[int, bool]:
        """The (depth, chain?) of the next step for a batch of B rows when the loop allows ``max_depth``;
        ``budgets``: the tokens each row may still emit (None: not known)."""
        limit = max(0, min(self.max_depth, int(max_depth)))
        if self.mode == "off" or limit == 0:
            return 0, False
        if self.mode == "fixed":
            return limit, False
        step = getattr(self, "_gen_step", 0)
        if len(self.target_cost) < 2 and step < 3:  # probes: 1 (untimed), 0, 1
            return (1, 0, 1)[step], False
        if self._plain_left > 0:  # an exploration's run of plain steps
            self._plain_left -= 1
            return 0, False
        d, chain = self._argmax(B, limit, budgets)
        if d > 0:
            self._spec_chosen_at = self.steps_total
        if limit == self.max_depth:  # (steps capped by the token budget say nothing about the choice)
            # the choice moved, or the batch size did by 2x (not the drift of a row or two that joins and leaves
            # make every few steps): explore at the base rate
            if self._last_best != (d, chain) or not 0.5 < B / max(self._base_rows, 1) < 2.0:
                self._explore_gap, self._base_rows = self.explore_every, B
            self._last_best = (d, chain)
        self._since_explore += 1
        # (an exploration pays the whole batch's tree for the outcomes of the attached rows: not while they are few)
        sparse = not self._direct and 2 * self._n_attached < B
        if self.explore_every and self._since_explore >= self._explore_gap and not sparse:
            gap = self._explore_gap
            self._since_explore = 0
            self._explore_gap = min(2 * self._explore_gap, self.explore_every * self.explore_backoff)
            e, e_chain = self._neighbour(B, d, chain, limit)
            if e > 0 and self._lag > 0 and self._catchup_too_dear(B, gap):
                return d, chain  # leaving plain steps would cost the drafter's catch-up on all of them: skipped
            self.explorations += 1
            return e, e_chain
        return d, chain

    def _argmax(self, B: int, limit: int, budgets: list[int] | None) -> tuple[int, bool]:
        """:meth:`best_step`; a clear answer (``_HOLD_LEAD`` ahead of the runner-up) stands for ``_HOLD`` steps
        unless ``B``, ``limit`` or whether the batch lags changes first (see "Schedule" in the module doc)."""
        key = (B, limit, self._lag > 0)
        held = self._held
        if held is not None and held[0] == key and held[2] > 0:
            self._held = (key, held[1], held[2] - 1)
            return held[1]
        best, lead = self._ranked(B, limit, budgets)
        self._held = (key, best, _HOLD - 1 if lead >= _HOLD_LEAD else 0)
        return best

    def _neighbour(self, B: int, d: int, chain: bool, limit: int) -> tuple[int, bool]:
        """The step an exploration tries instead of (d, chain): in turn one deeper, the other shape at the same
        depth (where there are two), plain steps, one shallower. Out of a plain step: depth 1 in the shape that scores
        better. Plain steps, and one shallower from depth 1, are a run of ``_SETTLED`` + 2 plain steps (this one, then
        :attr:`_plain_left`) where plain steps were not priced lately (else the plain turn is one shallower)."""
        turns = (("deeper", "shape", "plain", "shallower", "shape") if len(self.shapes) > 1
                 else ("deeper", "plain", "shallower"))
        turn = turns[self._explore_turn % len(turns)]
        self._explore_turn += 1
        if d == 0:
            return 1, max(self.shapes, key=lambda ch: self.score(B, 1, self.optimism, ch) or 0.0)
        if turn == "shape":
            return d, not chain
        if turn == "deeper" and d < limit:
            return d + 1, chain
        stale = self._plain_at is None or self.steps_total - self._plain_at > _PLAIN_SPACING * self.explore_every
        if (turn == "plain" or d == 1) and stale:
            self._plain_left = _SETTLED + 1
            return 0, False
        return d - 1, chain and d > 1

    def _catchup_too_dear(self, B: int, gap: int) -> bool:
        """Whether an exploration out of the present run of plain steps would pay the inner drafter's catch-up on
        the lag (its estimate: :meth:`_catchup_at` x lag) above ``catchup_budget`` of the ``gap`` plain steps
        until the next exploration. Explorations are meant to cost a small share of the time; one out of a lag pays
        the catch-up of every row at once (at 16 rows on the family, a new batch's deferred prompts cost EAGLE's
        draft ~6 plain steps), and where that is dear only the argmax leaves plain steps, with the catch-up
        charged (:meth:`best_step`)."""
        c = self._catchup_at(B)
        t = self.predicted_step_time(B, 0)
        return c is not None and t is not None and c * self._lag > self.catchup_budget * gap * t

    def _catchup_at(self, B: int) -> float | None:
        """Catch-up seconds per lagging token at B rows (None: unknown). A catch-up is one forward over B x lag
        tokens, so it is booked per token and row and scaled by B: measured at B, else at the nearest batch size.
        (As rows retire, a batch that kept plain steps reaches sizes it has not measured, where the lag is cheap
        to catch up on; the unscaled cost of 64 rows kept a drained batch plain to the end.) It is capped at twice
        a depth-1 step's draft time at B (a forward over one token a row, and the catch-up of what the last step
        accepted): reading one more token a row costs no more than that, so one inflated measurement (a hiccup
        in the step that measured it) cannot keep plain steps for good."""
        c = self.catchup.get(B)
        if c is None and self.catchup:
            c = self.catchup[min(self.catchup, key=lambda b: (max(b / B, B / b), b))]
        if c is None:
            return None
        cap = 2.0 * self._draft_time(B, 1)
        return min(c * B, cap) if cap > 0 else c * B
