"""trace_norm_rounding end to end on tiny-qwen3.5 (CPU, BF16): verdicts for known variants and defects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
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


def in_layer(site: str) -> str:
    """``layers.3.self_attn.q_norm`` -> ``self_attn.q_norm``; ``norm`` stays ``norm``."""
    return site.split(".", 2)[-1] if site.startswith("layers.") else site


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
    # where the candidate alone changed the rows (bitwise equal inputs), the tree analysis names the order
    # the candidate was written in (independently of ulptrace.trees, see candidates.block_sum_t32_v2) and
    # only that one; the reference's rows are not reproduced by it
    findings = {(f["site"], f["step"]): f["findings"] for f in data["trees"]}
    for s in own:
        summary = findings[(s["site"], s["step"])]["summary"]
        assert summary["candidate"] == ["blocked:t32:v2"], (s["site"], summary)
        assert "blocked:t32:v2" not in summary["reference"], (s["site"], summary)
    assert "ties" in data["conclusion"]


def test_candidate_block_sum_is_the_blocked_t32_v2_order() -> None:
    """The candidate's hand-written order: a hand-derived row, and the tree emulation on random rows."""
    from candidates import block_sum_t32_v2
    from ulptrace.trees import reduce_fp32

    tiny = 2.0**-24  # half an FP32 step of 1.0
    row = torch.tensor([[1.0, tiny, tiny, tiny]])
    # thread 0 adds 1 + 2^-24 -> 1 (tie to even); thread 1 adds 2^-24 + 2^-24 = 2^-23; the butterfly adds
    # the lanes: 1 + 2^-23. Sequentially every 2^-24 is lost against 1.
    assert block_sum_t32_v2(row).item() == 1.0 + 2.0**-23
    assert reduce_fp32(row, "sequential").item() == 1.0
    gen = torch.Generator().manual_seed(5)
    for n in (1, 63, 64, 65, 200, 1024):
        scale = torch.exp2(torch.randint(-8, 8, (16, n), generator=gen).float())
        x = torch.rand(16, n, generator=gen) * scale
        assert torch.equal(block_sum_t32_v2(x), reduce_fp32(x, "blocked:t32:v2")), n


def test_unrounded_residual_sum_is_a_named_boundary(tmp_path) -> None:
    rc, data = run(tmp_path, "candidates:unrounded_residual")
    assert rc == 1
    post = [s for s in data["sites"] if s["site"].endswith("post_attention_layernorm") and s["verdicts"]
            and s["verdicts"]["boundary"]]
    assert post, "some post-attention norm must show the missing rounding"
    for s in post:
        assert s["verdicts"]["error"] == 0
        assert s["boundary"] == "the BF16 rounding of `add(residual, delta)` (op 0) is missing"
    boundary_sites = {s["site"] for s in data["sites"] if s["verdicts"] and s["verdicts"]["boundary"]}
    assert boundary_sites == {f"layers.{i}.post_attention_layernorm" for i in range(4)}
    assert (data["onset"]["step"], data["onset"]["site"]) == (0, "layers.0.post_attention_layernorm")
    assert "explains" in data["conclusion"]


# The zero-centred norm's `1.0 + weight.float()` (op 7; op 8 after the post-attention norm's residual add),
# named by the norm's own weight, is what bf16_scale rounds to BF16
BF16_SCALE = {
    "input_layernorm": "`add(f32(input_layernorm.weight), 1.0)` (op 7) rounded to BF16",
    "post_attention_layernorm": "`add(f32(post_attention_layernorm.weight), 1.0)` (op 8) rounded to BF16",
    "self_attn.q_norm": "`add(f32(self_attn.q_norm.weight), 1.0)` (op 7) rounded to BF16",
    "self_attn.k_norm": "`add(f32(self_attn.k_norm.weight), 1.0)` (op 7) rounded to BF16",
    "norm": "`add(f32(model.norm.weight), 1.0)` (op 7) rounded to BF16",
}


def test_bf16_scale_is_a_named_boundary(tmp_path) -> None:
    rc, data = run(tmp_path, "candidates:bf16_scale")
    assert rc == 1
    assert all(s["verdicts"]["error"] == 0 and s["verdicts"]["nonfinite"] == 0 for s in data["sites"])
    bad = [s for s in data["sites"] if s["verdicts"]["boundary"]]
    assert bad
    for s in bad:
        assert s["boundary"] == BF16_SCALE[in_layer(s["site"])], s["site"]
    # every zero-centred norm is patched; the gated norm (another class) is not and keeps its ties
    assert {in_layer(s["site"]) for s in bad} == set(BF16_SCALE)
    assert all(s["kind"] == "gated_norm" for s in data["sites"] if not s["verdicts"]["boundary"])


def test_wrong_epsilon_is_an_error(tmp_path) -> None:
    rc, data = run(tmp_path, "candidates:wrong_eps", "--report-only")
    assert rc == 0  # --report-only
    t = totals(data)
    assert t["error"] > 0
    first = next(s for s in data["sites"] if s["verdicts"] and s["verdicts"]["error"])
    assert first["max_error_ulp"] >= 1
    assert data["onset"] is not None and "error" in data["conclusion"]


def test_the_text_report_names_the_reduction_orders_reproducing_each_side(monkeypatch) -> None:
    """Each tie row's site lists how many FP32 orders reproduce each side bit for bit, with the first two named."""
    import ulptrace.report as report
    from ulptrace.probes.norm_rounding import render

    monkeypatch.setattr(report, "to_table", lambda data, all_rows=False: "TABLE")
    data = {"conclusion": "C.", "trees": [
        {"step": 1, "site": "layers.0.input_layernorm", "findings": {"summary": {
            "reference": ["sequential", "pairwise", "blocked:t32"], "candidate": []}}},
        {"step": 2, "site": "layers.1.input_layernorm", "findings": None}]}
    lines = render(data).splitlines()
    assert ("  step 1 layers.0.input_layernorm: reference 3 orders, e.g. sequential, pairwise | candidate none"
            in lines)
    assert not any("layers.1" in line for line in lines)  # no findings, no line
