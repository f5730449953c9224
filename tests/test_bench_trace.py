"""The tracing benchmark's command line reaches its runs (bench/bench_trace.py): an option it accepts and does not pass
on would time another run than the one its output names — as ``--sdpa`` did until the thirty-ninth round."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
bench_trace = pytest.importorskip("bench_trace")


def _configs(*argv: str):
    args = bench_trace.arguments().parse_args(list(argv))
    return args, *bench_trace.run_configs(args)


def test_every_run_option_reaches_both_onsets_configs():
    args, p1, p3 = _configs("--model", "tiny-llama", "--candidate", "kernels:faithful", "--prompts", "3",
                            "--prompt-len", "20", "--new-tokens", "5", "--sdpa", "math", "--concurrent", "split",
                            "--reference-memory", "host", "--judge-workers", "2", "--oracle-prompts", "4",
                            "--oracle-prompt-len", "9", "--oracle-new-tokens", "6")
    for cfg in (p1, p3):
        assert (cfg.model, cfg.candidate, cfg.device, cfg.sdpa, cfg.concurrent, cfg.reference_memory) == (
            "tiny-llama", "kernels:faithful", "cpu", "math", "split", "host")
    assert (p1.prompts, p1.prompt_len, p1.new_tokens, p1.oracle) == (3, 20, 5, False)
    assert (p3.prompts, p3.prompt_len, p3.new_tokens, p3.oracle, p3.judge_workers) == (4, 9, 6, True, 2)


@pytest.mark.parametrize("flag, field, expected", [("--concurrent", "concurrent", True),
                                                   ("--concurrent=auto", "concurrent", "auto")])
def test_concurrent_alone_is_the_candidate_here_and_auto_the_commands_default(flag, field, expected):
    _, p1, p3 = _configs(flag)
    assert getattr(p1, field) == getattr(p3, field) == expected


def test_options_left_at_their_defaults_are_not_passed(monkeypatch):
    """An older commit's package (run for its reports) lacks the newer fields: only what was asked for is passed."""
    passed = []

    class Older:  # a RunConfig without sdpa, concurrent or judge_workers
        def __init__(self, model, candidate, device, prompts, prompt_len, new_tokens, reference_memory="auto",
                     oracle=True):
            passed.append(dict(locals()))

    import ulptrace.run
    monkeypatch.setattr(ulptrace.run, "RunConfig", Older)
    monkeypatch.setattr(bench_trace, "replace", lambda cfg, **kw: cfg)
    args = bench_trace.arguments().parse_args([])
    bench_trace.run_configs(args)
    assert [p["oracle"] for p in passed] == [False, True]
    with pytest.raises(TypeError, match="sdpa"):
        bench_trace.run_configs(bench_trace.arguments().parse_args(["--sdpa", "math"]))
