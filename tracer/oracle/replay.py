"""Replay a captured program: in float64 with intervals (the admissible set), or in its own dtypes.

:func:`admissible` answers "which outputs could an honest implementation of the reference semantics
produce from these inputs?" -- per element, every representable value of the output dtype between
``lo`` and ``hi``. :func:`replay` is the engine behind it and behind the hypotheses of
:mod:`ulptrace.oracle.hypotheses`, which replay the same program with one rounding decision changed
(:class:`Mods`). :func:`emulate` runs the program with torch in its own dtypes, optionally with an
explicit FP32 summation order for its sums and means, to show which order reproduces a result bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from ulptrace.oracle import intervals as I
from ulptrace.oracle.intervals import Iv
from ulptrace.oracle.program import Program, ValueRef
from ulptrace.oracle.rules import Call, UnsupportedOpError, arg_leaves, bind, map_args, rule_for
from ulptrace.oracle.sharding import split_matmul

Reducer = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class Mods:
    """Rounding decisions changed against the captured program.

    Attributes:
        keep_fp32: ops whose narrow (BF16/FP16) rounding is removed: their result stays FP32 (or better).
        round_narrow: ops whose FP32 result is additionally rounded to the program's narrow dtype.
        attention: ``{op index: stages}`` extra rounding stages inside fused attention ops.
        widen_narrow: ops whose narrow rounding happens at another point of the computation (flash
            kernels round the *unnormalised* probabilities): the result is widened by one narrow unit
            roundoff, relative, instead of being rounded onto the grid.
        exact: ops whose result is not rounded at all (kept in float64): the value a rounding point
            receives, computed exactly (``ulptrace.explain`` measures it against the rounding midpoints).
        split: ``{op index: shard lengths}`` matmul ops computed as a sharded reduction (tensor
            parallelism): partial products over contiguous slices of the reduction, each rounded to the
            result dtype, then summed as an all-reduce does (see :mod:`ulptrace.oracle.sharding`).
    """

    keep_fp32: frozenset[int] = frozenset()
    round_narrow: frozenset[int] = frozenset()
    attention: Mapping[int, frozenset[str]] = field(default_factory=dict)
    widen_narrow: frozenset[int] = frozenset()
    exact: frozenset[int] = frozenset()
    split: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    def first_op(self) -> int | None:
        """The first op index the modification touches (replay can reuse everything before it)."""
        touched = (set(self.keep_fp32) | set(self.round_narrow) | set(self.attention) | set(self.widen_narrow)
                   | set(self.exact) | set(self.split))
        return min(touched) if touched else None


def _resolve(values: list[Iv | None], program: Program, op_index: int, a: Any) -> Any:
    if isinstance(a, ValueRef):
        iv = values[a.index]
        if iv is None:
            producer = program.values[a.index]
            raise UnsupportedOpError(
                f"{program.where(op_index)}: uses output {producer.output} of op {producer.op}, which the "
                "replay does not compute")
        return iv
    return a


@dataclass(frozen=True)
class Records:
    """Constants that are each record's own in a stacked replay (``ulptrace.oracle.intervals.members``): a linear
    layer's weight where the records come from several layers. ``constants`` maps such a constant's name to one tensor
    per record of the layout (shaped as the program's); ``stacked`` holds the indices of the program's values laid
    along dimension 0 record by record (those made from its inputs: ``ulptrace.oracle.members.depends_on_inputs``).
    An op that reads one of them is evaluated record by record (:func:`_by_record`), the padding with the first
    record; everything else once for the stack."""

    constants: Mapping[str, Sequence[torch.Tensor]]
    stacked: frozenset[int]


class _Each:
    """A value that is each record's own (one of :class:`Records`' constants, or made from such values alone): one
    interval per record (records holding the same tensor share one)."""

    def __init__(self, ivs: Sequence[Iv]) -> None:
        self.ivs = list(ivs)


def initial_values(program: Program, inputs: Mapping[str, torch.Tensor], track_point: bool = True,
                   records: Records | None = None) -> list[Iv | _Each | None]:
    """Values before any op runs: inputs and constants as exact float64 points on the inputs' device (``records``:
    the constants each record has its own of, one point per record). A float input of another float dtype than
    captured is taken at its own values (``Program.check_inputs(exact_floats=True)``).

    Raises:
        TypeError, ValueError: see :meth:`Program.check_inputs`.
    """
    program.check_inputs(inputs, exact_floats=True)
    device = next(iter(inputs.values())).device
    values: list[Iv | _Each | None] = [None] * len(program.values)
    for name, index in program.inputs.items():
        values[index] = I.point(inputs[name], track_point)
    own = records.constants if records is not None else {}
    for value in program.values:
        if value.kind != "constant":
            continue
        if value.name in own:
            points: dict[int, Iv] = {}  # a layer's tensor made a point once however many of its records
            values[value.index] = _Each([points.setdefault(id(t), I.point(t.to(device), track_point))
                                         for t in own[value.name]])
        else:
            values[value.index] = I.point(program.constants[value.name].to(device), track_point)
    return values


def replay(
    program: Program,
    inputs: Mapping[str, torch.Tensor],
    mods: Mods | None = None,
    *,
    base: list[Iv | None] | None = None,
    track_point: bool = True,
    records: Records | None = None,
) -> list[Iv | None]:
    """Interval replay of every live op; returns the interval of every value (None where not computed).

    Args:
        program: from :func:`capture_semantics`.
        inputs: the judged path's own tensors, named and shaped as captured.
        mods: rounding decisions to change (a hypothesis); None replays the program as captured.
        base: the values of an unmodified replay of the same inputs; ops before ``mods.first_op()`` are
            then taken from it instead of recomputed.
        track_point: also carry the exact-replay point value.
        records: in a stacked replay, the constants each record has its own of (:class:`Records`).

    Raises:
        TypeError, ValueError: inputs do not match the program.
        UnsupportedOpError: an op (or one of its uses) cannot be replayed; names the op and its index.
    """
    mods = mods or Mods()
    start = mods.first_op() if base is not None else None
    if start is not None and base is not None:
        values = list(base)
        if not track_point:
            values = [v if v is None or isinstance(v, _Each) else Iv(v.lo, v.hi, v.pt if not v.is_float else None)
                      for v in values]
    else:
        values = initial_values(program, inputs, track_point, records)
        start = 0
    for op in program.ops:
        if op.index < start or op.index not in program.live:
            continue
        where = program.where(op.index)
        rule = rule_for(op.func, where)
        args, kwargs = map_args(lambda a, i=op.index: _resolve(values, program, i, a), (op.args, op.kwargs))
        out_dtype = program.values[op.outputs[0]].dtype if op.outputs[0] is not None else torch.float32
        compute = I.F64 if out_dtype == I.F64 else torch.float32
        stages = frozenset(mods.attention.get(op.index, ()))
        split = mods.split.get(op.index)

        def evaluate(args: Any, kwargs: Any, op: Any = op, rule: Any = rule, out_dtype: torch.dtype = out_dtype,
                     compute: torch.dtype = compute, stages: frozenset[str] = stages, where: str = where,
                     split: Any = split) -> Any:
            call = Call(op.func, args, kwargs, bind(op.func, args, kwargs), out_dtype, compute, op.attrs, stages,
                        where)
            return split_matmul(call, split) if split is not None else rule.handler(call)

        each = records is not None and any(isinstance(a, _Each) for a in arg_leaves((args, kwargs)))
        if each:
            assert records is not None
            result = _by_record(evaluate, op, args, kwargs, records.stacked)
        else:
            result = evaluate(args, kwargs)
        results = result if isinstance(result, tuple) else (result,)
        for k, out_index in enumerate(op.outputs):
            if out_index is None:
                continue
            iv = results[k] if k < len(results) else None
            if iv is not None and rule.kind not in ("view", "select", "compare"):
                if isinstance(iv, _Each):  # a value of the records' constants alone: each rounded as its own
                    rounded: dict[int, Iv] = {}  # once per distinct value (a layer's, however many records)
                    with I.one_record():
                        iv = _Each([rounded[id(x)] if id(x) in rounded else
                                    rounded.setdefault(id(x), _round(program, op.index, out_index, x, mods))
                                    for x in iv.ivs])
                else:
                    iv = _round(program, op.index, out_index, iv, mods)
            values[out_index] = iv
    return values


def _by_record(evaluate: Callable[[Any, Any], Any], op: Any, args: Any, kwargs: Any, stacked: frozenset[int]) -> Any:
    """``op`` (an argument of it is each record's own: :class:`_Each`) evaluated for each record on its own part of
    the stacked values and its own constants — the first record with the padding, which copies it — its results laid
    back in the stack's order; where no argument is stacked, one result per record (an :class:`_Each`). Decisions
    inside are taken per record (``intervals.one_record``), as its own replay takes them."""
    layout = I.stacked_layout()
    if layout is None:  # one record
        return evaluate(*map_args(lambda a: a.ivs[0] if isinstance(a, _Each) else a, (args, kwargs)))
    refs = {id(iv): a.index for a, iv in zip(arg_leaves((op.args, op.kwargs)), arg_leaves((args, kwargs)),
                                              strict=True) if isinstance(a, ValueRef)}
    rows = {id(iv) for iv in arg_leaves((args, kwargs)) if isinstance(iv, Iv) and refs.get(id(iv)) in stacked}
    if not rows:
        distinct: dict[tuple[int, ...], Any] = {}
        outs = []
        for k in range(layout.count):
            key = tuple(id(a.ivs[k]) for a in arg_leaves((args, kwargs)) if isinstance(a, _Each))
            if key not in distinct:
                with I.one_record():
                    distinct[key] = evaluate(*map_args(lambda a, k=k: a.ivs[k] if isinstance(a, _Each) else a,
                                                       (args, kwargs)))
            outs.append(distinct[key])
        if isinstance(outs[0], tuple):
            return tuple(_Each([o[j] for o in outs]) for j in range(len(outs[0])))
        return _Each(outs)
    pad = layout.units - layout.offsets[-1]

    def spans(k: int) -> list[tuple[int, int]]:  # record k's units (the first record's with the padding)
        own = [(layout.offsets[k], layout.offsets[k + 1])]
        return own + [(layout.offsets[-1], layout.units)] if k == 0 and pad else own

    def part(iv: Iv, k: int) -> Iv:
        step = iv.lo.shape[0] // layout.units
        cuts = [(a * step, b * step) for a, b in spans(k)]
        return iv.map(lambda t: torch.cat([t[a:b] for a, b in cuts]) if len(cuts) > 1 else t[cuts[0][0]:cuts[0][1]])

    parts = []
    for k in range(layout.count):
        def pick(a: Any, k: int = k) -> Any:
            if isinstance(a, _Each):
                return a.ivs[k]
            return part(a, k) if isinstance(a, Iv) and id(a) in rows else a

        with I.one_record():
            parts.append(evaluate(*map_args(pick, (args, kwargs))))
    first = parts[0] if isinstance(parts[0], tuple) else (parts[0],)
    laid = []
    for j in range(len(first)):
        pieces = [p[j] if isinstance(p, tuple) else p for p in parts]
        if pieces[0] is None:
            laid.append(None)
            continue
        units = [spans(k) for k in range(layout.count)]
        own0 = units[0][0][1] - units[0][0][0]
        head_units = sum(b - a for a, b in units[0])
        step = pieces[0].lo.shape[0] // head_units
        # the first record's own rows, the others', then the padding (the first record's evaluation's tail)
        cut = own0 * step
        order = [pieces[0].map(lambda t, cut=cut: t[:cut])] + pieces[1:]
        if pad:
            order.append(pieces[0].map(lambda t, cut=cut: t[cut:]))
        laid.append(_cat(order))
    return tuple(laid) if isinstance(parts[0], tuple) else laid[0]


def _cat(ivs: Sequence[Iv]) -> Iv:
    """Intervals of the records' parts, one after the other along dimension 0 (a point where each part is one)."""
    lo = torch.cat([iv.lo for iv in ivs])
    hi = lo if all(iv.is_point for iv in ivs) else torch.cat([iv.hi for iv in ivs])
    pts = [iv.pt for iv in ivs]
    pt = None if any(p is None for p in pts) else lo if all(iv.pt is iv.lo for iv in ivs) else torch.cat(pts)
    return Iv(lo, hi, pt)


def _round(program: Program, op_index: int, value_index: int, iv: Iv, mods: Mods) -> Iv:
    dtype = program.values[value_index].dtype
    if not dtype.is_floating_point or op_index in mods.exact:
        return iv
    if op_index in mods.widen_narrow and dtype in I.NARROW_DTYPES:
        return I.round_iv(I.widen_rel(iv, I.unit_roundoff(dtype)), torch.float32)
    if op_index in mods.keep_fp32 and dtype in I.NARROW_DTYPES:
        dtype = torch.float32
    iv = I.round_iv(iv, dtype)
    if op_index in mods.round_narrow and program.narrow_dtype is not None:
        iv = I.round_iv(iv, program.narrow_dtype)
    return iv


def output_interval(program: Program, values: list[Iv | None]) -> Iv:
    iv = values[program.output]
    if iv is None:
        raise UnsupportedOpError(f"{program.where()}: the output was not computed by the replay")
    return iv


def to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values that are representable in ``dtype`` (interval ends, exact replays) to ``dtype``;
    any cast is exact for them."""
    return x.to(dtype)


def admissible(program: Program, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ends ``(lo, hi)`` of the admissible set of the program's output on these inputs.

    Every representable value ``v`` of the output dtype with ``lo <= v <= hi`` is a result some honest
    implementation of the reference semantics could produce.

    Args:
        program: from :func:`capture_semantics`.
        inputs: name -> tensor, with the captured names, shapes and dtypes.

    Returns:
        ``(lo, hi)`` in the output's dtype and shape.

    Raises:
        TypeError, ValueError: inputs do not match the program.
        UnsupportedOpError: an op cannot be replayed.
    """
    iv = output_interval(program, replay(program, inputs, track_point=False))
    dtype = program.output_value.dtype
    return to_dtype(iv.lo, dtype), to_dtype(iv.hi, dtype)


def emulate(program: Program, inputs: Mapping[str, torch.Tensor], reducer: Reducer | None = None) -> torch.Tensor:
    """Run the program with torch in its own dtypes (not float64) and return the output.

    With ``reducer``, every ``sum``/``mean`` over a single dim of an FP32 tensor is computed as
    ``reducer(x_f32, dim)`` (an FP32 sum over ``dim``, e.g. ``lambda x, d: reduce_fp32(x, tree, d)``); a
    mean divides that sum by the length in FP32. Other accumulations (matmuls, softmax) stay torch's.

    Args:
        program: from :func:`capture_semantics`.
        inputs: name -> tensor, with the captured names, shapes and dtypes.
        reducer: optional explicit FP32 summation.

    Returns:
        the output tensor in the program's output dtype.

    Raises:
        TypeError, ValueError: inputs do not match, or the reducer returns a wrong shape or dtype.
        UnsupportedOpError: a sum/mean over several dims with a reducer.
    """
    program.check_inputs(inputs)
    device = next(iter(inputs.values())).device
    values: list[Any] = [None] * len(program.values)
    for name, index in program.inputs.items():
        values[index] = inputs[name]
    for value in program.values:
        if value.kind == "constant":
            values[value.index] = program.constants[value.name].to(device)
    for op in program.ops:
        if op.index not in program.live:
            continue
        args, kwargs = map_args(lambda a: values[a.index] if isinstance(a, ValueRef) else a, (op.args, op.kwargs))
        if op.name == "_to_copy":
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}  # stay on the inputs' device
        b = bind(op.func, args, kwargs) if op.name in ("sum", "mean") else {}
        if reducer is not None and b and b["self"].dtype == torch.float32 and b.get("dtype") in (None, torch.float32):
            out = _reduce(program, op.index, reducer, b)
        else:
            out = op.func(*args, **kwargs)
        results = out if isinstance(out, (tuple, list)) else (out,)
        for k, out_index in enumerate(op.outputs):
            if out_index is not None:
                values[out_index] = results[k]
    return values[program.output]


def _reduce(program: Program, op_index: int, reducer: Reducer, b: dict[str, Any]) -> torch.Tensor:
    x = b["self"]
    dim = b.get("dim")
    if dim is None or isinstance(dim, (list, tuple)) and len(dim) != 1:
        raise UnsupportedOpError(f"{program.where(op_index)}: a reducer sums over one dim, but the op reduces "
                                 f"over {dim}")
    d = dim if isinstance(dim, int) else dim[0]
    d = d % x.dim()
    s = reducer(x, d)
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise TypeError(f"reducer must return an FP32 tensor, but got {getattr(s, 'dtype', type(s).__name__)}")
    kept = list(x.shape)
    kept[d] = 1
    dropped = kept[:d] + kept[d + 1:]
    if list(s.shape) == dropped:
        s = s.unsqueeze(d)
    elif list(s.shape) != kept:
        raise ValueError(f"reducer must return shape {dropped} (or {kept}), but got {list(s.shape)}")
    if program.ops[op_index].name == "mean":
        s = s / torch.tensor(float(x.shape[d]), dtype=torch.float32, device=s.device)
    return s if b.get("keepdim") else s.squeeze(d)
