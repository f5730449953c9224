"""ulptrace.oracle.environment: the names a reference's code looks up as it runs, put back around a capture."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from ulptrace.oracle.environment import reference_namespaces

SOURCE = """
import torch

FLAG = 1


def helper(x):
    return x * 2


class Block(torch.nn.Module):
    def inner(self, x):
        return x + 1

    def forward(self, x):
        return helper(self.inner(x))
"""


@pytest.fixture
def tiny_module(tmp_path, monkeypatch):
    """A model whose forward reads a module-level helper and a method through its class, from a module of its own."""
    (tmp_path / "ulptrace_env_fixture.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ulptrace_env_fixture", raising=False)
    module = importlib.import_module("ulptrace_env_fixture")
    yield module
    sys.modules.pop("ulptrace_env_fixture", None)


def test_patched_names_are_put_back_inside_and_the_patch_restored_after(tiny_module) -> None:
    block = tiny_module.Block()
    forward = block.forward  # bound now, as a formula binds it
    env = reference_namespaces(block)
    x = torch.tensor([1.0, 2.0])
    assert env.changes() == []
    original_helper = tiny_module.helper
    tiny_module.helper = lambda x: x * 3  # a module global the forward reads as it runs
    tiny_module.Block.inner = lambda self, x: x - 1  # a method read through the class
    torch.nn.functional.ulptrace_added = lambda x: x  # an entry added since
    try:
        assert forward(x).tolist() == [0.0, 3.0]  # the candidate's arithmetic: (x - 1) * 3
        with env.restored() as names:
            assert sorted(names) == ["Block.inner", "torch.nn.functional.ulptrace_added", "ulptrace_env_fixture.helper"]
            assert forward(x).tolist() == [4.0, 6.0]  # the reference's: (x + 1) * 2
            assert tiny_module.helper is original_helper
            assert not hasattr(torch.nn.functional, "ulptrace_added")
        assert forward(x).tolist() == [0.0, 3.0]  # the candidate's again
        assert hasattr(torch.nn.functional, "ulptrace_added")
        with pytest.raises(RuntimeError), env.restored():
            raise RuntimeError("a failed capture")
        assert forward(x).tolist() == [0.0, 3.0]  # put back after an error too
    finally:
        del torch.nn.functional.ulptrace_added
        del tiny_module.Block.inner


def test_a_method_removed_since_is_put_back_and_data_entries_are_left_alone(tiny_module) -> None:
    env = reference_namespaces(tiny_module.Block())
    tiny_module.FLAG = 2  # data, not a name code calls: not put back
    original = tiny_module.Block.inner
    del tiny_module.Block.inner
    with env.restored() as names:
        assert names == ["Block.inner"] and tiny_module.Block.inner is original and tiny_module.FLAG == 2
    assert "inner" not in vars(tiny_module.Block)
    tiny_module.Block.inner = original
    assert env.changes() == []
