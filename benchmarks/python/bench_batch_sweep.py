"""Batch sweep: tokens/s of plain decoding, each fixed draft depth and adaptive speculation against the batch size.

    python benchmarks/python/bench_batch_sweep.py [--quick] [--drafter eagle2] [--standin] [--json PATH]

Models: the project's small model family (``specdec_ext.zoo.load_family``; ``--zoo DIR`` or ``$SPECDEC_ZOO`` for
another build) with ``--drafter`` (default eagle2; comma-separated for several sweeps in one run, each with its own
JSON and PNG); prompts are cut from the family's held-out text (``specdec_ext.bench.models``).
Without the family (or with ``--standin``): a randomly initialised Llama of the family's size (hidden 384, 8 layers,
intermediate 1024, vocabulary 4096) and an *oracle* drafter whose acceptance and cost are set on the command line:
it knows each prompt's greedy continuation (from a plain run) and drafts it, each draft token right with
probability ``--accept`` (a wrong token ends what can be accepted), and busy-waits ``--draft-ms`` per draft token
per step (a stand-in for a draft network's forwards). Results go to ``benchmarks/results/batch_sweep_<tag>.json``
with a plot beside it (``.png``, when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from specdec_ext.bench.batch_sweep import format_table, run_batch_sweep  # noqa: E402
from specdec_ext.drafters.base import pad_chains  # noqa: E402
from specdec_ext.generate import generate  # noqa: E402


class OracleDrafter:
    """Drafts each row's known greedy continuation (a chain of up to ``depth``), each token right with probability
    ``accept`` (seeded per position, so every configuration sees the same drafts), and costs ``draft_ms`` of busy
    host time per draft token (times the batch rows when ``per_row``)."""

    hidden_state_layers = ()

    def __init__(self, references: dict, depth: int = 8, accept: float = 0.8, draft_ms: float = 0.3,
                 seed: int = 0, vocab: int = 4096):
        self.refs = references  # prompt tuple -> full greedy sequence (prompt + continuation)
        self.depth, self.max_nodes = depth, depth + 1
        self.accept, self.draft_ms, self.seed, self.vocab = accept, draft_ms, seed, vocab

    def begin(self, target, state, prefill_hidden_states=None):
        self.seqs = [self.refs.get(tuple(ctx)) for ctx in state.host_tokens]

    def retire(self, keep):
        self.seqs = [self.seqs[i] for i in keep.tolist()]

    def _token(self, seq, pos: int) -> int:
        h = (self.seed * 0x9E3779B1 + pos * 0x85EBCA77 + seq[0] * 0xC2B2AE3D + seq[1] * 0x27D4EB2F) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h ^= h >> 12
        h = (h * 0x297A2D39) & 0xFFFFFFFF
        h ^= h >> 15
        good = seq[pos] if pos < len(seq) else 0
        return good if h / 2 ** 32 < self.accept else (good + 1 + h % (self.vocab - 1)) % self.vocab

    def propose(self, state, max_depth, max_nodes):
        k = min(self.depth, max_depth, max_nodes - 1)
        chains = []
        for ctx, seq in zip(state.host_tokens, self.seqs):
            n = len(ctx)
            chains.append([] if seq is None or k <= 0 else [self._token(seq, n + i) for i in range(k)])
        if k > 0 and self.draft_ms > 0:
            end = time.perf_counter() + k * self.draft_ms / 1000.0
            while time.perf_counter() < end:
                pass
        return pad_chains(chains, [ctx[-1] for ctx in state.host_tokens], state.device)

    def observe(self, state, tree, result):
        pass


def standin_models(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=2048)
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(args.seed)
    Bmax = max(args.batch_sizes)
    prompts = torch.randint(3, 4096, (Bmax, args.prompt_len), generator=gen).tolist()
    ref, _ = generate(target, None, prompts, max_new_tokens=args.max_new_tokens, eos_token_id=[])
    refs = {tuple(p): r.tolist() for p, r in zip(prompts, ref)}

    def make_drafter():
        return OracleDrafter(refs, depth=args.depth, accept=args.accept, draft_ms=args.draft_ms, seed=args.seed)

    name = f"oracle(accept={args.accept}, draft_ms={args.draft_ms}, depth={args.depth})"
    return target, make_drafter, prompts, name, "random Llama 384x8, vocab 4096 (stand-in)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch sizes 1, 4, 16, 64; 24 new tokens; 1 repeat")
    p.add_argument("--batch-sizes", default="", help="comma-separated (default 1,2,4,8,16,32,64)")
    p.add_argument("--max-new-tokens", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=0)
    p.add_argument("--fixed-depths", default="", help="comma-separated (default 1,2,3,4,6,8 up to the drafter's)")
    p.add_argument("--drafter", default="eagle2", help="family drafter(s), comma-separated (ngram, draft-model, "
                                                       "medusa, eagle1/2/3)")
    p.add_argument("--zoo", default=None, help="family directory (default: $SPECDEC_ZOO or the shipped one)")
    p.add_argument("--standin", action="store_true", help="random Llama + oracle drafter even if the family exists")
    p.add_argument("--accept", type=float, default=0.8, help="stand-in: per-token draft acceptance")
    p.add_argument("--draft-ms", type=float, default=0.3, help="stand-in: ms of draft work per draft token")
    p.add_argument("--depth", type=int, default=8, help="stand-in: the oracle's depth")
    p.add_argument("--cold", action="store_true", help="also time a fresh AdaptiveDrafter per run")
    p.add_argument("--budgets", choices=["mixed", "equal"], default="mixed",
                   help="row budgets: spread from 1/4 to all of --max-new-tokens (default), or all equal")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="default: benchmarks/results/batch_sweep_<drafter>.json (one "
                                                  "drafter only)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x] or (
        [1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64])
    args.max_new_tokens = args.max_new_tokens or (24 if args.quick else 64)
    fixed = [int(x) for x in args.fixed_depths.split(",") if x] or None

    models = None
    if not args.standin:
        try:
            from specdec_ext.bench.models import from_zoo

            models = from_zoo(args.zoo, device="cpu")
        except Exception as err:  # noqa: BLE001  (no family yet: the stand-in)
            print(f"(model family unavailable: {err}; using the stand-in)", file=sys.stderr)
    names = [n for n in args.drafter.split(",") if n] if models is not None else ["standin"]
    if args.json and len(names) > 1:
        p.error("--json takes one drafter")
    for drafter in names:
        if models is not None:
            target, prompts = models.target, None
            make_drafter = (lambda n=drafter: models.make_drafter(n))
            name, models_note = drafter, {"name": "specdec_ext.zoo family", "path": models.info.get("family_path"),
                                          "drafter_settings": models.info.get("drafter_settings", {}).get(drafter)}
        else:
            target, make_drafter, prompts, name, note = standin_models(args)
            models_note = {"name": note}
        result = run_batch_sweep(target, make_drafter, prompts, args.batch_sizes, args.max_new_tokens, fixed,
                                 drafter_name=name, models=models, prompt_len=args.prompt_len,
                                 repeats=args.repeats or None, quick=args.quick, seed=args.seed, cold=args.cold,
                                 budgets=args.budgets,
                                 log=lambda s: print(s, flush=True))
        result["models"] = models_note
        result["command"] = "python " + " ".join([os.path.relpath(__file__, ROOT)] + list(
            sys.argv[1:] if argv is None else argv))
        try:
            from specdec_ext.bench.machine import machine_info

            result["machine"] = machine_info()
        except Exception:  # noqa: BLE001
            pass
        print(format_table(result))
        tag = "standin" if models is None else drafter
        path = args.json or os.path.join(ROOT, "benchmarks", "results",
                                         f"batch_sweep_{tag}{'_quick' if args.quick else ''}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
        if not args.no_plot:
            try:
                from specdec_ext.bench.plots import plot_batch

                png = plot_batch({"batch": result, "machine": result.get("machine", {}), "models": models_note},
                                 os.path.splitext(path)[0] + ".png")
                if png:
                    print(f"wrote {png}")
            except ImportError as err:
                print(f"(no plot: {err})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
