"""Shared test setup: a fixed seed for every test, and the one CUDA gate.

GPU tests are marked ``@pytest.mark.gpu``, the one gate: they are deselected by default
(``pyproject.toml``'s addopts) and skipped with a reason when selected on a machine without CUDA.
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
