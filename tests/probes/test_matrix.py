"""ulptrace matrix: token parity per check, first divergent step, near-tie rule, every divergent row located."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from ulptrace.cli import main
from ulptrace.probes.divergence import NEAR_TIE_RULE, first_divergent_steps, near_tie
from ulptrace.probes.matrix import MatrixConfig, run_matrix
from ulptrace.run import RunConfig

HERE = Path(__file__).parent
ROW_KEYS = {"path", "mode", "seed", "batch", "attempt", "row", "token_exact", "first_divergent_step", "near_tie",
            "accumulated", "onset"}
ONSET_KEYS = {"step", "site", "kind", "layer", "reason", "verdict", "boundary"}


def test_near_tie_rule_on_constructed_logits() -> None:
    ref = torch.tensor([1.0, 3.0, 2.75, -1.0], dtype=torch.bfloat16)  # top-1/top-2 gap 0.25
    close = near_tie(ref, ref + torch.tensor([0.0, -0.375, 0.125, 0.0], dtype=torch.bfloat16))
    assert close["near_tie"] and close["gap"] == 0.25 and close["noise"] == 0.375
    assert (close["reference_token"], close["candidate_token"]) == (1, 2)
    far = near_tie(ref, ref + torch.tensor([0.0, 0.0, 0.125, 0.0], dtype=torch.bfloat16))
    assert not far["near_tie"] and far["gap"] == 0.25 and far["noise"] == 0.125
    # a gap equal to the noise is a near-tie: noise of that size flips the choice by the tie-break (here the
    # candidate's logits 2.75 and 2.75, the lower index chosen)
    swapped = torch.tensor([1.0, 2.75, 3.0, -1.0], dtype=torch.bfloat16)
    equal = near_tie(swapped, swapped + torch.tensor([0.0, 0.0, -0.25, 0.0], dtype=torch.bfloat16))
    assert equal["near_tie"] and equal["gap"] == equal["noise"] == 0.25
    assert (equal["reference_token"], equal["candidate_token"]) == (2, 1)
    # the noise is the largest difference anywhere in the row, not at the two tokens only
    anywhere = near_tie(ref, ref + torch.tensor([0.0, 0.0, 0.0, 0.5], dtype=torch.bfloat16))
    assert anywhere["near_tie"] and anywhere["noise"] == 0.5
    nonfinite = near_tie(ref, ref + torch.tensor([0.0, 0.0, float("nan"), 0.0], dtype=torch.bfloat16))
    assert not nonfinite["near_tie"]
    with pytest.raises(ValueError, match="two logit rows"):
        near_tie(ref, ref[:3])
    assert "top-1/top-2 logit gap" in NEAR_TIE_RULE


def test_until_onset_stops_judging_after_the_first_verdict_worse_than_tie() -> None:
    from ulptrace.probes.divergence import UntilOnset

    verdicts = iter([{"tie": 3}, {"boundary": 1}, {"tie": 1}])
    calls = []

    def judge(reference, candidate):
        calls.append(reference)
        return {"verdicts": next(verdicts)}

    until = UntilOnset(judge)
    assert [until(i, i)["verdicts"] for i in range(3)] == [{"tie": 3}, {"boundary": 1}, None]
    assert calls == [0, 1] and until(9, 9)["note"] == UntilOnset.NOTE


def test_rows_of_a_check_without_locating_and_locations_reused_from_an_identical_attempt() -> None:
    from ulptrace.probes.divergence import Generation, Side
    from ulptrace.probes.matrix import check_rows, reuse_locations, same_generation

    logits = [torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 0.75]]) for _ in range(3)]
    ref = Generation(torch.tensor([[1, 1, 1], [1, 1, 1]]), logits)
    flipped = [logits[0], torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 1.25]]), logits[2]]
    cand = Generation(torch.tensor([[1, 1, 1], [1, 2, 1]]), flipped)
    prompts = torch.zeros(2, 4, dtype=torch.long)
    check = {"path": "p", "mode": "graph", "seed": 0, "batch": 2, "attempt": 1}
    rows = check_rows(Side(None, "hf", "eager", prompts, ref), Side(None, "p", "graph", prompts, cand), check,
                      locate_limit=0)
    assert [r["first_divergent_step"] for r in rows] == [None, 1]
    assert rows[1]["near_tie"] is True and rows[1]["gap"] == 0.25 and rows[1]["noise"] == 0.5
    assert rows[1]["located"] is False and rows[1]["onset"] is None and rows[0]["token_exact"]
    late = check_rows(Side(None, "hf", "eager", prompts, ref), Side(None, "p", "graph", prompts, cand), check,
                      deadline=0.0)  # --locate-seconds spent: nothing is located, everything else is there
    assert late[1]["located"] is False and late[1]["near_tie"] is True
    again = Generation(cand.tokens.clone(), [x.clone() for x in cand.logits])
    assert same_generation(cand, again)
    assert not same_generation(cand, Generation(cand.tokens, [logits[0], logits[1], logits[2]]))
    rows[1].update(located=True, accumulated=False, onset={"site": "s"}, located_by="restored")
    second = check_rows(Side(None, "hf", "eager", prompts, ref), Side(None, "p", "graph", prompts, again),
                        {**check, "attempt": 2}, locate_limit=0)
    reuse_locations(second, rows)
    assert second[1]["onset"] == {"site": "s"} and second[1]["location_from_attempt"] == 1
    assert second[1]["attempt"] == 2 and "location_from_attempt" not in second[0]


def test_first_divergent_steps() -> None:
    ref = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 5, 6]])
    cand = torch.tensor([[1, 2, 3], [1, 9, 9], [0, 5, 6]])
    assert first_divergent_steps(ref, cand) == [None, 1, 0]


def test_hf_against_hf_is_token_exact_and_the_json_has_the_documented_keys(tmp_path, capsys) -> None:
    out, plot, md = tmp_path / "m.json", tmp_path / "m.png", tmp_path / "m.md"
    assert main(["matrix", "--model", "tiny-llama", "--candidate", "hf", "--modes", "eager", "static", "--seeds", "0",
                 "--batches", "2", "--prompt-len", "8", "--new-tokens", "2", "--json", str(out),
                 "--plot", str(plot), "--markdown", str(md)]) == 0
    report = json.loads(out.read_text())
    assert report["summary"] == {"hf": {"eager": {"exact": 1, "checks": 1}, "static": {"exact": 1, "checks": 1},
                                        "total": {"exact": 2, "checks": 2}}}
    assert len(report["rows"]) == 2 * 2
    for row in report["rows"]:
        assert ROW_KEYS <= row.keys()
        assert row["token_exact"] and row["first_divergent_step"] is None and row["near_tie"] is None
        assert row["onset"] is None
    assert report["near_tie_rule"] == NEAR_TIE_RULE
    printed = capsys.readouterr().out
    assert "Eager   1/1" in printed and "Static  1/1" in printed and "Total   2/2" in printed
    assert NEAR_TIE_RULE in printed
    assert plot.stat().st_size > 0 and "| Total | 2/2 |" in md.read_text()


def test_defects_are_located_at_their_site_and_step(monkeypatch) -> None:
    """Two defects on tiny-qwen3.5 (static cache, against HF's dynamic one: restoring crosses cache layouts).

    A GLU defect at decode step 2 only: every divergent row begins at layers.1.mlp.glu, step 2, an error —
    found from the restored step when the row flips there, from the start when it flips later through the
    recurrent state that step wrote (accumulated). A candidate that corrupts the keys it has *stored*: a
    step re-run from the reference's state is exact, so its flip is accumulated; from the start it begins
    where the corrupted cache is first read, in code no site observes.
    """
    monkeypatch.syspath_prepend(str(HERE))
    import generation_candidates

    monkeypatch.setattr(generation_candidates, "GLU_SCALE", -4.0)
    glu, drift = "generation_candidates:glu_error_at_step_2", "generation_candidates:key_drift"
    cfg = MatrixConfig(RunConfig(model="tiny-qwen3.5", prompt_len=16, new_tokens=4), candidates=[glu, drift],
                       seeds=[1], batches=[2], modes=["static"])
    report = run_matrix(cfg)
    assert report["summary"][glu]["total"] == {"exact": 0, "checks": 1}
    rows = [r for r in report["rows"] if r["path"] == glu]
    assert [r["first_divergent_step"] for r in rows] == [2, 3]  # row 1 flips a step later
    for row in rows:
        assert ONSET_KEYS <= row["onset"].keys(), row
        assert (row["onset"]["site"], row["onset"]["step"], row["onset"]["verdict"]) == ("layers.1.mlp.glu", 2, "error")
        assert row["onset"]["reason"] == "verdict" and isinstance(row["near_tie"], bool)
    assert rows[0]["accumulated"] is False and rows[1]["accumulated"] is True
    assert rows[0]["located_by"] == "decode step 2 re-run traced from the reference's state"
    assert rows[1]["located_by"].startswith("steps 0..3 re-run traced from the start")

    exact, flipped = [r for r in report["rows"] if r["path"] == drift]
    assert exact["token_exact"] and exact["accumulated"] is None and exact["onset"] is None
    assert flipped["first_divergent_step"] == 3
    assert flipped["accumulated"] is True and flipped["restored_step_diverges"] is False
    assert (flipped["onset"]["site"], flipped["onset"]["step"]) == ("layers.1.self_attn.core", 1)
    assert flipped["onset"]["reason"] == "unobserved"  # the keys changed in cache handling, which no site observes


def test_a_candidate_observable_at_some_sites_limits_every_recording_and_no_onset_is_called_unobserved(monkeypatch
                                                                                                       ) -> None:
    """A candidate path observable only at some sites: the matrix records only those on both sides, its traces
    say so (``selection.observed``), so the comparison is not complete — the first difference, at an attention
    core whose keys changed in code no recorded site sees, is not claimed as an ``unobserved`` onset (an
    unrecorded site may be where it began)."""
    monkeypatch.syspath_prepend(str(HERE))
    import generation_candidates

    path = "generation_candidates:key_drift_seen_at_attention"
    cfg = MatrixConfig(RunConfig(model="tiny-qwen3.5", prompt_len=16, new_tokens=4), candidates=[path],
                       seeds=[1], batches=[2], modes=["static"])
    report = run_matrix(cfg)
    assert report["judging"]["observed"] == f"{path}: {generation_candidates.key_drift_seen_at_attention.observed}"
    flipped = [r for r in report["rows"] if not r["token_exact"]]
    assert flipped, "the key drift flips a row"
    for row in flipped:
        assert row["onset"] is None, row["onset"]
        first = row["first_difference"]
        assert first is not None and first["kind"] == "attention" and first["site"].endswith("self_attn.core"), first


def test_graph_mode_on_cpu_exits_2_with_one_line(capsys) -> None:
    assert main(["matrix", "--candidate", "hf", "--modes", "eager", "graph"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--modes graph" in err[0] and "CUDA" in err[0]
    assert main(["matrix", "--candidate", "hf", "--reference-mode", "graph", "--modes", "eager"]) == 2
    assert "--reference-mode graph" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--batches", "0", "2"], "--batches values must be >= 1, but got 0"),
    (["--batches", "2", "2"], "--batches lists 2 more than once"),
    (["--graph-attempts", "0"], "--graph-attempts must be >= 1"),
    (["--prompts", "4"], "matrix does not take --prompts"),
    (["--seed", "5"], "matrix does not take --seed: each seed of --seeds draws the weights and prompts"),
    (["--seed", "0"], "matrix does not take --seed"),  # given, even as the default's value
    (["--graph-attempts", "3", "--modes", "eager", "static"],
     "--graph-attempts 3 counts the checks of graph mode, but the modes are eager static"),
    (["--steps", "0:2"], "matrix does not take --steps"),
    (["--seeds"], "argument --seeds: expected at least one argument"),
    (["--modes", "fast"], "invalid choice: 'fast'"),
    (["--plot", "x.txt"], "expected a file name ending in .png"),
])
def test_bad_grid_values_exit_2_with_one_line(argv, expected, capsys) -> None:
    try:
        status = main(["matrix", "--candidate", "hf", *argv])
    except SystemExit as exc:  # argparse's own errors (one line, see ulptrace.cli.Parser)
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_unknown_candidate_exits_2_before_any_model_is_built(capsys) -> None:
    assert main(["matrix", "--candidate", "hf", "no_such_module:patch", "--modes", "eager"]) == 2
    assert "no_such_module" in capsys.readouterr().err


def test_plot_matrix_marks_near_tie_flips() -> None:
    from ulptrace.plot import plot_matrix

    def row(path, step, tie, batch=2, r=0, verdict="error"):
        onset = None if step is None else {"step": step, "site": "s", "kind": "glu", "layer": 0, "reason": "verdict",
                                           "verdict": verdict, "boundary": None}
        return {"path": path, "mode": "eager", "seed": 0, "batch": batch, "attempt": 1, "row": r,
                "token_exact": step is None, "first_divergent_step": step, "near_tie": tie, "accumulated": False,
                "onset": onset}

    report = {"model": "m", "reference": {"path": "hf", "mode": "eager"}, "grid": {"new_tokens": 4},
              "rows": [row("a", None, None), row("a", 2, True, r=1), row("b", 0, False), row("b", 3, True, r=1, verdict="tie")]}
    fig = plot_matrix(report)
    ax = fig.axes[0]
    hollow = [line for line in ax.lines if line.get_marker() == "o" and line.get_markerfacecolor() == "none"]
    crosses = [line for line in ax.lines if line.get_marker() == "X"]
    assert len(hollow) == 2 and len(crosses) == 1
    assert sorted(line.get_ydata()[0] for line in hollow) == [2, 3]
    with pytest.raises(ValueError, match="no rows"):
        plot_matrix({"rows": []})


def test_merged_parts_equal_the_whole_grid_and_bad_parts_are_refused(monkeypatch, tmp_path, capsys) -> None:
    """A grid run as two parts (seed 0, seed 1) and merged gives the whole grid's summary, rows and checks."""
    from ulptrace.probes.matrix import merge_reports

    monkeypatch.syspath_prepend(str(HERE))
    import generation_candidates

    monkeypatch.setattr(generation_candidates, "GLU_SCALE", -4.0)
    glu = "generation_candidates:glu_error_at_step_2"

    def grid(seeds, candidates=("hf", glu)):
        return run_matrix(MatrixConfig(RunConfig(model="tiny-qwen3.5", prompt_len=16, new_tokens=4),
                                       candidates=list(candidates), seeds=seeds, batches=[1, 2], modes=["static"],
                                       locate=False))

    whole, part0, part1 = grid([0, 1]), grid([0]), grid([1])
    merged = merge_reports([part1, part0], names=["b.json", "a.json"])  # any order
    assert merged["summary"] == whole["summary"]
    assert merged["summary"][glu]["total"]["exact"] < merged["summary"][glu]["total"]["checks"]  # rows diverge
    assert merged["rows"] == whole["rows"]
    drop = lambda checks: [{k: v for k, v in c.items() if k != "seconds"} for c in checks]
    assert drop(merged["checks"]) == drop(whole["checks"])
    assert merged["grid"] == whole["grid"] and merged["complete"] is True
    assert [m["name"] for m in merged["merged_from"]] == ["b.json", "a.json"]

    with pytest.raises(ValueError, match=r"a\.json overlaps b\.json: both have seed 1 of path 'hf'"):
        merge_reports([part1, part1], names=["b.json", "a.json"])
    judged = {**part1, "judging": {**part1["judging"], "oracle": False}}  # located without the oracle
    with pytest.raises(ValueError, match=r"judging is \{'oracle': False.* in"):
        merge_reports([part0, judged])
    other = {**part1, "grid": {**part1["grid"], "new_tokens": 8}}
    with pytest.raises(ValueError, match=r"grid\.new_tokens is 8 there, 4 in"):
        merge_reports([part0, other])
    with pytest.raises(ValueError, match="expected a matrix report"):
        merge_reports([part0, {"schema": "ulptrace.onset"}])
    with pytest.raises(ValueError, match=r"report 2: not a whole matrix report: it lacks model, .*grid\.batches"):
        merge_reports([part0, {"schema": part0["schema"]}])

    # the command: parts from files, the merged report written; a bad file is one line, exit 2
    a, b, out, md = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json", tmp_path / "m.md"
    a.write_text(json.dumps(part0))
    b.write_text(json.dumps(part1))
    assert main(["matrix-merge", str(a), str(b), "--json", str(out), "--markdown", str(md)]) == 0
    assert json.loads(out.read_text())["summary"] == whole["summary"]
    assert "| Total |" in md.read_text()
    capsys.readouterr()
    assert main(["matrix-merge", str(a), str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such matrix report" in err[0]


def test_a_stopped_matrix_resumed_equals_the_whole_run_and_another_grid_is_refused(monkeypatch, tmp_path, capsys) -> None:
    """``--resume``: the checks of a stopped run's partial report are taken as they are and only the rest run
    (a spy counts the generations); the result is the whole grid's, located rows included."""
    from ulptrace.probes import matrix as matrix_probe

    monkeypatch.syspath_prepend(str(HERE))
    import generation_candidates

    monkeypatch.setattr(generation_candidates, "GLU_SCALE", -4.0)
    glu = "generation_candidates:glu_error_at_step_2"

    def cfg(**kw):
        return MatrixConfig(RunConfig(model="tiny-qwen3.5", prompt_len=16, new_tokens=4), candidates=["hf", glu],
                            seeds=[0, 1], batches=[1, 2], modes=["static"], **kw)

    whole = run_matrix(cfg())
    assert any(r.get("located") for r in whole["rows"])  # located rows are part of what is resumed
    partial = {**whole, "complete": False, "checks": whole["checks"][:5]}  # stopped after 5 of 8 checks
    partial["rows"] = [r for r in whole["rows"] if any(all(r[k] == c[k] for k in ("path", "mode", "seed", "batch",
                                                                                   "attempt")) for c in partial["checks"])]
    partial["rows"] = partial["rows"][:-1]  # the 5th check's rows cut off mid-write: that check runs again
    calls = []
    real = matrix_probe.generate
    monkeypatch.setattr(matrix_probe, "generate", lambda *a, **k: calls.append(bool(k.get("keep_states"))) or real(*a, **k))
    resumed = run_matrix(cfg(resume=partial))
    # seed 0's 4 checks taken, seed 1's 4 run: per batch a reference (keep_states) and 2 candidates
    assert sorted(calls) == [False] * 4 + [True] * 2
    assert resumed["complete"] is True and resumed["resumed"]["checks"] == 4
    assert resumed["summary"] == whole["summary"]
    strip = lambda items: [{k: v for k, v in x.items() if k not in ("seconds", "resumed")} for x in items]
    assert strip(resumed["checks"]) == strip(whole["checks"]) and resumed["rows"] == whole["rows"]
    assert [c.get("resumed", False) for c in resumed["checks"]] == [True] * 4 + [False] * 4
    # rows located in the taken checks count against --locate-limit: with a limit of exactly those, none is added
    taken = sum(bool(r.get("located")) for r in partial["rows"])  # the 4 taken checks (seed 0)
    assert taken > 0
    limited = run_matrix(cfg(resume=partial, locate_limit=taken))
    assert sum(bool(r.get("located")) for r in limited["rows"]) == taken
    assert any(not r["token_exact"] and not r["located"] for r in limited["rows"][6:])  # seed 1's rows: not located

    path = tmp_path / "partial.json"
    path.write_text(json.dumps(partial))
    capsys.readouterr()
    assert main(["matrix", "--model", "tiny-qwen3.5", "--prompt-len", "16", "--new-tokens", "8", "--candidate", "hf",
                 glu, "--seeds", "0", "1", "--batches", "1", "2", "--modes", "static", "--resume", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grid.new_tokens is 4 there, 8 here" in err[0], err
    assert main(["matrix", "--candidate", "hf", "--resume", str(tmp_path / "nope.json")]) == 2
    assert "no such matrix report" in capsys.readouterr().err
    # rows located another way (without the oracle here) are not mixed into this run's
    with pytest.raises(ValueError, match=r"judging is \{'oracle': True.*there, \{'oracle': False"):
        run_matrix(MatrixConfig(
            RunConfig(model="tiny-qwen3.5", prompt_len=16, new_tokens=4, oracle=False), candidates=["hf", glu],
            seeds=[0, 1], batches=[1, 2], modes=["static"], resume=partial))
    older = {k: v for k, v in partial.items() if k != "judging"}
    with pytest.raises(ValueError, match=r"does not record judging \(written by an older ulptrace\?\)"):
        run_matrix(cfg(resume=older))


def _divergent_rows(defect: str) -> list[dict]:
    """The divergent rows of ``defect``'s matrix on tiny-llama (one seed, batch 2, eager), at least one."""
    cfg = MatrixConfig(RunConfig(model="tiny-llama", prompt_len=16, new_tokens=4), candidates=[defect], seeds=[0],
                       batches=[2], modes=["eager"])
    rows = [r for r in run_matrix(cfg)["rows"] if not r["token_exact"]]
    assert rows, "the defect flips some row"
    return rows


def test_a_kernel_installed_by_name_is_located_on_its_own_side(monkeypatch) -> None:
    """Locating re-runs the reference while the candidate's path is applied: a kernel installed by assigning a name
    the modeling module's code looks up must not run there too (``ulptrace.sides``) — before, every divergent row of
    such a candidate read "no record differs"."""
    monkeypatch.syspath_prepend(str(HERE))
    for row in _divergent_rows("generation_candidates:rope_reversed_at_decode_by_name"):
        assert (row["onset"]["site"], row["onset"]["step"], row["onset"]["verdict"]) == \
            ("layers.0.self_attn.q_rope", 1, "error"), row


def test_the_oracle_judges_with_its_own_arithmetic_not_a_candidate_s(monkeypatch) -> None:
    """A candidate that replaces ``torch.rsqrt`` process-wide (1.25x too large at decode): the oracle's interval
    rules call ``torch.rsqrt`` too, and judging with the candidate's read the defect as a tie ("no onset"); the
    judge puts the reference's names back while it judges (``OracleJudge.replayed``)."""
    monkeypatch.syspath_prepend(str(HERE))
    for row in _divergent_rows("generation_candidates:rsqrt_scaled_at_decode"):
        assert (row["onset"]["site"], row["onset"]["verdict"]) == ("layers.0.input_layernorm", "error"), row
