"""The common training loop: AdamW, seeded batches, progress with loss and tokens/s, periodic acceptance
evaluation through :func:`specdec_ext.generate.generate`, resumable checkpoints (weights + optimizer + step +
sampler state)."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from specdec_ext.train.data import BatchSampler, pad_batch

__all__ = ["TrainConfig", "TrainResult", "Progress", "train_loop", "evaluate_acceptance", "default_device",
           "CHECKPOINT_FILE"]

CHECKPOINT_FILE = "trainer_state.pt"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 1e-3
    batch_size: int = 8
    weight_decay: float = 0.0
    warmup: int = 0
    schedule: str = "constant"  # after warm-up: "constant", or "cosine" decay to min_lr_ratio * lr at the last step
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str | None = None  # None: a GPU when present, else the CPU
    eval_every: int = 0  # 0: evaluate at the end only (when held-out prompts exist)
    eval_new_tokens: int = 32
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: checkpoint at the end only (when checkpoint_dir is set)
    resume: bool = False
    progress: bool = True


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step: int = 0
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, mean accepted length)
    seconds: float = 0.0
    tokens: int = 0

    def summary(self) -> dict:
        k = max(1, min(10, len(self.losses) // 5))
        return {"steps": self.step, "first_loss": sum(self.losses[:k]) / k if self.losses else None,
                "last_loss": sum(self.losses[-k:]) / k if self.losses else None, "evals": self.evals,
                "seconds": round(self.seconds, 2), "tokens": self.tokens}


class Progress:
    """tqdm when installed, else a plain printer to stderr (every ~2 s)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, initial: int = 0):
        self.enabled, self.total, self.n, self.desc = enabled, total, initial, desc
        self.bar = None
        self.last = 0.0
        self.post = ""
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        if not self.enabled:
            return
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last > 2 or self.n >= self.total:
            self.last = now
            extra = " ".join(f"{k}={v}" for k, v in postfix.items())
            print(f"{self.desc}: {self.n}/{self.total} {extra}", file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@torch.no_grad()
def evaluate_acceptance(target, drafter, prompts: list[list[int]], max_new_tokens: int = 32) -> float:
    """Mean accepted length (tokens per target forward) of greedy speculative decoding of ``prompts``."""
    from specdec_ext.generate import generate

    if not prompts:
        return float("nan")
    _, stats = generate(target, drafter, [torch.tensor(p) for p in prompts], max_new_tokens=max_new_tokens,
                        eos_token_id=[])
    return float(stats.mean_accepted_length)


def train_loop(module: torch.nn.Module, loss_fn, seqs: list[list[int]], cfg: TrainConfig, eval_fn=None,
               name: str = "train", params=None) -> TrainResult:
    """Trains ``module``'s (or ``params``') parameters for ``cfg.steps`` AdamW steps on batches of ``seqs``.

    ``loss_fn(tokens[B, T], mask[B, T]) -> (loss, n_tokens)``; ``eval_fn(step) -> float`` (mean accepted length),
    called every ``cfg.eval_every`` steps and at the end. With ``cfg.checkpoint_dir``, ``trainer_state.pt`` there
    holds the module's state, the optimizer, the step and the sampler (``cfg.resume`` continues from it: the same
    result as an uninterrupted run with the same seed)."""
    if not seqs:
        raise ValueError(f"{name}: no training sequences")
    if cfg.schedule not in ("constant", "cosine"):
        raise ValueError(f"{name}: schedule must be 'constant' or 'cosine', got {cfg.schedule!r}")
    device = torch.device(cfg.device or default_device())
    torch.manual_seed(cfg.seed)
    params = [p for p in (module.parameters() if params is None else params) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if cfg.warmup and step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        if cfg.schedule == "cosine":
            frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
            return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
        return cfg.lr

    sampler = BatchSampler(len(seqs), cfg.batch_size, cfg.seed)
    result = TrainResult()
    ckpt = os.path.join(cfg.checkpoint_dir, CHECKPOINT_FILE) if cfg.checkpoint_dir else None
    if cfg.resume and ckpt and os.path.isfile(ckpt):
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        result.step, result.losses, result.evals = state["step"], list(state["losses"]), list(state["evals"])
        result.tokens = state.get("tokens", 0)
        result.seconds = state.get("seconds", 0.0)  # training time before the interruption
        torch.set_rng_state(state["rng"])

    def save():
        if ckpt is None:
            return
        os.makedirs(cfg.checkpoint_dir, exist_ok=True)
        tmp = ckpt + ".tmp"
        torch.save({"module": module.state_dict(), "optimizer": opt.state_dict(), "sampler": sampler.state_dict(),
                    "step": result.step, "losses": result.losses, "evals": result.evals, "tokens": result.tokens,
                    "rng": torch.get_rng_state(), "name": name,
                    "seconds": seconds_before + time.perf_counter() - t0}, tmp)
        os.replace(tmp, ckpt)

    bar = Progress(cfg.steps, name, enabled=cfg.progress, initial=result.step)
    t0 = time.perf_counter()
    seconds_before = result.seconds
    tok_window, t_window = 0, t0
    module.train()
    while result.step < cfg.steps:
        toks, mask = pad_batch([seqs[i] for i in sampler.next()], device)
        for g in opt.param_groups:
            g["lr"] = lr_at(result.step)
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
        bar.update(1, loss=f"{result.losses[-1]:.4f}", tok_s=f"{tok_window / max(now - t_window, 1e-9):.0f}")
        if now - t_window > 5:
            tok_window, t_window = 0, now
        if eval_fn is not None and cfg.eval_every and result.step % cfg.eval_every == 0 and result.step < cfg.steps:
            module.eval()
            acc = eval_fn(result.step)
            module.train()
            result.evals.append((result.step, acc))
            bar.write(f"{name}: step {result.step} loss {result.losses[-1]:.4f} mean accepted length {acc:.3f}")
        if cfg.checkpoint_every and result.step % cfg.checkpoint_every == 0:
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
