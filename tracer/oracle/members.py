"""Several records of one program judged in one replay: which programs are the same, and which stack.

Why: judging a record is bound by the number of small ops its interval replay issues (a few microseconds of host
dispatch each, some 300-400 per record: ``bench/RESULTS.md``, P3), not by its elements. Many records are judged by
the same program — a site's record at every decode step, and the same formula at every layer where it has no
parameters of its own (a GLU, a residual add, an attention core) or equal ones. Where a site's semantics treat each
batch item (dimension 0) alone (``ulptrace.sites``: row-wise and batch-wise kinds), those records can be stacked
along dimension 0 and replayed once: the ops are issued once for all of them.

Why the verdicts are each record's own: the program replayed for a stack is captured for the stacked shape and must
match the record's program op for op, every value that depends on the inputs stacked along dimension 0 and every
other one the same (:func:`stacks`); each decision the replay takes on values (is a rounding's input an FP32 value,
is its result a single value) is taken per record, and a stack whose records would decide differently raises
``ulptrace.oracle.intervals.MixedDecision`` — its records are then judged one by one; and
``ulptrace.oracle.judge.judge_stacked`` gives each record its own counts, hypotheses, boundary and largest error.

Parameters of a layer's own (a norm's weight, the gates' ``A_log``) can be *per-unit* constants: captured in the rank
of the units with dimension 0 of one, and for a stack each unit's own layer's values stacked along dimension 0
(``ulptrace.verdicts``). :func:`stacks` then checks them as it checks the inputs — every value made from them
stacked along dimension 0 — so only a formula that uses them element by element stacks, and one program judges that
formula at every layer; :func:`signature` leaves their values out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import torch
from ulptrace.oracle.program import Program, ValueRef
from ulptrace.oracle.rules import arg_leaves

CONSTANT_BYTES = 1 << 20
"""Programs whose constants hold more bytes than this (a linear layer's weight) are the same program only as one
object (one site, one shape: a site's records at every decode step); below it their constants are compared by value
(a norm's weight, a mask), so equal formulas of different layers are one program too."""


def signature(program: Program, per_unit: frozenset[str] = frozenset(),
              per_record: frozenset[str] = frozenset()) -> Hashable:
    """A key equal for programs that compute the same thing on inputs of the same names, shapes and dtypes: the same
    ops with the same arguments, values and constants (:data:`CONSTANT_BYTES`), the ``per_unit`` and ``per_record``
    constants compared by name, shape and dtype only (their values are each unit's, or each record's, own: a linear
    layer's weight at every layer). Made once per program."""
    key = ("signature", per_unit, per_record)
    own = per_unit | per_record
    if key not in program.memo:
        digest = hashlib.sha256()
        for op in program.ops:
            digest.update(repr((op.target, op.args, sorted(op.kwargs.items()), op.outputs,
                                sorted(op.attrs.items()))).encode())
        for value in program.values:
            digest.update(repr((value.kind, value.dtype, value.shape, value.op, value.output,
                                value.name if value.kind == "input" else None)).encode())
        digest.update(repr((program.output, program.narrow_dtype, sorted(program.live))).encode())
        total = sum(t.nbytes for name, t in program.constants.items() if name not in own)
        if total > CONSTANT_BYTES:
            program.memo[key] = ("program", id(program))  # the memo lives as long as the program: the id stays its own
            return program.memo[key]
        for name, tensor in sorted(program.constants.items()):
            digest.update(repr((name, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))).encode())
            if name not in own:
                digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        program.memo[key] = ("values", digest.hexdigest())
    return program.memo[key]


def depends_on_inputs(program: Program, per_unit: frozenset[str] = frozenset()) -> frozenset[int]:
    """Indices of the values computed from the program's inputs and its ``per_unit`` constants (the rest come from
    other constants and arguments alone)."""
    key = ("depends", per_unit)
    if key not in program.memo:
        dependent = set(program.inputs.values())
        dependent.update(v.index for v in program.values if v.kind == "constant" and v.name in per_unit)
        for op in program.ops:
            if any(isinstance(a, ValueRef) and a.index in dependent for a in arg_leaves((op.args, op.kwargs))):
                dependent.update(i for i in op.outputs if i is not None)
        program.memo[key] = frozenset(dependent)
    return program.memo[key]


def stacks(one: Program, many: Program, count: int, per_unit: frozenset[str] = frozenset()) -> bool:
    """Whether ``many`` is ``one`` for ``count`` records stacked along dimension 0: the same ops in the same order with
    the same values, each value computed from the inputs (or the ``per_unit`` constants) ``count`` times as long in
    dimension 0 (the rest of its shape the same), each other value (constants and what is made from them) of the same
    shape."""
    if (len(one.ops) != len(many.ops) or len(one.values) != len(many.values) or one.output != many.output
            or one.inputs != many.inputs or one.live != many.live or set(one.constants) != set(many.constants)):
        return False
    if any(a.target != b.target or a.outputs != b.outputs for a, b in zip(one.ops, many.ops, strict=True)):
        return False
    dependent = depends_on_inputs(one, per_unit)
    for a, b in zip(one.values, many.values, strict=True):
        if (a.kind, a.dtype, a.op, a.output) != (b.kind, b.dtype, b.op, b.output):
            return False
        if a.index in dependent:
            if not a.shape or tuple(b.shape) != (count * a.shape[0], *a.shape[1:]):
                return False
        elif tuple(a.shape) != tuple(b.shape):
            return False
    return True


def stacked_lengths(program: Program, count: int, per_unit: frozenset[str] = frozenset()) -> frozenset[int]:
    """The lengths of dimension 0 of ``program``'s values computed from its inputs (and ``per_unit`` constants), where
    ``program`` is captured for ``count`` records stacked (``ulptrace.oracle.intervals.members``: the values whose
    decisions are taken per record); none for one record."""
    if count == 1:
        return frozenset()
    dependent = depends_on_inputs(program, per_unit)
    return frozenset(v.shape[0] for v in program.values if v.index in dependent and v.shape)
