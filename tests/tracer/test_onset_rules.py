"""The onset rules and the parity decision, on hand-built comparisons (no model, no oracle).

Each rule of ``Comparison.onsets`` (verdict, unjudged, unobserved, the same-step rule for records that
record no inputs), their order and their ties; and every reason ``Comparison.parity`` fails for, with
the words its message uses.
"""

from __future__ import annotations

import pytest
from ulptrace.comparison import Comparison, SiteDiff

EXACT = {"exact": 8, "tie": 0, "boundary": 0, "error": 0, "nonfinite": 0}


def site(name: str, *, step: int = 0, equal: bool = True, max_ulp: int | None = None, verdicts: dict | None = None,
         inputs: dict | None = None, kind: str = "norm", could_not_judge: str | None = None, **extra) -> SiteDiff:
    """A SiteDiff as ``diff_records`` makes it: bitwise equal or differing by ``max_ulp`` (default 1)."""
    max_ulp = (0 if equal else 1) if max_ulp is None else max_ulp
    return SiteDiff(site=name, step=step, kind=kind, layer=0, elements=8, differing=0 if equal else 2,
                    max_ulp=max_ulp, histogram={}, bitwise_equal=equal, dtype="bfloat16", shape=[2, 4],
                    input_delta=dict(inputs or {}), verdicts=verdicts, could_not_judge=could_not_judge, **extra)


def judged(**counts) -> dict:
    return {**EXACT, **counts}


def reasons(comparison: Comparison) -> list[tuple[str, int, str]]:
    return [(d.site, d.step, r) for d, r in comparison.onsets()]


# -- each rule ---------------------------------------------------------------------------------------

def test_no_difference_no_onset() -> None:
    c = Comparison(sites=[site("a", inputs={"x": 0}, verdicts=judged()), site("b", inputs={"x": 0})])
    assert c.onset_with_reason() == (None, None) and reasons(c) == []


@pytest.mark.parametrize("verdict", ["boundary", "error", "nonfinite"])
def test_a_verdict_worse_than_tie_is_an_onset(verdict) -> None:
    c = Comparison(sites=[site("a", inputs={"x": 0}, verdicts=judged()),
                          site("b", equal=False, inputs={"x": 0}, verdicts=judged(exact=6, **{verdict: 2}))])
    assert reasons(c) == [("b", 0, "verdict")]


def test_ties_are_no_onset() -> None:
    c = Comparison(sites=[site("a", equal=False, inputs={"x": 0}, verdicts=judged(exact=6, tie=2)),
                          site("b", equal=False, inputs={"x": 1}, verdicts=judged(exact=6, tie=2))])
    assert reasons(c) == []


def test_unjudged_differs_above_the_budget_on_equal_inputs() -> None:
    records = [site("a", inputs={"x": 0}, verdicts=judged()),
               site("scan", kind="attention", equal=False, max_ulp=3, inputs={"q": 0, "k": 0})]
    assert reasons(Comparison(sites=records)) == [("scan", 0, "unjudged")]
    assert reasons(Comparison(sites=records, max_ulp=3)) == []  # within the budget
    assert reasons(Comparison(sites=records, max_ulp=2)) == [("scan", 0, "unjudged")]


def test_unjudged_needs_every_input_compared_equal() -> None:
    # None: an input that could not be compared (missing on one side, another shape) is not "equal"
    c = Comparison(sites=[site("scan", kind="attention", equal=False, inputs={"q": 0, "g": None})])
    assert reasons(c) == []


def test_a_site_the_oracle_could_not_judge_is_held_to_the_budget_like_one_without_semantics() -> None:
    c = Comparison(sites=[site("glu", kind="glu", equal=False, max_ulp=2, inputs={"gate": 0, "up": 0},
                               could_not_judge="NotImplementedError: no rule for aten.foo")])
    assert reasons(c) == [("glu", 0, "unjudged")]


def test_unobserved_is_the_first_differing_record_whose_inputs_already_differ() -> None:
    c = Comparison(sites=[site("a", inputs={"x": 0}, verdicts=judged()),
                          site("core", kind="attention", equal=False, inputs={"query": 0, "key": 5},
                               verdicts=judged(exact=6, tie=2)),
                          site("o_proj", kind="linear", equal=False, inputs={"x": 9}, verdicts=judged(exact=6, tie=2))])
    assert reasons(c) == [("core", 0, "unobserved")]


def test_unobserved_checks_that_the_record_itself_differs() -> None:
    """The docstring's rule: the *first differing* record. A record whose inputs differ (a masked key) while its
    output is bitwise equal is not where a divergence shows; the old code returned it as the onset."""
    c = Comparison(sites=[site("core", kind="attention", equal=True, inputs={"query": 0, "key": 7},
                               verdicts=judged()),
                          site("o_proj", kind="linear", equal=True, inputs={"x": 0}, verdicts=judged())])
    assert reasons(c) == [] and c.onset() is None


def test_unobserved_only_before_any_difference() -> None:
    c = Comparison(sites=[site("a", equal=False, inputs={"x": 0}, verdicts=judged(exact=6, tie=2)),
                          site("b", equal=False, inputs={"x": 3}, verdicts=judged(exact=6, tie=2))])
    assert reasons(c) == []


def test_an_input_that_could_not_be_compared_is_no_evidence_of_unobserved_code() -> None:
    # a static cache passes an explicit mask where a dynamic one lets the kernel mask: the mask's delta is None
    c = Comparison(sites=[site("core", kind="attention", equal=False, inputs={"query": 0, "attention_mask": None},
                               verdicts=judged(exact=6, tie=2))])
    assert reasons(c) == []


def test_a_mask_that_differs_is_the_reason_even_where_unobserved_applies_too() -> None:
    """A mask is built from positions, not values: where it differs on the first differing record, that is the
    reason, not code no site observes (a kernel handed no mask over a static cache's padding)."""
    c = Comparison(sites=[site("a", inputs={"x": 0}, verdicts=judged()),
                          site("core", kind="attention", equal=False, inputs={"query": 0, "key": 3, "attention_mask": 1}),
                          site("o_proj", kind="linear", equal=False, inputs={"x": 9}, verdicts=judged(exact=6, tie=2))])
    assert reasons(c) == [("core", 0, "mask")]


# -- records without inputs (GatedDeltaNet states, the embedding) ---------------------------------

def test_a_state_that_differs_after_an_equal_step_is_an_onset() -> None:
    c = Comparison(sites=[site("layers.0.input_layernorm", inputs={"x": 0}, verdicts=judged()),
                          site("layers.0.linear_attn.core", kind="attention", inputs={"q": 0}),
                          site("layers.0.linear_attn.recurrent_state", kind="state", equal=False, max_ulp=1)])
    assert reasons(c) == [("layers.0.linear_attn.recurrent_state", 0, "unjudged")]


def test_a_state_is_no_onset_when_a_record_before_it_in_the_step_differs() -> None:
    c = Comparison(sites=[site("core", kind="attention", equal=False, inputs={"q": 0}, max_ulp=1),
                          site("state", kind="state", equal=False)], max_ulp=1)
    assert reasons(c) == []


def test_a_state_is_no_onset_when_an_earlier_record_of_the_step_has_differing_inputs() -> None:
    # the core's output is equal but its incoming state differs: the state carries the earlier step's difference
    c = Comparison(sites=[site("core", step=1, kind="attention", equal=True, inputs={"q": 0, "state": 4}),
                          site("state", step=1, kind="state", equal=False)])
    assert reasons(c) == []


def test_the_state_rule_looks_at_its_own_step_only() -> None:
    c = Comparison(sites=[site("a", step=0, equal=False, inputs={"x": 0}, verdicts=judged(exact=6, tie=2)),
                          site("a", step=1, inputs={"x": 0}, verdicts=judged()),
                          site("state", step=1, kind="state", equal=False)])
    assert reasons(c) == [("state", 1, "unjudged")]


def test_a_state_within_the_budget_is_no_onset() -> None:
    c = Comparison(sites=[site("state", kind="state", equal=False, max_ulp=2)], max_ulp=2)
    assert reasons(c) == []


# -- order and ties ---------------------------------------------------------------------------------

def test_the_onset_is_the_first_in_execution_order_whatever_its_reason() -> None:
    c = Comparison(sites=[site("scan", kind="attention", equal=False, inputs={"q": 0}),
                          site("glu", kind="glu", equal=False, inputs={"x": 2}, verdicts=judged(exact=6, error=2))])
    assert c.onset_with_reason()[1] == "unjudged" and c.onset().site == "scan"
    assert reasons(c) == [("scan", 0, "unjudged"), ("glu", 0, "verdict")]


def test_unobserved_wins_over_a_verdict_on_the_same_record() -> None:
    """Inputs that already differ at the first differing record say the divergence began before it, in code no site
    observes — whatever the record's own verdict (an infinity written into a cached key makes the attention's
    semantics on its inputs non-finite: a nonfinite verdict there is a consequence, not the beginning). The verdict
    still fails parity on its own."""
    c = Comparison(sites=[site("core", kind="attention", equal=False, inputs={"query": 3},
                               verdicts=judged(exact=6, nonfinite=2))])
    assert reasons(c) == [("core", 0, "unobserved")]
    assert {f.kind for f in c.parity().failures} == {"nonfinite", "unobserved"}
    # once a record before it differs, a record's verdict is its own again
    c = Comparison(sites=[site("a", equal=False, inputs={"x": 0}, verdicts=judged(exact=6, tie=2)),
                          site("core", kind="attention", equal=False, inputs={"query": 3},
                               verdicts=judged(exact=6, nonfinite=2))])
    assert reasons(c) == [("core", 0, "verdict")]


def test_unjudged_and_unobserved_cannot_both_hold() -> None:
    # unjudged needs equal inputs, unobserved differing ones; a record without inputs is only ever unjudged
    c = Comparison(sites=[site("embed", kind="other", equal=False)])
    assert reasons(c) == [("embed", 0, "unjudged")]


def test_steps_are_in_the_order_recorded() -> None:
    c = Comparison(sites=[site("a", step=0, inputs={"x": 0}, verdicts=judged()),
                          site("a", step=1, equal=False, inputs={"x": 0}, verdicts=judged(exact=6, error=2)),
                          site("b", step=1, equal=False, inputs={"x": 0}, verdicts=judged(exact=6, boundary=2))])
    assert c.onset().step == 1 and c.onset().site == "a"


# -- the parity decision ------------------------------------------------------------------------------

def kinds(parity) -> list[str]:
    return [f.kind for f in parity.failures]


def test_parity_holds_for_ties_only() -> None:
    c = Comparison(sites=[site("a", equal=False, inputs={"x": 0}, verdicts=judged(exact=6, tie=2))])
    parity = c.parity()
    assert parity.ok and bool(parity) and parity.failures == () and parity.summary() == "at parity"


def test_parity_names_a_boundary_a_boundary() -> None:
    c = Comparison(sites=[site("glu", equal=False, inputs={"x": 0}, verdicts=judged(exact=6, boundary=2),
                               boundary="the BF16 rounding of `silu(gate)` (op 0) is missing", explained=1.0)])
    parity = c.parity()
    assert not parity and kinds(parity) == ["boundary"]
    message = parity.failures[0].message
    assert message == ("2 boundary element(s) in 1 record(s); first at step 0, glu (norm): the BF16 rounding of "
                       "`silu(gate)` (op 0) is missing, explains 100% of its out-of-set elements")
    assert "error" not in parity.summary()
    assert c.parity(allow=("boundary",)).ok


def test_parity_fails_on_each_kind_of_failure() -> None:
    c = Comparison(
        sites=[site("a", equal=False, inputs={"x": 0}, verdicts=judged(exact=5, error=3), max_error_ulp=4),
               site("b", equal=False, inputs={"x": 0}, verdicts=judged(exact=7, nonfinite=1)),
               site("c", inputs={"x": 0}, could_not_judge="ValueError: no rule"),
               site("scan", kind="attention", equal=False, inputs={"q": 0})],
        missing=[{"site": "m", "step": 0}], extra=[{"site": "e", "step": 1}],
        mismatched=[{"site": "s", "step": 0, "reason": "reference has bfloat16 [2, 4], candidate has bfloat16 [2, 5]"}])
    parity = c.parity()
    assert kinds(parity) == ["error", "nonfinite", "could_not_judge", "missing", "extra", "mismatched", "unjudged"]
    by_kind = {f.kind: f for f in parity.failures}
    assert by_kind["error"].message.endswith("up to 4 ULP outside the admissible set")
    assert by_kind["could_not_judge"].message == ("the oracle could not judge 1 record(s); first at step 0, c (norm): "
                                                  "ValueError: no rule")
    assert by_kind["mismatched"].first == {"step": 0, "site": "s"}
    assert "candidate has bfloat16 [2, 5]" in by_kind["mismatched"].message
    assert by_kind["unjudged"].first["site"] == "scan"
    assert parity.to_json()["ok"] is False and len(parity.to_json()["failures"]) == 7


def test_a_scan_that_differs_on_equal_inputs_fails_parity_without_any_verdict() -> None:
    """The fixture's old rule looked at verdicts only: this passed it while `ulptrace onset` flagged it."""
    c = Comparison(sites=[site("core", kind="attention", equal=False, max_ulp=40, inputs={"q": 0, "k": 0})])
    assert kinds(c.parity()) == ["unjudged"]


def test_parity_fails_on_an_unobserved_onset() -> None:
    c = Comparison(sites=[site("core", kind="attention", equal=False, inputs={"key": 2}, verdicts=judged(tie=8))])
    parity = c.parity()
    assert kinds(parity) == ["unobserved"] and "unobserved code" in parity.failures[0].message


def test_could_not_judge_fails_unless_allowed() -> None:
    c = Comparison(sites=[site("glu", kind="glu", equal=False, max_ulp=1, inputs={"gate": 0},
                               could_not_judge="NotImplementedError: no rule for aten.foo")], max_ulp=1)
    assert kinds(c.parity()) == ["could_not_judge"]
    assert c.parity(allow=["could_not_judge"]).ok
    # allowed, it is held to the budget like a site without semantics
    assert kinds(Comparison(sites=c.sites, max_ulp=0).parity(allow=["could_not_judge"])) == ["unjudged"]


def test_parity_rejects_an_unknown_allowance() -> None:
    with pytest.raises(ValueError, match="allow must name some of boundary, error, nonfinite, could_not_judge, "
                                         "but got 'tie'"):
        Comparison().parity(allow=("tie",))


def test_the_json_carries_parity_and_the_sites_that_could_not_be_judged() -> None:
    c = Comparison(sites=[site("glu", kind="glu", could_not_judge="TypeError: bad")])
    data = c.to_json()
    assert data["could_not_judge"] == [{"step": 0, "site": "glu", "kind": "glu", "layer": 0, "reason": "TypeError: bad"}]
    assert data["parity"]["ok"] is False and data["parity"]["failures"][0]["kind"] == "could_not_judge"
    assert data["sites"][0]["could_not_judge"] == "TypeError: bad"
    assert c.to_json(allow=("could_not_judge",))["parity"] == {"ok": True, "allowed": ["could_not_judge"],
                                                              "failures": []}


# -- selections -----------------------------------------------------------------------------------

PARTIAL = {"selection": {"sites": None, "kinds": ["norm"], "layers": None, "steps": None}}


def test_a_selection_makes_the_comparison_incomplete() -> None:
    assert Comparison().complete
    assert Comparison(reference={"selection": {"sites": None, "kinds": None, "layers": None, "steps": None}}).complete
    assert not Comparison(reference=PARTIAL).complete
    assert not Comparison(candidate={"selection": {"steps": "2:3"}}).complete
    assert Comparison(reference=PARTIAL).to_json()["complete"] is False


def test_in_a_selection_a_difference_that_began_unrecorded_is_never_parity() -> None:
    """Unselected sites may differ: a first difference whose inputs already differ began in code the selection left
    out — which may hold a defect no recorded site can judge (a final norm applied twice, read only at the logits,
    was 'at parity' with every difference a tie): an ``unrecorded`` onset that fails parity, not silence. A state
    without inputs proves nothing either way there (earlier unrecorded records may differ): no onset."""
    records = [site("norm", inputs={"x": 0}, verdicts=judged()),
               site("post_norm", equal=False, inputs={"delta": 3}, verdicts=judged(exact=6, tie=2)),
               site("state", step=1, kind="state", equal=False)]
    assert reasons(Comparison(sites=records)) == [("post_norm", 0, "unobserved"), ("state", 1, "unjudged")]
    partial = Comparison(sites=records, reference=PARTIAL)
    assert reasons(partial) == [("post_norm", 0, "unrecorded")]
    parity = partial.parity()
    assert not parity.ok and kinds(parity) == ["unrecorded"]
    assert "code this selection did not record" in parity.failures[0].message
    # nothing recorded differs: the selection says what it checked, and that is at parity
    assert Comparison(sites=[site("norm", inputs={"x": 0}, verdicts=judged())], reference=PARTIAL).parity().ok
    # the local rules still hold: a verdict, and a difference on the record's own equal inputs
    local = [site("glu", equal=False, inputs={"x": 0}, verdicts=judged(exact=6, error=2)),
             site("scan", kind="attention", equal=False, inputs={"q": 0})]
    assert reasons(Comparison(sites=local, reference=PARTIAL)) == [("glu", 0, "verdict"), ("scan", 0, "unjudged")]


def test_errors_come_before_a_boundary_that_explains_few_and_shares_are_never_rounded_to_all_or_none() -> None:
    """A record whose out-of-set elements are mostly errors, a few of them inside a hypothesis's set, reads as the
    errors it has first; the boundary's share is never printed as 0% or 100% unless it is exactly that."""
    from ulptrace.oracle.judge import explained_share

    c = Comparison(sites=[site("norm", equal=False, inputs={"x": 0}, verdicts=judged(exact=10, boundary=1, error=399),
                               boundary="`rsqrt(%3)` (op 4) rounded to BF16", explained=1 / 400, max_error_ulp=88)])
    parity = c.parity()
    assert kinds(parity) == ["error", "boundary"]
    assert parity.failures[1].message.endswith("rounded to BF16, explains <1% of its out-of-set elements")
    assert [explained_share(x) for x in (0.0, 0.001, 0.02, 0.994, 0.996, 1.0)] == \
        ["0%", "<1%", "2%", "99%", ">99%", "100%"]
    assert [explained_share(x, 1) for x in (0.0004, 0.9996, 0.5)] == ["<0.1%", ">99.9%", "50.0%"]
