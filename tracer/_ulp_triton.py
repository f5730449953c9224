"""One-pass ULP statistics on CUDA (Triton): bit patterns -> ordered keys -> distance -> histogram
codes, NaN handling and the maximum in a single read of both tensors, no integer temporaries in memory.

``ulptrace.ulp.ulp_stats`` calls :func:`stats` for CUDA tensors when Triton is installed (``AVAILABLE``);
its result equals the elementwise torch path (tests compare them on the GPU). Imported lazily, and
importable without Triton: importing ulptrace never imports Triton.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

AVAILABLE = triton is not None
BINS = 32  # codes 0..16 = distance, 17 = "> 16", 18 = nonfinite, 19 = padding (ignored)

if AVAILABLE:

    @triton.jit
    def _kernel(a_ptr, b_ptr, counts_ptr, max_ptr, n, MAG: tl.constexpr, LIMIT: tl.constexpr,
                WIDE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        xa = tl.load(a_ptr + offsets, mask=inside, other=0).to(WIDE)
        xb = tl.load(b_ptr + offsets, mask=inside, other=0).to(WIDE)
        ma = xa & MAG
        mb = xb & MAG
        nan = (ma > LIMIT) | (mb > LIMIT)
        distance = tl.abs(tl.where(xa < 0, -ma, ma) - tl.where(xb < 0, -mb, mb))
        code = tl.where(nan, 18, tl.minimum(distance, 17))
        code = tl.where(inside, code, 19).to(tl.int32)
        tl.atomic_add(counts_ptr + tl.arange(0, 32), tl.histogram(code, 32))
        tl.atomic_max(max_ptr, tl.max(tl.where(nan | ~inside, 0, distance), axis=0).to(tl.int64))


def stats(bits_a: torch.Tensor, bits_b: torch.Tensor, magnitude_mask: int, limit: int, width: int
          ) -> tuple[list[int], int]:
    """(19 code counts, max finite distance) of two bit-pattern tensors of one integer dtype on CUDA.

    Raises:
        ImportError: Triton is not installed.
    """
    if not AVAILABLE:
        raise ImportError("the fused ULP statistics need Triton (pip install triton); the torch path serves without")
    a, b = bits_a.reshape(-1), bits_b.reshape(-1)
    n = a.numel()
    counts = torch.zeros(BINS, dtype=torch.int32, device=a.device)
    maximum = torch.zeros(1, dtype=torch.int64, device=a.device)
    block = 4096
    wide = tl.int64 if width > 16 else tl.int32
    _kernel[(triton.cdiv(n, block),)](a, b, counts, maximum, n, MAG=magnitude_mask, LIMIT=limit, WIDE=wide,
                                      BLOCK=block, num_warps=8)
    return counts[:19].tolist(), int(maximum.item())
