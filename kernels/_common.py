"""Validation, backend choice and launch shapes shared by every kernel wrapper.

Each op module (``rms_norm``, ``glu``, ...) has the same shape: check the inputs, pick a backend,
allocate or check the outputs, then run either the CUDA kernel or the plain-torch reference. The
pieces they share live here so the messages and the rules are the same everywhere. The launch
shape of the row kernels (threads per row, elements per load) is chosen here too, because it *is*
the FP32 reduction tree: :func:`blocked_tree` is the single source for both the launch and the
spec string a kernel declares.
"""

from __future__ import annotations

import torch

MODES = ("faithful", "fused")
BACKENDS = ("auto", "cuda", "reference")
ORDERS = ("hf", "kernel")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MODE_CODE = {"faithful": 0, "fused": 1}

# A block of a row kernel has at least this many threads; shorter rows share a block.
MIN_BLOCK = 128
MAX_THREADS = 1024
VECTOR_BYTES = 16


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``; raise ``ValueError`` naming both otherwise."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, but got {value!r}")
    return value  # type: ignore[return-value]


def mode_code(mode: str) -> int:
    """The integer the CUDA launchers take for ``mode`` (validated)."""
    return _MODE_CODE[check_choice("mode", mode, MODES)]


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of an allowed dtype and rank; raise a message naming ``name``.

    Raises:
        TypeError: ``t`` is not a tensor, or has a dtype outside ``dtype``.
        ValueError: ``t`` has a rank outside ``ndim`` or below ``min_ndim``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else dtype
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {tuple(str(d) for d in dtypes)}, but got {t.dtype}")
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    if ranks is not None and t.dim() not in ranks:
        raise ValueError(f"{name} must have {' or '.join(map(str, ranks))} dimensions, but got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, but got shape {tuple(t.shape)}")
    return t


def check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, *, what: str = "shape") -> None:
    """Raise ``ValueError``/``TypeError`` unless ``a`` and ``b`` agree in ``what`` (shape, dtype or device)."""
    va, vb = getattr(a, what), getattr(b, what)
    if what == "shape":
        va, vb = tuple(va), tuple(vb)
    if va != vb:
        exc = TypeError if what == "dtype" else ValueError
        raise exc(f"{name_a} and {name_b} must have the same {what}, but got {va} and {vb}")


def check_out(name: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> None:
    """Check a caller-provided output buffer (shape, dtype, device, contiguity)."""
    if out is None:
        return
    check_tensor(name, out)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {tuple(shape)} on {device}, "
            f"but got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous, but got strides {out.stride()}")


def check_no_overlap(outputs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]) -> None:
    """Raise ``ValueError`` if an output buffer shares memory with an input (kernels re-read inputs)."""
    for oname, out in outputs.items():
        if out is None:
            continue
        for iname, inp in inputs.items():
            if inp is None or inp.device != out.device or inp.numel() == 0 or out.numel() == 0:
                continue
            o0, o1 = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
            i0, i1 = inp.data_ptr(), inp.data_ptr() + inp.numel() * inp.element_size()
            if o0 < i1 and i0 < o1:
                raise ValueError(f"{oname} must not overlap {iname} (the kernel re-reads its inputs)")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """``"cuda"`` or ``"reference"`` for these tensors.

    ``auto`` takes the CUDA kernels when the tensors are on a CUDA device and the extension builds,
    and the references otherwise (warning once with the build problem when tensors are on CUDA).

    Raises:
        ValueError: unknown backend, or ``cuda`` for CPU tensors.
        RuntimeError: ``cuda`` requested and the extension cannot be built or loaded.
    """
    from ulptrace.kernels import _build

    check_choice("backend", backend, BACKENDS)
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "reference":
        return "reference"
    if backend == "cuda":
        if not on_cuda:
            devices = sorted({str(t.device) for t in tensors})
            raise ValueError(f"backend='cuda' needs CUDA tensors, but got tensors on {devices}")
        _build.extension()  # raises with the reason
        return "cuda"
    if on_cuda and _build.available(warn=True):
        return "cuda"
    return "reference"


def vector_width(n: int, dtype: torch.dtype) -> int:
    """Elements per 16-byte load along a row of ``n`` elements (1 when ``n`` is not a multiple)."""
    width = VECTOR_BYTES // dtype.itemsize
    return width if n % width == 0 else 1


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def blocked_launch(n: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(threads_per_row, vector)`` of the row kernels for rows of ``n`` elements of ``dtype``.

    ``vector`` is 16 bytes' worth of elements when ``n`` allows it, else 1; ``threads_per_row`` is
    the power of two covering ``n / vector`` loads, clamped to ``[32, 1024]``.
    """
    if n < 1:
        raise ValueError(f"rows must have at least one element, but got n={n}")
    vector = vector_width(n, dtype)
    threads = min(MAX_THREADS, max(32, _next_pow2(-(-n // vector))))
    return threads, vector


def blocked_tree(n: int, dtype: torch.dtype) -> str:
    """The FP32 reduction tree (``ulptrace.trees`` spec) of a row kernel over ``n`` elements."""
    threads, vector = blocked_launch(n, dtype)
    return f"blocked:t{threads}:v{vector}"


def aligned(t: torch.Tensor, vector: int) -> torch.Tensor:
    """``t`` contiguous, copied when its storage is not aligned for ``vector``-element loads."""
    t = t.contiguous()
    if t.data_ptr() % (vector * t.element_size()) != 0:
        t = t.clone()
    return t


def output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           name: str = "out") -> torch.Tensor:
    """``out`` after checking it, or a new uninitialised buffer (kernels write every element)."""
    if out is not None:
        check_out(name, out, shape, dtype, device)
        return out
    return torch.empty(shape, dtype=dtype, device=device)


def reduce_fp32(values: torch.Tensor, tree: str, dim: int = -1) -> torch.Tensor:
    """FP32 sum of ``values`` along ``dim`` in the order ``tree`` names (``ulptrace.trees``)."""
    from ulptrace.trees import reduce_fp32 as _reduce

    return _reduce(values, tree, dim)
