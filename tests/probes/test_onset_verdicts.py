"""ulptrace onset with the oracle: a GLU rounded once is a named boundary at the GLU site."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ulptrace.cli import main

HERE = Path(__file__).parent


def test_glu_rounded_once_is_a_boundary_at_the_glu_site(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    out = tmp_path / "onset.json"
    assert main(["onset", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "2", "--candidate",
                 "candidates:glu_rounded_once", "--kinds", "glu", "norm", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    onset = data["onset"]
    assert onset["site"] == "layers.0.mlp.glu" and onset["step"] == 0
    glu = next(s for s in data["sites"] if s["site"] == "layers.0.mlp.glu" and s["step"] == 0)
    assert glu["verdicts"]["boundary"] > 0 and glu["verdicts"]["error"] == 0
    assert glu["boundary"] == "the BF16 rounding of `silu(gate)` (op 0) is missing"
    assert "layers.0.mlp.glu" in capsys.readouterr().out


def _onset(tmp_path, monkeypatch, candidate: str, *extra: str) -> dict:
    monkeypatch.syspath_prepend(str(HERE))
    out = tmp_path / "onset.json"
    assert main(["onset", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "2", "--candidate", candidate,
                 "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_stale_weight_is_an_error_and_the_parameter_is_named(tmp_path, monkeypatch) -> None:
    data = _onset(tmp_path, monkeypatch, "candidates:stale_weight")
    assert data["parameters"]["differing"] == ["model.layers.1.post_attention_layernorm.weight"]
    assert data["onset"] == {"step": 0, "site": "layers.1.post_attention_layernorm", "kind": "norm", "layer": 1, "reason": "verdict"}
    site = next(s for s in data["sites"] if s["site"] == "layers.1.post_attention_layernorm" and s["step"] == 0)
    assert site["verdicts"]["error"] > 0 and site["max_error_ulp"] > 0


def test_unrounded_fp32_output_is_judged_not_hidden_by_a_cast(tmp_path, monkeypatch) -> None:
    data = _onset(tmp_path, monkeypatch, "candidates:fp32_norm_output", "--layers", "0:1")
    out = next(s for s in data["sites"] if s["site"] == "layers.0.post_attention_layernorm" and s["step"] == 0)
    assert "candidate stores float32" in out["note"]
    assert out["verdicts"]["boundary"] > 0 and out["verdicts"]["error"] == 0
    # op 10 is the norm's final cast to BF16, which the candidate skips
    assert out["boundary"] == ("the final BF16 rounding of `bf16(%9)` (op 10) is missing: "
                               "the result is kept in FP32")
    assert data["onset"]["site"] == "layers.0.post_attention_layernorm"


@pytest.mark.parametrize("candidate, site", [
    ("candidates:global_attention_scale", "layers.1.self_attn.core"),
    ("candidates:global_norm_class_patch", "layers.0.input_layernorm"),
    # names the reference's bound forward looks up as it runs (a method through its class, a module global): found
    # by an audit, judged as ties before (the captures ran the candidate's arithmetic)
    ("candidates:global_inner_norm_patch", "layers.0.input_layernorm"),
    ("candidates:global_rotate_half_patch", "layers.1.self_attn.q_rope"),
])
def test_global_patches_do_not_leak_into_the_reference_semantics(tmp_path, monkeypatch, candidate, site) -> None:
    """Paths that patch process-wide state must still be judged against HF's semantics, not their own."""
    data = _onset(tmp_path, monkeypatch, candidate)
    assert (data["onset"]["site"], data["onset"]["step"]) == (site, 0)
    first = next(s for s in data["sites"] if s["site"] == site and s["step"] == 0)
    assert first["verdicts"]["error"] > 0


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
@pytest.mark.parametrize("attn", ["hf", "hf:attn=eager"])
def test_hf_is_inside_its_own_semantics_everywhere(tmp_path, model, attn) -> None:
    """Every site with oracle semantics: HF's own output lies in the admissible set (prefill and decode)."""
    out = tmp_path / "onset.json"
    assert main(["onset", "--model", model, "--reference", attn, "--candidate", attn, "--prompts", "2",
                 "--prompt-len", "8", "--new-tokens", "2", "--check-reference", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    judged = [s for s in data["sites"] if s["reference_outside"] is not None]
    kinds = {s["kind"] for s in judged}
    common = {"norm", "glu", "rope", "attention", "residual", "linear", "logits"}
    assert kinds >= (common | {"gated_norm", "gates"} if model == "tiny-qwen3.5" else common)
    assert [s for s in judged if s["reference_outside"]] == []
    assert data["onset"] is None and data["first_difference"] is None


# HF's eager attention (head_dim 32: scaling 32**-0.5) against a fused kernel's FP32 scores
def _ops_unnumbered(name: str) -> str:
    return re.sub(r"%\d+", "%N", re.sub(r"\(op \d+\)", "(op N)", name))


SDPA_AGAINST_EAGER = (
    "fused attention around `_softmax` (op 18): scores kept in FP32 (skips "
    "`bmm(query, transpose(key, dim0=2, dim1=3))` (op 13), "
    "`mul(bmm(query, transpose(key, dim0=2, dim1=3)), 0.1767766952966369)` (op 15), "
    "`add(%15, attention_mask)` (op 16)), probabilities rounded to BF16 unnormalised, as flash kernels do"
)


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
def test_sdpa_judged_against_eager_is_a_named_boundary_not_an_error(tmp_path, model) -> None:
    """SDPA keeps the scores in FP32 where HF's eager path rounds them: a precision boundary, not a bug."""
    out = tmp_path / "onset.json"
    assert main(["onset", "--model", model, "--reference", "hf:attn=eager", "--candidate", "hf:attn=sdpa",
                 "--prompts", "2", "--prompt-len", "8", "--new-tokens", "2", "--kinds", "attention",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    cores = [s for s in data["sites"] if s["site"].endswith("self_attn.core") and not s["bitwise_equal"]]
    assert cores
    assert all(s["verdicts"]["error"] == 0 and s["verdicts"]["nonfinite"] == 0 for s in cores)
    assert all(s["verdicts"]["boundary"] > 0 for s in cores)
    # op numbers depend on the model's eager code (a grouped-query repeat_kv adds ops): compare the wording
    assert {_ops_unnumbered(s["boundary"]) for s in cores} == {_ops_unnumbered(SDPA_AGAINST_EAGER)}


@pytest.mark.parametrize("model, site", [("tiny-llama", "layers.0.self_attn.core"),
                                         ("tiny-qwen3.5", "layers.1.self_attn.core")])
def test_divergence_in_unobserved_code_is_the_onset_where_it_first_shows(tmp_path, monkeypatch, model, site) -> None:
    """RoPE is not a site: a RoPE bug shows as attention inputs that differ while every earlier record is equal."""
    data = _onset(tmp_path, monkeypatch, "candidates:rope_key_offset", "--model", model)
    assert data["onset"] == {"step": 0, "site": site, "kind": "attention", "layer": int(site.split(".")[1]),
                             "reason": "unobserved"}
    assert data["first_difference"]["site"] == site


def test_inputs_of_another_shape_locate_the_onset_where_they_first_show(tmp_path, monkeypatch) -> None:
    """Rotary tables of the whole head dim where Qwen3.5 rotates a quarter of it (found by an audit): the rope
    site's cos/sin inputs are float tensors of another shape — no ULP count, but they differ — so the first record
    they reach is the onset, ``unobserved``, with both shapes named (before, the onset was none: the oracle could
    not judge the site, and that was all)."""
    from ulptrace.models import build_model

    config = build_model("tiny-qwen3.5").config
    data = _onset(tmp_path, monkeypatch, "candidates:rope_full_width_tables", "--model", "tiny-qwen3.5")
    site = data["first_difference"]["site"]
    assert site.endswith(".self_attn.q_rope")
    assert data["onset"] == {"step": 0, "site": site, "kind": "rope", "layer": int(site.split(".")[1]),
                             "reason": "unobserved"}
    first = next(s for s in data["sites"] if s["site"] == site and s["step"] == 0)
    rotary = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    assert sorted(first["input_shapes"]) == ["cos", "sin"]
    for reference, candidate in first["input_shapes"].values():
        assert (reference[-1], candidate[-1]) == (rotary, config.head_dim) and reference[:-1] == candidate[:-1]
    assert data["parity"]["ok"] is False


@pytest.mark.parametrize("candidate", ["candidates:rope_key_nan", "candidates:rope_key_inf"])
@pytest.mark.parametrize("model, site", [("tiny-llama", "layers.0.self_attn.core"),
                                         ("tiny-qwen3.5", "layers.1.self_attn.core")])
def test_a_nonfinite_value_born_in_unobserved_code_is_the_onset_where_it_first_shows(tmp_path, monkeypatch, model,
                                                                                      site, candidate) -> None:
    """A NaN (or an infinity) written into a key by code no site observes: the attention's key input differs only
    where no element is a finite ULP distance apart (a NaN on one side), which its input delta must not call equal,
    and the attention's semantics on that input are NaN, so its own NaN output is no verdict of its own (an infinity
    makes them NaN where the kernel's output is finite: nonfinite there, a consequence) — the onset is where the
    divergence first shows, ``unobserved``, and parity fails; before, a NaN key passed at parity."""
    data = _onset(tmp_path, monkeypatch, candidate, "--model", model)
    assert data["onset"] == {"step": 0, "site": site, "kind": "attention", "layer": int(site.split(".")[1]),
                             "reason": "unobserved"}
    core = next(s for s in data["sites"] if s["site"] == site and s["step"] == 0)
    assert core["input_delta"]["key"] >= 1 and core["input_delta"]["query"] == 0
    assert not data["parity"]["ok"] and "unobserved" in {f["kind"] for f in data["parity"]["failures"]}


@pytest.mark.parametrize("model, layer", [("tiny-llama", 0), ("tiny-qwen3.5", 1)])
def test_rope_site_judges_rotary_variants(tmp_path, monkeypatch, model, layer) -> None:
    site = f"layers.{layer}.self_attn.q_rope"
    bug = _onset(tmp_path, monkeypatch, "candidates:rope_query_offset", "--model", model)
    assert bug["onset"] == {"step": 0, "site": site, "kind": "rope", "layer": layer, "reason": "verdict"}
    assert next(s for s in bug["sites"] if s["site"] == site and s["step"] == 0)["verdicts"]["error"] > 0
    fused = _onset(tmp_path, monkeypatch, "candidates:rope_fp32", "--model", model, "--kinds", "rope")
    ropes = [s for s in fused["sites"] if s["site"].endswith("q_rope") and not s["bitwise_equal"]]
    assert ropes and all(s["verdicts"]["error"] == 0 for s in ropes)
    assert all(s["verdicts"]["boundary"] > 0 for s in ropes)
    assert {s["boundary"] for s in ropes} == {"all intermediates fused into one final rounding"}


def test_a_scan_bug_is_an_error_at_the_scan_on_equal_inputs(tmp_path, monkeypatch) -> None:
    """The GatedDeltaNet scan has oracle semantics (ulptrace.oracle.gdn): an output scaled by (1 + 2^-6) is
    an error there, on bitwise-equal recorded inputs, whatever --max-ulp says (a budget is for sites
    without semantics)."""
    for extra in ((), ("--max-ulp", "100000")):
        data = _onset(tmp_path, monkeypatch, "candidates:gdn_scan_bug", *extra)
        assert data["onset"] == {"step": 0, "site": "layers.0.linear_attn.core", "kind": "attention", "layer": 0,
                                 "reason": "verdict"}
        core = next(s for s in data["sites"] if s["site"] == "layers.0.linear_attn.core" and s["step"] == 0)
        # the site's verdict is error (the worst class present); a uniform 1.6% scaling is within what BF16
        # tensor-core operands can do to many single elements, so only part of the elements are errors
        assert core["verdicts"]["error"] > 0
        assert set(core["input_delta"]) == {"query", "key", "value", "g", "beta"}
        assert all(v == 0 for v in core["input_delta"].values())


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
def test_logits_changed_after_the_head_module_are_an_error_at_the_output(tmp_path, monkeypatch, model) -> None:
    """A temperature applied in a wrapped ``model.forward`` (found by an audit): the LM head's output is bitwise
    equal, so before, no record differed and the run read as at parity with every greedy token flipped. What the
    model returns is the site ``output``, judged against the head's output it should equal."""
    data = _onset(tmp_path, monkeypatch, "candidates:logits_scaled_outside_head", "--model", model)
    assert data["onset"] == {"step": 0, "site": "output", "kind": "logits", "layer": None, "reason": "verdict"}
    differing = [s for s in data["sites"] if not s["bitwise_equal"]]
    assert {s["site"] for s in differing} == {"output"} and len(differing) == 2  # the prefill and one decode step
    assert all(s["verdicts"]["error"] > 0 for s in differing)
    assert data["parity"]["ok"] is False and data["parity"]["failures"][0]["kind"] == "error"


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
def test_logits_returned_in_float32_are_exact_and_at_parity(tmp_path, monkeypatch, model) -> None:
    """The valid twin: the same wrapper returning the logits upcast to float32 changes no value."""
    data = _onset(tmp_path, monkeypatch, "candidates:logits_upcast_outside_head", "--model", model)
    assert data["onset"] is None and data["parity"]["ok"] is True
    output = [s for s in data["sites"] if s["site"] == "output"]
    assert len(output) == 2 and all("candidate stores float32" in s["note"] for s in output)


def _first_core(data: dict) -> dict:
    return next(s for s in data["sites"] if s["site"].endswith("self_attn.core") and s["step"] == 0)


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
def test_masks_encoded_otherwise_are_compared_by_what_they_let_through(tmp_path, monkeypatch, model) -> None:
    """Found by an audit: a bool mask (SDPA) against an additive one (eager reference) was no evidence and could
    not be judged (another dtype), so a mask that lets each query see the next token read as at parity with
    ``--allow-could-not-judge``. Now the masks are compared by meaning: the defect is the onset where it first
    shows (the mask was built outside every site) and its valid twin, the correct mask made explicit, has equal
    masks and is judged with them (SDPA against eager: a named boundary, nothing else)."""
    eager = ["--model", model, "--reference", "hf:attn=eager"]
    wrong = _onset(tmp_path, monkeypatch, "candidates:mask_sees_next_token", *eager)
    core = _first_core(wrong)
    assert core["input_delta"]["attention_mask"] > 0 and core["could_not_judge"] is None
    # the mask is the reason, also where every earlier record is equal (``unobserved`` would apply too)
    assert wrong["onset"] == {"step": 0, "site": core["site"], "kind": "attention", "layer": core["layer"],
                              "reason": "mask"}
    assert "mask" in {f["kind"] for f in wrong["parity"]["failures"]}

    right = _onset(tmp_path, monkeypatch, "candidates:mask_always_explicit", *eager)
    core = _first_core(right)
    assert core["input_delta"]["attention_mask"] == 0 and core["could_not_judge"] is None
    assert core["verdicts"]["error"] == 0 and core["verdicts"]["boundary"] > 0
    assert right["onset"]["reason"] == "verdict" and right["onset"]["site"] == core["site"]
    assert {f["kind"] for f in right["parity"]["failures"]} == {"boundary"} and not right["could_not_judge"]


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
def test_a_value_handed_on_unrounded_is_judged_where_it_arrives(tmp_path, monkeypatch, model) -> None:
    """Found by an audit: down_proj's FP32 result added to the residual unrounded. The boundary is named at
    down_proj; the residual add that receives the FP32 value was "could not judge" (its program was captured on
    BF16) in every layer. Now it is judged on the values it received: no verdict worse than tie there."""
    data = _onset(tmp_path, monkeypatch, "candidates:down_proj_fp32_into_residual", "--model", model)
    assert data["onset"] == {"step": 0, "site": "layers.0.mlp.down_proj", "kind": "linear", "layer": 0,
                             "reason": "verdict"}
    down = next(s for s in data["sites"] if s["site"] == "layers.0.mlp.down_proj" and s["step"] == 0)
    assert down["boundary"].startswith("the final BF16 rounding of") and "kept in FP32" in down["boundary"]
    outputs = [s for s in data["sites"] if re.fullmatch(r"layers\.\d+\.output", s["site"])]
    assert outputs and not data["could_not_judge"]
    assert all(s["could_not_judge"] is None and s["verdicts"]["error"] == s["verdicts"]["boundary"] == 0
               for s in outputs)
    first = next(s for s in outputs if s["site"] == "layers.0.output" and s["step"] == 0)
    assert first["input_delta"]["residual"] == 0 and first["input_delta"]["delta"] > 0 and not first["bitwise_equal"]
    assert {f["kind"] for f in data["parity"]["failures"]} == {"boundary"}


def _tiny_checkpoint(path: Path, architecture: str, score_scale: float = 1.0, **config) -> Path:
    """A tiny checkpoint of ``architecture`` (``transformers.<Name>Config`` / ``<Name>ForCausalLM``) saved to ``path``,
    as a user's would be; ``score_scale`` multiplies the query and key projections so that attention scores have a
    trained model's size (~1-3 at 16; a random tiny model's are ~0.01, where a softmax is flat and small changes of
    the scores move no BF16 value)."""
    import torch
    import transformers

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = getattr(transformers, f"{architecture}ForCausalLM")(
        getattr(transformers, f"{architecture}Config")(**shape, **config))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(score_scale)
            layer.self_attn.k_proj.weight.mul_(score_scale)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


_GEMMA2 = dict(head_dim=16, final_logit_softcapping=30.0, sliding_window=4)


@pytest.fixture(scope="module")
def gemma2_checkpoint(tmp_path_factory) -> Path:
    """A tiny Gemma 2 checkpoint (sandwich norms, soft-capped attention and logits)."""
    return _tiny_checkpoint(tmp_path_factory.mktemp("gemma2"), "Gemma2", attn_logit_softcapping=50.0, **_GEMMA2)


@pytest.fixture(scope="module")
def gemma2_tight_cap_checkpoint(tmp_path_factory) -> Path:
    """The same shape with trained-size attention scores and a soft cap that bends them (1.0): Gemma 2's cap of 50
    leaves a random tiny model's ~0.01 scores alone at BF16's resolution, and their flat softmax would hide any change
    of them inside a flash kernel's BF16 probabilities."""
    return _tiny_checkpoint(tmp_path_factory.mktemp("gemma2_cap"), "Gemma2", 16.0, attn_logit_softcapping=1.0,
                            **_GEMMA2)


def test_gemma2_has_its_own_table_and_hf_is_inside_it(tmp_path, gemma2_checkpoint) -> None:
    """Gemma 2 was listed with the Llama family, whose post-attention norm is ``norm(residual + delta)``: HF's own
    outputs fell outside their semantics at every norm and residual site (and the checkpoint did not load: it has no
    SDPA attention). Its sandwich layers have a table of their own; HF is inside it everywhere."""
    import warnings

    import transformers

    out = tmp_path / "onset.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["onset", "--model", str(gemma2_checkpoint), "--candidate", "hf", "--prompts", "2",
                     "--prompt-len", "8", "--new-tokens", "2", "--check-reference", "--json", str(out)]) == 0
    eager = any("no SDPA attention" in str(w.message) for w in caught)
    assert eager == (not transformers.Gemma2ForCausalLM._supports_sdpa)  # said exactly where it is so
    data = json.loads(out.read_text())
    names = {s["site"] for s in data["sites"]}
    assert {"layers.0.post_attention_layernorm", "layers.0.pre_feedforward_layernorm",
            "layers.0.post_feedforward_layernorm", "layers.1.residual_attn", "output"} <= names
    judged = [s for s in data["sites"] if s["reference_outside"] is not None]
    assert len(judged) == len(data["sites"]) - 2  # every site but the embedding, at both steps
    assert all(s["reference_outside"] == 0 for s in judged) and data["parity"]["ok"]


def test_attention_without_gemma2s_soft_cap_is_an_error_at_its_core(tmp_path, monkeypatch,
                                                                    gemma2_tight_cap_checkpoint) -> None:
    """Found by a CPU whose BF16 products put HF's own attention outside its semantics: the oracle's attention core
    was called without the soft cap HF passes (``softcap=``), so a kernel that drops it was judged against a formula
    without it too — inside, never an error. The core is judged with the call's own keyword arguments now."""
    data = _onset(tmp_path, monkeypatch, "candidates:attention_softcap_dropped", "--model",
                  str(gemma2_tight_cap_checkpoint))
    assert data["onset"] == {"step": 0, "site": "layers.1.self_attn.core", "kind": "attention", "layer": 1,
                             "reason": "verdict"}
    core = next(s for s in data["sites"] if s["site"] == "layers.1.self_attn.core" and s["step"] == 0)
    assert core["verdicts"]["error"] > 0
    assert "error" in [f["kind"] for f in data["parity"]["failures"]]


def test_gemma2s_soft_cap_fused_in_fp32_is_a_named_boundary(tmp_path, monkeypatch, gemma2_tight_cap_checkpoint) -> None:
    """The valid twin: the scores, their soft cap and the mask kept in FP32 (a fused kernel) is the named
    fused-attention boundary at every attention core — no error."""
    data = _onset(tmp_path, monkeypatch, "candidates:attention_softcap_fp32", "--model",
                  str(gemma2_tight_cap_checkpoint))
    cores = [s for s in data["sites"] if s["site"].endswith("self_attn.core")]
    assert len(cores) == 4 and all(s["verdicts"]["error"] == 0 for s in cores)
    assert all(s["verdicts"]["boundary"] > 0 and "scores kept in FP32" in s["boundary"] for s in cores)
    assert [f["kind"] for f in data["parity"]["failures"]] == ["boundary"]


@pytest.fixture(scope="module")
def llama_trained_scores_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with trained-size attention scores."""
    return _tiny_checkpoint(tmp_path_factory.mktemp("llama_scores"), "Llama", 16.0)


@pytest.mark.parametrize("candidate, error", [("candidates:attention_scale_2_percent", True),
                                              ("candidates:attention_scores_fp32", False)])
def test_attention_at_trained_size_scores(tmp_path, monkeypatch, llama_trained_scores_checkpoint, candidate,
                                          error) -> None:
    """At a trained model's score sizes the oracle tells a 2% scale of the scores (an error at the first attention core)
    from a fused kernel that keeps the scores in FP32 (ties, at parity); HF's own attention is inside."""
    data = _onset(tmp_path, monkeypatch, candidate, "--model", str(llama_trained_scores_checkpoint),
                  "--prompt-len", "16", "--new-tokens", "3", "--check-reference")
    cores = [s for s in data["sites"] if s["site"].endswith("self_attn.core")]
    assert all(s["reference_outside"] == 0 for s in cores)
    if error:
        assert data["onset"] == {"step": 0, "site": "layers.0.self_attn.core", "kind": "attention", "layer": 0,
                                 "reason": "verdict"}
        assert "error" in [f["kind"] for f in data["parity"]["failures"]]
    else:
        assert data["parity"]["ok"] and all(s["verdicts"]["error"] == s["verdicts"]["boundary"] == 0 for s in cores)
        assert sum(s["verdicts"]["tie"] for s in cores) > 0  # the scores' FP32 values did move some outputs


def test_a_fault_after_gemma2s_mlp_norm_is_located_there(tmp_path, monkeypatch, gemma2_checkpoint) -> None:
    data = _onset(tmp_path, monkeypatch, "fault:layers.1.post_feedforward_layernorm@1+3", "--model",
                  str(gemma2_checkpoint))
    assert data["onset"] == {"step": 1, "site": "layers.1.post_feedforward_layernorm", "kind": "norm", "layer": 1,
                             "reason": "verdict"}
    assert [f["kind"] for f in data["parity"]["failures"]] == ["error"]


def test_a_scan_defect_seen_only_in_its_state_makes_the_whole_call_an_error(tmp_path, monkeypatch) -> None:
    """Found by an audit: a decode decay of exp(1.05 g) put the scan's output inside a chunked kernel's BF16
    hypotheses (onset read "boundary") while its FP32 state had errors no hypothesis explains. One call, one design:
    the output's out-of-set elements are errors too, and the note names the state."""
    data = _onset(tmp_path, monkeypatch, "candidates:gdn_decode_decay_scaled", "--model", "tiny-qwen3.5")
    assert data["onset"] == {"step": 1, "site": "layers.0.linear_attn.core", "kind": "attention", "layer": 0,
                             "reason": "verdict"}
    core, state = (next(s for s in data["sites"] if s["site"] == f"layers.0.linear_attn.{name}" and s["step"] == 1)
                   for name in ("core", "recurrent_state"))
    assert core["verdicts"]["boundary"] == 0 and core["verdicts"]["error"] > 0 and core["boundary"] is None
    assert "layers.0.linear_attn.recurrent_state" in core["note"] and "one design" in core["note"]
    assert state["verdicts"]["error"] > 0 and state["verdicts"]["boundary"] == 0
    assert sum(core["verdict_histogram"]["error"].values()) == core["verdicts"]["error"]
    assert [f["kind"] for f in data["parity"]["failures"]] == ["error"]



def test_a_mask_that_differs_after_other_records_differ_is_a_mask_onset(tmp_path, monkeypatch) -> None:
    """Found by an audit: a decode-only mask that hides a key, against HF's eager attention. The prefill already
    differs (SDPA's named boundary), the oracle judges each core with its own mask (inside its semantics), so neither
    ``unobserved`` nor a verdict of its own fired: only the SDPA boundary was reported (and with FP32-accumulated
    linears on eager attention, the same defect read as parity). A mask is built from positions, not values: where
    it lets other keys through, the record is a ``mask`` onset whatever came before."""
    data = _onset(tmp_path, monkeypatch, "candidates:a_key_hidden_at_decode", "--model", "tiny-qwen3.5",
                  "--reference", "hf:attn=eager")
    failures = {f["kind"]: f for f in data["parity"]["failures"]}
    assert set(failures) == {"boundary", "mask"} and "lets other keys through" in failures["mask"]["message"]
    assert failures["mask"]["first"] == {"step": 1, "site": "layers.1.self_attn.core", "kind": "attention", "layer": 1}
    core = next(s for s in data["sites"] if s["site"] == "layers.1.self_attn.core" and s["step"] == 1)
    assert core["input_delta"]["attention_mask"] == 1 and core["verdicts"]["error"] == 0
    twin = _onset(tmp_path, monkeypatch, "candidates:mask_always_explicit", "--model", "tiny-qwen3.5",
                  "--reference", "hf:attn=eager")
    assert {f["kind"] for f in twin["parity"]["failures"]} == {"boundary"}


@pytest.mark.parametrize("model, site", [("tiny-llama", "layers.0.self_attn.core"),
                                         ("tiny-qwen3.5", "layers.1.self_attn.core")])
def test_attention_handed_no_mask_over_a_static_cache_is_a_mask_onset(tmp_path, monkeypatch, model, site) -> None:
    """Found by an audit: an attention function registered without a mask function (transformers hands it none) over
    a static cache attends to the zero padding at decode. Against HF's dynamic cache the keys' lengths differ, which
    read as ``unobserved`` (code no site observes); it is the mask: which keys the attention lets through. The same
    function with a mask function registered for it is at parity."""
    data = _onset(tmp_path, monkeypatch, "candidates:attention_registered_without_masks", "--model", model,
                  "--candidate-mode", "static")
    assert data["onset"] == {"step": 1, "site": site, "kind": "attention", "layer": int(site.split(".")[1]),
                             "reason": "mask"}
    core = next(s for s in data["sites"] if s["site"] == site and s["step"] == 1)
    assert core["input_delta"]["attention_mask"] == 1 and core["input_shapes"] == {}
    assert core["input_delta"]["key"] == core["input_delta"]["value"] == core["input_delta"]["query"] == 0
    prefill = next(s for s in data["sites"] if s["site"] == site and s["step"] == 0)
    assert prefill["bitwise_equal"] and "attention_mask" not in prefill["input_delta"]
    failures = {f["kind"]: f for f in data["parity"]["failures"]}
    assert "mask" in failures and "unobserved" not in failures
    twin = _onset(tmp_path, monkeypatch, "candidates:attention_registered_with_masks", "--model", model,
                  "--candidate-mode", "static")
    assert twin["onset"] is None and twin["parity"]["ok"], twin["parity"]
