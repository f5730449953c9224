"""Comparison rules over several records: one design per call (``ulptrace.comparison.one_design_per_call``)."""

from __future__ import annotations


def _scan_pair(step: int, layer: int, core: dict, state: dict) -> list:
    from ulptrace.comparison import SiteDiff

    def diff(name: str, counts: dict) -> SiteDiff:
        verdicts = {"exact": 0, "tie": 0, "boundary": 0, "error": 0, "nonfinite": 0, **counts}
        buckets = {v: ({"1": n} if n else {}) for v, n in verdicts.items() if v != "exact"}
        return SiteDiff(site=f"layers.{layer}.linear_attn.{name}", step=step, kind="attention", layer=layer,
                        elements=100, differing=sum(counts.values()), max_ulp=1, histogram={}, bitwise_equal=False,
                        dtype="bfloat16", shape=[100], verdicts=verdicts, boundary="a design" if
                        verdicts["boundary"] else None, explained=1.0, verdict_histogram=buckets)

    return [diff("core", core), diff("recurrent_state", state)]


def test_one_design_per_call_counts_a_calls_boundaries_as_errors_where_any_output_has_errors() -> None:
    from ulptrace.comparison import one_design_per_call

    flagged = _scan_pair(1, 0, {"boundary": 7, "tie": 2}, {"boundary": 30, "error": 4})
    honest = _scan_pair(1, 2, {"boundary": 5}, {"boundary": 9})  # another layer: every element explained
    later = _scan_pair(2, 0, {"boundary": 3}, {"tie": 8})  # the same layer, another step (another call)
    one_design_per_call(flagged + honest + later)
    core, state = flagged
    assert core.verdicts == {"exact": 0, "tie": 2, "boundary": 0, "error": 7, "nonfinite": 0}
    assert core.verdict_histogram["error"] == {"1": 7} and core.verdict_histogram["boundary"] == {"1": 0}
    assert core.boundary is None and "layers.0.linear_attn.recurrent_state (4 error element(s))" in core.note
    assert state.verdicts["error"] == 34 and state.verdicts["boundary"] == 0 and "this record" in state.note
    assert [d.verdicts["boundary"] for d in honest + later] == [5, 9, 3, 0]  # untouched
    assert all(d.verdicts["error"] == 0 and d.note is None for d in honest + later)
