"""The ``liger`` path: Liger-Kernel's patch for the model's family, applied to the instance and fully undone.

Liger-Kernel needs Triton and a GPU, so these tests write a stand-in ``liger_kernel`` package into a temporary
folder that patches HF the way Liger 0.8.5 does (``liger_kernel/transformers/monkey_patch.py``): module-level
classes and functions of the modeling module replaced (``Qwen3_5RMSNorm``, ``Qwen3_5MLP``,
``apply_rotary_pos_emb``), instance forwards bound into each module's ``__dict__`` with extra attributes
(``offset``, ``casting_mode``, ``variance_epsilon``), plus things a library may patch beyond what it was asked
(``torch.nn.functional.cross_entropy``, a class attribute). ulptrace's undo must restore every one of them,
so a reference model in the same process is untouched before, during and after.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from ulptrace.models import build_model
from ulptrace.paths import apply_path
from ulptrace.run import make_prompts

FAKE_LIGER = '''
"""Stand-in for liger_kernel.transformers (ulptrace tests): patches HF the way Liger-Kernel 0.8.5 does."""
import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen3_5 import modeling_qwen3_5

CALLS = []
_hf_rope = modeling_llama.apply_rotary_pos_emb


class LigerRMSNormForQwen3Next(torch.nn.Module):
    """Liger's zero-centred RMSNorm in "gemma" casting mode: FP32 throughout, one final rounding."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (self.offset + self.weight.float())).to(hidden_states.dtype)


class LigerSwiGLUMLP(torch.nn.Module):
    """A fused SwiGLU epilogue: silu(gate) * up rounded once (HF rounds silu(gate) first)."""

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype))


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return _hf_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def liger_cross_entropy(*args, **kwargs):
    raise AssertionError("inference never computes a loss")


def _bind(module, name, fn):
    module.__dict__[name] = fn.__get__(module, module.__class__)


def _patch_rms_norm_module(module, offset=0.0, casting_mode="llama"):
    module.offset = offset
    module.casting_mode = casting_mode
    module.variance_epsilon = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or 1e-6
    module.in_place = False
    module.row_mode = None
    _bind(module, "forward", LigerRMSNormForQwen3Next.forward)
    _bind(module, "_get_name", lambda self: "LigerRMSNorm")


def _patch_swiglu_module(module):
    _bind(module, "forward", LigerSwiGLUMLP.forward)
    _bind(module, "_get_name", lambda self: "LigerSwiGLUMLP")


def _common(module, text_model, rms_norm, swiglu, offset, casting_mode, norm_class, mlp_class, prefix):
    torch.nn.functional.cross_entropy = liger_cross_entropy  # patched whatever was asked (ulptrace restores it)
    getattr(module, prefix + "ForCausalLM").liger_patched = True  # a class attribute added
    if rms_norm:
        setattr(module, prefix + "RMSNorm", norm_class)
    if swiglu:
        setattr(module, prefix + "MLP", mlp_class)
    if text_model is not None:
        if rms_norm:
            _patch_rms_norm_module(text_model.norm, offset, casting_mode)
        for layer in text_model.layers:
            if rms_norm:
                _patch_rms_norm_module(layer.input_layernorm, offset, casting_mode)
                _patch_rms_norm_module(layer.post_attention_layernorm, offset, casting_mode)
            if swiglu:
                _patch_swiglu_module(layer.mlp)


def apply_liger_kernel_to_qwen3_5(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                  swiglu=True, model=None):
    CALLS.append(("qwen3_5", dict(rope=rope, cross_entropy=cross_entropy,
                                   fused_linear_cross_entropy=fused_linear_cross_entropy, model=model is not None)))
    _common(modeling_qwen3_5, None if model is None else model.model, rms_norm, swiglu, 1.0, "gemma",
            LigerRMSNormForQwen3Next, LigerSwiGLUMLP, "Qwen3_5")


def apply_liger_kernel_to_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                swiglu=True, model=None):
    CALLS.append(("llama", dict(rope=rope, cross_entropy=cross_entropy,
                                fused_linear_cross_entropy=fused_linear_cross_entropy, model=model is not None)))
    if rope:
        modeling_llama.apply_rotary_pos_emb = liger_rotary_pos_emb
    _common(modeling_llama, None if model is None else model.model, rms_norm, swiglu, 0.0, "llama",
            LigerRMSNormForQwen3Next, LigerSwiGLUMLP, "Llama")
'''


@pytest.fixture
def fake_liger(tmp_path, monkeypatch):
    """A stand-in ``liger_kernel`` importable for one test; HF's modules are put back afterwards whatever
    the path did (so a failing undo cannot poison other tests)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3_5 import modeling_qwen3_5

    package = tmp_path / "liger_kernel"
    (package / "transformers").mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0.0+ulptrace-test"\n')
    (package / "transformers" / "__init__.py").write_text(textwrap.dedent(FAKE_LIGER))
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {m: dict(vars(m)) for m in (modeling_llama, modeling_qwen3_5, torch.nn.functional)}
    classes = {c: dict(vars(c)) for c in (modeling_llama.LlamaForCausalLM, modeling_qwen3_5.Qwen3_5ForCausalLM)}
    yield package
    for owner, before in list(saved.items()) + list(classes.items()):
        for key in set(vars(owner)) - set(before):
            delattr(owner, key)
        for key, value in before.items():
            if vars(owner).get(key) is not value and not key.startswith("__"):
                setattr(owner, key, value)
    for name in [n for n in sys.modules if n == "liger_kernel" or n.startswith("liger_kernel.")]:
        del sys.modules[name]


def _logits(model, prompts):
    with torch.no_grad():
        return model(prompts).logits


def _state(model):
    """Every module's ``__dict__`` (keys and value identities), to compare before and after."""
    return {name: {k: id(v) for k, v in vars(m).items()} for name, m in model.named_modules()}


def test_liger_is_applied_to_the_instance_and_fully_undone(fake_liger) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    reference, candidate = build_model("tiny-qwen3.5"), build_model("tiny-qwen3.5")
    prompts = make_prompts(reference.config.vocab_size, 2, 6, seed=1)
    expected = _logits(reference, prompts)
    hf_norm, hf_mlp, hf_ce = modeling_qwen3_5.Qwen3_5RMSNorm, modeling_qwen3_5.Qwen3_5MLP, \
        torch.nn.functional.cross_entropy
    before = _state(candidate)

    with apply_path(candidate, "liger") as applied:
        liger = sys.modules["liger_kernel.transformers"]
        assert liger.CALLS == [("qwen3_5", {"rope": False, "cross_entropy": False,
                                            "fused_linear_cross_entropy": False, "model": True})]
        assert modeling_qwen3_5.Qwen3_5RMSNorm is liger.LigerRMSNormForQwen3Next  # patched at module level
        assert "forward" in vars(candidate.model.layers[0].mlp)
        info = applied.info
        assert info["function"] == "liger_kernel.transformers.apply_liger_kernel_to_qwen3_5"
        assert info["options"] == {"fused_linear_cross_entropy": False, "cross_entropy": False}
        assert {"transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm",
                "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5MLP", "torch.nn.functional.cross_entropy",
                "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5ForCausalLM.liger_patched"} \
            <= set(info["module_level"])
        assert info["instances_patched"] == 4 * 3 + 1  # two norms and the MLP per layer, the final norm
        during = _logits(candidate, prompts)
        # the reference in the same process is untouched while the candidate is patched
        assert torch.equal(_logits(reference, prompts), expected)
    assert not torch.equal(during, expected)  # the stand-in rounds its GLU once: the path really ran

    assert modeling_qwen3_5.Qwen3_5RMSNorm is hf_norm and modeling_qwen3_5.Qwen3_5MLP is hf_mlp
    assert torch.nn.functional.cross_entropy is hf_ce
    assert "liger_patched" not in vars(modeling_qwen3_5.Qwen3_5ForCausalLM)
    assert _state(candidate) == before  # every instance attribute added by Liger removed, forwards unbound
    assert torch.equal(_logits(candidate, prompts), expected)
    fresh = build_model("tiny-qwen3.5")  # a model built afterwards gets HF's classes
    assert type(fresh.model.norm) is hf_norm and type(fresh.model.layers[0].mlp) is hf_mlp


def test_liger_module_level_function_restored_for_llama(fake_liger) -> None:
    """Liger replaces Llama's apply_rotary_pos_emb (looked up at call time by every Llama model): restored."""
    from transformers.models.llama import modeling_llama

    rope = modeling_llama.apply_rotary_pos_emb
    model = build_model("tiny-llama")
    with apply_path(model, "liger") as applied:
        assert modeling_llama.apply_rotary_pos_emb is not rope
        assert applied.info["function"] == "liger_kernel.transformers.apply_liger_kernel_to_llama"
        assert "transformers.models.llama.modeling_llama.apply_rotary_pos_emb" in applied.info["module_level"]
    assert modeling_llama.apply_rotary_pos_emb is rope
    assert modeling_llama.LlamaRMSNorm.__name__ == "LlamaRMSNorm"


def test_liger_onset_reports_the_glu_boundary(fake_liger, capsys) -> None:
    """``ulptrace onset --candidate liger``: the stand-in's one-rounding SwiGLU is a named boundary at the GLU;
    the report says which Liger function ran with which options."""
    from ulptrace.cli import main

    rc = main(["onset", "--candidate", "liger", "--prompts", "1", "--prompt-len", "6", "--new-tokens", "2",
               "--json", "-"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    info = data["candidate"]["path_info"]
    assert info["function"].endswith("apply_liger_kernel_to_qwen3_5") and info["library"] == "liger-kernel"
    glu = [s for s in data["sites"] if s["site"].endswith("mlp.glu") and not s["bitwise_equal"]]
    assert glu and all(s["verdicts"]["error"] == 0 for s in glu)
    assert any(s["verdicts"]["boundary"] for s in glu)


def test_liger_refuses_a_model_it_has_no_patch_for(fake_liger) -> None:
    with pytest.raises(ValueError, match="knows no Liger-Kernel patch for Linear"):
        apply_path(torch.nn.Linear(2, 2), "liger")


def test_liger_missing_is_exit_2_naming_the_extra(monkeypatch, capsys) -> None:
    from ulptrace.cli import main

    monkeypatch.setattr(sys, "path", [p for p in sys.path if "liger" not in p])
    if __import__("importlib.util").util.find_spec("liger_kernel") is not None:
        pytest.skip("Liger-Kernel is installed here")
    assert main(["onset", "--candidate", "liger"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'ulptrace[liger]'" in err and err.count("\n") == 1
    assert main(["paths"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("liger "))
    assert "not available here" in line and "ulptrace[liger]" in line


def test_paths_lists_liger_available_with_the_package(fake_liger, capsys) -> None:
    from ulptrace.cli import main

    assert main(["paths"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "not available" not in next(line for line in out if line.startswith("liger "))
    assert "not available" not in next(line for line in out if line.startswith("compile "))
