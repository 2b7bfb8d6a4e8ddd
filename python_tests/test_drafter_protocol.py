"""The drafter protocol as Medusa / EAGLE drafters will use it: target hidden states at the prefill and at every
tree node, dynamic trees (a different shape every step), and what begin/propose/observe see."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import test_generate_batch as batch_t  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext.drafters import DecodeState, DraftTree, NgramDrafter, StepResult  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Probe:
    """Records what the loop hands over; proposes a random tree (sizes vary by step) whose first child of the root
    is the n-gram guess, so that some drafts are accepted."""

    max_nodes = 6
    max_depth = 5
    hidden_state_layers = (0, 1, -1)
    forwards = 0
    defers_prefill = False
    serves_row_subsets = True

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)
        self.ngram = NgramDrafter(num_pred_tokens=3)
        self.steps = []

    def begin(self, target, state: DecodeState, prefill_hidden_states=None):
        self.prefill = prefill_hidden_states
        self.prompt = list(state.host_tokens[0])

    def add_rows(self, target, rows: DecodeState, prefill_hidden_states=None):
        raise AssertionError("never reached: every row of a generate call joins at its first step")

    def retire(self, keep):
        assert keep.numel() == 0, "one row: it only ever leaves at the end, and then no row stays"

    def propose(self, state: DecodeState, max_depth: int, max_nodes: int) -> DraftTree:
        assert torch.equal(state.last_tokens.cpu(), torch.tensor([ctx[-1] for ctx in state.host_tokens]))
        chain = self.ngram.propose(state, max_depth, max_nodes)
        n = int(torch.randint(1, max_nodes + 1, (1,), generator=self.gen))
        n = max(n, chain.num_nodes)
        parents = [-1] + list(range(chain.num_nodes - 1))
        tokens = chain.tokens[0].tolist()
        while len(tokens) < n:  # random extra branches
            parents.append(int(torch.randint(0, len(tokens), (1,), generator=self.gen)))
            tokens.append(int(torch.randint(0, V, (1,), generator=self.gen)))
        self.prefix = int(state.prefix_lens[0])
        return DraftTree(torch.tensor([tokens]), torch.tensor([parents]), None)

    def observe(self, state: DecodeState, tree: DraftTree, result: StepResult):
        self.steps.append((self.prefix, tree, result))


def test_hidden_states_reach_begin_and_observe():
    model = make_model("llama", seed=8)
    prompt = ([5, 9, 13, 5, 9] * 3)[:12]
    probe = Probe()
    out, stats = generate(model, probe, torch.tensor(prompt), max_new_tokens=20, eos_token_id=[])
    seq = out[None]
    with torch.no_grad():
        saved = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        ref = model(seq, output_hidden_states=True).hidden_states
        model.set_attn_implementation(saved)
    layers = [ref[i][0] for i in Probe.hidden_state_layers]
    P = len(prompt)
    assert len(probe.prefill) == 3
    for got, want in zip(probe.prefill, layers):
        assert got.shape == (1, P - 1, want.shape[-1])
        torch.testing.assert_close(got[0], want[: P - 1], atol=1e-4, rtol=1e-4)
    sizes = {tree.num_nodes for _, tree, _ in probe.steps}
    assert len(sizes) > 1  # dynamic trees: the shape changes between steps
    assert sum(int(r.accept_len[0]) for _, _, r in probe.steps) > 0
    for prefix, tree, result in probe.steps:
        a = int(result.accept_len[0])
        path = result.accepted[0, : a + 1]
        assert result.appended[0] <= a + 1
        m = min(a + 1, seq.shape[1] - prefix)  # path nodes inside the final sequence (the budget may cut it)
        for got, want in zip(result.hidden_states, layers):
            assert got.shape == (1, tree.num_nodes, want.shape[-1])
            # the accepted path's nodes sit at prefix + depth of the final sequence
            torch.testing.assert_close(got[0, path[:m]], want[prefix: prefix + m], atol=1e-4, rtol=1e-4)
    assert stats.new_tokens == 20 and stats.target_forwards == len(probe.steps)


@pytest.mark.parametrize("B, rows", [(10, [0, 9, 2, 8, 4, 5]),  # a retirement: freed slots filled from the end
                                     (20, list(range(10, 20))),  # ten moves, disjoint: gathered
                                     (6, [1, 0, 2, 3])])  # a swap: gathered
@pytest.mark.parametrize("dim", [0, 2])
def test_keep_batch_rows_along_any_dim(B, rows, dim):
    """The batch dimension anywhere (the target cache's is 2 of [L, 2, B, H, S, D]): index_select's result, whether
    the moves are copied one by one or gathered."""
    from specdec_ext.models.kv_cache import keep_batch_rows

    shape = [3, 2, 4, 5]
    shape.insert(dim, B)
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(B + dim))
    want = t.index_select(dim, torch.tensor(rows))
    assert torch.equal(keep_batch_rows(t, rows, dim=dim), want)


@pytest.mark.parametrize("rows", [[0, 5, 2, 3, 4], [2, 0, 1], [3], [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
def test_keep_batch_rows_equals_index_select(rows):
    """In-place retirement (only rows that change slot move, overlaps included) gives index_select's result."""
    from specdec_ext.models.kv_cache import keep_batch_rows

    g = torch.Generator().manual_seed(len(rows))
    a, b = torch.randn(6, 2, 7, 3, generator=g), torch.randn(6, 11, generator=g)
    want = [a.index_select(0, torch.tensor(rows)), b.index_select(0, torch.tensor(rows))]
    got = [keep_batch_rows(t, rows) for t in (a, b)]
    for x, w in zip(got, want):
        assert torch.equal(x, w) and x.is_contiguous()


def test_append_batch_rows_equals_cat_and_reuses_the_room_a_retirement_left():
    """Rows retired then joined: the result equals torch.cat every time; a join into the room that keep_batch_rows
    left writes into the same buffer, and one past it reallocates with room to spare (twice the rows)."""
    from specdec_ext.models.kv_cache import append_batch_rows, keep_batch_rows

    g = torch.Generator().manual_seed(0)
    t = torch.randn(4, 3, 5, generator=g)
    ref = t.clone()
    t = keep_batch_rows(t, [3, 1])  # two rows leave: a view of the first 2 of 4 allocated rows
    ref = ref[[3, 1]]
    buffer = t.untyped_storage().data_ptr()
    for n in (1, 1, 3, 2):
        new = torch.randn(n, 3, 5, generator=g)
        t, ref = append_batch_rows(t, new), torch.cat([ref, new])
        assert torch.equal(t, ref) and t.is_contiguous()
    assert t.shape[0] == 9 and t.untyped_storage().data_ptr() != buffer  # grown past the first buffer's 4 rows
    assert t.untyped_storage().nbytes() == 14 * 15 * 4  # (twice the 7 rows it grew from)
    fits = append_batch_rows(t[:8], torch.zeros(1, 3, 5))  # room left: written in place
    assert fits.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and torch.equal(fits[:8], ref[:8])
    with pytest.raises(ValueError, match="new rows must be"):
        append_batch_rows(t, torch.zeros(1, 3, 4))


def test_grow_batch_rows_zeroes_the_joining_rows_in_the_room_a_retirement_left():
    """Rows that join with nothing to copy (a deferred draft prefill): zeros after the kept rows, in the buffer's
    room even where a retired row's values lie there, and a reallocation past it."""
    from specdec_ext.models.kv_cache import grow_batch_rows, keep_batch_rows

    g = torch.Generator().manual_seed(1)
    t = torch.randn(4, 3, 5, generator=g)
    ref = t[[2, 1]].clone()
    t = keep_batch_rows(t, [2, 1])  # rows 2 and 3 of the buffer still hold old values
    buffer = t.untyped_storage().data_ptr()
    t = grow_batch_rows(t, 2)
    assert t.untyped_storage().data_ptr() == buffer and torch.equal(t, torch.cat([ref, torch.zeros(2, 3, 5)]))
    grown = grow_batch_rows(t, 3)
    assert grown.untyped_storage().data_ptr() != buffer and torch.equal(grown, torch.cat([t, torch.zeros(3, 3, 5)]))


class Budgeted:
    """Forwards to a drafter, asking each step for another node budget (1, 2, ..., its ``max_nodes``, again) and
    checking that the tree keeps the budget and the depth."""

    def __init__(self, inner):
        self.inner = inner
        self.max_nodes, self.max_depth = inner.max_nodes, inner.max_depth
        self.hidden_state_layers, self.defers_prefill = inner.hidden_state_layers, inner.defers_prefill
        self.serves_row_subsets = inner.serves_row_subsets
        self.calls, self.sizes = 0, set()

    @property
    def forwards(self):
        return self.inner.forwards

    def begin(self, target, state, prefill_hidden_states=None, *, defer_prefill=False):
        self.inner.begin(target, state, prefill_hidden_states)

    def add_rows(self, target, rows, prefill_hidden_states=None, *, defer_prefill=False):
        self.inner.add_rows(target, rows, prefill_hidden_states)

    def propose(self, state, max_depth, max_nodes):
        budget = 1 + self.calls % max_nodes
        self.calls += 1
        tree = self.inner.propose(state, max_depth, budget)
        assert tree.num_nodes <= budget, (type(self.inner).__name__, tree.num_nodes, budget)
        parents = tree.parents.tolist()
        for row in parents:
            depth = [0] * len(row)
            for i in range(1, len(row)):
                depth[i] = depth[row[i]] + 1
            assert max(depth) <= max_depth
        self.sizes.add(tree.num_nodes)
        return tree

    def observe(self, state, tree, result):
        self.inner.observe(state, tree, result)

    def retire(self, keep):
        self.inner.retire(keep)


@pytest.mark.parametrize("kind", [k for k in batch_t.KINDS if k != "plain"])
def test_every_drafter_keeps_the_node_budget_and_stays_exact(kind):
    """``propose(state, max_depth, max_nodes)``: every drafter's tree has at most ``max_nodes`` nodes (a caller's
    verification budget; AdaptiveDrafter's chain steps use it), and greedy output under budgets changing every step
    equals Hugging Face's greedy decoding of each prompt alone."""
    m, drafter, prompts = batch_t.case(kind)
    budgeted = Budgeted(drafter)
    got, _ = generate(m, budgeted, prompts, max_new_tokens=12, eos_token_id=[])
    for p, g in zip(prompts, got):
        assert g.tolist() == p + hf_greedy(m, p, 12), kind
    assert budgeted.calls >= 4 and len(budgeted.sizes) >= 2, budgeted.sizes  # budgets did shape the trees
