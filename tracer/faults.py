"""Fault injection: a candidate that differs from the reference at exactly one place.

``inject_fault(model, site, step, index, ulps)`` moves one element of one site's output at one
step by ``ulps`` representable values, where the site is observed, so everything upstream is
untouched and everything downstream inherits the change. It validates a tracing setup end to end
(does the onset land exactly there?) and is available as the path ``fault:SITE@STEP[+ULPS]``,
e.g. ``ulptrace onset --candidate 'fault:layers.1.mlp.glu@2+1'``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from ulptrace.sites import GDN_FUNCTIONS, Site, attention_lookup, site_table, submodule
from ulptrace.taps import Handle, tap
from ulptrace.ulp import next_down, next_up


def _nudge(t: torch.Tensor, index: tuple[int, ...] | int, ulps: int) -> torch.Tensor:
    out = t.clone()
    flat = out.view(-1) if isinstance(index, int) else None
    target = flat if flat is not None else out
    value = target[index].reshape(1)
    step = next_up if ulps > 0 else next_down
    for _ in range(abs(ulps)):
        value = step(value)
    target[index] = value[0]
    return out


class Fault:
    """An installed fault; ``undo()`` removes it. ``hits`` counts how often it fired (expect 1)."""

    def __init__(self, site: Site, step: int, index: Any, ulps: int) -> None:
        self.site, self.step, self.index, self.ulps = site, step, index, ulps
        self.hits = 0
        self._current = -1
        self._calls = 0
        self._handles: list[Any] = []
        self.info = {"fault": f"{site.name}@{step}{ulps:+d} ulp at index {index}"}

    def _due(self) -> bool:
        if self._current == self.step and self._calls == 0:
            self._calls += 1
            self.hits += 1
            return True
        return False

    def _count_step(self, module: Any, args: Any) -> None:
        self._current += 1
        self._calls = 0

    def verify(self) -> None:
        """Raise ``ValueError`` when the model ran but the fault never fired (e.g. its step was never
        reached, or the site never executed); the path layer calls this when the path is undone."""
        if self._current >= 0 and self.hits == 0:
            ran = self._current + 1
            raise ValueError(
                f"fault {self.site.name}@{self.step} never fired: the model ran {ran} forward call(s) "
                f"(steps 0..{ran - 1}), so nothing was perturbed"
                + (f"; step {self.step} is beyond the last step {ran - 1}" if self.step >= ran else
                   f"; {self.site.name} did not execute at step {self.step}")
            )

    def undo(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []

    def __enter__(self) -> Fault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def inject_fault(model: Any, site: str, step: int, index: tuple[int, ...] | int = 0, ulps: int = 1) -> Fault:
    """Perturb ``site``'s output at ``step`` (0 = prefill) at ``index`` by ``ulps`` ULPs.

    ``index`` is a flat index or a full index tuple. Raises ``KeyError`` for a site the model does
    not have (naming a few that it does) and ``ValueError`` for an observation point that cannot
    be altered (states, residual taken from a norm's input).
    """
    sites = {s.name: s for s in site_table(model, warn=False)}
    if site not in sites:
        near = [n for n in sites if n.split(".")[-1] == site.split(".")[-1]][:5] or list(sites)[:5]
        raise KeyError(f"model {type(model).__name__} has no site {site!r}; e.g. {', '.join(near)}")
    spec = sites[site]
    fault = Fault(spec, step, index, ulps)
    fault._handles.append(model.register_forward_pre_hook(fault._count_step))
    obs = spec.out
    module = submodule(model, obs.module) if obs.module else model
    if obs.at == "out":
        def post(m: Any, args: Any, output: Any) -> Any:
            if not fault._due():
                return None
            if isinstance(output, torch.Tensor):
                return _nudge(output, index, ulps)
            return (_nudge(output[0], index, ulps), *output[1:])

        fault._handles.append(module.register_forward_hook(post))
    elif obs.at == "in0":
        def pre(m: Any, args: tuple) -> Any:
            return (_nudge(args[0], index, ulps), *args[1:]) if fault._due() else None

        fault._handles.append(module.register_forward_pre_hook(pre))
    elif obs.at in ("tap.g", "tap.beta"):
        key = obs.at.removeprefix("tap.")
        namespace = sys.modules[type(module).__module__]
        active: list[bool] = []  # non-empty while this GatedDeltaNet module runs

        def enter(m: Any, args: Any) -> None:
            active.append(True)

        def leave(m: Any, args: Any, output: Any) -> None:
            active.pop()

        fault._handles.append(module.register_forward_pre_hook(enter))
        fault._handles.append(module.register_forward_hook(leave))

        def transform(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if active and key in kwargs and fault._due():
                kwargs = {**kwargs, key: _nudge(kwargs[key], index, ulps)}
            return args, kwargs

        for name in GDN_FUNCTIONS:
            if hasattr(namespace, name):
                fault._handles.append(tap(namespace, name).add_transform(transform))
    elif obs.at == "tap.core" and hasattr(module, "scaling"):
        fault._handles.append(_attention_result_fault(model, module, fault))
    else:
        raise ValueError(f"site {site!r} is observed at {obs.at!r}, where ulptrace cannot inject a fault")
    return fault


def _attention_result_fault(model: Any, module: Any, fault: Fault) -> Handle:
    namespace, name = attention_lookup(model)

    def result(args: tuple, kwargs: dict, out: Any) -> Any:
        if args and args[0] is module and fault._due():
            return (_nudge(out[0], fault.index, fault.ulps), *out[1:])
        return out

    return tap(namespace, name).add_result_transform(result)


def parse_fault(spec: str) -> tuple[str, int, int]:
    """``fault:SITE@STEP[+ULPS]`` -> ``(site, step, ulps)``; ``KeyError`` saying the expected form."""
    body = spec.removeprefix("fault:")
    site, _, rest = body.partition("@")
    step_text, sign, ulp_text = rest.partition("+") if "+" in rest else rest.partition("-")
    try:
        step = int(step_text)
        ulps = int(ulp_text) * (-1 if sign == "-" else 1) if ulp_text else 1
    except ValueError:
        raise KeyError(f"path {spec!r}: expected 'fault:SITE@STEP' or 'fault:SITE@STEP+ULPS'") from None
    if not site or step < 0 or ulps == 0:
        raise KeyError(f"path {spec!r}: expected 'fault:SITE@STEP[+ULPS]' with a site name, a step >= 0 and a "
                       "non-zero ULP count")
    return site, step, ulps


def fault_path(spec: str) -> Any:
    """The path function for ``fault:SITE@STEP[+ULPS]`` (index 0 of the flattened output)."""
    site, step, ulps = parse_fault(spec)
    return lambda model: inject_fault(model, site, step, 0, ulps)
