"""``concurrent="split"``: both sides recorded in processes of their own, the onset's process only comparing (issue
11's experiment for P1, whose wall is the candidate recorded and compared in the onset's process): the report the
sequential onset gives — records, statistics, verdicts, onset, tokens, the observation check —, each side's process
kept for the next run of its role, and what goes wrong in either process raised here, never read as a clean run and
never a wait.

Each new process imports and builds for a few seconds on a CPU: few runs, small shapes."""

from __future__ import annotations

import re

import pytest
from onset_reports import essentials as _essentials
from onset_reports import report as _report
from onset_reports import within as _within
from ulptrace.concurrent import ReferenceProcess, shutdown
from ulptrace.probes.onset import run_onset
from ulptrace.run import RunConfig

SMALL = {"prompts": 2, "prompt_len": 8, "new_tokens": 3}


@pytest.mark.parametrize("fields", [
    {"model": "tiny-qwen3.5", "candidate": "kernels:fused", "oracle": False},
    {"model": "tiny-llama", "candidate": "kernels:fused", "check_observation": True},
    {"model": "tiny-llama", "candidate": "fault:layers.1.mlp.glu@1+2", "judge_workers": 1},
], ids=["no-oracle", "oracle-observed", "judged-elsewhere"])
def test_a_split_onset_reports_what_the_sequential_one_does(fields) -> None:
    sequential = _report(RunConfig(**SMALL, **fields))
    split = _within(180, lambda: _report(RunConfig(**SMALL, concurrent="split", **fields)))
    assert _essentials(split) == _essentials(sequential)
    assert split["sites"], "records were compared"
    if fields.get("judge_workers"):  # a planted error, judged in a process of its own
        assert split["onset"] and split["run"]["judging_processes"]["pairs_judged_there"] > 0
    run = split["run"]
    assert run["candidate_process"]["pid"] != run["reference_process"]["pid"]
    # the candidate was fed the reference's tokens: its run waited for none it was not sent
    assert run["candidate_tokens"] == sequential["run"]["candidate_tokens"]
    if fields.get("check_observation"):
        assert split["run"]["observation"]["candidate"]["checked"]


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [{"model": "tiny-qwen3.5", "candidate": "kernels:fused", "oracle": False},
                                    {"model": "tiny-llama", "candidate": "fault:layers.1.mlp.glu@1+2"}], ids=str)
def test_a_split_onset_on_the_gpu_reports_what_the_sequential_one_does(fields, cuda_kernels) -> None:
    """On a GPU both sides' records come through CUDA IPC, and so does each token the candidate's process is fed."""
    sequential = _report(RunConfig(**SMALL, device="cuda", **fields))
    split = _within(300, lambda: _report(RunConfig(**SMALL, device="cuda", concurrent="split", **fields)))
    assert _essentials(split) == _essentials(sequential)
    assert split["sites"] and split["run"]["candidate_process"]["peak_gpu_bytes"] > 0


@pytest.mark.parametrize("shipping", ["in parts", "live"])
def test_a_split_onset_shipping_in_parts_or_live_values_reports_the_same(monkeypatch, shipping) -> None:
    """Both sides ship the way the reference does under ``--concurrent``: a step in parts of one byte (every record
    alone; the candidate fed once its step's last part came), or every value of 256 bytes or more handed over live
    (each side waits until this process has read it, and says so to whichever side waits): the sequential onset's
    report, and no wait between the three processes deadlocks."""
    from ulptrace import concurrent

    said: dict[str, int] = {}
    if shipping == "in parts":
        monkeypatch.setattr(concurrent, "PART_BYTES", 1)
    else:
        monkeypatch.setattr(concurrent, "LIVE_BYTES", 256)
        ack = ReferenceProcess.ack
        monkeypatch.setattr(ReferenceProcess, "ack",
                            lambda self: (said.__setitem__(self.role, said.get(self.role, 0) + 1), ack(self)))
    fields = {"model": "tiny-llama", "candidate": "fault:layers.1.mlp.glu@1+2"}
    sequential = _report(RunConfig(**SMALL, **fields))
    split = _within(180, lambda: _report(RunConfig(**SMALL, concurrent="split", **fields)))
    assert _essentials(split) == _essentials(sequential) and split["onset"] is not None
    if shipping == "live":
        assert said.get("reference", 0) > 10 and said.get("candidate", 0) > 10  # each side's values waited on


def test_each_sides_process_is_kept_for_the_next_split_run_of_its_role() -> None:
    cfg = RunConfig(**SMALL, model="tiny-llama", candidate="kernels:fused", oracle=False, concurrent="split")
    first, again = (_within(180, lambda: _report(cfg))["run"] for _ in range(2))
    for role in ("reference_process", "candidate_process"):
        assert again[role]["pid"] == first[role]["pid"]
        assert again[role]["run_in_process"] == first[role]["run_in_process"] + 1


@pytest.mark.parametrize("side", ["reference", "candidate"])
def test_a_failure_in_either_process_inside_the_run_is_raised_here(side) -> None:
    """A path that fails at its first decode step, on either side: the error the onset raises without processes,
    caused by its traceback in that process — the candidate waiting for a reference token that will not come is not
    left waiting, nor is this process."""
    path = "generation_candidates:raises_at_the_first_decode_step"
    cfg = RunConfig(**SMALL, model="tiny-llama", oracle=False, concurrent="split", **{side: path})
    with pytest.raises(RuntimeError, match="planted failure at the first decode step") as here:
        run_onset(RunConfig(**{**vars(cfg), "concurrent": False}))
    with pytest.raises(type(here.value), match="planted failure at the first decode step") as raised:
        _within(180, lambda: run_onset(cfg))
    assert re.search(f"(?s){side} run failed in its process.*planted failure", str(raised.value.__cause__))


def test_a_candidate_process_that_dies_is_reported_with_its_exit_code() -> None:
    shutdown()  # a new process: still importing when it is killed
    with ReferenceProcess(RunConfig(model="tiny-llama", **SMALL), role="candidate") as process:
        process.start()  # no model sent: it would build its own
        process.kill()
        with pytest.raises(RuntimeError, match=r"the candidate process ended without finishing its run \(exit code"):
            process.trace.metadata  # noqa: B018 — reading it waits for the process


def test_split_refuses_what_it_cannot_do(tmp_path) -> None:
    with pytest.raises(ValueError, match="records both sides in processes of their own and keeps no reference trace"):
        run_onset(RunConfig(concurrent="split", **SMALL), reference_dir=tmp_path)
    with pytest.raises(ValueError, match="--reference-memory host says where this process keeps"):
        RunConfig(concurrent="split", reference_memory="host", **SMALL).validate()
    with pytest.raises(ValueError, match="concurrent must be True, False, 'auto' or 'split', but got 'both'"):
        RunConfig(concurrent="both", **SMALL).validate()
