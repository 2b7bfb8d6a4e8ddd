"""``specdec train-medusa`` / ``train-eagle`` / ``train-draft`` / ``train-self-spec``: argument parsing and the
shared pipeline (load the target and its tokenizer, read the corpus, optionally self-distill, hold out evaluation
prompts, train, save, report: :mod:`specdec_ext.train.report`); ``specdec evaluate-drafter``: that report for any
drafter."""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from specdec_ext.threads import add_threads_argument
from specdec_ext.train.data import DISTILL_BATCH
from specdec_ext.train.schedule import DEFAULT_STEPS

__all__ = ["add_evaluate_command", "add_train_commands"]


# Long-context mixing by default for the drafts that read the context themselves (EAGLE-1, the draft LM): a tenth of
# the text in long windows held their acceptance at 4k context on the transfer target and on the family's, where
# drafts of short windows lost a quarter to a half of it (README: long context).
LONG_FRACTION = 0.1
# --minutes: the share of the budget self-distillation may take; 0.2-0.5 accepted alike on the family, a third the
# most (README, the recipe table), and it leaves two thirds to train on any corpus.
DISTILL_SHARE = 1 / 3
DISTILLED = "self_distill.json"  # in OUT/checkpoint: how many windows were rewritten, so that --resume rewrites those
TRAINING_LOG = "training_log.json"  # train-*'s record of its flags and losses, in OUT


def _window_arguments(p: argparse.ArgumentParser, max_length_help: str, long_fraction_help: str) -> None:
    p.add_argument("--max-length", type=int, default=None, help=max_length_help)
    p.add_argument("--long-fraction", type=float, default=None, metavar="F",
                   help="long-context mixing: this fraction of the text (0-1) trains in --long-length windows, "
                        f"batched apart with as many tokens a batch (0 = off; default {long_fraction_help})")
    p.add_argument("--long-length", type=int, default=None, metavar="N",
                   help="--long-fraction: tokens per long window (default min(4096, the model's context))")


def _common(p: argparse.ArgumentParser, lr: float, long_fraction: str = "0") -> None:
    p.add_argument("--model", required=True, help="directory of the target model (save_pretrained layout)")
    p.add_argument("--data", nargs="+", required=True,
                   help="text files (or directories of them), JSONL with 'text' / 'input_ids' / chat 'messages' fields")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {DEFAULT_STEPS}; or --minutes)")
    p.add_argument("--minutes", type=float, default=None, metavar="M",
                   help="a training-time budget instead of --steps: the step count is fixed after timing the first "
                        "steps, so that the schedule ends on time, at most --max-epochs passes over the data")
    p.add_argument("--max-epochs", type=float, default=2.0, metavar="E",
                   help="--minutes: at most E passes over the training sequences (more stopped paying on a small "
                        "corpus)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="after the warm-up: cosine decay to --min-lr-ratio * lr, or constant")
    p.add_argument("--warmup", type=int, default=None, help="linear learning-rate warm-up steps (default 5%% of "
                                                            "the steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="--schedule cosine: the final rate over --lr")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--weight-decay", type=float, default=0.0)
    _window_arguments(p, "tokens per training sequence (chunks; default min(256, the model's context))",
                      long_fraction)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="the frozen target's dtype (the trained module stays float32; default: the files', but "
                        "float32 for half-precision files on a CPU without fast bfloat16 products)")
    p.add_argument("--self-distill", type=int, default=None, metavar="N",
                   help="the target rewrites the last N tokens of each training window (its first --prompt-len "
                        "tokens at least stay the data's; default: --max-length minus --prompt-len (at most half of "
                        "it), each short window past its prompt; 0 = train on the data as is). Its time counts in "
                        "--minutes (at most --distill-share of them)")
    p.add_argument("--prompt-len", type=int, default=64,
                   help="prompt tokens of each held-out sequence (the evaluation and the report; at most half of "
                        "it), and the least of each window --self-distill keeps")
    p.add_argument("--distill-temperature", type=float, default=0.0, help="--self-distill: 0 = greedy")
    p.add_argument("--distill-batch", type=int, default=DISTILL_BATCH, metavar="B",
                   help="--self-distill: sequences decoded together (one engine; a finished one's row is refilled)")
    p.add_argument("--distill-share", type=float, default=DISTILL_SHARE, metavar="F",
                   help="--self-distill with --minutes: at most this fraction of the budget rewrites windows (a "
                        "random subset when not all fit; training reads only those). With --steps: as many windows "
                        "as the steps read")
    p.add_argument("--heldout", type=int, default=8, help="sequences held out to evaluate acceptance (0 = none)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate acceptance every N steps (0 = at the end)")
    p.add_argument("--eval-new-tokens", type=int, default=64, help="tokens generated per held-out prompt")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save a resumable checkpoint (OUT/checkpoint) every N steps (0 = by time only)")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0, metavar="M",
                   help="also save it after every M minutes of training (0 = off); always at the end")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/trainer_state.pt")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-report", action="store_true",
                   help="skip the end-of-training report (acceptance by depth, predicted speedup: OUT/"
                        "drafter_report.json)")
    add_threads_argument(p)


def _check_schedule_flags(args) -> None:
    """The schedule's flags, checked before anything loads (each error names its flag)."""
    if args.steps is not None and args.minutes is not None:
        raise ValueError(f"give --steps ({args.steps}) or --minutes ({args.minutes:g}), not both: --minutes chooses "
                         "the step count from the time it measures")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    for flag, v in (("--minutes", args.minutes), ("--max-epochs", args.max_epochs), ("--lr", args.lr)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{flag} must be a finite number > 0, got {v:g}")
    if not (math.isfinite(args.min_lr_ratio) and 0 <= args.min_lr_ratio <= 1):
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio:g}")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    steps = DEFAULT_STEPS if args.steps is None and args.minutes is None else args.steps
    if args.warmup is not None and steps is not None and args.warmup > steps:
        raise ValueError(f"--warmup ({args.warmup}) exceeds --steps ({steps})")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")


def _corpus(args, target, tok, name: str) -> tuple[list[list[int]], list[list[int]]]:
    """``(training sequences, held-out prompts)`` of ``--data``: ``--heldout`` sequences chosen by ``--seed`` (the
    same ones for train-* and evaluate-drafter given the same flags), each prompt its first ``--prompt-len``
    tokens (at most half of it)."""
    from specdec_ext.models.config import text_config
    from specdec_ext.train.data import DataError, load_corpus, model_max_length, prompt_of, split_heldout

    context = model_max_length(target)
    if args.max_length is None:
        args.max_length = min(256, context or 256)
    if args.long_fraction is None:
        args.long_fraction = _default_long_fraction(args, name, context)
    if args.long_fraction and args.long_length is None:
        args.long_length = min(4096, context or 4096)
    try:
        seqs = load_corpus(args.data, tok, max_length=args.max_length, context=context,
                           vocab_size=text_config(target.config).vocab_size, long_length=args.long_length,
                           long_fraction=args.long_fraction, seed=args.seed)
    except DataError as err:
        raise SystemExit(f"specdec {name}: bad data: {err}") from None
    train, held = split_heldout(seqs, args.heldout, args.seed)
    return train, [prompt_of(s, args.prompt_len) for s in held]


def _default_long_fraction(args, name: str, context: int | None) -> float:
    """``--long-fraction`` left unset: the mixing where the model's context holds windows longer than
    ``--max-length``, for EAGLE-1 (train-eagle --version 1) and the draft LM (train-draft, not --parallel), else
    none."""
    mixes = (name == "train-eagle" and args.version == 1) or (name == "train-draft" and args.parallel == 1)
    if mixes and context and min(4096, context) > args.max_length:
        return LONG_FRACTION
    return 0.0


def _trained_windows(home: str | None) -> dict:
    """The window flags a drafter was trained with (``TRAINING_LOG`` in its directory; {} without one), so that
    evaluate-drafter holds out the sequences its training held out."""
    path = os.path.join(home, TRAINING_LOG) if home else None
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        log = json.load(f)
    return {k: log[k] for k in ("max_length", "long_fraction", "long_length") if log.get(k) is not None}


def _target(args):
    from specdec_ext.generate import load_model
    from specdec_ext.models.fast_linear import bfloat16_is_fast
    from specdec_ext.train.common import load_tokenizer
    from specdec_ext.train.loop import default_device

    dtype = getattr(torch, args.dtype) if args.dtype else None
    args.device = args.device or default_device()
    target = load_model(args.model, dtype=dtype, device=args.device)
    p = next(q for q in target.parameters() if q.is_floating_point())
    if (dtype is None and p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float16)
            and not (p.dtype is torch.bfloat16 and bfloat16_is_fast("cpu"))):
        target = target.float()  # (such a CPU multiplies half precision through float32 conversions: slower)
    return target, load_tokenizer(args.model)


def _prepare(args, name: str):
    from specdec_ext.train.data import prompt_of, self_distill
    from specdec_ext.train.loop import TrainConfig

    _check_schedule_flags(args)
    if args.distill_batch < 1:
        raise ValueError(f"--distill-batch must be >= 1, got {args.distill_batch}")
    if not (math.isfinite(args.distill_share) and 0 < args.distill_share <= 1):
        raise ValueError(f"--distill-share must be in (0, 1], got {args.distill_share:g}")
    target, tok = _target(args)
    train, prompts = _corpus(args, target, tok, name)
    minutes = args.minutes
    if args.self_distill is None:  # each short window past its prompt
        args.self_distill = args.max_length - len(prompt_of(range(args.max_length), args.prompt_len))
    checkpoint_dir = os.path.join(args.out, "checkpoint")
    args.distilled = None  # windows rewritten (the training log records it)
    if args.self_distill:
        t0 = time.perf_counter()
        count, seconds = _distill_bound(args, checkpoint_dir)
        windows = len(train)
        train = self_distill(target, train, prompt_len=args.prompt_len, new_tokens=args.self_distill,
                             temperature=args.distill_temperature, seed=args.seed, batch_size=args.distill_batch,
                             progress=not args.no_progress, max_sequences=count, seconds=seconds)
        os.makedirs(checkpoint_dir, exist_ok=True)
        with open(os.path.join(checkpoint_dir, DISTILLED), "w") as f:
            json.dump({"sequences": len(train), "of": windows}, f)
        args.distilled = len(train)
        minutes = _minutes_left(name, args.minutes, time.perf_counter() - t0, len(train), windows)
    cfg = TrainConfig(steps=args.steps, minutes=minutes, max_epochs=args.max_epochs, lr=args.lr,
                      batch_size=args.batch_size, short_length=args.max_length if args.long_fraction else 0,
                      seed=args.seed, device=args.device, schedule=args.schedule,
                      warmup=args.warmup, warmup_fraction=0.05, min_lr_ratio=args.min_lr_ratio,
                      weight_decay=args.weight_decay,
                      eval_every=args.eval_every, eval_new_tokens=args.eval_new_tokens,
                      checkpoint_dir=checkpoint_dir, checkpoint_every=args.checkpoint_every,
                      checkpoint_minutes=args.checkpoint_minutes, resume=args.resume, progress=not args.no_progress)
    return target, tok, train, prompts, cfg


def _distill_bound(args, checkpoint_dir: str) -> tuple[int | None, float | None]:
    """``(max_sequences, seconds)`` for :func:`~specdec_ext.train.data.self_distill`: what the run it resumes
    rewrote (the same windows: the same seeded order), else the windows ``--steps`` read, or ``--distill-share`` of
    ``--minutes``."""
    from specdec_ext.models.safe_files import read_json

    saved = os.path.join(checkpoint_dir, DISTILLED)
    if args.resume and os.path.isfile(saved):
        count = read_json(saved, "--resume").get("sequences")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"--resume: {saved!r} does not record the windows self-distillation rewrote (a JSON "
                             "object with an integer 'sequences'); train into another output directory")
        return count, None
    if args.minutes is not None:
        return None, args.distill_share * args.minutes * 60
    return (DEFAULT_STEPS if args.steps is None else args.steps) * args.batch_size, None


def _minutes_left(name: str, minutes: float | None, distill_s: float, rewritten: int, windows: int) -> float | None:
    """The training's share of ``--minutes`` once self-distillation took ``distill_s`` seconds of it (None: no
    budget); too little left is an error naming both flags."""
    print(f"specdec {name}: self-distillation rewrote {rewritten} of {windows} windows in {distill_s / 60:.1f} "
          "minutes", flush=True)
    if minutes is None:
        return None
    left = minutes - distill_s / 60
    if left < 0.1 * minutes:
        raise SystemExit(f"specdec {name}: self-distillation took {distill_s / 60:.1f} of the {minutes:g} --minutes, "
                         "leaving too little to train: give more --minutes, a smaller --distill-share, or "
                         "--self-distill 0 (off)")
    return left


def _print_report(name: str, report, path: str) -> None:
    for line in report.lines():
        print(f"specdec {name}: {line}")
    print(f"specdec {name}: report saved to {path}")


def _report(args, name: str, result, extra: dict, target=None, drafter=None, prompts=()) -> None:
    """The training log (OUT/``TRAINING_LOG``), the summary line, and the drafter's report on the held-out
    prompts (OUT/drafter_report.json; not with --no-report or without held-out prompts)."""
    from specdec_ext.train.report import REPORT_FILE, evaluate_drafter

    report = None
    if drafter is not None and prompts and not args.no_report:
        report = evaluate_drafter(target, drafter, prompts, new_tokens=args.eval_new_tokens)
    windows = {"max_length": args.max_length, "long_fraction": args.long_fraction, "long_length": args.long_length,
               "self_distill": args.self_distill, "self_distilled_windows": args.distilled}
    info = {"command": name, "model": args.model, "data": args.data, **windows, **extra, **result.summary(),
            "report": report.to_dict() if report else None}
    with open(os.path.join(args.out, TRAINING_LOG), "w") as f:
        json.dump({**info, "losses": result.losses}, f, indent=1)
    s = result.summary()
    acc = f", mean accepted length {s['evals'][-1][1]:.3f}" if s["evals"] else ""
    plan = result.plan
    timed = plan and (plan.check_seconds or plan.step_seconds)  # (the check's timing re-fixed the probe's count)
    budget = (f" (the count {plan.budget_seconds / 60:.3g} minutes fit at {timed:.3f} s a step, at most "
              f"{plan.probe_total})" if timed else "")
    print(f"specdec {name}: {s['steps']} steps{budget}, loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}{acc}; "
          f"saved to {args.out}")
    if report is not None:
        _print_report(name, report, report.save(os.path.join(args.out, REPORT_FILE)))


def train_medusa_cmd(args) -> int:
    from specdec_ext.models.checkpoints import save_medusa
    from specdec_ext.train.medusa import medusa_drafter, train_medusa

    target, _, train, prompts, cfg = _prepare(args, "train-medusa")
    heads, result = train_medusa(target, train, cfg, num_heads=args.heads, num_layers=args.layers,
                                 decay=args.decay, heldout_prompts=prompts, share_lm_head=args.share_lm_head,
                                 soft_labels=args.soft_labels)
    save_medusa(heads, args.out, base_model_name_or_path=args.model, safetensors=True)
    _report(args, "train-medusa", result, {"heads": args.heads, "layers": args.layers, "soft_labels": args.soft_labels},
            target, medusa_drafter(heads, target), prompts)
    return 0


def train_eagle_cmd(args) -> int:
    from specdec_ext.models.checkpoints import save_eagle
    from specdec_ext.models.config import text_config
    from specdec_ext.models.draft_vocab import default_draft_vocab_size, draft_vocab_ids, write_draft_vocab
    from specdec_ext.train.eagle import eagle_drafter, train_eagle

    if args.version == 1 and args.draft_vocab:
        raise ValueError("--draft-vocab needs --version 3")
    if args.version == 3 and args.fr_vocab:
        raise ValueError("--fr-vocab is EAGLE-1's draft vocabulary file; an EAGLE-3 draft has its own (--draft-vocab)")
    if args.fr_vocab is not None and args.fr_vocab < 0:
        raise ValueError(f"--fr-vocab must be >= 0 (0 = no draft vocabulary), got {args.fr_vocab}")
    if args.vocab_loss and (args.version == 3 or args.fr_vocab == 0):  # (asked for explicitly: None is the default)
        raise ValueError("--vocab-loss takes EAGLE-1's token loss over its --fr-vocab ids: it needs --version 1 and "
                         "--fr-vocab other than 0 (an EAGLE-3 draft's loss is over its own --draft-vocab already)")
    if args.ttt_steps is not None and args.ttt_steps < 1:
        raise ValueError(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    target, _, train, prompts, cfg = _prepare(args, "train-eagle")
    fr_ids = None
    if args.version == 1:
        V = text_config(target.config).vocab_size
        n = default_draft_vocab_size(V) if args.fr_vocab is None else (args.fr_vocab or None)
        if n is not None and n > V:
            raise ValueError(f"--fr-vocab {n} exceeds the target's vocabulary ({V} ids)")
        fr_ids = draft_vocab_ids(train, V, n) if n is not None and n < V else None
    vocab_loss = args.vocab_loss is not False and fr_ids is not None  # (None, the default: on where there are ids)
    model, result = train_eagle(target, train, cfg, version=args.version, draft_vocab=args.draft_vocab,
                                ttt_steps=args.ttt_steps, token_weight=args.token_weight,
                                aux_layers=args.aux_layers, heldout_prompts=prompts, eval_draft_vocab=fr_ids,
                                vocab_loss=vocab_loss)
    save_eagle(model, args.out, base_model_name_or_path=args.model, safetensors=True)
    if fr_ids is not None:
        write_draft_vocab(args.out, fr_ids.tolist())
    _report(args, "train-eagle", result, {"version": args.version, "draft_vocab": args.draft_vocab,
                                          "fr_vocab": None if fr_ids is None else fr_ids.numel(),
                                          "vocab_loss": vocab_loss},
            target, eagle_drafter(model, target, fr_ids), prompts)
    return 0


def train_draft_cmd(args) -> int:
    from specdec_ext.train.draft_lm import draft_lm_drafter, first_layers, train_draft_lm

    if args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1 (1 = an ordinary draft LM), got {args.parallel}")
    for flag, v in (("--retention", args.retention), ("--min-retention", args.min_retention)):
        if not (math.isfinite(v) and 0 < v <= 1):
            raise ValueError(f"{flag} must be in (0, 1], got {v:g}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if args.init and (args.hidden_size or args.intermediate_size):
        raise ValueError("--init starts from that draft LM's own width: drop --hidden-size / --intermediate-size")
    init = None
    if args.init:
        from specdec_ext.generate import load_model

        init = load_model(args.init, dtype=torch.float32, device=args.device or "cpu")
        held = init.config.num_hidden_layers
        if args.layers is not None and args.layers > held:
            raise ValueError(f"--layers {args.layers}: the --init draft LM has {held} layer(s); it keeps its first "
                             f"1 to {held}")
        if args.layers is not None:
            init = first_layers(init, args.layers)
    target, tok, train, prompts, cfg = _prepare(args, "train-draft")
    model, result = train_draft_lm(target, train, cfg, num_layers=args.layers or 2, hidden_size=args.hidden_size,
                                   intermediate_size=args.intermediate_size, kl_weight=args.kl_weight,
                                   heldout_prompts=prompts, num_draft_tokens=args.num_draft_tokens, model=init,
                                   parallel=args.parallel, retention=args.retention,
                                   min_retention=args.min_retention)
    model.save_pretrained(args.out)
    if tok is not None:
        tok.save_pretrained(args.out)
    _report(args, "train-draft", result, {"layers": model.config.num_hidden_layers,
                                          "hidden_size": model.config.hidden_size, "init": args.init,
                                          "parallel": args.parallel, "retention": args.retention,
                                          "min_retention": args.min_retention},
            target, draft_lm_drafter(model, target, args.num_draft_tokens), prompts)
    return 0


def train_self_spec_cmd(args) -> int:
    from specdec_ext.models.config import text_config
    from specdec_ext.models.draft_vocab import default_draft_vocab_size, draft_vocab_ids, write_draft_vocab
    from specdec_ext.models.early_exit import load_early_exit, save_early_exit
    from specdec_ext.train.early_exit import early_exit_drafter, train_early_exit

    if args.num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    if args.init and args.exit_layer is not None:
        raise ValueError("--init continues that adapter at its own exit layer: drop --exit-layer")
    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary), got {args.draft_vocab}")
    target, _, train, prompts, cfg = _prepare(args, "train-self-spec")
    V = text_config(target.config).vocab_size
    n = default_draft_vocab_size(V) if args.draft_vocab is None else (args.draft_vocab or None)
    if n is not None and n > V:
        raise ValueError(f"--draft-vocab {n} exceeds the target's vocabulary ({V} ids)")
    ids = draft_vocab_ids(train, V, n) if n is not None and n < V else None
    init = load_early_exit(args.init, target=target, dtype=torch.float32) if args.init else None
    adapter, result = train_early_exit(target, train, cfg, exit_layer=args.exit_layer, heldout_prompts=prompts,
                                       num_draft_tokens=args.num_draft_tokens, adapter=init, draft_vocab=ids)
    save_early_exit(adapter, args.out, base_model_name_or_path=args.model,
                    dtype=next(q for q in target.parameters() if q.is_floating_point()).dtype)
    if ids is not None:
        write_draft_vocab(args.out, ids.tolist())
    _report(args, "train-self-spec", result, {"exit_layer": adapter.exit_layer, "init": args.init,
                                              "num_draft_tokens": args.num_draft_tokens,
                                              "draft_vocab": None if ids is None else ids.numel()},
            target, early_exit_drafter(adapter, target, args.num_draft_tokens, draft_vocab=ids), prompts)
    return 0


def evaluate_drafter_cmd(args) -> int:
    from specdec_ext.drafter_args import check_one_drafter, drafter_from_args
    from specdec_ext.train.data import prompt_of
    from specdec_ext.train.report import REPORT_FILE, evaluate_drafter

    check_one_drafter(args)
    if args.heldout < 0:
        raise ValueError(f"--heldout must be >= 0 (0 = every sequence of --data), got {args.heldout}")
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.prompts < 0:
        raise ValueError(f"--prompts must be >= 0 (0 = all), got {args.prompts}")
    if not any((args.eagle, args.medusa, args.draft_model, args.ngram, args.suffix, args.self_spec)):
        raise ValueError("evaluate-drafter needs a drafter: --eagle DIR, --medusa DIR, --draft-model DIR, --ngram, "
                         "--suffix or --self-spec FILE")
    home = args.eagle or args.medusa or args.draft_model
    out = args.out or (os.path.join(home, REPORT_FILE) if home else None)
    for key, value in _trained_windows(home).items():  # (flags given win)
        if getattr(args, key) is None:
            setattr(args, key, value)
    target, tok = _target(args)
    drafter = drafter_from_args(args, target)
    train, prompts = _corpus(args, target, tok, "evaluate-drafter")
    if args.heldout == 0:  # the data is held out as a whole (files the drafter never trained on)
        prompts = [prompt_of(s, args.prompt_len) for s in train]
    prompts = prompts[: args.prompts] if args.prompts else prompts
    report = evaluate_drafter(target, drafter, prompts, new_tokens=args.new_tokens, repeats=args.repeats)
    if out is None:
        for line in report.lines():
            print(f"specdec evaluate-drafter: {line}")
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    _print_report("evaluate-drafter", report, report.save(out))
    return 0


def add_evaluate_command(sub) -> None:
    from specdec_ext.drafter_args import add_drafter_arguments

    p = sub.add_parser("evaluate-drafter", help="acceptance by depth of a drafter on held-out data and the speedup "
                                                "it predicts on this machine")
    p.add_argument("--model", required=True, help="directory of the target model (save_pretrained layout)")
    p.add_argument("--data", nargs="+", required=True, help="the data, read as train-* reads it (--data there)")
    p.add_argument("--heldout", type=int, default=8,
                   help="evaluate on the N sequences train-* held out of --data with the same --seed and "
                        "--max-length (0 = every sequence: --data is held-out text)")
    p.add_argument("--prompts", type=int, default=0, help="at most this many prompts (0 = all)")
    _window_arguments(p, "tokens per sequence (as train-*; with --long-fraction and --long-length, which choose "
                         "the held-out sequences with it; default: the drafter's training's, from its "
                         f"{TRAINING_LOG}, else as train-*)", "the drafter's training's, else 0")
    p.add_argument("--prompt-len", type=int, default=64,
                   help="prompt tokens per sequence (at most half of it; as train-*)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=10, help="timed target forwards per size of the cost curve")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="the report's JSON file (default: drafter_report.json in the drafter's directory)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="the target's dtype (default as train-*: the files', float32 for half-precision files on a "
                        "CPU without fast bfloat16 products)")
    add_drafter_arguments(p)
    add_threads_argument(p)
    p.set_defaults(func=evaluate_drafter_cmd, no_packed_linears=False)


def add_train_commands(sub) -> None:
    p = sub.add_parser("train-medusa", help="train Medusa-1 heads for a local target (official layout)")
    _common(p, lr=1e-3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1, help="ResBlocks per head")
    p.add_argument("--decay", type=float, default=0.8, help="head h's loss weight is decay ** h")
    p.add_argument("--share-lm-head", action="store_true",
                   help="compact heads (ResBlocks only) that reuse the target's lm_head (legacy Medusa layout)")
    p.add_argument("--soft-labels", action=argparse.BooleanOptionalAction, default=True,
                   help="learn the target's own distribution of each future token (KL to it) instead of the text's "
                        "token (cross-entropy; --no-soft-labels); on by default: it accepted more on the family")
    p.set_defaults(func=train_medusa_cmd)
    p = sub.add_parser("train-eagle", help="train an EAGLE-1 or EAGLE-3 draft for a local target (official layout)")
    _common(p, lr=1e-3, long_fraction=f"{LONG_FRACTION:g} for --version 1 where the model's context is "
                                      "longer than --max-length, else 0")
    p.add_argument("--version", type=int, choices=[1, 3], default=1)
    p.add_argument("--draft-vocab", type=int, default=None, help="EAGLE-3: keep the N most frequent tokens")
    p.add_argument("--ttt-steps", type=int, default=None,
                   help="training-time-test steps: the draft continues from its own predictions (default 3: "
                        "EAGLE-3's published recipe; for EAGLE-1, published with 1, 3 accepted more on the family)")
    p.add_argument("--fr-vocab", type=int, default=None, metavar="N",
                   help="EAGLE-1: write OUT/draft_vocab.json, the data's N most frequent ids, which the drafter "
                        "scores instead of the whole lm_head (FR-Spec; default a quarter of the vocabulary, at least "
                        "1024; 0 = none)")
    p.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="I",
                   help="EAGLE-3: the three target layers whose inputs are fused (default 2, L//2, L-3)")
    p.add_argument("--token-weight", type=float, default=0.1, help="EAGLE-1: weight of the token loss")
    p.add_argument("--vocab-loss", action=argparse.BooleanOptionalAction, default=None,
                   help="EAGLE-1: take the token loss over the --fr-vocab ids the drafter ranks (the target's "
                        "distribution renormalised over them) instead of the whole vocabulary: cheaper steps "
                        "(default on with --fr-vocab ids; --no-vocab-loss: the whole vocabulary)")
    p.set_defaults(func=train_eagle_cmd)
    p = sub.add_parser("train-draft", help="distil a small draft LM (LlamaForCausalLM) from a local target")
    _common(p, lr=1e-3, long_fraction=f"{LONG_FRACTION:g} where the model's context is longer than --max-length "
                                      "(not with --parallel), else 0")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default 2); with --init: keep that draft LM's first N (default all)")
    p.add_argument("--hidden-size", type=int, default=None, help="default: half the target's (whole heads)")
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 2 * hidden size")
    p.add_argument("--kl-weight", type=float, default=1.0, help="KL to the target's logits vs CE on the data")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft chain length in the acceptance evaluation and the report (default: the library's chain "
                        "on the device, on a CPU a chain of 4)")
    p.add_argument("--init", metavar="DIR", default=None,
                   help="start from this draft LM (save_pretrained layout, the target's vocabulary) instead of a new "
                        "one")
    p.add_argument("--parallel", type=int, default=1, metavar="K",
                   help="train a parallel draft (PARD) that predicts K tokens in one forward from K - 1 mask tokens "
                        "after the context (1 = an ordinary draft LM); the mask is a new vocabulary row")
    p.add_argument("--retention", type=float, default=0.5,
                   help="--parallel: an anchor keeps mask j with probability max(R ** j, --min-retention) "
                        "(conditional drop-token training: about 1 + sum of those windows per window)")
    p.add_argument("--min-retention", type=float, default=0.1, help="--parallel: the least retention rate")
    p.set_defaults(func=train_draft_cmd)
    p = sub.add_parser("train-self-spec", help="train an early-exit adapter (Kangaroo-style self-speculation: the "
                                               "target's first layers + the adapter + its own LM head draft)")
    _common(p, lr=3e-4)
    p.add_argument("--exit-layer", type=int, default=None, metavar="L",
                   help="target decoder layers before the adapter (default: a quarter of them, at least 1)")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K",
                   help="the chain the held-out evaluation drafts")
    p.add_argument("--init", metavar="DIR", default=None, help="continue training this adapter directory")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft scores the N most frequent token ids of the data (draft_vocab.json beside the "
                        "adapter; default: a quarter of the vocabulary, at least 1024; 0 = all)")
    p.set_defaults(func=train_self_spec_cmd)
    add_evaluate_command(sub)

