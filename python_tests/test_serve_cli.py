"""``specdec serve`` from the command line: vLLM's ``--speculative-config`` becomes the same drafter flags, bad
command lines are one-line errors, and a real server process (a tiny model saved to a directory, the n-gram drafter)
answers like ``generate()``, requires its API key, and on SIGTERM stops admitting, lets a short in-flight stream
finish, aborts a long one at ``--shutdown-timeout`` and exits in bounded time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from test_serve import httpx, plain_greedy  # (skips without the server's packages)

import test_generate_greedy as greedy_t  # noqa: E402
from test_engine import word_tokenizer  # noqa: E402

from specdec_ext.cli import main  # noqa: E402
from specdec_ext.serve.cli import add_serve_command, apply_speculative_config  # noqa: E402
from specdec_ext.serve.frozen_heap import freeze_startup_objects  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("config,want", [
    ({"method": "eagle", "model": "E", "num_speculative_tokens": 5},
     {"eagle": "E", "eagle_depth": 5, "eagle_top_k": 1, "eagle_total_tokens": 5}),
    ({"method": "eagle3", "model": "E3"}, {"eagle": "E3", "eagle_depth": None, "eagle_top_k": None}),  # (the device's)
    ({"method": "medusa", "model": "M", "num_speculative_tokens": 3}, {"medusa": "M"}),
    ({"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4},
     {"ngram": True, "num_draft_tokens": 6, "max_ngram": 4}),
    ({"method": "draft_model", "model": "D", "num_speculative_tokens": 3}, {"draft_model": "D", "num_draft_tokens": 3}),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 12, "suffix_decoding_max_spec_factor": 2.0,
      "suffix_decoding_min_token_prob": 0.2},
     {"suffix": True, "suffix_depth": 12, "suffix_spec_factor": 2.0, "suffix_min_prob": 0.2}),
])
def test_speculative_config_sets_the_drafter_flags(config, want):
    args = serve_args("--model", "T", "--speculative-config", json.dumps(config))
    apply_speculative_config(args)
    assert {k: getattr(args, k) for k in want} == want


@pytest.mark.parametrize("config,words", [
    ("{not json", "not valid JSON"),
    ('["eagle"]', "JSON object"),
    ('{"method": "lookahead"}', "method must be one of"),
    ('{"method": "eagle"}', "needs \\\"model\\\""),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "acceptance": 1}', "unsupported key(s) acceptance"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": 100}', "counts tokens here"),
    ('{"method": "ngram", "suffix_decoding_min_token_prob": 0.2}', "belong(s) to method \\\"suffix\\\""),
])
def test_speculative_config_errors(config, words):
    args = serve_args("--model", "T", "--speculative-config", config)
    with pytest.raises(ValueError, match="--speculative-config") as err:
        apply_speculative_config(args)
    assert words.replace("\\", "") in str(err.value)


@pytest.mark.parametrize("argv,words", [
    ([], "exactly one of --model DIR and --zoo"),
    (["--model", "/nonexistent", "--zoo"], "exactly one of --model DIR and --zoo"),
    (["--model", "/nonexistent", "--ngram", "--eagle", "E"], "choose one drafter"),
    (["--model", "/nonexistent", "--suffix", "--ngram"], "choose one drafter"),
    (["--zoo", "--suffix", "--zoo-drafter", "eagle2"], "--suffix chooses the drafter: drop --zoo-drafter"),
    (["--zoo", "--self-spec", "skip.json", "--zoo-drafter", "eagle2"],
     "--self-spec chooses the drafter: drop --zoo-drafter"),
    (["--model", "/nonexistent", "--speculative-config", '{"method": "ngram"}', "--ngram"], "drop --ngram"),
    (["--model", "/nonexistent"], "is not a local directory"),
    (["--zoo", "--zoo-drafter", "eagle9"], "--zoo-drafter must be"),
    (["--zoo", "--zoo-drafter", "plain", "--adaptive"], "--adaptive wraps a drafter: --zoo-drafter plain"),
    (["--model", "/nonexistent", "--max-batch", "0"], "--max-batch must be >= 1"),
])
def test_bad_command_lines_are_one_line_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert words in str(exit_.value) and str(exit_.value).startswith("specdec serve: ")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny target with room for a stream that cannot finish inside the drain test's window on any machine
    (12,000 tokens; 2,000 took under 1.6 s on a Zen 5 core). The position range does not change the default RoPE."""
    d = tmp_path_factory.mktemp("tiny_model")
    model = greedy_t.target("llama")
    saved = model.config.max_position_embeddings
    model.config.max_position_embeddings = 16384
    try:
        model.save_pretrained(d)
    finally:
        model.config.max_position_embeddings = saved
    word_tokenizer().save_pretrained(d)
    return str(d)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_stream(url: str, body: dict, out: dict) -> None:
    """Collects a stream's token ids and whether it ended with [DONE] (a cut connection: done False)."""
    out.update(ids=[], done=False)
    try:
        with httpx.stream("POST", url, json=body, headers={"Authorization": "Bearer k"}, timeout=60) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    out["ids"] += json.loads(line[6:])["choices"][0].get("token_ids", [])
    except httpx.HTTPError as err:
        out["error"] = type(err).__name__


def test_server_process_answers_and_drains_on_sigterm(model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "specdec_ext", "serve", "--model", model_dir, "--ngram",
                             "--port", str(port), "--max-batch", "2", "--api-key", "k", "--shutdown-timeout", "1",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "SPECDEC_API_KEY": ""})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        prompt = greedy_t.prompt_of(9, 7)
        auth = {"Authorization": "Bearer k"}
        body = {"model": model_dir, "prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30)
        assert r.json()["choices"][0]["token_ids"] == plain_greedy(greedy_t.target("llama"), prompt, 10)

        short, long_ = {}, {}
        streams = [threading.Thread(target=read_stream, args=(url + "/v1/completions", {
            **body, "stream": True, "ignore_eos": True, "max_tokens": n}, out)) for n, out in ((60, short), (12000, long_))]
        for t in streams:
            t.start()
        time.sleep(0.3)  # (both running)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # new requests are refused while it drains
            assert httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        proc.wait(timeout=30)
        took = time.monotonic() - t0
        for t in streams:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM as for any process
    log = proc.stdout.read().decode()
    assert proc.returncode == -signal.SIGTERM, log
    assert re.search(r"; [1-9][0-9]* start-up objects frozen out of the garbage collector", log), log
    assert took < 1 + 10, took  # --shutdown-timeout 1, then the engine loop's close
    assert short["done"] and len(short["ids"]) == 60  # finished while the server drained
    assert not long_["done"] and len(long_["ids"]) < 12000  # aborted at the shutdown timeout


def test_the_suffix_flags_build_a_suffix_drafter():
    from specdec_ext.drafter_args import drafter_from_args
    from specdec_ext.drafters import SuffixDrafter

    args = serve_args("--model", "T", "--suffix", "--suffix-depth", "10", "--suffix-spec-factor", "2.5",
                      "--suffix-min-prob", "0.3", "--suffix-corpus-tokens", "5000")
    drafter = drafter_from_args(args, None)
    assert isinstance(drafter, SuffixDrafter)
    assert (drafter.max_depth, drafter.max_nodes, drafter.spec_factor, drafter.min_prob, drafter.corpus_tokens) == \
        (10, 11, 2.5, 0.3, 5000)
    with pytest.raises(ValueError, match="min_prob"):
        drafter_from_args(serve_args("--model", "T", "--suffix", "--suffix-min-prob", "2"), None)


def test_freezing_the_start_up_objects_keeps_them_out_of_collections_and_still_collects_new_garbage():
    """What ``specdec serve`` does before serving: the objects alive then leave the generations a collection walks;
    cycles made afterwards are still collected."""
    import gc
    import weakref

    class Node:
        pass

    loaded = Node()
    loaded.self = loaded  # (a container the collector tracks)
    try:
        assert freeze_startup_objects() >= 1 and gc.get_freeze_count() >= 1
        assert not any(o is loaded for o in gc.get_objects())  # frozen: no collection walks it
        garbage = Node()
        garbage.self = garbage
        gone = weakref.ref(garbage)
        del garbage
        gc.collect()
        assert gone() is None  # a cycle made after the freeze is collected as before
    finally:
        gc.unfreeze()  # (the rest of the test session collects as usual)
    assert any(o is loaded for o in gc.get_objects())
