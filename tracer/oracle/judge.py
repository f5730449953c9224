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
from ulptrace import _ulp_cpu
from ulptrace.oracle.hypotheses import enumerate_hypotheses
from ulptrace.oracle.intervals import Layout, members
from ulptrace.oracle.members import depends_on_inputs, stacked_lengths
from ulptrace.oracle.program import Program
from ulptrace.oracle.replay import Records, output_interval, replay, to_dtype
from ulptrace.oracle.sharding import ShardedReduction
from ulptrace.ulp import (
    FORMATS,
    HISTOGRAM_BUCKETS,
    grouped_ulp_histograms,
    ordering_key,
    round_to,
    same_bits,
)

VERDICTS: tuple[str, ...] = ("exact", "tie", "boundary", "error", "nonfinite")
"""Verdict names; ``Judgement.verdicts`` holds indices into this tuple (worse verdicts have larger codes)."""

EXACT, TIE, BOUNDARY, ERROR, NONFINITE = range(5)
# what judge_sets_stacked's sum of verdict codes relies on, and its tally's order
assert (EXACT, TIE, BOUNDARY, NONFINITE) == (0, 1, ERROR - 1, len(VERDICTS) - 1) == (0, 1, 2, 4)

WORSE_THAN_TIE: tuple[str, ...] = VERDICTS[BOUNDARY:]
"""The verdicts that say a path introduced a difference of its own (``boundary``, ``error``, ``nonfinite``)."""

DIFFERING_VERDICTS: tuple[str, ...] = VERDICTS[TIE:]
"""The verdicts of elements that differ from the reference: the keys of :func:`verdict_histogram`."""


def explained_share(fraction: float, digits: int = 0) -> str:
    """The share of a record's out-of-set elements a named boundary explains, as a percentage with ``digits``
    decimals — never rounded to ``0%`` or ``100%`` unless it is exactly that (``<1%``, ``>99%``): a boundary that
    explains all but a few elements, the rest errors, must not read as explaining them all, nor one that explains a
    few as explaining none."""
    text = f"{100 * fraction:.{digits}f}%"
    least = f"{10.0 ** -digits:.{digits}f}"
    if 0 < fraction and float(text[:-1]) == 0:
        return f"<{least}%"
    if fraction < 1 and float(text[:-1]) == 100:
        return f">{100 - float(least):.{digits}f}%"
    return text


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
            lines.append(f"  boundary: {self.boundary} (explains {explained_share(self.explained, 1)} of {outside} "
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
    return judge_stacked(program, inputs, output, reference_output, [program.name], hypotheses=hypotheses,
                         shards=shards)[0]


def judge_stacked(
    program: Program,
    inputs: Mapping[str, torch.Tensor],
    output: torch.Tensor,
    reference_output: torch.Tensor | None,
    sites: Sequence[str | None],
    *,
    layout: Layout | None = None,
    per_unit: frozenset[str] = frozenset(),
    per_record: Mapping[str, Sequence[torch.Tensor]] | None = None,
    hypotheses: bool = True,
    shards: Iterable[ShardedReduction] = (),
) -> list[Judgement]:
    """:func:`judge` of ``len(sites)`` records stacked along dimension 0, in one replay: ``program`` is captured for
    the stack (``ulptrace.oracle.members.stacks`` says whether it is the records' program stacked), ``inputs``,
    ``output`` and ``reference_output`` are the records' own, concatenated in order, as ``layout`` says (default:
    records of equal shapes, ``Layout.of(len(sites))``; its padding is judged for none); ``per_unit`` names the
    program's constants that hold each unit's own values (``ulptrace.oracle.members``); ``per_record`` gives the
    constants each record has its own of, one tensor per record (a linear layer's weight where the records come from
    several layers: the ops that read them are evaluated record by record, ``ulptrace.oracle.replay.Records``). Each
    record's :class:`Judgement` is the one :func:`judge` gives it alone.

    Raises:
        MixedDecision: the records would take different paths in the replay (``ulptrace.oracle.intervals``): judge
            them one by one.
        TypeError, ValueError, UnsupportedOpError: as :func:`judge`.
    """
    _check_output(program, output, "output")
    if reference_output is not None:
        _check_output(program, reference_output, "reference_output")
    layout = layout or Layout.of(len(sites))
    if layout.count != len(sites):
        raise ValueError(f"a layout of {layout.count} records for {len(sites)} sites")
    records = None
    if per_record:
        for name, tensors in per_record.items():
            want = program.constants.get(name)
            if want is None or len(tensors) != layout.count or any(
                    t.shape != want.shape or t.dtype != want.dtype for t in tensors):
                raise ValueError(f"per_record[{name!r}] must hold {layout.count} tensors shaped and typed as the "
                                 f"program's constant, but got {[(tuple(t.shape), t.dtype) for t in tensors]}")
        records = Records(per_record, depends_on_inputs(program, per_unit))
    with members(layout, stacked_lengths(program, layout.units, per_unit)):
        base = replay(program, inputs, track_point=True, records=records)
        iv = output_interval(program, base)
        options: list[tuple[HypothesisResult, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = []
        if hypotheses:
            for h in enumerate_hypotheses(program, shards):
                def interval(h=h) -> tuple[torch.Tensor, torch.Tensor]:
                    h_iv = output_interval(program, replay(program, inputs, h.mods, base=base, track_point=False,
                                                           records=records))
                    return h_iv.lo, h_iv.hi

                options.append((HypothesisResult(h.kind, h.description, h.op, 0), interval))
        assert iv.pt is not None
        return judge_sets_stacked(output, reference_output, iv.lo, iv.hi, iv.pt, options, program.output_value.dtype,
                                  sites, layout)


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
    return judge_sets_stacked(output, reference_output, lo, hi, pt, hypotheses, out_dtype, [site])[0]


def judge_sets_stacked(
    output: torch.Tensor,
    reference_output: torch.Tensor | None,
    lo: torch.Tensor,
    hi: torch.Tensor,
    pt: torch.Tensor,
    hypotheses: Sequence[tuple[Any, ...]],
    out_dtype: torch.dtype,
    sites: Sequence[str | None],
    layout: Layout | None = None,
) -> list[Judgement]:
    """:func:`judge_sets` of ``len(sites)`` records stacked along dimension 0 as ``layout`` says (default: equal
    shapes; ``judge_stacked``): each record's judgement as if judged alone — its counts, its hypotheses (a
    hypothesis's set is computed once, for every record, when one of them still has an unexplained element), its
    boundary, its largest error — from one pass of ops over all of them."""
    layout = layout or Layout.of(len(sites))
    count = layout.count
    # the output as float64: what the hypotheses and the distances compare (on the CPU made only where needed)
    v: torch.Tensor | None = None
    masks = _ulp_cpu.classify(output, reference_output, lo, hi, pt) if lo.device.type == "cpu" else None
    if masks is not None:  # one compiled pass, the same masks as the operations below (tested)
        tie, bad, outside = masks
    else:
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
        not_exact = ~exact
        tie, bad = in_set & not_exact, nonfinite & not_exact

    per_record = layout.sums
    part = layout.part  # record k's part of a value of them all
    # per record, in one read of the device: the out-of-set elements (for which hypotheses are tried), the ties and the
    # nonfinite ones — with the explained ones below, every count of the tally, without a pass over per-element groups
    n_outside, n_tie, n_bad = layout.sums_of(outside, tie, bad)
    if v is None and any(n_outside):
        v = output.detach().to(device=lo.device, dtype=torch.float64)
    results: list[list[HypothesisResult]] = [[] for _ in range(count)]
    explained_any: torch.Tensor | None = None  # none until a hypothesis is evaluated
    most = [0] * count
    full: list[set[str]] = [set() for _ in range(count)]  # hypotheses that explain every out-of-set element
    fit: list[dict[str, float]] = [{} for _ in range(count)]  # mean |output - center| over the out-of-set elements
    rivals: dict[str, tuple[str, ...]] = {}
    for record, interval, *extra in hypotheses:
        rivals[record.kind] = tuple(extra[0]) if extra else ()
        # an earlier hypothesis explains every out-of-set element of a record: no later one changes a verdict of it
        # or is named for it (the first of equals is, unless a rival design fits better), so it is not evaluated there
        settled = [bool(n and most[k] == n and not full[k] & set(rivals[record.kind])) for k, n in enumerate(n_outside)]
        wanted = [n > 0 and not settled[k] for k, n in enumerate(n_outside)]
        counts = [0] * count
        if any(wanted):
            h_lo, h_hi, *center = interval()
            hit = outside & (v >= h_lo) & (v <= h_hi)
            # a settled record's out-of-set elements are all explained already
            explained_any = hit if explained_any is None else explained_any.logical_or_(hit)
            counts = per_record(hit)
        for k in range(count):
            if settled[k]:
                results[k].append(HypothesisResult(record.kind, record.description, record.op, None))
                continue
            count_k = counts[k] if wanted[k] else 0
            most[k] = max(most[k], count_k)
            if wanted[k] and count_k == n_outside[k]:
                full[k].add(record.kind)
                if center:
                    fit[k][record.kind] = float((part(v, k) - part(center[0], k).to(v))[part(outside, k)].abs().mean())
            results[k].append(HypothesisResult(record.kind, record.description, record.op, count_k))

    # each element's code from the masks by arithmetic on their bytes (a bool tensor viewed as uint8 is free): an element
    # not exact is in the set, not finite, or outside it (one of the three), and an explained one is outside — so
    # TIE * in_set + NONFINITE * nonfinite + ERROR * outside - explained gives TIE, NONFINITE, ERROR or BOUNDARY, and
    # EXACT (0) where it is exact. Fewer ops than a fill per verdict, none of which branches per element on the CPU
    # (masked fills there did, on masks that follow the data), and no boolean-index assignment (on a GPU that waits
    # for the device to count the indices)
    verdicts = torch.add(tie.view(torch.uint8), bad.view(torch.uint8), alpha=NONFINITE)
    verdicts.add_(outside.view(torch.uint8), alpha=ERROR)
    n_explained = [0] * count
    if explained_any is not None:
        verdicts.sub_(explained_any.view(torch.uint8))
        n_explained = per_record(explained_any)
    # the tally from the counts: an element not exact is a tie, nonfinite, or outside — explained (boundary) or not
    unit = output.numel() // layout.units
    tally = [[(layout.offsets[k + 1] - layout.offsets[k]) * unit - n_tie[k] - n_bad[k] - n_outside[k], n_tie[k],
              n_explained[k], n_outside[k] - n_explained[k], n_bad[k]] for k in range(count)]

    if any(n_outside):
        d = _distance(output, v, lo, hi, out_dtype).clamp(min=1)
        distance = torch.where(bad, -1, torch.where(outside, d, 0))
        # an error element is outside and unexplained, so its distance is >= 1: 0 here means there is none
        tops = layout.maxima(torch.where(verdicts == ERROR, distance, 0)) if distance.numel() else [0] * count
    else:  # no element outside, so no error: every distance is 0, or -1 where nonfinite
        tops = [0] * count
        zero = torch.zeros((), dtype=torch.int64, device=lo.device)
        distance = -bad.long() if any(n_bad) else zero.expand(output.shape)
    lo_o, hi_o, pt_o = to_dtype(lo, out_dtype), to_dtype(hi, out_dtype), to_dtype(pt, out_dtype)

    judgements = []
    for k in range(count):
        best = max(results[k], key=lambda r: r.explained or 0, default=None)  # first of equals: the simplest ...
        for r in results[k]:  # ... unless a rival design explains as many and fits better
            if best is not None and best.kind in rivals.get(r.kind, ()) and r.kind in fit[k] and \
                    fit[k][r.kind] < fit[k].get(best.kind, float("inf")):
                best = r
        boundary = best.description if best is not None and best.explained else None
        explained = (best.explained or 0) / n_outside[k] if boundary is not None and best is not None \
            and n_outside[k] else 0.0
        judgements.append(Judgement(
            verdicts=part(verdicts, k),
            counts={name: int(tally[k][c]) for c, name in enumerate(VERDICTS)},
            boundary=boundary,
            explained=explained,
            hypotheses=results[k],
            max_error_ulp=int(tops[k]) if tops[k] > 0 else None,
            lo=part(lo_o, k),
            hi=part(hi_o, k),
            point=part(pt_o, k),
            distance=part(distance, k),
            against_reference=reference_output is not None,
            site=sites[k],
        ))
    return judgements


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
    histograms = verdict_histograms(verdicts, output, reference_output, Layout.of(1))
    return None if histograms is None else histograms[0]


def verdict_histograms(verdicts: torch.Tensor, output: torch.Tensor, reference_output: torch.Tensor,
                       layout: Layout) -> list[dict[str, dict[str, int]]] | None:
    """:func:`verdict_histogram` of the records of ``layout`` stacked along dimension 0, one per record (the padding's
    left out), from one pass over them all (``judge_stacked``)."""
    count = layout.count
    if verdicts.shape != output.shape or output.shape != reference_output.shape \
            or reference_output.dtype not in FORMATS:
        return None
    if not bool((verdicts != EXACT).any()):
        return [empty_verdict_histogram() for _ in range(count)]
    # over every element, the exact ones counted in their own group and dropped: fewer ops than selecting the others
    # first (three boolean selections, each a wait for the device on a GPU), which is what a judged record costs
    device = verdicts.device
    ref = reference_output.detach().to(device)
    cand = output.detach().to(device).to(reference_output.dtype)
    # record k's verdict c is group k * len(VERDICTS) + c (the padding's: count * len(VERDICTS) + c)
    bases = layout.record_of_unit(device) * len(VERDICTS)
    per_verdict = grouped_ulp_histograms(ref, cand, verdicts, bases, (count + 1) * len(VERDICTS))
    out = []
    for k in range(count):
        histogram = empty_verdict_histogram()
        for code in range(TIE, len(VERDICTS)):
            histogram[VERDICTS[code]] = per_verdict[k * len(VERDICTS) + code]
        out.append(histogram)
    return out
