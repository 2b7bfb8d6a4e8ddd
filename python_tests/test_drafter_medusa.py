"""Medusa drafter (specdec_ext.drafters.medusa) and static trees (specdec_ext.drafters.trees).

* ``mc_sim_7b_63`` and user choice lists lay out as valid trees (``ops.build_tree(validate=True)``) whose nodes are
  exactly the choices; truncation keeps them prefix-closed; bad lists are clear errors.
* ``hidden_states[-1]`` of the HF target is after the final norm (what Medusa heads read).
* ``propose`` drafts node i as the ``rank[i]``-th best token of head ``depth[i] - 1`` on the row's hidden state;
  ``observe`` moves to the hidden state of the last accepted node.
* End to end through :func:`specdec_ext.generate.generate`: heads trained for a few hundred Adam steps (about a
  second) on the tiny target's own greedy continuations, with their own lm_heads and legacy (target's lm_head),
  give exactly Hugging Face's greedy output, with a mean accepted length > 1 (so the test is not vacuous) and one
  target forward per step; also from an official-layout checkpoint on disk, batched prompts of different lengths
  (one of length 1), and sampling.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hf_reference import CountForwards, hf_greedy  # noqa: E402
from test_hf_tree_attention import V, make_model  # noqa: E402

from specdec_ext import ops  # noqa: E402
from specdec_ext.drafters.base import DecodeState, StepResult  # noqa: E402
from specdec_ext.drafters.medusa import MedusaDrafter  # noqa: E402
from specdec_ext.drafters.trees import MC_SIM_7B_63, static_tree  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.checkpoints import save_medusa  # noqa: E402
from specdec_ext.models.medusa import MedusaHeads  # noqa: E402

H = 64
NUM_HEADS = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------------------------
# Trees.


def node_path(tree, i: int) -> tuple[int, ...]:
    path = []
    while i > 0:
        path.append(tree.rank[i])
        i = tree.parents[i]
    return tuple(reversed(path))


def test_mc_sim_7b_63_tree():
    assert len(MC_SIM_7B_63) == 63 and len(set(MC_SIM_7B_63)) == 63
    tree = static_tree()
    assert tree.num_nodes == 64 and tree.max_depth == 4 and tree.top_k == 10
    assert sorted(tree.choices) == sorted(MC_SIM_7B_63)
    parents = torch.tensor([tree.parents])
    info = ops.build_tree(parents, 0, validate=True)
    assert info.depth[0].tolist() == list(tree.depth)
    assert all(node_path(tree, i) == tree.choices[i - 1] for i in range(1, 64))
    assert all(tree.parents[i] < i for i in range(1, 64))
    assert [tree.depth.count(d) for d in range(5)] == [1, 10, 28, 23, 2]
    # the flattened [depth, rank] table index of every node
    assert all(g == (d - 1) * 10 + r for g, d, r in zip(tree.gather_index, tree.depth[1:], tree.rank[1:]))


def test_static_tree_truncation_and_custom_choices():
    t = static_tree(max_nodes=10)
    assert t.num_nodes == 10
    assert set(t.choices) == set(MC_SIM_7B_63[:9])  # the first nine are prefix-closed
    for n in (1, 2, 17, 40, 64, 100):
        t = static_tree(MC_SIM_7B_63, max_nodes=n)
        assert t.num_nodes == min(n, 64)
        assert all(len(c) == 1 or c[:-1] in t.choices for c in t.choices)
        ops.build_tree(torch.tensor([t.parents]), 0, validate=True)
    # a choice whose parent did not fit is skipped, later ones still taken
    t = static_tree([[0], [1], [1, 0], [0, 0]], max_nodes=3)
    assert t.choices == ((0,), (1,))
    t = static_tree([(2,), (2, 0), (0,)])
    assert t.choices == ((0,), (2,), (2, 0)) and t.parents == (-1, 0, 0, 2) and t.top_k == 3
    chain = static_tree([[0], [0, 0], [0, 0, 0]])
    assert chain.parents == (-1, 0, 1, 2) and chain.top_k == 1
    assert static_tree([], max_nodes=None).num_nodes == 1
    with pytest.raises(ValueError, match=r"\[1, 0\]: its parent \[1\] is not among the choices"):
        static_tree([[0], [1, 0]])
    with pytest.raises(ValueError, match="appears twice"):
        static_tree([[0], [0]])
    with pytest.raises(ValueError, match="empty"):
        static_tree([[0], []])
    with pytest.raises(ValueError, match="integers >= 0"):
        static_tree([[-1]])
    with pytest.raises(TypeError, match="not a number"):
        static_tree([0, 1])
    with pytest.raises(ValueError, match="max_nodes"):
        static_tree(max_nodes=0)


# ---------------------------------------------------------------------------------------------------------------
# Hidden states, propose, observe.

_TARGET: dict = {}


def target():
    if "m" not in _TARGET:
        _TARGET["m"] = make_model("llama", seed=11)
    return _TARGET["m"]


@torch.no_grad()
def test_last_hidden_state_is_after_final_norm():
    m = target()
    x = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
    out = m(x, output_hidden_states=True)
    torch.testing.assert_close(m.lm_head(out.hidden_states[-1]), out.logits)


def random_heads(own_lm_head: bool = True, seed: int = 0, num_heads: int = NUM_HEADS) -> MedusaHeads:
    heads = MedusaHeads(num_heads, H, V if own_lm_head else None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return heads


def make_state(prompts: list[list[int]], max_len: int = 64) -> DecodeState:
    return DecodeState.of_prompts(prompts, max_len, V)


@pytest.mark.parametrize("own_lm_head", [True, False], ids=["own_lm_head", "legacy"])
@torch.no_grad()
def test_propose_and_observe(own_lm_head):
    m = target()
    heads = random_heads(own_lm_head)
    drafter = MedusaDrafter(heads)  # default: mc_sim_7b_63 without its depth-4 choices (3 heads)
    assert drafter.tree.max_depth == 3 and drafter.max_nodes == 62 and drafter.hidden_state_layers == (-1,)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13]]
    state = make_state(prompts)
    gen = torch.Generator().manual_seed(1)
    prefill = torch.randn(3, 4, H, generator=gen)  # [B, P_max - 1, H]
    drafter.begin(m, state, (prefill,))
    tree = drafter.propose(state, 10, drafter.max_nodes)
    N = tree.num_nodes
    assert N == 62 and tree.draft_probs is None and tree.tokens.shape == tree.parents.shape == (3, N)
    info = ops.build_tree(tree.parents, state.prefix_lens, validate=True)
    assert info.depth.max() == 3
    assert tree.tokens[:, 0].tolist() == [9, 12, 13]
    # hidden state of each row: the last prompt position before the root (zeros for a one-token prompt)
    hidden = torch.stack([prefill[0, 3], prefill[1, 1], torch.zeros(H)])
    logits = heads(hidden, m.lm_head)  # [B, K, V]
    t = drafter.tree
    for b in range(3):
        order = logits[b].argsort(-1, descending=True)
        for i in range(1, N):
            assert tree.tokens[b, i] == order[t.depth[i] - 1, t.rank[i]]
    # the budget limits the depth
    shallow = drafter.propose(state, 1, drafter.max_nodes)
    assert shallow.num_nodes == 11 and shallow.parents[0].tolist() == [-1] + [0] * 10
    assert torch.equal(shallow.tokens, tree.tokens[:, :11])
    assert drafter.propose(state, 0, drafter.max_nodes).num_nodes == 1
    # observe: the new hidden state is the one at the last accepted node
    hs = torch.randn(3, N, H, generator=gen)
    accepted = torch.full((3, N), -1, dtype=torch.int64)
    accepted[0, :3] = torch.tensor([0, 1, 11])
    accepted[1:, :1] = 0
    result = StepResult(accepted, torch.tensor([2, 0, 0]), torch.tensor([1, 2, 3]), [3, 1, 1], (hs,),
                        host_accept_len=[2, 0, 0])
    drafter.observe(state, tree, result)
    torch.testing.assert_close(drafter.hidden, torch.stack([hs[0, 11], hs[1, 0], hs[2, 0]]))


@pytest.mark.parametrize("scale", [1.0, 2.5])
@torch.no_grad()
def test_per_step_tree_keeps_the_best_candidates(scale):
    """dynamic=True: each row's tree is the max_nodes - 1 choices of highest cumulative head log-probability
    (computed here path by path in float64), each node the rank-th best token of its head, parents first."""
    import math

    m = target()
    heads = random_heads(True)
    drafter = MedusaDrafter(heads, dynamic=True, max_nodes=9)
    assert drafter.max_nodes == 9 and drafter.tree.num_nodes == 62  # candidates: mc_sim_7b_63 up to depth 3
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    state = make_state(prompts)
    prefill = 3.0 * torch.randn(2, 4, H, generator=torch.Generator().manual_seed(5))
    drafter.begin(m, state, (prefill,))
    if scale != 1.0:
        drafter.calibration.log_scale = torch.tensor(math.log(scale))
    tree = drafter.propose(state, 10, drafter.max_nodes)
    assert tree.num_nodes == 9 and tree.draft_probs is None
    ops.build_tree(tree.parents, state.prefix_lens, validate=True)
    logits = heads(torch.stack([prefill[0, 3], prefill[1, 1]]), m.lm_head).double()
    lp = torch.log_softmax(scale * logits, -1)
    t = drafter.tree
    for b in range(2):
        order = logits[b].argsort(-1, descending=True)

        def score(path):
            return sum(float(lp[b, d, order[d, r]]) for d, r in enumerate(path))

        want = sorted(t.choices, key=lambda c: (-score(c), t.choices.index(c)))[:8]
        got = []
        for i in range(1, 9):
            par = int(tree.parents[b, i])
            assert 0 <= par < i
            path = (got[par - 1] if par else ()) + (None,)
            d = len(path) - 1
            rank = int((order[d] == tree.tokens[b, i]).nonzero()[0, 0])
            got.append(path[:-1] + (rank,))
        assert set(got) == set(want) and got[0] == (0,)  # node 1: head 0's best token
        torch.testing.assert_close(drafter.calibration.predicted[b].double(), lp[b, 0].exp().max(), rtol=1e-4,
                                   atol=1e-6)
    assert drafter.propose(state, 1, drafter.max_nodes).num_nodes == 9  # depth 1 only: head 0's 8 best tokens
    assert drafter.propose(state, 0, drafter.max_nodes).num_nodes == 1
    with pytest.raises(ValueError, match="max_nodes must be an integer >= 1"):
        MedusaDrafter(heads, dynamic=True, max_nodes=0)


def test_one_token_prompts_start_with_a_plain_step():
    drafter = MedusaDrafter(random_heads())
    state = make_state([[4], [7]])
    drafter.begin(target(), state, None)
    tree = drafter.propose(state, 8, drafter.max_nodes)
    assert tree.num_nodes == 1 and tree.tokens[:, 0].tolist() == [4, 7]


def test_drafter_errors():
    with pytest.raises(ValueError, match="4 levels deep but there are only 3 Medusa heads"):
        MedusaDrafter(random_heads(), choices=MC_SIM_7B_63)
    with pytest.raises(TypeError, match="MedusaHeads"):
        MedusaDrafter(torch.nn.Linear(2, 2))
    d = MedusaDrafter(random_heads(), choices=[[0], [1], [0, 0]], max_nodes=3)
    assert d.max_nodes == 3 and d.tree.choices == ((0,), (1,))
    d = MedusaDrafter(MedusaHeads(2, 32, V), choices=[[0]])
    with pytest.raises(ValueError, match="hidden size 32 but the target's hidden_size is 64"):
        d.begin(target(), make_state([[1, 2]]), None)
    d = MedusaDrafter(MedusaHeads(2, H, V).to("meta"), choices=[[0]])
    with pytest.raises(ValueError, match="heads are on meta but the target on cpu"):
        d.begin(target(), make_state([[1, 2]]), None)
    d = MedusaDrafter(MedusaHeads(2, H, V + 1), choices=[[0]])
    with pytest.raises(ValueError, match=r"vocabulary size \(102\) differs from the target's \(101\)"):
        d.begin(target(), make_state([[1, 2]]), None)


@pytest.mark.parametrize("own_lm_head", [True, False], ids=["own_lm_head", "legacy"])
def test_float32_heads_on_a_bfloat16_target(own_lm_head):
    """Hidden states are cast to the heads' dtype (and, for legacy heads, back to the target's lm_head dtype)."""
    m = make_model("llama", seed=11, dtype=torch.bfloat16)
    drafter = MedusaDrafter(random_heads(own_lm_head), choices=[[0], [1], [0, 0]])
    out, stats = generate(m, drafter, [PROMPTS[1], PROMPTS[0]], max_new_tokens=6)
    assert [len(o) for o in out] == [len(PROMPTS[1]) + 6, len(PROMPTS[0]) + 6] and stats.steps >= 2
    assert drafter.hidden.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# End to end: trained heads, greedy == Hugging Face.

PROMPT_GEN = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, V, (n,), generator=PROMPT_GEN).tolist() for n in (2, 5, 9, 3, 12, 7)]
NEW = 40




_TRAINED: dict = {}


def reference_outputs() -> list[list[int]]:
    if "ref" not in _TRAINED:
        _TRAINED["ref"] = [hf_greedy(target(), p, NEW) for p in PROMPTS]
    return _TRAINED["ref"]


def trained_heads(own_lm_head: bool) -> MedusaHeads:
    """Heads fitted (Adam, 200 steps) to predict the target's own greedy continuations at offsets 2, 3, 4."""
    if own_lm_head in _TRAINED:
        return _TRAINED[own_lm_head]
    m = target()
    X, Y = [], []
    with torch.no_grad():
        for p, cont in zip(PROMPTS, reference_outputs()):
            seq = p + cont
            hs = m(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
            for t in range(len(seq) - 1 - NUM_HEADS):
                X.append(hs[t])
                Y.append([seq[t + 2 + h] for h in range(NUM_HEADS)])
    X, Y = torch.stack(X), torch.tensor(Y)
    torch.manual_seed(0)
    heads = MedusaHeads(NUM_HEADS, H, V if own_lm_head else None)
    if own_lm_head:
        heads.init_lm_heads_from(m.lm_head)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(200):
        loss = F.cross_entropy(heads(X, m.lm_head).reshape(-1, V), Y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    heads.requires_grad_(False)
    _TRAINED[own_lm_head] = heads
    return heads


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("own_lm_head", [True, False], ids=["own_lm_head", "legacy"])
def test_greedy_equals_hf(own_lm_head, dynamic):
    m = target()
    drafter = MedusaDrafter(trained_heads(own_lm_head), dynamic=dynamic, max_nodes=12 if dynamic else None)
    refs = reference_outputs()
    accepted = []
    for p, want in zip(PROMPTS, refs):
        counter = CountForwards(m)
        try:
            out, stats = generate(m, drafter, torch.tensor(p), max_new_tokens=NEW)
        finally:
            counter.handle.remove()
        assert out[len(p):].tolist() == want
        assert counter.calls == stats.target_forwards + stats.prefill_forwards == stats.steps + 1
        accepted.append(stats.mean_accepted_length)
    mean = sum(accepted) / len(accepted)
    assert mean > 1.5, accepted  # drafts are really accepted (not a vacuous pass)
    if dynamic:
        assert drafter.score_scale != 1.0  # calibrated during the generations


def test_batched_prompts_and_budget_inside_accepted_runs():
    m = target()
    drafter = MedusaDrafter(trained_heads(True), choices=[[0], [1], [0, 0], [0, 0, 0], [1, 0]])
    prompts = [PROMPTS[2], [PROMPTS[0][0]], PROMPTS[4]]
    for new in (1, 7, 13):
        outs, stats = generate(m, drafter, prompts, max_new_tokens=new)
        for p, o in zip(prompts, outs):
            assert o[len(p):].tolist() == hf_greedy(m, p, new)
    assert stats.mean_accepted_length > 1


def test_official_checkpoint_end_to_end(tmp_path):
    m = target()
    save_medusa(trained_heads(True), tmp_path / "heads", base_model_name_or_path="tiny-llama", safetensors=True)
    drafter = MedusaDrafter.from_pretrained(tmp_path / "heads", target=m, max_nodes=20)
    assert drafter.max_nodes == 20
    out, stats = generate(m, drafter, torch.tensor(PROMPTS[1]), max_new_tokens=NEW)
    assert out[len(PROMPTS[1]):].tolist() == reference_outputs()[1]
    assert stats.mean_accepted_length > 1.5


def test_sampling_runs():
    m = target()
    drafter = MedusaDrafter(trained_heads(True))
    a, stats = generate(m, drafter, [PROMPTS[1], PROMPTS[3]], max_new_tokens=12, temperature=0.7, top_k=20, seed=3)
    b, _ = generate(m, drafter, [PROMPTS[1], PROMPTS[3]], max_new_tokens=12, temperature=0.7, top_k=20, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(len(x) == len(p) + 12 and 0 <= int(x.min()) and int(x.max()) < V
               for x, p in zip(a, [PROMPTS[1], PROMPTS[3]]))
    assert stats.target_forwards == stats.steps


# ---------------------------------------------------------------------------------------------------------------
# Sampling: lossless with Medusa's deterministic tree drafts.


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_sampling_matches_the_target_distribution(T, top_k, top_p, dynamic):
    """The chi-square test of test_generate_sampling (same tiny V = 8 target, rows, thresholds; p < 1e-3 per test,
    2 tests per parameter set) with a Medusa drafter: heads whose lm_heads are the target's (so they propose likely
    tokens) on a tree with 2 candidates at depth 1 and 2 below the first."""
    sampling = pytest.importorskip("test_generate_sampling")
    tgt = sampling.tiny(21)
    Vs = sampling.V
    joint, third = sampling.exact_distributions(tgt, T, top_k, top_p)
    heads = MedusaHeads(2, tgt.config.hidden_size, Vs).init_lm_heads_from(tgt.lm_head)
    drafter = MedusaDrafter(heads, choices=[[0], [1], [0, 0], [0, 1], [1, 0]])
    if dynamic:  # 3 of the 5 candidates per step
        drafter = MedusaDrafter(heads, choices=[[0], [1], [0, 0], [0, 1], [1, 0]], dynamic=True, max_nodes=4)
    prompts = torch.tensor(sampling.PROMPT).expand(sampling.ROWS, -1).contiguous()
    out, st = generate(tgt, drafter, prompts, max_new_tokens=3, eos_token_id=[], temperature=T, top_k=top_k,
                       top_p=top_p, generator=torch.Generator().manual_seed(97))
    new = out[:, len(sampling.PROMPT):]
    assert new.shape == (sampling.ROWS, 3)
    p_pair = sampling.chi_square_p(torch.bincount(new[:, 0] * Vs + new[:, 1], minlength=Vs * Vs), joint)
    p_third = sampling.chi_square_p(torch.bincount(new[:, 2], minlength=Vs), third)
    assert p_pair > 1e-3 and p_third > 1e-3, (p_pair, p_third)
    # not vacuous: drafts were accepted, and some rejected (the residual distribution was sampled)
    assert st.accept_hist[0] > 0 and sum(st.accept_hist[1:]) > sampling.ROWS // 10, st.accept_hist


def test_typical_acceptance_at_temperature_zero_is_greedy():
    m = target()
    drafter = MedusaDrafter(trained_heads(True))
    out, stats = generate(m, drafter, torch.tensor(PROMPTS[0]), max_new_tokens=NEW, acceptance="typical")
    assert out[len(PROMPTS[0]):].tolist() == reference_outputs()[0]
    assert stats.mean_accepted_length > 1.5


def test_typical_acceptance_thresholds_decide():
    """Thresholds 0 make every node whose token has non-zero probability acceptable (at temperature 1 that is
    every node), so each step accepts the deepest path of the tree: every step but the budget-cut last one accepts
    exactly the tree's depth — which exact verification of the same drafts does not. Typical acceptance is lossy
    by design: its rule is tested here, not a distribution."""
    m = target()
    drafter = MedusaDrafter(trained_heads(True))
    depth = max(drafter.tree.depth)
    _, loose = generate(m, drafter, torch.tensor(PROMPTS[0]), max_new_tokens=NEW, temperature=1.0, seed=0,
                        acceptance="typical", posterior_threshold=0.0, posterior_alpha=0.0, eos_token_id=[])
    assert loose.steps >= 2
    assert loose.accept_hist[depth] >= loose.steps - 1  # all steps but possibly the last took the deepest path
    _, exact = generate(m, drafter, torch.tensor(PROMPTS[0]), max_new_tokens=NEW, temperature=1.0, seed=0,
                        eos_token_id=[])
    assert exact.mean_accepted_length < loose.mean_accepted_length
    with pytest.raises(ValueError, match="acceptance"):
        generate(m, drafter, torch.tensor(PROMPTS[0]), max_new_tokens=2, acceptance="fast")
    with pytest.raises(ValueError, match="posterior_threshold"):
        generate(m, drafter, torch.tensor(PROMPTS[0]), max_new_tokens=2, acceptance="typical",
                 posterior_threshold=2.0)


def test_cli_medusa(tmp_path, capsys):
    from specdec_ext.cli import main

    m = target()
    m.save_pretrained(tmp_path / "target")
    save_medusa(trained_heads(True), tmp_path / "heads", base_model_name_or_path="tiny-llama", safetensors=True)
    prompt = " ".join(map(str, PROMPTS[1]))
    assert main(["generate", "--model", str(tmp_path / "target"), "--medusa", str(tmp_path / "heads"),
                 "--prompt-ids", prompt, "--max-new-tokens", str(NEW), "--no-stream"]) == 0
    out = capsys.readouterr().out
    assert " ".join(map(str, reference_outputs()[1])) in out
    assert "accepted" in out
    assert main(["generate", "--model", str(tmp_path / "target"), "--medusa", str(tmp_path / "heads"),
                 "--prompt-ids", prompt, "--max-new-tokens", str(NEW), "--no-stream", "--medusa-dynamic",
                 "--medusa-nodes", "10"]) == 0
    assert " ".join(map(str, reference_outputs()[1])) in capsys.readouterr().out
    with pytest.raises(SystemExit, match="max_nodes must be an integer >= 1"):
        main(["generate", "--model", str(tmp_path / "target"), "--medusa", str(tmp_path / "heads"),
              "--prompt-ids", prompt, "--medusa-dynamic", "--medusa-nodes", "0"])
