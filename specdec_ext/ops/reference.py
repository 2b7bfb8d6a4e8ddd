"""Executable specification of every op: plain PyTorch, written for clarity, not speed.

Tests, benchmarks and documentation compare the C++ and CUDA kernels against these functions. Each mirrors the
schema of ``torch.ops.specdec_ext.<name>`` (same arguments, same outputs) and the conventions of
``csrc/kernels/common/params.h``:

* ``parents[B, N]`` (int64) describes a tree per row: node 0 is the root (parent -1), every other node's parent is
  an earlier node. Children are visited in increasing node index.
* Verification outputs ``accepted[B, N]`` (accepted path, root first, padded with -1), ``accept_len[B]`` (accepted
  draft tokens, root excluded) and ``next_token[B]`` (correction or bonus token).
* Randomness is an input (``uniforms``), so every implementation draws the same tokens.
* Invalid data (a malformed tree, an out-of-range token, NaN logits, bad sampling parameters) raises ``ValueError``
  when ``validate`` is true; otherwise the row gets sentinel outputs (-1 indices, 0 lengths, false masks).

Logits are read as float32 and weights ``w = exp(x - max)`` are float32; every SUM of weights (normalisers, running
sums for top-p and inverse-CDF sampling, acceptance tests) is accumulated in float64. Float32 accumulation over a
32k vocabulary drifts by ~1e-4 relative, enough to move a top-p cut or a sampled token; float64 makes every
implementation agree except at measure-zero boundaries.
"""

from __future__ import annotations

import math

import torch

# Status codes, as in csrc/kernels/common/status.h.
OK = 0
ROOT_NOT_MINUS_ONE = 1
PARENT_NOT_EARLIER = 2
TOKEN_OUT_OF_RANGE = 3
NON_FINITE_LOGITS = 4
NO_VALID_TOKEN = 5
BAD_TEMPERATURE = 6
BAD_TOP_P = 7
BAD_DRAFT_PROB = 8
BAD_PREFIX_LEN = 9
BAD_LENGTH = 10
BAD_DST_START = 11
BAD_SRC_POSITION = 12
BAD_WRITE_SLOT = 13
BAD_SELECTED = 14
BAD_COLUMN = 15
BAD_CANDIDATE_PARENT = 16
BAD_TOP_K = 17
BAD_UNIFORM = 18
BAD_TREE_PREFIX_LEN = 19
BAD_LOG_DECAY = 20
BAD_PATH_NODE = 21

# Temperatures below this are greedy (vLLM's sampling epsilon): a smaller divisor can overflow float32 logits.
GREEDY_TEMPERATURE = float(torch.tensor(1e-5, dtype=torch.float32))


class _RowError(Exception):
    """A validation failure inside one row: (code, node, value)."""

    def __init__(self, code: int, node: int, value: int):
        super().__init__(code, node, value)
        self.code, self.node, self.value = code, node, value


def status_message(op: str, row: int, code: int, node: int, value: int) -> str:
    """The error text shared by the reference and the C++ glue (csrc/ops/checks.h keeps the same wording)."""
    b = row
    if code == ROOT_NOT_MINUS_ONE:
        return f"{op}: parents[{b}, 0] must be -1 (node 0 is the root), got {value}"
    if code == PARENT_NOT_EARLIER:
        return (f"{op}: parents[{b}, {node}] = {value} is not an earlier node: expected 0 <= parent < {node} "
                "(nodes are topologically ordered and only node 0 is a root)")
    if code == TOKEN_OUT_OF_RANGE:
        return f"{op}: tokens[{b}, {node}] = {value} is out of range for the vocabulary"
    # node < 0 marks a 2-D logits matrix (sample_tokens), where the batch row is the logits row.
    where = f"logits[{b}, {node}" if node >= 0 else f"logits[{b}"
    if code == NON_FINITE_LOGITS:
        return f"{op}: {where}, {value}] is NaN or +inf"
    if code == NO_VALID_TOKEN:
        return f"{op}: {where}] is -inf everywhere: no token can be chosen"
    if code == BAD_TEMPERATURE:
        return f"{op}: temperature[{b}] must be finite and >= 0 (0 = greedy)"
    if code == BAD_TOP_P:
        return f"{op}: top_p[{b}] must be in (0, 1]"
    if code == BAD_DRAFT_PROB:
        return f"{op}: draft_probs[{b}, {node}, {value}] is negative or NaN"
    if code == BAD_PREFIX_LEN:
        return (f"{op}: prefix_lens[{b}] = {value} is out of range: need 0 <= prefix_lens[b] <= S - N (the tree "
                "nodes' keys and values sit at prefix_lens[b] + j)")
    if code == BAD_LENGTH:
        return f"{op}: lengths[{b}] = {value} is out of range: need 0 <= lengths[b] <= L"
    if code == BAD_DST_START:
        return f"{op}: dst_start[{b}] = {value} is out of range: need 0 <= dst_start[b] <= S - lengths[b]"
    if code == BAD_SRC_POSITION:
        return f"{op}: src_positions[{b}, {node}] = {value} is out of range [0, S)"
    if code == BAD_SELECTED:
        return f"{op}: selected[{b}, {node}] = {value} is out of range [0, F * top_k)"
    if code == BAD_COLUMN:
        return f"{op}: column[{b}, {node}] = {value} is out of range [0, C) (C: the ancestor table's columns)"
    if code == BAD_CANDIDATE_PARENT:
        return (f"{op}: parents[{b}, {node}] = {value}: candidate {node} is kept but its parent is not a kept "
                "earlier candidate")
    if code == BAD_WRITE_SLOT:
        return f"{op}: write_slots[{b}, {node}] = {value} is out of range [0, S) (S: the cache's positions)"
    if code == BAD_TOP_K:
        return f"{op}: top_k[{b}] = {value} must be >= 0 (0 = no top-k)"
    if code == BAD_UNIFORM:
        at = f"uniforms[{b}, {node}]" if node >= 0 else f"uniforms[{b}]"
        return f"{op}: {at} must be in [0, 1) (a torch.rand draw)"
    if code == BAD_TREE_PREFIX_LEN:
        return (f"{op}: prefix_lens[{b}] = {value} is out of range: need 0 <= prefix_lens[b] <= 2^63 - N (position ids "
                "prefix_lens[b] + depth must fit int64)")
    if code == BAD_LOG_DECAY:
        return f"{op}: log_decay[{node}] must be finite and <= 0 (a decay exp(log_decay) in (0, 1])"
    if code == BAD_PATH_NODE:
        return f"{op}: path[{b}, {node}] = {value} is out of range [0, N) (N: the tree's nodes)"
    return f"{op}: row {b}: unknown status {code}"


# ----------------------------------------------------------------------------------------------------------------
# Tree validation and topology.


def _check_tree_row(parents_row: list[int]) -> None:
    if parents_row[0] != -1:
        raise _RowError(ROOT_NOT_MINUS_ONE, 0, parents_row[0])
    for i in range(1, len(parents_row)):
        if not 0 <= parents_row[i] < i:
            raise _RowError(PARENT_NOT_EARLIER, i, parents_row[i])


INT64_MAX = 2**63 - 1


def _check_tree_prefix(prefix: int, N: int) -> None:
    """Position ids prefix + depth (depth <= N - 1) must fit int64."""
    if not 0 <= prefix <= INT64_MAX - (N - 1):
        raise _RowError(BAD_TREE_PREFIX_LEN, 0, prefix)


def _children(parents_row: list[int], node: int) -> list[int]:
    return [c for c in range(node + 1, len(parents_row)) if parents_row[c] == node]


def _depths(parents_row: list[int]) -> list[int]:
    depth = [0] * len(parents_row)
    for i in range(1, len(parents_row)):
        depth[i] = depth[parents_row[i]] + 1
    return depth


def _raise(op: str, row: int, err: _RowError) -> None:
    raise ValueError(status_message(op, row, err.code, err.node, err.value))


def build_tree(parents: torch.Tensor, prefix_lens: torch.Tensor, validate: bool = True):
    """Topology of each row's tree.

    Returns ``depth[B, N]``, ``position_ids[B, N]`` (prefix_lens + depth), ``first_child[B, N]``,
    ``next_sibling[B, N]``, ``retrieve_paths[B, N, N]`` (row l < num_leaves: the root-to-leaf path of the l-th leaf
    in increasing node order, padded with -1) and ``num_leaves[B]``; all int64.
    """
    B, N = parents.shape
    depth = torch.full((B, N), -1, dtype=torch.int64)
    position_ids = torch.full((B, N), -1, dtype=torch.int64)
    first_child = torch.full((B, N), -1, dtype=torch.int64)
    next_sibling = torch.full((B, N), -1, dtype=torch.int64)
    paths = torch.full((B, N, N), -1, dtype=torch.int64)
    num_leaves = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        row = parents[b].tolist()
        try:
            _check_tree_prefix(int(prefix_lens[b]), N)
            _check_tree_row(row)
        except _RowError as err:
            if validate:
                _raise("build_tree", b, err)
            continue
        d = _depths(row)
        depth[b] = torch.tensor(d)
        position_ids[b] = int(prefix_lens[b]) + torch.tensor(d)
        leaf = 0
        for i in range(N):
            kids = _children(row, i)
            if kids:
                first_child[b, i] = kids[0]
                for a, c in zip(kids, kids[1:]):
                    next_sibling[b, a] = c
            else:
                path, node = [], i
                while node != -1:
                    path.append(node)
                    node = row[node]
                paths[b, leaf, : len(path)] = torch.tensor(path[::-1])
                leaf += 1
        num_leaves[b] = leaf
    dev = parents.device
    return (depth.to(dev), position_ids.to(dev), first_child.to(dev), next_sibling.to(dev), paths.to(dev),
            num_leaves.to(dev))


def tree_ancestor_mask(parents: torch.Tensor, packed: bool = False, validate: bool = True) -> torch.Tensor:
    """``mask[b, i, j]`` is true when node j is node i or one of its ancestors.

    Dense: bool ``[B, N, N]``. Packed: int32 ``[B, N, ceil(N / 32)]``, bit ``j % 32`` of word ``j // 32``, least
    significant bit first (a little-endian uint8 view is FlashInfer's ``bitorder="little"``).
    """
    B, N = parents.shape
    dense = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        row = parents[b].tolist()
        try:
            _check_tree_row(row)
        except _RowError as err:
            if validate:
                _raise("tree_ancestor_mask", b, err)
            continue
        for i in range(N):
            node = i
            while node != -1:
                dense[b, i, node] = True
                node = row[node]
    if not packed:
        return dense.to(parents.device)
    W = (N + 31) // 32
    padded = torch.zeros(B, N, W * 32, dtype=torch.int64)
    padded[..., :N] = dense.to(torch.int64)
    weights = (2 ** torch.arange(32, dtype=torch.int64))
    words = (padded.view(B, N, W, 32) * weights).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # reinterpret as signed
    return words.to(parents.device)


# ----------------------------------------------------------------------------------------------------------------
# Target distributions.


def _check_logits_row(x: torch.Tensor, node: int) -> None:
    bad = torch.isnan(x) | (x == math.inf)
    if bool(bad.any()):
        raise _RowError(NON_FINITE_LOGITS, node, int(bad.nonzero()[0, 0]))
    if bool((x == -math.inf).all()):
        raise _RowError(NO_VALID_TOKEN, node, -1)


def _check_sampling_params(temperature: float, top_k: int | None = None, top_p: float | None = None) -> None:
    """The ranges of specdec_ext.generate: temperature finite and >= 0, top_k >= 0, top_p in (0, 1] (None: the op
    has no such filter). Checked in this order."""
    if not 0 <= temperature < math.inf:  # also catches NaN
        raise _RowError(BAD_TEMPERATURE, 0, 0)
    if top_k is not None and top_k < 0:
        raise _RowError(BAD_TOP_K, 0, top_k)
    if top_p is not None and not 0 < top_p <= 1:
        raise _RowError(BAD_TOP_P, 0, 0)


def _check_uniforms(u: list[float], columns: bool) -> None:
    """Every uniform in [0, 1) (torch.rand's range); ``columns``: name the column of a [B, N] row, else node -1."""
    for c, v in enumerate(u):
        if not 0 <= v < 1:  # also catches NaN
            raise _RowError(BAD_UNIFORM, c if columns else -1, 0)


def _first_argmax(x: torch.Tensor) -> int:
    return int((x == x.max()).nonzero()[0, 0])


def filtered_weights(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Unnormalised target weights ``w`` of one row (``w / w.sum()`` is the distribution), as in params.h.

    temperature below 1e-5 (GREEDY_TEMPERATURE) gives one-hot weights on the first argmax. Otherwise, with ``l`` the
    logits: top-k keeps ``l >= k-th largest l``; ``w = exp((l - max l) / temperature)`` on kept tokens (<= 1: no
    finite logit overflows float32 at any temperature, where ``l / temperature`` would for ``|l| > 3.4e38 *
    temperature``); top-p then keeps ``l >= l_m`` where ``m`` is the first position, in descending-l order, at which
    the running sum of ``w`` reaches ``top_p * sum(w)``. Ties at either threshold are kept. Rankings use ``l`` itself
    (the order of ``l / temperature`` without its rounding ties). The temperature must be finite (validated before):
    at +inf, ``-inf / inf`` is NaN and the limit depends on top-k, so both refuse it.
    """
    x = logits_row.float()
    V = x.numel()
    if temperature < GREEDY_TEMPERATURE:
        w = torch.zeros(V)
        w[_first_argmax(x)] = 1.0
        return w
    scaled = (x - x.max()) / torch.tensor(temperature, dtype=torch.float32)  # log-weights, <= 0
    keep = torch.ones(V, dtype=torch.bool)
    if 0 < top_k < V:
        kth = torch.sort(x, descending=True).values[top_k - 1]
        keep &= x >= kth
    w = torch.where(keep, torch.exp(scaled), torch.zeros(()))
    if top_p < 1:
        order = torch.sort(torch.where(keep, x, torch.tensor(-math.inf)), descending=True, stable=True).indices
        running = torch.cumsum(w[order].double(), 0)
        hit = (running >= top_p * w.double().sum()).nonzero()
        # If rounding leaves the running sum short of top_p * sum(w), every kept token stays.
        m = int(hit[0, 0]) if hit.numel() else int(keep.sum()) - 1
        keep &= x >= x[order[m]]
        w = torch.where(keep, w, torch.zeros(()))
    return w


def _sum64(w: torch.Tensor) -> float:
    return float(w.double().sum())


def _inverse_cdf(w: torch.Tensor, u: float) -> int:
    """First token whose running sum of ``w`` exceeds ``u * sum(w)`` (float64 sums); the last positive token if none
    does."""
    running = torch.cumsum(w.double(), 0)
    hit = (running > u * w.double().sum()).nonzero()
    if hit.numel():
        return int(hit[0, 0])
    return int((w > 0).nonzero()[-1, 0])


def _verify_outputs(B: int, N: int):
    return (torch.full((B, N), -1, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
            torch.full((B,), -1, dtype=torch.int64))


def _check_tokens(tokens_row: list[int], V: int) -> None:
    for i in range(1, len(tokens_row)):
        if not 0 <= tokens_row[i] < V:
            raise _RowError(TOKEN_OUT_OF_RANGE, i, tokens_row[i])


def _to_device(dev, *tensors):
    return tuple(t.to(dev) for t in tensors)


# ----------------------------------------------------------------------------------------------------------------
# Verification.


def verify_tree_greedy(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, validate: bool = True):
    """Greedy verification: from the root, follow the first child (in sibling order) whose token equals the
    target's argmax (first maximum) at the current node; next_token is the argmax at the last accepted node."""
    B, N, V = logits.shape
    accepted, accept_len, next_token = _verify_outputs(B, N)
    for b in range(B):
        prow, trow = parents[b].tolist(), tokens[b].tolist()
        try:
            _check_tree_row(prow)
            _check_tokens(trow, V)
            node, path = 0, [0]
            while True:
                x = logits[b, node].float().cpu()
                _check_logits_row(x, node)
                best = _first_argmax(x)
                nxt = next((c for c in _children(prow, node) if trow[c] == best), None)
                if nxt is None:
                    break
                node = nxt
                path.append(node)
        except _RowError as err:
            if validate:
                _raise("verify_tree_greedy", b, err)
            continue
        accepted[b, : len(path)] = torch.tensor(path)
        accept_len[b] = len(path) - 1
        next_token[b] = best
    return _to_device(logits.device, accepted, accept_len, next_token)


def verify_tree_sampling(logits, tokens, parents, draft_probs, uniforms, temperature, top_k, top_p,
                         validate: bool = True):
    """Lossless recursive rejection sampling over the tree; see ``VerifyTreeSamplingParams`` in params.h.

    ``draft_probs[B, N, V]`` (float32) row u is the distribution u's children were drafted from (i.i.d.), or None
    for deterministic drafts (q = one-hot of the drafted token). ``uniforms[B, N]``: column c >= 1 decides node c,
    column 0 draws next_token.
    """
    B, N, V = logits.shape
    accepted, accept_len, next_token = _verify_outputs(B, N)
    for b in range(B):
        prow, trow = parents[b].tolist(), tokens[b].tolist()
        T, k, p = float(temperature[b]), int(top_k[b]), float(top_p[b])
        u = uniforms[b].float().cpu()
        try:
            _check_sampling_params(T, k, p)
            _check_uniforms(u.tolist(), columns=True)
            _check_tree_row(prow)
            _check_tokens(trow, V)
            node, path = 0, [0]
            while True:
                x = logits[b, node].float().cpu()
                _check_logits_row(x, node)
                target = filtered_weights(x, T, k, p)
                r = target.clone()
                q = None if draft_probs is None else draft_probs[b, node].float().cpu()
                moved = False
                for c in _children(prow, node):
                    tok = trow[c]
                    qx = 1.0 if q is None else float(q[tok])
                    if not qx >= 0:
                        raise _RowError(BAD_DRAFT_PROB, node, tok)
                    # accept iff u * q(x) < r(x) / sum(r), i.e. u * q(x) * sum(r) < r(x) (r kept unnormalised)
                    if float(u[c]) * qx * _sum64(r) < float(r[tok]):
                        node, moved = c, True
                        path.append(c)
                        break
                    if q is None:
                        r[tok] = 0.0
                    else:
                        r = torch.clamp(r - q * _sum64(r), min=0.0)
                    if not _sum64(r) > 0:
                        r = target.clone()
                if not moved:
                    break
        except _RowError as err:
            if validate:
                _raise("verify_tree_sampling", b, err)
            continue
        accepted[b, : len(path)] = torch.tensor(path)
        accept_len[b] = len(path) - 1
        next_token[b] = _inverse_cdf(r, float(u[0]))
    return _to_device(logits.device, accepted, accept_len, next_token)


def typical_threshold(logits_row: torch.Tensor, temperature: float, posterior_threshold: float,
                      posterior_alpha: float) -> tuple[torch.Tensor, float]:
    """Medusa's typical-acceptance rule at one node: returns (p, threshold) with p = softmax(logits / T) (one-hot
    argmax at T = 0) and threshold = min(posterior_threshold, posterior_alpha * exp(-entropy(p)))."""
    w = filtered_weights(logits_row, temperature, 0, 1.0).double()
    p = w / w.sum()
    nz = p > 0
    entropy = float(-(p[nz] * torch.log(p[nz])).sum())
    return p, min(posterior_threshold, posterior_alpha * math.exp(-entropy))


def verify_tree_typical(logits, tokens, parents, uniforms, temperature, posterior_threshold: float,
                        posterior_alpha: float, validate: bool = True):
    """Medusa typical acceptance (lossy): the deepest node whose whole root path passes the typical rule (ties:
    lowest node index); next_token is drawn from p at that node by inverse CDF with ``uniforms[b]``."""
    B, N, V = logits.shape
    accepted, accept_len, next_token = _verify_outputs(B, N)
    for b in range(B):
        prow, trow = parents[b].tolist(), tokens[b].tolist()
        T = float(temperature[b])
        try:
            _check_sampling_params(T)
            _check_uniforms([float(uniforms[b])], columns=False)
            _check_tree_row(prow)
            _check_tokens(trow, V)
            ok = [False] * N
            ok[0] = True
            dist = {}
            for c in range(1, N):
                par = prow[c]
                if not ok[par]:
                    continue
                if par not in dist:
                    x = logits[b, par].float().cpu()
                    _check_logits_row(x, par)
                    dist[par] = typical_threshold(x, T, posterior_threshold, posterior_alpha)
                p, thr = dist[par]
                ok[c] = float(p[trow[c]]) > thr
            depth = _depths(prow)
            last = max(range(N), key=lambda i: (ok[i] and depth[i], -i))
            if last not in dist:
                x = logits[b, last].float().cpu()
                _check_logits_row(x, last)
                dist[last] = typical_threshold(x, T, posterior_threshold, posterior_alpha)
        except _RowError as err:
            if validate:
                _raise("verify_tree_typical", b, err)
            continue
        path, node = [], last
        while node != -1:
            path.append(node)
            node = prow[node]
        accepted[b, : len(path)] = torch.tensor(path[::-1])
        accept_len[b] = len(path) - 1
        next_token[b] = _inverse_cdf(dist[last][0], float(uniforms[b]))
    return _to_device(logits.device, accepted, accept_len, next_token)


# ----------------------------------------------------------------------------------------------------------------
# Draft sampling.


def sample_tokens(logits, uniforms, temperature, top_k, top_p, validate: bool = True):
    """One token per row of ``logits[R, V]`` from the filtered distribution (inverse CDF with ``uniforms[R]``),
    and that distribution as float32 ``probs[R, V]``. Invalid rows (validate=False): token -1, probs 0."""
    R, V = logits.shape
    tokens = torch.full((R,), -1, dtype=torch.int64)
    probs = torch.zeros(R, V, dtype=torch.float32)
    for r in range(R):
        T, k, p = float(temperature[r]), int(top_k[r]), float(top_p[r])
        try:
            _check_sampling_params(T, k, p)
            _check_uniforms([float(uniforms[r])], columns=False)
            x = logits[r].float().cpu()
            _check_logits_row(x, 0)
        except _RowError as err:
            if err.code in (NON_FINITE_LOGITS, NO_VALID_TOKEN):
                err.node = -1
            if validate:
                raise ValueError(status_message("sample_tokens", r, err.code, err.node, err.value)) from None
            continue
        w = filtered_weights(x, T, k, p)
        tokens[r] = _inverse_cdf(w, float(uniforms[r]))
        probs[r] = w / _sum64(w)
    return _to_device(logits.device, tokens, probs)


def _top_k_desc(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values, descending, ties broken by lower index."""
    return torch.sort(values, descending=True, stable=True).indices[:k]


def expand_tree_step(logits, parent_scores, top_k: int, num_select: int, validate: bool = True):
    """One EAGLE-2 expansion step: per frontier node the top_k tokens of log_softmax(logits) with cumulative score
    parent_score + log p, then the num_select best candidates over the whole frontier.

    Returns ``cand_tokens[B, F, top_k]`` (int64), ``cand_scores[B, F, top_k]`` (float32) and ``selected[B,
    num_select]`` (int64 flat indices ``f * top_k + j``, best first, ties: lower index).
    """
    B, F, V = logits.shape
    cand_tokens = torch.full((B, F, top_k), -1, dtype=torch.int64)
    cand_scores = torch.full((B, F, top_k), -math.inf, dtype=torch.float32)
    selected = torch.full((B, num_select), -1, dtype=torch.int64)
    for b in range(B):
        try:
            for f in range(F):
                x = logits[b, f].float().cpu()
                _check_logits_row(x, f)
                lp = torch.log_softmax(x, 0)
                idx = _top_k_desc(x, top_k)
                cand_tokens[b, f] = idx
                cand_scores[b, f] = float(parent_scores[b, f]) + lp[idx]
        except _RowError as err:
            cand_tokens[b] = -1
            cand_scores[b] = -math.inf
            if validate:
                _raise("expand_tree_step", b, err)
            continue
        selected[b] = _top_k_desc(cand_scores[b].reshape(-1), num_select)
    return _to_device(logits.device, cand_tokens, cand_scores, selected)


# ----------------------------------------------------------------------------------------------------------------
# Tree attention and KV-cache compaction.


def advance_tree_frontier(cand_tokens, cand_scores, selected, ancestors, self_column: int, column,
                          validate: bool = True):
    """The next frontier (csrc/kernels/common/params.h, AdvanceTreeFrontierParams), row by row in plain Python."""
    B, F, K = cand_tokens.shape
    S, C, L = selected.shape[1], ancestors.shape[-1], column.shape[-1]
    tokens = torch.zeros(B, S, dtype=torch.int64)
    scores = torch.zeros(B, S, dtype=torch.float32)
    parents = torch.zeros(B, S, dtype=torch.int64)
    anc = torch.zeros(B, S, C, dtype=torch.bool)
    mask = torch.zeros(B, S, L, dtype=torch.bool)
    errors = []
    for b in range(B):
        sel, col = selected[b].tolist(), column[b].tolist()
        bad = [_RowError(BAD_SELECTED, s, v) for s, v in enumerate(sel) if not 0 <= v < F * K]
        bad += [_RowError(BAD_COLUMN, i, v) for i, v in enumerate(col) if not 0 <= v < C]
        if bad:
            errors.append((b, bad[0]))
            continue
        for s, v in enumerate(sel):
            f, j = divmod(v, K)
            tokens[b, s], scores[b, s], parents[b, s] = cand_tokens[b, f, j], cand_scores[b, f, j], f
            row = ancestors[b, f].cpu().clone()
            row[self_column + s] = True
            anc[b, s] = row
            mask[b, s] = row[torch.tensor(col, dtype=torch.int64)]
    if validate and errors:
        _raise("advance_tree_frontier", *errors[0])
    dev = cand_tokens.device
    return tuple(t.to(dev) for t in (tokens, scores, parents, anc, mask))


def select_tree_nodes(tokens, scores, parents, roots, num_nodes: int, validate: bool = True):
    """The final tree (csrc/kernels/common/params.h, SelectTreeNodesParams), row by row in plain Python."""
    B, C = tokens.shape
    M = min(num_nodes, C)
    out_tok = torch.full((B, M + 1), -1, dtype=torch.int64)
    out_par = torch.full((B, M + 1), -1, dtype=torch.int64)
    errors = []
    for b in range(B):
        sc = [float("-inf") if math.isnan(x) else x for x in scores[b].tolist()]
        kept = sorted(sorted(range(C), key=lambda c: -sc[c])[:M])  # (Python's sort is stable: ties keep index order)
        node = {c: i + 1 for i, c in enumerate(kept)}
        par = parents[b].tolist()
        bad = [c for c in kept if par[c] != -1 and (par[c] not in node or par[c] >= c)]  # kept and earlier
        if bad:
            errors.append((b, _RowError(BAD_CANDIDATE_PARENT, bad[0], par[bad[0]])))
            continue
        out_tok[b, 0], out_par[b, 0] = int(roots[b]), -1
        for i, c in enumerate(kept):
            out_tok[b, i + 1] = int(tokens[b, c])
            out_par[b, i + 1] = 0 if par[c] == -1 else node[par[c]]
    if validate and errors:
        _raise("select_tree_nodes", *errors[0])
    return out_tok.to(tokens.device), out_par.to(tokens.device)


def unpack_tree_mask(mask: torch.Tensor, N: int) -> torch.Tensor:
    """A tree mask as dense bool ``[B, N, N]``: bool masks unchanged, packed int32 words ``[B, N, ceil(N/32)]``
    unpacked (bit ``j % 32`` of word ``j // 32``)."""
    if mask.dtype == torch.bool:
        return mask
    B = mask.shape[0]
    bits = (mask.to(torch.int64).unsqueeze(-1) >> torch.arange(32, device=mask.device)) & 1
    return bits.reshape(B, N, -1)[..., :N].bool()


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                   tree_mask: torch.Tensor, scale: float, validate: bool = True,
                   compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention of the N tree nodes of each row over its KV cache.

    ``q[B, H, N, D]``, ``k_cache`` / ``v_cache`` ``[B, Hkv, S, D]`` (query head h reads kv head h // (H / Hkv)),
    ``prefix_lens[B]``, ``tree_mask`` dense bool ``[B, N, N]`` or packed int32 ``[B, N, ceil(N/32)]``. Node i of row
    b attends to positions [0, prefix_lens[b]) and to prefix_lens[b] + j for the nodes j with mask[b, i, j] (the tree
    nodes' own keys and values are already in the cache there): the equivalent dense additive mask over
    prefix_lens[b] + N keys, then softmax(scale * q k^T) v, computed in ``compute_dtype`` (float32 by default; the
    tests also run it in the inputs' low precision for flash-attention's error rule). A query that attends to nothing
    gets zeros. A row with prefix_lens[b] < 0 or prefix_lens[b] + N > S is an error (zeros without validation).
    Returns ``[B, H, N, D]`` in q's dtype.
    """
    B, H, N, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    dense = unpack_tree_mask(tree_mask.cpu(), N)
    out = torch.zeros(B, H, N, D, dtype=q.dtype)
    for b in range(B):
        prefix = int(prefix_lens[b])
        if prefix < 0 or prefix > S - N:
            if validate:
                _raise("tree_attention", b, _RowError(BAD_PREFIX_LEN, 0, prefix))
            continue
        T = prefix + N
        k = k_cache[b, :, :T].cpu().to(compute_dtype).repeat_interleave(G, dim=0)  # [H, T, D]
        v = v_cache[b, :, :T].cpu().to(compute_dtype).repeat_interleave(G, dim=0)
        allowed = torch.ones(N, T, dtype=torch.bool)
        allowed[:, prefix:] = dense[b]
        # masked keys: exactly -inf whatever q . k is (NaN too); a query with no weight (no visible key, or -inf
        # scores for all of them): zeros, whatever V holds
        scores = ((q[b].cpu().to(compute_dtype) @ k.transpose(-1, -2)) * scale).masked_fill(~allowed, -math.inf)
        sees = ~(scores == -math.inf).all(-1, keepdim=True)
        p = torch.softmax(scores, dim=-1).masked_fill(~sees, 0.0)
        out[b] = (p @ v).masked_fill(~sees, 0.0).to(q.dtype)
    return out.to(q.device)


def _compact_row_status(src: list[int], dst: int, length: int, S: int) -> _RowError | None:
    L = len(src)
    if not 0 <= length <= L:
        return _RowError(BAD_LENGTH, 0, length)
    if dst < 0 or dst > S - length:
        return _RowError(BAD_DST_START, 0, dst)
    for i in range(length):
        if not 0 <= src[i] < S:
            return _RowError(BAD_SRC_POSITION, i, src[i])
    return None


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes the two tensors' elements span overlap (the glue's check_no_overlap)."""
    def span(t):
        first = t.data_ptr()
        extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        return first, first + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def compact_kv(caches: list[torch.Tensor], src_positions: torch.Tensor, dst_start: torch.Tensor,
               lengths: torch.Tensor, seq_dim: int, validate: bool = True) -> None:
    """In place, for every cache, row b and i < lengths[b]:
    ``cache[b, ..., dst_start[b] + i, ...] = OLD cache[b, ..., src_positions[b, i], ...]`` (``seq_dim`` is the
    position dimension: 2 for the HF layout ``[B, Hkv, S, D]``, 1 for a flat ``[B, S, F]`` cache). All reads of a
    row happen before its writes (a clone of the old cache), so overlapping ranges are fine; caches that share memory
    are refused (ValueError), as one would be moved twice. An invalid row
    (lengths[b] not in [0, L], dst_start[b] < 0 or dst_start[b] + lengths[b] > S, a src position not in [0, S)) is
    left untouched; with ``validate`` the lowest invalid row raises ValueError after the valid rows are moved.
    """
    B, L = src_positions.shape
    S = caches[0].shape[seq_dim]
    for j in range(len(caches)):
        for i in range(j):
            if _share_memory(caches[i], caches[j]):
                raise ValueError(f"compact_kv: caches[{i}] and caches[{j}] share memory (the same tensor, or "
                                 "overlapping views of one storage); every cache is moved in place once, so they must "
                                 "be distinct")
    errors = []
    for b in range(B):
        src = src_positions[b].tolist()
        length, dst = int(lengths[b]), int(dst_start[b])
        err = _compact_row_status(src, dst, length, S)
        if err is not None:
            errors.append((b, err))
            continue
        for cache in caches:
            old = cache[b].clone()
            idx = torch.tensor(src[:length], dtype=torch.int64, device=cache.device)
            pos = torch.arange(dst, dst + length, device=cache.device)
            cache[b].index_copy_(seq_dim - 1, pos, old.index_select(seq_dim - 1, idx))
    if validate and errors:
        _raise("compact_kv", *errors[0])


# The padding rows' marker of pack_linear_weight (params.h LinearPad): a fixed value near the largest finite one,
# as raw bits.
LINEAR_PAD_BITS = {torch.float32: (0x7F7FDEC5, torch.int32), torch.bfloat16: (0x7F7D, torch.int16),
                   torch.float16: (0x7BDD, torch.int16)}


def _linear_pad(dtype: torch.dtype) -> torch.Tensor:
    bits, int_dtype = LINEAR_PAD_BITS[dtype]
    return torch.tensor(bits, dtype=int_dtype).view(dtype)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``packed[n // 32, k // P, n % 32, k % P] = weight[n, k]`` (P = 1 for float32, 2 for 16-bit types), shape
    ``[ceil(N / 32), ceil(K / P), 32, P]``; padding ``k >= K`` is zero and the padding rows ``n >= N`` hold the
    marker value (LINEAR_PAD_BITS), which records N (the shape gives it only to within 32)."""
    N, K = weight.shape
    P = 1 if weight.dtype == torch.float32 else 2
    NP, KP = -(-N // 32), -(-K // P)
    padded = weight.new_zeros(NP * 32, KP * P)
    padded[:N, :K] = weight
    padded[N:] = _linear_pad(weight.dtype).to(weight.device)
    return padded.view(NP, 32, KP, P).permute(0, 2, 1, 3).contiguous()


def packed_rows_held(packed_weight: torch.Tensor) -> int:
    """The output features a packed weight holds: its first padding row (marker in the first column), else all."""
    NP = packed_weight.shape[0]
    bits, int_dtype = LINEAR_PAD_BITS[packed_weight.dtype]
    raw = packed_weight[NP - 1, 0, :, 0].cpu().contiguous().view(int_dtype).to(torch.int64)
    pad = ((raw & ((1 << 8 * packed_weight.element_size()) - 1)) == bits).nonzero()  # (bits as unsigned)
    return (NP - 1) * 32 + int(pad[0, 0]) if pad.numel() else NP * 32


def check_packed_rows(op: str, name: str, packed_weight: torch.Tensor, N: int, what: str) -> None:
    """ValueError unless ``packed_weight`` holds exactly N output features (the glue's check, same words)."""
    held = packed_rows_held(packed_weight)
    if held != N:
        raise ValueError(f"{op}: {name} holds {held} output features (pack_linear_weight's output for a weight of "
                         f"{held} rows) but {what} = {N}")


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``x @ weight.T + bias`` with weight unpacked from ``packed_weight``, accumulated in float64 and rounded once
    to x's dtype (the kernels accumulate in float32, k in order: tests compare within float32 accumulation error).
    An ``out_features`` other than the packed weight's row count is a ValueError."""
    check_packed_rows("packed_linear", "packed_weight", packed_weight, out_features, "out_features")
    K = x.shape[-1]
    NP, KP, _, P = packed_weight.shape
    weight = packed_weight.permute(0, 2, 1, 3).reshape(NP * 32, KP * P)[:out_features, :K]
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def unpack_linear_weight(packed_weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The ``[out_features, in_features]`` weight that :func:`pack_linear_weight` packed."""
    NP, KP, _, P = packed_weight.shape
    return packed_weight.permute(0, 2, 1, 3).reshape(NP * 32, KP * P)[:out_features, :in_features]


def draft_decoder_layer(x, input_norm_weight, input_norm_segments, residual, qkv_weight, qkv_bias, o_weight,
                        norm_weight, gate_up_weight, down_weight, position_ids, inv_freq, k_cache, v_cache,
                        write_slots, mask, num_heads: int, intermediate_size: int, eps: float,
                        qkv_scales=None, o_scales=None, gate_up_scales=None, down_scales=None,
                        qkv_group_scales=None, o_group_scales=None, gate_up_group_scales=None,
                        down_group_scales=None, validate: bool = True) -> torch.Tensor:
    """A Llama decoder layer over ``x[B, T, Din]`` written out op by op (csrc/kernels/common/params.h,
    DraftLayerParams): products in float64 rounded once to x's dtype (a weight given with its scales:
    :func:`packed_linear_int8`'s product; with its group scales too: :func:`packed_linear_int4`'s), every other
    intermediate computed in float32 and rounded to x's dtype
    where the module rounds its tensors. Writes the new K/V into the caches (a row's later position wins a duplicate
    slot); a row with a write slot outside [0, S) writes nothing and returns zeros (ValueError with ``validate``)."""
    dt = x.dtype
    B, T, Din = x.shape
    H = residual.shape[-1]
    nKV, S, D = k_cache.shape[1:]
    nH, I = num_heads, intermediate_size
    Q = (nH + 2 * nKV) * D
    scales = {id(qkv_weight): qkv_scales, id(o_weight): o_scales, id(gate_up_weight): gate_up_scales,
              id(down_weight): down_scales}
    groups = {id(qkv_weight): qkv_group_scales, id(o_weight): o_group_scales,
              id(gate_up_weight): gate_up_group_scales, id(down_weight): down_group_scales}
    for name, w, rows, what in (("qkv_weight", qkv_weight, Q, "[(num_heads + 2 nKV) D, Din]"),
                                ("o_weight", o_weight, H, "[H, num_heads D]"),
                                ("gate_up_weight", gate_up_weight, 2 * I, "[2 intermediate_size, H]"),
                                ("down_weight", down_weight, H, "[H, intermediate_size]")):
        if scales[id(w)] is None:
            check_packed_rows("draft_decoder_layer", name, w, rows, "the first dimension of " + what)

    def rnd(t):  # rounded to the layer's dtype, computed on in float32
        return t.to(dt).float()

    def lin(v, packed, N, K, bias=None):
        if groups[id(packed)] is not None:  # (v holds values of the layer's dtype, as the kernel's buffer does)
            return packed_linear_int4(v.to(dt), packed, groups[id(packed)], scales[id(packed)], bias).float()
        if scales[id(packed)] is not None:
            return packed_linear_int8(v.to(dt), packed, scales[id(packed)], bias).float()
        y = v.double() @ unpack_linear_weight(packed, N, K).double().T
        return rnd(y + bias.double() if bias is not None else y)

    def rms(v, w):
        return rnd(w.float() * rnd(v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)))

    a = x.float()
    if input_norm_weight is not None:
        seg = Din // input_norm_segments
        a = torch.cat([rms(a[..., i * seg: (i + 1) * seg], input_norm_weight[i * seg: (i + 1) * seg])
                       for i in range(input_norm_segments)], -1)
    qkv = lin(a, qkv_weight, Q, Din, qkv_bias).view(B, T, nH + 2 * nKV, D)
    angles = position_ids.float()[:, :, None, None] * inv_freq.float()  # [B, T, 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    half = D // 2

    def rope(h):
        x1, x2 = h[..., :half], h[..., half:]
        return rnd(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1))

    q, k, v = rope(qkv[:, :, :nH]), rope(qkv[:, :, nH: nH + nKV]), qkv[:, :, nH + nKV:]
    out = torch.zeros(B, T, H, dtype=dt, device=x.device)
    errors = []
    kv_len, G = mask.shape[-1], nH // nKV
    for b in range(B):
        slots = write_slots[b].tolist()
        bad = [(t, s) for t, s in enumerate(slots) if not 0 <= s < S]
        if bad:
            errors.append((b, _RowError(BAD_WRITE_SLOT, *bad[0])))
            continue
        for t, s in enumerate(slots):
            k_cache[b, :, s] = k[b, t].to(k_cache.dtype)
            v_cache[b, :, s] = v[b, t].to(v_cache.dtype)
        keys = k_cache[b, :, :kv_len].float().repeat_interleave(G, 0)  # [nH, kv_len, D]
        values = v_cache[b, :, :kv_len].float().repeat_interleave(G, 0)
        scores = q[b].transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(D)  # [nH, T, kv_len]
        scores = scores.masked_fill(~mask[b], -math.inf)
        # a query with no weight (sees nothing, or only -inf scores) gets zeros whatever V holds; NaN anywhere else
        # stays NaN, as in the kernels
        sees = ~(scores == -math.inf).all(-1, keepdim=True)
        p = torch.softmax(scores, -1).masked_fill(~sees, 0.0)
        o = rnd((p @ values).masked_fill(~sees, 0.0)).transpose(0, 1).reshape(T, nH * D)
        h1 = rnd(residual[b].float() + lin(o, o_weight, H, nH * D))
        gate, up = lin(rms(h1, norm_weight), gate_up_weight, 2 * I, H).chunk(2, -1)
        act = rnd(rnd(torch.nn.functional.silu(gate)) * up)
        out[b] = (h1 + lin(act, down_weight, H, I)).to(dt)
    if validate and errors:
        _raise("draft_decoder_layer", *errors[0])
    return out


# ----------------------------------------------------------------------------------------------------------------
# Linear attention with a fixed per-head decay over a draft tree (Lightning attention, Simple GLA), and its commit.
# The recurrence per head is S_t = a S_{t-1} + k_t^T v_t, o_t = q_t S_t (a = exp(log_decay) in (0, 1]). Because a
# does not depend on the input, every tree node's output follows in one pass from the saved state S and the nodes'
# own keys and values; no per-node state exists. A chain is the width-1 tree.


def _check_log_decay(op: str, log_decay: torch.Tensor, H: int) -> None:
    if log_decay.shape != (H,):
        raise ValueError(f"{op}: log_decay must have shape [H = {H}] (one decay per head), got "
                         f"{tuple(log_decay.shape)}")
    bad = ~(torch.isfinite(log_decay) & (log_decay <= 0))
    if bool(bad.any()):
        raise ValueError(status_message(op, 0, BAD_LOG_DECAY, int(bad.nonzero()[0, 0]), 0))


def tree_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                          log_decay: torch.Tensor, parents: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Outputs of the N tree nodes of each row of a linear-attention layer with a fixed per-head decay.

    ``q`` / ``k`` ``[B, H, N, Dk]``, ``v`` ``[B, H, N, Dv]`` (the nodes' own projections), ``state[B, H, Dk, Dv]``
    (the row's saved state after its prefix: ``sum_t a^(T-1-t) k_t^T v_t``), ``log_decay[H]`` (``log a``, <= 0),
    ``parents[B, N]`` the tree (node 0 the root). With ``d_i`` node i's depth (root 0: the number of its ancestors):

        o_i = a^(d_i + 1) q_i S + sum_{j ancestor-or-self of i} a^(d_i - d_j) (q_i . k_j) v_j

    which is ``q_i S_i`` for the state ``S_i`` after the root-to-i path. No softmax, no scale (as MiniMax's
    Lightning attention; a model that scales q does so before). Computed in float32; returns ``[B, H, N, Dv]`` in
    q's dtype. ``validate``: shapes, a finite decay <= 0 and well-formed trees (ValueError)."""
    B, H, N, Dk = q.shape
    Dv = v.shape[-1]
    if validate:
        if k.shape != (B, H, N, Dk) or v.shape[:3] != (B, H, N) or state.shape != (B, H, Dk, Dv):
            raise ValueError(f"tree_linear_attention: need q, k [B, H, N, Dk], v [B, H, N, Dv], state [B, H, Dk, Dv];"
                             f" got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, state "
                             f"{tuple(state.shape)}")
        _check_log_decay("tree_linear_attention", log_decay, H)
        if parents.shape != (B, N):
            raise ValueError(f"tree_linear_attention: parents must be [B = {B}, N = {N}], got {tuple(parents.shape)}")
        _check_trees("tree_linear_attention", parents)
    dense = tree_ancestor_mask(parents.cpu(), validate=False).to(q.device)
    log_a = log_decay.to(device=q.device, dtype=torch.float32)[None, :, None, None]  # [1, H, 1, 1]
    depth = (dense.sum(-1) - 1).to(torch.float32)[:, None]  # [B, 1, N]
    gap = depth[..., :, None] - depth[..., None, :]  # [B, 1, N, N]: d_i - d_j
    # masked entries (non-ancestors, where d_i - d_j may be negative) are exactly 0, never exp(+x)
    weights = torch.where(dense[:, None], torch.exp(log_a * gap.clamp(min=0)), torch.zeros((), device=q.device))
    qf, kf, vf = q.float(), k.float(), v.float()
    intra = ((qf @ kf.transpose(-1, -2)) * weights) @ vf
    inter = torch.exp(log_a * (depth[..., None] + 1)) * (qf @ state.float())
    return (inter + intra).to(q.dtype)


def commit_linear_state(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                        path: torch.Tensor, lengths: torch.Tensor, validate: bool = True) -> None:
    """In place, per row b, with n = lengths[b] and the nodes ``p_t = path[b, t]`` for t < n (root first):

        state[b] <- a^n state[b] + sum_{t < n} a^(n - 1 - t) k[b, :, p_t]^T v[b, :, p_t]

    i.e. the state after the accepted path, from the saved state and the nodes' keys and values (the analogue of
    ``compact_kv``; rows accept different lengths, n = 0 leaves a row as it is). ``state[B, H, Dk, Dv]`` (float32),
    ``k[B, H, N, Dk]``, ``v[B, H, N, Dv]``, ``log_decay[H]`` (<= 0), ``path[B, L]`` int64 node indices (-1 padded),
    ``lengths[B]``. Several layers commit in one call as more heads: ``[B, layers * H, ...]`` views. An invalid row
    (lengths[b] not in [0, L], a path node of t < n not in [0, N)) is left untouched; with ``validate`` the lowest
    one raises ValueError after the valid rows are committed, and a bad shape or decay raises first."""
    B, H, Dk, Dv = state.shape
    N, L = k.shape[2], path.shape[1]
    if validate:
        if k.shape != (B, H, N, Dk) or v.shape != (B, H, N, Dv) or path.shape != (B, L) or lengths.shape != (B,):
            raise ValueError(f"commit_linear_state: need state [B, H, Dk, Dv], k [B, H, N, Dk], v [B, H, N, Dv], "
                             f"path [B, L], lengths [B]; got state {tuple(state.shape)}, k {tuple(k.shape)}, v "
                             f"{tuple(v.shape)}, path {tuple(path.shape)}, lengths {tuple(lengths.shape)}")
        _check_log_decay("commit_linear_state", log_decay, H)
    dev = state.device
    n = lengths.to(device=dev, dtype=torch.int64)
    path = path.to(device=dev, dtype=torch.int64)
    t = torch.arange(L, device=dev)
    used = t[None, :] < n[:, None]  # [B, L]
    bad_node = (used & ((path < 0) | (path >= N))).any(1)
    bad = (n < 0) | (n > L) | bad_node
    log_a = log_decay.to(device=dev, dtype=torch.float32)[None, :, None]  # [1, H, 1]
    nf = n.clamp(0, L).to(torch.float32)[:, None, None]  # [B, 1, 1]
    w = torch.where(used[:, None], torch.exp(log_a * (nf - 1 - t.float()).clamp(min=0)),
                    torch.zeros((), device=dev))  # [B, H, L]
    idx = path.clamp(0, max(N - 1, 0))[:, None, :, None]
    kk = k.float().gather(2, idx.expand(B, H, L, Dk))
    vv = v.float().gather(2, idx.expand(B, H, L, Dv))
    new = torch.exp(log_a[..., None] * nf[..., None]) * state.float() + (kk * w[..., None]).transpose(-1, -2) @ vv
    keep = ~bad
    state.copy_(torch.where(keep[:, None, None, None], new.to(state.dtype), state))
    if validate and bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        nb = int(lengths[b])
        if not 0 <= nb <= L:
            raise ValueError(status_message("commit_linear_state", b, BAD_LENGTH, 0, nb))
        tb = int((used[b] & ((path[b] < 0) | (path[b] >= N))).nonzero()[0, 0])
        raise ValueError(status_message("commit_linear_state", b, BAD_PATH_NODE, tb, int(path[b, tb])))


# ----------------------------------------------------------------------------------------------------------------
# Gated DeltaNet (Qwen3-Next, Qwen3.5) over a draft tree, and its short causal convolution. The gates depend on the
# input, so there is no one-pass form: a node's state follows from its parent's (the root's from the saved state),
# level by level; the commit replays the accepted path from the saved state. Only the step's transient states exist.


def _delta_step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """One gated delta-rule step per head: ``S <- exp(g) S``, then ``S <- S + k (beta (v - S^T k))^T``.
    ``S[..., Dk, Dv]``, ``k[..., Dk]``, ``v[..., Dv]``, ``g`` / ``beta`` ``[...]``; float32."""
    S = S * g.exp()[..., None, None]
    delta = (v - (S * k[..., :, None]).sum(-2)) * beta[..., None]
    return S + k[..., :, None] * delta[..., None, :]


def _tree_depths(parents: torch.Tensor) -> torch.Tensor:
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depth[:, i] = depth.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0] + 1
    return depth


def _check_trees(op: str, parents: torch.Tensor) -> None:
    for b in range(parents.shape[0]):
        try:
            _check_tree_row(parents[b].tolist())
        except _RowError as err:
            _raise(op, b, err)


def _tree_states(step, state: torch.Tensor, parents: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, *state dims]`` float32: node i's state, one ``step(prev, *inputs at i)`` from its parent's (the
    root's from ``state[B, H, ...]``), all nodes of one depth at once; ``inputs`` are per node ``[B, H, N, ...]``."""
    B, H, N = inputs[0].shape[:3]
    parents = parents.to(state.device)
    depth = _tree_depths(parents)
    states = torch.zeros(B, H, N, *state.shape[2:], dtype=torch.float32, device=state.device)
    for d in range(int(depth.max()) + 1 if N else 0):
        b_idx, i_idx = (depth == d).nonzero(as_tuple=True)
        prev = state.float()[b_idx] if d == 0 else states[b_idx, :, parents[b_idx, i_idx]]
        states[b_idx, :, i_idx] = step(prev, *(t.float()[b_idx, :, i_idx] for t in inputs))
    return states


def _replay(op: str, step, state: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor, validate: bool,
            *inputs: torch.Tensor) -> None:
    """In place: ``state[b]`` advances by ``step`` through the nodes ``path[b, :lengths[b]]`` (root first); per-node
    ``inputs[B, H, N, ...]``. Invalid rows are left untouched; with ``validate`` the lowest raises ValueError after
    the valid rows are committed."""
    errors = []
    for b in range(state.shape[0]):
        nodes = _path_nodes(op, b, path, lengths, inputs[0].shape[2], errors)
        if nodes is None:
            continue
        S = state[b].float()
        for j in nodes:
            S = step(S, *(t[b, :, j].float() for t in inputs))
        state[b].copy_(S.to(state.dtype))
    if validate and errors:
        raise ValueError(errors[0])


def tree_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, parents: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """Outputs of the N tree nodes of each row of a gated delta-rule layer.

    ``q`` / ``k`` ``[B, H, N, Dk]`` (as the layer feeds the rule: Qwen3-Next l2-normalises both and scales q by
    ``Dk^-0.5`` first), ``v[B, H, N, Dv]``, ``g`` (log decay) / ``beta`` ``[B, H, N]``, ``state[B, H, Dk, Dv]`` the
    saved state after the prefix, ``parents[B, N]`` the tree (node 0 the root). Node i's state is one step
    (:func:`_delta_step`) from its parent's (the root's from ``state``) and ``o_i = S_i^T q_i``; nodes are computed
    level by level (all nodes of one depth at once). Float32; returns ``[B, H, N, Dv]`` in v's dtype."""
    if validate:
        _check_trees("tree_gated_delta_rule", parents)
    states = _tree_states(_delta_step, state, parents, k, v, g, beta)
    return (states * q.float()[..., :, None]).sum(-2).to(v.dtype)


def _path_nodes(op: str, b: int, path: torch.Tensor, lengths: torch.Tensor, N: int, errors: list) -> list | None:
    """Row b's accepted nodes ``path[b, :lengths[b]]``, or None (the error appended to ``errors``) when lengths[b]
    is not in [0, L] or a node is not in [0, N)."""
    n, L = int(lengths[b]), path.shape[1]
    if not 0 <= n <= L:
        errors.append(status_message(op, b, BAD_LENGTH, 0, n))
        return None
    nodes = path[b, :n].tolist()
    bad = next((t for t, j in enumerate(nodes) if not 0 <= j < N), None)
    if bad is not None:
        errors.append(status_message(op, b, BAD_PATH_NODE, bad, nodes[bad]))
        return None
    return nodes


def commit_gated_delta_state(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor,
                             validate: bool = True) -> None:
    """In place: ``state[b]`` advances by :func:`_delta_step` through the nodes ``path[b, :lengths[b]]`` (the
    accepted path, root first) from the saved state; tensors as :func:`tree_gated_delta_rule`'s, ``path[B, L]``
    int64 (-1 padded). An invalid row (lengths[b] not in [0, L], a path node not in [0, N)) is left untouched; with
    ``validate`` the lowest one raises ValueError after the valid rows are committed."""
    _replay("commit_gated_delta_state", _delta_step, state, path, lengths, validate, k, v, g, beta)


def _conv_windows(x: torch.Tensor, conv_state: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """``[B, C, N, K]``: node i's inputs to a width-K causal convolution, oldest first: its K - 1 nearest ancestors'
    ``x`` then its own, the saved window ``conv_state[B, C, K - 1]`` (oldest first) standing in above the root."""
    B, C, N = x.shape
    K = conv_state.shape[-1] + 1
    windows = torch.empty(B, C, N, K, dtype=x.dtype, device=x.device)
    for b in range(B):
        prow = parents[b].tolist()
        for i in range(N):
            path = [i]
            while prow[path[-1]] != -1 and len(path) < K:
                path.append(prow[path[-1]])
            cols = [x[b, :, j] for j in reversed(path)]
            missing = K - len(cols)
            windows[b, :, i] = torch.stack([conv_state[b, :, conv_state.shape[-1] - missing + t].to(x.dtype)
                                            for t in range(missing)] + cols, -1)
    return windows


def tree_causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       parents: torch.Tensor, activation: str | None = None, validate: bool = True) -> torch.Tensor:
    """A depthwise causal convolution of width K over a tree: ``x[B, C, N]`` (the nodes' inputs), ``conv_state[B, C,
    K - 1]`` the saved inputs before the root (oldest first), ``weight[C, K]``, ``bias[C]`` or None, ``parents[B,
    N]``. Node i's output is ``sum_t weight[c, t] window[c, t] + bias[c]`` over its window (its K - 1 nearest
    ancestors, then itself; the saved inputs above the root), then ``activation`` ("silu" or None). Float32;
    returns ``[B, C, N]`` in x's dtype."""
    if validate:
        _check_trees("tree_causal_conv1d", parents)
        if activation not in (None, "silu"):
            raise ValueError(f"tree_causal_conv1d: activation must be 'silu' or None, got {activation!r}")
    out = (_conv_windows(x.float(), conv_state.float(), parents) * weight.float()[None, :, None, :]).sum(-1)
    if bias is not None:
        out = out + bias.float()[None, :, None]
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    return out.to(x.dtype)


def commit_conv_state(conv_state: torch.Tensor, x: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor,
                      validate: bool = True) -> None:
    """In place: the saved window ``conv_state[b]`` (``[C, K - 1]``, oldest first) shifts along the accepted path:
    it becomes the last K - 1 of (old window, ``x[b, :, path[b, t]]`` for t < lengths[b]). Invalid rows as in
    :func:`commit_gated_delta_state`."""
    W = conv_state.shape[-1]
    errors = []
    for b in range(x.shape[0]):
        nodes = _path_nodes("commit_conv_state", b, path, lengths, x.shape[2], errors)
        if nodes is None:
            continue
        seq = torch.cat([conv_state[b]] + [x[b, :, j:j + 1].to(conv_state.dtype) for j in nodes], -1)
        conv_state[b].copy_(seq[:, seq.shape[-1] - W:])
    if validate and errors:
        raise ValueError(errors[0])


# ----------------------------------------------------------------------------------------------------------------
# Mamba-2 (Bamba) over a draft tree: its selective state update, level by level from each node's parent (the
# convolution in front is tree_causal_conv1d).


def _ssd_step(S: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor):
    """One Mamba-2 step per head: ``S <- exp(dt A) S + dt x B^T``; ``S[..., P, Ds]``, ``x[..., P]``, ``dt`` / ``A``
    ``[...]``, ``Bm[..., Ds]``; float32."""
    return S * torch.exp(dt * A)[..., None, None] + (dt[..., None] * x)[..., :, None] * Bm[..., None, :]


def tree_selective_state(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
                         D: torch.Tensor, state: torch.Tensor, parents: torch.Tensor,
                         validate: bool = True) -> torch.Tensor:
    """Outputs of the N tree nodes of each row of a Mamba-2 layer: ``x[B, H, N, P]``, ``dt[B, H, N]`` (after the
    softplus), ``A[H]`` (negative), ``Bm`` / ``Cm`` ``[B, H, N, Ds]`` (the groups' B and C per head), ``D[H]``,
    ``state[B, H, P, Ds]`` the saved state, ``parents[B, N]``. Node i's state is one :func:`_ssd_step` from its
    parent's (the root's from ``state``); ``y_i = S_i C_i + D x_i``. Float32; returns ``[B, H, N, P]`` in x's
    dtype."""
    if validate:
        _check_trees("tree_selective_state", parents)
    B, H, N = dt.shape
    per_node_A = A.float()[None, :, None].expand(B, H, N)
    states = _tree_states(_ssd_step, state, parents, x, dt, per_node_A, Bm)
    y = (states * Cm.float()[..., None, :]).sum(-1) + D.float()[None, :, None, None] * x.float()
    return y.to(x.dtype)


def commit_selective_state(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           Bm: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor, validate: bool = True) -> None:
    """In place: ``state[b]`` advances by :func:`_ssd_step` through the accepted nodes ``path[b, :lengths[b]]``;
    tensors as :func:`tree_selective_state`'s, ``A`` per head ``[H]``. Invalid rows as in
    :func:`commit_gated_delta_state`."""
    B, H, N = dt.shape
    _replay("commit_selective_state", _ssd_step, state, path, lengths, validate, x, dt,
            A.float()[None, :, None].expand(B, H, N), Bm)


# ----------------------------------------------------------------------------------------------------------------
# Weight-only int8 linear layers (csrc/kernels/common/params.h). Every float32 operation is written as a float64 one
# rounded to float32: exact for these (a product or quotient of two float32 values, a sum of two), and free of
# torch's own shortcuts (a division by a scalar may run as a multiplication by its reciprocal).

INT8_TINY_AMAX = 2.0 ** -120  # (127 / amax is finite above it)
LINEAR_INT8_MAX_K = 131072  # 127^2 * K fits the kernels' int32 sums


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def quantize_rows_int8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``v[R, K]`` (read as float32) -> ``(q[R, K] int8, scale[R] float32)``: amax = max |v|, scale =
    amax / 127, ``q = clamp(round_half_even(v * (127 / amax)), -127, 127)``; amax < 2^-120 gives scale 0 and q = 0;
    a row holding inf or NaN gives scale NaN and q = 0."""
    v = v.float()
    finite = torch.isfinite(v).all(-1)
    amax = torch.where(finite, v.abs().amax(-1), 0.0).double()
    tiny = amax < INT8_TINY_AMAX
    scale = _f32(torch.where(tiny, 0.0, amax / 127))
    inverse = _f32(torch.where(tiny, 0.0, 127 / torch.where(tiny, 1.0, amax)))
    scale = torch.where(finite, scale, math.nan)
    inverse = torch.where(finite, inverse, 0.0)
    q = _f32(torch.where(torch.isfinite(v), v, 0.0).double() * inverse.double()[:, None]).round().clamp(-127, 127)
    return q.to(torch.int8), scale


def _check_int8_in_features(op: str, what: str, K: int) -> None:
    if not 1 <= K <= LINEAR_INT8_MAX_K:
        raise ValueError(f"{op}: {what} must be in [1, {LINEAR_INT8_MAX_K}] (the int32 sums of 127^2 K), got {K}")


def pack_linear_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scales)``: each output channel of ``weight[N, K]`` quantised by :func:`quantize_rows_int8`,
    ``packed[n // 32, k // 4, n % 32, k % 4] = q[n, k]``, shape ``[ceil(N / 32), ceil(K / 4), 32, 4]``, zero
    padding. A weight holding inf or NaN is a ValueError."""
    N, K = weight.shape
    _check_int8_in_features("pack_linear_weight_int8", "weight's in_features", K)
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("pack_linear_weight_int8: weight must be finite (an output channel holding inf or NaN has "
                         "no int8 scale)")
    q, scales = quantize_rows_int8(weight.cpu())
    NP, KQ = -(-N // 32), -(-K // 4)
    padded = torch.zeros(NP * 32, KQ * 4, dtype=torch.int8)
    padded[:N, :K] = q
    packed = padded.view(NP, 32, KQ, 4).permute(0, 2, 1, 3).contiguous()
    return packed.to(weight.device), scales.to(weight.device)


def unpack_linear_weight_int8(packed_weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The ``[out_features, in_features]`` int8 weight that :func:`pack_linear_weight_int8` packed."""
    NP, KQ = packed_weight.shape[:2]
    return packed_weight.permute(0, 2, 1, 3).reshape(NP * 32, KQ * 4)[:out_features, :in_features]


def packed_linear_int8(x: torch.Tensor, packed_weight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[..., n] = T(float(acc) * (sx * scales[n]) + bias[n])`` with ``acc = sum_k qx[k] q[n, k]`` (exact
    integers), ``(qx, sx)`` each row of x quantised by :func:`quantize_rows_int8`, each float32 operation rounded
    (no fused multiply-add), T = x's dtype; an absent bias adds +0.0."""
    K, N = x.shape[-1], scales.shape[0]
    _check_int8_in_features("packed_linear_int8", "x's last dimension (in_features)", K)
    rows = x.reshape(-1, K).cpu()
    qx, sx = quantize_rows_int8(rows)
    qw = unpack_linear_weight_int8(packed_weight.cpu(), N, K)
    acc = qx.long() @ qw.long().T  # [M, N]
    t = _f32(sx.double()[:, None] * scales.cpu().double()[None, :])
    y = _f32(_f32(acc.double()).double() * t.double())
    b = bias.cpu().float() if bias is not None else torch.zeros(N)
    y = _f32(y.double() + b.double()[None, :])
    return y.to(x.dtype).reshape(*x.shape[:-1], N).to(x.device)


# ----------------------------------------------------------------------------------------------------------------
# Weight-only int4 linear layers (csrc/kernels/common/params.h, "Weight-only int4"): groups of 32 inputs, a float32
# scale per output channel and a 6-bit integer multiplier per group. Float32 operations written as int8's above.

INT4_TINY_AMAX = 2.0 ** -100  # (every group step is a normal float above it)
LINEAR_INT4_GROUP = 32
LINEAR_INT4_MAX_K = 32768  # 63 * 7 * 127 * K fits the kernels' int32 sums


def _check_int4_in_features(op: str, what: str, K: int) -> None:
    if not 1 <= K <= LINEAR_INT4_MAX_K:
        raise ValueError(f"{op}: {what} must be in [1, {LINEAR_INT4_MAX_K}] (the int32 sums of 63 * 7 * 127 K), got "
                         f"{K}")


def quantize_weight_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight[N, K]`` (finite, read as float32) -> ``(q[N, K] int8 in [-7, 7], m[N, G] uint8, scales[N] float32)``,
    G = ceil(K / 32): amax_g the largest magnitude of group g, amax = max_g amax_g; amax < 2^-100 gives scale 0, m = 0
    and q = 0; else ``scale = amax / 441``, ``m_g = clamp(ceil(amax_g * (63 / amax)), 1, 63)`` and ``q = clamp(
    round_half_even(w / (scale * m_g)), -7, 7)``."""
    w = weight.float()
    N, K = w.shape
    G = -(-K // LINEAR_INT4_GROUP)
    padded = torch.zeros(N, G * LINEAR_INT4_GROUP)
    padded[:, :K] = w
    group_amax = padded.abs().view(N, G, LINEAR_INT4_GROUP).amax(-1).double()  # [N, G]
    amax = group_amax.amax(-1)  # [N]
    tiny = amax < INT4_TINY_AMAX
    safe = torch.where(tiny, 1.0, amax)
    scale = _f32(torch.where(tiny, 0.0, safe / 441))
    ratio = _f32(group_amax * _f32(63 / safe).double()[:, None]).ceil().clamp(1, 63)
    m = torch.where(tiny[:, None], 0.0, ratio)
    step = _f32(scale.double()[:, None] * m.double())  # [N, G]
    step_k = step.repeat_interleave(LINEAR_INT4_GROUP, 1)[:, :K]
    q = _f32(w.double() / torch.where(step_k > 0, step_k, 1.0).double()).round().clamp(-7, 7)
    q = torch.where(step_k > 0, q, 0.0)
    return q.to(torch.int8), m.to(torch.uint8), scale


def pack_linear_weight_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, group_scales, scales)`` of ``weight[N, K]`` quantised by :func:`quantize_weight_int4`: with u = q
    + 8 (8 in the padding), ``packed[n // 32, o, n % 32, e] = u[n, 8o + e] | u[n, 8o + 4 + e] << 4``, shape
    ``[ceil(N / 32), Kp / 8, 32, 4]`` uint8, Kp = ceil(K / 32) * 32; ``group_scales[n // 32, g, n % 32] = m[n, g]``
    (0 in the padding). A weight holding inf or NaN is a ValueError."""
    N, K = weight.shape
    _check_int4_in_features("pack_linear_weight_int4", "weight's in_features", K)
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("pack_linear_weight_int4: weight must be finite (an output channel holding inf or NaN has "
                         "no int4 scale)")
    q, m, scales = quantize_weight_int4(weight.cpu())
    NP, G = -(-N // 32), m.shape[1]
    u = torch.full((NP * 32, G * LINEAR_INT4_GROUP), 8, dtype=torch.int32)
    u[:N, :K] = q.int() + 8
    u = u.view(NP, 32, G * 4, 2, 4)  # [panel, lane, octet, nibble (low: e, high: 4 + e), e]
    packed = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).permute(0, 2, 1, 3).to(torch.uint8).contiguous()
    group_scales = torch.zeros(NP * 32, G, dtype=torch.uint8)
    group_scales[:N] = m
    group_scales = group_scales.view(NP, 32, G).permute(0, 2, 1).contiguous()
    return packed.to(weight.device), group_scales.to(weight.device), scales.to(weight.device)


def unpack_linear_weight_int4(packed_weight: torch.Tensor, group_scales: torch.Tensor, out_features: int,
                              in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``q[out_features, in_features]`` (int8) and ``m[out_features, G]`` (uint8) that
    :func:`pack_linear_weight_int4` packed."""
    NP, octets = packed_weight.shape[:2]
    b = packed_weight.int().permute(0, 2, 1, 3)  # [panel, lane, octet, e]
    u = torch.stack([b & 15, b >> 4], 3).reshape(NP * 32, octets * 8)
    q = (u - 8)[:out_features, :in_features].to(torch.int8)
    m = group_scales.permute(0, 2, 1).reshape(NP * 32, -1)[:out_features]
    return q, m


def packed_linear_int4(x: torch.Tensor, packed_weight: torch.Tensor, group_scales: torch.Tensor,
                       scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[..., n] = T(float(acc) * (sx * scales[n]) + bias[n])`` with ``acc = sum_g m[n, g] sum_{k in g} qx[k]
    q[n, k]`` (exact integers), ``(qx, sx)`` each row of x quantised by :func:`quantize_rows_int8`, each float32
    operation rounded (no fused multiply-add), T = x's dtype; an absent bias adds +0.0."""
    K, N = x.shape[-1], scales.shape[0]
    _check_int4_in_features("packed_linear_int4", "x's last dimension (in_features)", K)
    rows = x.reshape(-1, K).cpu()
    qx, sx = quantize_rows_int8(rows)
    q, m = unpack_linear_weight_int4(packed_weight.cpu(), group_scales.cpu(), N, K)
    w = q.long() * m.long().repeat_interleave(LINEAR_INT4_GROUP, 1)[:, :K]  # [N, K]: the multiplier is an integer
    acc = qx.long() @ w.T  # [M, N]
    t = _f32(sx.double()[:, None] * scales.cpu().double()[None, :])
    y = _f32(_f32(acc.double()).double() * t.double())
    b = bias.cpu().float() if bias is not None else torch.zeros(N)
    y = _f32(y.double() + b.double()[None, :])
    return y.to(x.dtype).reshape(*x.shape[:-1], N).to(x.device)
