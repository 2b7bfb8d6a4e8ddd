"""The common training loop: AdamW, seeded batches, progress with loss and tokens/s, periodic acceptance
evaluation through :func:`specdec_ext.generate.generate`, resumable checkpoints (weights + optimizer + step +
sampler state), saved every few minutes and at the end, read back with torch's weights-only unpickler (a checkpoint
folder can hold no code that runs)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from specdec_ext.generate import generate
from specdec_ext.models.safe_files import read_weights_only
from specdec_ext.train.data import BatchSampler, pad_batch
from specdec_ext.train.progress import Progress
from specdec_ext.train.schedule import (DEFAULT_STEPS, SchedulePlan, epoch_cap, lr_at, resolve_warmup,
                                       steps_for_budget)

__all__ = ["TrainConfig", "TrainResult", "train_loop", "evaluate_acceptance", "default_device",
           "read_checkpoint", "check_resumable", "CHECKPOINT_FILE"]

CHECKPOINT_FILE = "trainer_state.pt"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class TrainConfig:
    steps: int | None = None  # None: DEFAULT_STEPS, or chosen from ``minutes``
    minutes: float | None = None  # a time budget instead of steps (train/schedule.py: how the count is chosen)
    max_epochs: float = 2.0  # with ``minutes``: at most this many passes over the data
    probe_steps: int = 10  # with ``minutes``: steps timed before the count is fixed
    lr: float = 1e-3
    batch_size: int = 8
    short_length: int = 0  # > 0: windows longer than this are batched apart (long-context mixing: train/data.py)
    weight_decay: float = 0.0
    warmup: int | None = 0  # linear warm-up steps; None: ``warmup_fraction`` of the steps
    warmup_fraction: float = 0.05
    schedule: str = "constant"  # after warm-up: "constant", or "cosine" decay to min_lr_ratio * lr at the last step
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str | None = None  # None: a GPU when present, else the CPU
    eval_every: int = 0  # 0: evaluate at the end only (when held-out prompts exist)
    eval_new_tokens: int = 32
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # also checkpoint every N steps (0: off; with checkpoint_dir)
    checkpoint_minutes: float = 5.0  # and after every this many minutes of training (0: off)
    resume: bool = False
    progress: bool = True


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step: int = 0
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, mean accepted length)
    seconds: float = 0.0
    tokens: int = 0
    plan: SchedulePlan | None = None  # the step count and warm-up the run followed

    def summary(self) -> dict:
        k = max(1, min(10, len(self.losses) // 5))
        return {"steps": self.step, "first_loss": sum(self.losses[:k]) / k if self.losses else None,
                "last_loss": sum(self.losses[-k:]) / k if self.losses else None, "evals": self.evals,
                "seconds": round(self.seconds, 2), "tokens": self.tokens,
                "schedule": self.plan.to_dict() if self.plan else None}


def _check_config(cfg: TrainConfig, name: str) -> None:
    for key, low in (("steps", 0), ("batch_size", 1), ("short_length", 0), ("warmup", 0), ("eval_every", 0),
                     ("eval_new_tokens", 1), ("checkpoint_every", 0), ("seed", 0), ("probe_steps", 1)):
        v = getattr(cfg, key)
        if v is None and key in ("steps", "warmup"):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}: {key} must be an integer >= {low}, got {v!r}")
    for key, positive in (("lr", True), ("weight_decay", False), ("grad_clip", False), ("min_lr_ratio", False),
                          ("checkpoint_minutes", False), ("minutes", True), ("max_epochs", True),
                          ("warmup_fraction", False)):
        v = getattr(cfg, key)
        if v is None and key == "minutes":
            continue
        bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
        if bad or positive and v == 0:
            raise ValueError(f"{name}: {key} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
    for key in ("min_lr_ratio", "warmup_fraction"):
        if getattr(cfg, key) > 1:
            raise ValueError(f"{name}: {key} must be at most 1 (a fraction), got {getattr(cfg, key)!r}")
    if cfg.schedule not in ("constant", "cosine"):
        raise ValueError(f"{name}: schedule must be 'constant' or 'cosine', got {cfg.schedule!r}")
    if cfg.steps is not None and cfg.minutes is not None:
        raise ValueError(f"{name}: give steps ({cfg.steps}) or minutes ({cfg.minutes}), not both: a time budget "
                         "chooses the step count itself")
    if cfg.steps is not None and cfg.warmup is not None and cfg.warmup > cfg.steps:
        raise ValueError(f"{name}: warmup ({cfg.warmup} steps) exceeds steps ({cfg.steps}): the rate would never "
                         "reach lr")


def _fresh_plan(cfg: TrainConfig, batches_per_epoch: float) -> SchedulePlan:
    if cfg.minutes is None:
        steps = DEFAULT_STEPS if cfg.steps is None else cfg.steps
        return SchedulePlan(steps=steps, warmup=resolve_warmup(cfg.warmup, cfg.warmup_fraction, steps))
    cap = epoch_cap(batches_per_epoch, cfg.max_epochs)
    warm = resolve_warmup(cfg.warmup, cfg.warmup_fraction, cap)  # (until the count is fixed: the longest run's)
    return SchedulePlan(steps=cap, warmup=warm, probe_steps=min(cfg.probe_steps, cap), probe_total=cap,
                        probe_warmup=warm, budget_seconds=60.0 * cfg.minutes)


def _resumed_plan(cfg: TrainConfig, saved: SchedulePlan, done: int) -> SchedulePlan:
    """The plan of a resumed run (``done`` steps in): the checkpoint's (a time budget's count stays what it chose);
    explicit other ``steps`` re-plan the rest of the run over the new total (the steps done keep the rates they had;
    a probe not finished ends there). A checkpoint from before plans were saved resumes with this run's fresh plan."""
    if cfg.steps is None or cfg.steps == saved.steps:
        return saved
    plan = {**saved.to_dict(), "steps": cfg.steps, "warmup": resolve_warmup(cfg.warmup, cfg.warmup_fraction, cfg.steps)}
    if saved.step_seconds is None:  # (the budget's probe had not ended: the given count replaces it)
        plan.update(probe_steps=min(saved.probe_steps, done), budget_seconds=None)
    return SchedulePlan(**plan)


_STATE_KEYS = ("module", "optimizer", "sampler", "step", "losses", "evals", "rng")  # (and "plan", since plans)


def read_checkpoint(path: str, name: str) -> dict:
    """The state :func:`train_loop` saved in ``path`` (weights-only: a crafted pickle is refused, never run)."""
    state = read_weights_only(path, f"{name}: resume")
    if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
        have = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{name}: resume: {path!r} is not a training checkpoint of this library (it needs "
                         f"{', '.join(_STATE_KEYS)}; it has {have})")
    return state


def _fmt(sig: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sig.items()) or "no recorded options"


def check_resumable(state: dict, module: torch.nn.Module, signature: dict | None, path: str, name: str) -> None:
    """Refuses (``ValueError``) a checkpoint whose module differs from ``module``: other options, keys or shapes."""
    saved = state.get("signature") or {}
    signature = signature or {}
    if saved and signature and saved != signature:
        raise ValueError(f"{name}: resume: {path!r} holds a {state.get('name', name)} trained with {_fmt(saved)}; "
                         f"this run asks for {_fmt(signature)} (resume with the same options, or train into "
                         "another output directory)")
    have = state["module"]
    want = module.state_dict()
    if not isinstance(have, dict):
        raise ValueError(f"{name}: resume: {path!r} holds no module state dict")
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    shapes = [k for k in want if k in have and (not isinstance(have[k], torch.Tensor)
                                                or tuple(have[k].shape) != tuple(want[k].shape))]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} tensor(s) this run's model has ({', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''})")
        if extra:
            parts.append(f"it has {len(extra)} tensor(s) this run's model lacks ({', '.join(extra[:3])}"
                         f"{', ...' if len(extra) > 3 else ''})")
        if shapes:
            k = shapes[0]
            got = list(have[k].shape) if isinstance(have[k], torch.Tensor) else type(have[k]).__name__
            parts.append(f"{k!r} is {got} there but {list(want[k].shape)} here"
                         f"{f' (and {len(shapes) - 1} more)' if len(shapes) > 1 else ''}")
        raise ValueError(f"{name}: resume: {path!r} holds a different model ({_fmt(saved)}) than this run's "
                         f"({_fmt(signature)}): {'; '.join(parts)}")


@torch.no_grad()
def evaluate_acceptance(target, drafter, prompts: list[list[int]], max_new_tokens: int = 32) -> float:
    """Mean accepted length (tokens per target forward) of greedy speculative decoding of ``prompts``."""
    if not prompts:
        return float("nan")
    _, stats = generate(target, drafter, [torch.tensor(p) for p in prompts], max_new_tokens=max_new_tokens,
                        eos_token_id=[])
    return float(stats.mean_accepted_length)


def _sampler(seqs: list[list[int]], cfg: TrainConfig) -> BatchSampler:
    """Batches of ``cfg.batch_size`` windows; with ``cfg.short_length``, the windows longer than it batched apart,
    as many tokens to a batch as a batch of short ones (at least one window)."""
    long = [i for i, s in enumerate(seqs) if cfg.short_length and len(s) > cfg.short_length]
    longest = max((len(seqs[i]) for i in long), default=1)
    return BatchSampler(len(seqs), cfg.batch_size, cfg.seed, long, cfg.batch_size * cfg.short_length // longest)


def train_loop(module: torch.nn.Module, loss_fn, seqs: list[list[int]], cfg: TrainConfig, eval_fn=None,
               name: str = "train", params=None, signature: dict | None = None) -> TrainResult:
    """Trains ``module``'s (or ``params``') parameters for ``cfg.steps`` AdamW steps (or as many as fit in
    ``cfg.minutes``: :mod:`specdec_ext.train.schedule`) on batches of ``seqs``.

    ``loss_fn(tokens[B, T], mask[B, T]) -> (loss, n_tokens)``; ``eval_fn(step) -> float`` (mean accepted length),
    called every ``cfg.eval_every`` steps and at the end. With ``cfg.checkpoint_dir``, ``trainer_state.pt`` there
    holds the module's state, the optimizer, the step, the sampler and the schedule plan, saved every
    ``cfg.checkpoint_every`` steps, every ``cfg.checkpoint_minutes`` and at the end (``cfg.resume`` continues from
    it: the same result as an uninterrupted run with the same seed; a time budget's step count is the one the
    first run chose). ``signature``: the options that shape the module (e.g. ``{"heads": 4}``), stored in the
    checkpoint; resuming with other ones is refused, naming both."""
    if not seqs:
        raise ValueError(f"{name}: no training sequences")
    _check_config(cfg, name)
    device = torch.device(cfg.device or default_device())
    torch.manual_seed(cfg.seed)
    params = [p for p in (module.parameters() if params is None else params) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sampler = _sampler(seqs, cfg)
    result = TrainResult()
    ckpt = os.path.join(cfg.checkpoint_dir, CHECKPOINT_FILE) if cfg.checkpoint_dir else None
    plan = _fresh_plan(cfg, sampler.batches_per_epoch)
    if cfg.resume and ckpt and os.path.isfile(ckpt):
        state = read_checkpoint(ckpt, name)
        check_resumable(state, module, signature, ckpt, name)
        sampler.load_state_dict(state["sampler"], who=f"{name}: resume: {ckpt!r}")  # (refuses other data first)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        result.step, result.losses, result.evals = state["step"], list(state["losses"]), list(state["evals"])
        result.tokens = state.get("tokens", 0)
        result.seconds = state.get("seconds", 0.0)  # training time before the interruption
        torch.set_rng_state(state["rng"])
        saved = state.get("plan")
        if saved is not None:
            plan = _resumed_plan(cfg, SchedulePlan.from_dict(saved, f"{name}: resume: {ckpt!r}"), result.step)
    result.plan = plan
    fixed = plan.budget_seconds is None or plan.step_seconds is not None  # the step count is known

    def save():
        if ckpt is None:
            return
        os.makedirs(cfg.checkpoint_dir, exist_ok=True)
        tmp = ckpt + ".tmp"
        torch.save({"module": module.state_dict(), "optimizer": opt.state_dict(), "sampler": sampler.state_dict(),
                    "step": result.step, "losses": result.losses, "evals": result.evals, "tokens": result.tokens,
                    "rng": torch.get_rng_state(), "name": name, "signature": signature or {},
                    "seconds": seconds_before + time.perf_counter() - t0, "plan": plan.to_dict()}, tmp)
        os.replace(tmp, ckpt)
        nonlocal saved_at
        saved_at = time.perf_counter()

    bar = Progress(plan.steps, name, enabled=cfg.progress, initial=result.step)
    t0 = saved_at = time.perf_counter()
    seconds_before = result.seconds
    tok_window, t_window = 0, t0
    timed_from, timed_steps = None, 0  # the probe's clock starts after this process's first step (one-time costs)
    check_from = None  # (time, step) where the check's clock started (module doc of train/schedule.py)
    module.train()
    while result.step < plan.steps:
        toks, mask = pad_batch([seqs[i] for i in sampler.next()], device)
        for g in opt.param_groups:
            g["lr"] = lr_at(result.step, plan, cfg.lr, cfg.schedule, cfg.min_lr_ratio)
        loss, ntok = loss_fn(toks, mask)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{name}: the loss became {loss.item()} at step {result.step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        result.step += 1
        result.losses.append(float(loss.detach()))
        ntok = int(ntok)
        result.tokens += ntok
        tok_window += ntok
        now = time.perf_counter()
        if not fixed:
            elapsed = seconds_before + now - t0
            if timed_from is None:
                timed_from = now
            else:
                timed_steps += 1
            step_s = (now - timed_from) / timed_steps if timed_steps else elapsed / max(1, result.step)
            # the probe ends after probe_steps, or sooner when finishing it would overrun the budget
            if (timed_steps and result.step >= plan.probe_steps
                    or elapsed + (plan.probe_steps - result.step) * step_s >= plan.budget_seconds):
                plan.step_seconds = step_s
                plan.steps = steps_for_budget(plan.budget_seconds, elapsed, step_s, result.step, plan.probe_total)
                plan.warmup = resolve_warmup(cfg.warmup, cfg.warmup_fraction, plan.steps)
                fixed = True
                bar.set_total(plan.steps)
                bar.write(f"{name}: {plan.step_seconds:.3f} s a step: {plan.steps} steps fit in "
                          f"{plan.budget_seconds / 60:.3g} minutes (at most {plan.probe_total}: {cfg.max_epochs:g} "
                          "passes over the data)")
        elif plan.budget_seconds is not None and not plan.check_step:
            if check_from is None:
                check_from = (now, result.step)
            elif result.step - check_from[1] >= max(plan.probe_steps, plan.steps // 10):
                plan.check_seconds = (now - check_from[0]) / (result.step - check_from[1])
                plan.check_step = result.step
                plan.steps = steps_for_budget(plan.budget_seconds, seconds_before + now - t0, plan.check_seconds,
                                              result.step, plan.probe_total)
                bar.set_total(plan.steps)
                bar.write(f"{name}: checked: {plan.check_seconds:.3f} s a step: {plan.steps} steps fit")
        bar.update(1, loss=f"{result.losses[-1]:.4f}", tok_s=f"{tok_window / max(now - t_window, 1e-9):.0f}")
        if now - t_window > 5:
            tok_window, t_window = 0, now
        if (eval_fn is not None and cfg.eval_every and result.step % cfg.eval_every == 0
                and result.step < plan.steps):
            module.eval()
            acc = eval_fn(result.step)
            module.train()
            result.evals.append((result.step, acc))
            bar.write(f"{name}: step {result.step} loss {result.losses[-1]:.4f} mean accepted length {acc:.3f}")
        if (cfg.checkpoint_every and result.step % cfg.checkpoint_every == 0
                or cfg.checkpoint_minutes and now - saved_at >= 60 * cfg.checkpoint_minutes):
            save()
    bar.close()
    module.eval()
    if eval_fn is not None and (not result.evals or result.evals[-1][0] != result.step):
        acc = eval_fn(result.step)
        if not (isinstance(acc, float) and math.isnan(acc)):
            result.evals.append((result.step, acc))
    result.seconds = seconds_before + time.perf_counter() - t0
    save()
    return result
