"""Fixtures shared by the recording and comparison tests: one tiny Qwen3.5 and its prompts per module."""

from __future__ import annotations

import pytest
from ulptrace.models import build_model
from ulptrace.run import make_prompts


@pytest.fixture(scope="module")
def qwen():
    """The embedded default model (tiny-qwen3.5, BF16, seed 0)."""
    return build_model("tiny-qwen3.5")


@pytest.fixture(scope="module")
def prompts(qwen):
    """Two seeded random prompts of six tokens."""
    return make_prompts(qwen.config.vocab_size, 2, 6, seed=1)
