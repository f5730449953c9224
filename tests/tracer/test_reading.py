"""``ulptrace.reading.UntilRead``: what was handed to enqueued device work is kept until the device has passed it,
within a byte budget (the oldest waited for past it) — with events of the test's own, so on any machine."""

from __future__ import annotations

import pytest
import torch
from ulptrace.reading import UntilRead


class _Event:
    """A recorded event the test lets pass (``passed``); ``synchronize`` is the host waiting for it."""

    def __init__(self, log: list) -> None:
        self.passed, self.log = False, log

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        if not self.passed:
            self.log.append("waited")
        self.passed = True


def _held(max_bytes: int):
    log, events, dropped = [], [], []

    def event(device):
        assert device == torch.device("cuda", 0)
        events.append(_Event(log))
        return events[-1]

    return UntilRead(max_bytes, drop=dropped.append, event=event), events, dropped, log


def test_groups_go_once_the_device_has_passed_them_in_order() -> None:
    held, events, dropped, log = _held(1000)
    for name in "abc":
        held.add([name], 100, torch.device("cuda", 0))
    assert len(held) == 3 and held.bytes == 300 and dropped == []
    events[1].passed = True  # a later event passed, the first not: nothing goes out of order
    held.release()
    assert dropped == [] and len(held) == 3
    events[0].passed = True
    held.release()
    assert dropped == [["a"], ["b"]] and held.bytes == 100 and log == []
    held.release(wait=True)  # everything, waiting for the device
    assert dropped == [["a"], ["b"], ["c"]] and held.bytes == 0 and log == ["waited"] and held.waited == 0


def test_past_the_budget_the_oldest_are_waited_for() -> None:
    held, events, dropped, log = _held(250)
    for i in range(3):
        held.add([i], 100, torch.device("cuda", 0))
    # the third took it to 300 > 250: the first was waited for, the others stay (200 <= 250)
    assert dropped == [[0]] and held.bytes == 200 and log == ["waited"] and held.waited == 1
    events[1].passed = True  # passed by itself: let go without a wait when the next one comes
    held.add([3], 40, torch.device("cuda", 0))
    assert dropped == [[0], [1]] and held.bytes == 140 and held.waited == 1
    held.add([4], 1000, torch.device("cuda", 0))  # alone over the budget: everything before it, and it, waited for
    assert dropped == [[0], [1], [2], [3], [4]] and held.bytes == 0 and held.waited == 4 and len(held) == 0


def test_a_budget_must_hold_something() -> None:
    with pytest.raises(ValueError, match="max_bytes must be >= 1, but got 0"):
        UntilRead(0)
