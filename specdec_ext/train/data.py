"""Training data for drafters: corpora read from disk, tokenized, packed into windows, optionally self-distilled.

Accepted files: plain text (any file that is not ``.jsonl`` / ``.json``: the whole file is one document), JSONL
(``.jsonl`` / ``.json``, one object a line) with ``"text"`` (a document), ``"messages"`` (chat, rendered with the
tokenizer's chat template; a document) or ``"input_ids"`` (token ids, a sequence of its own). Text is kept as it is
(indentation, blank lines): documents are tokenized whole, each followed by the tokenizer's EOS (none when it has
no EOS token), joined in file order into one stream and cut into windows of ``max_length`` tokens. Explicit
``input_ids`` are not packed: each record is chunked at ``max_length``, and one longer than the model's context is
an error naming the file and line. Self-distillation (:func:`self_distill`) replaces each window's end by the
target's own text (greedy or sampled), which is what makes drafts match the target's distribution.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

import torch

from specdec_ext.engine import Engine
from specdec_ext.models.config import text_config
from specdec_ext.train.progress import Progress

__all__ = ["DataError", "load_corpus", "prompt_of", "encode_texts", "document_stream", "windows", "self_distill",
           "distill_split", "split_heldout", "pad_batch", "BatchSampler", "model_max_length"]


class DataError(ValueError):
    """Bad training data (the message names the file and line)."""


def model_max_length(target) -> int | None:
    return getattr(text_config(target.config), "max_position_embeddings", None)


def encode_texts(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Each text tokenized whole, as it is (``add_special_tokens``: the tokenizer's own, e.g. a BOS)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]]


def document_stream(docs, separator: int | None) -> list[int]:
    """The documents (token lists) joined into one stream, each followed by ``separator`` (unless it already ends
    with it, or ``separator`` is None)."""
    stream: list[int] = []
    for ids in docs:
        stream += ids
        if separator is not None and ids and ids[-1] != separator:
            stream.append(separator)
    return stream


def windows(stream: list[int], length: int, min_length: int | None = None) -> list[list[int]]:
    """Consecutive non-overlapping windows of ``length`` tokens; the last, shorter one is kept when it has at least
    ``min_length`` tokens (None: only full windows)."""
    out = [stream[i: i + length] for i in range(0, len(stream), length)]
    if out and len(out[-1]) < (length if min_length is None else min_length):
        out.pop()
    return out


def _chat(tokenizer, messages, where: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: a chat record ('messages') needs a tokenizer with a chat template")
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _read_file(path: str, tokenizer, context: int | None, in_dir: bool = False) -> list[tuple[list[int], str, bool]]:
    """``(ids, where, packed)`` per document of one file; ``packed``: text to join into the stream, else explicit
    ids kept as their own sequence (``in_dir``: empty or non-UTF-8 files are skipped, not errors)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except UnicodeDecodeError as e:
        if in_dir:
            return []
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not raw.strip():
        if in_dir:
            return []
        raise DataError(f"{path}: the file is empty")
    if not (path.endswith(".jsonl") or path.endswith(".json")):
        if tokenizer is None:
            raise DataError(f"{path}: plain text needs a tokenizer (none was found with the model); pass JSONL "
                            "with 'input_ids' instead")
        return [(encode_texts(tokenizer, [raw])[0], path, True)]
    entries: list[tuple[list[int] | int, str, bool]] = []  # an int: the index of a text record, encoded below
    texts: list[str] = []
    for n, line in enumerate(raw.split("\n"), 1):  # (not splitlines: JSON strings may hold U+2028 and the like)
        where = f"{path}:{n}"
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{where}: each line must be a JSON object")
        if "input_ids" in rec:
            ids = rec["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise DataError(f"{where}: 'input_ids' must be a list of integers")
            if context is not None and len(ids) > context:
                raise DataError(f"{where}: 'input_ids' has {len(ids)} tokens, longer than the model's context "
                                f"({context}); split it")
            entries.append((ids, where, False))
        elif "text" in rec:
            if not isinstance(rec["text"], str):
                raise DataError(f"{where}: 'text' must be a string")
            if tokenizer is None:
                raise DataError(f"{where}: a 'text' record needs a tokenizer (none was found with the model)")
            entries.append((len(texts), where, True))
            texts.append(rec["text"])
        elif "messages" in rec:
            if tokenizer is None:
                raise DataError(f"{where}: a 'messages' record needs a tokenizer (none was found with the model)")
            entries.append((_chat(tokenizer, rec["messages"], where), where, True))
        else:
            raise DataError(f"{where}: the record has none of the fields 'input_ids', 'text', 'messages' (has "
                            f"{sorted(rec)})")
    encoded = encode_texts(tokenizer, texts) if texts else []
    return [(encoded[x] if isinstance(x, int) else x, where, packed) for x, where, packed in entries]


def load_corpus(paths, tokenizer=None, max_length: int = 256, context: int | None = None, vocab_size: int | None = None,
                min_length: int = 4, long_length: int | None = None, long_fraction: float = 0.0,
                seed: int = 0) -> list[list[int]]:
    """Token sequences (each ``min_length`` .. ``max_length`` tokens) from the files ``paths`` (a directory: every
    file below it, in sorted order): the text documents packed into windows of ``max_length`` (EOS after each
    document), then each explicit ``input_ids`` record chunked at ``max_length``.

    ``long_fraction`` of the packed text (0 .. 1) stays in windows of ``long_length`` tokens instead (chosen by
    ``seed``): the stream is cut at ``long_length``, and the chunks not chosen are cut again at ``max_length``.
    ``context``: the model's maximum positions (explicit ``input_ids`` longer than that are an error; ``max_length``
    and ``long_length`` may not exceed it). ``vocab_size``: ids outside ``[0, vocab_size)`` are an error."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise DataError("no data files given")
    if max_length < 2:
        raise DataError(f"max_length must be >= 2, got {max_length}")
    if context is not None and max_length > context:
        raise DataError(f"max_length {max_length} exceeds the model's context ({context} positions)")
    if not 0.0 <= long_fraction <= 1.0:
        raise DataError(f"long_fraction must be in [0, 1], got {long_fraction}")
    if long_fraction and (long_length is None or long_length <= max_length):
        raise DataError(f"long_length must be above max_length ({max_length}) with long_fraction {long_fraction}, "
                        f"got {long_length}")
    if long_fraction and context is not None and long_length > context:
        raise DataError(f"long_length {long_length} exceeds the model's context ({context} positions)")
    files: list[tuple[str, bool]] = []
    for path in paths:
        if os.path.isdir(path):  # every file below it, sorted; empty / non-UTF-8 files are skipped
            found = sorted(os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns if not n.startswith("."))
            if not found:
                raise DataError(f"{path}: the directory holds no files")
            files += [(f, True) for f in found]
        else:
            files.append((path, False))
    packed: list[list[int]] = []
    own: list[list[int]] = []
    for path, in_dir in files:
        for ids, where, pack in _read_file(path, tokenizer, context, in_dir):
            if vocab_size is not None and any(not 0 <= i < vocab_size for i in ids):
                bad = next(i for i in ids if not 0 <= i < vocab_size)
                raise DataError(f"{where}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
            (packed if pack else own).append(ids)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    stream = document_stream(packed, eos)
    if long_fraction:
        chunks = windows(stream, long_length, min_length)
        g = torch.Generator().manual_seed(seed)
        keep = set(torch.randperm(len(chunks), generator=g)[: round(long_fraction * len(chunks))].tolist())
        seqs = [w for i, c in enumerate(chunks) for w in ([c] if i in keep else windows(c, max_length, min_length))]
    else:
        seqs = windows(stream, max_length, min_length)
    for ids in own:
        seqs += windows(ids, max_length, min_length)
    if not seqs:
        raise DataError(f"{', '.join(paths)}: no sequence of at least {min_length} tokens")
    return seqs


def split_heldout(seqs: list[list[int]], n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """``(train, heldout)``: ``n`` sequences held out (chosen by ``seed``; none when there are too few)."""
    if n <= 0 or len(seqs) <= n:
        return seqs, []
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(seqs), generator=g).tolist()
    held = set(perm[:n])
    return [s for i, s in enumerate(seqs) if i not in held], [seqs[i] for i in sorted(held)]


def prompt_of(seq: list[int], prompt_len: int) -> list[int]:
    """The prompt a sequence is evaluated on (and the least of it self-distillation keeps): its first
    ``prompt_len`` tokens, at most half of it (so that there is something to continue), at least one."""
    return seq[: max(1, min(prompt_len, len(seq) // 2))]


# rows decoded together: more rows share each weight read of a step (rate by rows: benchmarks/python/
# bench_self_distill.py); 64 holds most of the gain at a modest cache (a row: its prompt + new tokens)
DISTILL_BATCH = 64


def distill_split(seq: list[int], prompt_len: int, new_tokens: int) -> int:
    """How many of ``seq``'s first tokens self-distillation keeps: all but its last ``new_tokens``, and at least its
    prompt (:func:`prompt_of`), so that a long window keeps its long context and a short one its first tokens."""
    return max(len(seq) - new_tokens, len(prompt_of(seq, prompt_len)))


# with a time budget, self_distill's first chunk: this many batches of rows, timed before it sizes the next chunk
DISTILL_PROBE_BATCHES = 4


@torch.no_grad()
def self_distill(target, seqs: list[list[int]], prompt_len: int = 16, new_tokens: int = 64, temperature: float = 0.0,
                 seed: int = 0, batch_size: int = DISTILL_BATCH, eos_token_id=None, progress: bool = True,
                 drafter=None, max_sequences: int | None = None, seconds: float | None = None,
                 clock=time.perf_counter) -> list[list[int]]:
    """The sequences with their ends rewritten by the target: each keeps its first tokens (all but its last
    ``new_tokens``, at least its first ``prompt_len``, at most half of it: :func:`distill_split`) and the target
    writes the rest up to the sequence's own length (greedy at ``temperature`` 0; else sampled, sequence i with its
    own stream seeded ``seed + i``, so its tokens do not depend on ``batch_size`` or its neighbours). A drafter is
    asked to continue what the target wrote after a prompt, which is this text, not the corpus's.

    ``max_sequences`` / ``seconds`` bound the work to what a training run can read: the sequences are drawn in an
    order shuffled by ``seed``, at most ``max_sequences`` of them, and with ``seconds`` the first
    ``DISTILL_PROBE_BATCHES * batch_size`` are timed, then chunks follow, each half of what the rest of ``seconds``
    fits at the rate so far (its first chunks carry one-time costs, so one estimate would stop short), until less
    than one sequence fits (``clock``: the timer). Only the rewritten sequences are returned (in their order in
    ``seqs``): all of them without a bound.

    Decoded by one :class:`~specdec_ext.engine.Engine` per group of similar lengths, ``batch_size`` rows at a
    time, a finished row's place taken by the next sequence (continuous batching); ``drafter``: speculative decoding
    of the rows (the output is the same: greedy tokens are plain greedy's, sampled ones follow the target's
    distribution)."""
    for name, v, least in (("batch_size", batch_size, 1), ("new_tokens", new_tokens, 0),
                           ("max_sequences", max_sequences, 0)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            raise ValueError(f"self_distill: {name} must be an integer >= {least}, got {v!r}")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not seconds >= 0):
        raise ValueError(f"self_distill: seconds must be a number >= 0 (a time budget), got {seconds!r}")
    order = list(range(len(seqs)))
    if max_sequences is not None or seconds is not None:
        order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()[:max_sequences]
    lengths = [len(s) for s in seqs]
    cuts = [distill_split(s, prompt_len, new_tokens) for s in seqs]
    out = {i: seqs[i][: cuts[i]] for i in order}
    bar = Progress(len(order), "self-distill", enabled=progress)

    def rewrite(idx: list[int]) -> None:
        todo = [i for i in idx if cuts[i] < lengths[i]]
        bar.update(len(idx) - len(todo))
        for group in _length_groups(todo, lengths):
            _decode_group(target, drafter, group, out, [lengths[i] for i in group], batch_size, temperature, seed,
                          eos_token_id, bar)

    if seconds is None:
        rewrite(order)
    else:  # chunks, each half of what the time left fits at the rate so far (the first: the probe), then stop
        t0, done, chunk = clock(), 0, DISTILL_PROBE_BATCHES * batch_size
        while done < len(order):
            rewrite(order[done: done + chunk])
            done = min(len(order), done + chunk)
            spent = clock() - t0
            fits = len(order) - done if spent <= 0 else int((seconds - spent) * done / spent)
            if fits < 1:
                break
            chunk = fits if fits <= 2 * batch_size else fits // 2
        order = order[:done]
        bar.set_total(done)
    bar.close()
    return [out[i] for i in sorted(order)]


def _decode_group(target, drafter, group: list[int], out: dict, lengths: list[int], batch_size: int,
                  temperature: float, seed: int, eos_token_id, bar: Progress) -> None:
    """Extends ``out[i]`` (a prompt) to ``lengths`` tokens for each ``i`` of ``group`` with one engine."""
    max_nodes = drafter.max_nodes if drafter is not None else 1
    sampled = temperature > 0
    with Engine(target, drafter, max_batch=min(batch_size, len(group)), max_len=max(lengths) + max_nodes,
                eos_token_id=eos_token_id, caller="self_distill") as engine:
        row = {engine.add_request(out[i], max_new_tokens=n - len(out[i]), temperature=float(temperature),
                                  seed=seed + i if sampled else None): i for i, n in zip(group, lengths)}
        while engine.has_unfinished():
            for rid, new, finish in engine.step():
                out[row[rid]].extend(int(t) for t in new)
                if finish is not None:
                    bar.update(1)


def _length_groups(todo: list[int], lengths: list[int]) -> list[list[int]]:
    """``todo`` in groups of similar ``lengths`` (each at most twice its group's shortest), decoded by engines of
    their own: an engine's cache rows and each step's attention mask (``[B, T, kv_len]``) are as long as its longest
    row, so a few long windows would size every short one's."""
    groups: list[list[int]] = []
    for i in sorted(todo, key=lambda i: lengths[i]):
        if groups and lengths[i] <= 2 * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def pad_batch(seqs: list[list[int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``tokens[B, T]`` (pad 0) and ``mask[B, T]`` (True on real tokens)."""
    T = max(len(s) for s in seqs)
    toks = torch.zeros(len(seqs), T, dtype=torch.int64)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    return toks.to(device), mask.to(device)


class BatchSampler:
    """Shuffled epochs of batches from a seeded generator whose state is checkpointed (exact resumption).

    ``long``: the indices of long windows, batched apart from the others, ``long_batch_size`` to a batch (a batch
    of short windows padded to a long one's length would be mostly padding); each epoch's long batches are spread
    evenly among its short ones, so that every stretch of steps (the time budget's probe too) mixes them alike."""

    def __init__(self, n: int, batch_size: int, seed: int, long: Sequence[int] = (), long_batch_size: int = 1):
        self.n, self.batch_size = n, max(1, min(batch_size, n - len(long) or n))
        self.long = sorted(set(long))
        if self.long and not (0 <= self.long[0] and self.long[-1] < n):
            raise ValueError(f"BatchSampler: long indices must be in [0, {n}), got {self.long[0]}..{self.long[-1]}")
        is_long = set(self.long)
        self.short = [i for i in range(n) if i not in is_long] if self.long else []
        self.long_batch_size = max(1, min(long_batch_size, len(self.long) or 1))
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list = []  # one window group: indices; with long windows: whole batches

    @property
    def batches_per_epoch(self) -> float:
        return (self.n - len(self.long)) / self.batch_size + len(self.long) / self.long_batch_size

    def next(self) -> list[int]:
        if not self.long:
            if len(self.order) < self.batch_size:
                self.order = torch.randperm(self.n, generator=self.gen).tolist()
            b, self.order = self.order[: self.batch_size], self.order[self.batch_size:]
            return b
        if not self.order:
            self.order = self._epoch()
        return self.order.pop(0)

    def _epoch(self) -> list[list[int]]:
        def batches(idx, size):
            perm = [idx[j] for j in torch.randperm(len(idx), generator=self.gen).tolist()]
            return [perm[j: j + size] for j in range(0, len(perm) - size + 1, size)]

        sb, lb = batches(self.short, self.batch_size), batches(self.long, self.long_batch_size)
        # long batch k goes after floor((k + 1/2) * len(sb) / len(lb)) short ones: equal gaps
        out, k = [], 0
        for j in range(len(sb) + 1):
            while k < len(lb) and (2 * k + 1) * len(sb) // (2 * len(lb)) <= j:
                out.append(lb[k])
                k += 1
            if j < len(sb):
                out.append(sb[j])
        return out

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "order": list(self.order), "n": self.n, "long": len(self.long)}

    def load_state_dict(self, sd: dict, who: str = "resume: the checkpoint") -> None:
        if sd.get("long", 0) != len(self.long):
            raise ValueError(f"{who} drew its batches from {sd.get('long', 0)} long windows, this run has "
                             f"{len(self.long)} (--long-fraction or --long-length changed); resume with the same "
                             "data and options, or train into another output directory")
        n = sd["n"] if "n" in sd else max(sd["order"], default=-1) + 1  # (older checkpoints: a lower bound)
        if n != self.n if "n" in sd else n > self.n:
            raise ValueError(f"{who} drew its batches from {n} training sequences, this run has {self.n} "
                             "(the data, --max-length, --heldout or --self-distill changed); resume with the same "
                             "data and options, or train into another output directory")
        self.gen.set_state(sd["gen"])
        self.order = list(sd["order"])
