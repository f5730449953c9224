"""The ``compile`` and ``compile:emulate`` paths (torch.compile with Inductor, the whole model in place) and
recording a compiled model.

Inductor compiles each graph in 30-50 s on two CPU cores, so CI runs two onset-free checks of the recorder
under dynamo (the ``eager`` backend: tracing without Inductor, seconds) and one Inductor run (prefill + one
decode step, 4 graphs: traced and untraced); the rest is ``slow``.
"""

from __future__ import annotations

import pytest
import torch
from ulptrace.models import build_model
from ulptrace.paths import apply_path
from ulptrace.record import Recorder
from ulptrace.run import RunConfig, greedy, make_prompts, observation_note, selected_sites
from ulptrace.sites import site_table
from ulptrace.thirdparty import compile_observable_sites

OBSERVABLE_QWEN35_LAYER = {
    0: {"linear_attn.out_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.glu", "mlp.down_proj"},  # GatedDeltaNet
    1: {"self_attn.core", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.glu", "mlp.down_proj"},
}


def test_compile_observable_sites_are_matmul_and_attention_operands() -> None:
    """Under compile only sites whose output and oracle inputs Inductor materialises anyway are recorded:
    matmul operands/results and the attention kernel's; norms, residual adds, gates, the GDN scan are fused."""
    model = build_model("tiny-qwen3.5")
    names = {s.name for s in compile_observable_sites(model, site_table(model))}
    for layer, expected in OBSERVABLE_QWEN35_LAYER.items():
        assert {n.split(".", 2)[2] for n in names if n.startswith(f"layers.{layer}.")} == expected
    assert {"logits", "output"} <= names and not {"embed", "norm", "layers.0.input_layernorm", "layers.0.residual_attn",
                                      "layers.0.linear_attn.gates.g", "layers.1.self_attn.q_rope"} & names
    llama = build_model("tiny-llama")
    assert {s.name for s in compile_observable_sites(llama, site_table(llama)) if s.layer == 0} == {
        "layers.0.self_attn.core", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj",
        "layers.0.mlp.glu", "layers.0.mlp.down_proj"}


def test_a_compiled_candidate_limits_both_sides_selection() -> None:
    model = build_model("tiny-qwen3.5")
    cfg = RunConfig(candidate="compile")
    assert [s.name for s in selected_sites(model, cfg)] == [s.name for s in compile_observable_sites(model, site_table(model))]
    assert "compile:" in observation_note(cfg) and observation_note(RunConfig()) is None
    with pytest.raises(ValueError, match="no site that can be observed"):
        selected_sites(model, RunConfig(candidate="compile", sites=["layers.*.input_layernorm"]))


def test_compile_path_is_undone_with_its_global_settings() -> None:
    import torch._dynamo
    import torch._inductor.config as inductor_config

    def settings() -> tuple:
        return (inductor_config.emulate_precision_casts, torch._dynamo.config.recompile_limit,
                torch._dynamo.config.fail_on_recompile_limit_hit, torch._dynamo.config.skip_nnmodule_hook_guards)

    before = settings()
    model = build_model("tiny-llama")
    with apply_path(model, "compile:emulate") as applied:
        assert inductor_config.emulate_precision_casts is True
        assert torch._dynamo.config.skip_nnmodule_hook_guards is False  # hooks added later recompile
        assert model._compiled_call_impl is not None
        info = applied.info
        assert info["emulate_precision_casts"] is True and info["graphs_compiled"] == 0  # nothing ran yet
    assert settings() == before and model._compiled_call_impl is None


class _OutsideGraphSink:
    """A sink that fails if it is called while dynamo traces (records must be made outside the graph)."""

    def __init__(self) -> None:
        self.records = []

    def add(self, record) -> None:
        assert not torch.compiler.is_compiling(), "a sink was called inside the compiled graph"
        self.records.append(record)


def test_recording_a_compiled_model_makes_records_outside_the_graph() -> None:
    """dynamo's ``eager`` backend (tracing, no Inductor): records equal the uncompiled model's bitwise, numbered
    by step, the step filter applied, the sink never called inside the graph; the wrapper is removed on exit."""
    eager, compiled = build_model("tiny-qwen3.5"), build_model("tiny-qwen3.5")
    prompts = make_prompts(eager.config.vocab_size, 1, 6, seed=1)
    sites = [s for s in site_table(eager) if s.name.endswith(("mlp.glu", "self_attn.core")) or s.name == "logits"]
    with Recorder(eager, sites=sites, steps=range(1, 3)) as expected:
        tokens = greedy(eager, prompts, 3)
    compiled.compile(backend="eager", dynamic=False)
    sink = _OutsideGraphSink()
    try:
        with Recorder(compiled, sites=sites, steps=range(1, 3), sink=sink):
            greedy(compiled, prompts, 3, forced=tokens)
        assert compiled._compiled_call_impl.__name__ != "call"  # the recorder's wrapper is gone
    finally:
        compiled._compiled_call_impl = None
    got = {(r.site, r.step): r for r in sink.records}
    assert set(got) == set(expected.trace.keys()) and {step for _, step in got} == {1, 2}
    for record in expected.trace:
        other = got[record.key]
        assert torch.equal(other.out, record.out) and other.inputs.keys() == record.inputs.keys()
        assert all(torch.equal(other.inputs[k], v) for k, v in record.inputs.items())


def test_recording_fused_sites_of_a_compiled_model_warns() -> None:
    model = build_model("tiny-llama")
    model.compile(backend="eager")
    try:
        with pytest.warns(UserWarning, match="Inductor fuses"), Recorder(model):
            pass
    finally:
        model._compiled_call_impl = None


def _compiled_onset(path: str, model: str = "tiny-qwen3.5"):
    from ulptrace.probes.onset import run_onset

    cfg = RunConfig(model=model, candidate=path, prompts=1, prompt_len=8, new_tokens=2, check_observation=True)
    comparison, info = run_onset(cfg)
    return comparison.to_json(), info


def _check_compiled_report(data: dict) -> None:
    obs = data["observation"]
    assert obs["candidate"]["bitwise_equal"] and obs["bitwise_equal"], obs  # observing changed nothing compiled
    assert data["complete"] is False and "compile" in data["candidate"]["selection"]["observed"]
    assert data["missing"] == data["extra"] == [] and data["could_not_judge"] == []
    assert all(s["verdicts"] is not None for s in data["sites"])  # every recorded site judged
    info = data["candidate"]["path_info"]
    assert info["graphs_compiled"] >= 4 and info["graph_breaks"] == 0  # 2 steps, traced and untraced


def test_compile_onset_is_judged_and_observation_is_bitwise() -> None:
    """Inductor (C++ backend) against HF on tiny-qwen3.5: every recorded site judged, the compiled logits
    traced and untraced bitwise equal, and Inductor's fused SwiGLU epilogue a named boundary (it keeps
    silu(gate) in FP32 where HF rounds it to BF16)."""
    data, _ = _compiled_onset("compile")
    _check_compiled_report(data)
    glu = [s for s in data["sites"] if s["site"].endswith("mlp.glu") and s["verdicts"]["boundary"]]
    assert glu and all(s["verdicts"]["error"] == 0 for s in glu) and all(s["boundary"] for s in glu)
    assert data["onset"]["reason"] == "verdict" and data["onset"]["kind"] == "glu"


@pytest.mark.slow
def test_compile_emulate_removes_the_glu_boundary() -> None:
    """With emulate_precision_casts Inductor keeps HF's BF16 roundings: no boundary at any GLU."""
    data, _ = _compiled_onset("compile:emulate")
    _check_compiled_report(data)
    assert data["candidate"]["path_info"]["emulate_precision_casts"] is True
    assert not [s for s in data["sites"] if s["kind"] == "glu" and s["verdicts"]["boundary"]]


@pytest.mark.slow
def test_compile_onset_on_llama() -> None:
    data, _ = _compiled_onset("compile", model="tiny-llama")
    _check_compiled_report(data)


@pytest.mark.slow
def test_observing_every_site_changes_what_inductor_computes() -> None:
    """Why fewer sites: recording every site of the compiled model (each a graph output) changes its logits."""
    model = build_model("tiny-qwen3.5")
    prompts = make_prompts(model.config.vocab_size, 1, 8, seed=0)
    with apply_path(model, "compile"):
        untraced: dict[int, torch.Tensor] = {}
        tokens = greedy(model, prompts, 2, on_logits=lambda s, l: untraced.__setitem__(s, l.clone()))
        traced: dict[int, torch.Tensor] = {}
        with pytest.warns(UserWarning, match="Inductor fuses"), Recorder(model):
            greedy(model, prompts, 2, forced=tokens, on_logits=lambda s, l: traced.__setitem__(s, l.clone()))
    assert any(not torch.equal(untraced[s], traced[s]) for s in untraced)
