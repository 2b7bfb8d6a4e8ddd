"""Vectorised pure-PyTorch baselines: what a user would write with torch ops, without our kernels.

They follow the semantics of specdec_ext.ops.reference (same outputs on the benchmark inputs) but process whole
tensors: argmax / softmax / sort over every [B, N, V] row, then a short tree walk with tensor ops. They run on the
device of their inputs.
"""

from __future__ import annotations

import math

import torch

from specdec_ext.ops import reference  # (the specs' per-node state recurrence, for the snapshot baselines)


# ----------------------------------------------------------------------------------------------------------------
# Trees.


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """anc[b, i, j] = j is i or an ancestor of i, by repeated squaring of (self | parent) (log2 N matmuls)."""
    B, N = parents.shape
    dev = parents.device
    eye = torch.eye(N, dtype=torch.float32, device=dev).expand(B, N, N)
    onehot = torch.zeros(B, N, N + 1, dtype=torch.float32, device=dev)
    onehot.scatter_(2, (parents + 1).clamp(min=0).unsqueeze(-1) + 0, 1.0)  # column 0 = "no parent"
    m = ((eye + onehot[..., 1:]) > 0).float()
    for _ in range(max(1, math.ceil(math.log2(max(N, 2))))):
        m = (torch.bmm(m, m) > 0).float()
    return m > 0


def build_tree(parents: torch.Tensor, prefix_lens: torch.Tensor):
    B, N = parents.shape
    dev = parents.device
    anc = ancestor_matrix(parents)
    depth = anc.sum(-1) - 1
    position_ids = prefix_lens.unsqueeze(1) + depth
    idx = torch.arange(N, device=dev)
    children = parents.unsqueeze(1) == idx.view(1, N, 1)  # [B, u, c]
    has_child = children.any(-1)
    first_child = torch.where(has_child, children.int().argmax(-1), torch.full_like(depth, -1))
    same_parent = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (idx.view(1, 1, N) > idx.view(1, N, 1))
    same_parent &= (idx > 0).view(1, N, 1)
    next_sibling = torch.where(same_parent.any(-1), same_parent.int().argmax(-1), torch.full_like(depth, -1))
    leaf = ~has_child
    num_leaves = leaf.sum(-1)
    rank = leaf.cumsum(-1) - 1
    paths = torch.full((B, N, N), -1, dtype=torch.int64, device=dev)
    b_i, l_i, j_i = (anc & leaf.unsqueeze(-1)).nonzero(as_tuple=True)
    paths[b_i, rank[b_i, l_i], depth[b_i, j_i]] = j_i
    return depth, position_ids, first_child, next_sibling, paths, num_leaves


def tree_ancestor_mask(parents: torch.Tensor, packed: bool = False) -> torch.Tensor:
    anc = ancestor_matrix(parents)
    if not packed:
        return anc
    B, N, _ = anc.shape
    W = (N + 31) // 32
    padded = torch.zeros(B, N, W * 32, dtype=torch.int64, device=anc.device)
    padded[..., :N] = anc.long()
    words = (padded.view(B, N, W, 32) << torch.arange(32, device=anc.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ----------------------------------------------------------------------------------------------------------------
# Target distributions.


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Rows of logits [M, V] -> filtered distributions [M, V] (float32): temperature, top-k and top-p from the
    descending order (torch.topk when every row has a top-k filter, else a full sort; ties at the thresholds kept),
    temperature 0 = one-hot argmax."""
    x = logits.float()
    M, V = x.shape
    greedy = temperature == 0
    x = x / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    k = torch.where((top_k <= 0) | (top_k >= V), torch.full_like(top_k, V), top_k)
    if not bool((k < V).any()) and not bool((top_p < 1).any()):
        # No filter at all: plain softmax (no sort).
        w = torch.exp(x - x.max(-1, keepdim=True).values)
        onehot = torch.zeros_like(w).scatter_(1, logits.float().argmax(-1, keepdim=True), 1.0)
        w = torch.where(greedy.unsqueeze(1), onehot, w)
        return w / w.sum(-1, keepdim=True)
    if bool((k < V).all()):
        # Every row has a top-k filter: the k largest (torch.topk) are all that top-k / top-p need (a user would
        # not sort the whole vocabulary here). Ties beyond the k-th value are still kept by `x >= kth`.
        sorted_x, order = x.topk(int(k.max()), dim=-1)
    else:
        sorted_x, order = x.sort(dim=-1, descending=True)
    keep = x >= sorted_x.gather(1, (k - 1).unsqueeze(1))
    w = torch.exp(x - sorted_x[:, :1]) * keep
    if bool((top_p < 1).any()):
        ws = w.gather(1, order)  # kept tokens come first in descending-x order
        cums = ws.cumsum(-1)
        need = (top_p * w.sum(-1)).unsqueeze(1)
        m = (cums < need).sum(-1, keepdim=True)
        m = torch.minimum(torch.minimum(m, keep.sum(-1, keepdim=True) - 1),
                          torch.full_like(m, sorted_x.shape[1] - 1))
        keep_p = x >= sorted_x.gather(1, m)
        w = torch.where((top_p < 1).unsqueeze(1), w * keep_p, w)
    onehot = torch.zeros_like(w).scatter_(1, logits.float().argmax(-1, keepdim=True), 1.0)
    w = torch.where(greedy.unsqueeze(1), onehot, w)
    return w / w.sum(-1, keepdim=True)


def inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows [M, V], uniforms [M] -> first token whose running sum exceeds u * sum (else the last positive)."""
    cums = w.cumsum(-1)
    t = torch.searchsorted(cums, (u * cums[:, -1]).unsqueeze(1).contiguous(), right=True).squeeze(1)
    V = w.shape[1]
    last_pos = V - 1 - (w > 0).flip(-1).int().argmax(-1)
    bad = t >= V
    t = torch.where(bad, last_pos, t.clamp(max=V - 1))
    return torch.where(w.gather(1, t.unsqueeze(1)).squeeze(1) > 0, t, last_pos)


# ----------------------------------------------------------------------------------------------------------------
# Verification.


def _children_lists(parents: torch.Tensor):
    out = []
    for row in parents.tolist():
        kids = [[] for _ in row]
        for c in range(1, len(row)):
            kids[row[c]].append(c)
        out.append(kids)
    return out


def verify_tree_greedy(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
    """argmax over all [B, N, V] rows, then a vectorised walk (one step per tree level for all rows at once)."""
    B, N, V = logits.shape
    dev = logits.device
    am = logits.argmax(-1)  # [B, N], first maximum
    match = tokens == am.gather(1, parents.clamp(min=0))
    match[:, 0] = False
    idx = torch.arange(N, device=dev)
    node = torch.zeros(B, dtype=torch.int64, device=dev)
    accepted = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    accepted[:, 0] = 0
    accept_len = torch.zeros(B, dtype=torch.int64, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    rows = torch.arange(B, device=dev)
    for _ in range(N - 1):
        cand = (parents == node.unsqueeze(1)) & match & (idx > 0)
        has = cand.any(-1) & active
        if not bool(has.any()):
            break
        nxt = cand.int().argmax(-1)
        accept_len = accept_len + has.long()
        accepted[rows[has], accept_len[has]] = nxt[has]
        node = torch.where(has, nxt, node)
        active = has
    return accepted, accept_len, am.gather(1, node.unsqueeze(1)).squeeze(1)


def verify_tree_sampling(logits, tokens, parents, draft_probs, uniforms, temperature, top_k, top_p):
    """Filtered target distributions (sort-based top-k / top-p) for ALL B * N rows, then the rejection walk."""
    B, N, V = logits.shape
    dev = logits.device
    probs = filtered_probs(logits.reshape(B * N, V), temperature.repeat_interleave(N), top_k.repeat_interleave(N),
                           top_p.repeat_interleave(N)).view(B, N, V)
    kids = _children_lists(parents)
    toks = tokens.tolist()
    accepted = torch.full((B, N), -1, dtype=torch.int64)
    accept_len = torch.zeros(B, dtype=torch.int64)
    residuals = []
    u_all = uniforms.float().cpu()
    for b in range(B):
        node, path = 0, [0]
        while True:
            target = probs[b, node]
            r = target
            q = None if draft_probs is None else draft_probs[b, node]
            moved = False
            for c in kids[b][node]:
                tok = toks[b][c]
                qx = 1.0 if q is None else q[tok]
                if bool(u_all[b, c] * qx * r.sum() < r[tok]):
                    node, moved = c, True
                    path.append(c)
                    break
                if q is None:
                    r = r.clone()
                    r[tok] = 0.0
                else:
                    r = torch.clamp(r - q * r.sum(), min=0.0)
                if not bool(r.sum() > 0):
                    r = target
            if not moved:
                break
        residuals.append(r)
        accepted[b, : len(path)] = torch.tensor(path)
        accept_len[b] = len(path) - 1
    next_token = inverse_cdf(torch.stack(residuals), uniforms[:, 0].float())
    return accepted.to(dev), accept_len.to(dev), next_token


def verify_tree_typical(logits, tokens, parents, uniforms, temperature, posterior_threshold, posterior_alpha):
    """softmax + entropy over ALL rows, per-node acceptability, then the deepest fully acceptable path."""
    B, N, V = logits.shape
    dev = logits.device
    T = temperature.float().unsqueeze(1).unsqueeze(2)
    x = logits.float()
    greedy = (temperature == 0).view(B, 1, 1)
    p = torch.softmax(x / torch.where(greedy, torch.ones_like(T), T), -1)
    onehot = torch.zeros_like(p).scatter_(2, x.argmax(-1, keepdim=True), 1.0)
    p = torch.where(greedy, onehot, p)
    ent = -(p * torch.log(p.clamp(min=1e-38))).sum(-1)
    thr = torch.clamp(posterior_alpha * torch.exp(-ent), max=posterior_threshold)  # [B, N]
    par = parents.clamp(min=0)
    p_tok = p.gather(1, par.unsqueeze(-1).expand(B, N, V)).gather(2, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ok = p_tok > thr.gather(1, par)
    ok[:, 0] = True
    depth = torch.zeros(B, N, dtype=torch.int64, device=dev)
    for c in range(1, N):  # topological order: parents come first
        ok[:, c] &= ok.gather(1, par[:, c : c + 1]).squeeze(1)
        depth[:, c] = depth.gather(1, par[:, c : c + 1]).squeeze(1) + 1
    idx = torch.arange(N, device=dev)
    score = torch.where(ok, depth * (N + 1) + (N - idx), torch.full_like(depth, -1))
    last = score.argmax(-1)
    accept_len = depth.gather(1, last.unsqueeze(1)).squeeze(1)
    accepted = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    node = last.clone()
    rows = torch.arange(B, device=dev)
    for _ in range(int(accept_len.max()) + 1):
        live = node >= 0
        pos = depth.gather(1, node.clamp(min=0).unsqueeze(1)).squeeze(1)
        accepted[rows[live], pos[live]] = node[live]
        node = torch.where(live, parents.gather(1, node.clamp(min=0).unsqueeze(1)).squeeze(1), node)
    next_token = inverse_cdf(p[rows, last], uniforms.float())
    return accepted, accept_len, next_token


# ----------------------------------------------------------------------------------------------------------------
# Draft sampling.


def sample_tokens(logits, uniforms, temperature, top_k, top_p):
    """torch softmax + top-k / top-p (torch.topk, or a full sort without top-k), then inverse CDF with the same
    uniforms (torch.multinomial would draw different tokens; the cost is the same)."""
    probs = filtered_probs(logits, temperature, top_k, top_p)
    return inverse_cdf(probs, uniforms.float()), probs


def expand_tree_step(logits, parent_scores, top_k: int, num_select: int):
    lp = torch.log_softmax(logits.float(), -1)
    vals, cand_tokens = lp.topk(top_k, dim=-1)
    cand_scores = parent_scores.unsqueeze(-1) + vals
    selected = cand_scores.flatten(1).topk(num_select, dim=-1).indices
    return cand_tokens, cand_scores, selected


# ----------------------------------------------------------------------------------------------------------------
# Attention and KV-cache compaction.


def tree_attention_dense_mask(prefix_lens: torch.Tensor, tree_mask: torch.Tensor, S: int) -> torch.Tensor:
    """The equivalent dense boolean SDPA mask [B, 1, N, S]: prefix positions, then the tree mask at prefix + j."""
    B, N = tree_mask.shape[0], tree_mask.shape[1]
    dev = tree_mask.device
    pos = torch.arange(S, device=dev)
    prefix = prefix_lens.view(B, 1, 1)
    in_prefix = (pos.view(1, 1, S) < prefix).expand(B, N, S)
    j = (pos.view(1, 1, S) - prefix).expand(B, N, S)
    in_tree = (j >= 0) & (j < N)
    tree = torch.gather(tree_mask, 2, j.clamp(0, N - 1)) & in_tree
    return (in_prefix | tree).unsqueeze(1)


def tree_attention_sdpa(q, k_cache, v_cache, dense_mask, scale):
    """torch SDPA with the dense mask (built once, outside the timing) and grouped-query attention."""
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=dense_mask, scale=scale,
                                                            enable_gqa=True)


def compact_kv(caches, src_positions, dst_start, lengths, seq_dim: int):
    """Per cache: advanced indexing on the [B, S, ...] view (the right side is a copy, so all reads come first).
    Rows with equal lengths only (the benchmark's case), so one gather/scatter per cache covers the batch."""
    B = src_positions.shape[0]
    n = int(lengths[0])
    dev = src_positions.device
    rows = torch.arange(B, device=dev).view(B, 1)
    dst = dst_start.view(B, 1) + torch.arange(n, device=dev).view(1, n)
    src = src_positions[:, :n]
    for c in caches:
        view = c.movedim(seq_dim, 1)
        view[rows, dst] = view[rows, src]


# ----------------------------------------------------------------------------------------------------------------
# Recurrent layers over a tree, vLLM's way: one state snapshot per draft node (all nodes' states computed level by
# level from their parents' and kept), the commit a copy of the accepted node's snapshot.


def _linear_step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    return S * log_a.exp()[..., None, None] + k[..., :, None] * v[..., None, :]


def _commit_snapshot(state: torch.Tensor, snapshots: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor):
    """state[b] <- snapshots[b, :, path[b, lengths[b] - 1]] where lengths[b] > 0 (in place)."""
    last = path.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0].clamp(min=0)
    taken = snapshots[torch.arange(state.shape[0], device=state.device), :, last]
    state.copy_(torch.where((lengths > 0)[:, None, None, None], taken, state))


def linear_attention_snapshots(q, k, v, state, log_decay, parents, path, lengths):
    """Outputs of tree_linear_attention and, in place, commit_linear_state's state, through per-node snapshots."""
    B, H, N, _ = q.shape
    log_a = log_decay[None, :, None].expand(B, H, N)
    snaps = reference._tree_states(_linear_step, state, parents, k, v, log_a)  # [B, H, N, Dk, Dv]
    out = (snaps * q.float()[..., :, None]).sum(-2)
    _commit_snapshot(state, snaps, path, lengths)
    return out


def gated_delta_snapshots(q, k, v, g, beta, state, parents, path, lengths):
    snaps = reference._tree_states(reference._delta_step, state, parents, k, v, g, beta)
    out = (snaps * q.float()[..., :, None]).sum(-2)
    _commit_snapshot(state, snaps, path, lengths)
    return out


def selective_state_snapshots(x, dt, A, Bm, Cm, D, state, parents, path, lengths):
    B, H, N = dt.shape
    snaps = reference._tree_states(reference._ssd_step, state, parents, x, dt, A[None, :, None].expand(B, H, N), Bm)
    out = (snaps * Cm.float()[..., None, :]).sum(-1) + D[None, :, None, None] * x.float()
    _commit_snapshot(state, snaps, path, lengths)
    return out
