"""ulptrace batch-invariance: each prompt alone and inside batches; divergent rows located, sliced to the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ulptrace.cli import main
from ulptrace.probes.batch_invariance import BatchInvarianceConfig, run_batch_invariance
from ulptrace.run import RunConfig

HERE = Path(__file__).parent
ROW_KEYS = {"path", "mode", "seed", "batch", "attempt", "row", "token_exact", "first_divergent_step", "near_tie",
            "accumulated", "onset"}


def test_hf_rows_are_the_same_alone_and_batched_on_cpu(tmp_path, capsys) -> None:
    out = tmp_path / "b.json"
    assert main(["batch-invariance", "--model", "tiny-llama", "--batches", "1", "2", "--prompt-len", "8",
                 "--new-tokens", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["summary"][1] == {"batch": 2, "exact": 2, "rows": 2, "logits_bitwise": 2, "logits_max_ulp": 0}
    assert report["repeatable"] == {"checked": "prompt 0 generated alone twice", "tokens_equal": True,
                                    "logits_bitwise": True}
    assert [r["batch"] for r in report["rows"]] == [2, 2] and all(ROW_KEYS <= r.keys() for r in report["rows"])
    assert all(r["token_exact"] for r in report["rows"])
    assert "2/2" in capsys.readouterr().out


def test_a_batch_dependent_defect_is_located_in_the_row(monkeypatch) -> None:
    """A defect active only in batches of 2+ rows, at decode step 2: each divergent row's onset (its records sliced
    out of the batch, the batch restored to the alone runs' states) is the defect's site and step."""
    monkeypatch.syspath_prepend(str(HERE))
    import generation_candidates

    monkeypatch.setattr(generation_candidates, "GLU_SCALE", -16.0)
    cfg = BatchInvarianceConfig(RunConfig(model="tiny-llama", reference="generation_candidates:glu_error_in_batches",
                                          prompts=2, prompt_len=16, new_tokens=3), batches=[2])
    report = run_batch_invariance(cfg)
    assert [{k: e[k] for k in ("batch", "exact", "rows", "logits_bitwise")} for e in report["summary"]] == \
        [{"batch": 2, "exact": 0, "rows": 2, "logits_bitwise": 0}]
    for row in report["rows"]:
        assert row["first_divergent_step"] == 2 and row["accumulated"] is False
        assert (row["onset"]["site"], row["onset"]["step"], row["onset"]["verdict"]) == ("layers.1.mlp.glu", 2, "error")
    assert [r["row"] for r in report["rows"]] == [0, 1]


@pytest.mark.parametrize("argv, expected", [
    (["--batches", "4", "--prompts", "2"], "a batch cannot hold more rows than there are prompts"),
    (["--batches", "2", "--prompts", "3"], "--prompts 3 is not a multiple of batch size(s) 2"),
    (["--batches", "2", "3"], "the number of prompts (by default the largest batch size, 3) is not a multiple of "
                              "batch size(s) 2: expected every prompt in a full batch of each size (--prompts 6 is)"),
    (["--batches", "0"], "--batches values must be >= 1"),
    (["--mode", "graph"], "--mode graph replays CUDA graphs"),
])
def test_bad_values_exit_2_with_one_line(argv, expected, capsys) -> None:
    assert main(["batch-invariance", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_a_stopped_run_resumed_takes_its_batches_and_runs_the_rest(monkeypatch, tmp_path, capsys) -> None:
    """``--resume``: the batch sizes a stopped run completed (located rows included) are taken as they are, the
    others run; the result equals the whole run. Another run's report is refused in one line."""
    from ulptrace.probes import batch_invariance as probe

    monkeypatch.syspath_prepend(str(HERE))
    import generation_candidates

    monkeypatch.setattr(generation_candidates, "GLU_SCALE", -16.0)

    def cfg(batches, **kw):
        return BatchInvarianceConfig(RunConfig(model="tiny-llama", reference="generation_candidates:glu_error_in_batches",
                                               prompts=4, prompt_len=16, new_tokens=3), batches=batches, **kw)

    whole = run_batch_invariance(cfg([1, 2, 4]))
    assert any(r.get("located") for r in whole["rows"])
    stopped = run_batch_invariance(cfg([1, 2]))  # as if stopped after batch 2
    batched = []
    real = probe.generate
    monkeypatch.setattr(probe, "generate", lambda model, prompts, *a, **k: batched.append(prompts.shape[0])
                        or real(model, prompts, *a, **k))
    resumed = run_batch_invariance(cfg([1, 2, 4], resume=stopped))
    # the prompts alone, prompt 0 alone again (does the path repeat itself?), then only batch 4 (batch 2's are taken)
    assert batched == [1, 1, 1, 1, 1, 4]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "resumed"} for r in rows]
    assert strip(resumed["rows"]) == whole["rows"] and strip(resumed["summary"]) == whole["summary"]
    assert resumed["resumed"]["batches"] == 1 and resumed["complete"] is True
    batched.clear()
    again = run_batch_invariance(cfg([1, 2, 4], resume=resumed))  # everything done: nothing generated
    assert batched == [] and strip(again["rows"]) == whole["rows"]

    path = tmp_path / "stopped.json"
    path.write_text(json.dumps(stopped))
    capsys.readouterr()
    assert main(["batch-invariance", "--model", "tiny-llama", "--path", "generation_candidates:glu_error_in_batches",
                 "--batches", "1", "2", "--prompts", "4", "--new-tokens", "5", "--prompt-len", "16",
                 "--resume", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "new_tokens is 3 there, 5 here" in err[0], err


def test_a_batch_dependent_logit_scale_that_keeps_the_tokens_is_batch_variant_all_the_same(monkeypatch, capsys
                                                                                          ) -> None:
    """Logits scaled by a factor that follows the batch size keep every greedy token: token-exact, yet the path is
    not batch-invariant — the bitwise-logits count says so, with the largest difference, and the table says the
    tokens hid it. HF itself: every row's logits bitwise those alone."""
    monkeypatch.syspath_prepend(str(HERE))
    argv = ["batch-invariance", "--model", "tiny-llama", "--batches", "1", "2", "--prompts", "2", "--prompt-len", "8",
            "--new-tokens", "3"]
    cfg = BatchInvarianceConfig(RunConfig(model="tiny-llama", reference="generation_candidates:logits_scaled_by_batch",
                                          prompts=2, prompt_len=8, new_tokens=3), batches=[1, 2])
    report = run_batch_invariance(cfg)
    batch2 = report["summary"][1]
    assert (batch2["exact"], batch2["logits_bitwise"]) == (2, 0) and batch2["logits_max_ulp"] > 0
    assert all(r["token_exact"] and not r["logits_bitwise"] for r in report["rows"])
    assert main([*argv, "--path", "generation_candidates:logits_scaled_by_batch"]) == 0
    out = capsys.readouterr().out
    assert "0/2 (largest difference" in out and "greedy tokens hid it" in out


def test_a_path_that_does_not_repeat_itself_is_said_not_to(monkeypatch, capsys) -> None:
    """A path whose logits change run to run (noise of its own) would have its differences read as the batch's:
    prompt 0 generated alone twice says it does not repeat itself."""
    monkeypatch.syspath_prepend(str(HERE))
    assert main(["batch-invariance", "--model", "tiny-llama", "--batches", "1", "2", "--prompts", "2", "--prompt-len",
                 "8", "--new-tokens", "3", "--path", "generation_candidates:noisy_logits"]) == 0
    assert "the path does not repeat itself: prompt 0 alone gave other" in capsys.readouterr().out
