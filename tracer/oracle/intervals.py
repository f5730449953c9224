"""Float64 interval arithmetic with the rounding model of the oracle.

The oracle replays a site's reference semantics in float64 and carries, per element, an interval
``[lo, hi]`` that contains every result an *honest* implementation of those semantics could produce
(plus ``pt``, the exact replay: float64 math rounded with one round-to-nearest-even at each op's
dtype). This module holds the arithmetic on such intervals; :mod:`ulptrace.oracle.replay` maps aten ops
onto it. Choices, all conservative (they may admit a little more than strictly necessary, never less):

- **Rounding to FP32** is modelled by rounding *outward*: ``[RD32(lo), RU32(hi)]``. This admits both an
  implementation that rounds to FP32 there and one that keeps more precision (FMA contraction, fused
  epilogues), and costs nothing when the ends are already FP32 values.
- **Rounding to a narrow format** (BF16, FP16, FP8) first rounds outward to FP32 (torch and CUDA kernels
  compute narrow ops in FP32 "opmath", so a value can be rounded twice) and then rounds both ends with
  one RNE (:func:`ulptrace.ulp.round_to`, monotone): the honest results are exactly the representable
  values between the two rounded ends.
- **Reductions** of ``n`` terms in FP32 (sums, means, dot products) widen by ``gamma(n) * sum |terms|``,
  the forward error bound of floating-point summation in *any* order (Higham, *Accuracy and Stability
  of Numerical Algorithms*, eq. 4.4), with ``gamma(k) = k*u / (1 - k*u)``, ``u = 2**-24``.
- **Approximate functions** (exp, rsqrt, sigmoid, silu, softplus, tanh, gelu, log, sqrt, reciprocal,
  division) get :data:`SLACK_ULPS` FP32 ULPs of slack beyond the exact float64 value, as a relative
  widening of ``SLACK_ULPS * 2**-23`` plus the same number of FP32's smallest subnormals.

Float64 evaluation error (about ``2**-53`` relative per operation) is neglected against these widths
except in reductions, where ``gamma`` carries a float64 term too. Non-float values (bool masks, integer
indices) travel as exact points.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple

import torch
from ulptrace import _ulp_cpu
from ulptrace.ulp import round_to

U32 = 2.0**-24
"""Unit roundoff of FP32 (half an ULP at 1.0)."""

SLACK_ULPS = 4
"""FP32 ULPs of slack granted to approximate functions beyond their exact float64 value."""

NARROW_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
"""Formats narrower than FP32 that an op result can be rounded to."""

F64 = torch.float64

CPU_PASS_ELEMENTS = 1 << 18
"""On a CPU, most elements the replay holds per float64 value at once (attention's score blocks, a stack of records):
its few dozen elementwise passes then run from cache (2 MB a temporary) rather than from memory. On 2 shared cores:
tiny-llama, one 4,096-token prompt, an onset judged by default took 66.4 s with attention blocks of 4M score
elements, 31.4 s of 1M, 29.5 s of 256K, 28.6 s of 128K, 32.6 s of 64K; ``bench/bench_stacked.py --model qwen3.5-0.8b
--new-tokens 2`` (728 pairs), stacked against one by one, 0.74x as fast with stacks of 4M output elements, 0.94x of
1M, 1.03x of 256K, 0.90x of 64K (the same answers each time). A GPU keeps its larger bounds (fewer, larger launches)."""


def elements_at_once(limit: int, cuda: bool) -> int:
    """``limit`` (a bound on the elements replayed at once) on a GPU; on a CPU at most :data:`CPU_PASS_ELEMENTS`."""
    return limit if cuda else min(limit, CPU_PASS_ELEMENTS)


def gamma(k: int) -> float:
    """``k*u/(1-k*u)`` with ``u = 2**-24``, plus ``k * 2**-52`` for the float64 evaluation of the bound.

    Raises:
        ValueError: ``k*u >= 1`` (more than 2**24 terms), where the bound is meaningless.
    """
    k = max(int(k), 0)
    if k * U32 >= 1.0:
        raise ValueError(f"FP32 accumulation bound needs fewer than 2**24 terms, but got {k}")
    return k * U32 / (1.0 - k * U32) + k * 2.0**-52


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff ``2**-p`` of a floating dtype (``p`` significand bits including the implicit one)."""
    return torch.finfo(dtype).eps / 2


@dataclass
class Iv:
    """An interval per element, plus the exact-replay point ``pt`` (None when not tracked).

    Float values hold float64 tensors; non-float values (bool, integer) hold the same exact tensor in
    ``lo``, ``hi`` and ``pt``.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    pt: torch.Tensor | None

    @property
    def is_float(self) -> bool:
        return self.lo.dtype.is_floating_point

    @property
    def is_point(self) -> bool:
        """Whether the interval is known to be a single value (cheap identity check, not a comparison)."""
        return self.lo is self.hi

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iv:
        """Apply a value-preserving function (view, selection) to every component."""
        lo = fn(self.lo)
        hi = lo if self.is_point else fn(self.hi)
        pt = None if self.pt is None else (lo if self.pt is self.lo else fn(self.pt))
        return Iv(lo, hi, pt)


def point(t: torch.Tensor, track: bool = True) -> Iv:
    """An exact value: floats become float64 (exactly), other dtypes are kept."""
    v = t.to(F64) if t.dtype.is_floating_point else t
    return Iv(v, v, v if track else None)


def scalar_iv(value: float, like: torch.Tensor) -> Iv:
    """A Python scalar as an exact 0-dim float64 interval on ``like``'s device."""
    v = _constant(struct.pack("<d", float(value)), F64, like.device)
    return Iv(v, v, v)


@functools.lru_cache(maxsize=1024)
def _constant(value: bytes, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The float64 of these 8 bytes as a 0-dim ``dtype`` tensor on ``device``, made once (a scalar interval or a
    rounding's ``nextafter`` target: on a GPU each was a copy from the host that waits for the device); keyed by its
    bytes, so -0.0 and 0.0 stay apart. Nothing writes to it."""
    return torch.tensor(struct.unpack("<d", value)[0], dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------- rounding

_DOWN, _UP, _ZERO = (struct.pack("<d", t) for t in (-math.inf, math.inf, 0.0))  # where _toward steps


def _toward(y: torch.Tensor, target: bytes) -> torch.Tensor:
    return torch.nextafter(y, _constant(target, y.dtype, y.device))


def _compiled(x: torch.Tensor) -> bool:
    """Whether the compiled CPU loop (``ulptrace._ulp_cpu.to_fp32``) rounds ``x``: float64 on the CPU, where a C
    compiler built it. It gives the same bits as the torch operations below, in one pass instead of five (whose
    ``where`` branches per element on the CPU: with a mask that depends on the data, 12-16x a multiply's time)."""
    return x.dtype == F64 and x.device.type == "cpu" and _ulp_cpu.library() is not None


def _down32(x: torch.Tensor) -> torch.Tensor:
    """Largest FP32 value <= x (as float32)."""
    if _compiled(x):
        return _ulp_cpu.to_fp32(x, "down")
    y = x.to(torch.float32)
    return torch.where(y.to(F64) > x, _toward(y, _DOWN), y)


def _up32(x: torch.Tensor) -> torch.Tensor:
    """Smallest FP32 value >= x (as float32)."""
    if _compiled(x):
        return _ulp_cpu.to_fp32(x, "up")
    y = x.to(torch.float32)
    return torch.where(y.to(F64) < x, _toward(y, _UP), y)


def rne(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One round-to-nearest-even of float64 ``x`` to ``dtype`` (float32, BF16, FP16 or FP8), as float64.

    For BF16/FP16 this rounds to FP32 *to odd* first (truncate, then set the last bit if inexact), after
    which torch's FP32 -> narrow cast is exactly the single RNE (FP32 keeps more than two extra bits).
    FP8 goes through :func:`ulptrace.ulp.round_to`.
    """
    if dtype == torch.float32:
        return x.to(torch.float32).to(F64)
    if dtype not in (torch.bfloat16, torch.float16):
        return round_to(x, dtype).to(F64)
    if _compiled(x):
        return _ulp_cpu.to_fp32(x, "odd").to(dtype).to(F64)
    y = x.to(torch.float32)
    back = y.to(F64)
    y = torch.where(back.abs() > x.abs(), _toward(y, _ZERO), y)  # toward zero
    # the truncation is inexact exactly where the nearest FP32 value is not x (a stepped one never is); NaN and the
    # infinities are exact (an infinite x casts to itself)
    inexact = (back != x) & ~torch.isnan(x)
    bits = y.view(torch.int32)
    y = torch.where(inexact, (bits | 1).view(torch.float32), y)
    return y.to(dtype).to(F64)


# ------------------------------------------------------------------------------------------- members

class Layout:
    """How the records of a stacked replay lie along dimension 0 of its values (``ulptrace.oracle.members``): the
    values split into ``units`` equal slices, record ``k`` holds ``lengths[k]`` consecutive ones, in order, and the
    slices after them are padding — copies of the first record's, decided with it (so they decide as it does) and
    counted for none. One record a slice (``Layout.of(count)``) is records of equal shapes stacked; a slice a row or a
    batch item lets records of different lengths stack (``ulptrace.verdicts``)."""

    def __init__(self, lengths: Sequence[int], units: int | None = None) -> None:
        self.lengths = tuple(int(n) for n in lengths)
        self.count = len(self.lengths)
        self.units = sum(self.lengths) if units is None else int(units)
        if self.count == 0 or min(self.lengths) < 1 or self.units < sum(self.lengths):
            raise ValueError(f"a layout needs records of at least one unit within {self.units} units, but got "
                             f"{self.lengths}")
        self.offsets = tuple(itertools.accumulate((0, *self.lengths)))
        self.even = self.units == self.count  # a record a slice: reductions per record need no index
        self._index: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def of(cls, count: int) -> Layout:
        """``count`` records of one slice each (equal shapes)."""
        return cls((1,) * count)

    def record_of_unit(self, device: torch.device) -> torch.Tensor:
        """The record each slice belongs to (int64, ``units`` long); the padding's is ``count``."""
        if device not in self._index:  # made on the host: on a GPU, one copy and no wait for an output size
            counts = (*self.lengths, self.units - self.offsets[-1])
            index = [k for k, n in enumerate(counts) for _ in range(n)]
            self._index[device] = torch.tensor(index, dtype=torch.int64).to(device)
        return self._index[device]

    def per_unit(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (dimension 0 the stacked one) as ``(units, -1)``."""
        return x.reshape(self.units, -1)

    def sums(self, x: torch.Tensor) -> list[int]:
        """The sum of ``x`` (integers or a mask) over each record's slices (the padding's left out): one read of the
        device."""
        return self.sums_of(x)[0]

    def sums_of(self, *xs: torch.Tensor) -> list[list[int]]:
        """:meth:`sums` of each of ``xs`` (of one shape and device), in one read of the device for them all."""
        if self.units == 1:
            return [[int(total)] for total in torch.stack([x.sum() for x in xs]).tolist()]
        per_unit = torch.stack([self.per_unit(x).sum(1) for x in xs])
        if not self.even:  # slices to records (the padding's to a record of its own, left out)
            per_unit = torch.zeros(len(xs), self.count + 1, dtype=per_unit.dtype, device=per_unit.device).index_add_(
                1, self.record_of_unit(per_unit.device), per_unit)[:, :self.count]
        return per_unit.tolist()

    def maxima(self, x: torch.Tensor) -> list[int]:
        """The largest element of ``x`` (non-negative) over each record's slices (the padding's left out)."""
        if self.units == 1:
            return [int(x.amax())]
        per_unit = self.per_unit(x).amax(1)
        if self.even:
            return per_unit.tolist()
        out = torch.zeros(self.count + 1, dtype=per_unit.dtype, device=x.device)
        return out.scatter_reduce_(0, self.record_of_unit(x.device), per_unit, "amax")[:self.count].tolist()

    def all_per_record(self, flags: torch.Tensor) -> list[bool]:
        """Whether every one of a record's ``flags`` (one per slice) is set, the padding's counted with the first
        record's."""
        if self.even:
            return flags.tolist()
        unset = torch.zeros(self.count + 1, dtype=torch.int64, device=flags.device)
        unset = unset.index_add_(0, self.record_of_unit(flags.device), (~flags).long()).tolist()
        unset[0] += unset.pop()
        return [n == 0 for n in unset]

    def part(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Record ``k``'s part of a value of the stack (dimension 0)."""
        if self.count == 1 and self.units == 1:
            return x
        step = x.shape[0] // self.units
        return x[self.offsets[k] * step:self.offsets[k + 1] * step]


_MEMBERS: ContextVar[tuple[Layout, frozenset[int]] | None] = ContextVar("members", default=None)


class MixedDecision(Exception):
    """The records of a stacked replay would take different paths at a rounding (one is a single value there, another
    is not): ``equal`` says, per record, which way it goes; each way must be replayed apart."""

    def __init__(self, equal: list[bool]) -> None:
        super().__init__(f"{sum(equal)} of {len(equal)} stacked records are equal there")
        self.equal = equal


@contextmanager
def members(layout: Layout, lengths: frozenset[int] = frozenset()) -> Iterator[None]:
    """Replay the records of ``layout`` stacked along dimension 0 (``ulptrace.oracle.members``): every decision the
    rounding takes on a value of the records — a tensor whose dimension 0 is one of ``lengths``, those of the
    program's values computed from its inputs — (is this an FP32 value? a single value?) is taken per record, and
    :class:`MixedDecision` is raised where the records differ, so a stacked replay is the records' own replays or
    none."""
    token = _MEMBERS.set((layout, frozenset(lengths)) if layout.units > 1 else None)
    try:
        yield
    finally:
        _MEMBERS.reset(token)


def stacked_layout() -> Layout | None:
    """The layout of the records being replayed stacked (:func:`members`), or None (one record)."""
    stacked = _MEMBERS.get()
    return None if stacked is None else stacked[0]


@contextmanager
def one_record() -> Iterator[None]:
    """Inside a stacked replay (:func:`members`), values of one record only: its decisions are taken on them whole,
    as its own replay takes them (``ulptrace.oracle.replay``: an op evaluated record by record)."""
    token = _MEMBERS.set(None)
    try:
        yield
    finally:
        _MEMBERS.reset(token)


def _all_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)`` for same-shaped tensors, the same for every record of a stacked replay. A value of the
    records has them stacked along dimension 0 (``ulptrace.oracle.members.stacks`` checks every value of the program
    computed from its inputs is so, and that the others are the same for all): compared record by record. Any other
    value (a norm's ``1 + weight``) is the same for every record, compared whole — and were one of them taken for the
    records' (its dimension 0 of a records' length), its parts would all be equal or all differ, or raise: never a
    wrong decision."""
    stacked = _MEMBERS.get()
    if stacked is None or a.dim() == 0 or a.shape[0] not in stacked[1]:
        return bool(torch.equal(a, b))
    layout = stacked[0]
    equal = layout.all_per_record(layout.per_unit(a == b).all(1))
    if any(equal) and not all(equal):
        raise MixedDecision(equal)
    return all(equal)


def round_iv(iv: Iv, dtype: torch.dtype) -> Iv:
    """Round an interval at a rounding point of ``dtype`` (see the module docstring for the model).

    float64 results are left alone; non-float values pass through.
    """
    if not iv.is_float or dtype == F64:
        return iv
    if dtype != torch.float32 and dtype not in NARROW_DTYPES:
        raise TypeError(f"the oracle rounds to float64, float32 or {NARROW_DTYPES}, but got {dtype}")
    if iv.is_point:
        exact = _fp32_point(iv, dtype)
        if exact is not None:
            return exact
    if dtype == torch.float32:
        # a point that gets here has an element that is NaN or no FP32 value: its ends differ, it stays an interval
        pt = None if iv.pt is None else iv.pt.to(torch.float32).to(F64)
        return Iv(_down32(iv.lo).to(F64), _up32(iv.hi).to(F64), pt)
    lo = _narrow(_down32(iv.lo), dtype).to(F64)
    hi = _narrow(_up32(iv.hi), dtype).to(F64)
    pt = None if iv.pt is None else rne(iv.pt, dtype)
    if iv.is_point and _all_equal(lo, hi):
        return Iv(lo, lo, pt)
    return Iv(lo, hi, pt)


def _narrow(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 values ``y`` rounded once to a narrow ``dtype``: from an FP32 value torch's cast to BF16/FP16 is one
    correct RNE (the float64 -> narrow casts are the ones that round twice); FP8 casts saturate in torch, so those go
    through ``round_to``."""
    return y.to(dtype) if dtype in (torch.bfloat16, torch.float16) else round_to(y, dtype)


def _fp32_point(iv: Iv, dtype: torch.dtype) -> Iv | None:
    """``round_iv`` of a point whose every element is an FP32 value (an exact upcast, a product that fits — a fifth
    of the replay's roundings): both outward roundings to FP32 are the identity, so the result is the point itself
    (FP32) or its one narrow rounding — found with one comparison instead of both ends' roundings and the point's.
    None when some element is not an FP32 value (or is NaN): ``round_iv``'s general path decides."""
    y = iv.lo.to(torch.float32)
    y64 = y.to(F64)
    if not _all_equal(y64, iv.lo):
        return None
    shared = iv.pt is iv.lo  # the exact replay's point is this value: it rounds as the ends do
    if dtype == torch.float32:
        pt = None if iv.pt is None else y64 if shared else iv.pt.to(torch.float32).to(F64)
        return Iv(y64, y64, pt)
    narrow = _narrow(y, dtype).to(F64)
    # an FP32 value's round-to-odd is itself, so its one RNE to BF16/FP16 is the cast (FP8: rne's own path)
    pt = None if iv.pt is None else narrow if shared and dtype in (torch.bfloat16, torch.float16) else rne(iv.pt, dtype)
    return Iv(narrow, narrow, pt)


def round_scalar(value: float, dtype: torch.dtype) -> float:
    """A Python scalar as an op of ``dtype`` uses it: converted to FP32 for FP32/narrow ops (torch's
    opmath), kept for float64 ops."""
    if dtype == F64 or isinstance(value, bool):
        return float(value)
    return _to_fp32(float(value))


@functools.lru_cache(maxsize=4096)
def _to_fp32(value: float) -> float:
    """``value`` rounded to FP32 as torch casts it (once per value: a replay meets the same few scalars — an epsilon,
    a scale — in every record, and each cast is three tensor ops)."""
    return float(torch.tensor(value, dtype=F64).to(torch.float32))


# ---------------------------------------------------------------------------------------------- widening


def widen_rel(iv: Iv, rel: float | torch.Tensor, absolute: float = 0.0) -> Iv:
    """Widen each end away from the other by ``rel * |end| + absolute``."""
    lo = iv.lo - (iv.lo.abs() * rel + absolute)
    hi = iv.hi + (iv.hi.abs() * rel + absolute)
    return Iv(lo, hi, iv.pt)


def approx_slack(iv: Iv, dtype: torch.dtype) -> Iv:
    """Grant an approximate function :data:`SLACK_ULPS` ULPs of its compute type (FP32 unless float64)."""
    if dtype == F64:
        return widen_rel(iv, SLACK_ULPS * 2.0**-52, SLACK_ULPS * 2.0**-1074)
    return widen_rel(iv, SLACK_ULPS * 2.0**-23, SLACK_ULPS * 2.0**-149)


def magnitude(iv: Iv) -> torch.Tensor:
    """Largest absolute value in each interval."""
    return iv.lo.abs() if iv.is_point else torch.maximum(iv.lo.abs(), iv.hi.abs())


# ---------------------------------------------------------------------------------------------- arithmetic


def _pt(fn: Callable[..., torch.Tensor], *ivs: Iv) -> torch.Tensor | None:
    if any(v.pt is None for v in ivs):
        return None
    return fn(*(v.pt for v in ivs))


def add(a: Iv, b: Iv) -> Iv:
    lo = a.lo + b.lo
    hi = lo if a.is_point and b.is_point else a.hi + b.hi
    return Iv(lo, hi, _pt(torch.add, a, b))


def neg(a: Iv) -> Iv:
    lo = -a.hi
    return Iv(lo, lo if a.is_point else -a.lo, _pt(torch.neg, a))


def sub(a: Iv, b: Iv) -> Iv:
    return add(a, neg(b))


def mul(a: Iv, b: Iv) -> Iv:
    if a.is_point and b.is_point:
        v = a.lo * b.lo
        return Iv(v, v, _pt(torch.mul, a, b))
    if a.is_point or b.is_point:  # two of the four corners: the other two are the same products (a weight, a scale)
        x, y = (b, a.lo) if a.is_point else (a, b.lo)
        p0, p1 = x.lo * y, x.hi * y
        return Iv(torch.minimum(p0, p1), torch.maximum(p0, p1), _pt(torch.mul, a, b))
    p = (a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi)
    lo = torch.minimum(torch.minimum(p[0], p[1]), torch.minimum(p[2], p[3]))
    hi = torch.maximum(torch.maximum(p[0], p[1]), torch.maximum(p[2], p[3]))
    return Iv(lo, hi, _pt(torch.mul, a, b))


def reciprocal(a: Iv) -> Iv:
    """``1/x``; an interval containing zero gives ``[-inf, inf]`` (or ``[1/hi, inf]`` from ``[0, hi]``)."""
    lo, hi = 1.0 / a.hi, 1.0 / a.lo
    spans_zero = (a.lo < 0) & (a.hi > 0)
    lo = torch.where(spans_zero, torch.full_like(lo, -math.inf), lo)
    hi = torch.where(spans_zero, torch.full_like(hi, math.inf), hi)
    return Iv(lo, hi, _pt(torch.reciprocal, a))


def div(a: Iv, b: Iv) -> Iv:
    q = mul(a, reciprocal(b))
    return Iv(q.lo, q.hi, _pt(torch.div, a, b))


def square(a: Iv) -> Iv:
    lo2, hi2 = a.lo * a.lo, a.hi * a.hi
    lo = torch.where(a.lo >= 0, lo2, torch.where(a.hi <= 0, hi2, torch.zeros_like(lo2)))
    hi = torch.maximum(lo2, hi2)
    return Iv(lo, hi, _pt(torch.square, a))


def abs_(a: Iv) -> Iv:
    lo = torch.where(a.lo >= 0, a.lo, torch.where(a.hi <= 0, -a.hi, torch.zeros_like(a.lo)))
    return Iv(lo, magnitude(a), _pt(torch.abs, a))


def monotone(a: Iv, fn: Callable[[torch.Tensor], torch.Tensor], increasing: bool = True) -> Iv:
    """Apply a monotone function to both ends (swapped when decreasing)."""
    flo = fn(a.lo)
    fhi = flo if a.is_point else fn(a.hi)
    pt = None if a.pt is None else (flo if a.pt is a.lo else fn(a.pt))
    return Iv(flo, fhi, pt) if increasing else Iv(fhi, flo, pt)


def even_power(a: Iv, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iv:
    """Apply ``f(x) = g(|x|)`` with ``g`` increasing (``x**4``, ``|x|**p``)."""
    m = abs_(a)
    return Iv(fn(m.lo), fn(m.hi), _pt(fn, a))


def single_minimum(a: Iv, fn: Callable[[torch.Tensor], torch.Tensor], x_min: float, f_min: float) -> Iv:
    """Apply a function that decreases up to ``x_min``, where it takes ``f_min``, then increases."""
    flo = fn(a.lo)
    fhi = flo if a.is_point else fn(a.hi)
    low = torch.where(a.hi <= x_min, fhi, torch.where(a.lo >= x_min, flo, torch.full_like(flo, f_min)))
    high = torch.maximum(flo, fhi)
    pt = None if a.pt is None else fn(a.pt)
    return Iv(low, high, pt)


@functools.cache
def minimum_of(name: str, fn: Callable[[torch.Tensor], torch.Tensor], left: float, right: float) -> tuple[float, float]:
    """``(x_min, f_min)`` of a unimodal function on ``[left, right]`` by golden-section search in float64.

    ``f_min`` is lowered by a relative ``2**-40`` so that the search's own error cannot make the interval
    too narrow. ``name`` only keys the cache.
    """
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = left, right

    def f(x: float) -> float:
        return float(fn(torch.tensor(x, dtype=F64)))

    for _ in range(200):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    x = (a + b) / 2.0
    fx = f(x)
    return x, fx - abs(fx) * 2.0**-40


def maximum(a: Iv, b: Iv) -> Iv:
    return Iv(torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi), _pt(torch.maximum, a, b))


def minimum(a: Iv, b: Iv) -> Iv:
    return Iv(torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi), _pt(torch.minimum, a, b))


# ---------------------------------------------------------------------------------------------- reductions


def reduce_sum(a: Iv, dims: list[int], keepdim: bool, terms: int) -> Iv:
    """Sum over ``dims`` with the any-order FP32 accumulation bound ``gamma(terms) * sum |x|``."""
    s_lo = a.lo.sum(dims, keepdim=keepdim)
    s_hi = s_lo if a.is_point else a.hi.sum(dims, keepdim=keepdim)
    bound = gamma(terms) * magnitude(a).sum(dims, keepdim=keepdim)
    pt = None if a.pt is None else (s_lo if a.pt is a.lo else a.pt.sum(dims, keepdim=keepdim))
    return Iv(s_lo - bound, s_hi + bound, pt)


class MatmulRight(NamedTuple):
    """What :func:`matmul` derives from its right operand (midpoint, radius, ``|mid| + rad``, magnitude), made once by
    :func:`matmul_right` for products taken in blocks of the left operand's rows (attention's query rows): each block
    then reads them instead of deriving them again from the whole operand — the same tensors, so the blocks' results
    are those of deriving them per block, bit for bit. ``rad`` and ``spread`` are None for a point with a point on the
    left (the product of two points needs neither)."""

    mid: torch.Tensor
    rad: torch.Tensor | None
    spread: torch.Tensor | None
    mag: torch.Tensor


def matmul_right(b: Iv, left_point: bool) -> MatmulRight:
    """:class:`MatmulRight` of ``b`` for left operands that are points (``left_point``) or not."""
    if left_point and b.is_point:
        return MatmulRight(b.lo, None, None, b.lo.abs())
    bm, br = (b.lo + b.hi) / 2, (b.hi - b.lo) / 2
    return MatmulRight(bm, br, bm.abs() + br, magnitude(b))


def matmul(a: Iv, b: Iv, terms: int, right: MatmulRight | None = None) -> Iv:
    """``a @ b`` (torch.matmul broadcasting) in midpoint-radius form, plus ``gamma(terms) * |a| @ |b|``. ``right``:
    ``matmul_right(b, a.is_point)``, made once for many products with ``b`` (made here when not given)."""
    if right is None:
        right = matmul_right(b, a.is_point)
    if a.is_point and b.is_point:  # no radius: the ends are mid -+ bound
        mid = a.lo @ right.mid
        bound = gamma(terms) * (a.lo.abs() @ right.mag)
        # where both points are their exact replays too (inputs, weights), that replay's product is ``mid`` itself
        pt = mid if a.pt is a.lo and b.pt is b.lo else _pt(torch.matmul, a, b)
        return Iv(mid - bound, mid + bound, pt)
    am, ar = (a.lo + a.hi) / 2, (a.hi - a.lo) / 2
    mid = am @ right.mid
    rad = am.abs() @ right.rad + ar @ right.spread
    bound = gamma(terms) * (magnitude(a) @ right.mag)
    return Iv(mid - rad - bound, mid + rad + bound, _pt(torch.matmul, a, b))


class NonnegRight(NamedTuple):
    """What :func:`nonneg_matmul` derives from its right operand (each end's positive and negative parts, its
    magnitude), made once by :func:`nonneg_right` for products in blocks of rows, as :class:`MatmulRight`."""

    lo_pos: torch.Tensor
    lo_neg: torch.Tensor
    hi_pos: torch.Tensor
    hi_neg: torch.Tensor
    mag: torch.Tensor


def nonneg_right(v: Iv) -> NonnegRight:
    lo_pos, lo_neg = v.lo.clamp(min=0), v.lo.clamp(max=0)
    if v.is_point:  # its ends are one tensor: their parts are too
        return NonnegRight(lo_pos, lo_neg, lo_pos, lo_neg, magnitude(v))
    return NonnegRight(lo_pos, lo_neg, v.hi.clamp(min=0), v.hi.clamp(max=0), magnitude(v))


def nonneg_matmul(p: Iv, v: Iv, terms: int, right: NonnegRight | None = None) -> Iv:
    """``p @ v`` for ``p >= 0`` (probabilities): tight per-term corners, plus the FP32 accumulation bound. ``right``:
    ``nonneg_right(v)``, made once for many products with ``v`` (made here when not given)."""
    if right is None:
        right = nonneg_right(v)
    plo, phi = p.lo.clamp(min=0), p.hi.clamp(min=0)
    lo = plo @ right.lo_pos + phi @ right.lo_neg
    hi = phi @ right.hi_pos + plo @ right.hi_neg
    bound = gamma(terms) * (phi @ right.mag)
    return Iv(lo - bound, hi + bound, _pt(torch.matmul, p, v))


def softmax(a: Iv, dim: int, compute: torch.dtype) -> Iv:
    """Softmax over ``dim`` with rigorous ends, and the error of an FP32 (or float64) evaluation.

    ``p_i`` is smallest with ``x_i`` at ``lo`` and the others at ``hi``, and vice versa. The evaluation
    error is bounded relative to ``p_i``: exp's slack and the rounding of ``x_i - max`` (``u*|x_i - max|``)
    for the numerator, the same weighted over the row plus ``gamma(n)`` for the denominator, and the
    division. Entries at ``-inf`` get exactly 0.
    """
    n = a.lo.shape[dim]
    top = a.hi.amax(dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e_lo, e_hi = torch.exp(a.lo - top), torch.exp(a.hi - top)
    s_lo, s_hi = e_lo.sum(dim, keepdim=True), e_hi.sum(dim, keepdim=True)
    p_lo = e_lo / (s_hi - e_hi + e_lo)
    p_hi = e_hi / (s_lo - e_lo + e_hi)
    p_lo = torch.nan_to_num(p_lo, nan=0.0).clamp(0.0, 1.0)
    p_hi = torch.nan_to_num(p_hi, nan=0.0).clamp(0.0, 1.0)
    if compute == F64:
        u, slack = 2.0**-53, SLACK_ULPS * 2.0**-52
    else:
        u, slack = U32, SLACK_ULPS * 2.0**-23
    spread = top - a.lo
    err = slack + u * torch.where(torch.isfinite(spread), spread, torch.zeros_like(spread))
    weighted = torch.where(e_hi > 0, e_hi * err, torch.zeros_like(err)).sum(dim, keepdim=True)
    rel = err + weighted / s_lo.clamp(min=1e-300) + gamma(n) + 2 * u
    floor = SLACK_ULPS * (2.0**-149 if compute != F64 else 2.0**-1074)
    lo = torch.where(e_lo > 0, p_lo * (1 - rel) - floor, p_lo).clamp(min=0.0)
    hi = torch.where(e_hi > 0, p_hi * (1 + rel) + floor, p_hi).clamp(max=1.0)
    pt = None if a.pt is None else torch.softmax(a.pt, dim)
    return Iv(lo, hi, pt)
