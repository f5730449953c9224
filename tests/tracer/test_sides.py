"""``ulptrace.sides``: two paths applied in one process, each side's model run with the names its own path set —
checked on the modeling module's ``apply_rotary_pos_emb``, a name every model of that module looks up as it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ulptrace
from ulptrace.paths import register_path
from ulptrace.sides import SideNames, apply_paths
from ulptrace.taps import tap, tap_of


@pytest.fixture
def modeling():
    model = ulptrace.build_model("tiny-llama")
    namespace = sys.modules[type(model.model.layers[0].self_attn).__module__]
    hf = namespace.apply_rotary_pos_emb
    yield model, namespace, hf
    namespace.apply_rotary_pos_emb = hf


def _assigning(namespace, value):
    def path(model):
        original = namespace.apply_rotary_pos_emb
        namespace.apply_rotary_pos_emb = value

        def undo():
            namespace.apply_rotary_pos_emb = original

        return undo

    return path


def test_entered_puts_back_a_name_assigned_since_and_then_the_assignment(modeling) -> None:
    model, namespace, hf = modeling
    names = SideNames(model)
    mine = lambda *a, **k: None  # noqa: E731
    namespace.apply_rotary_pos_emb = mine
    assert names.changes() == [f"{namespace.__name__}.apply_rotary_pos_emb"]
    with names.entered():
        assert namespace.apply_rotary_pos_emb is hf
    assert namespace.apply_rotary_pos_emb is mine
    with pytest.raises(RuntimeError), names.entered():
        raise RuntimeError("inside")
    assert namespace.apply_rotary_pos_emb is mine  # put back after an error too


def test_a_tap_stays_in_place_and_calls_the_side_s_function(modeling) -> None:
    """ulptrace's own tap on the name (a recorder's observers) is shared by both sides: entering a side leaves the
    tap's wrapper where it is and has it call that side's function; a tap over the same function is no change."""
    model, namespace, hf = modeling
    names = SideNames(model)
    mine = lambda *a, **k: "mine"  # noqa: E731
    namespace.apply_rotary_pos_emb = mine
    handle = tap(namespace, "apply_rotary_pos_emb").add_observer(lambda *a: None)
    try:
        wrapper = namespace.apply_rotary_pos_emb
        assert tap_of(wrapper).original is mine and tap_of(mine) is None
        with names.entered():
            assert namespace.apply_rotary_pos_emb is wrapper and tap_of(wrapper).original is hf
        assert namespace.apply_rotary_pos_emb is wrapper and tap_of(wrapper).original is mine
        assert SideNames(model).changes() == []  # taken with the tap in place: the same function
    finally:
        handle.remove()
    assert namespace.apply_rotary_pos_emb is mine


def test_each_side_runs_with_its_own_path_s_names_and_both_are_undone(modeling) -> None:
    """The reference's path and the candidate's each assign the name: inside, each side's names hold its own
    function (the candidate's path applied over the names before either, not over the reference's); the state
    between runs is the candidate's; afterwards HF's function again."""
    model, namespace, hf = modeling
    ref_fn, cand_fn = (lambda *a, **k: "ref"), (lambda *a, **k: "cand")  # noqa: E731
    register_path("test-sides:ref", _assigning(namespace, ref_fn), "assigns the modeling module's rotary function")
    seen = []

    def seen_by(path):  # what the candidate's path found when it was applied
        def apply(model):
            seen.append(namespace.apply_rotary_pos_emb)
            return _assigning(namespace, cand_fn)(model)
        return apply

    register_path("test-sides:cand-seeing", seen_by("cand"), "records what it found")
    twin = ulptrace.build_model("tiny-llama")
    with apply_paths(model, "test-sides:ref", twin, "test-sides:cand-seeing") as (_, _, ref_names, cand_names):
        assert seen == [hf]  # not the reference's function
        with ref_names.entered():
            assert namespace.apply_rotary_pos_emb is ref_fn
        with cand_names.entered():
            assert namespace.apply_rotary_pos_emb is cand_fn
        assert namespace.apply_rotary_pos_emb is cand_fn
    assert namespace.apply_rotary_pos_emb is hf


@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "reference beside"])
def test_an_onset_s_candidate_does_not_run_the_reference_path_s_assignment(modeling, concurrent) -> None:
    """A reference path that installs its kernel by name (here a rotation the wrong way at decode) must not reach
    the candidate, HF as is: the onset finds the two differ at ``self_attn.q_rope`` from decode step 1 — before, the
    candidate ran the reference's function and the pair read as at parity."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "probes"))
    try:
        from ulptrace.probes.onset import run_onset
        from ulptrace.run import RunConfig

        cfg = RunConfig(model="tiny-llama", reference="generation_candidates:rope_reversed_at_decode_by_name",
                        candidate="hf", prompts=1, prompt_len=8, new_tokens=3, concurrent=concurrent)
        comparison, _ = run_onset(cfg)
    finally:
        sys.path.remove(str(Path(__file__).parents[1] / "probes"))
    onset = comparison.onset()
    assert (onset.site, onset.step) == ("layers.0.self_attn.q_rope", 1) and onset.verdicts["error"] > 0
    assert not comparison.parity()
    assert modeling[1].apply_rotary_pos_emb is modeling[2]
