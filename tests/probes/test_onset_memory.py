"""Where the sequential onset keeps the reference's records (``--reference-memory``): ``auto`` keeps them on the GPU
up to a share of its memory (``MemorySink.room``) and sends the rest to host memory — the same report, and the spill
said, never silent (a long run's reference outgrowing the GPU is slow: the run info and a progress line say so and
name the remedy); with ``concurrent="auto"`` (the CLI's default) the onset starts again with the reference in a
process of its own instead — the same report again. On a CPU nothing is bounded, so the CPU tests give the sink a
small room of their own; the GPU tests shrink the real share."""

from __future__ import annotations

from dataclasses import replace

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


def _kept_sizes(cfg: RunConfig) -> list[tuple[int, int | None, str, int]]:
    """(step, layer, site, bytes) of each reference record as ``MemorySink`` counts what it keeps (a tensor in several
    roles once), in the order they come."""
    from ulptrace.run import build_pair, record_generation, selected_sites

    sizes = []

    class Counting(MemorySink):
        def add(self, record) -> None:
            tensors = {id(t): t for t in (record.out, *record.inputs.values())}
            sizes.append((record.step, record.layer, record.site, sum(t.nbytes for t in tensors.values())))

    ref, _, prompts = build_pair(cfg)
    record_generation(ref, cfg, "reference", prompts, {}, sink=Counting(), sites=selected_sites(ref, cfg))
    return sizes


@pytest.mark.parametrize(("model", "when"), [("tiny-qwen3.5", "prompt"), ("tiny-qwen3.5", "decode"),
                                           ("tiny-qwen3.5", "fits"), ("tiny-llama", "prompt")])
def test_concurrent_auto_switches_once_the_forecast_passes_the_room(monkeypatch, model, when) -> None:
    """The switch comes at the first forecast past the room, not once the room is full (at 8 x 4,096 tokens on an
    H200 the room was 67 GiB, full at layer 14 of 24): in the prompt, once its first layer has passed and the
    layers ahead counted as it (``prompt``: a room that holds two layers and a half; a hybrid family and a plain
    one); at a decode step, the last decode step's records counted for each step left (``decode``: a room past every
    forecast of the prompt, short of the run). A room the run fits with some to spare is never forecast past
    (``fits``). Reports as the sequential onset's."""
    cfg = RunConfig(**{**SMALL, "model": model})
    sizes = _kept_sizes(cfg)
    layers = len({layer for _, layer, _, _ in sizes if layer is not None})
    total = sum(size for *_, size in sizes)
    first_of = lambda step, layer: next(i for i, (s, l, _, _) in enumerate(sizes) if s == step and l == layer)
    before = lambda index: sum(size for *_, size in sizes[:index])
    layer0, layer1, layer2 = first_of(0, 0), first_of(0, 1), first_of(0, 2)
    layer2_end = max(i for i, (s, l, _, _) in enumerate(sizes) if s == 0 and l == 2) + 1
    step1, step2 = (next(i for i, (s, *_) in enumerate(sizes) if s == step) for step in (1, 2))
    if when == "prompt":
        room, at = (before(layer2) + before(layer2_end)) // 2, layer1
        # at layer 1: the bytes before layer 0, and layer 0's once for each layer (none of another kind passed yet)
        forecast = before(layer0) + layers * (before(layer1) - before(layer0))
        basis = f"the prompt's first 1 of {layers} layers"
    else:
        room, at = ((before(step2) + total) // 2, step2) if when == "decode" else (total * 6 // 5, None)
        forecast = before(step2) + (before(step2) - before(step1)) * (SMALL["new_tokens"] - 2)
        basis = "step 1's records for each of the 1 steps left"
    assert at is None or before(at) <= room < forecast  # the switch comes before the room is full
    sequential = _report(cfg)
    monkeypatch.setattr(MemorySink, "room", classmethod(lambda cls, device: room))
    said: list[str] = []
    try:
        comparison, info = run_onset(replace(cfg, concurrent="auto"), progress=said.append)
    finally:
        shutdown()
    switched = info.pop("switched_to_concurrent", None)
    assert essentials(dict(comparison.to_json(), run=info)) == essentials(sequential)
    if at is None:
        assert switched is None and "reference_spilled" not in info and "reference_process" not in info
        return
    assert {key: switched[key] for key in ("site", "step", "kept_on_device_bytes", "forecast_bytes", "room_bytes",
                                           "forecast_from")} == {
        "site": sizes[at][2], "step": sizes[at][0], "kept_on_device_bytes": before(at), "forecast_bytes": forecast,
        "room_bytes": room, "forecast_from": basis}
    assert sum("would outgrow their share of cpu's memory" in line and "forecast from" in line for line in said) == 1


def test_concurrent_takes_true_false_auto_or_split() -> None:
    RunConfig(concurrent="auto").validate()
    RunConfig(concurrent="auto", reference_memory="host").validate()  # auto never switches then: no conflict
    with pytest.raises(ValueError, match="concurrent must be True, False, 'auto' or 'split', but got 'yes'"):
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

