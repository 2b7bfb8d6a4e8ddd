"""Held-out prompts and the family's acceptance measurements (the model card's numbers and the tests' floors)."""

from __future__ import annotations

import statistics
import time

import torch

from specdec_ext.zoo.corpus import heldout_texts

__all__ = ["heldout_prompts", "evaluate_drafters"]


def heldout_prompts(tokenizer, n: int, length: int, root: str | None = None) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from the held-out files (a window from the middle of each file, so that
    prompts are code rather than license headers); files too short are skipped."""
    prompts = []
    for text in heldout_texts(root):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < 2 * length:
            continue
        start = len(ids) // 2
        prompts.append(ids[start: start + length])
        if len(prompts) == n:
            break
    if not prompts:
        raise ValueError(f"no held-out file has {2 * length} tokens")
    return prompts


@torch.no_grad()
def evaluate_drafters(family, prompts: list[list[int]], max_new_tokens: int, names=None, rounds: int = 1) -> dict:
    """Greedy decoding of every prompt (batch 1) without and with each drafter: per drafter the mean accepted
    length (tokens per target forward), acceptance by depth, tokens/s and whether its output equals plain greedy
    output token for token.

    Each drafter is made once per round and kept across the prompts, as a server keeps one. ``rounds`` > 1 repeats
    that round-robin (plain decoding, then each drafter with a fresh object, so that suffix decoding does not look
    up the previous rounds' outputs): tokens/s is then the median round's and the speedup the median of each round's
    ratio to that round's plain decoding, so that a slow moment of a shared machine does not reorder the drafters
    (the card's fastest is ``specdec serve --zoo``'s default)."""
    from specdec_ext.generate import DecodeStats, generate

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"evaluate_drafters: rounds must be an integer >= 1, got {rounds!r}")
    names = list(names or family.drafter_names)
    rates: dict[str, list[float]] = {name: [] for name in ["plain", *names]}
    results: dict = {}
    plain_out = None
    for _ in range(rounds):
        for name in ["plain", *names]:
            drafter = None if name == "plain" else family.make_drafter(name)
            tokens, forwards, hist, elapsed, outs = 0, 0, [], 0.0, []
            for p in prompts:
                t0 = time.perf_counter()
                out, stats = generate(family.target, drafter, torch.tensor(p),
                                      max_new_tokens=max_new_tokens, eos_token_id=[])
                elapsed += time.perf_counter() - t0
                outs.append(out.tolist())
                tokens += stats.new_tokens
                forwards += stats.row_steps
                hist = [a + b for a, b in zip(hist, stats.accept_hist)] if hist else list(stats.accept_hist)
            rates[name].append(tokens / elapsed)
            if name == "plain":
                plain_out = plain_out or outs
            elif name not in results:  # (greedy: every round decodes the same tokens; checked below)
                by_depth = [round(x, 4) for x in DecodeStats(accept_hist=hist).acceptance_by_depth]
                results[name] = {"mean_accepted_length": round(tokens / max(forwards, 1), 4),
                                 "acceptance_by_depth": by_depth, "greedy_identical": outs == plain_out}
            else:
                results[name]["greedy_identical"] &= outs == plain_out
    results = {"plain": {"tokens_per_s": statistics.median(rates["plain"])}, **results}
    for name in names:
        results[name]["tokens_per_s"] = statistics.median(rates[name])
        results[name]["speedup"] = statistics.median(r / p for r, p in zip(rates[name], rates["plain"]))
    return results
