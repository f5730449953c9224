"""The ulptrace_parity fixture as a user's test suite uses it (run through pytester)."""

from __future__ import annotations

import json

pytest_plugins = ["pytester"]

TEST_FILE = '''
import torch
import ulptrace

def run(model):
    model(torch.arange(12).reshape(2, 6))

def test_faithful_is_at_parity(ulptrace_parity):
    ulptrace_parity(ulptrace.build_model("tiny-qwen3.5"), "kernels:faithful", run)

def test_fused_glu_breaks_parity(ulptrace_parity):
    ulptrace_parity(ulptrace.build_model("tiny-qwen3.5"), "fault:layers.1.mlp.glu@0+3", run)
'''


def test_parity_fixture_passes_fails_and_saves(pytester, tmp_path) -> None:
    pytester.makepyfile(test_user=TEST_FILE)
    save = tmp_path / "saved"
    result = pytester.runpytest_subprocess(f"--ulptrace-save-dir={save}", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "fault:layers.1.mlp.glu@0+3 is not at parity" in out
    assert "onset: step 0, layers.1.mlp.glu (glu)" in out
    assert "ulptrace compare" in out
    saved = [p for p in save.rglob("manifest.json")]
    assert len(saved) == 2
    paths = sorted(json.loads(p.read_text())["metadata"]["path"] for p in saved)
    assert paths == ["fault:layers.1.mlp.glu@0+3", "hf"]
