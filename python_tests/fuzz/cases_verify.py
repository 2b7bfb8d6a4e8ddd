"""Fuzz specs of verification and sampling: verify_tree_greedy / _sampling / _typical, sample_tokens,
expand_tree_step."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fuzz.compare import close, draws, same, same_all
from fuzz.spec import FLOAT_DTYPES, Arg, OpSpec, dim, dtype_of
from helpers import make_gen, per_row, random_parents, shifted_uniforms
from specdec_ext import ops
from specdec_ext.ops import reference as ref
# the per-op tests' tolerances and rules
from test_expand_tree_step import S_ATOL, S_RTOL, _check_selected
from test_sample_tokens import P_ATOL, P_RTOL

R = torch.ops.specdec_ext
SEED = st.integers(0, 2**31 - 1)
TEMPERATURES = [0.0, 1e-6, 0.5, 1.0, 1.7, 4.0]
TOP_PS = [1.0, 0.95, 0.6, 0.2]

_BASE = {"B": dim(1, 3, 9), "N": dim(1, 8, 33), "V": dim(1, 10, 67, 300),
         "dtype": st.sampled_from(FLOAT_DTYPES),
         "tree": st.sampled_from(["random", "deep", "wide", "chain", "star"]), "seed": SEED,
         "planted": st.booleans(), "masked": st.booleans(), "scale": st.sampled_from([0.5, 2.0, 8.0])}
_PARAMS = {"temperature": st.sampled_from(TEMPERATURES), "top_k": st.integers(0, 11), "top_p": st.sampled_from(TOP_PS),
           "numbers": st.booleans(), "per_row": st.booleans()}


def _logits(g, shape, r) -> torch.Tensor:
    x = torch.randn(*shape, generator=g) * r["scale"]
    if r["masked"]:  # masked tokens (-inf), one finite token per row kept
        m = torch.rand(*shape, generator=g) < 0.3
        m[..., 0] = False
        x = x.masked_fill(m, float("-inf"))
    return x


def _tree_case(r) -> dict:
    """logits [B, N, V], tokens, parents: drafts often the target's argmax when ``planted`` (so paths get accepted);
    the root's token -1 (never read)."""
    g = make_gen(r["seed"])
    B, N, V = r["B"], r["N"], r["V"]
    parents = random_parents(B, N, g, r["tree"])
    logits = _logits(g, (B, N, V), r)
    tokens = torch.randint(0, V, (B, N), generator=g)
    if r["planted"]:
        best = logits.argmax(-1)
        take = torch.rand(B, N, generator=g) < 0.7
        tokens = torch.where(take, best.gather(1, parents.clamp(min=0)), tokens)
    tokens[:, 0] = -1
    return {"logits": logits.to(dtype_of(r["dtype"])), "tokens": tokens, "parents": parents}


def _row_param(r, name, rows, dtype, g):
    """A sampling parameter: a number (wrapper calls), or a [rows] tensor (the same or per-row values)."""
    if r["numbers"] and not r["raw"]:
        return r[name]
    if not r["per_row"]:
        return torch.full((rows,), r[name], dtype=dtype)
    choices = {"temperature": TEMPERATURES, "top_p": TOP_PS}.get(name)
    if choices is None:
        return torch.randint(0, 12, (rows,), generator=g)
    return torch.tensor(choices, dtype=dtype)[torch.randint(0, len(choices), (rows,), generator=g)]


def _tree_kinds(r) -> dict:
    return {"logits": Arg("float"), "tokens": Arg("index", (0, r["V"])), "parents": Arg("tree", (r["N"],))}


def _sampling_kinds(r) -> dict:
    return {"temperature": Arg("row_f"), "top_k": Arg("row_i", (0, r["V"])), "top_p": Arg("row_f")}


def _params_for_ref(a, rows):
    return (per_row(a["temperature"], rows, torch.float32), per_row(a["top_k"], rows, torch.int64),
            per_row(a["top_p"], rows, torch.float32))


def _rows(a) -> int:
    return a["logits"].shape[0]


# verify_tree_greedy ----------------------------------------------------------------------------------------------

VERIFY_TREE_GREEDY = OpSpec(
    name="verify_tree_greedy",
    base=st.fixed_dictionaries(_BASE),
    kinds=_tree_kinds,
    build=_tree_case,
    raw=lambda a, v: R.verify_tree_greedy(a["logits"], a["tokens"], a["parents"], v),
    wrapper=lambda a, v: ops.verify_tree_greedy(a["logits"], a["tokens"], a["parents"], validate=v),
    reference=lambda a, v: ref.verify_tree_greedy(a["logits"], a["tokens"], a["parents"], v),
    compare=lambda got, want, a, rerun: same_all(got, want, ["accepted", "accept_len", "next_token"]),
)

# verify_tree_sampling --------------------------------------------------------------------------------------------


def _sampling_case(r) -> dict:
    a = _tree_case(r)
    g = make_gen(r["seed"] + 1)
    B, N, V = r["B"], r["N"], r["V"]
    a["draft_probs"] = torch.softmax(torch.randn(B, N, V, generator=g) * r["scale"], -1) if r["q"] else None
    a["uniforms"] = torch.rand(B, N, generator=g)
    for name, dtype in (("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32)):
        a[name] = _row_param(r, name, B, dtype, g)
    return a


def _sampling_kinds_all(r) -> dict:
    kinds = {**_tree_kinds(r), "uniforms": Arg("float"), **_sampling_kinds(r)}
    if r["q"]:
        kinds["draft_probs"] = Arg("float")
    return kinds


def _sampling_ref(a, v):
    return ref.verify_tree_sampling(a["logits"], a["tokens"], a["parents"], a["draft_probs"], a["uniforms"],
                                    *_params_for_ref(a, _rows(a)), v)


def _compare_verification(got, want, a, rerun, shifted):
    same_all(got[:2], want[:2], ["accepted", "accept_len"])
    draws(got[2], want[2], lambda d: rerun(uniforms=shifted(a["uniforms"], d))[2], "next_token")


def _shift_column0(u, d):
    u = u.clone()
    u[:, 0] = shifted_uniforms(u[:, 0], d)
    return u


VERIFY_TREE_SAMPLING = OpSpec(
    name="verify_tree_sampling",
    base=st.fixed_dictionaries({**_BASE, **_PARAMS, "q": st.booleans()}),
    kinds=_sampling_kinds_all,
    build=_sampling_case,
    raw=lambda a, v: R.verify_tree_sampling(a["logits"], a["tokens"], a["parents"], a["draft_probs"], a["uniforms"],
                                            a["temperature"], a["top_k"], a["top_p"], v),
    wrapper=lambda a, v: ops.verify_tree_sampling(a["logits"], a["tokens"], a["parents"], a["uniforms"],
                                                  a["draft_probs"], a["temperature"], a["top_k"], a["top_p"],
                                                  validate=v),
    reference=_sampling_ref,
    compare=lambda got, want, a, rerun: _compare_verification(got, want, a, rerun, _shift_column0),
)

# verify_tree_typical ---------------------------------------------------------------------------------------------


def _typical_case(r) -> dict:
    a = _tree_case(r)
    g = make_gen(r["seed"] + 1)
    a["uniforms"] = torch.rand(r["B"], generator=g)
    a["temperature"] = _row_param(r, "temperature", r["B"], torch.float32, g)
    a["posterior_threshold"], a["posterior_alpha"] = r["thr_alpha"]
    return a


# a node whose probability is this close to its threshold (relative) is a tie: float32 softmax and entropy sums in
# another order than the reference's float64 ones may decide it either way (a uniform distribution with alpha 1)
TYPICAL_TIE_RTOL = 1e-5


def _typical_ties(a) -> torch.Tensor:
    """Per row ``[B]``: whether some node's token probability is within TYPICAL_TIE_RTOL of its parent's threshold
    (rows the reference refuses: no)."""
    logits, tokens, parents = a["logits"], a["tokens"], a["parents"]
    B, N, V = logits.shape
    temperature = per_row(a["temperature"], B, torch.float32)
    ties = torch.zeros(B, dtype=torch.bool)
    for b in range(B):
        for c in range(1, N):
            par, tok = int(parents[b, c]), int(tokens[b, c])
            if not (0 <= par < N and 0 <= tok < V):
                continue
            x = logits[b, par].float()
            if bool((x.isnan() | (x == float("inf"))).any()):
                continue  # (-inf: a masked id, as the reference reads it)
            try:
                p, thr = ref.typical_threshold(x, float(temperature[b]), a["posterior_threshold"],
                                               a["posterior_alpha"])
            except ValueError:
                continue
            ties[b] |= abs(float(p[tok]) - thr) <= TYPICAL_TIE_RTOL * max(abs(thr), 1e-30)
    return ties


def _compare_typical(got, want, a, rerun):
    """As the other verifications, but a row with a tie (:func:`_typical_ties`) is unspecified: taken as the
    reference's."""
    ties = _typical_ties(a)
    if bool(ties.any()):  # (an answer of another shape or dtype is left for the comparison to name)
        got = tuple(torch.where(ties.view(-1, *[1] * (w.dim() - 1)), w, g.detach().cpu())
                    if isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype else g
                    for g, w in zip(got, want))
    _compare_verification(got, want, a, rerun, shifted_uniforms)


VERIFY_TREE_TYPICAL = OpSpec(
    name="verify_tree_typical",
    base=st.fixed_dictionaries({**_BASE, **_PARAMS, "thr_alpha": st.sampled_from([(0.09, 0.3), (0.3, 0.5), (0.0, 0.0),
                                                                                   (1.0, 1.0)])}),
    kinds=lambda r: {**_tree_kinds(r), "uniforms": Arg("float"), "temperature": Arg("row_f"),
                     "posterior_threshold": Arg("real"), "posterior_alpha": Arg("real")},
    build=_typical_case,
    raw=lambda a, v: R.verify_tree_typical(a["logits"], a["tokens"], a["parents"], a["uniforms"], a["temperature"],
                                           a["posterior_threshold"], a["posterior_alpha"], v),
    wrapper=lambda a, v: ops.verify_tree_typical(a["logits"], a["tokens"], a["parents"], a["uniforms"],
                                                 a["temperature"], a["posterior_threshold"], a["posterior_alpha"],
                                                 validate=v),
    reference=lambda a, v: ref.verify_tree_typical(a["logits"], a["tokens"], a["parents"], a["uniforms"],
                                                   per_row(a["temperature"], _rows(a), torch.float32),
                                                   a["posterior_threshold"], a["posterior_alpha"], v),
    compare=_compare_typical,
)

# sample_tokens ---------------------------------------------------------------------------------------------------


def _sample_case(r) -> dict:
    g = make_gen(r["seed"])
    rows = r["B"] * r["N"]
    a = {"logits": _logits(g, (rows, r["V"]), r).to(dtype_of(r["dtype"])), "uniforms": torch.rand(rows, generator=g)}
    for name, dtype in (("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32)):
        a[name] = _row_param(r, name, rows, dtype, g)
    return a


def _compare_samples(got, want, a, rerun):
    draws(got[0], want[0], lambda d: rerun(uniforms=shifted_uniforms(a["uniforms"], d))[0], "tokens")
    close(got[1], want[1], P_ATOL, P_RTOL, "probs")


SAMPLE_TOKENS = OpSpec(
    name="sample_tokens",
    base=st.fixed_dictionaries({**_BASE, **_PARAMS}),
    kinds=lambda r: {"logits": Arg("float"), "uniforms": Arg("float"), **_sampling_kinds(r)},
    build=_sample_case,
    raw=lambda a, v: R.sample_tokens(a["logits"], a["uniforms"], a["temperature"], a["top_k"], a["top_p"], v),
    wrapper=lambda a, v: ops.sample_tokens(a["logits"], a["uniforms"], a["temperature"], a["top_k"], a["top_p"],
                                           validate=v),
    reference=lambda a, v: ref.sample_tokens(a["logits"], a["uniforms"], *_params_for_ref(a, _rows(a)), v),
    compare=_compare_samples,
)

# expand_tree_step ------------------------------------------------------------------------------------------------


def _expand_case(r) -> dict:
    g = make_gen(r["seed"])
    B, F, V = r["B"], r["N"], r["V"]
    top_k = 1 + r["top_k"] % V
    return {"logits": _logits(g, (B, F, V), r).to(dtype_of(r["dtype"])),
            "parent_scores": -torch.rand(B, F, generator=g) * 5, "top_k": top_k,
            "num_select": 1 + r["num_select"] % (F * top_k)}


def _compare_expand(got, want, a, rerun):
    same(got[0], want[0], "cand_tokens")
    close(got[1], want[1], S_ATOL, S_RTOL, "cand_scores")
    assert got[2].dtype == want[2].dtype and got[2].shape == want[2].shape, (
        f"selected: {got[2].dtype} {tuple(got[2].shape)}, the reference's {want[2].dtype} {tuple(want[2].shape)}")
    _check_selected(got[2].cpu(), got[1].cpu(), want[2])


def _expand_call(fn):
    return lambda a, v: fn(a["logits"], a["parent_scores"], a["top_k"], a["num_select"], v)


EXPAND_TREE_STEP = OpSpec(
    name="expand_tree_step",
    base=st.fixed_dictionaries({**_BASE, "top_k": st.integers(0, 9), "num_select": st.integers(0, 40)}),
    kinds=lambda r: {"logits": Arg("float"), "parent_scores": Arg("float"),
                     "top_k": Arg("int", (1, r["V"])), "num_select": Arg("int", (1, r["N"] * r["V"]))},
    build=_expand_case,
    raw=_expand_call(R.expand_tree_step),
    wrapper=_expand_call(ops.expand_tree_step),
    reference=_expand_call(ref.expand_tree_step),
    compare=_compare_expand,
)

SPECS = [VERIFY_TREE_GREEDY, VERIFY_TREE_SAMPLING, VERIFY_TREE_TYPICAL, SAMPLE_TOKENS, EXPAND_TREE_STEP]
