"""Shared test setup: a fixed seed for every test, and the GPU gates.

GPU tests are marked ``@pytest.mark.gpu``, the one gate: they are deselected by default
(``pyproject.toml``'s addopts) and skipped with a reason when selected on a machine without CUDA.
Tests that compile CUDA code also take a fixture: ``cuda_compiler`` (CUDA code can be built here) or
``cuda_kernels`` (ulptrace's extension, built). Both skip, saying why, only where nothing can be built
(no CUDA device, a torch without CUDA, no nvcc); a compiler or loader error is raised, so the test
errors and the run fails instead of passing by skipping.
Nothing is imported from conftest modules (a subfolder's conftest would shadow the name).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def ulptrace_script() -> str:
    """The installed ``ulptrace`` console script (beside this interpreter, else on ``PATH``): what a user types, its
    entry point included, not ``main`` called in-process."""
    import shutil
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("ulptrace")
    return str(script) if script.exists() else shutil.which("ulptrace") or "ulptrace"


@pytest.fixture(scope="session")
def cuda_compiler() -> None:
    """Skip, saying why, only where CUDA code cannot be built at all: no device, no CUDA torch, no nvcc."""
    from ulptrace.kernels import _build

    reason = _build.unavailable_reason()
    if reason is not None:
        pytest.skip(f"CUDA code cannot be built here: {reason}")


@pytest.fixture(scope="session")
def cuda_kernels(cuda_compiler):
    """ulptrace's CUDA extension, built; a failed build raises ``KernelBuildError`` (an error, not a skip)."""
    from ulptrace.kernels import _build

    return _build.extension()


@pytest.fixture
def fail_oracle_at(monkeypatch):
    """``fail_oracle_at(suffix)``: the oracle raises on every site whose program name ends with ``suffix`` (an
    interval rule missing for an op), as an oracle that cannot judge a site does; other sites are judged."""

    def fail(suffix: str) -> None:
        import ulptrace.oracle

        real = ulptrace.oracle.judge

        def failing(program, *args, **kwargs):
            if program.name.endswith(suffix):
                raise NotImplementedError("no interval rule for aten.fake_op")
            return real(program, *args, **kwargs)

        monkeypatch.setattr(ulptrace.oracle, "judge", failing)

    return fail
