"""Paths ulptrace did not write, one name away: ``compile`` / ``compile:emulate`` (torch.compile with
Inductor), ``liger`` (Liger-Kernel) and ``hf:fla`` (flash-linear-attention's GatedDeltaNet scan).

``ulptrace.paths`` imports this module only when one of these names is resolved; this module imports
Liger-Kernel and flash-linear-attention only when their path is applied, so nothing here costs anything
until it is asked for. Each path returns a handle whose ``undo()`` restores everything it changed, and whose
``info`` (the report's ``path_info``) says what ran.

- ``compile``, ``compile:emulate``: the whole model compiled in place (``model.compile(dynamic=False)``, as
  users do, with static shapes), so Inductor fuses across sites as it does in production; ``compile:emulate`` with
  ``torch._inductor.config.emulate_precision_casts`` set (a process-global setting, set while the path is
  applied and restored on undo). Observing a site inside a compiled graph makes its value a graph output,
  and Inductor then materialises (rounds) values it would otherwise keep in FP32 inside a fused kernel —
  observing would change what is measured. So under compile ulptrace records only the sites whose output
  and oracle inputs are materialised anyway: operands and results of the kernels Inductor calls out to
  (every ``nn.Linear``, the attention kernel), not norms, residual adds or the GatedDeltaNet internals,
  which Inductor fuses (:func:`compile_observable_sites`, recorded in the run's ``selection``). The
  observation check (``onset --check-observation``) re-runs the compiled candidate untraced and proves its
  logits bitwise unchanged.
- ``liger``: Liger-Kernel's ``apply_liger_kernel_to_<family>`` for the model's architecture
  (:data:`ulptrace.families.LIGER_PATCHES`), applied to the instance with ``fused_linear_cross_entropy`` and
  ``cross_entropy`` off (inference: the logits are the site). Liger replaces module-level classes and
  functions of the modeling module (``Qwen3_5RMSNorm``, ``Qwen3_5MLP``, ``apply_rotary_pos_emb``) as well as
  the instance's forwards; undo restores every attribute of every module and class it touched.
- ``hf:fla`` (``hf:fla=DIR``): HF with flash-linear-attention's ``chunk_gated_delta_rule`` /
  ``fused_recurrent_gated_delta_rule`` in place of HF's torch scan, swapped in through ``ulptrace.taps`` for
  this model's GatedDeltaNet layers only. FLA comes from ``DIR`` (or ``ULPTRACE_FLA_DIR``), a folder kept off
  the import path so HF's import-time binding never sees it, or from the environment when it is importable
  there — in which case HF bound FLA at import and the reference must be forced back onto HF's torch scan:
  ``hf:scan=torch`` does that, and ``onset`` runs it as the reference of an ``hf:fla`` candidate whose
  reference is ``hf`` (``ulptrace.run.paired_reference``). Both report which scan ran (``path_info``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import shutil
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ulptrace.attributes import AttributeSnapshot

# -- optional dependencies -----------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    """A package a path needs: its import name, its distribution and the ulptrace extra that installs it."""

    module: str
    distribution: str
    extra: str

    def install_hint(self) -> str:
        return f"pip install 'ulptrace[{self.extra}]' (or pip install {self.distribution})"


LIGER = Requirement("liger_kernel", "liger-kernel", "liger")
FLA = Requirement("fla", "flash-linear-attention", "fla")
FLA_DIR_ENV = "ULPTRACE_FLA_DIR"
"""Environment variable naming a folder FLA was installed into with ``pip install --target`` (kept off the
import path, so HF keeps its torch scan and only the ``hf:fla`` candidate runs FLA)."""


class MissingDependency(ValueError):
    """A path whose package is not installed here; the message says what to install (CLI: exit 2)."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fla_folder(folder: str | None = None) -> str | None:
    """The folder FLA is taken from: ``folder``, else ``$ULPTRACE_FLA_DIR``, else None (the environment)."""
    return folder or os.environ.get(FLA_DIR_ENV) or None


def unavailable(name: str, *, folder: str | None = None) -> str | None:
    """Why path ``name`` cannot run here (what to install), or None when it can."""
    if name in ("compile", "compile:emulate"):
        return _compile_unavailable()
    if name == "liger":
        if not _importable(LIGER.module):
            return f"path 'liger' needs Liger-Kernel, which is not installed here: {LIGER.install_hint()}"
        return None
    if name == "hf:fla" or name.startswith("hf:fla="):
        where = fla_folder(folder)
        if where is not None:
            if not os.path.isdir(os.path.join(where, FLA.module)):
                return (f"path {name!r}: the folder {where!r} holds no flash-linear-attention package "
                        f"(expected {os.path.join(where, FLA.module)}; install it there with "
                        f"pip install --target {where} flash-linear-attention fla-core)")
            return None
        if not _importable(FLA.module):
            return (f"path {name!r} needs flash-linear-attention, which is not installed here: {FLA.install_hint()}, "
                    f"or install it into a folder of its own (pip install --target DIR flash-linear-attention "
                    f"fla-core) and name it with {FLA_DIR_ENV}=DIR or hf:fla=DIR")
        return None
    return None


def require(name: str, *, folder: str | None = None) -> None:
    """Raise :class:`MissingDependency` naming what to install when path ``name`` cannot run here."""
    why = unavailable(name, folder=folder)
    if why is not None:
        raise MissingDependency(why)


def _compile_unavailable() -> str | None:
    try:
        import torch._dynamo

        if not torch._dynamo.is_dynamo_supported():
            return "torch.compile is not supported on this Python/platform (torch._dynamo.is_dynamo_supported())"
    except (ImportError, RuntimeError, AttributeError) as exc:  # pragma: no cover - a broken torch install
        return f"torch.compile is not usable here ({type(exc).__name__}: {exc})"
    if _cxx() is None and not _importable("triton"):
        return ("torch.compile's Inductor needs a C++ compiler on the CPU (g++ or clang++ on PATH, or $CXX) or "
                "triton on a GPU; neither was found")
    return None


def _cxx() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def availability() -> dict[str, str | None]:
    """Path name -> None (available here) or why not; for ``ulptrace paths``."""
    return {name: unavailable(name) for name in ("compile", "compile:emulate", "liger", "hf:fla", "hf:scan=torch")}


# -- torch.compile ---------------------------------------------------------------------------------

COMPILE_OBSERVED = ("sites whose output and oracle inputs are operands or results of the kernels Inductor "
                    "calls out to (nn.Linear matmuls, the attention kernel) or what the model returns: "
                    "materialised in the compiled program anyway, so recording them does not change what it "
                    "computes; norms, residual adds, "
                    "gates and the GatedDeltaNet scan are fused by Inductor and not observed")
_ATTENTION_TAPS = ("tap.query", "tap.key", "tap.value", "tap.mask", "tap.core")


def _materialised(model: Any, obs: Any) -> bool:
    """Whether observation point ``obs`` is a value Inductor materialises anyway: an ``nn.Linear``'s input
    or output (an extern matmul's operand or result), or the attention kernel's q/k/v/mask/output."""
    import torch
    from ulptrace.families import is_gated_deltanet
    from ulptrace.sites import submodule

    try:
        module = submodule(model, obs.module)
    except AttributeError:
        return False
    if obs.at in ("in0", "out") and isinstance(module, torch.nn.Linear):
        return True
    if obs.module == "" and obs.at == "out":  # what the compiled program returns
        return True
    return obs.at in _ATTENTION_TAPS and not is_gated_deltanet(module)


def compile_observable_sites(model: Any, sites: Iterable[Any]) -> list[Any]:
    """The sites of ``sites`` that can be recorded under ``torch.compile`` without changing the compiled
    numerics: output and every oracle input materialised (:data:`COMPILE_OBSERVED`)."""
    return [s for s in sites if _materialised(model, s.out) and all(_materialised(model, o) for o in s.inputs.values())]


class CompiledModel:
    """The handle of ``compile`` / ``compile:emulate``: the model compiled in place; ``undo()`` puts back its
    eager forward and the global Inductor and dynamo settings."""

    def __init__(self, model: Any, *, emulate: bool) -> None:
        import torch
        import torch._dynamo
        import torch._inductor.config as inductor_config
        from torch._dynamo.utils import counters
        from ulptrace.sdpa import lowered_error, pinned

        if pinned(model) != "default":
            raise lowered_error(pinned(model), "compile:emulate" if emulate else "compile")
        self._model = weakref.ref(model)
        self.emulate = emulate
        self._counters = counters
        self._before = self._count()
        self._saved = {
            (inductor_config, "emulate_precision_casts"): inductor_config.emulate_precision_casts,
            # a model recompiled past dynamo's limit silently runs eager: raise the limit while applied, and
            # fail rather than measure eager code under the name "compile"
            (torch._dynamo.config, "recompile_limit"): torch._dynamo.config.recompile_limit,
            (torch._dynamo.config, "fail_on_recompile_limit_hit"): torch._dynamo.config.fail_on_recompile_limit_hit,
            # dynamo does not guard on module hooks by default: a recorder's hooks added after a first compile
            # would silently never run (no records); guarded, adding or removing them recompiles
            (torch._dynamo.config, "skip_nnmodule_hook_guards"): torch._dynamo.config.skip_nnmodule_hook_guards,
        }
        inductor_config.emulate_precision_casts = emulate
        torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        self._had = model.__dict__.get("_compiled_call_impl")
        # the whole model, in place, as users do; with static shapes: by default dynamo recompiles a graph with
        # dynamic shapes once it has seen a second shape of a frame, and what it has seen depends on what the
        # process ran before (a second compile of the same model for the recorder's hooks would get dynamic
        # kernels where the first, untraced one got static ones, and other numerics); static, every graph is
        # compiled for the shapes it runs, the same traced or untraced, whatever ran before
        model.compile(dynamic=False)
        self.torch = torch.__version__
        self.active = True

    def _count(self) -> tuple[int, int]:
        return (int(self._counters["stats"].get("unique_graphs", 0)),
                int(sum(self._counters["graph_break"].values())))

    @property
    def info(self) -> dict[str, Any]:
        graphs, breaks = self._count()
        return {
            "compiler": "torch.compile (inductor)",
            "compiled": "the whole model in place (model.compile(dynamic=False): static shapes, a graph per shape)",
            "emulate_precision_casts": self.emulate,
            "graphs_compiled": graphs - self._before[0],
            "graph_breaks": breaks - self._before[1],
            "observed": COMPILE_OBSERVED,
            "torch": self.torch,
        }

    def undo(self) -> None:
        if not self.active:
            return
        model = self._model()
        if model is not None:
            model.__dict__["_compiled_call_impl"] = self._had
        for (owner, name), value in self._saved.items():
            setattr(owner, name, value)
        self.active = False


def compile_path(model: Any) -> CompiledModel:
    """``compile``: the model compiled in place with Inductor (``model.compile()``)."""
    return CompiledModel(model, emulate=False)


def compile_emulate_path(model: Any) -> CompiledModel:
    """``compile:emulate``: as ``compile``, with ``torch._inductor.config.emulate_precision_casts`` set."""
    return CompiledModel(model, emulate=True)


for _fn, _name in ((compile_path, "compile"), (compile_emulate_path, "compile:emulate")):
    _fn.require = (lambda name=_name: require(name))  # type: ignore[attr-defined]
    _fn.observable_sites = compile_observable_sites  # type: ignore[attr-defined]
    _fn.observed = COMPILE_OBSERVED  # type: ignore[attr-defined]
    _fn.lowers_attention = True  # type: ignore[attr-defined]  # Inductor lowers SDPA itself: --sdpa does not reach it


# -- what a library that patches HF may change (put back by ulptrace.attributes) ---------------------------


def _patchable_owners(model: Any) -> list[tuple[str, Any]]:
    """What a library that patches HF may change: every loaded ``transformers`` module and the classes it
    defines, ``torch.nn.functional`` (cross entropy), and every module instance of ``model``."""
    import torch.nn.functional

    owners: list[tuple[str, Any]] = []
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name == "transformers" or name.startswith("transformers.")):
            continue
        owners.append((name, module))
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                owners.append((f"{name}.{attr}", value))
    owners.append(("torch.nn.functional", torch.nn.functional))
    for path, sub in model.named_modules():
        owners.append((f"model.{path}" if path else "model", sub))
    return owners


# -- Liger-Kernel --------------------------------------------------------------------------------------

LIGER_OPTIONS = {"fused_linear_cross_entropy": False, "cross_entropy": False}
"""Liger options ulptrace sets (the rest keep Liger's defaults for the family): inference traces the logits,
so the fused linear cross entropy (which replaces the causal LM's forward) and the loss stay off."""


class LigerPatch:
    """The handle of ``liger``: Liger-Kernel's patch for the model's family; ``undo()`` restores every
    module-level class and function and every instance attribute it changed."""

    def __init__(self, model: Any) -> None:
        from ulptrace.families import LIGER_PATCHES

        require("liger")
        arch = type(model).__name__
        function_name = LIGER_PATCHES.get(arch)
        if function_name is None:
            known = ", ".join(sorted(LIGER_PATCHES))
            raise ValueError(f"path 'liger': ulptrace knows no Liger-Kernel patch for {arch} (it has one for: {known})")
        transformers_api = importlib.import_module("liger_kernel.transformers")
        apply = getattr(transformers_api, function_name, None)
        if apply is None:
            monkey = importlib.import_module("liger_kernel.transformers.monkey_patch")
            apply = getattr(monkey, function_name, None)
        if apply is None:
            raise ValueError(f"path 'liger': this Liger-Kernel ({_version('liger-kernel')}) has no {function_name} "
                             f"for {arch}")
        params = inspect.signature(apply).parameters
        self.options = {k: v for k, v in LIGER_OPTIONS.items() if k in params}
        self._snapshot = AttributeSnapshot(_patchable_owners(model))
        try:
            apply(model=model, **self.options)
        except BaseException:
            self._snapshot.restore()
            raise
        self.function = f"liger_kernel.transformers.{function_name}"
        self.version = _version("liger-kernel")
        changed = self._snapshot.changes()
        self.patched_module_level = [c for c in changed if not c.startswith("model")]
        self.patched_instances = sorted({c.rsplit(".", 1)[0] for c in changed if c.startswith("model")})
        self.active = True

    @property
    def info(self) -> dict[str, Any]:
        return {"library": "liger-kernel", "version": self.version, "function": self.function,
                "options": dict(self.options), "module_level": list(self.patched_module_level),
                "instances_patched": len(self.patched_instances)}

    def undo(self) -> None:
        if self.active:
            self._snapshot.restore()
            self.active = False


def liger_path(model: Any) -> LigerPatch:
    """``liger``: Liger-Kernel's patch for the model's family (``ulptrace.families.LIGER_PATCHES``)."""
    return LigerPatch(model)


liger_path.require = lambda: require("liger")  # type: ignore[attr-defined]


def _version(distribution: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(distribution)
    except (ImportError, ValueError):  # PackageNotFoundError is an ImportError
        return None


# -- the GatedDeltaNet scan: flash-linear-attention or HF's torch fallback, per model ----------------------

SCAN_FUNCTIONS = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
                  "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}
"""HF's module-level scan functions (``ulptrace.sites.GDN_FUNCTIONS``) and the FLA kernel each stands for."""


def scan_binding(function: Any) -> str:
    """What an HF scan function runs: ``"torch"`` (HF's fallback) or the dotted name of the
    flash-linear-attention kernel HF bound at import (beneath an ulptrace tap)."""
    bound = _fla_callable(function)
    return "torch" if bound is None else f"{bound.__module__}.{getattr(bound, '__name__', '?')}"


def _beneath(function: Any) -> Iterator[Any]:
    """``function`` and what it wraps, outermost first: beneath an ulptrace tap its original; beneath the function
    module that the hub-kernels package makes of a function (transformers 5.25 decorates its scan and conv functions
    with ``use_kernel_func_from_hub``: an ``nn.Module`` whose class's ``forward`` calls the function it closes over as
    ``func`` unless a hub kernel was kernelized for it) that function; beneath ``functools.wraps`` its ``__wrapped__``."""
    import torch

    seen: set[int] = set()
    while function is not None and id(function) not in seen:
        seen.add(id(function))
        yield function
        tapped = getattr(function, "__ulptrace_tap__", None)
        if tapped is not None:
            function = tapped.original
        elif isinstance(function, torch.nn.Module):
            forward = type(function).forward
            cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=True))
            function = cells["func"].cell_contents if "func" in cells else None
        else:
            function = getattr(function, "__wrapped__", None)


def _fla_callable(function: Any) -> Any:
    """The FLA function ``function`` is or dispatches to (HF's import-time binding keeps it in a closure),
    or None."""
    def is_fla(f: Any) -> bool:
        return callable(f) and str(getattr(f, "__module__", "") or "").split(".")[0] == FLA.module

    for layer in _beneath(function):
        if is_fla(layer):
            return layer
        for cell in getattr(layer, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if is_fla(value):
                return value
    return None


def torch_fallback(function: Any) -> Any:
    """HF's torch implementation beneath ``function`` (beneath an ulptrace tap, the hub-kernels function module and
    HF's FLA dispatch): the innermost function it wraps."""
    *_, innermost = _beneath(function)
    return innermost


class _Route:
    """Which scan the GatedDeltaNet layers of one model run: FLA kernels or HF's torch fallback."""

    def __init__(self, kind: str, impls: dict[str, Callable[..., Any]], describe: dict[str, str]) -> None:
        self.kind = kind
        self.impls = impls
        self.describe = describe
        self.calls = dict.fromkeys(impls, 0)


_STACK: list[_Route] = []  # the route of the GatedDeltaNet module running now (innermost last)


class _Router:
    """The implementation of one scan function's tap while an ``hf:fla`` or ``hf:scan=torch`` path is applied
    anywhere: a call made from a GatedDeltaNet layer of such a path's model runs that path's scan; any other
    call runs what HF bound (so a model without these paths runs as it would without ulptrace)."""

    def __init__(self, namespace: Any, name: str) -> None:
        from ulptrace.taps import tap

        self.name = name
        self.tap = tap(namespace, name)
        self.original = self.tap.original
        self.users = 0
        self.handle = self.tap.set_impl(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        route = _STACK[-1] if _STACK else None
        if route is None or self.name not in route.impls:
            return self.original(*args, **kwargs)
        route.calls[self.name] += 1
        return route.impls[self.name](*args, **kwargs)


_ROUTERS: dict[tuple[int, str], _Router] = {}


def _router(namespace: Any, name: str) -> tuple[_Router, Callable[[], None]]:
    key = (id(namespace), name)
    router = _ROUTERS.get(key)
    if router is None:
        router = _ROUTERS[key] = _Router(namespace, name)
    router.users += 1

    def release() -> None:
        router.users -= 1
        if router.users == 0:
            router.handle.remove()
            _ROUTERS.pop(key, None)

    return router, release


def _gdn_layers(model: Any, path: str) -> list[Any]:
    from ulptrace.families import is_gated_deltanet

    layers = [m for m in model.modules() if is_gated_deltanet(m)]
    if not layers:
        raise ValueError(f"path {path!r}: {type(model).__name__} has no GatedDeltaNet layer whose scan it could replace")
    return layers


class ScanRoute:
    """The handle of ``hf:fla`` and ``hf:scan=torch``: this model's GatedDeltaNet layers run the given scan
    (hooks mark their calls; the scan functions' taps route them); ``undo()`` removes hooks and routing."""

    def __init__(self, model: Any, path: str, kind: str, kernels: dict[str, Callable[..., Any]] | None = None,
                 source: str | None = None) -> None:
        from ulptrace.sites import GDN_FUNCTIONS

        layers = _gdn_layers(model, path)
        namespace = sys.modules[type(layers[0]).__module__]
        self.path = path
        self.kind = kind
        self.source = source
        self._undo: list[Callable[[], None]] = []
        impls: dict[str, Callable[..., Any]] = {}
        describe: dict[str, str] = {}
        self.hf_binding: dict[str, str] = {}
        try:
            for name in GDN_FUNCTIONS:
                if not hasattr(namespace, name):
                    continue
                self.hf_binding[name] = scan_binding(getattr(namespace, name))
                router, release = _router(namespace, name)
                self._undo.append(release)
                if kind == "fla":
                    assert kernels is not None
                    kernel = kernels[SCAN_FUNCTIONS[name]]
                    impls[name] = _fla_call(kernel)
                    describe[name] = f"{kernel.__module__}.{kernel.__name__}"
                else:
                    impls[name] = torch_fallback(router.original)
                    describe[name] = f"torch ({impls[name].__module__}.{impls[name].__name__})"
            self._route = _Route(kind, impls, describe)
            for layer in layers:
                self._undo.append(layer.register_forward_pre_hook(self._enter).remove)
                self._undo.append(layer.register_forward_hook(self._exit, always_call=True).remove)
        except BaseException:
            self.undo()
            raise
        self.active = True

    def _enter(self, module: Any, args: Any) -> None:
        _STACK.append(self._route)

    def _exit(self, module: Any, args: Any, output: Any) -> None:
        if _STACK and _STACK[-1] is self._route:
            _STACK.pop()

    @property
    def info(self) -> dict[str, Any]:
        scan = {name: {"ran": self._route.describe[name], "calls": self._route.calls[name]}
                for name in self._route.impls}
        out: dict[str, Any] = {"gdn_scan": "flash-linear-attention" if self.kind == "fla" else "torch (HF's fallback)",
                               "functions": scan, "hf_bound_at_import": dict(self.hf_binding)}
        if self.kind == "fla":
            out["fla_source"] = self.source
            out["versions"] = {d: _version(d) for d in ("flash-linear-attention", "fla-core")}
        return out

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.active = False


def _fla_call(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """HF's scan call convention mapped onto FLA's (contiguous operands, FLA's keyword names); the
    prototype of bench/fla_path.py, used on the H200."""
    def call(query: Any, key: Any, value: Any, g: Any = None, beta: Any = None, *args: Any, initial_state: Any = None,
             output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> Any:
        return kernel(query.contiguous(), key.contiguous(), value.contiguous(), g=g.contiguous(),
                      beta=beta.contiguous(), initial_state=initial_state, output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    call.__name__ = getattr(kernel, "__name__", "fla_kernel")
    return call


def load_fla(folder: str | None = None) -> tuple[dict[str, Callable[..., Any]], str]:
    """FLA's two scan kernels and where they came from: ``folder`` (or ``$ULPTRACE_FLA_DIR``) put on the
    import path only for the import, else the environment."""
    folder = fla_folder(folder)
    require("hf:fla", folder=folder)
    added = False
    if folder is not None and folder not in sys.path:
        sys.path.append(folder)
        added = True
    try:
        ops = importlib.import_module("fla.ops.gated_delta_rule")
    finally:
        if added:  # off the path again: a modeling module imported later must not bind FLA at import
            sys.path.remove(folder)
    kernels = {name: getattr(ops, name) for name in SCAN_FUNCTIONS.values()}
    source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ops.__file__))))
    return kernels, (f"{source} ({FLA_DIR_ENV} / hf:fla=DIR)" if folder is not None else f"{source} (importable)")


def fla_path(model: Any, folder: str | None = None) -> ScanRoute:
    """``hf:fla``: this model's GatedDeltaNet layers run flash-linear-attention's scan kernels."""
    kernels, source = load_fla(folder)
    return ScanRoute(model, "hf:fla", "fla", kernels, source)


def fla_path_in(folder: str) -> Callable[[Any], ScanRoute]:
    """``hf:fla=DIR``: as ``hf:fla``, FLA taken from ``folder``."""
    def apply(model: Any) -> ScanRoute:
        kernels, source = load_fla(folder)
        return ScanRoute(model, f"hf:fla={folder}", "fla", kernels, source)

    apply.require = lambda: require(f"hf:fla={folder}", folder=folder)  # type: ignore[attr-defined]
    apply.reference = "hf:scan=torch"  # type: ignore[attr-defined]
    return apply


def torch_scan_path(model: Any) -> ScanRoute:
    """``hf:scan=torch``: this model's GatedDeltaNet layers run HF's torch scan, also where HF bound
    flash-linear-attention at import (the reference of an ``hf:fla`` candidate)."""
    return ScanRoute(model, "hf:scan=torch", "torch")


fla_path.require = lambda: require("hf:fla")  # type: ignore[attr-defined]
fla_path.reference = "hf:scan=torch"  # type: ignore[attr-defined]
"""``onset`` runs this path as the reference of an ``hf:fla`` candidate compared with ``hf``."""
