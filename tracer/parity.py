"""Parity checks for test suites: "my injected path introduces no boundary or error anywhere".

``check_parity(model, candidate_path, run)`` records ``run(model)`` on the model as it is (the
reference) and on a deep copy with ``candidate_path`` applied, compares every site with the oracle,
and raises ``ParityError`` naming the onset (site, step, verdicts, named boundary) when a site
introduced error of its own. With a ``saver`` (the pytest fixture ``ulptrace_traces``) both traces are
kept on failure, with the ``ulptrace compare`` command that re-runs the comparison.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ulptrace.comparison import Comparison, compare
from ulptrace.paths import apply_path
from ulptrace.record import Recorder
from ulptrace.verdicts import OracleJudge


class ParityError(AssertionError):
    """A candidate path introduced a boundary mismatch or an error (see ``comparison``)."""

    def __init__(self, message: str, comparison: Comparison) -> None:
        super().__init__(message)
        self.comparison = comparison


def check_parity(model: Any, candidate_path: str, run: Callable[[Any], Any], *, allow: tuple[str, ...] = (),
                 saver: Any = None, label: str | None = None) -> Comparison:
    """Compare ``run(model)`` against ``run(copy of model with candidate_path)``; returns the comparison.

    ``allow`` lists verdict classes to tolerate besides ``exact`` and ``tie`` (e.g. ``("boundary",)``
    for a fused kernel whose boundary mismatches are intended). Raises ``ParityError`` otherwise.
    """
    __tracebackhide__ = True
    candidate = copy.deepcopy(model)
    with Recorder(model) as ref:
        run(model)
    with apply_path(candidate, candidate_path), Recorder(candidate, path=candidate_path) as cand:
        run(candidate)
    comparison = compare(ref.trace, cand.trace, judge=OracleJudge(model))
    bad = [d for d in comparison.sites
           if d.verdicts and any(d.verdicts.get(v, 0) for v in ("boundary", "error", "nonfinite") if v not in allow)]
    if bad:
        saved = saver.save(ref.trace, cand.trace, label=label) if saver is not None else None
        first = bad[0]
        counts = ", ".join(f"{k}: {v}" for k, v in first.verdicts.items() if v)
        lines = [
            f"{candidate_path} is not at parity with the reference: {len(bad)} site record(s) introduce error",
            f"onset: step {first.step}, {first.site} ({first.kind}) — {counts}",
        ]
        if first.boundary:
            lines.append(f"named boundary: {first.boundary} (explains {100 * (first.explained or 0):.0f}%)")
        if first.max_error_ulp:
            lines.append(f"error up to {first.max_error_ulp} ULP outside the admissible set")
        if saved is not None:
            lines.append(f"traces saved under {saved}")
        raise ParityError("\n".join(lines), comparison)
    return comparison
