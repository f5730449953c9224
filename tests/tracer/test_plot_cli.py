"""``--plot FILE`` on the command line: ``onset``/``compare``/``trace_norm_rounding`` write the report's figure."""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")

import pytest


def report() -> dict:
    """A one-site report with a boundary: enough for every panel that applies."""
    zero = dict.fromkeys(("0", "1", "2", "3-4", "5-8", "9-16", ">16", "nonfinite"), 0)
    site = {"site": "layers.0.input_layernorm", "step": 0, "kind": "norm", "layer": 0, "bitwise_equal": False,
            "verdicts": {"exact": 3, "tie": 0, "boundary": 1, "error": 0, "nonfinite": 0},
            "verdict_histogram": {"tie": zero, "boundary": {**zero, "1": 1}, "error": zero, "nonfinite": zero},
            "histogram": {**zero, "0": 3, "1": 1}, "max_ulp": 1, "input_delta": {"x": 0}}
    return {"sites": [site], "onset": {"site": site["site"], "step": 0, "kind": "norm", "layer": 0},
            "reference": {"path": "hf", "model": "m"}, "candidate": {"path": "c"}}

def test_emit_writes_the_figure(tmp_path, capsys) -> None:
    from ulptrace.cli import emit

    out = tmp_path / "report.png"
    emit(report(), argparse.Namespace(json=None, markdown=None, all=False, plot=str(out)), "table")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "figure written to" in capsys.readouterr().err


@pytest.mark.parametrize("name, message", [("report.txt", "expected a file name ending in .png"),
                                           ("missing/report.png", "does not exist"), (".", "expected a file name")])
@pytest.mark.parametrize("command", [["onset"], ["compare", "a", "b"]])
def test_bad_plot_file_exits_2_before_any_work(tmp_path, capsys, monkeypatch, command, name, message) -> None:
    from ulptrace.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:  # argparse rejects it while parsing: no model is built
        main([*command, "--plot", name])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "argument --plot" in err[0] and message in err[0], err


def test_trace_norm_rounding_refuses_a_bad_plot_file_too(tmp_path, capsys) -> None:
    from ulptrace.probes.norm_rounding import main

    with pytest.raises(SystemExit) as exit_:
        main(["--plot", str(tmp_path / "report.jpg")])
    assert exit_.value.code == 2 and "expected a file name ending in .png" in capsys.readouterr().err


def test_trace_norm_rounding_plot(tmp_path) -> None:
    from ulptrace.probes.norm_rounding import main

    png, report_json = tmp_path / "norms.png", tmp_path / "norms.json"
    rc = main(["--prompts", "2", "--prompt-len", "8", "--new-tokens", "2", "--trees", "sequential", "pairwise:b8",
               "--report-only", "--json", str(report_json), "--plot", str(png)])
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(report_json.read_text())
    rounding = data["rounding"]
    # the fused kernels' first norm record with a boundary, its elements placed against the midpoints
    assert (rounding["site"], rounding["step"]) == (data["onset"]["site"], data["onset"]["step"])
    site = next(s for s in data["sites"] if (s["site"], s["step"]) == (rounding["site"], rounding["step"]))
    assert sum(rounding["counts"]["boundary"]) == site["verdicts"]["boundary"] > 0
    assert rounding["elements"] == site["differing"]
