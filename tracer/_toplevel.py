"""This checkout's ``kernels/``, ``tracer/`` and ``probes/`` folders, reached under their own top-level names.

The folders are ``ulptrace.kernels``, ``ulptrace`` and ``ulptrace.probes`` (``package-dir`` in ``pyproject.toml``);
their bare names belong to other packages on PyPI. Python puts the current directory first on ``sys.path`` for
``python -m ...`` and ``python -c ...``, so run from the checkout's root, ``import kernels`` found the ``kernels/``
folder — and transformers (5.25 and later, which requires the PyPI ``kernels`` package) imports ``kernels`` when it
loads its models: it failed there with an ``ImportError`` about our folder. A folder imported under its bare name
calls :func:`step_aside`, which loads the package of that name from the rest of ``sys.path`` in its place; where there
is none, the module stays empty (no ``__version__``: transformers, which imports a ``kernels`` it finds without
installed metadata to read its version, then deems it unusable), every name read of it an ``AttributeError`` that says
what the folder is.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Any, NoReturn

_MODULE = {"__name__", "__doc__", "__file__", "__path__", "__package__", "__spec__", "__loader__", "__cached__",
           "__builtins__", "annotations"}


def step_aside(name: str, init_file: str, namespace: dict[str, Any]) -> None:
    """In the ``__init__.py`` of this checkout's folder ``name`` imported as ``name`` (not under ``ulptrace``), its
    ``globals()`` as ``namespace``: put the package ``name`` found on ``sys.path`` without this checkout's root into
    ``sys.modules`` — the import then returns it — or, with none, leave the module empty."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return
    real = "ulptrace" if name == "tracer" else f"ulptrace.{name}"

    def missing(attr: str) -> NoReturn:
        raise AttributeError(f"module {name!r} has no attribute {attr!r}: this checkout's {name}/ folder is imported "
                             f"as {real!r} (no other package {name!r} is installed)")

    for key in [k for k in namespace if k not in _MODULE]:
        del namespace[key]
    namespace["__getattr__"] = missing
