"""The ulptrace CLI: commands as a user runs them, the JSON contract, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ulptrace.cli import main

SMALL = ["--prompts", "2", "--prompt-len", "6", "--new-tokens", "3"]


def test_onset_json_contract_for_a_fault(tmp_path, capsys) -> None:
    out = tmp_path / "onset.json"
    md = tmp_path / "onset.md"
    rc = main(["onset", *SMALL, "--candidate", "fault:layers.2.mlp.glu@1+1", "--no-oracle",
               "--json", str(out), "--markdown", str(md), "--fail-on-onset"])
    assert rc == 1  # an onset was found and the user asked to fail on it
    data = json.loads(out.read_text())
    assert data["first_difference"] == {"step": 1, "site": "layers.2.mlp.glu", "kind": "glu", "layer": 2}
    assert data["onset"]["site"] == "layers.2.mlp.glu"
    for entry in data["sites"]:
        assert {"site", "step", "kind", "layer", "elements", "differing", "max_ulp", "histogram",
                "verdicts", "boundary"} <= set(entry)
    table = capsys.readouterr().out
    assert "first difference: step 1, layers.2.mlp.glu (glu)" in table
    # the markdown table: the faulted element (+1 ULP, one element of step 1's GLU) is its first row
    rows = markdown_rows(md.read_text())
    assert (rows[0]["step"], rows[0]["site"], rows[0]["kind"]) == ("1", "layers.2.mlp.glu", "glu")
    assert (rows[0]["differing"], rows[0]["max ulp"]) == ("1", "1")
    assert all(r["step"] == "1" for r in rows)  # nothing differs before the fault


def markdown_rows(text: str) -> list[dict[str, str]]:
    """The rows of the one markdown table in ``text``, as ``{column header: cell}``."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, separator, *body = cells
    assert set("".join(separator)) <= set("-:"), separator
    return [dict(zip(header, row, strict=True)) for row in body]


def test_record_then_compare(tmp_path, capsys) -> None:
    assert main(["record", *SMALL, "--out", str(tmp_path / "a")]) == 0
    # forced to a's tokens: eager attention flips a token here, and compare refuses traces fed other tokens
    assert main(["record", *SMALL, "--path", "hf:attn=eager", "--forced-from", str(tmp_path / "a"),
                 "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--no-oracle", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["first_difference"]["site"] == "layers.1.self_attn.core"
    assert data["reference"]["path"] == "hf" and data["candidate"]["path"] == "hf:attn=eager"
    # with the oracle: the reference model is rebuilt from the manifest and checked against its checksums
    assert main(["record", *SMALL, "--path", "fault:layers.0.mlp.glu@1+4", "--forced-from", str(tmp_path / "a"),
                 "--out", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--json", "-"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert "verdicts use the semantics of tiny-qwen3.5" in out.err
    assert data["onset"] == {"step": 1, "site": "layers.0.mlp.glu", "kind": "glu", "layer": 0, "reason": "verdict"}
    glu = next(s for s in data["sites"] if (s["site"], s["step"]) == ("layers.0.mlp.glu", 1))
    assert glu["verdicts"]["error"] == 1 and glu["max_error_ulp"] >= 1
    # a trace whose parameters the rebuilt model does not reproduce gets no verdicts, not wrong ones
    manifest = tmp_path / "a" / "manifest.json"
    meta = json.loads(manifest.read_text())
    meta["metadata"]["seed"] = 7
    manifest.write_text(json.dumps(meta))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--json", "-"]) == 2  # the seeds differ now
    assert "seed: reference 7, candidate 0" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--json", "-", "--allow-different-inputs"]) == 0
    out = capsys.readouterr()
    assert "parameters differ" in out.err
    data = json.loads(out.out)
    assert all(s["verdicts"] is None for s in data["sites"])
    # ... and that is never parity: every differing record is one the oracle could not judge
    differing = {(s["site"], s["step"]) for s in data["sites"] if s["differing"]}
    assert differing and {(c["site"], c["step"]) for c in data["could_not_judge"]} == differing
    assert not data["parity"]["ok"] and "parameters differ" in data["could_not_judge"][0]["reason"]
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--allow-different-inputs",
                 "--fail-on-onset"]) == 1
    # a trace recorded on a GPU: its seeded weights come from that device's generator, and the report says so
    meta["metadata"].update(seed=0, device="cuda:0")
    manifest.write_text(json.dumps(meta))
    capsys.readouterr()
    if not __import__("torch").cuda.is_available():
        assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--json", "-"]) == 0
        err = capsys.readouterr().err
        assert "verdicts use the semantics" in err and "rebuilt on cpu" in err  # the checksums still match
        first = next(iter(meta["metadata"]["parameters"]))
        meta["metadata"]["parameters"][first] += "0"
        manifest.write_text(json.dumps(meta))
        assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--json", "-"]) == 0
        out = capsys.readouterr()
        assert "recorded on cuda:0" in out.err and "compare on a machine with cuda" in out.err
        assert not json.loads(out.out)["parity"]["ok"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["onset", "--model", "nope"], "unknown model 'nope'"),
        (["onset", "--candidate", "bogus"], "unknown path 'bogus'"),
        (["onset", "--candidate", "nosuchmodule.x:fn"], "cannot import module 'nosuchmodule.x'"),
        (["compare", "/nonexistent/a", "/nonexistent/b"], "not a trace directory"),
        (["onset", "--kinds", "nrom"], "unknown site kind"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_models_and_module_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "ulptrace", "models"], capture_output=True, text=True, check=True)
    assert "tiny-qwen3.5" in done.stdout and "qwen3.5-0.8b" in done.stdout


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
def test_sites_lists_every_site_a_run_records_with_its_kind_inputs_and_semantics(model, capsys) -> None:
    """``ulptrace sites``: the names ``--sites`` and ``fault:SITE@STEP`` take, one line each, in the site table's order;
    a selection by kind and layer; bad input named."""
    from ulptrace.models import build_model
    from ulptrace.sites import site_table

    table = site_table(build_model(model))
    assert main(["sites", "--model", model]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["site", "kind", "layer", "oracle", "inputs"]
    assert [line.split()[0] for line in lines[1:]] == [s.name for s in table]
    norm = next(line.split() for line in lines[1:] if line.startswith("layers.0.input_layernorm "))
    assert norm == ["layers.0.input_layernorm", "norm", "0", "semantics", "x"]
    assert main(["sites", "--model", model, "--kinds", "glu", "linear", "--layers", "1"]) == 0
    chosen = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]]
    assert chosen == [[s.name, s.kind, "1"] for s in table if s.layer == 1 and s.kind in ("glu", "linear")]
    assert chosen
    for bad, message in ((["--kinds", "nope"], "unknown site kind(s) ['nope']"),
                         (["--layers", "x"], "expected a range like '3', '2:5' or '2:', but got 'x'"),
                         (["--layers", "5:2"], "--layers 5:2 is an empty range"),
                         (["--layers", "99"], "the selection --layers 99 matches no site"),
                         (["--kinds", "logits", "--layers", "0"], "the selection --kinds logits, --layers 0 matches no"),
                         (["--model", "nope"], "unknown model 'nope'")):
        assert main(["sites", *bad]) == 2
        assert message in capsys.readouterr().err


def test_user_patch_function_is_a_path(tmp_path, monkeypatch, capsys) -> None:
    """A user's own ``module:function`` patches the model in place and returns an undo callable."""
    (tmp_path / "my_kernels.py").write_text(
        "import torch\n"
        "def patch(model):\n"
        "    norm = model.model.layers[2].post_attention_layernorm\n"
        "    original = norm.forward\n"
        "    def forward(x):\n"
        "        out = original(x)\n"
        "        return out * (1 + 2 ** -7)  # a deliberate scale bug in 'my kernel'\n"
        "    norm.forward = forward\n"
        "    return lambda: delattr(norm, 'forward')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["onset", *SMALL, "--candidate", "my_kernels:patch", "--no-oracle", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["first_difference"]["site"] == "layers.2.post_attention_layernorm"
    assert data["first_difference"]["step"] == 0
    assert main(["onset", "--candidate", "my_kernels:nothing_here"]) == 2
    assert "has no function 'nothing_here'" in capsys.readouterr().err
