"""``onset --concurrent``: the reference recorded in a process of its own while the candidate runs gives the report
the sequential onset gives — records, statistics, verdicts, onset, tokens, the observation check — and what goes
wrong in that process is raised here, never read as a clean run.

Each concurrent run starts a process (imports and a model build, a few seconds on a CPU): few runs, small shapes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from onset_reports import essentials as _essentials
from onset_reports import report as _report
from onset_reports import within as _within
from ulptrace.cli import main
from ulptrace.concurrent import ReferenceProcess, shutdown
from ulptrace.models import build_model
from ulptrace.paths import PathError
from ulptrace.probes.onset import run_onset
from ulptrace.run import RunConfig, greedy, make_prompts

SMALL = {"prompts": 2, "prompt_len": 8, "new_tokens": 3}


class _Ends:
    """The parent's side of a reference process for a ``RemoteTrace`` without a process: messages from a queue, and
    what the trace tells that process counted here (messages taken, live reads acknowledged, bytes let go)."""

    def __init__(self, messages) -> None:
        self.messages, self.taken, self.acks, self.let_go_bytes = messages, 0, 0, 0

    def next_message(self):
        self.taken += 1
        return self.messages.get_nowait()

    def ack(self) -> None:
        self.acks += 1

    def let_go(self, nbytes: int) -> None:
        self.let_go_bytes += nbytes


def _both(**fields) -> tuple[dict, dict]:
    sequential = _report(RunConfig(**SMALL, **fields))
    concurrent = _report(RunConfig(**SMALL, concurrent=True, **fields))
    return sequential, concurrent


def test_concurrent_onset_reports_what_the_sequential_one_does() -> None:
    sequential, concurrent = _both(model="tiny-qwen3.5", candidate="kernels:fused", oracle=False)
    assert _essentials(concurrent) == _essentials(sequential)
    assert concurrent["sites"], "records were compared"
    assert "reference_process" in concurrent["run"]  # the reference's process reported back
    # where both sides' time went: the reference's packing and queue puts are parts of its run
    seconds = concurrent["run"]["reference_process"]["seconds"]
    assert set(seconds) == {"run_s", "pack_s", "flight_wait_s", "put_s", "live_wait_s", "candidate_waited_s",
                            "candidate_unpack_s"}
    assert min(seconds.values()) >= 0 and 0 < seconds["pack_s"] + seconds["put_s"] < seconds["run_s"]
    assert concurrent["run"]["reference_process"]["arena_waits"] == 0  # host memory: nothing waits for a device
    # where each side was when: every step sent whole before this side had its token, each event's end after its start
    messages = concurrent["run"]["reference_process"]["messages"]
    sent = {step: handed for step, _, handed in messages["sent"]}
    assert sorted(sent) == list(range(SMALL["new_tokens"]))
    asked = messages["asked"]
    assert [step for step, _, _ in asked] == list(range(SMALL["new_tokens"] - 1))  # the last step's token feeds nothing
    assert all(sent[step] <= had and asked_at <= had for step, asked_at, had in asked)
    events = [*messages["sent"], *messages["received"], *asked]  # (this side may wait before the reference began)
    assert all(start <= end for _, start, end in events) and min(end for _, _, end in events) >= 0
    assert messages["received"][-1][0] is None  # the reference's end, after its steps


def test_a_step_shipped_in_parts_reports_what_the_sequential_onset_does(monkeypatch) -> None:
    """A long prompt's prefill is shipped in parts (what waits in either process is bounded by the part size, not by
    the step): with parts of one byte every record travels alone, and nothing changes in the report."""
    from ulptrace import concurrent

    monkeypatch.setattr(concurrent, "PART_BYTES", 1)
    sequential, concurrent_report = _both(model="tiny-qwen3.5", candidate="kernels:fused", oracle=False)
    assert _essentials(concurrent_report) == _essentials(sequential)


def test_concurrent_onset_with_the_oracle_finds_the_same_onset_and_verdicts() -> None:
    # a planted one-element fault at step 1: a record that differs, judged by the oracle, after equal records
    began = time.perf_counter()
    sequential, concurrent = _both(model="tiny-llama", candidate="fault:layers.1.mlp.glu@1+2", check_observation=True)
    ended = time.perf_counter()
    assert _essentials(concurrent) == _essentials(sequential)
    # where each onset's time went, in order, inside the window the two ran in (the same clock)
    for data, marks in ((sequential, ["built_s", "reference_s", "candidate_s", "finished_s"]),
                        (concurrent, ["built_s", "candidate_s", "finished_s"])):
        timeline = data["run"]["timeline"]
        assert list(timeline) == ["started_at", *marks]
        seconds = [timeline[m] for m in marks]
        assert 0 < seconds[0] and seconds == sorted(seconds)
        assert began < timeline["started_at"] and timeline["started_at"] + seconds[-1] < ended
    assert sequential["run"]["timeline"]["started_at"] + sequential["run"]["timeline"]["finished_s"] \
        < concurrent["run"]["timeline"]["started_at"]  # run one after the other
    assert concurrent["onset"] is not None and concurrent["onset"]["step"] == 1
    assert concurrent["run"]["observation"]["checked"] and concurrent["run"]["observation"]["candidate"]["checked"]


def test_the_reference_process_is_kept_for_the_next_run_of_its_model() -> None:
    """A clean run leaves its process (model built, warm) for the next onset of the same model; another model gets a
    new one and the old one is stopped; ``shutdown`` stops the one kept."""
    cfg = {"model": "tiny-llama", "candidate": "fault:layers.0.mlp.glu@0+1", "oracle": False}
    sequential = _report(RunConfig(**SMALL, **cfg))
    first = _report(RunConfig(**SMALL, concurrent=True, **cfg))
    again = _report(RunConfig(**SMALL, concurrent=True, **cfg))
    assert _essentials(first) == _essentials(again) == _essentials(sequential)
    assert again["run"]["reference_process"]["pid"] == first["run"]["reference_process"]["pid"]
    assert again["run"]["reference_process"]["run_in_process"] == first["run"]["reference_process"]["run_in_process"] + 1
    other = _report(RunConfig(**SMALL, concurrent=True, model="tiny-qwen3.5", candidate="kernels:fused", oracle=False))
    assert other["run"]["reference_process"]["pid"] != first["run"]["reference_process"]["pid"]
    assert other["run"]["reference_process"]["run_in_process"] == 1
    from ulptrace.concurrent import _IDLE

    (kept,) = _IDLE.values()
    t0 = time.perf_counter()
    shutdown()  # asked to stop, it ends at once and cleanly (not killed: exit code 0)
    assert kept.process.exitcode == 0 and time.perf_counter() - t0 < 2.0 and not _IDLE
    assert _report(RunConfig(**SMALL, concurrent=True, **cfg))["run"]["reference_process"]["run_in_process"] == 1


def test_a_new_process_is_sent_the_model_and_reports_what_one_building_its_own_does(monkeypatch) -> None:
    """A new reference process gets a twin of this side's freshly built model (its memory shared) instead of drawing
    the weights again; one that builds its own (no model sent) gives the same report, parameter checksums included."""
    fields = {"model": "tiny-qwen3.5", "candidate": "kernels:fused", "oracle": False}
    shutdown()
    sequential, sent = _both(**fields)
    assert sent["run"]["reference_process"]["start_up"]["model_shipped"] is True
    shutdown()
    start = ReferenceProcess.start
    monkeypatch.setattr(ReferenceProcess, "start", lambda self, model=None: start(self))
    built = _report(RunConfig(**SMALL, concurrent=True, **fields))
    assert built["run"]["reference_process"]["start_up"]["model_shipped"] is False
    assert _essentials(sent) == _essentials(built) == _essentials(sequential)
    assert sent["reference"]["parameters"] == sequential["reference"]["parameters"] != {}
    with ReferenceProcess(RunConfig(**SMALL, concurrent=True, **fields)) as process, \
            pytest.raises(RuntimeError, match=r"not started \(ReferenceProcess.start\)"):
        process.trace.metadata  # noqa: B018 — nothing was sent: reading it must not wait for ever
    shutdown()


def test_a_run_that_cannot_be_sent_is_an_error_not_a_wait(monkeypatch) -> None:
    """multiprocessing pickles what a queue sends in a thread of its own and drops what fails (printing the error):
    a model that cannot be pickled would leave both processes waiting for ever. It is an error here instead."""
    from ulptrace import concurrent

    shutdown()  # a new process, which is sent its model
    monkeypatch.setattr(concurrent, "shipped_twin", lambda model: (lambda: model))  # a closure: pickle refuses it
    with pytest.raises(RuntimeError, match="could not be sent between this process and the other"):
        _within(60, lambda: _report(RunConfig(**SMALL, concurrent=True, model="tiny-llama", oracle=False)))


def test_a_process_that_ran_the_users_own_reference_path_is_not_kept() -> None:
    """The kept process would run the path's code as it imported it, not as the user has edited it since."""
    cfg = {"model": "tiny-llama", "reference": "generation_candidates:glu_error_in_batches", "oracle": False}
    first = _report(RunConfig(**SMALL, concurrent=True, **cfg))["run"]["reference_process"]
    second = _report(RunConfig(**SMALL, concurrent=True, **cfg))["run"]["reference_process"]
    assert second["run_in_process"] == 1 and second["pid"] != first["pid"]


def test_an_error_in_the_reference_process_is_raised_with_its_traceback() -> None:
    """Raised here as it was raised there — a user path's failure the same ``PathError`` as without ``--concurrent``
    — caused by its traceback in that process."""
    cfg = RunConfig(model="tiny-llama", reference="generation_candidates:raises_when_applied", oracle=False,
                    concurrent=True, **SMALL)
    with pytest.raises(PathError, match="planted failure while applying") as raised:
        run_onset(cfg)
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert re.search("(?s)reference run failed in its process.*planted failure while applying",
                     str(raised.value.__cause__))


def test_bad_input_found_in_the_reference_process_is_one_line_and_exit_2(capsys) -> None:
    """A selection that matches nothing, found where the reference's sites are selected: the same one-line error and
    exit status as without ``--concurrent``, no traceback."""
    argv = ["onset", "--no-oracle", "--model", "tiny-llama", "--prompts", "2", "--prompt-len", "8", "--new-tokens",
            "2", "--sites", "nomatch*", "--quiet"]
    assert main(argv) == 2
    sequential = capsys.readouterr().err
    assert main([*argv, "--concurrent"]) == 2
    concurrent = capsys.readouterr().err
    assert concurrent == sequential and "--sites 'nomatch*' matches no site" in concurrent
    assert "Traceback" not in concurrent


def test_a_reference_process_that_dies_is_reported_with_its_exit_code() -> None:
    shutdown()  # a new process: still importing when it is killed
    with ReferenceProcess(RunConfig(model="tiny-llama", concurrent=True, **SMALL)) as process:
        process.start()  # no model sent: it would build its own
        process.kill()
        with pytest.raises(RuntimeError, match=r"ended without finishing its run \(exit code -9\); if a script"):
            process.trace.metadata  # noqa: B018 — reading it waits for the process


def test_the_cli_runs_it(tmp_path) -> None:
    out = tmp_path / "onset.json"
    assert main(["onset", "--concurrent", "--no-oracle", "--model", "tiny-llama", "--candidate", "kernels:fused",
                 "--prompts", "2", "--prompt-len", "8", "--new-tokens", "2", "--quiet", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sites"] and report["run"]["reference_process"]["pid"] > 0


def test_concurrent_refuses_what_it_cannot_do(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="keeps no reference trace, but a reference directory was given"):
        run_onset(RunConfig(concurrent=True, **SMALL), reference_dir=tmp_path)
    assert main(["onset", "--concurrent", "--tp", "2", "--no-oracle"]) == 2
    assert "--tp 2 runs one process per rank already" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # a value it does not take: named, nothing run
        main(["onset", "--concurrent", "splt", "--no-oracle"])
    assert exited.value.code == 2
    assert "argument --concurrent: expected no value or 'split', but got 'splt'" in capsys.readouterr().err
    from contextlib import ExitStack

    from ulptrace.probes.onset import record_pair

    with ExitStack() as stack, pytest.raises(ValueError, match="concurrent=True is run_onset's"):
        record_pair(RunConfig(concurrent=True, **SMALL), stack)
    with ExitStack() as stack, pytest.raises(ValueError, match="judge_workers=2 is run_onset's"):
        record_pair(RunConfig(judge_workers=2, **SMALL), stack)  # accepted and ignored, it would read as judged there


def test_greedy_fed_by_a_function_feeds_what_a_tensor_feeds() -> None:
    model = build_model("tiny-llama")
    prompts = make_prompts(model.config.vocab_size, 2, 6, 0)
    forced = torch.randint(0, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(1))
    seen: list[int] = []

    def feed(step: int) -> torch.Tensor:
        seen.append(step)
        return forced[:, step:step + 1]

    logits_tensor, logits_function = [], []
    greedy(model, prompts, 5, forced=forced, on_logits=lambda s, l: logits_tensor.append(l.clone()))
    greedy(model, prompts, 5, forced=feed, on_logits=lambda s, l: logits_function.append(l.clone()))
    assert seen == [0, 1, 2, 3]  # asked once per decode step, in order, never for the last choice
    assert all(torch.equal(a, b) for a, b in zip(logits_tensor, logits_function, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [{"model": "tiny-qwen3.5", "candidate": "kernels:fused", "oracle": False},
                                    {"model": "tiny-llama", "candidate": "fault:layers.1.mlp.glu@1+2"}], ids=str)
def test_concurrent_onset_on_the_gpu_reports_what_the_sequential_one_does(fields, cuda_kernels) -> None:
    """On a GPU the reference's records come through CUDA IPC (one arena per step) and are compared there."""
    sequential, concurrent = _both(device="cuda", **fields)
    assert _essentials(concurrent) == _essentials(sequential)
    assert concurrent["sites"] and concurrent["run"]["reference_process"]["peak_gpu_bytes"] > 0


@pytest.mark.gpu
def test_live_values_through_cuda_ipc_report_the_same(monkeypatch, cuda_kernels) -> None:
    """Values of 64 KiB or more handed over live on the GPU (the model's own memory, shared through CUDA IPC; the
    reference waits until this side's statistics have read them): the sequential onset's report, no deadlock."""
    from ulptrace import concurrent

    monkeypatch.setattr(concurrent, "LIVE_BYTES", 64 << 10)
    sequential, concurrent_report = _both(device="cuda", model="tiny-qwen3.5", candidate="kernels:fused", oracle=False)
    assert _essentials(concurrent_report) == _essentials(sequential)


@pytest.mark.gpu
def test_large_tensors_shared_as_they_are_on_the_gpu_report_the_same(monkeypatch, cuda_kernels) -> None:
    """Parts of 1 KiB: a tensor of 256 bytes or more is shared through CUDA IPC as it is (no arena copy), the rest
    packed; the report is the sequential onset's."""
    from ulptrace import concurrent

    monkeypatch.setattr(concurrent, "PART_BYTES", 1024)
    sequential, concurrent_report = _both(device="cuda", model="tiny-qwen3.5", candidate="kernels:fused", oracle=False)
    assert _essentials(concurrent_report) == _essentials(sequential)


@pytest.mark.gpu
def test_arenas_past_the_waiting_budget_are_waited_for_and_the_report_is_the_same(monkeypatch, cuda_kernels) -> None:
    """Arenas read here wait for the device to pass them up to ``WAITING_BYTES``, then the oldest are waited for
    (a long prefill's host work runs far ahead of its device work): with a budget of one byte every message's arenas
    are waited for at once, parts of 1 KiB make many of them, and the report is the sequential onset's."""
    from ulptrace import concurrent

    monkeypatch.setattr(concurrent, "PART_BYTES", 1024)
    monkeypatch.setattr(concurrent, "WAITING_BYTES", 1)
    sequential, concurrent_report = _both(device="cuda", model="tiny-qwen3.5", candidate="kernels:fused", oracle=False)
    assert _essentials(concurrent_report) == _essentials(sequential)
    assert concurrent_report["run"]["reference_process"]["arena_waits"] >= 0


@pytest.mark.gpu
def test_cuda_arenas_are_let_go_once_read_and_unviewed(cuda_kernels) -> None:
    """On CUDA this side holds each message's arenas until no view of them is left and the device has read them
    (``RemoteTrace._let_go``, at each message taken): a step's records dropped, its arenas go at the next message;
    records still held keep theirs; every value reads back as it was shipped."""
    import queue

    from ulptrace.concurrent import RemoteTrace, _Shipper
    from ulptrace.trace import Record

    messages: queue.Queue = queue.Queue()
    shipper = _Shipper(messages)
    values = [torch.randn(64, 32, device="cuda").bfloat16() for _ in range(3)]
    for step, value in enumerate(values):
        shipper.add(Record("a", step, "norm", 0, shipper.copy_value(value), {}))
        shipper.ship(step, torch.tensor([[step]], device="cuda"))

    trace = RemoteTrace(_Ends(messages))
    first = trace.pop(("a", 0))
    assert torch.equal(first.out, values[0]) and len(trace._held) == 1
    del first
    kept = trace.pop(("a", 1))  # step 1 taken: step 0's arenas found unused
    trace._let_go(wait=True)
    assert len(trace._held) == 1 and not trace._unused  # step 1's, which a record still views
    assert torch.equal(kept.out, values[1]) and torch.equal(trace.pop(("a", 2)).out, values[2])
    assert [trace.forced_token(s).item() for s in range(3)] == [0, 1, 2]
    del kept
    trace._let_go(wait=True)
    assert len(trace._held) == 0  # step 2's record was dropped at once: nothing views any arena now


def test_a_kept_model_of_a_local_checkpoint_is_not_reused_once_its_files_change(tmp_path) -> None:
    from ulptrace.processes import model_key

    (tmp_path / "config.json").write_text("{}")
    before = model_key(RunConfig(model=str(tmp_path)))
    (tmp_path / "model.safetensors").write_bytes(b"new weights")
    assert model_key(RunConfig(model=str(tmp_path))) != before
    assert model_key(RunConfig(model="tiny-llama")) == model_key(RunConfig(model="tiny-llama"))


def test_a_steps_arena_gives_back_every_record_as_it_was_shipped() -> None:
    """One step packed into one arena and read back (no process: the two ends of the queue): dtypes and shapes, an
    empty tensor at the next one's offset, a tensor two records share coming back as one tensor, the token."""
    import queue

    from ulptrace.concurrent import RemoteTrace, _Shipper
    from ulptrace.trace import Record

    messages: queue.Queue = queue.Queue()
    shipper = _Shipper(messages)
    empty, shared = torch.empty(0, 3, dtype=torch.bfloat16), torch.randn(2, 3).bfloat16()
    ints, mask, scalar = torch.arange(5, dtype=torch.int32), torch.tensor([True, False, True]), torch.tensor(2.5)
    shipper.add(Record("a", 0, "norm", 0, empty, {"x": shared}))
    shipper.add(Record("b", 0, "linear", 1, ints, {"x": shared, "mask": mask, "scale": scalar}))
    shipper.ship(0, torch.tensor([[7], [9]]))

    trace = RemoteTrace(_Ends(messages))
    a, b = trace.pop(("a", 0)), trace.pop(("b", 0))
    assert a.out.shape == (0, 3) and a.out.dtype == torch.bfloat16
    for got, sent in ((a.inputs["x"], shared), (b.out, ints), (b.inputs["mask"], mask), (b.inputs["scale"], scalar)):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    assert a.inputs["x"] is b.inputs["x"]  # compared once (KnownPairs finds the pair by identity)
    assert (b.kind, b.layer) == ("linear", 1) and trace.forced_token(0).tolist() == [[7], [9]]
    token = trace.forced_token(0)  # a copy of its own: a view would keep the step's arenas as long as the run
    assert token.untyped_storage().nbytes() == token.nbytes
    assert trace.pop(("c", 0)) is None  # its step arrived whole: a record it does not hold is missing, not awaited


def test_the_references_copies_are_made_where_they_are_shipped_from() -> None:
    """The reference process's recorder copies into the arenas its next message ships (``processes.Arenas``): each
    copy is its value bit for bit, contiguous, at an aligned offset of one arena; packing finds it and a view inside it
    there (only what lies elsewhere is copied again), the other side reads every one back; the next message gets new
    arenas, sized from what this one held."""
    from ulptrace.processes import ALIGN, Arenas, Unpacked, pack

    written = Arenas()
    values = [torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.int64), torch.tensor(1.5, dtype=torch.float64),
              torch.randn(4, 6)[:, ::2], torch.randn(2, 3, requires_grad=True), torch.zeros(0, 4),
              torch.tensor([True, False, True]), torch.randn(3).half()]
    copies = [written.copy(v) for v in values]
    (arena,) = written.arenas
    for copy, value in zip(copies, values, strict=True):
        assert copy.dtype == value.dtype and copy.shape == value.shape and copy.is_contiguous()
        assert torch.equal(copy, value.detach()) and not copy.requires_grad
        if value.numel():  # (an empty tensor has no memory to point at)
            assert copy.untyped_storage().data_ptr() == arena.data_ptr()
            assert (copy.data_ptr() - arena.data_ptr()) % ALIGN == 0
    values[1] += 1  # a copy is no view of its value
    assert copies[1].tolist() == list(range(7))
    inside, elsewhere = copies[0][1:], torch.randn(5)
    tensors = [copies[0], inside, elsewhere, *copies[1:]]
    arenas, specs = pack(tensors, written=written)
    assert len(arenas) == 2 and arenas[1] is arena and specs[id(elsewhere)][0] == 0
    assert all(specs[id(t)][0] == 1 for t in tensors if t.numel() and t is not elsewhere)  # read where they are
    views = Unpacked(arenas)
    for t in tensors:
        got = views.tensor(specs[id(t)])
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    assert not written.arenas
    assert written.copy(torch.ones(2, device="meta")) is not None  # a message's arenas are on its first value's device
    assert written.copy(torch.ones(1)) is None and len(written.arenas) == 1
    written.take()
    big = torch.randn(100_000)
    written.copy(big)
    written.take()
    written.copy(torch.ones(1))  # the next message's arena holds what the last one held, an eighth more
    assert written.arenas[0].numel() == big.nbytes + big.nbytes // 8 > Arenas.MIN_BYTES


def test_a_messages_arenas_are_let_go_once_no_view_of_them_is_left() -> None:
    """This side keeps a message's CUDA arenas until nothing else refers to their memory (``concurrent._unused``,
    what ``RemoteTrace._let_go`` asks): a view of an arena keeps its message, and an arena sharing a storage with
    one that is viewed (two messages' arenas in one block) keeps its own message too."""
    from ulptrace.concurrent import _unused

    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    first, second, third = [a], [b], [a[32:]]
    held = [first, second, third]
    view = b[:8].view(torch.int64)
    assert [m is first or m is third for m in _unused(held)] == [True, True]
    del view
    assert len(_unused(held)) == 3
    record = a[:4]
    (unused,) = _unused(held)
    assert unused is second
    del record
    assert len(_unused(held)) == 3


def test_a_step_in_parts_is_whole_only_with_its_last_part() -> None:
    """Parts of a step (records past the part size shipped before the step ends): a record of a later part is
    waited for, a record the step does not hold is missing only once the last part (with the token) has come."""
    import queue

    from ulptrace.concurrent import RemoteTrace, _Shipper
    from ulptrace.trace import Record

    messages: queue.Queue = queue.Queue()
    shipper = _Shipper(messages, part_bytes=2 * 3 * 4)  # one float32 [2, 3] tensor makes a part
    values = [torch.randn(2, 3) for _ in range(3)]
    shipper.add(Record("a", 0, "norm", 0, values[0], {}))
    shipper.add(Record("b", 0, "norm", 1, values[1], {"x": values[0]}))  # a tensor of the part before: sent again
    assert messages.qsize() == 2 and not shipper.records
    shipper.add(Record("c", 0, "linear", 1, values[2][:, :1], {}))  # under the part size: waits for the step's end
    assert messages.qsize() == 2
    shipper.ship(0, torch.tensor([[4], [5]]))

    ends = _Ends(messages)
    trace = RemoteTrace(ends)
    assert torch.equal(trace.pop(("a", 0)).out, values[0]) and ends.taken == 1
    b = trace.pop(("b", 0))
    assert ends.taken == 2 and torch.equal(b.out, values[1]) and torch.equal(b.inputs["x"], values[0])
    assert 0 not in trace.tokens  # the step is not whole yet
    assert trace.pop(("z", 0)) is None and ends.taken == 3  # missing once the last part came
    assert torch.equal(trace.pop(("c", 0)).out, values[2][:, :1]) and trace.forced_token(0).tolist() == [[4], [5]]


def test_live_values_are_read_or_copied_before_the_reference_may_go_on() -> None:
    """A value of ``LIVE_BYTES`` or more reaches the reference's sink uncopied (it may be the model's own): the
    reference ships it at once and waits for this side to say it has read it — after the record was handed out and
    this side next waits for the reference, or, if it was not taken, after a copy of it was made here."""
    import queue

    from ulptrace.concurrent import RemoteTrace, _Shipper
    from ulptrace.trace import Record

    messages: queue.Queue = queue.Queue()
    acks: queue.Queue = queue.Queue()
    acks.put(True)  # what this side will have said (the sink waits for it)
    shipper = _Shipper(messages, part_bytes=1 << 20, live_bytes=64, acks=acks)
    small, big = torch.randn(2, 3), torch.randn(4, 8)  # 24 and 128 bytes
    shipper.add(Record("a", 0, "norm", 0, small, {}))
    assert messages.empty()  # under the part size: held
    shipper.add(Record("logits", 0, "logits", 1, big, {}))
    assert messages.qsize() == 1 and acks.empty()  # shipped at once with what was held, and the ack taken
    shipper.ship(0, torch.tensor([[1], [2]]))
    ends = _Ends(messages)
    trace = RemoteTrace(ends)
    assert torch.equal(trace.pop(("a", 0)).out, small) and not ends.acks
    logits = trace.pop(("logits", 0))
    assert torch.equal(logits.out, big) and not ends.acks  # handed out: read by the caller's work
    assert trace.forced_token(0).tolist() == [[1], [2]] and ends.acks == 1  # said before waiting for more

    messages = queue.Queue()  # the live record not taken before this side waits: copied, then said
    acks.put(True)
    shipper = _Shipper(messages, part_bytes=1 << 20, live_bytes=64, acks=acks)
    other = torch.randn(3)
    shipper.add(Record("a", 0, "norm", 0, small, {}))
    shipper.add(Record("b", 0, "norm", 0, other, {}))
    shipper.add(Record("logits", 0, "logits", 1, big, {"x": small}))  # its input: the tensor "a" holds
    shipper.ship(0, torch.tensor([[3], [4]]))
    ends = _Ends(messages)
    trace = RemoteTrace(ends)
    assert trace.pop(("elsewhere", 0)) is None and ends.acks == 1  # waited for the step's end: said first
    logits = trace.pop(("logits", 0))
    kept, a = logits.out, trace.pop(("a", 0)).out
    assert torch.equal(kept, big) and kept.untyped_storage().nbytes() == big.nbytes  # its own memory, not the arena's
    assert a is logits.inputs["x"] and torch.equal(a, small) and a.untyped_storage().nbytes() == small.nbytes
    assert trace.pop(("b", 0)).out.untyped_storage().nbytes() > other.nbytes  # not the live record's: still the arena


def test_a_concurrent_onset_with_live_values_reports_what_the_sequential_one_does(monkeypatch) -> None:
    """Every value of 256 bytes or more handed over live (the reference waits on each until it is read here): the
    report is the sequential onset's, and nothing deadlocks."""
    from ulptrace import concurrent

    monkeypatch.setattr(concurrent, "LIVE_BYTES", 256)
    said = []
    ack = ReferenceProcess.ack
    monkeypatch.setattr(ReferenceProcess, "ack", lambda self: (said.append(True), ack(self)))
    sequential, concurrent_report = _within(120, lambda: _both(model="tiny-llama", candidate="fault:layers.1.mlp.glu@1+2"))
    assert _essentials(concurrent_report) == _essentials(sequential)
    assert concurrent_report["onset"] is not None
    assert len(said) > 10  # values were handed over live, and each waited on


def test_a_reference_process_whose_parent_is_killed_exits() -> None:
    """A parent killed outright (no exit handlers) leaves its reference process blocked on a queue nobody will read
    or write again; it notices its parent is gone and ends instead of lingering with its model."""
    import signal

    code = ("from ulptrace.concurrent import ReferenceProcess\n"
            "from ulptrace.run import RunConfig\n"
            "p = ReferenceProcess(RunConfig(model='tiny-llama', prompts=2, prompt_len=8, new_tokens=12)).__enter__()\n"
            "print(p.pid, flush=True)\n"
            "import time; time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":  # exited, not yet reaped by init
            return
        time.sleep(0.5)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the reference process outlived its killed parent by two minutes")


class _Seen(BaseException):  # past the CLI's handling of errors
    pass


@pytest.mark.parametrize("flags, expected", [([], "auto"), (["--concurrent"], True), (["--no-concurrent"], False),
                                             (["--concurrent", "split"], "split"), (["--concurrent=split"], "split"),
                                             (["--concurrent", "split", "--no-concurrent"], False)])
def test_the_command_runs_the_reference_in_its_own_process_when_asked(flags, expected, monkeypatch) -> None:
    """``ulptrace onset`` runs the reference in a process of its own with ``--concurrent``; by default (``"auto"``)
    from the start for a large model on CUDA (``from_start``, below), else only once the reference is forecast to
    outgrow its GPU share (``test_onset_memory``); never with ``--no-concurrent``."""
    import ulptrace.probes.onset as onset_module

    seen: list[RunConfig] = []

    def capture(cfg, *args, **kwargs):
        seen.append(cfg)
        raise _Seen

    monkeypatch.setattr(onset_module, "run_onset", capture)
    with pytest.raises(_Seen):
        main(["onset", "--model", "tiny-llama", *flags])
    assert seen[0].concurrent == expected and type(seen[0].concurrent) is type(expected)


def test_where_this_process_keeps_the_reference_is_refused_with_concurrent(capsys) -> None:
    """``--reference-memory`` says where this process keeps the reference's records; with ``--concurrent`` they are
    recorded in a process of its own and none are kept here: asking for both is a usage error naming both, not an
    option accepted and ignored (no process is started)."""
    for memory in ("device", "host"):
        with pytest.raises(ValueError, match=f"--reference-memory {memory} says where this process keeps the "
                                             "reference's records, but --concurrent records them in a process of its "
                                             "own"):
            RunConfig(model="tiny-llama", concurrent=True, reference_memory=memory).validate()
    RunConfig(model="tiny-llama", concurrent=True, reference_memory="auto").validate()  # its default: accepted
    RunConfig(model="tiny-llama", reference_memory="host").validate()
    assert main(["onset", "--model", "tiny-llama", "--concurrent", "--reference-memory", "host"]) == 2
    err = capsys.readouterr().err
    assert "--reference-memory host says where this process keeps" in err and "Traceback" not in err


def test_the_reference_process_keeps_the_pin() -> None:
    """--concurrent: the reference recorded in a process of its own runs pinned too — the same report as the
    sequential onset, and its trace says the pin."""
    fields = dict(SMALL, model="tiny-qwen3.5", candidate="kernels:fused", oracle=False, sdpa="math")
    sequential = _report(RunConfig(**fields))
    concurrent = _report(RunConfig(**fields, concurrent=True))
    assert concurrent["reference"]["sdpa"] == "math"
    assert _essentials(concurrent) == _essentials(sequential)


def _native_threads() -> int:
    """Threads of this process that are not Python's (OpenMP teams' workers), from ``/proc``."""
    import threading

    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in python)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="threads counted from Linux's /proc; one torch thread has no OpenMP team")
def test_a_kept_reference_process_leaves_this_process_no_second_openmp_team() -> None:
    """What a queue sends is pickled on a feeder thread; a CPU tensor not yet in shared memory would be copied there by
    one of torch's parallel loops, and that thread would keep an OpenMP team of its own while it lives — with more
    OpenMP threads than cores libgomp stops spin-waiting, and every parallel region of this process paid for it while
    the reference process was kept (untraced generations 1.5-1.6x slower on 2 cores). The twin goes already shared."""
    cfg = RunConfig(**SMALL, model="tiny-qwen3.5", candidate="kernels:fused", oracle=False)
    shutdown()
    run_onset(cfg)  # this process's own team and every lazily started pool exist now
    before = _native_threads()
    run_onset(replace(cfg, concurrent=True))  # a new reference process, sent the twin, kept
    try:
        assert _native_threads() == before
    finally:
        shutdown()


def test_what_is_shipped_from_the_cpu_is_made_in_shared_memory() -> None:
    """The arenas a message ships and the twin a helper is sent are in shared memory before the queue sees them (its
    feeder thread then passes descriptors, copying nothing); CUDA tensors are not touched (IPC shares them)."""
    from ulptrace.processes import Arenas, byte_arena, pack, shipped_twin

    assert byte_arena(100, "cpu").is_shared() and byte_arena(100, "cpu").numel() == 100
    written = Arenas()
    copy = written.copy(torch.arange(6, dtype=torch.float32))
    arenas, _ = pack([copy, torch.ones(3, dtype=torch.bfloat16)], written=written)
    assert all(a.is_shared() for a in arenas if a is not None)
    assert not pack([torch.ones(3)], shared=False)[0][0].is_shared()  # judging ships host arenas as bytes
    model = build_model("tiny-llama", dtype=torch.float32, device="cpu", seed=0)
    twin = shipped_twin(model)
    assert twin is not model and all(p.is_shared() for p in twin.parameters())
    assert not any(p.is_shared() for p in model.parameters())  # this side's own model is left as it was
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters(), strict=True))


def test_helpers_start_with_openmp_waiting_passively_and_our_transformers_verbosity_unless_the_user_chose(
        tmp_path, monkeypatch) -> None:
    """A helper shares this machine's cores: its OpenMP threads must not spin between parallel regions (beside this
    process, on 2 cores, that made a reference run 3-6x slower). It logs as this process does: the CLI silences HF's
    fallback notices, and a helper printed them (it starts at transformers' default, ``warning``). A value the user
    set in the environment is theirs; this process's environment is left as it was."""
    from transformers.utils import logging as hf_logging
    from ulptrace.spawning import spawn_context, start_processes

    def seen(name: str) -> list[str]:
        out = tmp_path / name
        command = f'echo "${{OMP_WAIT_POLICY-unset}} ${{TRANSFORMERS_VERBOSITY-unset}}" > {out}'
        process = spawn_context().Process(target=os.system, args=(command,))
        start_processes([process])
        process.join(60)
        return out.read_text().split()

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    before = hf_logging.get_verbosity()
    try:
        hf_logging.set_verbosity_error()
        assert seen("default") == ["PASSIVE", "error"]
        hf_logging.set_verbosity_info()
        assert seen("info") == ["PASSIVE", "info"]
    finally:
        hf_logging.set_verbosity(before)
    assert "OMP_WAIT_POLICY" not in os.environ and "TRANSFORMERS_VERBOSITY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "debug")
    assert seen("chosen") == ["ACTIVE", "debug"]
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["TRANSFORMERS_VERBOSITY"] == "debug"


def test_a_fresh_concurrent_command_runs_the_reference_pinned(tmp_path) -> None:
    """The user's case, in a fresh process (its hooks numbered from 0, as the reference process's): `onset --concurrent
    --sdpa math` reports what `--no-concurrent` does — before the fix its reference ran torch's default CPU attention
    and the first full-attention layer's record differed. Nor does the reference process print HF's fallback notices
    beside the command's output (the command keeps them out; a new process starts at transformers' `warning`)."""
    reports = {}
    for mode in ("concurrent", "no-concurrent"):
        out = tmp_path / f"{mode}.json"
        done = subprocess.run([sys.executable, "-m", "ulptrace", "onset", "--model", "tiny-qwen3.5", "--candidate",
                               "kernels:fused", "--no-oracle", "--prompts", "2", "--prompt-len", "8", "--new-tokens",
                               "3", "--sdpa", "math", f"--{mode}", "--quiet", "--json", str(out)],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "falling back" not in done.stderr, done.stderr[-2000:]
        reports[mode] = json.loads(out.read_text())
    assert _essentials(reports["concurrent"]) == _essentials(reports["no-concurrent"])
    assert reports["concurrent"]["reference"]["sdpa"] == "math"


def test_the_reference_process_computes_under_this_process_torch_settings() -> None:
    """A new process starts with torch's defaults; settings that decide what a model computes (TF32 and the float32
    matmul precision, cuBLAS's reduced-precision reductions, cuDNN's and the deterministic switches, the SDPA backends,
    the default dtype, the thread count) are sent with each run and taken there — the reference recorded in its own
    process computes what it would here. Its run info says what it ran under."""
    from ulptrace.processes import apply_torch_settings, torch_settings

    saved = torch_settings()
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cudnn.deterministic = True
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.enable_cudnn_sdp(False)
        here = {name: str(value) for name, value in torch_settings().items()}
        assert here != {name: str(value) for name, value in saved.items()}
        report = _report(RunConfig(**SMALL, model="tiny-llama", candidate="kernels:fused", oracle=False,
                                   concurrent=True))
        assert report["run"]["reference_process"]["torch_settings"] == here
    finally:
        apply_torch_settings(saved)
    assert torch_settings() == saved


def test_torch_settings_sent_by_a_newer_torch_are_refused_by_name() -> None:
    from ulptrace.processes import apply_torch_settings

    with pytest.raises(ValueError, match="torch setting 'backends.quantum.fp32_precision' was sent"):
        apply_torch_settings({"backends.quantum.fp32_precision": "tf32"})


def plain_path(model) -> None:
    """A path of the user's own, registered by name in the test (importable by the helper from this module)."""


def test_a_path_registered_here_is_known_to_the_reference_process(monkeypatch) -> None:
    """``register_path`` in this process (a notebook's, a script's) is sent with the run: the reference process,
    a new one, knows only ulptrace's own names and answered "unknown path" for it."""
    from ulptrace import paths

    monkeypatch.setattr(paths, "_REGISTRY", dict(paths._REGISTRY))  # the registration undone after the test
    paths.register_path("mine:plain", plain_path, "HF as is, under a name of the user's")
    fields = dict(SMALL, model="tiny-llama", reference="mine:plain", candidate="kernels:fused", oracle=False)
    assert _essentials(_report(RunConfig(**fields, concurrent=True))) == _essentials(_report(RunConfig(**fields)))


def test_a_registered_path_a_helper_cannot_import_is_refused_before_it_starts(monkeypatch) -> None:
    from ulptrace import paths

    monkeypatch.setattr(paths, "_REGISTRY", dict(paths._REGISTRY))
    paths.register_path("mine:lambda", lambda model: None, "not importable elsewhere")
    with pytest.raises(ValueError, match=r"path 'mine:lambda' is registered here as .*lambda.*register it as an "
                                         r"import string"):
        run_onset(RunConfig(**SMALL, model="tiny-llama", reference="mine:lambda", candidate="kernels:fused",
                            oracle=False, concurrent=True))


def test_the_judging_processes_know_a_path_registered_here(monkeypatch) -> None:
    from ulptrace import paths

    monkeypatch.setattr(paths, "_REGISTRY", dict(paths._REGISTRY))
    paths.register_path("mine:plain", plain_path, "HF as is, under a name of the user's")
    fields = dict(SMALL, model="tiny-llama", reference="mine:plain", candidate="fault:layers.1.mlp.glu@1+2")
    pooled = _report(RunConfig(**fields, judge_workers=1))
    assert pooled["run"]["judging_processes"]["pairs_judged_there"] > 0
    assert _essentials(pooled) == _essentials(_report(RunConfig(**fields)))


def test_the_default_runs_the_reference_in_its_own_process_from_the_start_only_for_a_large_model_on_cuda(
        tmp_path) -> None:
    """``concurrent="auto"`` (the command's default) runs the reference in a process of its own from the start where
    that process's start-up is hidden behind this side's build and there are cores for it: a CUDA device and a model
    of ``FROM_START_BYTES`` of weights or more (an embedded model's parameters times the dtype's size, a checkpoint's
    weight files); never on a CPU, for a small model, with the records kept as asked (``--reference-memory``) or
    where the mode was chosen."""
    from ulptrace.catalog import weight_bytes
    from ulptrace.concurrent import from_start
    from ulptrace.spawning import FROM_START_BYTES

    assert weight_bytes("qwen3.5-0.8b", "bfloat16") == 752_393_024 * 2
    assert weight_bytes("qwen3.5-0.8b", "float32") == 752_393_024 * 4
    big = RunConfig(model="qwen3.5-0.8b", device="cuda:0", concurrent="auto")
    why = from_start(big)
    assert why is not None and "a model of 1.40 GiB of weights on cuda:0 (>= 512 MiB)" in why
    for other in (replace(big, device="cpu"), replace(big, model="tiny-qwen3.5"), replace(big, concurrent=True),
                  replace(big, concurrent=False), replace(big, reference_memory="device"),
                  replace(big, reference_memory="host")):
        assert from_start(other) is None, other
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with open(checkpoint / "model.safetensors", "wb") as f:
        f.truncate(FROM_START_BYTES - 1)  # sparse: its size is what counts
    assert from_start(replace(big, model=str(checkpoint))) is None
    with open(checkpoint / "model-00002-of-00002.safetensors", "wb") as f:
        f.truncate(1)
    assert weight_bytes(str(checkpoint), "bfloat16") == FROM_START_BYTES
    assert "of weights on cuda:0" in from_start(replace(big, model=str(checkpoint)))
    # a name that is no model: not decided here — the onset's own check names it, before any process starts
    assert from_start(replace(big, model="no-such-model")) is None
    with pytest.raises(KeyError, match="unknown model 'no-such-model'"):
        run_onset(replace(big, model="no-such-model", device="cpu"))


@pytest.mark.parametrize("flags, started", [
    (["--model", "qwen3.5-0.8b", "--device", "cuda"], True),  # the default, a large model on CUDA
    (["--model", "qwen3.5-0.8b", "--device", "cuda:1", "--dtype", "float32"], True),
    (["--model", "tiny-qwen3.5", "--device", "cuda"], False),  # small: built before that process could import
    (["--model", "qwen3.5-0.8b", "--device", "cpu"], False),
    (["--model", "qwen3.5-0.8b", "--device", "cuda", "--no-concurrent"], False),
    (["--model", "qwen3.5-0.8b", "--device", "cuda", "--reference-memory", "host"], False),
    (["--model", "tiny-qwen3.5", "--device", "cpu", "--concurrent"], True),  # asked for
    (["--model", "tiny-qwen3.5", "--device", "cpu", "--concurrent", "split"], True),  # both sides' processes
    (["--model", "no-such-model", "--device", "cuda"], False),  # the onset names it
])
def test_the_command_starts_the_reference_process_at_its_first_line_where_the_onset_will_take_it(
        flags, started, monkeypatch) -> None:
    """The command's first line starts the reference process exactly where the onset runs its reference in a process
    of its own from the start (the same rule, ``ulptrace.spawning.beside_from_start``, asked without torch), so no
    process is started for a run that will not take it."""
    import ulptrace.probes.onset as onset_module
    from ulptrace import spawning

    calls: list[tuple] = []
    monkeypatch.setattr(spawning, "start_reference", lambda *a: calls.append(a))

    def capture(cfg, *args, **kwargs):
        raise _Seen

    monkeypatch.setattr(onset_module, "run_onset", capture)
    try:
        main(["onset", *flags])
    except (_Seen, SystemExit):
        pass
    assert bool(calls) is started, calls
    if started:  # both sides' processes for a split onset: asked for, or the default's choice
        assert calls[0][:2] == (flags[1], flags[3])
        assert calls[0][3:] == (() if flags[-1] == "--concurrent" else (("reference", "candidate"),))


def test_the_command_starts_the_reference_process_before_it_imports_torch_and_the_onset_takes_it(tmp_path) -> None:
    """``onset --concurrent`` starts its reference process at the command's first line, before this process imports
    torch (``ulptrace.spawning``: the process's imports overlap this one's instead of following them), and the onset
    runs its reference in that very process — one process started, none left over."""
    out = tmp_path / "onset.json"
    code = f"""
import json, sys
from ulptrace import spawning
from ulptrace.cli import main
seen = {{"torch_before": None, "pids": []}}
original_init, original_start = spawning.ReferenceStart.__init__, spawning.start_reference
def init(self, *args):
    original_init(self, *args)
    seen["pids"].append(self.process.pid)
def start(*args):
    seen["torch_before"] = "torch" in sys.modules
    return original_start(*args)
spawning.ReferenceStart.__init__, spawning.start_reference = init, start
code = main(["onset", "--concurrent", "--no-oracle", "--model", "tiny-llama", "--prompts", "2", "--prompt-len", "8",
             "--new-tokens", "2", "--quiet", "--json", {str(out)!r}])
print(json.dumps({{**seen, "code": code}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0 and seen["torch_before"] is False
    report = json.loads(out.read_text())
    assert seen["pids"] == [report["run"]["reference_process"]["pid"]]  # started once, at the first line, and used
    assert report["sites"] and "concurrent_from_start" not in report["run"]  # asked for: no reason to give


def test_a_reference_process_started_for_a_run_that_does_not_take_it_is_stopped() -> None:
    """The command starts the reference process on CUDA before it knows the model (by default the onset decides
    then): an onset that runs here alone stops it — no process is left holding memory — and its report is the
    sequential one (no reference process in it). A concurrent onset that finds a kept process of its model stops the
    new one too."""
    from ulptrace import spawning

    shutdown()
    started = spawning.start_reference("tiny-llama", "cpu")
    cfg = RunConfig(model="tiny-llama", candidate="kernels:fused", oracle=False, concurrent="auto", **SMALL)
    comparison, info = run_onset(cfg)
    assert comparison.sites and "reference_process" not in info and "concurrent_from_start" not in info
    started.process.join(10)
    assert not started.process.is_alive() and spawning.take_reference("tiny-llama", "cpu") is None
    try:
        _, first = run_onset(replace(cfg, concurrent=True))  # kept afterwards
        again = spawning.start_reference("tiny-llama", "cpu")
        _, second = run_onset(replace(cfg, concurrent=True))
        assert second["reference_process"]["pid"] == first["reference_process"]["pid"] != again.process.pid
        again.process.join(10)
        assert not again.process.is_alive()
    finally:
        shutdown()



def test_the_console_script_s_reference_process_imports_a_path_module_from_the_working_directory(
        tmp_path, ulptrace_script) -> None:
    """``ulptrace onset --concurrent`` starts its reference process at the command's first line: that process must
    see the working directory on its import path as this one does (``cli.cwd_on_path``), or a user's
    ``module:function`` reference path there is not found in it."""
    (tmp_path / "mypkg.py").write_text("def patch(model):\n    return None\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([ulptrace_script, "onset", "--concurrent", "--model", "tiny-llama", "--reference", "mypkg:patch",
                           "--candidate", "kernels:fused", "--no-oracle", "--prompts", "2", "--prompt-len", "8",
                           "--new-tokens", "2", "--quiet", "--json", "onset.json"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "onset.json").read_text())
    assert report["reference"]["path"] == "mypkg:patch" and report["run"]["reference_process"]["pid"] > 0


def test_the_console_script_stops_its_kept_reference_process_before_it_ends(tmp_path, ulptrace_script) -> None:
    """The console script ends without the interpreter's teardown (``ulptrace.exiting``), its exit handlers run
    first: the reference process a clean run keeps for the next onset (HF's reference) is stopped and reaped by the
    time the command has ended, not left running until it notices that its parent is gone."""
    # output to files, not pipes, which the reference process holds too: reading pipes to their end would wait for it
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        done = subprocess.run([ulptrace_script, "onset", "--concurrent", "--model", "tiny-llama", "--candidate",
                               "kernels:fused", "--no-oracle", "--prompts", "2", "--prompt-len", "8", "--new-tokens",
                               "2", "--quiet", "--json", "onset.json"],
                              cwd=tmp_path, stdout=out, stderr=err, timeout=300, check=False)
    assert done.returncode == 0, (tmp_path / "err.txt").read_text()[-2000:]
    process = json.loads((tmp_path / "onset.json").read_text())["run"]["reference_process"]
    with pytest.raises(ProcessLookupError):
        os.kill(process["pid"], 0)


@pytest.mark.gpu
def test_the_commands_default_on_a_large_model_on_cuda_runs_the_reference_beside_it_and_reports_the_same(
        tmp_path, cuda_kernels) -> None:
    """The user's case: ``ulptrace onset`` on the 0.8B shape on CUDA, a fresh process, as typed — its reference runs
    in the process the command started at its first line, from the start (said in the run info), and the report is
    ``--no-concurrent``'s."""
    reports = {}
    for name, flags in (("default", []), ("no-concurrent", ["--no-concurrent"])):
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, "-m", "ulptrace", "onset", "--model", "qwen3.5-0.8b", "--device", "cuda",
                               "--candidate", "kernels:fused", "--no-oracle", "--prompts", "2", "--prompt-len", "16",
                               "--new-tokens", "3", "--sdpa", "flash", "--quiet", "--json", str(out), *flags],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        reports[name] = json.loads(out.read_text())
    run = reports["default"]["run"]
    assert "of weights on cuda" in run["concurrent_from_start"] and run["reference_process"]["run_in_process"] == 1
    assert run["candidate_process"]["pid"] not in (run["reference_process"]["pid"], None)  # split: both sides
    assert "reference_process" not in reports["no-concurrent"]["run"]
    assert _essentials(reports["default"]) == _essentials(reports["no-concurrent"])


def test_where_the_default_runs_beside_from_the_start_each_side_runs_in_a_process_of_its_own(monkeypatch) -> None:
    """The default's choice for a large model on CUDA (``beside_from_start``, made to hold here on the CPU): the split
    onset — the reference and the candidate each in a process of its own, this one comparing — said in the run info,
    with the sequential onset's report; asked for, ``--concurrent`` keeps the candidate here."""
    from ulptrace import concurrent

    monkeypatch.setattr(concurrent, "beside_from_start", lambda *args: 1 << 30)
    cfg = RunConfig(model="tiny-llama", candidate="fault:layers.1.mlp.glu@1+2", oracle=True, concurrent="auto",
                    **SMALL)
    try:
        comparison, info = run_onset(cfg)
        assert "each side runs in a process of its own" in info["concurrent_from_start"]
        assert info["candidate_process"]["pid"] != info["reference_process"]["pid"]
        sequential, _ = run_onset(replace(cfg, concurrent=False))
        assert comparison.onset_with_reason()[1] == "verdict"
        assert [d.to_json() for d in comparison.sites] == [d.to_json() for d in sequential.sites]
        _, beside = run_onset(replace(cfg, concurrent=True))
        assert "candidate_process" not in beside and "concurrent_from_start" not in beside
    finally:
        shutdown()


def test_a_process_per_role_runs_one_model_at_once_and_hands_its_records_on_as_they_came() -> None:
    """Two runs of one model at once, each in a kept process of its own role (the candidate's path and mode applied
    in the ``candidate`` one): ``arriving`` hands on every record of that run in the order it was made, the same
    records (bitwise) as the run recorded in this process; both processes are kept apart and serve the next runs of
    their roles; an unknown role is refused."""
    from ulptrace.concurrent import _IDLE
    from ulptrace.paths import apply_path
    from ulptrace.record import MemorySink
    from ulptrace.run import build_pair, record_generation, selected_sites
    from ulptrace.ulp import bits

    cfg = RunConfig(**SMALL, model="tiny-llama", candidate="kernels:fused", oracle=False, concurrent=True)
    _, model, prompts = build_pair(cfg, reference=False)
    here, local = MemorySink(), build_pair(cfg, reference=False)[1]
    with apply_path(local, cfg.candidate) as applied:
        record_generation(local, cfg, "candidate", prompts, applied.info, sink=here, sites=selected_sites(local, cfg))
    expected = [(r.key, r.out, r.inputs) for r in here.trace]
    pids = []
    for _ in range(2):
        with ReferenceProcess(cfg) as reference, ReferenceProcess(cfg, role="candidate") as candidate:
            reference.start(model)
            candidate.start(model)  # not fed: its own greedy tokens
            got = [(r.key, r.out, r.inputs) for r in candidate.trace.arriving()]
            assert next(reference.trace.arriving()).key == got[0][0]  # the reference's run went on beside it
            tokens = candidate.trace.finish()[0]
            reference.trace.finish()
            pids.append((reference.pid, candidate.pid))
        assert [key for key, _, _ in got] == [key for key, _, _ in expected] and len(got) > 10
        for (_, out, inputs), (_, want_out, want_inputs) in zip(got, expected, strict=True):
            assert torch.equal(bits(out), bits(want_out)) and inputs.keys() == want_inputs.keys()
            assert all(torch.equal(bits(inputs[r]), bits(want_inputs[r])) for r in inputs)
        assert tokens.shape == (SMALL["prompts"], SMALL["new_tokens"])
        assert sorted(role for role, _ in _IDLE) == ["candidate", "reference"]
    assert pids[0] == pids[1] and pids[0][0] != pids[0][1]  # each role's process served its second run too
    with pytest.raises(ValueError, match="role must be one of reference, candidate, but got 'judge'"):
        ReferenceProcess(cfg, role="judge")
    shutdown()
    assert not _IDLE


def test_what_a_side_process_ships_is_in_flight_until_this_side_has_handed_out_its_records() -> None:
    """The bytes in flight (``spawning.InFlight``): the shipper counts each message's arenas as it hands them on;
    this side counts a message let go once every record of it has been handed out (at its next wait for a message;
    on CUDA once the device has passed the work enqueued by then) — a record it keeps after that (the oracle's pair)
    is its own to hold and does not keep the reference waiting; a record never handed out keeps its message in flight;
    when all are handed out nothing is in flight."""
    import queue

    from ulptrace.concurrent import RemoteTrace, _Shipper
    from ulptrace.spawning import InFlight, spawn_context
    from ulptrace.trace import Record

    flight = InFlight(spawn_context())
    messages: queue.Queue = queue.Queue()
    shipper = _Shipper(messages, flight=flight, flight_bytes=1 << 30)
    values = [torch.randn(64, 32) for _ in range(3)]  # 8 KiB each
    for step, value in enumerate(values):
        shipper.add(Record("a", step, "norm", 0, value, {}))
        shipper.ship(step, torch.tensor([[step]]))
    sizes = [sum(a.nbytes for a in m[3] if a is not None) for m in list(messages.queue)]
    assert all(size >= values[0].nbytes for size in sizes) and flight.bytes == sum(sizes)
    assert shipper.most_in_flight == sum(sizes)

    class Ends(_Ends):
        def let_go(self, nbytes: int) -> None:
            super().let_go(nbytes)
            flight.let_go(nbytes)

    trace = RemoteTrace(Ends(messages))
    kept = trace.pop(("a", 0))
    assert torch.equal(kept.out, values[0]) and flight.bytes == sum(sizes)  # handed out: let go at the next wait
    assert torch.equal(trace.pop(("a", 1)).out, values[1]) and flight.bytes == sizes[1] + sizes[2]
    assert trace.forced_token(2).item() == 2 and flight.bytes == sizes[2]  # step 2's record not handed out yet
    assert torch.equal(kept.out, values[0])  # kept here, its memory still this side's to read
    assert torch.equal(trace.pop(("a", 2)).out, values[2]) and trace.pop(("a", 2)) is None  # handed out once
    trace._let_go()
    assert flight.bytes == 0 and trace._owner.let_go_bytes == sum(sizes)


def test_a_side_process_waits_to_ship_past_its_budget_until_bytes_are_let_go_or_this_side_waits() -> None:
    """``InFlight.wait_to_ship``: within the budget, or with nothing in flight (a message larger than the budget),
    it ships at once; past it, it waits until the parent lets bytes go — or, once for each wait, until the parent
    itself waits for a message (it may hold what is in flight while it needs the next: shipping then is what avoids a
    deadlock); a parent gone ends the wait."""
    import threading

    from ulptrace.spawning import InFlight, spawn_context

    flight = InFlight(spawn_context())
    never = lambda: None  # noqa: E731 — the parent is never gone here
    assert flight.wait_to_ship(10_000, 1_000, never) < 0.5  # nothing in flight: one message past the budget goes
    flight.shipped(600)
    assert flight.wait_to_ship(400, 1_000, never) < 0.5  # 1,000 within 1,000
    flight.shipped(400)
    for release in (lambda: flight.let_go(600), flight.wants):
        done: list[float] = []
        waiter = threading.Thread(target=lambda: done.append(flight.wait_to_ship(500, 1_000, never)))
        waiter.start()
        time.sleep(0.3)
        assert not done, "shipped past the budget while the parent neither let go nor waited"
        release()
        waiter.join(timeout=10)
        assert done and done[0] >= 0.3
        flight.shipped(1_000 - flight.bytes)  # in flight as before, for the next way out
    gone = []

    def parent_gone() -> None:
        gone.append(True)
        raise SystemExit(0)

    # the parent's wait was answered once: the next message past the budget waits again, until the parent is gone
    with pytest.raises(SystemExit):
        flight.wait_to_ship(1, 1_000, parent_gone)
    assert gone == [True]
    flight.reset()
    assert flight.bytes == 0 and flight.wait_to_ship(1, 1_000, never) < 0.5


def test_each_side_shipping_within_a_small_budget_in_flight_reports_what_the_sequential_onset_does(
        monkeypatch) -> None:
    """A split onset (each side in a process of its own) whose side processes ship parts of 4 KiB and may hold 8 KiB
    in flight: they wait for this side to let their messages go, and the report is the sequential onset's; each
    process says the most it had in flight."""
    from ulptrace import concurrent

    monkeypatch.setattr(concurrent, "PART_BYTES", 4 << 10)
    monkeypatch.setattr(concurrent, "FLIGHT_BYTES", 8 << 10)
    try:
        sequential = _report(RunConfig(**SMALL, model="tiny-qwen3.5", candidate="kernels:fused", oracle=False))
        split = _report(RunConfig(**SMALL, model="tiny-qwen3.5", candidate="kernels:fused", oracle=False,
                                  concurrent="split"))
    finally:
        shutdown()  # (the kept processes took the small budget with their run: the next run sends its own)
    assert _essentials(split) == _essentials(sequential)
    for role in ("reference", "candidate"):
        process = split["run"][f"{role}_process"]
        assert process["most_in_flight_bytes"] > 0 and process["seconds"]["flight_wait_s"] >= 0
