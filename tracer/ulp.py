"""ULP arithmetic for the narrow float formats that kernels and HF models store activations in.

Every statement ulptrace makes ("this norm output is 2 BF16 ULPs from HF", "the oracle admits these three
values") is phrased in units in the last place of the tensor's own dtype. This module is the single place
where such units are computed, for every supported format from one table (:data:`FORMATS`) instead of one
copy of the code per dtype.

All functions work element-wise on torch tensors of any shape on any device, with integer arithmetic on
the bit patterns (no Python loops over elements):

- :func:`ulp_distance` -- how many representable values lie between two tensors, element-wise;
- :func:`spacing`, :func:`next_up`, :func:`next_down` -- the ULP at ``x`` and its neighbours;
- :func:`round_to` -- a *single* round-to-nearest-even from float64 (or float32) to a format. torch's own
  ``double -> bfloat16/float16/float8`` casts go through float32 and can round twice; this one does not;
- :func:`ulp_histogram`, :func:`grouped_histograms` (:func:`grouped_ulp_histograms`), :func:`merge_histograms`,
  :func:`format_histogram` -- the fixed buckets used wherever ULP statistics are shown;
- :func:`ulp_stats`, :func:`record_stats` (:func:`pending_stats`, :func:`resolve_stats`) -- what a comparison
  computes per record, in one pass (a Triton kernel on CUDA, a compiled C pass on the CPU, torch elsewhere);
- :func:`ordering_key`, :func:`from_ordering_key` -- the monotone integer order behind all of the above;
- :func:`bits`, :func:`same_bits` (:func:`parts_differ`) -- bit patterns, the one definition of "bitwise equal"
  element-wise;
- :func:`row_ulp_distance`, :func:`row_histogram` -- differences in ULPs of the row's magnitude, beside
  the per-element ULPs (a near-zero element's own ULPs exaggerate a change that is tiny for its row).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from ulptrace import _ulp_cpu
from ulptrace.reading import UntilRead

__all__ = [
    "FORMATS",
    "HISTOGRAM_BUCKETS",
    "ROW_HISTOGRAM_BUCKETS",
    "FloatFormat",
    "PendingStats",
    "RecordStats",
    "RowUlpDistance",
    "StatsBatch",
    "UlpDistance",
    "bits",
    "format_histogram",
    "format_of",
    "from_ordering_key",
    "grouped_histograms",
    "grouped_ulp_histograms",
    "merge_histograms",
    "merge_record_stats",
    "next_down",
    "next_up",
    "ordering_key",
    "parts_differ",
    "pending_stats",
    "record_stats",
    "resolve_stats",
    "round_to",
    "row_histogram",
    "row_ulp_distance",
    "same_bits",
    "spacing",
    "torch_saturates",
    "ulp_distance",
    "ulp_histogram",
    "ulp_stats",
]


@dataclass(frozen=True)
class FloatFormat:
    """One binary floating-point format: its layout and the constants derived from it.

    ``nan_encoding`` is ``"ieee"`` when every pattern with an all-ones exponent and a non-zero mantissa
    is NaN (and the all-ones exponent with a zero mantissa is infinity), or ``"all_ones"`` when only the
    pattern with every exponent and mantissa bit set is NaN and there is no infinity (float8_e4m3fn).
    """

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_inf: bool
    nan_encoding: Literal["ieee", "all_ones"]
    int_dtype: torch.dtype  # signed integer dtype of the same width, for bit views

    @property
    def bits(self) -> int:
        """Total width in bits (sign + exponent + mantissa)."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def sign_bit(self) -> int:
        """The sign bit as an unsigned integer mask, e.g. ``0x8000`` for bfloat16."""
        return 1 << (self.bits - 1)

    @property
    def magnitude_mask(self) -> int:
        """Mask of the exponent and mantissa bits, e.g. ``0x7FFF`` for bfloat16."""
        return self.sign_bit - 1

    @property
    def inf_bits(self) -> int | None:
        """Bit pattern of +infinity, or None when the format has no infinity."""
        return (((1 << self.exponent_bits) - 1) << self.mantissa_bits) if self.has_inf else None

    @property
    def nan_above(self) -> int:
        """Magnitude bits above which a pattern is NaN: infinity's (IEEE formats), else the largest finite's."""
        return self.inf_bits if self.inf_bits is not None else self.max_finite_bits

    @property
    def max_finite_bits(self) -> int:
        """Bit pattern of the largest finite value; every larger magnitude pattern is inf or NaN."""
        if self.nan_encoding == "ieee":
            return (((1 << self.exponent_bits) - 1) << self.mantissa_bits) - 1
        return self.magnitude_mask - 1

    @property
    def nan_bits(self) -> int:
        """Canonical (quiet, positive) NaN pattern that this module produces."""
        if self.nan_encoding == "ieee":
            return (((1 << self.exponent_bits) - 1) << self.mantissa_bits) | (1 << (self.mantissa_bits - 1))
        return self.magnitude_mask

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value."""
        return (self.max_finite_bits >> self.mantissa_bits) - self.bias

    @property
    def max_finite(self) -> float:
        """Largest finite value, e.g. ``0x1.fep127`` for bfloat16, 448.0 for float8_e4m3fn."""
        return _decode_magnitude(self, self.max_finite_bits)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, ``2**emin``."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal value, ``2**(emin - mantissa_bits)``."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits)


def _decode_magnitude(fmt: FloatFormat, bits: int) -> float:
    """Value of a non-negative finite bit pattern, in Python float arithmetic (for the table's constants)."""
    exponent, mantissa = bits >> fmt.mantissa_bits, bits & ((1 << fmt.mantissa_bits) - 1)
    if exponent == 0:
        return math.ldexp(float(mantissa), fmt.emin - fmt.mantissa_bits)
    return math.ldexp(float((1 << fmt.mantissa_bits) + mantissa), exponent - fmt.bias - fmt.mantissa_bits)


FORMATS: dict[torch.dtype, FloatFormat] = {
    fmt.dtype: fmt
    for fmt in (
        FloatFormat("float32", torch.float32, 8, 23, 127, True, "ieee", torch.int32),
        FloatFormat("bfloat16", torch.bfloat16, 8, 7, 127, True, "ieee", torch.int16),
        FloatFormat("float16", torch.float16, 5, 10, 15, True, "ieee", torch.int16),
        FloatFormat("float8_e4m3fn", torch.float8_e4m3fn, 4, 3, 7, False, "all_ones", torch.int8),
        FloatFormat("float8_e5m2", torch.float8_e5m2, 5, 2, 15, True, "ieee", torch.int8),
    )
}
"""The supported formats, keyed by torch dtype."""


def format_of(dtype: torch.dtype) -> FloatFormat:
    """The :class:`FloatFormat` of ``dtype``.

    Raises:
        TypeError: ``dtype`` is not one of :data:`FORMATS` (the message lists the supported ones).
    """
    fmt = FORMATS.get(dtype)
    if fmt is None:
        supported = ", ".join(f.name for f in FORMATS.values())
        raise TypeError(f"ULP arithmetic supports {supported}, but got {dtype}")
    return fmt


def _require_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, but got {type(x).__name__}")
    return x


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its memory holding its values: a lazily negated view (``x.conj().imag`` of a complex ``x``) keeps
    the values before negation in memory, which bit patterns read as they are would take for its own (and torch
    refuses to view it as integers)."""
    return t.resolve_neg() if t.is_neg() else t


def _unsigned_bits(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The bit patterns of ``x`` as non-negative int64 (``0 .. 2**bits - 1``)."""
    bits = _resolved(x).view(fmt.int_dtype).to(torch.int64)
    return bits & ((1 << fmt.bits) - 1)


def _from_unsigned_bits(bits: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Inverse of :func:`_unsigned_bits`: int64 patterns ``0 .. 2**bits - 1`` back to ``fmt.dtype``."""
    signed = torch.where(bits >= fmt.sign_bit, bits - (1 << fmt.bits), bits)
    return signed.to(fmt.int_dtype).view(fmt.dtype)


def _is_nan_magnitude(magnitude: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    return magnitude > fmt.nan_above


def ordering_key(x: torch.Tensor) -> torch.Tensor:
    """A monotone int64 key of every element: ``key(a) < key(b)`` iff ``a < b`` for non-NaN values.

    The key is the signed count of representable values from zero: ``+0`` and ``-0`` both map to 0, the
    smallest subnormals to +-1, infinities to +-(max finite key + 1). NaN elements get keys beyond the
    infinities that carry no meaning; mask them with ``torch.isnan`` or :func:`ulp_distance`'s ``nan``.

    Args:
        x: a tensor of one of the dtypes in :data:`FORMATS`, any shape and device.

    Returns:
        int64 tensor of ``x``'s shape.

    Raises:
        TypeError: ``x`` is not a tensor or its dtype is unsupported.
    """
    return _key_and_magnitude(x, format_of(_require_tensor(x, "x").dtype))[0]


def _key_and_magnitude(x: torch.Tensor, fmt: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`ordering_key`, the magnitude bits) of ``x``, from one read of its bit patterns: widened with their
    sign, the sign bit fills an int64 (-1 for a negative value, else 0), and ``(magnitude ^ s) - s`` negates the
    magnitude where it is -1 — arithmetic, no ``where`` (whose CPU loop branches per element, and here the signs are
    the data's)."""
    signed = _resolved(x).view(fmt.int_dtype).to(torch.int64)
    magnitude = signed & fmt.magnitude_mask
    sign = signed >> 63
    return (magnitude ^ sign) - sign, magnitude


def from_ordering_key(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The value of ``dtype`` whose :func:`ordering_key` is ``key`` (key 0 gives +0).

    Raises:
        TypeError: ``key`` is not an integer tensor, or ``dtype`` is unsupported.
        ValueError: a key lies outside the format's range (beyond +-infinity, or beyond +-max finite for
            a format without infinity).
    """
    fmt = format_of(dtype)
    key = _require_tensor(key, "key")
    if key.dtype.is_floating_point or key.dtype.is_complex or key.dtype == torch.bool:
        raise TypeError(f"key must be an integer tensor, but got {key.dtype}")
    key = key.to(torch.int64)
    top = fmt.nan_above  # the largest ordered magnitude
    if key.numel() and int(key.abs().max()) > top:
        raise ValueError(f"{fmt.name} ordering keys lie in [-{top}, {top}], but got {int(key.abs().max())}")
    bits = torch.where(key < 0, fmt.sign_bit - key, key)
    return _from_unsigned_bits(bits, fmt)


class UlpDistance(NamedTuple):
    """Result of :func:`ulp_distance`: ``distance`` (int64, -1 where ``nan``) and ``nan`` (bool)."""

    distance: torch.Tensor
    nan: torch.Tensor


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> UlpDistance:
    """Element-wise number of representable steps between ``a`` and ``b``.

    ``distance[i]`` is how many times :func:`next_up` must be applied to the smaller of ``a[i]``, ``b[i]``
    to reach the larger: 0 for equal values (``+0`` and ``-0`` are 0 apart), 1 for neighbours, and the
    count crosses zero correctly (``-min_subnormal`` and ``+min_subnormal`` are 2 apart). Infinities are
    the ends of the order: ``max_finite`` and ``inf`` are 1 apart. Where either side is NaN, ``nan`` is
    True and ``distance`` is -1.

    Args:
        a, b: tensors of the same dtype (one of :data:`FORMATS`) and device; shapes broadcast.

    Returns:
        ``UlpDistance(distance, nan)`` with the broadcast shape; ``distance`` int64, ``nan`` bool.

    Raises:
        TypeError: an argument is not a tensor, the dtypes differ, or the dtype is unsupported.
    """
    _require_tensor(a, "a")
    _require_tensor(b, "b")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, but got {a.dtype} and {b.dtype}")
    fmt = format_of(a.dtype)
    a, b = torch.broadcast_tensors(a, b)
    (key_a, mag_a), (key_b, mag_b) = _key_and_magnitude(a, fmt), _key_and_magnitude(b, fmt)
    nan = _is_nan_magnitude(mag_a, fmt) | _is_nan_magnitude(mag_b, fmt)
    distance = (key_a - key_b).abs()
    return UlpDistance(distance.masked_fill_(nan, -1), nan)


def spacing(x: torch.Tensor) -> torch.Tensor:
    """The ULP at each element: the gap to the next representable value away from zero, as float64.

    The result is the power of two ``2**(e - mantissa_bits)`` of ``x``'s binade (``e`` the unbiased
    exponent; ``emin`` for zero and subnormals, so ``spacing(0) == spacing(subnormal) == min_subnormal``).
    It is returned as float64, where every such power of two is exact. At ``+-max_finite`` the next value
    away from zero is infinity (or NaN for float8_e4m3fn); there the result is still the binade's spacing,
    i.e. the gap that the next value would have if the exponent range continued (which is also the gap
    to :func:`next_down` of ``max_finite``). ``spacing(+-inf)`` is ``inf``; ``spacing(NaN)`` is NaN.
    The sign of ``x`` is ignored.

    Args:
        x: tensor of one of the dtypes in :data:`FORMATS`, any shape and device.

    Returns:
        float64 tensor of ``x``'s shape.

    Raises:
        TypeError: ``x`` is not a tensor or its dtype is unsupported.
    """
    fmt = format_of(_require_tensor(x, "x").dtype)
    magnitude = _unsigned_bits(x, fmt) & fmt.magnitude_mask
    biased = (magnitude >> fmt.mantissa_bits).clamp(min=1)
    result = torch.exp2((biased - fmt.bias - fmt.mantissa_bits).to(torch.float64))
    result = torch.where(_is_nan_magnitude(magnitude, fmt), torch.full_like(result, math.nan), result)
    if fmt.inf_bits is not None:
        result = torch.where(magnitude == fmt.inf_bits, torch.full_like(result, math.inf), result)
    return result


def next_up(x: torch.Tensor) -> torch.Tensor:
    """The next representable value toward +infinity, in ``x``'s dtype (like ``numpy.nextafter(x, +inf)``).

    ``next_up(-0) == next_up(+0) == +min_subnormal``; ``next_up(-min_subnormal) == -0``;
    ``next_up(max_finite)`` is ``+inf``, except for float8_e4m3fn, which has no infinity: there it is NaN
    (as ``ml_dtypes``' ``nextafter`` gives, since ``+inf`` is NaN in that format); ``next_up(+inf) == +inf``,
    ``next_up(-inf) == -max_finite``; NaN stays NaN.

    Raises:
        TypeError: ``x`` is not a tensor or its dtype is unsupported.
    """
    fmt = format_of(_require_tensor(x, "x").dtype)
    bits = _unsigned_bits(x, fmt)
    magnitude = bits & fmt.magnitude_mask
    negative = bits >= fmt.sign_bit
    stepped = torch.where(negative, bits - 1, bits + 1)
    stepped = torch.where(bits == fmt.sign_bit, torch.ones_like(bits), stepped)  # -0 -> +min_subnormal
    keep = _is_nan_magnitude(magnitude, fmt)
    if fmt.inf_bits is not None:
        keep = keep | (bits == fmt.inf_bits)
    return _from_unsigned_bits(torch.where(keep, bits, stepped), fmt)


def next_down(x: torch.Tensor) -> torch.Tensor:
    """The next representable value toward -infinity, in ``x``'s dtype: ``-next_up(-x)``.

    ``next_down(+0) == next_down(-0) == -min_subnormal``; ``next_down(-max_finite)`` is ``-inf`` (NaN for
    float8_e4m3fn); NaN stays NaN.

    Raises:
        TypeError: ``x`` is not a tensor or its dtype is unsupported.
    """
    fmt = format_of(_require_tensor(x, "x").dtype)
    return _negate(next_up(_negate(x, fmt)), fmt)


def _negate(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    return _from_unsigned_bits(_unsigned_bits(x, fmt) ^ fmt.sign_bit, fmt)


_F64_MANTISSA = 52
_F64_BIAS = 1023


def round_to(x: torch.Tensor, dtype: torch.dtype, *, saturate: bool = False) -> torch.Tensor:
    """Round every element of ``x`` to ``dtype`` with one round-to-nearest, ties-to-even.

    The rounding is done once, exactly, on the float64 bit pattern with integer arithmetic, so a float64
    value just above a bfloat16 midpoint rounds up even where torch's ``double -> bfloat16`` cast (which
    goes through float32, as do its float16 and float8 casts and ml_dtypes' bfloat16/float8 casts) first
    rounds it onto the midpoint and then to even. Subnormal results are rounded at the subnormal spacing.

    Overflow: a value whose rounded magnitude exceeds ``max_finite`` (e.g. ``>= 0x1.ff8p127`` for
    bfloat16; ``> 464`` for float8_e4m3fn, where 464 itself ties to even onto 448) and +-inf become
    +-inf, or NaN for float8_e4m3fn -- as ml_dtypes and the OCP FP8 specification's non-saturating mode
    convert. With ``saturate=True`` they become +-max_finite instead; that is how torch (2.13 at least)
    casts to float8_e4m3fn, see :func:`torch_saturates`. NaN gives the format's canonical quiet NaN with
    the input's sign; signed zeros keep their sign.

    Args:
        x: floating tensor, float64 or float32 (or any of :data:`FORMATS`, all of which are exact in
            float64); any shape and device.
        dtype: target dtype, one of :data:`FORMATS`.
        saturate: clamp overflow (including +-inf inputs) to +-max_finite instead of inf/NaN.

    Returns:
        tensor of ``x``'s shape in ``dtype``.

    Raises:
        TypeError: ``x`` is not a floating tensor of a supported input dtype, or ``dtype`` is unsupported.
    """
    fmt = format_of(dtype)
    _require_tensor(x, "x")
    if x.dtype != torch.float64 and x.dtype not in FORMATS:
        raise TypeError(
            f"round_to rounds float64 or {', '.join(f.name for f in FORMATS.values())} tensors, "
            f"but got {x.dtype}"
        )
    bits = x.to(torch.float64).view(torch.int64)
    negative = bits < 0
    magnitude = bits & ((1 << 63) - 1)
    exponent64 = magnitude >> _F64_MANTISSA
    fraction = magnitude & ((1 << _F64_MANTISSA) - 1)
    # value = significand * 2**(exponent64 - bias - 52), with exponent64 treated as 1 for subnormals
    significand = torch.where(exponent64 == 0, fraction, fraction | (1 << _F64_MANTISSA))
    unbiased = exponent64.clamp(min=1) - _F64_BIAS
    # target binade exponent (emin for subnormal results) and the number of low significand bits to drop
    target_exp = unbiased.clamp(min=fmt.emin)
    shift = (target_exp - fmt.mantissa_bits - (unbiased - _F64_MANTISSA)).clamp(max=62)
    kept = significand >> shift
    remainder = significand & ((torch.ones_like(shift) << shift) - 1)
    half = torch.ones_like(shift) << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((kept & 1) == 1))
    rounded = kept + round_up.to(torch.int64)
    # ((e - emin) << m) + r encodes subnormals (e == emin, r < 2**m) and normals alike; a carry of r into
    # 2**(m + 1) moves into the next binade by itself.
    out = ((target_exp - fmt.emin) << fmt.mantissa_bits) + rounded
    overflow = (out > fmt.max_finite_bits) | (exponent64 == 0x7FF)
    if saturate:
        overflow_bits = fmt.max_finite_bits
    else:
        overflow_bits = fmt.inf_bits if fmt.inf_bits is not None else fmt.nan_bits
    out = torch.where(overflow, torch.full_like(out, overflow_bits), out)
    is_nan = (exponent64 == 0x7FF) & (fraction != 0)
    out = torch.where(is_nan, torch.full_like(out, fmt.nan_bits), out)
    out = torch.where(negative, out | fmt.sign_bit, out)
    return _from_unsigned_bits(out, fmt)


@functools.cache
def torch_saturates(dtype: torch.dtype) -> bool:
    """Whether the installed torch's float32 -> ``dtype`` cast clamps overflow to max finite.

    torch 2.13 saturates float8_e4m3fn (``1e9`` and ``inf`` become 448) while ml_dtypes and older torch
    versions give NaN; the IEEE-like formats overflow to inf. Pass the result as
    ``round_to(x, dtype, saturate=torch_saturates(dtype))`` to model torch's own cast. Probed once, on CPU.

    Raises:
        TypeError: ``dtype`` is unsupported.
    """
    fmt = format_of(dtype)
    probe = torch.tensor([math.inf, 1e30], dtype=torch.float32).to(dtype)
    return bool((_unsigned_bits(probe, fmt) == fmt.max_finite_bits).all())


HISTOGRAM_BUCKETS: tuple[str, ...] = ("0", "1", "2", "3-4", "5-8", "9-16", ">16", "nonfinite")
"""Fixed ULP-distance buckets of every histogram ulptrace shows; the last counts NaN/Inf mismatches."""

def ulp_histogram(distance: torch.Tensor | UlpDistance, nan: torch.Tensor | None = None) -> dict[str, int]:
    """Count ULP distances into :data:`HISTOGRAM_BUCKETS`.

    Args:
        distance: integer tensor of ULP distances (any shape), or an :class:`UlpDistance` (its ``nan``
            is then used unless ``nan`` is given).
        nan: optional bool tensor of ``distance``'s shape marking elements to count as ``"nonfinite"``
            whatever their distance. Without it, negative distances (the -1 of :func:`ulp_distance` at
            NaN) count as nonfinite.

    Returns:
        ``{bucket: count}`` with every bucket of :data:`HISTOGRAM_BUCKETS`, in that order; the counts sum
        to ``distance.numel()``.

    Raises:
        TypeError: ``distance`` is not an integer tensor or ``nan`` not a bool tensor.
        ValueError: ``nan``'s shape differs from ``distance``'s.
    """
    if isinstance(distance, UlpDistance):
        distance, nan = distance.distance, distance.nan if nan is None else nan
    _require_tensor(distance, "distance")
    if distance.dtype.is_floating_point or distance.dtype.is_complex or distance.dtype == torch.bool:
        raise TypeError(f"distance must be an integer tensor, but got {distance.dtype}")
    distance = distance.to(torch.int64)
    if nan is None:
        nonfinite = distance < 0
    else:
        _require_tensor(nan, "nan")
        if nan.dtype != torch.bool:
            raise TypeError(f"nan must be a bool tensor, but got {nan.dtype}")
        if nan.shape != distance.shape:
            raise ValueError(
                f"nan must have distance's shape {tuple(distance.shape)}, but got {tuple(nan.shape)}"
            )
        nonfinite = nan | (distance < 0)
    # one bincount of the distances clamped at 17 (0..16 by value, 17 for "> 16"), folded into the buckets
    counts = torch.bincount(distance[~nonfinite].clamp(max=17), minlength=18).tolist()
    return _buckets(counts + [int(nonfinite.sum())])


def grouped_histograms(distance: UlpDistance, groups: torch.Tensor, n_groups: int) -> list[dict[str, int]]:
    """:func:`ulp_histogram` of the elements of each group, in one pass: ``groups`` holds each element's group
    (integers ``0 .. n_groups - 1``, ``distance``'s shape); returns one histogram per group, in order.

    Raises:
        ValueError: ``groups``' shape differs from the distances'.
    """
    d, nan = distance.distance, distance.nan
    if groups.shape != d.shape:
        raise ValueError(f"groups must have the distances' shape {tuple(d.shape)}, but got {tuple(groups.shape)}")
    code = torch.where(nan | (d < 0), torch.full_like(d, 18), d.clamp(max=17))  # 18: nonfinite
    counts = torch.bincount((groups.to(torch.int64) * 19 + code).reshape(-1), minlength=n_groups * 19)
    return [_buckets(row) for row in counts.reshape(n_groups, 19).tolist()]


def grouped_ulp_histograms(a: torch.Tensor, b: torch.Tensor, codes: torch.Tensor, bases: torch.Tensor,
                           n_groups: int) -> list[dict[str, int]]:
    """:func:`grouped_histograms` of :func:`ulp_distance` ``(a, b)`` with groups given per unit: dimension 0 of ``a``,
    ``b`` and ``codes`` (one shape) holds ``len(bases)`` equal units, and an element of unit ``u`` with code ``c`` is
    in group ``bases[u] + c`` — a stack of records (``bases``: each unit's record's first group) and a code per
    element (its verdict). On the CPU one compiled pass over the bit patterns (``ulptrace._ulp_cpu.grouped``), without
    the int64 temporaries of the torch operations, which serve elsewhere (same counts, tested).

    Raises:
        TypeError: ``a`` and ``b`` differ in dtype, or it is unsupported; ``codes`` or ``bases`` is not an integer
            tensor.
        ValueError: the shapes differ, dimension 0 does not split into ``len(bases)`` units, or a group lies outside
            ``0 .. n_groups - 1``.
    """
    for name, t in (("a", a), ("b", b), ("codes", codes), ("bases", bases)):
        _require_tensor(t, name)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, but got {a.dtype} and {b.dtype}")
    fmt = format_of(a.dtype)
    for name, t in (("codes", codes), ("bases", bases)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, but got {t.dtype}")
    units = bases.numel()
    if not (a.shape == b.shape == codes.shape) or bases.dim() != 1 or not units or a.numel() % units or (
            a.dim() and a.shape[0] % units):
        raise ValueError(f"a, b and codes must share a shape whose dimension 0 splits into the {units} units of "
                         f"bases (1-D), but got {tuple(a.shape)}, {tuple(b.shape)}, {tuple(codes.shape)} and bases "
                         f"{tuple(bases.shape)}")
    if a.numel():  # the lowest and highest group, in one read of the device
        base_ends = torch.stack([bases.min(), bases.max()]).long().to(codes.device)
        low, high = (torch.stack([codes.min(), codes.max()]).long() + base_ends).tolist()
        if low < 0 or high >= n_groups:
            raise ValueError(f"groups must lie in 0 .. {n_groups - 1}, but reach {low if low < 0 else high}")
    if a.device.type == "cpu" and codes.dtype == torch.uint8 and a.element_size() in (1, 2, 4) and \
            _cpu_stats() is not None:
        counts = _ulp_cpu.grouped(_values_in_memory(a), _values_in_memory(b), codes, bases.cpu(), n_groups, fmt)
        if counts is not None:
            return [dict(zip(HISTOGRAM_BUCKETS, row, strict=True)) for row in counts]
    groups = (codes.reshape(units, -1).long() + bases.to(codes.device).long().unsqueeze(1)).reshape(codes.shape)
    return grouped_histograms(ulp_distance(a, b), groups, n_groups)


def merge_histograms(*histograms: dict[str, int]) -> dict[str, int]:
    """Add histograms bucket by bucket (an empty call gives all zeros).

    Raises:
        ValueError: a histogram's keys are not exactly :data:`HISTOGRAM_BUCKETS`.
    """
    merged = dict.fromkeys(HISTOGRAM_BUCKETS, 0)
    for histogram in histograms:
        if set(histogram) != set(HISTOGRAM_BUCKETS):
            raise ValueError(f"histogram buckets must be {HISTOGRAM_BUCKETS}, but got {tuple(histogram)}")
        for bucket in HISTOGRAM_BUCKETS:
            merged[bucket] += int(histogram[bucket])
    return merged


def format_histogram(histogram: dict[str, int]) -> str:
    """One-line rendering ``"0: 117 | 1: 1 | 2: 0 | 3-4: 2 | ... | nonfinite: 0"``.

    Raises:
        ValueError: the keys are not exactly :data:`HISTOGRAM_BUCKETS`.
    """
    if set(histogram) != set(HISTOGRAM_BUCKETS):
        raise ValueError(f"histogram buckets must be {HISTOGRAM_BUCKETS}, but got {tuple(histogram)}")
    return " | ".join(f"{bucket}: {histogram[bucket]}" for bucket in HISTOGRAM_BUCKETS)


# -- bit patterns and row magnitude --------------------------------------------------------------

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> bit patterns' dtype


def bits(t: torch.Tensor, *, canonical_nan: bool = False) -> torch.Tensor:
    """The bit patterns of a floating tensor as integers of its width (so NaN == NaN and -0 != +0);
    other dtypes are returned as they are.

    With ``canonical_nan`` every NaN maps to one pattern (-1), for comparisons across backends whose
    NaN payloads differ. This is the one place ulptrace reads bit patterns for equality:
    ``ulptrace.comparison.bitwise_equal`` (is a record bitwise equal?) and :func:`same_bits` (which
    elements are) build on it.
    """
    if not t.dtype.is_floating_point:
        return t
    out = _values_in_memory(t).view(_INT_OF_WIDTH[t.element_size()])
    if canonical_nan:
        out = torch.where(torch.isnan(t), torch.full_like(out, -1), out)
    return out


def _values_in_memory(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, its memory holding its values (:func:`_resolved`): what a compiled pass reads."""
    return _resolved(t).contiguous()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: does ``a`` hold exactly ``b``'s value? A bool tensor of the broadcast shape.

    For one dtype this compares bit patterns (:func:`bits`). Tensors of two float dtypes share no bit
    patterns, so there an element is the same when it has the same value and sign (any NaN matching
    any NaN) — a candidate that stores FP32 where the reference stores BF16 is ``exact`` exactly where
    it holds the reference's value.
    """
    if a.dtype == b.dtype:
        return bits(a) == bits(b)
    wide = _HOLDING_BOTH.get(frozenset((a.dtype, b.dtype)))
    if wide is not None:  # both exactly in one of them (or FP32): one value and sign there is one bit pattern
        x, y = a.to(wide), b.to(wide)
        return (bits(x) == bits(y)) | (torch.isnan(x) & torch.isnan(y))
    x, y = a.to(torch.float64), b.to(torch.float64)
    return ((x == y) & (torch.signbit(x) == torch.signbit(y))) | (torch.isnan(x) & torch.isnan(y))


# the narrowest float dtype holding every value of both of two others exactly (a cast there is exact, so equal bit
# patterns there are equal values and signs): for the cast-record pairs a comparison meets most (an FP32 candidate of
# a BF16 reference), fewer and narrower passes than float64's comparisons of values and signs
_HOLDING_BOTH = {frozenset((a, b)): torch.promote_types(a, b)
                 for a in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
                 for b in (torch.bfloat16, torch.float16, torch.float32, torch.float64) if a != b}


def parts_differ(a: torch.Tensor, b: torch.Tensor, n_parts: int) -> torch.Tensor:
    """Which of ``n_parts`` equal consecutive parts of ``a`` and ``b`` (one shape; dimension 0 split first, as
    ``reshape(n_parts, -1)`` splits it) hold an element that is not :func:`same_bits`: a bool tensor of ``n_parts``.
    For one dtype on the CPU one ``memcmp`` a part (``ulptrace._ulp_cpu.parts_differ``; which rows of a record the
    oracle judges), else the element-wise comparison reduced per part.

    Raises:
        ValueError: the shapes differ, or the elements do not split into ``n_parts`` parts.
    """
    if a.shape != b.shape or n_parts < 1 or a.numel() % n_parts:
        raise ValueError(f"a and b must share a shape whose elements split into {n_parts} parts, but got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype == b.dtype and a.device.type == b.device.type == "cpu" and _cpu_stats() is not None:
        return _ulp_cpu.parts_differ(_values_in_memory(bits(a)), _values_in_memory(bits(b)), n_parts)
    return ~same_bits(a, b).reshape(n_parts, -1).all(-1)


ROW_HISTOGRAM_BUCKETS: tuple[str, ...] = ("0", "<1", "1", "2", "3-4", "5-8", "9-16", ">16", "nonfinite")
"""Buckets of row-magnitude ULP distances (:func:`row_ulp_distance`): ``<1`` holds differences smaller
than one ULP of the row's largest element (a near-zero element that moved by many of its own ULPs)."""


class RowUlpDistance(NamedTuple):
    """Result of :func:`row_ulp_distance`: ``distance`` (float64, -1 where ``nonfinite``), ``nonfinite`` (bool)."""

    distance: torch.Tensor
    nonfinite: torch.Tensor


def row_ulp_distance(reference: torch.Tensor, candidate: torch.Tensor) -> RowUlpDistance:
    """``|candidate - reference|`` in ULPs of the row's magnitude, element-wise (float64).

    A row is the last dimension; its magnitude is the largest finite ``|reference|`` in it, and the
    unit is that value's ULP in the reference's dtype (:func:`spacing`). An element next to zero that
    moved by thousands of its own ULPs, because its inputs moved by one, is a small fraction of a
    row ULP here. ``nonfinite`` marks elements where one side is NaN/Inf and the two are not bitwise equal
    (their distance is -1).

    Raises:
        TypeError: ``reference``'s dtype is not in :data:`FORMATS`.
        ValueError: the shapes differ.
    """
    format_of(_require_tensor(reference, "reference").dtype)
    if reference.shape != candidate.shape:
        raise ValueError(f"candidate must have the reference's shape {tuple(reference.shape)}, "
                         f"but got {tuple(candidate.shape)}")
    ref = reference.reshape(1, 1) if reference.dim() == 0 else reference
    cand = candidate.reshape(ref.shape).to(reference.dtype)
    unit = spacing(_row_magnitude(ref))
    x, y = ref.to(torch.float64), cand.to(torch.float64)
    same = bits(ref) == bits(cand)
    nonfinite = ~same & ~(torch.isfinite(x) & torch.isfinite(y))
    distance = torch.where(same, torch.zeros_like(x), (x - y).abs() / unit)
    distance = torch.where(nonfinite, torch.full_like(distance, -1.0), distance)
    return RowUlpDistance(distance.reshape(reference.shape), nonfinite.reshape(reference.shape))


def _row_magnitude(ref: torch.Tensor) -> torch.Tensor:
    """The largest finite ``|ref|`` of each row (last dimension, kept), in ``ref``'s dtype (0 where none);
    computed in float32 for the 8-bit formats, which torch's CPU reductions do not cover (exact)."""
    wide = ref.to(torch.float32) if ref.element_size() == 1 else ref
    magnitude = torch.where(torch.isfinite(wide), wide.abs(), torch.zeros_like(wide)).amax(-1, keepdim=True)
    return magnitude.to(ref.dtype)


def row_histogram(distance: RowUlpDistance) -> dict[str, int]:
    """Count row-magnitude ULP distances into :data:`ROW_HISTOGRAM_BUCKETS` (a fraction above 1
    counts in the bucket of the next integer: 1.5 is in ``2``)."""
    d, nonfinite = distance.distance, distance.nonfinite
    finite = d[~nonfinite]
    below = int(((finite > 0) & (finite < 1)).sum())
    # clamped before the integer conversion: a float32 row of zeros has a unit of 2**-149, and a distance past
    # 2**63 would wrap to a negative integer (and drop out of every bucket)
    whole = ulp_histogram(torch.where(finite < 1, torch.zeros_like(finite), finite.ceil()).clamp(max=17).to(torch.int64))
    counts = {"0": int((finite == 0).sum()), "<1": below}
    counts.update({b: whole[b] for b in HISTOGRAM_BUCKETS[1:-1]})
    counts["nonfinite"] = int(nonfinite.sum())
    return {b: counts[b] for b in ROW_HISTOGRAM_BUCKETS}


_CPU_CHUNK = 1 << 16  # elements per chunk of ulp_stats on the CPU (fits the L2 cache with its temporaries)
_GPU_CHUNK = 1 << 26  # elements per block of the torch row statistics on a GPU (Triton's kernel needs none)


class UlpStats(NamedTuple):
    """Result of :func:`ulp_stats`: what ``ulp_distance`` + ``ulp_histogram`` say about two tensors."""

    differing: int  # elements that are not at distance 0 (NaN on either side counts as differing)
    max_ulp: int  # largest finite distance (0 when none)
    histogram: dict[str, int]  # every bucket of HISTOGRAM_BUCKETS


def ulp_stats(a: torch.Tensor, b: torch.Tensor) -> UlpStats:
    """The ULP statistics of two same-shape tensors of one dtype, on their device, in one read of both: the
    compiled CPU pass or the fused CUDA kernel (Triton) where available; elsewhere one bit-pattern comparison (and
    a NaN count) when they are bitwise equal, the distances of the *differing* elements otherwise. Equal to
    ``ulp_histogram(ulp_distance(a, b))`` with ``differing = numel - histogram["0"]`` and ``max_ulp`` the largest
    finite distance (tested).

    Raises:
        TypeError: the dtypes differ or are not in :data:`FORMATS`.
        ValueError: the shapes differ.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, but got {a.dtype} and {b.dtype}")
    format_of(a.dtype)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, but got {tuple(a.shape)} and {tuple(b.shape)}")
    ba, bb = bits(a), bits(b)
    # a one-pass kernel (the compiled CPU pass, the fused CUDA one) reads equal tensors once and counts their NaNs as
    # _equal_stats does, so it needs no equality pass first
    fused = a.numel() and (_cpu_stats() if a.device.type == "cpu" else _triton_stats() if a.is_cuda else None)
    if not fused and torch.equal(ba, bb):
        return _equal_stats(a)
    return _differing_stats(a, ba, bb)


def _equal_stats(a: torch.Tensor) -> UlpStats:
    """``ulp_stats`` of a tensor against a bitwise copy: distance 0, NaNs counted as differing."""
    n = a.numel()
    nan = int(torch.isnan(a).sum()) if a.dtype.is_floating_point else 0
    return UlpStats(nan, 0, {k: (n - nan if k == "0" else nan if k == "nonfinite" else 0) for k in HISTOGRAM_BUCKETS})


def _differing_stats(a: torch.Tensor, ba: torch.Tensor, bb: torch.Tensor) -> UlpStats:
    """``ulp_stats`` of two tensors known to differ somewhere, from their bit patterns ``ba``, ``bb``."""
    n = a.numel()
    fmt = format_of(a.dtype)
    limit = fmt.nan_above
    compiled = _cpu_stats() if a.device.type == "cpu" else None
    if compiled is not None:  # one compiled pass (ulptrace._ulp_cpu)
        c = compiled(ba, bb, fmt, rows=False)
        return UlpStats(n - c[0], c[20], _buckets(c[0:19]))
    if a.is_cuda and _triton_stats() is not None:
        counts, top = _triton_stats()(ba, bb, fmt)  # one fused pass: the buckets' counts
        return UlpStats(n - counts[0], top, dict(zip(HISTOGRAM_BUCKETS, counts)))
    # ordered keys in the narrowest integer that holds a distance (int32 up to 16-bit formats); on the CPU in
    # cache-sized chunks, so the few elementwise passes run from cache rather than from memory
    wide = torch.int64 if fmt.bits > 16 else torch.int32
    counts = torch.zeros(19, dtype=torch.int64, device=a.device)
    max_ulp = torch.zeros((), dtype=wide, device=a.device)
    flat_a, flat_b = ba.reshape(-1), bb.reshape(-1)
    step = _GPU_CHUNK if a.is_cuda else _CPU_CHUNK
    for start in range(0, n, step):
        xa, xb = flat_a[start:start + step].to(wide), flat_b[start:start + step].to(wide)
        ma, mb = xa & fmt.magnitude_mask, xb & fmt.magnitude_mask
        nan = (ma > limit) | (mb > limit)
        distance = (torch.where(xa < 0, -ma, ma) - torch.where(xb < 0, -mb, mb)).abs()
        # one bincount: distances 0..16 by value, 17 for "> 16", 18 for nonfinite
        counts += torch.bincount(distance.clamp(max=17).masked_fill(nan, 18).to(torch.int64), minlength=19)
        max_ulp = torch.maximum(max_ulp, distance.masked_fill(nan, 0).max())
    c = counts.tolist()
    return UlpStats(n - c[0], int(max_ulp), _buckets(c))


def _buckets(c: list[int]) -> dict[str, int]:
    """Counts of codes 0..16 (distance), 17 (> 16), 18 (nonfinite) -> :data:`HISTOGRAM_BUCKETS`: a bucket's codes
    summed, so a count given by value (the CUDA kernel, the torch path) and a bucket's count at its first code (the
    compiled CPU pass, ``_ulp_cpu.c``) read alike."""
    return {"0": c[0], "1": c[1], "2": c[2], "3-4": c[3] + c[4], "5-8": sum(c[5:9]), "9-16": sum(c[9:17]),
            ">16": c[17], "nonfinite": c[18]}


def _cpu_stats() -> Any:
    """The compiled one-pass CPU statistics (``ulptrace._ulp_cpu.stats``), or None where they cannot be built
    (no C compiler: the torch path serves, with the same results)."""
    return _ulp_cpu.stats if _ulp_cpu.library() is not None else None


@functools.cache
def _triton_stats() -> Any:
    """The fused CUDA statistics (``ulptrace._ulp_triton.stats``), or None where Triton is not installed (looked
    up once: every record pair on a GPU asks)."""
    from ulptrace import _ulp_triton

    return _ulp_triton.stats if _ulp_triton.AVAILABLE else None


# -- a record's statistics: per element and per row, deferred on CUDA ----------------------------

class RecordStats(NamedTuple):
    """Everything a comparison says about two same-shape tensors of one dtype (see :func:`record_stats`)."""

    equal: bool  # bitwise equal (NaN payloads and signed zeros count)
    differing: int  # as UlpStats
    max_ulp: int | None  # None: no ULPs for this dtype (integer / bool records in a comparison)
    histogram: dict[str, int]
    max_row_ulp: float | None  # largest finite row_ulp_distance (0.0 when none; None: not computed)
    row_histogram: dict[str, int]  # row_histogram(row_ulp_distance(a, b)) ({} when not computed)


def merge_record_stats(parts: Sequence[RecordStats]) -> RecordStats:
    """The :class:`RecordStats` of a tensor pair from those of its parts, split between whole rows (a large record
    compared in chunks): counts and histograms add, maxima are the largest part's, equal when every part is. Equal
    to the statistics of the whole (tested), as rows never span parts.

    Raises:
        ValueError: no parts, or parts with and without row statistics.
    """
    if not parts:
        raise ValueError("merge_record_stats needs at least one part")
    rows = {p.max_row_ulp is None for p in parts}
    if len(rows) > 1:
        raise ValueError("parts must all have row statistics or none")
    if len(parts) == 1:
        return parts[0]
    maxima = [p.max_ulp for p in parts if p.max_ulp is not None]
    no_rows = rows == {True}
    return RecordStats(
        all(p.equal for p in parts), sum(p.differing for p in parts), max(maxima) if maxima else None,
        merge_histograms(*(p.histogram for p in parts)),
        None if no_rows else max(p.max_row_ulp for p in parts),
        {} if no_rows else {b: sum(p.row_histogram[b] for p in parts) for b in ROW_HISTOGRAM_BUCKETS},
    )


class PendingStats:
    """A :class:`RecordStats` being computed on the device (row ``index`` of the int64 result slab of the
    :class:`StatsBatch` launch ``launch`` — not launched yet while its ``slab`` is None) or already known
    (``value``): read it with :func:`resolve_stats`, which waits once for any number of them."""

    __slots__ = ("index", "launch", "numel", "rows", "value")

    def __init__(self, value: RecordStats | None = None, launch: _Launch | None = None, numel: int = 0,
                 index: int = 0, rows: bool = True) -> None:
        self.value, self.launch, self.numel, self.index = value, launch, numel, index
        self.rows = rows  # the row-magnitude statistics are wanted (decoded from the slab)


class _Launch:
    """One launch of a :class:`StatsBatch` being gathered: per float format and tile width, the kernel's table of
    its pairs, built as they arrive (``ulptrace._ulp_triton.Table``: the pairs kept alive until the device has read
    them); ``slab``, the zeroed int64 results of every pair (a row each), once launched."""

    __slots__ = ("batch", "count", "groups", "slab")

    def __init__(self, batch: StatsBatch) -> None:
        self.batch, self.groups, self.slab, self.count = batch, {}, None, 0


class StatsBatch:
    """Record pairs on one CUDA device whose statistics are launched together (Triton, ``ulptrace._ulp_triton``):
    one launch per float format and tile width instead of one per record, and one zeroed result slab for all.

    :func:`pending_stats` with ``batch=`` puts a pair here (nothing runs yet; the batch holds both tensors, so they
    must not be written to in place until it is launched — a recorder's records are copies). The batch launches
    when it holds ``max_records`` pairs (at most ``_ulp_triton.MAX_RECORDS``) or ``max_bytes`` of them (what it keeps
    alive is bounded), when a pair of another device arrives, and when :func:`resolve_stats` needs any of its
    results; ``launch()`` does it on demand. Each launch's table is built as its pairs arrive (a pair costs one short
    step here, none at the launch: a traced step queues hundreds). What it launched is held until the device has read
    it, at most ``max_reading_bytes`` of it (``ulptrace.reading.UntilRead``: past that the oldest launch is waited for).
    """

    def __init__(self, max_records: int = 512, max_bytes: int = 256 << 20, max_reading_bytes: int = 512 << 20) -> None:
        from ulptrace import _ulp_triton

        if not 0 < max_records <= _ulp_triton.MAX_RECORDS:
            raise ValueError(f"max_records must be 1 to {_ulp_triton.MAX_RECORDS} (a launch's table), "
                             f"but got {max_records}")
        self.max_records, self.max_bytes = max_records, max_bytes
        self._triton = _ulp_triton
        self._next = _Launch(self)
        self._device: torch.device | None = None
        self._bytes = 0
        # launched pairs, held until the device has read them (an event each launch): memory another process shares
        # through CUDA IPC (onset --concurrent's reference) goes back to it when the last tensor here is dropped — a
        # count on the host, not this stream's order — and it may write there at once. At most max_reading_bytes:
        # a long prefill's launches run far behind the host (ulptrace.reading)
        self._reading = UntilRead(max_reading_bytes, drop=_read)

    def __len__(self) -> int:
        return self._next.count

    def add(self, a: torch.Tensor, b: torch.Tensor, fmt: FloatFormat, rows: bool = True) -> PendingStats:
        """Queue the statistics of two same-shape contiguous tensors of ``fmt`` (its values or their bit patterns:
        the kernel reads the memory as ``fmt``'s bit patterns) on one CUDA device
        (``rows=False``: the row-magnitude statistics are left out of the result, as :func:`pending_stats`)."""
        if a.device != self._device:
            self.launch()
            self._device = a.device
        n_cols = a.shape[-1] if a.dim() else 1
        width = self._triton.tile_columns(n_cols)
        launch = self._next
        table = launch.groups.get((fmt, width))
        if table is None:
            table = launch.groups[(fmt, width)] = self._triton.Table(width)
        slot = launch.count
        launch.count = slot + 1
        table.add(a, b, slot, n_cols)
        self._bytes += 2 * a.nbytes
        if launch.count >= self.max_records or self._bytes >= self.max_bytes:
            self.launch()
        return PendingStats(numel=a.numel(), launch=launch, index=slot, rows=rows)

    def launch(self) -> None:
        """Enqueue every queued pair's statistics (no host synchronisation) and empty the batch."""
        launch = self._next
        if not launch.count:
            return
        nbytes, self._next, self._bytes = self._bytes, _Launch(self), 0
        slab = torch.zeros(launch.count, self._triton.RECORD_SLOTS, dtype=torch.int64, device=self._device)
        for (fmt, _), table in launch.groups.items():
            self._triton.launch_records(table.pairs, fmt, slab, table=table)
        launch.slab = slab
        if slab.is_cuda:  # (the Triton interpreter reads host memory at once)
            self._reading.add(launch, nbytes, slab.device)
        else:
            _read(launch)


def _read(launch: _Launch) -> None:
    """A launch the device has read: its pairs go (its results stay in its slab)."""
    launch.groups = None


# boundaries of the row codes: 0 "0", 1 "<1", 2 "1", 3 "2", 4 "3-4", 5 "5-8", 6 "9-16", 7 ">16" (torch.bucketize:
# index i where bounds[i-1] < d <= bounds[i]); code 8 is nonfinite
_ROW_BOUNDS = (0.0, math.nextafter(1.0, 0.0), 1.0, 2.0, 4.0, 8.0, 16.0)


def record_stats(a: torch.Tensor, b: torch.Tensor) -> RecordStats:
    """Bitwise equality, :func:`ulp_stats` and the row-magnitude statistics (:func:`row_ulp_distance`,
    :func:`row_histogram` and the largest finite row distance) of two same-shape tensors of one dtype in
    :data:`FORMATS`, equal to those functions' results (tested). On CUDA with Triton one fused kernel reads
    both tensors (``ulptrace._ulp_triton``); see :func:`pending_stats` to collect many without waiting.

    Raises:
        TypeError: the dtypes differ or are not in :data:`FORMATS`.
        ValueError: the shapes differ.
    """
    return resolve_stats([pending_stats(a, b)])[0]


def pending_stats(a: torch.Tensor, b: torch.Tensor, *, rows: bool = True,
                  batch: StatsBatch | None = None) -> PendingStats:
    """Start :func:`record_stats` of ``a`` and ``b``: on CUDA (Triton) the kernel is enqueued and nothing waits
    for it — with ``batch`` (a :class:`StatsBatch`), queued there and launched with other pairs; elsewhere the
    statistics are computed now. ``rows=False``: the row-magnitude statistics are not needed (``max_row_ulp``
    None, ``row_histogram`` empty). Errors as :func:`record_stats`."""
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, but got {a.dtype} and {b.dtype}")
    fmt = format_of(a.dtype)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, but got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = _values_in_memory(a), _values_in_memory(b)  # the compiled passes read memory as bit patterns
    n = a.numel()
    if a.is_cuda and b.device == a.device and n > 0 \
            and _triton_stats() is not None:
        # the kernel reads bit patterns through typed pointers: a contiguous tensor serves as it is (no view made)
        pair = (a, b, fmt, rows)
        if batch is not None:
            return batch.add(*pair)
        single = StatsBatch()
        pending = single.add(*pair)
        single.launch()
        return pending
    compiled = _cpu_stats() if a.device.type == "cpu" and n > 0 else None
    if compiled is not None:  # one compiled pass (ulptrace._ulp_cpu): it reads the memory as bit patterns itself
        return PendingStats(_from_slots(compiled(a, b, fmt, rows=rows), n, rows))
    ba, bb = bits(a), bits(b)
    if torch.equal(ba, bb):
        row_hist = dict.fromkeys(ROW_HISTOGRAM_BUCKETS, 0)
        row_hist["0"] = n
        return PendingStats(RecordStats(True, *_equal_stats(a), 0.0, row_hist))
    if not rows:
        return PendingStats(RecordStats(False, *_differing_stats(a, ba, bb), None, {}))
    max_row, row_hist = _row_stats_torch(a, b, ba, bb)
    return PendingStats(RecordStats(False, *_differing_stats(a, ba, bb), max_row, row_hist))


def resolve_stats(pending: list[PendingStats]) -> list[RecordStats]:
    """The results of :func:`pending_stats` calls, in order: batches not launched yet are launched, and every
    device result slab is read in one copy. Each result is decoded once and kept (a pending statistic shared by
    several records, e.g. an input that is another record's output, is listed once per record)."""
    firsts: dict[int, int] = {}  # id(launch) -> its slab's first row in the copy
    parts = []
    rows = 0
    for p in pending:
        launch = p.launch
        if p.value is None and id(launch) not in firsts:
            if launch.slab is None:
                launch.batch.launch()
            firsts[id(launch)] = rows
            parts.append(launch.slab)
            rows += launch.count
    if parts:
        host = torch.cat(parts).tolist()
        for p in pending:
            if p.value is None:
                p.value = _from_slots(host[firsts[id(p.launch)] + p.index], p.numel, p.rows)
                p.launch = None
    return [p.value for p in pending]


_DOUBLE, _INT64 = struct.Struct("<d"), struct.Struct("<q")


def _from_slots(c: list[int], numel: int, rows: bool) -> RecordStats:
    """A ``RecordStats`` from the 32 slots of ``ulptrace._ulp_triton.RECORD_LAYOUT`` (CUDA kernel or compiled CPU
    pass); ``rows=False``: the row slots were not computed."""
    codes = c[0:19]
    if not rows:
        return RecordStats(c[19] == 0, numel - codes[0], c[20], _buckets(codes), None, {})
    return RecordStats(c[19] == 0, numel - codes[0], c[20], _buckets(codes), _DOUBLE.unpack(_INT64.pack(c[30]))[0],
                       dict(zip(ROW_HISTOGRAM_BUCKETS, c[21:30])))


def _row_stats_torch(a: torch.Tensor, b: torch.Tensor, ba: torch.Tensor, bb: torch.Tensor
                     ) -> tuple[float, dict[str, int]]:
    """(largest finite row distance, row histogram) of two tensors that differ, in cache-sized blocks of rows."""
    n_cols = a.shape[-1] if a.dim() else 1
    a2, b2 = a.reshape(-1, n_cols), b.reshape(-1, n_cols)
    ba2, bb2 = ba.reshape(-1, n_cols), bb.reshape(-1, n_cols)
    bounds = torch.tensor(_ROW_BOUNDS, dtype=torch.float64, device=a.device)
    counts = torch.zeros(9, dtype=torch.int64, device=a.device)
    top = torch.zeros((), dtype=torch.float64, device=a.device)
    # blocks of rows: cache-sized on the CPU, bounded on a GPU (a long prompt's logits record has billions of
    # elements; its float64 temporaries at once would not fit)
    block = max(1, (_CPU_CHUNK if not a.is_cuda else _GPU_CHUNK) // max(n_cols, 1))
    for start in range(0, a2.shape[0], block):
        ref, cand = a2[start:start + block], b2[start:start + block]
        magnitude = _row_magnitude(ref)
        x, y = ref.to(torch.float64), cand.to(torch.float64)
        same = ba2[start:start + block] == bb2[start:start + block]
        nonfinite = ~same & ~(torch.isfinite(x) & torch.isfinite(y))
        d = torch.where(same, torch.zeros_like(x), (x - y).abs() / spacing(magnitude))
        code = torch.bucketize(d, bounds).masked_fill(nonfinite, 8)
        counts += torch.bincount(code.reshape(-1), minlength=9)
        top = torch.maximum(top, d.masked_fill(nonfinite, 0.0).max())
    return float(top), dict(zip(ROW_HISTOGRAM_BUCKETS, counts.tolist()))
