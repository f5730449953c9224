"""One-pass ULP statistics on CUDA (Triton): bit patterns -> ordered keys -> distance -> histogram
codes, NaN handling and the maximum in a single read of both tensors, no integer temporaries in memory.

``ulptrace.ulp.ulp_stats`` calls :func:`stats` for CUDA tensors when Triton is installed (``AVAILABLE``);
its result equals the elementwise torch path (tests compare them on the GPU). Imported lazily, and
importable without Triton: importing ulptrace never imports Triton.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from ulptrace.ulp import HISTOGRAM_BUCKETS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

AVAILABLE = triton is not None
BUCKETS = len(HISTOGRAM_BUCKETS)  # ulp_stats' kernel codes them in order: 0 "0", 1 "1", 2 "2", 3 "3-4", ... 7 nonfinite

if AVAILABLE:

    @triton.jit
    def _distance(xa, xb, ma, mb, LIMIT: tl.constexpr):
        """(NaN on either side, ordered-key distance) of bit patterns ``xa``, ``xb`` with magnitudes ``ma``, ``mb``."""
        nan = (ma > LIMIT) | (mb > LIMIT)
        return nan, tl.abs(tl.where(xa < 0, -ma, ma) - tl.where(xb < 0, -mb, mb))

    @triton.jit
    def _kernel(a_ptr, b_ptr, counts_ptr, max_ptr, n, MAG: tl.constexpr, LIMIT: tl.constexpr,
                WIDE: tl.constexpr, BLOCK: tl.constexpr, FIELD: tl.constexpr):
        # grid-stride: each program walks blocks pid, pid + programs, ... Each lane counts its elements' histogram
        # buckets (HISTOGRAM_BUCKETS' eight) in two int64 registers, four FIELD-bit fields each (the host keeps a
        # lane's elements under 2**FIELD: field_limit), so a block costs a few integer operations per element and no
        # cross-lane work; the lanes' fields are summed once per program and added to the global counters with one
        # atomic per counter. Padding lanes count in bucket 0 and are taken off by the host (it knows how many).
        pid = tl.program_id(0).to(tl.int64)
        stride = tl.num_programs(0).to(tl.int64) * BLOCK
        low = tl.zeros([BLOCK], dtype=tl.int64)  # buckets 0-3
        high = tl.zeros([BLOCK], dtype=tl.int64)  # buckets 4-7
        top = tl.zeros([BLOCK], dtype=WIDE)
        for start in range(pid * BLOCK, n, stride):
            offsets = start + tl.arange(0, BLOCK)
            inside = offsets < n
            xa = tl.load(a_ptr + offsets, mask=inside, other=0).to(WIDE)
            xb = tl.load(b_ptr + offsets, mask=inside, other=0).to(WIDE)
            nan, distance = _distance(xa, xb, xa & MAG, xb & MAG, LIMIT)
            # 0, 1, 2 as themselves; 3-4 -> 3, 5-8 -> 4, 9-16 -> 5, > 16 -> 6; NaN on either side -> 7
            code = tl.where(distance <= 2, distance, tl.where(distance <= 4, 3, tl.where(
                distance <= 8, 4, tl.where(distance <= 16, 5, 6))))
            code = tl.where(nan, 7, code).to(tl.int64)
            one = tl.full([BLOCK], 1, tl.int64) << ((code & 3) * FIELD)
            low += tl.where(code < 4, one, 0)
            high += tl.where(code < 4, 0, one)
            top = tl.maximum(top, tl.where(nan, 0, distance))  # padding lanes: distance 0
        for bucket in tl.static_range(4):
            tl.atomic_add(counts_ptr + bucket, tl.sum((low >> (FIELD * bucket)) & ((1 << FIELD) - 1), axis=0))
            tl.atomic_add(counts_ptr + 4 + bucket, tl.sum((high >> (FIELD * bucket)) & ((1 << FIELD) - 1), axis=0))
        tl.atomic_max(max_ptr, tl.max(top, axis=0).to(tl.int64))


PROGRAMS_PER_SM = 16  # ulp_stats' grid: enough programs to keep every SM's loads in flight, few global atomics
# elements per program and step, warps per program: the H200's best region (bench/bench_ulp_grid.py, 2026-12-02:
# 16 per SM, 2,048, 4 warps 37.3% of copy; 1,024-2,048 elements with 4 warps 37-38% at 16-32 per SM; 4,096 with
# 8 warps, the setting before, 24.9%)
BLOCK, WARPS = 2048, 4
FIELD_BITS = 16  # the width of a lane's bucket counters in the kernel (four in an int64)


def field_limit() -> int:
    """How many elements one lane of ``ulp_stats``' kernel may count: its fields' largest value."""
    return (1 << FIELD_BITS) - 1


def stats(bits_a: torch.Tensor, bits_b: torch.Tensor, fmt: Any, *, max_programs: int | None = None
          ) -> tuple[list[int], int]:
    """(counts of the eight ``HISTOGRAM_BUCKETS`` in order, max finite distance) of two bit-pattern tensors of one
    integer dtype on CUDA.

    One launch of at most ``PROGRAMS_PER_SM`` programs per multiprocessor (``max_programs`` caps it: tests use it
    to make each program walk several blocks).

    Raises:
        ImportError: Triton is not installed.
    """
    if not AVAILABLE:
        raise ImportError("the fused ULP statistics need Triton (pip install triton); the torch path serves without")
    a, b = bits_a.reshape(-1), bits_b.reshape(-1)
    n = a.numel()
    result = torch.zeros(BUCKETS + 1, dtype=torch.int64, device=a.device)  # the counts, then the maximum: one read
    counts, maximum = result[:BUCKETS], result[BUCKETS:]
    wide = tl.int64 if fmt.bits > 16 else tl.int32
    programs = triton.cdiv(n, BLOCK)
    if a.is_cuda:
        programs = min(programs, PROGRAMS_PER_SM * torch.cuda.get_device_properties(a.device).multi_processor_count)
    if max_programs is not None:
        programs = min(programs, max_programs)
    # enough programs that no lane counts more than field_limit() elements (one per block it walks)
    programs = max(programs, triton.cdiv(n, BLOCK * field_limit()), 1)
    _kernel[(programs,)](a, b, counts, maximum, n, MAG=fmt.magnitude_mask, LIMIT=fmt.nan_above, WIDE=wide,
                         BLOCK=BLOCK, FIELD=FIELD_BITS, num_warps=WARPS)
    host = result.tolist()
    padding = triton.cdiv(n, BLOCK) * BLOCK - n  # the last block's lanes past n, counted as bucket 0
    return [host[0] - padding, *host[1:BUCKETS]], host[BUCKETS]


# -- records' statistics, per element and per row, many records in one launch, no host synchronisation -------
# Each record's result is RECORD_SLOTS int64 (see ``RECORD_LAYOUT``) in a result slab shared by a batch of records,
# read with other slabs in one copy to the host (``ulptrace.ulp.resolve_stats``), so the forward pass never waits
# for it. A launch covers every record of one float format and one tile shape: a traced step of a model costs a
# few launches instead of one per record (each launch through Triton's Python launcher costs tens of us of host
# time, more than the kernel itself on a small record).
RECORD_SLOTS = 32
RECORD_LAYOUT = {"codes": (0, 19), "bits_differ": 19, "max_ulp": 20, "row_codes": (21, 30), "max_row_bits": 30}
SEARCH = 9  # binary-search steps that find a program's record: a launch takes up to 2**SEARCH records
MAX_RECORDS = 1 << SEARCH
TILES = (16, 128, 1024)  # columns of a tile (short, medium and long rows): few kernel variants per run
TILE_ELEMENTS = 2048  # elements of a tile: 2048 // columns rows
_ELEM = {8: "int8", 16: "int16", 32: "int32", 64: "int64"}

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

    @triton.jit(do_not_specialize=["n_records"])
    def _records_kernel(table_ptr, n_records, out_ptr, ELEM: tl.constexpr, MAG: tl.constexpr,
                        MAXF: tl.constexpr, LIMIT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                        WIDE: tl.constexpr, R: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr):
        # a launch's table: 6 int64 per record (a's address, b's address, rows, columns, result slot, first tile);
        # the program's record is the last entry whose first tile is at or before the program (binary search)
        pid = tl.program_id(0).to(tl.int64)
        lo = pid * 0
        hi = lo + n_records
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            go = tl.load(table_ptr + mid * 6 + 5) <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        entry = table_ptr + lo * 6
        abits_ptr = tl.load(entry).to(tl.pointer_type(ELEM))
        bbits_ptr = tl.load(entry + 1).to(tl.pointer_type(ELEM))
        n_rows = tl.load(entry + 2)
        n_cols = tl.load(entry + 3)
        out = out_ptr + tl.load(entry + 4) * 32
        rows = (pid - tl.load(entry + 5)) * R + tl.arange(0, R)
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
        tl.atomic_add(out + slots, codes.to(tl.int64), mask=slots < 19)
        tl.atomic_add(out + 19, tl.sum(tl.sum(differ, axis=1), axis=0).to(tl.int64))
        tl.atomic_max(out + 20, tl.max(tl.max(top_ulp, axis=1), axis=0).to(tl.int64))
        slots16 = tl.arange(0, 16)
        tl.atomic_add(out + 21 + slots16, row_codes.to(tl.int64), mask=slots16 < 9)
        # a non-negative float64's bit pattern orders like its value
        tl.atomic_max(out + 30, tl.max(tl.max(top_row, axis=1), axis=0).to(tl.int64, bitcast=True))


@functools.cache
def tile_columns(n_cols: int) -> int:
    """The tile width (one of ``TILES``) that serves rows of ``n_cols`` elements; records of one width share a launch."""
    return next(c for c in TILES if c >= n_cols or c == TILES[-1])


class Table:
    """One launch's records as the kernel reads them, built as they come (``ulptrace.ulp.StatsBatch`` adds each pair
    as it is queued; :func:`table_of` from a list): ``entries``, six int64 a record (a's address, b's address, rows,
    columns, result slot, first tile), ``tiles`` so far, every record of tile width ``width``, and the ``pairs``
    (a, b, slot) whose memory the entries point to."""

    __slots__ = ("entries", "pairs", "rows_per_tile", "tiles", "width")

    def __init__(self, width: int) -> None:
        self.entries: list[int] = []
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.tiles, self.width, self.rows_per_tile = 0, width, TILE_ELEMENTS // width

    def add(self, a: torch.Tensor, b: torch.Tensor, slot: int, n_cols: int) -> None:
        """Add the pair ``a``, ``b`` (rows of ``n_cols`` elements, of this table's width) with result slot ``slot``."""
        n_rows = a.numel() // max(n_cols, 1)
        self.pairs.append((a, b, slot))
        self.entries += (a.data_ptr(), b.data_ptr(), n_rows, n_cols, slot, self.tiles)
        self.tiles += -(-n_rows // self.rows_per_tile)


def launch_records(pairs: list[tuple[torch.Tensor, torch.Tensor, int]], fmt: Any, out: torch.Tensor,
                   table: Table | None = None) -> None:
    """Enqueue the statistics of record pairs of one float format and one tile width (:func:`tile_columns`) in one
    launch: ``pairs`` are (a, b, result slot), same-shape contiguous tensors on ``out``'s device whose memory is read
    as the format's bit patterns (the values or a bit-pattern view of them)
    (rows are the last dimension); slot ``s``'s results are added into ``out[s]`` (int64, ``RECORD_SLOTS`` per slot,
    zeroed by the caller). No host synchronisation: the launch's table reaches the device by an asynchronous copy.
    The tensors must stay alive and unchanged until the kernel has run (the caller's stream orders it).
    ``table``: the :class:`Table` of ``pairs``, built by the caller as the pairs arrived (``ulptrace.ulp.StatsBatch``);
    made here (:func:`table_of`) when not given.

    Raises:
        ImportError: Triton is not installed.
        ValueError: more than ``MAX_RECORDS`` pairs, or pairs of several tile widths.
    """
    if not AVAILABLE:
        raise ImportError("the fused ULP statistics need Triton (pip install triton); the torch path serves without")
    if not 0 < len(pairs) <= MAX_RECORDS:
        raise ValueError(f"a launch takes 1 to {MAX_RECORDS} record pairs, but got {len(pairs)}")
    if table is None:
        table = table_of(pairs)
    cols = table.width
    device_table = staging().upload(table.entries, out.device) if out.is_cuda else \
        torch.tensor(table.entries, dtype=torch.int64)
    _records_kernel[(table.tiles,)](
        device_table, len(pairs), out, ELEM=getattr(tl, _ELEM[fmt.bits]), MAG=fmt.magnitude_mask,
        MAXF=fmt.max_finite_bits, LIMIT=fmt.nan_above, MANT=fmt.mantissa_bits, BIAS=fmt.bias,
        WIDE=tl.int64 if fmt.bits > 16 else tl.int32, R=table.rows_per_tile, C=cols, STEPS=SEARCH, num_warps=8)


class Staging:
    """Pinned host memory, made once, through which the launches' tables reach a GPU without the host waiting.

    A table made as a new pinned tensor at every launch cost ~3-4 ms a launch on the H100's host inside the traced run
    (7% of the candidate's samples under py-spy, RESULTS.md's thirty-third round): each asked the pinned allocator for
    memory. Here tables are written one after another into one pinned ring of ``entries`` int64 and copied from there
    without waiting (``non_blocking``); a region is written again only after the ring has wrapped, and before the
    wrap every copy out of the ring is waited for (an event recorded after each: long done by then, a ring holding
    hundreds of tables). A table larger than the ring goes through pinned memory of its own, as before."""

    def __init__(self, entries: int = 1 << 18) -> None:
        self.size = entries
        self._ring: torch.Tensor | None = None
        self._at = 0
        self._copies: list[torch.cuda.Event] = []  # one per copy out of the ring since the last wrap

    def upload(self, entries: list[int], device: torch.device) -> torch.Tensor:
        """``entries`` as an int64 tensor on the CUDA ``device``, copied there without waiting (the copy is ordered
        before what the current stream does next)."""
        n = len(entries)
        if n > self.size:
            return torch.tensor(entries, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
        if self._ring is None:
            self._ring = torch.empty(self.size, dtype=torch.int64, pin_memory=True)
        if self._at + n > self.size:  # wrap: the ring's earlier copies must have read it
            for event in self._copies:
                event.synchronize()
            self._copies, self._at = [], 0
        region = self._ring[self._at:self._at + n]
        region.copy_(torch.tensor(entries, dtype=torch.int64))
        self._at += n
        on_device = region.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._copies.append(event)
        return on_device


# each process's, by process id: a forked child makes its own and never touches (or frees) its parent's ring
_staging: dict[int, Staging] = {}


def staging() -> Staging:
    """This process's :class:`Staging`."""
    pid = os.getpid()
    if pid not in _staging:
        _staging[pid] = Staging()
    return _staging[pid]


def table_of(pairs: list[tuple[torch.Tensor, torch.Tensor, int]]) -> Table:
    """The :class:`Table` of ``pairs``, in their order.

    Raises:
        ValueError: pairs of several tile widths (or none).
    """
    table = None
    for a, b, slot in pairs:
        n_cols = a.shape[-1] if a.dim() else 1
        width = tile_columns(n_cols)
        if table is None:
            table = Table(width)
        elif width != table.width:
            raise ValueError(f"one launch serves one tile width, but got rows of {table.width} and {width} columns")
        table.add(a, b, slot, n_cols)
    if table is None:
        raise ValueError("a table needs at least one record pair")
    return table
