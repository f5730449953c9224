"""The package surface and the JIT build's behaviour on a machine without CUDA."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ulptrace import kernels
from ulptrace.kernels import _build
from ulptrace.kernels._common import resolve_backend

pytest_plugins = ["pytester"]

EXPECTED_ALL = [
    "Injection", "KernelBuildError", "OPS", "add_rms_norm", "decode_attention", "decode_attention_reference",
    "faithful", "fused", "gated_rms_norm", "gated_rms_norm_reference", "gdn_gates", "gdn_gates_reference", "glu",
    "glu_reference", "inject", "kernels_available", "rms_norm_reference",
]


def test_public_names_are_pinned_and_callable():
    assert sorted(kernels.__all__) == sorted(EXPECTED_ALL)
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None
    assert callable(kernels.inject) and callable(kernels.glu)  # functions win over same-named modules
    module = importlib.import_module("ulptrace.kernels.inject")
    assert module.faithful is kernels.faithful and module.fused is kernels.fused


def test_import_builds_nothing_and_loads_no_transformers():
    code = ("import sys, ulptrace.kernels; from ulptrace.kernels import _build; "
            "assert 'transformers' not in sys.modules; assert 'module' not in _build._state; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.stdout.strip() == "ok", result.stderr


def test_build_directory_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = _build.build_directory()
    assert directory.parent == tmp_path and directory.name.startswith("ulptrace_kernels_")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    default = _build.build_directory()
    assert default.parent.parts[-3:] == (".cache", "ulptrace", "torch_extensions")
    assert default.name == directory.name  # the name is a hash of the sources, not of the place


def test_sources_are_packaged_next_to_the_code():
    for name in _build.SOURCES + _build.HEADERS:
        assert (_build.CSRC / name).is_file(), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_without_cuda_the_kernels_explain_and_references_are_used(monkeypatch):
    monkeypatch.setattr(_build, "_state", {})
    assert kernels.kernels_available() is False
    with pytest.raises(kernels.KernelBuildError, match="no CUDA device"):
        _build.extension()
    x = torch.zeros(2, 3)
    assert resolve_backend("auto", x) == "reference"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("cuda", x)


@pytest.mark.gpu
def test_extension_builds_and_loads(cuda_kernels):
    assert kernels.kernels_available() is True and _build.extension() is cuda_kernels
    assert cuda_kernels.decode_attention_max_len(256) > 4000


GATED_TEST = """
def test_needs_the_kernels(cuda_kernels):
    assert cuda_kernels is not None
"""


def test_gpu_gate_skips_only_without_a_compiler_and_fails_on_a_build_error(pytester, monkeypatch, tmp_path):
    """The ``cuda_kernels`` fixture (tests/conftest.py), run in-process on this CPU machine with the build
    faked: no nvcc is a skip that says so; a compiler error makes the test error, never skip."""
    from torch.utils import cpp_extension

    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_gated=GATED_TEST)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    run = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-rs")

    monkeypatch.setattr(_build, "_state", {})
    no_nvcc = "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"  # _build's own wording
    monkeypatch.setattr(_build, "unavailable_reason", lambda: no_nvcc)
    skipped = pytester.runpytest(*run)
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines(["SKIPPED*CUDA code cannot be built here: nvcc was not found*"])

    def compiler_error(**kwargs):
        raise RuntimeError("Error building extension: rms_norm.cu(12): error: identifier \"x\" is undefined")

    monkeypatch.setattr(_build, "_state", {})
    monkeypatch.setattr(_build, "unavailable_reason", lambda: None)  # a device and nvcc are "here"
    monkeypatch.setattr(cpp_extension, "load", compiler_error)
    failed = pytester.runpytest(*run)
    failed.assert_outcomes(errors=1)
    failed.stdout.fnmatch_lines(["*KernelBuildError: ulptrace CUDA kernels failed to build in*identifier*"])
    assert failed.ret == pytest.ExitCode.TESTS_FAILED
