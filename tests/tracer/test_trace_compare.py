"""Trace files, comparison and onset on tiny-qwen3.5 (CPU, BF16)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from ulptrace.comparison import StreamingComparator, compare
from ulptrace.faults import inject_fault
from ulptrace.probes.onset import run_onset
from ulptrace.record import Recorder
from ulptrace.run import RunConfig, greedy
from ulptrace.trace import LazyTrace, TraceError, load_trace


@pytest.fixture(scope="module")
def reference(qwen, prompts):
    with Recorder(qwen) as rec:
        greedy(qwen, prompts, 3)
    return rec.trace


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_trace_round_trips_bitwise(reference, tmp_path) -> None:
    reference.save(tmp_path / "t")
    loaded = load_trace(tmp_path / "t")
    assert loaded.keys() == reference.keys()
    assert loaded.metadata["model"] == "tiny-qwen3.5" and loaded.metadata["path"] == "hf"
    assert "torch" in loaded.metadata["versions"]
    for rec in reference:
        other = loaded[rec.key]
        assert (other.kind, other.layer) == (rec.kind, rec.layer)
        assert other.out.dtype == rec.out.dtype and torch.equal(_bits(other.out), _bits(rec.out))
        assert set(other.inputs) == set(rec.inputs)
        for role, t in rec.inputs.items():
            assert torch.equal(_bits(other.inputs[role]), _bits(t))
    with pytest.raises(FileExistsError, match="already exists"):
        reference.save(tmp_path / "t")


def test_records_whose_tensors_share_one_storage_are_written_and_read_back_exactly(tmp_path) -> None:
    """A recorder serves a view inside a copied value by a view of that copy, so two records' tensors can be views of
    one storage — one the whole of it under another shape (safetensors refuses tensors that share memory): each is
    written as a tensor of its own and reads back with its own values."""
    from ulptrace.trace import Record, TraceWriter

    whole = torch.arange(8, dtype=torch.float32).bfloat16()
    first, second = whole.view(2, 4).unbind(0)
    reshaped = whole.view(2, 4)  # the whole storage again, another shape
    writer = TraceWriter(tmp_path / "t")
    writer.add(Record("a", 0, "other", None, whole))
    writer.add(Record("b", 0, "other", None, reshaped, {"x": first, "y": second}))
    writer.close()
    loaded = load_trace(tmp_path / "t")
    a, b = loaded["a", 0], loaded["b", 0]
    assert torch.equal(_bits(a.out), _bits(whole)) and torch.equal(_bits(b.out), _bits(reshaped))
    assert torch.equal(_bits(b.inputs["x"]), _bits(first)) and torch.equal(_bits(b.inputs["y"]), _bits(second))


def test_bad_trace_directories_fail_clearly(reference, tmp_path) -> None:
    path = reference.save(tmp_path / "good")
    with pytest.raises(TraceError, match="not a trace directory"):
        load_trace(tmp_path / "missing")
    bad = tmp_path / "truncated"
    shutil.copytree(path, bad)
    shard = min(bad.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(TraceError, match="truncated"):
        load_trace(bad)
    foreign = tmp_path / "foreign"
    shutil.copytree(path, foreign)
    (foreign / "manifest.json").write_text(json.dumps({"schema": "something.else", "version": 1}))
    with pytest.raises(TraceError, match="schema 'something.else'.*not a ulptrace trace"):
        load_trace(foreign)
    newer = tmp_path / "newer"
    shutil.copytree(path, newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["version"] = 99
    (newer / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="version 99.*upgrade"):
        load_trace(newer)
    (newer / "manifest.json").write_text("{not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(newer)


def test_streaming_comparison_equals_stored_comparison(qwen, prompts, reference, tmp_path) -> None:
    reference.save(tmp_path / "ref")
    # a fault counts forward calls from its installation: one fault per run
    with inject_fault(qwen, "layers.1.mlp.glu", step=1, index=5, ulps=2), Recorder(qwen) as rec:
        greedy(qwen, prompts, 3)
    sink = StreamingComparator(LazyTrace(tmp_path / "ref"))
    with inject_fault(qwen, "layers.1.mlp.glu", step=1, index=5, ulps=2), Recorder(qwen, sink=sink):
        greedy(qwen, prompts, 3)
    stored = compare(load_trace(tmp_path / "ref"), rec.trace).to_json()
    streamed = sink.finish().to_json()
    stored.pop("candidate"), streamed.pop("candidate")
    assert stored == streamed
    assert stored["first_difference"] == {"step": 1, "site": "layers.1.mlp.glu", "kind": "glu", "layer": 1}
    glu = next(s for s in stored["sites"] if (s["site"], s["step"]) == ("layers.1.mlp.glu", 1))
    assert (glu["differing"], glu["max_ulp"], glu["histogram"]["2"]) == (1, 2, 1)


def test_hf_against_itself_reports_no_difference() -> None:
    comparison, info = run_onset(RunConfig(prompts=2, prompt_len=8, new_tokens=3, oracle=False,
                                           check_observation=True))
    assert comparison.sites and all(d.bitwise_equal for d in comparison.sites)
    assert comparison.first_difference() is None and comparison.onset() is None
    assert not (comparison.missing or comparison.extra or comparison.mismatched)
    assert comparison.observation["bitwise_equal"] is True
    assert info["first_token_flip"] is None


@pytest.mark.parametrize("site", ["layers.1.post_attention_layernorm", "layers.2.mlp.glu",
                                  "layers.2.linear_attn.gates.g", "layers.3.self_attn.core"])
def test_one_ulp_fault_is_located_exactly(site: str) -> None:
    comparison, _ = run_onset(RunConfig(candidate=f"fault:{site}@2+1", prompts=2, prompt_len=8, new_tokens=4,
                                        oracle=False))
    first = comparison.first_difference()
    assert (first.step, first.site) == (2, site)
    assert (first.differing, first.max_ulp, first.histogram["1"]) == (1, 1, 1)
    index = comparison.sites.index(first)
    assert index > 0 and all(d.bitwise_equal for d in comparison.sites[:index])
    onset = comparison.onset()
    assert (onset.step, onset.site) == (2, site)


def test_eager_attention_against_sdpa_diverges_at_the_first_attention_core() -> None:
    comparison, _ = run_onset(RunConfig(candidate="hf:attn=eager", prompts=2, prompt_len=8, new_tokens=2,
                                        oracle=False))
    first = comparison.first_difference()
    assert first.site == "layers.1.self_attn.core" and first.step == 0
    assert first.input_delta == {"query": 0, "key": 0, "value": 0}  # the core itself differs
    assert comparison.candidate["attn_implementation"] == "eager"


def test_mismatched_and_missing_records_are_listed_not_crashed(reference) -> None:
    from ulptrace.trace import Record, Trace

    records = list(reference)
    cand = Trace(reference.metadata)
    for rec in records[1:]:
        out = rec.out[..., :-1] if rec.site == "layers.0.input_layernorm" and rec.step == 0 else rec.out
        cand.add(Record(rec.site, rec.step, rec.kind, rec.layer, out, rec.inputs))
    cand.add(Record("extra.site", 0, "other", None, torch.zeros(2)))
    result = compare(reference, cand)
    assert result.missing == [{"site": records[0].site, "step": records[0].step}]
    assert result.extra == [{"site": "extra.site", "step": 0}]
    assert result.mismatched[0]["site"] == "layers.0.input_layernorm"
    assert "[2, 6, 128]" in result.mismatched[0]["reason"] and "[2, 6, 127]" in result.mismatched[0]["reason"]


def test_a_record_stored_in_another_float_dtype_is_equal_only_where_it_holds_the_references_values() -> None:
    """A candidate that stores FP32 where the reference stores BF16 (a kernel that skips a final rounding): ULPs are
    counted in the reference's dtype, where values within half a BF16 ULP round to the reference's — but such a record
    is not equal (before, it read ``bitwise_equal`` with 0 differing while its verdicts said boundary, and the first
    difference came after the onset); FP32 values that are the BF16 reference's own are equal, a narrower candidate
    converts exactly; a recorded input of another float dtype is compared as the output is (it was not compared)."""
    from ulptrace.comparison import diff_records
    from ulptrace.trace import Record

    ref = torch.tensor([[1.0, 2.0, 3.0, -0.5]], dtype=torch.bfloat16)
    near = ref.float() + torch.tensor([[2.0**-10, 0.0, -(2.0**-9), 0.0]])  # within half an ULP: rounds to ref
    wide = Record("a", 0, "gates", 0, near, {"x": near})
    got = diff_records(Record("a", 0, "gates", 0, ref, {"x": ref}), wide)
    assert (got.bitwise_equal, got.differing, got.max_ulp) == (False, 2, 0)
    assert got.histogram["0"] == 4 and "candidate stores float32, reference bfloat16" in got.note
    assert got.input_delta == {"x": 1}  # 0 ULPs in BF16, yet other values: 1, as a NaN on one side
    same = diff_records(Record("a", 0, "gates", 0, ref, {"x": ref}), Record("a", 0, "gates", 0, ref.float(), {"x": ref}))
    assert (same.bitwise_equal, same.differing, same.input_delta) == (True, 0, {"x": 0})
    narrow_ref = ref.float() + torch.tensor([[0.0, 0.0, 2.0**-20, 0.0]])
    narrow = diff_records(Record("g", 0, "gates", 0, narrow_ref, {"x": narrow_ref}),
                          Record("g", 0, "gates", 0, ref, {"x": ref}))
    assert (narrow.bitwise_equal, narrow.differing, narrow.max_ulp) == (False, 1, 2**(23 - 1 - 20))  # FP32 ULPs at 3
    assert narrow.input_delta == {"x": 2**(23 - 1 - 20)}
    assert (got.candidate_dtype, same.candidate_dtype, narrow.candidate_dtype) == ("float32", "float32", "bfloat16")
    assert diff_records(Record("a", 0, "gates", 0, ref, {}), Record("a", 0, "gates", 0, ref, {})).candidate_dtype is None


def test_the_text_report_says_which_records_were_stored_in_another_dtype() -> None:
    """A candidate's FP32 records that hold exactly the reference's BF16 values are equal in the reference's dtype —
    the text must not let "every compared record is bitwise equal" hide that they are stored otherwise (the JSON said
    so only in each site's note)."""
    from ulptrace.report import to_markdown, to_table
    from ulptrace.trace import Record, Trace

    values = [torch.tensor([[1.0, 2.0, 3.0, -0.5]], dtype=torch.bfloat16) * k for k in (1, 2, 3)]
    reference, widened = Trace(), []
    for i, v in enumerate(values):
        reference.add(Record(f"layers.{i}.mlp.glu", 0, "glu", i, v, {}))
        widened.append(Record(f"layers.{i}.mlp.glu", 0, "glu", i, v.float() + (2.0**-12 if i == 2 else 0.0), {}))
    data = compare(reference, widened).to_json()
    assert [s["candidate_dtype"] for s in data["sites"]] == ["float32"] * 3
    text = to_table(data)
    assert ("stored in another dtype: 3 candidate records (float32 where the reference has bfloat16: "
            "layers.0.mlp.glu@0, layers.1.mlp.glu@0, layers.2.mlp.glu@0), compared and judged in the reference's "
            "dtype; 2 of them hold exactly the reference's values") in " ".join(text.split())
    assert "stored in another dtype: 3 candidate records" in to_markdown(data)
    same = compare(reference, [Record(f"layers.{i}.mlp.glu", 0, "glu", i, v, {}) for i, v in enumerate(values)])
    same = same.to_json()
    assert "stored in another dtype" not in to_table(same)


def test_an_input_that_is_an_earlier_records_output_is_compared_once(monkeypatch) -> None:
    """The recorder keeps one copy per observation, so a site's input is often the same tensor object as an
    earlier site's output on each side: the streaming comparator reuses that comparison (same figures)."""
    import ulptrace.comparison as C
    from ulptrace.comparison import StreamingComparator
    from ulptrace.trace import Record, Trace

    calls = []
    real = C.pending_stats
    monkeypatch.setattr(C, "pending_stats", lambda a, b, **k: calls.append(1) or real(a, b, **k))
    ref_x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    cand_x = torch.tensor([[1.0, 2.0, 3.015625]], dtype=torch.bfloat16)  # 1 ULP at 3.0
    ref_y, cand_y = ref_x * 2, cand_x * 2
    reference = Trace()
    reference.add(Record("a", 0, "norm", 0, ref_x, {}))
    reference.add(Record("b", 0, "linear", 0, ref_y, {"x": ref_x}))
    sink = StreamingComparator(reference)
    sink.add(Record("a", 0, "norm", 0, cand_x, {}))
    sink.add(Record("b", 0, "linear", 0, cand_y, {"x": cand_x}))
    a, b = sink.finish().sites
    assert len(calls) == 2  # a's output and b's output; b's input is a's output
    assert a.max_ulp == 1 and b.input_delta == {"x": 1}
    # a copy with the same values is another object: compared again, same figure
    sink = StreamingComparator(reference)
    sink.add(Record("a", 0, "norm", 0, cand_x, {}))
    sink.add(Record("b", 0, "linear", 0, cand_y, {"x": cand_x.clone()}))
    assert sink.finish().sites[1].input_delta == {"x": 1} and len(calls) == 5


def test_trace_writer_writes_shards_in_the_background_and_raises_a_failed_write(tmp_path, monkeypatch) -> None:
    """Shards are written by a background thread; what is written equals what was recorded, and a write that
    fails is raised by the writer (at the next step or at close), never lost."""
    import safetensors.torch as st
    from ulptrace.trace import Record, TraceWriter

    writer = TraceWriter(tmp_path / "ok.trace")
    values = {step: torch.randn(3, 4).bfloat16() for step in range(3)}
    for step, value in values.items():
        writer.add(Record("s", step, "norm", 0, value, {"x": value * 2}))
    loaded = load_trace(writer.close())
    for step, value in values.items():
        record = loaded[("s", step)]
        assert torch.equal(record.out, value) and torch.equal(record.inputs["x"], value * 2)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", disk_full)
    writer = TraceWriter(tmp_path / "full.trace")
    writer.add(Record("s", 0, "norm", 0, values[0], {}))
    writer.add(Record("s", 1, "norm", 0, values[1], {}))  # step 0's shard is queued here
    with pytest.raises(OSError, match="No space left on device"):
        writer.close()
    assert not (tmp_path / "full.trace").exists()  # never renamed into place
    writer.abort()


@pytest.mark.gpu
def test_trace_writer_copies_gpu_records_without_waiting_and_writes_them_exactly(tmp_path) -> None:
    from ulptrace.trace import Record, TraceWriter

    writer = TraceWriter(tmp_path / "gpu.trace")
    values = {step: torch.randn(64, 256, device="cuda").bfloat16() for step in range(4)}
    for step, value in values.items():
        writer.add(Record("s", step, "norm", 0, value, {}))
    loaded = load_trace(writer.close())
    for step, value in values.items():
        assert torch.equal(loaded[("s", step)].out, value.cpu())


@pytest.mark.gpu
def test_batched_cuda_comparison_equals_the_cpu_pass_on_a_real_run() -> None:
    """A whole run's records compared on the GPU (``StatsBatch``: many records per launch, read in slabs) give
    exactly the statistics of the same records compared on the CPU (compiled pass): every field of every site."""
    from contextlib import ExitStack

    from ulptrace.probes.onset import record_pair
    from ulptrace.trace import Record, Trace

    cfg = RunConfig(model="tiny-qwen3.5", device="cuda", candidate="kernels:fused", prompts=3, prompt_len=20,
                    new_tokens=3, oracle=False)
    with ExitStack() as stack:
        ref, cand, _, _ = record_pair(cfg, stack)

    def on_cpu(records):
        return [Record(r.site, r.step, r.kind, r.layer, r.out.cpu(), {k: v.cpu() for k, v in r.inputs.items()})
                for r in records]

    gpu = compare(ref, cand).to_json()
    cpu = compare(Trace(ref.metadata, on_cpu(ref)), on_cpu(cand)).to_json()
    assert len(gpu["sites"]) > 100 and any(not s["bitwise_equal"] for s in gpu["sites"])
    assert gpu["sites"] == cpu["sites"]


def _live_comparison(device: str, monkeypatch, chunk: int | None = None) -> tuple[dict, dict]:
    """(streamed with every value handed over live, streamed with copies) of tiny-qwen3.5's HF path against the
    fused kernels on ``device``, the reference kept in host memory (``chunk``: its parts' size on the way over)."""
    from contextlib import ExitStack

    import ulptrace.comparison as C
    from ulptrace.probes.onset import record_pair
    from ulptrace.record import MemorySink

    cfg = RunConfig(model="tiny-qwen3.5", device=device, candidate="kernels:fused", prompts=3, prompt_len=20,
                    new_tokens=3, oracle=False)
    with ExitStack() as stack:
        ref, cand, _, _ = record_pair(cfg, stack)
    host = MemorySink(device="cpu")
    for record in ref:
        host.add(record)
    reference = host.trace
    if chunk is not None:
        monkeypatch.setattr(C, "MOVE_CHUNK_BYTES", chunk)
    results = []
    for live in (0, None):
        sink = StreamingComparator(reference)
        sink.live_bytes = live if live is not None else 1 << 62
        for record in cand:
            sink.add(record)
        results.append(sink.finish().to_json())
    return results[0], results[1]


def test_a_comparator_handed_live_values_gives_the_figures_of_copies(monkeypatch) -> None:
    """Every candidate value handed over uncopied (``live_bytes = 0``) gives the same comparison as copies."""
    live, copies = _live_comparison("cpu", monkeypatch)
    assert len(live["sites"]) > 100 and any(not s["bitwise_equal"] for s in live["sites"])
    assert live == copies


@pytest.mark.gpu
def test_live_values_and_a_host_reference_moved_over_in_parts_give_the_figures_of_a_whole_comparison(monkeypatch
                                                                                                 ) -> None:
    """On the GPU: the candidate's values handed over live (their statistics launched in ``add``) and a reference
    in host memory moved over in parts of whole rows give exactly the figures of copies compared whole."""
    live, copies = _live_comparison("cuda", monkeypatch, chunk=4096)
    assert len(live["sites"]) > 100 and any(not s["bitwise_equal"] for s in live["sites"])
    assert live == copies
    assert live == _live_comparison("cuda", monkeypatch)[1]  # and those of parts as large as the default


@pytest.mark.gpu
def test_a_live_value_written_behind_the_version_counter_after_add_is_compared_as_observed() -> None:
    """A record holding a live value has its statistics launched before ``add`` returns: a write that the model
    makes right after (through ``.data``, which no version counter sees) does not reach the comparison."""
    from ulptrace.trace import Record, Trace

    ref = torch.randn(64, 128, device="cuda").bfloat16()
    reference = Trace()
    reference.add(Record("s", 0, "norm", 0, ref, {}))
    cand = ref.clone()
    sink = StreamingComparator(reference)
    sink.live_bytes = 0
    sink.add(Record("s", 0, "norm", 0, cand, {}))
    cand.data.add_(1)  # the model writes its value in place after the record was handed over
    site = sink.finish().sites[0]
    assert site.bitwise_equal and site.differing == 0


def test_a_trace_of_views_sharing_a_storage_saves_and_loads_bitwise(tmp_path) -> None:
    """Records whose tensors are views of one storage (slices, overlapping ones) are written each with a storage of
    its own — safetensors refuses overlapping shared storage — and read back exactly."""
    from ulptrace.trace import Record, Trace

    buf = torch.randn(4, 8).bfloat16()
    trace = Trace({"model": "views"})
    trace.add(Record("a", 0, "norm", 0, buf[:2], {}))
    trace.add(Record("b", 0, "linear", 0, buf[1:], {"x": buf[:, 2:5], "y": buf[:2]}))
    loaded = load_trace(trace.save(tmp_path / "t"))
    for record in trace:
        other = loaded[record.key]
        assert torch.equal(_bits(other.out), _bits(record.out)) and other.inputs.keys() == record.inputs.keys()
        assert all(torch.equal(_bits(other.inputs[k]), _bits(v)) for k, v in record.inputs.items())
