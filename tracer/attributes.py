"""Attributes of modules, classes and objects as they were, to put back exactly: the one home of "what did a patch
change, and undo it".

Two parts of ulptrace need it. A third-party path that patches HF in place (``ulptrace.thirdparty``: Liger-Kernel
replaces module functions, classes and instance attributes) must be undone to the identity of every value. The oracle
(``ulptrace.oracle.environment``) must capture the reference's semantics with the names its code looks up as it runs
as they were when the judge was built, while a candidate's patch is in place, then give the candidate its values back.

:class:`AttributeSnapshot` keeps each owner's entries (its ``__dict__``) when made. Values are compared by identity, so
a function swapped for another is found even where it compares equal; an entry added since counts as changed (it is
deleted when put back), one removed since too (it is added back). A check first compares each owner's values in order
by identity in one C-level pass, so an unchanged owner costs no lookup by name — the oracle checks ~100 owners at
every capture, amid a run.
"""

from __future__ import annotations

import contextlib
import operator
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

MISSING = object()
"""The value of an entry that is not there (added since: it was missing then; removed since: it is missing now)."""


class AttributeSnapshot:
    """The entries of ``owners`` (``(label, owner)``: modules, classes, objects; the first of a repeated owner is
    kept) as they are now. ``tracked(value)`` says which entries count (default: all); an entry counts when its value
    then or now is tracked."""

    def __init__(self, owners: Iterable[tuple[str, Any]], tracked: Callable[[Any], bool] | None = None) -> None:
        self._tracked = tracked or (lambda value: True)
        self._depth = 0  # restored() contexts entered and not left
        self._owners: list[tuple[str, Any, dict[str, Any], tuple[Any, ...]]] = []
        seen: set[int] = set()
        for label, owner in owners:
            if id(owner) not in seen:
                seen.add(id(owner))
                entries = dict(vars(owner))
                self._owners.append((label, owner, entries, tuple(entries.values())))

    def changed(self) -> list[tuple[str, Any, str, Any]]:
        """``(label, owner, name, value then)`` for every counted entry not what it was (``value then`` is
        :data:`MISSING` for an entry added since)."""
        out = []
        for label, owner, then, values in self._owners:
            now = vars(owner)
            if len(now) == len(values) and not any(map(operator.is_not, now.values(), values)):
                continue  # every entry where it was
            for name in sorted(now.keys() | then.keys(), key=str):
                old, new = then.get(name, MISSING), now.get(name, MISSING)
                if old is not new and (self._tracked(old) or self._tracked(new)):
                    out.append((label, owner, name, old))
        return out

    def changes(self) -> list[str]:
        """``label.name`` of every changed entry, for messages."""
        return [f"{label}.{name}" for label, _, name, _ in self.changed()]

    def restore(self) -> None:
        """Every changed entry as it was when this was made."""
        for _, owner, name, value in self.changed():
            put(owner, name, value)

    @contextlib.contextmanager
    def restored(self) -> Iterator[list[str]]:
        """Inside: every changed entry as it was when this was made (yields their ``label.name``); after, even after
        an error: as it was before. Re-entrant: inside another ``restored()`` of this snapshot it checks nothing and
        yields ``[]`` (a caller may hold it around many captures, each of which asks for it)."""
        if self._depth:
            self._depth += 1
            try:
                yield []
            finally:
                self._depth -= 1
            return
        changes = self.changed()
        now = [(owner, name, vars(owner).get(name, MISSING)) for _, owner, name, _ in changes]
        self._depth = 1
        try:
            for _, owner, name, value in changes:
                put(owner, name, value)
            yield [f"{label}.{name}" for label, _, name, _ in changes]
        finally:
            self._depth = 0
            for owner, name, value in now:
                put(owner, name, value)


def put(owner: Any, name: str, value: Any) -> None:
    """Set (or, for :data:`MISSING`, delete) one entry: through ``setattr`` on a module or class, in the ``__dict__``
    of any other object (``nn.Module.__setattr__`` would route parameters and submodules elsewhere)."""
    namespace = isinstance(owner, (type, types.ModuleType))
    if value is MISSING:
        if name in vars(owner):
            delattr(owner, name) if namespace else vars(owner).pop(name)
    elif namespace:
        setattr(owner, name, value)
    else:
        vars(owner)[name] = value
