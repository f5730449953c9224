"""What a reference's semantics look up when they run, kept as it was when the judge was built.

A site's formula binds its reference module's ``forward`` when the judge is built, but that forward reads names as it
runs: a module-level helper (``apply_rotary_pos_emb`` calls ``rotate_half`` from its module's globals), a method
through its class (``Qwen3_5RMSNorm.forward`` calls ``self._norm``), ``torch.nn.functional.silu``. Programs are
captured when a record is judged, while the candidate's path is applied — so a candidate that installs its kernel the
ordinary way, by assigning such a name, would be judged against its own arithmetic and read as a tie.

:func:`reference_namespaces` takes, when the judge is built (the reference path applied, the candidate's not yet),
the callables of every namespace the reference model's code reads by name: the globals of the modules that define its
modules' classes (and of the modules their globals' functions come from, within those packages), the dictionaries of
those classes (their whole MRO), ``torch``, ``torch.nn.functional`` and ``torch.Tensor`` — an
``ulptrace.attributes.AttributeSnapshot``, whose ``restored()`` puts back, for the length of a capture, every entry
changed since (an entry added since is taken away), and then the candidate's again.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from ulptrace.attributes import AttributeSnapshot

_ALWAYS = (torch, torch.nn.functional)  # what any formula's code may call through
_ALWAYS_CLASSES = (torch.Tensor,)


def looked_up(value: Any) -> bool:
    """Whether code reaching ``value`` by name calls it or reads through it: functions, classes, modules and other
    callables (data entries — a logger, a cache, a flag — are left alone)."""
    return callable(value) or isinstance(value, (types.ModuleType, staticmethod, classmethod, property))


def reference_namespaces(model: torch.nn.Module) -> AttributeSnapshot:
    """The namespaces ``model``'s code reads by name, as they are now (see the module docstring): their looked-up
    entries (:func:`looked_up`), labelled by module name and class qualname."""
    return AttributeSnapshot(namespace_owners(model), tracked=looked_up)


def namespace_owners(model: torch.nn.Module, *, module_classes: bool = False) -> list[tuple[str, Any]]:
    """``(label, owner)`` of :func:`reference_namespaces`; ``module_classes``: also every class those modules'
    globals hold from the model's packages, with its MRO — the classes a run reaches through them beyond the
    model's own modules (a cache's layers: ``DynamicLayer.update``), which a side's run needs (``ulptrace.sides``)
    and a site's semantics do not."""
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
    if module_classes:
        for found in list(modules.values()):
            if found in _ALWAYS:
                continue
            for value in list(vars(found).values()):
                if isinstance(value, type) and isinstance(getattr(value, "__module__", None), str) \
                        and value.__module__.split(".")[0] in packages:
                    for cls in value.__mro__:
                        if cls is not object and cls.__module__.split(".")[0] in packages:
                            classes.setdefault(id(cls), cls)
    return [(m.__name__, m) for m in modules.values()] + [(c.__qualname__, c) for c in classes.values()]
