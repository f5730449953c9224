"""``onset --judge-workers N``: the oracle judging in processes of its own gives the report judging in this process
gives — every verdict, boundary, error distance and onset — and a worker that fails is raised here, never read as a
clean run.

Each new pool starts processes (imports, a second of CPU each and more on CI's two cores): few runs, small shapes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from onset_reports import essentials, report, within
from ulptrace import judging
from ulptrace.cli import main
from ulptrace.paths import PathError
from ulptrace.run import RunConfig

SMALL = {"prompts": 2, "prompt_len": 8, "new_tokens": 3}


def _verdicts(data: dict) -> dict[str, int]:
    totals: dict[str, int] = {}
    for site in data["sites"]:
        for verdict, count in (site.get("verdicts") or {}).items():
            totals[verdict] = totals.get(verdict, 0) + count
    return totals


def test_judged_in_processes_the_report_is_judging_heres_and_the_processes_are_kept(monkeypatch) -> None:
    judging.shutdown()
    fields = {**SMALL, "model": "tiny-qwen3.5", "candidate": "kernels:fused"}
    here = report(RunConfig(**fields))
    there = within(180, lambda: report(RunConfig(**fields, judge_workers=2)))
    assert essentials(there) == essentials(here)
    totals = _verdicts(here)
    assert totals["tie"] + totals["boundary"] > 0, "records that differ were judged (not only exact ones)"
    assert there["run"]["judging_processes"]["processes"] == 2
    assert there["run"]["judging_processes"]["pairs_judged_there"] > 0
    kept = list(judging._IDLE.values())
    assert len(kept) == 1 and all(p.is_alive() for p in kept[0].processes)
    pids = [p.pid for p in kept[0].processes]
    # the pairs held as a QueuedJudge holds them (a share of the device's memory, whatever the 256 MiB floor), so a
    # site's records reach one process together: one share per process at the end
    monkeypatch.setattr("ulptrace.verdicts.QUEUE_BYTES", 1)
    shares = []
    submit = judging.JudgePool.submit
    monkeypatch.setattr(judging.JudgePool, "submit", lambda self, pairs: shares.append(len(pairs)) or submit(self, pairs))
    again = within(120, lambda: report(RunConfig(**fields, judge_workers=2)))  # the kept processes, their model
    assert essentials(again) == essentials(here)
    assert len(shares) == 2 and sum(shares) == there["run"]["judging_processes"]["pairs_judged_there"], shares
    shares.clear()
    monkeypatch.setattr("ulptrace.verdicts.QUEUE_SHARE", 0)  # a bound of one byte: each pair sent as it comes
    assert essentials(within(120, lambda: report(RunConfig(**fields, judge_workers=2)))) == essentials(here)
    assert shares == [1] * there["run"]["judging_processes"]["pairs_judged_there"]
    assert [p.pid for p in next(iter(judging._IDLE.values())).processes] == pids
    judging.shutdown()
    assert not judging._IDLE and not any(p.is_alive() for p in kept[0].processes)


def test_judged_in_processes_beside_a_concurrent_reference_the_report_is_the_same() -> None:
    """Both helpers at once, the other family, a candidate with errors of its own: the reference's records arrive from
    its process and are judged in a third."""
    fields = {**SMALL, "prompt_len": 16, "model": "tiny-llama", "candidate": "generation_candidates:glu_error_at_step_2"}
    here = report(RunConfig(**fields))
    there = within(180, lambda: report(RunConfig(**fields, concurrent=True, judge_workers=1)))
    assert essentials(there) == essentials(here)
    assert _verdicts(here)["error"] > 0, "the planted error was judged"
    judging.shutdown()


def test_a_judging_process_that_dies_is_an_error_not_a_hang(monkeypatch) -> None:
    submit = judging.JudgePool.submit

    def submit_then_kill(self, pairs):
        pending = submit(self, pairs)
        for process in self._workers.processes:  # killed as the system's OOM killer would
            process.kill()
            process.join()
        return pending

    monkeypatch.setattr(judging.JudgePool, "submit", submit_then_kill)
    cfg = RunConfig(**{**SMALL, "prompt_len": 16}, model="tiny-llama",
                    candidate="generation_candidates:glu_error_at_step_2", judge_workers=1)
    with pytest.raises(RuntimeError, match=r"judging process 0 ended without answering \(exit code -9\)"):
        within(120, lambda: report(cfg))
    assert not judging._IDLE, "a failed pool is not kept"


@pytest.mark.parametrize("flags, said", [
    (["--judge-workers", "2", "--no-oracle"], "--judge-workers is the number of processes the oracle judges in"),
    (["--judge-workers", "-1"], "but got -1"),
])
def test_judge_workers_refused_where_it_would_be_ignored_or_meaningless(flags, said, capsys) -> None:
    assert main(["onset", "--model", "tiny-llama", "--prompts", "1", "--prompt-len", "4", "--new-tokens", "1",
                 *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.parametrize("how", [{}, {"concurrent": True}, {"reference_memory": "host"}],
                         ids=["sequential", "concurrent", "reference-in-host-memory"])
def test_judged_in_processes_on_the_gpu_the_report_is_judging_heres(how, cuda_kernels) -> None:
    """On a GPU each pair goes to its judging process through CUDA IPC (one arena, a copy); with ``--concurrent`` the
    reference's records arrive through CUDA IPC from a third process first; a reference waiting in host memory is
    moved to the GPU with its candidate before the two are packed."""
    fields = {**SMALL, "device": "cuda", "model": "tiny-qwen3.5", "candidate": "kernels:fused"}
    here = report(RunConfig(**fields))
    there = within(300, lambda: report(RunConfig(**fields, **how, judge_workers=2)))
    assert essentials(there) == essentials(here)
    assert there["run"]["judging_processes"]["pairs_judged_there"] > 0
    judging.shutdown()


def test_a_path_that_fails_in_a_judging_process_is_raised_here_and_the_pool_not_kept() -> None:
    """The reference path applied in the judging processes fails there (not here): the run raises that failure, with
    the processes' traceback, whether or not any pair was sent — never a report judged by nobody, nor a pool kept
    that the next onset would read the failure from."""
    judging.shutdown()
    cfg = RunConfig(**SMALL, model="tiny-llama", reference="generation_candidates:fails_in_a_helper_process",
                    candidate="generation_candidates:fails_in_a_helper_process", judge_workers=1)
    with pytest.raises(PathError, match="planted failure: this path does not run in a helper process") as raised:
        within(120, lambda: report(cfg))  # the two sides are the same: nothing differs, no pair is sent
    assert "failed in its process" in str(raised.value.__cause__)  # with the judging process's traceback
    assert not judging._IDLE


def test_pairs_held_to_a_byte_budget_report_the_same(monkeypatch) -> None:
    """With no room for more than one pair in flight (``AHEAD_BYTES`` of one byte) each pair waits for the answer to
    the one before: the same report, no deadlock."""
    fields = {**SMALL, "prompt_len": 16, "model": "tiny-llama", "candidate": "generation_candidates:glu_error_at_step_2"}
    here = report(RunConfig(**fields))
    monkeypatch.setattr(judging, "AHEAD_BYTES", 1)
    there = within(180, lambda: report(RunConfig(**fields, judge_workers=2)))
    assert essentials(there) == essentials(here)
    judging.shutdown()


def test_ending_helpers_drops_what_they_will_never_read() -> None:
    """A helper killed with a command still in its queue (a share of pairs larger than a pipe holds): this process
    exits at once, not waiting forever to send it (pytest hung after its summary until this was so)."""
    code = (
        "import time\n"
        "from ulptrace.processes import end_processes\n"
        "from ulptrace.spawning import spawn_context\n"
        "if __name__ == '__main__':\n"
        "    context = spawn_context()\n"
        "    queue = context.Queue()\n"
        "    process = context.Process(target=time.sleep, args=(60,), daemon=True)\n"
        "    process.start()\n"
        "    queue.put(b'x' * (4 << 20))\n"
        "    end_processes([process], [queue])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_judging_process_holds_nothing_of_the_parents_model_when_it_ends(monkeypatch) -> None:
    """When a judging process ends, nothing in it still holds the model the parent sent (its memory shared): on CUDA
    the parent, at its own exit, warned "Producer process has been terminated before all shared CUDA tensors
    released" while a variable of the process's loop still held it. Run here, its ending replaced by a check."""
    import gc
    import queue
    import weakref

    import torch
    from ulptrace.models import build_model

    model = build_model("tiny-llama")
    alive = weakref.ref(model)
    commands: queue.Queue = queue.Queue()
    answers: queue.Queue = queue.Queue()
    from ulptrace.processes import Setup

    for command in (("open", RunConfig(model="tiny-llama"), model, Setup.of(RunConfig(model="tiny-llama"))),
                    ("close",), None):
        commands.put(command)
    del model, command
    held: list[bool] = []

    def ending(out) -> None:
        gc.collect()
        held.append(alive() is not None)

    monkeypatch.setattr(judging, "end_helper", ending)
    threads = torch.get_num_threads()
    try:
        judging._serve(commands, answers)
    finally:
        torch.set_num_threads(threads)
    assert answers.get_nowait() == ("opened",)
    assert held == [False]
