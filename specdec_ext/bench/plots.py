"""PNG plots of the benchmark results (matplotlib, Agg backend: no display needed). One file per suite."""

from __future__ import annotations

import os

__all__ = ["plot_all", "plot_batch", "plot_context", "plot_e2e", "plot_engine"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _title(results: dict, what: str) -> str:
    m = results.get("machine", {})
    where = m.get("gpu") or f"{m.get('cpu', '?')} ({m.get('torch_threads', '?')} threads)"
    model = (results.get("models") or {}).get("name", "?")
    return f"{what} - models: {model} - {where}"


def plot_e2e(results: dict, path: str) -> str | None:
    e2e = results.get("e2e")
    if not e2e or not e2e.get("runs"):
        return None
    plt = _plt()
    runs = [r for r in e2e["runs"] if r.get("tokens_per_s") is not None]
    temps = sorted({r["temperature"] for r in runs})
    methods = list(dict.fromkeys(r["method"] for r in runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(1, len(temps))
    for j, T in enumerate(temps):
        vals = [next((r["tokens_per_s"] for r in runs if r["method"] == m and r["temperature"] == T), 0) for m in methods]
        xs = [i + (j - (len(temps) - 1) / 2) * width for i in range(len(methods))]
        bars = ax1.bar(xs, vals, width, label=f"temperature {T:g}")
        for x, m, b in zip(xs, methods, bars):
            r = next((r for r in runs if r["method"] == m and r["temperature"] == T), None)
            if r and r.get("speedup"):
                ax1.annotate(f"x{r['speedup']:.2f}", (x, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    ax1.set_ylabel("tokens/s (batch 1)")
    ax1.set_title("throughput (label: speedup vs our plain decoding, same run)", fontsize=9)
    ax1.legend(fontsize=8)
    greedy = [r for r in runs if r["temperature"] == temps[0] and r.get("impl") == "specdec" and r["method"] != "plain"]
    if greedy:
        names = [r["method"] for r in greedy]
        xs = range(len(names))
        ax2.bar([x - 0.2 for x in xs], [r.get("speedup") or 0 for r in greedy], 0.4, label="measured")
        ax2.bar([x + 0.2 for x in xs], [r.get("predicted_speedup") or 0 for r in greedy], 0.4,
                label="predicted: MAL x step(plain) / step(method)")
        ax2.plot(list(xs), [r.get("mean_accepted_length") or 0 for r in greedy], "k_", markersize=18,
                 label="mean accepted length (ideal)")
        ax2.axhline(1.0, color="grey", lw=0.8)
        ax2.set_xticks(list(xs), names, rotation=30, ha="right")
        ax2.set_ylabel("speedup over plain decoding")
        ax2.set_title(f"temperature {temps[0]:g}: measured vs predicted", fontsize=9)
        ax2.legend(fontsize=8)
    fig.suptitle(_title(results, "end to end"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_context(results: dict, path: str) -> str | None:
    ctx = results.get("context")
    if not ctx or not ctx.get("rows"):
        return None
    plt = _plt()
    rows = [r for r in ctx["rows"] if r.get("tokens_per_s") is not None]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lengths = sorted({r["context_len"] for r in rows})
    for i, m in enumerate(methods):
        pts = sorted(((r["context_len"], r) for r in rows if r["method"] == m), key=lambda p: p[0])
        xs = [p[0] for p in pts]
        c = colors[i % len(colors)]
        if m != "plain":
            ax1.plot(xs, [p[1].get("mean_accepted_length") or 0 for p in pts], "o-", label=m, color=c)
        ax2.plot(xs, [p[1].get("speedup") or 0 for p in pts], "o-", label=m, color=c)
        ax3.plot(xs, [p[1].get("predicted_speedup") or 0 for p in pts], "o-", label=m, color=c)
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("prompt length (tokens)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax1.set_ylabel("mean accepted length (tokens / target forward)")
    ax2.set_ylabel("end-to-end speedup (prefill included)")
    ax3.set_ylabel("decode-loop speedup (prefill excluded)")
    for ax in (ax2, ax3):
        ax.axhline(1.0, color="grey", lw=0.8)
    note = ctx.get("note")
    fig.suptitle(_title(results, "context-length sweep, greedy") + (f"\n{note}" if note else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _batch_rows(batch: dict) -> list[dict]:
    """The batch sweep's rows, whatever list of dicts it keeps them in, as long as each row has a batch size and
    tokens/s."""
    for key in ("rows", "runs", "results"):
        rows = batch.get(key)
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            return rows
    return []


def _batch_long_rows(rows: list[dict]) -> list[dict]:
    """specdec_ext.bench.batch_sweep's wide rows (``plain_tokens_per_s``, ``fixed_tokens_per_s: {depth: v}``,
    ``adaptive_tokens_per_s``) as one row per (method, batch size)."""
    if not rows or "plain_tokens_per_s" not in rows[0]:
        return rows
    out = []
    for r in rows:
        B = r.get("batch_size")
        out.append({"batch_size": B, "method": "plain", "tokens_per_s": r.get("plain_tokens_per_s")})
        for d, v in (r.get("fixed_tokens_per_s") or {}).items():
            out.append({"batch_size": B, "method": f"fixed depth {d}", "tokens_per_s": v})
        if r.get("adaptive_tokens_per_s") is not None:
            out.append({"batch_size": B, "method": "adaptive", "tokens_per_s": r["adaptive_tokens_per_s"]})
    return out


def plot_batch(results: dict, path: str) -> str | None:
    batch = results.get("batch")
    if not isinstance(batch, dict):
        return None
    rows = _batch_long_rows(_batch_rows(batch))
    bkey = next((k for k in ("batch_size", "B", "batch") if rows and k in rows[0]), None)
    mkey = next((k for k in ("method", "mode", "name") if rows and k in rows[0]), None)
    if not rows or bkey is None or "tokens_per_s" not in rows[0]:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    methods = list(dict.fromkeys(r.get(mkey, "?") for r in rows)) if mkey else ["?"]
    for m in methods:
        pts = sorted((r[bkey], r["tokens_per_s"]) for r in rows
                     if (mkey is None or r.get(mkey) == m) and r.get("tokens_per_s") is not None)
        if pts:
            style = "s-" if m == "adaptive" else ("k--" if m == "plain" else "o:")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=str(m), lw=2 if m == "adaptive" else 1)
    ax.set_xscale("log", base=2)
    sizes = sorted({r[bkey] for r in rows})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (all rows)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    drafter = batch.get("drafter")
    fig.suptitle(_title(results, "batch sweep" + (f" (drafter {drafter})" if drafter else "")), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_engine(results: dict, path: str) -> str | None:
    """Throughput and p99 inter-token latency against load, one line per method: closed loop (clients) on the
    left, Poisson arrivals (requests/s) on the right."""
    eng = results.get("engine")
    if not isinstance(eng, dict) or not eng.get("rows"):
        return None
    rows = eng["rows"]
    kinds = [k for k in ("closed", "poisson") if any(r["load"] == k for r in rows)]
    plt = _plt()
    fig, axes = plt.subplots(2, len(kinds), figsize=(6.5 * len(kinds), 8), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for j, kind in enumerate(kinds):
        for m in methods:
            pts = sorted((r["value"], r) for r in rows if r["load"] == kind and r["method"] == m)
            style = "s-" if m == "adaptive" else ("ko--" if m == "plain" else "o:")
            lw = 2 if m == "adaptive" else 1
            xs = [p[0] for p in pts]
            axes[0][j].plot(xs, [p[1]["tokens_per_s"] for p in pts], style, label=m, lw=lw)
            axes[1][j].plot(xs, [p[1]["itl_p99_ms"] for p in pts], style, label=m, lw=lw)
        values = sorted({r["value"] for r in rows if r["load"] == kind})
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(values, [f"{v:g}" for v in values])
            ax.minorticks_off()
            ax.set_xlabel("concurrent clients (closed loop)" if kind == "closed" else
                          "arrival rate, requests/s (Poisson)")
            ax.grid(alpha=0.3)
        axes[0][j].set_ylabel("throughput, tokens/s")
        axes[1][j].set_ylabel("inter-token latency p99, ms")
        axes[1][j].set_yscale("log")
    axes[0][0].legend(fontsize=8)
    inner = (eng.get("config") or {}).get("adaptive_inner")
    note = results.get("note")
    fig.suptitle(_title(results, "engine under load" + (f" (adaptive around {inner})" if inner else ""))
                 + (f"\n{note}" if note else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: dict, out_dir: str, stem: str) -> list[str]:
    """Writes ``<stem>_e2e.png``, ``<stem>_context.png``, ``<stem>_batch.png``, ``<stem>_engine.png`` for the
    suites present; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for suite, fn in (("e2e", plot_e2e), ("context", plot_context), ("batch", plot_batch), ("engine", plot_engine)):
        p = fn(results, os.path.join(out_dir, f"{stem}_{suite}.png"))
        if p:
            written.append(p)
    return written


def main(argv=None) -> int:
    """``python -m specdec_ext.bench.plots RESULTS.json``: redraws the PNGs next to the JSON and prints the tables."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m specdec_ext.bench.plots", description=main.__doc__)
    p.add_argument("json")
    args = p.parse_args(argv)
    with open(args.json) as f:
        results = json.load(f)
    stem = os.path.splitext(os.path.basename(args.json))[0]
    for path in plot_all(results, os.path.dirname(os.path.abspath(args.json)), stem):
        print(f"wrote {path}")
    if results.get("e2e"):
        from specdec_ext.bench.e2e import markdown_table

        print(markdown_table(results["e2e"]) + "\n")
    if results.get("context"):
        from specdec_ext.bench.context_sweep import markdown_table as context_table

        print(context_table(results["context"]))
    if results.get("engine"):
        from specdec_ext.bench.engine_load import format_table as engine_table

        print(engine_table(results["engine"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
