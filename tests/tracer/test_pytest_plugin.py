"""The ulptrace pytest plugin, exercised through pytester in-process runs (it loads by its entry point)."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from ulptrace.pytest_plugin import add_options

pytest_plugins = ["pytester"]

FAKE_TRACE = """
import json
from pathlib import Path

class FakeTrace:
    def __init__(self, name):
        self.name = name

    def save(self, path):
        path = Path(path)
        path.mkdir()
        (path / "manifest.json").write_text(json.dumps({"name": self.name}))
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An in-process pytest run; hypothesis' plugin (not needed here) is off because it costs ~1 s a run."""
    return pytester.runpytest("-p", "no:hypothesispytest", "-p", "no:cacheprovider", *args)


def test_entry_point_is_registered() -> None:
    points = importlib.metadata.entry_points(group="pytest11")
    assert any(p.name == "ulptrace" and p.value == "ulptrace.pytest_plugin" for p in points)


def test_plugin_import_does_not_import_torch() -> None:
    code = "import sys, ulptrace.pytest_plugin; print(sorted(m for m in ('torch', 'numpy', 'ulptrace.ulp') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_add_options_works_with_argparse() -> None:
    parser = argparse.ArgumentParser(prog="ulptrace")
    add_options(parser.add_argument)
    args = parser.parse_args(["--ulptrace-save-dir", "out", "--ulptrace-max-ulp", "2"])
    assert (args.ulptrace_save_dir, args.ulptrace_max_ulp) == ("out", 2)
    defaults = parser.parse_args([])
    assert (defaults.ulptrace_save_dir, defaults.ulptrace_max_ulp) == (None, 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ulptrace-max-ulp", "-3"])


def test_options_are_in_one_group_in_help(pytester: pytest.Pytester) -> None:
    result = run(pytester, "--help")
    result.stdout.fnmatch_lines(["*ulptrace*", "*--ulptrace-save-dir=DIR*", "*--ulptrace-max-ulp=N*"])


def test_budget_fixture_follows_the_option(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        """
        import os

        def test_budget(ulptrace_budget):
            assert ulptrace_budget == int(os.environ["EXPECTED_BUDGET"])
        """
    )
    monkeypatch.setenv("EXPECTED_BUDGET", "0")
    run(pytester).assert_outcomes(passed=1)
    monkeypatch.setenv("EXPECTED_BUDGET", "3")
    run(pytester, "--ulptrace-max-ulp=3").assert_outcomes(passed=1)
    bad = run(pytester, "--ulptrace-max-ulp=-1")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--ulptrace-max-ulp*non-negative integer*-1*"])


def test_traces_are_saved_only_with_the_option(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(fake_trace=FAKE_TRACE)
    pytester.makepyfile(
        test_save="""
        import os
        from pathlib import Path
        import pytest
        from fake_trace import FakeTrace

        @pytest.mark.parametrize("case", ["a/b"])
        def test_save(ulptrace_traces, case):
            first = ulptrace_traces.save(FakeTrace("ref"), FakeTrace("cand"))
            second = ulptrace_traces.save(FakeTrace("ref2"), FakeTrace("cand2"), label="step 1/prefill")
            if "SAVE_DIR" not in os.environ:
                assert first is None and second is None and not ulptrace_traces.enabled
                return
            root = Path(os.environ["SAVE_DIR"]) / "test_save.py_test_save_a_b"
            assert first == root / "0" and second == root / "step_1_prefill"
            assert (first / "reference" / "manifest.json").read_text() == '{"name": "ref"}'
            assert (first / "candidate" / "manifest.json").read_text() == '{"name": "cand"}'
            assert (second / "candidate" / "manifest.json").read_text() == '{"name": "cand2"}'

        def test_rejects_objects_without_save(ulptrace_traces):
            with pytest.raises(TypeError, match="candidate must have a save.path. method, but got int"):
                ulptrace_traces.save(FakeTrace("ref"), 3)
        """,
    )
    run(pytester).assert_outcomes(passed=2)
    assert list(pytester.path.rglob("manifest.json")) == []  # nothing saved without the option
    monkeypatch.setenv("SAVE_DIR", str(pytester.path / "traces"))
    run(pytester, "--ulptrace-save-dir=traces").assert_outcomes(passed=2)
    # a re-run replaces the saved directories instead of failing on them
    result = run(pytester, "--ulptrace-save-dir=traces")
    result.assert_outcomes(passed=2)
    assert "= ulptrace =" not in result.stdout.str()  # nothing failed: no summary section


def test_terminal_summary_lists_failed_ulp_assertions_and_saved_traces(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(fake_trace=FAKE_TRACE)
    pytester.makepyfile(
        test_glu_parity="""
        import pytest
        import torch
        from fake_trace import FakeTrace
        from ulptrace.assertions import UlpAssertionError, assert_ulp_close

        def bf16(bits):
            return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16)

        def test_fails(ulptrace_traces):
            ulptrace_traces.save(FakeTrace("ref"), FakeTrace("cand"), label="glu")
            assert_ulp_close(bf16([0x3F80, 0x3F84]), bf16([0x3F80, 0x3F80]), max_ulp=1)

        def test_passes_and_saves(ulptrace_traces):
            ulptrace_traces.save(FakeTrace("ref"), FakeTrace("cand"), label="kept")

        def test_expected_failure_is_not_reported():
            with pytest.raises(UlpAssertionError):
                assert_ulp_close(bf16([0x3F80]), bf16([0x3F90]))
        """,
    )
    result = run(pytester, "--ulptrace-save-dir=out")
    result.assert_outcomes(passed=2, failed=1)
    saved = pytester.path / "out" / "test_glu_parity.py_test_fails" / "glu"
    result.stdout.fnmatch_lines(
        [
            "*= ulptrace =*",
            "Failed ULP assertions:",
            (
                "  test_glu_parity.py::test_fails: ULP budget exceeded: max_ulp=1 (bfloat16); "
                "greatest 4 ULP at index (1,); 1 / 2 mismatched"
            ),
            "Saved traces of failed tests*",
            f"  test_glu_parity.py::test_fails [glu]: {saved}",
            f"    ulptrace compare {saved / 'reference'} {saved / 'candidate'}",
        ]
    )
    out = result.stdout.str()
    summary = out[out.index("= ulptrace =") :]
    assert "test_passes_and_saves" not in summary and "kept" not in summary
    assert "test_expected_failure_is_not_reported" not in summary
    assert (saved / "reference" / "manifest.json").is_file() and (
        saved / "candidate" / "manifest.json"
    ).is_file()


def test_no_section_without_failures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_ok():\n    assert True\n")
    result = run(pytester)
    result.assert_outcomes(passed=1)
    assert "= ulptrace =" not in result.stdout.str()


def test_summary_without_save_dir_still_lists_assertions(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(
        """
        import math
        import torch
        from ulptrace.assertions import assert_ulp_close

        def test_nan():
            assert_ulp_close(torch.tensor([math.nan]), torch.tensor([1.0]), max_ulp=4)
        """
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*= ulptrace =*",
            (
                "  test_summary_without_save_dir_still_lists_assertions.py::test_nan: ULP budget exceeded: "
                "max_ulp=4 (float32); greatest nonfinite at index (0,); 1 / 1 mismatched"
            ),
        ]
    )
    assert "Saved traces" not in result.stdout.str()
