"""The oracle judges a record on its differing rows (row-wise kinds) or batch items (batch-wise kinds) only: the
same figures as judging it whole."""

from __future__ import annotations

import pytest
import torch
from ulptrace import verdicts
from ulptrace.probes.onset import run_onset
from ulptrace.run import RunConfig
from ulptrace.sites import BATCH_WISE_KINDS, ROW_WISE_KINDS


@pytest.mark.parametrize("model, candidate", [
    ("tiny-qwen3.5", "fault:layers.0.input_layernorm@0+8"),
    ("tiny-qwen3.5", "kernels:fused"),
    ("tiny-llama", "fault:layers.0.post_attention_layernorm@1+1"),
])
def test_judging_the_differing_parts_gives_the_figures_of_the_whole_record(model, candidate, monkeypatch) -> None:
    """Every record of an onset with the oracle — a fault that leaves most rows equal, a fused path whose rows
    differ in places — judged on its differing rows and judged whole: the same report, field for field, and the
    rows path was taken (records cut to their rows, left-out elements counted exact), both where a record is judged
    alone (``_differing_parts``) and where records are stacked by units (``_units``)."""
    cfg = RunConfig(model=model, candidate=candidate, prompts=2, prompt_len=16, new_tokens=3)
    cut = []

    def counting(real):
        def cutting(site, reference, *rest):
            got = real(site, reference, *rest)
            if got is not None:
                kept = got[0].out.shape[0] if real is verdicts._units and site.kind in ROW_WISE_KINDS \
                    else got[0].out.shape[:-1].numel()
                cut.append((site.kind, reference.out.shape[:-1].numel(), kept))
            return got
        return cutting

    for name in ("_differing_parts", "_units"):
        monkeypatch.setattr(verdicts, name, counting(getattr(verdicts, name)))
    rows, _ = run_onset(cfg)
    for name in ("_differing_parts", "_units"):  # every record judged alone and whole
        monkeypatch.setattr(verdicts, name, lambda *a: None)
    whole, _ = run_onset(cfg)
    assert cut and all(kept <= total for _, total, kept in cut), cut
    fewer = {kind for kind, total, kept in cut if kept < total}
    assert fewer, cut
    if candidate.startswith("fault"):  # one prompt's rows differ: both kinds of cut are taken
        assert fewer & set(ROW_WISE_KINDS) and fewer & set(BATCH_WISE_KINDS), fewer
    assert rows.to_json() == whole.to_json()
    judged = [s for s in rows.sites if s.verdicts]
    assert judged and sum(s.verdicts["exact"] + s.verdicts["tie"] + s.verdicts["boundary"] + s.verdicts["error"]
                          + s.verdicts["nonfinite"] == s.elements for s in judged) == len(judged)


def test_rows_are_cut_only_where_the_semantics_are_row_wise_and_few_rows_differ() -> None:
    """Hand-made records: a norm with two of eight rows differing keeps those two (a power of two, no padding) and
    leaves 6 x 4 elements out; three differing rows are padded to four with an equal row; an attention record keeps
    its one differing batch item of two, and so does rope with tables of its own per item; rope with tables the batch
    shares, five differing rows of eight, both batch items, an input in other rows, or a dtype change: judged whole."""
    from ulptrace.sites import Obs, Site
    from ulptrace.trace import Record

    norm = Site("n", "norm", 0, Obs("n", "out"), {"x": Obs("n", "in0")})
    x = torch.randn(2, 4, 4).bfloat16()
    ref = Record("n", 0, "norm", 0, x * 2, {"x": x})

    def cand(rows):
        out = ref.out.clone().reshape(8, 4)
        out[rows, 0] += 1
        return Record("n", 0, "norm", 0, out.reshape(2, 4, 4), {"x": x})

    got = verdicts._differing_parts(norm, ref, cand([1, 6]))
    assert got is not None and got[0].out.shape == (1, 2, 4) and got[2] == 6 * 4
    assert torch.equal(got[1].out[0], cand([1, 6]).out.reshape(8, 4)[[1, 6]])
    got = verdicts._differing_parts(norm, ref, cand([0, 3, 5]))
    assert got is not None and got[0].out.shape == (1, 4, 4) and got[2] == 5 * 4 - 1 * 4
    assert torch.equal(got[1].out[0, 3], got[0].out[0, 3])  # the padding row is an equal one
    assert verdicts._differing_parts(norm, ref, cand([0, 1, 2, 3, 4])) is None  # more than half
    scan = Site("s", "attention", 0, Obs("s", "out"), {"x": Obs("s", "in0")})  # batch-wise: by batch item
    got = verdicts._differing_parts(scan, ref, cand([1]))
    assert got is not None and got[0].out.shape == (1, 4, 4) and got[2] == 16 and torch.equal(got[0].inputs["x"], x[:1])
    assert verdicts._differing_parts(scan, ref, cand([1, 6])) is None  # both batch items differ
    # rope is batch-wise: each batch item with its own positions' tables; tables the batch shares are judged whole
    rope = Site("r", "rope", 0, Obs("r", "out"), {"x": Obs("r", "in0"), "cos": Obs("r", "cos")})
    own = Record("r", 0, "rope", 0, ref.out, {"x": x, "cos": torch.randn(2, 4, 4)})
    got = verdicts._differing_parts(rope, own, cand([1]))
    assert got is not None and got[2] == 16 and torch.equal(got[0].inputs["cos"], own.inputs["cos"][:1])
    shared = Record("r", 0, "rope", 0, ref.out, {"x": x, "cos": torch.randn(1, 4, 4)})
    assert verdicts._differing_parts(rope, shared, cand([1])) is None
    other = Record("n", 0, "norm", 0, ref.out, {"x": x.reshape(4, 2, 4)})
    assert verdicts._differing_parts(norm, other, cand([1])) is None
    wide = Record("n", 0, "norm", 0, cand([1]).out.float(), {"x": x})
    assert verdicts._differing_parts(norm, ref, wide) is None
