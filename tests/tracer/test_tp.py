"""Tensor-parallel tracing (``ulptrace.tp``, ``ulptrace onset --tp N``): both tiny models sharded over 2 CPU
processes (gloo, transformers' own TP plans) and judged against the same checkpoint unsharded.

Two torchrun launches, bounded by a timeout: the CLI end to end (tiny-llama), and a worker
(``tp_worker.py``) that runs tiny-qwen3.5 and the planted stale shard in both models through the Python API in
one process group. What must hold: every judged site carries verdicts; only the row-parallel sites (the TP
plan's ``rowwise`` modules) are ``boundary``, named as partial sums rounded to BF16 before the all-reduce;
nothing is ``error``; the observation check stays bitwise (gathering changes nothing); a stale weight shard on
rank 1 is ``error`` at its site, with the parameter, its rank and slice named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="tensor-parallel loading needs accelerate (the test extra installs it)")

HERE = Path(__file__).parent
TIMEOUT_S = 300
PARTIAL_SUMS = "partial sums rounded to BF16 before the all-reduce (2 shards"


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s: {' '.join(cmd)}\n{exc.stderr}")


def _rowwise(data: dict[str, Any]) -> tuple[str, ...]:
    """Module names (relative to a decoder layer) that the run's TP plan makes row-parallel."""
    plan = data["run"]["tp"]["plan"]
    return tuple(key.split("*.", 1)[1] for key, style in plan.items() if style == "rowwise" and "*." in key)


def _check_clean(data: dict[str, Any]) -> None:
    rowwise = _rowwise(data)
    assert rowwise, data["run"]["tp"]["plan"]
    assert not data["missing"] and not data["extra"] and not data["mismatched"]
    assert data["could_not_judge"] == []
    assert data["parameters"] == {"differing": [], "only_reference": [], "only_candidate": []}
    assert data["run"]["tp"]["stale_parameters"] == [] and data["run"]["tp"]["replicas_differ"] == []
    assert data["observation"]["bitwise_equal"] and data["observation"]["candidate"]["bitwise_equal"]
    sites = data["sites"]
    assert {s["step"] for s in sites} == {0, 1, 2}
    for s in sites:
        if s["kind"] != "other":  # the embedding has no oracle semantics
            assert s["verdicts"] is not None, s
        v = s["verdicts"] or {}
        assert not v.get("error") and not v.get("nonfinite"), s
        if v.get("boundary"):
            assert s["site"].endswith(rowwise), s["site"]
            assert s["boundary"].startswith(PARTIAL_SUMS), s["boundary"]
    row_sites = {s["site"] for s in sites if s["site"].endswith(rowwise)}
    named = {s["site"] for s in sites if (s["verdicts"] or {}).get("boundary")}
    assert named == row_sites  # every row-parallel site shows the boundary at some step
    assert data["onset"]["site"] == data["first_difference"]["site"]
    assert data["onset"]["site"].endswith(rowwise)


def _check_stale(data: dict[str, Any]) -> None:
    sites = data["sites"]
    erring = {s["site"] for s in sites if (s["verdicts"] or {}).get("error")}
    assert erring == {"layers.1.mlp.down_proj"}
    weight = "model.layers.1.mlp.down_proj.weight"
    assert data["parameters"]["differing"] == [weight]
    (stale,) = data["run"]["tp"]["stale_parameters"]
    assert stale["parameter"] == weight and stale["rank"] == 1 and stale["slice"] == [1, 192, 384]
    first = next(s for s in sites if s["site"] == "layers.1.mlp.down_proj" and s["verdicts"]["error"])
    assert f"parameter {weight}: rank 1's shard" in first["note"]
    assert first["max_error_ulp"] > 16
    assert any(f["kind"] == "error" for f in data["parity"]["failures"])


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp")
    done = _torchrun([str(HERE / "tp_worker.py"), str(out), "qwen=tiny-qwen3.5",
                      "qwen_stale=tiny-qwen3.5:stale-shard", "llama_stale=tiny-llama:stale-shard"], HERE)
    assert done.returncode == 0, done.stderr[-6000:]
    return out


def test_tp_cli_tiny_llama_end_to_end(tmp_path: Path) -> None:
    report = tmp_path / "onset.json"
    done = _torchrun(["-m", "ulptrace", "onset", "--tp", "2", "--model", "tiny-llama", "--prompt-len", "8",
                      "--new-tokens", "3", "--check-observation", "--json", str(report)], tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.count("first difference:") == 1  # rank 0 reports, once
    assert "onset: step 0, layers.0.self_attn.o_proj (linear)" in done.stdout
    assert PARTIAL_SUMS in done.stdout
    data = json.loads(report.read_text())
    _check_clean(data)
    assert data["first_difference"] == {"step": 0, "site": "layers.0.self_attn.o_proj", "kind": "linear", "layer": 0}
    placements = data["run"]["tp"]["placements"]
    assert placements["layers.0.self_attn.o_proj:x"] == "Shard(-1) (plan)"  # a row-parallel input, from the plan
    assert placements["layers.0.mlp.gate_proj:out"] == "Shard(-1) (plan)"  # a column-parallel output
    assert placements["layers.0.self_attn.core:query"] == "Shard(1) (shapes)"  # local heads
    assert data["candidate"]["tp"] == {"size": 2, "backend": "gloo"}
    assert data["candidate"]["model"] == data["reference"]["model"] == "tiny-llama"


def test_tp_failure_on_one_rank_is_named_with_its_rank(tmp_path: Path) -> None:
    (tmp_path / "rank_paths.py").write_text(
        "import torch.distributed as dist\n\n\n"
        "def fail_on_rank1(model):\n"
        "    if dist.get_rank() == 1:\n"
        "        raise ValueError('this rank has no kernels')\n"
        "    return lambda: None\n")
    done = _torchrun(["-m", "ulptrace", "onset", "--tp", "2", "--model", "tiny-llama", "--prompt-len", "4",
                      "--new-tokens", "1", "--candidate", "rank_paths:fail_on_rank1"], tmp_path)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("ulptrace: error: rank 1 of 2: ")]
    assert lines and "this rank has no kernels" in lines[0], done.stderr[-3000:]
    assert "first difference:" not in done.stdout


def test_gloo_allreduce_of_bf16_is_one_rounding_of_the_exact_sum(worker_runs: Path) -> None:
    """The all-reduce of two ranks' BF16 partials, as the ``sharded`` hypothesis models it."""
    evidence = json.loads((worker_runs / "allreduce.json").read_text())
    assert evidence["dtype"] == "torch.bfloat16" and evidence["ranks"] == 2
    assert evidence["one_rounding_of_exact_sum"] == 1.0


def test_tp_api_tiny_qwen35(worker_runs: Path) -> None:
    data = json.loads((worker_runs / "qwen.json").read_text())
    _check_clean(data)
    # the GatedDeltaNet projections gather their outputs (colwise_gather_output): only attention and MLP reduce
    assert data["first_difference"]["site"] == "layers.0.mlp.down_proj"
    assert not any(s["site"].endswith("linear_attn.out_proj") and (s["verdicts"] or {}).get("boundary")
                   for s in data["sites"])


@pytest.mark.parametrize("name", ["llama_stale", "qwen_stale"])
def test_tp_stale_shard_is_error_with_the_parameter_named(worker_runs: Path, name: str) -> None:
    _check_stale(json.loads((worker_runs / f"{name}.json").read_text()))


# -- bad setups: exit 2, one line, before any process group or model ------------------------------------------

def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from ulptrace.cli import main

    capsys.readouterr()  # drop what the test printed before (e.g. save_pretrained's progress bar)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_tp_without_torchrun_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, err = _main(["onset", "--tp", "2", "--model", "tiny-llama"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "torchrun --nproc_per_node 2 -m ulptrace onset --tp 2" in err


def test_tp_wrong_world_size(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, err = _main(["onset", "--tp", "2", "--model", "tiny-llama"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "needs 2 processes, but torchrun started 3" in err


def test_tp_missing_accelerate(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    code, err = _main(["onset", "--tp", "2", "--model", "tiny-llama"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "needs the `accelerate` package" in err


def test_tp_model_without_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    code, err = _main(["onset", "--tp", "2", "--model", str(tmp_path)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "has no tensor-parallel plan" in err


def test_tp_needs_two_or_more(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _main(["onset", "--tp", "1"], capsys)
    assert code == 2 and "--tp must be >= 2" in err
