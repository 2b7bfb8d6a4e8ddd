"""Shared helpers of the Python benchmarks: planted inputs, timing (warmup + median), result table, JSON output.

Every bench compares, on the same inputs and in the same process (so ratios are measured side by side):
  reference  specdec_ext.ops.reference (slow Python-loop spec; timed on fewer repeats),
  baseline   a vectorised pure-PyTorch implementation (benchmarks/python/baselines.py),
  ours-cpu   torch.ops.specdec_ext via specdec_ext.ops on CPU,
  ours-cuda  the same on CUDA when available.
It first checks that our op's integer outputs equal the reference's and the baseline's on the benchmark inputs,
then times. GB/s use explicit byte formulas (printed with each result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

PLANTED_LOGIT = 20.0


# ----------------------------------------------------------------------------------------------------------------
# Arguments.


def parse_args(description: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer repeats and shapes")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--device", choices=["all", "cpu", "cuda"], default="all",
                   help="which of our implementations to time (the reference and baseline always run on CPU, "
                        "and on CUDA too for the baseline when --device includes cuda)")
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (default 30, quick 8)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.repeats <= 0:
        args.repeats = 8 if args.quick else 30
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return args


def want_gpu_shapes(args) -> bool:
    """The GPU-sized shapes (e.g. B=64, N=8, V=128000) run in full mode, or whenever CUDA is benchmarked."""
    return not args.quick or "cuda" in devices(args)


_DEVICES_CACHE: dict = {}


def devices(args) -> list[str]:
    key = args.device
    if key not in _DEVICES_CACHE:
        _DEVICES_CACHE[key] = _devices(args)
    return _DEVICES_CACHE[key]


def _devices(args) -> list[str]:
    out = []
    if args.device in ("all", "cpu"):
        out.append("cpu")
    if args.device in ("all", "cuda") and cuda_available():
        out.append("cuda")
    return out


def cuda_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import specdec_ext.ops as ops
        ops.chain_parents(1, 2)  # import side effects only
        # A tiny op call tells whether the extension has CUDA kernels.
        p = torch.tensor([[-1, 0]], device="cuda")
        ops.build_tree(p)
        return True
    except Exception as exc:  # noqa: BLE001
        print(f"# CUDA present but specdec_ext has no CUDA kernels: {exc}".splitlines()[0])
        return False


# ----------------------------------------------------------------------------------------------------------------
# Timing.


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_fn(fn, device: str = "cpu", repeats: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `repeats` calls after `warmup` calls. CUDA: CUDA events per call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device.startswith("cuda"):
        for _ in range(repeats):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@dataclass
class Result:
    op: str
    shape: str
    dtype: str
    impl: str
    device: str
    median_ms: float
    bytes: float
    byte_formula: str
    repeats: int
    gbps: float = 0.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.gbps = self.bytes / (self.median_ms * 1e-3) / 1e9 if self.median_ms > 0 else 0.0


class Table:
    """Collects results; prints them with ratios against the baseline and the reference of the same case."""

    def __init__(self, title: str):
        self.title = title
        self.results: list[Result] = []
        self.notes: list[str] = []

    def add(self, r: Result) -> Result:
        self.results.append(r)
        print(f"  {r.impl:<12} {r.device:<5} {r.median_ms:10.4f} ms  {r.gbps:8.2f} GB/s   (n={r.repeats})",
              flush=True)
        return r

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"# {text}", flush=True)

    def case(self, op: str, shape: str, dtype: str) -> None:
        print(f"\n{op}  {shape}  {dtype}", flush=True)

    def ratios(self) -> list[dict]:
        out = []
        keys = sorted({(r.op, r.shape, r.dtype) for r in self.results}, key=str)
        for key in keys:
            rs = {(r.impl, r.device): r for r in self.results if (r.op, r.shape, r.dtype) == key}
            for dev in ("cpu", "cuda"):
                ours = rs.get(("ours", dev))
                if ours is None:
                    continue
                row = {"op": key[0], "shape": key[1], "dtype": key[2], "device": dev, "ours_ms": ours.median_ms}
                base = rs.get(("baseline", dev))
                ref = rs.get(("reference", "cpu"))
                if base:
                    row["baseline_ms"] = base.median_ms
                    row["speedup_vs_baseline"] = base.median_ms / ours.median_ms
                if ref:
                    row["reference_ms"] = ref.median_ms
                    row["speedup_vs_reference"] = ref.median_ms / ours.median_ms
                out.append(row)
        return out

    def print_summary(self) -> None:
        print(f"\n== {self.title}: speedups (median baseline or reference time / median ours, same run)")
        print(f"{'op':<22} {'shape':<34} {'dtype':<6} {'dev':<5} {'ours ms':>9} {'x baseline':>11} "
              f"{'x reference':>12}")
        for row in self.ratios():
            vb = f"{row['speedup_vs_baseline']:.2f}x" if "speedup_vs_baseline" in row else "-"
            vr = f"{row['speedup_vs_reference']:.1f}x" if "speedup_vs_reference" in row else "-"
            print(f"{row['op']:<22} {row['shape']:<34} {row['dtype']:<6} {row['device']:<5} "
                  f"{row['ours_ms']:9.4f} {vb:>11} {vr:>12}")

    def to_json(self) -> dict:
        return {"title": self.title, "results": [asdict(r) for r in self.results], "ratios": self.ratios(),
                "notes": self.notes}


def finish(table: Table, args) -> dict:
    table.print_summary()
    data = table.to_json()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), **data}, f, indent=1)
        print(f"wrote {args.json}")
    return data


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


# ----------------------------------------------------------------------------------------------------------------
# Inputs.


def heap_parents(B: int, N: int) -> torch.Tensor:
    """Binary-heap trees: the parent of node i is (i - 1) // 2 (N = 64: depth 6)."""
    p = (torch.arange(N) - 1).div(2, rounding_mode="floor")
    p[0] = -1
    return p.expand(B, N).contiguous()


def planted_tree_inputs(B: int, N: int, V: int, seed: int = 0, dtype=torch.float32):
    """Draft trees whose verification accepts a known path of 2-4 tokens (capped by the tree depth).

    logits are uniform in [-2, 2); along the planted path the parent's row has PLANTED_LOGIT at the chosen child's
    token, and the path's last node has it at a token no child drafted. So greedy, rejection sampling (T <= 1,
    uniforms < 0.9) and typical acceptance all accept that path with probability ~1. Returns
    (logits [B, N, V], tokens [B, N], parents [B, N], planted accept_len [B], planted next token [B]).
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(B, N, V, generator=g) * 4 - 2
    parents = heap_parents(B, N)
    tokens = torch.randint(0, V, (B, N), generator=g)
    # Distinct sibling tokens (siblings are 2j+1, 2j+2).
    for b in range(B):
        for i in range(2, N, 2):
            while tokens[b, i] == tokens[b, i - 1]:
                tokens[b, i] = int(torch.randint(0, V, (1,), generator=g))
    accept_len = torch.zeros(B, dtype=torch.int64)
    next_token = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        want, u, n = 2 + b % 3, 0, 0
        while n < want:
            kids = [c for c in (2 * u + 1, 2 * u + 2) if c < N]
            if not kids:
                break
            c = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
            logits[b, u, tokens[b, c]] = PLANTED_LOGIT
            u, n = c, n + 1
        kid_tokens = {int(tokens[b, c]) for c in (2 * u + 1, 2 * u + 2) if c < N}
        while True:
            t = int(torch.randint(0, V, (1,), generator=g))
            if t not in kid_tokens:
                break
        logits[b, u, t] = PLANTED_LOGIT
        accept_len[b], next_token[b] = n, t
    return logits.to(dtype), tokens, parents, accept_len, next_token


def planted_note(accept_len: torch.Tensor) -> str:
    return (f"planted inputs: verification accepts {accept_len.float().mean():.2f} draft tokens per row on average "
            f"(min {int(accept_len.min())}, max {int(accept_len.max())}), not the trivial reject-at-root case")


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64"}.get(
        dtype, str(dtype))


def check_equal(name: str, got, want) -> None:
    """Integer outputs must be identical."""
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = g.cpu(), w.cpu()
        if g.dtype.is_floating_point:
            continue
        if not torch.equal(g, w):
            raise AssertionError(f"{name}: output {i} differs:\n got  {g.flatten()[:20].tolist()}\n want "
                                 f"{w.flatten()[:20].tolist()}")


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, atol=1e-5, rtol=1e-4) -> None:
    if not torch.allclose(got.cpu().float(), want.cpu().float(), atol=atol, rtol=rtol, equal_nan=True):
        err = (got.cpu().float() - want.cpu().float()).abs().max()
        raise AssertionError(f"{name}: float output differs (max abs err {float(err):.3g})")


# ----------------------------------------------------------------------------------------------------------------
# One benchmark case: check, then time every implementation side by side.


def to_device(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def run_case(table: Table, args, *, op: str, shape: str, dtype: torch.dtype, inputs: dict, reference, baseline,
             ours, bytes_ours: float, formula_ours: str, bytes_all: float, formula_all: str,
             float_outputs: tuple[int, ...] = (), ref_repeats: int | None = None,
             baseline_exact: bool = True) -> None:
    """reference / baseline / ours take **inputs (CPU tensors, or moved to CUDA for the CUDA runs) and return a
    tuple of tensors. Integer outputs must be identical to the reference's; float outputs listed in
    `float_outputs` must be close. bytes_ours: what our kernels must read (and write); bytes_all: what the
    baseline reads (every row). baseline_exact=False skips the integer check of the baseline (torch.topk leaves
    the order of tied values unspecified, so low-precision ties may legally come out in another order); our
    kernels are always checked exactly."""
    dname = dtype_name(dtype)
    table.case(op, shape, dname)
    want = reference(**inputs)
    for name, fn, dev in [("baseline", baseline, "cpu"), ("ours", ours, "cpu")]:
        got = fn(**inputs)
        if name == "ours" or baseline_exact:
            check_equal(f"{op} {name}-cpu vs reference", got, want)
        for i in float_outputs:
            check_close(f"{op} {name}-cpu vs reference (output {i})", got[i], want[i])
    print("  check: ours and baseline integer outputs equal the reference's", flush=True)
    n_ref = ref_repeats or max(2, args.repeats // 10)
    cpu_timing = args.device in ("all", "cpu")  # --device cuda: checks on CPU, timings on CUDA only
    if cpu_timing:
        table.add(Result(op, shape, dname, "reference", "cpu", time_fn(lambda: reference(**inputs), "cpu", n_ref, 1),
                         bytes_ours, formula_ours, n_ref))
    devs = devices(args)
    for dev in ("cpu", "cuda"):
        if (dev == "cuda" and "cuda" not in devs) or (dev == "cpu" and not cpu_timing):
            continue
        inp = inputs if dev == "cpu" else to_device(inputs, dev)
        if dev == "cuda":
            for name, fn in [("baseline", baseline), ("ours", ours)]:
                got = fn(**inp)
                sync(dev)
                check_equal(f"{op} {name}-cuda vs reference", got, want)
                for i in float_outputs:
                    check_close(f"{op} {name}-cuda vs reference (output {i})", got[i], want[i])
            print("  check: cuda outputs equal the reference's", flush=True)
        table.add(Result(op, shape, dname, "baseline", dev, time_fn(lambda: baseline(**inp), dev, args.repeats),
                         bytes_all, formula_all, args.repeats))
        if dev == "cpu" and "cpu" not in devs:
            continue
        table.add(Result(op, shape, dname, "ours", dev, time_fn(lambda: ours(**inp), dev, args.repeats),
                         bytes_ours, formula_ours, args.repeats))
    print(f"  bytes: ours and reference {formula_ours}; baseline {formula_all}", flush=True)
