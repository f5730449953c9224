"""Memory kept until the device has read it, within a budget.

A CUDA tensor handed to work that is only enqueued (a statistics launch, a copy) must outlive that work; when its
memory belongs to another process (``onset --concurrent``'s reference, shared through CUDA IPC) it must also not go
back before then, and torch's own end of such memory synchronises the current stream, stopping the run. So what was
handed over is kept here with an event recorded after the work, and dropped once the event has passed. The host runs
ahead of the device by as much as the launch queue allows — a long prompt's prefill, whose device work is long,
puts gigabytes of records behind it — so the bytes kept are bounded: past ``max_bytes`` the oldest are waited for
(the device is the bound there, so the run loses no time it had).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch


def recorded_event(device: torch.device) -> Any:
    """A CUDA event recorded on ``device``'s current stream (after the work enqueued so far)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class UntilRead:
    """Groups of objects kept until the device has run past the work enqueued before each was added, at most about
    ``max_bytes`` of them (the oldest waited for past it). ``drop(items)`` lets a group go (default: the last
    reference is let go here); ``event(device)`` makes the recorded event (CUDA's; tests give their own)."""

    def __init__(self, max_bytes: int, drop: Callable[[Any], None] | None = None,
                 event: Callable[[torch.device], Any] = recorded_event) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, but got {max_bytes}")
        self.max_bytes, self._drop, self._event = max_bytes, drop, event
        self._groups: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self.bytes = 0
        self.waited = 0  # groups waited for because the budget was exceeded

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, items: Any, nbytes: int, device: torch.device) -> None:
        """Keep ``items`` (``nbytes`` of device memory) until the work enqueued on ``device`` so far has run; then
        let go of every group whose event has passed, and wait for the oldest while more than ``max_bytes`` are kept."""
        self._groups.append((self._event(device), items, nbytes))
        self.bytes += nbytes
        self.release()

    def release(self, wait: bool = False) -> None:
        """Let go of the groups the device has read (``wait``: all of them, waiting for it), and of the oldest while
        more than ``max_bytes`` are kept (waiting for each)."""
        groups = self._groups
        while groups:
            event, items, nbytes = groups[0]
            over, passed = self.bytes > self.max_bytes, event.query()
            if not (wait or over or passed):
                break
            self.waited += int(over and not (wait or passed))
            event.synchronize()
            groups.popleft()
            self.bytes -= nbytes
            if self._drop is not None:
                self._drop(items)
