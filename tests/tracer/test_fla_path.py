"""The ``hf:fla`` path: flash-linear-attention's GatedDeltaNet scan for the candidate, HF's torch scan for the
reference, in one process — whether FLA sits in a folder of its own (``ULPTRACE_FLA_DIR``) or is importable and
HF bound it at import (then the reference is forced back onto the torch scan: ``hf:scan=torch``).

FLA's kernels are Triton (GPU), so a stand-in ``fla`` package is written into a temporary folder: HF's own
torch scan whose final state is handed back rounded to BF16 — a kernel that keeps its state in BF16, which the
GatedDeltaNet oracle names (``state_bf16``). The real package is traced on the H200 (bench/gpu_findings.sh).
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import textwrap

import pytest
import torch
from ulptrace.paths import apply_path
from ulptrace.run import RunConfig

FAKE_FLA = '''
"""Stand-in for fla.ops.gated_delta_rule (ulptrace tests): HF's torch scan, final state rounded to BF16."""
import inspect

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as _hf

_chunk = inspect.unwrap(_hf.torch_chunk_gated_delta_rule)
_recurrent = inspect.unwrap(_hf.torch_recurrent_gated_delta_rule)


def _bf16_state(out):
    core, state = out
    return core, None if state is None else state.to(torch.bfloat16).float()


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    return _bf16_state(_chunk(q, k, v, g=g, beta=beta, initial_state=initial_state,
                              output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel))


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    return _bf16_state(_recurrent(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel))
'''


@pytest.fixture
def fla_folder(tmp_path):
    """A folder holding a stand-in ``fla`` package (as ``pip install --target`` would), not on the import path."""
    ops = tmp_path / "fla" / "ops" / "gated_delta_rule"
    ops.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text('__version__ = "0.0+ulptrace-test"\n')
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (ops / "__init__.py").write_text(textwrap.dedent(FAKE_FLA))
    yield tmp_path
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        del sys.modules[name]


def _modeling():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _onset(candidate: str, **kw):
    from ulptrace.probes.onset import run_onset

    cfg = RunConfig(candidate=candidate, prompts=1, prompt_len=6, new_tokens=2, sites=["layers.*.linear_attn.*"], **kw)
    comparison, info = run_onset(cfg)
    return cfg, comparison.to_json(), info


def test_fla_from_its_folder_runs_for_the_candidate_only(fla_folder, monkeypatch) -> None:
    modeling = _modeling()
    before = {n: getattr(modeling, n) for n in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}
    monkeypatch.setenv("ULPTRACE_FLA_DIR", str(fla_folder))
    path_before = list(sys.path)
    cfg, data, _ = _onset("hf:fla")

    assert cfg.reference == "hf:scan=torch"  # the paired reference: HF's torch scan, said so in the report
    ref, cand = data["reference"]["path_info"], data["candidate"]["path_info"]
    assert ref["gdn_scan"] == "torch (HF's fallback)" and cand["gdn_scan"] == "flash-linear-attention"
    assert cand["functions"]["torch_chunk_gated_delta_rule"]["ran"] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    assert cand["functions"]["torch_chunk_gated_delta_rule"]["calls"] == 2  # two GDN layers, one prefill
    assert cand["functions"]["torch_recurrent_gated_delta_rule"]["calls"] == 2  # and one decode step
    assert ref["functions"]["torch_chunk_gated_delta_rule"]["calls"] == 2
    assert ref["hf_bound_at_import"] == {n: "torch" for n in before}
    assert str(fla_folder) in cand["fla_source"]
    # the stand-in's scan output is HF's; its state is rounded to BF16: a named boundary where it is produced
    first = data["first_difference"]
    assert (first["step"], first["site"]) == (0, "layers.0.linear_attn.recurrent_state")
    state = next(s for s in data["sites"] if (s["site"], s["step"]) == ("layers.0.linear_attn.recurrent_state", 0))
    assert state["verdicts"]["error"] == 0 and state["verdicts"]["boundary"] > 0 and "BF16" in state["boundary"]
    assert data["onset"]["site"] == "layers.0.linear_attn.recurrent_state" and data["onset"]["reason"] == "verdict"
    # nothing left behind: HF's functions, the import path
    assert {n: getattr(modeling, n) for n in before} == before
    assert sys.path == path_before


def _bind_like_hf(torch_fn, kernel):
    """HF's import-time binding when FLA is importable (transformers' use_kernel_func_from_hub_with_fallback)."""
    try:
        from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

        bound = use_kernel_func_from_hub_with_fallback(kernel.__name__, "fla")(torch_fn)
        if bound is not torch_fn and "fla" in str(getattr(bound, "__closure__", "")):
            return bound
    except ImportError:
        pass

    @functools.wraps(torch_fn)
    def wrapped(*args, **kwargs):  # the shape of HF's binding: the torch function wrapped, FLA in the closure
        return kernel(*args, **kwargs)

    return wrapped


def test_fla_bound_by_hf_at_import_reference_forced_onto_torch(fla_folder, monkeypatch) -> None:
    """FLA importable: HF bound it at import, so plain ``hf`` runs FLA; against an ``hf:fla`` candidate the
    reference runs ``hf:scan=torch`` and its scan is HF's torch fallback."""
    from ulptrace.thirdparty import scan_binding

    monkeypatch.syspath_prepend(str(fla_folder))
    monkeypatch.delenv("ULPTRACE_FLA_DIR", raising=False)
    import fla.ops.gated_delta_rule as kernels

    modeling = _modeling()
    for name, kernel in (("torch_chunk_gated_delta_rule", kernels.chunk_gated_delta_rule),
                         ("torch_recurrent_gated_delta_rule", kernels.fused_recurrent_gated_delta_rule)):
        monkeypatch.setattr(modeling, name, _bind_like_hf(inspect.unwrap(getattr(modeling, name)), kernel))
    assert scan_binding(modeling.torch_chunk_gated_delta_rule) == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"

    cfg, data, _ = _onset("hf:fla")
    assert cfg.reference == "hf:scan=torch"
    ref, cand = data["reference"]["path_info"], data["candidate"]["path_info"]
    assert ref["gdn_scan"] == "torch (HF's fallback)" and ref["functions"]["torch_chunk_gated_delta_rule"]["calls"] == 2
    assert ref["hf_bound_at_import"]["torch_chunk_gated_delta_rule"] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    assert cand["gdn_scan"] == "flash-linear-attention" and "(importable)" in cand["fla_source"]
    assert data["onset"]["site"] == "layers.0.linear_attn.recurrent_state"  # found although HF itself runs FLA

    # and plain hf in this process runs what HF bound (FLA): hf against hf:scan=torch differs the same way
    _, data, _ = _onset("hf:scan=torch", reference="hf")
    assert data["first_difference"]["site"] == "layers.0.linear_attn.recurrent_state"


def test_fla_route_is_per_model_and_undone(fla_folder, monkeypatch) -> None:
    """Two models in one process: only the one with ``hf:fla`` applied runs FLA; undo removes the routing."""
    from ulptrace.models import build_model
    from ulptrace.run import make_prompts

    monkeypatch.setenv("ULPTRACE_FLA_DIR", str(fla_folder))
    modeling = _modeling()
    original = modeling.torch_chunk_gated_delta_rule
    reference, candidate = build_model("tiny-qwen3.5"), build_model("tiny-qwen3.5")
    prompts = make_prompts(reference.config.vocab_size, 1, 6, seed=1)

    def final_state(model):
        cache = model(prompts, use_cache=True).past_key_values
        return cache.layers[0].recurrent_states[0].clone()

    with torch.no_grad():
        expected = final_state(reference)
        with apply_path(candidate, "hf:fla") as applied:
            assert modeling.torch_chunk_gated_delta_rule is not original  # the tap stands there
            assert torch.equal(final_state(reference), expected)
            fla = final_state(candidate)
            assert applied.info["functions"]["torch_chunk_gated_delta_rule"]["calls"] == 2
        assert torch.equal(fla, expected.to(torch.bfloat16).float()) and not torch.equal(fla, expected)
        assert modeling.torch_chunk_gated_delta_rule is original
        assert torch.equal(final_state(candidate), expected)


def test_fla_on_a_model_without_gated_deltanet(fla_folder, monkeypatch) -> None:
    from ulptrace.models import build_model

    monkeypatch.setenv("ULPTRACE_FLA_DIR", str(fla_folder))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no GatedDeltaNet layer"):
        apply_path(build_model("tiny-llama"), "hf:fla")


@pytest.mark.parametrize("argv, message", [
    (["onset", "--candidate", "hf:fla"], "pip install 'ulptrace[fla]'"),
    (["onset", "--candidate", "hf:fla=/nonexistent/fla-folder"], "holds no flash-linear-attention package"),
])
def test_fla_missing_is_exit_2(argv, message, monkeypatch, capsys) -> None:
    from ulptrace.cli import main

    monkeypatch.delenv("ULPTRACE_FLA_DIR", raising=False)
    if __import__("importlib.util").util.find_spec("fla") is not None and "=" not in argv[-1]:
        pytest.skip("flash-linear-attention is importable here")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_fla_folder_option_in_the_path_name(fla_folder, monkeypatch, capsys) -> None:
    """``hf:fla=DIR`` names the folder in the path itself; the CLI judges it against hf:scan=torch."""
    from ulptrace.cli import main

    monkeypatch.delenv("ULPTRACE_FLA_DIR", raising=False)
    rc = main(["onset", "--candidate", f"hf:fla={fla_folder}", "--prompts", "1", "--prompt-len", "6",
               "--new-tokens", "1", "--sites", "layers.0.linear_attn.*", "--json", "-"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reference"]["path"] == "hf:scan=torch" and data["candidate"]["path"] == f"hf:fla={fla_folder}"
    assert data["candidate"]["path_info"]["gdn_scan"] == "flash-linear-attention"


def test_core_imports_no_third_party_package() -> None:
    """Importing ulptrace (paths, CLI, run layer, recorder) imports neither ulptrace.thirdparty nor Liger or FLA."""
    import subprocess

    code = ("import sys, ulptrace, ulptrace.paths, ulptrace.cli, ulptrace.run, ulptrace.record, ulptrace.probes.onset\n"
            "ulptrace.paths.resolve_path('hf'); ulptrace.paths.resolve_path('kernels:fused')\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('liger_kernel', 'fla') or m == 'ulptrace.thirdparty']\n"
            "assert not bad, bad\n"
            "ulptrace.paths.resolve_path('compile')\n"
            "assert 'ulptrace.thirdparty' in sys.modules\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('liger_kernel', 'fla')]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_torch_scan_and_hfs_binding_are_found_beneath_a_hub_kernels_function_module() -> None:
    """transformers 5.25 with the hub-kernels package installed makes each scan function an ``nn.Module`` whose class's
    ``forward`` calls the function it closes over (``func``: HF's dispatch, ``functools.wraps`` of the torch scan, the
    FLA kernel in its closure where HF bound one): beneath it are the torch scan and the binding, as beneath a plain
    function (and beneath an ulptrace tap over it)."""
    from types import SimpleNamespace

    from ulptrace.taps import tap
    from ulptrace.thirdparty import scan_binding, torch_fallback

    def torch_scan(x):
        return x

    def chunk_gated_delta_rule(x):
        return x

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"

    def function_module(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    bound = function_module(functools.wraps(torch_scan)(lambda x: chunk_gated_delta_rule(x)))
    unbound = function_module(functools.wraps(torch_scan)(lambda x: torch_scan(x)))
    assert torch_fallback(bound) is torch_fallback(unbound) is torch_scan
    assert scan_binding(bound) == "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule"
    assert scan_binding(unbound) == "torch"
    namespace = SimpleNamespace(scan=bound)
    handle = tap(namespace, "scan").add_observer(lambda args, kwargs, result: None)
    try:
        assert namespace.scan is not bound and namespace.scan(3) == 3
        assert torch_fallback(namespace.scan) is torch_scan
        assert scan_binding(namespace.scan) == "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule"
    finally:
        handle.remove()
    assert namespace.scan is bound
