"""The token-parity matrix: seeds x batches x modes x candidate paths, every divergent row located.

Against a reference path and mode (default ``hf``, ``eager``: HF's dynamic cache), every candidate path
runs greedy generations (EOS disabled) of seeded prompts in each mode — ``eager``, ``static`` and
``graph``, the latter ``graph_attempts`` times, each attempt a fresh session and CUDA-graph capture — for
every seed (weights and prompts) and batch size (the batch of ``b`` rows is the first ``b`` prompts). A
*check* is one such generation: whole-batch token-exact or not. The summary counts exact checks per path
and mode (the shape of the report it reproduces: Eager k/8, Graph k/16, Total k/24 for seeds 0/1, batches
1/2/4/8, one eager and two graph attempts). Every row of every check gets its first divergent step; each
divergent row is classified near-tie or not and located (``ulptrace.probes.divergence``): the step re-run
traced from the reference's state, or — when that no longer flips the row — a re-run from the start fed
the reference's tokens (``accumulated``).

The reference of a (seed, batch) runs once and keeps its decoding state before every decode step
(memory: one state per step, e.g. about 160 MB per step for Qwen3.5-0.8B at batch 8); candidates keep
their logits only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from ulptrace.comparison import bitwise_equal
from ulptrace.models import build_model, twin
from ulptrace.paths import apply_path, resolve_path
from ulptrace.sides import SideNames, apply_candidate
from ulptrace.probes.divergence import (
    NEAR_TIE_RULE,
    ROW_HEAD,
    Side,
    check_resumable,
    check_values,
    first_divergent_steps,
    generate,
    judging,
    locate,
    near_tie,
    row_cells,
)
from ulptrace.record import recording_collector
from ulptrace.run import RunConfig, check_mode, make_prompts, selected_sites, selection_metadata, torch_dtype

SCHEMA = "ulptrace.matrix"


@dataclass
class MatrixConfig:
    """The grid. ``run`` holds the common options: model, ``reference`` path and ``reference_mode``,
    ``prompt_len``, ``new_tokens``, ``cache_len``, device, dtype, site selection, ``oracle``, ``max_ulp``
    (its ``prompts``, ``seed``, ``candidate`` and ``candidate_mode`` are set from the grid)."""

    run: RunConfig
    candidates: Sequence[str]
    seeds: Sequence[int] = (0, 1)
    batches: Sequence[int] = (1, 2, 4, 8)
    modes: Sequence[str] = ("eager", "graph")
    graph_attempts: int = 2
    locate: bool = True
    locate_limit: int | None = None  # at most this many divergent rows located per path and mode (None: all)
    locate_seconds: float | None = None  # no row located once locating has taken this long (None: no limit)
    resume: dict[str, Any] | None = None  # an earlier (e.g. stopped) report of this grid: its checks are not re-run

    def attempts(self, mode: str) -> int:
        return self.graph_attempts if mode == "graph" else 1

    def validate(self) -> None:
        """Everything that can be checked before a model is built; ``ValueError`` naming expected and found."""
        check_values("--candidate", self.candidates, kind="path")
        check_values("--seeds", self.seeds)
        check_values("--batches", self.batches, minimum=1)
        check_values("--modes", self.modes, kind="mode")
        for mode in self.modes:
            check_mode(mode, self.run.device, what="modes")
        if self.locate_limit is not None and self.locate_limit < 0:
            raise ValueError(f"--locate-limit must be >= 0 (0 locates no row), but got {self.locate_limit}")
        if self.locate_seconds is not None and self.locate_seconds < 0:
            raise ValueError(f"--locate-seconds must be >= 0, but got {self.locate_seconds}")
        if self.graph_attempts < 1:
            raise ValueError(f"--graph-attempts must be >= 1 (each attempt is a fresh CUDA-graph capture), "
                             f"but got {self.graph_attempts}")
        for path in self.candidates:
            resolve_path(path)
        resolve_path(self.run.reference)
        base = self.run
        static = next((m for m in self.modes if m != "eager"), "eager")
        for path in self.candidates:  # the run layer's own checks, once per candidate (fault: steps, selection)
            RunConfig(**{**vars(base), "candidate": path, "candidate_mode": static, "prompts": max(self.batches),
                         "extra": dict(base.extra)}).validate()
        if self.resume is not None:
            resumed_checks(self, self.resume)

    @property
    def cache_len(self) -> int | None:
        if self.run.reference_mode == "eager" and all(m == "eager" for m in self.modes):
            return None
        return self.run.cache_len or self.run.prompt_len + self.run.new_tokens


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@recording_collector()  # every recorder of the run and what is made between them
def run_matrix(cfg: MatrixConfig, progress: Callable[[str], None] | None = None,
               on_check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the grid; returns the report (the JSON contract: ``summary``, ``rows``, see the README).

    ``on_check`` receives the report so far (``complete`` false) after every check, e.g. to keep a partial
    report on disk should the run be stopped.
    """
    say = progress or (lambda msg: None)
    cfg.validate()
    run = cfg.run
    dtype = torch_dtype(run.dtype)
    started = time.perf_counter()
    timing = {"generation_seconds": 0.0, "reference_seconds": 0.0, "locate_seconds": 0.0, "build_seconds": 0.0}
    summary = {path: {mode: {"exact": 0, "checks": 0} for mode in cfg.modes} for path in cfg.candidates}
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    cache_len = cfg.cache_len
    meta = {"selection": selection_metadata(run, cfg.candidates, steps=False)}
    budget = {(p, m): cfg.locate_limit if cfg.locate else 0 for p in cfg.candidates for m in cfg.modes}
    done = resumed_checks(cfg, cfg.resume) if cfg.resume is not None else {}
    wanted = [(p, m, a) for p in cfg.candidates for m in cfg.modes for a in range(1, cfg.attempts(m) + 1)]
    earlier: dict[tuple, tuple[Any, list[dict[str, Any]]]] = {}  # an earlier attempt of the same configuration

    def report(complete: bool) -> dict[str, Any]:
        totals = {path: {**summary[path], "total": {
            "exact": sum(summary[path][m]["exact"] for m in cfg.modes),
            "checks": sum(summary[path][m]["checks"] for m in cfg.modes)}} for path in cfg.candidates}
        return {
            "schema": SCHEMA,
            "version": 1,
            "complete": complete,
            "model": run.model,
            "reference": {"path": run.reference, "mode": run.reference_mode},
            "candidates": list(cfg.candidates),
            "grid": {"seeds": list(cfg.seeds), "batches": list(cfg.batches), "modes": list(cfg.modes),
                     "graph_attempts": cfg.graph_attempts, "prompt_len": run.prompt_len, "new_tokens": run.new_tokens,
                     "cache_len": cache_len, "device": run.device, "dtype": run.dtype},
            "near_tie_rule": NEAR_TIE_RULE,
            "located": cfg.locate,
            "judging": judging(run, cfg.candidates),
            "locate_limit": cfg.locate_limit,
            "locate_seconds": cfg.locate_seconds,
            "summary": totals,
            "rows": rows,
            "checks": checks,
            "timing": {**timing, "seconds": time.perf_counter() - started},
            **({"resumed": {"checks": len(done), "note": "checks taken from an earlier report of this grid (--resume), "
                            "not re-run; timing counts this run only"}} if cfg.resume is not None else {}),
        }

    def take(key: tuple) -> None:
        """A check of the earlier report (``--resume``), counted as if run now."""
        check, found = done[key]
        summary[check["path"]][check["mode"]]["checks"] += 1
        summary[check["path"]][check["mode"]]["exact"] += int(check["token_exact"])
        if budget[check["path"], check["mode"]] is not None:  # rows it located count against --locate-limit
            budget[check["path"], check["mode"]] -= located_afresh(found)
        rows.extend(found)
        checks.append(check)

    for seed in cfg.seeds:
        if all((p, m, seed, b, a) in done for b in cfg.batches for p, m, a in wanted):
            for batch in cfg.batches:
                for p, m, a in wanted:
                    take((p, m, seed, batch, a))
            say(f"seed {seed}: every check taken from the resumed report")
            continue
        t0 = time.perf_counter()
        ref_model = build_model(run.model, dtype=dtype, device=run.device, seed=seed, sdpa=run.sdpa)
        cand_model = twin(ref_model)
        timing["build_seconds"] += time.perf_counter() - t0
        prompts_all = make_prompts(ref_model.config.vocab_size, max(cfg.batches), run.prompt_len, seed, run.device)
        sites = selected_sites(ref_model, run, cfg.candidates)  # observable on every candidate path
        before = SideNames(ref_model)  # what the models' code looks up, before either path (ulptrace.sides)
        with apply_path(ref_model, run.reference):
            ref_names = SideNames(ref_model)
            judge = None
            if run.oracle and cfg.locate:
                from ulptrace.verdicts import OracleJudge

                judge = OracleJudge(ref_model)  # built while only the reference's path is applied
            for batch in cfg.batches:
                if all((p, m, seed, batch, a) in done for p, m, a in wanted):
                    for p, m, a in wanted:
                        take((p, m, seed, batch, a))
                    say(f"seed {seed}, batch {batch}: every check taken from the resumed report")
                    continue
                prompts = prompts_all[:batch]
                say(f"seed {seed}, batch {batch}: reference {run.reference!r} ({run.reference_mode})")
                t0 = time.perf_counter()
                ref_gen = generate(ref_model, prompts, run.new_tokens, mode=run.reference_mode, cache_len=cache_len,
                                   keep_states=cfg.locate)
                _sync(run.device)
                timing["reference_seconds"] += time.perf_counter() - t0
                reference = Side(ref_model, run.reference, run.reference_mode, prompts, ref_gen, cache_len, ref_names)
                for path in cfg.candidates:
                    with apply_candidate(before, cand_model, path, names=True) as (_, cand_names):
                        for mode in cfg.modes:
                            for attempt in range(1, cfg.attempts(mode) + 1):
                                if (path, mode, seed, batch, attempt) in done:
                                    take((path, mode, seed, batch, attempt))
                                    continue
                                t0 = time.perf_counter()
                                gen = generate(cand_model, prompts, run.new_tokens, mode=mode, cache_len=cache_len)
                                _sync(run.device)
                                seconds = time.perf_counter() - t0
                                timing["generation_seconds"] += seconds
                                candidate = Side(cand_model, path, mode, prompts, gen, cache_len, cand_names)
                                check = {"path": path, "mode": mode, "seed": seed, "batch": batch, "attempt": attempt}
                                t0 = time.perf_counter()
                                same = earlier.get((path, mode, seed, batch))
                                if same is not None and same_generation(same[0], gen):
                                    found = check_rows(reference, candidate, check, locate_limit=0)
                                    reuse_locations(found, same[1])
                                else:
                                    deadline = None if cfg.locate_seconds is None else \
                                        time.perf_counter() + cfg.locate_seconds - timing["locate_seconds"]
                                    found = check_rows(reference, candidate, check, judge=judge,
                                                       locate_limit=budget[path, mode], max_ulp=run.max_ulp,
                                                       sites=sites, metadata=meta, deadline=deadline)
                                    earlier[path, mode, seed, batch] = (gen, found)
                                if budget[path, mode] is not None:
                                    budget[path, mode] -= located_afresh(found)
                                _sync(run.device)
                                timing["locate_seconds"] += time.perf_counter() - t0
                                exact = all(r["token_exact"] for r in found)
                                summary[path][mode]["checks"] += 1
                                summary[path][mode]["exact"] += int(exact)
                                rows += found
                                checks.append({**check, "token_exact": exact, "seconds": seconds})
                                say(f"  {path} {mode} attempt {attempt}: "
                                    + ("token-exact" if exact else
                                       f"{sum(not r['token_exact'] for r in found)} of {batch} row(s) diverge"))
                                if on_check is not None:
                                    on_check(report(False))
        del ref_model, cand_model
    return report(True)


def resumed_checks(cfg: MatrixConfig, report: dict[str, Any]) -> dict[tuple, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The checks of an earlier report of ``cfg``'s grid (``--resume``), keyed ``(path, mode, seed, batch,
    attempt)``, each with its rows. A check without all of its batch's rows (cut off mid-write) is left to run.

    Raises:
        ValueError: not a matrix report, or one of another grid (naming the field and both values).
    """
    run = cfg.run
    ours = {"model": run.model, "reference": {"path": run.reference, "mode": run.reference_mode},
            "located": cfg.locate, "judging": judging(run, cfg.candidates), "grid.seeds": list(cfg.seeds),
            "grid.batches": list(cfg.batches), "grid.modes": list(cfg.modes), "grid.graph_attempts": cfg.graph_attempts,
            "grid.prompt_len": run.prompt_len, "grid.new_tokens": run.new_tokens, "grid.cache_len": cfg.cache_len,
            "grid.device": run.device, "grid.dtype": run.dtype}
    check_resumable(report, SCHEMA, ours)
    if set(report.get("candidates", [])) - set(cfg.candidates):
        raise ValueError(f"--resume: the report has candidate paths {report['candidates']}, this run "
                         f"{list(cfg.candidates)}: expected a subset")
    keys = ("path", "mode", "seed", "batch", "attempt")
    by_check: dict[tuple, list[dict[str, Any]]] = {}
    for row in report.get("rows", []):
        by_check.setdefault(tuple(row[k] for k in keys), []).append(row)
    out = {}
    for check in report.get("checks", []):
        key = tuple(check[k] for k in keys)
        found = sorted(by_check.get(key, []), key=lambda r: r["row"])
        if [r["row"] for r in found] == list(range(check["batch"])):
            out[key] = ({**check, "resumed": True}, found)
    return out


def located_afresh(rows: list[dict[str, Any]]) -> int:
    """The rows of a check located by a traced re-run of their own (not copied from an earlier attempt): what
    counts against ``--locate-limit``."""
    return sum(bool(r.get("located")) and "location_from_attempt" not in r for r in rows)


LOCATION_KEYS = ("accumulated", "restored_step_diverges", "onset", "first_difference", "located_by", "located")


def same_generation(a: Any, b: Any) -> bool:
    """Two generations (``Generation``) with bitwise the same tokens and logits at every step."""
    return bool(torch.equal(a.tokens, b.tokens)) and len(a.logits) == len(b.logits) and \
        all(bitwise_equal(x, y) for x, y in zip(a.logits, b.logits))


def reuse_locations(rows: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> None:
    """Copy the locations of an earlier attempt whose generation was bitwise the same (``same_generation``):
    its rows were located from the same states, tokens and logits. ``location_from_attempt`` says so."""
    for row, before in zip(rows, earlier):
        if not row["token_exact"] and before.get("located"):
            row.update({k: before[k] for k in LOCATION_KEYS if k in before},
                       location_from_attempt=before.get("location_from_attempt", before["attempt"]))


def check_rows(reference: Side, candidate: Side, check: dict[str, Any], *, judge: Any = None,
               locate_limit: int | None = None, max_ulp: int = 0, sites: Sequence[Any] | None = None,
               metadata: dict[str, Any] | None = None, deadline: float | None = None) -> list[dict[str, Any]]:
    """One check's rows (``rows`` of the JSON): token-exact or the first divergent step, near-tie, location.

    Row ``r`` of the candidate is paired with row ``r`` of the reference (the same prompt in the same batch).
    Rows that first diverge at the same step are located together (one traced re-run per step), earliest
    step first, at most ``locate_limit`` rows (None: all), none once ``time.perf_counter()`` has passed
    ``deadline``; a divergent row says whether it was ``located``.
    """
    ref, cand = reference.generation, candidate.generation
    steps = first_divergent_steps(ref.tokens, cand.tokens)
    rows = []
    for row, step in enumerate(steps):
        entry = {**check, "row": row, "token_exact": step is None, "first_divergent_step": step, "near_tie": None,
                 "accumulated": None, "onset": None}
        if step is not None:
            tie = near_tie(ref.logits[step][row], cand.logits[step][row])
            entry.update(near_tie=tie["near_tie"], gap=tie["gap"], noise=tie["noise"],
                         reference_token=tie["reference_token"], candidate_token=tie["candidate_token"],
                         located=False)
        rows.append(entry)
    left = len(rows) if locate_limit is None else locate_limit
    for step in sorted({s for s in steps if s is not None}):
        wanted = {row: (reference, row) for row, s in enumerate(steps) if s == step}
        wanted = dict(list(wanted.items())[:max(left, 0)])
        if not wanted or (deadline is not None and time.perf_counter() > deadline):
            break
        left -= len(wanted)
        state = ref.states[step] if step else None
        feed = ref.tokens[:, step - 1:step] if step else None
        found = locate(wanted, candidate, step, candidate_state=state, candidate_feed=feed,
                       candidate_forced=ref.tokens, judge=judge, max_ulp=max_ulp, sites=sites, metadata=metadata)
        for row, where in found.items():
            rows[row].update(where, located=True)
    return rows


# the grid fields a merged report's parts must share (seeds and candidates are what parts split)
_SHARED_GRID = ("batches", "modes", "graph_attempts", "prompt_len", "new_tokens", "cache_len", "device", "dtype")
_REPORT_KEYS = ("model", "reference", "candidates", "grid", "near_tie_rule", "located", "locate_limit",
                "locate_seconds", "complete", "rows", "checks", "timing")


def merge_reports(reports: Sequence[dict[str, Any]], names: Sequence[str] | None = None) -> dict[str, Any]:
    """One matrix report from reports of disjoint parts of one grid — other seeds and/or other candidate paths
    of the same model, reference, batches, modes, attempts, lengths, device and dtype — e.g. a matrix too long
    for one machine session, run as ``--seeds 0`` and ``--seeds 1``. The summary is recounted from the checks;
    rows and checks are put in the order one run of the whole grid makes; timings add up; ``complete`` only if
    every part is; ``merged_from`` lists each part (``names``, its seeds, paths, completeness and locating
    budget).

    Raises:
        ValueError: fewer than two reports, a report that is not a matrix report, parts of different grids
            (naming the field and both values), or parts that overlap (the same seed and path twice).
    """
    names = list(names) if names is not None else [f"report {i + 1}" for i in range(len(reports))]
    if len(reports) < 2:
        raise ValueError(f"merging needs at least two matrix reports, but got {len(reports)}")
    for name, r in zip(names, reports):
        if not isinstance(r, dict) or r.get("schema") != SCHEMA:
            found = r.get("schema") if isinstance(r, dict) else type(r).__name__
            raise ValueError(f"{name}: expected a matrix report (schema {SCHEMA!r}), but found {found!r}")
        missing = [k for k in _REPORT_KEYS if k not in r] + [f"grid.{k}" for k in _SHARED_GRID + ("seeds",)
                                                              if k not in r.get("grid", {})]
        if missing:
            raise ValueError(f"{name}: not a whole matrix report: it lacks {', '.join(missing)}")
    first, first_name = reports[0], names[0]
    for name, r in zip(names[1:], reports[1:]):
        for field, a, b in [("model", first["model"], r["model"]), ("reference", first["reference"], r["reference"]),
                            ("near_tie_rule", first["near_tie_rule"], r["near_tie_rule"]),
                            ("located", first["located"], r["located"]),
                            ("judging", first.get("judging"), r.get("judging"))] + \
                [(f"grid.{k}", first["grid"].get(k), r["grid"].get(k)) for k in _SHARED_GRID]:
            if a != b:
                raise ValueError(f"{name} is not part of the grid of {first_name}: {field} is {b!r} there, {a!r} in "
                                 f"{first_name}")
    owner: dict[tuple[int, str], str] = {}
    for name, r in zip(names, reports):
        for seed in r["grid"]["seeds"]:
            for path in r["candidates"]:
                if (seed, path) in owner:
                    raise ValueError(f"{name} overlaps {owner[seed, path]}: both have seed {seed} of path {path!r}")
                owner[seed, path] = name
    candidates = list(dict.fromkeys(p for r in reports for p in r["candidates"]))
    seeds = sorted({s for r in reports for s in r["grid"]["seeds"]})
    grid = first["grid"]
    order = {"seed": seeds, "batch": grid["batches"], "path": candidates, "mode": grid["modes"]}

    def position(x: dict[str, Any]) -> tuple:
        return tuple(order[k].index(x[k]) for k in order) + (x["attempt"], x.get("row", 0))

    checks = sorted((c for r in reports for c in r["checks"]), key=position)
    rows = sorted((row for r in reports for row in r["rows"]), key=position)
    summary = {p: {m: {"exact": 0, "checks": 0} for m in grid["modes"]} for p in candidates}
    for c in checks:
        summary[c["path"]][c["mode"]]["checks"] += 1
        summary[c["path"]][c["mode"]]["exact"] += int(c["token_exact"])
    for p in candidates:
        summary[p]["total"] = {k: sum(summary[p][m][k] for m in grid["modes"]) for k in ("exact", "checks")}
    timing = {k: sum(r["timing"].get(k, 0.0) for r in reports) for k in first["timing"]}
    limits = {r["locate_limit"] for r in reports}
    budgets = {r["locate_seconds"] for r in reports}
    return {
        **first,
        "complete": all(r["complete"] for r in reports),
        "candidates": candidates,
        "grid": {**grid, "seeds": seeds},
        "locate_limit": limits.pop() if len(limits) == 1 else None,
        "locate_seconds": budgets.pop() if len(budgets) == 1 else None,
        "summary": summary,
        "rows": rows,
        "checks": checks,
        "timing": timing,
        "merged_from": [{"name": n, "seeds": r["grid"]["seeds"], "candidates": r["candidates"],
                         "complete": r["complete"], "locate_limit": r["locate_limit"],
                         "locate_seconds": r["locate_seconds"]} for n, r in zip(names, reports)],
    }


# -- rendering -----------------------------------------------------------------------------------

def _mode_label(mode: str) -> str:
    return mode.capitalize()


def summary_lines(report: dict[str, Any]) -> list[list[str]]:
    """The summary table's cells: a header of candidate paths, one row per mode, then Total."""
    paths = report["candidates"]
    modes = report["grid"]["modes"]
    body = [[""] + paths]
    for mode in modes + ["total"]:
        body.append([_mode_label(mode)] + [f"{report['summary'][p][mode]['exact']}/{report['summary'][p][mode]['checks']}"
                                           for p in paths])
    return body


def _grid_line(report: dict[str, Any]) -> str:
    grid = report["grid"]
    ref = report["reference"]
    attempts = f" ({grid['graph_attempts']} attempts, each a fresh capture)" if "graph" in grid["modes"] else ""
    return (f"{report['model']} [{grid['dtype']}, {grid['device']}]: seeds {' '.join(map(str, grid['seeds']))}, "
            f"batches {' '.join(map(str, grid['batches']))}, modes {' '.join(grid['modes'])}{attempts}; "
            f"{grid['prompt_len']} prompt + {grid['new_tokens']} new tokens, greedy, EOS disabled; "
            f"reference {ref['path']} ({ref['mode']})")


def _columns(body: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in body) for i in range(len(body[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]


def _named_boundary(row: dict[str, Any]) -> str:
    """The boundary that names a divergent row's onset: its record's verdict is ``boundary``. Not the partial one of
    a record whose verdict is worse (an error record with a few elements inside some hypothesis's set: that name
    explains a few of its elements, not the row)."""
    onset = row.get("onset") or {}
    return (onset.get("boundary") or "") if onset.get("verdict") == "boundary" else ""


def to_table(report: dict[str, Any], limit: int | None = 40) -> str:
    """The terminal report: the summary table, the near-tie rule, the divergent rows, the timing."""
    lines = [_grid_line(report), "", "token-exact checks (whole batch), per candidate path:"]
    lines += _columns(summary_lines(report), "  ")
    divergent = [r for r in report["rows"] if not r["token_exact"]]
    lines += ["", f"divergent rows: {len(divergent)} of {len(report['rows'])}", NEAR_TIE_RULE]
    if divergent:
        shown = divergent if limit is None else divergent[:limit]
        lines += _columns([ROW_HEAD] + [row_cells(r) for r in shown], "  ")
        named = {_named_boundary(r) for r in shown} - {""}
        for boundary in sorted(named):
            lines.append(f"  boundary: {boundary}")
        if limit is not None and len(divergent) > limit:
            lines.append(f"  ... {len(divergent) - limit} more rows (--all or --json for every row)")
        unlocated = sum(not r.get("located") for r in divergent)
        if unlocated and report.get("located", True):
            lines.append(f"  {unlocated} divergent row(s) not located: the --locate-limit or --locate-seconds budget "
                         "was spent")
    if report.get("complete") is False:
        lines.append(f"INCOMPLETE: {len(report['checks'])} checks run before the matrix stopped")
    timing = report["timing"]
    lines += ["", (f"time: {timing['seconds']:.1f} s (candidate generation {timing['generation_seconds']:.1f} s, "
                   f"reference {timing['reference_seconds']:.1f} s, locating {timing['locate_seconds']:.1f} s, "
                   f"model builds {timing['build_seconds']:.1f} s)")]
    return "\n".join(lines)


def to_markdown(report: dict[str, Any]) -> str:
    """The report in markdown: the summary table in the reference report's shape, then the divergent rows."""
    table = summary_lines(report)
    lines = ["## ulptrace token-parity matrix", "", _grid_line(report), "",
             "| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(r) + " |" for r in table[1:]]
    divergent = [r for r in report["rows"] if not r["token_exact"]]
    lines += ["", f"{NEAR_TIE_RULE}.", "", f"Divergent rows: {len(divergent)} of {len(report['rows'])}.", ""]
    if divergent:
        lines += ["| " + " | ".join(ROW_HEAD + ["boundary"]) + " |", "|" + "---|" * (len(ROW_HEAD) + 1)]
        for r in divergent:
            boundary = _named_boundary(r)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row_cells(r) + [boundary]) + " |")
    return "\n".join(lines) + "\n"
