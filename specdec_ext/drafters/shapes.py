"""The shapes drafters decode with (chain lengths, tree sizes), one table for the whole library.

:data:`CPU_SHAPES` is what the model family, the benchmarks, the end-of-training report and the command line's
drafter flags use on a CPU: measured there (the comment below). :func:`drafter_shape` is the lookup by device: on
any other device the drafters' own defaults, the papers' GPU shapes (EAGLE-2's 60-node trees, Medusa's
``mc_sim_7b_63``), which a wide accelerator verifies at about the cost of one token; they are not measured here.
Keys such as ``"draft_vocab": "frequent"`` name files the caller resolves (a family's ``eagle1/draft_vocab.json``).
"""

from __future__ import annotations

__all__ = ["CPU_SHAPES", "DRAFTER_NAMES", "drafter_shape", "eagle_tree_shape"]

DRAFTER_NAMES = ("ngram", "suffix", "draft-model", "parallel-draft", "medusa", "eagle1", "eagle2", "eagle3",
                 "early-exit")

# Drafter shapes for a CPU, from sweeps on the shipped family (1 thread, held-out prompts): on a CPU every
# draft-network forward costs ~1-2 ms of fixed overhead and every verified node real compute (in float32 a 13-node
# tree costs ~1.7 plain steps, in bfloat16 ~1.2), so shallow chains and small trees win: EAGLE chains of 3 beat 4-5
# (1.43x vs 1.36x), static Medusa trees of 8 tie 4 and beat 16. EAGLE-2/3 trees with calibrated scores (EagleDrafter's
# default) reach further than with raw ones: depth 5 / top-k 2 / 8 nodes was the best or within 3% of the best of
# five shapes from 6 to 16 nodes in both dtypes (EAGLE-2 2.03x in bfloat16, 1.41x in float32; 8 prompts x 128
# tokens), where raw scores had made 6 nodes the best. Re-checked after the packed products made verification
# cheaper (2026-11-29, float32, 4 prompts x 2 rounds): EAGLE-2 5/2/8 still the best of seven shapes of 6-16 nodes
# (4/2/6 and 6/2/10 within 2%), Medusa per-step trees of 12 nodes still beat 16 (1.55x vs 1.42x in bfloat16).
# Re-checked 2026-11-30 with leaner EAGLE drafts (benchmarks/python/bench_tree_sizes.py, float32 and bfloat16, 8
# prompts x 128 tokens, each size side by side with plain decoding): EAGLE-2 8 drafts still the best of 4-12 (10
# within 1%); Medusa trees of 10 nodes ahead of 12 in six paired runs (+0-5% float32, +1% bfloat16), 8 within 2%.
# Re-checked 2026-11-30 after the draft layer became one op (draft_decoder_layer: a draft level ~0.45 -> ~0.2 ms),
# which makes deeper drafts pay (8 prompts x 128 tokens, side by side with plain decoding): the EAGLE-1 chain of 6
# 2.21x fp32 / 2.25x bf16 where 3 gave 2.00x / 1.99x (5: 2.17x / 2.19x, 7: 2.17x fp32); EAGLE-2 depth 6 with 8
# drafts 2.33-2.35x fp32 / 2.18x bf16 where depth 5 gave 2.28-2.33x / 2.15x (6/2/10 within 1%, 7/2/10 and 4/2/8
# behind); EAGLE-3 stays at depth 5 (depth 6: 2.06x vs 2.11x, 1.96x vs 2.01x in two fp32 runs). Re-checked
# 2026-11-30 after the draft network became op calls (EagleStepOps), two fp32 runs: EAGLE-2 6/2/8 2.55-2.62x still
# ahead of 7/2/8 (2.48-2.52x), 6/2/10 (2.45-2.52x), 7/2/10 (2.42-2.47x), 8/2/10 and 6/3/10 (2.38-2.50x).
CPU_SHAPES = {
    "ngram": {"num_pred_tokens": 6, "max_ngram_size": 3},
    # suffix decoding: SuffixDecoding's shapes (the paper's), as benchmarks/python/bench_suffix.py measured them
    "suffix": {"max_depth": 16, "max_nodes": 17, "spec_factor": 3.0, "min_prob": 0.1},
    "draft-model": {"num_draft_tokens": 4},
    # a parallel draft (PARD): one draft forward whatever the depth. On the family (2026-12-03, float32, 8 prompts x
    # 128 tokens, benchmarks/python/bench_tree_sizes.py) chains of 2 / 3 / 4 / 6 / 8 ran at 1.36 / 1.37 / 1.44 / 1.43
    # / 1.29x (mean accepted length 2.09 -> 2.42: its guesses beyond the first token are weak) and EAGLE-2 trees of
    # 4 / 6 / 8 drafts at depth 4 at 1.40 / 1.34 / 1.40x (6 prompts x 96)
    "parallel-draft": {"num_draft_tokens": 4},
    # Medusa's per-step tree (calibrated head probabilities pick 9 of mc_sim_7b_63's choices each step): with aten's
    # products 12 nodes (mean accepted length 2.29, where the best static tree, 8 nodes, reached 1.82) beat 6, 8,
    # 10, 16, 20 and 28; with the packed products, which make each verified node cheaper, 10 nodes lead (above).
    "medusa": {"max_nodes": 10, "dynamic": True},
    # EAGLE-1 drafts over the training data's most frequent ids (FR-Spec; "frequent": the family's
    # eagle1/draft_vocab.json, ZooSpec.eagle1_vocab of them). Over the EAGLE-3 draft's 2048 ids they were 2-4% (bf16)
    # and 4-10% (fp32) faster than over all 4096, with the same accepted lengths; with the draft level one op, 1024
    # ids were another 2% faster (EAGLE-2 2.44x -> 2.50x and 2.37x -> 2.42x in two fp32 runs, mean accepted length
    # 4.38 -> 4.39; 768 ids the same speed, 512 accepted less: 4.34).
    "eagle1": {"depth": 6, "top_k": 1, "total_tokens": 6, "draft_vocab": "frequent"},  # EAGLE-1 network, chain
    "eagle2": {"depth": 6, "top_k": 2, "total_tokens": 8, "draft_vocab": "frequent"},  # EAGLE-2 dynamic tree
    "eagle3": {"depth": 5, "top_k": 2, "total_tokens": 8},  # EAGLE-3 network, dynamic tree
    # self-speculation by early exit (the target's first layers + the family's adapter + its LM head), chains
    # verified from the exit layer, over the adapter's draft vocabulary
    "early-exit": {"num_draft_tokens": 4},
}


def drafter_shape(name: str, device_type: str) -> dict:
    """The keyword arguments drafter ``name`` (one of :data:`DRAFTER_NAMES`) decodes with on a ``device_type``
    device ("cpu", "cuda", ...): a copy of its :data:`CPU_SHAPES` entry on a CPU, else ``{}`` (the constructor's
    defaults), but for ``eagle1``, the EAGLE-1 network's chain, which stays the CPU's chain."""
    if name not in CPU_SHAPES:
        raise ValueError(f"drafter_shape: unknown drafter {name!r}; expected one of {', '.join(DRAFTER_NAMES)}")
    if device_type == "cpu":
        return dict(CPU_SHAPES[name])
    if name == "eagle1":
        return {k: CPU_SHAPES[name][k] for k in ("depth", "top_k", "total_tokens")}
    return {}


def eagle_tree_shape(version: int, device_type: str) -> dict:
    """``depth`` / ``top_k`` / ``total_tokens`` of the EAGLE-2 tree an EAGLE-``version`` draft (1 or 3) decodes with
    on a ``device_type`` device (:func:`drafter_shape` of ``eagle2`` / ``eagle3`` without its file keys)."""
    shape = drafter_shape("eagle2" if version == 1 else "eagle3", device_type)
    return {k: v for k, v in shape.items() if k in ("depth", "top_k", "total_tokens")}
