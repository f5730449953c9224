"""Parity checks for test suites: "my injected path introduces no boundary or error anywhere".

``check_parity(model, candidate_path, run)`` records ``run(model)`` on the model as it is (the
reference) and on a deep copy with ``candidate_path`` applied, compares every site with the oracle,
and raises ``ParityError`` when the comparison is not at parity — decided by ``Comparison.parity``, the
same decision as the CLI's exit codes: a verdict worse than tie, a site the oracle could not judge, a
record missing or of another shape, an unjudged or unobserved onset. The message names each failure
in its own words (a boundary is called a boundary) and the onset. With a ``saver`` (the pytest fixture
``ulptrace_traces``) both traces are kept on failure, with the ``ulptrace compare`` command that re-runs
the comparison.
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
                 max_ulp: int = 0, saver: Any = None, label: str | None = None) -> Comparison:
    """Compare ``run(model)`` against ``run(copy of model with candidate_path)``; returns the comparison.

    ``allow`` lists what to tolerate (see ``Comparison.parity``): verdicts worse than tie, e.g.
    ``("boundary",)`` for a fused kernel whose boundary mismatches are intended, and
    ``"could_not_judge"`` for sites the oracle cannot judge. ``max_ulp`` is the budget of sites without
    oracle semantics. Raises ``ParityError`` when the comparison is not at parity, ``ValueError`` for
    an unknown ``allow`` entry.
    """
    __tracebackhide__ = True
    candidate = copy.deepcopy(model)
    with Recorder(model) as ref:
        run(model)
    with apply_path(candidate, candidate_path), Recorder(candidate, path=candidate_path) as cand:
        run(candidate)
    comparison = compare(ref.trace, cand.trace, judge=OracleJudge(model), max_ulp=max_ulp)
    parity = comparison.parity(allow)
    if not parity:
        saved = saver.save(ref.trace, cand.trace, label=label) if saver is not None else None
        lines = [f"{candidate_path} is not at parity with the reference:"]
        lines += [f"  {f.kind}: {f.message}" for f in parity.failures]
        onset, reason = comparison.onset_with_reason()
        if onset is not None:
            counts = ", ".join(f"{k}: {v}" for k, v in (onset.verdicts or {}).items() if v) or "no verdicts"
            lines.append(f"onset: step {onset.step}, {onset.site} ({onset.kind}) — {reason}; {counts}")
        if saved is not None:
            lines.append(f"traces saved under {saved}")
        raise ParityError("\n".join(lines), comparison)
    return comparison
