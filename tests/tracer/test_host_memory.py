"""Host memory freed by one op is kept for the next (``ulptrace.host_memory``): what a process judging on the CPU
relies on — a freed block of a few MiB reused without the kernel faulting its pages in again — and that the user's
own malloc settings, or another C library, are left alone. Each case runs in a fresh interpreter: the settings are
the process's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")

PAGES = 10 * 12 * (8 << 20) // 4096  # the pages the churn below writes: 10 rounds of twelve 8 MiB tensors
# (96 MiB held at once: more than glibc's adaptive trim threshold ever reaches, 64 MiB, whatever the process did before)
CHURN = """
import resource, sys, torch
from ulptrace.host_memory import keep_freed_memory
status = keep_freed_memory() if sys.argv[1] == "on" else "not asked"
def churn():  # what a replay does: temporaries of a few MiB made, written whole, held a while and freed
    for _ in range(10):
        held = [torch.ones(1 << 20, dtype=torch.float64)]
        for _ in range(11):
            held.append(held[-1] + 1)
        del held
churn()  # the first round may fault: the heap grows once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(status)
"""


def _churn(mode: str, **env: str) -> tuple[int, str]:
    """(minor page faults of the second churn, keep_freed_memory's line) in a fresh interpreter. Without the settings
    the count depends on what the process allocated before (glibc's thresholds adapt to it: 10% to all of the pages
    here, by the directory it ran in); a user's fixed 128 KiB threshold maps and unmaps every block."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=120,
                          env={**base, "OMP_NUM_THREADS": "1", **env}, check=True)
    faults, status = done.stdout.strip().splitlines()
    return int(faults), status


def test_freed_blocks_are_reused_without_faulting_their_pages_in_again() -> None:
    faults, status = _churn("on")
    assert status.startswith("glibc ") and "32 MiB" in status and "128 MiB" in status, status
    assert faults < PAGES // 20, (faults, PAGES)  # of 245,760 pages written


@pytest.mark.parametrize("env, named", [
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, "GLIBC_TUNABLES"),
])
def test_the_users_own_malloc_settings_are_left_as_they_are(env: dict[str, str], named: str) -> None:
    faults, status = _churn("on", **env)
    assert status == f"malloc left as the environment sets it ({named})"
    assert faults > PAGES * 9 // 10, faults  # their 128 KiB threshold still maps and unmaps every block


def test_tunables_that_are_not_mallocs_do_not_stop_it() -> None:
    faults, status = _churn("on", GLIBC_TUNABLES="glibc.pthread.rseq=0")
    assert status.startswith("glibc "), status
    assert faults < PAGES // 20, faults


def test_it_is_made_once_and_says_the_same_each_time() -> None:
    code = ("from ulptrace.host_memory import keep_freed_memory\n"
            "import ulptrace.host_memory as h\n"
            "first = keep_freed_memory()\n"
            "h._apply = lambda: 'made again'\n"
            "assert keep_freed_memory() == first, keep_freed_memory()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("module", ["ulptrace.cli", "ulptrace.probes.norm_rounding"])
def test_a_console_script_makes_it_before_its_command_runs(module: str) -> None:
    code = (f"import {module} as m\n"
            "import ulptrace.host_memory as h\n"
            "m.main = lambda: print('made' if h._state else 'not made') or 0\n"
            "m.console()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout == "made\n"


@pytest.mark.parametrize("module, entry", [("ulptrace.judging", "_serve"), ("ulptrace.concurrent", "serve")])
def test_a_helper_process_makes_it_when_it_starts(module: str, entry: str, monkeypatch) -> None:
    """A judging process and an onset's reference process, run here on a queue that stops them at once, their
    ending replaced."""
    import importlib
    import queue

    import torch

    helper = importlib.import_module(module)
    calls: list[str] = []
    monkeypatch.setattr(helper, "keep_freed_memory", lambda: calls.append("made") or "")
    monkeypatch.setattr(helper, "end_helper", lambda out: calls.append("ended"))
    commands: queue.Queue = queue.Queue()
    commands.put(None)
    threads = torch.get_num_threads()  # a judging process sets its own
    try:
        getattr(helper, entry)(commands, queue.Queue(), *([queue.Queue()] if entry == "serve" else []))
    finally:
        torch.set_num_threads(threads)
    assert calls == ["made", "ended"]


class _FakeLibc:
    """A C library as ctypes shows it: glibc's two functions (``mallopt`` refusing ``refuse``), or neither."""

    def __init__(self, glibc: bool, refuse: tuple[int, ...] = ()) -> None:
        self.asked: list[tuple[int, int]] = []
        if glibc:
            self.gnu_get_libc_version = lambda: b"9.99"
            self.mallopt = lambda number, value: self.asked.append((number, value)) or number not in refuse


@pytest.mark.parametrize("libc, status", [
    (_FakeLibc(glibc=False), "malloc left as it is: the C library is not glibc"),
    (_FakeLibc(glibc=True, refuse=(-1,)), "glibc 9.99 malloc refused the trim threshold"),
    (_FakeLibc(glibc=True, refuse=(-3, -1)), "glibc 9.99 malloc refused the mmap and trim threshold"),
    (_FakeLibc(glibc=True), "glibc 9.99 malloc: blocks under 32 MiB reused from the heap, its free top kept up to 128 MiB"),
])
def test_what_it_says_for_another_library_or_a_refusal(libc, status: str, monkeypatch) -> None:
    """Said, never raised: the settings only make judging faster. Run on a stand-in library (nothing is set here)."""
    from ulptrace import host_memory

    for name in [*host_memory._USER_VARIABLES, "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: libc)
    assert host_memory._apply() == status
    if hasattr(libc, "mallopt"):
        assert libc.asked == [(-3, 32 << 20), (-1, 128 << 20)]  # mallopt's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD
