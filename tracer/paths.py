"""Paths: named ways of executing a model, resolved by name at run time.

A path is a function ``fn(model)`` that changes how ``model`` executes, in place, and returns
something that undoes it (an object with ``undo()`` or ``remove()``, a context manager, a
callable, or None when nothing needs undoing). ``hf`` is the reference; ``hf:attn=<impl>``
switches HF's attention implementation; ``kernels:faithful`` / ``kernels:fused`` inject
ulptrace's own kernels (resolved by import string, so the core never imports ``ulptrace.kernels``);
``fault:SITE@STEP[+ULPS]`` moves one element of one site (``ulptrace.faults``);
and any ``package.module:function`` names a user's own patching function — the way to trace your
own kernels without writing code against ulptrace.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PathFn = Callable[[Any], Any]


@dataclass(frozen=True)
class PathSpec:
    name: str
    target: str | PathFn  # an import string "pkg.mod:function" or the function itself
    description: str


_REGISTRY: dict[str, PathSpec] = {}
_RESERVED = ("hf", "kernels", "compile", "fault")  # prefixes of built-in names, never import strings


def register_path(name: str, target: str | PathFn, description: str = "") -> None:
    """Register ``name`` (e.g. ``"mykernels:v2"``) for ``target`` (a function or import string)."""
    _REGISTRY[name] = PathSpec(name, target, description)


def list_paths() -> dict[str, str]:
    """Registered path names and their descriptions (``hf:attn=<impl>`` and ``module:function`` also work)."""
    return {name: spec.description for name, spec in _REGISTRY.items()}


def _set_attention(impl: str) -> PathFn:
    def apply(model: Any) -> Callable[[], None]:
        previous = model.config._attn_implementation
        model.set_attn_implementation(impl)
        return lambda: model.set_attn_implementation(previous)

    apply.attention = impl  # type: ignore[attr-defined]  # the HF attention implementation the path runs
    return apply


class PathError(Exception):
    """A path that failed in the user's own code: one line naming the path, plus the user's frames."""

    def __init__(self, message: str, frames: str = "") -> None:
        super().__init__(message)
        self.frames = frames


def _library_dirs() -> tuple[str, ...]:
    import ulptrace

    dirs = {os.path.dirname(os.path.abspath(ulptrace.__file__))}
    for mod in ("ulptrace.probes", "ulptrace.kernels"):
        loaded = sys.modules.get(mod)
        if loaded is not None and getattr(loaded, "__file__", None):
            dirs.add(os.path.dirname(os.path.abspath(loaded.__file__)))
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path))
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``exc``'s traceback in the user's own code: outside ulptrace, the standard
    library and installed packages (site-packages)."""
    library = _library_dirs()
    frames = traceback.extract_tb(exc.__traceback__)
    return [f for f in frames if f.filename and not f.filename.startswith("<")
            and not os.path.abspath(f.filename).startswith(library)
            and "site-packages" not in f.filename and "dist-packages" not in f.filename]


def format_user_error(exc: BaseException) -> str:
    """The user's frames of ``exc`` formatted like a traceback (without ulptrace's or torch's frames)."""
    frames = user_frames(exc)
    return "".join(traceback.format_list(frames)).rstrip() if frames else ""


_ACTIVE_USER_PATHS: list[str] = []  # user paths currently applied, innermost last (for error messages)


def active_user_paths() -> list[str]:
    """Names of the user paths (``package.module:function``) applied right now."""
    return list(_ACTIVE_USER_PATHS)


def is_user_path(name: str) -> bool:
    """Whether path ``name`` is the user's own code (``package.module:function``, or registered from outside
    ulptrace) rather than one of ulptrace's or HF's."""
    spec = _REGISTRY.get(name)
    if spec is not None:
        target = spec.target
        module = target.partition(":")[0] if isinstance(target, str) else getattr(target, "__module__", "") or ""
        return not (module == "ulptrace" or module.startswith("ulptrace.") or module == __name__)
    return not name.startswith(("hf:", "fault:")) and ":" in name


def registration_to_send(name: str) -> PathSpec | None:
    """The registration of path ``name`` made in this process from outside ulptrace (``register_path``), for a helper
    process that runs it (``--concurrent``'s reference process, the judging processes): a new process imports
    ulptrace's own registrations only. None for any other name. A function it cannot import there — one defined in
    an interactive session's ``__main__``, a lambda or a nested function — is refused here, naming the way out."""
    spec = _REGISTRY.get(name)
    if spec is None or not is_user_path(name):
        return None
    target = spec.target
    if not isinstance(target, str):
        module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
        interactive = module == "__main__" and not hasattr(sys.modules.get("__main__"), "__file__")
        if module is None or interactive or "<" in qualname:
            raise ValueError(f"path {name!r} is registered here as {qualname or target!r}"
                             f"{' from an interactive session' if interactive else ''}, which a helper process "
                             "cannot import: register it as an import string ('package.module:function') or from a "
                             "module's top level, or run without --concurrent/--judge-workers")
    return spec


def _check_import_string(target: str) -> tuple[str, str]:
    module_name, colon, attr = target.partition(":")
    parts = module_name.split(".")
    if not colon or not module_name or not attr or not all(p.isidentifier() for p in parts) \
            or not all(a.isidentifier() for a in attr.split(".")):
        problem = ("the module name is empty" if not module_name else
                   "the function name is empty" if not attr else
                   f"{module_name!r} is not a dotted module name" if not all(p.isidentifier() for p in parts) else
                   f"{attr!r} is not a function name")
        raise KeyError(f"path {target!r}: expected package.module:function, but {problem}")
    return module_name, attr


def _import(target: str) -> PathFn:
    module_name, attr = _check_import_string(target)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        cwd = "" if "" in sys.path or os.getcwd() in sys.path else " (the current directory is not on sys.path)"
        raise KeyError(f"path {target!r}: cannot import module {module_name!r} ({exc}){cwd}") from None
    except Exception as exc:  # the user's module raised while being imported
        raise PathError(f"path {target!r}: importing module {module_name!r} raised {type(exc).__name__}: {exc}",
                        format_user_error(exc)) from exc
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise KeyError(f"path {target!r}: module {module_name!r} has no function {attr!r}")
    return fn


def resolve_path(name: str) -> PathFn:
    """The function for path ``name``; raises ``KeyError`` listing the known names, and
    ``ulptrace.thirdparty.MissingDependency`` (a ``ValueError``) naming what to install for a path whose
    package is missing (a path function's ``require()``, called here)."""
    spec = _REGISTRY.get(name)
    if spec is not None:
        return _required(_import(spec.target) if isinstance(spec.target, str) else spec.target)
    if name.startswith("hf:fla="):  # flash-linear-attention from a folder of its own
        from ulptrace.thirdparty import fla_path_in

        return _required(fla_path_in(name.split("=", 1)[1]))
    if name.startswith("hf:attn="):
        return _set_attention(name.split("=", 1)[1])
    if name.startswith("fault:"):
        from ulptrace.faults import fault_path

        return fault_path(name)
    prefix = name.partition(":")[0]
    if ":" in name and prefix not in _RESERVED:
        return _import(name)
    known = ", ".join(list(_REGISTRY) + ["hf:attn=<eager|sdpa|...>", "fault:SITE@STEP[+ULPS]",
                                         "package.module:function"])
    raise KeyError(f"unknown path {name!r}: expected one of {known}")


def _required(fn: PathFn) -> PathFn:
    require = getattr(fn, "require", None)
    if callable(require):
        require()
    return fn


def unavailable(name: str) -> str | None:
    """Why path ``name`` cannot run here (what to install), or None; for the paths of libraries ulptrace
    did not write (``ulptrace.thirdparty``), None for every other name."""
    spec = _REGISTRY.get(name)
    target = spec.target if spec is not None else None
    if name.startswith("hf:fla=") or (isinstance(target, str) and target.startswith("ulptrace.thirdparty:")):
        from ulptrace import thirdparty

        return thirdparty.unavailable(name, folder=name.split("=", 1)[1] if name.startswith("hf:fla=") else None)
    return None


class Applied:
    """An applied path; ``undo()`` restores the model (idempotent)."""

    def __init__(self, name: str, undo: Any) -> None:
        self.name = name
        self._handle = undo
        self._undo = undo

    @property
    def info(self) -> dict[str, Any]:
        """What the path reports about itself (e.g. which implementation ran), read now: the handle's
        ``info`` dict, else its public plain-data attributes."""
        handle = self._handle
        if isinstance(getattr(handle, "info", None), dict):
            return dict(handle.info)
        plain = (str, int, float, bool, type(None), dict, list, tuple)
        return {k: v for k, v in vars(handle).items() if not k.startswith("_") and isinstance(v, plain)} \
            if hasattr(handle, "__dict__") and not callable(handle) else {}

    def undo(self) -> None:
        undo, self._undo = self._undo, None
        if undo is None:
            return
        if self.name in _ACTIVE_USER_PATHS:
            _ACTIVE_USER_PATHS.remove(self.name)
        for method in ("undo", "remove", "__exit__"):
            if hasattr(undo, method):
                fn = getattr(undo, method)
                fn(None, None, None) if method == "__exit__" else fn()
                return
        if callable(undo):
            undo()

    def __enter__(self) -> Applied:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        handle = self._handle
        if isinstance(exc, BaseException) and self.name in _ACTIVE_USER_PATHS \
                and not hasattr(exc, "ulptrace_path"):
            exc.ulptrace_path = self.name  # type: ignore[attr-defined]  # the CLI names the path in its message
        self.undo()
        # a path may check that it did its job (a fault that never fired): only after a clean run
        verify = getattr(handle, "verify", None)
        if exc_type is None and callable(verify):
            verify()


def apply_path(model: Any, name: str) -> Applied:
    """Apply path ``name`` to ``model`` in place; use the result as a context manager or call ``undo()``.

    Raises ``KeyError`` for an unknown path name, naming the known ones, and checks that the
    named attention implementation exists. A user's path function that raises gives a
    ``PathError`` naming the path, with the user's own frames. Used as a context manager, a path
    whose handle has ``verify()`` is checked on a clean exit (a fault that never fired raises).
    """
    fn = resolve_path(name)
    user = is_user_path(name)
    try:
        handle = fn(model)
    except KeyError as exc:  # e.g. HF's "not a valid attention implementation"
        message = exc.args[0] if exc.args else exc
        raise KeyError(f"path {name!r} cannot be applied: {message}") from None
    except Exception as exc:
        if not user:
            raise
        raise PathError(f"path {name!r} raised {type(exc).__name__} while patching the model: {exc}",
                        format_user_error(exc)) from exc
    if user:
        _ACTIVE_USER_PATHS.append(name)
    if hasattr(handle, "__enter__") and not hasattr(handle, "undo"):
        handle.__enter__()
    return Applied(name, handle)


register_path("hf", lambda model: None, "HF as configured (the reference)")
register_path("hf:attn=eager", _set_attention("eager"), "HF with eager attention (probabilities rounded before P@V)")
register_path("hf:attn=sdpa", _set_attention("sdpa"), "HF with torch scaled_dot_product_attention")
register_path("kernels:faithful", "ulptrace.kernels.inject:faithful",
              "ulptrace's kernels keeping HF's rounding points (CUDA on GPU, references on CPU)")
register_path("kernels:fused", "ulptrace.kernels.inject:fused",
              "ulptrace's kernels in fused mode: FP32 inside, one final rounding (CUDA on GPU, references on CPU)")
# libraries ulptrace did not write (ulptrace.thirdparty, imported only when one of these is resolved)
register_path("compile", "ulptrace.thirdparty:compile_path",
              "torch.compile (Inductor): the whole model compiled in place; observed only where Inductor materialises")
register_path("compile:emulate", "ulptrace.thirdparty:compile_emulate_path",
              "as compile, with torch._inductor.config.emulate_precision_casts (eager's BF16 roundings kept)")
register_path("liger", "ulptrace.thirdparty:liger_path",
              "Liger-Kernel's patch for the model's family (pip install 'ulptrace[liger]')")
register_path("hf:fla", "ulptrace.thirdparty:fla_path",
              "HF with flash-linear-attention's GatedDeltaNet scan (pip install 'ulptrace[fla]', or a folder: "
              "ULPTRACE_FLA_DIR or hf:fla=DIR); judged against hf:scan=torch")
register_path("hf:scan=torch", "ulptrace.thirdparty:torch_scan_path",
              "HF with its torch GatedDeltaNet scan, also where HF bound flash-linear-attention at import")
