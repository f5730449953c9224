"""ulptrace lockstep: two runs from the same restored state, step by step; free-running for contrast."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest
from ulptrace.cli import main
from ulptrace.probes.lockstep import run_lockstep
from ulptrace.run import RunConfig

HERE = Path(__file__).parent
STEP_KEYS = {"step", "logits_bitwise_equal", "states_bitwise_equal", "max_ulp", "onset"}


def test_restored_hf_against_hf_is_bitwise_at_every_step(tmp_path, capsys) -> None:
    out, plot = tmp_path / "l.json", tmp_path / "l.png"
    assert main(["lockstep", "--reference-mode", "static", "--candidate-mode", "static", "--prompt-len", "8",
                 "--new-tokens", "4", "--json", str(out), "--plot", str(plot)]) == 0
    report = json.loads(out.read_text())
    assert report["restored"] and len(report["steps"]) == 3 and report["bitwise_steps"] == 3
    for entry in report["steps"]:
        assert STEP_KEYS <= entry.keys()
        assert entry["logits_bitwise_equal"] and entry["states_bitwise_equal"] and entry["onset"] is None
        states = {k for k in entry["max_ulp"] if k != "logits"}
        # every KV cache, conv and recurrent state tensor of the hybrid model is compared
        assert {"layers.0.conv_states.0", "layers.0.recurrent_states.0", "layers.1.keys", "layers.1.values"} <= states
        assert set(entry["max_ulp"].values()) == {0}
    assert "decode steps bitwise identical (logits and every state tensor): 3 of 3" in capsys.readouterr().out
    assert plot.stat().st_size > 0


def test_restoring_keeps_a_one_step_defect_to_its_step(monkeypatch) -> None:
    """A GLU defect at decode step 2 only: restored, steps 1 and 3 are bitwise again and step 2's onset is the
    defect's site; free-running, step 3 inherits the difference through the state step 2 wrote."""
    monkeypatch.syspath_prepend(str(HERE))
    cfg = RunConfig(model="tiny-llama", candidate="generation_candidates:glu_error_at_step_2", prompts=1,
                    prompt_len=16, new_tokens=4)
    restored = run_lockstep(cfg)
    steps = {e["step"]: e for e in restored["steps"]}
    assert steps[1]["logits_bitwise_equal"] and steps[3]["logits_bitwise_equal"] and steps[3]["states_bitwise_equal"]
    assert not steps[2]["logits_bitwise_equal"] and not steps[2]["states_bitwise_equal"]
    assert (steps[2]["onset"]["site"], steps[2]["onset"]["step"], steps[2]["onset"]["verdict"]) == \
        ("layers.1.mlp.glu", 2, "error")
    assert steps[2]["max_ulp"]["layers.1.keys"] == 0 and steps[2]["max_ulp"]["layers.2.keys"] > 0  # after layer 1
    free = run_lockstep(cfg, free_running=True)
    assert not free["restored"]
    last = free["steps"][-1]
    assert not last["logits_bitwise_equal"] and not last["states_bitwise_equal"]
    assert last["onset"] is None or last["onset"]["reason"] == "unobserved"  # inherited through the cache


def test_stored_state_corruption_shows_in_the_states_not_in_the_logits(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    cfg = RunConfig(model="tiny-llama", candidate="generation_candidates:key_drift", prompts=1, prompt_len=8,
                    new_tokens=3)
    report = run_lockstep(cfg)
    for entry in report["steps"]:
        assert entry["logits_bitwise_equal"] and not entry["states_bitwise_equal"]
        assert entry["max_ulp"]["layers.0.keys"] > 0 and entry["max_ulp"]["layers.0.values"] == 0


def test_one_kernel_path_in_two_modes_shares_one_model() -> None:
    """The main case's shape (one path, two modes): kernels:fused patches the attention function, which two
    injected copies cannot share, so both sides run on one model; static against eager of the same path."""
    cfg = RunConfig(model="tiny-llama", reference="kernels:fused", candidate="kernels:fused",
                    candidate_mode="static", prompts=2, prompt_len=8, new_tokens=3)
    report = run_lockstep(cfg)
    assert report["shared_model"] and len(report["steps"]) == 2
    assert report["prefill"]["records"] == report["steps"][0]["records"] > 0  # both sides recorded every step


def test_graph_mode_on_cpu_exits_2(capsys) -> None:
    assert main(["lockstep", "--candidate-mode", "graph"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--candidate-mode graph" in err[0]
    assert main(["lockstep", "--all"]) == 2  # accepted and ignored, it would read as honoured
    assert "lockstep does not take --all: every step is listed" in capsys.readouterr().err


def test_lockstep_and_batch_invariance_record_with_the_old_objects_frozen(monkeypatch) -> None:
    """Their recorders (several per run) are built while the recording collector is held, and nothing stays frozen."""
    import gc

    from ulptrace.probes import batch_invariance, lockstep

    seen = []
    for module in (lockstep, batch_invariance):
        real = module.selected_sites
        monkeypatch.setattr(module, "selected_sites",
                            lambda *a, real=real, **k: seen.append(gc.get_freeze_count()) or real(*a, **k))
    assert gc.get_freeze_count() == 0
    lockstep.run_lockstep(RunConfig(model="tiny-llama", prompts=1, prompt_len=8, new_tokens=2))
    batch_invariance.run_batch_invariance(batch_invariance.BatchInvarianceConfig(
        RunConfig(model="tiny-llama", prompts=2, prompt_len=8, new_tokens=2), batches=[2]))
    assert len(seen) >= 3 and all(n > 1000 for n in seen), seen
    assert gc.get_freeze_count() == 0


def test_a_kernel_installed_by_name_runs_on_its_own_side_only(monkeypatch) -> None:
    """Both paths are applied in one process: a kernel installed by assigning a name the modeling module's code looks
    up (``apply_rotary_pos_emb``) must run on its own side only (``ulptrace.sides``) — before, the reference ran it
    too and a rotation the wrong way read "bitwise identical" at every step. As the candidate: an error at
    ``self_attn.q_rope`` from decode step 1; as the reference, against HF: the same steps differ; afterwards the
    modeling module's name is HF's own again."""
    import sys

    monkeypatch.syspath_prepend(str(HERE))
    from ulptrace import build_model

    namespace = sys.modules[type(build_model("tiny-llama").model.layers[0].self_attn).__module__]
    hf_rope = namespace.apply_rotary_pos_emb
    defect = "generation_candidates:rope_reversed_at_decode_by_name"
    report = run_lockstep(RunConfig(model="tiny-llama", candidate=defect, prompts=1, prompt_len=8, new_tokens=3))
    assert report["prefill"]["logits_bitwise_equal"]  # the prefill's many-token rotation is HF's
    for step in report["steps"]:
        assert not step["logits_bitwise_equal"], step
        assert (step["onset"]["site"], step["onset"]["step"], step["onset"]["verdict"]) == \
            ("layers.0.self_attn.q_rope", step["step"], "error")
    reverse = run_lockstep(RunConfig(model="tiny-llama", reference=defect, candidate="hf", prompts=1, prompt_len=8,
                                     new_tokens=3))
    assert [s["logits_bitwise_equal"] for s in reverse["steps"]] == [False, False]
    assert namespace.apply_rotary_pos_emb is hf_rope


def test_an_attention_installed_in_the_registry_runs_on_its_own_side_only(monkeypatch) -> None:
    """The attention registry's entry the model looks up (``ALL_ATTENTION_FUNCTIONS[impl]``) replaced by the
    candidate's path reaches every model of that implementation: the reference's side runs HF's (``ulptrace.sides``),
    so a decode-only scaling defect is an error at ``self_attn.core`` from step 1, and HF's entry is back after."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.syspath_prepend(str(HERE))
    hf = ALL_ATTENTION_FUNCTIONS["sdpa"]
    report = run_lockstep(RunConfig(model="tiny-llama", candidate="generation_candidates:attention_registry_overridden",
                                    prompts=1, prompt_len=8, new_tokens=3))
    assert report["prefill"]["logits_bitwise_equal"]
    for step in report["steps"]:
        assert (step["onset"]["site"], step["onset"]["verdict"]) == ("layers.0.self_attn.core", "error"), step
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is hf


@pytest.mark.parametrize("candidate, site", [
    ("attention_registered_class_wide", "layers.0.self_attn.core"),
    ("rsqrt_scaled_at_decode", "layers.0.input_layernorm"),
    ("cache_update_scaled_at_decode", "layers.0.self_attn.core"),
])
def test_a_kernel_installed_process_wide_in_other_ways_runs_on_its_own_side_only(monkeypatch, candidate, site) -> None:
    """Other ways a kernel reaches every model (a third audit's): registered class-wide in the attention registry
    (a registry entry a tap left behind shadowed it: never run), ``torch.rsqrt`` (the oracle's arithmetic calls it:
    judged with the candidate's, a tie), a cache layer's class. Each differs from decode step 1 at its site, and the
    onset finds the registered one too."""
    from ulptrace.probes.onset import run_onset

    monkeypatch.syspath_prepend(str(HERE))
    path = f"generation_candidates:{candidate}"
    report = run_lockstep(RunConfig(model="tiny-llama", candidate=path, prompts=1, prompt_len=8, new_tokens=3))
    assert report["prefill"]["logits_bitwise_equal"]
    for step in report["steps"]:
        assert not step["logits_bitwise_equal"] and step["onset"]["site"] == site, step
        assert step["onset"]["reason"] == "unobserved" if "cache" in candidate else step["onset"]["verdict"] == "error"
    if "registered" in candidate:
        comparison, _ = run_onset(RunConfig(model="tiny-llama", candidate=path, prompts=1, prompt_len=8, new_tokens=3))
        assert comparison.onset() is not None and comparison.onset().site == site
