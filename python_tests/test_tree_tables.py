"""A tree's derived tables (specdec_ext.state.TreeTables), computed once and handed on with the tree.

* The tables a tree hands on equal the plain-Python spec (``ops.reference.build_tree`` depth,
  ``ops.reference.tree_ancestor_mask``) of its parents: static trees' (``StaticTree.tables``, cached per batch size
  and device), the 1-node tree's (``state.plain_tree``), and the trees Medusa and EAGLE-1 static drafters propose.
  ``StaticTree.ancestors_tensor`` / ``level_tensors`` (what the EAGLE static drafter feeds level by level) likewise.
* ``tree_forward`` given the tables gives the same logits, bit for bit, as deriving them from the parents, through
  the kernel and the 4-D mask fallback, with packed and dense masks, and calls neither ``build_tree`` nor
  ``tree_ancestor_mask``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_drafter_eagle import PROMPTS_P, random_draft  # noqa: E402
from test_drafter_eagle import target as eagle_target  # noqa: E402
from test_drafter_medusa import random_heads  # noqa: E402
from test_drafter_medusa import target as medusa_target  # noqa: E402
from test_hf_tree_attention import V, CountCalls, make_model, random_prompts, random_tree  # noqa: E402

from specdec_ext import ops  # noqa: E402
from specdec_ext.drafters.eagle import EagleDrafter  # noqa: E402
from specdec_ext.drafters.medusa import MedusaDrafter  # noqa: E402
from specdec_ext.drafters.trees import MC_SIM_7B_63, static_tree  # noqa: E402
from specdec_ext.models import TreeKVCache, extend, tree_forward, use_tree_attention  # noqa: E402
from specdec_ext.ops import reference as ref  # noqa: E402
from specdec_ext.state import DecodeState, TreeTables, plain_tree  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_tables_of(tables: TreeTables, parents: torch.Tensor):
    """``tables`` are those of ``parents`` by the plain-Python spec (the mask in whichever form it is kept)."""
    B, N = parents.shape
    want_depth = ref.build_tree(parents, torch.zeros(B, dtype=torch.int64))[0]
    assert torch.equal(tables.depth.expand(B, N), want_depth)
    packed = tables.mask.dtype == torch.int32
    assert torch.equal(tables.mask, ref.tree_ancestor_mask(parents, packed=packed))


@pytest.mark.parametrize("max_nodes", [1, 2, 26, 64])
@pytest.mark.parametrize("B", [1, 3])
def test_static_tree_tables_equal_the_spec(max_nodes, B):
    tree = static_tree(MC_SIM_7B_63, max_nodes=max_nodes)
    parents = tree.parents_tensor(B)
    tables = tree.tables(B)
    assert_tables_of(tables, parents)
    assert tables.depth[0].tolist() == list(tree.depth)  # (the layout's own depths)
    assert tree.tables(B) is tables and tree.tables(B, "cpu") is tables  # made once per batch size and device
    assert tree.tables(B + 1).depth.shape == (B + 1, tree.num_nodes)
    assert torch.equal(tree.ancestors_tensor(), ref.tree_ancestor_mask(parents[:1])[0])
    levels = tree.level_tensors()
    assert len(levels) == tree.max_depth
    for d, (nodes, par, rank) in enumerate(levels, 1):
        assert nodes.tolist() == [i for i in range(tree.num_nodes) if tree.depth[i] == d]
        assert par.tolist() == [tree.parents[i] for i in nodes.tolist()]
        assert rank.tolist() == [tree.rank[i] for i in nodes.tolist()]


@pytest.mark.parametrize("B", [1, 4])
def test_plain_tree_is_the_one_node_tree_with_its_tables(B):
    roots = torch.arange(7, 7 + B)
    tree = plain_tree(roots)
    assert tree.tokens.tolist() == [[7 + b] for b in range(B)] and tree.parents.tolist() == [[-1]] * B
    assert tree.draft_probs is None
    assert_tables_of(tree.tables, tree.parents)


def test_tables_of_refuses_a_bad_tree():
    with pytest.raises(ValueError, match="build_tree"):
        TreeTables.of(torch.tensor([[-1, 2, 0]]))


@torch.no_grad()
def test_medusa_hands_on_its_static_trees_tables():
    m = medusa_target()
    drafter = MedusaDrafter(random_heads())
    state = DecodeState.of_prompts([[5, 6, 7, 8, 9], [10, 11, 12], [13]], 64, V)
    assert drafter.propose(state, 10, drafter.max_nodes).tables is not None  # before any hidden state: the 1-node tree
    drafter.begin(m, state, (torch.randn(3, 4, drafter.heads.hidden_size),))
    for depth in (10, 2, 1, 0):
        tree = drafter.propose(state, depth, drafter.max_nodes)
        assert_tables_of(tree.tables, tree.parents)
    dynamic = MedusaDrafter(random_heads(), dynamic=True, max_nodes=12)
    dynamic.begin(m, state, (torch.randn(3, 4, dynamic.heads.hidden_size),))
    assert dynamic.propose(state, 10, dynamic.max_nodes).tables is None  # a per-step tree: tree_forward derives them


@pytest.mark.parametrize("version", [1, 3])
@torch.no_grad()
def test_eagle_static_tree_hands_on_its_tables(version):
    tgt = eagle_target()
    drafter = EagleDrafter(random_draft(version, seed=7), target=tgt, choices=static_tree(MC_SIM_7B_63, max_nodes=20))
    state = DecodeState.of_prompts(PROMPTS_P, 64, V)
    P = max(len(p) for p in PROMPTS_P)
    width = drafter.model.feature_size
    pre = torch.randn(3, P - 1, width, generator=torch.Generator().manual_seed(2))
    drafter.begin(tgt, state, (pre,) if version == 1 else tuple(pre.split(width // 3, -1)))
    for depth in (10, 1, 0):
        tree = drafter.propose(state, depth, drafter.max_nodes)
        assert_tables_of(tree.tables, tree.parents)


def _forward_twice(model, prompt_lens, tokens, parents, tables, monkeypatch, **kw):
    """tree_forward without and with ``tables`` on one cache (the forward rewinds it: both see the same prefix);
    checks that only the first derives the tables."""
    gen = torch.Generator().manual_seed(4)
    _, padded = random_prompts(gen, prompt_lens)
    cache = TreeKVCache(model.config, len(prompt_lens), 96)
    extend(model, cache, padded, torch.tensor(prompt_lens))
    builds, masks = CountCalls(monkeypatch, "build_tree"), CountCalls(monkeypatch, "tree_ancestor_mask")
    derived = tree_forward(model, cache, tokens, parents, **kw)
    assert (builds.calls, masks.calls) == (1, 1)
    given = tree_forward(model, cache, tokens, parents, tables=tables, **kw)
    assert (builds.calls, masks.calls) == (1, 1)
    return derived, given


@pytest.mark.parametrize("tree_kind", ["static", "random", "plain"])
@pytest.mark.parametrize("use_kernel,packed", [(True, True), (True, False), (False, True)])
@torch.no_grad()
def test_tree_forward_with_the_tables_equals_deriving_them(tree_kind, use_kernel, packed, monkeypatch):
    model = make_model("llama", seed=5)
    use_tree_attention(model)
    gen = torch.Generator().manual_seed(9)
    B = 3
    if tree_kind == "static":
        tree = static_tree(MC_SIM_7B_63, max_nodes=40)  # N > 32: two mask words per node
        parents, tables = tree.parents_tensor(B), tree.tables(B)
    elif tree_kind == "random":
        parents = random_tree(gen, B, 13)
        tables = TreeTables.of(parents, packed=packed)
    else:
        one = plain_tree(torch.zeros(B, dtype=torch.int64))
        parents, tables = one.parents, one.tables
    tokens = torch.randint(0, V, parents.shape, generator=gen)
    derived, given = _forward_twice(model, [5, 17, 2], tokens, parents, tables, monkeypatch, use_kernel=use_kernel,
                                    packed=packed)
    assert torch.equal(given, derived)


def test_tables_of_another_tree_are_refused_by_name():
    model = make_model("llama", seed=5)
    cache = TreeKVCache(model.config, 2, 32)
    tree = static_tree(MC_SIM_7B_63, max_nodes=6)
    tokens = torch.zeros(2, 6, dtype=torch.int64)
    for wrong in (tree.tables(3), static_tree(MC_SIM_7B_63, max_nodes=5).tables(2),
                  TreeTables(tree.tables(2).depth.int(), tree.tables(2).mask)):
        with pytest.raises(ValueError, match="tree_forward: tables must be a tree's TreeTables for B = 2, N = 6"):
            tree_forward(model, cache, tokens, tree.parents_tensor(2), 0, tables=wrong)
