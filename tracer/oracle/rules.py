"""Which aten ops the oracle can replay, and how: one table from op name to a kind and an interval rule.

Kinds decide the rounding model that :mod:`ulptrace.oracle.replay` applies after the rule:

=========  ================================================================  ======================
kind       ops                                                               rounding afterwards
=========  ================================================================  ======================
view       view, reshape, expand, transpose, permute, slice, select, split,  none (values unchanged)
           clone, contiguous, ...
select     cat, stack, where, masked_fill, index, gather, tril, pad, ...     none (picks values)
convert    ``_to_copy`` (``.to(dtype)``, ``.float()``, ``type_as``)          at the result dtype
exact      add, sub, mul, neg, square, abs, max/min, clamp, relu             at the result dtype
approx     exp, log, sqrt, rsqrt, reciprocal, div, sigmoid, silu, softplus,  slack, then result dtype
           tanh, gelu, erf, pow with other exponents
reduce     sum, mean, linalg_vector_norm (any-order FP32 bound)              at the result dtype
matmul     mm, bmm, addmm, baddbmm, mv, dot, depthwise 1-d convolution       at the result dtype
           (FP32 accumulation)
softmax    ``_softmax``                                                      at the result dtype
attention  the fused SDPA ops of :mod:`ulptrace.oracle.attention`            at the result dtype
compare    eq, ne, lt, le, gt, ge, logical ops (exact inputs only)           none
=========  ================================================================  ======================

An op not in the table cannot be replayed; :func:`rule_for` raises an error naming it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from ulptrace.oracle import intervals as I
from ulptrace.oracle.attention import ATTENTION_OPS, replay_attention
from ulptrace.oracle.intervals import Iv


class UnsupportedOpError(NotImplementedError):
    """An op of a captured program has no replay rule (or is used in a way the rule cannot replay)."""


@dataclass(frozen=True)
class Call:
    """One op call during replay: the overload, its arguments (program values as :class:`Iv`), the
    same arguments bound to schema names, and the context the rules need."""

    func: Any
    args: tuple
    kwargs: dict
    b: dict[str, Any]
    out_dtype: torch.dtype
    compute: torch.dtype
    attrs: dict
    stages: frozenset
    where: str


Handler = Callable[[Call], Any]


@dataclass(frozen=True)
class Rule:
    kind: str
    handler: Handler


def bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of an aten call by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    n = len(args)
    for i, (name, kwarg_only, default) in enumerate(_schema(func)):
        if not kwarg_only and i < n:
            bound[name] = args[i]
        elif name in kwargs:
            bound[name] = kwargs[name]
        else:
            bound[name] = default
    return bound


@functools.cache
def _schema(func: Any) -> tuple[tuple[str, bool, Any], ...]:
    """An aten op's arguments as (name, keyword-only, default or None), read from its schema once: the replay binds
    every op's arguments on every record judged, and reading the schema through its bindings costs more than the
    binding. (Positional arguments precede keyword-only ones in an aten schema, so the i-th argument is positional i.)"""
    return tuple((a.name, a.kwarg_only, a.default_value if a.has_default_value() else None)
                 for a in func._schema.arguments)


def map_args(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` — an op's arguments: tuples, lists and dicts around leaves — with ``fn`` applied to every leaf. What
    torch's pytree ``tree_map`` does for these containers (other types, ``torch.Size`` included, are leaves as they
    are there or hold no value reference), at a fraction of its cost on the replay's path (per op, per record)."""
    kind = type(tree)
    if kind is tuple:
        return tuple(map_args(fn, x) for x in tree)
    if kind is list:
        return [map_args(fn, x) for x in tree]
    if kind is dict:
        return {k: map_args(fn, v) for k, v in tree.items()}
    return fn(tree)


def arg_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in :func:`map_args`'s order (``tree_flatten``'s for these containers)."""
    out: list[Any] = []
    map_args(out.append, tree)
    return out


# ---------------------------------------------------------------------------------------------- helpers


def _iv(c: Call, value: Any) -> Iv:
    """A tensor argument as an interval, a Python scalar as the op's compute type sees it."""
    if isinstance(value, Iv):
        return value
    if isinstance(value, (bool, int, float)):
        like = next(v.lo for v in c.b.values() if isinstance(v, Iv))
        return I.scalar_iv(I.round_scalar(value, c.compute), like)
    raise UnsupportedOpError(f"{c.where}: cannot replay argument {value!r}")


def _componentwise(c: Call) -> Any:
    """Apply the op itself to the lo, hi and pt components (views, selections, monotone maps)."""
    ivs = [leaf for leaf in arg_leaves((c.args, c.kwargs)) if isinstance(leaf, Iv)]
    all_point = all(v.is_point for v in ivs)
    track = all(v.pt is not None for v in ivs)

    def run(which: str) -> Any:
        args, kwargs = map_args(lambda a: getattr(a, which) if isinstance(a, Iv) else a, (c.args, c.kwargs))
        return c.func(*args, **kwargs)

    lo = run("lo")
    hi = lo if all_point else run("hi")
    pt = (lo if all(v.pt is v.lo for v in ivs) else run("pt")) if track else None

    def wrap(lo_t: Any, hi_t: Any, pt_t: Any) -> Any:
        if isinstance(lo_t, torch.Tensor):
            return Iv(lo_t, hi_t, pt_t)
        return None

    if isinstance(lo, torch.Tensor):
        return wrap(lo, hi, pt)
    pts = pt if pt is not None else [None] * len(lo)
    return tuple(wrap(a, b, p) for a, b, p in zip(lo, hi, pts))


def _reshape(c: Call) -> Iv:
    size = c.b.get("size") or c.b.get("shape")
    return c.b["self"].map(lambda t: t.reshape(size))


def _dims(c: Call, x: Iv) -> list[int]:
    dim = c.b.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.lo.dim()))
    return [dim] if isinstance(dim, int) else list(dim)


def _terms(x_shape: tuple[int, ...], dims: list[int]) -> int:
    return math.prod(x_shape[d] for d in dims) if x_shape else 1


# ---------------------------------------------------------------------------------------------- exact ops


def _add(c: Call, sign: float = 1.0) -> Iv:
    a, b = _iv(c, c.b["self"]), _iv(c, c.b["other"])
    alpha = c.b.get("alpha", 1)
    if alpha is not None and float(alpha) != 1.0:
        b = I.round_iv(I.mul(b, _iv(c, alpha)), c.compute)
    return I.add(a, b) if sign > 0 else I.sub(a, b)


def _rsub(c: Call) -> Iv:
    a, b = _iv(c, c.b["self"]), _iv(c, c.b["other"])
    alpha = c.b.get("alpha", 1)
    if alpha is not None and float(alpha) != 1.0:
        a = I.round_iv(I.mul(a, _iv(c, alpha)), c.compute)
    return I.sub(b, a)


def _mul(c: Call) -> Iv:
    return I.mul(_iv(c, c.b["self"]), _iv(c, c.b["other"]))


def _div(c: Call) -> Iv:
    if c.b.get("rounding_mode") is not None:
        raise UnsupportedOpError(f"{c.where}: division with rounding_mode={c.b['rounding_mode']!r}")
    return I.approx_slack(I.div(_iv(c, c.b["self"]), _iv(c, c.b["other"])), c.compute)


def _pow(c: Call) -> Iv:
    x, e = c.b["self"], c.b["exponent"]
    if isinstance(e, Iv):
        raise UnsupportedOpError(f"{c.where}: pow with a tensor exponent")
    e = float(e)
    if e == 1.0:
        return x
    if e == 2.0:
        return I.square(x)
    if e == 0.5:
        r = I.monotone(x, torch.sqrt)
    elif e == -0.5:
        r = I.monotone(x, torch.rsqrt, increasing=False)
    elif e == -1.0:
        r = I.reciprocal(x)
    elif e.is_integer() and int(e) % 2 == 0 and e > 0:
        r = I.even_power(x, lambda t: t.pow(e))
    elif e.is_integer() and e > 0:
        r = I.monotone(x, lambda t: t.pow(e))
    else:
        # non-integer (or negative) exponents are only defined for x >= 0, where pow is monotone
        r = I.monotone(x, lambda t: t.pow(e), increasing=e > 0)
    return I.approx_slack(r, c.compute)


# ---------------------------------------------------------------------------------------------- approximate functions


def _silu(t: torch.Tensor) -> torch.Tensor:
    return t * torch.sigmoid(t)


def _gelu_none(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t)


def _gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")


def _softplus_fn(beta: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        bt = t * beta
        return (torch.log1p(torch.exp(-bt.abs())) + bt.clamp(min=0)) / beta

    return fn


_INCREASING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log, "log2": torch.log2,
    "log1p": torch.log1p, "sqrt": torch.sqrt, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "erf": torch.erf,
}


def _increasing(c: Call) -> Iv:
    name = c.func._schema.name.split("::")[1]
    return I.approx_slack(I.monotone(c.b["self"], _INCREASING[name]), c.compute)


def _rsqrt(c: Call) -> Iv:
    return I.approx_slack(I.monotone(c.b["self"], torch.rsqrt, increasing=False), c.compute)


def _reciprocal(c: Call) -> Iv:
    return I.approx_slack(I.reciprocal(c.b["self"]), c.compute)


def _unimodal(c: Call, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iv:
    x_min, f_min = I.minimum_of(name, fn, -4.0, 0.0)
    return I.approx_slack(I.single_minimum(c.b["self"], fn, x_min, f_min), c.compute)


def _silu_rule(c: Call) -> Iv:
    return _unimodal(c, "silu", _silu)


def _gelu(c: Call) -> Iv:
    approximate = c.b.get("approximate") or "none"
    return _unimodal(c, f"gelu-{approximate}", _gelu_tanh if approximate == "tanh" else _gelu_none)


def _softplus(c: Call) -> Iv:
    beta = float(c.b.get("beta") or 1.0)
    if beta <= 0:
        raise UnsupportedOpError(f"{c.where}: softplus with beta={beta}")
    return I.approx_slack(I.monotone(c.b["self"], _softplus_fn(beta)), c.compute)


def _abs(c: Call) -> Iv:
    return I.abs_(c.b["self"])


def _neg(c: Call) -> Iv:
    return I.neg(c.b["self"])


def _square(c: Call) -> Iv:
    return I.square(c.b["self"])


# ---------------------------------------------------------------------------------------------- reductions


def _sum(c: Call, mean: bool = False) -> Iv:
    x = c.b["self"]
    dims = _dims(c, x)
    n = _terms(tuple(x.lo.shape), dims)
    keepdim = bool(c.b.get("keepdim") or False)
    # (n - 1) additions; a mean also scales by a rounded 1/n (or divides): two more roundings at most
    s = I.reduce_sum(x, dims, keepdim, n + 1 if mean else max(n - 1, 0))
    if not mean:
        return s
    return Iv(s.lo / n, s.lo / n if s.is_point else s.hi / n, None if s.pt is None else s.pt / n)


def _mean(c: Call) -> Iv:
    return _sum(c, mean=True)


def _vector_norm(c: Call) -> Iv:
    x = c.b["self"]
    if float(c.b.get("ord", 2)) != 2.0:
        raise UnsupportedOpError(f"{c.where}: linalg_vector_norm with ord={c.b.get('ord')}; only ord=2")
    dims = _dims(c, x)
    n = _terms(tuple(x.lo.shape), dims)
    s = I.reduce_sum(I.square(x), dims, bool(c.b.get("keepdim") or False), n)
    return I.approx_slack(I.monotone(s, torch.sqrt), c.compute)


def _softmax(c: Call) -> Iv:
    dim = c.b["dim"]
    return I.softmax(c.b["self"], dim, c.compute)


# ---------------------------------------------------------------------------------------------- matmul


def _mm(c: Call) -> Iv:
    a, b = c.b["self"], c.b.get("mat2", c.b.get("vec", c.b.get("tensor")))
    return I.matmul(a, b, a.lo.shape[-1])


def _addmm(c: Call) -> Iv:
    bias = c.b["self"]
    a = c.b.get("mat1", c.b.get("batch1"))
    b = c.b.get("mat2", c.b.get("batch2"))
    n = a.lo.shape[-1]
    prod = I.matmul(a, b, n + 1)
    alpha, beta = float(c.b.get("alpha", 1)), float(c.b.get("beta", 1))
    if alpha != 1.0:
        prod = I.mul(prod, _iv(c, alpha))
    term = bias if beta == 1.0 else I.mul(bias, _iv(c, beta))
    fused = I.add(prod, term)
    bound = I.gamma(n + 1) * I.magnitude(term)
    fused = Iv(fused.lo - bound, fused.hi + bound, fused.pt)
    if c.out_dtype in I.NARROW_DTYPES:
        # the bias may also be added after the product is rounded (CPU oneDNN and some cuBLAS paths):
        # admit both orders by taking the hull
        late = I.add(I.round_iv(prod, c.out_dtype), term)
        fused = Iv(torch.minimum(fused.lo, late.lo), torch.maximum(fused.hi, late.hi), fused.pt)
    return fused


def _convolution(c: Call) -> Iv:
    """Depthwise 1-d convolution (the GatedDeltaNet causal conv): each output an FP32 accumulation of
    ``kernel`` products (plus the bias), any order."""
    x, w, bias = c.b["input"], c.b["weight"], c.b.get("bias")
    groups = int(c.b.get("groups") or 1)
    stride, dilation = list(c.b.get("stride") or [1]), list(c.b.get("dilation") or [1])
    if (c.b.get("transposed") or x.lo.dim() != 3 or w.lo.dim() != 3 or groups != x.lo.shape[1]
            or w.lo.shape[:2] != (groups, 1) or set(stride) != {1} or set(dilation) != {1}):
        raise UnsupportedOpError(f"{c.where}: only depthwise 1-d convolutions (stride 1, no dilation) are replayed")
    pad = int(list(c.b.get("padding") or [0])[0])
    kernel = w.lo.shape[-1]

    def windows(t: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C, T_out, kernel]
        return torch.nn.functional.pad(t, (pad, pad)).unfold(-1, kernel, 1)

    terms = I.mul(x.map(windows), w.map(lambda t: t[:, 0][None, :, None, :]))
    out = I.reduce_sum(terms, [-1], False, kernel if bias is not None else kernel - 1)
    if bias is not None:
        out = I.add(out, bias.map(lambda t: t[None, :, None]))
    return out


# ---------------------------------------------------------------------------------------------- misc


def _convert(c: Call) -> Iv:
    x = c.b["self"]
    if x.is_float or not c.out_dtype.is_floating_point:
        return x
    return I.point(x.lo.to(I.F64), track=x.pt is not None)


def _compare(c: Call) -> Any:
    if not all(leaf.is_point for leaf in arg_leaves((c.args, c.kwargs)) if isinstance(leaf, Iv)):
        raise UnsupportedOpError(f"{c.where}: a comparison of values that are not exactly known; the oracle "
                                 "replays comparisons of constants only")
    return _componentwise(c)


def _attention(c: Call) -> Any:
    return replay_attention(
        c.b,
        input_dtype=c.attrs["input_dtype"],
        compute=c.compute,
        semantics=c.attrs.get("attention", "flash"),
        stages=c.stages,
        outputs=ATTENTION_OPS[c.func._schema.name],
        where=c.where,
    )


def _max_values(c: Call) -> Any:
    values = _componentwise(c)
    if isinstance(values, tuple):
        return (values[0],) + (None,) * (len(values) - 1)
    return values


_VIEW = (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "expand_copy", "unsqueeze", "squeeze",
    "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "permute", "transpose", "t", "contiguous",
    "clone", "alias", "detach", "lift_fresh", "lift_fresh_copy", "narrow", "movedim", "diagonal", "unfold",
    "view_copy", "permute_copy", "transpose_copy", "t_copy", "unsqueeze_copy", "squeeze_copy", "slice_copy",
    "select_copy", "split_copy", "_unsafe_split", "flatten", "unflatten", "squeeze_copy",
)
_SELECT = (
    "cat", "stack", "where", "masked_fill", "index", "index_select", "gather", "tril", "triu", "flip", "roll",
    "repeat", "repeat_interleave", "constant_pad_nd", "take_along_dim",
)
_COMPARE = ("eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "bitwise_not", "isinf",
            "isnan", "isfinite")

RULES: dict[str, Rule] = {}
for _name in _VIEW:
    RULES[_name] = Rule("view", _reshape if _name in ("view", "_unsafe_view", "reshape", "_reshape_alias")
                        else _componentwise)
for _name in _SELECT:
    RULES[_name] = Rule("select", _componentwise)
for _name in _COMPARE:
    RULES[_name] = Rule("compare", _compare)
for _name in _INCREASING:
    RULES[_name] = Rule("approx", _increasing)
for _name in ATTENTION_OPS:
    RULES[_name.split("::")[1]] = Rule("attention", _attention)
RULES.update({
    "_to_copy": Rule("convert", _convert),
    "convolution": Rule("matmul", _convolution),
    "add": Rule("exact", _add),
    "sub": Rule("exact", lambda c: _add(c, -1.0)),
    "rsub": Rule("exact", _rsub),
    "mul": Rule("exact", _mul),
    "neg": Rule("exact", _neg),
    "square": Rule("exact", _square),
    "abs": Rule("exact", _abs),
    "maximum": Rule("exact", _componentwise),
    "minimum": Rule("exact", _componentwise),
    "clamp": Rule("exact", _componentwise),
    "clamp_min": Rule("exact", _componentwise),
    "clamp_max": Rule("exact", _componentwise),
    "relu": Rule("exact", _componentwise),
    "amax": Rule("exact", _componentwise),
    "amin": Rule("exact", _componentwise),
    "max": Rule("exact", _max_values),
    "min": Rule("exact", _max_values),
    "div": Rule("approx", _div),
    "pow": Rule("approx", _pow),
    "rsqrt": Rule("approx", _rsqrt),
    "reciprocal": Rule("approx", _reciprocal),
    "silu": Rule("approx", _silu_rule),
    "gelu": Rule("approx", _gelu),
    "softplus": Rule("approx", _softplus),
    "sum": Rule("reduce", _sum),
    "mean": Rule("reduce", _mean),
    "linalg_vector_norm": Rule("reduce", _vector_norm),
    "_softmax": Rule("softmax", _softmax),
    "_safe_softmax": Rule("softmax", _softmax),  # SDPA's math backend: fully masked rows give 0
    "mm": Rule("matmul", _mm),
    "bmm": Rule("matmul", _mm),
    "matmul": Rule("matmul", _mm),
    "mv": Rule("matmul", _mm),
    "dot": Rule("matmul", _mm),
    "addmm": Rule("matmul", _addmm),
    "baddbmm": Rule("matmul", _addmm),
})


def op_name(func: Any) -> str:
    """``aten::add`` -> ``add`` (the packet name the table is keyed by)."""
    return func._schema.name.split("::")[-1]


def rule_for(func: Any, where: str) -> Rule:
    """The replay rule of an aten overload.

    Raises:
        UnsupportedOpError: the op has no rule; the message starts with ``where`` (site, op index and op).
    """
    name = op_name(func)
    rule = RULES.get(name)
    if rule is None or not func._schema.name.startswith("aten::"):
        raise UnsupportedOpError(f"{where} is not supported by the oracle replay (the supported ops are listed "
                                 "by ulptrace.oracle.supported_ops())")
    if name == "pow" and func._overloadname != "Tensor_Scalar":
        raise UnsupportedOpError(f"{where} is not supported; of pow, only pow.Tensor_Scalar is")
    return rule


def supported_ops() -> dict[str, str]:
    """``{op name: kind}`` of every op the replay supports."""
    return {name: rule.kind for name, rule in sorted(RULES.items())}
