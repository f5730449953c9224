"""Run layer for the generation diagnostics: restore across cache layouts, one step traced from a restored
state, a row spliced into a batch state, records restricted to one batch row."""

from __future__ import annotations

import pytest
import torch
from ulptrace.comparison import bitwise_equal, compare
from ulptrace.models import build_model
from ulptrace.record import MemorySink, Recorder
from ulptrace.run import (
    RowSink,
    Session,
    batch_row,
    greedy,
    make_prompts,
    record_row,
    splice_row,
    step_from,
)
from ulptrace.trace import Record


@pytest.fixture(scope="module")
def qwen():
    model = build_model("tiny-qwen3.5")
    return model, make_prompts(model.config.vocab_size, 3, 8, seed=5)


def _run_to_step_1(model, prompts, mode):
    session = Session(model, mode, max_len=12)
    first = session.prefill(prompts).argmax(-1, keepdim=True)
    session.step(first)
    return session


@pytest.mark.parametrize("source, target", [("eager", "static"), ("static", "eager")])
def test_restore_moves_a_state_between_cache_layouts(qwen, source, target) -> None:
    """A state restored into a session of the other mode continues exactly as that mode's own run does."""
    model, prompts = qwen
    state = _run_to_step_1(model, prompts, source).snapshot()
    own = _run_to_step_1(model, prompts, target)
    restored = Session(model, target, max_len=12)
    restored.prefill(prompts)
    restored.restore(state)
    tokens = torch.tensor([[3], [4], [5]])
    assert bitwise_equal(restored.step(tokens), own.step(tokens))
    layouts = {name: tuple(t.shape) for name, t in restored.snapshot().tensors().items()}
    assert layouts == {name: tuple(t.shape) for name, t in own.snapshot().tensors().items()}


def test_step_from_records_the_step_it_reruns(qwen) -> None:
    model, prompts = qwen
    session = _run_to_step_1(model, prompts, "eager")
    state = session.snapshot()
    tokens = torch.tensor([[7], [8], [9]])
    expected = session.step(tokens)
    recorder = Recorder(model)
    logits = step_from(model, "static", prompts, state, tokens, cache_len=12, recorders=[recorder])
    assert {r.step for r in recorder.trace} == {2}  # the prefill is 0, the step after the state's first decode 2
    assert (logits.float() - expected.float()).abs().max() < 0.5  # the same step, in the static cache's numerics
    again = Recorder(model)
    assert bitwise_equal(step_from(model, "eager", prompts, state, tokens, recorders=[again]), expected)
    with pytest.raises(ValueError, match="precedes no decode step"):
        step_from(model, "eager", torch.cat([prompts, prompts], 1), state, tokens)  # a 16-token prompt


def test_splice_row_puts_one_row_of_another_state_into_a_batch(qwen) -> None:
    model, prompts = qwen
    batch = _run_to_step_1(model, prompts, "eager").snapshot()
    alone = _run_to_step_1(model, prompts[2:3], "eager").snapshot()
    spliced = splice_row(batch, 0, alone, 0)
    for name, tensor in spliced.tensors().items():
        if tensor.dim() == 0:  # a count for the whole batch (transformers 5.25 keeps one per linear-attention layer)
            assert torch.equal(tensor, alone.tensors()[name]) and torch.equal(tensor, batch.tensors()[name]), name
        else:
            assert torch.equal(tensor[0], alone.tensors()[name][0]), name
            assert torch.equal(tensor[1:], batch.tensors()[name][1:]), name
        assert tensor.data_ptr() != batch.tensors()[name].data_ptr()  # a copy: the batch state is unchanged
    later = _run_to_step_1(model, prompts, "eager")
    later.step(torch.tensor([[1], [1], [1]]))
    with pytest.raises(ValueError, match="position"):
        splice_row(later.snapshot(), 0, alone, 0)


def test_batch_row_slices_batch_first_and_batch_major_tensors() -> None:
    x = torch.arange(24).reshape(3, 8)
    assert torch.equal(batch_row(x, 1, 3), x[1:2])
    shared = torch.ones(1, 4)
    assert batch_row(shared, 2, 3) is shared  # broadcast over the batch: every row's
    flat = torch.arange(3 * 4 * 2).reshape(3 * 4, 2)  # [batch * k, d], batch-major
    assert torch.equal(batch_row(flat, 2, 3), flat[8:12])
    assert batch_row(x, 0, 1) is x
    with pytest.raises(ValueError, match="leading dimension"):
        batch_row(torch.zeros(5, 2), 0, 3)
    with pytest.raises(ValueError, match="outside a batch"):
        batch_row(x, 3, 3)
    record = Record("s", 0, "glu", 0, x, {"x": flat, "cos": shared})
    row = record_row(record, 1, 3)
    assert row.out.shape == (1, 8) and row.inputs["x"].shape == (4, 2) and row.inputs["cos"] is shared


def test_row_sink_gives_each_row_the_records_of_its_prompt_alone(qwen) -> None:
    """A batched run's records restricted to a row have the shapes (and here, on CPU, the bits) of that prompt's
    run alone — the GatedDeltaNet norm's flattened [batch * tokens * heads, dim] included."""
    model, prompts = qwen
    sinks = {0: MemorySink(), 2: MemorySink()}
    with Recorder(model, sink=RowSink(3, sinks)):
        greedy(model, prompts, 2)
    with Recorder(model) as alone:
        greedy(model, prompts[2:3], 2)
    assert sinks[2].trace.metadata["row"] == 2 and sinks[2].trace.metadata["batch"] == 3
    comparison = compare(alone.trace, sinks[2].trace)
    assert not comparison.missing and not comparison.extra and not comparison.mismatched
    assert all(d.bitwise_equal for d in comparison.sites)
    with pytest.raises(ValueError, match="outside a batch"):
        RowSink(3, {3: MemorySink()})


def test_splice_row_keeps_a_batch_wide_count_and_refuses_two_that_differ() -> None:
    """A 0-dim state tensor is one count for the whole batch (transformers 5.25's ``cumulative_length_linear``): kept
    when both states agree, refused with both values when they do not (the row would not be on the same path)."""
    from ulptrace.run import DecodeState

    def state(count: int, fill: float) -> DecodeState:
        return DecodeState([{}, {"count": torch.tensor(count), "conv": torch.full((2, 3), fill)}], 5, None)

    spliced = splice_row(state(5, 0.0), 1, state(5, 1.0), 0)
    assert spliced.tensors()["layers.0.count"].item() == 5
    assert spliced.tensors()["layers.0.conv"].tolist() == [[0.0] * 3, [1.0] * 3]
    with pytest.raises(ValueError, match=r"layers.0.count.*4 in the source and 5 in the state"):
        splice_row(state(5, 0.0), 1, state(4, 1.0), 0)
