"""A command's end without the interpreter's teardown (the console scripts' last step).

Why: once a command's work is done and its output written, CPython's finalization still tears down every module and
object it made — torch's, transformers', a model's, the CUDA context — which took 1.2-1.4 s after a small onset's
4-5 s on a 2-core host (``bench/RESULTS.md``, twenty-sixth round), and 2-3 s after each command on the H200's host.
Helper processes end the same way (``ulptrace.processes.end_helper``).

Nothing is lost by it: the exit handlers run first (``atexit``: the kept helper processes are stopped,
multiprocessing's children joined, logging flushed), then stdout and stderr are flushed; where a thread that is not
a daemon still runs (a writer not done), the ordinary exit is taken, which waits for it. An exception out of the
command never gets here: it ends the ordinary way, with its traceback.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End this process with exit status ``code`` at once: exit handlers run, output flushed, no teardown."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # the ordinary exit joins them first
    atexit._run_exitfuncs()  # the handlers the ordinary exit would run, in its order (a private name of CPython)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (``| head``) or a stream closed: nothing more can be written
            pass
    os._exit(code)
