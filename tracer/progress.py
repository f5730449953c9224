"""A progress bar for long runs: which side is running, the step (of prefill + decodes), how many sites each
step records, the time spent and the time left — one line on stderr, redrawn in place.

A long GPU trace or a CPU run of a big model otherwise sits silent for minutes. The bar is drawn only when its
stream is a terminal, and never in CI (``CI`` set) or with ``--quiet``: logs and pipes get the ordinary
``[ulptrace]`` lines and no carriage-return noise. The estimate is the mean time of the steps done so far times
the steps left (decode steps are alike; the prefill, step 0, is excluded from the mean once a decode step has run).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO


def bar_enabled(stream: TextIO | None = None, *, quiet: bool = False) -> bool:
    """Whether a bar may be drawn on ``stream`` (default stderr): a terminal, not in CI, not ``quiet``."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not quiet and not os.environ.get("CI") and bool(isatty and isatty())


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds} s"


class Progress:
    """``start(label, steps, sites)`` a phase, ``step(done)`` after each step, ``close()`` at the end.

    Args:
        stream: where to draw (default stderr).
        enabled: draw at all (default :func:`bar_enabled` of ``stream``); a disabled bar does nothing.
        width: characters of the bar itself.
        interval: least seconds between redraws (the last step always redraws).
        clock: seconds since an arbitrary start (default ``time.perf_counter``).
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None, width: int = 24,
                 interval: float = 0.1, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bar_enabled(self.stream) if enabled is None else enabled
        self.width, self.interval = width, interval
        self.label, self.steps, self.sites, self.unit = "", 0, 0, "step"
        self._start = self._last = self._after_prefill = 0.0
        self._drawn = False

    def start(self, label: str, steps: int, sites: int | None = None, unit: str = "step") -> None:
        """A new phase (e.g. recording the reference) of ``steps`` steps recording ``sites`` sites each; ``unit``
        names what is counted (the oracle's judging of held record pairs counts stacks: :meth:`counter`)."""
        self.close()
        self.label, self.steps, self.sites, self.unit = label, max(int(steps), 1), sites, unit
        self._start = self._last = self.clock()
        self._after_prefill = 0.0
        self._draw(0, force=True)

    def step(self, done: int) -> None:
        """``done`` steps of the phase have finished."""
        if done == 1:
            self._after_prefill = self.clock()
        self._draw(done, force=done >= self.steps)

    def line(self, done: int, now: float | None = None) -> str:
        """The bar's text after ``done`` steps (for tests and for the redraw)."""
        now = self.clock() if now is None else now
        done = min(max(done, 0), self.steps)
        elapsed = now - self._start
        filled = round(self.width * done / self.steps)
        text = f"[ulptrace] {self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.unit} {done}/{self.steps}"
        if self.sites:
            text += f", {self.sites} sites each"
        text += f", {_clock(elapsed)}"
        if 0 < done < self.steps:
            if self.unit == "step" and done >= 2 and self._after_prefill:  # decode steps alike: the prefill left out
                per = (now - self._after_prefill) / (done - 1)
            else:
                per = elapsed / done
            text += f", about {_clock(per * (self.steps - done))} left"
        return text

    def _draw(self, done: int, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        self.stream.write("\r" + self.line(done, now) + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def counter(self, label: str, unit: str) -> Callable[[int, int], None]:
        """A ``(done, total)`` callback that draws a phase of its own (``label``, counting ``unit``) from its first
        call, and closes it at its last."""
        def report(done: int, total: int) -> None:
            if done == 0 or self.label != label:
                self.start(label, total, unit=unit)
            self.step(done)
            if done >= total:
                self.close()
                self.label = ""
        return report

    def close(self) -> None:
        """End the current line (if one was drawn)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
