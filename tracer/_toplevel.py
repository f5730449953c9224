"""This checkout's ``kernels/``, ``tracer/`` and ``probes/`` folders, reached under their own top-level names.

The folders are ``ulptrace.kernels``, ``ulptrace`` and ``ulptrace.probes`` (``package-dir`` in ``pyproject.toml``);
their bare names belong to other packages on PyPI. Python puts the current directory first on ``sys.path`` for
``python -m ...`` and ``python -c ...``, so run from the checkout's root, ``import kernels`` found the ``kernels/``
folder — and transformers (5.25 and later, which requires the PyPI ``kernels`` package) imports ``kernels`` when it
loads its models: it failed there with an ``ImportError`` about our folder. A folder imported under its bare name
calls :func:`step_aside`, which loads the package of that name from the rest of ``sys.path`` in its place, or says that
there is none.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def step_aside(name: str, init_file: str) -> None:
    """In the ``__init__.py`` of this checkout's folder ``name`` imported as ``name`` (not under ``ulptrace``): put the
    package ``name`` found on ``sys.path`` without this checkout's root into ``sys.modules`` — the import then returns
    it — or raise ``ModuleNotFoundError`` naming the folder's real name."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, rest)
    if spec is None or spec.loader is None:
        real = "ulptrace" if name == "tracer" else f"ulptrace.{name}"
        raise ModuleNotFoundError(f"No module named {name!r}: this checkout's {name}/ folder is imported as {real!r}, "
                                  f"and no other package {name!r} is installed", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
