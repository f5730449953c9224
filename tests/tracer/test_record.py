"""Recording: hooks installed and always removed, steps, numbering, selection, observation check."""

from __future__ import annotations

import pytest
import torch
from ulptrace.models import build_model
from ulptrace.run import greedy
from ulptrace.record import Recorder
from ulptrace.sites import select, site_table


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_generate_records_prefill_and_each_decode_step(qwen, prompts) -> None:
    with Recorder(qwen) as rec:
        qwen.generate(prompts, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    trace = rec.trace
    assert trace.steps == [0, 1, 2]
    names = {s.name for s in site_table(qwen)}
    for step in trace.steps:
        assert {site for site, t in trace.keys() if t == step} == names
    # prefill sees the whole prompt, decode steps one token; batch rows are kept
    assert trace["layers.0.input_layernorm", 0].out.shape == (2, 6, 128)
    assert trace["layers.0.input_layernorm", 2].out.shape == (2, 1, 128)
    # kinds and oracle inputs are recorded where the table says
    g = trace["layers.0.linear_attn.gates.g", 1]
    assert g.kind == "gates" and g.out.dtype == torch.float32 and set(g.inputs) == {"a"}
    glu = trace["layers.1.mlp.glu", 0]
    assert set(glu.inputs) == {"gate", "up"}
    # the GLU really is act(gate) * up of the recorded inputs (recorded from three different hooks)
    expected = torch.nn.functional.silu(glu.inputs["gate"]) * glu.inputs["up"]
    assert torch.equal(glu.out, expected)
    post = trace["layers.1.post_attention_layernorm", 0]
    assert torch.equal(trace["layers.1.residual_attn", 0].out, post.inputs["residual"] + post.inputs["delta"])


def test_hooks_and_taps_are_removed_also_on_exception(qwen, prompts) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    before_hooks = _hook_count(qwen)
    before = (mq.torch_chunk_gated_delta_rule, ALL_ATTENTION_FUNCTIONS["sdpa"])
    with pytest.raises(RuntimeError, match="boom"), Recorder(qwen):
        qwen(prompts)
        raise RuntimeError("boom")
    assert _hook_count(qwen) == before_hooks
    assert (mq.torch_chunk_gated_delta_rule, ALL_ATTENTION_FUNCTIONS["sdpa"]) == before


def test_nested_recorders_see_the_same_records(qwen, prompts) -> None:
    with Recorder(qwen) as outer:
        with Recorder(qwen) as inner:
            qwen(prompts)
        qwen(prompts)
    assert len(inner.trace) == len(outer.trace) // 2
    for rec in inner.trace:
        assert torch.equal(rec.out, outer.trace[rec.key].out)
    with pytest.raises(RuntimeError, match="already active"), outer, outer:
        pass


def test_module_called_twice_is_numbered(qwen, prompts) -> None:
    norm = qwen.model.norm
    original = norm.forward
    norm.forward = lambda x: original(original(x))  # a model that runs its final norm twice
    try:
        with Recorder(qwen, sites=select(site_table(qwen), ["norm"])) as rec:
            qwen(prompts)
    finally:
        del norm.forward
    assert [r.site for r in rec.trace] == ["norm"]  # the inner call is the module call; forward is patched
    # a real second module call:
    with Recorder(qwen, sites=select(site_table(qwen), ["layers.0.input_layernorm"])) as rec:
        x = torch.randn(1, 2, 128, dtype=torch.bfloat16)
        qwen(prompts[:, :2])
        qwen.model.layers[0].input_layernorm(x)  # outside a model forward: same step, second call
    assert [r.site for r in rec.trace] == ["layers.0.input_layernorm", "layers.0.input_layernorm#1"]


def test_selection_by_glob_kind_layer_and_step(qwen, prompts) -> None:
    sites = site_table(qwen)
    assert {s.kind for s in select(sites, kinds=["norm"])} == {"norm"}
    assert {s.layer for s in select(sites, layers=range(1, 3))} == {1, 2}
    glus = select(sites, ["layers.*.mlp.glu"])
    assert [s.name for s in glus] == [f"layers.{i}.mlp.glu" for i in range(4)]
    with pytest.raises(ValueError, match="unknown site kind"):
        select(sites, kinds=["nrom"])
    with Recorder(qwen, sites=glus, steps=[1]) as rec:
        greedy(qwen, prompts, 3)
    assert {r.step for r in rec.trace} == {1} and len(rec.trace) == 4


def test_observation_does_not_change_numerics(qwen, prompts) -> None:
    plain = greedy(qwen, prompts, 3)
    logits_plain = qwen(prompts).logits
    with Recorder(qwen):
        traced = greedy(qwen, prompts, 3)
        logits_traced = qwen(prompts).logits
    assert torch.equal(plain, traced)
    assert torch.equal(logits_plain.view(torch.int16), logits_traced.view(torch.int16))


def test_llama_family_table_and_fallback_warning() -> None:
    llama = build_model("tiny-llama")
    names = [s.name for s in site_table(llama)]
    assert "layers.0.self_attn.core" in names and "layers.0.mlp.glu" in names
    assert not any("linear_attn" in n or "q_norm" in n for n in names)
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.warns(UserWarning, match="no site table for GPT2LMHeadModel"):
        fallback = site_table(gpt2)
    assert fallback and all(s.kind == "other" and s.formula is None for s in fallback)
    with Recorder(gpt2, sites=fallback) as rec:
        gpt2(torch.tensor([[1, 2, 3]]))
    recorded = {r.site: r for r in rec.trace}
    assert {"transformer.h.0", "transformer.h.1", "lm_head", "output"} <= set(recorded) <= {s.name for s in fallback}
    assert torch.equal(recorded["output"].out, recorded["lm_head"].out)  # what the model returns: its logits
    assert recorded["transformer.h.1"].layer == 1 and recorded["transformer.h.0.mlp.c_fc"].layer == 0


def test_memory_sink_auto_keeps_cpu_records_in_place() -> None:
    from ulptrace.record import MemorySink
    from ulptrace.trace import Record

    sink = MemorySink(device="auto")
    out = torch.ones(3)
    sink.add(Record("s", 0, "norm", 0, out, {}))
    assert sink.trace.get(("s", 0)).out is out  # nothing to move on the CPU


@pytest.mark.gpu
def test_memory_sink_auto_spills_to_host_past_its_share(monkeypatch) -> None:
    from ulptrace.record import MemorySink
    from ulptrace.trace import Record

    total = torch.cuda.get_device_properties(0).total_memory
    first, second = torch.ones(2**20, device="cuda"), torch.full((2**20,), 2.0, device="cuda")  # 4 MiB each
    # room for one such record above what is allocated now (both records included)
    monkeypatch.setattr(MemorySink, "AUTO_SHARE", (torch.cuda.memory_allocated() + 6 * 2**20) / total)
    said = []
    sink = MemorySink(device="auto", on_spill=lambda record, kept: said.append((record.site, kept)))
    sink.add(Record("a", 0, "norm", 0, first, {}))
    assert not said and sink.spilled == {"records": 0, "bytes": 0}
    sink.add(Record("b", 0, "norm", 0, second, {"x": second}))  # a tensor in two roles counts once
    sink.add(Record("c", 0, "norm", 0, second.clone(), {}))
    trace = sink.trace
    assert trace.get(("a", 0)).out is first  # kept where it was produced
    assert trace.get(("b", 0)).out.device.type == "cpu" and torch.equal(trace.get(("b", 0)).out, second.cpu())
    # said once, at the first record that went to the host, with what the GPU kept; both spilled records counted
    assert said == [("b", 4 * 2**20)]
    assert sink.spilled == {"records": 2, "bytes": 8 * 2**20} and sink.kept_bytes == {first.device: 4 * 2**20}


def test_the_record_forecast_scales_the_prompts_layers_by_kind_and_repeats_a_decode_step() -> None:
    """Hand-computed: layers 0 and 2 of one kind, 1 and 3 of another, three steps (0: the prompt). At each layer of
    the prompt: the bytes so far plus, for each layer ahead, the mean of the passed layers of its kind (of all passed
    layers while its kind has none); from the second decode step on: the bytes so far plus the last decode step's for
    each step left (the prompt's step is no measure of a decode step's: no forecast at step 1)."""
    from ulptrace.record import RecordForecast

    forecast = RecordForecast({0: "gdn", 1: "attn", 2: "gdn", 3: "attn"}, steps=4)
    seen = [forecast.add(0, None, 10), forecast.add(0, 0, 100), forecast.add(0, 0, 20)]
    assert seen == [None, None, None]  # nothing passed yet
    assert forecast.add(0, 1, 50) == 10 + 120 + 3 * 120  # layer 0 passed: every layer ahead counts as it did
    assert "first 1 of 4 layers" in forecast.basis
    assert forecast.add(0, 1, 10) is None
    assert forecast.add(0, 2, 100) == 10 + 120 + 60 + 120 + 60  # both kinds passed: each layer as its kind's mean
    assert forecast.add(0, 3, 60) == 10 + 120 + 60 + 100 + 60  # layer 2 as it was, layer 3 as layer 1
    assert forecast.add(0, None, 5) is None  # after the last layer (the logits): counted, no layer started
    assert forecast.add(1, 0, 7) is None and forecast.add(1, None, 3) is None  # step 0 is 355 bytes, step 1 10
    assert forecast.add(2, 0, 4) == 355 + 10 + 10 * 2  # steps 2 and 3 left, each as step 1
    assert forecast.basis == "step 1's records for each of the 2 steps left"
    assert forecast.add(3, 0, 1) == 355 + 10 + 4 + 4 * 1
    assert RecordForecast({5: "a"}, steps=1).add(0, 5, 8) is None  # one layer: nothing to scale


def test_memory_sink_auto_says_once_when_the_forecast_passes_its_room(monkeypatch) -> None:
    """``on_outgrow`` is called at the first forecast past the room (the room counted when the first record came),
    once, with what was kept and forecast; records keep going where the room says (here all kept: they fit)."""
    from ulptrace.record import MemorySink, Outgrowth, RecordForecast
    from ulptrace.trace import Record

    monkeypatch.setattr(MemorySink, "room", classmethod(lambda cls, device: 1000))
    said = []
    sink = MemorySink(device="auto", forecast=RecordForecast({0: "a", 1: "a", 2: "a"}, steps=1),
                      on_outgrow=lambda record, outgrowth: said.append((record.site, outgrowth)))
    for layer in range(3):
        sink.add(Record(f"l{layer}", 0, "norm", layer, torch.ones(100), {}))  # 400 bytes each
    assert said == [("l1", Outgrowth(kept_bytes=400, forecast_bytes=1200, room_bytes=1000,
                                     basis="the prompt's first 1 of 3 layers"))]
    assert sink.spilled["records"] == 1  # the third record did not fit the room: past it, as without a forecast


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-llama"])
def test_recorder_releases_each_observation_once_its_sites_have_emitted(name) -> None:
    """The recorder holds what a site still to emit needs, not a whole step: while a step runs it never holds
    more than a few layers' observations, and at its end none (a norm's input, which its post-hook may read back
    as the residual, is dropped once that hook and the sites reading it are done); small copies kept for reuse
    (``HOLD_BYTES``) go when the recorder exits."""
    from ulptrace.run import make_prompts

    model = build_model(name)
    prompts = make_prompts(model.config.vocab_size, 2, 8, 0, "cpu")
    sites = site_table(model)
    observed = {s.out.key for s in sites} | {o.key for s in sites for o in s.inputs.values()}
    peak = []
    with Recorder(model) as rec:
        add = rec.sink.add

        def counting(record):
            add(record)
            peak.append(len(rec.held()))

        rec.sink.add = counting
        greedy(model, prompts, 2)
    assert len(rec.trace) == 2 * len(sites)  # every record still made
    assert rec.held() == [] and rec._bases == {}
    assert max(peak) < len(observed) / 2, (max(peak), len(observed))


class _Chain(torch.nn.Module):
    """a -> b (b adds 1 to its input in place and returns it) -> c."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()
        self.b.forward = lambda x: x.add_(1)

    def forward(self, x):
        return self.c(self.b(self.a(x.clone())))


def _chain_sites():
    from ulptrace.sites import Obs, Site

    return [Site("a", "other", None, Obs("a", "out")),
            Site("b", "other", None, Obs("b", "out"), {"x": Obs("b", "in0")}),
            Site("c", "other", None, Obs("c", "out"), {"x": Obs("c", "in0")})]


def test_one_copy_per_unchanged_tensor_and_a_new_one_after_an_in_place_write() -> None:
    """A tensor observed under several names (a's output is b's input) is copied once while unchanged; b writes it
    in place, so b's output (the same tensor object) gets a copy of its own, with the new values."""
    model = _Chain()
    x = torch.arange(4.0)
    with Recorder(model, sites=_chain_sites()) as rec:
        model(x)
    a, b, c = (rec.trace[name, 0] for name in "abc")
    assert torch.equal(a.out, x) and torch.equal(b.inputs["x"], x) and torch.equal(b.out, x + 1)
    assert b.inputs["x"] is a.out  # unchanged between the observations: one copy
    assert b.out is not a.out  # written in place in between: a new copy
    assert c.inputs["x"] is b.out and torch.equal(c.out, x + 1)
    with torch.inference_mode(), Recorder(model, sites=_chain_sites()) as rec:  # no version counter: always copy
        model(x)
    a, b = rec.trace["a", 0], rec.trace["b", 0]
    assert torch.equal(b.inputs["x"], x) and b.inputs["x"] is not a.out and torch.equal(b.out, x + 1)


def test_the_returned_logits_share_the_heads_copy_unless_changed_after_it() -> None:
    """What the model returns (site ``output``) is its head's output: one copy for both records, which a comparison
    then compares once (``KnownPairs``); a forward wrapper that changes the logits after the head gets a copy of its
    own, holding the changed values."""
    model = build_model("tiny-llama")
    ids = torch.tensor([[1, 2, 3]])
    with Recorder(model, sites=site_table(model)) as rec:
        model(ids)
    assert rec.trace["output", 0].out is rec.trace["logits", 0].out
    assert rec.trace["output", 0].inputs["x"] is rec.trace["logits", 0].inputs["x"]  # the head's input
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = forward
    with Recorder(model, sites=site_table(model)) as rec:
        model(ids)
    del model.forward
    head, returned = rec.trace["logits", 0].out, rec.trace["output", 0].out
    assert returned is not head and torch.equal(returned, head * 2)


def test_the_returned_logits_reach_a_live_sink_and_are_never_copied(monkeypatch) -> None:
    """The logits (a long prompt's are the run's largest value) go to a sink that takes live values as the model left
    them, for the head's record and the returned one alike, and the recorder copies them nowhere: no reader after
    the head's call reads them (the returned logits are judged from the head's input)."""
    from ulptrace import record

    sources = []
    real = record._copy
    monkeypatch.setattr(record, "_copy", lambda t: (sources.append(t), real(t))[1])
    model = build_model("tiny-llama")
    returned = {}
    model.register_forward_hook(lambda m, args, out: returned.setdefault("logits", out.logits))
    sink = _KeepLive()
    with Recorder(model, sites=site_table(model), sink=sink):
        model(torch.tensor([[1, 2, 3]]))
    logits = returned["logits"]
    assert sink.handed["logits", 0][0] is logits and sink.handed["output", 0][0] is logits
    assert sources and not any(t.data_ptr() == logits.data_ptr() for t in sources)


def test_known_pairs_give_an_output_only_statistics_with_rows() -> None:
    """An input's statistics (no row statistics) are not reused for an output, which reports them."""
    from ulptrace.comparison import KnownPairs

    known, a, b = KnownPairs(), torch.zeros(2), torch.ones(2)
    known.put(a, b, "input's")
    assert known.get(a, b) == "input's" and known.get(a, b, rows=True) is None
    known.put(a, b, "output's", rows=True)
    assert known.get(a, b) == known.get(a, b, rows=True) == "output's"
    assert known.get(a, torch.ones(2)) is None  # found by identity, not by value


def test_a_residual_read_back_from_the_norms_input_is_that_inputs_copy(qwen, prompts, monkeypatch) -> None:
    """HF's norm takes the residual as its input: the recorder reads it back from the copy its pre-hook made and
    keeps that copy (one copy a call, not a copy of the copy), and its values are the input's at the norm's call."""
    from ulptrace import record

    sources, made = [], []
    real = record._copy

    def copy(t):
        sources.append(t)
        made.append(real(t))
        return made[-1]

    monkeypatch.setattr(record, "_copy", copy)
    norm = qwen.model.layers[1].post_attention_layernorm
    seen = []
    handle = norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    try:
        with Recorder(qwen, sites=select(site_table(qwen), ["layers.1.residual_attn"])) as rec:
            qwen(prompts)
    finally:
        handle.remove()
    assert not any(src is ours for src in sources for ours in made)  # never a copy of the recorder's own copy
    assert any(torch.equal(src, seen[0]) for src in sources)  # the norm's input was copied (once, by its pre-hook)
    assert torch.equal(rec.trace["layers.1.residual_attn", 0].out, seen[0])


def _frozen(*objects) -> list[bool]:
    """Whether each object is in the collector's permanent generation (``gc.freeze``): tracked, yet in no generation
    ``gc.get_objects`` lists. Asked per object, since the frozen count alone moves when any frozen object is freed by
    its reference count while a test runs (a helper thread's frame, a cache entry replaced)."""
    import gc

    assert all(gc.is_tracked(o) for o in objects)
    listed = {id(o) for o in gc.get_objects()}
    return [id(o) not in listed for o in objects]


def test_recording_runs_the_garbage_collector_less_often_and_freezes_old_objects_until_exit(qwen, prompts) -> None:
    import gc

    from ulptrace.record import RECORDING_GC_THRESHOLD

    before = gc.get_threshold()
    assert before[0] < RECORDING_GC_THRESHOLD and gc.get_freeze_count() == 0
    old = [object()]  # exists when recording starts
    with Recorder(qwen):
        assert gc.get_threshold() == (RECORDING_GC_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 1000  # the libraries' and the model's objects: out of the collector's view
        young = [object()]  # made while recording: the collector still sees it
        assert _frozen(old, qwen, young) == [True, True, False]
        with Recorder(qwen):  # nested: neither freezes more nor unfreezes; the outer recorder restores
            assert _frozen(old, young) == [True, False]
        assert gc.get_threshold()[0] == RECORDING_GC_THRESHOLD and _frozen(old, young) == [True, False]
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0 and _frozen(old, young) == [False, False]
    with pytest.raises(RuntimeError, match="boom"), Recorder(qwen):
        assert _frozen(old) == [True]
        raise RuntimeError("boom")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0 and _frozen(old) == [False]
    gc.freeze()  # a caller that froze objects itself keeps them frozen, and only those
    try:
        later = [object()]
        with Recorder(qwen):
            assert _frozen(old, later) == [True, False] and gc.get_freeze_count() > 1000
        assert _frozen(old, later) == [True, False]
    finally:
        gc.unfreeze()
    gc.set_threshold(RECORDING_GC_THRESHOLD * 2, *before[1:])  # a caller's own higher threshold is left as it is
    try:
        with Recorder(qwen):
            assert gc.get_threshold()[0] == RECORDING_GC_THRESHOLD * 2
        assert gc.get_threshold()[0] == RECORDING_GC_THRESHOLD * 2
    finally:
        gc.set_threshold(*before)


class _RawChain(_Chain):
    """As ``_Chain``, but b writes its input in place behind the version counter (through ``.data``, as an extension
    kernel writing through a pointer does) and returns twice the result: only what was read or copied before b ran
    keeps a's values."""

    def __init__(self) -> None:
        super().__init__()
        self.b.forward = lambda x: (x.data.add_(1), x * 2)[1]


class _KeepLive:
    """A sink taking every value uncopied (``live_bytes = 0``) that keeps, as a correct one must, what it read in
    ``add``: clones, and which tensors it was handed."""

    live_bytes = 0

    def __init__(self) -> None:
        self.records, self.handed = {}, {}

    def add(self, record) -> None:
        self.records[record.key] = (record.out.clone(), {k: v.clone() for k, v in record.inputs.items()})
        self.handed[record.key] = (record.out, dict(record.inputs))


def test_a_sink_taking_live_values_gets_the_models_own_output_only_where_every_reader_is_served_at_once() -> None:
    """With ``Sink.live_bytes`` a value read only by the records emitted where it is observed goes to the sink
    uncopied (the model's own tensor); one a later record still reads (an input observed before its module ran) is
    copied before the model goes on, so a write behind the version counter does not reach it. What the sink reads
    in ``add`` equals what a recorder of copies records."""
    outputs = {}
    model = _RawChain()
    for name in "abc":
        getattr(model, name).register_forward_hook(lambda m, args, out, name=name: outputs.setdefault(name, out))
    x = torch.arange(4.0)
    sink = _KeepLive()
    with Recorder(model, sites=_chain_sites(), sink=sink) as rec:
        model(x)
    assert rec.held() == []
    for name in "abc":  # each site's output is read by its own record only: handed over as it is
        assert sink.handed[name, 0][0] is outputs[name]
    assert sink.handed["b", 0][1]["x"] is not outputs["a"]  # b's input is read after b ran: a copy
    with Recorder(_RawChain(), sites=_chain_sites()) as copied:  # the default sink: every value copied
        copied.model(x)
    for name in "abc":
        out, inputs = sink.records[name, 0]
        assert torch.equal(out, copied.trace[name, 0].out)
        assert inputs.keys() == copied.trace[name, 0].inputs.keys()
        assert all(torch.equal(v, copied.trace[name, 0].inputs[k]) for k, v in inputs.items())
    assert torch.equal(sink.records["a", 0][0], x) and torch.equal(sink.records["b", 0][1]["x"], x)
    assert torch.equal(sink.records["b", 0][0], 2 * (x + 1))


class _CopyingSink(list):
    """A sink that makes the recorder's copies (``Sink.copy_value``; for the third it is asked, None) and, being a
    list, has a ``copy`` method of its own that must not be taken for it."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.Tensor | None] = []

    def add(self, record) -> None:
        self.append(record)

    def copy_value(self, value: torch.Tensor) -> torch.Tensor | None:
        self.made.append(None if len(self.made) == 2 else value.clone())
        return self.made[-1]


def test_a_sink_that_copies_gets_the_recorders_copies_asked_of_it() -> None:
    """``Sink.copy_value``: each new copy the recorder needs is asked of the sink (the reference process's sink
    writes them where it ships them from), a value observed again unchanged is served by the same copy, and where the
    sink answers None the recorder copies as usual; the records equal a default recorder's."""
    x = torch.arange(4.0)
    sink = _CopyingSink()
    with Recorder(_Chain(), sites=_chain_sites(), sink=sink) as rec:
        rec.model(x)
    records = {r.key: r for r in sink}
    assert len(sink.made) == 3 and sink.made[2] is None  # a's output, b's output (written in place), c's output
    assert records["a", 0].out is sink.made[0] and records["b", 0].inputs["x"] is sink.made[0]
    assert records["b", 0].out is sink.made[1] and records["c", 0].inputs["x"] is sink.made[1]
    assert all(records["c", 0].out is not t for t in sink.made[:2])  # the recorder's own copy
    with Recorder(_Chain(), sites=_chain_sites()) as copied:
        copied.model(x)
    for key, record in records.items():
        assert torch.equal(record.out, copied.trace[key].out)
        assert all(torch.equal(v, copied.trace[key].inputs[k]) for k, v in record.inputs.items())


def test_a_host_memory_sink_copies_large_values_it_is_handed_in_host_memory(qwen, prompts) -> None:
    """``MemorySink(device="cpu")`` takes large values uncopied (on a GPU it copies them straight to the host); a
    value already in host memory it copies itself, so a record it keeps never aliases the model's tensors and the
    trace equals the default sink's, bit for bit."""
    from ulptrace.record import LIVE_BYTES, MemorySink

    sink = MemorySink(device="cpu")
    assert sink.live_bytes == LIVE_BYTES and MemorySink().live_bytes is None and MemorySink(device="auto").live_bytes is None
    sink.live_bytes = 0  # every value handed over as it is
    model = _RawChain()
    x = torch.arange(4.0)
    with Recorder(model, sites=_chain_sites(), sink=sink):
        model(x)
    assert torch.equal(sink.trace["a", 0].out, x)  # copied in add, before b wrote it behind the version counter
    with Recorder(qwen, sites=site_table(qwen)[:40]) as plain:
        greedy(qwen, prompts, 2)
    live = MemorySink(device="cpu")
    live.live_bytes = 0
    with Recorder(qwen, sites=site_table(qwen)[:40], sink=live):
        greedy(qwen, prompts, 2)
    assert plain.trace.keys() == live.trace.keys()
    for record in plain.trace:
        other = live.trace[record.key]
        assert torch.equal(other.out, record.out) and other.inputs.keys() == record.inputs.keys()


class _InPlaceNorm(torch.nn.Module):
    """Adds the residual into its input in place behind the version counter (as a kernel registered with ``Tensor(a!)``
    writes through its pointer) and returns (normed, that input) — vLLM's fused add + RMSNorm."""

    def forward(self, x, residual):
        x.data.add_(residual)
        return x * 2, x


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm = torch.nn.Identity(), _InPlaceNorm()

    def forward(self, x, residual):
        return self.norm(self.a(x.clone()), residual)


def test_a_modules_output_written_in_place_behind_the_version_counter_is_copied_after_the_call() -> None:
    """A module that writes its input in place without moving the version counter and returns it: the recorder shows
    the input as it was before the call and the output as the call left it — never the input's earlier copy as the
    output (a copy of an unchanged tensor is reused only for observations made before the module ran again)."""
    from ulptrace.sites import Obs, Site

    sites = [Site("a", "other", None, Obs("a", "out")),
             Site("norm", "norm", None, Obs("norm", "out"), {"x": Obs("norm", "in0"), "residual": Obs("norm", "in1")}),
             Site("norm.residual", "other", None, Obs("norm", "out1"))]
    x, residual = torch.arange(4.0), torch.full((4,), 10.0)
    model = _Block()
    with Recorder(model, sites=sites) as rec:
        model(x, residual)
    assert torch.equal(rec.trace["a", 0].out, x) and torch.equal(rec.trace["norm", 0].inputs["x"], x)
    assert torch.equal(rec.trace["norm", 0].out, 2 * (x + residual))
    assert torch.equal(rec.trace["norm.residual", 0].out, x + residual)  # was x: a's copy, reused
    assert rec.trace["norm", 0].inputs["x"] is rec.trace["a", 0].out  # before the call: still one copy


def test_a_tapped_functions_inputs_are_recorded_as_it_received_them(qwen, prompts, monkeypatch) -> None:
    """The GatedDeltaNet scan's inputs are read before it runs: a scan that writes the state it was given in place
    behind the version counter (as a recurrent kernel updating its state does) leaves the recorded initial state as
    it was handed over — equal to a run whose scan writes nothing — and its output as it returned it."""
    import sys

    namespace = sys.modules[type(qwen.model.layers[0].linear_attn).__module__]
    original = namespace.torch_recurrent_gated_delta_rule

    def writes_its_state(*args, **kwargs):
        result = original(*args, **kwargs)
        state = kwargs.get("initial_state", args[5] if len(args) > 5 else None)
        if state is not None:
            state.data.add_(1.0)  # after the real scan: the output is unchanged, the state it was given is not
        return result

    sites = select(site_table(qwen), ["layers.0.linear_attn.core"])
    with Recorder(qwen, sites=sites) as plain:
        greedy(qwen, prompts, 2)
    monkeypatch.setattr(namespace, "torch_recurrent_gated_delta_rule", writes_its_state)
    with Recorder(qwen, sites=sites) as writing:
        greedy(qwen, prompts, 2)
    ours, theirs = writing.trace["layers.0.linear_attn.core", 1], plain.trace["layers.0.linear_attn.core", 1]
    assert ours.inputs["state"] is not None and torch.equal(ours.inputs["state"], theirs.inputs["state"])
    assert torch.equal(ours.out, theirs.out)


class _Split(torch.nn.Module):
    """a -> its output split into halves (views) -> b(first half), c(second half, after an in-place write to it)."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()
        self.write = write

    def forward(self, x):
        y = self.a(x.clone())
        first, second = y.view(2, -1).unbind(0)
        self.b(first)
        if self.write:
            second.mul_(3)  # a view's in-place write moves the version counter it shares with y
        return self.c(second)


@pytest.mark.parametrize("write", [False, True])
def test_a_view_of_a_value_copied_before_is_that_copys_view_unless_written_since(write, monkeypatch) -> None:
    """A contiguous view of a tensor the recorder copied earlier in the step (HF splits a projection into query, key
    and value) is served by the same view of that copy — one copy, the view's values — while the version counter it
    shares with the tensor has not moved; after an in-place write it is copied anew, with the written values."""
    from ulptrace import record
    from ulptrace.sites import Obs, Site

    made = []
    real = record._copy
    monkeypatch.setattr(record, "_copy", lambda t: made.append(real(t)) or made[-1])
    sites = [Site("a", "other", None, Obs("a", "out")),
             Site("b", "other", None, Obs("b", "out"), {"x": Obs("b", "in0")}),
             Site("c", "other", None, Obs("c", "out"), {"x": Obs("c", "in0")})]
    x = torch.arange(8.0)
    with Recorder(_Split(write), sites=sites) as rec:
        rec.model(x)
    a, b, c = (rec.trace[name, 0] for name in "abc")
    assert torch.equal(a.out, x) and torch.equal(b.inputs["x"], x[:4]) and torch.equal(b.out, x[:4])
    expected = x[4:] * 3 if write else x[4:]
    assert torch.equal(c.inputs["x"], expected) and torch.equal(c.out, expected)
    assert torch.equal(a.out, x)  # the copy the views were served from still holds a's output as observed
    shares = lambda t: t.untyped_storage().data_ptr() == a.out.untyped_storage().data_ptr()
    assert shares(b.inputs["x"])  # a view of a's copy, no copy of its own
    assert shares(c.inputs["x"]) is (not write)
    # a module's output (b's, c's: the view it was given) is copied after its call (_copy_once's rule for outputs)
    assert not shares(b.out) and not shares(c.out)
    assert len(made) == (4 if write else 3)


class _Reshaped(torch.nn.Module):
    """b is given a contiguous 2-D view at an offset inside a's output (a key split out of a projection, reshaped
    to heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, x):
        y = self.a(x.clone())
        return self.b(y.view(3, 4)[1:].reshape(2, 2, 2))


def test_a_reshaped_view_at_an_offset_is_served_with_its_own_shape_and_values() -> None:
    """The copy's view stands where the value stood: the elements from the view's offset, in the view's shape (both
    different from the copied tensor's), one copy for both."""
    from ulptrace.sites import Obs, Site

    sites = [Site("a", "other", None, Obs("a", "out")),
             Site("b", "other", None, Obs("b", "out"), {"x": Obs("b", "in0")})]
    x = torch.arange(12.0) - 5.5
    with Recorder(_Reshaped(), sites=sites) as rec:
        rec.model(x)
    a, b = rec.trace["a", 0], rec.trace["b", 0]
    given = b.inputs["x"]
    expected = torch.tensor([[[-1.5, -0.5], [0.5, 1.5]], [[2.5, 3.5], [4.5, 5.5]]])  # x[4:12], by hand
    assert given.shape == (2, 2, 2) and given.is_contiguous() and torch.equal(given, expected)
    assert given.untyped_storage().data_ptr() == a.out.untyped_storage().data_ptr()  # a view of a's copy
    assert given.data_ptr() == a.out.data_ptr() + 4 * a.out.element_size()
    assert torch.equal(a.out, x)


class _Outer(torch.nn.Module):
    """outer returns what its inner module returned (an MLP returns its down_proj's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Identity()
        self.inner.forward = lambda x: x * 2

    def forward(self, x):
        return self.inner(x)


def test_a_modules_result_that_a_module_inside_it_returned_is_that_results_copy(monkeypatch) -> None:
    """The same tensor observed as a nested module's result and then as its parent's: one copy (made when the inner
    call returned, so after the parent began: nothing the parent's call did before could be in it), the values right."""
    from ulptrace import record
    from ulptrace.sites import Obs, Site

    made = []
    real = record._copy
    monkeypatch.setattr(record, "_copy", lambda t: made.append(real(t)) or made[-1])
    sites = [Site("outer.inner", "other", None, Obs("outer.inner", "out")), Site("outer", "other", None, Obs("outer", "out"))]
    model = torch.nn.Sequential()
    model.outer = _Outer()
    x = torch.arange(4.0)
    with Recorder(model, sites=sites) as rec:
        model(x)
    inner, outer = rec.trace["outer.inner", 0], rec.trace["outer", 0]
    assert torch.equal(inner.out, 2 * x) and outer.out is inner.out and len(made) == 1


_DTENSOR_RUN = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from ulptrace.record import Recorder
from ulptrace.sites import Obs, Site

mesh = init_device_mesh("cpu", (1,))

class Sharded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, x):
        y = self.a(DTensor.from_local(x * 2, mesh, [Shard(0)]))
        return self.b(y[0])

sites = [Site("a", "other", None, Obs("a", "out")), Site("b", "other", None, Obs("b", "out"), {"x": Obs("b", "in0")})]
x = torch.arange(8.0).reshape(2, 4)
with Recorder(Sharded(), sites=sites) as rec:
    rec.model(x)
got = rec.trace["b", 0]
assert torch.equal(got.inputs["x"].full_tensor(), 2 * x[0]) and torch.equal(rec.trace["a", 0].out.full_tensor(), 2 * x)
dist.destroy_process_group()
print("ok")
"""


def test_a_recorder_observing_dtensors_copies_them(tmp_path) -> None:
    """A tensor-parallel model may hand its hooks DTensors, which have no storage of their own to look a copy up by:
    the recorder copies them as they are (a view of one is not served from a copy)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", _DTENSOR_RUN], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORT": str(port)})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("live", [False, True])
def test_a_sparse_value_is_recorded_as_a_copy(live) -> None:
    """A sparse tensor has no size in bytes to weigh and no storage to look a copy up by: it is copied as it is,
    with a plain sink and with one that takes large values uncopied (``Sink.live_bytes``)."""
    from ulptrace.sites import Obs, Site

    class Sparse(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Identity(), torch.nn.Identity()

        def forward(self, x):
            return self.b(self.a(x.to_sparse()))

    class Live:
        live_bytes = 1  # every dense value would go uncopied

        def __init__(self) -> None:
            self.records = []

        def add(self, record) -> None:
            self.records.append(record)

    sink = Live() if live else None
    sites = [Site("a", "other", None, Obs("a", "out")), Site("b", "other", None, Obs("b", "out"), {"x": Obs("b", "in0")})]
    x = torch.eye(3)
    with Recorder(Sparse(), sites=sites, sink=sink) as rec:
        rec.model(x)
    records = sink.records if live else list(rec.trace)
    assert [r.site for r in records] == ["a", "b"]
    assert all(torch.equal(r.out.to_dense(), x) for r in records)
    assert torch.equal(records[1].inputs["x"].to_dense(), x)


def test_a_lazily_conjugated_view_is_not_served_from_its_bases_copy() -> None:
    """``conj()`` of a complex tensor is a view of the same memory with other values (a conjugate bit): the recorder
    copies it with its own values, never serves it as a view of its base's copy."""
    from ulptrace.sites import Obs, Site

    class Conj(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Identity(), torch.nn.Identity()

        def forward(self, x):
            return self.b(self.a(x * 1).conj())

    sites = [Site("a", "other", None, Obs("a", "out")), Site("b", "other", None, Obs("b", "in0"))]
    x = torch.tensor([1 + 2j, 3 - 1j])
    with Recorder(Conj(), sites=sites) as rec:
        rec.model(x)
    assert torch.equal(rec.trace["a", 0].out, x) and torch.equal(rec.trace["b", 0].out, x.conj())


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_returned_logits_formula_is_what_the_model_returns(softcap) -> None:
    """The ``output`` site's semantics (the logits the model returns, made from its head's output) reproduce the
    model's own returned logits bit for bit — plain (Llama family) and soft-capped after the head (Gemma 2's
    ``final_logit_softcapping``, from the config)."""
    import transformers

    config = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       final_logit_softcapping=softcap, max_position_embeddings=64,
                                       attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).to(torch.bfloat16).eval()
    seen = {}
    model.lm_head.register_forward_hook(lambda m, a, out: seen.update(x=a[0], head=out))
    with torch.no_grad():
        returned = model(torch.randint(0, 128, (2, 5))).logits
        site = next(s for s in site_table(model) if s.name == "output")
        made = site.formula(model)(x=seen["x"])
    assert site.kind == "logits" and (site.inputs["x"].module, site.inputs["x"].at) == ("lm_head", "in0")
    assert made.dtype == returned.dtype and torch.equal(made.view(torch.int16), returned.view(torch.int16))
    assert (softcap is None) == torch.equal(returned, seen["head"])


def test_known_pairs_drop_the_gone_and_keep_the_living_in_few_passes() -> None:
    """Pairs whose tensors are gone are dropped, living ones kept and found; with many pairs alive at once (an
    oracle's queue holding a run's records) the table is passed over a logarithmic number of times, not at every
    put past a fixed size (which made a comparison of the 0.8B shape quadratic)."""
    from ulptrace.comparison import KnownPairs

    known = KnownPairs()
    alive = [(torch.zeros(1), torch.zeros(1)) for _ in range(5 * KnownPairs.PRUNE_AT)]
    for i, (a, b) in enumerate(alive):
        known.put(a, b, i)
    assert len(known) == len(alive)  # nothing dropped while it lives
    assert all(known.get(a, b) == i for i, (a, b) in enumerate(alive))
    assert known.prunes <= 3  # 4096, 8192, 16384 (passes over 4K, 8K, 16K entries), not one a put past 4096
    del alive[: 4 * KnownPairs.PRUNE_AT]  # those pairs are gone now
    prunes, later = known.prunes, []
    while known.prunes == prunes and len(later) < 20 * KnownPairs.PRUNE_AT:  # new pairs, up to the next pass
        later.append((torch.zeros(1), torch.zeros(1)))
        known.put(*later[-1], None)
    assert known.prunes == prunes + 1
    assert len(known) <= len(alive) + len(later)  # the gone ones dropped (or their keys taken by new pairs)
    assert all(known.get(a, b) == i + 4 * KnownPairs.PRUNE_AT for i, (a, b) in enumerate(alive))
