"""What a reference's semantics look up when they run, kept as it was when the judge was built.

A site's formula binds its reference module's ``forward`` when the judge is built, but that forward reads names as it
runs: a module-level helper (``apply_rotary_pos_emb`` calls ``rotate_half`` from its module's globals), a method
through its class (``Qwen3_5RMSNorm.forward`` calls ``self._norm``), ``torch.nn.functional.silu``. Programs are
captured when a record is judged, while the candidate's path is applied — so a candidate that installs its kernel the
ordinary way, by assigning such a name, would be judged against its own arithmetic and read as a tie.

:class:`Environment` takes, when the judge is built (the reference path applied, the candidate's not yet), the
callables of every namespace the reference model's code reads by name: the globals of the modules that define its
modules' classes (and of the modules their globals' functions come from, within those packages), the dictionaries of
those classes (their whole MRO), ``torch``, ``torch.nn.functional`` and ``torch.Tensor``. :meth:`Environment.restored`
puts back, for the length of a capture, every entry changed since (an entry added since is taken away), and then the
candidate's again.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

_MISSING = object()
_ALWAYS = (torch, torch.nn.functional)  # what any formula's code may call through
_ALWAYS_CLASSES = (torch.Tensor,)


def _looked_up(value: Any) -> bool:
    """Whether code reaching ``value`` by name calls it or reads through it: functions, classes, modules and other
    callables (data entries — a logger, a cache, a flag — are left alone)."""
    return callable(value) or isinstance(value, (types.ModuleType, staticmethod, classmethod, property))


class Environment:
    """The namespaces ``model``'s code reads by name, as they are now (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        classes: dict[int, type] = {id(c): c for c in _ALWAYS_CLASSES}
        for module in model.modules():
            for cls in type(module).__mro__:
                if cls is not object and cls.__module__ != "builtins":
                    classes[id(cls)] = cls
        modules: dict[int, types.ModuleType] = {id(m): m for m in _ALWAYS}
        packages = set()
        for cls in classes.values():
            found = sys.modules.get(cls.__module__)
            if found is not None and not cls.__module__.startswith("torch"):  # torch's: _ALWAYS
                modules[id(found)] = found
                packages.add(cls.__module__.split(".")[0])
        for found in list(modules.values()):  # one step on: the modules their globals' functions are defined in
            if found in _ALWAYS:
                continue
            for value in vars(found).values():
                name = getattr(value, "__module__", None)
                if isinstance(name, str) and name.split(".")[0] in packages and name in sys.modules:
                    modules[id(sys.modules[name])] = sys.modules[name]
        # each owner's entries as they are (a dict) and its values in order (a tuple): a check first compares the
        # values by identity in one C-level pass — no lookup by name, which a capture amid a run pays in cache misses
        self._owners = [(owner, dict(vars(owner)), tuple(vars(owner).values()))
                        for owner in [*modules.values(), *classes.values()]]

    def changed(self) -> list[tuple[Any, str, Any]]:
        """``(owner, name, value then)`` for every looked-up entry that is not what it was (``value then`` is a
        sentinel for an entry added since)."""
        out = []
        for owner, then, values in self._owners:
            now = vars(owner)
            if len(now) == len(values) and not any(map(operator.is_not, now.values(), values)):
                continue  # every entry where it was
            out += [(owner, n, v) for n, v in then.items() if _looked_up(v) and now.get(n, _MISSING) is not v]
            out += [(owner, n, _MISSING) for n, v in now.items() if n not in then and _looked_up(v)]
        return out

    def describe(self, changes: list[tuple[Any, str, Any]]) -> list[str]:
        """``module.name`` / ``Class.name`` of each change, for messages."""
        return [f"{getattr(owner, '__qualname__', None) or owner.__name__}.{name}" for owner, name, _ in changes]

    @contextlib.contextmanager
    def restored(self) -> Iterator[list[str]]:
        """Inside: every changed entry as it was when this was made (yields their names); after: as it was before."""
        changes = self.changed()
        now = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in changes]
        try:
            for owner, name, value in changes:
                _put(owner, name, value)
            yield self.describe(changes)
        finally:
            for owner, name, value in now:
                _put(owner, name, value)


def _put(owner: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, value)
