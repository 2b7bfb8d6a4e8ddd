"""``specdec serve``: the OpenAI-compatible server from the command line.

    specdec serve --model DIR [--draft-model DIR | --ngram | --medusa DIR | --eagle DIR] [--adaptive]
                  [--host 127.0.0.1 --port 8000] [--max-batch 32] [--max-queue 1024] [--api-key KEY]
    specdec serve --model DIR --speculative-config '{"method": "eagle", "model": "DIR", "num_speculative_tokens": 4}'
    specdec serve --zoo [--zoo-drafter NAME]       # the shipped model family with its best drafter, offline

The server's packages (fastapi, uvicorn, prometheus-client: ``pip install specdec_ext[serve]``) are imported when
the command runs, so the rest of the command line works without them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdec_ext.drafter_args import add_drafter_arguments, check_one_drafter, draft_quant, drafter_from_args
from specdec_ext.threads import add_threads_argument

__all__ = ["add_serve_command", "apply_speculative_config", "best_drafter", "build_server", "serve_cmd"]

SPEC_METHODS = ("eagle", "eagle3", "medusa", "ngram", "draft_model", "suffix")
# vLLM's suffix-decoding keys and the --suffix flags they set
SUFFIX_KEYS = {"suffix_decoding_max_tree_depth": "suffix_depth", "suffix_decoding_max_spec_factor": "suffix_spec_factor",
               "suffix_decoding_min_token_prob": "suffix_min_prob"}


def add_serve_command(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics) with "
                                     "speculative decoding", description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[2:]))
    m = p.add_argument_group("the model")
    m.add_argument("--model", help="directory of the target model (save_pretrained layout, with its tokenizer)")
    m.add_argument("--zoo", nargs="?", const="", default=None, metavar="DIR",
                   help="serve a model family (default: $SPECDEC_ZOO or the shipped one) instead of --model")
    m.add_argument("--zoo-drafter", default="best",
                   help="--zoo: the family's drafter (best: the fastest on its card; plain: none; or ngram, "
                        "draft-model, medusa, eagle1, eagle2, eagle3)")
    m.add_argument("--served-model-name", help="the model id clients send (default: --model as given, or the "
                                               "family's name)")
    m.add_argument("--chat-template", help="file with a Jinja chat template (default: the tokenizer's own)")
    m.add_argument("--device", default="cpu")
    m.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    m.add_argument("--no-packed-linears", action="store_true",
                   help="multiply with aten's products (default: packed weights for few-row products)")
    d = p.add_argument_group("speculation")
    add_drafter_arguments(d)
    d.add_argument("--speculative-config",
                   help="vLLM's JSON: {\"method\": eagle|eagle3|medusa|ngram|draft_model|suffix, \"model\": DIR, "
                        "\"num_speculative_tokens\": k} (suffix: vLLM's suffix_decoding_* keys, no model)")
    d.add_argument("--adaptive", action="store_true",
                   help="wrap the drafter in AdaptiveDrafter (each step's depth chosen for the load)")
    s = p.add_argument_group("the server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=32, help="rows decoded together (default 32)")
    s.add_argument("--max-queue", type=int, default=1024,
                   help="requests that may wait for a row; more get HTTP 429 (default 1024)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens limit (default: the target's max_position_embeddings)")
    s.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECDEC_API_KEY, else none)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight requests may take to finish before they are aborted")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_threads_argument(s)
    p.set_defaults(func=serve_cmd)
    return p


def apply_speculative_config(args: argparse.Namespace) -> None:
    """Sets the drafter flags from ``--speculative-config`` (vLLM's spelling); a ValueError names what is wrong."""
    try:
        cfg = json.loads(args.speculative_config)
    except ValueError as err:
        raise ValueError(f"--speculative-config is not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(cfg).__name__}")
    method = cfg.get("method")
    if method not in SPEC_METHODS:
        raise ValueError(f"--speculative-config: method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
    if "suffix_decoding_max_cached_requests" in cfg:
        raise ValueError("--speculative-config: suffix_decoding_max_cached_requests is not supported: the corpus' "
                         "budget counts tokens here (specdec serve --suffix --suffix-corpus-tokens N)")
    unknown = sorted(set(cfg) - {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
                                 "prompt_lookup_min", "draft_tensor_parallel_size", *SUFFIX_KEYS})
    if unknown:
        raise ValueError(f"--speculative-config: unsupported key(s) {', '.join(unknown)}")
    misplaced = sorted(set(cfg) & set(SUFFIX_KEYS)) if method != "suffix" else []
    if misplaced:
        raise ValueError(f"--speculative-config: {', '.join(misplaced)} belong(s) to method \"suffix\"")
    k = cfg.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    model = cfg.get("model")
    if method not in ("ngram", "suffix") and not isinstance(model, str):
        raise ValueError(f"--speculative-config: method {method!r} needs \"model\": the draft's directory")
    if any((args.ngram, args.suffix, args.draft_model, args.medusa, args.eagle)):
        raise ValueError("--speculative-config chooses the drafter: drop --ngram / --suffix / --draft-model / --medusa "
                         "/ --eagle")
    if method == "suffix":
        args.suffix = True
        for key, flag in SUFFIX_KEYS.items():
            if key in cfg:
                setattr(args, flag, cfg[key])  # (checked by SuffixDrafter, which names the setting)
    elif method == "ngram":
        args.ngram = True
        args.num_draft_tokens = k or args.num_draft_tokens
        args.max_ngram = cfg.get("prompt_lookup_max", args.max_ngram)
    elif method == "draft_model":
        args.draft_model, args.num_draft_tokens = model, k or args.num_draft_tokens
    elif method == "medusa":
        args.medusa = model  # (the heads' tree decides the depth: num_speculative_tokens caps nothing here)
    else:  # eagle / eagle3: vLLM drafts a chain of k tokens
        args.eagle = model
        if k is not None:
            args.eagle_depth, args.eagle_top_k, args.eagle_total_tokens = k, 1, k


def best_drafter(card: dict, names) -> str:
    """The drafter of ``names`` with the highest speedup on a family's card (``eagle2`` when the card says none)."""
    measured = (card.get("evaluation") or {}).get("drafters") or {}
    scored = [(v.get("speedup") or 0.0, name) for name, v in measured.items() if name in names and isinstance(v, dict)]
    return max(scored)[1] if scored else "eagle2"


def build_server(args: argparse.Namespace):
    """(engine, model name, tokenizer) for the flags; every check before a model loads where it can be."""
    import torch

    from specdec_ext.adaptive import AdaptiveDrafter
    from specdec_ext.engine import Engine

    if (args.model is None) == (args.zoo is None):
        raise ValueError("pass exactly one of --model DIR and --zoo")
    if args.speculative_config is not None:
        apply_speculative_config(args)
    check_one_drafter(args)
    for flag in ("max_batch", "max_queue", "port"):
        if getattr(args, flag) < (0 if flag in ("max_queue", "port") else 1):
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {0 if flag != 'max_batch' else 1}, got "
                             f"{getattr(args, flag)}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    chat_template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    if args.zoo is not None:
        from specdec_ext.zoo import DRAFTER_NAMES, load_family

        if any((args.ngram, args.draft_model, args.medusa, args.eagle)):
            raise ValueError("--zoo brings its drafters: choose one with --zoo-drafter, not --ngram/--eagle/... "
                             "(--suffix, --self-spec and --early-exit, drafters of the family's own target, go with "
                             "it)")
        own = next((flag for flag, given in (("--suffix", args.suffix), ("--self-spec", args.self_spec),
                                             ("--early-exit", args.early_exit)) if given), None)
        if own and args.zoo_drafter != "best":
            raise ValueError(f"{own} chooses the drafter: drop --zoo-drafter")
        if args.zoo_drafter not in ("best", "plain", *DRAFTER_NAMES):
            raise ValueError(f"--zoo-drafter must be best, plain or one of {', '.join(DRAFTER_NAMES)}, got "
                             f"{args.zoo_drafter!r}")
        if args.adaptive and args.zoo_drafter == "plain":
            raise ValueError("--adaptive wraps a drafter: --zoo-drafter plain has none")
        fam = load_family(args.zoo or None, device=args.device, dtype=args.dtype or "float32",
                          packed_linears=not args.no_packed_linears, eagle_dtype="auto")
        name = best_drafter(fam.card, fam.drafter_names) if args.zoo_drafter == "best" else args.zoo_drafter
        target, tokenizer = fam.target, fam.tokenizer
        if own:  # (drafters of the family's own target: no draft model of their own)
            drafter = drafter_from_args(args, target)
        else:
            quant = draft_quant(args)
            if quant is not None and name in ("plain", "ngram", "suffix"):
                raise ValueError(f"--draft-quant quantises a drafter's network; the zoo's {name!r} has none")
            drafter = None if name == "plain" else fam.make_drafter(name, **({"draft_quant": quant} if quant else {}))
        model_name = args.served_model_name or fam.card.get("name") or "specdec-zoo"
    else:
        from transformers import AutoTokenizer

        from specdec_ext.generate import load_model

        if not os.path.isdir(args.model):
            raise FileNotFoundError(f"--model {args.model!r} is not a local directory")
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        target = load_model(args.model, dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device)
        drafter = drafter_from_args(args, target)
        model_name = args.served_model_name or args.model
    if args.adaptive:
        if drafter is None:
            raise ValueError("--adaptive wraps a drafter: choose one (or --zoo-drafter other than plain)")
        drafter = AdaptiveDrafter(drafter)
    max_nodes = drafter.max_nodes if drafter is not None else 1
    max_len = None if args.max_model_len is None else args.max_model_len + max_nodes
    engine = Engine(target, drafter, max_batch=args.max_batch, max_len=max_len, tokenizer=tokenizer,
                    packed_linears=not args.no_packed_linears, caller="serve")
    return engine, model_name, chat_template


def serve_cmd(args: argparse.Namespace) -> int:
    import uvicorn

    from specdec_ext.serve.app import DrainingServer, create_app
    from specdec_ext.serve.engine_loop import EngineLoop
    from specdec_ext.serve.frozen_heap import freeze_startup_objects
    from specdec_ext.serve.metrics import ServerMetrics

    engine, model_name, chat_template = build_server(args)
    depth = engine.drafter.max_depth if engine.drafter is not None else 0
    loop = EngineLoop(engine, max_queue=args.max_queue, metrics=ServerMetrics(depth))
    app = create_app(loop, model_name, api_key=args.api_key, chat_template=chat_template)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = DrainingServer(config, loop)
    frozen = freeze_startup_objects()  # (else a full collection walks the loaded heap under load: frozen_heap.py)
    print(f"specdec serve: {model_name!r} on http://{args.host}:{args.port}/v1 (drafter: "
          f"{type(engine.drafter).__name__ if engine.drafter is not None else 'none'}, {args.max_batch} rows; "
          f"{frozen} start-up objects frozen out of the garbage collector)", file=sys.stderr, flush=True)
    server.run()
    return 0
