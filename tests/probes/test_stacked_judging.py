"""Records of one program judged in one replay (``OracleJudge.replayed_many``, ``QueuedJudge``): on both families'
recorded runs every pair's answer is the one judging it alone gives, the plan does stack records (across decode steps
and layers), and an onset's report is the report without stacking."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from onset_reports import essentials, report
from ulptrace import verdicts
from ulptrace.probes.onset import record_pair
from ulptrace.run import RunConfig
from ulptrace.verdicts import OracleJudge, QueuedJudge

SMALL = {"prompts": 2, "prompt_len": 16, "new_tokens": 4}
RUNS = [
    pytest.param({"model": "tiny-qwen3.5", "candidate": "kernels:fused"}, id="qwen3.5-fused"),
    pytest.param({"model": "tiny-llama", "candidate": "generation_candidates:glu_error_at_step_2"}, id="llama-glu-error"),
]


def _pairs(fields: dict, stack: ExitStack) -> tuple[OracleJudge, list]:
    ref, cand, ref_model, _ = record_pair(RunConfig(**SMALL, **fields), stack)
    judge = OracleJudge(ref_model)
    pairs = [(r, cand.get(r.key)) for r in ref]
    pairs = [(r, c) for r, c in pairs if c is not None and judge.without_replay(r, c) is None]
    return judge, pairs


@pytest.mark.parametrize("fields", RUNS)
def test_stacked_answers_are_each_pairs_own(fields) -> None:
    with ExitStack() as stack:
        judge, pairs = _pairs(fields, stack)
        assert len(pairs) > 20, "records differ and need the oracle"
        alone = [judge.replayed(r, c) for r, c in pairs]
        plan = judge.stacks(pairs)
        assert sorted(i for s in plan for i, _ in s) == list(range(len(pairs)))  # each pair planned once
        stacked = [s for s in plan if len(s) > 1]
        assert stacked, "some records share a program"
        # across decode steps (one site) and, for a formula without parameters of its own, across layers
        assert any(len({pairs[i][0].step for i, _ in s}) > 1 for s in stacked)
        assert any(len({pairs[i][0].site for i, _ in s}) > 1 for s in stacked)
        if any(r.step == 0 and r.kind == "norm" for r, _ in pairs):  # norms differ at the prefill and after
            # a site's prefill and decode steps in one stack (their rows stacked), and a norm at several layers with
            # weights of their own in one (the weight per unit)
            assert any(len({pairs[i][0].out.shape for i, _ in s}) > 1 for s in stacked)
            norms = [s for s in stacked if {pairs[i][0].kind for i, _ in s} == {"norm"}
                     and len({pairs[i][0].layer for i, _ in s}) > 1]
            assert norms, "one norm program at every layer"
            params = dict(judge.model.named_parameters())
            weights = {tuple(params[n].flatten().tolist()) for i, _ in norms[0] for n in params
                       if n.endswith(f"{pairs[i][0].site}.weight")}
            assert len(weights) > 1, "the stacked layers' norms have weights of their own"
        linear = [s for s in stacked if {pairs[i][0].kind for i, _ in s} == {"linear"}]
        if len({r.layer for r, _ in pairs if r.kind == "linear"}) > 1:  # a weight matrix each record's own
            assert any(len({pairs[i][0].layer for i, _ in s}) > 1 and all(part.own for _, part in s)
                       for s in linear), "linear layers of several layers in one stack"
        ropes = [s for s in stacked if {pairs[i][0].kind for i, _ in s} == {"rope"}]
        own = {r.layer for r, _ in pairs if r.kind == "rope" and r.inputs["cos"].shape[0] == r.out.shape[0] > 1}
        if len(own) > 1:  # batch-wise where each item has its own tables: a query's items at every layer and step
            assert any(len({pairs[i][0].layer for i, _ in s}) > 1 for s in ropes), "rope stacked across layers"
        scans = [r.site for r, _ in pairs if hasattr(judge.program(judge.site(r.site), r.inputs), "judge_stacked")]
        if scans:  # the GatedDeltaNet scan's construction: whole records of every layer and step in a few stacks
            stacked_scans = [s for s in stacked if pairs[s[0][0]][0].site in scans]
            assert sum(len(s) for s in stacked_scans) > len(stacked_scans)
            assert any(len({pairs[i][0].layer for i, _ in s}) > 1 for s in stacked_scans)
        together = judge.replayed_many(pairs)
        assert [a.get("admissible_width") for a in together] == [a.get("admissible_width") for a in alone]
        assert any(a.get("admissible_width") is not None for a in together) == bool(scans)
        assert together == alone
        verdict_totals = {v: sum(a["verdicts"][v] for a in alone) for v in alone[0]["verdicts"]}
        assert verdict_totals["tie"] + verdict_totals["boundary"] + verdict_totals["error"] > 0


def test_a_stack_holds_the_layers_own_weights_up_to_its_bound(monkeypatch) -> None:
    """``STACK_OWN_BYTES`` bounds the float64 copies of the layers' own weights one stack holds: at one byte each
    stack holds one layer's (a site's prefill and decode steps still together), with the same answers."""
    with ExitStack() as stack:
        judge, pairs = _pairs(RUNS[0].values[0], stack)
        alone = [judge.replayed(r, c) for r, c in pairs]
        monkeypatch.setattr(verdicts, "STACK_OWN_BYTES", 1)
        linear = [s for s in judge.stacks(pairs) if {pairs[i][0].kind for i, _ in s} == {"linear"}]
        assert linear and all(len({pairs[i][0].layer for i, _ in s}) == 1 for s in linear)
        assert any(len({pairs[i][0].step for i, _ in s}) > 1 for s in linear)
        assert judge.replayed_many(pairs) == alone


def test_queued_judge_answers_as_each_pair_alone(monkeypatch) -> None:
    with ExitStack() as stack:
        judge, pairs = _pairs(RUNS[1].values[0], stack)
        alone = [judge.replayed(r, c) for r, c in pairs]
        queued = judge.queued()
        held = [queued(r, c) for r, c in pairs]
        assert all(callable(getattr(h, "result", None)) for h in held), "held until an answer is read"
        assert [h.result() for h in held] == alone
        every = QueuedJudge(judge, queue_bytes=1)  # judged as each comes: the same answers
        assert [every(r, c).result() for r, c in pairs] == alone
        monkeypatch.setattr("ulptrace.record.LIVE_BYTES", 1)  # every record may be the model's own: judged at once
        assert [queued(r, c) for r, c in pairs] == alone


def test_the_queue_holds_a_share_of_the_judges_memory() -> None:
    """Records of one program stack only when held together (a site's prefill with its decode steps): the queue's bound
    is a sixteenth of the judge's memory — here the host's, read from /proc/meminfo — never below 256 MiB."""
    import torch
    from ulptrace.verdicts import queue_bytes_for

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    got = queue_bytes_for(torch.device("cpu"))
    assert got >= 256 << 20
    if total // 16 > 256 << 20:
        assert abs(got - total // 16) <= total // 1000  # MemTotal leaves out the kernel's own reserve


def test_an_onset_judges_its_held_pairs_at_once_and_a_small_bound_gives_the_same_report(monkeypatch) -> None:
    """With the default share of memory an onset's pairs are judged in one plan (prefill and decode steps of a site
    stacked), whatever the floor; with a bound of one byte each pair is judged as it comes: the same report."""
    flushes: list[int] = []
    real = QueuedJudge.flush

    def flush(self) -> None:
        flushes.append(len(self._pairs))
        real(self)

    monkeypatch.setattr(QueuedJudge, "flush", flush)
    cfg = RunConfig(**SMALL, model="tiny-qwen3.5", candidate="kernels:fused")
    monkeypatch.setattr(verdicts, "QUEUE_BYTES", 1)  # the floor alone would judge each pair as it comes
    held = report(cfg)
    assert len(flushes) == 1 and flushes[0] > 20, flushes
    flushes.clear()
    monkeypatch.setattr(verdicts, "QUEUE_SHARE", 0)
    each = report(cfg)
    assert len(flushes) > 20 and max(flushes) == 1, flushes
    assert essentials(held) == essentials(each)


@pytest.mark.parametrize("fields", RUNS)
def test_onset_report_is_the_report_without_stacking(fields, monkeypatch) -> None:
    stacked = report(RunConfig(**SMALL, **fields))
    monkeypatch.setattr(verdicts, "STACK_RECORDS", 1)  # one record a stack: each judged alone
    alone = report(RunConfig(**SMALL, **fields))
    assert essentials(stacked) == essentials(alone)
    assert any(site.get("verdicts") for site in alone["sites"])


@pytest.mark.gpu
@pytest.mark.parametrize("fields", RUNS)
def test_stacked_answers_on_the_gpu_are_each_pairs_own(fields, cuda_kernels) -> None:
    """On the GPU a stack's float64 sums and matmuls run at another size than one record's (other kernels, other
    splits of the work): every answer is still the one judging the pair alone gives."""
    with ExitStack() as stack:
        judge, pairs = _pairs({**fields, "device": "cuda"}, stack)
        assert any(len(s) > 1 for s in judge.stacks(pairs))
        assert judge.replayed_many(pairs) == [judge.replayed(r, c) for r, c in pairs]


@pytest.mark.parametrize("bad", ["fails", "wrong_rank"])
def test_a_formula_that_cannot_take_its_parameters_per_unit_is_stacked_without(bad, monkeypatch) -> None:
    """Per-unit parameters that make the capture fail (shapes that do not broadcast) or change the output's shape:
    the unit's program is captured with the layer's own parameters instead, which are then each record's own
    (``per_record``: the ops reading them evaluated record by record), and every answer is still the one judging it
    alone gives."""
    real = OracleJudge._per_unit

    def broken(self, site, unit):
        vectors = real(self, site, unit)
        if bad == "fails":
            return {n: t.reshape(-1)[:3].reshape(*t.shape[:-1], 3) for n, t in vectors.items()}
        return {n: t.reshape(1, *t.shape) for n, t in vectors.items()}

    monkeypatch.setattr(OracleJudge, "_per_unit", broken)
    with ExitStack() as stack:
        judge, pairs = _pairs(RUNS[0].values[0], stack)
        alone = [judge.replayed(r, c) for r, c in pairs]
        plan = [s for s in judge.stacks(pairs) if len(s) > 1]
        norms = [s for s in plan if {pairs[i][0].kind for i, _ in s} == {"norm"}]
        assert norms and all(not part.params for s in norms for _, part in s), "no per-unit parameters"
        assert any(len({pairs[i][0].layer for i, _ in s}) > 1 and all(part.own for _, part in s) for s in norms), \
            "norms of several layers in one stack, each record with its own weight"
        assert judge.replayed_many(pairs) == alone


MORE_RUNS = [("tiny-qwen3.5", "kernels:faithful"), ("tiny-qwen3.5", "fault:layers.0.mlp.glu@2+2"),
             ("tiny-qwen3.5", "fault:layers.2.linear_attn.norm@0+1"), ("tiny-qwen3.5", "fault:layers.3.self_attn.core@1+4"),
             ("tiny-llama", "kernels:fused"), ("tiny-llama", "fault:layers.0.input_layernorm@0+2"),
             ("tiny-llama", "fault:layers.1.self_attn.core@2+1")]


@pytest.mark.parametrize("shape", [(2, 16), (3, 9)], ids=["2x16", "3x9"])
@pytest.mark.parametrize(("model", "candidate"), MORE_RUNS, ids=[f"{m}-{c}" for m, c in MORE_RUNS])
def test_stacked_answers_are_each_pairs_own_on_more_runs(model, candidate, shape) -> None:
    """Both families, other paths and single-element faults at a GLU, a gated norm, attention cores and a norm, an odd
    batch and prompt length: every pair's answer stacked is the one it gets alone."""
    fields = {"model": model, "candidate": candidate, "prompts": shape[0], "prompt_len": shape[1], "new_tokens": 4}
    with ExitStack() as stack:
        ref, cand, ref_model, _ = record_pair(RunConfig(**fields), stack)
        judge = OracleJudge(ref_model)
        pairs = [(r, cand.get(r.key)) for r in ref]
        pairs = [(r, c) for r, c in pairs if c is not None and judge.without_replay(r, c) is None]
        assert pairs
        assert judge.replayed_many(pairs) == [judge.replayed(r, c) for r, c in pairs]
