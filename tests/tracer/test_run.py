"""The run layer: modes, forced tokens, snapshot/restore, static caches judged, graph capture protocol."""

from __future__ import annotations

import pytest
import torch
from ulptrace.cli import main
from ulptrace.comparison import bitwise_equal, compare, without_cache_padding
from ulptrace.models import build_model
from ulptrace.probes.onset import run_onset
from ulptrace.record import Recorder
from ulptrace.run import RunConfig, Session, greedy, make_prompts
from ulptrace.trace import Record
from ulptrace.verdicts import OracleJudge

FAMILIES = ("tiny-qwen3.5", "tiny-llama")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """Two copies of one tiny model (same seed, same weights) and prompts."""
    a, b = build_model(request.param), build_model(request.param)
    return a, b, make_prompts(a.config.vocab_size, 2, 8, seed=3)


def _state_equal(a, b) -> list[str]:
    """Names of state tensors that are not bitwise equal (or exist on one side only)."""
    ta, tb = a.tensors(), b.tensors()
    return sorted(n for n in ta.keys() | tb.keys() if n not in ta or n not in tb or not bitwise_equal(ta[n], tb[n]))


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_snapshot_restore_round_trips_bitwise(pair, mode) -> None:
    model, _, prompts = pair
    session = Session(model, mode, max_len=40)
    session.prefill(prompts)
    tokens = torch.tensor([[5], [7]])
    session.step(tokens)
    saved = session.snapshot()
    assert saved.tensors(), "the snapshot holds the cache's tensors"
    first = [session.step(tokens + i) for i in range(3)]
    assert _state_equal(session.snapshot(), saved), "decoding changed the state (else the test proves nothing)"
    session.restore(saved)
    assert _state_equal(session.snapshot(), saved) == []
    assert session.position == saved.position
    again = [session.step(tokens + i) for i in range(3)]
    assert all(bitwise_equal(x, y) for x, y in zip(first, again))


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_restore_into_another_session_continues_identically(pair, mode) -> None:
    """Lockstep's foundation: the state of one session, restored into a copy, decodes the same bits."""
    model, copy, prompts = pair
    a, b = Session(model, mode, max_len=40), Session(copy, mode, max_len=40)
    a.prefill(prompts)
    b.prefill(prompts[:, :5] if mode == "eager" else prompts)  # b's own state differs before the restore
    a.step(torch.tensor([[1], [2]]))
    b.restore(a.snapshot())
    tokens = torch.tensor([[9], [4]])
    assert bitwise_equal(a.step(tokens), b.step(tokens))
    assert _state_equal(a.snapshot(), b.snapshot()) == []


def test_greedy_feeds_forced_tokens_and_returns_own_choice(pair) -> None:
    model, _, prompts = pair
    own = greedy(model, prompts, 5)
    forced = (own + 1) % model.config.vocab_size
    seen = []
    with Recorder(model, sites=[]) as rec:  # counts steps only
        chosen = greedy(model, prompts, 5, forced=forced, on_logits=lambda s, l: seen.append(s))
    assert seen == [0, 1, 2, 3, 4] and rec.step == 4
    assert torch.equal(chosen[:, 0], own[:, 0])  # the prefill's choice does not depend on forcing
    # the decode steps consumed the forced tokens: an untraced eager run fed the same tokens agrees bitwise
    session = Session(model)
    session.prefill(prompts)
    logits = [session.step(forced[:, i : i + 1]) for i in range(4)]
    assert torch.equal(chosen[:, 1:], torch.stack([x.argmax(-1) for x in logits], 1))


def test_static_cache_logits_differ_from_dynamic_so_the_judged_test_below_is_not_vacuous() -> None:
    model = build_model("tiny-llama")
    prompts = make_prompts(model.config.vocab_size, 2, 16, seed=0)
    logits = {}
    for mode in ("eager", "static"):
        logits[mode] = []
        greedy(model, prompts, 4, mode=mode, cache_len=64, on_logits=lambda s, l, m=mode: logits[m].append(l))
    assert not all(bitwise_equal(a, b) for a, b in zip(logits["eager"], logits["static"]))


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("reference_mode,candidate_mode", [("eager", "static"), ("static", "eager")])
def test_static_vs_dynamic_cache_is_located_and_judged(model, reference_mode, candidate_mode) -> None:
    cfg = RunConfig(model=model, reference_mode=reference_mode, candidate_mode=candidate_mode, prompts=2,
                    prompt_len=16, new_tokens=4, cache_len=64, check_reference=True)
    comparison, _ = run_onset(cfg)
    data = comparison.to_json()
    assert data["missing"] == [] and data["extra"] == [] and data["mismatched"] == []
    first = data["first_difference"]
    assert first is not None and first["kind"] == "attention" and first["site"].endswith("self_attn.core")
    assert first["step"] >= 1  # the prefill attends through the same positions either way
    attention = [d for d in comparison.sites if d.site.endswith("self_attn.core")]
    assert attention and all(d.verdicts is not None for d in attention), [d.note for d in attention]
    assert all(d.input_delta.get("key") is not None for d in attention), "key/value deltas measured"
    assert sum(d.verdicts["tie"] for d in attention) > 0
    # a static cache is an honest implementation of the same attention: nothing worse than a tie
    assert data["onset"] is None
    assert all(d.reference_outside == 0 for d in comparison.sites if d.verdicts is not None)
    assert {m["mode"] for m in (data["reference"], data["candidate"])} == {"eager", "static"}


def test_cache_padding_is_trimmed_by_the_mask() -> None:
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    bool_mask = torch.tensor([True] * 5 + [False] * 3).view(1, 1, 1, 8)
    additive = torch.zeros(1, 1, 1, 8).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    for mask in (bool_mask, additive):
        rec = Record("a", 1, "attention", 0, q, {"query": q, "key": k, "value": v, "attention_mask": mask})
        trimmed = without_cache_padding(rec)
        assert trimmed.inputs["key"].shape == (1, 2, 5, 4) and torch.equal(trimmed.inputs["key"], k[:, :, :5])
        assert torch.equal(trimmed.inputs["value"], v[:, :, :5])
        assert trimmed.inputs["attention_mask"].shape == (1, 1, 1, 5)
    # a hole in the middle is not padding: only the tail after the last visible key goes
    holes = torch.tensor([True, False, True, True, False, False, False, False]).view(1, 1, 1, 8)
    rec = Record("a", 1, "attention", 0, q, {"query": q, "key": k, "value": v, "attention_mask": holes})
    assert without_cache_padding(rec).inputs["key"].shape[-2] == 4
    # no mask: a multi-token query is causal top-left aligned; a one-token query sees every key
    q3 = torch.randn(1, 2, 3, 4)
    assert without_cache_padding(Record("a", 0, "attention", 0, q3, {"query": q3, "key": k, "value": v})
                                 ).inputs["key"].shape[-2] == 3
    unchanged = Record("a", 1, "attention", 0, q, {"query": q, "key": k, "value": v})
    assert without_cache_padding(unchanged) is unchanged


def test_two_records_are_trimmed_to_one_length() -> None:
    """A mask that hides the newest key on one side (found by an audit) is not cache padding to cut from that side
    only: the pair keeps the longer side's visible keys on both, so keys, values and masks are compared."""
    from ulptrace.comparison import without_cache_padding_pair

    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    reference = Record("a", 1, "attention", 0, q, {"query": q, "key": k, "value": v})  # sees all 8
    hides_newest = torch.tensor([True] * 7 + [False]).view(1, 1, 1, 8)
    candidate = Record("a", 1, "attention", 0, q, {"query": q, "key": k, "value": v, "attention_mask": hides_newest})
    ref, cand = without_cache_padding_pair(reference, candidate)
    assert ref is reference and cand.inputs["key"].shape[-2] == 8 and cand.inputs["attention_mask"].shape[-1] == 8
    padded = torch.tensor([True] * 5 + [False] * 3).view(1, 1, 1, 8)  # a static cache's tail on both sides
    both = Record("a", 1, "attention", 0, q, {"query": q, "key": k, "value": v, "attention_mask": padded})
    peek = torch.tensor([True] * 6 + [False] * 2).view(1, 1, 1, 8)
    other = Record("a", 1, "attention", 0, q, {"query": q, "key": k, "value": v, "attention_mask": peek})
    ref, cand = without_cache_padding_pair(both, other)
    assert ref.inputs["key"].shape[-2] == cand.inputs["key"].shape[-2] == 6


def test_attention_over_keys_the_other_side_does_not_hold_is_a_mask_difference() -> None:
    """Found by an audit: transformers hands an attention function registered without a mask function no mask, also
    over a static cache's padding. Against a dynamic cache's live keys that read as an ``unobserved`` onset (keys of
    another shape); what differs is which keys the attention lets through: the mask's delta, keys and values compared
    over the keys both hold. A mask that hides the padding is trimmed away instead, and one with no plain visibility
    leaves the keys' shapes named as they are."""
    from ulptrace.comparison import Comparison, diff_records

    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    pad = torch.zeros(1, 2, 2, 4)
    kp, vp = torch.cat([k, pad], dim=2), torch.cat([v, pad], dim=2)
    out = torch.randn(1, 2, 1, 4)
    reference = Record("core", 1, "attention", 0, out, {"query": q, "key": k, "value": v})
    blind = Record("core", 1, "attention", 0, out * 0.5, {"query": q, "key": kp, "value": vp})
    d = diff_records(reference, blind)
    assert d.input_delta == {"attention_mask": 1, "query": 0, "key": 0, "value": 0} and d.input_shapes == {}
    assert [(x.site, r) for x, r in Comparison(sites=[d]).onsets()] == [("core", "mask")]
    changed = Record("core", 1, "attention", 0, out * 0.5, {"query": q, "key": kp * 2, "value": vp})
    assert diff_records(reference, changed).input_delta["key"] > 0  # the keys both hold are still compared
    live = torch.tensor([True] * 3 + [False] * 2).view(1, 1, 1, 5)
    hidden = Record("core", 1, "attention", 0, out, {"query": q, "key": kp, "value": vp, "attention_mask": live})
    d = diff_records(reference, hidden)
    assert d.bitwise_equal and d.input_delta == {"query": 0, "key": 0, "value": 0}
    bias = torch.zeros(1, 1, 1, 5)
    bias[..., 0] = -0.5
    biased = Record("core", 1, "attention", 0, out, {"query": q, "key": kp, "value": vp, "attention_mask": bias})
    d = diff_records(reference, biased)
    assert d.input_shapes == {"key": [[1, 2, 3, 4], [1, 2, 5, 4]], "value": [[1, 2, 3, 4], [1, 2, 5, 4]]}


def test_graph_mode_without_cuda_exits_2_with_one_line(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal is for machines without it")
    for argv in (["onset", "--candidate-mode", "graph"], ["record", "--mode", "graph", "--out", "x.trace"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "graph" in err[0] and "CUDA" in err[0], err
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Session(build_model("tiny-llama"), "graph", max_len=8)


def test_unknown_mode_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["onset", "--reference-mode", "turbo"])
    assert exc.value.code == 2
    assert "turbo" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be one of eager, static, graph"):
        RunConfig(candidate_mode="turbo").validate()


def test_capture_protocol_emits_records_per_replay_with_the_step_filter() -> None:
    """The recorder's side of CUDA-graph mode, on CPU: what is observed during a capture is kept as
    buffers and emitted after each replay with that replay's step number (hooks fire only in capture)."""
    model = build_model("tiny-qwen3.5")
    prompts = make_prompts(model.config.vocab_size, 2, 6, seed=1)
    session = Session(model, "static", max_len=12)
    with Recorder(model) as eager:
        session.prefill(prompts)
        saved = session.snapshot()
        session.step(torch.tensor([[3], [4]]))
    session.restore(saved)
    with Recorder(model, steps=[1, 3]) as graph:
        graph.step = 0  # the prefill ran before this recorder; replays are decode steps 1, 2, 3
        graph.begin_capture()
        session.step(torch.tensor([[3], [4]]))  # on CPU this runs the step: its buffers hold step 1's values
        graph.end_capture()
        assert list(graph.trace) == [], "nothing is emitted during a capture"
        for _ in range(3):
            graph.replayed()
    assert graph.trace.steps == [1, 3]
    assert {s for s, t in graph.trace.keys() if t == 1} == {s for s, t in eager.trace.keys() if t == 1}  # noqa: SIM118
    for record in eager.trace:
        if record.step == 1:
            replayed = graph.trace[record.site, 1]
            assert bitwise_equal(replayed.out, record.out), record.site
            assert all(bitwise_equal(replayed.inputs[r], t) for r, t in record.inputs.items())
    # emitted records own their memory: a later replay does not rewrite an earlier record
    assert graph.trace["logits", 1].out.data_ptr() != graph.trace["logits", 3].out.data_ptr()


def test_paused_recorder_observes_nothing(qwen, prompts) -> None:
    with Recorder(qwen) as rec:
        rec.pause()
        qwen(prompts)
        rec.resume()
        qwen(prompts)
    assert rec.trace.steps == [0]


# -- GPU: CUDA-graph replay observed -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("path", ["hf", "kernels:faithful", "kernels:fused"])
def test_graph_replay_records_equal_static_eager_records(model, path) -> None:
    from ulptrace.paths import apply_path

    ref, cand = build_model(model, device="cuda"), build_model(model, device="cuda")
    prompts = make_prompts(ref.config.vocab_size, 2, 12, seed=0, device="cuda")
    logits: dict[str, list[torch.Tensor]] = {"static": [], "graph": []}
    with apply_path(ref, path), Recorder(ref) as static:
        tokens = greedy(ref, prompts, 6, mode="static", on_logits=lambda s, l: logits["static"].append(l.clone()))
    with apply_path(cand, path), Recorder(cand) as graph:
        session = Session(cand, "graph", max_len=18)
        greedy(cand, prompts, 6, forced=tokens, session=session,
               on_logits=lambda s, l: logits["graph"].append(l.clone()))
    assert session.replays == 5
    assert all(bitwise_equal(a, b) for a, b in zip(logits["static"], logits["graph"]))
    comparison = compare(static.trace, graph.trace)
    assert comparison.missing == [] and comparison.extra == [] and comparison.mismatched == []
    assert graph.trace.steps == list(range(6))
    assert [d.site for d in comparison.sites if not d.bitwise_equal] == []


@pytest.mark.gpu
def test_graph_mode_onset_is_judged_against_eager() -> None:
    cfg = RunConfig(model="tiny-qwen3.5", candidate_mode="graph", device="cuda", prompts=2, prompt_len=16,
                    new_tokens=5, cache_len=64, check_observation=True)
    comparison, _ = run_onset(cfg)
    data = comparison.to_json()
    assert data["missing"] == [] and data["extra"] == [] and data["observation"]["bitwise_equal"]
    assert data["onset"] is None
    assert all(d.verdicts is not None for d in comparison.sites if d.site.endswith("self_attn.core"))


def test_judge_program_cache_survives_padded_and_unpadded_inputs() -> None:
    """The oracle's program is captured on the reference's unpadded inputs and reused for the padded side."""
    model = build_model("tiny-llama")
    prompts = make_prompts(model.config.vocab_size, 1, 6, seed=2)
    traces = {}
    for mode in ("eager", "static"):
        with Recorder(model, sites=None) as rec:
            greedy(model, prompts, 3, mode=mode, cache_len=32)
        traces[mode] = rec.trace
    result = compare(traces["eager"], traces["static"], judge=OracleJudge(model, judge_reference=True))
    cores = [d for d in result.sites if d.site.endswith("self_attn.core")]
    assert cores and all(d.verdicts is not None and d.reference_outside == 0 for d in cores)


def test_cache_len_without_a_static_mode_is_refused(capsys) -> None:
    """An option that would be accepted and ignored is an error instead."""
    assert main(["onset", "--cache-len", "64"]) == 2
    assert "--cache-len" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must hold the prompt and the new tokens"):
        RunConfig(candidate_mode="static", prompt_len=16, new_tokens=4, cache_len=10).validate()


def test_memory_sink_moves_records_once_per_shared_tensor() -> None:
    """A GPU run's reference kept in host memory: records move as they arrive, a tensor shared between
    roles (a GLU's gate is the gate projection's output) moves once and stays shared."""
    from ulptrace.record import MemorySink

    shared = torch.randn(2, 3)
    sink = MemorySink(device="meta")
    sink.add(Record("glu", 0, "glu", 0, torch.randn(2, 3), {"gate": shared, "again": shared}))
    record = sink.trace["glu", 0]
    assert record.out.device.type == "meta" and record.inputs["gate"].device.type == "meta"
    assert record.inputs["gate"] is record.inputs["again"]
    with pytest.raises(ValueError, match="--reference-memory must be one of auto, device, host"):
        RunConfig(reference_memory="gpu").validate()
