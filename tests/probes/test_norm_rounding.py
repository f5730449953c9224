"""trace_norm_rounding end to end on tiny-qwen3.5 (CPU, BF16): verdicts for known variants and defects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ulptrace.probes.norm_rounding import main

HERE = Path(__file__).parent
SMALL = ["--prompts", "2", "--prompt-len", "8", "--new-tokens", "2"]


@pytest.fixture(autouse=True)
def _candidates_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def run(tmp_path, candidate: str, *extra: str, size: list[str] = SMALL) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    rc = main([*size, "--candidate", candidate, "--json", str(out), "--trees", "sequential", "pairwise:b8",
               "blocked:t32:v2", *extra])
    return rc, json.loads(out.read_text())


def totals(data: dict) -> dict[str, int]:
    out = dict.fromkeys(("exact", "tie", "boundary", "error", "nonfinite"), 0)
    for s in data["sites"]:
        for k, v in (s["verdicts"] or {}).items():
            out[k] += v
    return out


def test_hf_against_itself_is_exact_and_reference_admissible(tmp_path) -> None:
    rc, data = run(tmp_path, "hf")
    assert rc == 0
    assert data["sites"] and all(s["bitwise_equal"] for s in data["sites"])
    t = totals(data)
    assert t["exact"] == sum(s["elements"] for s in data["sites"]) and t["tie"] == t["boundary"] == t["error"] == 0
    # the reference judged against its own semantics: admissible everywhere
    assert all(s["reference_outside"] == 0 for s in data["sites"])
    assert "bitwise identical" in data["conclusion"]


def test_reordered_fp32_sums_are_ties_never_errors(tmp_path) -> None:
    # a reordered FP32 sum flips a BF16 rounding rarely (~1e-5 per element): use 8 x 32 tokens
    rc, data = run(tmp_path, "candidates:reordered_norm_sums",
                   size=["--prompts", "8", "--prompt-len", "32", "--new-tokens", "1"])
    t = totals(data)
    own = [s for s in data["sites"] if not s["bitwise_equal"] and all(v == 0 for v in s["input_delta"].values())]
    assert own, "the reordering must change some element on identical inputs, or the test proves nothing"
    assert all(s["verdicts"]["tie"] == s["differing"] for s in own)
    assert t["boundary"] == t["error"] == t["nonfinite"] == 0
    assert rc == 0 and data["onset"] is None
    # the tree analysis finds the candidate's declared order for its rows
    found = [f for f in data["trees"] if f["findings"]]
    assert found and any("blocked:t32:v2" in f["findings"]["summary"]["candidate"] for f in found)
    assert "ties" in data["conclusion"]


def test_unrounded_residual_sum_is_a_named_boundary(tmp_path) -> None:
    rc, data = run(tmp_path, "candidates:unrounded_residual")
    assert rc == 1
    post = [s for s in data["sites"] if s["site"].endswith("post_attention_layernorm") and s["verdicts"]
            and s["verdicts"]["boundary"]]
    assert post, "some post-attention norm must show the missing rounding"
    for s in post:
        assert s["verdicts"]["error"] == 0
        assert "add" in s["boundary"] and "missing" in s["boundary"]
    assert data["onset"]["site"].endswith("post_attention_layernorm")
    assert "explains" in data["conclusion"]


def test_bf16_scale_is_a_named_boundary(tmp_path) -> None:
    rc, data = run(tmp_path, "candidates:bf16_scale")
    assert rc == 1
    bad = [s for s in data["sites"] if s["verdicts"] and s["verdicts"]["boundary"]]
    assert bad and all(s["verdicts"]["error"] == 0 for s in bad)
    assert any("BF16" in s["boundary"] or "bf16" in s["boundary"] for s in bad)


def test_wrong_epsilon_is_an_error(tmp_path) -> None:
    rc, data = run(tmp_path, "candidates:wrong_eps", "--report-only")
    assert rc == 0  # --report-only
    t = totals(data)
    assert t["error"] > 0
    first = next(s for s in data["sites"] if s["verdicts"] and s["verdicts"]["error"])
    assert first["max_error_ulp"] >= 1
    assert data["onset"] is not None and "error" in data["conclusion"]
