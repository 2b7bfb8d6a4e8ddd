"""End-to-end decoding benchmark: plain decoding vs each drafter vs Hugging Face's assisted generation and prompt
lookup, on the same target, the same prompts and the same token budget, greedy and at temperature 1.

Protocol
    * Every method is warmed up once (the first prompt, a short budget; not timed), then runs once more untimed
      for its peak memory (below).
    * Timed runs go round-robin: for each prompt, every method in turn, so that slow drifts of a shared machine hit
      all methods alike; ``speedup`` is tokens/s over our plain decoding's tokens/s measured in the same run.
    * EOS is ignored (every run emits exactly ``max_new_tokens`` tokens: steady-state decoding, equal work).
    * Batch size 1 (Hugging Face's assisted generation supports nothing else).
    * Wall time of each whole call (prefill included), with a device synchronisation on CUDA.

Reported per method and temperature
    ``tokens_per_s``, ``speedup`` (vs our plain decoding, same run), ``speedup_vs_hf_plain``,
    ``mean_accepted_length`` (tokens emitted per target forward; for Hugging Face methods counted with a forward hook
    on the target), ``acceptance_by_depth`` ([d-1] = fraction of steps accepting at least d drafts; ours only),
    ``step_ms`` (mean decode-loop time per step, ours: (draft + verify + bookkeeping) / steps, prefill excluded),
    ``draft_share`` (the drafter's part of that loop time, ours),
    ``predicted_speedup`` and peak memory (below).

Predicted speedup (ours)
    predicted = mean_accepted_length * step_ms(plain) / step_ms(method)

    i.e. tokens per step times how much cheaper a plain step is than a speculative one, both per-step latencies
    measured in this run. It is what the measured acceptance buys given the measured step costs; the measured
    speedup differs from it by what happens outside the decode loop (prefill, drafter set-up) — on long prompts
    and short budgets that gap grows. ``ideal_speedup`` = mean_accepted_length (drafting and verifying for free).

Verification-bound speedup (ours)
    bound = wall(plain) / (wall(method) - draft time - bookkeeping time), per token

    the speedup the method would reach if drafting and host bookkeeping cost nothing: only the prefill and the
    target's verification forwards (with their verification op and cache compaction) remain, as measured. No
    drafter with this acceptance and this tree size can beat it on this machine; how far the measured speedup falls
    short of it is what drafting costs.

Peak memory
    Measured in one extra, untimed run per method (the first prompt, the full budget, after the warm-up), so that
    no measurement runs during the timed runs. CUDA: ``torch.cuda.max_memory_allocated()`` (reset before the run),
    and the same minus the memory allocated when the run started (weights and anything resident): ``peak_mem_mb`` /
    ``peak_mem_over_start_mb``. CPU: the process's resident set size (RSS, /proc/self/statm) sampled every 2 ms by a
    background thread: peak RSS and peak RSS minus the RSS at the run's start. RSS counts everything the process
    holds (allocator caches included, freed memory not returned to the OS: a method can reuse memory an earlier
    one left behind), so on CPU "over start" is a lower bound of what the method needs and differences of a few MB
    are noise.

Greedy correctness
    At temperature 0 every method's output must equal our plain greedy output; the Hugging Face outputs are also
    compared with their counterparts (assisted generation vs our draft-model drafter, prompt lookup vs our n-gram
    drafter). Each comparison is recorded (``greedy_checks``: equal, and the first differing position per prompt).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from specdec_ext.bench.models import BenchModels
from specdec_ext.drafters import DraftModelDrafter, EagleDrafter, EarlyExitDrafter, MedusaDrafter, SelfSpecDrafter
from specdec_ext.engine.stats import reached_fractions
from specdec_ext.models.fast_linear import PackableLinear, packed_linears
from specdec_ext.models.quantized import module_bytes

__all__ = ["E2EConfig", "compare_outputs", "run_e2e", "measure", "MemoryMeter", "HF_METHODS", "SELF_SPEC",
           "with_self_spec"]

HF_METHODS = ("hf-plain", "hf-assisted", "hf-prompt-lookup")
HF_COUNTERPART = {"hf-plain": "plain", "hf-assisted": "draft-model", "hf-prompt-lookup": "ngram"}


@dataclass
class E2EConfig:
    num_prompts: int = 8
    prompt_len: int = 128
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    methods: list[str] | None = None  # ours (besides plain) and HF ones; None: all available
    hf: bool = True
    warmup_tokens: int = 16
    seed: int = 0
    num_draft_tokens: int = 4  # HF assisted / prompt lookup when our drafter does not say
    # Hugging Face's methods multiply with the packed weights too (inside fast_linear.packed_linears): a comparison
    # of decoding algorithms on the same products. False (default): Hugging Face as its users run it (aten).
    hf_packed_linears: bool = False
    # a `specdec tune-self-spec` file: adds the method "self-spec" (the target drafting for itself, those layers
    # skipped; with_self_spec)
    self_spec: str | None = None
    # a `specdec train-self-spec` directory: adds the method "early-exit" (the target's first layers and that
    # adapter draft; with_early_exit)
    early_exit: str | None = None


# ---- memory ------------------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # high-water mark (never decreases)


class MemoryMeter:
    """Peak memory of one run: CUDA allocator statistics on a GPU, sampled RSS on CPU (see the module doc)."""

    def __init__(self, device: torch.device, interval_s: float = 0.002):
        self.cuda = device.type == "cuda"
        self.kind = "cuda max_memory_allocated" if self.cuda else "process RSS sampled every 2 ms"
        self.interval = interval_s
        self._peak = 0
        self._stop = threading.Event()
        self._thread = None

    def _loop(self):
        while not self._stop.wait(self.interval):
            r = _rss_bytes()
            if r > self._peak:
                self._peak = r

    @contextlib.contextmanager
    def measure(self, out: dict):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        else:
            start = self._peak = _rss_bytes()
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
            else:
                self._stop.set()
                self._thread.join()
                peak = max(self._peak, _rss_bytes())
            out["peak"], out["start"] = peak, start


# ---- output comparison --------------------------------------------------------------------------------------------
def compare_outputs(a: list[list[int]], b: list[list[int]], name_a: str = "a", name_b: str = "b",
                    max_mismatches: int = 5) -> dict:
    """Token-by-token comparison of two methods' continuations (one list per prompt). ``equal`` only when every
    prompt's continuation is identical (same length too); ``mismatches`` lists, per differing prompt, the first
    differing position and both tokens there (None past the end of the shorter one)."""
    if len(a) != len(b):
        return {"a": name_a, "b": name_b, "equal": False, "prompts_compared": min(len(a), len(b)),
                "mismatches": [{"prompt": None, "reason": f"{len(a)} outputs vs {len(b)}"}]}
    mismatches = []
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = list(map(int, x)), list(map(int, y))
        if x == y:
            continue
        pos = next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y)))
        mismatches.append({"prompt": i, "position": pos, name_a: x[pos] if pos < len(x) else None,
                           name_b: y[pos] if pos < len(y) else None, "lengths": [len(x), len(y)]})
    return {"a": name_a, "b": name_b, "equal": not mismatches, "prompts_compared": len(a),
            "mismatches": mismatches[:max_mismatches], "num_mismatching_prompts": len(mismatches)}


# ---- running one method -------------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _hf_mode(*models):
    """Hugging Face's own attention (SDPA) and no EOS for the duration of a Hugging Face generate call."""
    saved = []
    for m in models:
        if m is None:
            continue
        gc = getattr(m, "generation_config", None)
        saved.append((m, m.config._attn_implementation, gc, getattr(gc, "eos_token_id", None)))
        m.set_attn_implementation("sdpa")
        if gc is not None:
            gc.eos_token_id = None
    try:
        yield
    finally:
        for m, attn, gc, eos in saved:
            m.set_attn_implementation(attn)
            if gc is not None:
                gc.eos_token_id = eos


class _CountForwards:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1

    def close(self):
        self.handle.remove()


@dataclass
class _Acc:
    """Totals of one method at one temperature over the timed runs."""

    new_tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    row_steps: int = 0
    loop_s: float = 0.0
    unverified_s: float = 0.0  # draft + bookkeeping time of the decode loop (ours)
    draft_s: float = 0.0  # the drafter's time in the decode loop (ours)
    forwards: int = 0
    accept_hist: list[int] = field(default_factory=list)
    peak: int = 0
    peak_over_start: int = 0
    weight_bytes: int | None = None  # the drafter's own weights (its network; the target's shared layers excluded)
    outputs: list[list[int]] = field(default_factory=list)
    runs: int = 0
    error: str | None = None


def hf_settings(models: BenchModels, drafters: dict, cfg: E2EConfig) -> dict:
    """The Hugging Face knobs, matched to our drafters: assisted generation drafts as many tokens as our draft-model
    chain (constant schedule; Hugging Face's confidence threshold left at its default), prompt lookup as many as our
    n-gram drafter with the same longest n-gram."""
    dm, ng = drafters.get("draft-model"), drafters.get("ngram")
    k_dm = int(getattr(dm, "k", 0) or cfg.num_draft_tokens)
    k_ng = int(getattr(ng, "num_pred_tokens", 0) or cfg.num_draft_tokens)
    n_ng = int(getattr(ng, "max_ngram_size", 0) or 3)
    from transformers import GenerationConfig

    threshold = getattr(GenerationConfig(), "assistant_confidence_threshold", None)
    return {"assisted": {"num_assistant_tokens": k_dm, "num_assistant_tokens_schedule": "constant",
                         "assistant_confidence_threshold": threshold},
            "prompt_lookup": {"prompt_lookup_num_tokens": k_ng, "max_matching_ngram_size": n_ng},
            "attention": "sdpa", "top_k": 0, "top_p": 1.0,
            "packed_linears": bool(cfg.hf_packed_linears)
            and any(isinstance(m, PackableLinear) for m in models.target.modules())}


def _run_ours(models: BenchModels, drafter, prompt, temperature, max_new_tokens, seed):
    from specdec_ext.generate import generate

    dev = models.device
    _sync(dev)
    t0 = time.perf_counter()
    # (packed products exactly where the loader prepared the target: --no-packed-linears keeps aten's)
    packed = any(isinstance(m, PackableLinear) for m in models.target.modules())
    tokens, stats = generate(models.target, drafter, torch.tensor(prompt, dtype=torch.int64),
                             max_new_tokens=max_new_tokens, eos_token_id=[], temperature=temperature, seed=seed,
                             packed_linears=packed)
    _sync(dev)
    wall = time.perf_counter() - t0
    return tokens.tolist()[len(prompt):], wall, stats


def _run_hf(models: BenchModels, method, prompt, temperature, max_new_tokens, seed, settings):
    target, dev = models.target, models.device
    ids = torch.tensor([prompt], dtype=torch.int64, device=dev)
    kw = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids), pad_token_id=0)
    if temperature > 0:
        kw.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        kw.update(do_sample=False)
    assistant = None
    if method == "hf-assisted":
        assistant = models.draft_lm
        s = settings["assisted"]
        gc = assistant.generation_config
        gc.num_assistant_tokens = s["num_assistant_tokens"]
        gc.num_assistant_tokens_schedule = s["num_assistant_tokens_schedule"]
        kw["assistant_model"] = assistant
    elif method == "hf-prompt-lookup":
        kw.update(settings["prompt_lookup"])
    counter = _CountForwards(target)
    try:
        # hf_packed_linears: inside the packed-linears block, as our generate() (the same products in both
        # libraries); else outside it, where a model prepared with pack_linears is exactly nn.Linear (aten)
        with _hf_mode(target, assistant), torch.no_grad(), packed_linears(settings["packed_linears"]):
            _sync(dev)
            t0 = time.perf_counter()
            out = target.generate(ids, **kw)
            _sync(dev)
            wall = time.perf_counter() - t0
    finally:
        counter.close()
    return out[0, len(prompt):].tolist(), wall, counter.calls


def prompts_and_warmup(models: BenchModels, n: int, length: int, seed: int) -> tuple[list[list[int]], list[int], str]:
    """``n`` measured prompts, one more held-out prompt for :func:`measure`'s warm-up and memory runs, and the note
    on how they were made."""
    prompts, how = models.prompts(n + 1, length, seed)
    return prompts[:-1], prompts[-1], how + " (the last one for the warm-up and memory runs only)"


def measure(models: BenchModels, methods: list[str], prompts: list[list[int]], temperature: float,
            max_new_tokens: int, *, warmup_tokens: int = 16, seed: int = 0, log=print,
            hf_cfg: E2EConfig | None = None, memory: bool = True,
            warmup_prompt: list[int] | None = None) -> tuple[dict[str, _Acc], dict]:
    """Runs every method on every prompt (round-robin after one warm-up each) and returns per-method totals and
    the Hugging Face settings used. ``methods``: "plain", our drafter names and :data:`HF_METHODS`. ``memory``:
    measure peak memory (one extra untimed run per method). ``warmup_prompt``: the prompt of the warm-up and memory
    runs (default the first prompt); pass one outside ``prompts`` where a drafter drafts from earlier requests'
    outputs (suffix decoding), which would otherwise replay its own output of that prompt in the timed run."""
    warm = prompts[0] if warmup_prompt is None else warmup_prompt
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "generation_config together with generation arguments" warnings
    drafters, accs = {}, {m: _Acc() for m in methods}
    for m in methods:
        if m != "plain" and m not in HF_METHODS:
            try:
                drafters[m] = models.build_drafter(m)
            except Exception as err:  # noqa: BLE001  (record and go on with the other methods)
                accs[m].error = f"{type(err).__name__}: {err}"
                log(f"  {m}: could not be built: {accs[m].error}")
    settings = hf_settings(models, drafters, hf_cfg or E2EConfig())
    meter = MemoryMeter(models.device)

    def one(m, prompt, budget, s):
        if m == "plain":
            return _run_ours(models, None, prompt, temperature, budget, s)
        if m in HF_METHODS:
            return _run_hf(models, m, prompt, temperature, budget, s, settings)
        return _run_ours(models, drafters[m], prompt, temperature, budget, s)

    for m in methods:  # warm-up
        if accs[m].error is None:
            try:
                one(m, warm, min(warmup_tokens, max_new_tokens), seed)
            except Exception as err:  # noqa: BLE001
                accs[m].error = f"{type(err).__name__}: {err}"
                log(f"  {m}: failed in warm-up: {accs[m].error}")
    for m, d in drafters.items():  # (after the warm-up: EAGLE-1 builds its draft-vocabulary rows at its first run)
        accs[m].weight_bytes = drafter_weight_bytes(d)
    for m in methods:  # memory: one untimed run per method on the warm-up prompt (no sampler during timed runs)
        if memory and accs[m].error is None:
            mem: dict = {}
            try:
                with meter.measure(mem):
                    one(m, warm, max_new_tokens, seed)
            except Exception as err:  # noqa: BLE001
                accs[m].error = f"{type(err).__name__}: {err}"
                log(f"  {m}: failed: {accs[m].error}")
                continue
            accs[m].peak, accs[m].peak_over_start = mem["peak"], mem["peak"] - mem["start"]
    for i, prompt in enumerate(prompts):
        for m in methods:
            acc = accs[m]
            if acc.error is not None:
                continue
            try:
                out, wall, extra = one(m, prompt, max_new_tokens, seed + i)
            except Exception as err:  # noqa: BLE001
                acc.error = f"{type(err).__name__}: {err}"
                log(f"  {m}: failed on prompt {i}: {acc.error}")
                continue
            acc.runs += 1
            acc.outputs.append(out)
            acc.new_tokens += len(out)
            acc.wall_s += wall
            if m in HF_METHODS:
                acc.forwards += extra
            else:
                st = extra
                acc.steps += st.steps
                acc.row_steps += st.row_steps
                acc.forwards += st.target_forwards
                acc.loop_s += st.draft_s + st.verify_s + st.bookkeeping_s
                acc.unverified_s += st.draft_s + st.bookkeeping_s
                acc.draft_s += st.draft_s
                h = list(st.accept_hist)
                if len(h) > len(acc.accept_hist):
                    acc.accept_hist += [0] * (len(h) - len(acc.accept_hist))
                for d, c in enumerate(h):
                    acc.accept_hist[d] += c
    settings["memory"] = meter.kind
    return accs, settings


def drafter_weight_bytes(drafter) -> int | None:
    """Bytes of a drafter's own weights: the draft model, the EAGLE draft (with its draft-vocabulary rows of the
    target's lm_head, a copy it holds) or the Medusa heads; 0 for self-speculation (the target's own layers), the
    adapter's for early exit; None for drafters without a network."""
    if isinstance(drafter, DraftModelDrafter):
        return module_bytes(drafter.model)
    if isinstance(drafter, EagleDrafter):
        head = drafter.vocab_head
        return module_bytes(drafter.model) + (module_bytes(head) if head is not None else 0)
    if isinstance(drafter, MedusaDrafter):
        return module_bytes(drafter.heads)
    if isinstance(drafter, SelfSpecDrafter):
        return 0  # (its network is the target's own layers)
    if isinstance(drafter, EarlyExitDrafter):  # (and the target's own first layers and head)
        head = drafter.vocab_head
        return module_bytes(drafter.adapter) + (module_bytes(head) if head is not None else 0)
    return None


def acceptance_by_depth(hist: list[int]) -> list[float]:
    """:func:`~specdec_ext.engine.stats.reached_fractions`, rounded, without the depths no step reached."""
    out = [round(f, 4) for f in reached_fractions(hist)]
    while out and out[-1] == 0.0:
        out.pop()
    return out


def summarise(accs: dict[str, _Acc], temperature: float) -> list[dict]:
    """One row per method: tokens/s, speedups, acceptance, predicted speedup, memory (see the module doc)."""
    rows = []
    plain, hf_plain = accs.get("plain"), accs.get("hf-plain")

    def tps(a):
        return a.new_tokens / a.wall_s if a is not None and a.error is None and a.wall_s > 0 else None

    def step_ms(a):
        return 1e3 * a.loop_s / a.steps if a is not None and a.steps else None

    base, hf_base, plain_step = tps(plain), tps(hf_plain), step_ms(plain)
    mb = 1 / 2**20
    for m, a in accs.items():
        hf = m in HF_METHODS
        row = {"method": m, "impl": "hf" if hf else "specdec", "temperature": temperature, "runs": a.runs}
        if a.error is not None and a.runs == 0:
            row["error"] = a.error
            rows.append(row)
            continue
        t = tps(a)
        row.update(new_tokens=a.new_tokens, time_s=round(a.wall_s, 4), tokens_per_s=round(t, 2) if t else None,
                   speedup=round(t / base, 3) if t and base else None,
                   speedup_vs_hf_plain=round(t / hf_base, 3) if t and hf_base else None,
                   target_forwards=a.forwards)
        if hf:
            row["mean_accepted_length"] = round(a.new_tokens / a.forwards, 3) if a.forwards else None
            row["acceptance_by_depth"] = None
        else:
            mal = a.new_tokens / a.row_steps if a.row_steps else None
            s = step_ms(a)
            verified_s = a.wall_s - a.unverified_s
            bound = a.new_tokens / verified_s / base if verified_s > 0 and base else None
            row.update(mean_accepted_length=round(mal, 3) if mal else None,
                       acceptance_by_depth=acceptance_by_depth(a.accept_hist), accept_hist=list(a.accept_hist),
                       step_ms=round(s, 4) if s else None, ideal_speedup=round(mal, 3) if mal else None,
                       draft_share=round(a.draft_s / a.loop_s, 4) if a.loop_s else None,
                       predicted_speedup=round(mal * plain_step / s, 3) if mal and s and plain_step else None,
                       verification_bound_speedup=round(bound, 3) if bound else None)
        if a.peak:
            row.update(peak_mem_mb=round(a.peak * mb, 1), peak_mem_over_start_mb=round(a.peak_over_start * mb, 1))
        if a.weight_bytes is not None:
            row["drafter_weight_mb"] = round(a.weight_bytes * mb, 3)
        if a.error is not None:
            row["error"] = a.error
        rows.append(row)
    return rows


def greedy_checks(accs: dict[str, _Acc]) -> list[dict]:
    checks = []
    plain = accs.get("plain")
    if plain is None or plain.error is not None:
        return checks
    for m, a in accs.items():
        if m == "plain" or a.error is not None:
            continue
        checks.append(compare_outputs(a.outputs, plain.outputs, m, "plain"))
        other = HF_COUNTERPART.get(m)
        if other and other != "plain" and other in accs and accs[other].error is None:
            checks.append(compare_outputs(a.outputs, accs[other].outputs, m, other))
    return checks


SELF_SPEC, EARLY_EXIT = "self-spec", "early-exit"


def with_drafter(models: BenchModels, name: str, make_one, info: dict) -> BenchModels:
    """``models`` with one more drafter ``name``, made by ``make_one()`` (a drafter of the target's own weights:
    no draft keywords apply), ``info`` added to the models' record."""
    make_one()  # (checked against the target now)

    def make(n: str, **kw):
        if n != name:
            return models.make_drafter(n, **kw)
        if kw:
            raise ValueError(f"{name} drafts with the target's own weights ({', '.join(kw)} does not apply); the "
                             "target on int8 weights drafting for itself is the method self-int8")
        return make_one()

    return replace(models, drafter_names=[*models.drafter_names, name], make_drafter=make,
                   info={**models.info, **info})


def with_self_spec(models: BenchModels, path: str) -> BenchModels:
    """``models`` with the drafter :data:`SELF_SPEC`: the target drafting for itself with the layers of the
    self-speculation file ``path`` skipped."""
    return with_drafter(models, SELF_SPEC, lambda: SelfSpecDrafter.from_file(path, target=models.target),
                        {"self_spec_file": path})


def with_early_exit(models: BenchModels, path: str) -> BenchModels:
    """``models`` with the drafter :data:`EARLY_EXIT`: the target's first layers and the adapter in ``path``
    (chains of 4, verified from the exit layer)."""
    return with_drafter(models, EARLY_EXIT, lambda: EarlyExitDrafter.from_pretrained(path, models.target),
                        {"early_exit_dir": path})


def available_methods(models: BenchModels, cfg: E2EConfig) -> list[str]:
    ours = ["plain"] + list(models.drafter_names)
    quantized = models.quantized_methods()  # (on request only)
    hf = []
    if cfg.hf:
        hf = ["hf-plain"] + (["hf-assisted"] if models.draft_lm is not None else []) + ["hf-prompt-lookup"]
    if cfg.methods:
        unknown = [m for m in cfg.methods if m not in ours + quantized + list(HF_METHODS)]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; available: {', '.join(ours + quantized + hf)}")
        missing = [m for m in cfg.methods if m not in ours + quantized + hf]
        if missing:
            raise ValueError(f"method(s) {missing} not available with these models (hf-assisted needs a draft LM; "
                             f"HF methods need hf on)")
        return ["plain"] + [m for m in cfg.methods if m != "plain"]
    return ours + hf


def run_e2e(models: BenchModels, cfg: E2EConfig | None = None, log=print) -> dict:
    """The end-to-end table (see the module doc). Returns a JSON-able dict."""
    cfg = cfg or E2EConfig()
    if cfg.self_spec:
        models = with_self_spec(models, cfg.self_spec)
    if cfg.early_exit:
        models = with_early_exit(models, cfg.early_exit)
    methods = available_methods(models, cfg)
    limit = models.max_positions
    if limit is not None and cfg.prompt_len + cfg.max_new_tokens > limit:
        raise ValueError(f"prompt_len {cfg.prompt_len} + max_new_tokens {cfg.max_new_tokens} exceeds the target's "
                         f"max_position_embeddings {limit}")
    prompts, warm, how = prompts_and_warmup(models, cfg.num_prompts, cfg.prompt_len, cfg.seed)
    log(f"e2e: {len(prompts)} prompts of {cfg.prompt_len} tokens ({how}), {cfg.max_new_tokens} new tokens, "
        f"methods {', '.join(methods)}")
    out = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
           "methods": methods, "prompts": {"count": len(prompts), "length": cfg.prompt_len, "source": how},
           "runs": [], "greedy_checks": [], "hf_settings": None,
           "notes": ["speedup: tokens/s over our plain decoding's, same run, round-robin over prompts",
                     "predicted_speedup = mean_accepted_length * step_ms(plain) / step_ms(method) "
                     "(decode-loop time per step; prefill excluded)",
                     "verification_bound_speedup: the speedup with drafting and bookkeeping free (prefill and "
                     "verification forwards only, as measured)",
                     "EOS ignored: every run emits max_new_tokens tokens; batch size 1"]}
    for T in cfg.temperatures:
        log(f"e2e: temperature {T}")
        t0 = time.perf_counter()
        accs, settings = measure(models, methods, prompts, T, cfg.max_new_tokens, warmup_tokens=cfg.warmup_tokens,
                                 seed=cfg.seed, log=log, hf_cfg=cfg, warmup_prompt=warm)
        out["hf_settings"] = settings
        rows = summarise(accs, T)
        out["runs"].extend(rows)
        for r in rows:
            log("  " + format_row(r))
        if T == 0:
            checks = greedy_checks(accs)
            out["greedy_checks"] = checks
            bad = [c for c in checks if not c["equal"]]
            log(f"  greedy outputs: {len(checks) - len(bad)} of {len(checks)} comparisons identical"
                + "".join(f"\n    DIFFERENT: {c['a']} vs {c['b']}: {c['mismatches'][:2]}" for c in bad))
        log(f"  ({time.perf_counter() - t0:.1f} s)")
    return out


def format_row(r: dict) -> str:
    if r.get("tokens_per_s") is None:
        return f"{r['method']:<18} error: {r.get('error')}"

    def f(x, spec):
        return format(x, spec) if x is not None else "-"

    return (f"{r['method']:<18} {f(r['tokens_per_s'], '9.1f')} tok/s  x{f(r.get('speedup'), '.2f')}  "
            f"MAL {f(r.get('mean_accepted_length'), '.2f')}  predicted x{f(r.get('predicted_speedup'), '.2f')}  "
            f"bound x{f(r.get('verification_bound_speedup'), '.2f')}  "
            f"draft {f(r.get('draft_share'), '.0%')} of the loop  "
            f"peak +{f(r.get('peak_mem_over_start_mb'), '.1f')} MB")


def markdown_table(e2e: dict) -> str:
    """The e2e results as a Markdown table (the README's): one line per method, greedy and temperature-1 columns
    side by side when both ran."""
    runs = [r for r in e2e.get("runs", []) if r.get("tokens_per_s") is not None]
    temps = sorted({r["temperature"] for r in runs})
    methods = list(dict.fromkeys(r["method"] for r in runs))
    checks = {c["a"]: c["equal"] for c in e2e.get("greedy_checks", []) if c["b"] == "plain"}

    def cell(x, spec):
        return format(x, spec) if x is not None else "-"

    head = ["method"]
    for T in temps:
        t = f"T={T:g}"
        head += [f"{t} tokens/s", f"{t} speedup", f"{t} mean accepted length"]
        if T == 0:
            head += ["predicted speedup", "verification-bound speedup", "greedy output = plain"]
    head.append("peak memory over start (MB)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        row = [m]
        mem = None
        for T in temps:
            r = next((r for r in runs if r["method"] == m and r["temperature"] == T), None) or {}
            row += [cell(r.get("tokens_per_s"), ".1f"), cell(r.get("speedup"), ".2f") + ("x" if r.get("speedup") else ""),
                    cell(r.get("mean_accepted_length"), ".2f")]
            if T == 0:
                pred, bound = r.get("predicted_speedup"), r.get("verification_bound_speedup")
                row += [cell(pred, ".2f") + ("x" if pred else ""), cell(bound, ".2f") + ("x" if bound else ""),
                        "(reference)" if m == "plain" else {True: "yes", False: "**no**"}.get(checks.get(m), "-")]
            if mem is None:
                mem = r.get("peak_mem_over_start_mb")
        row.append(cell(mem, ".1f"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
