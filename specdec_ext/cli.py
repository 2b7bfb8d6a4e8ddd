"""The ``specdec`` command line (also ``python -m specdec_ext``).

``specdec demo`` runs a short tour of the kernels: it builds a draft tree, verifies it greedily and by lossless
rejection sampling, shows that sampled verification reproduces the target distribution, and times each op.

``specdec generate --model DIR [--ngram | --draft-model DIR | --medusa DIR | --eagle DIR] (--prompt TEXT [--chat] |
--prompt-ids "1 2 3")``
generates from a local Hugging Face model (plain decoding without a drafter), streams the output and ends with a
summary line (tokens/s, mean accepted length, target forwards, time split).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import specdec_ext
from specdec_ext import ops


def _median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _demo_tree() -> torch.Tensor:
    """A Medusa-style tree: the root, 3 first-level candidates, 2 children under each of the first two."""
    return torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 2, 4]])


def demo(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    print(f"specdec_ext {specdec_ext.__version__} | torch {torch.__version__} | CUDA kernels built: "
          f"{specdec_ext.built_with_cuda()} | device: {device}")

    # 1. Tree topology.
    parents = _demo_tree().to(device)
    info = ops.build_tree(parents, prefix_lens=torch.tensor([100], device=device))
    print("\n1. A draft tree from parents =", parents[0].tolist())
    print("   depth        ", info.depth[0].tolist())
    print("   position_ids ", info.position_ids[0].tolist(), "(prefix of 100 tokens + depth)")
    leaves = int(info.num_leaves[0])
    print(f"   {leaves} root-to-leaf paths:", [[n for n in p if n >= 0] for p in info.retrieve_paths[0, :leaves].tolist()])
    packed = ops.tree_ancestor_mask(parents, packed=True)
    print("   packed ancestor mask rows (bits):", [format(int(w) & 0xFFFFFFFF, "09b")[::-1] for w in packed[0, :, 0]])

    # 2. Greedy verification: plant the target's argmax so the path 0 -> 1 -> 4 -> 8 is accepted.
    V = 32000
    tokens = torch.randint(0, V, (1, parents.shape[1]), device=device)
    logits = torch.randn(1, parents.shape[1], V, device=device)
    for node, child in ((0, 1), (1, 4), (4, 8)):
        logits[0, node, tokens[0, child]] = 20.0
    result = ops.verify_tree_greedy(logits, tokens, parents)
    print("\n2. Greedy verification (target argmax planted along 0 -> 1 -> 4 -> 8):")
    print(f"   accepted nodes {result.accepted[0, :int(result.accept_len[0]) + 1].tolist()}, "
          f"{int(result.accept_len[0])} draft tokens accepted, bonus token {int(result.next_token[0])} "
          f"= argmax at node 8: {int(logits[0, 8].argmax())}")

    # 3. Lossless chain verification: the first emitted token follows the target distribution exactly.
    draws, vocab = args.draws, 6
    target_logits = torch.randn(vocab, device=device)
    draft_logits = target_logits + torch.randn(vocab, device=device)
    q = torch.softmax(draft_logits, -1)
    chain = ops.chain_parents(draws, 2, device=device)
    drafted = torch.multinomial(q, draws, replacement=True)
    chain_tokens = torch.stack([torch.zeros_like(drafted), drafted], 1)
    logits_chain = target_logits.expand(draws, 2, vocab).contiguous()
    draft_probs = q.expand(draws, 2, vocab).contiguous()
    out = ops.verify_tree_sampling(logits_chain, chain_tokens, chain, torch.rand(draws, 2, device=device),
                                   draft_probs=draft_probs, temperature=0.8, top_k=5)
    first = torch.where(out.accept_len > 0, chain_tokens[:, 1], out.next_token)
    empirical = torch.bincount(first, minlength=vocab).float() / draws
    scaled = target_logits / 0.8
    scaled[scaled < scaled.topk(5).values[-1]] = float("-inf")
    exact = torch.softmax(scaled, -1)
    print(f"\n3. Rejection sampling, {draws} chains (temperature 0.8, top-k 5), first emitted token:")
    print("   target     ", [round(v, 4) for v in exact.tolist()])
    print("   empirical  ", [round(v, 4) for v in empirical.tolist()])
    print(f"   total variation {0.5 * float((empirical - exact).abs().sum()):.4f} "
          f"(sampling noise ~{(vocab / draws) ** 0.5 / 2:.4f}); draft acceptance rate "
          f"{float(out.accept_len.float().mean()):.3f}")

    # 4. Timings of each op on a realistic step.
    B, N, V = 8, 64, 32000
    tree = torch.cat([torch.tensor([-1]), torch.arange(N - 1) // 4]).expand(B, N).contiguous().to(device)
    logits = torch.randn(B, N, V, device=device)
    toks = torch.randint(0, V, (B, N), device=device)
    uniforms = torch.rand(B, N, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn):
        return _median_ms(lambda: (fn(), sync()))

    print(f"\n4. Op timings (median ms) at B={B}, N={N}, V={V}, float32, on {device}:")
    rows = [
        ("build_tree", lambda: ops.build_tree(tree)),
        ("tree_ancestor_mask (packed)", lambda: ops.tree_ancestor_mask(tree, packed=True)),
        ("verify_tree_greedy", lambda: ops.verify_tree_greedy(logits, toks, tree)),
        ("verify_tree_sampling (T=0.8, top-p 0.9)",
         lambda: ops.verify_tree_sampling(logits, toks, tree, uniforms, temperature=0.8, top_p=0.9)),
        ("sample_tokens [B*N rows] (T=0.8, top-k 50)",
         lambda: ops.sample_tokens(logits.view(B * N, V), uniforms.view(-1), temperature=0.8, top_k=50)),
        ("expand_tree_step (F=8, top-k 8, keep 8)",
         lambda: ops.expand_tree_step(logits[:, :8], torch.zeros(B, 8, device=device), 8, 8)),
    ]
    for name, fn in rows:
        print(f"   {name:<44} {timed(fn):8.3f}")
    print("\nSide-by-side comparisons with PyTorch baselines: python benchmarks/python/run_all.py")
    return 0


class _IdStreamer:
    """Prints token ids as they come (HF streamer protocol: the first ``put`` is the prompt)."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        print(" ".join(str(int(t)) for t in value.flatten()), end=" ", file=self.out, flush=True)

    def end(self) -> None:
        print(file=self.out, flush=True)


def _load_tokenizer(path: str, required: bool):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001  (any failure: no usable tokenizer in the directory)
        if required:
            raise SystemExit(f"specdec generate: no tokenizer could be loaded from {path!r} ({type(err).__name__}: "
                             f"{err}); pass --prompt-ids instead of --prompt") from None
        return None


def generate_cmd(args: argparse.Namespace) -> int:
    from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter, NgramDrafter
    from specdec_ext.generate import generate, load_model

    if (args.prompt is None) == (args.prompt_ids is None):
        raise SystemExit("specdec generate: pass exactly one of --prompt and --prompt-ids")
    if sum(map(bool, (args.ngram, args.draft_model, args.medusa, args.eagle))) > 1:
        raise SystemExit("specdec generate: choose one drafter (--ngram, --draft-model, --medusa or --eagle)")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        target = load_model(args.model, dtype=dtype, device=args.device)
        drafter = None
        if args.draft_model:
            drafter = DraftModelDrafter(load_model(args.draft_model, dtype=dtype, device=args.device),
                                        num_draft_tokens=args.num_draft_tokens, tree_width=args.tree_width)
        elif args.ngram:
            drafter = NgramDrafter(num_pred_tokens=args.num_draft_tokens, max_ngram_size=args.max_ngram)
        elif args.medusa:
            drafter = MedusaDrafter.from_pretrained(args.medusa, target=target, device=args.device)
        elif args.eagle:
            drafter = EagleDrafter.from_pretrained(args.eagle, target=target, depth=args.eagle_depth,
                                                   top_k=args.eagle_top_k, total_tokens=args.eagle_total_tokens)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise SystemExit(f"specdec generate: {err}") from None
    tokenizer = _load_tokenizer(args.model, required=args.prompt is not None)
    if args.prompt is not None:
        if args.chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(args.prompt)["input_ids"]
    else:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise SystemExit(f"specdec generate: --prompt-ids must be integers, got {args.prompt_ids!r}") from None
    streamer = None
    if not args.no_stream:
        if tokenizer is not None:
            from transformers import TextStreamer

            streamer = TextStreamer(tokenizer, skip_prompt=True)
        else:
            streamer = _IdStreamer()
    try:
        tokens, stats = generate(target, drafter, torch.tensor(ids, dtype=torch.int64),
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seed=args.seed, streamer=streamer,
                                 eos_token_id=None if args.eos_id is None else args.eos_id,
                                 acceptance="typical" if args.typical else "exact")
    except ValueError as err:
        raise SystemExit(f"specdec generate: {err}") from None
    if args.no_stream:
        new = tokens[len(ids):]
        print(tokenizer.decode(new) if tokenizer is not None else " ".join(str(int(t)) for t in new))
    print(stats.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="a short tour of the kernels with timings")
    p_demo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p_demo.add_argument("--draws", type=int, default=20000)
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    p_gen = sub.add_parser("generate", help="generate from a local Hugging Face model, with an optional drafter")
    p_gen.add_argument("--model", required=True, help="directory of the target model (save_pretrained layout)")
    p_gen.add_argument("--draft-model", help="directory of a smaller draft model with the same tokenizer")
    p_gen.add_argument("--ngram", action="store_true", help="n-gram (prompt lookup) drafter")
    p_gen.add_argument("--medusa", help="directory of Medusa-1 heads (config.json + medusa_lm_head.pt/.safetensors)")
    p_gen.add_argument("--eagle", help="directory of an EAGLE-1 or EAGLE-3 draft (config.json + weights)")
    p_gen.add_argument("--eagle-depth", type=int, default=8, help="--eagle: tree depth (EAGLE's depth + 1)")
    p_gen.add_argument("--eagle-top-k", type=int, default=10, help="--eagle: children per frontier node")
    p_gen.add_argument("--eagle-total-tokens", type=int, default=60, help="--eagle: draft tokens per tree")
    p_gen.add_argument("--typical", action="store_true",
                       help="Medusa typical acceptance when sampling (LOSSY: faster, not the exact distribution)")
    p_gen.add_argument("--num-draft-tokens", type=int, default=4, help="draft chain length")
    p_gen.add_argument("--tree-width", type=int, default=1,
                       help="--draft-model: top-k tree with this many branches at the root (1 = chain)")
    p_gen.add_argument("--max-ngram", type=int, default=3, help="longest n-gram matched by --ngram")
    p_gen.add_argument("--prompt", help="prompt text (needs a tokenizer in --model)")
    p_gen.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    p_gen.add_argument("--prompt-ids", help="prompt as token ids, e.g. '1 2 3'")
    p_gen.add_argument("--max-new-tokens", type=int, default=64)
    p_gen.add_argument("--eos-id", type=int, action="append", help="EOS token id (repeatable; default: the model's)")
    p_gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p_gen.add_argument("--top-k", type=int, default=0)
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--seed", type=int, default=0)
    p_gen.add_argument("--device", default="cpu")
    p_gen.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p_gen.add_argument("--no-stream", action="store_true", help="print the output at the end instead of streaming")
    p_gen.set_defaults(func=generate_cmd)
    from specdec_ext.train.cli import add_train_commands

    add_train_commands(sub)
    from specdec_ext.bench.cli import add_bench_command

    add_bench_command(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
