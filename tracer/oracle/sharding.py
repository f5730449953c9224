"""Sharded reductions: a matmul whose sum runs over a parameter split into contiguous shards.

Under tensor parallelism a row-parallel linear layer holds its weight split along the *input* features
(the reduction dim). Each process computes the dot products over its own slice, stores that partial result
in the layer's dtype (a BF16 ``F.linear`` accumulates in FP32 and rounds once, to BF16), and the partials
are summed by an all-reduce — in that same dtype. That is a rounding point the unsharded reference does
not have: ``bf16(sum_k x_k w_k)`` becomes ``bf16(bf16(sum_{k<64} x_k w_k) + bf16(sum_{k>=64} x_k w_k))``.

This module lets the oracle name it. A :class:`ShardedReduction` says which program constant (the
parameter) is split along which of its dims, and the shard lengths; :func:`split_ops` finds the matmul ops
of a captured program that contract over that dim (following the parameter through transposes and views),
so a hypothesis applies to *any* linear site whose reduction is sharded, never to a site by name; and
:func:`split_matmul` is the interval rule of the hypothesis:

- each shard's partial product over its contiguous slice of the reduction, with the FP32 accumulation bound
  of its own length, rounded to the op's result dtype (as each process stores it);
- the partials summed as an all-reduce does: in the result dtype, rounded after every add, in an order that
  may differ per element (gloo's ring reduces each chunk starting at another rank; NCCL's ring and tree
  likewise). Two shards are one rounding of an exact sum (the replay's own rounding of the op's result);
  ``N > 2`` shards add ``N - 2`` intermediate roundings, bounded in any order by
  ``gamma_u(N - 2) * sum |partial|`` with the result dtype's unit roundoff ``u`` (Higham, eq. 4.4). A
  reduction that sums at higher precision and rounds once lies inside that set too;
- a bias (``addmm``) added after the all-reduce, as transformers' ``RowwiseParallel`` does, with its own
  rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_flatten
from ulptrace.oracle import intervals as I
from ulptrace.oracle.intervals import Iv
from ulptrace.oracle.program import Program, ValueRef, dtype_word
from ulptrace.oracle.rules import Call, UnsupportedOpError, bind, op_name


@dataclass(frozen=True)
class ShardedReduction:
    """A parameter split into contiguous shards along ``dim``, in order (shard ``r`` on process ``r``).

    Attributes:
        constant: the parameter's name as a program constant (e.g. ``self_attn.o_proj.weight``).
        dim: the parameter's dim that is split.
        sizes: the shard lengths along ``dim``, in order (``64, 64``; uneven splits allowed).
        reduce: how the partial results are combined, for the hypothesis' sentence.
    """

    constant: str
    dim: int
    sizes: tuple[int, ...]
    reduce: str = "all-reduce"

    @property
    def shards(self) -> int:
        return len(self.sizes)


# which operands of a matmul op contract, and which argument is a bias added afterwards
_OPERANDS: dict[str, tuple[str, str, str | None]] = {
    "mm": ("self", "mat2", None),
    "bmm": ("self", "mat2", None),
    "matmul": ("self", "other", None),
    "mv": ("self", "vec", None),
    "dot": ("self", "tensor", None),
    "addmm": ("mat1", "mat2", "self"),
    "baddbmm": ("batch1", "batch2", "self"),
}
_SAME_DIMS = ("alias", "detach", "clone", "contiguous", "lift_fresh", "lift_fresh_copy", "_to_copy")
_RESHAPES = ("view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze")


def _contracted(name: str, role: str, ndim: int) -> int | None:
    """The dim of operand ``role`` of matmul op ``name`` that the product sums over."""
    a, b, _ = _OPERANDS[name]
    if role == a:
        return ndim - 1
    if role == b:
        return 0 if ndim == 1 else ndim - 2
    return None


def _through(program: Program, op_index: int, dim: int) -> int | None:
    """Where dim ``dim`` of a view-like op's (first) input lands in its result, or None (not followed)."""
    op = program.ops[op_index]
    name = op.name
    src = next(a for a in tree_flatten((op.args, op.kwargs))[0] if isinstance(a, ValueRef))
    old = program.values[src.index].shape
    out = op.outputs[0]
    if out is None:
        return None
    new = program.values[out].shape
    b = bind(op.func, op.args, op.kwargs)
    if name in _SAME_DIMS:
        return dim if len(old) == len(new) else None
    if name == "t":
        return 1 - dim if len(old) == 2 else dim
    if name == "transpose":
        d0, d1 = b["dim0"] % len(old), b["dim1"] % len(old)
        return d1 if dim == d0 else d0 if dim == d1 else dim
    if name == "permute":
        order = [d % len(old) for d in b["dims"]]
        return order.index(dim)
    if name == "expand":
        j = dim + len(new) - len(old)
        return j if new[j] == old[dim] else None
    if name in _RESHAPES:
        before = math.prod(old[:dim])
        for j in range(len(new)):
            if new[j] == old[dim] and math.prod(new[:j]) == before:
                return j
    return None


def split_ops(program: Program, shards: Iterable[ShardedReduction]) -> dict[int, tuple[ShardedReduction, int]]:
    """The live matmul ops of ``program`` that contract over a sharded dim of one of its constants.

    Returns ``{op index: (the sharded reduction, the contraction length)}``. A constant is followed
    through transposes, permutes, expands and reshapes that keep the sharded dim whole; an op whose
    contraction length differs from the shards' total is not one (the split is of another dim).
    """
    by_name = {s.constant: s for s in shards}
    tracked: dict[int, tuple[ShardedReduction, int]] = {}  # value index -> (reduction, dim of that value)
    for value in program.values:
        spec = by_name.get(value.name) if value.kind == "constant" else None
        if spec is not None and 0 <= spec.dim < len(value.shape) and value.shape[spec.dim] == sum(spec.sizes):
            tracked[value.index] = (spec, spec.dim)
    found: dict[int, tuple[ShardedReduction, int]] = {}
    for op in program.ops:
        if op.index not in program.live or op.outputs[0] is None:
            continue
        b = bind(op.func, op.args, op.kwargs)
        if op.name in _OPERANDS:
            for role, arg in b.items():
                if not isinstance(arg, ValueRef) or arg.index not in tracked:
                    continue
                spec, dim = tracked[arg.index]
                if dim == _contracted(op.name, role, len(program.values[arg.index].shape)):
                    found[op.index] = (spec, program.values[arg.index].shape[dim])
            continue
        refs = [a for a in tree_flatten((op.args, op.kwargs))[0] if isinstance(a, ValueRef)]
        if len(refs) == 1 and refs[0].index in tracked and program.kind(op.index) in ("view", "convert"):
            spec, dim = tracked[refs[0].index]
            moved = _through(program, op.index, dim)
            if moved is not None:
                tracked[op.outputs[0]] = (spec, moved)
    return found


def describe(program: Program, op_index: int, spec: ShardedReduction, terms: int) -> str:
    """The hypothesis' sentence, e.g. ``partial sums rounded to BF16 before the all-reduce (2 shards: 64+64 of
    the 128-term reduction over self_attn.o_proj.weight dim 1) in `mm(x, t(...))` (op 2)``."""
    word = dtype_word(program.result_dtype(op_index))
    sizes = "+".join(map(str, spec.sizes))
    return (f"partial sums rounded to {word} before the {spec.reduce} ({spec.shards} shards: {sizes} of the "
            f"{terms}-term reduction over {spec.constant} dim {spec.dim}) in `{program.op_label(op_index)}` "
            f"(op {op_index})")


def split_matmul(c: Call, sizes: tuple[int, ...]) -> Iv:
    """Interval of a matmul op computed as a sharded reduction (see the module docstring); the replay rounds
    the returned interval to the op's result dtype, which is the all-reduce's last rounding."""
    name = op_name(c.func)
    if name not in _OPERANDS:
        raise UnsupportedOpError(f"{c.where}: a sharded reduction is modelled for matmul ops only")
    ra, rb, rbias = _OPERANDS[name]
    a, b = c.b[ra], c.b[rb]
    if not isinstance(a, Iv) or not isinstance(b, Iv):
        raise UnsupportedOpError(f"{c.where}: a sharded reduction needs tensor operands")
    b_dim = 0 if b.lo.dim() == 1 else b.lo.dim() - 2
    if a.lo.shape[-1] != sum(sizes) or b.lo.shape[b_dim] != sum(sizes):
        raise UnsupportedOpError(f"{c.where}: shards {sizes} do not cover the {a.lo.shape[-1]}-term reduction")
    alpha = float(c.b.get("alpha", 1) or 1) if rbias else 1.0
    narrow = c.out_dtype
    partials: list[Iv] = []
    start = 0
    for size in sizes:
        a_i = a.map(lambda t, s=start, n=size: t.narrow(-1, s, n))
        b_i = b.map(lambda t, s=start, n=size: t.narrow(b_dim, s, n))
        p = I.matmul(a_i, b_i, size)
        if alpha != 1.0:
            p = I.mul(p, I.scalar_iv(I.round_scalar(alpha, c.compute), p.lo))
        partials.append(I.round_iv(p, narrow))  # each process stores its partial in the result dtype
        start += size
    total = partials[0]
    for p in partials[1:]:
        total = I.add(total, p)
    if len(partials) > 2 and narrow.is_floating_point and narrow != I.F64:
        k = len(partials) - 2  # intermediate roundings of the all-reduce, any order
        u = I.unit_roundoff(narrow)
        bound = k * u / (1 - k * u) * sum(I.magnitude(p) for p in partials)
        total = Iv(total.lo - bound, total.hi + bound, total.pt)
    if rbias is None:
        return total
    bias = c.b[rbias]
    beta = float(c.b.get("beta", 1) or 1)
    if not isinstance(bias, Iv):
        raise UnsupportedOpError(f"{c.where}: a sharded reduction's bias must be a tensor")
    term = bias if beta == 1.0 else I.mul(bias, I.scalar_iv(I.round_scalar(beta, c.compute), bias.lo))
    return I.add(I.round_iv(total, narrow), term)  # transformers adds the bias after the all-reduce



def in_scope(shards: Mapping[str, ShardedReduction], model: torch.nn.Module,
             scope: torch.nn.Module) -> tuple[ShardedReduction, ...]:
    """``shards`` keyed by parameter names of ``model``, renamed as :func:`capture_semantics` names a scope's
    constants (relative to the submodule ``scope``, matched by identity); parameters outside it are dropped."""
    if not shards:
        return ()
    full = dict(model.named_parameters())
    relative = {id(p): name for name, p in scope.named_parameters()}
    out = []
    for name, spec in shards.items():
        param = full.get(name)
        if param is not None and id(param) in relative:
            out.append(replace(spec, constant=relative[id(param)]))
    return tuple(out)
