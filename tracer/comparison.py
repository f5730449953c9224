"""Comparison: align two traces by (site, step), measure ULPs, attach verdicts, find the onset.

``compare(reference, candidate)`` gives one ``SiteDiff`` per aligned record — element count,
differing count, max ULP, histogram, bitwise equality, the ULP delta of the site's recorded
inputs (error inherited from upstream) and, with a ``SiteJudge``, the oracle's verdict counts and
named boundary. Missing and extra records and shape/dtype mismatches are listed, never crashed on.
``StreamingComparator`` does the same record by record as a recorder sink, keeping statistics only.
Masks are compared by what they let through (``ulptrace.masks``), whatever their encoding; the outputs of
one call (``ulptrace.sites.ONE_CALL``) are held to one design (``one_design_per_call``).

The *onset* is the first (step, site), in execution order, whose candidate introduced error of its
own (``Comparison.onsets`` lists every record that qualifies, with its reason):

- ``verdict``: any verdict worse than ``tie``;
- ``unjudged``: a record without verdicts (no oracle semantics, or the oracle could not judge it) that
  differs by more than ``max_ulp`` although every recorded input is bitwise equal — or, when it records
  no inputs at all (the GatedDeltaNet ``conv_state``/``recurrent_state``, the embedding), although every
  record before it in the same step is bitwise equal, inputs included;
- ``unobserved``: the first record whose output differs, when its recorded inputs already differ although
  every earlier record is bitwise equal (the divergence began in code no site observes);
- ``mask``: a record whose attention mask lets other keys through than the reference's, whatever came before.

Whether a comparison is *at parity* is decided in one place, ``Comparison.parity``, which the CLI exit
codes, ``trace_norm_rounding`` and the pytest fixture use: no verdict worse than ``tie``, no record
missing, extra or of another shape, no site the oracle could not judge, no ``unjudged``, ``unobserved`` or
``mask`` onset. "Could not judge" (the oracle failed on a site that has semantics) is its own
outcome with its reason (``SiteDiff.could_not_judge``), never counted as "no semantics".

Besides ULPs of each element's own dtype, every record has its difference in ULPs of the row's
magnitude (``max_row_ulp``, ``row_histogram``; a row is the last dimension): a near-zero element differs
by thousands of its own ULPs when its inputs move by one, which is nothing for its row.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from ulptrace.masks import MASK, STRUCTURAL_INPUTS, keys_seen, same_meaning_pair, visibility_pair
from ulptrace.oracle.judge import WORSE_THAN_TIE, explained_share
from ulptrace.record import LIVE_BYTES
from ulptrace.sites import ONE_CALL
from ulptrace.trace import Record, Trace, dtype_name
from ulptrace.ulp import (
    FORMATS,
    PendingStats,
    RecordStats,
    StatsBatch,
    bits,
    merge_record_stats,
    pending_stats,
    resolve_stats,
    same_bits,
)

ONSET_REASONS = ("mask", "unobserved", "unrecorded", "verdict", "unjudged")
COULD_NOT_JUDGE = "could_not_judge"
"""What ``Comparison.parity(allow=...)`` accepts besides verdict names: sites the oracle could not judge."""


class SiteJudge(Protocol):
    """Judges one aligned record pair with the oracle (see ``ulptrace.verdicts.OracleJudge``): the fields to set on
    the record's ``SiteDiff``, None, or an answer still on its way — an object whose ``result()`` gives them, read
    when the diff is finished (``ulptrace.judging.Pending``: judged in another process while the run goes on)."""

    def __call__(self, reference: Record, candidate: Record) -> Any: ...


@dataclass
class SiteDiff:
    """Statistics of one (site, step): what differs, by how many ULPs, and the oracle's verdict."""

    site: str
    step: int
    kind: str
    layer: int | None
    elements: int
    differing: int
    max_ulp: int | None
    histogram: dict[str, int]
    bitwise_equal: bool
    dtype: str
    shape: list[int]
    input_delta: dict[str, int | None] = field(default_factory=dict)
    # recorded inputs of another shape on the two sides (their delta is None): role -> [reference's, candidate's]
    input_shapes: dict[str, list[list[int]]] = field(default_factory=dict)
    verdicts: dict[str, int] | None = None
    boundary: str | None = None
    explained: float | None = None
    max_error_ulp: int | None = None
    reference_outside: int | None = None  # reference elements outside its own semantics
    note: str | None = None
    # the candidate's dtype where it stores another float dtype (compared in the reference's ``dtype``), else None
    candidate_dtype: str | None = None
    could_not_judge: str | None = None  # why the oracle failed on a site that has semantics
    max_row_ulp: float | None = None  # greatest difference in ULPs of its row's magnitude
    row_histogram: dict[str, int] = field(default_factory=dict)
    admissible_width: float | None = None  # median width of the admissible set, ULPs of the output (GDN scan)
    # {verdict: {ULP bucket: count}} of the differing elements (tie, boundary, error, nonfinite); None unjudged
    verdict_histogram: dict[str, dict[str, int]] | None = None

    @property
    def own_error(self) -> bool:
        """True when a verdict worse than ``tie`` says this site introduced a difference of its own."""
        return bool(self.verdicts) and any(self.verdicts.get(v, 0) for v in WORSE_THAN_TIE)

    @property
    def inputs_equal(self) -> bool:
        """Every recorded input is bitwise equal (None, an input that could not be compared, is not)."""
        return all(v == 0 for v in self.input_delta.values())

    @property
    def inputs_differ(self) -> bool:
        """Some recorded input measurably differs, or is of another shape on the two sides (None otherwise, e.g. a mask
        one path leaves to the kernel, is no evidence)."""
        return bool(self.input_shapes) or any(v for v in self.input_delta.values())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _stats(a: torch.Tensor, b: torch.Tensor, rows: bool = True, batch: StatsBatch | None = None
           ) -> PendingStats | RecordStats:
    """The statistics of two same-shape tensors of one dtype: pending (``ulptrace.ulp.pending_stats``, nothing
    waits for a CUDA device; queued in ``batch`` when given) for the float formats; counted now for integer /
    bool records (no ULPs). ``rows=False`` for a recorded input, whose row-magnitude statistics nobody reads."""
    if a.dtype in FORMATS:
        return pending_stats(a, b, rows=rows, batch=batch)
    return RecordStats(bitwise_equal(a, b), int((a != b).sum()), None, {}, None, {})


MOVE_CHUNK_BYTES = 256 << 20  # a reference on another device than its candidate moves over in parts this large


class _Parts(tuple):
    """The pending statistics of one pair compared in parts of whole rows (``ulptrace.ulp.merge_record_stats``)."""


Stats = PendingStats | RecordStats | _Parts


def _stats_to(ref: torch.Tensor, cand: torch.Tensor, rows: bool, batch: StatsBatch | None) -> Stats:
    """``_stats`` of a reference tensor and a candidate tensor, where the candidate's is: a reference kept on another
    device (host memory) is copied over asynchronously — a large one in parts of whole rows of at most
    ``MOVE_CHUNK_BYTES``, each part's statistics enqueued before the next part is copied, so comparing a long
    prompt's logits needs one part's room on the device, not a second copy of them."""
    where = cand.device
    if ref.device == where:
        return _stats(ref, cand, rows, batch)
    if ref.nbytes <= MOVE_CHUNK_BYTES or ref.dim() == 0 or ref.dtype not in FORMATS:  # (callers: same shapes)
        return _stats(ref.to(where, non_blocking=True), cand, rows, batch)
    n_cols = ref.shape[-1]
    per = max(1, MOVE_CHUNK_BYTES // max(1, n_cols * ref.element_size()))
    ref2, cand2 = ref.reshape(-1, n_cols), cand.reshape(-1, n_cols)
    parts = []
    for start in range(0, ref2.shape[0], per):
        parts.append(_stats(ref2[start:start + per].to(where, non_blocking=True), cand2[start:start + per], rows, batch))
        if batch is not None:
            batch.launch()  # this part's copy is read before the next one is made
    return _Parts(parts)


class _Cast(NamedTuple):
    """The statistics of a pair whose candidate is stored in another float dtype than the reference — counted in the
    reference's, the candidate cast to it — and how many elements hold another value than the reference's
    (``ulptrace.ulp.same_bits`` across dtypes: ``numel`` less ``same``, a 0-dim count read by ``finish_diffs``): a
    wider candidate's values that round to the reference's are not its values, so such a record is not "equal"."""

    stats: Stats
    same: torch.Tensor
    numel: int


def _cast_stats(ref: torch.Tensor, cand: torch.Tensor, rows: bool, batch: StatsBatch | None) -> _Cast:
    """:class:`_Cast` of a reference tensor and a candidate tensor of another float dtype, of one shape (a reference
    kept elsewhere is moved over once, for both)."""
    here = ref.to(cand.device, non_blocking=True)
    return _Cast(_stats_to(here, cand.to(ref.dtype), rows, batch), torch.count_nonzero(same_bits(here, cand)),
                 ref.numel())


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and bit patterns (NaN payloads and signed zeros
    count): the one test of "this record is bitwise equal" (bit patterns come from ``ulptrace.ulp.bits``)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(bits(a), bits(b)))


def without_cache_padding(record: Record, keep: int = 0) -> Record:
    """``record`` with the key/value positions that no query can see removed (``keep``: at least that many kept).

    A static KV cache pads keys and values to the cache length and hides the unused tail; a dynamic
    cache holds only the live positions. Attention over hidden positions contributes exact zeros, so
    both describe the same computation: trimming the tail after the last visible key lets either be
    compared with, and judged by the semantics of, the other. Visible keys come from the mask (bool,
    or additive with the dtype's lowest value / -inf where hidden) when it spans the key length;
    without a mask, a multi-token query is causal top-left aligned (HF's SDPA prefill: ``is_causal``),
    so keys past the query length are hidden. Records without ``key``/``value`` are returned as is.
    Two records to compare are trimmed to one length (``without_cache_padding_pair``).
    """
    used = _keys_used(record)
    if used is None:
        return record
    length = record.inputs["key"].shape[-2]
    used = min(max(used, keep), length)
    if used == length:
        return record
    inputs = dict(record.inputs)
    key, value, mask = inputs["key"], inputs["value"], inputs.get("attention_mask")
    inputs["key"], inputs["value"] = key[..., :used, :], value[..., :used, :]
    if mask is not None:
        inputs["attention_mask"] = mask[..., :used]
    return Record(record.site, record.step, record.kind, record.layer, record.out, inputs)


def without_cache_padding_pair(reference: Record, candidate: Record) -> tuple[Record, Record]:
    """Both records without their cache padding, trimmed to one length: the longer of the two sides' last visible
    keys — a key one side hides and the other sees (a mask that hides the newest key) stays on both, to be compared
    rather than cut from one side only."""
    keep = max(_keys_used(reference) or 0, _keys_used(candidate) or 0)
    return without_cache_padding(reference, keep), without_cache_padding(candidate, keep)


def _keys_used(record: Record) -> int | None:
    """How many leading keys of an attention record some query can see (``without_cache_padding``,
    ``ulptrace.masks.keys_seen``); None for a record without keys and values."""
    inputs = record.inputs
    if "key" not in inputs:  # most records: no attention inputs
        return None
    query, key, value = inputs.get("query"), inputs["key"], inputs.get("value")
    if key is None or value is None or key.dim() < 2:
        return None
    queries = query.shape[-2] if query is not None and query.dim() >= 2 else 1
    return keys_seen(inputs.get(MASK), queries, key.shape[-2])


def _visibility_stats(reference: Record, candidate: Record
                      ) -> tuple[Stats | None, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """Two attention records (trimmed: ``without_cache_padding_pair``) of which one holds keys the other does not,
    visible to it (a kernel handed no mask over a static cache's padding, against a dynamic cache's live keys): the
    mask's statistics compare what each side's attention lets through (``ulptrace.masks.visibility_pair``: a mask
    left to the kernel read by HF's convention), and the inputs to compare with them: keys and values over the keys
    both hold (the longer side's extra keys are the mask's difference, not theirs). None for records without keys,
    for keys of one length (a mask one side leaves to the kernel there is no evidence: the kernel may be given its
    masking otherwise, e.g. a sliding window) and where either mask has no plain visibility (the keys' shapes are
    then named as they are)."""
    r_in, c_in = reference.inputs, candidate.inputs
    if "key" not in r_in or "key" not in c_in or "query" not in r_in or "query" not in c_in:
        return None
    r_key, c_key = r_in["key"], c_in["key"]
    if r_key.dim() < 2 or c_key.dim() < 2 or r_in["query"].dim() < 2 or c_in["query"].dim() < 2:
        return None
    r_keys, c_keys = r_key.shape[-2], c_key.shape[-2]
    if r_keys == c_keys:
        return None
    pair = visibility_pair((r_in.get(MASK), r_in["query"].shape[-2], r_keys),
                           (c_in.get(MASK), c_in["query"].shape[-2], c_keys), r_key.device)
    if pair is None:
        return None
    shared = min(r_keys, c_keys)
    r_in = {**r_in, **{role: r_in[role][..., :shared, :] for role in ("key", "value") if role in r_in}}
    c_in = {**c_in, **{role: c_in[role][..., :shared, :] for role in ("key", "value") if role in c_in}}
    return _stats(*pair, False), r_in, c_in


def diff_records(reference: Record, candidate: Record, judge: SiteJudge | None = None) -> SiteDiff | dict:
    """A ``SiteDiff`` for two records of the same (site, step), or a mismatch dict (shape/dtype)."""
    pending = start_diff(reference, candidate, judge)
    return pending if isinstance(pending, dict) else finish_diffs([pending])[0]


class KnownPairs:
    """Statistics already started for a (reference tensor, candidate tensor) pair, found again by identity.

    A site's recorded input is often another site's output — the same tensor object on each side (the recorder
    keeps one copy per observation) — so it is compared once. Held by weak references: an entry lives as long
    as both tensors do, and nothing is kept alive for it. The entries of tensors that are gone are dropped when the
    table has grown to twice what the last such pass left (at least ``PRUNE_AT``): a pass over it each time it passed
    a fixed size cost every later ``put`` a pass over the whole table while more pairs than that lived (an oracle's
    queue holding a run's records, or a benchmark's) — 1.7 ms a put: a comparison of the 0.8B shape's 8 x 128 tokens,
    16 steps, took 8.8 s on an H100, 0.71 s now (``bench/bench_compare_cost.py``; ``bench/RESULTS.md``, thirty-fourth
    round).
    """

    PRUNE_AT = 4096

    def __init__(self) -> None:
        self._pairs: dict[tuple[int, int], tuple[Any, Any, Stats, bool]] = {}
        self._prune_at = self.PRUNE_AT
        self.prunes = 0  # passes over the table (each drops the entries of tensors that are gone)

    def put(self, a: torch.Tensor, b: torch.Tensor, stats: Stats, rows: bool = False) -> None:
        """Keep ``stats`` of the pair; ``rows``: they hold the row statistics an output needs (an input's do not)."""
        if len(self._pairs) >= self._prune_at:  # drop the entries of tensors that are gone
            self._pairs = {k: v for k, v in self._pairs.items() if v[0]() is not None and v[1]() is not None}
            self._prune_at = max(self.PRUNE_AT, 2 * len(self._pairs))
            self.prunes += 1
        self._pairs[id(a), id(b)] = (weakref.ref(a), weakref.ref(b), stats, rows)

    def __len__(self) -> int:
        """Entries held (those of tensors gone since the last pass among them)."""
        return len(self._pairs)

    def get(self, a: torch.Tensor, b: torch.Tensor, rows: bool = False) -> Stats | None:
        """The pair's statistics, if kept (with row statistics, when ``rows`` asks for them)."""
        entry = self._pairs.get((id(a), id(b)))
        if entry is None or entry[0]() is not a or entry[1]() is not b or (rows and not entry[3]):
            return None
        return entry[2]


def start_diff(reference: Record, candidate: Record, judge: SiteJudge | None = None,
               known: KnownPairs | None = None, batch: StatsBatch | None = None) -> _PendingDiff | dict:
    """``diff_records`` without waiting for the device: the statistics are enqueued (read them, for many
    records at once, with ``finish_diffs``); the judge, if any, runs now. A mismatch dict as ``diff_records``.
    ``known``: pairs compared before (``KnownPairs``), reused for the inputs and extended with this record's.
    ``batch``: a ``StatsBatch`` that launches the CUDA statistics of many records together (the records'
    tensors must not change until then)."""
    reference, candidate = without_cache_padding_pair(reference, candidate)
    ref, cand = reference.out, candidate.out
    shape, dtype = ref.shape, ref.dtype  # (each read of a tensor's shape makes a new object: read once)
    cand_shape, cand_dtype = cand.shape, cand.dtype
    note = None
    cast = dtype != cand_dtype and shape == cand_shape and ref.is_floating_point() and cand.is_floating_point()
    if cast:
        # e.g. a kernel that emits the GDN decay gate in BF16 where HF keeps FP32: compare (and judge) in the
        # reference's dtype, and say so; a narrower candidate converts exactly.
        # ULP statistics are in the reference's dtype; equal and differing say whether the candidate's own values
        # are the reference's; the oracle judges the candidate's own values (a wider candidate that skips the
        # final rounding is then a boundary, not hidden by a cast).
        note = (f"candidate stores {dtype_name(cand_dtype)}, reference {dtype_name(dtype)}: ULPs counted in "
                "the reference's dtype")
    elif shape != cand_shape or dtype != cand_dtype:
        return {
            "site": reference.site, "step": reference.step,
            "reason": f"reference has {dtype_name(dtype)} {list(shape)}, "
                      f"candidate has {dtype_name(cand_dtype)} {list(cand_shape)}",
        }
    # statistics where the candidate's record was produced, started without waiting for the device
    inputs: dict[str, Stats | None] = {}
    reshaped: dict[str, list[list[int]]] = {}
    reference_inputs, candidate_inputs = reference.inputs, candidate.inputs
    visibility = _visibility_stats(reference, candidate)
    if visibility is not None:  # one side sees keys the other does not hold
        inputs[MASK], reference_inputs, candidate_inputs = visibility
    for role, r_in in reference_inputs.items():
        if role in inputs:
            continue
        c_in = candidate_inputs.get(role)
        if role in STRUCTURAL_INPUTS and c_in is not None and (c_in.dtype != r_in.dtype or c_in.shape != r_in.shape):
            # a mask encoded or shaped otherwise (bool / additive, broadcast): compared by what it lets through
            pair = same_meaning_pair(r_in, c_in)
            inputs[role] = None if pair is None else _stats(*pair, False)
            continue
        if c_in is None or c_in.shape != r_in.shape:
            inputs[role] = None
            # both recorded as floats of one dtype, shaped otherwise: another quantity (rotary tables of another
            # width), by no ULP count; a mask a path leaves out, or one with no plain visibility, is no evidence
            if c_in is not None and c_in.dtype == r_in.dtype and r_in.is_floating_point():
                reshaped[role] = [list(r_in.shape), list(c_in.shape)]
            continue
        if c_in.dtype != r_in.dtype:  # stored in another float dtype: compared as the output is; else not at all
            both_float = c_in.is_floating_point() and r_in.is_floating_point()
            inputs[role] = _cast_stats(r_in, c_in, False, batch) if both_float else None
            continue
        seen = known.get(r_in, c_in) if known is not None else None
        if seen is None:
            seen = _stats_to(r_in, c_in, False, batch)
            if known is not None:
                known.put(r_in, c_in, seen)
        inputs[role] = seen
    if cast:
        stats = _cast_stats(ref, cand, True, batch)
    else:  # an output another record already had (the logits the model returns are its head's): compared once
        stats = known.get(ref, cand, rows=True) if known is not None else None
        if stats is None:
            stats = _stats_to(ref, cand, True, batch)
            if known is not None:  # the output as recorded (not cast): another record may read it
                known.put(reference.out, candidate.out, stats, rows=True)
    pending = _PendingDiff((reference.site, reference.step, reference.kind, reference.layer), ref.numel(),
                           list(shape), dtype_name(dtype), note, stats, inputs, reshaped,
                           candidate_dtype=dtype_name(cand_dtype) if cast else None)
    if judge is not None:
        pending.judged = judge(reference, candidate)
    return pending


@dataclass
class _PendingDiff:
    """A ``SiteDiff`` whose statistics may still be computing on the device (``finish_diffs`` completes it)."""

    key: tuple[str, int, str, int | None]  # the reference record's site, step, kind, layer (not its tensors)
    elements: int
    shape: list[int]
    dtype: str
    note: str | None
    stats: Stats
    inputs: dict[str, Stats | None]
    reshaped: dict[str, list[list[int]]]  # SiteDiff.input_shapes
    judged: Any = None  # the judge's fields, or an answer still on its way (SiteJudge)
    candidate_dtype: str | None = None  # SiteDiff.candidate_dtype


def finish_diffs(pending: list[_PendingDiff]) -> list[SiteDiff]:
    """The ``SiteDiff`` of each ``start_diff`` result, in order, waiting for the device once."""
    waiting = []
    casts: dict[torch.device, list[_Cast]] = {}
    for p in pending:
        for x in (p.stats, *p.inputs.values()):
            if type(x) is _Cast:
                casts.setdefault(x.same.device, []).append(x)
                x = x.stats
            if type(x) is PendingStats:
                waiting.append(x)
            elif type(x) is _Parts:
                waiting += [part for part in x if type(part) is PendingStats]
    resolve_stats(waiting)  # each one's value is known now
    # the counts of the pairs stored in another dtype, one read of each device for them all
    differing = {id(c): c.numel - n for group in casts.values()
                 for c, n in zip(group, torch.stack([c.same for c in group]).tolist(), strict=True)}

    def done(x: Stats) -> RecordStats:
        kind = type(x)
        if kind is PendingStats:
            return x.value
        if kind is _Parts:
            return merge_record_stats([done(part) for part in x])
        if kind is _Cast:
            return done(x.stats)._replace(equal=differing[id(x)] == 0, differing=differing[id(x)])
        return x

    diffs = []
    for p in pending:
        stats = done(p.stats)
        inputs: dict[str, int | None] = {}
        for role, x in p.inputs.items():
            if x is None:
                inputs[role] = None
                continue
            got = done(x)
            # the largest finite ULP distance; 1 for an input that differs where no element is a finite distance
            # apart (a NaN on one side, a zero of the other sign), which a 0 would call equal; without ULPs (an
            # integer input), 1 where it differs
            inputs[role] = got.max_ulp or int(not got.equal)
        site, step, kind, layer = p.key
        diff = SiteDiff(
            site=site, step=step, kind=kind, layer=layer, elements=p.elements, differing=stats.differing,
            max_ulp=stats.max_ulp, histogram=stats.histogram, bitwise_equal=stats.equal, dtype=p.dtype,
            shape=p.shape, input_delta=inputs, input_shapes=p.reshaped, note=p.note, max_row_ulp=stats.max_row_ulp,
            row_histogram=stats.row_histogram, candidate_dtype=p.candidate_dtype,
        )
        judged = p.judged
        if judged is not None and callable(getattr(judged, "result", None)):
            judged = judged.result()
        for key, value in (judged or {}).items():
            if key == "note" and diff.note:
                value = f"{diff.note}; {value}"
            setattr(diff, key, value)
        diffs.append(diff)
    return diffs


@dataclass
class Comparison:
    """The result of comparing two traces (or a streamed candidate against a reference)."""

    sites: list[SiteDiff] = field(default_factory=list)
    missing: list[dict[str, Any]] = field(default_factory=list)  # in the reference only
    extra: list[dict[str, Any]] = field(default_factory=list)  # in the candidate only
    mismatched: list[dict[str, Any]] = field(default_factory=list)  # shape or dtype differ
    reference: dict[str, Any] = field(default_factory=dict)  # metadata
    candidate: dict[str, Any] = field(default_factory=dict)
    max_ulp: int = 0
    observation: dict[str, Any] | None = None  # result of the observation check, if run

    @property
    def parameters(self) -> dict[str, list[str]] | None:
        """Parameters whose checksums differ between the two runs, or exist on one side only
        (None when a trace carries no checksums). A stale or re-quantised weight copy in a kernel
        shows here even where no site's verdict would name it."""
        ref, cand = self.reference.get("parameters"), self.candidate.get("parameters")
        if not isinstance(ref, dict) or not isinstance(cand, dict):
            return None
        return {
            "differing": sorted(n for n in ref.keys() & cand.keys() if ref[n] != cand[n]),
            "only_reference": sorted(ref.keys() - cand.keys()),
            "only_candidate": sorted(cand.keys() - ref.keys()),
        }

    @property
    def complete(self) -> bool:
        """Whether both runs recorded every site at every step (no ``selection`` of sites, kinds, layers or
        steps in their metadata). The rules that rely on "every earlier record is bitwise equal" hold only
        then: with a selection, an unselected site may be where a difference began."""
        return not self._selects()

    @property
    def left_out(self) -> bool:
        """Whether a run's selection left out sites, kinds, layers or steps it could have recorded (a user's choice:
        ``--sites``, ``--kinds``, ``--layers``, ``--steps``), as opposed to sites a candidate's path cannot expose
        (``selection.observed`` alone, e.g. under ``torch.compile``), which no run can record."""
        return self._selects(but="observed")

    def _selects(self, but: str | None = None) -> bool:
        """Whether either run's metadata names a selection (any of its entries set, ``but`` one not counted)."""
        return any(any(v not in (None, [], "") for k, v in (meta.get("selection") or {}).items() if k != but)
                   for meta in (self.reference, self.candidate))

    def first_difference(self) -> SiteDiff | None:
        return next((d for d in self.sites if not d.bitwise_equal), None)

    def onset(self) -> SiteDiff | None:
        return self.onset_with_reason()[0]

    def onset_with_reason(self) -> tuple[SiteDiff | None, str | None]:
        """The onset and why it is one: the first of :meth:`onsets`, or ``(None, None)``."""
        return next(self.onsets(), (None, None))

    def onsets(self) -> Iterator[tuple[SiteDiff, str]]:
        """Every record that introduced a difference of its own, in execution order, with the reason
        (one of ``ONSET_REASONS``; where several apply to one record, the first in that order):

        - ``"mask"``: its attention mask lets other keys through than the reference's (compared by meaning,
          ``ulptrace.masks``: a mask left to the kernel read by HF's convention, keys one side does not hold
          hidden on it), whatever came before: a mask is built from positions and lengths, not from values,
          so no rounding upstream explains it — and the oracle judges the record with its own mask, so its verdict
          alone would not show it;
        - ``"unobserved"`` (at most one): the first record whose output differs, when its recorded inputs
          already differ although every earlier record is bitwise equal — the divergence began in code
          between observed sites (RoPE, the KV cache, a reshape) and this site is the first place it shows;
          so even where this record's own verdict is worse than ``tie`` too (a NaN or infinity written into a
          cached key makes the attention's semantics on its inputs non-finite), the divergence began before it;
        - ``"unrecorded"`` (at most one): the same first record where a selection left out sites it could have
          recorded (:attr:`left_out`) — the divergence began in code it did not record, which may hold a defect no
          recorded site can judge: such a selection never claims parity for differences it did not see begin (sites a
          path cannot expose, ``selection.observed`` alone, are judged as before: its report says which it exposes);
        - ``"verdict"``: a verdict worse than ``tie`` (boundary, error, nonfinite);
        - ``"unjudged"``: no verdicts (no oracle semantics, or the oracle could not judge it), the output
          differs by more than ``max_ulp`` and every recorded input is bitwise equal; a record with no
          recorded inputs (a GatedDeltaNet state, the embedding) qualifies when every record before it
          in the same step is bitwise equal, outputs and inputs.

        The two rules that look at earlier records (a record without inputs, ``unobserved``) apply only
        when the comparison is :attr:`complete`: in a selection the unrecorded sites may differ — there the first
        one's record is ``unrecorded`` instead, where the selection :attr:`left_out` what it could have recorded.
        """
        complete, left_out = self.complete, self.left_out
        seen_difference = False  # an earlier record's output differs
        clean_steps: dict[int, bool] = {}  # step -> every record so far in it is equal, outputs and inputs
        for d in self.sites:
            step_clean = clean_steps.get(d.step, True)
            if any(d.input_delta.get(role) for role in STRUCTURAL_INPUTS):
                yield d, "mask"
            elif not seen_difference and not d.bitwise_equal and d.inputs_differ and (complete or left_out):
                yield d, "unobserved" if complete else "unrecorded"
            elif d.own_error:
                yield d, "verdict"
            elif d.verdicts is None and not d.bitwise_equal and (d.max_ulp is None or d.max_ulp > self.max_ulp) \
                    and (d.inputs_equal if d.input_delta else complete and step_clean):
                yield d, "unjudged"
            seen_difference = seen_difference or not d.bitwise_equal
            clean_steps[d.step] = step_clean and d.bitwise_equal and d.inputs_equal

    def parity(self, allow: Iterable[str] = ()) -> Parity:
        """Is the candidate at parity with the reference? The one decision every gate uses.

        Not at parity when any record has a verdict worse than ``tie``, the oracle could not judge a site
        that has semantics, a record is missing, extra or of another shape or dtype, or a record is an
        ``unjudged``, ``unobserved`` or ``mask`` onset (:meth:`onsets`). ``allow`` names what to tolerate: verdicts
        of ``WORSE_THAN_TIE`` (e.g. ``("boundary",)`` for kernels whose boundaries are intended) and
        ``"could_not_judge"`` (such a site is then held to ``max_ulp`` like one without semantics).

        Raises:
            ValueError: ``allow`` names something else.
        """
        allowed = tuple(allow)
        known = WORSE_THAN_TIE + (COULD_NOT_JUDGE,)
        unknown = [a for a in allowed if a not in known]
        if unknown:
            raise ValueError(f"allow must name some of {', '.join(known)}, but got {', '.join(map(repr, unknown))}")
        failures: list[Failure] = []
        # a named boundary last: the errors and nonfinite elements beside one that explains a few come first
        for verdict in sorted(WORSE_THAN_TIE, key=lambda v: v == "boundary"):
            hit = [d for d in self.sites if (d.verdicts or {}).get(verdict)]
            if hit and verdict not in allowed:
                failures.append(_verdict_failure(verdict, hit))
        unjudgeable = [d for d in self.sites if d.could_not_judge]
        if unjudgeable and COULD_NOT_JUDGE not in allowed:
            first = unjudgeable[0]
            failures.append(Failure(COULD_NOT_JUDGE, len(unjudgeable), _where(first),
                                    f"the oracle could not judge {len(unjudgeable)} record(s); first at "
                                    f"{_at(first)}: {first.could_not_judge}"))
        for key, what in (("missing", "missing in the candidate"), ("extra", "only in the candidate"),
                          ("mismatched", "of another shape or dtype")):
            records = getattr(self, key)
            if records:
                shown = ", ".join(f"{m['site']}@{m['step']}" + (f" ({m['reason']})" if "reason" in m else "")
                                  for m in records[:3])
                more = f" (+{len(records) - 3} more)" if len(records) > 3 else ""
                failures.append(Failure(key, len(records), {"step": records[0]["step"], "site": records[0]["site"]},
                                        f"{len(records)} record(s) {what}: {shown}{more}"))
        for reason in ("unjudged", "unobserved", "unrecorded", "mask"):
            hit = [d for d, r in self.onsets() if r == reason]
            if hit:
                failures.append(_onset_failure(reason, hit, self.max_ulp))
        return Parity(tuple(failures), allowed)

    def to_json(self, allow: Iterable[str] = ()) -> dict[str, Any]:
        """The documented JSON contract (README, "JSON output"): keys are added, never renamed.
        ``parity`` is :meth:`parity` with ``allow``."""

        def point(d: SiteDiff | None) -> dict[str, Any] | None:
            return None if d is None else {"step": d.step, "site": d.site, "kind": d.kind, "layer": d.layer}

        onset, reason = self.onset_with_reason()
        return {
            "schema": "ulptrace.comparison",
            "version": 1,
            "first_difference": point(self.first_difference()),
            "onset": None if onset is None else {**point(onset), "reason": reason},
            "max_ulp_budget": self.max_ulp,
            "complete": self.complete,
            "reference": self.reference,
            "candidate": self.candidate,
            "observation": self.observation,
            "parameters": self.parameters,
            "missing": self.missing,
            "extra": self.extra,
            "mismatched": self.mismatched,
            "sites": [d.to_json() for d in self.sites],
            "could_not_judge": [{**point(d), "reason": d.could_not_judge} for d in self.sites if d.could_not_judge],
            "parity": self.parity(allow).to_json(),
        }


@dataclass(frozen=True)
class Failure:
    """One reason a comparison is not at parity: what failed (``kind``: a verdict name, ``could_not_judge``,
    ``missing``, ``extra``, ``mismatched``, ``unjudged``, ``unobserved``, ``unrecorded`` or ``mask``), in how many
    records, the first of them, and a sentence naming it."""

    kind: str
    records: int
    first: dict[str, Any]
    message: str


@dataclass(frozen=True)
class Parity:
    """The result of ``Comparison.parity``: true when nothing failed; ``failures`` say exactly what did."""

    failures: tuple[Failure, ...]
    allowed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        """One line: ``at parity`` or ``not at parity: <every failure>``."""
        if self.ok:
            return "at parity" + (f" (allowed: {', '.join(self.allowed)})" if self.allowed else "")
        return "not at parity: " + "; ".join(f.message for f in self.failures)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "allowed": list(self.allowed), "failures": [asdict(f) for f in self.failures]}


def _where(d: SiteDiff) -> dict[str, Any]:
    return {"step": d.step, "site": d.site, "kind": d.kind, "layer": d.layer}


def _at(d: SiteDiff) -> str:
    return f"step {d.step}, {d.site} ({d.kind})"


def _verdict_failure(verdict: str, hit: list[SiteDiff]) -> Failure:
    first = hit[0]
    elements = sum(d.verdicts[verdict] for d in hit)
    text = f"{elements} {verdict} element(s) in {len(hit)} record(s); first at {_at(first)}"
    if verdict == "boundary" and first.boundary:
        share = "" if first.explained is None else f", explains {explained_share(first.explained)} of its out-of-set elements"
        text += f": {first.boundary}{share}"
    elif verdict == "error" and first.max_error_ulp is not None:
        text += f": up to {first.max_error_ulp} ULP outside the admissible set"
    return Failure(verdict, len(hit), _where(first), text)


def _onset_failure(reason: str, hit: list[SiteDiff], budget: int) -> Failure:
    first = hit[0]
    if reason == "unjudged":
        why = (f"differs by up to {first.max_ulp} ULP (budget {budget}) without verdicts, although "
               + ("its recorded inputs are bitwise equal" if first.input_delta else
                  "every record before it in the same step is bitwise equal"))
    elif reason == "mask":
        roles = ", ".join(r for r in STRUCTURAL_INPUTS if first.input_delta.get(r))
        why = f"its {roles} lets other keys through than the reference's (a mask is built from positions, not values)"
    else:
        shaped = "".join(f"; its input '{role}' is {ref} in the reference, {cand} in the candidate"
                         for role, (ref, cand) in first.input_shapes.items())
        where = ("unobserved code" if reason == "unobserved" else
                 "code this selection did not record: record every site to judge it")
        why = f"its inputs already differ while every earlier record is bitwise equal (divergence in {where}){shaped}"
    return Failure(reason, len(hit), _where(first), f"{len(hit)} {reason} onset(s); first at {_at(first)}: {why}")


class StreamingComparator:
    """A recorder sink comparing each candidate record against ``reference`` as it arrives.

    Keeps only ``SiteDiff`` statistics; the reference can be a ``Trace`` or a ``LazyTrace`` on
    disk (read one step shard at a time), so memory stays bounded for long runs. On a GPU the statistics
    of up to ``BATCH`` records are read from the device together (``result.sites`` is complete after
    ``finish``), so the traced run is not stopped at every site to wait for them, and they are launched together
    (``ulptrace.ulp.StatsBatch``: a few kernel launches per step instead of one per record; a recorder's records
    are copies nothing writes to, as a batch requires). A recorder hands it values of ``live_bytes`` or more
    uncopied (``ulptrace.record.Sink.live_bytes``): a record holding one has its statistics launched before ``add``
    returns, so they read the value as it was observed — a long prompt's logits are compared where the model left
    them, never copied. ``judging(done, total)`` follows the judging of the pairs an ``OracleJudge`` holds (stacks
    judged: ``OracleJudge.replayed_many``), which happens when the statistics are read (``finish``) — a progress bar's
    phase of its own (``ulptrace.progress.Progress.counter``).
    """

    # each read-back waits for the device (the run loses its lead over the GPU): fewer of them. On the H200 (8 x 128,
    # 16 steps) 4,096 against 256 read 1.88x vs 2.10x in one call and 1.80x vs 1.46x in the next: within that
    # host's noise, not a measured gain (RESULTS.md, eighth round). Kept: waiting less often cannot lose overlap, and
    # 4,096 records' pending statistics hold ~1 MiB of result slabs on the device
    BATCH = 4096
    live_bytes = LIVE_BYTES

    def __init__(self, reference: Any, *, judge: SiteJudge | None = None, max_ulp: int = 0,
                 metadata: dict[str, Any] | None = None, release: bool = False,
                 judging: Callable[[int, int], None] | None = None) -> None:
        self.reference = reference
        # a judge that can hold pairs and judge them together (OracleJudge.queued: the replays of one program shared)
        # is used so; its answers are read in finish_diffs, and judging(done, total) follows its stacks
        self.judge = judge.queued(progress=judging) if callable(getattr(judge, "queued", None)) else judge
        self.release = release and hasattr(reference, "pop")  # free each reference record once compared
        # a reference that streams in (ulptrace.concurrent.RemoteTrace) knows its keys once it has finished
        self._keys = list(reference.keys()) if self.release and not getattr(reference, "streaming", False) \
            else None
        self.result = Comparison(reference=dict(getattr(reference, "metadata", {})), max_ulp=max_ulp,
                                 candidate=dict(metadata or {}))
        self._seen: set[tuple[str, int]] = set()
        self._pending: list[_PendingDiff] = []
        self._known = KnownPairs()
        self._batch = StatsBatch()

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Called by the recorder on entry: the candidate run's metadata."""
        self.result.candidate = dict(metadata)

    def add(self, record: Record) -> None:
        self._seen.add(record.key)
        ref = self.reference.pop(record.key) if self.release else self.reference.get(record.key)
        if ref is None:
            self.result.extra.append({"site": record.site, "step": record.step})
            return
        diff = start_diff(ref, record, self.judge, self._known, self._batch)
        if isinstance(diff, dict):
            self.result.mismatched.append(diff)
            return
        live = self.live_bytes
        if record.out.nbytes >= live or any(t.nbytes >= live for t in record.inputs.values()):
            self._batch.launch()  # it may hold the model's own values (Sink.live_bytes): read them now
        self._pending.append(diff)  # its statistics are read, with the next ones', without stalling the run
        if len(self._pending) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        self.result.sites += finish_diffs(self._pending)
        self._pending = []

    def finish(self) -> Comparison:
        self._flush()
        if self._keys is not None:
            keys = self._keys
        else:
            keys = self.reference.keys() if hasattr(self.reference, "keys") else [r.key for r in self.reference]
        self.result.missing = [{"site": s, "step": t} for s, t in keys if (s, t) not in self._seen]
        one_design_per_call(self.result.sites)
        return self.result


def one_design_per_call(sites: list[SiteDiff]) -> None:
    """Outputs of one call on the same inputs (``ulptrace.sites.ONE_CALL``: the GatedDeltaNet scan's output and its
    state, at one layer and step) share one design: where any of them has ``error`` elements — no hypothesis explains
    them — no design explains the call, so every ``boundary`` element of it is an error too, and the record's note
    says why. A hypothesis wide enough to cover a defect in one output (the chunked form's BF16 roundings at a
    one-token decode cover a decay a few percent off in the scan's output; the state, kept in FP32, shows it) explains
    nothing about the call. Applied to a finished comparison's records in place (``StreamingComparator.finish``)."""
    calls: dict[tuple[int, str, tuple[str, ...]], list[SiteDiff]] = {}
    for d in sites:
        for names in ONE_CALL:
            for name in names:
                if d.site == name or d.site.endswith("." + name):
                    calls.setdefault((d.step, d.site[:-len(name)], names), []).append(d)
    for members in calls.values():
        failing = [(d.site, d.verdicts["error"]) for d in members if d.verdicts and d.verdicts.get("error")]
        for d in members:
            moved = (d.verdicts or {}).get("boundary", 0)
            if not failing or not moved:
                continue
            others = [f"{'this record' if site == d.site else site} ({n} error element(s))" for site, n in failing]
            d.verdicts = {**d.verdicts, "boundary": 0, "error": d.verdicts["error"] + moved}
            if d.verdict_histogram:
                histogram = {k: dict(v) for k, v in d.verdict_histogram.items()}
                for bucket, n in histogram.get("boundary", {}).items():
                    histogram.setdefault("error", {})[bucket] = histogram.get("error", {}).get(bucket, 0) + n
                    histogram["boundary"][bucket] = 0
                d.verdict_histogram = histogram
            why = (f"{moved} element(s) outside the admissible set counted as errors, not as the boundary "
                   f"'{d.boundary}': {', '.join(others)} in the same call — one design must explain it all")
            d.note = f"{d.note}; {why}" if d.note else why
            d.boundary, d.explained = None, None


def compare(reference: Trace | Any, candidate: Trace | Iterable[Record], *, judge: SiteJudge | None = None,
            max_ulp: int = 0) -> Comparison:
    """Align ``candidate`` with ``reference`` by (site, step) and compare every pair.

    Both may be ``Trace`` or ``LazyTrace``; ``judge`` (an ``OracleJudge``) adds verdicts.
    """
    streaming = StreamingComparator(reference, judge=judge, max_ulp=max_ulp,
                                    metadata=getattr(candidate, "metadata", {}))
    for record in candidate:
        streaming.add(record)
    return streaming.finish()


def first_difference(comparison: Comparison) -> SiteDiff | None:
    """The first (step, site) in execution order whose output is not bitwise equal."""
    return comparison.first_difference()


def onset(comparison: Comparison) -> SiteDiff | None:
    """The first (step, site) in execution order that introduced error of its own (see module doc)."""
    return comparison.onset()
