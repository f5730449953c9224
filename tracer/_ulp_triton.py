"""One-pass ULP statistics on CUDA (Triton): bit patterns -> ordered keys -> distance -> histogram
codes, NaN handling and the maximum in a single read of both tensors, no integer temporaries in memory.

``ulptrace.ulp.ulp_stats`` calls :func:`stats` for CUDA tensors when Triton is installed (``AVAILABLE``);
its result equals the elementwise torch path (tests compare them on the GPU). Imported lazily, and
importable without Triton: importing ulptrace never imports Triton.
"""

from __future__ import annotations

from typing import Any

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
    def _distance(xa, xb, ma, mb, LIMIT: tl.constexpr):
        """(NaN on either side, ordered-key distance) of bit patterns ``xa``, ``xb`` with magnitudes ``ma``, ``mb``."""
        nan = (ma > LIMIT) | (mb > LIMIT)
        return nan, tl.abs(tl.where(xa < 0, -ma, ma) - tl.where(xb < 0, -mb, mb))

    @triton.jit
    def _kernel(a_ptr, b_ptr, counts_ptr, max_ptr, n, MAG: tl.constexpr, LIMIT: tl.constexpr,
                WIDE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        xa = tl.load(a_ptr + offsets, mask=inside, other=0).to(WIDE)
        xb = tl.load(b_ptr + offsets, mask=inside, other=0).to(WIDE)
        nan, distance = _distance(xa, xb, xa & MAG, xb & MAG, LIMIT)
        code = tl.where(nan, 18, tl.minimum(distance, 17))
        code = tl.where(inside, code, 19).to(tl.int32)
        tl.atomic_add(counts_ptr + tl.arange(0, 32), tl.histogram(code, 32).to(tl.int64))  # int64: n may pass 2**31
        tl.atomic_max(max_ptr, tl.max(tl.where(nan | ~inside, 0, distance), axis=0).to(tl.int64))


def stats(bits_a: torch.Tensor, bits_b: torch.Tensor, fmt: Any) -> tuple[list[int], int]:
    """(19 code counts, max finite distance) of two bit-pattern tensors of one integer dtype on CUDA.

    Raises:
        ImportError: Triton is not installed.
    """
    if not AVAILABLE:
        raise ImportError("the fused ULP statistics need Triton (pip install triton); the torch path serves without")
    a, b = bits_a.reshape(-1), bits_b.reshape(-1)
    n = a.numel()
    counts = torch.zeros(BINS, dtype=torch.int64, device=a.device)
    maximum = torch.zeros(1, dtype=torch.int64, device=a.device)
    block = 4096
    wide = tl.int64 if fmt.bits > 16 else tl.int32
    _kernel[(triton.cdiv(n, block),)](a, b, counts, maximum, n, MAG=fmt.magnitude_mask, LIMIT=fmt.nan_above, WIDE=wide,
                                      BLOCK=block, num_warps=8)
    return counts[:19].tolist(), int(maximum.item())


# -- one record's statistics, per element and per row, in one kernel without a host synchronisation --------
# The result is one int64 buffer of RECORD_SLOTS (see ``RECORD_LAYOUT``), read with the buffers of other
# records in one copy to the host (``ulptrace.ulp.resolve_stats``), so the forward pass never waits for it.
RECORD_SLOTS = 32
RECORD_LAYOUT = {"codes": (0, 19), "bits_differ": 19, "max_ulp": 20, "row_codes": (21, 30), "max_row_bits": 30}

if AVAILABLE:

    @triton.jit
    def _pow2(e):
        """2**e as float64, built from its exponent bits (exact; e within float64's normal range)."""
        return ((e + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)

    @triton.jit
    def _value(x, magnitude, MANT: tl.constexpr, BIAS: tl.constexpr):
        """The float64 value of finite bit patterns (sign ``x < 0``), decoded from the bits so that subnormals
        are exact whatever the hardware's flush-to-zero; inf and NaN patterns give meaningless finite values."""
        exponent = magnitude >> MANT
        fraction = magnitude & ((1 << MANT) - 1)
        significand = tl.where(exponent == 0, fraction, fraction | (1 << MANT)).to(tl.float64)
        value = significand * _pow2(tl.maximum(exponent, 1) - BIAS - MANT)
        return tl.where(x < 0, -value, value)

    @triton.jit
    def _record_kernel(abits_ptr, bbits_ptr, out_ptr, n_rows, n_cols, MAG: tl.constexpr,
                       MAXF: tl.constexpr, LIMIT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                       WIDE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
        base = rows * n_cols
        row_in = rows < n_rows
        # pass 1: the row's magnitude, the largest finite |a| (magnitude bits order like the values)
        top = tl.zeros([R, C], dtype=WIDE)
        for start in range(0, n_cols, C):
            cols = start + tl.arange(0, C)
            inside = row_in[:, None] & (cols < n_cols)[None, :]
            ma = tl.load(abits_ptr + base[:, None] + cols[None, :], mask=inside, other=0).to(WIDE) & MAG
            top = tl.maximum(top, tl.where(ma <= MAXF, ma, 0))
        biased = tl.maximum(tl.max(top, axis=1) >> MANT, 1)
        # 1 / the row ULP as a float64 power of two built from its exponent bits (exact)
        inv_unit = _pow2(BIAS + MANT - biased)
        codes = tl.zeros([32], dtype=tl.int32)
        row_codes = tl.zeros([16], dtype=tl.int32)
        differ = tl.zeros([R, C], dtype=tl.int32)
        top_ulp = tl.zeros([R, C], dtype=WIDE)
        top_row = tl.zeros([R, C], dtype=tl.float64)
        for start in range(0, n_cols, C):
            cols = start + tl.arange(0, C)
            inside = row_in[:, None] & (cols < n_cols)[None, :]
            at = base[:, None] + cols[None, :]
            xa = tl.load(abits_ptr + at, mask=inside, other=0).to(WIDE)
            xb = tl.load(bbits_ptr + at, mask=inside, other=0).to(WIDE)
            ma = xa & MAG
            mb = xb & MAG
            # per element: ordered-key distance (codes 0..16, 17 = "> 16", 18 = NaN, 31 = padding)
            nan, distance = _distance(xa, xb, ma, mb, LIMIT)
            code = tl.where(inside, tl.where(nan, 18, tl.minimum(distance, 17)), 31)
            codes += tl.histogram(tl.reshape(code.to(tl.int32), [R * C]), 32)
            top_ulp = tl.maximum(top_ulp, tl.where(nan | ~inside, 0, distance))
            same = xa == xb
            differ += (inside & ~same).to(tl.int32)
            # per element in ULPs of the row's magnitude, float64 (codes 0 "0", 1 "<1", 2 "1", 3 "2", 4 "3-4",
            # 5 "5-8", 6 "9-16", 7 ">16", 8 nonfinite, 15 padding)
            x = _value(xa, ma, MANT, BIAS)
            y = _value(xb, mb, MANT, BIAS)
            nonfinite = ~same & ((ma > MAXF) | (mb > MAXF))
            d = tl.where(same, 0.0, tl.abs(x - y) * inv_unit[:, None])
            row_code = tl.where(d == 0, 0, tl.where(d < 1, 1, tl.where(d <= 1, 2, tl.where(d <= 2, 3, tl.where(
                d <= 4, 4, tl.where(d <= 8, 5, tl.where(d <= 16, 6, 7)))))))
            row_code = tl.where(inside, tl.where(nonfinite, 8, row_code), 15)
            row_codes += tl.histogram(tl.reshape(row_code.to(tl.int32), [R * C]), 16)
            top_row = tl.maximum(top_row, tl.where(nonfinite | ~inside, 0.0, d))
        slots = tl.arange(0, 32)
        tl.atomic_add(out_ptr + slots, codes.to(tl.int64), mask=slots < 19)
        tl.atomic_add(out_ptr + 19, tl.sum(tl.sum(differ, axis=1), axis=0).to(tl.int64))
        tl.atomic_max(out_ptr + 20, tl.max(tl.max(top_ulp, axis=1), axis=0).to(tl.int64))
        slots16 = tl.arange(0, 16)
        tl.atomic_add(out_ptr + 21 + slots16, row_codes.to(tl.int64), mask=slots16 < 9)
        # a non-negative float64's bit pattern orders like its value
        tl.atomic_max(out_ptr + 30, tl.max(tl.max(top_row, axis=1), axis=0).to(tl.int64, bitcast=True))


def record_stats(bits_a: torch.Tensor, bits_b: torch.Tensor, fmt: Any) -> torch.Tensor:
    """Enqueue the statistics of two same-shape CUDA tensors of one float format, given as bit patterns;
    returns the int64 buffer of ``RECORD_SLOTS`` they are written to (``RECORD_LAYOUT``). Rows are the last
    dimension. No host synchronisation.

    Raises:
        ImportError: Triton is not installed.
    """
    if not AVAILABLE:
        raise ImportError("the fused ULP statistics need Triton (pip install triton); the torch path serves without")
    n_cols = bits_a.shape[-1] if bits_a.dim() else 1
    n_rows = bits_a.numel() // max(n_cols, 1)
    out = torch.zeros(RECORD_SLOTS, dtype=torch.int64, device=bits_a.device)
    # three tile shapes in all (short, medium and long rows), so a run compiles few variants of the kernel
    cols = next(c for c in (16, 128, 1024) if c >= n_cols or c == 1024)
    rows = 2048 // cols
    _record_kernel[(triton.cdiv(n_rows, rows),)](
        bits_a.reshape(-1), bits_b.reshape(-1), out, n_rows, n_cols,
        MAG=fmt.magnitude_mask, MAXF=fmt.max_finite_bits, LIMIT=fmt.nan_above, MANT=fmt.mantissa_bits, BIAS=fmt.bias,
        WIDE=tl.int64 if fmt.bits > 16 else tl.int32, R=rows, C=cols, num_warps=8)
    return out
