"""Per-element verdicts: is a path's output exact, a tie, a boundary mismatch, an error, or nonfinite?

:func:`judge` replays the reference semantics on the judged path's *own* inputs (so a site is blamed
only for error it introduced), compares the path's output with the admissible set, and tries every
hypothesis of :mod:`ulptrace.oracle.hypotheses` on the elements that fall outside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from ulptrace.oracle.hypotheses import enumerate_hypotheses
from ulptrace.oracle.program import Program
from ulptrace.oracle.replay import output_interval, replay, to_dtype
from ulptrace.oracle.sharding import ShardedReduction
from ulptrace.ulp import (
    FORMATS,
    HISTOGRAM_BUCKETS,
    grouped_histograms,
    ordering_key,
    round_to,
    same_bits,
    ulp_distance,
)

VERDICTS: tuple[str, ...] = ("exact", "tie", "boundary", "error", "nonfinite")
"""Verdict names; ``Judgement.verdicts`` holds indices into this tuple (worse verdicts have larger codes)."""

EXACT, TIE, BOUNDARY, ERROR, NONFINITE = range(5)

WORSE_THAN_TIE: tuple[str, ...] = VERDICTS[BOUNDARY:]
"""The verdicts that say a path introduced a difference of its own (``boundary``, ``error``, ``nonfinite``)."""

DIFFERING_VERDICTS: tuple[str, ...] = VERDICTS[TIE:]
"""The verdicts of elements that differ from the reference: the keys of :func:`verdict_histogram`."""


@dataclass
class HypothesisResult:
    """How one hypothesis fared: its kind, sentence, op index and the out-of-set elements it explains."""

    kind: str
    description: str
    op: int | None
    explained: int | None  # None: not tried, an earlier hypothesis already explained every out-of-set element


@dataclass
class Judgement:
    """The verdicts on one output (see :func:`judge`).

    Attributes:
        verdicts: uint8 tensor of the output's shape; codes index :data:`VERDICTS`.
        counts: ``{verdict: count}`` with all five keys.
        boundary: the hypothesis that explains the most out-of-set elements, or None.
        explained: share of out-of-set (boundary + error) elements that ``boundary`` explains (0.0 if none).
        hypotheses: every hypothesis tried, in order, with its count.
        max_error_ulp: largest ULP distance (output dtype of the program) from an ``error`` element to the
            admissible set, or None when there is no error.
        lo, hi: the admissible set's ends, in the program's output dtype.
        point: the exact replay (float64 math, one RNE per op), in the program's output dtype.
        distance: int64 ULP distance of every element to the admissible set (0 inside, -1 nonfinite).
        against_reference: True when judged against a reference output (``exact`` = bitwise equal to it);
            False when judging a path against the semantics alone (``exact`` = inside the admissible set).
        site: the program's site name.
    """

    verdicts: torch.Tensor
    counts: dict[str, int]
    boundary: str | None
    explained: float
    hypotheses: list[HypothesisResult]
    max_error_ulp: int | None
    lo: torch.Tensor
    hi: torch.Tensor
    point: torch.Tensor
    distance: torch.Tensor
    against_reference: bool
    site: str | None = None

    @property
    def inside(self) -> bool:
        """Whether every element is inside the admissible set (or bitwise equal to the reference)."""
        return self.counts["boundary"] + self.counts["error"] + self.counts["nonfinite"] == 0

    @property
    def worst(self) -> str:
        """The worst verdict present (the site's verdict)."""
        present = [k for k, name in enumerate(VERDICTS) if self.counts[name]]
        return VERDICTS[max(present)] if present else "exact"

    def mask(self, verdict: str) -> torch.Tensor:
        """Bool tensor of the elements with ``verdict``.

        Raises:
            ValueError: unknown verdict name.
        """
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, but got {verdict!r}")
        return self.verdicts == VERDICTS.index(verdict)

    def __str__(self) -> str:
        total = self.verdicts.numel()
        head = f"site {self.site!r}" if self.site else "output"
        exact = "exact" if self.against_reference else "admissible"
        counts = " | ".join(f"{exact if n == 'exact' else n} {self.counts[n]}" for n in VERDICTS)
        lines = [f"{head}: {total} elements: {counts} (worst: {self.worst})"]
        outside = self.counts["boundary"] + self.counts["error"]
        if self.boundary is not None:
            lines.append(f"  boundary: {self.boundary} (explains {100 * self.explained:.1f}% of {outside} "
                         "out-of-set elements)")
        if self.max_error_ulp is not None:
            lines.append(f"  error: up to {self.max_error_ulp} ULP outside the admissible set")
        return "\n".join(lines)


def _check_output(program: Program, output: torch.Tensor, what: str) -> None:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{program.where()}: {what} must be a tensor, but got {type(output).__name__}")
    expected = program.output_value
    if tuple(output.shape) != expected.shape:
        raise ValueError(f"{program.where()}: {what} must have the captured output shape {expected.shape}, "
                         f"but got {tuple(output.shape)}")
    if not output.dtype.is_floating_point:
        raise TypeError(f"{program.where()}: {what} must be a floating tensor, but got {output.dtype}")


def _distance(output: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """ULP distance (in ``dtype``, float32 if unsupported) from the output (``v``: its float64 copy) to the nearer of
    ``lo``/``hi``, meaningful where none of them is NaN (the out-of-set elements): differences of ordering keys. The
    ends are representable in ``dtype`` (as ``to_dtype`` relies on), so they are cast, not rounded, and an output
    stored in that dtype is its own rounding — ~30 ops instead of ~100 for each judged record that has an
    out-of-set element."""
    fmt = dtype if dtype in FORMATS else torch.float32
    if fmt == dtype:
        lo_o, hi_o = lo.to(fmt), hi.to(fmt)
    else:
        lo_o, hi_o = round_to(lo, fmt), round_to(hi, fmt)
    vo = output.detach().to(v.device) if output.dtype == fmt else round_to(v, fmt)
    key = ordering_key(vo)
    return torch.minimum((key - ordering_key(lo_o)).abs(), (key - ordering_key(hi_o)).abs())


def judge(
    program: Program,
    inputs: Mapping[str, torch.Tensor],
    output: torch.Tensor,
    reference_output: torch.Tensor | None = None,
    *,
    hypotheses: bool = True,
    shards: Iterable[ShardedReduction] = (),
) -> Judgement:
    """Verdict per element of one path's ``output`` of a site.

    The reference semantics are replayed on ``inputs`` (this path's own recorded inputs) to get the
    admissible set. Each element is then

    - ``exact``: bitwise equal to ``reference_output``; without a reference output, inside the
      admissible set (this is how to ask whether the reference is inside its own semantics);
    - ``tie``: different from the reference but inside the admissible set;
    - ``boundary``: outside, but inside the admissible set of some hypothesis;
    - ``error``: explained by no hypothesis (``distance`` says how far, ``max_error_ulp`` the worst);
    - ``nonfinite``: NaN/Inf in the output where the semantics are finite, or the reverse.

    Args:
        program: from :func:`capture_semantics`.
        inputs: the judged path's inputs, named, shaped and typed as captured.
        output: the path's output, the captured output shape, any floating dtype (compared by value).
        reference_output: the reference path's output, same shape; optional.
        hypotheses: try the hypotheses on out-of-set elements (else they are all ``error``).
        shards: parameters the judged run holds split into shards (tensor parallelism), for the ``sharded``
            hypotheses (:mod:`ulptrace.oracle.sharding`).

    Returns:
        a :class:`Judgement`.

    Raises:
        TypeError, ValueError: inputs or outputs do not match the program (names, shapes, dtypes).
        UnsupportedOpError: an op of the program cannot be replayed.
    """
    _check_output(program, output, "output")
    if reference_output is not None:
        _check_output(program, reference_output, "reference_output")
    base = replay(program, inputs, track_point=True)
    iv = output_interval(program, base)
    options: list[tuple[HypothesisResult, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = []
    if hypotheses:
        for h in enumerate_hypotheses(program, shards):
            def interval(h=h) -> tuple[torch.Tensor, torch.Tensor]:
                h_iv = output_interval(program, replay(program, inputs, h.mods, base=base, track_point=False))
                return h_iv.lo, h_iv.hi

            options.append((HypothesisResult(h.kind, h.description, h.op, 0), interval))
    assert iv.pt is not None
    return judge_sets(output, reference_output, iv.lo, iv.hi, iv.pt, options, program.output_value.dtype,
                      site=program.name)


def judge_sets(
    output: torch.Tensor,
    reference_output: torch.Tensor | None,
    lo: torch.Tensor,
    hi: torch.Tensor,
    pt: torch.Tensor,
    hypotheses: Sequence[tuple[Any, ...]],
    out_dtype: torch.dtype,
    *,
    site: str | None = None,
) -> Judgement:
    """Verdicts of ``output`` against an admissible set ``[lo, hi]`` (float64, ends already rounded to the
    output's dtype) and hypotheses, each a result record and a function giving its set — called only
    when some element is outside. Every oracle construction (captured programs, the GatedDeltaNet scan)
    decides verdicts here, so their meaning is the same everywhere (see :func:`judge`).

    A hypothesis may be a triple ``(record, interval, rivals)``: ``rivals`` names earlier hypotheses it is an
    alternative design to (e.g. kernels rounding different sets of a scan's intermediates), and its
    ``interval`` returns ``(lo, hi, center)``. It is tried even after a rival explained every out-of-set
    element, and it is named instead when it explains as many and its center is closer to the output on
    them (mean absolute distance): sets widened for intermediate roundings can each cover another design's
    values, and the name is the design that fits.
    """
    v = output.detach().to(device=lo.device, dtype=torch.float64)
    # each mask once (a judged record is bound by the number of ops it issues, not by elements)
    v_nan, pt_nan, set_nan = torch.isnan(v), torch.isnan(pt), torch.isnan(lo) | torch.isnan(hi)
    in_set = ((v >= lo) & (v <= hi)) | (v_nan & (pt_nan | set_nan))
    nonfinite = ~in_set & (v_nan | torch.isinf(v) | pt_nan | torch.isinf(pt) | set_nan)
    if reference_output is not None:
        exact = same_bits(output.detach().to(lo.device), reference_output.detach().to(lo.device))
    else:
        exact = in_set
    outside = ~in_set & ~nonfinite & ~exact
    n_outside = int(outside.sum())

    results: list[HypothesisResult] = []
    explained_any = torch.zeros_like(outside)
    most = 0
    full: set[str] = set()  # hypotheses that explain every out-of-set element
    fit: dict[str, float] = {}  # mean |output - center| over the out-of-set elements, where a center is given
    rivals: dict[str, tuple[str, ...]] = {}
    for record, interval, *extra in hypotheses:
        rivals[record.kind] = tuple(extra[0]) if extra else ()
        if n_outside and most == n_outside and not full & set(rivals[record.kind]):
            # an earlier hypothesis explains every out-of-set element: no later one changes a verdict or is named
            # (the first of equals is, unless a rival design fits better), so it is not evaluated
            results.append(HypothesisResult(record.kind, record.description, record.op, None))
            continue
        count = 0
        if n_outside:
            h_lo, h_hi, *center = interval()
            hit = outside & (v >= h_lo) & (v <= h_hi)
            explained_any |= hit
            count = int(hit.sum())
            most = max(most, count)
            if count == n_outside:
                full.add(record.kind)
                if center:
                    fit[record.kind] = float((v - center[0].to(v))[outside].abs().mean())
        results.append(HypothesisResult(record.kind, record.description, record.op, count))

    # masked fills, not boolean-index assignments: those find the indices first (on a GPU, a wait for the device)
    verdicts = torch.full(v.shape, ERROR, dtype=torch.uint8, device=v.device)
    verdicts.masked_fill_(explained_any, BOUNDARY)
    verdicts.masked_fill_(in_set & ~exact, TIE)
    verdicts.masked_fill_(nonfinite & ~exact, NONFINITE)
    verdicts.masked_fill_(exact, EXACT)
    tally = torch.bincount(verdicts.flatten().long(), minlength=len(VERDICTS)).tolist()
    counts = {name: int(tally[k]) for k, name in enumerate(VERDICTS)}

    best = max(results, key=lambda r: r.explained or 0, default=None)  # first of equals: the simplest ...
    for r in results:  # ... unless a rival design explains as many and fits better
        if best is not None and best.kind in rivals.get(r.kind, ()) and r.kind in fit and \
                fit[r.kind] < fit.get(best.kind, float("inf")):
            best = r
    boundary = best.description if best is not None and best.explained else None
    explained = (best.explained or 0) / n_outside if boundary is not None and best is not None and n_outside else 0.0

    distance = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    if n_outside:
        d = _distance(output, v, lo, hi, out_dtype).clamp(min=1)
        distance = torch.where(outside, d, distance)
    distance = torch.where(nonfinite & ~exact, torch.full_like(distance, -1), distance)
    # an error element is outside and unexplained, so its distance is >= 1: 0 here means there is none
    top = int(torch.where(verdicts == ERROR, distance, 0).max()) if distance.numel() else 0
    max_error = top if top > 0 else None
    return Judgement(
        verdicts=verdicts,
        counts=counts,
        boundary=boundary,
        explained=explained,
        hypotheses=results,
        max_error_ulp=max_error,
        lo=to_dtype(lo, out_dtype),
        hi=to_dtype(hi, out_dtype),
        point=to_dtype(pt, out_dtype),
        distance=distance,
        against_reference=reference_output is not None,
        site=site,
    )


def empty_verdict_histogram() -> dict[str, dict[str, int]]:
    """``{verdict: {bucket: 0}}`` for :data:`DIFFERING_VERDICTS` x ``HISTOGRAM_BUCKETS``: nothing differs."""
    return {v: dict.fromkeys(HISTOGRAM_BUCKETS, 0) for v in DIFFERING_VERDICTS}


def verdict_histogram(verdicts: torch.Tensor, output: torch.Tensor,
                      reference_output: torch.Tensor) -> dict[str, dict[str, int]] | None:
    """ULP histograms of the elements that differ from the reference, one per verdict.

    For each verdict of :data:`DIFFERING_VERDICTS` (``tie``, ``boundary``, ``error``, ``nonfinite``), the
    :data:`~ulptrace.ulp.HISTOGRAM_BUCKETS` histogram of the ULP distance between ``output`` and
    ``reference_output`` over the elements with that verdict, counted in the reference's dtype (a wider
    output is rounded to it first, as the comparison's own histogram does). Only the elements that are not
    ``exact`` are counted; an output bitwise equal to the reference costs one comparison of the codes.
    A ``tie`` can sit in bucket ``"0"`` (``+0`` against ``-0``).

    Args:
        verdicts: uint8 verdict codes (:attr:`Judgement.verdicts`), ``output``'s shape.
        output: the judged path's output.
        reference_output: the reference path's output, same shape.

    Returns:
        ``{verdict: {bucket: count}}``; the counts of a verdict sum to its count in the judgement. None when the
        shapes differ or the reference's dtype has no ULP arithmetic (nothing to measure in).
    """
    if verdicts.shape != output.shape or output.shape != reference_output.shape \
            or reference_output.dtype not in FORMATS:
        return None
    out = empty_verdict_histogram()
    if not bool((verdicts != EXACT).any()):
        return out
    # over every element, the exact ones counted in their own group and dropped: fewer ops than selecting the others
    # first (three boolean selections, each a wait for the device on a GPU), which is what a judged record costs
    device = verdicts.device
    ref = reference_output.detach().to(device)
    cand = output.detach().to(device).to(reference_output.dtype)
    per_verdict = grouped_histograms(ulp_distance(ref, cand), verdicts, len(VERDICTS))
    for code in range(TIE, len(VERDICTS)):
        out[VERDICTS[code]] = per_verdict[code]
    return out
