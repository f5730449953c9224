"""Shared fixtures: a fixed seed for every test, and the one CUDA gate."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
