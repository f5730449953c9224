"""Verdicts for recorded sites: the bridge between traces and the oracle.

``OracleJudge`` is what ``compare``/``onset`` call for every aligned record pair. For a site with
oracle semantics it captures the *reference* model's formula for that site (its own HF modules and
parameters, see ``ulptrace.sites``) on the reference record's inputs, then judges the candidate's
output on the candidate's *own* recorded inputs — so a site is blamed only for error it introduced
— and, on request, judges the reference against its own semantics too. Sites whose kind has no
oracle semantics get ``verdicts = None`` and a note saying why, never a guess. A site that has
semantics but that the oracle cannot judge (an unsupported op, an input missing on one side, an oracle
bug) gets ``verdicts = None`` *and* ``could_not_judge`` with the reason: an outcome of its own, which
``Comparison.parity`` fails on unless it is explicitly allowed.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

import torch
from ulptrace.comparison import bitwise_equal
from ulptrace.masks import STRUCTURAL_INPUTS, encoded_like
from ulptrace.oracle.environment import reference_namespaces
from ulptrace.oracle.intervals import elements_at_once
from ulptrace.oracle.judge import VERDICTS, empty_verdict_histogram, verdict_histogram
from ulptrace.sites import BATCH_WISE_KINDS, ROW_WISE_KINDS, Site, decoder_layers, site_table
from ulptrace.trace import Record, dtype_name
from ulptrace.ulp import parts_differ

STACKED_KINDS = ROW_WISE_KINDS + BATCH_WISE_KINDS
"""Kinds whose records ``OracleJudge.replayed_many`` stacks along dimension 0: their semantics treat each batch item
(and a row-wise kind each row) alone."""
STACK_ELEMENTS = 1 << 22
"""Most output elements in one stack of records judged together (its replay holds some tens of float64 values of
this size; on a CPU cache-sized, ``ulptrace.oracle.intervals.CPU_PASS_ELEMENTS``)."""
STACK_RECORDS = 64
"""Most records in one stack."""
STACK_OWN_BYTES = 1 << 31
"""Most bytes of the per-record constants (each layer's weight matrices, in float64) one stack holds: a stack of
records from several layers holds each layer's once (``judge_stacked(per_record=)``)."""
QUEUE_BYTES = 256 << 20
"""Record bytes a ``QueuedJudge`` holds at least before it judges them (:func:`queue_bytes`), and a judging pool's
queue holds before it sends them to its processes (``ulptrace.judging``)."""
QUEUE_SHARE = 1 / 16
"""Share of the judge's device memory (host memory for the CPU) a ``QueuedJudge`` may hold in record pairs
(:func:`queue_bytes`)."""
_CALL_SUFFIX = re.compile(r"#\d+$")


class OracleJudge:
    """Judge record pairs with the oracle, using ``reference_model``'s semantics and parameters.

    Build it while only the reference path is applied: the formulas bind the reference's modules and
    attention function at construction, so a candidate path applied later (even one that patches
    classes or HF's attention registry globally) cannot leak into the semantics it is judged by; the names
    their code looks up as it runs are put back, as they were at construction, around each capture
    (``ulptrace.oracle.environment``).

    Args:
        reference_model: the model of the reference path (with that path applied), whose modules
            define each site's semantics.
        judge_reference: also check that the reference output lies inside its own semantics
            (``reference_outside`` in the result counts the elements that do not).
        hypotheses: search boundary hypotheses for out-of-set elements.
        rows: judge a record on the parts where the candidate differs from the reference only — rows of a row-wise
            kind, batch items of a batch-wise one (``ulptrace.sites.ROW_WISE_KINDS``, ``BATCH_WISE_KINDS``) — when
            they are at most half of them (a long prompt's record with a few differing rows, a batch with one prompt
            diverged); the other parts are bitwise equal, so ``exact``. The figures equal those of judging the whole
            record (tested); ``judge_reference`` and the GatedDeltaNet scan's own construction judge whole records.
        shards: ``{parameter name: ulptrace.oracle.sharding.ShardedReduction}`` of ``reference_model``'s
            parameters that the judged run holds split into shards (tensor parallelism, ``ulptrace.tp``), so
            matmuls contracting over a split dim get the ``sharded`` hypothesis.
    """

    def __init__(self, reference_model: Any, *, judge_reference: bool = False, hypotheses: bool = True,
                 rows: bool = True, shards: dict[str, Any] | None = None) -> None:
        self.model = reference_model
        self.rows = rows
        self.sites: dict[str, Site] = {s.name: s for s in site_table(reference_model, warn=False)}
        # built now, before any candidate path is applied: see ulptrace.sites on binding formulas
        self._formulas = {name: s.formula(reference_model) for name, s in self.sites.items() if s.formula}
        # and what their code looks up by name as it runs, put back around each capture (ulptrace.oracle.environment)
        self._environment = reference_namespaces(reference_model)
        self.judge_reference = judge_reference
        self.hypotheses = hypotheses
        self.shards = dict(shards or {})  # parameter name -> ShardedReduction: how the judged run splits it (TP)
        self._programs: dict[tuple, Any] = {}
        self._vectors: dict[tuple, dict[str, torch.Tensor]] = {}  # (layer, rank) -> its vector parameters per unit
        self._names: dict[int | None, dict[str, torch.Tensor]] = {}  # layer (None: the model) -> its tensors, named
        self._layers: Any = None
        param = next(reference_model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")

    def site(self, name: str) -> Site | None:
        return self.sites.get(_CALL_SUFFIX.sub("", name))

    def program(self, site: Site, inputs: dict[str, torch.Tensor],
                per_unit: dict[str, torch.Tensor] | None = None) -> Any:
        """The captured reference semantics of ``site`` for inputs shaped like ``inputs`` (cached). ``per_unit``: the
        layer's parameters (named relative to it) that hold these values instead, shaped for the units of a stack
        (``ulptrace.oracle.members``); the program is captured once per their shapes and given their values."""
        from ulptrace.oracle import capture_semantics

        formula = self._formulas[site.name]
        if hasattr(formula, "judge"):  # semantics with a construction of their own (the GatedDeltaNet scan)
            return formula
        swapped = per_unit or {}
        key = (site.name,) + tuple((r, tuple(t.shape), t.dtype) for r, t in sorted(inputs.items())) + \
            tuple((n, tuple(t.shape), t.dtype) for n, t in sorted(swapped.items()))
        if key not in self._programs:
            assert site.formula is not None
            # name parameters as a kernel engineer reads them: relative to the layer ("linear_attn.A_log")
            scope = self._scope(site)
            try:
                with _swapped(scope, swapped), self._environment.restored():
                    captured = capture_semantics(self._formulas[site.name], inputs,
                                                 constant_names={**self._named(site), **swapped}, name=site.name)
                self._programs[key] = (captured, swapped)
            except (NotImplementedError, ValueError, TypeError, RuntimeError) as exc:
                if not swapped:
                    raise
                self._programs[key] = (exc, swapped)  # a formula that cannot take them so: not asked again
        program, captured_with = self._programs[key]
        if isinstance(program, Exception):
            raise program.with_traceback(None)  # raised again for each record: no traceback piling up
        # the values it was captured with (a unit's own layer's, each time: one program, its memo kept) or others
        used = {n: t for n, t in swapped.items() if n in program.constants and t is not captured_with[n]}
        return program.with_constants(used) if used else program

    def __call__(self, reference: Record, candidate: Record) -> dict[str, Any] | None:
        reference, candidate = self.on_device(reference), self.on_device(candidate)
        answer = self.without_replay(reference, candidate)
        return answer if answer is not None else self.replayed(reference, candidate)

    def replayed(self, reference: Record, candidate: Record) -> dict[str, Any]:
        """The judgement of a pair :meth:`without_replay` did not answer, its records on this judge's device
        (:meth:`on_device`): the semantics replayed on the candidate's inputs. What ``__call__`` does after
        ``without_replay``; a judging process of ``ulptrace.judging`` does only this (the pair was sent because
        this process's ``without_replay`` did not answer it). The names the oracle's own arithmetic calls
        (``torch.rsqrt`` in an interval rule) are the reference's while it judges, as in a capture: a candidate's
        path that replaced one would otherwise be judged by its own arithmetic."""
        with self._environment.restored():
            return self._replayed(reference, candidate)

    def on_device(self, record: Record) -> Record:
        """``record`` where the semantics run (the reference model's device): a reference read back from disk, or kept
        in host memory, is on the CPU."""
        return _on(record, self.device)

    def _replayed(self, reference: Record, candidate: Record) -> dict[str, Any]:
        site = self.site(reference.site)
        assert site is not None
        # without_replay has answered equal outputs unless the reference is judged too
        same = self.judge_reference and bitwise_equal(reference.out, candidate.out)
        subset = None if self._whole(site) else _differing_parts(site, reference, candidate)
        if subset is not None:  # judged on the differing parts (rows or batch items); the others are exact
            part_ref, part_cand, exact_elsewhere = subset
            out = self._judged(site, part_ref, part_cand, same)
            if out.get("verdicts") is not None:
                out["verdicts"]["exact"] += exact_elsewhere
                return out
            # the parts alone could not be judged (a formula that wants the record's own shape): the whole record is
        return self._judged(site, reference, candidate, same)

    def replayed_many(self, pairs: Sequence[tuple[Record, Record]],
                      progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
        """:meth:`replayed` of each pair, in order, where pairs judged by the same program are replayed together
        (:meth:`stacks`): each answer is the one :meth:`replayed` gives (tested); a stack that cannot be judged as
        one (an op that fails) is judged record by record. ``progress(done, total)`` is called with the stacks judged
        (0 before the first)."""
        answers: list[dict[str, Any] | None] = [None] * len(pairs)
        # the names the reference's code looks up put back once for every capture of the batch (one check, not one a
        # capture: ~0.4 ms each, 164 in the 8 x 128 CPU onset); nothing of the candidate's runs in between
        with self._environment.restored():
            plan = self.stacks(pairs)
            if progress is not None and plan:
                progress(0, len(plan))
            for done, stack in enumerate(plan, 1):
                parts = [part for _, part in stack]
                judged = self._judged_stacked(parts) if len(parts) > 1 else [None]  # type: ignore[arg-type]
                for (index, _), answer in zip(stack, judged, strict=True):
                    answers[index] = answer if answer is not None else self.replayed(*pairs[index])
                if progress is not None:
                    progress(done, len(plan))
        return answers  # type: ignore[return-value]

    def stacks(self, pairs: Sequence[tuple[Record, Record]]) -> list[list[tuple[int, _Part | None]]]:
        """The pairs (their indices) grouped as :meth:`replayed_many` judges them: one stack per list. The differing
        parts of records of a row-wise or batch-wise kind (``ulptrace.sites``) — their rows, or batch items — laid
        along dimension 0, one unit each, are stacked where one program computes the same thing on a unit
        (``ulptrace.oracle.members.signature``: a site at its prefill and every decode step, a formula without
        parameters of its own at every layer) on units of the same shapes: up to :data:`STACK_ELEMENTS` output
        elements and :data:`STACK_RECORDS` records a stack (judged as a power of two of units, padded with copies of
        the first record's) and :data:`STACK_OWN_BYTES` of the layers' own weights; any other pair is a stack of its
        own (its part None). A linear layer's records stack across layers, each with its own layer's weight
        (:meth:`_per_record`)."""
        stacks: list[list[tuple[int, _Part | None]]] = []
        groups: dict[Any, list[tuple[int, _Part]]] = {}
        for index, (reference, candidate) in enumerate(pairs):
            part = self._stackable(reference, candidate)
            if part is None:
                stacks.append([(index, None)])
            else:
                groups.setdefault(part.key, []).append((index, part))
        for group in groups.values():
            if group[0][1].own:  # a layer's records side by side: its weights held once while its records last
                group.sort(key=lambda item: (item[1].site.layer, item[0]))
            cap = _stack_cap(math.prod(group[0][1].candidate.out.shape[1:]), group[0][1].candidate.out.is_cuda)
            stack: list[tuple[int, _Part | None]] = []
            units = held = 0
            own: set[int] = set()  # the per-record tensors the stack holds (each once, in float64 while judged)
            for index, part in group:
                new = {id(t): 8 * t.numel() for t in part.own.values() if id(t) not in own}
                if stack and (units + part.units > cap or len(stack) >= STACK_RECORDS
                              or (new and held + sum(new.values()) > STACK_OWN_BYTES)):
                    stacks.append(stack)
                    stack, units, held, own = [], 0, 0, set()
                    new = {id(t): 8 * t.numel() for t in part.own.values()}
                stack.append((index, part))
                units += part.units
                held += sum(new.values())
                own.update(new)
            stacks.append(stack)
        return stacks

    def queued(self, queue_bytes: int = 0, progress: Callable[[int, int], None] | None = None) -> QueuedJudge:
        """This judge as a ``SiteJudge`` that judges the pairs it is handed together (:class:`QueuedJudge`, holding up
        to ``queue_bytes``, default :func:`queue_bytes_for` its device; ``progress`` as :meth:`replayed_many`'s)."""
        return QueuedJudge(self, queue_bytes, progress)

    def _whole(self, site: Site) -> bool:
        """Whether ``site``'s records are judged whole, not on their differing parts: with the reference judged too,
        without ``rows``, and for a construction with a bound of its own (the GatedDeltaNet scan), whose width
        (``admissible_width``) is reported over the whole record."""
        return self.judge_reference or not self.rows or hasattr(self._formulas[site.name], "judge")

    def _stackable(self, reference: Record, candidate: Record) -> _Part | None:
        """The part of a pair :meth:`replayed_many` may stack with others — its differing rows (a row-wise kind) or
        batch items (a batch-wise one) laid along dimension 0, one unit each — with its key (equal for parts whose
        units one program judges on inputs and outputs of the same shapes and dtypes), or None: judged alone. A
        row-wise formula that uses its layer's vector parameters element by element (a norm's weight) is captured
        with them per unit (:meth:`_per_unit`), so one program judges it at every layer."""
        site = self.site(reference.site)
        if site is None or site.kind not in STACKED_KINDS:
            return None
        inputs = self._candidate_inputs(reference, candidate)
        if isinstance(inputs, str):
            return None
        formula = self._formulas[site.name]
        if hasattr(formula, "judge"):
            return self._stackable_whole(site, formula, reference, candidate, inputs)
        if self._whole(site):
            return None
        cut = _units(site, reference, candidate, inputs)
        if cut is None:
            return None
        ref, cand, inputs, exact_elsewhere = cut
        unit = {role: t[:1] for role, t in ref.inputs.items()}
        from ulptrace.oracle.members import signature

        params = self._per_unit(site, unit)
        try:
            program = self.program(site, unit, params) if params else None
            if program is None or tuple(program.output_value.shape) != (1, *cand.out.shape[1:]):
                params, program = {}, self.program(site, unit)
        except (NotImplementedError, ValueError, TypeError, RuntimeError):
            try:
                params, program = {}, self.program(site, unit)
            except (NotImplementedError, ValueError, TypeError, RuntimeError):
                return None  # judged alone, where the reason is reported
        params = {n: t for n, t in params.items() if n in program.constants}
        per_unit = frozenset(params)
        own = self._per_record(site, program, per_unit)
        per_record = frozenset(own)
        shapes = tuple((role, tuple(t.shape[1:]), t.dtype) for role, t in sorted(inputs.items()))
        key = (signature(program, per_unit, per_record), per_unit, per_record, shapes, tuple(cand.out.shape[1:]),
               cand.out.dtype, ref.out.dtype, ref.out.device)
        return _Part(key, site, ref, cand, inputs, exact_elsewhere, program, cand.out.shape[0], params, own)

    def _per_record(self, site: Site, program: Any, per_unit: frozenset[str]) -> dict[str, torch.Tensor]:
        """The constants of ``program`` that are its layer's own tensors (named relative to the layer, not per unit:
        a linear layer's weight), with this layer's values: a stack of records from several layers gives each record
        its own (``judge_stacked(per_record=)``), so one program judges the formula at every layer. None outside the
        layers or with sharded parameters."""
        if site.layer is None or self.shards:
            return {}
        named = self._named(site)
        return {n: named[n] for n, t in program.constants.items() if n not in per_unit and n in named
                and named[n].shape == t.shape and named[n].dtype == t.dtype}

    def _stackable_whole(self, site: Site, formula: Any, reference: Record, candidate: Record,
                         inputs: dict[str, torch.Tensor]) -> _Part | None:
        """A pair of a construction with a bound of its own (the GatedDeltaNet scan) as a part of a stack: the whole
        records, their batch items the units, where the semantics say records of equal shapes per batch item are
        judged alike (``stack_key``) and the reference is not judged too."""
        if self.judge_reference or not hasattr(formula, "stack_key"):
            return None
        tensors = [reference.out, candidate.out, *inputs.values()]
        batch = reference.out.shape[0] if reference.out.dim() else 0
        if not batch or any(t.dim() == 0 or t.shape[0] != batch for t in tensors):
            return None
        shapes = tuple((role, tuple(t.shape[1:]), t.dtype) for role, t in sorted(inputs.items()))
        key = (formula.stack_key, shapes, tuple(candidate.out.shape[1:]), candidate.out.dtype, reference.out.dtype,
               reference.out.device)
        return _Part(key, site, reference, candidate, inputs, 0, formula, batch, {}, {})

    def _per_unit(self, site: Site, unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The vector parameters of ``site``'s layer (named relative to it) in the rank of its units, dimension 0 of
        one, as a program takes them per unit (``ulptrace.oracle.members``); none for a site outside the layers, a
        batch-wise kind, or a run with sharded parameters."""
        if site.layer is None or site.kind not in ROW_WISE_KINDS or self.shards or not unit:
            return {}
        rank = max(t.dim() for t in unit.values())
        if rank < 2:
            return {}
        key = (site.layer, rank)
        if key not in self._vectors:  # once per layer and rank
            self._vectors[key] = {name: t.reshape(*(1,) * (rank - 1), -1) for name, t in self._named(site).items()
                                  if t.dim() == 1 and t.is_floating_point() and t.nbytes <= _PER_UNIT_BYTES}
        return self._vectors[key]

    def _named(self, site: Site) -> dict[str, torch.Tensor]:
        """The parameters and buffers of ``site``'s scope (:meth:`_scope`), named relative to it: the names its
        programs give their constants (found once per scope, not at every capture)."""
        if site.layer not in self._names:
            scope = self._scope(site)
            self._names[site.layer] = {n: t.detach() for n, t in [*scope.named_parameters(), *scope.named_buffers()]}
        return self._names[site.layer]

    def _judged_stacked(self, parts: list[_Part]) -> list[dict[str, Any] | None]:
        """The answers of parts with one key judged in one replay; None for a part to judge alone. Parts whose
        records would decide differently in the replay are split by that decision and each side stacked again."""
        from ulptrace.oracle import judge_stacked
        from ulptrace.oracle.intervals import Layout, MixedDecision
        from ulptrace.oracle.judge import verdict_histograms
        from ulptrace.oracle.members import stacks

        count = len(parts)
        if count == 1:
            return [None]
        first = parts[0]
        lengths = [p.units for p in parts]
        construction = hasattr(first.program, "judge_stacked")  # evaluated on the records as they are: no padding
        layout = Layout(lengths, None if construction else 1 << (sum(lengths) - 1).bit_length())  # a few shapes
        pad = layout.units - sum(lengths)

        def stacked(values: list[torch.Tensor]) -> torch.Tensor:  # the padding: copies of the first record's units
            head = values[0]
            copies = head.repeat(-(-pad // head.shape[0]), *(1,) * (head.dim() - 1))[:pad] if pad else head[:0]
            return torch.cat([*values, copies])

        per_unit = frozenset(first.params)
        try:
            inputs = {role: stacked([p.inputs[role] for p in parts]) for role in first.inputs}
            output = stacked([p.candidate.out for p in parts])
            reference = stacked([p.reference.out for p in parts])
            sites = [p.site.name for p in parts]
            if construction:
                results = first.program.judge_stacked(inputs, output, reference, layout, sites,
                                                      hypotheses=self.hypotheses)
            else:
                params = {n: stacked([p.params[n].expand(p.units, *p.params[n].shape[1:]) for p in parts])
                          for n in per_unit}
                program = self.program(first.site, {role: stacked([p.reference.inputs[role] for p in parts])
                                                    for role in first.reference.inputs}, params)
                if not stacks(first.program, program, layout.units, per_unit):
                    return [None] * count
                own = {n: [p.own[n] for p in parts] for n in first.own}
                results = judge_stacked(program, inputs, output, reference, sites, layout=layout, per_unit=per_unit,
                                        per_record=own, hypotheses=self.hypotheses, shards=self._shards(first.site))
            real = layout.offsets[-1] * (output.shape[0] // layout.units)
            histograms = verdict_histograms(torch.cat([r.verdicts for r in results]), output[:real], reference[:real],
                                            Layout(lengths))
        except MixedDecision as mixed:  # the padding copies the first part: it decides as that one does
            sides = [[k for k in range(count) if mixed.equal[k] == way] for way in (True, False)]
            answers: list[dict[str, Any] | None] = [None] * count
            if not all(sides):  # a value the records share, split as theirs (ulptrace.oracle.intervals._all_equal)
                return answers
            for side in sides:
                for k, answer in zip(side, self._judged_stacked([parts[k] for k in side]), strict=True):
                    answers[k] = answer
            return answers
        except (NotImplementedError, ValueError, TypeError, RuntimeError):
            return [None] * count  # each judged alone: the same answers, or the reason one of them cannot be judged
        return [_answer(result, histogram, part.exact_elsewhere, width=construction)
                for part, result, histogram in zip(parts, results, histograms or [None] * count, strict=True)]

    def without_replay(self, reference: Record, candidate: Record) -> dict[str, Any] | None:
        """The answer for a pair that needs no replay of the semantics — a site without them, an oracle input missing,
        bitwise-equal outputs (unless the reference is judged too) — or None: the pair must be judged (the
        records may be on any device). What ``__call__`` answers first; ``ulptrace.judging`` answers it before
        sending a pair to a judging process, which then calls :meth:`replayed`."""
        site = self.site(reference.site)
        if site is None or site.formula is None:
            return {"verdicts": None, "note": f"no oracle semantics for {reference.kind} site {reference.site}"}
        missing = [r for r in site.inputs if r not in site.optional and r not in reference.inputs]
        if missing:
            why = f"reference record lacks oracle input(s) {missing}"
            return {"verdicts": None, "could_not_judge": why, "note": why}
        if not self.judge_reference and bitwise_equal(reference.out.to(candidate.out.device), candidate.out):
            return {"verdicts": {v: (reference.out.numel() if v == "exact" else 0) for v in VERDICTS},
                    "verdict_histogram": empty_verdict_histogram()}
        return None

    def _judged(self, site: Site, reference: Record, candidate: Record, same: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            program = self.program(site, reference.inputs)
            if self.judge_reference:
                out["reference_outside"] = self._outside(program, reference.inputs, reference.out)
                if hasattr(program, "width_ulps"):  # how sharp a bound of its own is, also where nothing differs
                    out["admissible_width"] = program.width_ulps(reference.inputs)
            if same:
                out["verdicts"] = {v: (reference.out.numel() if v == "exact" else 0) for v in VERDICTS}
                out["verdict_histogram"] = empty_verdict_histogram()
                return out
            inputs = self._candidate_inputs(reference, candidate)
            if isinstance(inputs, str):
                out.update(verdicts=None, could_not_judge=inputs, note=inputs)
                return out
            from ulptrace.oracle import judge

            judge_fn = program.judge if hasattr(program, "judge") else \
                lambda *a, **k: judge(program, *a, shards=self._shards(site), **k)
            result = judge_fn(inputs, candidate.out, reference.out, hypotheses=self.hypotheses)
        except (NotImplementedError, ValueError, TypeError, RuntimeError) as exc:
            # an outcome of its own, never "no semantics": parity fails on it unless explicitly allowed
            why = f"{type(exc).__name__}: {exc}"
            out.update(verdicts=None, could_not_judge=why, note=f"oracle could not judge {reference.site}: {why}")
            return out
        # ULPs from the reference per verdict, measured on the differing elements only; a construction with a bound of
        # its own says how sharp it is
        out.update(_answer(result, verdict_histogram(result.verdicts, candidate.out, reference.out),
                           width=hasattr(program, "judge")))
        return out

    def _shards(self, site: Site) -> tuple[Any, ...]:
        """The judged run's sharded parameters, named as the site's program names its constants."""
        from ulptrace.oracle.sharding import in_scope

        return in_scope(self.shards, self.model, self._scope(site))

    def _scope(self, site: Site) -> Any:
        """The module a site's program names its constants relative to: its decoder layer, else the model."""
        if site.layer is None:
            return self.model
        if self._layers is None:  # looked up once (a walk over every module)
            self._layers = decoder_layers(self.model)
        return self._layers[site.layer]

    @staticmethod
    def _candidate_inputs(reference: Record, candidate: Record) -> dict[str, torch.Tensor] | str:
        """The candidate's own inputs for the reference's program, or a note saying what is missing.

        Structural inputs (the attention mask) are not activations: one path may pass an explicit
        causal mask where the other lets the kernel mask, so the reference's mask stands in for a
        missing one and an extra one is dropped — the reference's formula defines the masking. A mask
        encoded otherwise (bool where the reference's is additive, or the other way) is the candidate's
        own mask written in the reference's encoding (``ulptrace.masks``): what it lets through is judged.
        """
        inputs = {}
        for role, tensor in reference.inputs.items():
            if role in candidate.inputs:
                given = candidate.inputs[role]
                if role in STRUCTURAL_INPUTS and (given.dtype != tensor.dtype or given.shape != tensor.shape):
                    given = encoded_like(given, tensor)
                    if given is None:
                        return (f"candidate's {role} ({dtype_name(candidate.inputs[role].dtype)} "
                                f"{list(candidate.inputs[role].shape)}) cannot be written as the reference's "
                                f"({dtype_name(tensor.dtype)} {list(tensor.shape)}): not only visible or hidden, "
                                "or of a shape that does not broadcast")
                inputs[role] = given
            elif role in STRUCTURAL_INPUTS:
                inputs[role] = tensor
            else:
                return f"candidate record lacks oracle input {role!r}"
        return inputs

    def _outside(self, program: Any, inputs: dict[str, torch.Tensor], output: torch.Tensor) -> int:
        from ulptrace.oracle import admissible

        lo, hi = program.admissible(inputs) if hasattr(program, "admissible") else admissible(program, inputs)
        value = output.double()
        inside = (value >= lo.double()) & (value <= hi.double())
        inside |= torch.isnan(value) & (torch.isnan(lo) | torch.isnan(hi))
        return int((~inside).sum())


def queue_bytes_for(device: torch.device) -> int:
    """Record bytes a :class:`QueuedJudge` judging on ``device`` holds before it judges them: :data:`QUEUE_SHARE` of
    the device's memory (host memory for the CPU), at least :data:`QUEUE_BYTES`. Records of one program stack only
    when they are held together — a site's prefill with its decode steps, a layer's with the others' — so a bound
    below one run's differing records judged most pairs one by one (on qwen3.5-0.8b, 2 x 32 tokens and 4 steps:
    ~1.4 GB of pairs, five flushes of 256 MiB, 470 of 1,456 pairs judged alone against 42 held together)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # no such query here: the floor
            total = 0
    return max(QUEUE_BYTES, int(QUEUE_SHARE * total))


class QueuedJudge:
    """A ``SiteJudge`` (for ``StreamingComparator``/``compare``) that holds the pairs its ``OracleJudge`` must replay
    and judges them together (``OracleJudge.replayed_many``: pairs of one program in one replay) when an answer is
    first read (``ulptrace.comparison.finish_diffs``), or once it holds ``queue_bytes`` of records; what needs no
    replay is answered at once (``OracleJudge.without_replay``); ``queue_bytes`` defaults to :func:`queue_bytes_for`
    the judge's device. The answers are those of judging each pair as it comes (tested). A record of ``ulptrace.record.LIVE_BYTES`` or more (it may be the model's own value, valid only
    while the recorder hands it over) is judged at once."""

    def __init__(self, judge: OracleJudge, queue_bytes: int = 0,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.judge = judge
        self.queue_bytes = queue_bytes or queue_bytes_for(judge.device)
        self.progress = progress  # (stacks judged, stacks) while the held pairs are judged
        self._pairs: list[tuple[Record, Record]] = []
        self._indices: list[int] = []
        self._bytes = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._next = 0

    def __call__(self, reference: Record, candidate: Record) -> Any:
        from ulptrace.record import LIVE_BYTES

        reference, candidate = self.judge.on_device(reference), self.judge.on_device(candidate)
        answer = self.judge.without_replay(reference, candidate)
        if answer is not None:
            return answer
        sizes = [t.nbytes for r in (reference, candidate) for t in (r.out, *r.inputs.values())]
        if max(sizes) >= LIVE_BYTES:
            return self.judge.replayed(reference, candidate)
        index, self._next = self._next, self._next + 1
        self._pairs.append((reference, candidate))
        self._indices.append(index)
        self._bytes += sum(sizes)
        if self._bytes >= self.queue_bytes:
            self.flush()
        return _Queued(self, index)

    def flush(self) -> None:
        """Judge every pair held."""
        pairs, indices = self._pairs, self._indices
        self._pairs, self._indices, self._bytes = [], [], 0
        self._answers.update(zip(indices, self.judge.replayed_many(pairs, self.progress), strict=True))

    def result(self, index: int) -> dict[str, Any]:
        if index not in self._answers:
            self.flush()
        return self._answers.pop(index)


class _Queued:
    """A pair's answer from a :class:`QueuedJudge`: :meth:`result` judges what the queue holds, if it is not yet."""

    def __init__(self, queue: QueuedJudge, index: int) -> None:
        self._queue, self._index = queue, index

    def result(self) -> dict[str, Any]:
        return self._queue.result(self._index)


class _Part(NamedTuple):
    """A pair's records (or their differing parts) as ``OracleJudge.replayed_many`` stacks them."""

    key: Any  # equal for parts that one program judges on inputs and outputs of the same shapes and dtypes
    site: Site
    reference: Record
    candidate: Record
    inputs: dict[str, torch.Tensor]  # the candidate's inputs for the reference's program
    exact_elsewhere: int  # elements of the record left out of the part (bitwise equal)
    program: Any  # the program of one unit (dimension 0 of one)
    units: int  # the part's length in dimension 0
    params: dict[str, torch.Tensor]  # the program's per-unit constants: this layer's values, dimension 0 of one
    own: dict[str, torch.Tensor]  # the program's per-record constants: this layer's tensors (a linear weight)


_DIGITS = re.compile(r"\d+")
_PER_UNIT_BYTES = 1 << 20  # a layer's vector parameters a stack holds per unit: a norm's weight, not an embedding


@contextmanager
def _swapped(scope: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``scope``'s parameters and buffers named in ``tensors`` (relative to it) hold those tensors for the block: a
    formula bound to the module reads them (``OracleJudge.program``'s per-unit capture)."""
    saved = []
    try:
        for name, tensor in tensors.items():
            owner_name, _, attr = name.rpartition(".")
            owner = scope.get_submodule(owner_name) if owner_name else scope
            table = owner._parameters if attr in owner._parameters else owner._buffers
            saved.append((table, attr, table[attr]))
            table[attr] = tensor
        yield
    finally:
        for table, attr, old in reversed(saved):
            table[attr] = old


def stack_hint(record: Record) -> tuple:
    """A sort key that puts records that may be judged in one stack (``OracleJudge.stacks``) next to each other, from
    the record alone (no program): its site with the layer numbers taken out, the shape of one unit of its output (a
    row of a row-wise kind, a batch item of another) and its dtype, its site, its step. A hint only:
    ``OracleJudge.stacks`` decides."""
    unit = record.out.shape[-1:] if record.kind in ROW_WISE_KINDS else record.out.shape[1:]
    return (_DIGITS.sub("#", record.site), tuple(unit), str(record.out.dtype), record.site, record.step)


def _answer(result: Any, histogram: Any, exact_elsewhere: int = 0, width: bool = False) -> dict[str, Any]:
    """A pair's answer from its ``ulptrace.oracle.Judgement``: verdict counts (``exact_elsewhere`` elements left out
    of the judged part counted exact), boundary, share explained, largest error, verdict histogram, and with
    ``width`` the admissible set's median width in ULPs (a construction with a bound of its own)."""
    verdicts = {v: int(result.counts.get(v, 0)) for v in VERDICTS}
    verdicts["exact"] += exact_elsewhere
    out = {"verdicts": verdicts, "boundary": result.boundary,
           "explained": None if result.explained is None else float(result.explained),
           "max_error_ulp": result.max_error_ulp, "verdict_histogram": histogram}
    if width:
        from ulptrace.ulp import ulp_distance

        out["admissible_width"] = float(ulp_distance(result.lo, result.hi).distance.double().median())
    return out


def _stack_cap(elements: int, cuda: bool) -> int:
    """How many units of ``elements`` output elements each one stack holds: a power of two, within
    :data:`STACK_ELEMENTS` (cache-sized on a CPU: ``intervals.elements_at_once``)."""
    cap = max(1, elements_at_once(STACK_ELEMENTS, cuda) // max(elements, 1))
    return 1 << (cap.bit_length() - 1)


def _differing(site: Site, reference: Record, tensors: Sequence[torch.Tensor]) -> tuple[int, torch.Tensor] | None:
    """How many parts ``reference``'s output has — rows of a row-wise kind (``ulptrace.sites.ROW_WISE_KINDS``: every
    one of ``tensors`` shaped in the output's rows), batch items of a batch-wise one (``BATCH_WISE_KINDS``: every one
    with the output's batch) — and which of them the candidate's output (``tensors[0]``) differs in (every one where
    its dtype is another); None where a record is judged whole (another kind, tensors shaped otherwise)."""
    ref_out, cand_out = reference.out, tensors[0]
    if ref_out.dim() < 2 or ref_out.shape != cand_out.shape:
        return None
    if site.kind in ROW_WISE_KINDS:
        lead = ref_out.shape[:-1]
        if any(t.shape[:-1] != lead for t in tensors):
            return None
        n_parts = math.prod(lead)
    elif site.kind in BATCH_WISE_KINDS:
        n_parts = ref_out.shape[0]
        if any(t.dim() == 0 or t.shape[0] != n_parts for t in tensors):
            return None
    else:
        return None
    if ref_out.dtype != cand_out.dtype:
        return n_parts, torch.ones(n_parts, dtype=torch.bool, device=ref_out.device)
    return n_parts, parts_differ(ref_out, cand_out, n_parts)


def _cut(site: Site, t: torch.Tensor, n_parts: int, parts: torch.Tensor | None, rows_first: bool) -> torch.Tensor:
    """The ``parts`` of ``t`` (:func:`_differing`; None: every one, in order, so no copy): batch items along dimension
    0; rows of a row-wise kind along the next-to-last dimension (``(1, ..., rows, columns)``), or along the first with
    ``rows_first`` (``(rows, 1, ..., columns)``), the rank kept."""
    if site.kind in BATCH_WISE_KINDS:
        return t if parts is None else t.index_select(0, parts)
    ones = (1,) * (t.dim() - 2)
    if parts is None:
        rows = t
        count = n_parts
    else:
        rows = t.reshape(n_parts, t.shape[-1]).index_select(0, parts)
        count = parts.numel()
    return rows.reshape(count, *ones, t.shape[-1]) if rows_first else rows.reshape(*ones, count, t.shape[-1])


def _cut_record(site: Site, r: Record, n_parts: int, parts: torch.Tensor | None, rows_first: bool = False,
                inputs: dict[str, torch.Tensor] | None = None) -> Record:
    cut = {k: _cut(site, v, n_parts, parts, rows_first) for k, v in (r.inputs if inputs is None else inputs).items()}
    return Record(r.site, r.step, r.kind, r.layer, _cut(site, r.out, n_parts, parts, rows_first), cut)


def _differing_parts(site: Site, reference: Record, candidate: Record) -> tuple[Record, Record, int] | None:
    """The two records cut down to the parts where the candidate's output differs from the reference's
    (:func:`_differing`), and how many elements that leaves out — or None where judging the whole record is the way:
    a record judged whole (:func:`_differing`), and where more than half the parts differ (all do where the output's
    dtype changed).

    The parts kept are the differing ones, then copies of one equal part up to a power of two (so a site's programs
    come in a few shapes, each captured once); the copies are bitwise equal, so ``exact``: the caller counts the
    left-out elements as exact, the padding's taken back off."""
    found = _differing(site, reference, [candidate.out, *reference.inputs.values(), *candidate.inputs.values()])
    if found is None:
        return None
    n_parts, differ = found
    picked = differ.nonzero().flatten()
    width = 1 << max(0, int(picked.numel()) - 1).bit_length()  # a power of two >= the differing parts
    if picked.numel() == 0 or 2 * width > n_parts:
        return None
    equal = int((~differ).nonzero()[0, 0])
    parts = torch.cat([picked, picked.new_full((width - picked.numel(),), equal)])
    left_out = (n_parts - width) * (reference.out.numel() // n_parts)  # the equal parts left out, less the padding's
    return _cut_record(site, reference, n_parts, parts), _cut_record(site, candidate, n_parts, parts), left_out


def _units(site: Site, reference: Record, candidate: Record, inputs: dict[str, torch.Tensor]
           ) -> tuple[Record, Record, dict[str, torch.Tensor], int] | None:
    """The differing parts of a pair (:func:`_differing`: every one of them, however many) laid along dimension 0 as
    ``OracleJudge.replayed_many`` stacks them, one unit a part, with the candidate's ``inputs`` for the program cut
    alike, and how many elements are left out (bitwise equal); None where the record is judged whole."""
    found = _differing(site, reference, [candidate.out, *reference.inputs.values(), *inputs.values()])
    if found is None:
        return None
    n_parts, differ = found
    parts: torch.Tensor | None = differ.nonzero().flatten()
    kept = parts.numel()
    if kept == 0:
        return None
    if kept == n_parts:  # every part: the records laid out as they are
        parts = None
    left_out = (n_parts - kept) * (reference.out.numel() // n_parts)
    cand = _cut_record(site, candidate, n_parts, parts, True, inputs)
    return _cut_record(site, reference, n_parts, parts, True), cand, cand.inputs, left_out


def _on(record: Record, device: torch.device) -> Record:
    if record.out.device == device and all(t.device == device for t in record.inputs.values()):
        return record
    return Record(record.site, record.step, record.kind, record.layer, record.out.to(device),
                  {k: v.to(device) for k, v in record.inputs.items()})


class UnavailableOracle:
    """The judge of a stored trace whose reference model cannot be rebuilt (``judge_for_trace``).

    Every record that differs gets ``could_not_judge`` with the reason, so a comparison whose oracle was
    asked for but is missing fails parity (unless ``could_not_judge`` is allowed) instead of reading as
    "no onset"; bitwise-equal records need no oracle and get none.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self, reference: Record, candidate: Record) -> dict[str, Any] | None:
        if bitwise_equal(reference.out, candidate.out):
            return None
        return {"verdicts": None, "could_not_judge": self.reason, "note": f"no oracle: {self.reason}"}


def _rebuild_device(metadata: dict[str, Any]) -> str:
    """Where to rebuild a trace's reference model: the device it was recorded on when this machine has it
    (an embedded model's seeded weights are drawn by that device's generator), else the CPU."""
    recorded = str(metadata.get("device") or "cpu")
    if recorded.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(recorded).index
        return recorded if index is None or index < torch.cuda.device_count() else "cuda"
    return "cpu"


def judge_for_trace(metadata: dict[str, Any], progress: Callable[[str], None] | None = None, *,
                    stack: ExitStack, judge_reference: bool = False) -> OracleJudge | UnavailableOracle:
    """Rebuild the reference model a trace was recorded from, for judging stored traces offline.

    Works for embedded models and local checkpoints named in the manifest, rebuilt on the device the trace
    was recorded on when this machine has one (``_rebuild_device``). When the model cannot be rebuilt, or
    its parameters differ from the recorded ones, returns an ``UnavailableOracle`` (and says why through
    ``progress``): every differing record is then "could not judge" with that reason — never a guessed
    verdict, and never a silent comparison without verdicts. The reference's path defines the semantics,
    so it stays applied for as long as the judge is used: until ``stack`` (the caller's ``ExitStack``)
    closes, which undoes it — a ``kernels:`` path's process-wide attention function included.
    """
    from ulptrace.models import build_model
    from ulptrace.paths import apply_path

    say = progress or (lambda msg: None)

    def unavailable(reason: str) -> UnavailableOracle:
        say(f"no verdicts: {reason}; every differing record is reported as 'could not judge' "
            "(--no-oracle compares without the oracle on purpose)")
        return UnavailableOracle(reason)

    device = _rebuild_device(metadata)
    try:
        model = build_model(metadata["model"], dtype=getattr(torch, metadata.get("dtype") or "bfloat16"),
                            seed=metadata.get("seed") or 0, device=device,
                            attn_implementation=metadata.get("attn_implementation") or "sdpa")
        stack.enter_context(apply_path(model, metadata.get("path", "hf")))
    except (KeyError, ValueError, OSError) as exc:
        return unavailable(f"cannot rebuild the reference model from the trace metadata ({exc})")
    from ulptrace.record import parameter_checksums

    recorded = metadata.get("parameters")
    if isinstance(recorded, dict) and recorded != parameter_checksums(model):
        where = str(metadata.get("device") or "cpu")
        if torch.device(where).type != torch.device(device).type:
            return unavailable(f"the trace was recorded on {where}, and an embedded model's seeded weights are "
                               f"drawn by that device's generator: rebuilt on {device} they differ (compare "
                               f"on a machine with {torch.device(where).type})")
        return unavailable("the rebuilt reference model's parameters differ from the ones the trace was recorded "
                           "with (another checkpoint, seed or ulptrace version?)")
    say(f"verdicts use the semantics of {metadata['model']} on path {metadata.get('path', 'hf')!r} (rebuilt on {device})")
    return OracleJudge(model, judge_reference=judge_reference)


def site_semantics(model_name: str, site_name: str, *, path: str = "hf", seed: int = 0) -> str:
    """The printable op list of the reference semantics at ``site_name`` (e.g. where HF rounds)."""
    from ulptrace.models import build_model
    from ulptrace.paths import apply_path
    from ulptrace.record import Recorder
    from ulptrace.run import greedy, make_prompts
    from ulptrace.sites import select

    model = build_model(model_name, seed=seed)
    with apply_path(model, path):  # undone on return: a kernels: path patches process-wide state
        sites = select(site_table(model), [site_name])
        if not sites:
            names = [s.name for s in site_table(model) if s.formula is not None]
            raise KeyError(f"unknown site {site_name!r} for {model_name}; sites with semantics include "
                           f"{', '.join(names[:12])}, ...")
        if sites[0].formula is None:
            raise ValueError(f"site {site_name!r} ({sites[0].kind}) has no oracle semantics")
        with Recorder(model, sites=sites, steps=[0]) as rec:
            greedy(model, make_prompts(model.config.vocab_size, 1, 4, seed), 1)
        record = next(iter(rec.trace))
        program = OracleJudge(model).program(sites[0], record.inputs)
    return f"{site_name} ({sites[0].kind}) on {model_name}, path {path}:\n{program}"
