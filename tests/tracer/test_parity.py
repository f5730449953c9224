"""One parity decision for the fixture, the CLI exit codes and reports; "could not judge" is never silence.

The oracle is made to fail on one site (as an unsupported op or an oracle bug would): the site must be
counted with its reason, shown in the table, markdown and JSON, and fail ``check_parity`` (the
``ulptrace_parity`` fixture) and ``--fail-on-onset`` unless explicitly allowed.
"""

from __future__ import annotations

import json

import pytest
import torch
import ulptrace
from ulptrace.cli import main
from ulptrace.parity import ParityError, check_parity
from ulptrace.report import to_markdown

GLU_FAULT = "fault:layers.1.mlp.glu@0+1"  # one GLU element moved by one ULP
SMALL = ["--prompts", "2", "--prompt-len", "8", "--new-tokens", "2"]


@pytest.fixture
def oracle_fails_on_glu(fail_oracle_at):
    fail_oracle_at("mlp.glu")


def run(model):
    model(torch.arange(12).reshape(2, 6))


def test_check_parity_fails_on_a_site_it_could_not_judge(oracle_fails_on_glu) -> None:
    model = ulptrace.build_model("tiny-qwen3.5")
    with pytest.raises(ParityError) as exc:
        check_parity(model, GLU_FAULT, run, max_ulp=1)
    message = str(exc.value)
    assert message.splitlines()[0] == f"{GLU_FAULT} is not at parity with the reference:"
    assert ("  could_not_judge: the oracle could not judge 1 record(s); first at step 0, layers.1.mlp.glu (glu): "
            "NotImplementedError: no interval rule for aten.fake_op") in message
    glu = next(d for d in exc.value.comparison.sites if d.site == "layers.1.mlp.glu")
    assert glu.verdicts is None and glu.could_not_judge == "NotImplementedError: no interval rule for aten.fake_op"
    # allowed explicitly, the site is held to the budget like one without semantics
    comparison = check_parity(model, GLU_FAULT, run, max_ulp=1, allow=("could_not_judge",))
    assert comparison.parity(("could_not_judge",)).ok
    with pytest.raises(ParityError, match="unjudged onset"):
        check_parity(model, GLU_FAULT, run, max_ulp=0, allow=("could_not_judge",))


def test_the_parity_message_calls_a_boundary_a_boundary() -> None:
    model = ulptrace.build_model("tiny-qwen3.5")
    with pytest.raises(ParityError) as exc:
        check_parity(model, "kernels:fused", run)
    message = str(exc.value)
    assert "introduce error" not in message
    failures = [line for line in message.splitlines() if line.startswith("  ")]
    assert [line.split(":")[0].strip() for line in failures] == ["boundary"]
    assert failures[0].startswith("  boundary: ") and " boundary element(s) in " in failures[0]
    assert check_parity(model, "kernels:fused", run, allow=("boundary",)).parity(("boundary",)).ok


def test_onset_shows_and_fails_on_a_site_it_could_not_judge(oracle_fails_on_glu, tmp_path, capsys) -> None:
    out, md = tmp_path / "onset.json", tmp_path / "onset.md"
    args = ["onset", *SMALL, "--candidate", GLU_FAULT, "--max-ulp", "1", "--fail-on-onset", "--json", str(out),
            "--markdown", str(md)]
    assert main(args) == 1
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["could_not_judge"] == [{"step": 0, "site": "layers.1.mlp.glu", "kind": "glu", "layer": 1,
                                        "reason": "NotImplementedError: no interval rule for aten.fake_op"}]
    assert [f["kind"] for f in data["parity"]["failures"]] == ["could_not_judge"]
    glu_row = next(line for line in table.splitlines() if "layers.1.mlp.glu " in line and line.startswith("0 "))
    assert "COULD NOT JUDGE" in table and "COULD NOT JUDGE" in glu_row + table.split(glu_row)[1][:400]
    assert "could not judge: 1 record(s) with oracle semantics: step 0 layers.1.mlp.glu: NotImplementedError" in \
        " ".join(table.split())
    assert "parity: NOT at parity" in table
    assert "COULD NOT JUDGE" in md.read_text() and "could_not_judge: the oracle could not judge" in md.read_text()
    assert main([*args, "--allow-could-not-judge"]) == 0
    assert json.loads(out.read_text())["parity"]["ok"] is True


def test_compare_exit_code_uses_the_same_decision(tmp_path) -> None:
    ref, cand, other = tmp_path / "hf.trace", tmp_path / "fault.trace", tmp_path / "hf2.trace"
    assert main(["record", *SMALL, "--out", str(ref)]) == 0
    assert main(["record", *SMALL, "--path", "fault:layers.0.mlp.glu@0+2", "--forced-from", str(ref),
                 "--out", str(cand)]) == 0
    assert main(["record", *SMALL, "--forced-from", str(ref), "--out", str(other)]) == 0
    out = tmp_path / "c.json"
    assert main(["compare", str(ref), str(cand), "--json", str(out)]) == 0  # reports only
    assert main(["compare", str(ref), str(cand), "--fail-on-onset", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["parity"]["failures"][0]["kind"] == "error"
    assert main(["compare", str(ref), str(other), "--fail-on-onset", "--json", str(out)]) == 0


def test_the_verdict_map_draws_could_not_judge_apart_from_no_semantics() -> None:
    from ulptrace.plot import worst_class

    base = {"bitwise_equal": False, "verdicts": None}
    assert worst_class({**base, "could_not_judge": "TypeError: bad"}) == "could not judge"
    assert worst_class(base) == "unjudged"
    assert worst_class({**base, "verdicts": {"exact": 1, "tie": 2, "boundary": 0, "error": 1, "nonfinite": 0}}) == "error"


def test_markdown_and_json_of_a_comparison_without_failures() -> None:
    data = {"sites": [], "reference": {}, "candidate": {}, "missing": [], "extra": [], "mismatched": [],
            "first_difference": None, "onset": None, "parity": {"ok": True, "allowed": [], "failures": []}}
    assert "- parity: at parity" in to_markdown(data)


def test_a_recorded_selection_makes_the_comparison_incomplete(tmp_path) -> None:
    """Traces of a selection say so in their metadata; their comparison does not infer where a difference began
    from records it never saw — and never calls it parity: a GLU fault of 4,000 ULP left out of a norm selection was
    'at parity', exit 0 with --fail-on-onset, every norm downstream a tie on inputs that already differ."""
    ref, cand, out = tmp_path / "hf.trace", tmp_path / "fault.trace", tmp_path / "c.json"
    assert main(["record", *SMALL, "--kinds", "norm", "--out", str(ref)]) == 0
    assert main(["record", *SMALL, "--kinds", "norm", "--path", "fault:layers.1.mlp.glu@0+4000", "--forced-from",
                 str(ref), "--out", str(cand)]) == 0
    assert main(["compare", str(ref), str(cand), "--fail-on-onset", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["reference"]["selection"]["kinds"] == ["norm"]
    # the GLU was not recorded: the first norm downstream differs on differing inputs — where it began is unrecorded
    first = data["first_difference"]
    assert first is not None and data["onset"] == {**first, "reason": "unrecorded"}
    assert [f["kind"] for f in data["parity"]["failures"]] == ["unrecorded"] and data["parity"]["ok"] is False
    full = tmp_path / "full.json"
    assert main(["onset", *SMALL, "--candidate", "fault:layers.1.mlp.glu@0+4000", "--json", str(full)]) == 0
    assert json.loads(full.read_text())["complete"] is True
