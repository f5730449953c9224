"""ulptrace.ulp against independent ground truth.

Ground truth never comes from ulptrace itself: ml_dtypes / numpy decode the bit patterns and provide
``nextafter`` and float32 -> narrow casts; numpy's float64 -> float16 cast (a single rounding); Python's
``fractions.Fraction`` with ``round`` (ties to even) for exact rounding from float64; hex-float constants
for the table. Single-argument properties run over every bit pattern of the 8- and 16-bit formats.
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ulptrace.ulp import (
    FORMATS,
    HISTOGRAM_BUCKETS,
    UlpDistance,
    format_histogram,
    format_of,
    from_ordering_key,
    merge_histograms,
    next_down,
    next_up,
    ordering_key,
    round_to,
    spacing,
    torch_saturates,
    ulp_distance,
    ulp_histogram,
)

# decoding NaN patterns and overflowing casts are the point of several tests
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

# torch dtype -> (numpy dtype that ml_dtypes/numpy decode it with, unsigned and signed integer views)
NUMPY = {
    torch.float32: (np.dtype(np.float32), np.uint32, np.int32),
    torch.bfloat16: (np.dtype(ml_dtypes.bfloat16), np.uint16, np.int16),
    torch.float16: (np.dtype(np.float16), np.uint16, np.int16),
    torch.float8_e4m3fn: (np.dtype(ml_dtypes.float8_e4m3fn), np.uint8, np.int8),
    torch.float8_e5m2: (np.dtype(ml_dtypes.float8_e5m2), np.uint8, np.int8),
}
TORCH_INT = {np.int32: torch.int32, np.int16: torch.int16, np.int8: torch.int8}
SMALL = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
ALL = [torch.float32, *SMALL]


def ids(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """Decode a torch tensor through its bits with numpy/ml_dtypes (no torch float conversion)."""
    np_dtype, _unsigned, signed = NUMPY[x.dtype]
    return x.contiguous().view(TORCH_INT[signed]).numpy().view(np_dtype)


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Encode a numpy/ml_dtypes array (already of ``dtype``'s numpy type) as a torch tensor, by bits."""
    np_dtype, _unsigned, signed = NUMPY[dtype]
    return torch.from_numpy(np.ascontiguousarray(a.astype(np_dtype)).view(signed)).view(dtype)


def bits_of(x: torch.Tensor) -> np.ndarray:
    """Unsigned bit patterns as int64."""
    return to_numpy(x).view(NUMPY[x.dtype][1]).astype(np.int64)


def all_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit dtype, in pattern order."""
    _, unsigned, signed = NUMPY[dtype]
    n = np.dtype(unsigned).itemsize * 8
    return torch.from_numpy(np.arange(2**n, dtype=np.int64).astype(unsigned).view(signed)).view(dtype)


def from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    _, unsigned, signed = NUMPY[dtype]
    return torch.from_numpy(np.array(bits, dtype=np.int64).astype(unsigned).view(signed)).view(dtype)


def table(dtype: torch.dtype) -> np.ndarray:
    """Sorted distinct non-NaN values of an 8/16-bit dtype as float64 (+-0 merged), decoded by ml_dtypes."""
    with np.errstate(invalid="ignore"):
        values = to_numpy(all_patterns(dtype)).astype(np.float64)
    return np.unique(values[~np.isnan(values)])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, except that any two NaNs count as equal."""
    na, nb = np.isnan(to_numpy(a).astype(np.float64)), np.isnan(to_numpy(b).astype(np.float64))
    return bool(np.array_equal(na, nb) and np.array_equal(bits_of(a)[~na], bits_of(b)[~nb]))


# --- the format table -----------------------------------------------------------------------------

HEX_CONSTANTS = {  # dtype: (max finite, min subnormal, min normal)
    torch.float32: ("0x1.fffffep127", "0x1p-149", "0x1p-126"),
    torch.bfloat16: ("0x1.fep127", "0x1p-133", "0x1p-126"),
    torch.float16: ("0x1.ffcp15", "0x1p-24", "0x1p-14"),
    torch.float8_e4m3fn: ("0x1.cp8", "0x1p-9", "0x1p-6"),
    torch.float8_e5m2: ("0x1.cp15", "0x1p-16", "0x1p-14"),
}


@pytest.mark.parametrize("dtype", ALL, ids=ids)
def test_format_constants_match_hex_floats_and_finfo(dtype: torch.dtype) -> None:
    fmt = FORMATS[dtype]
    max_finite, min_sub, min_normal = (float.fromhex(h) for h in HEX_CONSTANTS[dtype])
    assert (fmt.max_finite, fmt.min_subnormal, fmt.min_normal) == (max_finite, min_sub, min_normal)
    info = ml_dtypes.finfo(NUMPY[dtype][0])
    assert fmt.bits == info.bits
    assert fmt.mantissa_bits == info.nmant and fmt.exponent_bits == info.nexp
    assert float(info.max) == fmt.max_finite and float(info.smallest_subnormal) == fmt.min_subnormal
    assert fmt.has_inf == bool(np.isinf(np.array([np.inf]).astype(NUMPY[dtype][0]))[0])
    assert torch.finfo(dtype).max == fmt.max_finite and fmt.dtype is dtype
    assert fmt.emax == math.frexp(max_finite)[1] - 1


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_format_bit_constants_decode_to_what_they_name(dtype: torch.dtype) -> None:
    fmt = FORMATS[dtype]

    def decode(bits: int) -> float:
        return float(to_numpy(from_bits([bits], dtype))[0])

    assert decode(fmt.max_finite_bits) == fmt.max_finite
    assert math.isnan(decode(fmt.nan_bits))
    if fmt.has_inf:
        assert decode(fmt.inf_bits) == math.inf
    else:
        assert fmt.inf_bits is None
    assert decode(fmt.sign_bit) == 0.0 and math.copysign(1.0, decode(fmt.sign_bit)) == -1.0


def test_unsupported_dtype_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"supports float32, bfloat16.*but got torch.float64"):
        format_of(torch.float64)
    with pytest.raises(TypeError, match="int32"):
        spacing(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="list"):
        next_up([1.0])  # type: ignore[arg-type]


# --- single-argument properties over every bit pattern ----------------------------------------------


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_next_up_next_down_match_the_sorted_table_exhaustively(dtype: torch.dtype) -> None:
    x = all_patterns(dtype)
    values = to_numpy(x).astype(np.float64)
    tbl = table(dtype)
    finite_nan = np.isnan(values)
    up, down = to_numpy(next_up(x)).astype(np.float64), to_numpy(next_down(x)).astype(np.float64)
    # independent: the next larger / smaller entry of the sorted table; none beyond the ends
    i_up = np.searchsorted(tbl, values, side="right")
    i_down = np.searchsorted(tbl, values, side="left") - 1
    expect_up = np.where(i_up < len(tbl), tbl[np.minimum(i_up, len(tbl) - 1)], np.nan)
    expect_down = np.where(i_down >= 0, tbl[np.maximum(i_down, 0)], np.nan)
    top = values == tbl[-1]  # +inf keeps +inf, e4m3fn's +max has no successor (NaN)
    expect_up = np.where(top & np.isinf(values), values, expect_up)
    expect_down = np.where((values == tbl[0]) & np.isinf(values), values, expect_down)
    np.testing.assert_array_equal(up[~finite_nan], expect_up[~finite_nan])
    np.testing.assert_array_equal(down[~finite_nan], expect_down[~finite_nan])
    assert np.isnan(up[finite_nan]).all() and np.isnan(down[finite_nan]).all()
    if not FORMATS[dtype].has_inf:
        assert math.isnan(next_up(torch.tensor([448.0]).to(dtype)).float().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2], ids=ids)
def test_next_up_next_down_match_numpy_nextafter_including_zero_signs(dtype: torch.dtype) -> None:
    x = all_patterns(dtype)
    a = to_numpy(x)
    inf = np.full_like(a, np.inf)
    for ours, toward in ((next_up(x), inf), (next_down(x), -inf)):
        expect = np.nextafter(a, toward)
        nan = np.isnan(expect.astype(np.float64))
        assert np.array_equal(nan, np.isnan(to_numpy(ours).astype(np.float64)))
        # bitwise, so -0 (nextafter(-min_subnormal, +inf)) is checked too
        np.testing.assert_array_equal(
            bits_of(ours)[~nan], expect.view(NUMPY[dtype][1]).astype(np.int64)[~nan]
        )


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_spacing_is_the_nextafter_gap_away_from_zero_in_every_binade(dtype: torch.dtype) -> None:
    fmt = FORMATS[dtype]
    x = all_patterns(dtype)
    v = to_numpy(x).astype(np.float64)
    s = spacing(x)
    assert s.dtype == torch.float64
    s = s.numpy()
    tbl = table(dtype)
    finite = np.isfinite(v) & (np.abs(v) < fmt.max_finite)
    # gap to the next table entry away from zero (zeros: toward +inf), computed from the table alone
    away = np.where(
        np.signbit(v), np.searchsorted(tbl, v, side="left") - 1, np.searchsorted(tbl, v, side="right")
    )
    gap = np.abs(tbl[np.clip(away, 0, len(tbl) - 1)] - v)
    np.testing.assert_array_equal(s[finite], gap[finite])
    # at +-max finite: the binade's spacing, equal to the gap below max
    at_max = np.abs(v) == fmt.max_finite
    below = tbl[np.searchsorted(tbl, fmt.max_finite) - 1]
    np.testing.assert_array_equal(s[at_max], fmt.max_finite - below)
    # frexp-based: 2**(exponent - mantissa_bits) for normals, min_subnormal below the normal range
    nonzero = finite & (v != 0)
    expo = np.frexp(np.abs(v[nonzero]))[1] - 1
    np.testing.assert_array_equal(s[nonzero], np.ldexp(1.0, np.maximum(expo, fmt.emin) - fmt.mantissa_bits))
    assert (s[v == 0] == fmt.min_subnormal).all()
    assert np.isposinf(s[np.isinf(v)]).all() and np.isnan(s[np.isnan(v)]).all()


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_neighbours_are_one_ulp_apart_and_distance_is_symmetric(dtype: torch.dtype) -> None:
    x = all_patterns(dtype)
    v = to_numpy(x).astype(np.float64)
    up = next_up(x)
    d = ulp_distance(x, up)
    steps = ~np.isnan(to_numpy(up).astype(np.float64)) & ~np.isnan(v) & ~np.isposinf(v)
    assert (d.distance.numpy()[steps] == 1).all()
    assert (d.distance.numpy()[np.isnan(v)] == -1).all() and d.nan.numpy()[np.isnan(v)].all()
    partner = x[torch.randperm(x.numel())]
    forward, backward = ulp_distance(x, partner), ulp_distance(partner, x)
    assert torch.equal(forward.distance, backward.distance) and torch.equal(forward.nan, backward.nan)


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_distance_counts_the_values_between_exhaustively(dtype: torch.dtype) -> None:
    x = all_patterns(dtype)
    tbl = table(dtype)
    for _ in range(3):
        partner = x[torch.randperm(x.numel())]
        va, vb = to_numpy(x).astype(np.float64), to_numpy(partner).astype(np.float64)
        nan = np.isnan(va) | np.isnan(vb)
        rank_a = np.searchsorted(tbl, np.where(nan, 0, va))
        rank_b = np.searchsorted(tbl, np.where(nan, 0, vb))
        d = ulp_distance(x, partner)
        np.testing.assert_array_equal(d.nan.numpy(), nan)
        np.testing.assert_array_equal(d.distance.numpy(), np.where(nan, -1, np.abs(rank_a - rank_b)))


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_ordering_key_is_monotone_and_inverts(dtype: torch.dtype) -> None:
    x = all_patterns(dtype)
    v = to_numpy(x).astype(np.float64)
    ok = ~np.isnan(v)
    key = ordering_key(x).numpy()[ok]
    order = np.argsort(v[ok], kind="stable")
    assert (np.diff(key[order]) >= 0).all()
    assert np.array_equal(np.diff(key[order]) == 0, np.diff(v[ok][order]) == 0)
    back = from_ordering_key(torch.from_numpy(key), dtype)
    np.testing.assert_array_equal(to_numpy(back).astype(np.float64), v[ok])
    assert not torch.signbit(from_ordering_key(torch.tensor([0]), dtype).float()).any()
    with pytest.raises(ValueError, match="ordering keys"):
        from_ordering_key(torch.tensor([int(key.max()) + 1]), dtype)
    with pytest.raises(TypeError, match="integer"):
        from_ordering_key(torch.tensor([1.0]), dtype)


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_round_to_round_trips_every_pattern(dtype: torch.dtype) -> None:
    x = all_patterns(dtype)
    as64 = torch.from_numpy(to_numpy(x).astype(np.float64))
    out = round_to(as64, dtype)
    assert same(out, x)  # bitwise for every non-NaN pattern, -0 included
    assert same(round_to(x, dtype), out)  # directly from the format itself
    # NaN payloads are not kept, the sign is
    sign = FORMATS[dtype].sign_bit
    nan = np.isnan(as64.numpy())
    np.testing.assert_array_equal(bits_of(out)[nan] >= sign, bits_of(x)[nan] >= sign)


# --- special values and errors ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL, ids=ids)
def test_edges_by_hex_float(dtype: torch.dtype) -> None:
    fmt = FORMATS[dtype]
    max_finite, min_sub, _ = (float.fromhex(h) for h in HEX_CONSTANTS[dtype])
    t = lambda *vals: torch.tensor(vals, dtype=torch.float64).to(dtype)
    assert ulp_distance(t(0.0), t(-0.0)).distance.item() == 0
    assert ulp_distance(t(-min_sub), t(min_sub)).distance.item() == 2
    assert ulp_distance(t(0.0), t(min_sub)).distance.item() == 1
    assert next_up(t(-0.0)).double().item() == min_sub
    assert torch.signbit(next_up(t(-min_sub)).double()).item() and next_up(t(-min_sub)).double().item() == 0.0
    assert next_down(t(0.0)).double().item() == -min_sub
    assert spacing(t(0.0)).item() == min_sub and spacing(t(-min_sub)).item() == min_sub
    if fmt.has_inf:
        inf = t(math.inf)
        assert ulp_distance(t(max_finite), inf).distance.item() == 1
        inf_bits = ((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits  # all-ones exponent, by hand
        assert ulp_distance(t(-math.inf), inf).distance.item() == 2 * inf_bits
        assert next_up(inf).double().item() == math.inf and next_down(inf).double().item() == max_finite
        assert next_up(t(max_finite)).double().item() == math.inf
        assert next_up(t(-math.inf)).double().item() == -max_finite
        assert spacing(inf).item() == math.inf
    else:
        assert math.isnan(next_up(t(max_finite)).double().item())
        assert math.isnan(next_down(t(-max_finite)).double().item())
    assert spacing(t(max_finite)).item() == max_finite - next_down(t(max_finite)).double().item()


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_every_nan_pattern_is_flagged(dtype: torch.dtype) -> None:
    x = all_patterns(dtype)
    nan = np.isnan(to_numpy(x).astype(np.float64))
    one = torch.ones_like(x)
    for d in (ulp_distance(x, one), ulp_distance(one, x)):
        np.testing.assert_array_equal(d.nan.numpy(), nan)
        assert (d.distance.numpy()[nan] == -1).all() and (d.distance.numpy()[~nan] >= 0).all()
    assert np.isnan(spacing(x).numpy()[nan]).all()
    expected_nans = {
        torch.bfloat16: 2 * 127,
        torch.float16: 2 * 1023,
        torch.float8_e4m3fn: 2,
        torch.float8_e5m2: 6,
    }
    assert int(nan.sum()) == expected_nans[dtype]


def test_ulp_distance_broadcasts_and_rejects_bad_input() -> None:
    a = torch.tensor([[1.0], [2.0], [-1.0]], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 1.0078125, 0.99609375, -2.0], dtype=torch.bfloat16)  # 1, 1+2^-7, 1-2^-8
    d = ulp_distance(a, b)
    assert d.distance.shape == (3, 4) and d.distance.dtype == torch.int64 and d.nan.dtype == torch.bool
    assert d.distance[0].tolist() == [0, 1, 1, 0x3F80 + 0x4000]  # 1.0 is 0x3F80 steps above 0, 2.0 0x4000
    # 2.0 -> 1.0 crosses one binade of 128 steps
    assert d.distance[1, 0].item() == 128
    with pytest.raises(TypeError, match="bfloat16 and torch.float16"):
        ulp_distance(a, b.to(torch.float16))
    with pytest.raises(TypeError, match="float64"):
        ulp_distance(a.double(), b.double())
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        ulp_distance(a, 1.0)  # type: ignore[arg-type]


def test_nan_payloads_and_signalling_nans_are_nan() -> None:
    patterns = torch.tensor([0x7FC1, 0x7F81, -1, -0x7F, 0x7F80], dtype=torch.int16).view(torch.bfloat16)
    d = ulp_distance(patterns, torch.zeros_like(patterns))
    assert d.nan.tolist() == [True, True, True, True, False]
    assert d.distance.tolist()[:4] == [-1] * 4 and d.distance[4].item() == 0x7F80


# --- float32: pairs by hypothesis, checked by walking nextafter -------------------------------------

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(start=finite32, steps=st.integers(0, 40), upward=st.booleans())
def test_float32_distance_equals_nextafter_steps(start: float, steps: int, upward: bool) -> None:
    x = np.float32(start)
    toward = np.float32(np.inf if upward else -np.inf)
    y, taken = x, 0
    for _ in range(steps):
        if np.isinf(y) and np.sign(y) == np.sign(toward):
            break
        y, taken = np.nextafter(y, toward), taken + 1
    d = ulp_distance(torch.tensor([x]), torch.tensor([y]))
    assert d.distance.item() == taken and not d.nan.item()
    assert torch.equal(next_up(torch.tensor([x])), torch.tensor([np.nextafter(x, np.float32(np.inf))]))


@settings(max_examples=200, deadline=None)
@given(
    a=st.integers(0, 2**16 - 1),
    b=st.integers(0, 2**16 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_pairs_distance_counts_representable_values_between(a: int, b: int, dtype: torch.dtype) -> None:
    x = torch.tensor([a, b], dtype=torch.int64).to(torch.int16).view(dtype)
    va, vb = to_numpy(x).astype(np.float64)
    d = ulp_distance(x[:1], x[1:])
    if math.isnan(va) or math.isnan(vb):
        assert d.nan.item() and d.distance.item() == -1
        return
    lo, hi = sorted((va, vb))
    tbl = TABLES[dtype]
    # values strictly above lo and up to hi: the steps from lo to hi
    assert d.distance.item() == int(((tbl > lo) & (tbl <= hi)).sum())


TABLES = {dtype: table(dtype) for dtype in (torch.bfloat16, torch.float16)}


# --- round_to -------------------------------------------------------------------------------------


def exact_round(value: float, dtype: torch.dtype, saturate: bool = False) -> float:
    """Round a float64 to ``dtype`` with Fraction arithmetic: nearest representable, ties to even.

    Representable values are ``k * 2**(e - m)`` for the binade exponent ``e >= emin``; Python's ``round``
    of a Fraction rounds halves to the even integer ``k``, which is the even mantissa.
    """
    info = ml_dtypes.finfo(NUMPY[dtype][0])
    m, emin, max_finite = int(info.nmant), int(info.minexp), float(info.max)
    if math.isnan(value):
        return math.nan
    if math.isinf(value):
        overflow = max_finite if saturate else (value if FORMATS[dtype].has_inf else math.nan)
        return math.copysign(abs(overflow), value)
    if value == 0:
        return value
    e = max(math.frexp(abs(value))[1] - 1, emin)
    quantum = Fraction(2) ** (e - m)
    result = round(Fraction(abs(value)) / quantum) * quantum
    if result > max_finite:
        if saturate:
            result = Fraction(max_finite)
        else:
            return math.copysign(math.inf, value) if FORMATS[dtype].has_inf else math.nan
    return math.copysign(float(result), value)


def check_against_exact(values: np.ndarray, dtype: torch.dtype, saturate: bool = False) -> None:
    out = round_to(torch.from_numpy(values), dtype, saturate=saturate)
    got = to_numpy(out).astype(np.float64)
    expect = np.array([exact_round(float(v), dtype, saturate) for v in values])
    nan = np.isnan(expect)
    assert np.array_equal(nan, np.isnan(got)), values[nan != np.isnan(got)][:5]
    bad = (got[~nan] != expect[~nan]) | (np.signbit(got[~nan]) != np.signbit(expect[~nan]))
    assert not bad.any(), list(zip(values[~nan][bad][:5], got[~nan][bad][:5], expect[~nan][bad][:5]))


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_round_to_at_every_midpoint_and_its_float64_neighbours(dtype: torch.dtype) -> None:
    """Midpoints of all neighbouring pairs (and of max and the first value past it): exact ties go to the
    even pattern, the float64 values just above/below go up/down."""
    fmt = FORMATS[dtype]
    x = all_patterns(dtype)
    v = to_numpy(x).astype(np.float64)
    bits = bits_of(x)
    keep = np.isfinite(v) & (v >= 0) & ~((v == 0) & np.signbit(v))
    lo, lo_bits = v[keep], bits[keep]
    order = np.argsort(lo)
    lo, lo_bits = lo[order], lo_bits[order]
    beyond = fmt.max_finite + (fmt.max_finite - lo[-2])  # the value the next pattern would have
    hi, _hi_bits = np.append(lo[1:], beyond), np.append(lo_bits[1:], lo_bits[-1] + 1)
    mid = (lo + hi) / 2  # exact in float64
    overflow = math.inf if fmt.has_inf else math.nan
    hi_value = np.where(hi == beyond, overflow, hi)
    tie = np.where(lo_bits % 2 == 0, lo, hi_value)
    for sign in (1.0, -1.0):
        for probe, expect in (
            (mid, tie),
            (np.nextafter(mid, np.inf), hi_value),
            (np.nextafter(mid, -np.inf), lo),
        ):
            got = to_numpy(round_to(torch.from_numpy(sign * probe), dtype)).astype(np.float64)
            np.testing.assert_array_equal(got, sign * expect)


def test_round_to_float32_midpoints_and_neighbours() -> None:
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 0x7F7FFFFF, 4000, dtype=np.int64).astype(np.uint32).view(np.float32)
    lo = patterns.astype(np.float64)
    hi = np.nextafter(patterns, np.float32(np.inf)).astype(np.float64)
    mid = (lo + hi) / 2
    even = np.where(patterns.view(np.uint32) % 2 == 0, lo, hi)
    for probe, expect in ((mid, even), (np.nextafter(mid, np.inf), hi), (np.nextafter(mid, -np.inf), lo)):
        for sign in (1.0, -1.0):
            got = round_to(torch.from_numpy(sign * probe), torch.float32).double().numpy()
            np.testing.assert_array_equal(got, sign * expect)
    values = rng.standard_normal(2000) * np.exp2(rng.integers(-160, 140, 2000))
    np.testing.assert_array_equal(
        round_to(torch.from_numpy(values), torch.float32).numpy(), values.astype(np.float32)
    )


@pytest.mark.parametrize(
    ("dtype", "value_hex", "expect_hex"),
    [
        # just above the bfloat16 midpoint between 1 and 1+2^-7: float32 rounds it onto the midpoint,
        # which then ties to even (1.0); the single rounding goes up
        (torch.bfloat16, "0x1.0100000001p0", "0x1.02p0"),
        (torch.bfloat16, "-0x1.0100000001p0", "-0x1.02p0"),
        (torch.bfloat16, "0x1.1000000001p-130", "0x1.2p-130"),  # subnormal: 8.5 steps of 2^-133, just above
        (torch.float16, "0x1.0020000001p0", "0x1.004p0"),
        (torch.float8_e4m3fn, "0x1.1000000001p0", "0x1.2p0"),
        (torch.float8_e5m2, "0x1.2000000001p0", "0x1.4p0"),
        # just below a midpoint: float32 rounds it up onto the midpoint, which then ties to even (up)
        (torch.bfloat16, "0x1.02fffffffffp0", "0x1.02p0"),
    ],
)
def test_round_to_is_a_single_rounding_where_float32_would_round_twice(
    dtype: torch.dtype, value_hex: str, expect_hex: str
) -> None:
    value, expect = float.fromhex(value_hex), float.fromhex(expect_hex)
    assert exact_round(value, dtype) == expect  # the independent construction agrees with the table
    through_f32 = float(np.float32(value))
    assert through_f32 != value and exact_round(through_f32, dtype) != expect  # a real double-rounding trap
    got = round_to(torch.tensor([value], dtype=torch.float64), dtype)
    assert got.double().item() == expect


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_round_to_from_float32_matches_ml_dtypes(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(1)
    fmt = FORMATS[dtype]
    scale = np.exp2(rng.integers(fmt.emin - fmt.mantissa_bits - 3, fmt.emax + 3, 20000))
    values = (rng.standard_normal(20000) * scale).astype(np.float32)
    values = np.concatenate([values, np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32)])
    with np.errstate(over="ignore"):
        expect = values.astype(NUMPY[dtype][0])
    got = round_to(torch.from_numpy(values), dtype)
    assert same(got, from_numpy(expect, dtype))


def test_round_to_from_float64_matches_numpy_float16() -> None:
    rng = np.random.default_rng(2)
    values = rng.standard_normal(20000) * np.exp2(rng.integers(-30, 20, 20000))
    with np.errstate(over="ignore"):
        expect = values.astype(np.float16)
    assert same(round_to(torch.from_numpy(values), torch.float16), from_numpy(expect, torch.float16))


@settings(max_examples=300, deadline=None)
@given(
    value=st.floats(allow_nan=True, allow_infinity=True)
    | st.builds(lambda m, e: math.ldexp(m, e), st.integers(-(2**40), 2**40), st.integers(-180, 90)),
    dtype=st.sampled_from(ALL),
    saturate=st.booleans(),
)
def test_round_to_matches_exact_fraction_rounding(value: float, dtype: torch.dtype, saturate: bool) -> None:
    check_against_exact(np.array([value]), dtype, saturate)


@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_round_to_overflow_and_saturation(dtype: torch.dtype) -> None:
    fmt = FORMATS[dtype]
    big = np.array([fmt.max_finite * 1.01, fmt.max_finite * 4, 1e300, np.inf, -np.inf, -1e300, np.nan])
    check_against_exact(big, dtype, saturate=False)
    check_against_exact(big, dtype, saturate=True)
    sat = to_numpy(round_to(torch.from_numpy(big), dtype, saturate=True)).astype(np.float64)
    np.testing.assert_array_equal(sat[:-1], [fmt.max_finite] * 4 + [-fmt.max_finite] * 2)


def test_torch_saturates_matches_torch_cast_and_round_to_models_it() -> None:
    values = torch.tensor([460.0, 464.0, 470.0, 480.0, 1e9, math.inf, -math.inf, -500.0, 1.1])
    for dtype in SMALL:
        cast = values.to(dtype)
        ours = round_to(values, dtype, saturate=torch_saturates(dtype))
        assert same(ours, cast), dtype
    assert torch_saturates(torch.bfloat16) is False and torch_saturates(torch.float8_e5m2) is False


def test_round_to_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="int64"):
        round_to(torch.ones(2, dtype=torch.int64), torch.bfloat16)
    with pytest.raises(TypeError, match="float64"):
        round_to(torch.ones(2, dtype=torch.float64), torch.float64)
    with pytest.raises(TypeError, match="Tensor"):
        round_to(1.0, torch.bfloat16)  # type: ignore[arg-type]


def test_round_to_keeps_shape_and_zero_signs() -> None:
    x = torch.tensor([[0.0, -0.0], [1e-300, -1e-300]], dtype=torch.float64)
    out = round_to(x, torch.bfloat16)
    assert out.shape == (2, 2) and out.dtype == torch.bfloat16
    assert torch.signbit(out).tolist() == [[False, True], [False, True]] and (out == 0).all()


# --- histograms -----------------------------------------------------------------------------------


def test_histogram_buckets_hand_counted() -> None:
    d = torch.tensor([0, 0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 1000, -1])
    assert ulp_histogram(d) == {
        "0": 2,
        "1": 1,
        "2": 1,
        "3-4": 2,
        "5-8": 2,
        "9-16": 2,
        ">16": 2,
        "nonfinite": 1,
    }
    mask = torch.zeros(13, dtype=torch.bool)
    mask[0] = True
    h = ulp_histogram(d, mask)
    assert h["0"] == 1 and h["nonfinite"] == 2 and sum(h.values()) == 13
    assert tuple(h) == HISTOGRAM_BUCKETS


def test_histogram_of_ulp_distance_and_merge() -> None:
    a = torch.tensor([1.0, 1.0, math.nan, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 1.0078125, 1.0, 2.0625], dtype=torch.bfloat16)  # 0, 1 ulp, nan, 4 ulps
    h = ulp_histogram(ulp_distance(a, b))
    assert h == {"0": 1, "1": 1, "2": 0, "3-4": 1, "5-8": 0, "9-16": 0, ">16": 0, "nonfinite": 1}
    merged = merge_histograms(h, h, ulp_histogram(torch.tensor([], dtype=torch.int64)))
    assert merged == {k: 2 * v for k, v in h.items()}
    assert merge_histograms() == dict.fromkeys(HISTOGRAM_BUCKETS, 0)
    assert format_histogram(h) == "0: 1 | 1: 1 | 2: 0 | 3-4: 1 | 5-8: 0 | 9-16: 0 | >16: 0 | nonfinite: 1"
    assert isinstance(ulp_distance(a, b), UlpDistance)


def test_histogram_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="integer tensor, but got torch.float32"):
        ulp_histogram(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"shape \(2,\), but got \(3,\)"):
        ulp_histogram(torch.tensor([1, 2]), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        ulp_histogram(torch.tensor([1, 2]), torch.zeros(2))
    with pytest.raises(ValueError, match="buckets"):
        merge_histograms({"0": 1})
    with pytest.raises(ValueError, match="buckets"):
        format_histogram({"0": 1})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", SMALL, ids=ids)
def test_cuda_matches_cpu(dtype: torch.dtype) -> None:
    x = all_patterns(dtype)
    partner = x[torch.randperm(x.numel())]
    xc, pc = x.cuda(), partner.cuda()
    cpu, gpu = ulp_distance(x, partner), ulp_distance(xc, pc)
    assert torch.equal(cpu.distance, gpu.distance.cpu()) and torch.equal(cpu.nan, gpu.nan.cpu())
    for fn in (next_up, next_down):
        assert same(fn(x), fn(xc).cpu())
    cpu_spacing, gpu_spacing = spacing(x), spacing(xc).cpu()  # float64, NaN exactly at NaN patterns
    nan = torch.isnan(cpu_spacing)
    assert torch.equal(nan, torch.isnan(gpu_spacing)) and torch.equal(nan, torch.isnan(x.float()))
    assert torch.equal(cpu_spacing[~nan].view(torch.int64), gpu_spacing[~nan].view(torch.int64))  # bitwise
    values = torch.randn(10000, dtype=torch.float64) * torch.exp2(torch.randint(-40, 40, (10000,)).double())
    assert same(round_to(values, dtype), round_to(values.cuda(), dtype).cpu())
    assert ulp_histogram(gpu) == ulp_histogram(cpu)


def test_ordering_keys_and_distances_of_a_lazily_negated_view_are_those_of_its_values() -> None:
    """``x.conj().imag`` of a complex ``x`` is a real tensor, strided and lazily negated (its memory holds the values
    before negation): its keys, distances and neighbours are those of its values, not an error from inside torch."""
    z = torch.complex(torch.randn(16), torch.randn(16))
    view, plain = z.conj().imag, -z.imag
    assert view.is_neg() and not plain.is_neg()
    assert torch.equal(ordering_key(view), ordering_key(plain))
    other = plain + 2.0**-20
    assert torch.equal(ulp_distance(view, other).distance, ulp_distance(plain, other).distance)
    assert torch.equal(next_up(view), next_up(plain)) and torch.equal(next_down(view), next_down(plain))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64], ids=str)
def test_parts_differ_says_which_parts_hold_an_element_that_is_not_the_same_bits(dtype, compiled, monkeypatch) -> None:
    """The rows the oracle judges: a part differs where one element's bits differ — a NaN payload, a zero's sign, one
    ULP — and not where only equal bits are (NaN against the same NaN); a lazily negated view by its values; the
    compiled ``memcmp`` a part and the element-wise comparison give the same answer; bad shapes named."""
    import ulptrace.ulp as U
    from ulptrace.ulp import parts_differ

    if not compiled:
        monkeypatch.setattr(U, "_cpu_stats", lambda: None)
    a = (torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8) - 20).to(dtype)
    b = a.clone()
    if dtype.is_floating_point:
        bits_b = b.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[b.element_size()])
        bits_b[1, 3] += 1  # one step
        if dtype != torch.float8_e4m3fn:
            a[2, 0], b[2, 0] = 0.0, -0.0  # a zero's sign
            a[3, 5], b[3, 5] = float("nan"), float("nan")  # the same NaN: equal bits
        want = [False, True, dtype != torch.float8_e4m3fn, False, False, True]
    else:
        b[4, 7] += 1
        want = [False, False, False, False, True, True]
    bits_b = b.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()])
    bits_b[5, 7] ^= torch.iinfo(bits_b.dtype).min  # a part's last element's sign bit: its last byte in memory
    assert parts_differ(a, b, 6).tolist() == want
    assert parts_differ(a, b, 3).tolist() == [want[0] or want[1], want[2] or want[3], want[4] or want[5]]
    assert parts_differ(a, a.clone(), 48).tolist() == [False] * 48
    if dtype in (torch.bfloat16, torch.float32):  # (torch negates no FP8)
        assert parts_differ(torch._neg_view(-a), a, 6).tolist() == [False] * 6
    with pytest.raises(ValueError, match=r"split into 5 parts, but got \(6, 8\) and \(6, 8\)"):
        parts_differ(a, b, 5)
    with pytest.raises(ValueError, match=r"but got \(6, 8\) and \(8, 6\)"):
        parts_differ(a, b.reshape(8, 6), 6)


@pytest.mark.parametrize("wide", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=str)
def test_same_bits_across_float_dtypes_is_same_value_and_sign(narrow, wide) -> None:
    """A candidate stored wider than the reference holds the reference's value exactly where its value and sign are
    the reference's: 1.0 and -0.0 and infinity (by hand), any NaN against any NaN (two payloads built from bit
    patterns), not 1/3 in the wider format (not the narrow one's value), not +0 against -0, not a NaN against a
    number — in both argument orders, and for BF16 against FP16 (neither holds the other)."""
    from ulptrace.ulp import same_bits

    nan_a = torch.tensor([0x7FC1 if narrow == torch.bfloat16 else 0x7E01], dtype=torch.int16).view(narrow)
    nan_b = torch.tensor([0x7FF00001 if wide == torch.float32 else 0x7FF8_0000_0000_0042],
                         dtype=torch.int32 if wide == torch.float32 else torch.int64).view(wide)
    assert torch.isnan(nan_a).all() and torch.isnan(nan_b).all()
    a = torch.cat([torch.tensor([1.0, -0.0, float("inf"), 1 / 3, 0.0, 2.0], dtype=narrow), nan_a])
    b = torch.cat([torch.tensor([1.0, -0.0, float("inf"), 1 / 3, -0.0, float("nan")], dtype=wide), nan_b])
    expected = torch.tensor([True, True, True, False, False, False, True])
    assert torch.equal(same_bits(a, b), expected) and torch.equal(same_bits(b, a), expected)
    other = torch.float16 if narrow == torch.bfloat16 else torch.bfloat16  # 1.0 and 2**-3 in both; 1/3 in neither alike
    c = torch.tensor([1.0, 0.125, 1 / 3, -0.0], dtype=other)
    d = torch.tensor([1.0, 0.125, 1 / 3, 0.0], dtype=narrow)
    assert same_bits(c, d).tolist() == [True, True, False, False]
