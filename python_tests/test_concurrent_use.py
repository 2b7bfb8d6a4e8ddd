"""Generations at the same time (threads): a drafter serves one generation at a time, and a second generation that
asks for a busy drafter gets a clear ValueError at once; generations with their own drafters may share the target
(and a draft model's weights) and give what they give one after the other."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_tree_attention import make_model  # noqa: E402

from specdec_ext.adaptive import AdaptiveDrafter  # noqa: E402
from specdec_ext.drafters import DraftModelDrafter, NgramDrafter  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402
from specdec_ext.models.fast_linear import pack_linears  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 9, 13, 5, 9, 13, 7, 5, 9]
BUSY = r"this \w+ is in use by another generation; a drafter serves one generation at a time: create one drafter " \
       r"per concurrent generation"
WAIT_S = 60  # a generous bound: no wait here is expected to take more than a fraction of a second


@pytest.fixture(scope="module")
def target():
    model = make_model("llama", seed=11)
    pack_linears(model)  # the packed weights are built lazily, at the first product: shared by every thread
    return model


@pytest.fixture(scope="module")
def draft_lm():
    return make_model("llama", seed=12, num_hidden_layers=1)


class Run(threading.Thread):
    """One generation on a thread; its result or its exception for the main thread."""

    def __init__(self, *args, **kwargs):
        super().__init__(daemon=True)
        self.args, self.kwargs, self.result, self.error = args, kwargs, None, None

    def run(self):
        try:
            self.result = generate(*self.args, **self.kwargs)[0].tolist()
        except BaseException as err:  # noqa: BLE001  (reported by the main thread)
            self.error = err

    def finish(self):
        self.join(WAIT_S)
        assert not self.is_alive(), "the generation did not finish"
        if self.error is not None:
            raise self.error
        return self.result


class HoldAfterFirstStep:
    """A streamer that parks its generation after the first step until ``release`` (the drafter is then busy,
    mid-generation, with caches filled: the state a second generation used to corrupt)."""

    def __init__(self):
        self.parked, self.release, self.steps = threading.Event(), threading.Event(), 0

    def put(self, value):
        self.steps += 1
        if self.steps == 2:  # put 1 is the prompt
            self.parked.set()
            assert self.release.wait(WAIT_S)

    def end(self):
        pass


def _drafters(draft_lm):
    return {"ngram": lambda: NgramDrafter(num_pred_tokens=3),
            "draft-model": lambda: DraftModelDrafter(draft_lm, num_draft_tokens=3),
            "draft-model-tree": lambda: DraftModelDrafter(draft_lm, num_draft_tokens=3, tree_width=2, total_tokens=6),
            # pinned depth: the adaptive choice follows timings, which would make sampled outputs run-dependent
            "adaptive": lambda: AdaptiveDrafter(DraftModelDrafter(draft_lm, num_draft_tokens=3), mode="fixed",
                                                depth=2)}


@pytest.mark.parametrize("name", ["ngram", "draft-model", "draft-model-tree", "adaptive"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_busy_drafter_is_refused_and_the_first_generation_is_untouched(target, draft_lm, name, temperature):
    make = _drafters(draft_lm)[name]
    kw = dict(max_new_tokens=16, eos_token_id=[], temperature=temperature, seed=3)
    want, _ = generate(target, make(), torch.tensor(PROMPT), **kw)
    drafter = make()
    hold = HoldAfterFirstStep()
    first = Run(target, drafter, torch.tensor(PROMPT), streamer=hold, **kw)
    first.start()
    assert hold.parked.wait(WAIT_S)
    try:
        with pytest.raises(ValueError, match="generate: " + BUSY):
            generate(target, drafter, torch.tensor([1, 2, 3]), max_new_tokens=4)
    finally:
        hold.release.set()
    assert first.finish() == want.tolist()  # the refused call changed nothing in the running generation
    again, _ = generate(target, drafter, torch.tensor(PROMPT), **kw)  # released at the end: usable again
    assert again.tolist() == want.tolist()


def test_a_wrapped_drafter_is_held_through_its_wrapper(target, draft_lm):
    """Two AdaptiveDrafters around one inner drafter share its caches: the second is refused while the first runs."""
    inner = DraftModelDrafter(draft_lm, num_draft_tokens=3)
    hold = HoldAfterFirstStep()
    first = Run(target, AdaptiveDrafter(inner), torch.tensor(PROMPT), max_new_tokens=8, streamer=hold)
    first.start()
    assert hold.parked.wait(WAIT_S)
    try:
        with pytest.raises(ValueError, match=BUSY.replace(r"\w+", "DraftModelDrafter")):
            generate(target, AdaptiveDrafter(inner), torch.tensor([1, 2, 3]), max_new_tokens=4)
        with pytest.raises(ValueError, match=BUSY.replace(r"\w+", "DraftModelDrafter")):
            generate(target, inner, torch.tensor([1, 2, 3]), max_new_tokens=4)
    finally:
        hold.release.set()
    first.finish()


def test_the_same_drafter_from_a_streamer_callback_is_refused_and_an_error_releases_it(target):
    """The same thread counts too (a streamer that starts a generation with the generation's own drafter); a
    generation that ends in an error releases its drafter."""
    drafter = NgramDrafter(num_pred_tokens=3)
    refused = []

    class Nested:
        def put(self, value):
            if len(refused) < 1 and value.dim() == 1:
                try:
                    generate(target, drafter, torch.tensor([1, 2]), max_new_tokens=2)
                except ValueError as err:
                    refused.append(str(err))

        def end(self):
            pass

    generate(target, drafter, torch.tensor(PROMPT), max_new_tokens=6, streamer=Nested())
    assert len(refused) == 1 and "in use by another generation" in refused[0]

    class Fails:
        def put(self, value):
            if value.dim() == 1:
                raise RuntimeError("the consumer went away")

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="the consumer went away"):
        generate(target, drafter, torch.tensor(PROMPT), max_new_tokens=6, streamer=Fails())
    want, _ = generate(target, NgramDrafter(num_pred_tokens=3), torch.tensor(PROMPT), max_new_tokens=6)
    got, _ = generate(target, drafter, torch.tensor(PROMPT), max_new_tokens=6)
    assert got.tolist() == want.tolist()


class Lockstep:
    """Streamers that make two generations take their steps in turn-ish lockstep (each step waits for the other
    generation's), so that their forwards on the shared target interleave; the first to end frees the other."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=WAIT_S)

    def put(self, value):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:  # the other generation ended
            pass

    def end(self):
        self.barrier.abort()


@pytest.mark.parametrize("pair", [("ngram", "draft-model"), ("draft-model", "draft-model-tree"), (None, "adaptive")])
def test_generations_with_their_own_drafters_share_the_target(target, draft_lm, pair):
    """The target's caches are per generation (TreeKVCache), the tree metadata and the packed-linears switch are
    context variables: two threads on one target (and one draft LM's weights) give their sequential outputs."""
    makers = _drafters(draft_lm)
    prompts = (PROMPT, [7, 3, 7, 3, 8, 7, 3])
    kws = (dict(max_new_tokens=20, eos_token_id=[]), dict(max_new_tokens=14, eos_token_id=[], temperature=0.8, seed=5))
    want = [generate(target, makers[n]() if n else None, torch.tensor(p), **kw)[0].tolist()
            for n, p, kw in zip(pair, prompts, kws)]
    lock = Lockstep()
    runs = [Run(target, makers[n]() if n else None, torch.tensor(p), streamer=lock, **kw)
            for n, p, kw in zip(pair, prompts, kws)]
    for r in runs:
        r.start()
    assert [r.finish() for r in runs] == want
