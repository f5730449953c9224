"""In the normal runs, every site that has oracle semantics was judged: none reads "could not judge".

A failing oracle used to turn a site into ``verdicts: null``, indistinguishable from a site without
semantics, and the kernel-path tests summed ``d.verdicts or {}`` and passed.
"""

from __future__ import annotations

import pytest
import ulptrace
from ulptrace.probes.onset import run_onset
from ulptrace.run import RunConfig
from ulptrace.sites import site_table

RUNS = [("hf", "kernels:faithful"), ("hf", "kernels:fused"), ("hf:attn=eager", "hf:attn=sdpa")]


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
@pytest.mark.parametrize("reference, candidate", RUNS)
def test_every_site_with_semantics_is_judged(model, reference, candidate) -> None:
    judged_sites = {s.name for s in site_table(ulptrace.build_model(model), warn=False) if s.formula is not None}
    comparison, _ = run_onset(RunConfig(model=model, reference=reference, candidate=candidate, prompts=2,
                                        prompt_len=8, new_tokens=2))
    with_semantics = [d for d in comparison.sites if d.site in judged_sites]
    assert {d.site for d in with_semantics} == judged_sites  # each was recorded
    unjudged = [(d.step, d.site, d.could_not_judge or d.note) for d in with_semantics
                if d.verdicts is None or d.could_not_judge]
    assert unjudged == []
    assert all(sum(d.verdicts.values()) == d.elements for d in with_semantics)
    assert comparison.missing == comparison.extra == comparison.mismatched == []
    assert [f.kind for f in comparison.parity(("boundary",)).failures] == []
