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
    # run on the CPU (RunConfig's default device): every op is the plain-torch reference, none is skipped
    assert comparison.candidate["path_info"]["implementation"] == dict.fromkeys(
        ("add_rms_norm", "glu", "gated_rms_norm", "gdn_gates", "decode_attention"), "reference")
    verdicts, _ = _by_site(comparison)
    for site, counts in verdicts.items():
        assert counts["boundary"] == counts["error"] == counts["nonfinite"] == 0, site
    assert comparison.onset() is None


def test_fused_kernels_show_their_real_boundaries_named(fused) -> None:
    comparison, _ = fused
    verdicts, names = _by_site(comparison)
    assert all(c["error"] == 0 and c["nonfinite"] == 0 for c in verdicts.values())
    expected = {
        # g emitted as BF16 where HF keeps the FP32 product -exp(A_log) * softplus(a + dt_bias) (op 6)
        "linear_attn.gates.g": "`mul(neg(exp(f32(linear_attn.A_log))), softplus(add(f32(a), "
                               "linear_attn.dt_bias)))` (op 6) rounded to BF16",
        "mlp.glu": "the BF16 rounding of `silu(gate)` (op 0) is missing",  # silu(gate) * up rounded once
        # the residual sum normalised in FP32
        "post_attention_layernorm": "the BF16 rounding of `add(residual, delta)` (op 0) is missing",
        "linear_attn.norm": "all intermediates fused into one final rounding",  # gated norm rounded once
    }
    for site, name in expected.items():
        assert verdicts[site]["boundary"] > 0, site
        assert names[site] == {name}, (site, names[site])
    boundary_sites = {s for s, c in verdicts.items() if c["boundary"]}
    assert boundary_sites == set(expected)
    onset = comparison.onset()
    assert (onset.step, onset.site) == (0, "layers.0.linear_attn.gates.g")
