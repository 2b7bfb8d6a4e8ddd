"""The drafter flags of the command line (``--draft-model DIR | --ngram | --suffix | --medusa DIR | --eagle DIR |
--self-spec FILE | --early-exit DIR`` and their shapes), shared by ``specdec generate`` and ``specdec serve``:
:func:`add_drafter_arguments` declares them, :func:`drafter_from_args` builds the drafter they choose (None: plain
decoding).
"""

from __future__ import annotations

import argparse

import torch

from specdec_ext.models.quantized import DRAFT_QUANT_SCHEMES

__all__ = ["add_drafter_arguments", "check_one_drafter", "draft_quant", "drafter_from_args"]


def add_drafter_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", help="directory of a smaller draft model with the same tokenizer (a parallel "
                                         "draft, one whose config records a pard_token, drafts every token of a "
                                         "step in one forward: specdec train-draft --parallel K)")
    p.add_argument("--ngram", action="store_true", help="n-gram (prompt lookup) drafter")
    p.add_argument("--medusa", help="directory of Medusa-1 heads (config.json + medusa_lm_head.pt/.safetensors)")
    p.add_argument("--eagle", help="directory of an EAGLE-1 or EAGLE-3 draft (config.json + weights)")
    p.add_argument("--eagle-depth", type=int, default=None,
                   help="--eagle: tree depth (EAGLE's depth + 1; default, as for the next two: the library's tree "
                        "on the device, on a CPU 6 with --eagle-top-k 2 and --eagle-total-tokens 8; on a GPU "
                        "EAGLE-2's 8 / 10 / 60)")
    p.add_argument("--eagle-top-k", type=int, default=None, help="--eagle: children per frontier node")
    p.add_argument("--eagle-total-tokens", type=int, default=None, help="--eagle: draft tokens per tree")
    p.add_argument("--eagle-dtype", choices=["auto", "float32", "float16", "bfloat16"], default=None,
                   help="dtype of the EAGLE draft (default: the target's; auto: bfloat16 for a float32 target "
                        "where bfloat16 products are fast, e.g. CPUs with AVX512-BF16)")
    p.add_argument("--medusa-nodes", type=int, default=None,
                   help="--medusa: tree nodes, root included (default: all 63 choices of mc_sim_7b_63; 16 with "
                        "--medusa-dynamic; with neither flag the library's tree on the device: on a CPU a per-step "
                        "tree of 10)")
    p.add_argument("--medusa-dynamic", action="store_true",
                   help="--medusa: each step keeps the --medusa-nodes choices of highest calibrated head "
                        "probability (a per-step tree) instead of a fixed tree")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft chain length (default 4; a parallel draft: the positions it was trained for)")
    p.add_argument("--tree-width", type=int, default=1,
                   help="--draft-model: top-k tree with this many branches at the root (1 = chain)")
    p.add_argument("--tree-total-tokens", type=int, default=None,
                   help="--draft-model with --tree-width > 1: an EAGLE-2 dynamic tree of this many drafts (depth "
                        "--num-draft-tokens, --tree-width children per frontier node)")
    p.add_argument("--confidence-threshold", type=float, default=0.0,
                   help="--draft-model chains: stop drafting after a draft below this probability (0 = off)")
    p.add_argument("--max-ngram", type=int, default=3, help="longest n-gram matched by --ngram")
    p.add_argument("--suffix", action="store_true",
                   help="suffix decoding: drafts from the request's context and earlier requests' outputs")
    p.add_argument("--suffix-depth", type=int, default=16, help="--suffix: deepest draft tree")
    p.add_argument("--suffix-spec-factor", type=float, default=3.0,
                   help="--suffix: drafts per matched context token (the tree follows the match's length)")
    p.add_argument("--suffix-min-prob", type=float, default=0.1, help="--suffix: least estimated draft probability")
    p.add_argument("--self-spec", metavar="FILE",
                   help="self-speculation: the target drafts with the layers of FILE (specdec tune-self-spec) skipped, "
                        "a chain of the file's length (with --tree-width > 1 and --tree-total-tokens: an EAGLE-2 "
                        "tree of depth --num-draft-tokens)")
    p.add_argument("--early-exit", metavar="DIR",
                   help="self-speculation by early exit: the target's first layers, the adapter in DIR (specdec "
                        "train-self-spec) and the target's LM head draft a chain of --num-draft-tokens (default 4; "
                        "with --tree-width > 1 and --tree-total-tokens: an EAGLE-2 tree of that depth)")
    p.add_argument("--suffix-corpus-tokens", type=int, default=1 << 18,
                   help="--suffix: tokens of earlier outputs kept (oldest evicted first; 0: the context only)")
    p.add_argument("--draft-quant", choices=["none", *DRAFT_QUANT_SCHEMES], default="none",
                   help="weights of the drafter's network (--draft-model, --medusa, --eagle, --early-exit's adapter, "
                        "the zoo's): int8 holds a quarter of float32's bytes, int4 (groups of 32) an eighth; "
                        "verification stays on the target, so output is unchanged")


def check_one_drafter(args: argparse.Namespace) -> None:
    chosen = (args.ngram, args.suffix, args.draft_model, args.medusa, args.eagle, args.self_spec, args.early_exit)
    if sum(map(bool, chosen)) > 1:
        raise ValueError("choose one drafter (--ngram, --suffix, --draft-model, --medusa, --eagle, --self-spec or "
                         "--early-exit)")
    if draft_quant(args) is not None and (args.ngram or args.suffix):
        raise ValueError("--draft-quant quantises a drafter's network; --ngram and --suffix have none")
    if draft_quant(args) is not None and args.self_spec:
        raise ValueError("--draft-quant: --self-spec drafts with the target's own weights (the target on quantised "
                         "weights as its own draft is DraftModelDrafter.from_target)")


def draft_quant(args: argparse.Namespace) -> str | None:
    """``--draft-quant`` as the drafters' ``draft_quant`` keyword (None: float weights)."""
    return None if args.draft_quant == "none" else args.draft_quant


def drafter_from_args(args: argparse.Namespace, target: torch.nn.Module):
    """The drafter the flags choose for ``target`` (None: no drafter flag). Reads ``args.device``, ``args.dtype``
    and ``args.no_packed_linears`` besides the drafter flags."""
    from specdec_ext.drafters import (DraftModelDrafter, EagleDrafter, EarlyExitDrafter, MedusaDrafter, NgramDrafter,
                                      ParallelDraftDrafter, SelfSpecDrafter, SuffixDrafter)
    from specdec_ext.drafters.parallel_draft import parallel_draft_config
    from specdec_ext.drafters.shapes import drafter_shape
    from specdec_ext.generate import load_model
    from specdec_ext.models.checkpoints import resolve_eagle_dtype

    check_one_drafter(args)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    k = args.num_draft_tokens
    if args.draft_model:
        model = load_model(args.draft_model, dtype=dtype, device=args.device)
        shape = {"tree_width": args.tree_width, "total_tokens": args.tree_total_tokens,
                 "packed_linears": not args.no_packed_linears, "draft_quant": draft_quant(args)}
        if parallel_draft_config(model.config) is None:
            return DraftModelDrafter(model, num_draft_tokens=k or 4, confidence_threshold=args.confidence_threshold,
                                     **shape)
        if args.confidence_threshold:
            raise ValueError("--confidence-threshold stops a chain drafted token by token; a parallel draft "
                             f"({args.draft_model}) drafts its whole chain in one forward")
        return ParallelDraftDrafter(model, num_draft_tokens=k, **shape)
    if args.ngram:
        return NgramDrafter(num_pred_tokens=k or 4, max_ngram_size=args.max_ngram)
    if args.suffix:
        return SuffixDrafter(max_depth=args.suffix_depth, max_nodes=args.suffix_depth + 1,
                             spec_factor=args.suffix_spec_factor, min_prob=args.suffix_min_prob,
                             corpus_tokens=args.suffix_corpus_tokens)
    if args.medusa:
        given = args.medusa_nodes is not None or args.medusa_dynamic
        shape = ({"max_nodes": args.medusa_nodes, "dynamic": args.medusa_dynamic} if given else
                 drafter_shape("medusa", next(target.parameters()).device.type))
        return MedusaDrafter.from_pretrained(args.medusa, target=target, device=args.device, **shape,
                                             draft_quant=draft_quant(args))
    if args.eagle:
        tdtype = next(p.dtype for p in target.parameters() if p.is_floating_point())
        return EagleDrafter.from_pretrained(args.eagle, target=target, depth=args.eagle_depth,
                                            top_k=args.eagle_top_k, total_tokens=args.eagle_total_tokens,
                                            dtype=resolve_eagle_dtype(args.eagle_dtype, tdtype, args.device),
                                            draft_quant=draft_quant(args))
    if args.self_spec:
        tree = {"num_draft_tokens": k, "tree_width": args.tree_width,
                "total_tokens": args.tree_total_tokens} if args.tree_width > 1 else {}
        tree = {key: v for key, v in tree.items() if v is not None}
        return SelfSpecDrafter.from_file(args.self_spec, target=target, **tree)
    if args.early_exit:
        tree = {"tree_width": args.tree_width, "total_tokens": args.tree_total_tokens} if args.tree_width > 1 else {}
        return EarlyExitDrafter.from_pretrained(args.early_exit, target, num_draft_tokens=k or 4,
                                                draft_quant=draft_quant(args), **tree)
    return None
