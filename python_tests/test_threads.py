"""specdec_ext.threads: the ``--threads`` value, the ``auto`` count (free cores, a cgroup quota, OMP_NUM_THREADS),
and every ``specdec`` command taking ``--threads``."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from specdec_ext import threads
from specdec_ext.cli import main


@pytest.mark.parametrize("value, want", [("auto", "auto"), (" AUTO ", "auto"), ("3", 3), (2, 2), ("1", 1)])
def test_parse_threads_accepts(value, want):
    assert threads.parse_threads(value) == want


@pytest.mark.parametrize("value", ["0", "-1", 0, "x", "", 1.5, True, None, "2.0"])
def test_parse_threads_refuses_naming_the_value(value):
    with pytest.raises(ValueError, match=r"threads must be 'auto' or an integer >= 1, got"):
        threads.parse_threads(value)


@pytest.mark.parametrize("usable, busy, torch_default, want", [
    (2, 0, 2, 2),  # idle: every core
    (2, 1, 2, 1),  # one busy process on two cores: one thread
    (2, 5, 2, 1),  # at least one
    (16, 3, 8, 5),  # torch's default (physical cores) caps the count before the busy cores are taken off
    (4, 0, 8, 4),  # an affinity mask or quota caps it
])
def test_auto_counts_the_free_cores(monkeypatch, usable, busy, torch_default, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: usable)
    monkeypatch.setattr(threads, "busy_cores", lambda: busy)
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", torch_default)
    assert threads.default_threads() == want


def test_auto_keeps_torch_count_when_omp_num_threads_is_set(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", 3)
    monkeypatch.setattr(threads, "busy_cores", lambda: 2)
    assert threads.default_threads() == 3


def test_busy_cores_is_at_most_what_runs_now(monkeypatch):
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (3.6, 1.0, 1.0))
    monkeypatch.setattr(threads, "_running_now", lambda: 1)
    assert threads.busy_cores() == 1  # a load that has ended is not counted
    monkeypatch.setattr(threads, "_running_now", lambda: 9)
    assert threads.busy_cores() == 4
    monkeypatch.setattr(threads, "_running_now", lambda: None)  # no /proc/stat: the load average alone
    assert threads.busy_cores() == 4


@pytest.mark.parametrize("text, want", [("max 100000", None), ("150000 100000", 2), ("50000 100000", 1),
                                        ("400000 100000\n", 4), ("garbage", None)])
def test_quota_cores(tmp_path, text, want):
    f = tmp_path / "cpu.max"
    f.write_text(text)
    assert threads.quota_cores(str(f)) == want
    assert threads.quota_cores(str(tmp_path / "missing")) is None


def test_set_threads_sets_torch():
    saved = torch.get_num_threads()
    try:
        assert threads.set_threads(1) == 1 and torch.get_num_threads() == 1
        n = threads.set_threads("auto")
        assert n >= 1 and torch.get_num_threads() == n
    finally:
        torch.set_num_threads(saved)


COMMANDS = [["generate"], ["demo"], ["ops-tour"], ["train-medusa"], ["train-eagle"], ["train-draft"], ["bench"],
            ["zoo", "build"], ["zoo", "evaluate"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_takes_threads(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert "--threads N|auto" in out.getvalue()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_bad_thread_count_is_one_line(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--threads", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--threads: must be 'auto' or an integer >= 1, got '0'" in err and "\n" not in err


def test_the_command_runs_at_its_thread_count(tmp_path):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(SystemExit):  # (no model there: the command fails after its threads are set)
            main(["generate", "--model", str(tmp_path / "none"), "--prompt-ids", "1", "--threads", "1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(saved)


def test_a_command_may_keep_its_own_default():
    import argparse

    p = argparse.ArgumentParser()
    threads.add_threads_argument(p, default=1, why="small products")
    assert p.parse_args([]).threads == 1 and p.parse_args(["--threads", "auto"]).threads == "auto"
    with pytest.raises(ValueError, match="threads must be"):
        threads.add_threads_argument(argparse.ArgumentParser(), default=0)
