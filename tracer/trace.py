"""Traces: the records of one run, in memory and on disk.

A trace maps ``(site, step)`` to a ``Record`` (the site's output and the inputs the oracle needs),
plus metadata (model, path, dtype, device, seeds, prompt shapes, library versions). On disk it is
a directory with ``manifest.json`` and one safetensors shard per step; it is written to a
temporary directory that is renamed into place, so a crash never leaves a partial trace under the
final name. Loading checks the schema name and version and every shard's size, and says which
check failed for a truncated, foreign or newer trace.

A writer killed before it finishes (``kill -9``, a power cut) leaves its temporary directory
behind: ``.NAME.ulptrace-tmp.PID.XXXX`` next to the final name, with a ``writer.json`` naming the
owning process. ``stale_temporaries`` finds those whose process no longer exists on this host,
``remove_stale`` deletes them; every new ``TraceWriter`` does that in its target directory, and
``ulptrace clean [DIR]`` does it on request.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ulptrace.reading import recorded_event

SCHEMA = "ulptrace.trace"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TMP_MARK = ".ulptrace-tmp."  # in a temporary trace directory's name: .NAME.ulptrace-tmp.PID.XXXX
OWNER_FILE = "writer.json"  # inside it: the owning process (pid, host, start time)


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how traces, reports and messages name a dtype (the one spelling)."""
    return str(dtype).removeprefix("torch.")


class TraceError(ValueError):
    """A trace directory that cannot be read: missing, truncated, foreign or of a newer schema."""


@dataclass
class Record:
    """One observation of one site at one step.

    ``out`` is the site's output; ``inputs`` maps oracle input roles (``x``, ``residual``,
    ``gate``, ...) to the tensors this path fed the site. Tensors are detached copies.
    """

    site: str
    step: int
    kind: str
    layer: int | None
    out: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return (self.site, self.step)

    def describe(self) -> dict[str, Any]:
        return {
            "site": self.site,
            "step": self.step,
            "kind": self.kind,
            "layer": self.layer,
            "dtype": dtype_name(self.out.dtype),
            "shape": list(self.out.shape),
            "inputs": {
                role: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
                for role, t in self.inputs.items()
            },
        }


def library_versions() -> dict[str, str]:
    """Versions that decide numerics: python, torch (+CUDA), transformers, ulptrace."""
    import ulptrace

    versions = {"python": platform.python_version(), "torch": torch.__version__, "ulptrace": ulptrace.__version__}
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    return versions


class Trace:
    """Records in execution order plus metadata; ``trace[site, step]`` gives a ``Record``."""

    def __init__(self, metadata: dict[str, Any] | None = None, records: Iterable[Record] = ()) -> None:
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._records: dict[tuple[str, int], Record] = {}
        for record in records:
            self.add(record)

    def add(self, record: Record) -> None:
        if record.key in self._records:
            raise ValueError(f"trace already has a record for site {record.site!r} at step {record.step}")
        self._records[record.key] = record

    def __getitem__(self, key: tuple[str, int]) -> Record:
        try:
            return self._records[key]
        except KeyError:
            raise KeyError(f"trace has no record for site {key[0]!r} at step {key[1]}") from None

    def get(self, key: tuple[str, int]) -> Record | None:
        return self._records.get(key)

    def pop(self, key: tuple[str, int]) -> Record | None:
        """Remove and return the record at ``key`` (None if absent): a streaming comparison releases each
        reference record as soon as it is compared."""
        return self._records.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def keys(self) -> list[tuple[str, int]]:
        return list(self._records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    @property
    def sites(self) -> list[str]:
        """Site names in first-execution order."""
        return list(dict.fromkeys(site for site, _ in self._records))

    @property
    def steps(self) -> list[int]:
        return sorted({step for _, step in self._records})

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically to directory ``path`` (must not exist); returns the path."""
        writer = TraceWriter(path, self.metadata)
        for record in self:
            writer.add(record)
        return writer.close()


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host with a storage of its own (safetensors refuses tensors whose storage others share)."""
    if t.device.type != "cpu":  # a copy of its own (from a GPU into pinned memory, not waited for)
        return t.detach().contiguous().to("cpu", non_blocking=t.is_cuda)
    t = t.detach()
    return t if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes else t.clone(
        memory_format=torch.contiguous_format)


def _shard_name(step: int) -> str:
    return f"step-{step:05d}.safetensors"


def _tensor_key(site: str, step: int, role: str) -> str:
    return f"{site}|{step}|{role}"


class TraceWriter:
    """Streams records to disk one step shard at a time; ``close()`` renames the directory into place.

    Records must arrive step by step (all of step t before step t+1), as a recorder produces them. A finished
    step's shard is written by a background thread (GPU tensors copied to pinned host memory without waiting),
    so the run does not stall on the disk; a failed write is raised by the next ``add`` that starts a step, or by
    ``close``. Memory held: the step being recorded and the one being written.
    """

    def __init__(self, path: str | os.PathLike, metadata: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"trace directory {self.path} already exists; choose a new path or remove it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # temporaries of writers that were killed (their process is gone) are removed here
        self.removed_stale: list[StaleTemporary] = remove_stale(self.path.parent)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}{TMP_MARK}{os.getpid()}.", dir=self.path.parent))
        (self._tmp / OWNER_FILE).write_text(json.dumps(_owner()))
        self.metadata = dict(metadata or {})
        self._entries: list[dict[str, Any]] = []
        self._shards: dict[str, int] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._stored: dict[int, str] = {}  # id(tensor) -> key, within the pending step
        self._step: int | None = None
        self._closed = False
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ulptrace-trace-writer")
        self._writing: Future | None = None  # the previous step's shard

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Called by the recorder on entry; keys given to ``close`` later still win."""
        self.metadata = {**metadata, **self.metadata}

    def add(self, record: Record) -> None:
        if self._step is not None and record.step != self._step:
            if record.step < self._step or _shard_name(record.step) in self._shards:
                raise ValueError(f"records must arrive step by step; got step {record.step} after {self._step}")
            self._flush()
        self._step = record.step
        entry = record.describe()
        entry["shard"] = _shard_name(record.step)
        # records share tensors (a GLU's gate input is the gate_proj output): store each once
        entry["tensors"] = {}
        for role, tensor in [("out", record.out)] + [("in." + r, t) for r, t in record.inputs.items()]:
            key = self._stored.get(id(tensor))
            if key is None:
                key = _tensor_key(record.site, record.step, role)
                self._stored[id(tensor)] = key
                self._pending[key] = tensor
            entry["tensors"][role] = key
        self._entries.append(entry)

    def _flush(self) -> None:
        self._wait()  # one shard in flight: a failed write surfaces here, before more is queued
        if not self._pending:
            return
        name = _shard_name(self._step)  # type: ignore[arg-type]
        devices = {v.device for v in self._pending.values() if v.is_cuda}
        # GPU tensors go to pinned host memory asynchronously; the writer waits for those copies (an event); a host
        # tensor that is a view of a larger storage (a slice), or shares its storage with another, is copied out of it
        tensors, storages = {}, set()
        for k, v in self._pending.items():
            own = _own_storage(v)
            where = own.untyped_storage().data_ptr()
            # two views of one copy (a recorder serves a view of a value it copied by a view of that copy)
            tensors[k] = own.clone() if where in storages and own.nbytes else own  # own: host memory
            storages.add(where)
        events = [recorded_event(device) for device in devices]
        self._writing = self._writer.submit(self._write, name, tensors, events)
        self._pending = {}
        self._stored = {}

    def _write(self, name: str, tensors: dict[str, torch.Tensor], events: list[Any]) -> None:
        from safetensors.torch import save_file

        for event in events:
            event.synchronize()
        save_file(tensors, str(self._tmp / name))
        self._shards[name] = (self._tmp / name).stat().st_size

    def _wait(self) -> None:
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def close(self, metadata: dict[str, Any] | None = None) -> Path:
        if self._closed:
            return self.path
        try:
            self._flush()
            self._wait()
        finally:
            self._writer.shutdown(wait=True)
        if metadata:
            self.metadata.update(metadata)
        manifest = {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "metadata": self.metadata,
            "records": self._entries,
            "shards": self._shards,
        }
        (self._tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False, default=str))
        (self._tmp / OWNER_FILE).unlink(missing_ok=True)
        os.replace(self._tmp, self.path)
        self._closed = True
        return self.path

    def abort(self) -> None:
        self._writer.shutdown(wait=True)  # a shard being written finishes before its directory goes
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._closed = True


def _owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    except OSError:
        return True  # cannot tell: keep the directory
    return True


@dataclass
class StaleTemporary:
    """A temporary trace directory whose writer no longer runs (it was killed before ``close``)."""

    path: Path
    pid: int
    bytes: int


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def stale_temporaries(directory: str | os.PathLike) -> list[StaleTemporary]:
    """Temporary trace directories in ``directory`` whose owning process no longer exists on this host.

    Only directories a ``TraceWriter`` made are considered (the ``.ulptrace-tmp.`` name and the
    ``writer.json`` owner file); one written on another host, or whose process still runs (or
    cannot be checked), is kept.
    """
    directory = Path(directory)
    found: list[StaleTemporary] = []
    if not directory.is_dir():
        return found
    host = socket.gethostname()
    for entry in sorted(directory.iterdir()):
        if not (entry.name.startswith(".") and TMP_MARK in entry.name and entry.is_dir() and not entry.is_symlink()):
            continue
        try:
            owner = json.loads((entry / OWNER_FILE).read_text())
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or still being created
        if owner.get("host") != host or pid == os.getpid() or _process_exists(pid):
            continue
        found.append(StaleTemporary(entry, pid, _size(entry)))
    return found


def remove_stale(directory: str | os.PathLike) -> list[StaleTemporary]:
    """Remove what ``stale_temporaries(directory)`` finds; returns what was removed."""
    removed = []
    for stale in stale_temporaries(directory):
        shutil.rmtree(stale.path, ignore_errors=True)
        if not stale.path.exists():
            removed.append(stale)
    return removed


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The validated manifest of trace directory ``path``; raises ``TraceError`` saying what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise TraceError(f"{path} is not a trace directory (expected a directory with {MANIFEST})")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise TraceError(f"{path} has no {MANIFEST}: not a ulptrace trace, or one whose write did not finish")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{manifest_path} is not valid JSON (truncated or foreign file): {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise TraceError(f"{manifest_path} has schema {found!r}, expected {SCHEMA!r}: not a ulptrace trace")
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TraceError(
            f"{manifest_path} has a malformed 'version' field: expected an integer schema version such as "
            f"{SCHEMA_VERSION}, but found {version!r} ({type(version).__name__})"
        )
    if version > SCHEMA_VERSION:
        raise TraceError(
            f"{path} was written with trace schema version {version!r}; this ulptrace reads versions up to "
            f"{SCHEMA_VERSION} — upgrade ulptrace to read it"
        )
    for key in ("metadata", "records", "shards"):
        if key not in manifest:
            raise TraceError(f"{manifest_path} lacks the {key!r} field required by schema version {version}")
    for name, size in manifest["shards"].items():
        shard = path / name
        if not shard.is_file():
            raise TraceError(f"{path}: shard {name} listed in the manifest is missing")
        found = shard.stat().st_size
        if found != size:
            raise TraceError(f"{path}: shard {name} has {found} bytes, the manifest says {size} (truncated or altered)")
    return manifest


class LazyTrace:
    """A trace on disk read one step shard at a time (bounded memory for streaming comparison)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.metadata: dict[str, Any] = self.manifest["metadata"]
        self._entries = {(e["site"], e["step"]): e for e in self.manifest["records"]}
        self._shard_name: str | None = None
        self._shard: dict[str, torch.Tensor] = {}

    def _load_shard(self, name: str) -> dict[str, torch.Tensor]:
        if name != self._shard_name:
            from safetensors.torch import load_file

            try:
                self._shard = load_file(str(self.path / name))
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise TraceError(f"{self.path}: shard {name} cannot be read ({exc})") from None
            self._shard_name = name
        return self._shard

    def keys(self) -> list[tuple[str, int]]:
        return list(self._entries)

    def get(self, key: tuple[str, int]) -> Record | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        shard = self._load_shard(entry["shard"])
        site, step = key

        def tensor(role: str) -> torch.Tensor:
            name = entry.get("tensors", {}).get(role)
            if name is None:
                raise TraceError(f"{self.path}: the manifest names no tensor for {site!r} step {step} role {role!r}")
            if name not in shard:
                raise TraceError(f"{self.path}: shard {entry['shard']} lacks tensor {name!r} listed in the manifest")
            return shard[name]

        return Record(
            site, step, entry["kind"], entry["layer"], tensor("out"),
            {role: tensor("in." + role) for role in entry.get("inputs", {})},
        )

    def __iter__(self) -> Iterator[Record]:
        for key in self._entries:
            record = self.get(key)
            assert record is not None
            yield record

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def load(self) -> Trace:
        return Trace(self.metadata, iter(self))


def load_trace(path: str | os.PathLike) -> Trace:
    """Load a whole trace directory into memory; raises ``TraceError`` for bad directories."""
    return LazyTrace(path).load()
