"""Fuzz specs of the tree ops: build_tree, tree_ancestor_mask, advance_tree_frontier, select_tree_nodes."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fuzz.compare import same, same_all
from fuzz.spec import Arg, OpSpec, dim
from helpers import make_gen, per_row, random_parents
from specdec_ext import ops
from specdec_ext.ops import reference as ref

R = torch.ops.specdec_ext
TREE_KINDS = ["random", "deep", "wide", "chain", "star"]
SEED = st.integers(0, 2**31 - 1)


def _tree_base(**more):
    return st.fixed_dictionaries({"B": dim(1, 3, 8), "N": dim(1, 9, 33, 40), "tree": st.sampled_from(TREE_KINDS),
                                  "seed": SEED, **more})


def _parents(r) -> torch.Tensor:
    return random_parents(r["B"], r["N"], make_gen(r["seed"]), r["tree"])


# build_tree ------------------------------------------------------------------------------------------------------

def _build_tree_args(r):
    prefix = r["prefix"] if not r["raw"] and r["number"] else torch.randint(
        0, r["prefix"] + 1, (r["B"],), generator=make_gen(r["seed"] + 1))
    return {"parents": _parents(r), "prefix_lens": prefix}


BUILD_TREE = OpSpec(
    name="build_tree",
    base=_tree_base(prefix=st.integers(0, 60), number=st.booleans()),
    kinds=lambda r: {"parents": Arg("tree", (r["N"],)), "prefix_lens": Arg("row_i", (0, 2**63 - 1 - r["N"]))},
    build=_build_tree_args,
    raw=lambda a, v: R.build_tree(a["parents"], a["prefix_lens"], v),
    wrapper=lambda a, v: ops.build_tree(a["parents"], a["prefix_lens"], validate=v),
    reference=lambda a, v: ref.build_tree(a["parents"], per_row(a["prefix_lens"], a["parents"].shape[0],
                                                                torch.int64), v),
    compare=lambda got, want, a, rerun: same_all(got, want, ["depth", "position_ids", "first_child", "next_sibling",
                                                             "retrieve_paths", "num_leaves"]),
)

# tree_ancestor_mask ----------------------------------------------------------------------------------------------

TREE_ANCESTOR_MASK = OpSpec(
    name="tree_ancestor_mask",
    base=_tree_base(packed=st.booleans()),
    kinds=lambda r: {"parents": Arg("tree", (r["N"],))},
    build=lambda r: {"parents": _parents(r), "packed": r["packed"]},
    raw=lambda a, v: R.tree_ancestor_mask(a["parents"], a["packed"], v),
    wrapper=lambda a, v: ops.tree_ancestor_mask(a["parents"], a["packed"], validate=v),
    reference=lambda a, v: ref.tree_ancestor_mask(a["parents"], a["packed"], v),
    compare=lambda got, want, a, rerun: same(got, want, "mask"),
)

# advance_tree_frontier -------------------------------------------------------------------------------------------


def _frontier_args(r):
    g = make_gen(r["seed"])
    B, F, K, S, L = r["B"], r["F"], r["K"], r["S"], r["L"]
    C = r["self_column"] + S + r["extra"]
    return {"cand_tokens": torch.randint(-5, 100, (B, F, K), generator=g),
            "cand_scores": torch.randn(B, F, K, generator=g),
            "selected": torch.randint(0, F * K, (B, S), generator=g),
            "ancestors": torch.rand(B, F, C, generator=g) < 0.5,
            "self_column": r["self_column"],
            "column": torch.randint(0, C, (B, L), generator=g)}


def _frontier_kinds(r):
    C = r["self_column"] + r["S"] + r["extra"]
    return {"cand_tokens": Arg("index"), "cand_scores": Arg("float"), "selected": Arg("index", (0, r["F"] * r["K"])),
            "ancestors": Arg("mask"), "self_column": Arg("int", (0, C - r["S"], C)), "column": Arg("index", (0, C))}


def _frontier_call(fn):
    return lambda a, v: fn(a["cand_tokens"], a["cand_scores"], a["selected"], a["ancestors"], a["self_column"],
                           a["column"], v)


ADVANCE_TREE_FRONTIER = OpSpec(
    name="advance_tree_frontier",
    base=st.fixed_dictionaries({"B": dim(1, 2, 9), "F": dim(1, 4, 17), "K": dim(1, 3, 8), "S": dim(1, 4, 20),
                                "L": dim(1, 6, 70), "self_column": st.integers(0, 3),
                                "extra": st.integers(0, 3), "seed": SEED}),
    kinds=_frontier_kinds,
    build=_frontier_args,
    raw=_frontier_call(R.advance_tree_frontier),
    wrapper=_frontier_call(ops.advance_tree_frontier),
    reference=_frontier_call(ref.advance_tree_frontier),
    compare=lambda got, want, a, rerun: same_all(got, want, ["tokens", "scores", "parents", "ancestors", "mask"]),
)

# select_tree_nodes -----------------------------------------------------------------------------------------------


def _select_args(r):
    g = make_gen(r["seed"])
    B, C = r["B"], r["C"]
    parents = torch.full((B, C), -1, dtype=torch.int64)
    scores = torch.empty(B, C)
    for c in range(C):
        p = torch.randint(-1, c, (B,), generator=g) if c else torch.full((B,), -1)
        parents[:, c] = p
        base = torch.where(p >= 0, scores[torch.arange(B), p.clamp(min=0)], torch.zeros(B)) if c else torch.zeros(B)
        step = torch.rand(B, generator=g)
        # cumulative log-probabilities (a child scores below its parent, as in EAGLE-2), or ties on a coarse grid
        scores[:, c] = base - step if r["monotone"] else (torch.randn(B, generator=g) * 2).round() / 2
    return {"tokens": torch.randint(0, 50, (B, C), generator=g), "scores": scores, "parents": parents,
            "roots": torch.randint(0, 50, (B,), generator=g), "num_nodes": r["num_nodes"]}


def _select_call(fn):
    return lambda a, v: fn(a["tokens"], a["scores"], a["parents"], a["roots"], a["num_nodes"], v)


SELECT_TREE_NODES = OpSpec(
    name="select_tree_nodes",
    base=st.fixed_dictionaries({"B": dim(1, 2, 9), "C": dim(1, 8, 40), "num_nodes": st.integers(0, 10),
                                "monotone": st.booleans(), "seed": SEED}),
    kinds=lambda r: {"tokens": Arg("index"), "scores": Arg("float"), "parents": Arg("index", (-1, r["C"])),
                     "roots": Arg("index"), "num_nodes": Arg("int", (0, r["C"]))},
    build=_select_args,
    raw=_select_call(R.select_tree_nodes),
    wrapper=_select_call(ops.select_tree_nodes),
    reference=_select_call(ref.select_tree_nodes),
    compare=lambda got, want, a, rerun: same_all(got, want, ["tree_tokens", "tree_parents"]),
)

SPECS = [BUILD_TREE, TREE_ANCESTOR_MASK, ADVANCE_TREE_FRONTIER, SELECT_TREE_NODES]
