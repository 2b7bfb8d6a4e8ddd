"""Context-length sweep: acceptance and speedup against the prompt length (128 .. 4096 tokens by default).

Each row has the end-to-end ``speedup`` (wall time of the whole call: with long prompts and a short budget the
prefill, the same for every method, dominates and pulls it towards 1) and the decode-loop speedup
(``predicted_speedup`` = mean accepted length x step time(plain) / step time(method), which at batch 1 is exactly
tokens per second of the decode loop over plain decoding's, prefill excluded).

The prompts are windows of held-out text at the longest length (see :meth:`BenchModels.prompts`), and a shorter
length's prompts are the last tokens of the same windows: every length continues the same text, and only the
context before it grows (windows cut per length from other text would mix how predictable the text is with how
long the context is). Greedy decoding, batch 1,
the same protocol as :mod:`specdec_ext.bench.e2e` (warm-up, round-robin, speedup vs plain decoding at the same
length in the same run). Lengths that do not fit the target's ``max_position_embeddings`` together with the token
budget and the largest draft tree are dropped and replaced by the longest length that fits; the result says so.
"""

from __future__ import annotations

import time

from specdec_ext.bench.e2e import measure, prompts_and_warmup, summarise
from specdec_ext.bench.models import BenchModels

__all__ = ["DEFAULT_LENGTHS", "QUICK_LENGTHS", "fit_lengths", "run_context_sweep"]

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (128, 512)


def fit_lengths(lengths, max_positions: int | None, max_new_tokens: int, tree_nodes: int) -> tuple[list[int], str | None]:
    """The lengths that fit ``max_positions`` (prompt + budget + tree), plus the longest length that fits when some
    were dropped; and a note saying what was dropped (None when nothing was)."""
    lengths = sorted(set(int(n) for n in lengths))
    if max_positions is None:
        return lengths, None
    cap = max_positions - max_new_tokens - tree_nodes
    kept = [n for n in lengths if n <= cap]
    dropped = [n for n in lengths if n > cap]
    if not dropped:
        return kept, None
    if cap >= 1 and (not kept or kept[-1] < cap):
        kept.append(cap)
    return kept, (f"the target's max_position_embeddings is {max_positions}: prompt lengths {dropped} do not fit with "
                  f"{max_new_tokens} new tokens and a {tree_nodes}-node draft tree; the sweep goes up to {cap} tokens")


def run_context_sweep(models: BenchModels, lengths=DEFAULT_LENGTHS, methods: list[str] | None = None,
                      num_prompts: int = 4, max_new_tokens: int = 64, seed: int = 0, warmup_tokens: int = 16,
                      log=print) -> dict:
    """``methods``: our drafters (plain decoding always runs as the baseline); default: all of them."""
    names = [m for m in (methods or models.drafter_names) if m != "plain"]
    unknown = [m for m in names if m not in models.drafter_names]
    if unknown:
        raise ValueError(f"context sweep: unknown drafter(s) {unknown}; available: {', '.join(models.drafter_names)}")
    tree_nodes = 1
    for m in names:
        try:
            tree_nodes = max(tree_nodes, int(models.make_drafter(m).max_nodes))
        except Exception:  # noqa: BLE001  (measure() records the error)
            pass
    kept, note = fit_lengths(lengths, models.max_positions, max_new_tokens, tree_nodes)
    if note:
        log(f"context sweep: {note}")
    methods_all = ["plain"] + names
    out = {"config": {"lengths_requested": list(lengths), "lengths": kept, "num_prompts": num_prompts,
                      "max_new_tokens": max_new_tokens, "temperature": 0.0, "seed": seed},
           "methods": methods_all, "note": note, "rows": [], "prompt_sources": {}}
    longest, warm_longest, how_longest = ([], [], "") if not kept else prompts_and_warmup(models, num_prompts,
                                                                                          kept[-1], seed)
    for n in kept:
        prompts, warm = [p[-n:] for p in longest], warm_longest[-n:]
        how = how_longest if n == kept[-1] else f"the last {n} tokens of the {kept[-1]}-token prompts ({how_longest})"
        out["prompt_sources"][str(n)] = how
        log(f"context sweep: prompt length {n} ({len(prompts)} prompts: {how})")
        t0 = time.perf_counter()
        accs, _ = measure(models, methods_all, prompts, 0.0, max_new_tokens, warmup_tokens=warmup_tokens, seed=seed,
                          log=log, memory=False, warmup_prompt=warm)
        for r in summarise(accs, 0.0):
            r["context_len"] = n
            out["rows"].append(r)
            if r.get("tokens_per_s") is not None:
                log(f"  {r['method']:<14} {r['tokens_per_s']:9.1f} tok/s  x{r['speedup']:.2f}  "
                    f"MAL {r['mean_accepted_length']:.2f}")
            else:
                log(f"  {r['method']:<14} error: {r.get('error')}")
        log(f"  ({time.perf_counter() - t0:.1f} s)")
    return out


def markdown_table(ctx: dict) -> str:
    """Per drafter (columns) and prompt length (rows), as Markdown: mean accepted length, end-to-end speedup
    (prefill included) and decode-loop speedup (prefill excluded: ``predicted_speedup``, which at batch 1 is
    exactly tokens per decode-loop second over plain decoding's)."""
    rows = [r for r in ctx.get("rows", []) if r.get("tokens_per_s") is not None]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    lengths = sorted({r["context_len"] for r in rows})
    head = ["prompt tokens", "plain tokens/s"] + [f"{m}: accepted / speedup / loop speedup" for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in lengths:
        at = {r["method"]: r for r in rows if r["context_len"] == n}
        cells = [str(n), f"{at['plain']['tokens_per_s']:.1f}" if "plain" in at else "-"]
        for m in methods:
            r = at.get(m)
            loop = f" / {r['predicted_speedup']:.2f}x" if r and r.get("predicted_speedup") else " / -"
            cells.append(f"{r['mean_accepted_length']:.2f} / {r['speedup']:.2f}x{loop}" if r and r.get("speedup")
                         else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
