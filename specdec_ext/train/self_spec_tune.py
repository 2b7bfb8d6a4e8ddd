"""``specdec tune-self-spec``: choose the decoder layers a target skips when it drafts for itself
(:class:`~specdec_ext.drafters.SelfSpecDrafter`), by measured acceptance and cost on held-out text. No training.

Objective. For a skipped set S and a chain of k drafts, the expected speedup over plain decoding is::

    speedup(S, k) = tokens(S, k) * t_verify(1) / (k * t_draft(L - |S|) + t_verify(k + 1))

``tokens(S, k) = 1 + E[min(a, k)]``, where a is the number of drafts the target accepts from a chain of K =
``max_draft_tokens`` (greedy drafts are deterministic, so a chain of k accepts ``min(a, k)``): measured by greedy
generation with the drafter over the held-out prompts, one run per set, which gives every k <= K at once.
``t_draft(n)``: one draft forward running n of the L layers (the drafter's own route: op calls on CPUs), and
``t_verify(m)``: the target's verification forward of an m-node chain, both timed once before the search on a
prefilled cache (the fastest of repeated forwards taken in turns).
The decoder layers have equal shapes, so a draft forward costs the fixed part (embeddings, norm, LM head, the call
overheads) plus n equal layer costs: ``t_draft`` is measured at n = L and n = 0 and interpolated, which is exact up
to timing noise and keeps the search's comparisons free of it.

Search: greedy forward selection. From the empty set, each round measures every set of one more layer and goes on
from the round's best, even where that is not the best so far (a layer more can pay where one did not: the draft's
cost falls with every layer skipped); it stops after two rounds without a new best, when every layer is skipped, or
when the time budget is spent, and returns the best set measured (of at least ``min_skipped`` layers: with the
kept layers run as op calls, a draft of *no* skipped layer can beat plain decoding, whose target forward runs the
Hugging Face modules, and ``--min-skip 1`` asks for a real layer-skipping draft).

Why greedy and not SWIFT's Bayesian optimisation: at most L (L + 1) / 2 evaluations (36 for the family's 8 layers)
measure every single addition instead of sampling them, the result is deterministic, and it needs no dependency. Bayesian optimisation pays where evaluations are scarce against a huge
space (SWIFT searches the attention and MLP sub-layers of 40-80-layer models separately, 2^80 and more sets, on the
fly); whole layers of a small model are a space greedy selection covers.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from specdec_ext.drafters.self_spec import SelfSpecDrafter
from specdec_ext.drafters.self_spec_file import SelfSpecFile, write_self_spec
from specdec_ext.generate import generate
from specdec_ext.models import use_tree_attention
from specdec_ext.models.config import text_config
from specdec_ext.models.fast_linear import pack_linears_where_fast, packed_linears
from specdec_ext.state import DecodeState
from specdec_ext.threads import add_threads_argument
from specdec_ext.train.timing import PrefilledTarget, fastest_times

__all__ = ["Costs", "add_tune_self_spec_command", "measure_costs", "tune_self_spec"]


@dataclass
class Costs:
    """Seconds: ``draft_all`` / ``draft_none``: one draft forward with every layer / no layer run; ``verify[m - 1]``:
    the target's forward over an m-node chain."""

    num_layers: int
    draft_all: float
    draft_none: float
    verify: list[float]

    def draft(self, kept: int) -> float:
        return self.draft_none + (self.draft_all - self.draft_none) * kept / self.num_layers

    def speedup(self, tokens: float, k: int, kept: int) -> float:
        """The objective of the module doc for a chain of ``k`` drafts that yields ``tokens`` per step."""
        return tokens * self.verify[0] / (k * self.draft(kept) + self.verify[k])


@torch.no_grad()
def measure_costs(target: torch.nn.Module, prompt: list[int], max_draft_tokens: int, repeats: int = 15,
                  clock=time.perf_counter) -> Costs:
    """The forward times of the module doc after ``prompt``, as the engine runs them (inside its packed-products
    block, on a cache holding the prompt but its last token, the root): a draft forward is a one-draft
    :meth:`~specdec_ext.drafters.SelfSpecDrafter.propose` (its own route: op calls or modules), a verification a
    chain ``tree_forward`` of the target (through its op calls where the engine takes them). Each the fastest of
    ``repeats``, taken in turns (:mod:`specdec_ext.train.timing`)."""
    cfg = text_config(target.config)
    L = cfg.num_hidden_layers
    timed = PrefilledTarget(target, prompt, len(prompt) + max_draft_tokens + 2)
    state = DecodeState.of_prompts([prompt], timed.cache.max_len, cfg.vocab_size, timed.device,
                                   target_cache=timed.cache)
    with packed_linears(True):
        drafters = [SelfSpecDrafter(skip, num_draft_tokens=1) for skip in ([], list(range(L)))]
        for d in drafters:
            d.begin(target, state)

        def draft(d):
            return lambda: d.propose(state, 1, 2)

        times = fastest_times([draft(d) for d in drafters] + [timed.chain(m) for m in range(1, max_draft_tokens + 2)],
                              repeats, clock)
    verify_s = [max(times[2: 3 + i]) for i in range(max_draft_tokens + 1)]  # (a longer chain never costs less)
    return Costs(L, times[0], times[1], verify_s)


class _Measuring(SelfSpecDrafter):
    """A chain drafter that records how many drafts the target accepted of every chain of its full length (a
    chain the budget cut short measures nothing about K)."""

    def __init__(self, skip_layers, num_draft_tokens: int):
        super().__init__(skip_layers, num_draft_tokens=num_draft_tokens)
        self.accepted: list[int] = []

    def observe(self, state, tree, result) -> None:
        super().observe(state, tree, result)
        if tree.num_nodes == self.k + 1:
            self.accepted += result.accept_len.tolist()

    def tokens_by_depth(self) -> list[float]:
        """``tokens(k)`` of the module doc for k = 0 .. K."""
        if not self.accepted:
            raise ValueError("tune_self_spec: no chain of max_draft_tokens drafts ran: raise new_tokens above "
                             "max_draft_tokens")
        n = len(self.accepted)
        return [1.0 + sum(min(a, k) for a in self.accepted) / n for k in range(self.k + 1)]


_PATIENCE = 2  # rounds whose best set is not the best so far before the search stops


@dataclass
class _Scored:
    skip: tuple[int, ...]
    k: int
    speedup: float
    tokens: float
    record: dict = field(default_factory=dict)


def tune_self_spec(target: torch.nn.Module, prompts: list[list[int]], *, max_draft_tokens: int = 6,
                   new_tokens: int = 32, min_skipped: int = 0, time_limit_s: float | None = None,
                   costs: Costs | None = None, clock=time.perf_counter, log=None) -> SelfSpecFile:
    """The skipped set and chain length of best measured speedup (module doc) for ``target`` on ``prompts``
    (held-out token lists, decoded greedily for ``new_tokens`` each, as one batch), among sets of at least
    ``min_skipped`` layers; ``time_limit_s``: stop the search after that long (None: run it out). ``costs``: forward
    times (default: :func:`measure_costs`). ``log``: called with a line per evaluated set."""
    if not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise ValueError("tune_self_spec: prompts must be a non-empty list of non-empty token lists")
    for name, v in (("max_draft_tokens", max_draft_tokens), ("new_tokens", new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"tune_self_spec: {name} must be an integer >= 1, got {v!r}")
    L = text_config(target.config).num_hidden_layers
    if isinstance(min_skipped, bool) or not isinstance(min_skipped, int) or not 0 <= min_skipped <= L:
        raise ValueError(f"tune_self_spec: min_skipped must be an integer in [0, {L}] (the target's layers), got "
                         f"{min_skipped!r}")
    start = clock()
    use_tree_attention(target)
    pack_linears_where_fast(target)
    if costs is None:
        costs = measure_costs(target, prompts[0], max_draft_tokens, clock=clock)
    K = max_draft_tokens
    history: list[dict] = []

    def evaluate(skip: tuple[int, ...]) -> _Scored:
        drafter = _Measuring(list(skip), K)
        generate(target, drafter, prompts, max_new_tokens=new_tokens, eos_token_id=[])
        tokens = drafter.tokens_by_depth()
        best_k = max(range(1, K + 1), key=lambda k: costs.speedup(tokens[k], k, L - len(skip)))
        s = _Scored(skip, best_k, costs.speedup(tokens[best_k], best_k, L - len(skip)), tokens[best_k])
        s.record = {"skip_layers": list(skip), "num_draft_tokens": best_k,
                    "mean_accepted_length": round(tokens[best_k], 4), "estimated_speedup": round(s.speedup, 4)}
        history.append(s.record)
        if log is not None:
            log(f"skip {list(skip)}: {tokens[best_k]:.2f} tokens/step at k = {best_k}, est. x{s.speedup:.2f}")
        return s

    current = evaluate(())
    best = current if min_skipped == 0 else None
    out_of_time, stale = False, 0
    while len(current.skip) < L and not out_of_time and stale < _PATIENCE:
        round_best = None
        for layer in range(L):
            if layer in current.skip:
                continue
            if time_limit_s is not None and clock() - start > time_limit_s:
                out_of_time = True
                break
            s = evaluate(tuple(sorted(current.skip + (layer,))))
            if round_best is None or s.speedup > round_best.speedup:
                round_best = s
        if round_best is None:
            break
        current = round_best
        if len(current.skip) >= min_skipped and (best is None or current.speedup > best.speedup):
            best, stale = current, 0
        elif len(current.skip) > min_skipped:
            stale += 1
    if best is None:
        raise ValueError(f"tune_self_spec: the time budget ran out before a set of min_skipped = {min_skipped} "
                         "layers was measured")
    tuning = {"method": "greedy forward selection by estimated speedup (specdec_ext.train.self_spec_tune)",
              "estimated_speedup": round(best.speedup, 4), "mean_accepted_length": round(best.tokens, 4),
              "prompts": len(prompts), "new_tokens": new_tokens, "max_draft_tokens": K, "min_skipped": min_skipped,
              "draft_forward_ms": {"all_layers": round(costs.draft_all * 1e3, 4),
                                   "no_layer": round(costs.draft_none * 1e3, 4)},
              "verify_ms": [round(t * 1e3, 4) for t in costs.verify], "stopped_by_time": out_of_time,
              "seconds": round(clock() - start, 2), "history": history}
    return SelfSpecFile(L, best.skip, best.k, tuning)


# ---- the command --------------------------------------------------------------------------------------------------
def add_tune_self_spec_command(sub) -> None:
    p = sub.add_parser("tune-self-spec", help="choose the layers a target skips to draft for itself (no training)",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="directory of the target model (save_pretrained layout)")
    p.add_argument("--data", nargs="+", required=True,
                   help="held-out text files (or directories, or JSONL with 'text' / 'input_ids') for the prompts")
    p.add_argument("--out", required=True, help="the JSON file to write (load it with generate --self-spec)")
    p.add_argument("--minutes", type=float, default=10.0, help="time budget of the search (default 10)")
    p.add_argument("--num-prompts", type=int, default=4, help="held-out prompts decoded per evaluated set")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per prompt and set")
    p.add_argument("--max-draft-tokens", type=int, default=6, help="longest chain considered")
    p.add_argument("--min-skip", type=int, default=0, help="fewest layers the chosen set skips (default 0)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    add_threads_argument(p)
    p.set_defaults(func=tune_self_spec_cmd)


def tune_self_spec_cmd(args: argparse.Namespace) -> int:
    from specdec_ext.generate import load_model
    from specdec_ext.train.common import load_tokenizer
    from specdec_ext.train.data import load_corpus, model_max_length

    for name in ("num_prompts", "prompt_len", "new_tokens", "max_draft_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.minutes > 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    tokenizer = load_tokenizer(args.model)
    target = load_model(args.model, dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device)
    seqs = load_corpus(args.data, tokenizer, max_length=args.prompt_len, context=model_max_length(target),
                       vocab_size=text_config(target.config).vocab_size, min_length=args.prompt_len)
    step = max(1, len(seqs) // args.num_prompts)  # evenly spread over the text
    prompts = seqs[::step][: args.num_prompts]
    plan = tune_self_spec(target, prompts, max_draft_tokens=args.max_draft_tokens, new_tokens=args.new_tokens,
                          min_skipped=args.min_skip, time_limit_s=args.minutes * 60, log=print)
    write_self_spec(args.out, plan)
    print(f"skip layers {list(plan.skip_layers)} of {plan.num_layers}, chain of {plan.num_draft_tokens}: "
          f"{plan.tuning['mean_accepted_length']:.2f} tokens/step, estimated x{plan.tuning['estimated_speedup']:.2f} "
          f"over plain decoding ({len(prompts)} prompts of {args.prompt_len} tokens) -> {args.out}")
    return 0
