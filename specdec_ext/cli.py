"""The ``specdec`` command line (also ``python -m specdec_ext``).

``specdec demo`` (the main job): the shipped model family decoding held-out Python source, a completion streamed
with accepted draft tokens marked, then plain decoding vs every drafter measured side by side
(:mod:`specdec_ext.demo`). ``specdec ops-tour``: the kernels on random data (:mod:`specdec_ext.ops_tour`).

``specdec generate --model DIR [--ngram | --draft-model DIR | --medusa DIR | --eagle DIR | --self-spec FILE]
(--prompt TEXT [--chat] | --prompt-ids "1 2 3")``
generates from a local Hugging Face model (plain decoding without a drafter), streams the output and ends with a
summary line (tokens/s, mean accepted length, target forwards, time split).

``specdec serve --model DIR [drafter flags] | --zoo``: an OpenAI-compatible HTTP server on the engine
(:mod:`specdec_ext.serve`).

``specdec train-medusa | train-eagle | train-draft | evaluate-drafter`` (:mod:`specdec_ext.train.cli`),
``specdec tune-self-spec``
(:mod:`specdec_ext.train.self_spec_tune`), ``specdec zoo build``
(:mod:`specdec_ext.zoo.cli`), ``specdec bench`` (:mod:`specdec_ext.bench.cli`).

Errors: one line ``specdec <command>: ...`` on stderr and a non-zero status (2: a bad command line, 130: Ctrl-C),
formatted here in :func:`main` only; ``specdec --debug <command> ...`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys

import torch

from specdec_ext.devices import check_device
from specdec_ext.drafter_args import add_drafter_arguments, check_one_drafter, drafter_from_args
from specdec_ext.host_allocator import tune_host_allocator
from specdec_ext.threads import add_threads_argument, apply_threads

try:
    from safetensors import SafetensorError
except ImportError:  # safetensors comes with transformers; without it no such error can arise
    SafetensorError = ValueError

# Errors that mean bad input (a file, an argument, the machine): printed as the message alone. Anything else is
# printed with its type as an unexpected error; both as one line, the traceback only with --debug.
USER_ERRORS = (ValueError, OSError, NotImplementedError, SafetensorError, pickle.UnpicklingError,
               torch.OutOfMemoryError)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and the (sub)command's name recorded for main's error lines."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "command_name", None) is None:  # the innermost subcommand parses first and wins
            ns.command_name = self.prog
        return ns, rest


def error_line(command: str, err: BaseException) -> str:
    """``err`` as the one line ``specdec <command>: ...`` (the traceback is for --debug)."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, USER_ERRORS):
        return f"{command}: {text or type(err).__name__}"
    return (f"{command}: unexpected {type(err).__name__}{': ' + text if text else ''} (run with "
            f"specdec --debug for the traceback)")


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
    if required and not os.path.isdir(path):
        raise FileNotFoundError(f"--model {path!r} is not a local directory")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001  (any failure: no usable tokenizer in the directory)
        if required:
            raise ValueError(f"no tokenizer could be loaded from {path!r} ({type(err).__name__}: {err}); pass "
                             "--prompt-ids instead of --prompt") from None
        return None


def generate_cmd(args: argparse.Namespace) -> int:
    from specdec_ext.generate import generate, load_model
    from specdec_ext.serve.prompts import chat_ids, text_ids

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("pass exactly one of --prompt and --prompt-ids")
    if args.chat and args.prompt is None:
        raise ValueError("--chat wraps --prompt text in the chat template; drop it with --prompt-ids")
    check_one_drafter(args)
    ids = None
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be integers, got {args.prompt_ids!r}") from None
    # the tokenizer first (text in or out needs it; ids in and out do not): its errors come before a model loads
    tokenizer = None if ids is not None and args.print_ids else _load_tokenizer(args.model, required=ids is None)
    if ids is None:
        if args.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"--chat: the tokenizer in {args.model!r} has no chat template; drop --chat to "
                                 "use the prompt as it is")
            ids = chat_ids(tokenizer, [{"role": "user", "content": args.prompt}], "--chat")
        else:
            ids = text_ids(tokenizer, args.prompt)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    target = load_model(args.model, dtype=dtype, device=args.device)
    drafter = drafter_from_args(args, target)
    decoder = None if args.print_ids else tokenizer  # output as text, or as ids
    streamer = None
    if not args.no_stream:
        if decoder is not None:
            from transformers import TextStreamer

            streamer = TextStreamer(decoder, skip_prompt=True)
        else:
            streamer = _IdStreamer()
    tokens, stats = generate(target, drafter, torch.tensor(ids, dtype=torch.int64),
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed, streamer=streamer,
                             eos_token_id=None if args.eos_id is None else args.eos_id,
                             acceptance="typical" if args.typical else "exact",
                             packed_linears=not args.no_packed_linears)
    if args.no_stream:
        new = tokens[len(ids):]
        print(decoder.decode(new) if decoder is not None else " ".join(str(int(t)) for t in new))
    print(stats.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="specdec", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="on an error, show its traceback (default: one line)")
    sub = parser.add_subparsers(dest="command", required=True)
    from specdec_ext.demo import add_demo_command
    from specdec_ext.ops_tour import add_ops_tour_command

    add_demo_command(sub)
    add_ops_tour_command(sub)
    p_gen = sub.add_parser("generate", help="generate from a local Hugging Face model, with an optional drafter")
    p_gen.add_argument("--model", required=True, help="directory of the target model (save_pretrained layout)")
    add_drafter_arguments(p_gen)
    p_gen.add_argument("--typical", action="store_true",
                       help="Medusa typical acceptance when sampling (LOSSY: faster, not the exact distribution)")
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
    p_gen.add_argument("--print-ids", action="store_true",
                       help="print the output as token ids, not text (the default where --model has no tokenizer)")
    p_gen.add_argument("--no-packed-linears", action="store_true",
                       help="multiply with aten's products (default: the target and draft model multiply with "
                            "weights packed once for few-row products, which costs a copy of their weights)")
    add_threads_argument(p_gen)
    p_gen.set_defaults(func=generate_cmd)
    from specdec_ext.train.cli import add_train_commands

    add_train_commands(sub)
    from specdec_ext.train.self_spec_tune import add_tune_self_spec_command

    add_tune_self_spec_command(sub)
    from specdec_ext.bench.cli import add_bench_command

    add_bench_command(sub)
    from specdec_ext.zoo.cli import add_zoo_command

    add_zoo_command(sub)
    from specdec_ext.serve.cli import add_serve_command

    add_serve_command(sub)
    args = parser.parse_args(argv)
    command = args.command_name
    # The one place errors become lines: commands raise, they never print-and-exit (SystemExit passes through).
    try:
        if getattr(args, "device", None) is not None:
            check_device(args.device, "--device")
        if getattr(args, "threads", None) is not None:
            apply_threads(args)
        tune_host_allocator()  # (a decoding process's malloc thresholds; see specdec_ext/host_allocator.py)
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as err:  # noqa: BLE001  (every error is one line; --debug shows the traceback)
        if args.debug:
            raise
        raise SystemExit(error_line(command, err)) from None


if __name__ == "__main__":
    sys.exit(main())
