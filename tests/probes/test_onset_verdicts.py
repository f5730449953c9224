"""ulptrace onset with the oracle: a GLU rounded once is a named boundary at the GLU site."""

from __future__ import annotations

import json
from pathlib import Path

from ulptrace.cli import main

HERE = Path(__file__).parent


def test_glu_rounded_once_is_a_boundary_at_the_glu_site(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    out = tmp_path / "onset.json"
    assert main(["onset", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "2", "--candidate",
                 "candidates:glu_rounded_once", "--kinds", "glu", "norm", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    onset = data["onset"]
    assert onset["site"] == "layers.0.mlp.glu" and onset["step"] == 0
    glu = next(s for s in data["sites"] if s["site"] == "layers.0.mlp.glu" and s["step"] == 0)
    assert glu["verdicts"]["boundary"] > 0 and glu["verdicts"]["error"] == 0
    assert glu["boundary"]
    assert "layers.0.mlp.glu" in capsys.readouterr().out
