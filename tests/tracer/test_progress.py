"""The progress bar of long runs: its text (steps, sites, elapsed, time left from the decode steps' mean), drawn
only on a terminal, never in CI or with ``--quiet``; ``--quiet`` also silences the ``[ulptrace]`` lines."""

from __future__ import annotations

import io

import pytest
from ulptrace.progress import Progress, bar_enabled


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_counts_steps_sites_and_time_left_from_the_decode_steps() -> None:
    now = [0.0]
    bar = Progress(Terminal(), enabled=True, width=10, clock=lambda: now[0])
    bar.start("candidate x", 5, 369)
    assert bar.line(0) == "[ulptrace] candidate x [..........] step 0/5, 369 sites each, 0 s"
    now[0] = 2.0  # the prefill took 2 s
    bar.step(1)
    assert bar.line(1).endswith("step 1/5, 369 sites each, 2 s, about 8 s left")  # 4 steps at 2 s
    now[0] = 4.0  # two decode steps of 1 s
    bar.step(2)
    bar.step(3)
    assert bar.line(3) == "[ulptrace] candidate x [######....] step 3/5, 369 sites each, 4 s, about 2 s left"
    now[0] = 66.0
    bar.step(5)
    assert bar.line(5) == "[ulptrace] candidate x [##########] step 5/5, 369 sites each, 1:06"
    bar.close()
    out = bar.stream.getvalue()
    assert out.startswith("\r[ulptrace] candidate x") and out.endswith("1:06\x1b[K\n")


def test_drawn_only_on_a_terminal_and_never_in_ci_or_quiet(monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert bar_enabled(Terminal()) and not bar_enabled(io.StringIO())
    assert not bar_enabled(Terminal(), quiet=True)
    monkeypatch.setenv("CI", "true")
    assert not bar_enabled(Terminal())
    log = io.StringIO()
    bar = Progress(log)  # a file or pipe: nothing is written
    bar.start("x", 3, 1)
    bar.step(3)
    bar.close()
    assert log.getvalue() == ""


@pytest.mark.parametrize("quiet", [False, True])
def test_onset_quiet_silences_progress(quiet, capsys) -> None:
    from ulptrace.cli import main

    args = ["onset", "--prompts", "1", "--prompt-len", "4", "--new-tokens", "2", "--no-oracle"]
    assert main(args + (["--quiet"] if quiet else [])) == 0
    err = capsys.readouterr().err
    assert ("[ulptrace]" in err) is not quiet


def test_a_counter_draws_a_phase_of_its_own_and_closes_it() -> None:
    now = [0.0]
    bar = Progress(Terminal(), enabled=True, width=4, clock=lambda: now[0])
    report = bar.counter("judging", "stack")
    report(0, 4)
    assert bar.line(0) == "[ulptrace] judging [....] stack 0/4, 0 s"
    now[0] = 3.0
    report(1, 4)  # the mean of all stacks so far (no prefill to leave out)
    assert bar.line(1) == "[ulptrace] judging [#...] stack 1/4, 3 s, about 9 s left"
    report(4, 4)
    assert bar.stream.getvalue().endswith("stack 4/4, 3 s\x1b[K\n")  # closed at its last


def test_an_onset_with_the_oracle_shows_the_judging_of_the_held_pairs(monkeypatch) -> None:
    """The pairs the oracle holds are judged after the candidate's run: the bar shows that phase, stack by stack, to
    its end (none without the oracle)."""
    from ulptrace.probes.onset import JUDGING, run_onset
    from ulptrace.run import RunConfig

    cfg = RunConfig(model="tiny-qwen3.5", candidate="kernels:fused", prompts=1, prompt_len=8, new_tokens=2)
    for oracle in (True, False):
        bar = Progress(Terminal(), enabled=True)
        run_onset(RunConfig(**{**cfg.__dict__, "oracle": oracle}), bar=bar)
        lines = [line for line in bar.stream.getvalue().split("\r") if line.startswith(f"[ulptrace] {JUDGING}")]
        if not oracle:
            assert not lines
            continue
        total = int(lines[-1].split(" stack ")[1].split("/")[1].split(",")[0])
        assert total > 1 and lines[-1].split(" stack ")[1].startswith(f"{total}/{total}")
