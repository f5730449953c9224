"""Divergent rows of greedy generations: where did each one begin? Shared by ``matrix`` and ``batch_invariance``.

Two greedy runs (EOS disabled) of the same prompts agree token for token or not; for a row that does
not, three questions are answered here, each in one place:

- *first divergent step* (``first_divergent_steps``): the first position whose token differs (step 0 is
  the prefill's token, step ``t`` the ``t``-th decode step's);
- *near-tie* (``near_tie``, rule ``NEAR_TIE_RULE``): at that step, is the reference's top-1/top-2 logit gap
  at most the largest logit difference between the two runs (the row's whole vocabulary)? Then any
  noise of that size could flip the choice (a gap equal to it: by the tie-break of equal logits). A flip always
  comes with a difference of at least half the gap somewhere, so a defect's flips are near-ties too: where it
  began (its verdict) is what tells a defect from noise;
- *where it began* (``locate``): both runs are restored to the reference's decoding state just before that
  step (``ulptrace.run.Session.restore``), the step is re-run traced on both, and the records of the row
  (``ulptrace.run.RowSink``) are compared and judged; the onset (``Comparison.onset_with_reason``) is
  where it began. If the restored step no longer flips the row, the difference had *accumulated* over
  earlier steps: both runs are then re-run traced from the start, the candidate fed the reference's
  tokens, and the onset of that run (restricted to the row) is reported.

``generate`` runs a greedy generation keeping what this needs (every step's logits and, on request, the
decoding state before every decode step).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from ulptrace.comparison import Comparison, StreamingComparator
from ulptrace.oracle.judge import VERDICTS, WORSE_THAN_TIE
from ulptrace.record import MemorySink, Recorder
from ulptrace.run import DecodeState, RowSink, Session, greedy, selection_metadata, step_from
from ulptrace.sides import SideNames

NEAR_TIE_RULE = ("near-tie: at the first divergent step, the reference's top-1/top-2 logit gap is at most the "
                 "largest |logit difference| between the two runs at that step (that row, every vocabulary entry)")


@dataclass
class Generation:
    """One greedy generation: its tokens ``[batch, new_tokens]``, the logits of every step (``[batch, vocab]``
    each) and, when kept, ``states[t]``: the decoding state just before decode step ``t`` (``states[0]`` is
    None: nothing precedes the prefill)."""

    tokens: torch.Tensor
    logits: list[torch.Tensor]
    states: list[DecodeState | None] = field(default_factory=list)


@torch.no_grad()
def generate(model: Any, prompts: torch.Tensor, new_tokens: int, *, mode: str = "eager", cache_len: int | None = None,
             keep_states: bool = False) -> Generation:
    """Greedy decoding of ``prompts`` in ``mode`` (a fresh ``Session``, so a graph is captured anew), keeping
    every step's logits and, with ``keep_states``, the state before every decode step (memory: one decoding
    state per step)."""
    session = Session(model, mode, max_len=cache_len or prompts.shape[1] + new_tokens)
    logits: list[torch.Tensor] = []
    states: list[DecodeState | None] = [None]

    def keep(step: int, step_logits: torch.Tensor) -> None:
        logits.append(step_logits.clone())  # the prefill's is a view of [batch, len, vocab]: keep the row only
        if keep_states and step + 1 < new_tokens:
            states.append(session.snapshot())

    tokens = greedy(model, prompts, new_tokens, on_logits=keep, session=session)
    return Generation(tokens, logits, states if keep_states else [])


def first_divergent_steps(reference: torch.Tensor, candidate: torch.Tensor) -> list[int | None]:
    """Per row, the first step whose token differs (None for a token-exact row)."""
    if reference.shape != candidate.shape:
        raise ValueError(f"token tensors differ in shape: reference {list(reference.shape)}, "
                         f"candidate {list(candidate.shape)}")
    differ = (reference.cpu() != candidate.cpu())
    return [int(row.nonzero()[0]) if bool(row.any()) else None for row in differ]


def near_tie(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, Any]:
    """The near-tie rule (``NEAR_TIE_RULE``) on one row's logits ``[vocab]`` at the first divergent step.

    Returns ``near_tie`` (``gap <= noise``), ``gap`` (the reference's top-1 minus top-2 logit), ``noise``
    (the largest |reference - candidate| logit difference), and both runs' tokens. Computed in float64
    (exact for BF16/FP16/FP32 logits). A nonfinite difference is never a near-tie.
    """
    if reference.shape != candidate.shape or reference.dim() != 1 or reference.numel() < 2:
        raise ValueError(f"expected two logit rows [vocab] of the same shape (vocab >= 2), but got "
                         f"{list(reference.shape)} and {list(candidate.shape)}")
    ref, cand = reference.double().cpu(), candidate.double().cpu()
    top = ref.topk(2)
    gap = float(top.values[0] - top.values[1])
    noise = float((ref - cand).abs().max())
    finite = bool(torch.isfinite(ref).all() and torch.isfinite(cand).all())
    return {"near_tie": bool(finite and gap <= noise), "gap": gap, "noise": noise,
            "reference_token": int(ref.argmax()), "candidate_token": int(cand.argmax())}


def site_verdict(diff: Any) -> str | None:
    """The worst verdict present at a compared record (``SiteDiff``), or None when it has no verdicts."""
    counts = diff.verdicts
    if not counts:
        return None
    return max((v for v in VERDICTS if counts.get(v)), key=VERDICTS.index, default="exact")


def onset_object(comparison: Comparison) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(onset, first_difference)`` of a comparison as in ``onset --json``, each with ``verdict`` (the worst
    verdict at that record, or None without verdicts), ``boundary`` (the named hypothesis when boundary
    elements are present) and ``max_ulp`` added; None where there is none."""
    data = comparison.to_json()
    onset, _ = comparison.onset_with_reason()
    first = comparison.first_difference()

    def extend(point: dict[str, Any] | None, diff: Any) -> dict[str, Any] | None:
        if point is None or diff is None:
            return None
        boundary = diff.boundary if (diff.verdicts or {}).get("boundary") else None
        return {**point, "verdict": site_verdict(diff), "boundary": boundary, "max_ulp": diff.max_ulp}

    return extend(data["onset"], onset), extend(data["first_difference"], first)


def describe_point(point: dict[str, Any] | None) -> str:
    """``step 2, layers.1.mlp.glu (glu): error`` — one located record in words, with why it is the onset."""
    if point is None:
        return "none"
    verdict = point.get("verdict")
    reason = point.get("reason")
    if reason == "unjudged":
        why = "unjudged (differs on bitwise-equal inputs, no verdicts)"
    elif reason == "unobserved":
        why = "unobserved (its inputs already differ while every earlier record is equal: began in code no site " \
              f"observes{'; its own verdict ' + verdict if verdict else ''})"
    elif reason == "unrecorded":
        why = "unrecorded (its inputs already differ while every earlier record is equal: began in code the " \
              f"selection did not record{'; its own verdict ' + verdict if verdict else ''})"
    elif reason == "mask":
        why = "mask (its attention mask lets other keys through than the reference's)"
    else:
        why = verdict or "no verdicts"
    return f"step {point['step']}, {point['site']} ({point['kind']}): {why}"


@dataclass
class Side:
    """One side of a diagnosed pair: a model with its path applied, how it ran, and what it produced."""

    model: Any
    path: str
    mode: str
    prompts: torch.Tensor  # [batch, prompt_len]
    generation: Generation
    cache_len: int | None = None
    names: SideNames | None = None  # what its code looks up as its path set it, beside another path (ulptrace.sides)

    @property
    def batch(self) -> int:
        return self.prompts.shape[0]

    def running(self) -> AbstractContextManager[Any]:
        """The context each run of this side's model is made in: its own names entered, where another side's path is
        applied in this process too."""
        return self.names.entered() if self.names is not None else nullcontext()


class UntilOnset:
    """A site judge (``OracleJudge``) that stops judging after the first record with a verdict worse than tie.

    A located row reports its first onset only, and every record before it is judged as usual, so the
    onset is the same; records after it get no verdicts (``note`` says why). On a re-run from the start
    this spares judging everything after an early onset (most of a prefill, for a kernel path).
    """

    NOTE = "not judged: after this comparison's first verdict worse than tie (only the onset is reported)"

    def __init__(self, judge: Any) -> None:
        self.judge, self.done = judge, False

    def __call__(self, reference: Any, candidate: Any) -> dict[str, Any] | None:
        if self.done:
            return {"verdicts": None, "note": self.NOTE}
        out = self.judge(reference, candidate)
        if out and any((out.get("verdicts") or {}).get(v) for v in WORSE_THAN_TIE):
            self.done = True
        return out


def _comparator(reference: Any, judge: Any, max_ulp: int) -> StreamingComparator:
    return StreamingComparator(reference, judge=None if judge is None else UntilOnset(judge), max_ulp=max_ulp)


def _recorder(side: Side, sink: Any, sites: Sequence[Any] | None, metadata: dict[str, Any]) -> Recorder:
    return Recorder(side.model, sites=sites, sink=sink, path=side.path, metadata={**metadata, "mode": side.mode})


@torch.no_grad()
def locate(references: dict[int, tuple[Side, int]], candidate: Side, step: int, *, candidate_state: DecodeState | None,
           candidate_feed: torch.Tensor | None, candidate_forced: torch.Tensor, judge: Any = None, max_ulp: int = 0,
           sites: Sequence[Any] | None = None, metadata: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """Where the divergence of candidate rows that first diverge at ``step`` began.

    Args:
        references: candidate row -> (the reference side for it, its row there). The matrix pairs row ``r``
            of a batch with row ``r`` of the reference's batch; batch invariance pairs a row with its prompt
            decoded alone.
        candidate: the candidate side (its generation's own tokens are not used).
        step: the first divergent step of these rows (0 = the prefill).
        candidate_state: the reference's decoding state before ``step``, in the candidate's batch (unused for
            step 0); candidate_feed: the tokens the reference fed at ``step`` ``[batch, 1]``.
        candidate_forced: the reference's tokens for the candidate's rows ``[batch, >= step]``, fed on a
            re-run from the start.
        judge: an ``OracleJudge`` of the reference model (None: ULP statistics only).
        sites: the sites to record (default every site); metadata: added to both recordings (``selection``).

    Returns: per candidate row, ``accumulated`` (the restored step no longer flips the row),
    ``restored_step_diverges``, ``onset`` and ``first_difference`` (``onset_object``) of the restored step,
    or of the re-run from the start when accumulated, and ``located_by`` saying which.
    """
    meta = dict(metadata or {})
    rows = sorted(references)

    def run_references(run: Any) -> dict[int, tuple[dict[int, Any], torch.Tensor]]:
        """Each reference side run once by ``run(side, recorder)``, recording the rows needed:
        id(side) -> (its row -> trace, its logits)."""
        out = {}
        for side, needed in _sides(references):
            traces = {r: MemorySink() for r in needed}
            with side.running():
                logits = run(side, _recorder(side, RowSink(side.batch, traces), sites, meta))
            out[id(side)] = ({r: s.trace for r, s in traces.items()}, logits)
        return out

    def comparators(refs: dict[int, Any]) -> dict[int, StreamingComparator]:
        return {row: _comparator(refs[id(side)][0][ref_row], judge, max_ulp) for row, (side, ref_row) in references.items()}

    result: dict[int, dict[str, Any]] = {}
    if step == 0:  # the prefill: nothing precedes it, so it is re-run as it was
        refs = run_references(_prefill)
        sinks = comparators(refs)
        with candidate.running():
            cand_logits = _prefill(candidate, _recorder(candidate, RowSink(candidate.batch, sinks), sites, meta))
        for row in rows:
            side, ref_row = references[row]
            onset, first = onset_object(sinks[row].finish())
            result[row] = {"accumulated": False,  # nothing precedes the prefill to accumulate over
                           "restored_step_diverges": int(cand_logits[row].argmax()) != int(refs[id(side)][1][ref_row].argmax()),
                           "onset": onset, "first_difference": first, "located_by": "prefill re-run traced"}
        return result
    if candidate_state is None or candidate_feed is None:
        raise ValueError(f"locating a divergence at decode step {step} needs the reference's state and tokens")

    def restored(side: Side, rec: Recorder) -> torch.Tensor:  # step_from enters the recorder after its prefill
        return step_from(side.model, side.mode, side.prompts, side.generation.states[step],
                         side.generation.tokens[:, step - 1:step], cache_len=side.cache_len, recorders=[rec])

    refs = run_references(restored)
    sinks = comparators(refs)
    rec = _recorder(candidate, RowSink(candidate.batch, sinks), sites, meta)
    with candidate.running():
        cand_logits = step_from(candidate.model, candidate.mode, candidate.prompts, candidate_state, candidate_feed,
                                cache_len=candidate.cache_len, recorders=[rec])
    accumulated = []
    for row in rows:
        side, ref_row = references[row]
        diverges = int(cand_logits[row].argmax()) != int(refs[id(side)][1][ref_row].argmax())
        onset, first = onset_object(sinks[row].finish())
        result[row] = {"accumulated": not diverges, "restored_step_diverges": diverges, "onset": onset,
                       "first_difference": first,
                       "located_by": f"decode step {step} re-run traced from the reference's state"}
        if not diverges:
            accumulated.append(row)
    if accumulated:  # the difference built up over earlier steps: re-run both from the start
        again = locate_from_start({row: references[row] for row in accumulated}, candidate, step,
                                  candidate_forced=candidate_forced, judge=judge, max_ulp=max_ulp, sites=sites,
                                  metadata=meta)
        for row in accumulated:
            result[row].update(again[row])
    return result


def _sides(references: dict[int, tuple[Side, int]]) -> list[tuple[Side, list[int]]]:
    """The distinct reference sides of ``references`` with the rows needed from each."""
    grouped: dict[int, tuple[Side, list[int]]] = {}
    for side, ref_row in references.values():
        rows = grouped.setdefault(id(side), (side, []))[1]
        if ref_row not in rows:
            rows.append(ref_row)
    return list(grouped.values())


def _prefill(side: Side, recorder: Recorder) -> torch.Tensor:
    logits: list[torch.Tensor] = []
    with recorder:
        greedy(side.model, side.prompts, 1, mode=side.mode, cache_len=side.cache_len,
               on_logits=lambda s, l: logits.append(l))
    return logits[0]


@torch.no_grad()
def locate_from_start(references: dict[int, tuple[Side, int]], candidate: Side, step: int, *,
                      candidate_forced: torch.Tensor, judge: Any = None, max_ulp: int = 0,
                      sites: Sequence[Any] | None = None, metadata: dict[str, Any] | None = None
                      ) -> dict[int, dict[str, Any]]:
    """The onset of each candidate row over steps ``0..step``, both sides traced from the start, the candidate
    fed ``candidate_forced`` (the reference's tokens) and the references their own tokens (see ``locate``)."""
    meta = dict(metadata or {})
    traces: dict[int, dict[int, Any]] = {}
    for side, needed in _sides(references):
        sinks = {r: MemorySink() for r in needed}
        with side.running(), _recorder(side, RowSink(side.batch, sinks), sites, meta):
            greedy(side.model, side.prompts, step + 1, forced=side.generation.tokens, mode=side.mode,
                   cache_len=side.cache_len)
        traces[id(side)] = {r: s.trace for r, s in sinks.items()}
    comparators = {row: _comparator(traces[id(side)][ref_row], judge, max_ulp) for row, (side, ref_row) in references.items()}
    with candidate.running(), _recorder(candidate, RowSink(candidate.batch, comparators), sites, meta):
        greedy(candidate.model, candidate.prompts, step + 1, forced=candidate_forced, mode=candidate.mode,
               cache_len=candidate.cache_len)
    out = {}
    for row, sink in comparators.items():
        onset, first = onset_object(sink.finish())
        out[row] = {"onset": onset, "first_difference": first,
                    "located_by": f"steps 0..{step} re-run traced from the start, the candidate fed the reference's tokens"}
    return out


def judging(run: Any, candidates: Sequence[str]) -> dict[str, Any]:
    """How rows are located and judged (``judging`` in a report): oracle on or off, the ULP budget of sites
    without verdicts, and the site selection (``ulptrace.run.selection_metadata`` over every step; ``observed``
    only where a path limits observation, so reports from before it was recorded still resume). Rows resumed or
    merged from other reports must agree on it."""
    chosen = selection_metadata(run, candidates, steps=False)
    if chosen["observed"] is None:
        del chosen["observed"]
    return {"oracle": run.oracle, "max_ulp": run.max_ulp, **chosen}


def check_resumable(report: Any, schema: str, ours: dict[str, Any]) -> None:
    """``--resume``: ``report`` must be a report of ``schema`` whose fields (``"grid.x"`` for nested ones) equal
    ``ours``; raises ``ValueError`` naming the first field that differs or is not recorded, and both values."""
    if not isinstance(report, dict) or report.get("schema") != schema:
        found = report.get("schema") if isinstance(report, dict) else type(report).__name__
        raise ValueError(f"--resume: expected a report of schema {schema!r}, but found {found!r}")
    for name, value in ours.items():
        theirs = report.get("grid", {}).get(name[5:]) if name.startswith("grid.") else report.get(name)
        if theirs is None and value is not None:
            raise ValueError(f"--resume: the report does not record {name} (written by an older ulptrace?), so "
                             f"its rows cannot be shown to belong to this run ({name} {value!r} here)")
        if theirs != value:
            raise ValueError(f"--resume: the report is of another run: {name} is {theirs!r} there, {value!r} here")


def check_values(flag: str, values: Sequence[Any], *, minimum: int | None = None, kind: str = "value") -> None:
    """A grid option's values: at least one, each once, none below ``minimum``."""
    values = list(values)
    if not values:
        raise ValueError(f"{flag} needs at least one {kind}, but got none")
    repeated = sorted({v for v in values if values.count(v) > 1}, key=values.index)
    if repeated:
        raise ValueError(f"{flag} lists {', '.join(map(str, repeated))} more than once: expected each {kind} once")
    if minimum is not None:
        low = [v for v in values if v < minimum]
        if low:
            raise ValueError(f"{flag} values must be >= {minimum}, but got {', '.join(map(str, low))}")


def where_it_began(row: dict[str, Any]) -> str:
    """A located row in words: from the restored step or, when accumulated, from the start."""
    if row.get("onset") is None and row.get("first_difference") is None:
        return "not located" if row.get("accumulated") is None else "no record differs"
    how = "accumulated; from the start: " if row.get("accumulated") else "restored step: "
    if row.get("location_from_attempt"):
        how = f"(as attempt {row['location_from_attempt']}, the same generation bitwise) " + how
    if row.get("onset") is not None:
        return how + "onset " + describe_point(row["onset"])
    return how + "no onset (every difference a tie); first difference " + describe_point(row["first_difference"])


def row_cells(row: dict[str, Any]) -> list[str]:
    """A divergent row's cells under ``ROW_HEAD`` (matrix and batch-invariance tables)."""
    if row["near_tie"] is None:
        tie = "-"
    else:
        tie = (f"yes (gap {row['gap']:.4g} <= {row['noise']:.4g})" if row["near_tie"]
               else f"no (gap {row['gap']:.4g} > {row['noise']:.4g})")
    return [row["path"], row["mode"], str(row["seed"]), str(row["batch"]), str(row["attempt"]), str(row["row"]),
            str(row["first_divergent_step"]), tie, where_it_began(row)]


ROW_HEAD = ["path", "mode", "seed", "batch", "attempt", "row", "step", "near-tie", "where it began"]
