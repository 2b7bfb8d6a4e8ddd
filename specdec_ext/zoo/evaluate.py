"""Held-out prompts and the family's acceptance measurements (the model card's numbers and the tests' floors)."""

from __future__ import annotations

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
def evaluate_drafters(family, prompts: list[list[int]], max_new_tokens: int, names=None) -> dict:
    """Greedy decoding of every prompt (batch 1) without and with each drafter: per drafter the mean accepted
    length (tokens per target forward), acceptance by depth, tokens/s and whether its output equals plain greedy
    output token for token."""
    from specdec_ext.generate import DecodeStats, generate

    names = list(names or family.drafter_names)
    results: dict = {}
    plain_out, plain_time, plain_tokens = [], 0.0, 0
    for p in prompts:
        t0 = time.perf_counter()
        out, stats = generate(family.target, None, torch.tensor(p), max_new_tokens=max_new_tokens, eos_token_id=[])
        plain_time += time.perf_counter() - t0
        plain_tokens += stats.new_tokens
        plain_out.append(out.tolist())
    results["plain"] = {"tokens_per_s": plain_tokens / plain_time}
    for name in names:
        tokens, forwards, hist, elapsed, identical = 0, 0, [], 0.0, True
        drafter = family.make_drafter(name)  # one per drafter, kept across prompts (as a server would)
        for p, ref in zip(prompts, plain_out):
            t0 = time.perf_counter()
            out, stats = generate(family.target, drafter, torch.tensor(p), max_new_tokens=max_new_tokens,
                                  eos_token_id=[])
            elapsed += time.perf_counter() - t0
            identical &= out.tolist() == ref
            tokens += stats.new_tokens
            forwards += stats.row_steps
            hist = [a + b for a, b in zip(hist, stats.accept_hist)] if hist else list(stats.accept_hist)
        by_depth = [round(x, 4) for x in DecodeStats(accept_hist=hist).acceptance_by_depth]
        results[name] = {"mean_accepted_length": round(tokens / max(forwards, 1), 4),
                         "acceptance_by_depth": by_depth, "tokens_per_s": tokens / elapsed,
                         "speedup": (tokens / elapsed) / results["plain"]["tokens_per_s"],
                         "greedy_identical": bool(identical)}
    return results
