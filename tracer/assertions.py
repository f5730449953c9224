"""ULP-budget assertions for tests of kernels and model paths.

``torch.testing.assert_close`` has no ULP mode and numpy's ``assert_array_max_ulp`` rejects bfloat16, so
kernel tests keep growing their own ULP checks. :func:`assert_ulp_close` is ulptrace's one: budgets in
ULPs of the tensors' own dtype, and on failure a message with a fixed layout that summarises every
mismatch (count, greatest distance and where, the histogram of :data:`ulptrace.ulp.HISTOGRAM_BUCKETS`,
the first offenders), raised as :class:`UlpAssertionError`.

Every failure is also appended to a small module-level log that the pytest plugin drains after each test
(:func:`drain_failures`) to list failed ULP assertions in its terminal summary. Nothing happens at import.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from ulptrace.ulp import FORMATS, format_histogram, format_of, ordering_key, ulp_distance, ulp_histogram

__all__ = ["UlpAssertionError", "assert_ulp_close", "drain_failures"]

# Failures not yet collected by the pytest plugin; bounded so that use outside pytest cannot grow it.
_FAILURES: collections.deque[UlpAssertionError] = collections.deque(maxlen=1000)


class UlpAssertionError(AssertionError):
    """An :func:`assert_ulp_close` failure, with its numbers as attributes.

    Attributes:
        max_ulp: the budget that was exceeded.
        dtype: the tensors' dtype.
        mismatched: number of elements over budget (NaN/Inf mismatches included).
        total: number of elements compared.
        greatest: ULP distance of the worst offender, or None if it is a NaN/Inf mismatch (those count
            as worse than any finite distance).
        index: index of the worst offender (the first one in row-major order among equals).
        histogram: counts per :data:`ulptrace.ulp.HISTOGRAM_BUCKETS` over all elements; ``nonfinite``
            counts the NaN/Inf mismatches.
        header: the ``"ULP budget exceeded: ..."`` line of the message.
    """

    def __init__(
        self,
        message: str,
        *,
        max_ulp: int,
        dtype: torch.dtype,
        mismatched: int,
        total: int,
        greatest: int | None,
        index: tuple[int, ...],
        histogram: dict[str, int],
        header: str,
    ) -> None:
        super().__init__(message)
        self.max_ulp = max_ulp
        self.dtype = dtype
        self.mismatched = mismatched
        self.total = total
        self.greatest = greatest
        self.index = index
        self.histogram = histogram
        self.header = header


def drain_failures() -> list[UlpAssertionError]:
    """Return and forget the failures recorded since the last call (oldest first; at most 1000 kept)."""
    failures = list(_FAILURES)
    _FAILURES.clear()
    return failures


def _check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a non-negative int, but got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, but got {value}")
    return value


def _validate(actual: Any, expected: Any) -> None:
    for name, value in (("actual", actual), ("expected", expected)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(value).__name__}")
    if actual.dtype != expected.dtype:
        raise TypeError(
            f"actual and expected must have the same dtype, but got {actual.dtype} and {expected.dtype}"
        )
    if actual.dtype not in FORMATS:
        supported = ", ".join(f.name for f in FORMATS.values())
        raise TypeError(f"assert_ulp_close supports {supported}, but got {actual.dtype}")
    if actual.shape != expected.shape:
        raise ValueError(
            f"actual and expected must have the same shape, but got {tuple(actual.shape)} and {tuple(expected.shape)}"
        )
    if actual.device != expected.device:
        raise ValueError(
            f"actual and expected must be on the same device, but got {actual.device} and {expected.device}"
        )


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def assert_ulp_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    max_ulp: int = 0,
    *,
    equal_nan: bool = True,
    msg: str | None = None,
    max_offenders: int = 5,
) -> None:
    """Assert that every element of ``actual`` is within ``max_ulp`` ULPs of ``expected``.

    Distances are :func:`ulptrace.ulp.ulp_distance` in the tensors' dtype (``+0``/``-0`` are equal). NaN
    positions must match (both NaN passes) unless ``equal_nan=False``, in which case every NaN fails. A
    NaN on one side only, and an infinity facing a finite value or the opposite infinity, always fail
    whatever the budget and are counted as ``nonfinite``.

    Args:
        actual, expected: tensors of the same shape, dtype (one of :data:`ulptrace.ulp.FORMATS`) and device.
        max_ulp: budget in ULPs; 0 asks for equality.
        equal_nan: treat NaN facing NaN as equal.
        msg: optional line put in front of the message.
        max_offenders: how many offenders to list (row-major order).

    Raises:
        UlpAssertionError: some elements are over budget; the message has a fixed layout::

            ULP budget exceeded: max_ulp=1 (bfloat16)
            Mismatched elements: 3 / 120 (2.5%)
            Greatest ULP distance: 4 at index (1, 7) (actual=1.2265625, expected=1.21875)
            ULP histogram: 0: 117 | 1: 1 | 2: 0 | 3-4: 2 | 5-8: 0 | 9-16: 0 | >16: 0 | nonfinite: 0
            First offenders:
              (0, 3): actual=1.015625, expected=1.0, ulp=2
              ...
        TypeError: an argument is not a tensor, the dtypes differ or are unsupported, or a count is not
            an int.
        ValueError: the shapes or devices differ, or a count is negative.
    """
    __tracebackhide__ = True
    _validate(actual, expected)
    max_ulp = _check_count(max_ulp, "max_ulp")
    max_offenders = _check_count(max_offenders, "max_offenders")
    fmt = format_of(actual.dtype)
    total = actual.numel()
    if total == 0:
        return

    result = ulp_distance(actual, expected)
    nan_actual = ulp_distance(actual, actual).nan
    nan_expected = ulp_distance(expected, expected).nan
    both_nan = nan_actual & nan_expected
    distance = torch.where(result.nan, torch.zeros_like(result.distance), result.distance)
    nonfinite = nan_actual ^ nan_expected
    if not equal_nan:
        nonfinite = nonfinite | both_nan
    if fmt.inf_bits is not None:
        infinite = (ordering_key(actual).abs() == fmt.inf_bits) | (
            ordering_key(expected).abs() == fmt.inf_bits
        )
        nonfinite = nonfinite | (infinite & ~result.nan & (distance != 0))
    mismatch = nonfinite | (distance > max_ulp)
    mismatched = int(mismatch.sum())
    if mismatched == 0:
        return

    flat_mismatch = mismatch.reshape(-1)
    flat_nonfinite = nonfinite.reshape(-1)
    flat_distance = distance.reshape(-1)
    # worst offender: a nonfinite mismatch if any, else the greatest distance (first in row-major order)
    if bool(flat_nonfinite.any()):
        worst = int(flat_nonfinite.nonzero()[0])
        greatest: int | None = None
    else:
        greatest = int(flat_distance.max())
        worst = int((flat_distance == greatest).nonzero()[0])
    offenders = flat_mismatch.nonzero().reshape(-1)[:max_offenders].tolist()
    picks = torch.tensor([worst, *offenders], dtype=torch.int64, device=actual.device)
    actual_values = actual.reshape(-1)[picks].to(torch.float64).cpu().tolist()
    expected_values = expected.reshape(-1)[picks].to(torch.float64).cpu().tolist()
    picked_distance = flat_distance[picks].cpu().tolist()
    picked_nonfinite = flat_nonfinite[picks].cpu().tolist()

    histogram = ulp_histogram(distance, nonfinite)
    index = _unravel(worst, actual.shape)
    header = f"ULP budget exceeded: max_ulp={max_ulp} ({fmt.name})"
    shown = "nonfinite" if greatest is None else str(greatest)
    lines = [
        header,
        f"Mismatched elements: {mismatched} / {total} ({100 * mismatched / total:.3g}%)",
        (
            f"Greatest ULP distance: {shown} at index {index} "
            f"(actual={actual_values[0]!r}, expected={expected_values[0]!r})"
        ),
        f"ULP histogram: {format_histogram(histogram)}",
    ]
    if offenders:
        lines.append("First offenders:")
        for k, flat in enumerate(offenders, start=1):
            ulp = "nonfinite" if picked_nonfinite[k] else str(picked_distance[k])
            lines.append(
                f"  {_unravel(flat, actual.shape)}: actual={actual_values[k]!r}, "
                f"expected={expected_values[k]!r}, ulp={ulp}"
            )
        if mismatched > len(offenders):
            lines.append(f"  ... and {mismatched - len(offenders)} more")
    message = "\n".join(lines) if msg is None else f"{msg}\n" + "\n".join(lines)
    error = UlpAssertionError(
        message,
        max_ulp=max_ulp,
        dtype=actual.dtype,
        mismatched=mismatched,
        total=total,
        greatest=greatest,
        index=index,
        histogram=histogram,
        header=header,
    )
    _FAILURES.append(error)
    raise error
