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


def test_the_command_starts_both_sides_processes_before_it_imports_torch_and_the_onset_takes_them(tmp_path) -> None:
    """``onset --concurrent split`` starts the reference's and the candidate's processes at the command's first line,
    before this process imports torch (their imports overlap this one's build), and the onset records each side in
    the very process started for it — two processes started, none left over."""
    import json
    import subprocess
    import sys

    out = tmp_path / "onset.json"
    code = f"""
import json, sys
from ulptrace import spawning
from ulptrace.cli import main
seen = {{"torch_before": None, "pids": {{}}}}
original_init, original_start = spawning.ReferenceStart.__init__, spawning.start_reference
def init(self, verbosity=None, role="reference"):
    original_init(self, verbosity, role)
    seen["pids"][role] = self.process.pid
def start(*args):
    seen["torch_before"] = "torch" in sys.modules
    return original_start(*args)
spawning.ReferenceStart.__init__, spawning.start_reference = init, start
code = main(["onset", "--concurrent", "split", "--no-oracle", "--model", "tiny-llama", "--prompts", "2",
             "--prompt-len", "8", "--new-tokens", "2", "--quiet", "--json", {str(out)!r}])
print(json.dumps({{**seen, "code": code, "early": len(spawning._EARLY)}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0 and seen["torch_before"] is False and seen["early"] == 0
    run = json.loads(out.read_text())["run"]
    assert seen["pids"] == {"reference": run["reference_process"]["pid"],
                            "candidate": run["candidate_process"]["pid"]}


def test_a_process_started_for_one_role_is_taken_by_that_role_only() -> None:
    """Each side's early process (``ulptrace.spawning.start_reference``) is taken by its own role; taking one leaves
    the other role's of the same run to its taker, stops any started for another model or device, and what nobody
    takes is stopped by ``drop_reference``; a role it does not know is refused, naming the roles."""
    from ulptrace import spawning

    first = spawning.start_reference("tiny-llama", "cpu", None, spawning.ROLES)
    both = {role: spawning._EARLY[role, "tiny-llama", "cpu"] for role in spawning.ROLES}
    assert first is both["reference"] and both["candidate"].process.name == "ulptrace-candidate"
    try:
        assert spawning.take_reference("tiny-llama", "cpu", "candidate") is both["candidate"]
        assert both["reference"].process.is_alive() and spawning.take_reference("tiny-llama", "cpu") is both["reference"]
        assert not spawning._EARLY
        other = spawning.start_reference("tiny-llama", "cpu", None, spawning.ROLES)
        assert spawning.take_reference("tiny-qwen3.5", "cpu", "candidate") is None  # another model's: stopped
        other.process.join(10)
        assert not other.process.is_alive() and not spawning._EARLY
        spawning.start_reference("tiny-llama", "cpu", None, spawning.ROLES)
        left = list(spawning._EARLY.values())
        spawning.drop_reference()
        for start in left:
            start.process.join(10)
            assert not start.process.is_alive()
        with pytest.raises(ValueError, match="role must be one of reference, candidate, but got 'judge'"):
            spawning.ReferenceStart(role="judge")
    finally:
        from ulptrace.processes import end_processes

        end_processes([s.process for s in both.values()],
                      [q for s in both.values() for q in (s.commands, s.messages, s.acks)])
        spawning.drop_reference()
