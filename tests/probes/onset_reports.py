"""Helpers of the tests that run onsets with helper processes (``--concurrent``, ``--judge-workers``): an onset's
report, the report less what says when and in which process, and a run that fails instead of hanging."""

from __future__ import annotations

import threading

import pytest
from ulptrace.probes.onset import run_onset
from ulptrace.run import RunConfig

# when and in which process, not what was found
VOLATILE = ("versions", "path_info", "reference_process", "candidate_process", "judging_processes", "timeline",
            "concurrent_from_start")


def report(cfg: RunConfig) -> dict:
    """``run_onset(cfg)``'s comparison as JSON, with the run info under ``run``."""
    comparison, info = run_onset(cfg)
    data = comparison.to_json()
    data["run"] = info
    return data


def essentials(data: object) -> object:
    """``data`` without the :data:`VOLATILE` fields, at any depth."""
    if isinstance(data, dict):
        return {k: essentials(v) for k, v in data.items() if k not in VOLATILE}
    if isinstance(data, list):
        return [essentials(v) for v in data]
    return data


def within(seconds: float, run):
    """``run()``'s result, or a failure after ``seconds`` (a deadlock between processes fails the test instead of
    hanging the suite: the run is left in a daemon thread)."""
    result: list = []

    def target() -> None:
        try:
            result.append((True, run()))
        except BaseException as exc:  # noqa: BLE001 — raised again in the test's thread
            result.append((False, exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if not result:
        pytest.fail(f"no result within {seconds} s (processes waiting for each other?)")
    ok, value = result[0]
    if not ok:
        raise value
    return value
