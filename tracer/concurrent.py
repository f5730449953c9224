"""An onset's reference side in a process of its own, running while the candidate runs (``onset --concurrent``).

Why: the streaming onset runs the reference, then the candidate, in one process. Observing costs each side a hook
dispatch and a copy per observed value, which on a host-bound GPU run puts the pair at ~2x its untraced time
(``bench/RESULTS.md``, P1). The two sides are independent but for the tokens the candidate is fed, so they can run at
once: not in one process (a path may patch process-wide state, and two threads share one interpreter lock), but in
two. Measured on the H200 (``bench/bench_concurrent.py``, processes warmed up): each side in its own process, both
traced, took 0.92x the two untraced generations run one after the other. A process started for one onset pays its
start-up (imports, CUDA context, the model's build) and a cold first run: on the H200, 8 x 128 tokens, 16 steps,
3.2x the untraced pair against 2.5x for the sequential onset, when every onset started its own (``bench/RESULTS.md``,
tenth round). So a clean run's process is kept, with its model, for the next onset of the same model (a notebook's,
a benchmark's, a test suite's): the next onset then took 1.38x (the sequential onset 2.40x the same hour; eleventh
round).

How: :class:`ReferenceProcess` hands the run to a reference process (spawned, or the one a clean run of the same model
left, ``shutdown`` stops it). A new one imports what building the model needs while this side builds it, then is sent
a twin of this side's fresh model (``start``; its memory shared, the weights not drawn again: the parameter checksums
in both sides' metadata say they are the same), applies the reference path and records its generation with a sink that
ships each step's records when the step's logits are out (a long prefill's in parts of ``PART_BYTES``): the tensors in
byte arenas shared with this process through CUDA IPC or shared memory (per-tensor sharing costs more than small
records): the recorder's copies are made straight into them (``processes.Arenas``, the sink's ``copy_value``), what
else a record holds is packed into one more (one device copy; a large one is shared as it is), the records travel as
offsets into them, and, with the step's last part, the token the reference chose. This side holds a message's CUDA
arenas until no view of them is left and the device has read them, then lets them go while a stream nothing runs on is
current (``RemoteTrace._let_go``): torch synchronises the current stream when received CUDA memory ends. A value of
``LIVE_BYTES`` or more (a long prompt's logits) reaches that sink uncopied, as the model left it: it is shipped at
once and the reference waits until this process has read it (or, not taken yet, copied it) and says so — so a long
prefill's logits are not copied there. This process reads them as :class:`RemoteTrace`, a reference the streaming
comparison pops records from (waiting for a step that has not arrived), and feeds the candidate the reference's tokens
as they come (``forced_token``). The queue holds a few messages (``ulptrace.spawning.AHEAD``), so the reference runs
at most that far ahead, and what it has shipped and this side has not yet compared stays within ``FLIGHT_BYTES``
(``spawning.InFlight``; past it the reference waits, unless nothing is in flight or this side waits for a message):
a long prefill's parts do not pile up in either process while this side compares. An error in that process is
raised here with its traceback; a process that dies without a word is reported with its exit code.

A kept process serves one role (``ROLES``): the onset's reference, or its candidate (``role="candidate"``: the
candidate's path and mode) — two runs of one model at once, each process kept for the next run of its role. The
onset's ``concurrent="split"`` runs both sides so and only compares here (issue 11's P1: this process's candidate,
recorded and compared here, is the concurrent onset's wall on a GPU host): the candidate's process is fed the
reference's token of each step, forwarded from here once that process has shipped the step before it
(``ReferenceProcess.start(feed=)``; it waits for it there, and stops with an error if the parent sends anything
else), and ``RemoteTrace.arriving`` hands on its records in the order they were made.
"""

from __future__ import annotations

import atexit
import collections
import math
import os
import queue as queue_module
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from ulptrace.host_memory import keep_freed_memory
from ulptrace.paths import is_user_path
from ulptrace.processes import (
    GUARD,
    Arenas,
    Orphaned,
    Setup,
    Unpacked,
    child_get,
    child_put,
    end_helper,
    end_processes,
    model_key,
    note_unsent,
    pack,
    parent_get,
    parent_gone,
    pickled_error,
    prepare_imports,
    received_model,
    record_metas,
    remote_error,
    shipped_twin,
    torch_settings,
)
from ulptrace.reading import UntilRead
from ulptrace.spawning import (
    FROM_START_BYTES,
    ROLES,
    ReferenceStart,
    beside_from_start,
    take_reference,
)
from ulptrace.trace import Record

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations are not evaluated here

PART_BYTES = 256 << 20  # a step's records are shipped in parts of about this size (a long prefill's do not wait whole)
# values this large are handed to the reference's sink uncopied (Sink.live_bytes: a long prompt's logits, gigabytes):
# the reference then waits in its sink's add until this side has read the value (or copied it) and says so
LIVE_BYTES = 1 << 30
WAITING_BYTES = 2 * PART_BYTES  # arenas read here and waiting for the device to pass them, at most (RemoteTrace)
# a side process's bytes shipped and not yet compared here, at most (spawning.InFlight: more are shipped only when
# nothing is in flight or this side waits for a message): with a part being written there, about this and a part
FLIGHT_BYTES = 3 * PART_BYTES


class _Shipper:
    """The reference process's sink: records are kept until their step's logits are out or until they add up to
    ``PART_BYTES``, then shipped at once (a long prompt's prefill in parts: what waits in either process is bounded
    by the part size and ``AHEAD``, not by the step)."""

    def __init__(self, out: Any, part_bytes: int = 0, live_bytes: int = 0, acks: Any = None, flight: Any = None,
                 flight_bytes: int = 0) -> None:
        self.out = out
        self.part_bytes = part_bytes or PART_BYTES
        # the bytes in flight and their budget (spawning.InFlight; None: bounded by the queue's AHEAD messages only)
        self.flight, self.flight_bytes = flight, flight_bytes or FLIGHT_BYTES
        self.acks = acks  # where the other side says it has read a live value (None: every value is copied)
        if acks is not None:
            self.live_bytes = live_bytes or LIVE_BYTES  # Sink.live_bytes, read by the recorder
        self.records: list[Record] = []
        self._written = Arenas()  # the recorder's copies, made where they are shipped from (Sink.copy_value)
        self._bytes = 0
        self._seen: set[int] = set()  # ids of the tensors counted in _bytes (a shared input counts once)
        # where this process's shipping time went: packing the arenas, waiting for the bytes in flight to come within
        # their budget, handing them to the queue (which waits while AHEAD messages are not yet taken: the other
        # side is then the slower one), waiting for live reads; the most bytes in flight after a message was shipped
        # (a live value counts: the model's own memory, shipped as it left it)
        self.seconds = {"pack_s": 0.0, "flight_wait_s": 0.0, "put_s": 0.0, "live_wait_s": 0.0}
        self.most_in_flight = 0
        self.sent: list[tuple[int, float, float]] = []  # each message: (its step, when packing began, when handed on)

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        child_put(self.out, ("metadata", metadata))

    def copy_value(self, value: torch.Tensor) -> torch.Tensor | None:
        """The recorder's copy of an observed value, written into the arena the next message ships
        (``ulptrace.record.Sink``)."""
        return self._written.copy(value)

    def add(self, record: Record) -> None:
        self.records.append(record)
        for t in (record.out, *record.inputs.values()):
            if id(t) not in self._seen:
                self._seen.add(id(t))
                self._bytes += t.numel() * t.element_size()
        live = self.acks is not None and any(t.nbytes >= self.live_bytes for t in (record.out, *record.inputs.values()))
        if live:  # possibly the model's own value: shipped now, and not left to the model until it has been read
            self._send(record.step, None, record.key)
            t = time.perf_counter()
            child_get(self.acks, _SENT_ERRORS)
            self.seconds["live_wait_s"] += time.perf_counter() - t
        elif self._bytes >= self.part_bytes:
            self._send(record.step, None)

    def ship(self, step: int, token: torch.Tensor) -> None:
        """The step's records not yet shipped and the reference's token at ``step``: the step is whole there."""
        copy = self._written.copy(token)  # in the arena with the step's records: no arena of its own
        self._send(step, token if copy is None else copy)

    def _send(self, step: int, token: torch.Tensor | None, live: tuple[str, int] | None = None) -> None:
        """The records held (and ``token``, when the step ends) as arenas (``processes.pack``): the ones the
        recorder's copies were made in, read where they are; a CUDA tensor of a quarter part or more, or a live one,
        shared as it is (no copy); the rest packed into one. ``live``: the key of the last record, whose value the
        other side must read (or copy) and acknowledge."""
        t0 = time.perf_counter()
        tensors = [t for record in self.records for t in (record.out, *record.inputs.values())]
        arenas, specs = pack([*(() if token is None else (token,)), *tensors],
                             alone_bytes=min(self.part_bytes // 4, getattr(self, "live_bytes", math.inf)),
                             written=self._written)
        metas = record_metas(self.records, specs)
        self.records, self._bytes, self._seen = [], 0, set()
        t1 = time.perf_counter()
        if self.flight is not None:
            nbytes = sum(a.nbytes for a in arenas if a is not None)
            self.seconds["flight_wait_s"] += self.flight.wait_to_ship(nbytes, self.flight_bytes, _orphaned)
            if any(a is not None and a.is_cuda for a in arenas):
                torch.cuda.ipc_collect()  # what the parent let go meanwhile: its memory reused by the next arenas
            self.flight.shipped(nbytes)
            self.most_in_flight = max(self.most_in_flight, self.flight.bytes)
        t2 = time.perf_counter()
        child_put(self.out, ("step", step, None if token is None else specs[id(token)], arenas, metas, live))
        t3 = time.perf_counter()
        self.seconds["pack_s"] += t1 - t0
        self.seconds["put_s"] += t3 - t2
        self.sent.append((step, t0, t3))


def from_start(cfg: Any) -> str | None:
    """Why the onset of ``cfg`` (a ``RunConfig``) runs each side in a process of its own from the start under
    ``concurrent="auto"``, the command's default (``ulptrace.spawning.beside_from_start``: where and why); None where
    it does not."""
    size = beside_from_start(cfg.model, cfg.device, cfg.dtype, cfg.concurrent, cfg.reference_memory)
    if size is None:
        return None
    return (f"a model of {size / 2**30:.2f} GiB of weights on {cfg.device} (>= {FROM_START_BYTES >> 20} MiB): each "
            "side runs in a process of its own from the start, this one comparing (--concurrent: the candidate here; "
            "--no-concurrent: one side after the other here)")


def _orphaned() -> None:
    """Raise ``Orphaned`` if the process that started this one is gone (a side process's waits)."""
    if parent_gone():
        raise Orphaned(0)


def serve(commands: Any, out: Any, acks: Any, flight: Any = None) -> None:
    """The reference process: one run per configuration it is sent (None: stop), its model (sent or built here) kept
    for the next run of the same model, dtype, device and seed (``processes.model_key``; one at a time). Asked to
    stop, it ends at once (``processes.end_helper``: nothing is left to flush — every message was taken)."""
    note_unsent(out, _SENT_ERRORS)
    keep_freed_memory()  # as the command that started it (ulptrace.host_memory)
    models: dict[tuple, Any] = {}
    runs = 0
    serving_at = imported_at = time.perf_counter()  # this process's interpreter and imports (torch, this module)
    while (command := child_get(commands, _SENT_ERRORS)) is not None:
        if command[0] == "prepare":  # imported while the parent builds the model it will send (not after)
            prepare_imports(command[1])
            imported_at = time.perf_counter()
            continue
        if command[0] == "token":  # a feed for a run that has ended (it failed before taking it): nothing to do
            continue
        runs += 1
        _reference_run(*command[1:], out, acks, flight, models, runs, (serving_at, imported_at), commands)
    models.clear()  # the parent's twin, its memory shared: released before this process ends
    end_helper(out)


_SENT_ERRORS: list[BaseException] = []  # the reference process's: what its queue to the parent could not send


class _Fed:
    """A candidate run's feed in its process: the reference's token of each step, as the parent forwards them
    (``("token", step, tensor)`` on this process's commands queue), each kept until the run ends — a received CUDA
    tensor's memory ends with a wait for this process's stream — for the observation check's re-run too."""

    def __init__(self, commands: Any) -> None:
        self.commands = commands
        self.tokens: dict[int, torch.Tensor] = {}

    def __call__(self, step: int) -> torch.Tensor:
        while step not in self.tokens:
            item = child_get(self.commands, _SENT_ERRORS)
            if item is None or item[0] != "token":
                raise RuntimeError(f"the reference's token at step {step} was due, but the parent sent "
                                   f"{'a stop' if item is None else repr(item[0])}")
            self.tokens[item[1]] = item[2]
        return self.tokens[step]


def _reference_run(cfg: Any, part_bytes: int, live_bytes: int, flight_bytes: int, shipped: Any, setup: Setup,
                   role: str, fed: bool, out: Any, acks: Any, flight: Any, models: dict[tuple, Any], runs: int,
                   started: tuple[float, float], commands: Any) -> None:
    """Record ``cfg``'s generation of side ``role`` (``ROLES``: its path and mode) and ship each step; then the
    tokens, the path's report, the observation check and about this process (its id, how many runs it has served,
    its peak GPU memory, when its model was ready, when the parts of its start-up ended, the torch settings it ran
    under). ``fed``: the run is fed the reference's tokens, which the parent forwards as they come (:class:`_Fed`),
    else it takes its own. The model is ``shipped`` (the parent's twin of its candidate, its memory shared) or, where
    none came, built here; the parent's ``setup`` (its torch settings, its registration of the role's path) is taken
    first. Any error is shipped as its traceback (the parent then stops this process: its state is not trusted
    again)."""
    try:
        from ulptrace.models import build_model
        from ulptrace.paths import apply_path
        from ulptrace.run import check_observation, make_prompts, record_generation, torch_dtype

        setup.take()
        key = model_key(cfg)
        if key not in models:
            models.clear()  # one model at a time: its memory is this process's only lasting cost
            # when each part of the start-up ended (time.perf_counter: system-wide on Linux, CLOCK_MONOTONIC, so
            # comparable with the parent's clock)
            start = {"serving_at": started[0], "imported_at": started[1], "command_at": time.perf_counter()}
            if torch.device(cfg.device).type == "cuda":
                torch.empty(0, device=cfg.device)  # the CUDA context
                start["context_at"] = time.perf_counter()
            if shipped is None:
                model = build_model(cfg.model, dtype=torch_dtype(cfg.dtype), device=cfg.device, seed=cfg.seed,
                                    sdpa=cfg.sdpa)
            else:
                model = received_model(shipped)
            models[key] = model, {**start, "model_at": time.perf_counter(), "model_shipped": shipped is not None}
        model, start = models[key]
        built_at = time.perf_counter()
        if torch.device(cfg.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        prompts = make_prompts(model.config.vocab_size, cfg.prompts, cfg.prompt_len, cfg.seed, cfg.device)
        sink = _Shipper(out, part_bytes, live_bytes, acks, flight, flight_bytes)
        final: dict[int, torch.Tensor] = {}

        def on_logits(step: int, logits: torch.Tensor) -> None:
            if cfg.check_observation:
                final[step] = logits.clone()
            sink.ship(step, logits.argmax(-1, keepdim=True))

        forced = _Fed(commands) if fed else None
        path, mode = cfg.path_and_mode(role)
        with apply_path(model, path) as applied:
            began = time.perf_counter()
            tokens, _ = record_generation(model, cfg, role, prompts, applied.info, sink=sink, forced=forced,
                                          on_logits=on_logits)
            ran = time.perf_counter() - began
            path_info = applied.info  # read after the run: a path may report what ran
            observation = check_observation(model, prompts, cfg.new_tokens, tokens if forced is None else forced,
                                            final, mode=mode, cache_len=cfg.cache_len) if cfg.check_observation \
                else None
        peak = torch.cuda.max_memory_allocated() if torch.device(cfg.device).type == "cuda" else None
        child_put(out, ("done", tokens.cpu().share_memory_(), path_info, observation,
                 {"pid": os.getpid(), "run_in_process": runs, "peak_gpu_bytes": peak, "built_at": built_at,
                  "torch_settings": {name: str(value) for name, value in torch_settings().items()},
                  "start_up": start, "seconds": {"run_s": ran, **sink.seconds},
                  "most_in_flight_bytes": sink.most_in_flight,
                  "messages": {"began_at": began, "sent": sink.sent}}))
    except Orphaned:
        raise
    except BaseException as exc:  # noqa: BLE001 — shipped whole, raised in the parent
        child_put(out, ("error", traceback.format_exc(), pickled_error(exc)))


class _Worker:
    """A reference process and its queues (``ulptrace.spawning.ReferenceStart``: the one the command line started
    for this run, else a new one), and what this side knows of it: the model it holds and the twin it shares."""

    def __init__(self, started: ReferenceStart) -> None:
        self.started = started
        self.spawned_at = started.spawned_at
        self.process, self.commands, self.messages, self.acks = (started.process, started.commands, started.messages,
                                                                 started.acks)
        self.flight = started.flight  # the bytes its runs have in flight (spawning.InFlight)
        self.model_key: tuple | None = None  # whose model the process holds (sent or built there)
        self.shipped: Any = None  # the twin whose memory the process uses: kept alive here while it lives
        self.unsent: list[BaseException] = []  # what the commands queue could not send (its model, say)
        note_unsent(self.commands, self.unsent)

    def stop(self, *, idle: bool = False) -> None:
        """End the process: an ``idle`` one is asked to (it leaves its loop and exits as a process does), one in a run
        or past a failure is killed (:func:`shutdown` ends many so at once)."""
        end_processes([self.process], [self.commands, self.messages, self.acks], ask=[self.commands] if idle else None)
        self.shipped = None


# a process kept after a clean run, by its role and its model's key (one model's at most, a process per role)
_IDLE: dict[tuple, _Worker] = {}


def _take_worker(cfg: Any, role: str = "reference") -> _Worker:
    """The idle process of ``role`` holding ``cfg``'s model if there is one (its model built, its CUDA context and
    kernels warm), else the one the command line started for this run and role
    (``ulptrace.spawning.start_reference``), else a new one; idle processes of another model are stopped (one model's
    memory kept at most)."""
    key = model_key(cfg)
    worker = _IDLE.pop((role, key), None)
    started = take_reference(cfg.model, cfg.device, role)
    if worker is not None and worker.process.is_alive():
        if started is not None:  # one the command line started is not needed
            _Worker(started).stop()
        return worker
    for other in [k for k in _IDLE if k[1] != key]:
        _IDLE.pop(other).stop(idle=True)
    return _Worker(started if started is not None else ReferenceStart(role=role))


def shutdown() -> None:
    """Stop the processes kept for the next concurrent onset (each holds its model's memory while it waits); also done
    when this process exits. All are asked at once, then waited for: each one's exit (its CUDA context's teardown)
    runs beside the others'."""
    workers = list(_IDLE.values())
    _IDLE.clear()
    end_processes([w.process for w in workers], [q for w in workers for q in (w.commands, w.messages, w.acks)],
                  ask=[w.commands for w in workers])
    for worker in workers:
        worker.shipped = None


atexit.register(shutdown)


class RemoteTrace:
    """A run's records as they arrive from its process (the reference's, or a split onset's candidate's, ``role``):
    what ``StreamingComparator`` reads of a reference (``metadata``, ``pop``, ``get``, ``keys``), each waiting for the
    step it needs, or each as it came (``arriving``). ``streaming``: its keys are known only once the run has finished
    (``keys`` waits for that). ``on_step(step)``, when set, is called once each step has arrived whole."""

    streaming = True

    def __init__(self, owner: ReferenceProcess, role: str = "reference") -> None:
        self._owner = owner
        self.role = role  # whose run it is (ROLES): what its errors are called
        self.on_step: Callable[[int], None] | None = None  # called with each step that has arrived whole
        self._records: dict[tuple[str, int], Record] = {}
        self._order: list[tuple[str, int]] = []
        self._metadata: dict[str, Any] | None = None
        self.tokens: dict[int, torch.Tensor] = {}  # step -> the reference's token then (its step has arrived whole)
        self.done: tuple | None = None
        self.failure: BaseException | None = None  # what went wrong there, raised again at any later read
        # live records (a value the reference's model may still hold, Sink.live_bytes; the reference waits until
        # this side says it has read it): still here, and handed out (read once the caller's work has run)
        self._unread: set[tuple[str, int]] = set()
        self._handed: list[tuple[str, int]] = []
        # this side's time waiting for the reference's messages, and unpacking them (finish() reports them)
        self.seconds = {"candidate_waited_s": 0.0, "candidate_unpack_s": 0.0}
        # each message taken: (its step or None, when this side began to wait for it, when it had it); each token asked
        # for: (its step, when asked, when answered) — where each side was when (time.perf_counter, both processes')
        self.received: list[tuple[int | None, float, float]] = []
        self.asked: list[tuple[int, float, float]] = []
        # the CUDA arenas of the messages taken, a list a message, held here until no view of them is left and the
        # device has read them (_let_go): torch's end of a CUDA IPC memory synchronises the current stream, which
        # stops this side's run at every message if the last view of one goes while the run goes on
        self._held: list[list[torch.Tensor]] = []
        # what the reference process counts in flight (spawning.InFlight) is told each message's bytes went once this
        # side has handed out all of its records and the device has passed the work enqueued by then: records kept
        # after that (the oracle's pairs) are this side's to hold, not a reason for the reference to wait. By message:
        # [its records not handed out yet, its bytes, the device of its CUDA arenas or None]; each record's message
        self._messages: dict[int, list] = {}
        self._message_of: dict[tuple[str, int], int] = {}
        self._handed_whole: list[int] = []  # messages whose records are all handed out, since the last _let_go
        self._consumed = UntilRead(1 << 62, drop=owner.let_go)  # their bytes, until the device has passed
        # those no view holds, until the device has read them (at most WAITING_BYTES: the oldest waited for past it)
        self._unused = UntilRead(WAITING_BYTES, drop=self._drop_quietly)
        self._quiet: torch.cuda.Stream | None = None  # a stream nothing runs on: what those synchronisations wait for

    @property
    def metadata(self) -> dict[str, Any]:
        while self._metadata is None:
            self._receive()
        return self._metadata

    def _receive(self) -> None:
        """Take the next message of the reference process (waiting for it), or raise what went wrong there."""
        self._release_live()
        self._let_go()
        if self.done is not None:
            raise RuntimeError("the reference process has finished: nothing more will arrive")
        if self.failure is not None:
            raise self.failure
        t0 = time.perf_counter()
        try:
            item = self._owner.next_message()
        except RuntimeError as exc:
            self.failure = exc
            raise
        t1 = time.perf_counter()
        self.seconds["candidate_waited_s"] += t1 - t0
        kind = item[0]
        self.received.append((item[1] if kind == "step" else None, t0, t1))
        if kind == "metadata":
            self._metadata = item[1]
        elif kind == "step":
            self._unpack(*item[1:])
            self.seconds["candidate_unpack_s"] += time.perf_counter() - t1
        elif kind == "done":
            self.done = item[1:]
            self.done[-1]["start_up"]["spawned_at"] = self._owner.spawned_at
            self.done[-1]["start_up"]["sent_at"] = self._owner.sent_at
        else:
            self.failure = remote_error(*item[1:], f"the {self.role} run")
            raise self.failure

    def _unpack(self, step: int, token: tuple | None, arenas: list[torch.Tensor], metas: list,
                live: tuple[str, int] | None) -> None:
        views = Unpacked(arenas)
        cuda = [a for a in arenas if a is not None and a.is_cuda]  # (memory in a host arena ends without a wait)
        if cuda:
            self._held.append(cuda)
        message = len(self.received)
        self._messages[message] = [len(metas), sum(a.nbytes for a in arenas if a is not None),
                                   cuda[0].device if cuda else None]
        for meta in metas:
            record = views.record(meta)
            self._records[record.key] = record
            self._order.append(record.key)
            self._message_of[record.key] = message
        if not metas:
            self._handed_whole.append(message)
        if token is not None:  # the step's last part: the token kept as a copy (a view would keep its arena here)
            self.tokens[step] = views.tensor(token).clone()
            if self.on_step is not None:
                self.on_step(step)
        if live is not None:
            self._unread.add(tuple(live))

    def _release_live(self) -> None:
        """Tell the reference it may go on with the live values it waits on: before this side waits for anything
        more from it (it sends nothing until then). A value handed out has been read by now (what the caller did
        with it is enqueued; the device is waited for); one not taken yet is copied here first."""
        if not (self._unread or self._handed):
            return
        live = {id(t) for key in self._unread if key in self._records
                for t in (self._records[key].out, *self._records[key].inputs.values())}
        copies: dict[int, torch.Tensor] = {}  # a tensor several records hold is copied once, and shared again
        for key, record in list(self._records.items()):  # the live records, and any other holding their tensors
            if any(id(t) in live for t in (record.out, *record.inputs.values())):
                self._records[key] = _own(record, copies)
        records = [*self._unread, *self._handed]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the reads (and the copies) done before the memory goes back
            self._let_go(wait=True)  # the live values' arenas among them: no longer held here
        self._unread.clear()
        self._handed.clear()
        for _ in records:
            self._owner.ack()

    def _let_go(self, wait: bool = False) -> None:
        """Give back to the reference the arenas of messages no view of which is left here (their storages used by
        the arenas held alone), once the device has read them (an event recorded when they were found unused;
        ``wait``: waiting for it; more than ``WAITING_BYTES`` waiting: the oldest waited for, so that a long prefill,
        whose device work runs far behind this host, does not hold its records twice over). Their memory goes while a
        stream nothing runs on is the current one, so torch's synchronisation at an IPC memory's end waits for
        nothing: the event already says that this side's reads of it are done. An arena a view still holds is kept (a
        record kept for the oracle, say); if the counts are ever wrong, letting go of an arena a view holds only leaves
        its end to that view (torch's own synchronisation). The reference is told the bytes of each message whose
        records have all been handed out, once the device has passed the work enqueued by then (host messages at
        once): what it counts in flight (``spawning.InFlight``) is what waits here, not what this side keeps."""
        unused = _unused(self._held)
        if unused:
            ids = {id(arenas) for arenas in unused}
            self._held = [arenas for arenas in self._held if id(arenas) not in ids]
            self._unused.add(unused, sum(a.nbytes for arenas in unused for a in arenas), unused[0][0].device)
        self._unused.release(wait)
        for message in self._handed_whole:
            _, nbytes, device = self._messages.pop(message)
            if device is None:
                self._owner.let_go(nbytes)
            else:
                self._consumed.add(nbytes, nbytes, device)
        self._handed_whole.clear()
        self._consumed.release(wait)

    def _handed_out(self, key: tuple[str, int]) -> None:
        """A record is handed out (once): its message's count of records to hand out goes down."""
        message = self._message_of.pop(key, None)
        if message is not None:
            left = self._messages[message]
            left[0] -= 1
            if not left[0]:
                self._handed_whole.append(message)

    def _drop_quietly(self, unused: list[list[torch.Tensor]]) -> None:
        """The last references to read arenas, dropped while a stream nothing runs on is current (``_let_go``)."""
        if self._quiet is None:
            self._quiet = torch.cuda.Stream(unused[0][0].device)
        with torch.cuda.stream(self._quiet):
            unused.clear()  # the arenas' last references: their memory goes back to the reference now

    def _until(self, key: tuple[str, int]) -> None:
        while key not in self._records and self.done is None and key[1] not in self.tokens:
            self._receive()

    def pop(self, key: tuple[str, int]) -> Record | None:
        self._until(key)
        if key in self._unread:
            self._unread.discard(key)
            self._handed.append(key)
        self._handed_out(key)
        return self._records.pop(key, None)

    def get(self, key: tuple[str, int]) -> Record | None:
        self._until(key)
        if key in self._unread:  # kept here after the call: a copy of its own
            self._records[key] = _own(self._records[key])
            self._unread.discard(key)
            self._handed.append(key)
        self._handed_out(key)
        return self._records.get(key)

    def arriving(self) -> Iterator[Record]:
        """Each record as it arrives, in the order the process made them, taken from here (``pop``): what a sink
        would have been handed in that process, for a caller that compares a side run elsewhere as it goes."""
        taken = 0
        while True:
            while taken == len(self._order) and self.done is None:
                self._receive()
            if taken == len(self._order):
                return
            key = self._order[taken]
            taken += 1
            record = self.pop(key)
            if record is not None:
                yield record

    def keys(self) -> list[tuple[str, int]]:
        """Every record the reference made, in its order (waits for the reference to finish)."""
        while self.done is None:
            self._receive()
        return list(self._order)

    def forced_token(self, step: int) -> torch.Tensor:
        """The token the reference chose at ``step`` (``[batch, 1]``): what the candidate is fed after it."""
        asked = time.perf_counter()
        while step not in self.tokens:
            self._receive()
        self.asked.append((step, asked, time.perf_counter()))
        return self.tokens[step]

    def finish(self) -> tuple[torch.Tensor, Any, dict[str, Any] | None, dict[str, Any]]:
        """Wait for the reference to finish: (its tokens, its path's report, its observation check, about its process:
        ``pid``, ``run_in_process`` (1 for a new process), ``peak_gpu_bytes`` in the run (None off CUDA),
        ``built_at``, its ``time.perf_counter()`` when its model was ready — on Linux the same clock as this
        process's, so a benchmark can time the run from when both sides were ready — and ``start_up``, when the
        process was started (``spawned_at``, this process's clock; ``sent_at``, when this process sent the run, its
        model built), had its imports (``serving_at``, then ``imported_at``), got its first run (``command_at``), its
        CUDA context (``context_at``, on CUDA) and its model (``model_at``; ``model_shipped``: a twin sent by this
        process, else built there)) and ``seconds``, where the run's time went on both sides: the reference's run
        (``run_s``), in it its packing (``pack_s``), its handing messages to the queue (``put_s``: it waits while
        ``AHEAD`` are not taken, i.e. while this side is behind) and its waits for live reads; this side's waits for
        messages (``candidate_waited_s``: the reference is behind) and their unpacking), ``arena_waits``, how
        often this side waited for the device to pass arenas it had read because more than ``WAITING_BYTES`` of them
        were waiting (a long prefill's device work behind), and ``messages``, where each side was when: the reference's
        run began at ``began_at`` (its clock) and, in seconds from then, each message it ``sent`` (step, packing began,
        handed on — a step's parts share its step), each one this side ``received`` (step or None for the last, began
        to wait, had it) and each token this side ``asked`` for (step, asked, answered: where its steps ended)."""
        self.keys()
        self.done[-1]["seconds"].update(self.seconds)  # type: ignore[index]
        self.done[-1]["arena_waits"] = self._unused.waited  # type: ignore[index]
        messages = self.done[-1]["messages"]  # type: ignore[index]
        began = messages["began_at"]
        for name, events in (("sent", messages["sent"]), ("received", self.received), ("asked", self.asked)):
            messages[name] = [(step, round(a - began, 4), round(b - began, 4)) for step, a, b in events]
        return self.done  # type: ignore[return-value]


def _unused(held: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """The messages of ``held`` (each its list of arenas) no view of which is left: every arena's storage is referred
    to only by the arenas ``held`` keeps of it (and by the Python storage object that answers)."""
    if not held:
        return []
    own = collections.Counter(a.untyped_storage()._cdata for arenas in held for a in arenas)
    return [arenas for arenas in held
            if all(torch._C._storage_Use_Count(a.untyped_storage()._cdata) <= own[a.untyped_storage()._cdata] + 1
                   for a in arenas)]


def _own(record: Record, copies: dict[int, torch.Tensor] | None = None) -> Record:
    """``record`` with tensors of this process's own (a live value's memory goes back to the reference); ``copies``:
    those made for other records, by the id of what they copy (a shared tensor is copied once)."""
    copies = {} if copies is None else copies
    own = lambda t: copies[id(t)] if id(t) in copies else copies.setdefault(id(t), t.clone())
    return Record(record.site, record.step, record.kind, record.layer, own(record.out),
                  {role: own(t) for role, t in record.inputs.items()})


class ReferenceProcess:
    """``cfg``'s reference side (model, path, mode, sites, steps) recorded in a reference process while the caller
    runs the candidate; ``trace`` is a :class:`RemoteTrace` of it. A context manager: on a clean exit the process is
    kept for the next run of the same model (``shutdown`` stops it), after a failure here or there it is stopped, and
    after a reference path of the user's own code too (the kept process would run the code it imported then, not what
    the user has edited since)."""

    def __init__(self, cfg: Any, role: str = "reference") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, but got {role!r}")
        self.cfg = cfg
        self.role = role  # which kept process serves it (ROLES): two runs of one model can go on at once, one each
        self.trace = RemoteTrace(self, role)
        self._worker: _Worker | None = None
        self._started = False
        self._setup: Setup | None = None  # what the process takes of this one with the run
        self._feed: Callable[[int], torch.Tensor] | None = None  # the tokens a fed run is sent (start)
        self.sent_at: float | None = None  # when this process sent the run (its model built), time.perf_counter()

    def __enter__(self) -> Self:
        self._setup = Setup.of(self.cfg, self.path)  # a path it could not import: refused before any process starts
        self._worker = _take_worker(self.cfg, self.role)
        if self._worker.model_key != model_key(self.cfg):  # a new process: its imports now, while this side builds
            self._worker.started.prepare(self.cfg.model, self.cfg.device)
        return self

    @property
    def path(self) -> str:
        """The path this run applies (its role's: ``RunConfig.path_and_mode``)."""
        return self.cfg.path_and_mode(self.role)[0]

    def start(self, model: Any = None, feed: Callable[[int], torch.Tensor] | None = None) -> None:
        """Send the run. A process without ``cfg``'s model is sent a twin of ``model`` (this side's freshly built
        model, before its path is applied: same model, dtype, device and seed), its memory shared through CUDA IPC
        or shared memory — or, with ``model`` None, builds its own (drawing the weights again). ``feed`` (step ->
        token): the run is fed those tokens — the reference's (its ``RemoteTrace.forced_token``), each forwarded when
        this run has shipped the step before it (:meth:`step_ended`) — else it takes its own."""
        worker = self._worker
        if worker is None:
            raise RuntimeError("the reference run is not open (ReferenceProcess is a context manager)")
        key = model_key(self.cfg)
        shipped = None
        if worker.model_key != key:
            shipped = shipped_twin(model) if model is not None else None
            worker.model_key, worker.shipped = key, shipped
        self._started = True
        self.sent_at = time.perf_counter()
        # PART_BYTES, LIVE_BYTES and FLIGHT_BYTES read here: a test may set small ones
        self._feed = feed
        self.trace.on_step = None if feed is None else self.step_ended
        worker.flight.reset()  # (the process is idle: nothing of a run before is in flight)
        worker.commands.put(("run", self.cfg, PART_BYTES, LIVE_BYTES, FLIGHT_BYTES, shipped, self._setup, self.role,
                             feed is not None))

    def step_ended(self, step: int) -> None:
        """This run has shipped step ``step`` whole: a fed run is sent the token that feeds its next step (none after
        its last). The run waits for it there, so it is sent now, not when the step's records are compared."""
        if self._feed is not None and step < self.cfg.new_tokens - 1 and self._worker is not None:
            self._worker.commands.put(("token", step, self._feed(step)))

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        worker = self._worker
        if worker is None:
            return
        try:
            if exc_type is None and self.trace.done is None and self.trace.failure is None:
                self.trace.keys()  # the whole run: its messages are all taken
        finally:
            # what this process still holds of the shared memory goes, and the device is done reading it
            self.trace._records.clear()
            self.trace.tokens.clear()
            if torch.device(self.cfg.device).type == "cuda":
                torch.cuda.synchronize()
                self.trace._let_go(wait=True)
            self._worker = None
            if exc_type is None and self.trace.done is not None and self.trace.failure is None \
                    and worker.process.is_alive() and not is_user_path(self.path):
                previous = _IDLE.pop((self.role, model_key(self.cfg)), None)
                if previous is not None:  # (another run of this role beside it: one kept)
                    previous.stop(idle=True)
                _IDLE[self.role, model_key(self.cfg)] = worker  # kept: memory it shared stays valid while it lives
            else:
                worker.stop()

    @property
    def spawned_at(self) -> float | None:
        """When this process started the reference process (``time.perf_counter()``)."""
        return None if self._worker is None else self._worker.spawned_at

    @property
    def pid(self) -> int | None:
        """The reference process's id (while the run is open)."""
        return None if self._worker is None else self._worker.process.pid

    def ack(self) -> None:
        """Tell the reference process this side has read a live value it waits on."""
        if self._worker is not None:
            self._worker.acks.put(True)

    def kill(self) -> None:
        """Kill the reference process now (what a crash does; tests)."""
        if self._worker is not None:
            self._worker.process.kill()
            self._worker.process.join()

    def next_message(self) -> tuple:
        worker = self._worker
        if worker is None:
            raise RuntimeError("the reference run is not open (ReferenceProcess is a context manager)")
        if not self._started:
            raise RuntimeError("the reference run was not started (ReferenceProcess.start)")
        process = worker.process
        try:
            return worker.messages.get_nowait()
        except queue_module.Empty:  # waited for: the process ships what it holds back for the bytes in flight
            pass
        worker.flight.wants()
        return parent_get(worker.messages, worker.unsent, lambda: None if process.is_alive() else (
            f"the {self.role} process ended without finishing its run (exit code {process.exitcode}); {GUARD}"))

    def let_go(self, nbytes: int) -> None:
        """This side is done with ``nbytes`` the run shipped: their records all compared (``spawning.InFlight``)."""
        if self._worker is not None:
            self._worker.flight.let_go(nbytes)
