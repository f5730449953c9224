"""JIT build of ulptrace's CUDA kernels, cached, with a clear answer when it cannot be built.

All kernels are one extension (``csrc/*.cu`` + ``csrc/bindings.cpp``), built once per source
version with ``torch.utils.cpp_extension.load`` into ``$TORCH_EXTENSIONS_DIR`` or, when that is
not set, ``~/.cache/ulptrace/torch_extensions``. The extension name carries a hash of the sources,
so an edited kernel is rebuilt instead of a stale one being loaded. The target architecture follows
``TORCH_CUDA_ARCH_LIST`` (e.g. ``9.0`` for an H100/H200) or, when unset, the visible device.

Nothing is built at import time. :func:`available` answers without raising (and warns once when a
CUDA device is present but the build fails); :func:`extension` raises :class:`KernelBuildError`
naming the reason (no CUDA device, no ``nvcc``, a compiler error).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bindings.cpp", "rms_norm.cu", "glu.cu", "gated_rms_norm.cu", "gdn_gates.cu", "decode_attention.cu")
HEADERS = ("launchers.h", "common.cuh")
# No fast-math: the kernels rely on IEEE division/sqrt and on libdevice's expf/log1pf, as torch does.
CUDA_FLAGS = ("-O3", "-lineinfo")

_state: dict[str, object] = {}


class KernelBuildError(RuntimeError):
    """The CUDA extension cannot be built or loaded here; the message says why."""


def _source_hash() -> str:
    digest = hashlib.sha1()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(CUDA_FLAGS).encode())
    return digest.hexdigest()[:12]


def build_directory() -> Path:
    """Where the extension is built and cached."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "ulptrace" / "torch_extensions"
    return base / f"ulptrace_kernels_{_source_hash()}"


def unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot run here (without trying to build), or None if they may."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (torch.cuda.is_available() is False)"
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def extension() -> ModuleType:
    """The loaded extension module, building it on first use.

    Raises:
        KernelBuildError: no CUDA device, no nvcc, or the build failed (the compiler's message is
            included). The failure is remembered for the rest of the process.
    """
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    if "error" in _state:
        raise KernelBuildError(str(_state["error"]))
    reason = unavailable_reason()
    if reason is not None:
        _state["error"] = f"ulptrace CUDA kernels unavailable: {reason}; the plain-torch references are used"
        raise KernelBuildError(str(_state["error"]))
    from torch.utils.cpp_extension import load

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        module = load(
            name=directory.name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cuda_cflags=list(CUDA_FLAGS),
            extra_cflags=["-O3"],
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            verbose=os.environ.get("ULPTRACE_BUILD_VERBOSE") == "1",
        )
    except Exception as exc:  # compiler or loader failure: remember and explain
        _state["error"] = f"ulptrace CUDA kernels failed to build in {directory}: {exc}"
        raise KernelBuildError(str(_state["error"])) from exc
    _state["module"] = module
    return module


def available(warn: bool = False) -> bool:
    """Whether the CUDA kernels can run here (builds them on first call when a device is present).

    With ``warn=True`` a failed build on a machine that has a CUDA device warns once.
    """
    try:
        extension()
    except KernelBuildError as exc:
        if warn and torch.cuda.is_available() and not _state.get("warned"):
            _state["warned"] = True
            warnings.warn(str(exc), RuntimeWarning, stacklevel=3)
        return False
    return True
