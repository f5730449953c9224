"""Comparison: align two traces by (site, step), measure ULPs, attach verdicts, find the onset.

``compare(reference, candidate)`` gives one ``SiteDiff`` per aligned record — element count,
differing count, max ULP, histogram, bitwise equality, the ULP delta of the site's recorded
inputs (error inherited from upstream) and, with a ``SiteJudge``, the oracle's verdict counts and
named boundary. Missing and extra records and shape/dtype mismatches are listed, never crashed on.
``StreamingComparator`` does the same record by record as a recorder sink, keeping statistics only.

The *onset* is the first (step, site), in execution order, whose candidate introduced error of its
own: any verdict worse than ``tie``; for a site whose kind has no oracle semantics, a difference
above ``max_ulp`` although every recorded input was bitwise equal; or the first site whose recorded
inputs differ although no earlier record differs (the divergence began in unobserved code).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from ulptrace.trace import Record, Trace
from ulptrace.ulp import FORMATS, ulp_distance, ulp_histogram

BAD_VERDICTS = ("boundary", "error", "nonfinite")


class SiteJudge(Protocol):
    """Judges one aligned record pair with the oracle (see ``ulptrace.verdicts.OracleJudge``)."""

    def __call__(self, reference: Record, candidate: Record) -> dict[str, Any] | None: ...


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
    verdicts: dict[str, int] | None = None
    boundary: str | None = None
    explained: float | None = None
    max_error_ulp: int | None = None
    reference_outside: int | None = None  # reference elements outside its own semantics
    note: str | None = None

    @property
    def own_error(self) -> bool:
        """True when this site introduced a difference of its own (see module docstring)."""
        if self.verdicts is not None:
            return any(self.verdicts.get(v, 0) for v in BAD_VERDICTS)
        return False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ulp_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int | None, dict[str, int]]:
    """(differing count, max ULP or None when not measurable, histogram) of two same-shape tensors."""
    if a.dtype in FORMATS:
        dist = ulp_distance(a, b)
        hist = ulp_histogram(dist.distance, dist.nan)
        differing = int(a.numel() - hist["0"])
        finite = dist.distance[~dist.nan]
        max_ulp = int(finite.max()) if finite.numel() else 0
        return differing, max_ulp, hist
    differing = int((a != b).sum())  # integer / bool records: count only
    return differing, None, {}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a floating tensor as integers (so NaN == NaN and -0 != +0); others as is."""
    if not t.dtype.is_floating_point:
        return t
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and bit patterns (NaN payloads and signed zeros count)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(bits(a), bits(b)))


def without_cache_padding(record: Record) -> Record:
    """``record`` with the key/value positions that no query can see removed.

    A static KV cache pads keys and values to the cache length and hides the unused tail; a dynamic
    cache holds only the live positions. Attention over hidden positions contributes exact zeros, so
    both describe the same computation: trimming the tail after the last visible key lets either be
    compared with, and judged by the semantics of, the other. Visible keys come from the mask (bool,
    or additive with the dtype's lowest value / -inf where hidden) when it spans the key length;
    without a mask, a multi-token query is causal top-left aligned (HF's SDPA prefill: ``is_causal``),
    so keys past the query length are hidden. Records without ``key``/``value`` are returned as is.
    """
    query, key, value = (record.inputs.get(r) for r in ("query", "key", "value"))
    mask = record.inputs.get("attention_mask")
    if key is None or value is None or key.dim() < 2:
        return record
    length = key.shape[-2]
    if mask is None:
        if query is None or query.dim() < 2 or not 1 < query.shape[-2] < length:
            return record
        used = query.shape[-2]
    elif mask.shape[-1] != length:
        return record
    else:
        if mask.dtype == torch.bool:
            live = mask
        else:
            live = (mask != float("-inf")) & (mask != torch.finfo(mask.dtype).min)
        live = live.reshape(-1, length).any(0)
        used = int(live.nonzero().max()) + 1 if bool(live.any()) else 0
    if used == length:
        return record
    inputs = dict(record.inputs)
    inputs["key"], inputs["value"] = key[..., :used, :], value[..., :used, :]
    if mask is not None:
        inputs["attention_mask"] = mask[..., :used]
    return Record(record.site, record.step, record.kind, record.layer, record.out, inputs)


def diff_records(reference: Record, candidate: Record, judge: SiteJudge | None = None) -> SiteDiff | dict:
    """A ``SiteDiff`` for two records of the same (site, step), or a mismatch dict (shape/dtype)."""
    reference, candidate = without_cache_padding(reference), without_cache_padding(candidate)
    ref, cand = reference.out, candidate.out
    note = None
    if ref.shape == cand.shape and ref.dtype != cand.dtype and ref.is_floating_point() and cand.is_floating_point():
        # e.g. a kernel that emits the GDN decay gate in BF16 where HF keeps FP32: compare (and judge) in the
        # reference's dtype, and say so; a narrower candidate converts exactly.
        # ULP statistics are in the reference's dtype; the oracle judges the candidate's own values (a wider
        # candidate that skips the final rounding is then a boundary, not hidden by a cast).
        note = (f"candidate stores {str(cand.dtype).removeprefix('torch.')}, reference "
                f"{str(ref.dtype).removeprefix('torch.')}: ULPs counted in the reference's dtype")
        cand = cand.to(ref.dtype)
    if ref.shape != cand.shape or ref.dtype != cand.dtype:
        return {
            "site": reference.site, "step": reference.step,
            "reason": f"reference has {str(ref.dtype).removeprefix('torch.')} {list(ref.shape)}, "
                      f"candidate has {str(cand.dtype).removeprefix('torch.')} {list(cand.shape)}",
        }
    ref, cand = ref.cpu(), cand.cpu()
    differing, max_ulp, hist = _ulp_stats(ref, cand)
    inputs: dict[str, int | None] = {}
    for role, r_in in reference.inputs.items():
        c_in = candidate.inputs.get(role)
        if c_in is None or c_in.shape != r_in.shape or c_in.dtype != r_in.dtype:
            inputs[role] = None
            continue
        _, in_max, _ = _ulp_stats(r_in.cpu(), c_in.cpu())
        inputs[role] = in_max if in_max is not None else int(not torch.equal(r_in.cpu(), c_in.cpu()))
    diff = SiteDiff(
        site=reference.site, step=reference.step, kind=reference.kind, layer=reference.layer,
        elements=ref.numel(), differing=differing, max_ulp=max_ulp, histogram=hist,
        bitwise_equal=bitwise_equal(ref, cand), dtype=str(ref.dtype).removeprefix("torch."),
        shape=list(ref.shape), input_delta=inputs, note=note,
    )
    if judge is not None:
        judged = judge(reference, candidate)
        if judged:
            for key, value in judged.items():
                if key == "note" and diff.note:
                    value = f"{diff.note}; {value}"
                setattr(diff, key, value)
    return diff


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

    def first_difference(self) -> SiteDiff | None:
        return next((d for d in self.sites if not d.bitwise_equal), None)

    def onset(self) -> SiteDiff | None:
        return self.onset_with_reason()[0]

    def onset_with_reason(self) -> tuple[SiteDiff | None, str | None]:
        """The onset and why it is one (see the module docstring):

        - ``"verdict"``: a verdict worse than ``tie`` (boundary, error, nonfinite);
        - ``"unjudged"``: no oracle semantics for the kind, output differs above ``max_ulp``, inputs equal;
        - ``"unobserved"``: the first differing record's own inputs already differ although every earlier
          record is bitwise equal — the divergence began in code between observed sites (RoPE, the KV
          cache, a reshape): this site is the first place it shows.
        """
        seen_difference = False
        for d in self.sites:
            if d.own_error:
                return d, "verdict"
            if d.verdicts is None and not d.bitwise_equal and d.input_delta:
                own = all(v == 0 for v in d.input_delta.values())
                if own and (d.max_ulp is None or d.max_ulp > self.max_ulp):
                    return d, "unjudged"
            if not seen_difference and any(v for v in d.input_delta.values()):
                return d, "unobserved"
            seen_difference = seen_difference or not d.bitwise_equal
        return None, None

    def to_json(self) -> dict[str, Any]:
        """The documented JSON contract (README, "JSON output"): keys are added, never renamed."""

        def point(d: SiteDiff | None) -> dict[str, Any] | None:
            return None if d is None else {"step": d.step, "site": d.site, "kind": d.kind, "layer": d.layer}

        onset, reason = self.onset_with_reason()
        return {
            "schema": "ulptrace.comparison",
            "version": 1,
            "first_difference": point(self.first_difference()),
            "onset": None if onset is None else {**point(onset), "reason": reason},
            "max_ulp_budget": self.max_ulp,
            "reference": self.reference,
            "candidate": self.candidate,
            "observation": self.observation,
            "parameters": self.parameters,
            "missing": self.missing,
            "extra": self.extra,
            "mismatched": self.mismatched,
            "sites": [d.to_json() for d in self.sites],
        }


class StreamingComparator:
    """A recorder sink comparing each candidate record against ``reference`` as it arrives.

    Keeps only ``SiteDiff`` statistics; the reference can be a ``Trace`` or a ``LazyTrace`` on
    disk (read one step shard at a time), so memory stays bounded for long runs.
    """

    def __init__(self, reference: Any, *, judge: SiteJudge | None = None, max_ulp: int = 0,
                 metadata: dict[str, Any] | None = None) -> None:
        self.reference = reference
        self.judge = judge
        self.result = Comparison(reference=dict(getattr(reference, "metadata", {})), max_ulp=max_ulp,
                                 candidate=dict(metadata or {}))
        self._seen: set[tuple[str, int]] = set()

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Called by the recorder on entry: the candidate run's metadata."""
        self.result.candidate = dict(metadata)

    def add(self, record: Record) -> None:
        self._seen.add(record.key)
        ref = self.reference.get(record.key)
        if ref is None:
            self.result.extra.append({"site": record.site, "step": record.step})
            return
        diff = diff_records(ref, record, self.judge)
        if isinstance(diff, dict):
            self.result.mismatched.append(diff)
        else:
            self.result.sites.append(diff)

    def finish(self) -> Comparison:
        keys = self.reference.keys() if hasattr(self.reference, "keys") else [r.key for r in self.reference]
        self.result.missing = [{"site": s, "step": t} for s, t in keys if (s, t) not in self._seen]
        return self.result


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
