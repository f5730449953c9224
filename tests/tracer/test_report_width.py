"""The terminal table fits the terminal (it was ~230 columns wide), and nothing is cut off to make it fit."""

from __future__ import annotations

import pytest
from ulptrace.comparison import SiteDiff
from ulptrace.report import to_table

BOUNDARY = ("`mul(neg(exp(f32(linear_attn.A_log))), softplus(add(f32(a), linear_attn.dt_bias)))` (op 6) rounded "
            "to BF16")


def data() -> dict:
    rows = [
        SiteDiff(site="layers.0.linear_attn.gates.g", step=0, kind="gates", layer=0, elements=64, differing=64,
                 max_ulp=32297, histogram={">16": 64}, bitwise_equal=False, dtype="float32", shape=[2, 8, 4],
                 input_delta={"a": 0}, verdicts={"exact": 0, "tie": 0, "boundary": 64, "error": 0, "nonfinite": 0},
                 boundary=BOUNDARY, explained=1.0, max_row_ulp=32297.0, row_histogram={">16": 64}),
        SiteDiff(site="layers.3.post_attention_layernorm", step=2, kind="norm", layer=3, elements=2048,
                 differing=919, max_ulp=30158, histogram={"0": 1129, "1": 653, "2": 132, "3-4": 60, ">16": 16},
                 bitwise_equal=False, dtype="bfloat16", shape=[2, 8, 128],
                 input_delta={"residual": 256, "delta": 28947},
                 verdicts={"exact": 1129, "tie": 527, "boundary": 392, "error": 0, "nonfinite": 0},
                 boundary="the BF16 rounding of `add(residual, delta)` (op 0) is missing", explained=1.0,
                 max_row_ulp=2.0, row_histogram={"0": 1129, "<1": 891, "1": 27, "2": 1}),
        SiteDiff(site="layers.1.mlp.glu", step=0, kind="glu", layer=1, elements=6144, differing=1, max_ulp=1,
                 histogram={"0": 6143, "1": 1}, bitwise_equal=False, dtype="bfloat16", shape=[2, 8, 384],
                 input_delta={"gate": 0, "up": 0}, verdicts=None,
                 could_not_judge="NotImplementedError: no interval rule for aten.fake_op", max_row_ulp=0.25,
                 row_histogram={"0": 6143, "<1": 1}),
    ]
    meta = {"path": "kernels:fused", "model": "tiny-qwen3.5", "dtype": "bfloat16", "device": "cpu",
            "attn_implementation": "sdpa", "versions": {"torch": "2.13.0+cpu", "transformers": "5.24.0"}}
    return {"sites": [r.to_json() for r in rows], "reference": {**meta, "path": "hf"}, "candidate": meta,
            "missing": [], "extra": [], "mismatched": [],
            "first_difference": {"step": 0, "site": rows[0].site, "kind": "gates", "layer": 0},
            "onset": {"step": 0, "site": rows[0].site, "kind": "gates", "layer": 0, "reason": "verdict"},
            "parity": {"ok": False, "allowed": [], "failures": [
                {"kind": "boundary", "records": 2, "first": {}, "message": "456 boundary element(s) in 2 record(s); "
                 "first at step 0, layers.0.linear_attn.gates.g (gates): " + BOUNDARY}]}}


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("width", [60, 80, 100, 132, 200])
def test_every_line_fits_and_nothing_is_lost(width) -> None:
    table = to_table(data(), width=width)
    assert max(len(line) for line in table.splitlines()) <= width
    flat = words(table)
    for text in (BOUNDARY, "the BF16 rounding of `add(residual, delta)` (op 0) is missing [explains 100%]",
                 "NotImplementedError: no interval rule for aten.fake_op", "residual:256,delta:28947",
                 "exact:1129 tie:527 boundary:392", "0:1129 <1:891 1:27 2:1", "COULD NOT JUDGE"):
        assert text in flat, (width, text)


def test_a_wide_terminal_keeps_each_row_on_one_line() -> None:
    table = to_table(data(), width=400)
    row = next(line for line in table.splitlines() if "post_attention_layernorm" in line)
    assert "exact:1129 tie:527 boundary:392" in row and "residual:256,delta:28947" in row
    assert "add(residual, delta)" in row


def test_the_default_width_is_the_terminal_s(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "90")  # shutil.get_terminal_size reads COLUMNS first
    table = to_table(data())
    assert max(len(line) for line in table.splitlines()) <= 90
    monkeypatch.setenv("COLUMNS", "400")
    assert max(len(line) for line in to_table(data()).splitlines()) > 200
