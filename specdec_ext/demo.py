"""``specdec demo``, the main job: speculative decoding on the shipped model family, offline, on this machine.

1. A completion of a held-out piece of Python source, streamed as it is decoded: tokens that came from accepted
   drafts are marked (green on a terminal, ``«...»`` otherwise); the rest are the target's own tokens (the
   correction or bonus token of each step).
2. A table: plain greedy decoding vs each drafter on the same prompts — tokens/s, speedup, mean accepted length
   and whether the output equals plain greedy decoding token for token — all measured in this run. Methods take
   turns prompt by prompt, so that a machine that slows down mid-run slows every method alike.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from specdec_ext.threads import add_threads_argument

__all__ = ["MarkingStreamer", "add_demo_command", "demo"]

GREEN, RESET = "\x1b[32m", "\x1b[0m"


class MarkingStreamer:
    """HF-style streamer for :func:`specdec_ext.generate.generate`: each ``put`` after the prompt is one step's
    tokens — the accepted drafts, then the target's own token — printed as text with the drafts marked."""

    def __init__(self, tokenizer, out=None, color: bool | None = None):
        self.tok, self.out = tokenizer, out or sys.stdout
        self.color = self.out.isatty() if color is None else color
        self.ids: list[int] = []
        self.text = ""
        self.seen_prompt = False
        self.drafted = 0  # tokens that came from accepted drafts

    def _piece(self, new: list[int]) -> str:
        """The text ``new`` adds after ``self.ids`` (decoding the whole completion keeps multi-byte characters
        split across tokens intact)."""
        self.ids += new
        text = self.tok.decode(self.ids)
        piece, self.text = text[len(self.text):], text
        return piece

    def _mark(self, s: str) -> str:
        if not s:
            return s
        return f"{GREEN}{s}{RESET}" if self.color else f"«{s}»"

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        step = [int(t) for t in value.flatten()]
        drafts, own = step[:-1], step[-1:]
        self.drafted += len(drafts)
        self.out.write(self._mark(self._piece(drafts)) + self._piece(own))
        self.out.flush()

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def _run(family, name, prompt, max_new_tokens, streamer=None):
    from specdec_ext.generate import generate

    drafter = None if name == "plain" else family.make_drafter(name)
    t0 = time.perf_counter()
    out, stats = generate(family.target, drafter, torch.tensor(prompt), max_new_tokens=max_new_tokens,
                          eos_token_id=[], streamer=streamer)
    return out.tolist(), stats, time.perf_counter() - t0


def demo(args: argparse.Namespace) -> int:
    import specdec_ext
    from specdec_ext.zoo import load_family
    from specdec_ext.zoo.family import SHIPPED_HYBRID_DIR
    from specdec_ext.zoo.evaluate import heldout_prompts

    for name, val in (("--max-new-tokens", args.max_new_tokens), ("--prompts", args.prompts),
                      ("--prompt-tokens", args.prompt_tokens)):
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    t_start = time.perf_counter()
    if args.hybrid and args.family:
        raise ValueError("--hybrid and --family are exclusive (--hybrid: the shipped hybrid family)")
    family = SHIPPED_HYBRID_DIR if args.hybrid else args.family
    fam = load_family(family, dtype=getattr(torch, args.dtype), eagle_dtype=args.eagle_dtype)
    names = fam.drafter_names if not args.drafters else tuple(args.drafters.split(","))
    unknown = [n for n in names if n not in fam.drafter_names]
    if unknown or (args.stream_with not in fam.drafter_names):
        bad = unknown[0] if unknown else args.stream_with
        raise ValueError(f"unknown drafter {bad!r}; choose from {', '.join(fam.drafter_names)}")
    card = fam.card
    n_params = sum(p.numel() for p in fam.target.parameters())
    print(f"specdec_ext {specdec_ext.__version__} | torch {torch.__version__} ({torch.get_num_threads()} threads, "
          f"{args.dtype}; EAGLE drafts {str(fam.eagle1.fc.weight.dtype).replace('torch.', '')}) | "
          f"family {fam.path}")
    if card.get("built"):
        spec = card.get("spec", {})
        kind = ("MiniMax hybrid (Lightning attention layers beside softmax attention)"
                if spec.get("architecture") == "minimax" else spec.get("architecture", "llama").capitalize())
        print(f"target: {n_params / 1e6:.1f} M-parameter {kind} trained on the Python standard library "
              f"({card['training']['target']['steps']} steps, built {card['built']}); float32 on the CPU")
    prompts = heldout_prompts(fam.tokenizer, args.prompts, args.prompt_tokens)
    if args.prompt:
        prompts = [fam.tokenizer(args.prompt, add_special_tokens=False)["input_ids"]] + prompts[: args.prompts - 1]

    # 1. One completion, streamed.
    streamer = MarkingStreamer(fam.tokenizer, color=None if not args.no_color else False)
    legend = "green" if streamer.color else "«between marks»"
    print(f"\n1. Completion by the {args.stream_with} drafter (greedy; accepted draft tokens {legend}):\n")
    print(fam.tokenizer.decode(prompts[0]), end="")
    _, stats, _ = _run(fam, args.stream_with, prompts[0], args.max_new_tokens, streamer)
    print(f"\n   {stats.new_tokens} tokens, {streamer.drafted} of them from accepted drafts, in {stats.steps} target "
          f"forwards (mean accepted length {stats.mean_accepted_length:.2f})")

    # 2. The table: warm-up, then every method on every prompt, taking turns.
    methods = ("plain",) + tuple(names)
    for m in methods:
        _run(fam, m, prompts[0][:16], 8)
    totals = {m: {"tokens": 0, "seconds": 0.0, "forwards": 0, "identical": True} for m in methods}
    reference = {}
    for i, p in enumerate(prompts):
        for m in methods:
            out, st, dt = _run(fam, m, p, args.max_new_tokens)
            t = totals[m]
            t["tokens"] += st.new_tokens
            t["seconds"] += dt
            t["forwards"] += st.row_steps
            if m == "plain":
                reference[i] = out
            else:
                t["identical"] &= out == reference[i]
    plain_tps = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    print(f"\n2. Greedy decoding of {len(prompts)} held-out prompts of {args.prompt_tokens} tokens, "
          f"{args.max_new_tokens} new tokens each, measured in this run:\n")
    print(f"   {'method':<15} {'tokens/s':>9} {'speedup':>8} {'mean accepted length':>21}  same tokens as plain")
    for m in methods:
        t = totals[m]
        tps = t["tokens"] / t["seconds"]
        same = "-" if m == "plain" else ("yes" if t["identical"] else "NO")
        print(f"   {m:<15} {tps:9.1f} {tps / plain_tps:7.2f}x {t['tokens'] / t['forwards']:21.2f}  {same}")
    print(f"\n   mean accepted length = tokens per target forward; drafter shapes and training: "
          f"{fam.path}/README.md\n   total demo time {time.perf_counter() - t_start:.0f} s")
    if not all(totals[m]["identical"] for m in methods):
        print("specdec demo: a drafter's greedy output differs from plain greedy decoding", file=sys.stderr)
        return 1
    return 0


def add_demo_command(sub) -> None:
    p = sub.add_parser("demo", help="speculative decoding on the shipped model family: streamed output and a "
                                    "speed table (offline, CPU)")
    p.add_argument("--family", default=None, help="family directory (default: $SPECDEC_ZOO or the shipped one)")
    p.add_argument("--hybrid", action="store_true", help="the shipped hybrid family: a MiniMax target whose Lightning "
                                                         "layers keep recurrent states, with its own drafters")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts in the table")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per held-out prompt")
    p.add_argument("--prompt", default=None, help="your own prompt text (streamed, and first in the table)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--drafters", default=None, help="comma-separated subset of the family's drafters")
    p.add_argument("--stream-with", default="eagle3", help="the drafter of the streamed completion")
    add_threads_argument(p, default=1, why="the family's products are too small to gain from a second thread "
                                            "and lost 23-40%% with one on a 2-core machine")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="model dtype; bfloat16 pays on CPUs with bfloat16 instructions (AVX512-BF16, AMX), where "
                        "verifying a tree costs little more than one token, and crawls on others")
    p.add_argument("--eagle-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="dtype of the EAGLE drafts (auto: bfloat16 for a float32 target on CPUs with AVX512-BF16, "
                        "where a draft level then reads half the bytes; else the target's)")
    p.add_argument("--no-color", action="store_true", help="mark accepted drafts with «» instead of color")
    p.set_defaults(func=demo)
