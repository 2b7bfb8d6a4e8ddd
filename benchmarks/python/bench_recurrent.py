"""Benchmark the recurrent tree ops (one verification step of one hybrid layer: the tree op, then the commit of the
accepted path) against the spec and against per-node state snapshots (vLLM's way, benchmarks/python/baselines.py).

Shapes of a ~15M-parameter hybrid (hidden 256-512): H = 4 or 8 heads of head dim 64 (Lightning: Dk = Dv = 64;
Gated DeltaNet: Dk = Dv = 64; Mamba-2: P = 64, Ds = 64), EAGLE-2-like trees of N = 32 nodes (depth <= 6) and
chains of 6, B = 1 and 4, float32, 4 accepted nodes per row; ours on CPU and (when available) CUDA, the spec and
the snapshots on CPU. Each timed call restores the saved state first (the same copy in every implementation).
Outputs and committed states are checked against the spec before timing. Bytes: the saved states read and
written plus the nodes' inputs read, B*H*(2*R*C + N*(inputs per node))*4. The snapshot baseline also keeps N states
per row and layer (reported as a note): ours keeps none.
"""

from __future__ import annotations

import common  # noqa: F401  (sets sys.path)
import torch

import baselines
import specdec_ext.ops as ops
from specdec_ext.ops import reference

ACCEPT = 4


def shapes(quick: bool):
    """(B, H, N, tree kind)."""
    s = [(1, 4, 32, "tree"), (4, 8, 32, "tree")]
    if not quick:
        s += [(1, 8, 6, "chain"), (4, 4, 32, "tree")]
    return s


def tree(B: int, N: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """EAGLE-2-like: the N - 1 drafts in 6 levels of equal width, each node's parent among the first 3 nodes of the
    level above (depth 6); or a chain."""
    if kind == "chain":
        return ops.chain_parents(B, N)
    width = -(-(N - 1) // 6)
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(1, N):
        level = (i - 1) // width  # level 0 hangs off the root
        first = 0 if level == 0 else 1 + (level - 1) * width
        choices = 1 if level == 0 else min(3, width)
        parents[:, i] = first + torch.randint(0, choices, (B,), generator=g)
    return parents


def accepted(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ACCEPT nodes of the path to each row's last node."""
    B, N = parents.shape
    path = torch.full((B, ACCEPT), -1, dtype=torch.int64)
    lengths = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        node, up = N - 1, []
        while node != -1:
            up.append(node)
            node = int(parents[b, node])
        nodes = up[::-1][:ACCEPT]
        path[b, :len(nodes)] = torch.tensor(nodes)
        lengths[b] = len(nodes)
    return path, lengths


def cases(B, H, N, parents, g, dev):
    """(op name, ours, spec, snapshots, inputs per node): each callable runs one step (tree op, then commit) on a
    state it is given and returns the outputs; tensors on ``dev`` (the spec and the snapshots are run on CPU)."""
    D = 64
    path, lengths = accepted(parents)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    q, k, v = rnd(B, H, N, D, scale=0.1), rnd(B, H, N, D, scale=0.1), rnd(B, H, N, D)
    log_decay = -torch.rand(H, generator=g) * 0.2
    qn, kn = torch.nn.functional.normalize(q, dim=-1) * D ** -0.5, torch.nn.functional.normalize(k, dim=-1)
    gate, beta = -torch.rand(B, H, N, generator=g) * 0.3, torch.rand(B, H, N, generator=g)
    dt = torch.nn.functional.softplus(rnd(B, H, N))
    A, Dskip = -torch.rand(H, generator=g) - 0.1, rnd(H)
    Bm, Cm = rnd(B, H, N, D, scale=0.1), rnd(B, H, N, D, scale=0.1)
    t = {name: x.to(dev) for name, x in dict(q=q, k=k, v=v, log_decay=log_decay, qn=qn, kn=kn, gate=gate, beta=beta,
                                               dt=dt, A=A, Dskip=Dskip, Bm=Bm, Cm=Cm, parents=parents, path=path,
                                               lengths=lengths).items()}

    def lin_ours(S):
        o = ops.tree_linear_attention(t["q"], t["k"], t["v"], S, t["log_decay"], t["parents"], validate=False)
        ops.commit_linear_state(S, t["k"], t["v"], t["log_decay"], t["path"], t["lengths"], validate=False)
        return o

    def lin_spec(S):
        o = reference.tree_linear_attention(q, k, v, S, log_decay, parents, validate=False)
        reference.commit_linear_state(S, k, v, log_decay, path, lengths, validate=False)
        return o

    def delta_ours(S):
        o = ops.tree_gated_delta_rule(t["qn"], t["kn"], t["v"], t["gate"], t["beta"], S, t["parents"],
                                      validate=False)
        ops.commit_gated_delta_state(S, t["kn"], t["v"], t["gate"], t["beta"], t["path"], t["lengths"],
                                     validate=False)
        return o

    def delta_spec(S):
        o = reference.tree_gated_delta_rule(qn, kn, v, gate, beta, S, parents, validate=False)
        reference.commit_gated_delta_state(S, kn, v, gate, beta, path, lengths, validate=False)
        return o

    def ssd_ours(S):
        y = ops.tree_selective_state(t["v"], t["dt"], t["A"], t["Bm"], t["Cm"], t["Dskip"], S, t["parents"],
                                     validate=False)
        ops.commit_selective_state(S, t["v"], t["dt"], t["A"], t["Bm"], t["path"], t["lengths"], validate=False)
        return y

    def ssd_spec(S):
        y = reference.tree_selective_state(v, dt, A, Bm, Cm, Dskip, S, parents, validate=False)
        reference.commit_selective_state(S, v, dt, A, Bm, path, lengths, validate=False)
        return y

    return [
        ("tree_linear_attention", lin_ours, lin_spec,
         lambda S: baselines.linear_attention_snapshots(q, k, v, S, log_decay, parents, path, lengths), 3 * D),
        ("tree_gated_delta_rule", delta_ours, delta_spec,
         lambda S: baselines.gated_delta_snapshots(qn, kn, v, gate, beta, S, parents, path, lengths), 3 * D + 2),
        ("tree_selective_state", ssd_ours, ssd_spec,
         lambda S: baselines.selective_state_snapshots(v, dt, A, Bm, Cm, Dskip, S, parents, path, lengths),
         3 * D + 1),
    ]


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    table = common.Table("recurrent tree ops (tree op + commit, one layer)")
    D = 64
    for B, H, N, kind in shapes(args.quick):
        g = torch.Generator().manual_seed(B * 100 + H * 10 + N)
        parents = tree(B, N, kind, g)
        saved = torch.randn(B, H, D, D, generator=g)
        depth = int(reference._tree_depths(parents).max())
        shape = f"B={B},H={H},N={N},{kind},depth={depth}"
        nbytes_of = {}
        for dev in common.devices(args):
            for op, ours, spec, snapshots, per_node in cases(B, H, N, parents, torch.Generator().manual_seed(1), dev):
                table.case(op, shape, "f32")
                nbytes = nbytes_of.setdefault(op, 4.0 * B * H * (2 * D * D + N * per_node))
                formula = "B*H*(2*64*64+N*inputs)*4"
                want_state = saved.clone()
                want = spec(want_state)
                got_state = saved.to(dev, copy=True)
                got = ours(got_state)
                torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(got_state.cpu(), want_state, atol=1e-4, rtol=1e-4)
                work, source = saved.to(dev).clone(), saved.to(dev)
                if dev == "cpu":
                    base_state = saved.clone()
                    torch.testing.assert_close(snapshots(base_state), want, atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(base_state, want_state, atol=1e-4, rtol=1e-4)
                    n_ref = max(3, args.repeats // 4)
                    table.add(common.Result(op, shape, "f32", "reference", "cpu", common.time_fn(
                        lambda: spec(work.copy_(source)), "cpu", n_ref), nbytes, formula, n_ref))
                    table.add(common.Result(op, shape, "f32", "baseline", "cpu", common.time_fn(
                        lambda: snapshots(work.copy_(source)), "cpu", args.repeats), nbytes, formula, args.repeats))
                table.add(common.Result(op, shape, "f32", "ours", dev, common.time_fn(
                    lambda: ours(work.copy_(source)), dev, args.repeats), nbytes, formula, args.repeats))
        table.note(f"{shape}: the snapshot baseline keeps N * H * 64 * 64 * 4 = {N * H * D * D * 4 / 2**20:.1f} MiB "
                   "of per-node states per row and layer; ours keeps none; each timed call first restores the saved "
                   "state (the same copy in every implementation)")
    return common.finish(table, args)


if __name__ == "__main__":
    main()
