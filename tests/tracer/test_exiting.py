"""The console scripts end without the interpreter's teardown (``ulptrace.exiting``): nothing may be lost by it —
the exit status, output still buffered, the exit handlers' work, a thread still writing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter whose output is buffered as a command's is (not ``PYTHONUNBUFFERED``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env, check=False)


@pytest.mark.parametrize("status", [0, 1, 3])
def test_the_status_buffered_output_and_exit_handlers_survive(status: int, tmp_path) -> None:
    done = _run("import atexit, sys\n"
                "from ulptrace.exiting import exit_now\n"
                "atexit.register(lambda: print('handler ran', flush=False))\n"
                "sys.stdout.write('x' * 200_000)\n"  # more than a pipe's buffer, not flushed yet
                "sys.stderr.write('to stderr')\n"
                f"exit_now({status})\n", tmp_path)
    assert done.returncode == status
    assert done.stdout == "x" * 200_000 + "handler ran\n"  # the handler's own output flushed too
    assert done.stderr == "to stderr"


def test_a_thread_still_writing_keeps_the_ordinary_exit_which_waits_for_it(tmp_path) -> None:
    done = _run("import threading, time\n"
                "from ulptrace.exiting import exit_now\n"
                "def write():\n"
                "    time.sleep(0.5)\n"
                "    open('written.txt', 'w').write('all of it')\n"
                "threading.Thread(target=write).start()\n"
                "exit_now(4)\n", tmp_path)
    assert done.returncode == 4, done.stderr
    assert (tmp_path / "written.txt").read_text() == "all of it"


def test_an_error_out_of_the_command_ends_the_ordinary_way_with_its_traceback(tmp_path) -> None:
    done = _run("from ulptrace.exiting import exit_now\n"
                "def command():\n"
                "    raise RuntimeError('what went wrong')\n"
                "exit_now(command())\n", tmp_path)
    assert done.returncode == 1 and "RuntimeError: what went wrong" in done.stderr


def test_the_console_scripts_end_through_it(tmp_path) -> None:
    """``ulptrace`` and ``trace_norm_rounding`` (and ``python -m ulptrace``) run their ``main`` and end through
    ``exit_now`` with its status: a usage error's 2, a listing's 0 with its whole output."""
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts") if e.name in ("ulptrace",
                                                                                            "trace_norm_rounding")}
    assert scripts == {"ulptrace": "ulptrace.cli:console",
                       "trace_norm_rounding": "ulptrace.probes.norm_rounding:console"}
    listed = subprocess.run([sys.executable, "-m", "ulptrace", "models"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert listed.returncode == 0 and "qwen3.5-0.8b" in listed.stdout, listed.stderr
    wrong = subprocess.run([sys.executable, "-m", "ulptrace", "onset", "--model", "no-such-model", "--quiet"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert wrong.returncode == 2 and "unknown model 'no-such-model'" in wrong.stderr
