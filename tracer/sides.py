"""Two paths applied in one process: each side's model runs with the names its own path set, not the other's.

Why: lockstep and the locating of the matrix and of an onset run the reference's and the candidate's models in one
process while both paths are applied. A path that installs its kernel the ordinary way — by assigning a name the
model's code looks up as it runs: a modeling module's function (``torch_recurrent_gated_delta_rule``,
``apply_rotary_pos_emb``), a method of a class, ``torch.nn.functional`` (Liger-Kernel's way, and a user's) — changes
it for both models; so does replacing the attention registry's entry the model looks up (``ALL_ATTENTION_FUNCTIONS``).
The reference then ran the candidate's kernel, and a gross defect read as "bitwise identical"
(an audit with defects no issue names, ``bench/results/audit_2026-12-05h``).

:class:`SideNames` takes those names (``ulptrace.oracle.environment.namespace_owners``: the namespaces a model's code
reads, and the classes those hold — a cache's layers) as they are when its side's path has been applied;
:meth:`SideNames.entered` puts them back for the length of one of that side's runs, then what was there. A pair is
set up by :func:`apply_paths` (or, for several candidates against one reference, :func:`apply_candidate`): the
candidate's path is applied over the names as they were before either path (the reference path's own assignments do
not reach the candidate either). ulptrace's own function taps (``ulptrace.taps``: the recorder's observers, kernel
injection, which scopes itself to its own model's modules) stand between a name and its function for both models: a
tap is left in place, and the function it calls is what is put back. The oracle's own arithmetic is kept from a
candidate's names by its judge (``ulptrace.verdicts.OracleJudge``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ulptrace.attributes import MISSING, AttributeSnapshot, put
from ulptrace.oracle.environment import looked_up, namespace_owners
from ulptrace.paths import apply_path
from ulptrace.sites import attention_lookup
from ulptrace.taps import own_entry, set_own_entry, tap_of


class SideNames:
    """The names ``model``'s code looks up as it runs, as they are now (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self._snapshot = AttributeSnapshot(namespace_owners(model, module_classes=True), tracked=looked_up)
        # and the registry entry its attention is looked up by (ALL_ATTENTION_FUNCTIONS: ``registry[key] = fn``
        # replaces it for every model), where it is one
        self._entries: list[tuple[Any, str, Any]] = []
        try:
            registry, key = attention_lookup(model)
        except (AttributeError, IndexError, TypeError, StopIteration):  # no attention layer a table knows
            return
        if isinstance(registry, Mapping):
            self._entries.append((registry, key, registry.get(key, MISSING)))

    def _changed(self) -> list[tuple[str, Any, str, Any, Any]]:
        """``(label, owner, name, value then, value now)`` of every name whose function is not what it was (an
        owner that is a registry: its entry ``name``)."""
        out = []
        for label, owner, name, then in self._snapshot.changed():
            now = vars(owner).get(name, MISSING)
            if _function(now) is not _function(then):
                out.append((label, owner, name, then, now))
        for registry, key, then in self._entries:
            now = registry.get(key, MISSING)
            if _function(now) is not _function(then):
                out.append((type(registry).__name__, registry, key, then, now))
        return out

    def changes(self) -> list[str]:
        """``label.name`` of every name whose function is not what it was when this was taken, for messages."""
        return [f"{label}.{name}" for label, _, name, _, _ in self._changed()]

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Inside: every name's function as it was when this was taken (where a tap stands in for the name now, the
        function the tap calls); after, even after an error: as it was before."""
        undo: list[Callable[[], None]] = []
        try:
            for _, owner, name, then, now in self._changed():
                tapped = tap_of(now)
                if tapped is not None and then is not MISSING:
                    undo.append(functools.partial(setattr, tapped, "original", tapped.original))
                    tapped.original = _function(then)
                elif isinstance(owner, Mapping):  # its own entry put back exactly after (none: none)
                    undo.append(functools.partial(set_own_entry, owner, name, own_entry(owner, name)))
                    if then is MISSING:
                        set_own_entry(owner, name, MISSING)
                    else:
                        owner[name] = _function(then)
                else:
                    undo.append(functools.partial(put, owner, name, now))
                    put(owner, name, then)
            yield
        finally:
            for step in reversed(undo):
                step()


def _function(value: Any) -> Any:
    """What calling ``value`` runs, a tap looked through (the function it stands in for)."""
    tapped = tap_of(value)
    return value if tapped is None else tapped.original


@contextlib.contextmanager
def apply_candidate(before: SideNames | None, model: Any, path: str, *, names: bool = False
                    ) -> Iterator[tuple[Any, SideNames | None]]:
    """Apply ``path`` to ``model`` for the length of the context over the names ``before`` holds (taken before any
    path was applied: another path's own assignments stay out of it). Yields its ``AppliedPath`` and, with ``names``
    (a caller that runs the other side while this one is applied), its :class:`SideNames`, else None; ``before`` None
    (no other path applied in this process): ``apply_path``'s, and None."""
    if before is None:
        with apply_path(model, path) as applied:
            yield applied, None
        return
    with before.entered(), apply_path(model, path) as applied:
        yield applied, SideNames(model) if names else None


@contextlib.contextmanager
def apply_paths(reference_model: Any, reference: str, candidate_model: Any, candidate: str
                ) -> Iterator[tuple[Any, Any, SideNames, SideNames]]:
    """Apply ``reference`` to ``reference_model`` and ``candidate`` to ``candidate_model`` for the length of the
    context, the candidate's over the names as they were before either (:func:`apply_candidate`). Yields
    ``(reference's AppliedPath, candidate's AppliedPath, reference's SideNames, candidate's SideNames)``: run each
    side inside its names' :meth:`SideNames.entered` — and build an oracle judge of the reference inside the
    reference's, as it takes the names its semantics look up when it is built (``ulptrace.verdicts.OracleJudge``)."""
    before = SideNames(reference_model)
    with apply_path(reference_model, reference) as ref_applied:
        ref_names = SideNames(reference_model)
        with apply_candidate(before, candidate_model, candidate, names=True) as (cand_applied, cand_names):
            yield ref_applied, cand_applied, ref_names, cand_names
