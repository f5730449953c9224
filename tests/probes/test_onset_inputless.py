"""A record without recorded inputs is an onset where it first differs (the embedding here; the GatedDeltaNet
states before they recorded their inputs): the divergence is located where it begins, not one site later."""

from __future__ import annotations

from ulptrace.probes.onset import run_onset
from ulptrace.run import RunConfig


def test_a_difference_that_begins_at_a_record_without_inputs_is_located_there() -> None:
    comparison, _ = run_onset(RunConfig(candidate="fault:embed@0+1", prompts=2, prompt_len=8, new_tokens=2))
    embed = next(d for d in comparison.sites if d.site == "embed" and d.step == 0)
    assert embed.input_delta == {} and not embed.bitwise_equal and embed.max_ulp == 1
    onset, reason = comparison.onset_with_reason()
    assert (onset.site, onset.step, reason) == ("embed", 0, "unjudged")
    assert [f.kind for f in comparison.parity().failures] == ["unjudged"]
    # a budget that covers it: no onset there, and the rest is honest rounding of a moved input
    tolerant, _ = run_onset(RunConfig(candidate="fault:embed@0+1", prompts=2, prompt_len=8, new_tokens=2, max_ulp=1))
    assert tolerant.onset() is None and tolerant.parity().ok


def test_an_onset_holds_the_recording_collector_between_its_two_recorders(monkeypatch) -> None:
    """The reference's and the candidate's recorders are built with the old objects frozen out of the collector's
    view (a full collection landing between them scanned the whole heap), and everything is unfrozen after."""
    import gc

    from ulptrace.probes import onset

    seen = []
    real = onset.selected_sites

    def selected(model, cfg):
        seen.append(gc.get_freeze_count())
        return real(model, cfg)

    monkeypatch.setattr(onset, "selected_sites", selected)
    assert gc.get_freeze_count() == 0
    run_onset(RunConfig(candidate="kernels:fused", prompts=1, prompt_len=4, new_tokens=1))
    assert len(seen) == 2 and all(n > 1000 for n in seen), seen
    assert gc.get_freeze_count() == 0
