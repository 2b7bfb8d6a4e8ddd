"""The hybrid benchmark's baselines (specdec_ext.bench.state_baselines) and its runner (specdec_ext.bench.hybrid).

* The vLLM-style snapshot cache and the llama.cpp-style checkpoint + replay cache keep exactly the states of the
  library's cache: after the same chain is verified and a prefix of it accepted, every linear layer's state equals
  the HybridCache's (and the accepted sequence's state from scratch, through the library's cache), for every
  accepted length.
* Through the engine, with a draft that is often but not always accepted, each gives Hugging Face's greedy
  output, the replay cache replays after rejections (and only then), and the memory each keeps is what it says.
* Trees are refused by both (neither engine verifies a Lightning tree); a replay cache without its model too.
* The runner measures every method on a tiny hybrid family and reports the table's columns.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import hf_greedy  # noqa: E402
from test_hybrid_minimax import NEW, PROMPTS, make_drafter, references, target  # noqa: E402

from specdec_ext import ops  # noqa: E402
from specdec_ext.bench.hybrid import cache_factory, format_table, hybrid_methods, run_hybrid_bench  # noqa: E402
from specdec_ext.bench.state_baselines import ReplayCache, SnapshotCache, state_bytes_per_row  # noqa: E402
from specdec_ext.engine import Engine  # noqa: E402
from specdec_ext.models import HybridCache, extend, tree_forward, use_tree_attention  # noqa: E402
from specdec_ext.models.minimax_step import MiniMaxStepOps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAIN = 5  # root + 4 drafts


def _caches(model, B: int):
    cfg = model.config
    return {"ours": HybridCache(cfg, B, 96), "snapshots": SnapshotCache(cfg, B, 96, positions=CHAIN),
            "replay": ReplayCache(cfg, B, 96, model=model, positions=CHAIN)}


def _states(cache) -> dict[int, torch.Tensor]:
    return {l: cache.linear_state(l).clone() for l in cache.linear_layers}


@pytest.mark.parametrize("accepted", [0, 2, CHAIN - 1])
def test_baselines_keep_the_states_of_the_library_cache(accepted):
    """Prefill two rows, verify one chain of 5 per row, accept ``accepted`` drafts in row 0 and all in row 1:
    every cache's states equal the library's, and the library's equal the accepted sequence prefilled from
    scratch."""
    model = target()
    use_tree_attention(model)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 100, (2, 9), generator=gen)
    chain = torch.randint(3, 100, (2, CHAIN), generator=gen)
    parents = ops.chain_parents(2, CHAIN)
    accept_len = torch.tensor([accepted, CHAIN - 1])
    path = torch.arange(CHAIN).expand(2, CHAIN)
    after = {}
    for name, cache in _caches(model, 2).items():
        extend(model, cache, prompt)
        tree_forward(model, cache, chain, parents, 9)
        cache.accept(path, accept_len, 9)
        assert cache.lengths.tolist() == [9 + accepted + 1, 9 + CHAIN]
        after[name] = _states(cache)
    for name in ("snapshots", "replay"):
        for layer, state in after["ours"].items():
            torch.testing.assert_close(after[name][layer], state, rtol=1e-5, atol=1e-5, msg=f"{name} {layer}")
    for b in range(2):  # the library's cache against the accepted sequence from scratch
        n = int(accept_len[b]) + 1
        fresh = HybridCache(model.config, 1, 96)
        extend(model, fresh, torch.cat([prompt[b], chain[b, :n]])[None])
        for layer, state in _states(fresh).items():
            torch.testing.assert_close(after["ours"][layer][b], state[0], rtol=1e-5, atol=1e-5)


def _engine_greedy(model, drafter, states: str):
    made = []
    make = cache_factory(states, model, drafter.max_nodes, made)
    with Engine(model, drafter, max_batch=2, max_len=96, eos_token_id=[], make_cache=make) as engine:
        assert isinstance(engine.target_ops, MiniMaxStepOps)  # (every way of keeping states on the same route)
        ids = [engine.add_request(p, max_new_tokens=NEW) for p in PROMPTS]
        got = {i: [] for i in ids}
        while engine.has_unfinished():
            for r, new, _ in engine.step():
                got[r] += new
        outs = [got[i] for i in ids]
    return outs, engine.stats, made[0]


@pytest.mark.parametrize("states", ["ours", "snapshots", "replay"])
def test_engine_with_each_way_of_keeping_states_equals_hf(states):
    """Four prompts through an engine of two rows (joins and retirements), a draft model's chains of 4 that are
    often but not always accepted: Hugging Face's greedy continuations with every cache; the replay baseline
    replays after rejections; bookkeeping was timed."""
    model = target()
    outs, stats, cache = _engine_greedy(model, make_drafter("draft", model), states)
    assert outs == references()
    assert 1.2 < stats.mean_accepted_length < CHAIN, stats.mean_accepted_length  # some drafts rejected
    assert cache.bookkeeping_s > 0
    one = state_bytes_per_row(cache)
    assert cache.persistent_state_bytes_per_row() == {"ours": one, "snapshots": one * (1 + CHAIN),
                                                      "replay": 2 * one}[states]
    if states == "replay":
        rejected = sum(stats.accept_hist[:-1])
        assert 0 < cache.replays <= rejected


def test_baselines_refuse_trees_and_missing_models():
    model = target()
    use_tree_attention(model)
    star = torch.tensor([[-1, 0, 0]])
    for cache in (SnapshotCache(model.config, 1, 64, positions=4),
                  ReplayCache(model.config, 1, 64, model=model, positions=4)):
        extend(model, cache, torch.tensor([[5, 6, 7]]))
        with pytest.raises(ValueError, match="chains only"):
            tree_forward(model, cache, torch.tensor([[8, 9, 10]]), star, 3)
    with pytest.raises(ValueError, match="ReplayCache: model"):
        ReplayCache(model.config, 1, 64)
    with pytest.raises(ValueError, match="positions must be >= 1"):
        SnapshotCache(model.config, 1, 64, positions=0)


class _TinyFamily:
    """What run_hybrid_bench reads of a family: the target and a drafter by name."""

    def __init__(self, model):
        self.target = model
        self.made: list[str] = []

    def make_drafter(self, name):
        self.made.append(name)
        return make_drafter({"chain": "draft", "tree": "tree"}[name], self.target)


def test_run_hybrid_bench_reports_every_method():
    model = target()
    methods = hybrid_methods(chain_drafters=("chain",), tree_drafters=("tree",))
    assert [m for m, _, _ in methods] == ["plain", "chain+snapshots", "chain+replay", "chain", "tree"]
    family = _TinyFamily(model)
    result = run_hybrid_bench(family, PROMPTS[:2], 8, methods, log=lambda *a: None)
    # one drafter a method for the whole run (a tree's online score calibration carries over, as on a server)
    assert family.made == ["chain", "chain", "chain", "tree"]
    assert not model._forward_pre_hooks  # (the benchmark leaves the model as it found it)
    rows = result["methods"]
    assert rows["plain"]["speedup"] == 1.0 and rows["plain"]["identical"] is None
    refs = [hf_greedy(model, p, 8) for p in PROMPTS[:2]]
    assert rows["plain"]["tokens"] == sum(map(len, refs))
    for m in ("chain+snapshots", "chain", "tree"):
        assert rows[m]["identical"] is True, m
    one = rows["plain"]["committed_state_bytes"]
    assert rows["chain+snapshots"]["state_bytes_per_sequence"] == one * (1 + CHAIN)
    assert rows["chain"]["state_bytes_per_sequence"] == rows["tree"]["state_bytes_per_sequence"] == one
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and 0 < r["state_bookkeeping_share"] < 1
        assert r["mean_accepted_length"] >= 1
    assert len(format_table(result)) == 1 + len(methods)
