"""Every option ``trace_norm_rounding`` offers does what its help says (one test per option)."""

from __future__ import annotations

import json

import pytest
from ulptrace.probes.norm_rounding import main

SMALL = ["--prompts", "2", "--prompt-len", "8", "--new-tokens", "2"]
FAULT = "fault:layers.0.input_layernorm@0+3"  # one element of one norm output moved by 3 ULPs


def run(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    rc = main([*SMALL, "--trees", "sequential", "--json", str(out), *args])
    return rc, json.loads(out.read_text())


def test_kinds_selects_among_the_norm_kinds(tmp_path) -> None:
    rc, data = run(tmp_path, "--candidate", "hf", "--kinds", "gated_norm")
    assert rc == 0
    assert data["sites"] and {s["kind"] for s in data["sites"]} == {"gated_norm"}
    rc, data = run(tmp_path, "--candidate", "hf", "--kinds", "norm")
    assert {s["kind"] for s in data["sites"]} == {"norm"}


def test_kinds_outside_the_norms_is_bad_input(tmp_path, capsys) -> None:
    assert main([*SMALL, "--kinds", "glu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("trace_norm_rounding looks at norm kinds only: --kinds must be some of norm, gated_norm, "
                        "but got glu")


def test_no_oracle_skips_the_verdicts(tmp_path) -> None:
    rc, data = run(tmp_path, "--candidate", FAULT, "--no-oracle", "--max-ulp", "3")
    assert data["sites"] and all(s["verdicts"] is None for s in data["sites"])
    assert all(s["reference_outside"] is None and s["could_not_judge"] is None for s in data["sites"])
    assert data["trees"] == []
    assert "not judged (--no-oracle)" in data["conclusion"]
    assert rc == 0


def test_max_ulp_is_the_budget_of_records_without_verdicts(tmp_path) -> None:
    fault = "layers.0.input_layernorm"
    rc, data = run(tmp_path, "--candidate", FAULT, "--no-oracle", "--max-ulp", "2")
    assert rc == 1
    assert (data["onset"]["site"], data["onset"]["reason"]) == (fault, "unjudged")
    assert [f["kind"] for f in data["parity"]["failures"]] == ["unjudged"]
    rc, data = run(tmp_path, "--candidate", FAULT, "--no-oracle", "--max-ulp", "3")
    assert rc == 0 and data["onset"] is None and data["max_ulp_budget"] == 3
    # with the oracle the budget does not excuse a verdict: the moved element is an error
    rc, data = run(tmp_path, "--candidate", FAULT, "--max-ulp", "3")
    assert rc == 1 and (data["onset"]["site"], data["onset"]["reason"]) == (fault, "verdict")


def test_check_reference_is_not_offered_because_the_reference_is_always_judged(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--check-reference"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --check-reference" in capsys.readouterr().err
    _, data = run(tmp_path, "--candidate", "hf")
    assert data["sites"] and all(s["reference_outside"] == 0 for s in data["sites"])


def test_all_shows_bitwise_equal_rows_in_the_table(tmp_path, capsys) -> None:
    capsys.readouterr()
    run(tmp_path, "--candidate", "hf")
    plain = capsys.readouterr().out
    assert "every compared record is bitwise equal" in plain and "layers.0.input_layernorm" not in plain
    run(tmp_path, "--candidate", "hf", "--all")
    table = capsys.readouterr().out
    assert "every compared record is bitwise equal" not in table
    assert "layers.0.input_layernorm" in table and "layers.0.linear_attn.norm" in table


def test_allow_could_not_judge(tmp_path, fail_oracle_at) -> None:
    """An oracle that fails on the gated norm: exit 1 naming it, unless --allow-could-not-judge."""
    fail_oracle_at("linear_attn.norm")
    rc, data = run(tmp_path, "--candidate", "kernels:fused", "--kinds", "gated_norm")
    assert rc == 1
    assert data["could_not_judge"] and all(c["site"].endswith("linear_attn.norm") for c in data["could_not_judge"])
    assert data["could_not_judge"][0]["reason"] == "NotImplementedError: no interval rule for aten.fake_op"
    # the gated norms' inputs already differ (the fused scan before them is not recorded): never parity either
    assert [f["kind"] for f in data["parity"]["failures"]] == ["could_not_judge", "unrecorded"]
    assert "the oracle could not judge" in data["conclusion"]
    rc, data = run(tmp_path, "--candidate", "kernels:fused", "--kinds", "gated_norm", "--allow-could-not-judge")
    assert rc == 1 and data["parity"]["allowed"] == ["could_not_judge"]
    assert [f["kind"] for f in data["parity"]["failures"]] == ["unrecorded"]


def test_the_conclusion_of_inherited_ties_says_how_far_the_inputs_are_and_where_to_look() -> None:
    """Every differing norm a tie on inputs that already differ: honest rounding inherited, or a defect upstream of
    the norms (a GLU computing GELU reads the same way here). The conclusion gives the inputs' largest distance and
    points to `ulptrace onset`, which looks at every site."""
    from ulptrace.probes.norm_rounding import conclusion

    def record(site, delta):
        return {"site": site, "step": 0, "bitwise_equal": False, "differing": 10, "max_ulp": 3, "boundary": None,
                "verdicts": {"exact": 0, "tie": 10, "boundary": 0, "error": 0, "nonfinite": 0},
                "input_delta": {"x": delta}, "could_not_judge": None}

    data = {"reference": {"path": "hf", "model": "tiny-qwen3.5"}, "candidate": {"path": "mine"},
            "sites": [record("layers.0.post_attention_layernorm", 30044), record("norm", 12)]}
    text = conclusion(data)
    assert "2 of those records differ because their inputs already differ, by up to 30,044 ULP" in text
    assert "`ulptrace onset` looks at every site" in text
