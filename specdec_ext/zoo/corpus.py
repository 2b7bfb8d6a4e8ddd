"""The zoo's corpus: the Python standard library's own source, present on every machine with Python installed.

Files are listed in sorted order; a fixed ~2% of them (by a hash of their path, so the split does not move when the
standard library gains or loses files) is held out for evaluation. Tests, demos, IDLE, lib2to3 and installed
packages are left out: they are either not library code or not part of every installation.
"""

from __future__ import annotations

import os
import sysconfig
import zlib

__all__ = ["stdlib_dir", "python_sources", "split_sources", "read_sources", "heldout_texts", "EXCLUDED_DIRS",
           "CORPUS_PARTS"]

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3",
                           "ensurepip", "turtledemo", "__pycache__", "config-3"})
HELDOUT_EVERY = 50  # one file in 50 is held out
CORPUS_PARTS = ("all", "odd", "even")  # the training files used: all, or one half by a hash of the path


def stdlib_dir() -> str:
    """The directory of the running interpreter's standard library source."""
    return sysconfig.get_paths()["stdlib"]


def python_sources(root: str | None = None, max_files: int | None = None) -> list[str]:
    """Paths (relative to ``root``, default the standard library) of the ``.py`` files below it, sorted."""
    root = root or stdlib_dir()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus root {root!r} is not a directory")
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS and not x.startswith(("config-", ".")))
        found += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    found.sort()
    if not found:
        raise FileNotFoundError(f"no .py files below {root!r}")
    return found[:max_files] if max_files else found


def _path_hash(f: str) -> int:
    return zlib.crc32(f.replace(os.sep, "/").encode())


def split_sources(files: list[str], part: str = "all") -> tuple[list[str], list[str]]:
    """``(train, heldout)``: a file is held out when the CRC-32 of its relative path is 0 mod 50. ``part`` "odd" /
    "even" keeps the training files whose hash over 50 is odd / even: two disjoint halves (for a second target that
    trains on other text than the family's), the held-out files the same for both."""
    if part not in CORPUS_PARTS:
        raise ValueError(f"part must be 'all', 'odd' or 'even', got {part!r}")
    held = [f for f in files if _path_hash(f) % HELDOUT_EVERY == 0]
    keep = set(held)
    train = [f for f in files if f not in keep]
    if part != "all":
        train = [f for f in train if (_path_hash(f) // HELDOUT_EVERY) % 2 == (part == "odd")]
    return train, held


def read_sources(files: list[str], root: str | None = None) -> list[str]:
    """The files' texts (UTF-8; undecodable and empty files are skipped)."""
    root = root or stdlib_dir()
    texts = []
    for f in files:
        try:
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
    return texts


def heldout_texts(root: str | None = None) -> list[str]:
    """The held-out source files' texts (for evaluation prompts: the family never trained on them)."""
    files = python_sources(root)
    return read_sources(split_sources(files)[1], root)
