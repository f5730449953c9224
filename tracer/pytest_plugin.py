"""pytest plugin for ulptrace, registered through the ``pytest11`` entry point ``ulptrace``.

Parity tests ("the kernel path stays within 1 BF16 ULP of HF") fail with a one-line assertion; what a
kernel engineer needs next is the full picture: which ULP assertions failed and by how much, and both
sides' traces on disk to re-run ``ulptrace compare`` on. This plugin provides:

- the option group ``ulptrace`` (``--ulptrace-save-dir DIR``, ``--ulptrace-max-ulp N``), defined once in
  :func:`add_options` so that the ``ulptrace`` CLI can add the same options to its argparse parser;
- the fixture ``ulptrace_budget`` (the ``--ulptrace-max-ulp`` default budget, 0 unless given);
- the fixture ``ulptrace_traces`` (a :class:`TraceSaver`: ``save(reference, candidate, label=...)``
  writes both traces under ``--ulptrace-save-dir`` and remembers the ``ulptrace compare`` command);
- the fixture ``ulptrace_parity`` (records a model run on the reference and on a candidate path, judges
  every site with the oracle and fails naming the onset, saving both traces through ``ulptrace_traces``);
- an ``ulptrace`` section in the terminal summary listing failed :func:`ulptrace.assert_ulp_close`
  calls and, for failed tests, the saved traces with their re-run commands.

It is kept light: at import it loads only pytest and the standard library; ulptrace's torch-based modules
are looked up in ``sys.modules`` inside hooks, never imported by the plugin, so a pytest run that does not
use ulptrace does not pay for torch.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ulptrace.cli import non_negative_int

__all__ = ["TraceSaver", "add_options"]


def add_options(adder: Callable[..., Any]) -> None:
    """Add the ``--ulptrace-*`` options through ``adder``.

    ``adder`` is ``argparse.ArgumentParser.add_argument`` (or an argument group's) or pytest's
    ``OptionGroup.addoption``; both take the same names and keywords. The parsed values land in
    ``ulptrace_save_dir`` (str or None) and ``ulptrace_max_ulp`` (int, default 0).
    """
    adder(
        "--ulptrace-save-dir",
        dest="ulptrace_save_dir",
        metavar="DIR",
        default=None,
        help="save both sides' traces of parity tests under DIR/<test id>/<label>/ (ulptrace_traces fixture)",
    )
    adder(
        "--ulptrace-max-ulp",
        dest="ulptrace_max_ulp",
        metavar="N",
        type=non_negative_int,
        default=0,
        help="default ULP budget returned by the ulptrace_budget fixture (default: 0)",
    )


@dataclass(frozen=True)
class _Saved:
    nodeid: str
    label: str
    directory: Path
    command: str


@dataclass
class _State:
    failures: list[tuple[str, Any]] = field(default_factory=list)  # (nodeid, UlpAssertionError)
    saved: list[_Saved] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)


_STATE = pytest.StashKey[_State]()

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 120


def _sanitise(text: str) -> str:
    """A file-name-safe version of a test id or label (long ones shortened with a hash suffix)."""
    name = _UNSAFE.sub("_", text).strip("._") or "_"
    if len(name) > _MAX_NAME:
        name = f"{name[: _MAX_NAME - 11]}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"
    return name


class TraceSaver:
    """What the ``ulptrace_traces`` fixture returns: saves a test's reference and candidate traces.

    Saving happens only when ``--ulptrace-save-dir`` was given; otherwise :meth:`save` does nothing.
    """

    def __init__(self, save_dir: Path | None, nodeid: str, record: Callable[[_Saved], None]) -> None:
        self._save_dir = save_dir
        self._nodeid = nodeid
        self._record = record
        self._count = 0

    @property
    def enabled(self) -> bool:
        """Whether ``--ulptrace-save-dir`` was given."""
        return self._save_dir is not None

    def save(self, reference: Any, candidate: Any, *, label: str | None = None) -> Path | None:
        """Save both traces to ``DIR/<sanitised test id>/<label>/{reference,candidate}``.

        Args:
            reference, candidate: objects with a ``save(path)`` method (ulptrace traces).
            label: sub-directory name for this pair (sanitised); default ``"0"``, ``"1"``, ... per test.
                An existing directory of the same test and label is replaced.

        Returns:
            The ``<label>`` directory, or None when ``--ulptrace-save-dir`` was not given.

        Raises:
            TypeError: a trace has no callable ``save``, or ``label`` is not a str.
        """
        for name, trace in (("reference", reference), ("candidate", candidate)):
            if not callable(getattr(trace, "save", None)):
                raise TypeError(f"{name} must have a save(path) method, but got {type(trace).__name__}")
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a str or None, but got {type(label).__name__}")
        if self._save_dir is None:
            return None
        label = str(self._count) if label is None else label
        self._count += 1
        directory = self._save_dir / _sanitise(self._nodeid) / _sanitise(label)
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        reference_path, candidate_path = directory / "reference", directory / "candidate"
        reference.save(reference_path)
        candidate.save(candidate_path)
        command = f"ulptrace compare {shlex.quote(str(reference_path))} {shlex.quote(str(candidate_path))}"
        self._record(_Saved(self._nodeid, label, directory, command))
        return directory


def _drain_assertion_failures() -> list[Any]:
    # Only if the assertions module is loaded: otherwise nothing can have failed, and importing it would
    # import torch into every pytest run.
    module = sys.modules.get("ulptrace.assertions")
    return module.drain_failures() if module is not None else []


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(
        parser.getgroup("ulptrace", "ulptrace: ULP budgets and saved traces of parity tests").addoption
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STATE] = _State()


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _drain_assertion_failures()  # failures raised outside any test are not attributed to this one


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    failures = _drain_assertion_failures()
    state = item.config.stash.get(_STATE, None)
    if state is not None and report.failed:
        state.failed.add(item.nodeid)
        state.failures.extend((item.nodeid, failure) for failure in failures)
    return report


@pytest.fixture
def ulptrace_budget(request: pytest.FixtureRequest) -> int:
    """The default ULP budget: ``--ulptrace-max-ulp`` (0 unless given)."""
    return int(request.config.getoption("ulptrace_max_ulp"))


@pytest.fixture
def ulptrace_traces(request: pytest.FixtureRequest) -> TraceSaver:
    """A :class:`TraceSaver` for this test; it saves only when ``--ulptrace-save-dir`` is given."""
    config = request.config
    option = config.getoption("ulptrace_save_dir")
    save_dir = None
    if option:
        save_dir = Path(option)
        if not save_dir.is_absolute():
            save_dir = Path(config.invocation_params.dir) / save_dir
    state = config.stash.get(_STATE, None)
    record = state.saved.append if state is not None else (lambda saved: None)
    return TraceSaver(save_dir, request.node.nodeid, record)


@pytest.fixture
def ulptrace_parity(ulptrace_traces: TraceSaver) -> Callable[..., Any]:
    """``ulptrace_parity(model, candidate_path, run, allow=())``: record ``run(model)`` on the model and on a
    copy with ``candidate_path`` applied, judge every site with the oracle, and fail naming the onset; on
    failure both traces go to ``--ulptrace-save-dir`` (see :func:`ulptrace.parity.check_parity`)."""
    from ulptrace.parity import check_parity  # torch-heavy: imported only when the fixture is used

    def check(model: Any, candidate_path: str, run: Callable[[Any], Any], **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return check_parity(model, candidate_path, run, saver=ulptrace_traces, **kwargs)

    return check


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    saved = [entry for entry in state.saved if entry.nodeid in state.failed]
    if not state.failures and not saved:
        return
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", "ulptrace")
    if state.failures:
        write("Failed ULP assertions:")
        for nodeid, failure in state.failures:
            greatest = "nonfinite" if failure.greatest is None else f"{failure.greatest} ULP"
            write(
                f"  {nodeid}: {failure.header}; greatest {greatest} at index {failure.index}; "
                f"{failure.mismatched} / {failure.total} mismatched"
            )
    if saved:
        write("Saved traces of failed tests (re-run the comparison with the command below each):")
        for entry in saved:
            write(f"  {entry.nodeid} [{entry.label}]: {entry.directory}")
            write(f"    {entry.command}")
