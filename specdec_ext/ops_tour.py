"""``specdec ops-tour``: a short tour of the kernels on random data: it builds a draft tree, verifies it greedily
and by lossless rejection sampling, shows that sampled verification reproduces the target distribution, and times
each op."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec_ext
from specdec_ext import ops
from specdec_ext.threads import add_threads_argument

__all__ = ["add_ops_tour_command", "ops_tour"]


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


def ops_tour(args: argparse.Namespace) -> int:
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


def add_ops_tour_command(sub) -> None:
    p = sub.add_parser("ops-tour", help="a short tour of the kernels on random data, with timings")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--draws", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    add_threads_argument(p)
    p.set_defaults(func=ops_tour)
