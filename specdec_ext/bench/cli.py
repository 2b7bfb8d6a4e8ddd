"""``specdec bench``: the benchmark suite from the command line.

    specdec bench [--suite e2e,batch,context,engine] [--quick] [--out DIR]      # the project's model family
    specdec bench --suite engine --concurrency 1,2,4,...,64 --rates 2,8,32      # the Engine under load
    specdec bench --suite serve [--concurrency 1,2,...,64]                     # the HTTP server under load
    specdec bench --model DIR [--draft-model DIR --medusa DIR --eagle DIR ...]  # your own local models
    specdec bench --tiny --quick                                                # tiny random models (CI)

Writes ``<out>/<name>_<machine>.json`` (machine, versions, models, every suite's results) and one PNG per suite
(``<name>_<machine>_<suite>.png``).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import sys
import time

import specdec_ext
from specdec_ext.devices import check_device
from specdec_ext.host_allocator import tune_host_allocator
from specdec_ext.threads import add_threads_argument, apply_threads

SUITES = ("e2e", "batch", "context", "engine", "serve")
DEFAULT_SUITES = ("e2e", "batch", "context", "engine")  # (serve needs the server's packages: asked for by name)

# (full, --quick)
PRESETS = {
    "num_prompts": (8, 2), "prompt_len": (128, 64), "max_new_tokens": (128, 32),
    "context_prompts": (4, 1), "context_new_tokens": (64, 32), "warmup_tokens": (16, 8),
    "concurrency": ((1, 2, 4, 8, 16), (1, 2)), "rates": ((2.0, 8.0, 32.0), (50.0,)), "requests": (16, 4),
    "engine_prompt_len": (64, 32), "engine_max_new_tokens": (48, 16), "engine_repeats": (5, 1),
    "serve_concurrency": ((1, 2, 4, 8, 16, 32, 64), (1, 2)), "serve_time_limit": (60.0, 30.0),
    "serve_repeats": (3, 1), "serve_per_client": (4, 2), "load_warmup_rounds": (1, 0),
}


class BenchError(Exception):
    """A user error: printed as ``specdec bench: <message>`` with exit status 2."""


def add_bench_command(sub) -> argparse.ArgumentParser:
    """Adds ``bench`` to an argparse sub-parser collection (``specdec``'s)."""
    p = sub.add_parser("bench", help="end-to-end benchmarks: plain vs drafters vs Hugging Face, batch and context "
                                     "sweeps (JSON + PNG)",
                       description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="\n".join(__doc__.splitlines()[2:]))
    add_bench_arguments(p)
    p.set_defaults(func=bench_cmd)
    return p


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (default: the project's model family, specdec_ext.zoo)")
    g.add_argument("--model", help="directory of a target model (save_pretrained layout)")
    g.add_argument("--draft-model", help="directory of a draft LM with the target's tokenizer (also the HF "
                                         "assisted-generation baseline)")
    g.add_argument("--medusa", help="directory of Medusa-1 heads for --model")
    g.add_argument("--eagle", help="directory of an EAGLE-1 (or EAGLE-3) draft for --model")
    g.add_argument("--eagle3", help="directory of an EAGLE-3 draft for --model")
    g.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    g.add_argument("--zoo", help="directory of a model family (default: $SPECDEC_ZOO or the shipped one)")
    g.add_argument("--tiny", action="store_true", help="tiny random models (exercise the suite; numbers mean nothing)")
    g.add_argument("--random-model", choices=["125m", "1b"],
                   help="a random-weight Llama of this size with random drafters: TIMING ONLY (step costs)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--no-packed-linears", action="store_true",
                   help="multiply with aten's products (default: the target and draft LM are prepared with "
                        "pack_linears, for ours and Hugging Face's methods alike)")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--eagle-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="dtype of the EAGLE drafts (default auto: bfloat16 for a float32 target where bfloat16 "
                        "products are fast, e.g. CPUs with AVX512-BF16; else the target's)")
    s = p.add_argument_group("what to run")
    s.add_argument("--suite", default=",".join(DEFAULT_SUITES),
                   help="comma-separated: e2e, batch, context, engine, serve (default: all but serve)")
    s.add_argument("--quick", action="store_true", help="small, fast settings (CI)")
    s.add_argument("--methods", help="comma-separated methods for e2e/context (default: all available), e.g. "
                                     "ngram,draft-model,eagle2,hf-assisted")
    s.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    s.add_argument("--hf-packed-linears", action="store_true",
                   help="run the Hugging Face baselines on our packed products too (a comparison of decoding "
                        "algorithms; default: Hugging Face as its users run it, on aten's products)")
    s.add_argument("--temperatures", default="0,1", help="e2e temperatures (default 0,1)")
    s.add_argument("--num-prompts", type=int, help="e2e prompts (default 8, quick 2)")
    s.add_argument("--prompt-len", type=int, help="e2e prompt length in tokens (default 128, quick 64)")
    s.add_argument("--max-new-tokens", type=int, help="e2e tokens per generation (default 128, quick 32)")
    s.add_argument("--context-lengths", help="context sweep prompt lengths (default 128,256,...,4096; quick 128,512)")
    s.add_argument("--context-prompts", type=int,
                   help="context sweep prompts per length (default 4, quick 1; as many as the held-out text holds)")
    s.add_argument("--context-new-tokens", type=int, help="context sweep tokens per generation (default 64, quick 32)")
    s.add_argument("--prompts-file", help="text file or directory to cut prompts from (default: the zoo's held-out "
                                          "Python files)")
    s.add_argument("--num-draft-tokens", type=int, default=4, help="--model: n-gram / draft-model chain length")
    s.add_argument("--self-spec", metavar="FILE", help="e2e: add the method self-spec (a specdec tune-self-spec file)")
    s.add_argument("--early-exit", metavar="DIR",
                   help="e2e: add the method early-exit (a specdec train-self-spec adapter directory)")
    s.add_argument("--seed", type=int, default=0)
    add_threads_argument(s)
    e = p.add_argument_group("engine suite (requests arriving at an Engine: closed and open loops)")
    e.add_argument("--concurrency", help="closed loop: concurrent clients, comma-separated (default 1,2,4,8,16; "
                                         "quick 1,2; up to 64 and beyond as the machine allows)")
    e.add_argument("--rates", help="open loop: Poisson arrival rates in requests/s (default 2,8,32; quick 50)")
    e.add_argument("--requests", type=int, help="requests per load point (default 16, quick 4; a closed loop sends "
                                                "at least 2 per client)")
    e.add_argument("--engine-prompt-len", type=int, help="longest prompt in tokens; each request takes half to all "
                                                         "of it (default 64, quick 32)")
    e.add_argument("--engine-max-new-tokens", type=int, help="largest budget; each request draws a quarter to all "
                                                             "of it (default 48, quick 16)")
    e.add_argument("--max-batch", type=int, default=16, help="open loop: the engine's rows (default 16)")
    e.add_argument("--engine-methods", help="comma-separated: plain, drafter names, adaptive (default: all)")
    e.add_argument("--adaptive-inner", default="best", help="the adaptive drafter's inner drafter (default best: "
                                                            "the fastest fixed drafter at one client, timed first)")
    e.add_argument("--sampled", action="store_true", help="sample at temperature 1 (default greedy)")
    e.add_argument("--repeats", type=int, help="rounds per load, in rotated method order; each method reports its "
                                               "median round; the goal is judged on paired rounds (default 5, quick "
                                               "1; the serve suite 3, quick 1)")
    e.add_argument("--warmup-rounds", type=int, help="unmeasured rounds of every method at the start of each load, "
                                                     "engine and serve suites (default 1, quick 0)")
    v = p.add_argument_group("serve suite (specdec serve on loopback, streaming clients; --concurrency, --requests, "
                             "--engine-prompt-len and --engine-max-new-tokens apply; default concurrency 1,2,...,64)")
    v.add_argument("--serve-per-client", type=int,
                   help="requests per client at least, per point (default 4, quick 2): with two, a point at 64 clients "
                        "was all ramp and drain")
    v.add_argument("--serve-drafter", default="best",
                   help="the fixed drafter, also inside adaptive (default best: the fastest on the family's card)")
    v.add_argument("--serve-time-limit", type=float,
                   help="seconds per load point after which no new request starts (default 60, quick 30)")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="output directory (default: benchmarks/results when run from the repository, "
                                 "else ./specdec_bench_results)")
    o.add_argument("--name", default="bench", help="file name prefix (default: bench)")
    o.add_argument("--no-plots", action="store_true", help="JSON only")
    o.add_argument("--note", help="a note recorded in the JSON (e.g. what else ran on the machine)")


def _csv(text: str, what: str, conv=str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise BenchError(f"{what} is empty")
    try:
        return [conv(t) for t in items]
    except ValueError:
        raise BenchError(f"{what} must be a comma-separated list of {conv.__name__}s, got {text!r}") from None


def check_args(args: argparse.Namespace) -> dict:
    """Validates the arguments before anything is loaded; returns the resolved settings. Raises BenchError."""
    suites = _csv(args.suite, "--suite")
    bad = [s for s in suites if s not in SUITES]
    if bad:
        raise BenchError(f"unknown suite(s) {bad} in --suite (choose from {', '.join(SUITES)})")
    user = [f for f in ("draft_model", "medusa", "eagle", "eagle3", "tokenizer") if getattr(args, f)]
    if user and not args.model:
        raise BenchError(f"--{user[0].replace('_', '-')} needs --model (the target it drafts for)")
    if args.tiny and args.random_model:
        raise BenchError("--tiny and --random-model are two different model sets: pass one")
    if (args.tiny or args.random_model) and (args.model or args.zoo):
        raise BenchError(f"--{'tiny' if args.tiny else 'random-model'} cannot be combined with --model or --zoo")
    if args.model and args.zoo:
        raise BenchError("pass either --model (your models) or --zoo (a model family), not both")
    for flag in ("model", "draft_model", "medusa", "eagle", "eagle3", "tokenizer", "zoo"):
        path = getattr(args, flag)
        if path is not None and not os.path.isdir(path):
            raise BenchError(f"--{flag.replace('_', '-')} {path!r} is not a directory")
    if args.prompts_file and not os.path.exists(args.prompts_file):
        raise BenchError(f"--prompts-file {args.prompts_file!r} does not exist")
    temps = _csv(args.temperatures, "--temperatures", float)
    if any(t < 0 for t in temps):
        raise BenchError(f"--temperatures must be >= 0, got {temps}")
    q = 1 if args.quick else 0
    st = {k: v[q] for k, v in PRESETS.items()}
    for flag, key in (("num_prompts", "num_prompts"), ("prompt_len", "prompt_len"),
                      ("max_new_tokens", "max_new_tokens"), ("context_prompts", "context_prompts"),
                      ("context_new_tokens", "context_new_tokens")):
        val = getattr(args, flag)
        if val is not None:
            if val < 1:
                raise BenchError(f"--{flag.replace('_', '-')} must be >= 1, got {val}")
            st[key] = val
    if args.num_draft_tokens < 1:
        raise BenchError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    from specdec_ext.bench.context_sweep import DEFAULT_LENGTHS, QUICK_LENGTHS

    lengths = _csv(args.context_lengths, "--context-lengths", int) if args.context_lengths else \
        list(QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    if any(n < 2 for n in lengths):
        raise BenchError(f"--context-lengths must be >= 2 tokens, got {lengths}")
    methods = _csv(args.methods, "--methods") if args.methods else None
    if args.device is not None:
        try:
            check_device(args.device, "--device")
        except ValueError as err:
            raise BenchError(str(err)) from None
    st.update(suites=suites, temperatures=temps, context_lengths=lengths, methods=methods,
              engine=_engine_config(args, st))
    st["serve"] = _serve_config(args, st) if "serve" in suites else None
    return st


def _serve_config(args: argparse.Namespace, st: dict):
    """The serve suite's :class:`ServeLoadConfig` (the engine suite's request shape; its own concurrency preset)."""
    try:
        from specdec_ext.bench.serve_load import ServeLoadConfig
    except ImportError as err:
        raise BenchError(f"--suite serve needs the server's packages ({err}): pip install specdec_ext[serve]") \
            from None
    e = st["engine"]
    conc = tuple(e.concurrency) if args.concurrency else tuple(st["serve_concurrency"])
    limit = args.serve_time_limit if args.serve_time_limit is not None else st["serve_time_limit"]
    if not limit > 0:
        raise BenchError(f"--serve-time-limit must be > 0 seconds, got {limit}")
    repeats = args.repeats if args.repeats is not None else st["serve_repeats"]  # (>= 1: checked with the engine's)
    per_client = args.serve_per_client if args.serve_per_client is not None else st["serve_per_client"]
    if per_client < 1:
        raise BenchError(f"--serve-per-client must be >= 1 request, got {per_client}")
    return ServeLoadConfig(concurrency=conc, requests=e.requests, prompt_len=e.prompt_len,
                           max_new_tokens=e.max_new_tokens, time_limit_s=limit, drafter=args.serve_drafter,
                           repeats=repeats, warmup_rounds=e.warmup_rounds, per_client=per_client, seed=args.seed)


def _engine_config(args: argparse.Namespace, st: dict):
    """The engine suite's :class:`EngineLoadConfig` from the flags (presets where a flag is not given)."""
    from specdec_ext.bench.engine_load import EngineLoadConfig

    conc = _csv(args.concurrency, "--concurrency", int) if args.concurrency else list(st["concurrency"])
    rates = _csv(args.rates, "--rates", float) if args.rates else list(st["rates"])
    if any(c < 1 for c in conc):
        raise BenchError(f"--concurrency must be >= 1 clients, got {conc}")
    if any(not r > 0 for r in rates):
        raise BenchError(f"--rates must be > 0 requests/s, got {rates}")
    sizes = {}
    for flag, key in (("requests", "requests"), ("engine_prompt_len", "engine_prompt_len"),
                      ("engine_max_new_tokens", "engine_max_new_tokens"), ("max_batch", None),
                      ("repeats", "engine_repeats")):
        val = getattr(args, flag)
        if val is not None and val < 1:
            raise BenchError(f"--{flag.replace('_', '-')} must be >= 1, got {val}")
        sizes[flag] = val if val is not None else st[key]
    warmup = args.warmup_rounds if args.warmup_rounds is not None else st["load_warmup_rounds"]
    if warmup < 0:
        raise BenchError(f"--warmup-rounds must be >= 0, got {warmup}")
    methods = tuple(_csv(args.engine_methods, "--engine-methods")) if args.engine_methods else None
    return EngineLoadConfig(concurrency=tuple(conc), rates=tuple(rates), requests=sizes["requests"],
                            prompt_len=sizes["engine_prompt_len"], max_new_tokens=sizes["engine_max_new_tokens"],
                            max_batch=sizes["max_batch"], temperature=1.0 if args.sampled else 0.0, methods=methods,
                            adaptive_inner=args.adaptive_inner, seed=args.seed, repeats=sizes["repeats"],
                            warmup_rounds=warmup)


def default_out_dir() -> str:
    return os.path.join("benchmarks", "results") if os.path.isdir(os.path.join("benchmarks", "results")) \
        else "specdec_bench_results"


def load_models(args, device: str, dtype):
    from specdec_ext.bench import models as M

    if args.tiny:
        return M.tiny_random(seed=args.seed, device=device, num_draft_tokens=args.num_draft_tokens)
    if args.random_model:
        return M.random_llama(args.random_model, device=device, dtype=dtype, seed=args.seed,
                              num_draft_tokens=args.num_draft_tokens, packed_linears=not args.no_packed_linears)
    if args.model:
        return M.from_dirs(args.model, draft_model=args.draft_model, medusa=args.medusa, eagle=args.eagle,
                           eagle3=args.eagle3, tokenizer=args.tokenizer, device=device, dtype=dtype,
                           num_draft_tokens=args.num_draft_tokens, prompts_file=args.prompts_file,
                           packed_linears=not args.no_packed_linears, eagle_dtype=args.eagle_dtype)
    try:
        return M.from_zoo(args.zoo, device=device, dtype=dtype or "float32", prompts_file=args.prompts_file,
                          packed_linears=not args.no_packed_linears, eagle_dtype=args.eagle_dtype)
    except RuntimeError as err:
        raise BenchError(f"{err}. Point --model (and --draft-model, --medusa, --eagle) at local models, or "
                         "use --tiny to try the suite on tiny random models") from None


def call_batch_sweep(fn, models, quick: bool, seed: int, log) -> dict:
    """Calls ``run_batch_sweep`` with the arguments its signature asks for (by name) out of what the bench knows."""
    known = {"models": models, "family": models, "bench_models": models, "target": models.target,
             "draft_lm": models.draft_lm, "tokenizer": models.tokenizer, "make_drafter": models.make_drafter,
             "drafter_names": models.drafter_names, "quick": quick, "device": models.device, "seed": seed,
             "log": log}
    kwargs, args = {}, []
    params = list(inspect.signature(fn).parameters.values())
    for i, prm in enumerate(params):
        if prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
            continue
        if prm.name in known:
            kwargs[prm.name] = known[prm.name]
        elif prm.default is prm.empty:
            if i == 0:
                args.append(models)
            else:
                raise RuntimeError(f"run_batch_sweep needs an argument {prm.name!r} that specdec bench does not have")
    result = fn(*args, **kwargs)
    if not isinstance(result, dict):
        result = {"rows": result}
    return result


def run(args: argparse.Namespace, log=print) -> tuple[dict, list[str]]:
    """Runs the requested suites; returns the results dict and the files written."""
    st = check_args(args)
    import torch

    from specdec_ext.bench import BatchSweepUnavailable, load_batch_sweep
    from specdec_ext.bench.context_sweep import run_context_sweep
    from specdec_ext.bench.e2e import E2EConfig, run_e2e
    from specdec_ext.bench.machine import machine_info, machine_tag

    batch_fn = None
    if "batch" in st["suites"]:
        try:
            batch_fn = load_batch_sweep()
        except BatchSweepUnavailable as err:
            if st["suites"] == ["batch"]:
                raise BenchError(f"--suite batch: {err}") from None
            log(f"specdec bench: skipping the batch sweep: {err}")
            batch_fn = err
    apply_threads(args)  # (also when run() is called without specdec's main)
    tune_host_allocator()
    device = args.device or ("cuda" if torch.cuda.is_available() and specdec_ext.built_with_cuda() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else None)
    try:
        models = load_models(args, device, dtype)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise BenchError(str(err)) from None
    machine = machine_info()
    results = {"tool": "specdec bench", "format": 1,
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(sys.argv), "quick": bool(args.quick), "machine": machine,
               "models": models.describe(), "suites": st["suites"], **({"note": args.note} if args.note else {})}
    t0 = time.perf_counter()
    if "e2e" in st["suites"]:
        cfg = E2EConfig(num_prompts=st["num_prompts"], prompt_len=st["prompt_len"],
                        max_new_tokens=st["max_new_tokens"], temperatures=tuple(st["temperatures"]),
                        methods=st["methods"], hf=not args.no_hf, warmup_tokens=st["warmup_tokens"], seed=args.seed,
                        num_draft_tokens=args.num_draft_tokens, hf_packed_linears=args.hf_packed_linears,
                        self_spec=args.self_spec, early_exit=args.early_exit)
        try:
            results["e2e"] = run_e2e(models, cfg, log=log)
        except ValueError as err:
            raise BenchError(f"e2e: {err}") from None
    if "batch" in st["suites"]:
        if isinstance(batch_fn, Exception):
            results["batch"] = {"skipped": str(batch_fn)}
        else:
            log("batch sweep")
            results["batch"] = call_batch_sweep(batch_fn, models, args.quick, args.seed, log)
    if "context" in st["suites"]:
        ctx_methods = [m for m in (st["methods"] or models.drafter_names) if m in models.drafter_names]
        try:
            results["context"] = run_context_sweep(models, st["context_lengths"], ctx_methods or None,
                                                   num_prompts=st["context_prompts"],
                                                   max_new_tokens=st["context_new_tokens"], seed=args.seed,
                                                   warmup_tokens=st["warmup_tokens"], log=log)
        except ValueError as err:
            raise BenchError(f"context sweep: {err}") from None
    if "engine" in st["suites"]:
        from specdec_ext.bench.engine_load import run_engine_load

        results["engine"] = _under_load("engine", run_engine_load, models, st["engine"], log)
    if "serve" in st["suites"]:
        from specdec_ext.bench.serve_load import run_serve_load

        results["serve"] = _under_load("serve", run_serve_load, models, st["serve"], log)
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    out_dir = args.out or default_out_dir()
    os.makedirs(out_dir, exist_ok=True)
    stem = f"{args.name}_{machine_tag(machine)}"
    path = os.path.join(out_dir, stem + ".json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    written = [path]
    if not args.no_plots:
        try:
            from specdec_ext.bench.plots import plot_all

            written += plot_all(results, out_dir, stem)
            if results.get("serve"):
                from specdec_ext.bench.serve_load import plot_serve

                written.append(plot_serve(results["serve"], os.path.join(out_dir, f"{stem}_serve.png")))
        except ImportError as err:
            log(f"specdec bench: no plots ({err}; pip install matplotlib)")
    if results.get("e2e"):
        from specdec_ext.bench.e2e import markdown_table

        log("\n" + markdown_table(results["e2e"]))
    if results.get("context"):
        from specdec_ext.bench.context_sweep import markdown_table as context_table

        log("\n" + context_table(results["context"]) + "\n")
    if results.get("engine"):
        from specdec_ext.bench.engine_load import format_table as engine_table

        log("\n" + engine_table(results["engine"]) + "\n")
    if results.get("serve"):
        from specdec_ext.bench.serve_load import format_table as serve_table

        log("\n" + serve_table(results["serve"]) + "\n")
    for p in written:
        log(f"wrote {p}")
    return results, written


def _under_load(suite: str, run_suite, models, cfg, log) -> dict:
    """A load suite (engine, serve): its ValueErrors are the user's (a BenchError naming the suite)."""
    log(f"{suite} under load")
    try:
        return run_suite(models, cfg, log=log)
    except ValueError as err:
        raise BenchError(f"{suite}: {err}") from None


def bench_cmd(args: argparse.Namespace) -> int:
    try:
        run(args)
    except BenchError as err:
        print(f"specdec bench: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    add_bench_arguments(p)
    return bench_cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
