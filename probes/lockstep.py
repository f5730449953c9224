"""Lockstep: two runs advanced one decode step at a time from the same restored state.

The reference and the candidate (each a path in a mode: the main case is ``graph`` against ``static``
eager of the same path) prefill the same prompts; then, before every decode step, the candidate's whole
decoding state — KV caches, GatedDeltaNet conv and recurrent states, position, next tokens — is
overwritten with the reference's (``ulptrace.run.Session.restore``; across cache layouts when the modes
differ), so a difference cannot compound: each step shows only what that step itself does differently.
Both are fed the reference's greedy token. Per step: the logits, every state tensor after the step
(bitwise and in ULPs of its dtype), and that step's per-site comparison with its onset. With
``free_running`` the restore is dropped (both still fed the reference's tokens), which shows how the
differences grow.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from ulptrace.comparison import bitwise_equal, compare
from ulptrace.paths import apply_path
from ulptrace.probes.divergence import describe_point, onset_object
from ulptrace.record import Recorder, recording_collector
from ulptrace.run import DecodeState, RunConfig, Session, adapt_state, build_pair, selected_sites, selection_metadata
from ulptrace.sides import SideNames, apply_paths
from ulptrace.trace import Trace
from ulptrace.ulp import FORMATS, row_ulp_distance, ulp_distance

SCHEMA = "ulptrace.lockstep"


class _StepSink:
    """Records of the current step into a fresh ``Trace`` (one step kept at a time)."""

    def __init__(self) -> None:
        self.trace = Trace()
        self.metadata: dict[str, Any] = {}

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        self.metadata = dict(metadata)

    def take(self) -> Trace:
        done, self.trace = self.trace, Trace(self.metadata)
        done.metadata = dict(self.metadata)
        return done

    def add(self, record: Any) -> None:
        self.trace.add(record)


def _max_ulp(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Greatest ULP distance of two same-shape tensors (None when not a float format or shapes differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return None
    if a.dtype not in FORMATS:
        return 0 if torch.equal(a, b) else None
    if a.numel() == 0:
        return 0
    dist = ulp_distance(a, b)
    finite = dist.distance[~dist.nan]
    return int(finite.max()) if finite.numel() else 0


def _max_row_ulp(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Greatest difference in ULPs of the row's magnitude (``ulptrace.ulp.row_ulp_distance``): an element next
    to zero that moved by millions of its own ULPs is a fraction of its row's ULP. None when not measurable."""
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in FORMATS:
        return None
    if a.numel() == 0:
        return 0.0
    dist = row_ulp_distance(a, b)
    finite = dist.distance[~dist.nonfinite]
    return float(finite.max()) if finite.numel() else 0.0


def compare_states(reference: DecodeState, candidate: DecodeState
                   ) -> tuple[bool, dict[str, int | None], dict[str, float | None]]:
    """(every state tensor bitwise equal, max ULP per tensor name, max row ULP per tensor name); the candidate
    is moved to the reference's cache layout first (``adapt_state``), so a static cache is compared on its live
    positions."""
    candidate = adapt_state(candidate, reference.cache)
    ref, cand = reference.tensors(), candidate.tensors()
    equal = ref.keys() == cand.keys()
    ulps: dict[str, int | None] = {}
    rows: dict[str, float | None] = {}
    for name in ref:
        if name not in cand:
            ulps[name] = rows[name] = None
            continue
        same = bitwise_equal(ref[name], cand[name])
        equal = equal and same
        ulps[name] = 0 if same else _max_ulp(ref[name], cand[name])
        rows[name] = 0.0 if same else _max_row_ulp(ref[name], cand[name])
    return equal, ulps, rows


class _Side:
    """One side's session and how its forwards are recorded.

    Each side normally has its own model and one recorder open for the whole run. When both sides run the
    same path they share one model (a path such as ``kernels:fused`` patches state that two copies cannot
    hold at once, e.g. the attention function): then the side that replays a CUDA graph keeps the open
    recorder (it must be active when the graph is captured), paused while the other side runs, and the
    other side records each forward with a recorder of its own, numbered as that step.
    """

    def __init__(self, model: Any, mode: str, max_len: int, path: str, sites: Any, meta: dict[str, Any],
                 names: SideNames | None = None) -> None:
        self.model, self.path, self.sites = model, path, sites
        self.names = names  # what its code looks up, as its path set it (ulptrace.sides): entered for each forward
        self.meta = {**meta, "mode": mode}
        self.session = Session(model, mode, max_len=max_len)
        self.sink = _StepSink()
        self.recorder: Recorder | None = None  # the open one, when this side keeps one
        self.other: _Side | None = None  # the side sharing this model, if any

    def open(self) -> Recorder:
        self.recorder = Recorder(self.model, sites=self.sites, sink=self.sink, path=self.path, metadata=self.meta)
        return self.recorder

    def run(self, step: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        other = self.other.recorder if self.other is not None else None
        if other is not None:
            other.pause()
        try:
            with self.names.entered() if self.names is not None else nullcontext():
                return self._run(step, forward)
        finally:
            if other is not None:
                other.resume()

    def _run(self, step: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.recorder is not None:
            return forward().clone()
        with Recorder(self.model, sites=self.sites, sink=self.sink, path=self.path, metadata=self.meta) as rec:
            rec.step = step - 1  # this forward is that step
            return forward().clone()


@recording_collector()  # every recorder of the run and what is made between them
def run_lockstep(cfg: RunConfig, *, free_running: bool = False,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the lockstep comparison of ``cfg.reference`` (``cfg.reference_mode``) and ``cfg.candidate``
    (``cfg.candidate_mode``) over ``cfg.new_tokens`` steps; returns the report (``prefill`` and ``steps``).

    Raises:
        ValueError: both sides run the same path in ``graph`` mode (they share one model, and one model
            replays the graphs of one recording session at a time).
    """
    say = progress or (lambda msg: None)
    shared = cfg.reference == cfg.candidate
    if shared and cfg.reference_mode == cfg.candidate_mode == "graph":
        raise ValueError(f"lockstep of path {cfg.reference!r} against itself with both modes graph is not supported "
                         "(both sides share one model): expected --reference-mode eager or static")
    ref_model, cand_model, prompts = build_pair(cfg)
    if shared:
        cand_model = ref_model  # one model, its path applied once; see _Side
    max_len = cfg.cache_len or cfg.prompt_len + cfg.new_tokens
    judge = None
    entries: list[dict[str, Any]] = []
    meta = {"selection": selection_metadata(cfg, steps=False)}
    with ExitStack() as stack:
        if shared:
            stack.enter_context(apply_path(ref_model, cfg.reference))
            ref_names = cand_names = None
        else:  # each side runs with the names its own path set (ulptrace.sides)
            *_, ref_names, cand_names = stack.enter_context(apply_paths(ref_model, cfg.reference, cand_model,
                                                                        cfg.candidate))
        if cfg.oracle:
            from ulptrace.verdicts import OracleJudge

            with ref_names.entered() if ref_names is not None else nullcontext():
                judge = OracleJudge(ref_model)  # the reference's semantics, with the names its path set
        ref = _Side(ref_model, cfg.reference_mode, max_len, cfg.reference, selected_sites(ref_model, cfg), meta,
                    ref_names)
        cand = _Side(cand_model, cfg.candidate_mode, max_len, cfg.candidate, selected_sites(cand_model, cfg), meta,
                     cand_names)
        if shared:
            ref.other, cand.other = cand, ref
            stack.enter_context((ref if cfg.reference_mode == "graph" else cand).open())
        else:
            stack.enter_context(ref.open())
            stack.enter_context(cand.open())
        say(f"lockstep: {cfg.reference} ({cfg.reference_mode}) vs {cfg.candidate} ({cfg.candidate_mode}), "
            f"{'free-running' if free_running else 'candidate restored to the reference before every step'}"
            + (" (one model: both sides run the same path)" if shared else ""))
        ref_logits = ref.run(0, lambda: ref.session.prefill(prompts))
        cand_logits = cand.run(0, lambda: cand.session.prefill(prompts))
        entries.append(_entry(0, ref_logits, cand_logits, ref, cand, judge, cfg.max_ulp, restored=False))
        for step in range(1, cfg.new_tokens):
            tokens = ref_logits.argmax(-1, keepdim=True)
            ref.session.tokens = tokens
            if not free_running:
                cand.session.restore(ref.session.snapshot())
            cand.session.tokens = tokens
            ref_logits = ref.run(step, lambda fed=tokens: ref.session.step(fed))
            cand_logits = cand.run(step, lambda fed=tokens: cand.session.step(fed))
            entries.append(_entry(step, ref_logits, cand_logits, ref, cand, judge, cfg.max_ulp,
                                  restored=not free_running))
            e = entries[-1]
            say(f"  step {step}: logits {'bitwise equal' if e['logits_bitwise_equal'] else 'differ'}, "
                f"states {'bitwise equal' if e['states_bitwise_equal'] else 'differ'}")
    steps = entries[1:]
    return {
        "schema": SCHEMA,
        "version": 1,
        "model": cfg.model,
        "reference": {"path": cfg.reference, "mode": cfg.reference_mode},
        "candidate": {"path": cfg.candidate, "mode": cfg.candidate_mode},
        "restored": not free_running,
        "shared_model": shared,
        "prompts": list(prompts.shape),
        "new_tokens": cfg.new_tokens,
        "cache_len": None if cfg.reference_mode == cfg.candidate_mode == "eager" else max_len,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "prefill": entries[0],
        "steps": steps,
        "bitwise_steps": sum(e["logits_bitwise_equal"] and e["states_bitwise_equal"] for e in steps),
    }


def _entry(step: int, ref_logits: torch.Tensor, cand_logits: torch.Tensor, ref: _Side, cand: _Side, judge: Any,
           max_ulp: int, *, restored: bool) -> dict[str, Any]:
    states_equal, ulps, row_ulps = compare_states(ref.session.snapshot(), cand.session.snapshot())
    comparison = compare(ref.sink.take(), cand.sink.take(), judge=judge, max_ulp=max_ulp)
    onset, first = onset_object(comparison)
    differing = [d for d in comparison.sites if not d.bitwise_equal]
    return {
        "step": step,
        "restored": restored,
        "logits_bitwise_equal": bitwise_equal(ref_logits, cand_logits),
        "states_bitwise_equal": states_equal,
        "max_ulp": {"logits": _max_ulp(ref_logits, cand_logits), **ulps},
        "max_row_ulp": {"logits": _max_row_ulp(ref_logits, cand_logits), **row_ulps},
        "tokens_equal": bool(torch.equal(ref_logits.argmax(-1), cand_logits.argmax(-1))),
        "records": len(comparison.sites),
        "differing_records": len(differing),
        "onset": onset,
        "first_difference": first,
    }


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def to_table(report: dict[str, Any]) -> str:
    """One line per step: logits and states bitwise or their max ULPs, and the step's onset."""
    ref, cand = report["reference"], report["candidate"]
    how = ("the candidate restored to the reference's state before every step" if report["restored"]
           else "free-running (no restore)")
    title = (f"lockstep on {report['model']} [{report['dtype']}, {report['device']}], prompts "
             f"{report['prompts'][0]}x{report['prompts'][1]}: {cand['path']} ({cand['mode']}) vs {ref['path']} "
             f"({ref['mode']}), {how}; both fed the reference's greedy tokens")
    lines = [title, ""]
    head = ["step", "logits ulp (row ulp)", "states", "worst state: ulp (row ulp)", "records differing",
            "onset / first difference"]
    body = [head]
    for e in [report["prefill"]] + report["steps"]:
        rows = {k: v for k, v in e["max_row_ulp"].items() if k != "logits"}
        worst = max(rows, key=lambda k: -1.0 if rows[k] is None else rows[k], default=None)
        body.append([
            "0 (prefill)" if e["step"] == 0 else str(e["step"]),
            "bitwise" if e["logits_bitwise_equal"] else
            f"{e['max_ulp']['logits']} ({_number(e['max_row_ulp']['logits'])})",
            "bitwise" if e["states_bitwise_equal"] else "differ",
            "-" if e["states_bitwise_equal"] or worst is None else
            f"{worst}: {e['max_ulp'][worst]} ({_number(rows[worst])})",
            f"{e['differing_records']}/{e['records']}",
            ("onset " + describe_point(e["onset"])) if e["onset"] else
            ("none" if e["first_difference"] is None else "no onset; first difference "
             + describe_point(e["first_difference"])),
        ])
    widths = [max(len(r[i]) for r in body) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    steps = report["steps"]
    summary = (f"decode steps bitwise identical (logits and every state tensor): {report['bitwise_steps']} of "
               f"{len(steps)}")
    legend = ("ulp: the largest distance of an element in ULPs of its own dtype; row ulp: in ULPs of its row's "
              "largest magnitude (the last dimension), which a near-zero element cannot inflate")
    lines += ["", summary, legend]
    return "\n".join(lines)


def to_markdown(report: dict[str, Any]) -> str:
    table = to_table(report).splitlines()
    return "## ulptrace lockstep\n\n```\n" + "\n".join(table) + "\n```\n"
