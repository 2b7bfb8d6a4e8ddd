"""EagleStepOps (specdec_ext.models.eagle_step): an EAGLE draft's forwards and logits in a drafting step as direct
op calls.

* The same bits as the module path: whole generations with the ops and with the modules give identical trees, draft
  caches and outputs. Cases: EAGLE-1 over the target's lm_head and over a draft vocabulary, EAGLE-3, float32 and
  bfloat16 drafts, two prompts of different lengths (the padded catch-up), a static tree.
* The module path runs wherever it could differ, and then the modules' own code (their hooks) runs: a forward
  hook on one of the draft's modules or a global one, a subclassed layer, gradients, no packed kernel. A forward of
  more rows than the layer op takes also goes through the modules, with the same results.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from test_drafter_eagle import NEW, PROMPTS, make_state, target, trained_draft  # noqa: E402

from specdec_ext.drafters.eagle import EagleDrafter  # noqa: E402
from specdec_ext.drafters.trees import MC_SIM_7B_63  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext import ops  # noqa: E402
from specdec_ext.models import draft_layer as DL  # noqa: E402
from specdec_ext.models import eagle_step as ES  # noqa: E402
from specdec_ext.models import fast_linear  # noqa: E402
from specdec_ext.models.eagle_step import EagleStepOps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _draft(version: int, dtype: torch.dtype):
    return copy.deepcopy(trained_draft(version)).to(dtype)


def _needs_kernel(dtype: torch.dtype):
    if not fast_linear.packed_enabled(dtype) or fast_linear.layer_operand(torch.nn.Linear(4, 4).to(dtype)) is None:
        pytest.skip(f"no packed {dtype} kernel path on this CPU: drafting takes the module path only")


def _record(drafter: EagleDrafter, prompts: list[list[int]]) -> tuple[list, list, list]:
    """Every step's tree, the draft cache after each generation, and the outputs (greedy)."""
    trees, caches, outs = [], [], []
    orig = drafter.propose

    def spy(state, max_depth, max_nodes):
        tree = orig(state, max_depth, max_nodes)
        trees.append((tree.tokens.clone(), tree.parents.clone()))
        return tree

    drafter.propose = spy
    try:
        ids = [torch.tensor(p) for p in prompts]
        out, _ = generate(target(), drafter, ids if len(ids) > 1 else ids[0], max_new_tokens=NEW, eos_token_id=[])
        outs.extend(torch.as_tensor(o).tolist() for o in (out if isinstance(out, list) else [out]))
        caches.append((drafter.cache.k.clone(), drafter.cache.v.clone()))
    finally:
        del drafter.propose
    return trees, caches, outs


CASES = {
    "eagle1_lm_head": (1, dict(depth=5, top_k=3, total_tokens=10)),
    "eagle1_draft_vocab": (1, dict(depth=4, top_k=2, total_tokens=6, draft_vocab=torch.arange(0, 101, 2))),
    "eagle1_static": (1, dict(choices=MC_SIM_7B_63[:12])),
    "eagle3": (3, dict(depth=5, top_k=3, total_tokens=10)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_step_ops_give_the_module_paths_bits(monkeypatch, case, dtype, batch):
    _needs_kernel(dtype)
    version, kw = CASES[case]
    model = _draft(version, dtype)
    prompts = [PROMPTS[1]] if batch == 1 else [PROMPTS[2], PROMPTS[4]]
    built = []
    real = EagleStepOps.build.__func__

    def counting(cls, *a, **k):
        ops = real(cls, *a, **k)
        built.append(ops is not None)
        return ops

    runs = {}
    for mode in ("ops", "modules"):
        if mode == "ops":
            monkeypatch.setattr(EagleStepOps, "build", classmethod(counting))
        else:
            monkeypatch.setattr(EagleStepOps, "build", classmethod(lambda cls, *a, **k: None))
        drafter = EagleDrafter(model, target=target(), calibrate=False, **kw)
        runs[mode] = _record(drafter, prompts)
    assert built == [True]  # built once for the generation, and every step drafted through the ops
    (trees_a, caches_a, outs_a), (trees_b, caches_b, outs_b) = runs["ops"], runs["modules"]
    assert len(trees_a) == len(trees_b) > 1
    for (ta, pa), (tb, pb) in zip(trees_a, trees_b):
        assert torch.equal(ta, tb) and torch.equal(pa, pb)
    for (ka, va), (kb, vb) in zip(caches_a, caches_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert outs_a == outs_b


def _ready_drafter(version: int = 1) -> EagleDrafter:
    drafter = EagleDrafter(_draft(version, torch.float32), target=target(), depth=3, top_k=2, total_tokens=4)
    drafter.begin(target(), make_state([PROMPTS[2]]))
    return drafter


def _build(drafter: EagleDrafter):
    m = drafter.model
    lm = drafter._lm_head if m.version == 1 else m.lm_head
    return EagleStepOps.build(m, drafter.cache, drafter._embed_ids, lm)


@pytest.mark.parametrize("version", [1, 3])
def test_module_path_where_the_modules_could_differ(version):
    _needs_kernel(torch.float32)
    drafter = _ready_drafter(version)
    m = drafter.model
    with torch.no_grad():
        assert _build(drafter) is not None
        calls = []
        handle = m.fc.register_forward_hook(lambda mod, args, out: calls.append(1))
        assert _build(drafter) is None  # a hook on one of the draft's modules
        drafter.propose(make_state([PROMPTS[2] + [5, 6]]), 3, drafter.max_nodes)
        assert calls  # ... which the module path ran
        handle.remove()
        decoder = m.layers[0] if version == 1 else m.midlayer
        for module in (m, decoder):
            handle = module.register_forward_pre_hook(lambda mod, args: None)
            assert _build(drafter) is None
            handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
        try:
            assert _build(drafter) is None  # a global hook
        finally:
            handle.remove()
        assert _build(drafter) is not None

        class Custom(type(m.fc)):  # a subclassed layer may compute something else
            pass

        m.fc.__class__ = Custom
        assert _build(drafter) is None
        m.fc.__class__ = Custom.__mro__[1]
    with torch.enable_grad():
        assert _build(drafter) is None  # the op has no autograd


def test_module_path_without_the_packed_kernel(monkeypatch):
    drafter = _ready_drafter()
    monkeypatch.setattr(fast_linear, "_ENABLED", False)
    with torch.no_grad():
        assert _build(drafter) is None


def test_forward_beyond_the_ops_rows_takes_the_modules(monkeypatch):
    """More rows than the layer op takes (a long catch-up): the modules run, with the module path's results."""
    _needs_kernel(torch.float32)
    drafter = _ready_drafter()
    m = drafter.model
    T = DL.NATIVE_LAYER_MAX_ROWS + 6
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, T, m.feature_size, generator=g)
    ids = torch.randint(0, 101, (1, T), generator=g)
    pos = torch.arange(T)[None]
    mask = pos[0][None, :, None] >= pos[0][None, None, :]  # causal [1, T, T]
    with torch.no_grad():
        step = _build(drafter)
        calls = []
        real = ops.draft_decoder_layer
        monkeypatch.setattr(ops, "draft_decoder_layer", lambda **kw: calls.append(1) or real(**kw))
        k0, v0 = drafter.cache.k.clone(), drafter.cache.v.clone()
        got = step.forward(hidden, ids, pos, from_target=True, mask=mask, write_slots=pos, kv_len=T)
        assert not calls
        drafter.cache.k.copy_(k0)
        drafter.cache.v.copy_(v0)
        want = m(hidden, drafter._embed_ids(ids), pos, from_target=True, mask=mask, cache=drafter.cache,
                 write_slots=pos, kv_len=T)
    assert torch.equal(got, want)
    # and a few rows take the op
    with torch.no_grad():
        step.forward(hidden[:, :3], ids[:, :3], pos[:, :3], from_target=True, mask=mask[:, :3, :3],
                    write_slots=pos[:, :3], kv_len=3)
    assert calls == [1]


def test_step_ops_module_is_used_by_the_drafter():
    """The drafter builds its step's ops in propose (the hot path) and drops them at begin (the prompt's long
    catch-up)."""
    _needs_kernel(torch.float32)
    drafter = _ready_drafter()
    assert drafter._ops is None
    with torch.no_grad():
        drafter.propose(make_state([PROMPTS[2] + [5, 6]]), 3, drafter.max_nodes)
    assert isinstance(drafter._ops, ES.EagleStepOps)
    drafter.begin(target(), make_state([PROMPTS[2]]))
    assert drafter._ops is None
