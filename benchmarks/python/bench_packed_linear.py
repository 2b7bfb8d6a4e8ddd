"""Benchmark packed_linear: few-row products over weights packed once (ours) vs aten's F.linear (the baseline).

Cases: every weight matrix of a Llama model run as one decoding forward does (q, k, v, o, gate, up, down per layer,
then the vocabulary projection): the model family's target (8 layers, hidden 384, SwiGLU 1024, vocabulary 4096;
14 M weights) and, on CUDA or in full mode, a 1.1 B Llama's (22 layers, hidden 2048, 5632, vocabulary 32000). Two
copies of the weights are used alternately, so on CPU they stream from memory (more than the last-level cache), as
in decoding. M = rows per product: 1 (plain decoding), 2-16 (tree verification, drafting), 64 (a prefill chunk).
Bytes: the weights read once per forward (sum of N*K*elem); GB/s = bytes / time. Checked first: ours against
F.linear in float64 within float32 accumulation error. Goal (reported, not asserted): on CPU, 9 rows cost at most
1.5x one row (aten float32: 1.8x).
"""

from __future__ import annotations

import common  # noqa: F401  (sets sys.path)
import torch
import torch.nn.functional as F

import specdec_ext.ops as ops

OP = "packed_linear"
MODELS = {  # name: (layers, hidden, intermediate, kv width, vocabulary)
    "family": (8, 384, 1024, 128, 4096),
    "llama-1.1b": (22, 2048, 5632, 256, 32000),
}


def model_shapes(name: str) -> list[tuple[int, int]]:
    """(N, K) of every product of one forward, in order."""
    layers, h, f, kv, vocab = MODELS[name]
    per_layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    return per_layer * layers + [(vocab, h)]


def cases(args):
    rows = [1, 2, 5, 9, 16] if args.quick else [1, 2, 5, 9, 12, 16, 64]
    out = [("family", dt, m) for dt in (torch.float32, torch.bfloat16) for m in rows]
    if common.want_gpu_shapes(args):
        out += [("llama-1.1b", torch.bfloat16, m) for m in (1, 9, 16)]
    return out


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table(OP)
    for dev in common.devices(args):
        built: dict = {}
        for name, dtype, M in cases(args):
            if name != "family" and dev == "cpu" and args.quick:
                continue
            key = (name, dtype)
            if key not in built:
                g = torch.Generator(device=dev).manual_seed(0)  # drawn on the device: a 1.1B model in seconds
                copies = []
                for _ in range(2):
                    ws = [(torch.randn(N, K, generator=g, device=dev) * K ** -0.5).to(dtype)
                          for N, K in model_shapes(name)]
                    copies.append([(w, ops.pack_linear_weight(w)) for w in ws])
                built = {key: copies}
            copies = built[key]
            widths = sorted({w.shape[1] for w, _ in copies[0]})
            g = torch.Generator().manual_seed(M)
            xs = {K: torch.randn(M, K, generator=g).to(dtype).to(dev) for K in widths}
            w0, p0 = copies[0][-1]
            want = F.linear(xs[w0.shape[1]].double(), w0.double())
            got = ops.packed_linear(xs[w0.shape[1]], p0, None, w0.shape[0])
            K = w0.shape[1]
            tol = 1e-6 * K if dtype == torch.float32 else 1e-2
            common.check_close(f"{OP} {name} M={M}", got.double(), want, atol=tol * float(want.abs().max() + 1),
                               rtol=0)
            state = {"i": 0}

            def forward(use_ours: bool):
                ws = copies[state["i"] % 2]
                state["i"] += 1
                for w, p in ws:
                    x = xs[w.shape[1]]
                    if use_ours:
                        ops.packed_linear(x, p, None, w.shape[0])
                    else:
                        F.linear(x, w)

            shape = f"{name},M={M}"
            dname = common.dtype_name(dtype)
            table.case(OP, shape, dname)
            es = torch.empty((), dtype=dtype).element_size()
            nbytes = float(sum(n * k for n, k in model_shapes(name)) * es)
            formula = f"sum(N*K)*{es} ({len(model_shapes(name))} matrices of {name})"
            repeats = max(4, args.repeats // (4 if name != "family" else 1))
            table.add(common.Result(OP, shape, dname, "baseline", dev, common.time_fn(
                lambda: forward(False), dev, repeats, warmup=2), nbytes, formula, repeats))
            table.add(common.Result(OP, shape, dname, "ours", dev, common.time_fn(
                lambda: forward(True), dev, repeats, warmup=2), nbytes, formula, repeats))
        print(f"  check: ours equals F.linear in float64 within float32 accumulation error; bytes: weights once")
    rows_cost = {}
    for r in table.results:
        if r.op == OP and r.shape.startswith("family,"):
            rows_cost[(r.impl, r.device, r.dtype, int(r.shape.split("M=")[1]))] = r.median_ms
    for (impl, dev, dname, m), ms in sorted(rows_cost.items()):
        one = rows_cost.get((impl, dev, dname, 1))
        if m == 9 and one:
            table.note(f"{impl} {dev} {dname}: 9 rows cost {ms / one:.2f}x one row (goal for ours on CPU: <= 1.5x)")
    return common.finish(table, args)


if __name__ == "__main__":
    main()
