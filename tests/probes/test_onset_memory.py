"""Where the sequential onset keeps the reference's records (``--reference-memory``): ``auto`` keeps them on the GPU
up to a share of its memory (``MemorySink.room``) and sends the rest to host memory — the same report, and the spill
said, never silent (a long run's reference outgrowing the GPU is slow: the run info and a progress line say so and
name the remedy); with ``concurrent="auto"`` (the CLI's default) the onset starts again with the reference in a
process of its own instead — the same report again. On a CPU nothing is bounded, so the CPU tests give the sink a
small room of their own; the GPU tests shrink the real share."""

from __future__ import annotations

import pytest
from onset_reports import essentials
from onset_reports import report as _report
from ulptrace.concurrent import shutdown
from ulptrace.probes.onset import run_onset
from ulptrace.record import MemorySink
from ulptrace.run import RunConfig

TINY_ROOM = 64 << 10  # bytes: less than the reference's records (a few hundred KiB at this size)


def _small_room(monkeypatch) -> None:
    monkeypatch.setattr(MemorySink, "room", classmethod(lambda cls, device: TINY_ROOM))


SMALL = {"model": "tiny-qwen3.5", "candidate": "kernels:fused", "prompts": 2, "prompt_len": 8, "new_tokens": 3,
         "oracle": False}


def test_a_cpu_onset_spills_nothing_and_says_nothing() -> None:
    said: list[str] = []
    comparison, info = run_onset(RunConfig(**SMALL), progress=said.append)
    assert comparison.sites and "reference_spilled" not in info
    assert not any("host memory" in line for line in said)


def test_a_reference_past_its_room_is_said_and_reports_the_same(monkeypatch) -> None:
    kept = _report(RunConfig(**SMALL))
    _small_room(monkeypatch)
    said: list[str] = []
    comparison, info = run_onset(RunConfig(**SMALL), progress=said.append)
    note = info.pop("reference_spilled")
    assert essentials(dict(comparison.to_json(), run=info)) == essentials(kept)
    assert note["records"] > 0 and note["bytes"] > 0 and 0 <= note["kept_on_device_bytes"] <= TINY_ROOM
    assert [line for line in said if "go to host memory" in line and "--concurrent" in line] == [
        next(line for line in said if "share of cpu's memory" in line)]  # said once


@pytest.mark.parametrize("oracle", [False, True], ids=["no oracle", "oracle"])
def test_concurrent_auto_starts_again_streaming_a_reference_that_outgrew_its_room(monkeypatch, oracle) -> None:
    """``concurrent="auto"``: the reference's first record past its room stops the sequential run; the onset starts
    again with the reference in a process of its own (which keeps nothing here) and reports what the sequential
    onset does — verdicts too —, with the switch in its run info and said once."""
    fields = {**SMALL, "oracle": oracle, "model": "tiny-llama" if oracle else SMALL["model"]}
    sequential = _report(RunConfig(**fields))
    _small_room(monkeypatch)
    said: list[str] = []
    try:
        comparison, info = run_onset(RunConfig(**fields, concurrent="auto"), progress=said.append)
    finally:
        shutdown()  # the reference's process, kept for a next onset: not for other tests
    switched = info.pop("switched_to_concurrent")
    assert essentials(dict(comparison.to_json(), run=info)) == essentials(sequential)
    assert "reference_process" in info and "reference_spilled" not in info
    assert oracle == any(site["verdicts"] for site in comparison.to_json()["sites"])  # judged after the switch
    assert switched["step"] in range(SMALL["new_tokens"]) and 0 <= switched["kept_on_device_bytes"] <= TINY_ROOM
    assert switched["site"] and switched["device"] == "cpu"
    assert sum("starting again with the reference in a process of its own" in line for line in said) == 1
    # without the switch (False) or where the records are not kept by auto, nothing starts again
    for cfg in (RunConfig(**fields, concurrent=False), RunConfig(**fields, concurrent="auto", reference_memory="host")):
        _, info = run_onset(cfg)
        assert "switched_to_concurrent" not in info and "reference_process" not in info


def test_concurrent_takes_true_false_or_auto() -> None:
    RunConfig(concurrent="auto").validate()
    RunConfig(concurrent="auto", reference_memory="host").validate()  # auto never switches then: no conflict
    with pytest.raises(ValueError, match="concurrent must be True, False or 'auto', but got 'yes'"):
        RunConfig(concurrent="yes").validate()


@pytest.mark.gpu
@pytest.mark.parametrize("room", [None, 1 << 20], ids=["no share", "1 MiB"])
def test_a_reference_past_its_gpu_share_goes_to_the_host_with_the_same_report(monkeypatch, room, cuda_kernels
                                                                             ) -> None:
    """Nothing kept on the GPU (a share of 0: the real bound, below what is allocated), or some of it (a room of
    1 MiB): the records past it go to host memory, the report is the one of a reference kept on the GPU."""
    kept = _report(RunConfig(**SMALL, device="cuda", reference_memory="device"))
    if room is None:
        monkeypatch.setattr(MemorySink, "AUTO_SHARE", 0.0)
    else:
        monkeypatch.setattr(MemorySink, "room", classmethod(lambda cls, device: room))
    said: list[str] = []
    comparison, info = run_onset(RunConfig(**SMALL, device="cuda"), progress=said.append)
    spilled = dict(comparison.to_json(), run=info)
    note = spilled["run"].pop("reference_spilled")
    assert essentials(spilled) == essentials(kept)
    assert note["records"] > 0 and note["bytes"] > 0
    assert note["kept_on_device_bytes"] == 0 if room is None else 0 < note["kept_on_device_bytes"] <= room
    assert sum("go to host memory" in line and "--concurrent" in line for line in said) == 1

@pytest.mark.gpu
def test_concurrent_auto_on_the_gpu_starts_again_streaming_and_reports_the_same(monkeypatch, cuda_kernels) -> None:
    """On a GPU the switch frees what the stopped run held (its records, its models) before the reference's own
    process starts, and the records then come through CUDA IPC: the sequential onset's report."""
    kept = _report(RunConfig(**SMALL, device="cuda", reference_memory="device"))
    monkeypatch.setattr(MemorySink, "AUTO_SHARE", 0.0)
    try:
        comparison, info = run_onset(RunConfig(**SMALL, device="cuda", concurrent="auto"))
    finally:
        shutdown()
    switched = info.pop("switched_to_concurrent")
    assert essentials(dict(comparison.to_json(), run=info)) == essentials(kept)
    assert switched["device"].startswith("cuda") and switched["step"] == 0 and switched["kept_on_device_bytes"] == 0
    assert info["reference_process"]["peak_gpu_bytes"] > 0

