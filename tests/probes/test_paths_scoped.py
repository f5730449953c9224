"""Every applied path is undone: two ``kernels:`` paths run one after another in one process give what they give
in two separate processes.

A ``kernels:`` path installs a process-wide attention function; a reference path that was applied and never
undone (the judge of ``trace_norm_rounding``, of ``ulptrace compare``, ``ulptrace semantics``) made the second
injection in the same process fail.
"""

from __future__ import annotations

import json
import subprocess
import sys

from ulptrace.cli import main as ulptrace_main
from ulptrace.probes.norm_rounding import main as norm_main
from ulptrace.verdicts import site_semantics

SMALL = ["--prompts", "2", "--prompt-len", "8", "--new-tokens", "2"]
PATHS = ("kernels:faithful", "kernels:fused")


def in_subprocess(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def essentials(report: dict) -> dict:
    """What a run found (not when or where it ran)."""
    return {"sites": report["sites"], "onset": report["onset"], "parity": report["parity"],
            "conclusion": report.get("conclusion")}


def test_norm_rounding_with_kernel_references_in_one_process(tmp_path) -> None:
    here = {}
    for path in PATHS:  # the reference path defines the semantics and must be undone after judging
        out = tmp_path / f"{path.replace(':', '_')}.json"
        norm_main([*SMALL, "--reference", path, "--candidate", "hf", "--trees", "sequential", "--json", str(out)])
        here[path] = essentials(json.loads(out.read_text()))
    for path in PATHS:
        out = tmp_path / f"separate_{path.replace(':', '_')}.json"
        in_subprocess("from ulptrace.probes.norm_rounding import main; "
                      f"main({[*SMALL, '--reference', path, '--candidate', 'hf', '--trees', 'sequential', '--json', str(out)]!r})")
        assert here[path] == essentials(json.loads(out.read_text())), path
    assert here["kernels:faithful"] != here["kernels:fused"]  # the two runs are not vacuously equal


def test_semantics_of_two_kernel_paths_in_one_process() -> None:
    site = "layers.1.self_attn.core"
    here = {path: site_semantics("tiny-qwen3.5", site, path=path) for path in PATHS}
    for path in PATHS:
        separate = in_subprocess("from ulptrace.verdicts import site_semantics; "
                                 f"print(site_semantics('tiny-qwen3.5', {site!r}, path={path!r}))")
        assert separate.rstrip("\n") == here[path]


def test_compare_traces_of_two_kernel_paths_in_one_process(tmp_path) -> None:
    traces = {path: tmp_path / path.replace(":", "_") for path in PATHS}
    assert ulptrace_main(["record", *SMALL, "--path", PATHS[0], "--out", str(traces[PATHS[0]])]) == 0
    assert ulptrace_main(["record", *SMALL, "--path", PATHS[1], "--forced-from", str(traces[PATHS[0]]),
                          "--out", str(traces[PATHS[1]])]) == 0
    a, b = (str(traces[p]) for p in PATHS)
    here = {}
    for ref, cand in ((a, b), (b, a)):  # each rebuilds its reference with that kernels: path applied, as judge
        out = tmp_path / "here.json"
        assert ulptrace_main(["compare", ref, cand, "--json", str(out)]) == 0
        here[ref] = essentials(json.loads(out.read_text()))
    for ref, cand in ((a, b), (b, a)):
        out = tmp_path / "separate.json"
        in_subprocess("from ulptrace.cli import main; "
                      f"main(['compare', {ref!r}, {cand!r}, '--json', {str(out)!r}])")
        assert here[ref] == essentials(json.loads(out.read_text()))
    assert any(s["verdicts"] for s in here[a]["sites"])  # judged, not skipped
