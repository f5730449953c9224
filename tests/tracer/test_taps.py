"""Function taps: the order in which transforms, pre-observers, the implementation, result transforms and observers
see a call, and that the last handle removed puts the original back."""

from __future__ import annotations

import torch
from ulptrace.taps import tap


def test_a_pre_observer_sees_the_final_arguments_before_the_call_writes_them() -> None:
    events = []

    def original(x):
        events.append(("call", x.tolist()))
        x.add_(10)  # writes its argument in place
        return x * 2

    registry = {"f": original}
    t = tap(registry, "f")
    handles = [
        t.add_transform(lambda args, kwargs: ((args[0] + 1,), kwargs)),
        t.add_pre_observer(lambda args, kwargs: events.append(("before", args[0].tolist()))),
        t.add_result_transform(lambda args, kwargs, result: result + 100),
        t.add_observer(lambda args, kwargs, result: events.append(("after", args[0].tolist(), result.tolist()))),
    ]
    assert registry["f"] is not original
    out = registry["f"](torch.tensor([1.0]))
    assert events == [("before", [2.0]), ("call", [2.0]), ("after", [12.0], [124.0])]
    assert out.tolist() == [124.0]
    for handle in handles:
        handle.remove()
    assert registry["f"] is original
