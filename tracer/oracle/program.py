"""Reference semantics of a site, captured as a list of aten ops with the dtype of every result.

The oracle never trusts the code under test for *what* to compute. The caller hands
:func:`capture_semantics` a formula built from the **reference** path's HF module (``lambda x:
ref_norm(x)``), and example inputs; the formula runs once under a ``TorchDispatchMode`` that records every
aten op it dispatches, its arguments (program values, constants or Python scalars) and the dtype and shape
of each result. Tensors that do not derive from the inputs (the module's weight, ``A_log``, a mask built
outside) become named *constants* of the program, copied from the reference module: semantics and
parameters come from the reference, only activations come from each judged path.

Every result stored in BF16/FP16/FP32 is a rounding point; ``str(program)`` lists them one op per line so
that "where does HF round in ``Qwen3_5RMSNormGated``?" takes one call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from ulptrace.oracle import intervals as I
from ulptrace.oracle.attention import ATTENTION_OPS, SEMANTICS, attention_terms
from ulptrace.oracle.rules import RULES, UnsupportedOpError, arg_leaves, bind, map_args, op_name, rule_for

_DTYPE_NAMES = {
    torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
    torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2", torch.bool: "bool", torch.int64: "i64",
    torch.int32: "i32",
}
_DTYPE_WORDS = {
    torch.float64: "FP64", torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16",
    torch.float8_e4m3fn: "FP8 (e4m3)", torch.float8_e5m2: "FP8 (e5m2)",
}
# ops that create tensors whose values do not depend on their tensor arguments' values
_FACTORIES = (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_empty", "new_zeros",
    "new_ones", "new_full", "scalar_tensor", "arange", "empty", "zeros", "ones", "full", "empty_strided",
)
# views shown as their argument in expression labels
_TRANSPARENT = ("view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "contiguous", "clone", "alias",
                "detach", "lift_fresh", "lift_fresh_copy", "unsqueeze", "squeeze")
_LABEL_LIMIT = 48


def dtype_short(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bf16``."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def dtype_word(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``BF16``."""
    return _DTYPE_WORDS.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class ValueRef:
    """A reference to program value ``index`` inside an op's arguments."""

    index: int

    def __repr__(self) -> str:
        return f"%{self.index}"


@dataclass
class Value:
    """One tensor of the program: an input, a constant, or output ``output`` of op ``op``."""

    index: int
    kind: str  # "input" | "constant" | "op"
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: int | None = None
    output: int = 0


@dataclass
class Op:
    """One recorded aten call; tensors in ``args``/``kwargs`` are :class:`ValueRef`."""

    index: int
    func: Any
    args: tuple
    kwargs: dict
    outputs: tuple[int | None, ...]
    attrs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """Short op name, e.g. ``add``."""
        return op_name(self.func)

    @property
    def target(self) -> str:
        """Full overload name, e.g. ``aten.add.Tensor``."""
        return str(self.func)


@dataclass
class Program:
    """A captured site: inputs, constants, ops and the output value. Build with :func:`capture_semantics`.

    Attributes:
        name: the site name (for messages), or None.
        inputs: input name -> value index.
        constants: constant name -> tensor (the reference module's values).
        values: every value; ``values[i].index == i``.
        ops: every recorded op in execution order.
        output: value index of the site's output.
        narrow_dtype: the program's narrow dtype (BF16/FP16) used by "rounded to ..." hypotheses, or None.
        live: indices of the ops the output depends on.
        memo: results of pure functions of the program, computed once (its hypotheses per set of shards:
            ``ulptrace.oracle.hypotheses.enumerate_hypotheses``; the messages' op locations, ``where``; the values'
            labels); a program is not changed once captured.
    """

    name: str | None
    inputs: dict[str, int]
    constants: dict[str, torch.Tensor]
    values: list[Value]
    ops: list[Op]
    output: int
    narrow_dtype: torch.dtype | None
    live: frozenset[int] = frozenset()
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def with_constants(self, replaced: dict[str, torch.Tensor]) -> Program:
        """This program with the named constants' values replaced by tensors of their shapes and dtypes (the same ops:
        its memo's results that depend on constants' values are not kept)."""
        constants = dict(self.constants)
        for name, t in replaced.items():
            old = constants.get(name)
            if old is None or old.shape != t.shape or old.dtype != t.dtype:
                raise ValueError(f"constant {name!r} of {self.name or 'a program'} is "
                                 f"{None if old is None else (tuple(old.shape), old.dtype)}, but got "
                                 f"{(tuple(t.shape), t.dtype)}")
            constants[name] = t
        memo = {k: v for k, v in self.memo.items() if not (isinstance(k, tuple) and k[:1] == ("signature",))}
        return Program(self.name, self.inputs, constants, self.values, self.ops, self.output, self.narrow_dtype,
                       self.live, memo)

    # ------------------------------------------------------------------------------------------ queries

    @property
    def output_value(self) -> Value:
        return self.values[self.output]

    def where(self, op_index: int | None = None) -> str:
        """``"site 'x', op 3 (aten.mul.Tensor)"`` for messages (made once per op: the replay hands it to every rule
        it calls, for the messages they may raise)."""
        key = ("where", op_index)
        if key not in self.memo:
            site = f"site {self.name!r}" if self.name else "program"
            self.memo[key] = site if op_index is None else f"{site}, op {op_index} ({self.ops[op_index].target})"
        return self.memo[key]

    def kind(self, op_index: int) -> str:
        """The replay kind of an op (see :mod:`ulptrace.oracle.rules`); ``x**2`` is an exact product."""
        op = self.ops[op_index]
        if op.name == "pow" and len(op.args) > 1 and op.args[1] in (1, 2, 1.0, 2.0):
            return "exact"
        return RULES[op.name].kind

    def result_dtype(self, op_index: int) -> torch.dtype:
        return self.values[self.ops[op_index].outputs[0]].dtype  # type: ignore[index]

    def is_upcast(self, op_index: int) -> bool:
        """A conversion whose result dtype is at least as wide as its input's (no rounding)."""
        op = self.ops[op_index]
        if self.kind(op_index) != "convert":
            return False
        src = self.values[op.args[0].index].dtype
        dst = self.result_dtype(op_index)
        if not src.is_floating_point:
            return False
        return dst == torch.float64 or (dst == torch.float32 and src != torch.float64) or src == dst

    def is_rounding_point(self, op_index: int) -> bool:
        """Whether the op stores a computed value in BF16/FP16/FP8/FP32 (views and upcasts do not)."""
        if self.kind(op_index) in ("view", "select", "compare") or self.is_upcast(op_index):
            return False
        return self.result_dtype(op_index) in (torch.float32,) + I.NARROW_DTYPES

    def output_ops(self) -> frozenset[int]:
        """The ops whose rounding is the output's own: its producers, looking through views and selections
        (a ``cat`` of two results has two)."""
        found: set[int] = set()
        pending = [self.output]
        while pending:
            value = self.values[pending.pop()]
            if value.kind != "op":
                continue
            op = self.ops[value.op]  # type: ignore[index]
            if self.kind(op.index) not in ("view", "select"):
                found.add(op.index)
                continue
            pending += [a.index for a in arg_leaves((op.args, op.kwargs)) if isinstance(a, ValueRef)]
        return frozenset(found)

    def output_op(self) -> int:
        """The last of :meth:`output_ops` (the only one unless the output is assembled by a selection)."""
        return max(self.output_ops())

    def terms(self, op_index: int) -> int | None:
        """Length of the op's accumulation (reductions, matmuls, softmax, attention), else None."""
        op = self.ops[op_index]
        kind = self.kind(op_index)
        b = bind(op.func, op.args, op.kwargs)

        def shape(ref: Any) -> tuple[int, ...]:
            return self.values[ref.index].shape

        if kind == "reduce":
            x = shape(b["self"])
            dim = b.get("dim")
            dims = range(len(x)) if dim is None or dim == [] else ([dim] if isinstance(dim, int) else dim)
            n = 1
            for d in dims:
                n *= x[d]
            return n
        if kind == "matmul":
            a = b.get("mat1", b.get("batch1")) if op.name in ("addmm", "baddbmm") else b["self"]
            return shape(a)[-1]
        if kind == "softmax":
            return shape(b["self"])[b["dim"]]
        if kind == "attention":
            return attention_terms(b, shape)
        return None

    def label(self, index: int) -> str:
        """Readable expression of a value (its name, or the op that makes it, abbreviated as ``%op``)."""
        return self._labels[index]

    def op_label(self, op_index: int) -> str:
        """Readable expression of an op's (first) result, e.g. ``add(f32(weight), 1.0)``."""
        return self._render(self.ops[op_index], limit=10_000)

    # ------------------------------------------------------------------------------------------ rendering

    def __repr__(self) -> str:
        out = self.output_value
        return (f"<Program {self.name or ''}: inputs {list(self.inputs)}, {len(self.ops)} ops, output "
                f"{dtype_short(out.dtype)} {list(out.shape)}>")

    @property
    def _labels(self) -> list[str]:
        """Every value's label, rendered on first use (messages and printing need them; judging does not)."""
        labels = self.memo.get("labels")
        if labels is None:
            labels = self.memo["labels"] = []  # filled in order: an op's label reads its arguments' labels
            for value in self.values:
                if value.kind != "op":
                    labels.append(value.name)
                    continue
                op = self.ops[value.op]  # type: ignore[index]
                text = self._render(op)
                if value.output and len([o for o in op.outputs if o is not None]) > 1:
                    text = f"{text}[{value.output}]"
                labels.append(text)
        return labels

    def _arg(self, a: Any) -> str:
        if isinstance(a, ValueRef):
            return self._labels[a.index] if a.index < len(self._labels) else repr(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self._arg(x) for x in a)
            return f"[{inner}]"
        if isinstance(a, torch.dtype):
            return dtype_short(a)
        if isinstance(a, float):
            return repr(a)
        return str(a)

    def _render(self, op: Op, limit: int = _LABEL_LIMIT) -> str:
        name = op.name
        b = bind(op.func, op.args, op.kwargs)
        if name in _TRANSPARENT and isinstance(b.get("self"), ValueRef):
            return self._arg(b["self"])
        if name == "_to_copy":
            text = f"{dtype_short(self.values[op.outputs[0]].dtype)}({self._arg(b['self'])})"  # type: ignore[index]
        else:
            parts = []
            for arg in op.func._schema.arguments:
                value = b.get(arg.name)
                refs = isinstance(value, ValueRef) or (
                    isinstance(value, (list, tuple)) and any(isinstance(x, ValueRef) for x in value))
                if refs or (arg.name in ("other", "exponent") and value is not None):
                    parts.append(self._arg(value))
                    continue
                if value is None or arg.name in ("layout", "device", "pin_memory", "memory_format"):
                    continue
                if arg.has_default_value() and value == arg.default_value:
                    continue
                parts.append(f"{arg.name}={self._arg(value)}")
            text = f"{name}({', '.join(parts)})"
        if len(text) > limit:
            return f"%{op.index}"
        return text

    def _note(self, op_index: int) -> str:
        op = self.ops[op_index]
        kind = self.kind(op_index)
        dtype = self.result_dtype(op_index)
        if kind == "view":
            return "view, no rounding"
        if kind == "select":
            return "selection, no rounding"
        if kind == "compare":
            return "comparison, exact"
        if self.is_upcast(op_index):
            return f"exact conversion to {dtype_word(dtype)}"
        rounding = {torch.float64: "float64, no rounding", torch.float32: "FP32 rounding"}.get(
            dtype, f"rounds to {dtype_word(dtype)}")
        n = self.terms(op_index)
        prefix = {
            "exact": "" if dtype == torch.float32 else "computed in FP32, ",
            "convert": "",
            "approx": f"approximate (+-{I.SLACK_ULPS} FP32 ULPs), ",
            "reduce": f"reduction n={n}, FP32 accumulation in any order, ",
            "matmul": f"dot products n={n}, FP32 accumulation, ",
            "softmax": f"softmax over n={n} in FP32, ",
        }.get(kind, "")
        if kind == "attention":
            if op.attrs.get("attention") == "flash":
                inner = "probabilities kept in FP32 or rounded unnormalised to " + dtype_word(
                    op.attrs["input_dtype"]) + " before P @ V"
            else:
                inner = "probabilities kept in FP32"
            prefix = f"fused attention over n={n} keys: FP32 scores and softmax, {inner}; "
        return prefix + rounding

    def __str__(self) -> str:
        lines = [f"Program {self.name or ''}".rstrip() + f": {len(self.inputs)} inputs, {len(self.constants)} constants, "
                 f"{len(self.ops)} ops; output {self.label(self.output)} "
                 f"{dtype_short(self.output_value.dtype)} {list(self.output_value.shape)}"]
        for kind in ("input", "constant"):
            for value in self.values:
                if value.kind == kind:
                    lines.append(f"  {kind:<8} {value.name}: {dtype_short(value.dtype)} {list(value.shape)}")
        out_ops = self.output_ops()
        for op in self.ops:
            value = self.values[op.outputs[0]] if op.outputs and op.outputs[0] is not None else None
            result = f"{dtype_short(value.dtype)} {list(value.shape)}" if value is not None else "?"
            mark = "  <- output" if op.index in out_ops else ("" if op.index in self.live else "  (unused)")
            lines.append(f"{op.index:>4}  {self._render(op, limit=10_000)} -> {result}  [{self._note(op.index)}]{mark}")
        return "\n".join(lines)

    # ------------------------------------------------------------------------------------------ validation

    def check_inputs(self, inputs: Mapping[str, torch.Tensor], exact_floats: bool = False) -> None:
        """Raise unless ``inputs`` has exactly the captured names, shapes and dtypes.

        ``exact_floats``: a float input may be of another float dtype than captured — the replay in float64 takes
        its values exactly, so a value a path hands on unrounded (FP32 where the reference rounded it to BF16) is
        judged as what the site received: the semantics applied to its own values. (Only where values are replayed
        exactly: running the program in its own dtypes needs the captured ones.)

        Raises:
            TypeError: a value is not a tensor, or a dtype differs.
            ValueError: names or shapes differ (the message lists expected and found).
        """
        expected, found = set(self.inputs), set(inputs)
        if expected != found:
            raise ValueError(f"{self.where()}: inputs must be named {sorted(expected)}, but got {sorted(found)}")
        for name, index in self.inputs.items():
            t, v = inputs[name], self.values[index]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.where()}: input {name!r} must be a tensor, but got {type(t).__name__}")
            if tuple(t.shape) != v.shape:
                raise ValueError(f"{self.where()}: input {name!r} must have shape {v.shape} as captured, "
                                 f"but got {tuple(t.shape)}")
            if t.dtype != v.dtype and not (exact_floats and t.is_floating_point() and v.dtype.is_floating_point):
                raise TypeError(f"{self.where()}: input {name!r} must have dtype {v.dtype} as captured, "
                                f"but got {t.dtype}")


# ---------------------------------------------------------------------------------------------- capture


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.storage_offset())


class _Builder:
    def __init__(self, inputs: Mapping[str, torch.Tensor], names: Mapping[str, torch.Tensor], semantics: str,
                 site: str | None) -> None:
        self.values: list[Value] = []
        self.ops: list[Op] = []
        self.constants: dict[str, torch.Tensor] = {}
        self.by_id: dict[int, int] = {}
        self.by_key: dict[tuple, int] = {}
        self.keep: list[torch.Tensor] = []  # keeps recorded tensors alive so that ids are not reused
        self.semantics = semantics
        self.site = site
        self.const_names = {_key(t): name for name, t in names.items() if isinstance(t, torch.Tensor)}
        self.inputs: dict[str, int] = {}
        for name, t in inputs.items():
            index = self._new("input", name, t)
            self.inputs[name] = index
            self.by_key.setdefault(_key(t), index)

    def _where(self, op_index: int, func: Any) -> str:
        site = f"site {self.site!r}" if self.site else "program"
        return f"{site}, op {op_index} ({func})"

    def _new(self, kind: str, name: str, t: torch.Tensor, op: int | None = None, output: int = 0) -> int:
        index = len(self.values)
        self.values.append(Value(index, kind, name, t.dtype, tuple(t.shape), op, output))
        self.by_id[id(t)] = index
        self.keep.append(t)
        return index

    def lookup(self, t: torch.Tensor) -> int | None:
        index = self.by_id.get(id(t))
        if index is None:
            index = self.by_key.get(_key(t))
        return index

    def constant(self, t: torch.Tensor) -> int:
        key = _key(t)
        name = self.const_names.get(key) or f"const{len(self.constants)}"
        while name in self.constants or name in self.inputs:
            name = f"{name}_"
        self.constants[name] = t.detach().clone()
        index = self._new("constant", name, t)
        self.by_key[key] = index
        return index

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = op_name(func)
        tensors = [a for a in arg_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        known = [self.lookup(t) for t in tensors]
        if name in _FACTORIES or not tensors:
            return  # a fresh tensor; if the formula uses it, it becomes a constant then
        if name == "_local_scalar_dense":
            if any(k is not None and self.values[k].kind == "input" for k in known) or any(
                    k is not None and self.values[k].kind == "op" for k in known):
                raise UnsupportedOpError(f"{self._where(len(self.ops), func)}: the formula reads a value "
                                         "(.item(), bool(), control flow on data); the oracle cannot replay that")
            return
        mutable = func._schema.is_mutable
        if mutable:
            target = args[0] if args else None
            if all(k is None for k in known):
                return  # initialising a fresh tensor (empty + fill_): it becomes a constant when used
            if not isinstance(target, torch.Tensor) or self.lookup(target) is None or not name.endswith("_"):
                raise UnsupportedOpError(
                    f"{self._where(len(self.ops), func)}: an in-place write into a tensor that is not a program "
                    "value; write the formula out of place")
            functional = getattr(getattr(torch.ops.aten, name[:-1]), func._overloadname, None)
            if functional is None:
                raise UnsupportedOpError(f"{self._where(len(self.ops), func)}: no out-of-place form of {func}")
            func, out = functional, target
        refs = {}
        for t in tensors:
            index = self.lookup(t)
            refs[id(t)] = index if index is not None else self.constant(t)

        def to_ref(a: Any) -> Any:
            return ValueRef(refs[id(a)]) if isinstance(a, torch.Tensor) else a

        r_args, r_kwargs = map_args(to_ref, (tuple(args), dict(kwargs)))
        op_index = len(self.ops)
        results = out if isinstance(out, (tuple, list)) else (out,)
        outputs: list[int | None] = []
        for k, r in enumerate(results):
            if isinstance(r, torch.Tensor):
                outputs.append(self._new("op", "", r, op_index, k))
            else:
                outputs.append(None)
        attrs: dict = {}
        if func._schema.name in ATTENTION_OPS:
            attrs = {"attention": self.semantics, "input_dtype": self.values[refs[id(tensors[0])]].dtype}
        self.ops.append(Op(op_index, func, r_args, r_kwargs, tuple(outputs), attrs))


class _Recorder(TorchDispatchMode):
    def __init__(self, builder: _Builder) -> None:
        super().__init__()
        self.builder = builder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.builder.record(func, args, kwargs, out)
        return out


def _names(constant_names: Mapping[str, torch.Tensor] | torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """The named tensors, checked: only their keys (``_key``: device, dtype, storage, shape, stride) are read, so they
    are taken as they are (not detached: an op each, for every tensor of a layer at every capture)."""
    if constant_names is None:
        return {}
    if isinstance(constant_names, torch.nn.Module):
        named = dict(constant_names.named_parameters())
        named.update(dict(constant_names.named_buffers()))
        return named
    if not isinstance(constant_names, Mapping):
        raise TypeError(f"constant_names must be a dict of tensors or an nn.Module, but got "
                        f"{type(constant_names).__name__}")
    out = {}
    for name, t in constant_names.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"constant_names[{name!r}] must be a tensor, but got {type(t).__name__}")
        out[name] = t
    return out


def _live(values: list[Value], ops: list[Op], output: int) -> frozenset[int]:
    needed = {output}
    live = set()
    for op in reversed(ops):
        if not any(o in needed for o in op.outputs if o is not None):
            continue
        live.add(op.index)
        for a in arg_leaves((op.args, op.kwargs)):
            if isinstance(a, ValueRef):
                needed.add(a.index)
    return frozenset(live)


def capture_semantics(
    fn: Callable[..., Any],
    inputs: Mapping[str, torch.Tensor],
    *,
    constant_names: Mapping[str, torch.Tensor] | torch.nn.Module | None = None,
    name: str | None = None,
    attention: str = "flash",
) -> Program:
    """Record what ``fn(**inputs)`` computes, op by op, as a replayable :class:`Program`.

    Args:
        fn: the site's formula built from the reference module, e.g. ``lambda x: ref_norm(x)``. It must
            return a tensor, or a tuple/list whose first element is the output (HF attention functions
            return ``(out, weights)``).
        inputs: name -> example tensor (the reference path's recorded inputs, usually); the program is
            specialised to their shapes and dtypes.
        constant_names: names for the tensors that are not derived from the inputs: a dict name ->
            tensor, or a module whose parameters and buffers are named automatically (matched by storage
            pointer, shape and stride). Unnamed ones are called ``const0``, ``const1``, ...
        name: the site name, used in messages.
        attention: how fused attention ops are read, ``"flash"`` (default: probabilities may be rounded
            to the input dtype before ``P @ V``, as torch's flash kernels do) or ``"fp32"`` (strictly
            FP32 inside, one final rounding). See :mod:`ulptrace.oracle.attention`.

    Returns:
        the :class:`Program`.

    Raises:
        TypeError: ``inputs`` is not a dict of tensors, or ``constant_names`` is malformed.
        ValueError: ``attention`` is unknown, or the output does not depend on the inputs.
        UnsupportedOpError: the formula uses an op that the replay does not support (named with its
            index), reads a value into Python, or writes in place into a non-program tensor.
    """
    if not isinstance(inputs, Mapping) or not inputs:
        raise TypeError(f"inputs must be a non-empty dict of tensors, but got {type(inputs).__name__}")
    for key, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"inputs[{key!r}] must be a tensor, but got {type(t).__name__}")
    if attention not in SEMANTICS:
        raise ValueError(f"attention must be one of {SEMANTICS}, but got {attention!r}")
    builder = _Builder(inputs, _names(constant_names), attention, name)
    with torch.no_grad(), _Recorder(builder):
        result = fn(**inputs)
    if isinstance(result, (tuple, list)):
        result = result[0] if result else None
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"fn must return a tensor (or a tuple starting with one), but got {type(result).__name__}")
    output = builder.lookup(result)
    if output is None or builder.values[output].kind != "op":
        raise ValueError("fn's output is not computed from its inputs (it is an input, a constant, or made "
                         "outside the dispatcher); nothing to replay")
    live = _live(builder.values, builder.ops, output)
    site = f"site {name!r}" if name else "program"
    for op in builder.ops:
        if op.index in live:
            rule_for(op.func, f"{site}, op {op.index} ({op.func})")
    used = {a.index for i in live for a in arg_leaves((builder.ops[i].args, builder.ops[i].kwargs))
            if isinstance(a, ValueRef)}
    if not used & set(builder.inputs.values()):
        raise ValueError("fn's output is not computed from its inputs (it depends on constants only); nothing "
                         "to judge")
    out_dtype = builder.values[output].dtype
    narrow = out_dtype if out_dtype in I.NARROW_DTYPES else None
    for index in list(builder.inputs.values()) + [v.index for v in builder.values]:
        if narrow is None and builder.values[index].dtype in I.NARROW_DTYPES:
            narrow = builder.values[index].dtype
    return Program(name, dict(builder.inputs), builder.constants, builder.values, builder.ops, output, narrow, live)
