"""``record_stats`` (what the comparison computes per record: bitwise equality, ULP statistics and the
row-magnitude statistics, deferred on CUDA) equals the reference definitions — ``bitwise_equal``,
``ulp_histogram(ulp_distance(a, b))``, ``row_histogram(row_ulp_distance(a, b))`` — on every format, with NaN,
infinities, signed zeros, subnormals, rows without a finite value, 0-d tensors, one-column and long rows.

The fused Triton kernel is checked on the GPU (``gpu``) and, where Triton is importable with
``TRITON_INTERPRET=1``, by Triton's interpreter on the CPU (skipped otherwise, e.g. in CI)."""

from __future__ import annotations

import os

import pytest
import torch
import ulptrace.ulp as U
from ulptrace.comparison import bitwise_equal
from ulptrace.ulp import (
    FORMATS,
    pending_stats,
    record_stats,
    resolve_stats,
    row_histogram,
    row_ulp_distance,
    ulp_distance,
    ulp_histogram,
)


def _expected(a, b):
    d = ulp_distance(a, b)
    h = ulp_histogram(d)
    finite = d.distance[~d.nan]
    rows = row_ulp_distance(a, b)
    row_finite = rows.distance[~rows.nonfinite]
    return (bitwise_equal(a, b), a.numel() - h["0"], int(finite.max()) if finite.numel() else 0, h,
            float(row_finite.max()) if row_finite.numel() else 0.0, row_histogram(rows))


def _cases(dtype):
    """(name, a, b) pairs covering the special values, each as a 2-d record of rows."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(6, 333, generator=gen).mul(4).to(dtype)
    b = (a.float() * (1 + 2.0 ** -6 * torch.randn(a.shape, generator=gen))).to(dtype)
    yield "equal", a, a.clone()
    yield "differ", a, b
    a2, b2 = a.clone(), b.clone()
    a2[0, :3], b2[0, 1:4] = float("nan"), float("nan")
    a2[1, 5], b2[1, 5] = 0.0, -0.0
    a2[2, 7] = b2[2, 7] = float("nan")  # NaN on both sides, bitwise equal
    a2[3] = 0.0  # a row of zeros (the unit is the smallest subnormal)
    b2[3, :4] = torch.tensor([FORMATS[dtype].min_subnormal, -FORMATS[dtype].min_subnormal, 1.0, 0.0])
    if dtype != torch.float8_e4m3fn:
        a2[4, 7], b2[4, 9] = float("inf"), float("-inf")
        a2[5, :] = float("inf")  # no finite value in the row
    yield "special", a2, b2
    yield "equal with NaN", a2, a2.clone()
    mixed = a2.clone()
    mixed[1], mixed[4] = b2[1], b2[4]  # rows 0 (NaNs), 2, 3 and 5 (all inf) bitwise equal, rows 1 and 4 differ
    yield "some rows equal", a2, mixed
    yield "0-d", a[0, 0].clone(), b[0, 1].clone()
    yield "one column", a[:, :1].clone(), b[:, :1].clone()
    yield "short rows", a2[:, :100].clone(), b2[:, :100].clone()  # special values included
    long_a = torch.randn(2, 5000, generator=gen).to(dtype)
    yield "long rows", long_a, (long_a.float() * (1 + 2.0 ** -5 * torch.randn(2, 5000, generator=gen))).to(dtype)


@pytest.fixture(params=["compiled", "torch"])
def cpu_path(request, monkeypatch):
    """Both CPU paths: the compiled one-pass C function (ulptrace._ulp_cpu) and the torch operations."""
    if request.param == "compiled":
        from ulptrace import _ulp_cpu

        assert _ulp_cpu.library() is not None, _ulp_cpu.unavailable_reason()  # CI has a C compiler
    else:
        monkeypatch.setattr(U, "_cpu_stats", lambda: None)
        monkeypatch.setattr(U, "_CPU_CHUNK", 1000)  # several blocks of rows
    return request.param


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_record_stats_equal_the_reference_definitions(dtype, cpu_path) -> None:
    for name, a, b in _cases(dtype):
        assert tuple(record_stats(a, b)) == _expected(a, b), (dtype, name, cpu_path)
        rows_off = resolve_stats([pending_stats(a, b, rows=False)])[0]  # a recorded input's statistics
        assert tuple(rows_off)[:4] == _expected(a, b)[:4], (dtype, name, cpu_path)


def test_a_lazily_negated_view_is_judged_by_its_values(cpu_path) -> None:
    """A lazily negated tensor keeps its values before negation in memory (``x.conj().imag`` of a complex ``x`` is
    one; contiguous when it has one element, or as torch's ``_neg_view`` makes it): its statistics and bit patterns
    are those of its values (read as memory, equal values were reported 8 of 8 differing by > 16 ULPs, and ``bits``
    raised from inside torch)."""
    from ulptrace.ulp import bits

    x = torch.randn(4, 8)
    z = torch.complex(torch.ones(1), torch.tensor([0.3]))
    for view, plain in ((torch._neg_view(x), -x), (z.conj().imag, -z.imag)):
        assert view.is_neg() and view.is_contiguous() and not plain.is_neg()
        assert torch.equal(bits(view), bits(plain))
        stats = record_stats(view, plain)
        assert stats.equal and stats.differing == 0 and stats.histogram["0"] == plain.numel()
        assert tuple(record_stats(view, plain + 2.0 ** -20)) == _expected(plain, plain + 2.0 ** -20)


@pytest.mark.parametrize("shape", [(37, 7), (24, 32), (9, 256), (3, 513), (1, 1000), (700,), (5, 1)], ids=str)
def test_record_stats_across_blocks_and_row_buffers(shape, cpu_path) -> None:
    """The compiled pass takes elements in blocks of 256 and buffers short rows' distances to 256 before counting them
    (``_ulp_cpu.c``): rows that end inside a block, fill it exactly, or span several; equal and differing blocks mixed;
    special values anywhere — against the definitions, every format."""
    gen = torch.Generator().manual_seed(sum(shape))
    for dtype, fmt in FORMATS.items():
        a = torch.randn(shape, generator=gen).mul(3).to(dtype)
        moved = a.float() * (1 + 2.0 ** -fmt.mantissa_bits * torch.randint(-40, 41, shape, generator=gen))
        b = torch.where(torch.rand(shape, generator=gen) < 0.5, moved.to(dtype), a)
        flat_a, flat_b = a.view(-1), b.view(-1)
        flat_b[: flat_b.numel() // 3] = flat_a[: flat_a.numel() // 3]  # leading blocks bitwise equal
        specials = [float("nan"), 0.0, -0.0, fmt.min_subnormal] + ([] if dtype == torch.float8_e4m3fn else
                                                                   [float("inf"), float("-inf")])
        where = torch.randint(0, a.numel(), (12,), generator=gen)
        for k, i in enumerate(where.tolist()):
            (flat_a if k % 2 else flat_b)[i] = specials[k % len(specials)]
        assert tuple(record_stats(a, b)) == _expected(a, b), (dtype, shape, cpu_path)
        assert tuple(record_stats(a, a.clone())) == _expected(a, a.clone()), (dtype, shape, cpu_path)


def test_hand_derived_row_distances(cpu_path) -> None:
    # a row [4.0, 1.0]: magnitude 4.0, its BF16 ULP 2**-5; 1.0 -> 1.0078125 (0x3F81) moved 2**-7 = 1/4 row ULP;
    # 4.0 -> 4.0625 (0x4082) moved 2**-4 = 2 row ULPs (and 2 of its own ULPs)
    a = torch.tensor([[0x4080, 0x3F80]], dtype=torch.int16).view(torch.bfloat16)
    b = torch.tensor([[0x4082, 0x3F81]], dtype=torch.int16).view(torch.bfloat16)
    stats = record_stats(a, b)
    assert not stats.equal and stats.differing == 2 and stats.max_ulp == 2
    assert stats.max_row_ulp == 2.0
    assert stats.row_histogram == {"0": 0, "<1": 1, "1": 0, "2": 1, "3-4": 0, "5-8": 0, "9-16": 0, ">16": 0,
                                   "nonfinite": 0}
    # +0 vs -0: not bitwise equal, 0 ULPs apart
    z = record_stats(torch.zeros(1, dtype=torch.bfloat16), -torch.zeros(1, dtype=torch.bfloat16))
    assert not z.equal and z.differing == 0 and z.row_histogram["0"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_hand_derived_distances_fall_in_their_buckets(dtype, cpu_path) -> None:
    """Every distance 0..20 once (1.0's bit pattern moved k patterns up), +-smallest subnormal (2 apart across zero),
    a NaN: each bucket's count derived by hand — the compiled pass counts buckets by nested comparisons
    (> 0, > 1, > 2, > 4, > 8, > 16), so each boundary is checked from both sides, in one block and in two."""
    int_dtype = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    one, nan = (int(torch.tensor(x, dtype=dtype).view(int_dtype)) for x in (1.0, float("nan")))
    sign = 1 << (8 * dtype.itemsize - 1)
    pairs = [(one, one + k) for k in range(21)] + [(1, 1 | sign), (one, nan)]
    expected = {"0": 1, "1": 1, "2": 2, "3-4": 2, "5-8": 4, "9-16": 8, ">16": 4, "nonfinite": 1}

    def wrap(x: int) -> int:  # the pattern as the signed integer of its width
        return x - (1 << 8 * dtype.itemsize) if x >= sign else x

    for repeat in (1, 20):  # 23 elements, then 460: several blocks of 256
        a = torch.tensor([wrap(x) for x, _ in pairs] * repeat, dtype=int_dtype).view(dtype)
        b = torch.tensor([wrap(y) for _, y in pairs] * repeat, dtype=int_dtype).view(dtype)
        stats = record_stats(a, b)
        assert stats.histogram == {k: v * repeat for k, v in expected.items()}, (dtype, repeat, cpu_path)
        assert stats.max_ulp == 20 and stats.differing == 22 * repeat and not stats.equal


def test_pending_stats_resolve_in_order_and_name_bad_input() -> None:
    a = torch.ones(4, dtype=torch.bfloat16)
    pending = [pending_stats(a, a), pending_stats(a, a * 2)]
    first, second = resolve_stats(pending)
    assert first.equal and not second.equal and second.differing == 4
    with pytest.raises(TypeError, match="same dtype"):
        pending_stats(a, a.float())
    with pytest.raises(ValueError, match=r"same shape, but got \(4,\) and \(3,\)"):
        pending_stats(a, a[:3])


def _fused(a, b):
    """The Triton kernel's result for one pair of CPU tensors (interpreter) or CUDA tensors, launched alone."""
    pending = U.StatsBatch().add(U.bits(a), U.bits(b), FORMATS[a.dtype])
    return tuple(resolve_stats([pending])[0])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton with TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_fused_kernel_in_the_triton_interpreter(dtype) -> None:
    pytest.importorskip("triton")
    for name, a, b in _cases(dtype):
        if name == "long rows":
            a, b = a[:, :2100], b[:, :2100]  # the interpreter is slow; still more than one column block
        expected = _expected(a, b)
        assert _fused(a, b) == expected, (dtype, name)
        # the values themselves, as pending_stats queues contiguous records: the kernel reads their memory as bits
        values = U.StatsBatch().add(a.contiguous(), b.contiguous(), FORMATS[a.dtype])
        assert tuple(resolve_stats([values])[0]) == expected, (dtype, name, "values")


def _mixed_pairs():
    """Pairs of every format, many shapes (tile widths 16, 128 and 1024, 0-d, one column) in one list."""
    pairs = []
    for dtype in FORMATS:
        for name, a, b in _cases(dtype):
            if name == "long rows":
                a, b = a[:, :2100], b[:, :2100]  # the interpreter is slow; still more than one column block
            pairs.append((f"{dtype} {name}", a, b))
    return pairs


def _batched(pairs, max_records):
    """Every pair's statistics through one ``StatsBatch`` (launched by the batch itself and by resolve_stats)."""
    batch = U.StatsBatch(max_records=max_records)
    pending = []
    for _, a, b in pairs:
        pending.append(batch.add(U.bits(a), U.bits(b), FORMATS[a.dtype]))
    assert len(batch) == len(pairs) % max_records  # full batches were launched as they filled
    return [tuple(s) for s in resolve_stats(pending)]


def test_a_batch_groups_launches_by_format_and_width_and_reads_each_pair_from_its_slot(monkeypatch) -> None:
    """The batching itself, without Triton (CI): each launch gets pairs of one format and one tile width, at most
    ``MAX_RECORDS``, and slot numbers into the batch's slab; a launch computing each slot with the compiled CPU
    pass gives every pair the reference definitions' statistics, whatever the batch size, and a batch fills,
    launches and empties at ``max_records`` and at ``max_bytes``."""
    from ulptrace import _ulp_cpu, _ulp_triton

    assert _ulp_cpu.library() is not None, _ulp_cpu.unavailable_reason()
    launches = []

    def launch(pairs, fmt, out, table=None):
        widths = {_ulp_triton.tile_columns(a.shape[-1] if a.dim() else 1) for a, _, _ in pairs}
        assert len(widths) == 1 and 0 < len(pairs) <= _ulp_triton.MAX_RECORDS
        made = _ulp_triton.table_of(pairs)  # the batch's table, built as the pairs came, is the launch's
        assert (table.entries, table.tiles, table.width) == (made.entries, made.tiles, made.width)
        assert all(a.dtype == fmt.int_dtype and b.dtype == fmt.int_dtype for a, b, _ in pairs)
        for a, b, slot in pairs:
            out[slot] += torch.tensor(_ulp_cpu.stats(a, b, fmt, rows=True))
        launches.append((fmt.name, widths.pop(), len(pairs)))

    monkeypatch.setattr(_ulp_triton, "launch_records", launch)
    pairs = _mixed_pairs()
    expected = [_expected(a, b) for _, a, b in pairs]
    groups = {(str(a.dtype), _ulp_triton.tile_columns(a.shape[-1] if a.dim() else 1)) for _, a, b in pairs}
    for max_records in (1, 7, 512):
        launches.clear()
        assert _batched(pairs, max_records) == expected, max_records
        assert sum(n for *_, n in launches) == len(pairs)
        if max_records == 512:  # one batch: one launch per format and width
            assert len(launches) == len(groups)
    launches.clear()
    batch = U.StatsBatch(max_bytes=1)  # every pair exceeds the bytes it may hold: launched as it arrives
    pending = [batch.add(U.bits(a), U.bits(b), FORMATS[a.dtype]) for _, a, b in pairs[:5]]
    assert len(batch) == 0 and [n for *_, n in launches] == [1] * 5
    assert [tuple(s) for s in resolve_stats(pending)] == expected[:5]
    batch = U.StatsBatch()  # a recorded input's statistics: no row statistics in the result
    pending = [batch.add(U.bits(a), U.bits(b), FORMATS[a.dtype], rows=False) for _, a, b in pairs]
    assert [tuple(s) for s in resolve_stats(pending + pending[:3])] == [e[:4] + (None, {}) for e in expected + expected[:3]]
    limit = _ulp_triton.MAX_RECORDS
    with pytest.raises(ValueError, match=f"max_records must be 1 to {limit} .a launch's table., but got {limit + 1}"):
        U.StatsBatch(max_records=limit + 1)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton with TRITON_INTERPRET=1")
def test_batched_launches_in_the_triton_interpreter() -> None:
    """Pairs of several formats and tile widths share launches (one per format and width, a binary search finds a
    program's record); each result equals the reference definitions, whatever the batch size."""
    pytest.importorskip("triton")
    pairs = _mixed_pairs()
    expected = [_expected(a, b) for _, a, b in pairs]
    for max_records in (7, 512):
        assert _batched(pairs, max_records) == expected, max_records
    batch = U.StatsBatch()  # a recorded input's statistics: no row statistics in the result
    pending = [batch.add(U.bits(a), U.bits(b), FORMATS[a.dtype], rows=False) for _, a, b in pairs]
    assert [tuple(s) for s in resolve_stats(pending)] == [e[:4] + (None, {}) for e in expected]


def test_a_launch_names_what_it_cannot_take() -> None:
    pytest.importorskip("triton")
    from ulptrace import _ulp_triton

    a = torch.ones(2, 20, dtype=torch.bfloat16).view(torch.int16)
    out = torch.zeros(2, _ulp_triton.RECORD_SLOTS, dtype=torch.int64)
    fmt = FORMATS[torch.bfloat16]
    with pytest.raises(ValueError, match="one tile width, but got rows of 128 and 16 columns"):
        _ulp_triton.launch_records([(a, a, 0), (a[:, :3], a[:, :3], 1)], fmt, out)
    with pytest.raises(ValueError, match=f"1 to {_ulp_triton.MAX_RECORDS} record pairs, but got 0"):
        _ulp_triton.launch_records([], fmt, out)


@pytest.mark.gpu
def test_batched_cuda_stats_equal_the_reference_definitions() -> None:
    """As in the interpreter, on the GPU, through ``pending_stats(batch=...)`` as the comparison calls it."""
    pairs = _mixed_pairs()
    for max_records in (5, 512):
        batch = U.StatsBatch(max_records=max_records)
        pending = [pending_stats(a.cuda(), b.cuda(), batch=batch) for _, a, b in pairs]
        got = [tuple(s) for s in resolve_stats(pending)]
        for (name, a, b), result in zip(pairs, got):
            assert result == _expected(a, b), (max_records, name)


@pytest.mark.gpu
def test_a_batch_past_its_reading_budget_waits_for_what_it_launched() -> None:
    """What a batch launched is held until the device has read it, at most ``max_reading_bytes`` (a long prefill's
    launches run far behind the host): past it the oldest launch is waited for and let go at once — the results
    are the same."""
    import gc
    import weakref

    a, b = torch.randn(64, 512, device="cuda").bfloat16(), torch.randn(64, 512, device="cuda").bfloat16()
    expected = _expected(a.cpu(), b.cpu())
    held = weakref.ref(a)
    batch = U.StatsBatch(max_reading_bytes=1)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning ahead of the launch on this stream
    pending = pending_stats(a, b, batch=batch)
    batch.launch()  # 131,072 bytes launched, over the budget: waited for
    assert batch._reading.waited == 1 and len(batch._reading) == 0
    del a, b
    gc.collect()
    assert held() is None, "held past the budget"
    assert tuple(resolve_stats([pending])[0]) == expected


@pytest.mark.gpu
def test_a_batch_holds_what_it_launched_until_the_device_has_read_it() -> None:
    """Memory another process shares (CUDA IPC: onset --concurrent's reference) goes back to it when this process
    drops its last tensor, whatever this stream still has to do: a launched pair is held until an event after its
    kernel has completed. The stream kept busy, the pair outlives the caller's references; done, it is released."""
    import gc
    import weakref

    a, b = torch.randn(64, 512, device="cuda").bfloat16(), torch.randn(64, 512, device="cuda").bfloat16()
    expected = _expected(a.cpu(), b.cpu())
    held = weakref.ref(a)
    batch = U.StatsBatch()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning ahead of the launch on this stream
    pending = pending_stats(a, b, batch=batch)
    batch.launch()
    del a, b
    gc.collect()
    assert held() is not None, "released while its statistics were still queued behind other work"
    assert tuple(resolve_stats([pending])[0]) == expected
    pending_stats(torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"), batch=batch)
    batch.launch()  # a later launch releases what the device has read
    gc.collect()
    assert held() is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_fused_cuda_record_stats_equal_the_reference_definitions(dtype) -> None:
    from ulptrace import _ulp_triton

    assert _ulp_triton.AVAILABLE, "Triton must be installed on the GPU machine (the fused path is what is tested)"
    for name, a, b in _cases(dtype):
        assert tuple(record_stats(a.cuda(), b.cuda())) == _expected(a, b), (dtype, name)
    big = torch.randn(4, 248_320).bfloat16()  # a logits-sized row
    other = (big.float() * (1 + 2.0 ** -7 * torch.randn(big.shape))).bfloat16()
    assert tuple(record_stats(big.cuda(), other.cuda())) == _expected(big, other)


def test_without_a_c_compiler_the_torch_path_serves_and_says_why(tmp_path, monkeypatch) -> None:
    from ulptrace import _ulp_cpu

    monkeypatch.setattr(_ulp_cpu, "_state", {})
    monkeypatch.setenv("ULPTRACE_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert _ulp_cpu.library() is None and "no-such-cc" in _ulp_cpu.unavailable_reason()
    a = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    assert tuple(record_stats(a, a * 2)) == _expected(a, a * 2)  # the torch path, same figures
    with pytest.raises(RuntimeError, match="compiled ULP statistics are unavailable: .*no-such-cc"):
        _ulp_cpu.stats(U.bits(a), U.bits(a), FORMATS[torch.bfloat16], rows=True)


def test_large_pairs_split_over_threads_give_the_same_statistics(monkeypatch) -> None:
    """Pairs of ``PARALLEL_ELEMENTS`` or more run on several threads (whole rows, or any elements without the row
    statistics); the merged statistics equal the reference definitions and one thread's."""
    from ulptrace import _ulp_cpu

    assert _ulp_cpu.library() is not None, _ulp_cpu.unavailable_reason()
    monkeypatch.setattr(_ulp_cpu, "PARALLEL_ELEMENTS", 1 << 14)  # small pairs take the threaded path too
    gen = torch.Generator().manual_seed(3)
    for shape in ((97, 333), (3, 9001), (50_001,)):
        a = torch.randn(shape, generator=gen).mul(3).bfloat16()
        b = (a.float() * (1 + 2.0 ** -6 * torch.randn(shape, generator=gen))).bfloat16()
        flat_a, flat_b = a.view(-1), b.view(-1)
        flat_a[::101], flat_b[7::89] = float("nan"), float("inf")
        flat_b[: flat_b.numel() // 3] = flat_a[: flat_a.numel() // 3]  # equal rows / stretches too
        threads = torch.get_num_threads()
        try:
            results = []
            for n in (1, 3):
                torch.set_num_threads(n)
                results.append((tuple(record_stats(a, b)), tuple(resolve_stats([pending_stats(a, b, rows=False)])[0])))
        finally:
            torch.set_num_threads(threads)
        assert results[0] == results[1], shape
        assert results[1][0] == _expected(a, b), shape
        assert results[1][1][:4] == _expected(a, b)[:4], shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_statistics_merged_from_parts_of_whole_rows_equal_those_of_the_whole(dtype) -> None:
    """A pair compared in parts of whole rows (a host reference moved over part by part) merges into exactly the
    whole's statistics — every field, with special values and equal rows in some parts only — and is checked against
    the definitions, not only against the whole pass; bad parts are named."""
    from ulptrace.ulp import merge_record_stats

    for name, a, b in _cases(dtype):
        if a.dim() < 2 or a.shape[0] < 3:
            continue
        for rows in (True, False):
            whole = resolve_stats([pending_stats(a, b, rows=rows)])[0]
            parts = [resolve_stats([pending_stats(a[i:j].contiguous(), b[i:j].contiguous(), rows=rows)])[0]
                     for i, j in ((0, 1), (1, 4), (4, a.shape[0]))]
            merged = merge_record_stats(parts)
            assert merged == whole, name
            if rows:
                assert tuple(merged) == _expected(a, b), name
    a, b = next((x, y) for n, x, y in _cases(dtype) if n == "differ")
    with_rows, without = record_stats(a, b), resolve_stats([pending_stats(a, b, rows=False)])[0]
    with pytest.raises(ValueError, match="at least one part"):
        merge_record_stats([])
    with pytest.raises(ValueError, match="row statistics or none"):
        merge_record_stats([with_rows, without])


@pytest.mark.gpu
def test_launch_tables_staged_through_one_pinned_ring_arrive_as_written() -> None:
    """``_ulp_triton.Staging``: tables copied to the device out of one pinned ring, without the host waiting, arrive
    as written — also when the stream is still busy (``torch.cuda._sleep``) as the ring wraps over a region whose copy
    has not run yet (the wrap waits for it: without that the second table's values would be read for the first),
    and a table larger than the ring."""
    from ulptrace import _ulp_triton

    staging = _ulp_triton.Staging(entries=16)
    first, second, large = list(range(10)), list(range(100, 110)), list(range(1000, 1040))
    torch.cuda._sleep(50_000_000)  # the stream busy for a while: the copies below wait behind it
    got_first = staging.upload(first, torch.device("cuda"))
    got_second = staging.upload(second, torch.device("cuda"))  # does not fit after the first: the ring wraps
    got_large = staging.upload(large, torch.device("cuda"))
    assert got_first.tolist() == first and got_second.tolist() == second and got_large.tolist() == large
    assert got_first.dtype == torch.int64 and got_first.is_cuda
