"""The engine's parts on their own: request settings (validation), stop strings over a byte-level BPE tokenizer
(matched across token boundaries, held back while they may still match, cut before the stop string), a request's
cuts at stop tokens / budget / stop strings, and the scheduler's FIFO admission and retirement order."""

from __future__ import annotations

import pytest
import torch

from specdec_ext.engine import Request, RequestSettings, Scheduler, TextStops
from specdec_ext.engine.scheduler import PREFILL_PADDING, PREFILL_SMALL, prefill_groups

# ---------------------------------------------------------------------------------------------------------------
# Settings.


@pytest.mark.parametrize("kwargs, name", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": 2.0}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": 1.5}, "seed"),
    ({"seed": 2 ** 64}, "seed"), ({"seed": -2 ** 63 - 1}, "seed"),
    ({"seed": 1, "generator": torch.Generator()}, "seed and generator"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"), ({"stop": [""]}, "stop"), ({"stop": [3]}, "stop"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"temprature": 1.0}, "temprature"),
])
def test_bad_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RequestSettings.of(**kwargs)


def test_settings_forms():
    s = RequestSettings.of(max_new_tokens=5, temperature=1, stop_token_ids=7, stop="END")
    assert (s.max_new_tokens, s.temperature, s.stop_token_ids, s.stop, s.greedy) == (5, 1.0, (7,), ("END",), False)
    assert RequestSettings.of(s) == s
    assert RequestSettings.of().greedy and RequestSettings.of().make_generator(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="not both"):
        RequestSettings.of(s, max_new_tokens=3)
    with pytest.raises(TypeError, match="generator"):
        RequestSettings.of(generator=3)
    a = RequestSettings.of(temperature=1.0, seed=3).make_generator(torch.device("cpu"))
    b = RequestSettings.of(temperature=1.0, seed=3).make_generator(torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


# ---------------------------------------------------------------------------------------------------------------
# Stop strings.


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("tokenizers")
    from specdec_ext.zoo.tokenizer import train_tokenizer

    texts = ["hello world, the end of the story. " * 20, "déjà vu, naïve café " * 20, "stop here STOP now " * 20]
    return train_tokenizer(texts, 300, min_frequency=2)


def _stream(tokenizer, stops, prompt, text):
    """Feeds ``text``'s tokens one by one; returns (pieces handed out per token, whether it stopped, tokens fed)."""
    ids = tokenizer.encode(text)
    t = TextStops(tokenizer, tuple(stops), tokenizer.encode(prompt))
    pieces, fed = [], 0
    for tok in ids:
        fed += 1
        stopped = t.push(tok)
        pieces.append(t.take())
        if stopped:
            break
    if not t.stopped:
        pieces.append(t.take(final=True))
    return pieces, t.stopped, fed, ids


def test_text_without_stops_is_the_decoded_output(tokenizer):
    text = "hello déjà vu, naïve café story."
    pieces, stopped, fed, ids = _stream(tokenizer, (), "the end ", text)
    assert not stopped and "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # split characters wait for their last byte


@pytest.mark.parametrize("stop", ["STOP", "d of the st", "é", "ry."])
def test_stop_string_across_tokens(tokenizer, stop):
    text = "hello world, the end of the story. stop here STOP now déjà"
    pieces, stopped, fed, ids = _stream(tokenizer, [stop, "never matches"], "", text)
    cut = text.index(stop)
    assert stopped and "".join(pieces) == text[:cut]
    # it stopped at the first token after which the text (complete characters: a character split over tokens waits
    # for its last byte) contains the stop string
    first = next(n for n in range(1, len(ids) + 1)
                 if not tokenizer.decode(ids[:n]).endswith("\ufffd") and stop in tokenizer.decode(ids[:n]))
    assert fed == first


def test_held_back_text_is_released_at_the_end(tokenizer):
    pieces, stopped, _, _ = _stream(tokenizer, ["the story"], "", "hello world, the")
    assert not stopped and "".join(pieces) == "hello world, the"
    assert "".join(pieces[:-1]) == "hello world, "  # "the" could begin the stop string until the end


# ---------------------------------------------------------------------------------------------------------------
# Requests.


def _request(**kw):
    s = RequestSettings.of(**kw)
    return Request(0, [1, 2], s, frozenset(s.stop_token_ids), None)


def test_request_cuts_at_stop_token_and_budget():
    r = _request(max_new_tokens=5, stop_token_ids=[9])
    assert r.emit([3, 4]) == [3, 4] and r.finish_reason is None
    assert r.emit([5, 9, 6]) == [5, 9] and r.finish_reason == "stop"
    r = _request(max_new_tokens=3, stop_token_ids=[9])
    assert r.emit([3, 4, 5, 9]) == [3, 4, 5] and r.finish_reason == "length" and r.remaining == 0


# ---------------------------------------------------------------------------------------------------------------
# Scheduler.


def test_prefill_groups_by_padding_and_the_rows_reordered_only_when_they_split():
    assert PREFILL_PADDING == 2.0 and PREFILL_SMALL == 512
    assert prefill_groups([]) == [] and prefill_groups([0]) == [[0]]
    # one group keeps the admission order, whatever the lengths
    assert prefill_groups([150] + [100] * 8) == [list(range(9))]  # 1350 padded for 950 tokens: within twice
    assert prefill_groups([120, 1, 1, 1]) == [[0, 1, 2, 3]]  # 480 padded: a forward that small stays one
    # a long prompt among short ones: a forward of its own, the short ones (by length) together
    assert prefill_groups([3903] + [63] * 63) == [list(range(1, 64)), [0]]  # 64 x 3903 padded: 31x its tokens
    assert prefill_groups([100] * 4 + [400] + [100] * 4) == [[0, 1, 2, 3, 5, 6, 7, 8], [4]]
    assert prefill_groups([2000, 7, 300, 3, 41, 7, 40]) == [[3, 1, 5, 6, 4], [2, 0]]  # (2 x 2000 for 2300: one)
    s = Scheduler(max_batch=4)
    for i in range(5):
        s.add(Request(i, [1, 2], RequestSettings.of(), frozenset(), None))
    assert [r.id for r in s.admit()] == [0, 1, 2, 3]  # oldest first
    s.reorder_admitted([2, 0, 3, 1])
    assert [r.id for r in s.running] == [2, 0, 3, 1]
    with pytest.raises(ValueError, match="order must be a permutation"):
        s.reorder_admitted([0, 0])


def test_scheduler_fifo_and_retire_order():
    s = Scheduler(max_batch=3)
    reqs = [_request() for _ in range(6)]
    for i, r in enumerate(reqs):
        r.id = i
        s.add(r)
    assert [r.id for r in s.admit()] == [0, 1, 2] and s.admit() == [] and len(s) == 6
    assert s.retire() is None
    reqs[0].finish_reason = "stop"
    assert s.retire() == [2, 1] and [r.id for r in s.running] == [2, 1]
    assert s.drop_waiting(reqs[4]) and not s.drop_waiting(reqs[1])
    assert [r.id for r in s.admit()] == [3] and [r.id for r in s.running] == [2, 1, 3]
    reqs[2].finish_reason = reqs[3].finish_reason = "length"
    assert s.retire() == [1] and [r.id for r in s.admit()] == [5]
