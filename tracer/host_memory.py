"""Host memory freed by one op kept for the next: glibc malloc's thresholds for a process that judges on the CPU.

Why: the oracle replays a record in float64 intervals, tens of temporaries of the record's size each (a prefill's GLU
record of tiny-qwen3.5 at 8 x 128 tokens: 3 MiB apiece). glibc's malloc serves such blocks from the heap once one
was freed, but gives the heap's free top back to the system as soon as it passes twice that size, so the next
temporary is faulted in again, page by page, zeroed by the kernel: 318K minor faults (1.3 GB) in one onset of that
workload with the oracle on 2 CPU cores, ~20% of its time (``bench/RESULTS.md``, twenty-eighth round). Keeping the
heap's free top up to :data:`TRIM_THRESHOLD` and serving blocks below :data:`MMAP_THRESHOLD` from the heap (the most
glibc's own adaptive threshold reaches on 64-bit machines) stops that: ~5K faults a run, results unchanged — an
allocator's choice of addresses changes no value. Larger blocks are still mapped and unmapped on their own, so a long
prompt's largest temporaries go back to the system when freed.

The settings are the process's own (``mallopt``), so they are made where ulptrace owns the process: the console
scripts and the helper processes they start. A script or notebook that judges on the CPU may call
:func:`keep_freed_memory` itself. Malloc settings of the user's own (``MALLOC_*_`` variables, ``glibc.malloc``
tunables in ``GLIBC_TUNABLES``) are left as they are, and a C library other than glibc is left alone.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 32 << 20
"""Blocks smaller than this come from the heap, and freed ones are reused there."""
TRIM_THRESHOLD = 128 << 20
"""Free memory at the heap's top is given back to the system only beyond this."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
_USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_state: dict[str, str] = {}


def keep_freed_memory() -> str:
    """Set glibc malloc's thresholds (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`) once in this process; returns
    one line saying what holds — the settings made, or why none were (another C library, the user's own settings)."""
    if "status" not in _state:
        _state["status"] = _apply()
    return _state["status"]


def _apply() -> str:
    own = [name for name in _USER_VARIABLES if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        own.append("GLIBC_TUNABLES")
    if own:
        return f"malloc left as the environment sets it ({', '.join(own)})"
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no such symbol (musl, macOS), no process handle (Windows)
        return "malloc left as it is: the C library is not glibc"
    version.restype = ctypes.c_char_p
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # setting either ends glibc's adaptive thresholds (which would move the mmap one up to a freed block's size, and the
    # trim one to twice that): both are set
    refused = [name for name, number, value in (("mmap", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                                ("trim", _M_TRIM_THRESHOLD, TRIM_THRESHOLD))
               if not mallopt(number, value)]
    if refused:
        return f"glibc {version().decode()} malloc refused the {' and '.join(refused)} threshold"
    return (f"glibc {version().decode()} malloc: blocks under {MMAP_THRESHOLD >> 20} MiB reused from the heap, "
            f"its free top kept up to {TRIM_THRESHOLD >> 20} MiB")
