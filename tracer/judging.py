"""The oracle's judging spread over worker processes beside the run (``onset --judge-workers N``).

Why: judging a differing record replays its site's semantics with intervals — some 420 small ops per record, each a
few microseconds of host dispatch (``bench/RESULTS.md``, P3) — so an onset with the oracle is bound by one host
core's dispatch, not by the device or the memory. A record's verdicts depend only on its two records and the
reference model's semantics, so records can be judged anywhere, in any order: N processes judging at once use N host
cores. On one GPU they also share the device, by time-slicing (no MPS): on the H200, N processes each judging P3's
record pairs had 1.79x one's throughput at 4 and 2.07x at 8 (``bench/bench_judge_scaling.py``), and P3's warm onset
took 8.98 s judged in its own process, 5.92 s in 4 judging processes, 5.28 s in 8 (``bench/RESULTS.md``, twelfth
round). A new pool's start-up (imports in N processes) is paid back only by a long run or a kept pool.

How: :class:`JudgePool` starts N judging processes (spawned) that import what a run needs while this side builds its
models, then sends them one twin of the reference model as built (``start``; its memory shared through CUDA IPC or
shared memory, the weights not drawn again — each applies the reference path to it and builds its own
``OracleJudge``). :meth:`JudgePool.judge` wraps this side's ``OracleJudge``: a pair that needs no replay (a site
without semantics, an input missing, bitwise-equal outputs) is answered here at once; the others are held (up to
``ulptrace.verdicts.queue_bytes_for`` the judge's device, as a ``QueuedJudge`` holds them, or until an answer is
read), ordered so that records of one program are neighbours (``ulptrace.verdicts.stack_hint``) and cut into one share
per worker; each share is packed into one arena
(``ulptrace.processes.pack``: a copy, so the run may reuse its memory) and sent to the least busy worker, which judges
it with ``OracleJudge.replayed_many`` (records of one program stacked, judged in one replay); each pair's answer is a
:class:`Pending` that ``ulptrace.comparison.finish_diffs`` reads. At most ``AHEAD`` shares per worker are in flight (the run then waits for an answer), so what waits stays
bounded. Every worker judges with the same semantics on the same device, so the verdicts are those of judging in
this process (tested: identical reports). A worker's failure is raised here with its traceback; a worker that dies,
with its exit code. A clean run's workers are kept, with their model, for the next onset of the same model and worker
count (``shutdown`` stops them), as the reference process is (``ulptrace.concurrent``).

Memory: each worker holds its CUDA context and its replay's temporaries (float64 intervals of one stack at a time:
``ulptrace.verdicts.STACK_ELEMENTS``), and the workers together one twin of the reference model; the pairs held are
the records themselves, those in flight copies (at most ``AHEAD`` shares per worker, ``AHEAD_BYTES`` in all).
"""

from __future__ import annotations

import atexit
import traceback
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from ulptrace.host_memory import keep_freed_memory
from ulptrace.paths import is_user_path
from ulptrace.processes import (
    GUARD,
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
    pickled_error,
    prepare_imports,
    received_model,
    record_metas,
    remote_error,
    shipped_twin,
)
from ulptrace.spawning import spawn_context, start_processes
from ulptrace.trace import Record
from ulptrace.verdicts import queue_bytes_for, stack_hint

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations are not evaluated here

AHEAD = 4  # shares of pairs in flight per worker before the run waits for an answer
AHEAD_BYTES = 1 << 30  # and bytes of pairs in flight (copies): a long prompt's large records wait for answers

_SENT_ERRORS: list[BaseException] = []  # a worker's: what its queue to the parent could not send


def _serve(commands: Any, answers: Any) -> None:
    """A judging process: ``("prepare", cfg)`` imports what a run needs; ``("open", cfg, model)`` applies ``cfg``'s
    reference path to ``model`` (the parent's twin; None: the one this process holds) and builds the judge;
    answers ``("opened",)``; ``("judge", index, arenas, metas)`` judges the pairs (``OracleJudge.replayed_many``:
    a share of the pairs held, those of one program neighbours) and answers ``("answer", index, results)``; ``("close",)``
    undoes the path; None stops. Any failure is answered as ``("error", traceback, pickled exception)``, after which
    the parent stops this process."""
    note_unsent(answers, _SENT_ERRORS)
    keep_freed_memory()  # as the command that started it (ulptrace.host_memory)
    torch.set_num_threads(1)  # N of them judge at once, each bound by its op dispatch: intra-op threads only contend
    model: Any = None
    judge: Any = None
    stack = ExitStack()
    while (command := child_get(commands, _SENT_ERRORS)) is not None:
        try:
            if command[0] == "prepare":
                prepare_imports(command[1])
            elif command[0] == "open":
                from ulptrace.paths import apply_path
                from ulptrace.verdicts import OracleJudge

                model = received_model(command[2]) if command[2] is not None else model
                command[3].take(keep=("num_threads",))  # its one thread (above) kept
                cfg, command = command[1], None  # nothing here but ``model`` holds the parent's twin (released at the end)
                stack = ExitStack()
                stack.enter_context(apply_path(model, cfg.reference))
                judge = OracleJudge(model, judge_reference=cfg.check_reference)
                child_put(answers, ("opened",))
            elif command[0] == "judge":
                arenas = [torch.frombuffer(bytearray(a), dtype=torch.uint8) if isinstance(a, bytes) else a
                          for a in command[2]]
                index, views, metas = command[1], Unpacked(arenas), command[3]
                del arenas
                command = None
                records = [views.record(meta) for meta in metas]
                pairs = list(zip(records[::2], records[1::2], strict=True))
                result = judge.replayed_many(pairs)  # the parent's without_replay did not answer them
                del records, pairs, views  # this process's hold on the parent's memory, released now
                child_put(answers, ("answer", index, result))
            elif command[0] == "close":
                judge = None
                stack.close()
        except Orphaned:
            raise
        except BaseException as exc:  # noqa: BLE001 — shipped whole, raised in the parent
            child_put(answers, ("error", traceback.format_exc(), pickled_error(exc)))
    judge = model = None  # the parent's twin, its memory shared: released before this process ends
    stack.close()
    end_helper(answers)


class _Workers:
    """The judging processes, each with its command queue, and the one queue they all answer on."""

    def __init__(self, count: int) -> None:
        context = spawn_context()
        self.count = count
        self.model_key: tuple | None = None  # whose model the processes hold
        self.shipped: Any = None  # the twin whose memory they use: kept alive here while they live
        self.answers = context.Queue()
        self.unsent: list[BaseException] = []  # what a command queue could not send (the model, say)
        self.commands = [context.Queue() for _ in range(count)]
        for queue in self.commands:
            note_unsent(queue, self.unsent)
        self.processes = [context.Process(target=_serve, args=(queue, self.answers), daemon=True,
                                          name=f"ulptrace-judge-{i}") for i, queue in enumerate(self.commands)]
        start_processes(self.processes)

    def gone(self) -> str | None:
        """Why a worker is no longer there (None: all alive)."""
        for i, process in enumerate(self.processes):
            if not process.is_alive():
                return f"judging process {i} ended without answering (exit code {process.exitcode}); {GUARD}"
        return None

    def send_all(self, command: tuple) -> None:
        for queue in self.commands:
            queue.put(command)

    def stop(self, *, idle: bool = False) -> None:
        """End the processes: idle ones are asked to (they exit as a process does), busy or failed ones killed."""
        end_processes(self.processes, [*self.commands, self.answers], ask=self.commands if idle else None)
        self.shipped = None


_IDLE: dict[tuple, _Workers] = {}  # judging processes kept after a clean run, by (model key, count) (at most one set)


def shutdown() -> None:
    """Stop the judging processes kept for the next onset (they hold their model's memory while they wait); also
    done when this process exits."""
    while _IDLE:
        _IDLE.popitem()[1].stop(idle=True)


atexit.register(shutdown)


class Pending:
    """A pair's answer on its way from a judging process: :meth:`result` waits for it."""

    def __init__(self, queue: _PoolQueue, index: int) -> None:
        self._queue, self._index = queue, index

    def result(self) -> dict[str, Any] | None:
        return self._queue.result(self._index)


class _PoolQueue:
    """``JudgePool.judge``'s ``SiteJudge``: pairs held until an answer is read or ``queue_bytes_for`` the judge's device
    are held (records of one program stack only in one share: a site's prefill with its decode steps), then sent a
    share to each worker (:meth:`flush`; a pair of ``LIVE_BYTES`` or more, maybe the model's own value, is sent at
    once: packing copies it)."""

    def __init__(self, pool: JudgePool, local: Any) -> None:
        self.pool, self.local = pool, local
        self.queue_bytes = queue_bytes_for(local.device)
        self._held: list[tuple[int, Record, Record]] = []
        self._bytes = 0
        self._sent: dict[int, tuple[int, int]] = {}  # pair -> (its share's index in the pool, its place there)
        self._shares: dict[int, list[dict[str, Any]]] = {}  # answers of a share not all read yet
        self._unread: dict[int, int] = {}
        self._next = 0

    def __call__(self, reference: Record, candidate: Record) -> Any:
        from ulptrace.record import LIVE_BYTES

        # moved first to where the workers judge (the reference may wait in host memory): one arena, one device
        reference, candidate = self.local.on_device(reference), self.local.on_device(candidate)
        answer = self.local.without_replay(reference, candidate)
        if answer is not None:
            return answer
        index, self._next = self._next, self._next + 1
        sizes = [t.nbytes for r in (reference, candidate) for t in (r.out, *r.inputs.values())]
        if max(sizes) >= LIVE_BYTES:
            self._send([(index, reference, candidate)])
        else:
            self._held.append((index, reference, candidate))
            self._bytes += sum(sizes)
            if self._bytes >= self.queue_bytes:
                self.flush()
        return Pending(self, index)

    def flush(self) -> None:
        """Send every pair held: ordered so that pairs that may stack are neighbours (``ulptrace.verdicts.stack_hint``),
        then cut into one run of neighbours per worker, which stacks them (``OracleJudge.replayed_many``). This side
        plans nothing that needs a program (the workers capture theirs)."""
        held, self._held, self._bytes = self._held, [], 0
        held.sort(key=lambda pair: stack_hint(pair[1]))
        share = -(-len(held) // self.pool.count)
        for start in range(0, len(held), share):
            self._send(held[start:start + share])

    def _send(self, pairs: list[tuple[int, Record, Record]]) -> None:
        sent = self.pool.submit([(r, c) for _, r, c in pairs])
        self._unread[sent] = len(pairs)
        for place, (index, _, _) in enumerate(pairs):
            self._sent[index] = (sent, place)

    def result(self, index: int) -> dict[str, Any]:
        if index not in self._sent:
            self.flush()
        sent, place = self._sent.pop(index)
        if sent not in self._shares:
            self._shares[sent] = self.pool.result(sent)
        answers = self._shares[sent]
        self._unread[sent] -= 1
        if not self._unread[sent]:
            del self._shares[sent], self._unread[sent]
        return answers[place]


class JudgePool:
    """``workers`` judging processes for ``cfg``'s reference semantics (model, reference path, ``check_reference``).

    A context manager: entered, it takes the kept processes of the same model and count or starts new ones (which
    import what a run needs while this side builds); ``start(model)`` sends the model; :meth:`judge` wraps this side's
    ``OracleJudge``. On a clean exit (every answer read) the processes are kept for the next onset of the same model,
    unless the reference path is the user's own code (the kept processes would run the code they imported then);
    after a failure here or there they are stopped.
    """

    def __init__(self, cfg: Any, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a judging pool needs at least one worker, but got {workers}")
        self.cfg = cfg
        self.count = workers
        self._workers: _Workers | None = None
        self._key = (model_key(cfg), workers)
        self._answers: dict[int, list[dict[str, Any]]] = {}
        self._busy: dict[int, int] = {}  # index in flight -> its worker
        self._held: dict[int, list[torch.Tensor]] = {}  # index in flight -> its arenas (alive until answered)
        self._next = 0
        self._opening = 0  # workers that have not yet said their run is open (a failure there is said instead)
        self._started = False
        self._setup: Setup | None = None  # what the processes take of this one with the run
        self.failure: BaseException | None = None
        self.judged = 0  # pairs sent to the workers (the rest were answered here without a replay)

    def __enter__(self) -> Self:
        self._setup = Setup.of(self.cfg)  # a reference path they could not import: refused before any process starts
        workers = _IDLE.pop(self._key, None)
        if workers is None or workers.gone() is not None:
            if workers is not None:
                workers.stop()
            shutdown()  # one set of kept processes at most
            workers = _Workers(self.count)
            workers.send_all(("prepare", self.cfg))
        self._workers = workers
        return self

    def start(self, model: Any = None) -> None:
        """Open the run: processes without ``cfg``'s model are sent one twin of ``model`` (this side's freshly built
        reference model, before its path is applied), shared by all of them."""
        workers = self._open()
        shipped = None
        if workers.model_key != model_key(self.cfg):
            if model is None:
                raise ValueError("the judging processes hold no model yet: start() needs the reference model")
            shipped = shipped_twin(model)
            workers.model_key, workers.shipped = model_key(self.cfg), shipped
        workers.send_all(("open", self.cfg, shipped, self._setup))
        self._opening = workers.count
        self._started = True

    def judge(self, local: Any) -> Any:
        """A ``SiteJudge`` for ``StreamingComparator``/``compare``: ``local`` (this side's ``OracleJudge`` of the
        same semantics) answers what needs no replay; the rest is held and, when an answer is first read or
        ``queue_bytes_for`` its device are held, planned into stacks (``OracleJudge.stacks``: pairs of one program judged in one
        replay) that the workers judge, a stack each (a :class:`Pending` per pair)."""
        return _PoolQueue(self, local)

    def submit(self, pairs: list[tuple[Record, Record]]) -> int:
        """Send pairs to the least busy worker (after waiting for an answer while every worker has ``AHEAD``
        shares in flight); their tensors, on one device (:meth:`judge` moves them to the judge's), are copied into
        one arena first; the worker judges them with ``OracleJudge.replayed_many``. Returns the index their answers
        come back under (:meth:`result`)."""
        workers = self._open()
        if not self._started:
            raise RuntimeError("the judging processes were not started (JudgePool.start)")
        records = [r for pair in pairs for r in pair]
        tensors = [t for r in records for t in (r.out, *r.inputs.values())]
        size = sum(t.nbytes for t in tensors)
        while self._busy and (len(self._busy) >= AHEAD * workers.count or self._held_bytes + size > AHEAD_BYTES):
            self._receive()
        load = [0] * workers.count
        for worker in self._busy.values():
            load[worker] += 1
        worker = load.index(min(load))
        arenas, specs = pack(tensors, shared=False)  # host arenas go as bytes (below)
        index, self._next = self._next, self._next + 1
        self._busy[index], self._held[index] = worker, arenas
        # a host arena goes as bytes through the pipe: for one pair's few kilobytes or megabytes that costs less than
        # moving it into shared memory and passing its descriptor (a CUDA one is shared through IPC)
        wired = [a if a is None or a.is_cuda else a.numpy().tobytes() for a in arenas]
        workers.commands[worker].put(("judge", index, wired, record_metas(records, specs)))
        self.judged += len(pairs)
        return index

    def result(self, index: int) -> list[dict[str, Any]]:
        """The answers to the pairs sent as ``index`` (waiting for them)."""
        while index not in self._answers:
            self._receive()
        return self._answers.pop(index)

    @property
    def _held_bytes(self) -> int:
        return sum(a.nbytes for arenas in self._held.values() for a in arenas if a is not None)

    def _receive(self) -> None:
        if self.failure is not None:
            raise self.failure
        workers = self._open()
        try:
            item = parent_get(workers.answers, workers.unsent, workers.gone)
        except RuntimeError as exc:
            self.failure = exc
            raise
        if item[0] == "error":
            self.failure = remote_error(*item[1:], "a judging process")
            raise self.failure
        if item[0] == "opened":
            self._opening -= 1
            return
        index, result = item[1], item[2]
        self._answers[index] = result
        del self._busy[index]
        self._held.pop(index)

    def _open(self) -> _Workers:
        if self._workers is None:
            raise RuntimeError("the judging pool is not open (JudgePool is a context manager)")
        return self._workers

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        workers = self._workers
        if workers is None:
            return
        clean = exc_type is None and self.failure is None
        try:
            # every answer read (nothing of this side's memory is still in use there), every worker's opening too (a
            # failure there is raised, not left for the next run to read)
            while clean and (self._busy or self._opening):
                self._receive()
        except BaseException:
            clean = False
            raise
        finally:
            self._workers = None
            self._held.clear()
            if clean and workers.gone() is None and not is_user_path(self.cfg.reference):
                if self._started:
                    workers.send_all(("close",))
                _IDLE[self._key] = workers  # kept: memory they share stays valid while they live
            else:
                workers.stop()
