"""Injection into tiny HF models: bitwise faithful path on CPU, restore, site contract, errors."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from kernel_cases import run_steps, tiny_llama, tiny_qwen35
from ulptrace.kernels import OPS, inject
from ulptrace.kernels._patches import KernelRMSNorm

QWEN_MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen35("eager")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def qwen_hf(qwen, ids):
    return run_steps(qwen, ids)


def test_faithful_reference_path_is_bitwise_hf_for_qwen35(qwen, ids, qwen_hf):
    with inject(qwen, "faithful", backend="reference") as handle:
        got = run_steps(qwen, ids)
    assert handle.ops == OPS  # every op has a site in the hybrid model
    assert handle.calls["gdn_gates"] > 0 and handle.calls["decode_attention_kernel"] > 0
    for step, (want, have) in enumerate(zip(qwen_hf, got)):
        assert torch.equal(have, want), f"step {step} differs"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_faithful_reference_path_is_bitwise_hf_for_llama_family(family, ids):
    model = tiny_llama("eager", family=family)
    want = run_steps(model, ids)
    with inject(model, "faithful") as handle:
        got = run_steps(model, ids)
    assert handle.ops == ("add_rms_norm", "glu", "decode_attention")
    assert set(handle.skipped) == {"gated_rms_norm", "gdn_gates"}
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_sdpa_model_prefill_is_bitwise_and_decode_uses_fp32_semantics(ids):
    model = tiny_qwen35("sdpa")
    want = run_steps(model, ids)
    with inject(model, "faithful") as handle:
        got = run_steps(model, ids)
    assert handle.attention_semantics == "sdpa" and handle.calls["decode_attention_kernel"] > 0
    assert torch.equal(got[0], want[0])  # no decode attention in the prefill
    for have, hf in zip(got[1:], want[1:]):  # SDPA's CPU backend rounds in its own order
        assert float((have.float() - hf.float()).abs().max()) < 0.05 * float(hf.float().abs().max())


def test_fused_path_differs_but_stays_close(qwen, ids, qwen_hf):
    with inject(qwen, "fused") as handle:
        got = run_steps(qwen, ids)
    assert handle.mode == "fused"
    assert not torch.equal(got[0], qwen_hf[0])
    for have, hf in zip(got, qwen_hf):
        assert float((have.float() - hf.float()).abs().max()) < 0.05 * float(hf.float().abs().max())


def test_undo_restores_modules_forwards_taps_and_outputs_bitwise(qwen, ids, qwen_hf):
    modeling = importlib.import_module(QWEN_MODELING)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modules = dict(qwen.named_modules())
    functions = {name: getattr(modeling, name) for name in
                 ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "eager_attention_forward")}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    state = {k: v.clone() for k, v in qwen.state_dict().items()}
    handle = inject(qwen, "fused")
    assert isinstance(qwen.model.layers[0].post_attention_layernorm, KernelRMSNorm)
    assert set(qwen.state_dict()) == set(state)  # the replacements share HF's parameters by name
    handle.undo()
    handle.undo()  # idempotent
    assert not handle.active
    after = dict(qwen.named_modules())
    assert after.keys() == modules.keys() and all(after[k] is modules[k] for k in modules)
    assert all("forward" not in m.__dict__ for m in qwen.modules())
    assert all(getattr(modeling, name) is fn for name, fn in functions.items())
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert all(torch.equal(state[k], v) for k, v in qwen.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(run_steps(qwen, ids), qwen_hf))


def test_context_manager_undoes_on_exception(qwen, ids, qwen_hf):
    with pytest.raises(KeyError), inject(qwen, "fused"):
        raise KeyError("boom")
    assert all(torch.equal(a, b) for a, b in zip(run_steps(qwen, ids), qwen_hf))


def test_site_contract_names_tuple_norm_glu_input_and_gates(qwen, ids):
    names = [name for name, _ in qwen.named_modules()]
    seen: dict[str, object] = {}
    with inject(qwen, "fused", backend="reference") as handle:
        assert [name for name, _ in qwen.named_modules()] == names
        layer = qwen.model.layers[0]  # a GDN layer
        hooks = [
            layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.setdefault("post", o)),
            layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("down_in", a[0])),
            layer.mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.setdefault("gate", o)),
            layer.mlp.up_proj.register_forward_hook(lambda m, i, o: seen.setdefault("up", o)),
            layer.linear_attn.norm.register_forward_hook(lambda m, i, o: seen.setdefault("gated", o)),
        ]
        from ulptrace.taps import tap

        modeling = importlib.import_module(QWEN_MODELING)
        observer = tap(modeling, "torch_chunk_gated_delta_rule").add_observer(
            lambda args, kwargs, result: seen.setdefault("g", kwargs["g"]))
        try:
            run_steps(qwen, ids, steps=0)
        finally:
            observer.remove()
            for h in hooks:
                h.remove()
        assert handle.sites["add_rms_norm"][0].startswith("model.layers.0")
    post = seen["post"]
    assert isinstance(post, tuple) and len(post) == 2  # (normed, new residual)
    from ulptrace.kernels import glu_reference

    assert torch.equal(seen["down_in"], glu_reference(seen["gate"], seen["up"], mode="fused"))
    assert seen["g"].dtype == torch.bfloat16  # the recorder sees the fused kernel's BF16 gate
    assert isinstance(seen["gated"], torch.Tensor)


def test_ops_subset_touches_only_those_sites(qwen, ids, qwen_hf):
    with inject(qwen, "fused", ops=["glu"]) as handle:
        assert handle.ops == ("glu",)
        assert not isinstance(qwen.model.norm, KernelRMSNorm)
        assert "forward" in qwen.model.layers[0].mlp.__dict__
        assert "forward" not in qwen.model.layers[0].__dict__
        got = run_steps(qwen, ids, steps=0)
    assert not torch.equal(got[0], qwen_hf[0])


def test_metadata_is_json_and_names_implementation(qwen):
    with inject(qwen, "faithful") as handle:
        meta = json.loads(json.dumps(handle.metadata()))
    assert meta["path"] == "kernels:faithful" and meta["backend"] == "reference" and meta["order"] == "hf"
    assert meta["implementation"] == {op: "reference" for op in OPS}
    assert meta["trees"] == {}  # references reduce in HF's own torch order
    assert meta["attention_semantics"] == "eager"
    assert handle.info == handle.metadata()


def test_registered_path_functions_apply_and_undo(qwen, ids, qwen_hf):
    paths = importlib.import_module("ulptrace.kernels.inject")
    for fn, mode in ((paths.faithful, "faithful"), (paths.fused, "fused")):
        handle = fn(qwen)
        assert handle.mode == mode and handle.active
        handle.undo()
    assert all(torch.equal(a, b) for a, b in zip(run_steps(qwen, ids), qwen_hf))


def test_nested_injection_is_refused_and_leaves_state_intact(qwen, ids, qwen_hf):
    other = tiny_qwen35("eager")
    with inject(qwen, "faithful"):
        with pytest.raises(RuntimeError, match="already has an active injection"):
            inject(qwen, "fused")
        with pytest.raises(RuntimeError, match="already has a replacement"):
            inject(other, "fused")  # decode attention's tap holds one implementation
        assert all("forward" not in m.__dict__ for m in other.modules())  # nothing half-applied
        assert not any(isinstance(m, KernelRMSNorm) for m in other.modules())
        with inject(other, "fused", ops=["add_rms_norm", "glu"]):  # without the tap it is fine
            pass
    assert all(torch.equal(a, b) for a, b in zip(run_steps(qwen, ids), qwen_hf))


@pytest.mark.parametrize(
    ("model_fn", "kwargs", "error", "message"),
    [
        (lambda: torch.nn.Linear(3, 3), {}, ValueError, "has none"),
        (lambda: "model", {}, TypeError, "must be a torch.nn.Module"),
        (tiny_llama, {"ops": ["gdn_gates"]}, ValueError, "cannot be injected"),
        (tiny_llama, {"ops": ["norms"]}, ValueError, "op must be one of"),
        (tiny_llama, {"mode": "exact"}, ValueError, "mode must be one of"),
        (tiny_llama, {"backend": "cuda"}, ValueError, "needs the model on a CUDA device"),
    ],
    ids=["no-layers", "not-module", "op-without-site", "unknown-op", "mode", "cuda-on-cpu"],
)
def test_bad_requests_raise_and_leave_the_model_unchanged(model_fn, kwargs, error, message):
    model = model_fn()
    with pytest.raises(error, match=message):
        inject(model, **kwargs)
    if isinstance(model, torch.nn.Module):
        assert not any(isinstance(m, KernelRMSNorm) for m in model.modules())
        assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_cuda_injection_agrees_with_hf_on_gpu(attn):
    model = tiny_qwen35(attn).cuda()
    tokens = torch.randint(0, 128, (4, 9), device="cuda")
    want = run_steps(model, tokens, steps=3)
    with inject(model, "faithful", backend="cuda") as handle:
        got = run_steps(model, tokens, steps=3)
    assert handle.implementation == {op: "cuda" for op in OPS}
    assert handle.trees["add_rms_norm"] and handle.trees["decode_attention"]["pv"] == "sequential"
    assert handle.calls["decode_attention_kernel"] > 0 and handle.calls["gdn_gates"] > 0
    for have, hf in zip(got, want):
        assert float((have.float() - hf.float()).abs().max()) < 0.05 * float(hf.float().abs().max())
    assert all(torch.equal(a, b) for a, b in zip(run_steps(model, tokens, steps=3), want))


def test_registry_names_resolve_to_these_paths(qwen, ids, qwen_hf):
    import ulptrace

    with ulptrace.apply_path(qwen, "kernels:fused") as applied:
        assert applied.info["mode"] == "fused" and applied.info["implementation"]["glu"] == "reference"
        assert not torch.equal(run_steps(qwen, ids, steps=0)[0], qwen_hf[0])
    assert all(torch.equal(a, b) for a, b in zip(run_steps(qwen, ids), qwen_hf))
