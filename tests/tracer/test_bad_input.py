"""Bad input as a new user meets it (issue 9): one line, exit 2, saying what was expected and what was
found — never a traceback, never a silent "fine" — and checked before the first model is built where
the check needs no model."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import ulptrace
import ulptrace.models
from ulptrace.cli import build_parser, main
from ulptrace.probes import norm_rounding
from ulptrace.trace import OWNER_FILE, TMP_MARK, TraceWriter, stale_temporaries

TINY = ["--prompts", "1", "--prompt-len", "4", "--new-tokens", "2"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith(("[ulptrace]", "[transformers]"))]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a model is built: the error must come before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the bad input was reported")

    monkeypatch.setattr(ulptrace.models, "build_model", refuse)


# -- empty selections and faults that never fire ---------------------------------------------------

SELECTIONS = [
    (["--layers", "5:2"], "--layers 5:2 is an empty range"),
    (["--steps", "7:9"], "--steps 7:9 selects no step: the run has steps 0..1"),
    (["--steps", "1:9"], "--steps 1:9 runs past the run: it has steps 0..1"),
    (["--kinds"], "--kinds needs at least one kind: expected some of norm, gated_norm"),
    (["--sites"], "--sites needs at least one GLOB"),
    (["--layers", "x"], "--layers: expected a range like '3', '2:5' or '2:', but got 'x'"),
]


@pytest.mark.parametrize("command, extra, message",
                         [(c, e, m) for c in ("onset", "record", "trace_norm_rounding") for e, m in SELECTIONS])
def test_empty_selection_without_a_model_is_exit_2(command, extra, message, tmp_path, capsys, no_model) -> None:
    argv = [*TINY, *extra]
    if command == "trace_norm_rounding":
        rc = norm_rounding.main(argv)
    else:
        rc = main([command, *argv, *(["--out", str(tmp_path / "t")] if command == "record" else [])])
    assert rc == 2
    assert message in _one_line_error(capsys)


@pytest.mark.parametrize("command", ["onset", "record", "trace_norm_rounding"])
def test_fault_beyond_the_last_step_is_refused_before_the_run(command, tmp_path, capsys, no_model) -> None:
    spec = "fault:layers.1.mlp.glu@10"
    if command == "trace_norm_rounding":
        rc = norm_rounding.main([*TINY, "--candidate", spec])
    elif command == "record":
        rc = main(["record", *TINY, "--path", spec, "--out", str(tmp_path / "t")])
    else:
        rc = main(["onset", *TINY, "--candidate", spec, "--fail-on-onset"])
    assert rc == 2
    line = _one_line_error(capsys)
    assert "perturbs step 10, but the run has steps 0..1" in line and "would never fire" in line


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--layers", "10:20"], "the selection --layers 10:20 matches no site: tiny-qwen3.5 has "),
        (["--sites", "layers.*.mlp.gluu"], "--sites 'layers.*.mlp.gluu' matches no site"),
        # a part of a selection that selects nothing is refused too, not dropped beside a part that does
        (["--sites", "layers.1.self_atn.*", "layers.*.mlp.glu"], "--sites 'layers.1.self_atn.*' matches no site"),
        (["--layers", "3:9"], "--layers 3:9 runs past the model's layers: tiny-qwen3.5 has "),
        (["--sites", "layers.*.mlp.glu", "--kinds", "norm"], "the selection --sites layers.*.mlp.glu, --kinds norm "
                                                            "matches no site"),
    ],
)
def test_selection_matching_no_site_of_the_model_is_exit_2(extra, message, capsys) -> None:
    assert main(["onset", "--candidate", "kernels:fused", *TINY, *extra, "--fail-on-onset"]) == 2
    line = _one_line_error(capsys)
    assert message in line
    assert re.search(r"tiny-qwen3\.5 has \d+ sites in layers 0\.\.3, of kinds .*norm", line)  # what exists
    assert "layers.0.input_layernorm" in line


def test_selection_matching_no_site_also_fails_record_and_trace_norm_rounding(tmp_path, capsys) -> None:
    assert main(["record", *TINY, "--layers", "10:20", "--out", str(tmp_path / "t")]) == 2
    assert "matches no site" in _one_line_error(capsys)
    assert not (tmp_path / "t").exists() and not list(tmp_path.iterdir())  # no temporary left either
    assert norm_rounding.main([*TINY, "--sites", "nothing*"]) == 2
    assert "--sites 'nothing*' matches no site" in _one_line_error(capsys)


def test_a_fault_that_never_fired_raises_when_its_path_is_undone() -> None:
    from ulptrace.run import greedy, make_prompts

    model = ulptrace.build_model("tiny-llama")
    prompts = make_prompts(model.config.vocab_size, 1, 4, 0)
    with pytest.raises(ValueError, match=r"fault layers\.1\.mlp\.glu@5 never fired: the model ran 2 forward "
                                         r"call\(s\) \(steps 0\.\.1\).*beyond the last step 1"):
        with ulptrace.apply_path(model, "fault:layers.1.mlp.glu@5"):
            greedy(model, prompts, 2)
    with ulptrace.apply_path(model, "fault:layers.1.mlp.glu@1") as applied:  # reached: fires once, no error
        greedy(model, prompts, 2)
    assert applied._handle.hits == 1


# -- compare: traces of different run inputs ------------------------------------------------------

def _record(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    assert main(["record", "--model", "tiny-llama", "--prompts", "1", "--prompt-len", "4", "--new-tokens", "3",
                 *extra, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    base = tmp_path_factory.mktemp("traces")
    made = {"ref": _record(base, "ref"),
            "forced": _record(base, "forced", "--path", "fault:layers.0.mlp.glu@1+4", "--forced-from",
                              str(base / "ref"))}
    made["seed"] = _record(base, "seed", "--seed", "1")
    out = base / "len"
    assert main(["record", "--model", "tiny-llama", "--prompts", "1", "--prompt-len", "5", "--new-tokens", "3",
                 "--out", str(out)]) == 0
    made["len"] = out
    return made


@pytest.mark.parametrize("other, field", [("seed", "seed: reference 0, candidate 1"),
                                          ("len", "prompts: reference [1, 4], candidate [1, 5]")])
def test_compare_refuses_traces_of_different_run_inputs(traces, other, field, capsys) -> None:
    assert main(["compare", str(traces["ref"]), str(traces[other]), "--no-oracle"]) == 2
    line = _one_line_error(capsys)
    assert "recorded with different run inputs" in line and field in line and "--allow-different-inputs" in line
    assert main(["compare", str(traces["ref"]), str(traces[other]), "--no-oracle", "--allow-different-inputs",
                 "--json", "-"]) == 0
    out = capsys.readouterr()
    assert "warning: run inputs differ" in out.err
    assert json.loads(out.out)["inputs"]["same"] is False


def test_compare_refuses_a_candidate_fed_other_tokens(traces, tmp_path, capsys) -> None:
    """A candidate recorded without --forced-from whose own tokens flipped was fed other inputs."""
    flipped = tmp_path / "flipped"
    shutil.copytree(traces["ref"], flipped)
    manifest = json.loads((flipped / "manifest.json").read_text())
    meta = manifest["metadata"]
    meta["tokens"] = [[t + (i == 1) for i, t in enumerate(row)] for row in meta["tokens"]]
    meta["fed_tokens"] = [row[:-1] for row in meta["tokens"]]
    (flipped / "manifest.json").write_text(json.dumps(manifest))
    assert main(["compare", str(traces["ref"]), str(flipped), "--no-oracle"]) == 2
    line = _one_line_error(capsys)
    assert "tokens fed: at step 2 row 0" in line and "record it with --forced-from REFERENCE" in line


def test_record_forced_from_feeds_the_reference_tokens_and_says_so(traces, capsys) -> None:
    ref = json.loads((traces["ref"] / "manifest.json").read_text())["metadata"]
    forced = json.loads((traces["forced"] / "manifest.json").read_text())["metadata"]
    assert forced["fed_tokens"] == [row[:-1] for row in ref["tokens"]]
    assert forced["forced_from"] == str(traces["ref"].resolve())
    assert ref["forced_from"] is None
    assert main(["compare", str(traces["ref"]), str(traces["forced"]), "--no-oracle", "--json", "-"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["same"] is True and inputs["candidate_forced_from"] == str(traces["ref"].resolve())
    assert "the candidate was fed the reference's tokens" in inputs["note"]


def test_record_output_says_whether_tokens_were_forced(traces, tmp_path, capsys) -> None:
    _record(tmp_path, "own")
    assert "not forced" in capsys.readouterr().err
    _record(tmp_path, "forced", "--forced-from", str(traces["ref"]))
    assert f"fed the tokens of {traces['ref']} (forced)" in capsys.readouterr().err


def test_forced_from_a_trace_of_other_inputs_is_refused_before_the_run(traces, tmp_path, capsys, no_model) -> None:
    assert main(["record", "--model", "tiny-llama", "--prompts", "1", "--prompt-len", "6", "--new-tokens", "3",
                 "--forced-from", str(traces["ref"]), "--out", str(tmp_path / "x")]) == 2
    line = _one_line_error(capsys)
    assert "--forced-from" in line and "prompts: that trace [1, 4], this run [1, 6]" in line


# -- one line instead of a traceback ----------------------------------------------------------------

@pytest.mark.parametrize(
    "extra, message",
    [
        (["--device", "tpu"], "--device must be a torch device such as cpu or cuda:0, but got 'tpu'"),
        (["--dtype", "int8"], "--dtype must be one of bfloat16, float16, float32, but got 'int8'"),
        (["--dtype", "float8_e4m3fn"], "--dtype must be one of bfloat16, float16, float32, but got 'float8_e4m3fn'"),
        (["--dtype", "float64", "--candidate", "kernels:fused"], "--dtype must be one of bfloat16, float16, float32"),
        (["--new-tokens", "0"], "--new-tokens must be >= 1 (1 = the prefill only), but got 0"),
        (["--candidate", ":patch"], "path ':patch': expected package.module:function, but the module name is empty"),
        (["--candidate", "mypkg:"], "path 'mypkg:': expected package.module:function, but the function name is empty"),
        (["--candidate", "my pkg:fn"], "'my pkg' is not a dotted module name"),
        (["--candidate", "fault:layers.1.mlp.glu@x"], "expected 'fault:SITE@STEP' or 'fault:SITE@STEP+ULPS'"),
    ],
)
def test_bad_run_input_is_one_line_before_any_model(extra, message, capsys, no_model) -> None:
    assert main(["onset", *TINY, *extra]) == 2
    assert message in _one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys, no_model) -> None:
    assert main(["onset", *TINY, "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is available on this machine (use --device cpu)" in _one_line_error(capsys)


def test_kernel_paths_refuse_a_model_of_a_dtype_they_do_not_support() -> None:
    """The CLI refuses float64 for every path (``ulptrace.run.DTYPES``); a float64 model built through the
    API is refused by the kernel paths when applied, with one line, not by a TypeError mid-forward."""
    model = ulptrace.build_model("tiny-llama", dtype=torch.float64)
    for path in ("kernels:fused", "kernels:faithful"):
        with pytest.raises(ValueError, match="ulptrace's kernels support float32, float16, bfloat16 models, but "
                                             "LlamaForCausalLM is float64"):
            ulptrace.apply_path(model, path)
    with ulptrace.apply_path(model, "hf"):  # the reference path itself has nothing to refuse
        pass


@pytest.mark.parametrize("case", ["no_weights", "bad_json", "not_a_config", "no_config"])
def test_broken_checkpoint_directory_is_one_line(case, tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if case != "no_config":
        (ckpt / "config.json").write_text({"no_weights": '{"model_type": "llama", "vocab_size": 64}',
                                           "bad_json": '{"model_type": "llama", "vocab_size": ',
                                           "not_a_config": '[1, 2]'}[case])
    assert main(["onset", *TINY, "--model", str(ckpt)]) == 2
    line = _one_line_error(capsys)
    assert {"no_weights": "has no weights: expected one of model.safetensors",
            "bad_json": "config.json is not a valid JSON file",
            "not_a_config": "is not an HF model config: expected a JSON object with a 'model_type'",
            "no_config": "has no config.json"}[case] in line


def test_checkpoint_that_transformers_cannot_load_is_one_line(tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (ckpt / "model.safetensors").write_bytes(b"not really")
    assert main(["onset", *TINY, "--model", str(ckpt)]) == 2
    assert f"checkpoint directory {ckpt} cannot be loaded by transformers" in _one_line_error(capsys)


def test_manifest_version_of_the_wrong_type_is_called_malformed(tmp_path, capsys) -> None:
    trace = tmp_path / "t"
    (trace).mkdir()
    (trace / "manifest.json").write_text(json.dumps({"schema": "ulptrace.trace", "version": "1", "metadata": {},
                                                     "records": [], "shards": {}}))
    assert main(["compare", str(trace), str(trace)]) == 2
    line = _one_line_error(capsys)
    assert "malformed 'version' field" in line and "found '1' (str)" in line and "upgrade" not in line


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys) -> None:
    """KeyboardInterrupt in the middle of a run (here raised by a path's forward): exit 130, no trace left."""
    (tmp_path / "interrupting.py").write_text(
        "def patch(model):\n"
        "    mlp = model.model.layers[1].mlp\n"
        "    def forward(x):\n"
        "        raise KeyboardInterrupt\n"
        "    mlp.forward = forward\n"
        "    return lambda: delattr(mlp, 'forward')\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        out = tmp_path / "traces"
        out.mkdir()
        assert main(["record", *TINY, "--model", "tiny-llama", "--path", "interrupting:patch",
                     "--out", str(out / "t")]) == 130
        assert _one_line_error(capsys) == "ulptrace: interrupted (Ctrl-C)"
        assert list(out.iterdir()) == []  # the temporary trace directory was removed
        assert norm_rounding.main([*TINY, "--model", "tiny-llama", "--candidate", "interrupting:patch"]) == 130
        assert "interrupted (Ctrl-C)" in _one_line_error(capsys)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("interrupting", None)


def test_user_path_that_raises_names_the_path_and_shows_only_the_users_frames(tmp_path, capsys) -> None:
    (tmp_path / "raising_kernels.py").write_text(
        "def patch(model):\n"
        "    return load_table(model)\n"
        "def load_table(model):\n"
        "    raise RuntimeError('kernel table missing')\n"
        "def at_run(model):\n"
        "    mlp = model.model.layers[1].mlp\n"
        "    def forward(x):\n"
        "        return x @ x  # a shape bug in 'my kernel'\n"
        "    mlp.forward = forward\n"
        "    return lambda: delattr(mlp, 'forward')\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["onset", *TINY, "--model", "tiny-llama", "--candidate", "raising_kernels:patch"]) == 2
        err = capsys.readouterr().err
        assert "ulptrace: error: path 'raising_kernels:patch' raised RuntimeError while patching the model: kernel " \
               "table missing" in err
        assert "raising_kernels.py\", line 2, in patch" in err and "line 4, in load_table" in err
        assert "Traceback" not in err and "ulptrace/" not in err and "tracer/" not in err
        assert main(["onset", *TINY, "--model", "tiny-llama", "--candidate", "raising_kernels:at_run",
                     "--no-oracle"]) == 2
        err = capsys.readouterr().err
        assert "path 'raising_kernels:at_run' raised RuntimeError during the run" in err
        assert "line 8, in forward" in err
        assert "Traceback" not in err and "site-packages" not in err and "tracer/" not in err
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("raising_kernels", None)


def test_usage_errors_are_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["onset", "--prompts", "x"])
    assert exit_.value.code == 2
    assert _one_line_error(capsys) == ("ulptrace onset: error: argument --prompts: invalid int value: 'x' "
                                       "(see `ulptrace onset --help`)")


@pytest.mark.parametrize("argv, command", [(["onset", "--max-ulp", "-1"], "onset"),
                                           (["compare", "a", "b", "--max-ulp", "-1"], "compare")])
def test_a_negative_ulp_budget_is_refused(argv, command, capsys) -> None:
    """A budget below zero has no meaning (every difference is over it, and so is none): refused while parsing."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert _one_line_error(capsys) == (f"ulptrace {command}: error: argument --max-ulp: expected a non-negative "
                                       f"integer, but got -1 (see `ulptrace {command} --help`)")


# -- output paths are checked before the first model is built ---------------------------------------

@pytest.mark.parametrize(
    "argv, message",
    [
        (["onset", *TINY, "--json", "{tmp}"], "--json {tmp} is a directory: expected a file name"),
        (["onset", *TINY, "--markdown", "{tmp}"], "--markdown {tmp} is a directory"),
        (["onset", *TINY, "--json", "{tmp}/missing/r.json"], "the directory '{tmp}/missing' does not exist"),
        (["record", *TINY, "--out", "{tmp}"], "--out {tmp} already exists (a directory)"),
        (["record", *TINY, "--out", "{tmp}/missing/t"], "the directory '{tmp}/missing' does not exist"),
        (["compare", "{tmp}/a", "{tmp}/b", "--json", "{tmp}"], "--json {tmp} is a directory"),
    ],
)
def test_output_paths_are_checked_before_any_model(argv, message, tmp_path, capsys, no_model) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    assert message.replace("{tmp}", str(tmp_path)) in _one_line_error(capsys)


def test_trace_norm_rounding_checks_its_output_paths_first(tmp_path, capsys, no_model) -> None:
    assert norm_rounding.main([*TINY, "--markdown", str(tmp_path)]) == 2
    assert f"--markdown {tmp_path} is a directory" in _one_line_error(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_output_directory_is_refused(tmp_path, capsys, no_model) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["onset", *TINY, "--json", str(locked / "r.json")]) == 2
        assert "is not writable" in _one_line_error(capsys)
    finally:
        locked.chmod(0o700)


# -- stale temporary trace directories ---------------------------------------------------------------

def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _temporary(directory: Path, name: str, pid: int, host: str | None = None) -> Path:
    tmp = directory / f".{name}{TMP_MARK}{pid}.abcd1234"
    tmp.mkdir()
    (tmp / OWNER_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": 0}))
    (tmp / "step-00000.safetensors").write_bytes(b"\0" * 1000)
    return tmp


def test_clean_removes_temporaries_of_dead_writers_only(tmp_path, capsys) -> None:
    dead = _temporary(tmp_path, "y.trace", _dead_pid())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = _temporary(tmp_path, "z.trace", sleeper.pid)
        elsewhere = _temporary(tmp_path, "w.trace", _dead_pid(), host="another-host")
        foreign = tmp_path / ".y.trace.abcdefgh"  # not made by a TraceWriter of this version: never touched
        foreign.mkdir()
        assert main(["clean", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"removed {dead} (" in out and "no longer runs" in out
        assert not dead.exists() and alive.exists() and elsewhere.exists() and foreign.exists()
        assert main(["clean", str(tmp_path)]) == 0
        assert "no stale temporary trace directories" in capsys.readouterr().out
    finally:
        sleeper.kill()
        sleeper.wait()
    assert main(["clean", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in _one_line_error(capsys)


def test_next_write_to_the_directory_removes_stale_temporaries(tmp_path, capsys) -> None:
    dead = _temporary(tmp_path, "y.trace", _dead_pid())
    writer = TraceWriter(tmp_path / "y.trace")
    assert [s.path for s in writer.removed_stale] == [dead] and not dead.exists()
    # the writer's own temporary names its process, and is not stale while it runs
    assert TMP_MARK + str(os.getpid()) in writer._tmp.name
    assert json.loads((writer._tmp / OWNER_FILE).read_text())["pid"] == os.getpid()
    assert stale_temporaries(tmp_path) == []
    writer.close()
    assert not (tmp_path / "y.trace" / OWNER_FILE).exists()
    dead = _temporary(tmp_path, "x.trace", _dead_pid())
    assert main(["record", *TINY, "--model", "tiny-llama", "--out", str(tmp_path / "x.trace")]) == 0
    assert f"removed {dead}: a temporary trace directory of a writer that no longer runs" in capsys.readouterr().err
    assert not dead.exists()


# -- paths in the working directory, listing, help ----------------------------------------------------

def test_console_script_imports_a_path_module_from_the_working_directory(tmp_path, ulptrace_script) -> None:
    (tmp_path / "mypkg.py").write_text("def patch(model):\n    return None\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([ulptrace_script, "record", *TINY, "--model", "tiny-llama", "--path", "mypkg:patch",
                           "--out", "t"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["metadata"]["path"] == "mypkg:patch"


def test_paths_lists_fault(capsys) -> None:
    assert main(["paths"]) == 0
    out = capsys.readouterr().out
    assert "fault:SITE@STEP[+ULPS]" in out and "kernels:fused" in out and "pkg.module:fn" in out


def _actions(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        else:
            yield parser.prog, action


def test_every_path_option_and_trace_argument_has_help() -> None:
    named = {"--reference", "--candidate", "--path", "--forced-from", "--allow-different-inputs", "--device",
             "--dtype"}
    seen = set()
    for parser in (build_parser(), norm_rounding.build_parser()):
        for prog, action in _actions(parser):
            flags = set(action.option_strings) or {action.dest}
            if flags & named or (prog == "ulptrace compare" and action.dest in ("reference", "candidate")):
                assert action.help, f"{prog} {sorted(flags)} has no help text"
                seen.add((prog, tuple(sorted(flags))))
    progs = {p for p, _ in seen}
    assert {"ulptrace onset", "ulptrace record", "ulptrace compare", "trace_norm_rounding"} <= progs


# -- noise -------------------------------------------------------------------------------------------

def test_kernel_paths_run_without_transformers_warnings() -> None:
    """kernels:* on Qwen3.5 passed `cache_params=None` beside `cache` (a FutureWarning every run)."""
    from ulptrace.run import cache_kwarg, greedy, make_prompts

    model = ulptrace.build_model("tiny-qwen3.5")
    assert cache_kwarg(model) == "cache" and cache_kwarg(model.model.layers[0].linear_attn) == "cache"
    prompts = make_prompts(model.config.vocab_size, 1, 4, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path in ("kernels:fused", "kernels:faithful"):
            with ulptrace.apply_path(model, path):
                greedy(model, prompts, 2)
    assert [str(w.message) for w in caught] == []


def test_open_ended_ranges_run_to_the_end_and_are_not_past_it(capsys) -> None:
    """``--layers 2:`` and ``--steps 1:`` select to the end (not refused as running past it); ``--steps 1:`` made
    the recorder build a set of 2**30 steps (MemoryError, or the process killed)."""
    assert main(["onset", "--candidate", "hf", *TINY, "--layers", "2:", "--steps", "1:", "--fail-on-onset"]) == 0
    assert "at parity" in capsys.readouterr().out
