"""ulptrace.attributes: module, class and instance entries put back to the identity of every value."""

from __future__ import annotations

import types

import pytest
import torch
from ulptrace.attributes import AttributeSnapshot


class Equal:
    """Equal to every other instance: a swap must be found by identity, not by ==."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Equal)

    __hash__ = object.__hash__


def _owners():
    module = types.ModuleType("ulptrace_attr_fixture")
    module.helper = lambda x: x
    module.value = Equal()

    class Layer(torch.nn.Module):
        def method(self):
            return 1

    layer = Layer()
    layer.tag = "first"
    return module, Layer, layer


def test_every_kind_of_change_is_named_and_undone() -> None:
    module, cls, layer = _owners()
    helper, value, method = module.helper, module.value, cls.method
    snapshot = AttributeSnapshot([("mod", module), ("Layer", cls), ("layer", layer), ("again", module)])
    assert snapshot.changes() == []
    module.helper = lambda x: x + 1  # changed
    module.value = Equal()  # equal by ==, another object
    module.added = 3  # added since
    del cls.method  # removed since
    layer.tag = "second"  # an instance attribute (in the module's __dict__, not a parameter)
    assert snapshot.changes() == ["mod.added", "mod.helper", "mod.value", "Layer.method", "layer.tag"]
    snapshot.restore()
    assert module.helper is helper and module.value is value and not hasattr(module, "added")
    assert cls.method is method and layer.tag == "first" and "tag" in vars(layer)
    assert snapshot.changes() == []


def test_restored_puts_back_inside_and_the_changes_after_even_on_error() -> None:
    module, cls, layer = _owners()
    helper, extra = module.helper, torch.nn.Identity()
    object.__setattr__(layer, "extra", extra)  # an nn.Module value held in the instance's own __dict__
    snapshot = AttributeSnapshot([("mod", module), ("layer", layer)])
    patched = module.helper = lambda x: x * 2
    del vars(layer)["extra"]
    with snapshot.restored() as names:
        assert names == ["mod.helper", "layer.extra"]
        # put back where it was, not routed into _modules by nn.Module.__setattr__
        assert module.helper is helper and vars(layer)["extra"] is extra and "extra" not in layer._modules
    assert module.helper is patched and "extra" not in vars(layer)
    with pytest.raises(KeyError), snapshot.restored():
        assert module.helper is helper
        raise KeyError("a failed capture")
    assert module.helper is patched and "extra" not in vars(layer)


def test_tracked_entries_only() -> None:
    module, _, _ = _owners()
    snapshot = AttributeSnapshot([("mod", module)], tracked=callable)
    module.value = Equal()  # data: not tracked
    module.flag = 1  # added data: not tracked
    assert snapshot.changes() == []
    module.flag = len  # a callable now where none was: tracked
    assert snapshot.changes() == ["mod.flag"]
    with snapshot.restored():
        assert not hasattr(module, "flag")
    assert module.flag is len


def test_restored_is_reentrant_and_the_outer_exit_gives_the_changes_back() -> None:
    module, _, _ = _owners()
    helper = module.helper
    snapshot = AttributeSnapshot([("mod", module)])
    patched = module.helper = len
    with snapshot.restored() as outer:
        assert outer == ["mod.helper"] and module.helper is helper
        with snapshot.restored() as inner:  # already restored: nothing checked, nothing put back on leaving
            assert inner == [] and module.helper is helper
        assert module.helper is helper
    assert module.helper is patched
    with pytest.raises(ValueError), snapshot.restored(), snapshot.restored():
        raise ValueError("a failed capture inside")
    assert module.helper is patched
    with snapshot.restored() as again:  # the depth went back to 0: a check again
        assert again == ["mod.helper"]
