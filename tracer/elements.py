"""Explain one record element by element: what the oracle knows about each differing element.

Reports carry counts (``tie 108, boundary 53``); someone debugging a site wants the elements behind
them. :func:`explain` judges one aligned record pair as ``compare`` does (the reference's semantics,
the candidate's own inputs) and keeps, for every element that differs, both sides' values, the exact
FP64 value of the reference's formula, the admissible set ``[lo, hi]``, the verdict, the hypothesis
that explains a boundary element, and how close the exact value sits to a rounding midpoint:

- ``exact``: the reference formula evaluated in float64 on the candidate's inputs with *no* rounding
  at all (every op's result kept in float64);
- ``point``: the exact replay — float64 math rounded (RNE) to each op's dtype, as the reference rounds;
  the value an implementation with perfectly accurate FP32 arithmetic would store;
- ``midpoint``: at the rounding point that decides the element (below), the distance of the value that
  point receives, computed exactly, to the nearest midpoint between two neighbours of the rounded dtype,
  in ULPs of that dtype: from 0 (on the midpoint) to 0.5 (on a representable value). ``band`` is the
  half-width of the interval of honest FP32 results at that point in the same unit. An FP32 reduction in
  another order moves the value by a fraction of ``band``, so it can round the other way only when
  ``midpoint`` is within ``band``: ties on bitwise-equal inputs cluster at 0, boundary mismatches (a
  rounding skipped or added) do not. The deciding point is, of the rounding points whose result has the
  output's shape (narrow roundings and the output's own), the one whose midpoint is nearest in units of
  its band (the output's own rounding when none has a band).

On a record whose inputs differ (error inherited from upstream) the candidate is judged on its own
inputs, so its ties are honest results for *those* inputs, not rounding-order flips: ``inputs_equal``
says which case an explanation is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from ulptrace.oracle import intervals as I
from ulptrace.oracle.hypotheses import enumerate_hypotheses
from ulptrace.oracle.judge import EXACT, VERDICTS, Judgement, explained_share
from ulptrace.oracle.judge import judge as judge_program
from ulptrace.oracle.replay import Mods, output_interval, replay
from ulptrace.trace import Record, dtype_name
from ulptrace.ulp import FORMATS, next_down, next_up, round_to, ulp_distance

MIDPOINT_BINS: tuple[float, ...] = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5)
"""Bucket edges of :meth:`Explanation.midpoint_histogram` (ULPs of the rounded dtype; the last is inclusive)."""


@dataclass(frozen=True)
class ElementRow:
    """One element of an explained record (see the module docstring for ``exact``, ``point``, ``midpoint``).

    Attributes:
        index: the element's index in the record's output.
        reference, candidate: both sides' values (the candidate's in its own dtype).
        ulp: ULP distance between them in the reference's dtype (None where one is NaN).
        verdict: one of ``exact``, ``tie``, ``boundary``, ``error``, ``nonfinite``.
        exact: the reference formula in float64 on the candidate's inputs, unrounded (None when the site's
            semantics are not an op list, e.g. the GatedDeltaNet scan, whose exact value is ``point``).
        point: the exact replay, rounded as the reference rounds.
        lo, hi: the admissible set's ends in the output's dtype.
        distance: ULPs from the candidate to the admissible set (0 inside, -1 nonfinite).
        hypothesis: for a ``boundary`` element, the site's named boundary (the hypothesis explaining the most
            out-of-set elements) when its admissible set holds the element, else the first hypothesis (simplest
            first) whose set does.
        midpoint, band, rounding_op: see the module docstring (None without an op list).
    """

    index: tuple[int, ...]
    reference: float
    candidate: float
    ulp: int | None
    verdict: str
    exact: float | None
    point: float
    lo: float
    hi: float
    distance: int
    hypothesis: str | None = None
    midpoint: float | None = None
    band: float | None = None
    rounding_op: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["index"] = list(self.index)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) and k in ("midpoint", "band") else v)
                for k, v in out.items()}


_SEVERITY = {name: k for k, name in enumerate(VERDICTS)}


@dataclass
class Explanation:
    """The elements of one record pair, judged (returned by :func:`explain`).

    Attributes:
        site, step, kind: the record.
        dtype, shape: the reference output's dtype name and shape.
        counts: verdict counts over every element (as the report's ``verdicts``).
        boundary, explained: the hypothesis that explains the most out-of-set elements and its share.
        inputs_equal: every oracle input of the two records is bitwise equal (differences are then the
            site's own; otherwise the candidate was judged on inputs that already differ).
        rows: one :class:`ElementRow` per differing element (every element with ``all_elements``), in
            C order of the output.
        judgement: the oracle's :class:`~ulptrace.oracle.judge.Judgement` (full tensors).
        limit: how many offenders ``str()`` shows.
    """

    site: str
    step: int
    kind: str
    dtype: str
    shape: list[int]
    counts: dict[str, int]
    boundary: str | None
    explained: float
    inputs_equal: bool
    rows: list[ElementRow]
    judgement: Judgement | None = field(default=None, repr=False)
    limit: int = 12

    def offenders(self, n: int | None = None) -> list[ElementRow]:
        """The differing rows, worst first: by verdict (nonfinite, error, boundary, tie), then ULP distance."""
        rows = [r for r in self.rows if r.verdict != "exact"]
        rows.sort(key=lambda r: (-_SEVERITY[r.verdict], -(r.ulp if r.ulp is not None else 1 << 62), r.index))
        return rows if n is None else rows[:n]

    def where(self, verdict: str) -> list[ElementRow]:
        """The rows with ``verdict``.

        Raises:
            ValueError: unknown verdict name.
        """
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, but got {verdict!r}")
        return [r for r in self.rows if r.verdict == verdict]

    def midpoint_histogram(self, bins: Sequence[float] = MIDPOINT_BINS) -> dict[str, Any]:
        """The differing elements' ``midpoint`` distances counted into ``bins``, per verdict.

        Returns:
            ``{"site", "step", "inputs_equal", "edges": [...], "counts": {verdict: [n per bin]}, "band": median
            band or None, "elements": rows counted}`` — what :func:`ulptrace.plot.plot_midpoint_distance`
            draws, and what ``trace_norm_rounding`` keeps in its JSON report (``rounding``).
        """
        edges = [float(b) for b in bins]
        if len(edges) < 2 or edges != sorted(edges):
            raise ValueError(f"bins must be at least two increasing edges, but got {list(bins)}")
        counts = {v: [0] * (len(edges) - 1) for v in VERDICTS[1:]}
        bands, used = [], 0
        for r in self.rows:
            if r.verdict == "exact" or r.midpoint is None or not math.isfinite(r.midpoint):
                continue
            k = _bucket(r.midpoint, edges)
            if k is None:
                continue
            counts[r.verdict][k] += 1
            used += 1
            if r.band is not None and math.isfinite(r.band) and r.band > 0:
                bands.append(r.band)
        bands.sort()
        return {"site": self.site, "step": self.step, "inputs_equal": self.inputs_equal, "edges": edges,
                "counts": counts, "band": bands[len(bands) // 2] if bands else None, "elements": used}

    def to_json(self) -> dict[str, Any]:
        """Every field except the judgement's tensors; rows as dicts (stable keys, see :class:`ElementRow`)."""
        return {"site": self.site, "step": self.step, "kind": self.kind, "dtype": self.dtype, "shape": self.shape,
                "counts": self.counts, "boundary": self.boundary, "explained": self.explained,
                "inputs_equal": self.inputs_equal, "rows": [r.to_json() for r in self.rows]}

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        differing = sum(v for k, v in self.counts.items() if k != "exact")
        total = sum(self.counts.values())
        counts = " | ".join(f"{k} {self.counts[k]}" for k in VERDICTS)
        head = [(f"step {self.step}, {self.site} ({self.kind}, {self.dtype} {self.shape}): {differing} of {total} "
                 f"elements differ: {counts}"),
                "inputs bitwise equal: the differences are the site's own" if self.inputs_equal else
                "inputs differ: judged on the candidate's own inputs (error inherited from upstream)"]
        if self.boundary:
            head.append(f"boundary: {self.boundary} (explains {explained_share(self.explained, 1)} of out-of-set elements)")
        shown = self.offenders(self.limit)
        if not shown:
            return "\n".join(head)
        cols = ("index", "reference", "candidate", "ulp", "verdict", "exact (FP64)", "admissible [lo, hi]",
                "midpoint", "hypothesis")
        table = [cols] + [(
            str(list(r.index)), _num(r.reference), _num(r.candidate), "nan" if r.ulp is None else str(r.ulp),
            r.verdict + (f" +{r.distance}" if r.verdict == "error" else ""),
            "-" if r.exact is None else f"{r.exact:.10g}", f"[{_num(r.lo)}, {_num(r.hi)}]",
            "-" if r.midpoint is None else f"{r.midpoint:.2e}" + ("" if r.band is None else f" ({r.band:.0e})"),
            r.hypothesis or "") for r in shown]
        widths = [max(len(row[k]) for row in table) for k in range(len(cols) - 1)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1] for row in table]
        more = len(self.offenders()) - len(shown)
        tail = [f"... {more} more differing element(s) (.rows has them all)"] if more > 0 else []
        return "\n".join(head + [f"first {len(shown)} offenders (worst first; midpoint in ULPs, band in brackets):"]
                         + lines + tail)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython shows the table, not the dataclass
        p.text(str(self))


def _num(x: float) -> str:
    return f"{x:.6g}"


def _bucket(value: float, edges: list[float]) -> int | None:
    if value < edges[0] or value > edges[-1]:
        return None
    for k in range(len(edges) - 1):
        if value < edges[k + 1]:
            return k
    return len(edges) - 2


def _resolve(source: Any, site: Any, step: int | None) -> Record:
    if isinstance(source, Record):
        return source
    if site is None:
        raise ValueError("explain needs site= (a name, a SiteDiff or a report entry) when given traces, "
                         "not records")
    name = site if isinstance(site, str) else (site["site"] if isinstance(site, dict) else site.site)
    at = step if step is not None else (0 if isinstance(site, str) else
                                        (site["step"] if isinstance(site, dict) else site.step))
    record = source.get((name, at))
    if record is None:
        raise KeyError(f"no record ({name!r}, step {at}) in the trace; it has e.g. {list(source.keys())[:3]}")
    return record


def explain(reference: Any, candidate: Any, judge: Any, *, site: Any = None, step: int | None = None,
            all_elements: bool = False, limit: int = 12) -> Explanation:
    """Explain one record pair element by element (see the module docstring).

    Args:
        reference, candidate: two :class:`~ulptrace.trace.Record` s of the same site and step, or two traces
            (``Trace``, ``LazyTrace``, a ``Recorder``'s ``.trace``) with ``site`` naming the record.
        judge: an :class:`~ulptrace.verdicts.OracleJudge` built on the reference model (its semantics judge).
        site: a site name, or a ``SiteDiff`` / report entry (e.g. ``comparison.onset()``), when given traces.
        step: the step (default: the ``SiteDiff``'s, else 0).
        all_elements: keep a row for every element, not only the differing ones.
        limit: how many offenders ``str()`` shows.

    Returns:
        an :class:`Explanation`.

    Raises:
        ValueError: the records are of different sites/steps or shapes, or the site has no oracle semantics
            (e.g. a residual add, a cache state) or one of its inputs is missing.
        KeyError: the traces hold no such record.
    """
    from ulptrace.comparison import without_cache_padding_pair
    from ulptrace.verdicts import OracleJudge

    ref, cand = _resolve(reference, site, step), _resolve(candidate, site, step)
    if ref.key != cand.key:
        raise ValueError(f"reference and candidate must be the same (site, step), but got {ref.key} and {cand.key}")
    ref, cand = without_cache_padding_pair(ref, cand)
    if ref.out.shape != cand.out.shape:
        raise ValueError(f"reference and candidate outputs must have the same shape, but got "
                         f"{tuple(ref.out.shape)} and {tuple(cand.out.shape)}")
    device = getattr(judge, "device", ref.out.device)
    ref = Record(ref.site, ref.step, ref.kind, ref.layer, ref.out.to(device), {k: v.to(device) for k, v in ref.inputs.items()})
    cand = Record(cand.site, cand.step, cand.kind, cand.layer, cand.out.to(device),
                  {k: v.to(device) for k, v in cand.inputs.items()})
    spec = judge.site(ref.site)
    if spec is None or spec.formula is None:
        raise ValueError(f"{ref.site} ({ref.kind}) has no oracle semantics: nothing to explain element by element "
                         "(its ULP statistics are in the comparison)")
    missing = [r for r in spec.inputs if r not in spec.optional and r not in ref.inputs]
    if missing:
        raise ValueError(f"the reference record of {ref.site} lacks oracle input(s) {missing}")
    program = judge.program(spec, ref.inputs)
    inputs = OracleJudge._candidate_inputs(ref, cand)  # the candidate's own inputs, as compare judges them
    lacking = inputs if isinstance(inputs, str) else None
    if lacking:
        raise ValueError(f"{ref.site}: {lacking}")
    inputs_equal = all(r in cand.inputs and cand.inputs[r].dtype == t.dtype and cand.inputs[r].shape == t.shape
                       and torch.equal(cand.inputs[r], t) for r, t in ref.inputs.items())
    hypotheses = getattr(judge, "hypotheses", True)
    if hasattr(program, "judge"):  # a construction of its own (the GatedDeltaNet scan): no op list to replay
        result = program.judge(inputs, cand.out, ref.out, hypotheses=hypotheses)
        exact = hypothesis = None
        mid = None
    else:
        result = judge_program(program, inputs, cand.out, ref.out, hypotheses=hypotheses)
        exact = _exact(program, inputs)
        hypothesis = _hypothesis_per_element(program, inputs, cand.out, result) if hypotheses else None
        mid = _midpoints(program, inputs)
    keep = torch.ones_like(result.verdicts, dtype=torch.bool) if all_elements else result.verdicts != EXACT
    rows = _rows(keep, ref.out, cand.out, result, exact, hypothesis, mid)
    return Explanation(site=ref.site, step=ref.step, kind=ref.kind, dtype=dtype_name(ref.out.dtype),
                       shape=list(ref.out.shape), counts=dict(result.counts), boundary=result.boundary,
                       explained=float(result.explained), inputs_equal=inputs_equal, rows=rows, judgement=result,
                       limit=limit)


def _exact(program: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output with no rounding anywhere: every op kept in float64."""
    every = frozenset(op.index for op in program.ops)
    return output_interval(program, replay(program, inputs, Mods(exact=every))).pt


def _hypothesis_per_element(program: Any, inputs: dict[str, torch.Tensor], output: torch.Tensor,
                            result: Judgement) -> list[str | None] | None:
    """For each ``boundary`` element the named boundary when it holds the element, else the first hypothesis (the
    judge's order) whose set does; None for the other elements."""
    boundary = result.verdicts == VERDICTS.index("boundary")
    if not bool(boundary.any()):
        return None
    v = output.detach().to(torch.float64)
    names: list[str | None] = [None] * v.numel()
    pending = boundary.reshape(-1).clone()
    base = replay(program, inputs, track_point=False)
    tried = list(zip(enumerate_hypotheses(program), result.hypotheses))
    tried.sort(key=lambda pair: pair[0].description != result.boundary)  # the named boundary first (stable)
    for h, outcome in tried:
        if not outcome.explained or not bool(pending.any()):
            continue
        iv = output_interval(program, replay(program, inputs, h.mods, base=base, track_point=False))
        hit = pending & ((v >= iv.lo) & (v <= iv.hi)).reshape(-1)
        for i in hit.nonzero().flatten().tolist():
            names[i] = h.description
        pending &= ~hit
    return names


def _ulp_at(value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rounded, gap)``: each float64 value rounded to ``dtype`` (RNE, as float64) and the gap from it to its
    neighbour on the value's side. Nonfinite values give NaN."""
    finite = torch.isfinite(value)
    v = torch.where(finite, value, torch.zeros_like(value))
    r = round_to(v, dtype)
    r64 = r.to(torch.float64)
    neighbour = torch.where(v >= r64, next_up(r), next_down(r)).to(torch.float64)
    gap = (neighbour - r64).abs()
    nan = torch.full_like(gap, math.nan)
    return torch.where(finite, r64, nan), torch.where(finite & torch.isfinite(gap), gap, nan)


def midpoint_distance(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Distance from each float64 value to the nearest rounding midpoint of ``dtype``, in ULPs of ``dtype``.

    0 on a midpoint (round-to-nearest-even decides), 0.5 on a representable value; NaN where the value is not
    finite. Example: in BF16 the neighbours of 1.0 are 1.0 and 1.0078125, so 1.00390625 is at 0 and 1.001953125
    at 0.25.

    Raises:
        TypeError: ``dtype`` is not one of ``ulptrace.FORMATS``.
    """
    rounded, gap = _ulp_at(value.to(torch.float64), dtype)
    return 0.5 - (value.to(torch.float64) - rounded).abs() / gap


def _midpoints(program: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per element ``(midpoint, band, op)`` at the deciding rounding point, or None when there is none."""
    shape = program.output_value.shape
    out_ops = program.output_ops()
    points = [op.index for op in program.ops if op.index in program.live and program.is_rounding_point(op.index)
              and program.values[op.outputs[0]].shape == shape
              and (op.index in out_ops or program.result_dtype(op.index) in I.NARROW_DTYPES)
              and program.result_dtype(op.index) in FORMATS]
    if not points:
        return None
    fp32 = frozenset(op.index for op in program.ops if op.index in program.live and program.is_rounding_point(op.index)
                     and program.result_dtype(op.index) == torch.float32)
    found = {}
    for i in points:
        out = program.ops[i].outputs[0]
        dtype = program.result_dtype(i)
        exact = replay(program, inputs, Mods(exact=fp32 | {i}))[out].pt  # the value point i receives, exactly
        honest = replay(program, inputs, Mods(exact=frozenset({i})), track_point=False)[out]  # FP32 roundings kept
        _, gap = _ulp_at(exact, dtype)
        mid = midpoint_distance(exact, dtype)
        band = ((honest.hi - honest.lo) / 2) / gap
        ratio = torch.nan_to_num(torch.where(band > 0, mid / band, torch.full_like(mid, math.inf)), nan=math.inf)
        found[i] = (ratio, mid, band)
    # the output's own rounding decides unless another point has its midpoint nearer in units of its band
    last = max(points)
    ratio, mid, band = found[last]
    op = torch.full(mid.shape, last, dtype=torch.int64, device=mid.device)
    for i in points:
        if i == last:
            continue
        r_i, m_i, b_i = found[i]
        take = r_i < ratio
        ratio, mid, band = torch.where(take, r_i, ratio), torch.where(take, m_i, mid), torch.where(take, b_i, band)
        op = torch.where(take, torch.full_like(op, i), op)
    return mid, band, op


def _rows(keep: torch.Tensor, ref: torch.Tensor, cand: torch.Tensor, result: Judgement, exact: torch.Tensor | None,
          hypothesis: list[str | None] | None, mid: tuple[torch.Tensor, ...] | None) -> list[ElementRow]:
    flat = keep.reshape(-1).nonzero().flatten()
    if flat.numel() == 0:
        return []
    shape = tuple(ref.shape)
    ulp: list[int | None] = [None] * flat.numel()
    if ref.dtype in FORMATS:
        d = ulp_distance(ref.reshape(-1)[flat], cand.reshape(-1)[flat].to(ref.dtype))
        ulp = [None if n else int(x) for x, n in zip(d.distance.tolist(), d.nan.tolist())]

    def pick(t: torch.Tensor | None) -> list[Any] | None:
        return None if t is None else t.reshape(-1)[flat].double().tolist() if t.is_floating_point() \
            else t.reshape(-1)[flat].tolist()

    r_v, c_v = pick(ref), pick(cand)
    point, lo, hi, dist = pick(result.point), pick(result.lo), pick(result.hi), pick(result.distance)
    codes = result.verdicts.reshape(-1)[flat].tolist()
    ex = pick(exact)
    mids = [pick(t) for t in mid] if mid is not None else None
    rows = []
    for k, i in enumerate(flat.tolist()):
        rows.append(ElementRow(
            index=_unravel(i, shape), reference=r_v[k], candidate=c_v[k], ulp=ulp[k], verdict=VERDICTS[codes[k]],
            exact=None if ex is None else ex[k], point=point[k], lo=lo[k], hi=hi[k], distance=int(dist[k]),
            hypothesis=None if hypothesis is None else hypothesis[i],
            midpoint=None if mids is None else mids[0][k], band=None if mids is None else mids[1][k],
            rounding_op=None if mids is None else int(mids[2][k])))
    return rows


def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))
