"""Where the sequential onset keeps the reference's records (``--reference-memory``): ``auto`` keeps them on the GPU
up to a share of its memory and sends the rest to host memory — the same report, and the spill said, never silent
(a long run's reference outgrowing the GPU is slow: the run info and a progress line say so and name the remedy)."""

from __future__ import annotations

import pytest
import torch
from onset_reports import essentials
from onset_reports import report as _report
from ulptrace.probes.onset import run_onset
from ulptrace.record import MemorySink
from ulptrace.run import RunConfig

SMALL = {"model": "tiny-qwen3.5", "candidate": "kernels:fused", "prompts": 2, "prompt_len": 8, "new_tokens": 3,
         "oracle": False}


def test_a_cpu_onset_spills_nothing_and_says_nothing() -> None:
    said: list[str] = []
    comparison, info = run_onset(RunConfig(**SMALL), progress=said.append)
    assert comparison.sites and "reference_spilled" not in info
    assert not any("host memory" in line for line in said)


@pytest.mark.gpu
@pytest.mark.parametrize("share", [0.0, None], ids=["all spilled", "part spilled"])
def test_a_reference_past_its_gpu_share_goes_to_the_host_with_the_same_report(monkeypatch, share, cuda_kernels
                                                                             ) -> None:
    kept = _report(RunConfig(**SMALL, device="cuda", reference_memory="device"))
    if share is None:  # room for about half of the reference's records above what the run has allocated
        records_bytes = 2 * 2**20  # tiny-qwen3.5 at 2 x 8 tokens, 3 steps: its records are ~1-3 MiB in all
        share = (torch.cuda.memory_allocated() + records_bytes // 2) / torch.cuda.get_device_properties(0).total_memory
    monkeypatch.setattr(MemorySink, "AUTO_SHARE", share)
    said: list[str] = []
    comparison, info = run_onset(RunConfig(**SMALL, device="cuda"), progress=said.append)
    spilled = dict(comparison.to_json(), run=info)
    note = spilled["run"].pop("reference_spilled")
    assert essentials(spilled) == essentials(kept)
    assert note["records"] > 0 and note["bytes"] > 0 and note["share"] == share
    assert (note["kept_on_device_bytes"] == 0) == (share == 0.0)
    assert sum("go to host memory" in line and "--concurrent" in line for line in said) == 1
