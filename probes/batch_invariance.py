"""Batch invariance: does a prompt get the same greedy tokens alone as inside a batch of ``b``?

One path in one mode. Every prompt is generated alone (batch 1, the reference of its row), then the prompts
are generated in consecutive batches of each size ``b`` (prompts ``0..b-1``, ``b..2b-1``, ...). A row is
token-exact when its tokens equal the same prompt's alone. A divergent row gets the matrix's treatment
(``ulptrace.probes.divergence``): its first divergent step, near-tie or not, and where it began — the batch
restored to the alone runs' states just before that step (each row its own prompt's, ``splice_row``), the
step re-run traced on both, and the onset of that row (its records sliced out of the batch). Divergence
caused by the batch shape typically begins at a reduction whose order changed with it (a matmul or a
norm), judged a tie when the order is an honest one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from ulptrace.comparison import bitwise_equal
from ulptrace.models import build_model
from ulptrace.paths import apply_path
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
from ulptrace.run import RunConfig, check_mode, make_prompts, selected_sites, selection_metadata, splice_row, torch_dtype
from ulptrace.ulp import ulp_stats

SCHEMA = "ulptrace.batch_invariance"


@dataclass
class BatchInvarianceConfig:
    """``run``: the common options; its ``reference`` is the path and ``reference_mode`` the mode, ``prompts``
    the number of prompts (None: the largest batch size)."""

    run: RunConfig
    batches: Sequence[int] = (1, 2, 4, 8)
    locate: bool = True
    locate_seconds: float | None = None  # no row located once locating has taken this long (None: no limit)
    resume: dict[str, Any] | None = None  # an earlier (e.g. stopped) report of this run: its batch sizes are kept

    @property
    def prompts(self) -> int:
        return self.run.prompts if self.run.prompts is not None else max(self.batches)

    def validate(self) -> None:
        check_values("--batches", self.batches, minimum=1)
        if self.locate_seconds is not None and self.locate_seconds < 0:
            raise ValueError(f"--locate-seconds must be >= 0, but got {self.locate_seconds}")
        check_mode(self.run.reference_mode, self.run.device, what="mode")
        prompts = self.prompts
        if prompts < 1:
            raise ValueError(f"--prompts must be >= 1, but got {prompts}")
        large = [b for b in self.batches if b > prompts]
        if large:
            raise ValueError(f"--batches {' '.join(map(str, large))}: a batch cannot hold more rows than there are "
                             f"prompts (--prompts {prompts}); expected batch sizes <= {prompts}")
        ragged = [b for b in self.batches if prompts % b]
        if ragged:
            given = f"--prompts {prompts}" if self.run.prompts is not None else \
                f"the number of prompts (by default the largest batch size, {prompts})"
            raise ValueError(f"{given} is not a multiple of batch size(s) {' '.join(map(str, ragged))}: expected "
                             f"every prompt in a full batch of each size (--prompts {math.lcm(*self.batches)} is)")
        RunConfig(**{**vars(self.run), "prompts": prompts, "candidate": self.run.reference,
                     "candidate_mode": self.run.reference_mode, "extra": dict(self.run.extra)}).validate()


@recording_collector()  # every recorder of the run and what is made between them
def run_batch_invariance(cfg: BatchInvarianceConfig, progress: Callable[[str], None] | None = None,
                         on_batch: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Generate every prompt alone and in batches; returns the report (``summary``, ``rows``).

    ``on_batch`` receives the report so far (``complete`` false) after every batch size.
    """
    say = progress or (lambda msg: None)
    cfg.validate()
    run = cfg.run
    started = time.perf_counter()
    count = cfg.prompts
    done = resumed_batches(cfg, cfg.resume) if cfg.resume is not None else {}
    resumed = len(done)
    done[1] = ({"batch": 1, "exact": count, "rows": count, "note": "alone: the reference"}, [])  # nothing compared
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    if all(b in done for b in cfg.batches):  # nothing left to generate
        for batch in cfg.batches:
            summary.append(done[batch][0])
            rows += done[batch][1]
        return _report(cfg, count, summary, rows, started, complete=True, resumed=resumed)
    cache_len = None if run.reference_mode == "eager" else run.cache_len or run.prompt_len + run.new_tokens
    model = build_model(run.model, dtype=torch_dtype(run.dtype), device=run.device, seed=run.seed, sdpa=run.sdpa)
    prompts = make_prompts(model.config.vocab_size, count, run.prompt_len, run.seed, run.device)
    sites = selected_sites(model, run, ())  # one path: the reference, at every batch size
    meta = {"selection": selection_metadata(run, (), steps=False)}
    locate_spent = 0.0
    with apply_path(model, run.reference):
        judge = None
        if run.oracle and cfg.locate:
            from ulptrace.verdicts import OracleJudge

            judge = OracleJudge(model)
        say(f"{count} prompt(s) alone ({run.reference}, {run.reference_mode})")
        alone = [Side(model, run.reference, run.reference_mode, prompts[i:i + 1],
                      generate(model, prompts[i:i + 1], run.new_tokens, mode=run.reference_mode, cache_len=cache_len,
                               keep_states=cfg.locate), cache_len)
                 for i in range(count)]
        # does the path repeat itself? Prompt 0 alone once more: a path that does not would have its run-to-run
        # differences read as the batch's
        again = generate(model, prompts[:1], run.new_tokens, mode=run.reference_mode, cache_len=cache_len)
        first = alone[0].generation
        repeat = {"checked": "prompt 0 generated alone twice", "tokens_equal": bool(torch.equal(first.tokens,
                                                                                                  again.tokens)),
                  "logits_bitwise": all(bitwise_equal(a, b) for a, b in zip(first.logits, again.logits))}
        if not repeat["logits_bitwise"]:
            say("the path does not repeat itself: prompt 0 alone gave other logits the second time")
        for batch in cfg.batches:
            if batch in done:  # alone (batch 1), or taken from the resumed report
                summary.append(done[batch][0])
                rows += done[batch][1]
                if batch != 1:
                    say(f"  batch {batch}: taken from the resumed report")
                continue
            exact = 0
            for first in range(0, count, batch):
                members = list(range(first, first + batch))
                gen = generate(model, prompts[first:first + batch], run.new_tokens, mode=run.reference_mode,
                               cache_len=cache_len, keep_states=cfg.locate)
                side = Side(model, run.reference, run.reference_mode, prompts[first:first + batch], gen, cache_len)
                t0 = time.perf_counter()  # the budget counts locating only, not generating
                deadline = None if cfg.locate_seconds is None else t0 + cfg.locate_seconds - locate_spent
                found = batch_rows(alone, members, side, judge=judge, locate_rows=cfg.locate, max_ulp=run.max_ulp,
                                   sites=sites, metadata=meta, seed=run.seed, deadline=deadline)
                locate_spent += time.perf_counter() - t0
                exact += sum(r["token_exact"] for r in found)
                rows += found
            mine = rows[len(rows) - count:]
            summary.append({"batch": batch, "exact": exact, "rows": count,
                            "logits_bitwise": sum(r["logits_bitwise"] for r in mine),
                            "logits_max_ulp": max(r["logits_max_ulp"] for r in mine)})
            say(f"  batch {batch}: {exact} of {count} rows token-exact, {summary[-1]['logits_bitwise']} with bitwise "
                "logits")
            if on_batch is not None:
                on_batch(_report(cfg, count, summary, rows, started, complete=False, resumed=resumed,
                                 repeat=repeat))
    return _report(cfg, count, summary, rows, started, complete=True, resumed=resumed, repeat=repeat)


def resumed_batches(cfg: BatchInvarianceConfig, report: dict[str, Any]
                    ) -> dict[int, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The batch sizes an earlier report of this run completed (``--resume``), each with its summary entry and
    rows (marked ``"resumed": true``); batch sizes this run does not ask for are left out.

    Raises:
        ValueError: not a batch-invariance report, or one of another run (naming the field and both values).
    """
    run = cfg.run
    check_resumable(report, SCHEMA, {
        "model": run.model, "path": run.reference, "mode": run.reference_mode, "seed": run.seed,
        "prompts": [cfg.prompts, run.prompt_len], "new_tokens": run.new_tokens, "device": run.device,
        "dtype": run.dtype, "located": cfg.locate, "judging": judging(run, ())})
    out = {}
    for entry in report.get("summary", []):
        batch = entry["batch"]
        found = [{**r, "resumed": True} for r in report.get("rows", []) if r["batch"] == batch]
        if batch != 1 and batch in cfg.batches and len(found) == entry["rows"]:
            out[batch] = ({**entry, "resumed": True}, found)
    return out


def _report(cfg: BatchInvarianceConfig, count: int, summary: list[dict[str, Any]], rows: list[dict[str, Any]],
            started: float, *, complete: bool, resumed: int = 0, repeat: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    run = cfg.run
    extra = {"resumed": {"batches": resumed, "note": "batch sizes taken from an earlier report of this run "
                         "(--resume), not re-run; timing counts this run only"}} if cfg.resume is not None else {}
    return {
        "schema": SCHEMA,
        "version": 1,
        "complete": complete,
        "model": run.model,
        "path": run.reference,
        "mode": run.reference_mode,
        "seed": run.seed,
        "prompts": [count, run.prompt_len],
        "new_tokens": run.new_tokens,
        "batches": list(cfg.batches),
        "device": run.device,
        "dtype": run.dtype,
        "near_tie_rule": NEAR_TIE_RULE,
        "located": cfg.locate,
        "judging": judging(run, ()),
        "locate_seconds": cfg.locate_seconds,
        "summary": summary,
        "rows": rows,
        "repeatable": repeat,  # None: nothing generated in this run (every batch size resumed)
        "timing": {"seconds": time.perf_counter() - started},
        **extra,
    }


def batch_rows(alone: list[Side], members: list[int], batched: Side, *, judge: Any = None, locate_rows: bool = True,
               max_ulp: int = 0, sites: Sequence[Any] | None = None, metadata: dict[str, Any] | None = None,
               seed: int = 0, deadline: float | None = None) -> list[dict[str, Any]]:
    """The rows of one batch (``members``: the prompt of each row) against those prompts alone; no row is
    located once ``time.perf_counter()`` has passed ``deadline``."""
    gen = batched.generation
    reference = torch.cat([alone[i].generation.tokens for i in members])
    steps = first_divergent_steps(reference, gen.tokens)
    batch = len(members)
    rows = []
    for row, step in enumerate(steps):
        prompt = members[row]
        entry = {"path": batched.path, "mode": batched.mode, "seed": seed, "batch": batch, "attempt": 1,
                 "row": prompt, "row_in_batch": row, "token_exact": step is None, "first_divergent_step": step,
                 "near_tie": None, "accumulated": None, "onset": None}
        # the logits of every step whose inputs both runs share (to the first divergent one): bitwise, or how far
        logits = [(alone[prompt].generation.logits[t][0], gen.logits[t][row])
                  for t in range(gen.tokens.shape[1] if step is None else step + 1)]
        entry["logits_bitwise"] = all(bitwise_equal(a, b) for a, b in logits)
        entry["logits_max_ulp"] = max(ulp_stats(a, b).max_ulp for a, b in logits)
        if step is not None:
            tie = near_tie(alone[prompt].generation.logits[step][0], gen.logits[step][row])
            entry.update(near_tie=tie["near_tie"], gap=tie["gap"], noise=tie["noise"],
                         reference_token=tie["reference_token"], candidate_token=tie["candidate_token"],
                         located=False)
        rows.append(entry)
    if not locate_rows:
        return rows
    for step in sorted({s for s in steps if s is not None}):
        if deadline is not None and time.perf_counter() > deadline:
            break
        wanted = {row: (alone[members[row]], 0) for row, s in enumerate(steps) if s == step}
        state = feed = None
        if step:  # every row of the batch put back on its own prompt's alone run, just before the step
            state = gen.states[step]
            for row, prompt in enumerate(members):
                state = splice_row(state, row, alone[prompt].generation.states[step], 0)
            feed = reference[:, step - 1:step]
        found = locate(wanted, batched, step, candidate_state=state, candidate_feed=feed, candidate_forced=reference,
                       judge=judge, max_ulp=max_ulp, sites=sites, metadata=metadata)
        for row, where in found.items():
            rows[row].update(where, located=True)
    return rows


def to_table(report: dict[str, Any], limit: int | None = 40) -> str:
    head = (f"batch invariance of {report['path']} ({report['mode']}) on {report['model']} [{report['dtype']}, "
            f"{report['device']}]: {report['prompts'][0]} prompts of {report['prompts'][1]} tokens, "
            f"{report['new_tokens']} new tokens, greedy, EOS disabled; each row against its prompt generated alone")
    lines = [head, "", "token-exact rows per batch size, and rows whose logits are bitwise those alone (every step "
                       "whose inputs both share):"]
    body = [["batch", "exact rows", "bitwise logits"]]
    for entry in report["summary"]:
        if entry["batch"] == 1:
            body.append(["1", f"{entry['exact']}/{entry['rows']} (alone: the reference)", "-"])
            continue
        bitwise = entry.get("logits_bitwise")  # (a report resumed from before it was counted has none)
        body.append([str(entry["batch"]), f"{entry['exact']}/{entry['rows']}",
                     "?" if bitwise is None else f"{bitwise}/{entry['rows']}" + (
                         f" (largest difference {entry['logits_max_ulp']} ULP)" if bitwise < entry["rows"] else "")])
    widths = [max(len(r[i]) for r in body) for i in range(3)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    hidden = [e["batch"] for e in report["summary"] if e["batch"] != 1 and e["exact"] == e["rows"]
              and e.get("logits_bitwise", e["rows"]) < e["rows"]]
    if hidden:
        lines.append(f"  batch {', '.join(map(str, hidden))}: every row token-exact, but not every row's logits are "
                     "bitwise those alone — the batch changes what the path computes; greedy tokens hid it")
    repeat = report.get("repeatable")
    if repeat is not None and not repeat["logits_bitwise"]:
        lines.append("  the path does not repeat itself: prompt 0 alone gave other "
                     + ("logits" if repeat["tokens_equal"] else "tokens") + " the second time — a difference above "
                     "may be run-to-run noise, not the batch's")
    divergent = [r for r in report["rows"] if not r["token_exact"]]
    lines += ["", f"divergent rows: {len(divergent)} of {len(report['rows'])} (row = the prompt's index)", NEAR_TIE_RULE]
    if divergent:
        shown = divergent if limit is None else divergent[:limit]
        body = [ROW_HEAD] + [row_cells(r) for r in shown]
        widths = [max(len(r[i]) for r in body) for i in range(len(ROW_HEAD))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
        if limit is not None and len(divergent) > limit:
            lines.append(f"  ... {len(divergent) - limit} more rows (--all or --json for every row)")
        unlocated = sum(not r.get("located") for r in divergent)
        if unlocated and report.get("located", True):
            lines.append(f"  {unlocated} divergent row(s) not located: the --locate-seconds budget was spent")
    lines += ["", f"time: {report['timing']['seconds']:.1f} s"]
    return "\n".join(lines)


def to_markdown(report: dict[str, Any]) -> str:
    return "## ulptrace batch invariance\n\n```\n" + to_table(report, limit=None) + "\n```\n"
