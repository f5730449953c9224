"""ulptrace's own kernel paths judged by the oracle on tiny-qwen3.5 (CPU: the plain-torch references).

faithful keeps HF's rounding points: no boundary or error anywhere. fused (FP32 inside, one final
rounding) has exactly the boundary mismatches such kernels really have, each named.
"""

from __future__ import annotations

import collections

import pytest
from ulptrace.probes.onset import run_onset
from ulptrace.run import RunConfig


def _by_site(comparison):
    verdicts = collections.defaultdict(collections.Counter)
    names = collections.defaultdict(set)
    for d in comparison.sites:
        key = d.site.split(".", 2)[-1] if d.site.startswith("layers.") else d.site
        verdicts[key].update(d.verdicts or {})
        if d.boundary and (d.verdicts or {}).get("boundary"):
            names[key].add(d.boundary)
    return verdicts, names


@pytest.fixture(scope="module")
def fused():
    return run_onset(RunConfig(candidate="kernels:fused", prompts=2, prompt_len=8, new_tokens=3))


def test_faithful_kernels_have_no_boundary_or_error() -> None:
    comparison, _ = run_onset(RunConfig(candidate="kernels:faithful", prompts=2, prompt_len=8, new_tokens=3))
    assert comparison.candidate["path_info"]["implementation"]["add_rms_norm"] in ("reference", "cuda")
    verdicts, _ = _by_site(comparison)
    for site, counts in verdicts.items():
        assert counts["boundary"] == counts["error"] == counts["nonfinite"] == 0, site
    assert comparison.onset() is None


def test_fused_kernels_show_their_real_boundaries_named(fused) -> None:
    comparison, _ = fused
    verdicts, names = _by_site(comparison)
    assert all(c["error"] == 0 and c["nonfinite"] == 0 for c in verdicts.values())
    expected = {
        "linear_attn.gates.g": "rounded to BF16",  # g emitted as BF16 where HF keeps FP32
        "mlp.glu": "silu",  # the SiLU output's BF16 rounding is skipped
        "post_attention_layernorm": "add(residual, delta)",  # the residual sum normalised in FP32
        "linear_attn.norm": "fused into one final rounding",  # gated norm rounded once
    }
    for site, words in expected.items():
        assert verdicts[site]["boundary"] > 0, site
        assert any(words in n for n in names[site]), (site, names[site])
    boundary_sites = {s for s, c in verdicts.items() if c["boundary"]}
    assert boundary_sites == set(expected)
    onset = comparison.onset()
    assert (onset.step, onset.site) == (0, "layers.0.linear_attn.gates.g")
