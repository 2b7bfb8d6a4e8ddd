"""EAGLE drafter (specdec_ext.drafters.eagle): EAGLE-1 / EAGLE-3 drafts with EAGLE-2 dynamic trees.

* ``propose`` equals an uncached recomputation: every draft node's logits (the draft run with plain causal
  attention over the row's real (feature, next token) pairs followed by the node's ancestors, fed its own outputs)
  rank the node's token among the parent's top_k; a ``top_k = 1`` tree is exactly the greedy chain.
* Dynamic trees are valid (``ops.build_tree(validate=True)``), hold at most ``total_tokens`` drafts, are no deeper
  than ``depth`` or the loop's budget, and cumulative scores never grow from a parent to a child.
* ``observe`` keeps the target features of every context position (checked against a full target forward after
  a generation), and the next catch-up recomputes the rolled-back draft cache from them.
* End to end through :func:`generate`: tiny drafts trained for a few hundred Adam steps (a few seconds) on the tiny
  target's own greedy continuations give exactly Hugging Face's greedy output with a mean accepted length > 1
  (not vacuous): EAGLE-1 chain and dynamic tree, EAGLE-3 (draft vocabulary of 64 of 101 ids) dynamic tree;
  batches with a one-token prompt and budgets inside accepted runs; sampling (chi-square, lossless).
* EAGLE-1 static trees from a choices list (``mc_sim_7b_63`` truncated): node (.., r) is the r-th best child of its
  parent by the uncached draft; greedy equals HF.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from helpers import record_valid_at_propose  # noqa: E402
from hf_reference import CountForwards, hf_greedy  # noqa: E402
from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext import ops  # noqa: E402
from specdec_ext.drafters.base import DecodeState, StepResult  # noqa: E402
from specdec_ext.drafters.eagle import EagleDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.eagle import Eagle1Model, Eagle3Model, EagleConfig  # noqa: E402

H = 64
L_TARGET = 8  # EAGLE-3 features: inputs of layers (2, 4, 5)
VD = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


_CACHE: dict = {}


def target():
    if "m" not in _CACHE:
        _CACHE["m"] = make_model("llama", seed=11, num_hidden_layers=L_TARGET)
    return _CACHE["m"]


def draft_config(**kw) -> EagleConfig:
    return EagleConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=V, head_dim=64, **kw)


def random_draft(version: int, seed: int = 0):
    torch.manual_seed(seed)
    if version == 1:
        m = Eagle1Model(draft_config(), fc_bias=True)
    else:
        m = Eagle3Model(draft_config(draft_vocab_size=VD))
        m.set_vocab_map(torch.randperm(V)[:VD].sort().values)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def make_state(prompts: list[list[int]], max_len: int = 64) -> DecodeState:
    return DecodeState.of_prompts(prompts, max_len, V)


@torch.no_grad()
def target_features(drafter: EagleDrafter, seq: list[int]) -> torch.Tensor:
    """``[len(seq), Hf]``: the target's features (the drafter's layers, concatenated) at every position."""
    out = target()(torch.tensor([seq]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in drafter.hidden_state_layers], -1)


@torch.no_grad()
def uncached_logits(drafter: EagleDrafter, feats: torch.Tensor, ctx: list[int], path: list[int]) -> torch.Tensor:
    """Draft logits (target ids' ranking in draft ids) after the context ``ctx`` (features ``feats[t]``, t < n - 1)
    and the draft tokens ``path``: plain causal attention over all inputs, no cache."""
    m, tgt = drafter.model, target()
    emb = tgt.get_input_embeddings()
    n = len(ctx)
    hid = feats[: n - 1]
    if m.version == 3:
        hid = m.fc(hid)
    toks = list(ctx[1:])
    for tok in [None] + path:
        if tok is not None:
            toks.append(tok)
            hid = torch.cat([hid, out[-1:]])  # noqa: F821 - the previous output is fed back
        pos = torch.arange(len(toks))[None]
        if m.version == 3:
            out = m.midlayer(hid[None], emb(torch.tensor([toks])), pos)[0]
        else:
            out = m(hid[None], emb(torch.tensor([toks])), pos)[0]
    return m.logits(out[-1], tgt.get_output_embeddings())


def node_path(parents: list[int], tokens: list[int], i: int) -> list[int]:
    path = []
    while i > 0:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


# ---------------------------------------------------------------------------------------------------------------
# Construction and errors.


def test_construction_and_errors():
    tgt = target()
    d1 = EagleDrafter(random_draft(1))
    assert d1.hidden_state_layers == (-1,) and d1.max_nodes == 61 and (d1.depth, d1.top_k) == (8, 10)
    d3 = EagleDrafter(random_draft(3), target=tgt)
    assert d3.hidden_state_layers == (2, 4, 5)
    assert EagleDrafter(random_draft(3), aux_layers=[1, 2, 3]).hidden_state_layers == (1, 2, 3)
    assert EagleDrafter(random_draft(1), depth=3, top_k=2, total_tokens=100).max_nodes == 1 + 2 + 2 * 4
    assert EagleDrafter(random_draft(1), depth=4, top_k=1, total_tokens=4).max_nodes == 5  # a chain
    with pytest.raises(ValueError, match="needs its target feature layers"):
        EagleDrafter(random_draft(3))
    with pytest.raises(TypeError, match="Eagle1Model or Eagle3Model"):
        EagleDrafter(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="top_k = 65 exceeds the draft vocabulary"):
        EagleDrafter(random_draft(3), top_k=65, target=tgt)
    with pytest.raises(ValueError, match="the tree uses rank 64 but the draft vocabulary has 64 ids"):
        EagleDrafter(random_draft(3), target=tgt, choices=[[64]])
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        EagleDrafter(random_draft(1), depth=0)
    with pytest.raises(ValueError, match="needs L >= 4"):
        EagleDrafter(random_draft(3), target=make_model("llama", seed=1))
    d = EagleDrafter(random_draft(1).to("meta"))
    with pytest.raises(ValueError, match="draft is on meta but the target on cpu"):
        d.begin(tgt, make_state([[1, 2]]), None)
    small = Eagle1Model(EagleConfig(hidden_size=32, intermediate_size=64, num_attention_heads=1,
                                    num_key_value_heads=1, vocab_size=V, head_dim=64))
    with pytest.raises(ValueError, match="target hidden size of 32 but the target's hidden_size is 64"):
        EagleDrafter(small).begin(tgt, make_state([[1, 2]]), None)


# ---------------------------------------------------------------------------------------------------------------
# propose against an uncached recomputation.

PROMPTS_P = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15]]


@pytest.mark.parametrize("version", [1, 3])
@torch.no_grad()
def test_chain_equals_uncached_greedy(version):
    tgt = target()
    drafter = EagleDrafter(random_draft(version), depth=4, top_k=1, total_tokens=4, target=tgt)
    state = make_state(PROMPTS_P)
    feats = [target_features(drafter, p) for p in PROMPTS_P]
    P = max(len(p) for p in PROMPTS_P)
    pre = torch.zeros(3, P - 1, feats[0].shape[-1])
    for b, f in enumerate(feats):
        pre[b, : len(PROMPTS_P[b]) - 1] = f[:-1]
    drafter.begin(tgt, state, tuple(pre.split([H] * (pre.shape[-1] // H), -1)))
    tree = drafter.propose(state, 10, drafter.max_nodes)
    assert tree.tokens.shape == (3, 5) and tree.parents[0].tolist() == [-1, 0, 1, 2, 3]
    assert tree.draft_probs is None
    m = drafter.model
    for b, p in enumerate(PROMPTS_P):
        path = []
        for d in range(4):
            tok = int(m.to_target_ids(uncached_logits(drafter, feats[b], p, path).argmax()))
            path.append(tok)
        assert tree.tokens[b].tolist() == [p[-1]] + path, b
    assert drafter.valid == [len(p) - 1 for p in PROMPTS_P]
    assert drafter.propose(state, 2, drafter.max_nodes).num_nodes == 3 and drafter.propose(state, 0, drafter.max_nodes).num_nodes == 1


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("depth,top_k,total,max_depth", [(3, 3, 10, 9), (4, 2, 30, 9), (5, 3, 12, 2), (1, 4, 3, 9)])
@torch.no_grad()
def test_dynamic_tree_nodes_and_validity(version, depth, top_k, total, max_depth):
    tgt = target()
    drafter = EagleDrafter(random_draft(version, seed=depth), depth=depth, top_k=top_k, total_tokens=total, target=tgt)
    state = make_state(PROMPTS_P)
    feats = [target_features(drafter, p) for p in PROMPTS_P]
    P = max(len(p) for p in PROMPTS_P)
    pre = torch.zeros(3, P - 1, feats[0].shape[-1])
    for b, f in enumerate(feats):
        pre[b, : len(PROMPTS_P[b]) - 1] = f[:-1]
    drafter.begin(tgt, state, (pre,) if version == 1 else tuple(pre.split(H, -1)))
    tree = drafter.propose(state, max_depth, drafter.max_nodes)
    N = tree.num_nodes
    eff = min(depth, max_depth)
    assert N - 1 == min(total, top_k + (eff - 1) * top_k * top_k) and N <= drafter.max_nodes
    info = ops.build_tree(tree.parents, state.prefix_lens, validate=True)
    assert int(info.depth.max()) <= eff
    m = drafter.model
    for b, p in enumerate(PROMPTS_P):
        par, toks = tree.parents[b].tolist(), tree.tokens[b].tolist()
        assert toks[0] == p[-1]
        score = [0.0] * N
        for i in range(1, N):
            path = node_path(par, toks, i)
            lp = uncached_logits(drafter, feats[b], p, path[:-1]).float().log_softmax(-1)
            top = m.to_target_ids(lp.topk(top_k).indices).tolist()
            assert toks[i] in top, (b, i)  # the node is among its parent's top_k
            draft_id = top.index(toks[i])
            score[i] = score[par[i]] + float(lp.topk(top_k).values[draft_id])
            assert score[i] <= score[par[i]] + 1e-6
        # siblings are distinct tokens
        for i in range(N):
            kids = [toks[c] for c in range(N) if par[c] == i]
            assert len(kids) == len(set(kids))
        # the node set is EAGLE-2's: the `total` best of all expanded candidates by cumulative score
        assert {tuple(node_path(par, toks, i)) for i in range(1, N)} == eagle2_paths(drafter, feats[b], p, eff)


def eagle2_paths(drafter: EagleDrafter, feats: torch.Tensor, ctx: list[int], depth: int) -> set:
    """EAGLE-2's tree by brute force with uncached logits: top_k per frontier node, the best top_k children as
    the next frontier, then the total_tokens best candidates by cumulative log-probability."""
    m, k = drafter.model, drafter.top_k
    cands = []  # (score, path)
    frontier = [(0.0, [])]
    for d in range(depth):
        level = []
        for score, path in frontier:
            lp = uncached_logits(drafter, feats, ctx, path).float().log_softmax(-1)
            top = lp.topk(k)
            for v, i in zip(top.values.tolist(), m.to_target_ids(top.indices).tolist()):
                level.append((score + v, path + [i]))
        cands += level
        frontier = sorted(level, key=lambda c: -c[0])[:k]
    best = sorted(cands, key=lambda c: -c[0])[: drafter.total_tokens]
    return {tuple(p) for _, p in best}


# ---------------------------------------------------------------------------------------------------------------
# Training tiny drafts on the target's own greedy continuations.

PROMPT_GEN = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, V, (n,), generator=PROMPT_GEN).tolist() for n in (2, 5, 9, 3, 12, 7)]
NEW = 40




def reference_outputs() -> list[list[int]]:
    if "ref" not in _CACHE:
        _CACHE["ref"] = [hf_greedy(target(), p, NEW) for p in PROMPTS]
    return _CACHE["ref"]


def training_batch(layers):
    """Right-padded sequences (prompt + greedy continuation): tokens ``[S, T]``, features ``[S, T, Hf]``,
    lengths."""
    m = target()
    seqs = [p + c for p, c in zip(PROMPTS, reference_outputs())]
    T = max(len(s) for s in seqs)
    toks = torch.zeros(len(seqs), T, dtype=torch.int64)
    feats = []
    with torch.no_grad():
        for i, s in enumerate(seqs):
            toks[i, : len(s)] = torch.tensor(s)
            hs = m(torch.tensor([s]), output_hidden_states=True).hidden_states
            f = torch.cat([hs[j][0] for j in layers], -1)
            feats.append(F.pad(f, (0, 0, 0, T - len(s))))
    return toks, torch.stack(feats), torch.tensor([len(s) for s in seqs])


def trained_draft(version: int):
    """A draft fitted (Adam) to the target's greedy continuations: EAGLE-1 regresses the next feature and
    classifies the token after it through the target's lm_head; EAGLE-3 classifies in its draft vocabulary (the
    64 most frequent ids), from target features and, a second time, from its own shifted outputs."""
    key = f"draft{version}"
    if key in _CACHE:
        return _CACHE[key]
    tgt = target()
    emb, lm = tgt.get_input_embeddings(), tgt.get_output_embeddings()
    layers = (-1,) if version == 1 else (2, 4, 5)
    toks, feats, lens = training_batch(layers)
    S, T = toks.shape
    t = torch.arange(T - 2)
    valid = t[None] < (lens[:, None] - 2)  # inputs (feat t, tok t+1) with targets tok t+2 / feat t+1
    inp_e = emb(toks[:, 1: T - 1]).detach()
    pos = t[None].expand(S, -1)
    torch.manual_seed(0)
    if version == 1:
        m = Eagle1Model(draft_config(), fc_bias=True)
        y_tok = toks[:, 2:].masked_fill(~valid, -100)
    else:
        m = Eagle3Model(draft_config(draft_vocab_size=VD))
        counts = torch.bincount(toks[toks > 0], minlength=V)
        counts[0] = -1  # the pad id never counts
        ids = counts.topk(VD).indices.sort().values
        m.set_vocab_map(ids)
        lookup = torch.full((V,), -100, dtype=torch.int64)
        lookup[ids] = torch.arange(VD)
        y_tok = lookup[toks[:, 2:]].masked_fill(~valid, -100)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    with torch.enable_grad():  # (also when the first caller is a no_grad test)
        for _ in range(300):
            out = m(feats[:, : T - 2], inp_e, pos, from_target=True)
            if version == 1:
                reg = F.smooth_l1_loss(out, feats[:, 1: T - 1], reduction="none").mean(-1)
                reg = (reg * valid).sum() / valid.sum()
                loss = reg + 0.3 * F.cross_entropy(lm(out).reshape(-1, V), y_tok.reshape(-1), ignore_index=-100)
            else:
                loss = F.cross_entropy(m.logits(out).reshape(-1, VD), y_tok.reshape(-1), ignore_index=-100)
                shifted = torch.cat([out[:, :1], out[:, :-1]], 1)  # own output at t - 1 fed at t
                out2 = m(shifted, inp_e, pos, from_target=False)
                loss = loss + F.cross_entropy(m.logits(out2)[:, 1:].reshape(-1, VD), y_tok[:, 1:].reshape(-1),
                                              ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
    m.requires_grad_(False)
    m.eval()
    _CACHE[key] = m
    return m


CASES = {"eagle1_chain": (1, dict(depth=5, top_k=1, total_tokens=5)),
         "eagle2_tree": (1, dict(depth=5, top_k=4, total_tokens=24)),
         "eagle3_tree": (3, dict(depth=5, top_k=4, total_tokens=24))}
MEAN_ACCEPTED: dict = {}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf(case):
    version, kw = CASES[case]
    m = target()
    drafter = EagleDrafter(trained_draft(version), target=m, **kw)
    accepted = []
    for p, want in zip(PROMPTS, reference_outputs()):
        counter = CountForwards(m)
        try:
            out, stats = generate(m, drafter, torch.tensor(p), max_new_tokens=NEW, eos_token_id=[])
        finally:
            counter.handle.remove()
        assert out[len(p):].tolist() == want
        assert counter.calls == stats.target_forwards + stats.prefill_forwards == stats.steps + 1
        accepted.append(stats.mean_accepted_length)
    mean = sum(accepted) / len(accepted)
    MEAN_ACCEPTED[case] = mean
    print(f"{case}: mean accepted length {mean:.2f}")
    assert mean > 1.5, accepted  # drafts are really accepted (not a vacuous pass)


@pytest.mark.parametrize("version", [1, 3])
def test_batched_prompts_and_budget_inside_accepted_runs(version):
    m = target()
    drafter = EagleDrafter(trained_draft(version), depth=4, top_k=3, total_tokens=12, target=m)
    prompts = [PROMPTS[2], [PROMPTS[0][0]], PROMPTS[4]]
    for new in (1, 7, 13):  # (the reference continuations contain id 2, the config's EOS: HF ignores it here)
        outs, stats = generate(m, drafter, prompts, max_new_tokens=new, eos_token_id=[])
        for p, o in zip(prompts, outs):
            assert o[len(p):].tolist() == hf_greedy(m, p, new)
    assert stats.mean_accepted_length > 1


@pytest.mark.parametrize("steps", ["drafted", "plain", "mixed"])
@pytest.mark.parametrize("rows", [[1, 3], [3]], ids=["two_rows", "one_row"])
@torch.no_grad()
def test_features_kept_and_catch_up_after_rollback(rows, steps):
    """After a generation the drafter holds the target's features of every position before the last token, and
    a chain drafted now (catch-up over the rolled-back cache) equals the uncached recomputation. One row takes the
    drafter's batch-1 paths (catch-up by slices, features by one index_select), two rows the general ones; plain
    steps (an adaptive drafter's depth 0: one-node trees, the draft's prefill deferred) their one write per row."""
    from specdec_ext.adaptive import AdaptiveDrafter

    m = target()
    drafter = EagleDrafter(trained_draft(1), depth=3, top_k=3, total_tokens=8, target=m)
    driver = {"drafted": drafter, "plain": AdaptiveDrafter(drafter), "mixed": AdaptiveDrafter(drafter, explore_every=2)}[steps]
    if steps == "plain":  # (pinned to plain steps with the rows held: mode "off" would leave them out of the drafter)
        driver.choose = lambda B, max_depth, budgets=None: (0, False)
    prompts = [PROMPTS[i] for i in rows]
    held, left = list(range(len(prompts))), {}  # prompt of each drafter row; features of the rows that left
    retire = drafter.retire

    def snapshot_then_retire(keep):
        if keep.numel() == 0:  # the last rows leaving: held back, so that the chain below drafts from their state
            return
        for i, b in enumerate(held):
            if i not in keep.tolist():
                left[b] = drafter.feats[i].clone()
        held[:] = [held[i] for i in keep.tolist()]
        retire(keep)

    drafter.retire = snapshot_then_retire
    outs, stats = generate(m, driver, prompts, max_new_tokens=15, eos_token_id=[])
    assert (stats.mean_accepted_length == 1) if steps == "plain" else (stats.mean_accepted_length > 1)
    if steps == "mixed":
        assert 0 in driver.depth_hist and len(driver.depth_hist) > 1, driver.depth_hist
    for b, o in enumerate(outs):
        seq = o.tolist()
        f = target_features(drafter, seq)
        feats = left[b] if b in left else drafter.feats[held.index(b)]
        torch.testing.assert_close(feats[: len(seq) - 1], f[:-1], atol=1e-4, rtol=1e-4)
    # draft a chain from the final state of the rows still held (top_k = 1 view of the same cache)
    seqs = [outs[b].tolist() for b in held]
    state = make_state(seqs)
    drafter.top_k, drafter.total_tokens, drafter.depth = 1, 3, 3
    tree = drafter.propose(state, 3, drafter.max_nodes)
    for b, seq in enumerate(seqs):
        f = target_features(drafter, seq)
        path = []
        for _ in range(3):
            path.append(int(uncached_logits(drafter, f, seq, path).argmax()))
        assert tree.tokens[b].tolist() == [seq[-1]] + path


@pytest.mark.parametrize("calibrate", [False, True])
def test_sampling_runs(calibrate):
    m = target()
    drafter = EagleDrafter(trained_draft(3), depth=4, top_k=3, total_tokens=12, target=m, calibrate=calibrate)
    a, stats = generate(m, drafter, [PROMPTS[1], PROMPTS[3]], max_new_tokens=12, temperature=0.7, top_k=20, seed=3)
    drafter.reset_calibration()  # the same seed repeats the same tokens from the same calibration state
    b, _ = generate(m, drafter, [PROMPTS[1], PROMPTS[3]], max_new_tokens=12, temperature=0.7, top_k=20, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(len(x) == len(p) + 12 for x, p in zip(a, [PROMPTS[1], PROMPTS[3]]))
    assert stats.target_forwards == stats.steps
    assert (drafter.score_scale == 1.0) != calibrate


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_sampling_matches_the_target_distribution(T, top_k, top_p):
    """The chi-square test of test_generate_sampling (same tiny V = 8 target, rows, thresholds; p < 1e-3 per test)
    with an EAGLE-1 dynamic tree drafted by a random draft (deterministic top-k drafts: lossless)."""
    sampling = pytest.importorskip("test_generate_sampling")
    tgt = sampling.tiny(21)
    Vs = sampling.V
    joint, third = sampling.exact_distributions(tgt, T, top_k, top_p)
    torch.manual_seed(3)
    draft = Eagle1Model(EagleConfig(hidden_size=32, intermediate_size=64, num_attention_heads=1,
                                    num_key_value_heads=1, vocab_size=Vs, head_dim=64)).eval()
    drafter = EagleDrafter(draft, depth=2, top_k=2, total_tokens=4)
    prompts = torch.tensor(sampling.PROMPT).expand(sampling.ROWS, -1).contiguous()
    out, st = generate(tgt, drafter, prompts, max_new_tokens=3, eos_token_id=[], temperature=T, top_k=top_k,
                       top_p=top_p, generator=torch.Generator().manual_seed(97))
    new = out[:, len(sampling.PROMPT):]
    p_pair = sampling.chi_square_p(torch.bincount(new[:, 0] * Vs + new[:, 1], minlength=Vs * Vs), joint)
    p_third = sampling.chi_square_p(torch.bincount(new[:, 2], minlength=Vs), third)
    assert p_pair > 1e-3 and p_third > 1e-3, (p_pair, p_third)
    assert st.accept_hist[0] > 0 and sum(st.accept_hist[1:]) > sampling.ROWS // 10, st.accept_hist


@pytest.mark.parametrize("version", [1, 3])
def test_official_checkpoint_end_to_end(tmp_path, version):
    """A trained draft written in the official layout and loaded back drafts as well as before."""
    from specdec_ext.models.checkpoints import save_eagle

    m = target()
    save_eagle(trained_draft(version), tmp_path / "draft", base_model_name_or_path="tiny-llama",
               safetensors=version == 3)
    drafter = EagleDrafter.from_pretrained(tmp_path / "draft", target=m, depth=5, top_k=4, total_tokens=24)
    assert drafter.max_nodes == 25
    out, stats = generate(m, drafter, torch.tensor(PROMPTS[1]), max_new_tokens=NEW, eos_token_id=[])
    assert out[len(PROMPTS[1]):].tolist() == reference_outputs()[1]
    assert stats.mean_accepted_length > 1.5


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16], ids=["f32_draft", "bf16_draft"])
def test_bfloat16_target(version, draft_dtype):
    """Features, embeddings and logits are cast between the target's and the draft's dtypes."""
    m = make_model("llama", seed=11, num_hidden_layers=L_TARGET, dtype=torch.bfloat16)
    drafter = EagleDrafter(random_draft(version).to(draft_dtype), depth=3, top_k=3, total_tokens=8, target=m)
    prompts = [PROMPTS[1], [PROMPTS[0][0]]]
    plain, _ = generate(m, None, prompts, max_new_tokens=8, eos_token_id=[])
    out, stats = generate(m, drafter, prompts, max_new_tokens=8, eos_token_id=[])
    assert all(torch.equal(a, b) for a, b in zip(out, plain))
    assert drafter.feats.dtype == draft_dtype and stats.target_forwards == stats.steps


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-1 static trees (choices lists).


@pytest.mark.parametrize("version", [1, 3])
@torch.no_grad()
def test_static_tree_nodes_equal_uncached_ranks(version):
    from specdec_ext.drafters.trees import MC_SIM_7B_63, static_tree

    tgt = target()
    tree = static_tree(MC_SIM_7B_63, max_nodes=20)
    drafter = EagleDrafter(random_draft(version, seed=7), target=tgt, choices=tree)
    assert drafter.max_nodes == 20 and drafter.depth == tree.max_depth
    state = make_state(PROMPTS_P)
    feats = [target_features(drafter, p) for p in PROMPTS_P]
    P = max(len(p) for p in PROMPTS_P)
    pre = torch.zeros(3, P - 1, feats[0].shape[-1])
    for b, f in enumerate(feats):
        pre[b, : len(PROMPTS_P[b]) - 1] = f[:-1]
    drafter.begin(tgt, state, (pre,) if version == 1 else tuple(pre.split(H, -1)))
    out = drafter.propose(state, 10, drafter.max_nodes)
    assert out.parents[0].tolist() == list(tree.parents) and out.draft_probs is None
    m = drafter.model
    for b, p in enumerate(PROMPTS_P):
        toks = out.tokens[b].tolist()
        assert toks[0] == p[-1]
        for i in range(1, tree.num_nodes):
            path = node_path(list(tree.parents), toks, i)
            lg = uncached_logits(drafter, feats[b], p, path[:-1])
            assert toks[i] == int(m.to_target_ids(lg.topk(tree.top_k).indices)[tree.rank[i]]), (b, i)
    shallow = drafter.propose(state, 1, drafter.max_nodes)
    assert shallow.parents[0].tolist() == [-1] + [0] * sum(1 for d in tree.depth if d == 1)


def test_static_tree_greedy_equals_hf():
    from specdec_ext.drafters.trees import MC_SIM_7B_63, static_tree

    m = target()
    drafter = EagleDrafter(trained_draft(1), choices=static_tree(MC_SIM_7B_63, max_nodes=26))
    accepted = []
    for p, want in zip(PROMPTS, reference_outputs()):
        out, stats = generate(m, drafter, torch.tensor(p), max_new_tokens=NEW, eos_token_id=[])
        assert out[len(p):].tolist() == want
        accepted.append(stats.mean_accepted_length)
    mean = sum(accepted) / len(accepted)
    print(f"eagle1_static_tree: mean accepted length {mean:.2f}")
    assert mean > 1.5, accepted


@pytest.mark.parametrize("eagle_dtype", [None, "bfloat16", "auto"])
def test_cli_eagle(tmp_path, capsys, monkeypatch, eagle_dtype):
    """`specdec generate --eagle DIR` loads an official-layout draft and reproduces HF greedy output, with the
    draft in the dtype `--eagle-dtype` asks for (default: the target's)."""
    from specdec_ext.cli import main
    from specdec_ext.models.checkpoints import resolve_eagle_dtype, save_eagle

    m = target()
    m.save_pretrained(tmp_path / "target")
    save_eagle(trained_draft(1), tmp_path / "draft", base_model_name_or_path="tiny-llama", safetensors=True)
    prompt = " ".join(map(str, PROMPTS[1]))
    loaded = []
    real = EagleDrafter.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        drafter = real(cls, *args, **kwargs)
        loaded.append(drafter.model.fc.weight.dtype)
        return drafter

    monkeypatch.setattr(EagleDrafter, "from_pretrained", classmethod(spy))
    assert main(["generate", "--model", str(tmp_path / "target"), "--eagle", str(tmp_path / "draft"),
                 "--eagle-depth", "5", "--eagle-top-k", "4", "--eagle-total-tokens", "24", "--prompt-ids", prompt,
                 "--max-new-tokens", str(NEW), "--no-stream",
                 *(["--eagle-dtype", eagle_dtype] if eagle_dtype else [])]) == 0
    assert loaded == [resolve_eagle_dtype(eagle_dtype, torch.float32)]
    out = capsys.readouterr().out
    assert " ".join(map(str, reference_outputs()[1])) in out
    assert "accepted" in out


@pytest.mark.parametrize("version", [1, 3])
def test_draft_prefill_runs_in_begin(version):
    """The EAGLE draft reads every prompt position but the last during the generation's prefill (begin): the first
    propose's catch-up covers one position per row; output equals HF greedy, 1-token prompts included."""
    m = target()
    drafter = EagleDrafter(trained_draft(version), depth=3, top_k=2, total_tokens=6, target=m)
    seen = record_valid_at_propose(drafter)
    prompts = [PROMPTS[4], [PROMPTS[0][0]], PROMPTS[1]]
    outs, _ = generate(m, drafter, prompts, max_new_tokens=6, eos_token_id=[])
    assert seen[0] == [len(PROMPTS[4]) - 2, 0, len(PROMPTS[1]) - 2]
    for p, o in zip(prompts, outs):
        assert o[len(p):].tolist() == hf_greedy(m, p, 6)


# ---------------------------------------------------------------------------------------------------------------
# Score calibration.


def _step_result(B: int, N: int, best_child_accepted: list[bool]) -> StepResult:
    accepted = torch.full((B, N), -1, dtype=torch.int64)
    accepted[:, 0] = 0
    for b, ok in enumerate(best_child_accepted):
        if ok:
            accepted[b, 1] = 1
    accept_len = torch.tensor([1 if ok else 0 for ok in best_child_accepted])
    return StepResult(accepted=accepted, accept_len=accept_len, next_token=torch.zeros(B, dtype=torch.int64),
                      appended=[1] * B, hidden_states=(torch.zeros(B, N, H),),
                      host_accept_len=accept_len.tolist())


def prefill_features(tgt) -> torch.Tensor:
    """The target's prefill features of PROMPTS_P as the loop hands them to ``begin``: ``[3, P - 1, H]``."""
    feats = [target_features(EagleDrafter(random_draft(1), target=tgt), p) for p in PROMPTS_P]
    pre = torch.zeros(3, max(len(p) for p in PROMPTS_P) - 1, H)
    for b, f in enumerate(feats):
        pre[b, : len(PROMPTS_P[b]) - 1] = f[:-1]
    return pre


@torch.no_grad()
def test_calibration_follows_the_best_childs_acceptance():
    tgt = target()
    pre = prefill_features(tgt)

    def fresh(**kw):
        d = EagleDrafter(random_draft(1), depth=3, top_k=2, total_tokens=4, target=tgt, **kw)
        state = make_state(PROMPTS_P)
        d.begin(tgt, state, (pre,))
        return d, state

    d, state = fresh()
    assert d.score_scale == 1.0
    tree = d.propose(state, 10, d.max_nodes)
    predicted = d.calibration.predicted.clone()
    assert predicted.shape == (3,) and bool(((predicted > 0) & (predicted < 1)).all())
    d.observe(state, tree, _step_result(3, tree.num_nodes, [True] * 3))
    want = math.exp(0.2 * float((1 - predicted).mean()))
    assert d.score_scale == pytest.approx(want, rel=1e-5)  # accepted more often than predicted: sharper
    for _ in range(200):
        tree = d.propose(state, 10, d.max_nodes)
        d.observe(state, tree, _step_result(3, tree.num_nodes, [True] * 3))
    assert d.score_scale == pytest.approx(16.0)  # clamped
    scales = []
    for _ in range(100):  # never accepted: the scale falls (towards flat scores, where the prediction -> 0)
        tree = d.propose(state, 10, d.max_nodes)
        d.observe(state, tree, _step_result(3, tree.num_nodes, [False] * 3))
        scales.append(d.score_scale)
    assert all(b < a for a, b in zip(scales, scales[1:])) and scales[-1] < 4.0
    d.calibration.log_scale = torch.tensor(-10.0)
    tree = d.propose(state, 10, d.max_nodes)
    d.observe(state, tree, _step_result(3, tree.num_nodes, [False] * 3))
    assert d.score_scale == pytest.approx(1 / 16)  # clamped
    # every row of the batch counts (rows that finished have left it); a step without a tree (depth 0) changes
    # nothing
    d, state = fresh(calibration_rate=0.5)
    tree = d.propose(state, 10, d.max_nodes)
    p = d.calibration.predicted.clone()
    d.observe(state, tree, _step_result(3, tree.num_nodes, [True, False, False]))
    want = math.exp(0.5 * float((torch.tensor([1.0, 0.0, 0.0]) - p).mean()))
    assert d.score_scale == pytest.approx(want, rel=1e-5)
    before = d.score_scale
    tree = d.propose(state, 0, d.max_nodes)
    d.observe(state, tree, _step_result(3, 1, [False] * 3))
    assert d.score_scale == before
    # the scale ranks candidates; it never changes them: a chain is the same whatever the scale
    d, state = fresh()
    chain = EagleDrafter(d.model, depth=3, top_k=1, total_tokens=3, target=tgt)
    chain.begin(tgt, state, (pre,))
    raw = chain.propose(state, 10, chain.max_nodes).tokens.clone()
    chain.calibration.log_scale = torch.tensor(math.log(8.0))
    assert torch.equal(chain.propose(state, 10, chain.max_nodes).tokens, raw)
    # off: raw EAGLE-2 scores
    d, state = fresh(calibrate=False)
    tree = d.propose(state, 10, d.max_nodes)
    d.observe(state, tree, _step_result(3, tree.num_nodes, [True] * 3))
    assert d.score_scale == 1.0
    with pytest.raises(ValueError, match="calibration_rate"):
        EagleDrafter(random_draft(1), calibration_rate=0.0)


# ---------------------------------------------------------------------------------------------------------------
# A draft vocabulary for EAGLE-1 (FR-Spec).


def test_draft_vocab_restricts_drafts_and_stays_lossless():
    m = target()
    seqs = [p + c for p, c in zip(PROMPTS, reference_outputs())]
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=V)
    common = counts.argsort(descending=True)[:40]  # the 40 most frequent ids of the greedy continuations
    drafter = EagleDrafter(trained_draft(1), target=m, depth=5, top_k=4, total_tokens=24, draft_vocab=common)
    seen, accepted = set(), 0
    orig = drafter.propose

    def spy(state, max_depth, max_nodes):
        tree = orig(state, max_depth, max_nodes)
        seen.update(tree.tokens[:, 1:].flatten().tolist())
        return tree

    drafter.propose = spy
    for p, want in zip(PROMPTS, reference_outputs()):
        out, stats = generate(m, drafter, torch.tensor(p), max_new_tokens=NEW, eos_token_id=[])
        assert out[len(p):].tolist() == want
        accepted += stats.new_tokens - stats.target_forwards
    assert seen and seen <= set(common.tolist())  # only ids of the draft vocabulary are drafted
    assert accepted > NEW  # and they are accepted
    # the whole vocabulary as draft_vocab drafts exactly what no draft_vocab does
    everything = EagleDrafter(trained_draft(1), target=m, depth=5, top_k=4, total_tokens=24,
                              draft_vocab=torch.arange(V).flip(0), calibrate=False)
    plain = EagleDrafter(trained_draft(1), target=m, depth=5, top_k=4, total_tokens=24, calibrate=False)
    for d in (everything, plain):
        d.begin(m, make_state(PROMPTS_P), None)
    state = make_state(PROMPTS_P)
    a, b = everything.propose(state, 10, everything.max_nodes), plain.propose(state, 10, plain.max_nodes)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_draft_vocab_in_a_bfloat16_draft_for_a_float32_target():
    """The draft vocabulary's lm_head rows are kept in the draft's dtype (the projection runs with the draft);
    outputs stay the target's greedy ones."""
    m = target()
    common = torch.arange(0, V, 2)
    drafter = EagleDrafter(trained_draft(1).to(torch.bfloat16), target=m, depth=4, top_k=3, total_tokens=10,
                           draft_vocab=common)
    for p, want in zip(PROMPTS, reference_outputs()):
        out, stats = generate(m, drafter, torch.tensor(p), max_new_tokens=NEW, eos_token_id=[])
        assert out[len(p):].tolist() == want
    w = drafter._lm_sub.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, m.get_output_embeddings().weight[common].to(torch.bfloat16))


@pytest.mark.parametrize("bad,match", [(torch.tensor([[1, 2, 3, 4]]), "1-D"), (torch.tensor([1, 1, 2, 3]), "distinct"),
                                       (torch.tensor([1, 2, V]), "distinct"), (torch.tensor([1.0, 2.0, 3.0, 4.0]), "1-D"),
                                       (torch.tensor([1, 2]), "at least top_k")])
def test_draft_vocab_errors(bad, match):
    with pytest.raises(ValueError, match="draft_vocab"):
        EagleDrafter(random_draft(1), depth=3, top_k=3, total_tokens=6, draft_vocab=bad)
    with pytest.raises(ValueError, match="EAGLE-3 draft has its own"):
        EagleDrafter(random_draft(3), depth=3, top_k=3, total_tokens=6, draft_vocab=torch.arange(10))


def test_token_embeddings_honour_the_targets_module():
    """A plain embedding table is looked up directly; a subclass (a scaled embedding) or a hooked module is called
    as the target defines it."""

    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    m = target()
    drafter = EagleDrafter(random_draft(1), depth=2, top_k=1, total_tokens=2, target=m)
    drafter.begin(m, make_state([PROMPTS[0]]))
    ids = torch.tensor([[3, 5]])
    table = m.get_input_embeddings().weight
    assert torch.equal(drafter._embed_ids(ids), table[ids])
    scaled = Scaled(V, H)
    with torch.no_grad():
        scaled.weight.copy_(table)
    drafter._embed = scaled
    assert torch.equal(drafter._embed_ids(ids), 2.0 * table[ids])
    plain = torch.nn.Embedding(V, H)
    plain.register_forward_hook(lambda mod, args, out: out + 1.0)
    drafter._embed = plain
    assert torch.equal(drafter._embed_ids(ids), plain.weight[ids] + 1.0)


@torch.no_grad()
def test_a_budget_of_one_node_per_depth_drafts_eagle1s_chain():
    """``propose(state, d, n)`` on an EAGLE-2 drafter: with ``n <= d + 1`` the tree is EAGLE-1's chain of
    ``n - 1`` tokens over the same draft (the chain steps of AdaptiveDrafter), token for token; a larger budget keeps
    the best ``n - 1`` of the tree's candidates."""
    tgt = target()
    pre = prefill_features(tgt)
    model = random_draft(1)
    tree_d = EagleDrafter(model, depth=4, top_k=2, total_tokens=7, target=tgt)
    chain_d = EagleDrafter(model, depth=4, top_k=1, total_tokens=4, target=tgt)
    state = make_state(PROMPTS_P)
    for d in (tree_d, chain_d):
        d.begin(tgt, state, (pre,))
    for depth, budget in [(4, 5), (3, 4), (4, 3), (2, 3), (1, 2)]:
        got, want = tree_d.propose(state, depth, budget), chain_d.propose(state, depth, budget)
        assert got.num_nodes == min(depth, budget - 1) + 1
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents), (depth, budget)
    full = tree_d.propose(state, 4, tree_d.max_nodes)
    assert full.num_nodes == 8 and not torch.equal(full.parents[:, 1:], torch.arange(7).expand(3, 7))  # a tree
    for budget in (6, 7):
        cut = tree_d.propose(state, 4, budget)
        assert cut.num_nodes == budget
        # the best budget - 1 candidates of the same growth: a subset of the full tree's (token, parent token) pairs
        for b in range(3):
            pairs = lambda t: {(int(t.tokens[b, i]), int(t.tokens[b, t.parents[b, i]])) for i in range(1, t.num_nodes)}
            assert pairs(cut) <= pairs(full)
    assert tree_d.propose(state, 4, 1).num_nodes == 1
