"""One-pass ULP statistics on the CPU, and the oracle's roundings to FP32: small C functions (``_ulp_cpu.c``)
compiled on first use and called through ctypes.

The torch path of ``ulptrace.ulp.record_stats`` makes a dozen elementwise passes over a record per statistic;
on a CPU that is most of what tracing costs. This reads both bit-pattern arrays once and fills the CUDA kernel's
buffer (``ulptrace._ulp_triton.RECORD_LAYOUT``; a histogram bucket's distance codes summed into its first, which
``ulp`` reads alike), equal to the reference definitions (tested). It needs a C compiler (``cc``, or ``$CC``). It is built for the machine it runs on
(``-march=native``, where the compiler takes it: the vectorized loops need more than the baseline instruction set to
be faster; ``-fno-trapping-math`` lets their selects vectorize) and cached under ``~/.cache/ulptrace`` (or
``$ULPTRACE_CACHE``) by a hash of the source, the flags and the processor (``_processor``), so a cache shared
between machines never hands one a library built for another's instructions. Where it cannot be built, :func:`library`
is None, :func:`unavailable_reason` says why, and the torch path serves (same results, slower).

:func:`to_fp32` rounds float64 values to FP32 down, up or to odd, as the oracle's interval replay does at every
rounding point (``ulptrace.oracle.intervals``): the same bits as its torch operations — a cast, a comparison, a
``nextafter`` and a ``where`` whose CPU loop branches per element — in one vectorized pass (a tiny-qwen3.5 onset with
the oracle, 8 x 128 tokens: ~10% less time, ``bench/RESULTS.md``, twenty-eighth round).

:func:`grouped` counts the ULP distances of a pair into histograms by group — an element's group given by its unit
(a stacked record's row) and its code (its verdict): the oracle's verdict histograms of a stack of judged records
(``ulptrace.ulp.grouped_ulp_histograms``) in one pass over the bit patterns, for the ~20 passes of int64 temporaries
of the torch operations (a tiny-qwen3.5 onset with the oracle, 8 x 128 tokens: ~145 -> ~45 ms of its ~1.1 s judging).

:func:`classify` makes a judgement's masks — tie, nonfinite, outside the admissible set — from the output's bit
patterns, the reference's and the set's float64 ends and point in one pass (~30 torch operations on float64 and
boolean temporaries for each judged stack otherwise).

A large pair (:data:`PARALLEL_ELEMENTS` or more) is split into contiguous parts — whole rows, or any elements
when the row statistics are not asked for — computed on ``torch.get_num_threads()`` threads (ctypes releases
the GIL during the call) and merged exactly: counts add, maxima are maxima.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("_ulp_cpu.c")
PARALLEL_ELEMENTS = 1 << 20
"""Pairs of at least this many elements are split over threads (smaller ones cost less than a thread hand-off, which
takes ~0.15-0.25 ms on 2 shared cores). Measured there with the 138 record pairs of 64K elements or more of a
tiny-qwen3.5 onset (8 x 128, 16 steps; 17.7M elements, most of them equal): 57-73 ms split from 64K elements on,
29-34 ms from 1M on or never (the vectorized pass of 2026-12-04 made a pair 2-4x cheaper than when 64K was chosen:
39-52 us whole for a 66K-element cache record without row statistics, 200-260 us split); one differing 524K-element
pair with row statistics took 1.21 ms whole, 1.09 ms split."""
BASE_FLAGS = ("-O3", "-fno-trapping-math", "-shared", "-fPIC")
NATIVE_FLAGS = (("-march=native",), ("-mcpu=native",), ())  # tried in order: x86 and most compilers, some ARM ones, none
_state: dict[str, Any] = {}
_FUNCTIONS = {1: "ulptrace_stats_8", 2: "ulptrace_stats_16", 4: "ulptrace_stats_32"}
_GROUPED = {1: "ulptrace_grouped_8", 2: "ulptrace_grouped_16", 4: "ulptrace_grouped_32"}
_CLASSIFY = {torch.bfloat16: "ulptrace_classify_16", torch.float32: "ulptrace_classify_32"}
_SLOTS = ctypes.c_int64 * 32


def _cache() -> Path:
    root = os.environ.get("ULPTRACE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "ulptrace"


def _processor() -> str:
    """What a library built with ``-march=native`` depends on: the architecture and, where the system says (Linux's
    ``/proc/cpuinfo``), the processor's model and instruction-set flags."""
    described = {platform.machine()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            described |= {line.strip() for line in info if line.startswith(("model name", "flags", "Features", "CPU part"))}
    except OSError:
        pass
    return "\n".join(sorted(described))


def _build() -> ctypes.CDLL:
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (cc, gcc or $CC)")
    key = hashlib.sha1(source + repr((compiler, BASE_FLAGS, NATIVE_FLAGS)).encode() + _processor().encode())
    target = _cache() / f"ulp_cpu_{key.hexdigest()[:12]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed into place (atomic)
            built = Path(tmp) / target.name
            for native in NATIVE_FLAGS:  # the first this compiler takes
                done = subprocess.run([compiler, *BASE_FLAGS, *native, "-o", str(built), str(SOURCE), "-lm"],
                                      capture_output=True, text=True, check=False)
                if done.returncode == 0:
                    break
            else:
                raise OSError(f"{compiler} failed: {done.stderr.strip()[:500]}")
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.argtypes = [p, p, i64, i64, i64, i64, i64, i32, i32, i32, p]
        fn.restype = None
    for name in _GROUPED.values():
        fn = getattr(lib, name)
        fn.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, p]
        fn.restype = i32
    for name in _CLASSIFY.values():
        fn = getattr(lib, name)
        fn.argtypes = [p, p, p, p, p, i64, p, p, p]
        fn.restype = None
    lib.ulptrace_parts_differ.argtypes = [p, p, i64, i64, p]
    lib.ulptrace_parts_differ.restype = None
    lib.ulptrace_to_fp32.argtypes = [p, p, i64, i32]
    lib.ulptrace_to_fp32.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled statistics, built on first use; None where they cannot be (see :func:`unavailable_reason`)."""
    if "lib" not in _state:
        try:
            _state["lib"] = _build()
        except OSError as exc:
            _state["lib"], _state["why"] = None, str(exc)
    return _state["lib"]


def _loaded(what: str = "CPU loops") -> ctypes.CDLL:
    """:func:`library`, or a RuntimeError saying why it cannot be built (each entry point's first line)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the compiled {what} are unavailable: {unavailable_reason()}")
    return lib


def unavailable_reason() -> str | None:
    """Why the compiled statistics are not used here, or None when they are."""
    return None if library() is not None else _state.get("why")


def stats(a: torch.Tensor, b: torch.Tensor, fmt: Any, *, rows: bool) -> list[int]:
    """The 32 int64 slots of ``RECORD_LAYOUT`` (each bucket's codes at its first) for two CPU tensors of the format
    ``fmt`` (``ulptrace.ulp.FloatFormat``): its values or their bit patterns, the memory is read as bit patterns
    either way (rows are the last dimension; ``rows=False`` leaves the row slots 0).

    Raises:
        RuntimeError: :func:`library` is None.
    """
    lib = _loaded("ULP statistics")
    a, b = a.contiguous(), b.contiguous()
    n_cols = a.shape[-1] if a.dim() else 1
    n_rows = a.numel() // max(n_cols, 1)
    function = getattr(lib, _FUNCTIONS[a.element_size()])
    size = a.element_size()
    constants = _constants(fmt)
    threads = min(torch.get_num_threads(), 8)
    if a.numel() < PARALLEL_ELEMENTS or threads < 2 or (rows and n_rows < threads):
        # most records: one call into a ctypes array (a torch tensor and its tolist cost more than the pass itself)
        slots = _SLOTS()
        function(a.data_ptr(), b.data_ptr(), n_rows, n_cols, *constants, int(rows), slots)
        return slots[:]  # a slice is a list made in C: list(slots) reads the 32 items one by one (~3 us a record)

    def part(first: int, count: int, length: int, out: torch.Tensor) -> None:
        """``count`` rows of ``length`` elements from element ``first``."""
        function(a.data_ptr() + first * size, b.data_ptr() + first * size, count, length, *constants, int(rows),
                 out.data_ptr())

    if rows:  # whole rows per thread: a row's statistics need all of it
        cuts = [n_rows * k // threads * n_cols for k in range(threads + 1)]
        parts = [(cuts[k], (cuts[k + 1] - cuts[k]) // n_cols, n_cols) for k in range(threads)]
    else:  # no row statistics: the element statistics do not depend on where rows begin
        cuts = [a.numel() * k // threads for k in range(threads + 1)]
        parts = [(cuts[k], 1, cuts[k + 1] - cuts[k]) for k in range(threads)]
    outs = torch.zeros(threads, 32, dtype=torch.int64)
    pool = _pool(threads - 1)
    futures = [pool.submit(part, *parts[k], outs[k]) for k in range(1, threads)]
    part(*parts[0], outs[0])
    for future in futures:
        future.result()
    merged = outs.sum(0)
    merged[20] = outs[:, 20].max()  # the largest finite distance
    merged[30] = outs[:, 30].max()  # the largest row distance: non-negative doubles order like their bit patterns
    return merged.tolist()


def grouped(a: torch.Tensor, b: torch.Tensor, codes: torch.Tensor, bases: torch.Tensor, n_groups: int,
            fmt: Any) -> list[list[int]] | None:
    """The ULP-distance histogram counts (8 a group, in ``ulptrace.ulp.HISTOGRAM_BUCKETS``' order) of two CPU tensors of
    the format ``fmt`` (``ulptrace.ulp.FloatFormat``; the memory read as bit patterns), ``n_groups`` rows: dimension
    0 holds ``len(bases)`` equal units, and an element of unit ``u`` with code ``c`` (``codes``: uint8, their shape) is
    in group ``bases[u] + c``. The caller checks every group is below ``n_groups`` (``ulptrace.ulp``). None where the
    loop's counters cannot be had (too many groups for its 32-bit indices, or no memory): count them otherwise.

    Raises:
        RuntimeError: :func:`library` is None.
    """
    lib = _loaded()
    a, b, codes = a.contiguous(), b.contiguous(), codes.contiguous()
    bases = bases.to(torch.int64).contiguous()
    counts = torch.zeros(n_groups, 8, dtype=torch.int64)
    constants = _constants(fmt)
    failed = getattr(lib, _GROUPED[a.element_size()])(a.data_ptr(), b.data_ptr(), codes.data_ptr(), bases.data_ptr(),
                                                      bases.numel(), a.numel() // max(bases.numel(), 1), n_groups,
                                                      constants[0], constants[2], counts.data_ptr())
    return None if failed else counts.tolist()


def classify(output: torch.Tensor, reference: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor,
             pt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The masks a judgement counts (``ulptrace.oracle.judge.judge_sets_stacked``), from one pass: ``(tie, bad,
    outside)`` — in the admissible set ``[lo, hi]`` and not exact; not finite (the output, the point ``pt`` or the set)
    and outside it, not exact; neither, not exact — where exact is bitwise equal to ``reference`` (None: in the set).
    For a BF16 or FP32 output on the CPU, a reference of its dtype or None, and float64 CPU ends and point of its
    shape; None otherwise (and where the loops are not built): the caller's torch operations decide.
    """
    name = _CLASSIFY.get(output.dtype)
    shape = output.shape
    if name is None or library() is None or output.device.type != "cpu" or any(
            t.dtype != torch.float64 or t.device.type != "cpu" or t.shape != shape for t in (lo, hi, pt)) or (
            reference is not None and (reference.dtype != output.dtype or reference.shape != shape
                                       or reference.device.type != "cpu")):
        return None
    out = output.detach().resolve_neg().contiguous()
    ref = None if reference is None else reference.detach().resolve_neg().contiguous()
    ends = [t.resolve_neg().contiguous() for t in (lo, hi, pt)]
    masks = [torch.empty(shape, dtype=torch.bool) for _ in range(3)]
    getattr(library(), name)(out.data_ptr(), None if ref is None else ref.data_ptr(), *(t.data_ptr() for t in ends),
                             out.numel(), *(m.data_ptr() for m in masks))
    return masks[0], masks[1], masks[2]


def parts_differ(a: torch.Tensor, b: torch.Tensor, n_parts: int) -> torch.Tensor:
    """Whether each of ``n_parts`` equal consecutive parts of two contiguous CPU tensors of one dtype and shape differs
    bitwise (``ulptrace_parts_differ``: a ``memcmp`` a part), as a bool tensor of ``n_parts``; the caller gives tensors
    whose memory holds their values (``ulptrace.ulp.parts_differ``).

    Raises:
        RuntimeError: :func:`library` is None.
    """
    lib = _loaded()
    out = torch.empty(n_parts, dtype=torch.bool)
    lib.ulptrace_parts_differ(a.data_ptr(), b.data_ptr(), n_parts, a.nbytes // max(n_parts, 1), out.data_ptr())
    return out


TO_FP32_MODES = {"down": 0, "up": 1, "odd": 2}


def to_fp32(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Float64 CPU tensor ``x`` to FP32 in one pass (``ulptrace_to_fp32``): ``"down"`` the largest FP32 value <= each
    element, ``"up"`` the smallest >= it, ``"odd"`` rounded to odd — bit for bit what the oracle's torch operations give
    (``ulptrace.oracle.intervals``: a cast, a comparison, a ``nextafter`` and a ``where``, whose CPU loop branches per
    element). A new contiguous float32 tensor of ``x``'s shape.

    Raises:
        RuntimeError: :func:`library` is None.
        ValueError: ``x`` is not a float64 CPU tensor, or ``mode`` is none of :data:`TO_FP32_MODES`.
    """
    lib = _loaded()
    if x.dtype != torch.float64 or x.device.type != "cpu" or mode not in TO_FP32_MODES:
        raise ValueError(f"to_fp32 takes a float64 CPU tensor and a mode of {sorted(TO_FP32_MODES)}, but got "
                         f"{x.dtype} on {x.device} and {mode!r}")
    x = x.resolve_neg().contiguous()  # the memory as the values are (a lazily negated view is not)
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.ulptrace_to_fp32(x.data_ptr(), out.data_ptr(), x.numel(), TO_FP32_MODES[mode])
    return out


@functools.cache
def _constants(fmt: Any) -> tuple[int, int, int, int, int]:
    """The format's constants the C function takes (properties of ``fmt``, computed once per format)."""
    return fmt.magnitude_mask, fmt.max_finite_bits, fmt.nan_above, fmt.mantissa_bits, fmt.bias


def _pool(workers: int) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    pool = _state.get("pool")
    # a new pool for more workers, and in a forked child (the parent's worker threads do not exist there)
    if pool is None or _state.get("workers", 0) < workers or _state.get("pid") != os.getpid():
        pool = _state["pool"] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ulptrace-stats")
        _state["workers"], _state["pid"] = workers, os.getpid()
    return pool
