"""Pinning torch's scaled-dot-product-attention backend for one model (``--sdpa``).

HF's ``sdpa`` attention calls ``F.scaled_dot_product_attention``, and torch picks the kernel per call: on an H200
with torch 2.11 it picks cuDNN's attention for Qwen3.5's full-attention layers, prefill and decode, whose output
was measured not to repeat its bits run after run on bitwise-equal inputs (``bench/op_repeatability.py``; the
twenty-second round of ``bench/RESULTS.md``). A reference that does not repeat makes two onsets of the same work
differ. Pinning a backend that repeats (``flash``, ``math``) makes every run of the model compute the same bits;
the pin belongs to the model (forward hooks that enter torch's ``sdpa_kernel`` for the length of each forward, kept
by ``copy.deepcopy`` and pickling), so it holds on both sides, in every mode and in a helper process. A path that
compiles the model (``torch.compile``: Inductor lowers attention itself and does not read the pin, measured) refuses
a pinned model (``refuse_unreached``, ``lowered_error``) rather than run unpinned under the option's name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SDPA_BACKENDS = ("default", "flash", "efficient", "math", "cudnn")
"""``--sdpa`` values: ``default`` is torch's own choice per call; the others pin one backend."""

CUDA_ONLY = ("efficient", "cudnn")
"""Backends torch has on CUDA only."""

_TORCH_NAMES = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH",
                "cudnn": "CUDNN_ATTENTION"}
NO_KERNEL = "No available kernel"
"""The start of torch's error when no enabled backend can run an attention call."""


def _on_cuda(device: str | torch.device) -> bool:
    """Whether ``device`` names a CUDA device (False for a name torch does not parse: the device check says why)."""
    import torch  # here: the command line reads SDPA_BACKENDS before it imports torch

    try:
        return torch.device(device).type == "cuda"
    except RuntimeError:
        return False


def check_sdpa(backend: str, device: str | torch.device) -> str:
    """``backend`` if it can be pinned on ``device``; else ``ValueError`` naming the choices."""
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"--sdpa must be one of {', '.join(SDPA_BACKENDS)}, but got {backend!r}")
    if backend in CUDA_ONLY and not _on_cuda(device):
        raise ValueError(f"--sdpa {backend} is a CUDA backend of torch's attention, but the device is {str(device)!r}"
                         f" (on it: {', '.join(b for b in SDPA_BACKENDS if b not in CUDA_ONLY)})")
    return backend


def lowered_error(backend: str, name: str) -> ValueError:
    """The error for a pinned ``backend`` meeting path ``name``, which compiles attention itself."""
    return ValueError(f"--sdpa {backend} pins the kernel torch's SDPA dispatches to, but path {name!r} compiles the "
                      "model and its compiler lowers attention itself (the pin would not reach it): use --sdpa "
                      f"default with {name!r}")


def refuse_unreached(backend: str, paths: Any) -> None:
    """``ValueError`` when ``backend`` is pinned and would not reach the attention of the run of ``paths`` (names):
    one of them compiles attention itself (its path function's ``lowers_attention``: torch.compile's Inductor lowers
    SDPA at compile time and does not read the pin), or none runs HF's ``sdpa`` attention (each sets another
    implementation, ``hf:attn=eager``: the function's ``attention``). A name that resolves to no path is left to the
    path check."""
    if backend == "default":
        return
    from ulptrace.paths import resolve_path

    implementations = []
    for name in paths:
        try:
            fn = resolve_path(name)
        except (KeyError, ValueError):
            return
        if getattr(fn, "lowers_attention", False):
            raise lowered_error(backend, name)
        implementations.append(getattr(fn, "attention", "sdpa"))
    if implementations and "sdpa" not in implementations:
        raise ValueError(f"--sdpa {backend} pins the kernel of HF's sdpa attention, but the run's paths "
                         f"({', '.join(map(repr, paths))}) use {' and '.join(sorted(set(implementations)))} attention: "
                         "the pin would change nothing; drop --sdpa")


def pinned(model: Any) -> str:
    """The backend ``model`` is pinned to (``default``: none)."""
    return getattr(model, "ulptrace_sdpa", "default")


def _enter(module: Any, args: Any) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    context = sdpa_kernel([getattr(SDPBackend, _TORCH_NAMES[module.ulptrace_sdpa])])
    context.__enter__()
    module.ulptrace_sdpa_contexts.append(context)


def _exit(module: Any, args: Any, output: Any) -> None:
    if module.ulptrace_sdpa_contexts:
        module.ulptrace_sdpa_contexts.pop().__exit__(None, None, None)


def pin_sdpa(model: Any, backend: str) -> Any:
    """Pin ``model``'s SDPA attention to ``backend`` for every forward from now on (``default``: leave torch's
    choice); returns ``model``. Refuses a backend the model's device lacks and a model pinned already to another."""
    device = next(iter(model.parameters())).device
    check_sdpa(backend, device)
    if backend == "default" or pinned(model) == backend:
        return model
    if pinned(model) != "default":
        raise ValueError(f"the model's attention is pinned to {pinned(model)} already; cannot pin it to {backend}")
    model.ulptrace_sdpa = backend
    model.ulptrace_sdpa_contexts = []
    model.register_forward_pre_hook(_enter)
    model.register_forward_hook(_exit, always_call=True)
    return model


def no_kernel_error(model: Any, exc: BaseException, where: str) -> ValueError | None:
    """The user error for torch finding no kernel of the pinned backend for an attention call of ``model``
    (``where``: which forward), or None when ``exc`` is something else."""
    backend = pinned(model)
    if backend == "default" or not isinstance(exc, RuntimeError) or NO_KERNEL not in str(exc):
        return None
    return ValueError(f"--sdpa {backend}: torch's {backend} attention cannot run this model's attention call in the "
                      f"{where} (torch: {str(exc).strip().splitlines()[0]}); its warnings above say why — pick "
                      f"another backend ({', '.join(b for b in SDPA_BACKENDS if b != backend)})")


def default_note(device: str | torch.device, backend: str) -> str | None:
    """What a user should know when torch may pick cuDNN's attention (``--sdpa default`` on CUDA with torch's cuDNN
    attention enabled): a line for stderr, or None."""
    import torch

    if backend != "default" or not _on_cuda(device) or not torch.cuda.is_available() \
            or not torch.backends.cuda.cudnn_sdp_enabled():  # (no CUDA device: the device check says so)
        return None
    return ("note: torch may run cuDNN's attention here (--sdpa default); on an H200 with torch 2.11 its output did "
            "not repeat its bits run after run, so two runs' reports can differ — --sdpa flash pins a backend that "
            "repeats")
