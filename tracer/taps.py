"""Function taps: observe or alter calls to a function that a model looks up by name at call time.

Some sites are not modules: HF computes the GatedDeltaNet gates inline and passes them to a
module-level function (``torch_chunk_gated_delta_rule``), and runs the attention core through a
function looked up in a registry (``ALL_ATTENTION_FUNCTIONS``). Both the recorder (which observes)
and kernel injection (which replaces arguments or the implementation) need to stand between the
caller and that function. If each patched the name on its own, whichever came last would see the
other's arguments or not, depending on order. A tap is the one wrapper installed per name; it

1. applies the *transforms* (injection: rewrite the arguments),
2. hands the final arguments to every *pre-observer* (recording what the call receives, before it runs: an
   implementation may write its arguments in place, as a kernel updating a state it was given does),
3. calls the *implementation* (the original, or one set by injection),
4. applies the *result transforms* (fault injection: alter what the call returns),
5. hands the final arguments and the result to every *observer* (recording).

so observers always see what the implementation really received and returned. The original is
put back when the last user of a tap goes away. Taps are process-global state, but every change
is undone by a handle, and installing or removing one never touches numerics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping
from typing import Any

from ulptrace.attributes import MISSING

Transform = Callable[[tuple, dict], "tuple[tuple, dict]"]
ResultTransform = Callable[[tuple, dict, Any], Any]
Observer = Callable[[tuple, dict, Any], None]
PreObserver = Callable[[tuple, dict], None]

_TAPS: dict[tuple[int, str], FunctionTap] = {}


def _is_mapping(namespace: Any) -> bool:
    return isinstance(namespace, MutableMapping) or (
        hasattr(namespace, "__getitem__") and hasattr(namespace, "__setitem__") and not _is_module(namespace)
    )


def _is_module(namespace: Any) -> bool:
    import types

    return isinstance(namespace, types.ModuleType)


class Handle:
    """Undo one registration on a tap; calling ``remove`` twice is harmless."""

    def __init__(self, undo: Callable[[], None]) -> None:
        self._undo: Callable[[], None] | None = undo

    def remove(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()


class FunctionTap:
    """The single wrapper standing in for ``namespace.name`` (or ``namespace[name]``)."""

    def __init__(self, namespace: Any, name: str) -> None:
        self.namespace = namespace
        self.name = name
        self._mapping = _is_mapping(namespace)
        self.original = namespace[name] if self._mapping else getattr(namespace, name)
        self.transforms: list[Transform] = []
        self.result_transforms: list[ResultTransform] = []
        self.observers: list[Observer] = []
        self.pre_observers: list[PreObserver] = []
        self.impl: Callable[..., Any] | None = None
        tap = self

        @functools.wraps(self.original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for transform in tuple(tap.transforms):
                args, kwargs = transform(args, kwargs)
            for pre_observer in tuple(tap.pre_observers):
                pre_observer(args, kwargs)
            result = (tap.impl or tap.original)(*args, **kwargs)
            for result_transform in tuple(tap.result_transforms):
                result = result_transform(args, kwargs, result)
            for observer in tuple(tap.observers):
                observer(args, kwargs, result)
            return result

        wrapper.__ulptrace_tap__ = self  # type: ignore[attr-defined]
        self.wrapper = wrapper
        # a registry's own entry before the tap (transformers' registries: a local entry over a class-wide one),
        # put back as it was when the tap goes — a local entry left behind would shadow a later register()
        self._own = own_entry(namespace, name) if self._mapping else None
        self._set(wrapper)

    def _set(self, value: Any) -> None:
        if self._mapping:
            self.namespace[self.name] = value
        else:
            setattr(self.namespace, self.name, value)

    def _release_if_unused(self) -> None:
        if not (self.transforms or self.result_transforms or self.observers or self.pre_observers) \
                and self.impl is None:
            if self._mapping:
                set_own_entry(self.namespace, self.name, self._own)
            else:
                self._set(self.original)
            _TAPS.pop((id(self.namespace), self.name), None)

    def _register(self, items: list, item: Any) -> Handle:
        items.append(item)

        def undo() -> None:
            items.remove(item)
            self._release_if_unused()

        return Handle(undo)

    def add_transform(self, transform: Transform) -> Handle:
        """Rewrite ``(args, kwargs)`` before the call; returns a handle that removes it."""
        return self._register(self.transforms, transform)

    def add_result_transform(self, transform: ResultTransform) -> Handle:
        """Replace the result by ``transform(args, kwargs, result)`` before observers see it."""
        return self._register(self.result_transforms, transform)

    def add_observer(self, observer: Observer) -> Handle:
        """Call ``observer(args, kwargs, result)`` after each call; returns a handle."""
        return self._register(self.observers, observer)

    def add_pre_observer(self, observer: PreObserver) -> Handle:
        """Call ``observer(args, kwargs)`` with the final arguments just before each call; returns a handle."""
        return self._register(self.pre_observers, observer)

    def set_impl(self, impl: Callable[..., Any]) -> Handle:
        """Run ``impl`` instead of the original until the handle is removed (one at a time)."""
        if self.impl is not None:
            raise RuntimeError(
                f"tap {self.name!r} already has a replacement implementation ({self.impl!r}); "
                "remove it before setting another"
            )
        self.impl = impl

        def undo() -> None:
            self.impl = None
            self._release_if_unused()

        return Handle(undo)


def _own_table(registry: Any) -> Any:
    """Where ``registry[name] = value`` writes: a transformers registry's (``GeneralInterface``) local mapping, which
    shadows its class-wide one (``register``); any other mapping itself."""
    local = getattr(registry, "_local_mapping", None)
    return local if isinstance(local, dict) else registry


def own_entry(registry: Any, name: str) -> Any:
    """The entry ``registry`` holds for ``name`` itself (:func:`_own_table`), or :data:`ulptrace.attributes.MISSING`
    — a class-wide entry then shows through."""
    return _own_table(registry).get(name, MISSING)


def set_own_entry(registry: Any, name: str, value: Any) -> None:
    """Put back what :func:`own_entry` returned: the entry, or none (the class-wide one shows through again)."""
    table = _own_table(registry)
    if value is MISSING:
        table.pop(name, None)
    else:
        table[name] = value


def tap_of(value: Any) -> FunctionTap | None:
    """The tap whose wrapper ``value`` is, or None (any other value)."""
    try:
        found = getattr(value, "__ulptrace_tap__", None)
    except Exception:  # noqa: BLE001 — an object whose attribute lookup fails is no tap's wrapper
        return None
    return found if isinstance(found, FunctionTap) else None


def tap(namespace: Any, name: str) -> FunctionTap:
    """The tap for ``namespace.name`` (a module attribute) or ``namespace[name]`` (a registry entry).

    Raises ``KeyError``/``AttributeError`` naming the namespace when the name does not exist there.
    """
    key = (id(namespace), name)
    existing = _TAPS.get(key)
    if existing is not None:
        return existing
    try:
        _ = namespace[name] if _is_mapping(namespace) else getattr(namespace, name)
    except (KeyError, AttributeError) as exc:
        where = getattr(namespace, "__name__", type(namespace).__name__)
        raise type(exc)(f"cannot tap {name!r}: {where} has no such function") from None
    created = FunctionTap(namespace, name)
    _TAPS[key] = created
    return created
