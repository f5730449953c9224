"""Worker for tests/tracer/test_tp.py, launched by torchrun (2 processes, gloo): runs the tensor-parallel onset
(``ulptrace.probes.tp_onset.run_onset_tp``) for each scenario on the command line, in one process group, and
rank 0 writes each result to ``OUT/<name>.json``.

    torchrun --standalone --nproc_per_node 2 tp_worker.py OUT NAME=MODEL[:CANDIDATE] ...

``CANDIDATE`` ``stale-shard`` plants a defect: rank 1's local shard of ``layers.1.mlp.down_proj.weight`` (a
row-parallel weight, split along its input features) has one element moved after loading, as a stale
per-rank weight copy would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STALE = (3, 5)  # (row, column) of rank 1's local shard
STALE_BY = 0.25


def stale_shard(model: Any) -> Any:
    """Perturb one element of rank 1's shard of ``layers.1.mlp.down_proj.weight`` (a DTensor, Shard(1))."""
    local = model.model.layers[1].mlp.down_proj.weight.to_local()  # this rank's shard, same storage
    if dist.get_rank() != 1:
        return lambda: None
    old = local[STALE].clone()
    with torch.no_grad():
        local[STALE] += STALE_BY

    def undo() -> None:
        with torch.no_grad():
            local[STALE] = old

    return undo


def _allreduce_evidence(out: str) -> None:
    """How gloo all-reduces BF16 tensors: compared with one BF16 rounding of the exact sum of the ranks' values
    (what the oracle's ``sharded`` hypothesis models for two shards)."""
    gen = torch.Generator().manual_seed(7)
    values = [(torch.randn(100_000, generator=gen) * torch.exp(3 * torch.randn(100_000, generator=gen)))
              .to(torch.bfloat16) for _ in range(dist.get_world_size())]
    mine = values[dist.get_rank()].clone()
    dist.all_reduce(mine)
    if dist.get_rank() == 0:
        exact = sum(v.double() for v in values)
        once = exact.to(torch.float32).to(torch.bfloat16)  # exact in FP32 for two BF16 addends, then one rounding
        Path(out, "allreduce.json").write_text(json.dumps({
            "dtype": str(mine.dtype), "ranks": dist.get_world_size(),
            "one_rounding_of_exact_sum": float((mine == once).double().mean()),
            "fp32_sum": float((mine == sum(v.float() for v in values).to(torch.bfloat16)).double().mean())}))


def main(out: str, scenarios: list[str]) -> None:
    from ulptrace.paths import register_path
    from ulptrace.probes.tp_onset import run_onset_tp
    from ulptrace.run import RunConfig

    dist.init_process_group("gloo")
    _allreduce_evidence(out)
    register_path("test:stale-shard", stale_shard, "rank 1's shard of layers.1.mlp.down_proj.weight is stale")
    try:
        for scenario in scenarios:
            name, spec = scenario.split("=", 1)
            model, _, candidate = spec.partition(":")
            cfg = RunConfig(model=model, candidate="test:stale-shard" if candidate == "stale-shard" else "hf",
                            prompts=2, prompt_len=8, new_tokens=3, check_observation=True)
            comparison, info = run_onset_tp(cfg, 2)
            if comparison is not None:
                data = comparison.to_json()
                data["run"] = info
                Path(out, f"{name}.json").write_text(json.dumps(data, default=str))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
