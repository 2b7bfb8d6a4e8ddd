"""What one fuzz example is and how it is judged.

A *recipe* is a JSON-able dict of primitives drawn by hypothesis: the op, its dimensions and variants, a seed for the
tensor values, ``raw`` (call ``torch.ops.specdec_ext.<op>`` instead of the ``specdec_ext.ops`` wrapper), ``validate``
and a list of *mutations* applied to the valid arguments the op's :class:`OpSpec` builds from it. A recipe rebuilds
the same arguments every time, so a failing one is a reproducer (``python -m fuzz.worker --replay '<recipe>'``).

The verdict of one example (:func:`check`):
* an exception must be an argument error (:data:`ARGUMENT_ERRORS`) whose message names the op or an argument;
* when only argument *values* were mutated, the reference must refuse too, with the same first line;
* an answer must equal the reference's answer on CPU copies of the arguments (tolerances of the per-op tests);
* meta tensors mixed with CPU ones must be refused naming both devices; all-meta arguments must give meta outputs of
  the shapes and dtypes the CPU kernel gives;
* an op that works in place changes nothing when it refuses structurally, and what the reference changes otherwise.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from hypothesis import strategies as st

# Project policy: every argument error is a ValueError. Exception types tolerated besides it while ops are converted
# (RuntimeError was, during issue 19; the CPU ops hold to the policy since): empty = the policy itself.
TOLERATED_FOR_NOW: tuple[type[Exception], ...] = ()
ARGUMENT_ERRORS: tuple[type[Exception], ...] = (ValueError,) + TOLERATED_FOR_NOW

EXTREME_INTS = [-1, -2, 2**31 - 1, 2**31, -2**31 - 1, 2**32 + 1, 2**62, 2**63 - 1, 2**63 - 2, -2**63, -2**63 + 1]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e30, -1e30, 3.4e38, 1e-40, 65504.0, -1.0, 1.0,
                  0.99999994, 1.0000001]
FLOAT_DTYPES = ["float32", "float16", "bfloat16"]
OTHER_DTYPES = ["float64", "int64", "int32", "int16", "uint8", "bool"]


def dim(low: int, high: int, *big: int) -> st.SearchStrategy[int]:
    """A dimension: mostly in [low, high] (the reference is slow Python), sometimes one of ``big`` (the kernels'
    vector tails, tiles, thread splits and multi-word masks)."""
    return st.sampled_from(list(range(low, high + 1)) * 3 + list(big))


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


class Failure(AssertionError):
    """The op broke its contract on this example (the message says how)."""


# ---------------------------------------------------------------------------------------------------------------
# Arguments and mutations.


@dataclass
class Arg:
    """One argument of an op, as far as mutating it goes.

    kind: "tree" (parents: int64, a tree per row), "index" (an int64 tensor of positions / tokens), "float" (a float
    tensor of data), "mask" (a bool tensor), "row_f" / "row_i" (a per-row float / int parameter: a number or a [B]
    tensor), "int" / "real" (a scalar argument), "caches" (a list of tensors), "fixed" (not mutated).
    bounds: integers near which the argument's validity changes (e.g. V for tokens), for value mutations.
    alias: another argument this one may be replaced by (the same tensor passed twice).
    """

    kind: str
    bounds: tuple[int, ...] = ()
    alias: str = ""


TENSOR_KINDS = ("tree", "index", "float", "mask", "row_f", "row_i")
DATA = {"value", "row", "tree"}  # mutations of values only: the reference can judge them
LAYOUT = {"layout"}  # values kept, memory layout changed
ORDER = {"value": 0, "row": 0, "tree": 0, "scalar": 0, "shape": 1, "dtype": 2, "alias": 3, "layout": 4, "meta": 5,
         "all_meta": 6}


def _int_values(bounds) -> st.SearchStrategy[int]:
    near = sorted({b + d for b in bounds for d in (-1, 0, 1)})
    return st.one_of(st.sampled_from(EXTREME_INTS), st.sampled_from(near or [0]), st.integers(-3, 40))


def _float_values() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(-10, 10, width=32))


@st.composite
def mutation(draw, args: dict[str, Arg]) -> list:
    """One mutation of one of ``args`` (a JSON-able list: kind, argument name, parameters)."""
    name = draw(st.sampled_from(sorted(args)))
    a = args[name]
    kinds = []
    if a.kind in TENSOR_KINDS and draw(st.integers(0, 6)) == 4:  # (meta: rarer, it makes the other mutations moot)
        return ["meta", name]
    if a.kind in TENSOR_KINDS:
        kinds += ["value", "dtype", "shape", "layout"]
        kinds += {"tree": ["tree", "tree"], "float": ["row", "value"], "row_f": ["value"], "row_i": ["value"]}.get(
            a.kind, [])
        kinds += ["alias"] if a.alias else []
    elif a.kind in ("int", "real"):
        kinds += ["scalar"]
    elif a.kind == "caches":
        kinds += ["alias", "layout", "meta", "dtype", "shape", "value"]
    else:
        return ["all_meta"]
    kind = draw(st.sampled_from(kinds))
    pos = draw(st.integers(0, 2**16))
    if kind in ("value", "scalar"):
        if a.kind in ("float", "row_f", "real") or (a.kind == "caches" and kind == "value"):
            return [kind, name, pos, draw(_float_values())]
        return [kind, name, pos, draw(_int_values(a.bounds))]
    if kind == "row":
        return [kind, name, pos, draw(st.sampled_from([-math.inf, math.nan, math.inf, 0.0, 1e30]))]
    if kind == "tree":
        return [kind, name, pos, draw(st.sampled_from(["root", "self", "later", "minus1", "extreme"])),
                draw(st.sampled_from(EXTREME_INTS))]
    if kind == "dtype":
        return [kind, name, pos, draw(st.sampled_from(FLOAT_DTYPES + OTHER_DTYPES))]
    if kind == "shape":
        return [kind, name, pos, draw(st.sampled_from(["unsqueeze", "drop", "grow", "shrink", "empty", "scalar"]))]
    if kind == "layout":
        return [kind, name, pos, draw(st.sampled_from(["transpose", "gap", "lastdim", "offset", "broadcast"]))]
    if kind == "alias":
        return [kind, name, pos]
    return [kind, name]  # meta


def _get(args: dict, name: str):
    if "." in name:
        base, i = name.split(".")
        return args[base][int(i)]
    return args[name]


def _set(args: dict, name: str, value) -> None:
    if "." in name:
        base, i = name.split(".")
        args[base] = list(args[base])
        args[base][int(i)] = value
    else:
        args[name] = value


def _tree(t: torch.Tensor, pos: int, mode: str, extreme: int) -> torch.Tensor:
    if t.dim() != 2 or t.numel() == 0:
        return t
    t = t.clone()
    B, N = t.shape
    b, i = pos % B, 1 + (pos // B) % max(N - 1, 1)
    if mode == "root" or N == 1:
        t[b, 0] = 0 if mode != "extreme" else extreme
    elif mode == "self":
        t[b, i] = i
    elif mode == "later":
        t[b, i] = min(i + 1 + pos % 3, N)
    elif mode == "minus1":
        t[b, i] = -1
    else:
        t[b, i] = extreme
    return t


def _value(t, pos: int, v, kind: str):
    if not isinstance(t, torch.Tensor):
        return v if kind != "row_i" or isinstance(v, int) else t
    if t.numel() == 0:
        return t
    t = t.clone()
    flat = t.view(-1)
    i = pos % t.numel()
    if t.dtype == torch.bool:
        flat[i] = not bool(flat[i])
    elif t.is_floating_point():
        flat[i] = float(v)
    else:
        info = torch.iinfo(t.dtype)
        flat[i] = int(v) if info.min <= int(v) <= info.max else info.max
    return t


def _row(t: torch.Tensor, pos: int, v: float) -> torch.Tensor:
    if t.dim() < 1 or t.numel() == 0 or not t.is_floating_point():
        return t
    t = t.clone()
    rows = t.view(-1, t.shape[-1])
    rows[pos % rows.shape[0]] = v
    return t


def _shape(t, pos: int, how: str):
    if not isinstance(t, torch.Tensor):
        return t
    if how == "unsqueeze":
        return t.unsqueeze(0)
    if how == "scalar":
        return t.reshape(-1)[0].clone() if t.numel() else t.sum()
    if t.dim() == 0:
        return t.reshape(1)
    d = pos % t.dim()
    if how == "drop":
        return t.select(d, 0).clone() if t.shape[d] else t.sum(d)
    if how == "grow":
        return torch.cat([t, t.narrow(d, 0, 1)], d) if t.shape[d] else t.new_zeros(*t.shape[:d], 1, *t.shape[d + 1:])
    if how == "shrink":
        return t.narrow(d, 0, max(t.shape[d] - 1, 0)).clone()
    return t.narrow(d, 0, 0).clone()  # empty


def _layout(t, how: str):
    """A view with ``t``'s values and another memory layout (non-contiguous, or contiguous at an odd offset); or,
    "broadcast", a stride-0 view repeating ``t``'s first row."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return t
    if how == "broadcast":
        return t[:1].expand_as(t) if t.dim() else t
    if how == "offset" or t.dim() == 0:
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
    elif how == "transpose" and t.dim() >= 2:
        view = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).permute(*range(t.dim() - 1, -1, -1))
    elif how == "gap" and t.dim() >= 2:
        big = torch.empty(*t.shape[:-2], 2 * t.shape[-2], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
        view = big[..., ::2, : t.shape[-1]]
    else:  # lastdim (and 1-D tensors): every other element
        view = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)[..., ::2]
    view.copy_(t)
    return view


def _dtype(t, name: str):
    if not isinstance(t, torch.Tensor):
        return t
    return t.to(dtype_of(name))


def _tensors(args: dict) -> list[torch.Tensor]:
    out = []
    for v in args.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


# Argument checks that read a tensor's values even with validate=False, so that meta tensors (no values) cannot meet
# them: the row-count marker in a packed weight's padding (csrc/ops/checks.h, check_packed_rows).
CHECKS_OF_DATA = (" output features (pack_linear_weight's output for a weight of ",)


def to_meta(t: torch.Tensor, bases: dict | None = None) -> torch.Tensor:
    """``t`` on the meta device with its strides (``Tensor.to`` makes a gapped layout contiguous; a meta ``t``: itself,
    so that a second mutation to meta keeps what the first shared). ``bases``: one meta
    storage per real one across calls, so tensors that shared memory share it as meta views too (an aliasing the op
    refuses must still be there to refuse)."""
    if t.device.type == "meta":
        return t
    if bases is None or t.numel() == 0:  # (empty tensors hold no memory to share)
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    storage = t.untyped_storage()
    key = (storage.data_ptr(), t.dtype)
    if key not in bases:
        bases[key] = torch.empty(storage.nbytes() // t.element_size(), dtype=t.dtype, device="meta")
    return bases[key].as_strided(t.shape, t.stride(), t.storage_offset())


def apply_mutations(args: dict, kinds: dict[str, Arg], mutations: list) -> dict:
    """``args`` with ``mutations`` applied: values first, then shapes, dtypes, aliases, layouts, devices."""
    args = dict(args)
    bases: dict = {}  # (one meta storage per real one, whichever mutation moves a tensor to meta: to_meta)
    for m in sorted(mutations, key=lambda m: ORDER[m[0]]):
        kind, name = m[0], m[1] if len(m) > 1 else None
        if kind == "all_meta":
            for n, v in args.items():
                if isinstance(v, torch.Tensor):
                    args[n] = to_meta(v, bases)
                elif isinstance(v, list):
                    args[n] = [to_meta(t, bases) for t in v]
            continue
        a = kinds[name]
        if a.kind == "caches":
            caches = args[name]
            i = m[2] % len(caches) if len(m) > 2 else 0
            target = f"{name}.{i}"
            if kind == "alias":
                if len(caches) > 1:
                    _set(args, f"{name}.{(i + 1) % len(caches)}", caches[i])
                continue
            if kind == "meta":
                _set(args, target, to_meta(caches[i], bases))
                continue
            name = target
        v = _get(args, name)
        if kind == "alias":
            v = args[a.alias]
        elif kind == "value" or kind == "scalar":
            v = _value(v, m[2], m[3], a.kind)
        elif kind == "row":
            v = _row(v, m[2], m[3])
        elif kind == "tree":
            v = _tree(v, m[2], m[3], m[4])
        elif kind == "dtype":
            v = _dtype(v, m[3])
        elif kind == "shape":
            v = _shape(v, m[2], m[3])
        elif kind == "layout":
            v = _layout(v, m[3])
        elif kind == "meta":
            v = to_meta(v, bases) if isinstance(v, torch.Tensor) else v
        _set(args, name, v)
    return args


# ---------------------------------------------------------------------------------------------------------------
# Ops.


@dataclass
class OpSpec:
    """How to fuzz one op.

    base: hypothesis strategy of the op's own recipe fields (dimensions, dtype, variants, seed).
    kinds(recipe): the op's arguments (raw schema names, in schema order) and how to mutate them.
    build(recipe): valid arguments (CPU tensors), keyed by kinds' names; per-row parameters may be numbers unless
        recipe["raw"].
    raw(args, validate) / wrapper(args, validate): call the op (the wrapper is None for ops without one).
    reference(args, validate): the reference's answer on CPU arguments.
    compare(got, want, args, rerun): asserts the kernel's answer matches the reference's; ``args`` are CPU copies
        of the arguments, ``rerun(**overrides)`` reruns the reference with some of them replaced.
    inplace: arguments the op writes (compared after the call).
    inplace_tolerance(name, got, want, args): asserts the kernel's value of the written argument ``name`` matches the
        reference's (``args``: CPU copies of the arguments before the call); None: bit-exact.
    """

    name: str
    base: st.SearchStrategy
    kinds: Callable[[dict], dict[str, Arg]]
    build: Callable[[dict], dict]
    raw: Callable[[dict, bool], Any]
    reference: Callable[[dict, bool], Any]
    compare: Callable[[Any, Any, dict, Callable], None]
    wrapper: Callable[[dict, bool], Any] | None = None
    inplace: tuple[str, ...] = ()
    inplace_tolerance: Callable[[str, torch.Tensor, torch.Tensor, dict], None] | None = None
    names: tuple[str, ...] = ()  # more words a clear message may name (the wrapper's argument names)


@st.composite
def recipes(draw, spec: OpSpec) -> dict:
    recipe = {"op": spec.name, **draw(spec.base)}
    recipe["raw"] = spec.wrapper is None or draw(st.booleans())
    recipe["validate"] = draw(st.sampled_from([True, True, False]))
    kinds = spec.kinds(recipe)
    n = draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))
    recipe["mutations"] = [draw(mutation(kinds)) for _ in range(n)]
    if draw(st.integers(0, 24)) == 13:  # (not 0: hypothesis draws its simplest values most often)
        recipe["mutations"].append(["all_meta"])
    return recipe


def materialize(spec: OpSpec, recipe: dict) -> dict:
    return apply_mutations(spec.build(recipe), spec.kinds(recipe), recipe["mutations"])


def call(spec: OpSpec, recipe: dict, args: dict, validate: bool | None = None):
    validate = recipe["validate"] if validate is None else validate
    if recipe["raw"] or spec.wrapper is None:
        return spec.raw(args, validate)
    return spec.wrapper(args, validate)


def to_cpu(args: dict) -> dict:
    """Independent CPU copies (clones) of every tensor argument; a tensor passed twice gives one copy, passed twice."""
    seen: dict[int, torch.Tensor] = {}

    def copy(t):
        if id(t) not in seen:
            seen[id(t)] = t.detach().cpu().clone()
        return seen[id(t)]

    return {n: copy(v) if isinstance(v, torch.Tensor) else [copy(t) for t in v] if isinstance(v, list) else v
            for n, v in args.items()}


def describe(args: dict) -> str:
    """The arguments, one line each: shape, dtype, device, strides, and the values of small tensors."""

    def one(v) -> str:
        if isinstance(v, torch.Tensor):
            s = f"tensor{list(v.shape)} {str(v.dtype).replace('torch.', '')} {v.device}"
            if not v.is_contiguous() or v.storage_offset():
                s += f" strides={list(v.stride())} offset={v.storage_offset()}"
            if v.device.type != "meta" and v.numel() <= 48:
                s += f" {v.tolist()}"
            elif v.device.type != "meta" and v.is_floating_point():
                s += f" (nan {int(v.isnan().sum())}, inf {int(v.isinf().sum())})"
            return s
        if isinstance(v, list):
            return "[" + ", ".join(one(t) for t in v) + "]"
        return repr(v)

    return "\n".join(f"  {n} = {one(v)}" for n, v in args.items())


def _clear(spec: OpSpec, names, exc: BaseException) -> str | None:
    """Why ``exc`` is not a clear argument error (None when it is)."""
    if not isinstance(exc, ARGUMENT_ERRORS):
        return f"raised {type(exc).__name__}, not an argument error ({', '.join(e.__name__ for e in ARGUMENT_ERRORS)})"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    words = {spec.name, *names, *spec.names}
    if not any(re.search(rf"(?<![A-Za-z_]){re.escape(w)}(?![A-Za-z_])", first) for w in words):
        return "the message names neither the op nor an argument"
    if "INTERNAL ASSERT" in str(exc):
        return "an internal assertion, not an argument check"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _run(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001  (the verdict sorts exceptions)
        return None, exc


def _shapes(out) -> list:
    if isinstance(out, torch.Tensor):
        return [(tuple(out.shape), out.dtype)]
    if out is None:
        return []
    return [x for o in out for x in _shapes(o)]


def _devices(out) -> set:
    if isinstance(out, torch.Tensor):
        return {out.device.type}
    if out is None:
        return set()
    return set().union(*(_devices(o) for o in out))


def check(spec: OpSpec, recipe: dict) -> str:
    """Runs one example; returns "answered", "refused" or "meta", raises :class:`Failure` with the details."""
    names = tuple(spec.kinds(recipe))
    args = materialize(spec, recipe)
    tensors = _tensors(args)
    metas = [t for t in tensors if t.device.type == "meta"]
    cpu_before = to_cpu({n: args[n] for n in spec.inplace}) if not metas else {}
    got, exc = _run(lambda: call(spec, recipe, args))

    def fail(what: str) -> None:
        detail = f"{type(exc).__name__}: {_first_line(exc)}" if exc is not None else "(answered)"
        raise Failure(f"{spec.name}: {what}\n  op said: {detail}\n{describe(args)}\n  recipe: {json.dumps(recipe)}")

    if metas:
        if exc is not None and (why := _clear(spec, names, exc)):
            fail(f"meta arguments: {why}")
        if len(metas) < len(tensors):
            if exc is None:
                fail("meta tensors mixed with CPU tensors were accepted, not refused")
            only_devices = all(m[0] in DATA or m[0] == "meta" for m in recipe["mutations"])
            checked_data = any(c in str(exc) for c in CHECKS_OF_DATA)  # (a value mutation a data check saw first)
            if only_devices and not checked_data and ("meta" not in str(exc) or "cpu" not in str(exc)):
                fail("meta tensors mixed with CPU tensors: the message does not name both devices")
            return "refused"
        cpu_recipe = {**recipe, "mutations": [m for m in recipe["mutations"] if m[0] not in ("meta", "all_meta")]}
        cpu_args = materialize(spec, cpu_recipe)
        cpu_got, cpu_exc = _run(lambda: call(spec, cpu_recipe, cpu_args, validate=False))
        if cpu_exc is None and exc is not None:
            fail("all-meta arguments refused although the CPU kernel answers the same arguments")
        if cpu_exc is not None and exc is None:
            if any(c in str(cpu_exc) for c in CHECKS_OF_DATA):
                return "meta"  # (refused on CPU for values that meta tensors do not have)
            fail(f"all-meta arguments accepted although the CPU kernel refuses them ({_first_line(cpu_exc)})")
        if exc is None and (_shapes(got) != _shapes(cpu_got) or _devices(got) - {"meta"}):
            fail(f"all-meta outputs {_shapes(got)} on {_devices(got)}, the CPU kernel gives {_shapes(cpu_got)}")
        return "meta"

    data_only = all(m[0] in DATA for m in recipe["mutations"])
    if exc is not None and (why := _clear(spec, names, exc)):
        fail(why)
    untouched = all(_same_values(args[n], cpu_before[n]) for n in spec.inplace)
    if exc is not None and not data_only and untouched:
        return "refused"
    # (the reference runs only now: given what the kernels refuse, e.g. absurd sizes, it may allocate without limit)
    ref_args = to_cpu({**args, **cpu_before})
    before = to_cpu(ref_args)  # (the reference writes ref_args)
    want, ref_exc = _run(lambda: spec.reference(ref_args, recipe["validate"]))
    if exc is not None:
        # refused after writing (a data error found by the kernel, the valid rows moved): as the reference does
        if data_only or not untouched:
            if ref_exc is None:
                fail("refused arguments that the reference answers")
            if not isinstance(ref_exc, ValueError):
                fail(f"the reference fails with {type(ref_exc).__name__}: {_first_line(ref_exc)}")
            if _first_line(ref_exc) != _first_line(exc):
                fail(f"message differs from the reference's: {_first_line(ref_exc)!r}")
            for n in spec.inplace:  # the valid rows moved as in the reference
                _compare_inplace(spec, n, args[n], ref_args[n], before, fail)
        return "refused"
    if ref_exc is not None:
        fail(f"answered arguments that the reference refuses: {type(ref_exc).__name__}: {_first_line(ref_exc)}")

    def rerun(**over):
        a = to_cpu({**args, **cpu_before, **over})
        return spec.reference(a, recipe["validate"])

    try:
        spec.compare(got, want, to_cpu({**args, **cpu_before}), rerun)
    except AssertionError as err:
        fail(f"differs from the reference: {str(err).strip()[:600]}")
    for n in spec.inplace:
        _compare_inplace(spec, n, args[n], ref_args[n], before, fail)
    return "answered"


def _same_values(got, want) -> bool:
    """Equal shapes and values (NaN equal to NaN), element by element of a list."""
    pairs = zip(got, want) if isinstance(got, list) else [(got, want)]
    return all(not isinstance(g, torch.Tensor) or (
        g.shape == w.shape and torch.equal(g.detach().cpu().isnan(), w.isnan())
        and torch.equal(g.detach().cpu().nan_to_num(), w.nan_to_num())) for g, w in pairs)


def _compare_inplace(spec: OpSpec, name: str, got, want, before: dict, fail) -> None:
    """An argument the op writes, after the call, against the reference's after its call (``before``: CPU copies of
    the arguments before the call)."""
    pairs = zip(got, want) if isinstance(got, list) else [(got, want)]
    for i, (g, w) in enumerate(pairs):
        if not isinstance(g, torch.Tensor):
            continue
        if spec.inplace_tolerance is None:
            if not _same_values(g, w):
                fail(f"{name}[{i}] after the call differs from the reference's")
            continue
        try:
            spec.inplace_tolerance(name, g.detach().cpu(), w, before)
        except AssertionError as err:
            fail(f"{name}[{i}] after the call differs from the reference's: {str(err).strip()[:300]}")
