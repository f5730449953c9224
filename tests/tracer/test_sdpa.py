"""``--sdpa``: torch's attention backend pinned on a model for every forward — the pinned kernel is the one that runs
(seen at the dispatcher), torch's flags are as before after each forward (an exception included), a twin and a pickled
copy keep the pin (a helper process: test_onset_concurrent), traces and reports say it, and a backend that cannot run is one clear line."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from ulptrace.cli import main
from ulptrace.models import build_model
from ulptrace.run import RunConfig, greedy, make_prompts
from ulptrace.sdpa import check_sdpa, default_note, pin_sdpa, pinned


class _Attention(TorchDispatchMode):
    """The aten ops of a run that belong to attention: the fused SDPA kernels, and the math path's softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "scaled_dot_product" in name or "softmax" in name:
            self.ops.add(name.removeprefix("aten.").split(".")[0])
        return func(*args, **(kwargs or {}))


def _attention_ops(model, mode: str = "eager") -> set[str]:
    seen = _Attention()
    with seen, torch.no_grad():
        greedy(model, make_prompts(model.config.vocab_size, 2, 8, 0, model.device), 3, mode=mode)
    return seen.ops


def _flags() -> tuple[bool, ...]:
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled()


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_the_pinned_backend_is_the_one_that_runs(mode) -> None:
    before = _flags()
    assert _attention_ops(build_model("tiny-qwen3.5"), mode) == {"_scaled_dot_product_flash_attention_for_cpu"}
    pinned_math = build_model("tiny-qwen3.5", sdpa="math")
    ops = _attention_ops(pinned_math, mode)
    assert "_scaled_dot_product_flash_attention_for_cpu" not in ops and "_safe_softmax" in ops
    assert _flags() == before  # torch's choice is back once the forward returns
    assert _attention_ops(build_model("tiny-qwen3.5", sdpa="flash"), mode) \
        == {"_scaled_dot_product_flash_attention_for_cpu"}


def test_the_pin_is_undone_after_a_forward_that_raises() -> None:
    model = build_model("tiny-qwen3.5", sdpa="math")
    before = _flags()
    with pytest.raises(IndexError):
        model(torch.tensor([[model.config.vocab_size + 5]]))  # an embedding index out of range
    assert _flags() == before and model.ulptrace_sdpa_contexts == []


def test_a_twin_and_a_pickled_copy_keep_the_pin() -> None:
    model = build_model("tiny-qwen3.5", sdpa="math")
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert pinned(copied) == "math"
        assert "_scaled_dot_product_flash_attention_for_cpu" not in _attention_ops(copied)


def test_bad_backends_are_one_clear_error(capsys) -> None:
    with pytest.raises(ValueError, match="--sdpa must be one of default, flash, efficient, math, cudnn, but got 'fast'"):
        check_sdpa("fast", "cpu")
    with pytest.raises(ValueError, match="--sdpa cudnn is a CUDA backend .* the device is 'cpu'"):
        RunConfig(sdpa="cudnn").validate()
    with pytest.raises(ValueError, match="pinned to math already; cannot pin it to flash"):
        pin_sdpa(build_model("tiny-qwen3.5", sdpa="math"), "flash")
    assert main(["onset", "--model", "tiny-qwen3.5", "--sdpa", "efficient", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ulptrace: error: --sdpa efficient is a CUDA backend") and "Traceback" not in err


def test_a_pinned_backend_without_a_kernel_names_the_option(monkeypatch) -> None:
    """torch's own 'No available kernel' (raised deep inside its SDPA) becomes a user error naming --sdpa and the
    forward; without a pin the same RuntimeError is left alone (not ours to explain)."""

    def no_kernel(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_kernel)
    model = build_model("tiny-qwen3.5", sdpa="math")
    prompts = make_prompts(model.config.vocab_size, 1, 4, 0)
    with pytest.raises(ValueError, match=r"--sdpa math: torch's math attention cannot run .* eager mode's prefill "
                                         r"\(torch: No available kernel"):
        greedy(model, prompts, 2)
    with pytest.raises(ValueError, match=r"in the static mode's prefill \(torch: No available kernel"):
        greedy(model, prompts, 2, mode="static")
    with pytest.raises(RuntimeError, match="No available kernel"):
        greedy(build_model("tiny-qwen3.5"), prompts, 2)


def test_the_note_on_cuda_defaults() -> None:
    """The note where torch may pick cuDNN's attention — a CUDA device present, torch's choice, cuDNN's attention
    enabled — and none without a CUDA device (the device check's error says what is wrong there)."""
    assert default_note("cpu", "default") is None and default_note("cuda", "flash") is None
    note = default_note("cuda", "default")
    if torch.cuda.is_available() and torch.backends.cuda.cudnn_sdp_enabled():
        assert "--sdpa flash" in note
    else:
        assert note is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA device")
def test_a_missing_cuda_device_is_the_only_word(capsys) -> None:
    """Asked for CUDA where there is none, both commands say so and nothing before it: no note on cuDNN's attention,
    no announcement of a run that cannot start."""
    from ulptrace.probes.norm_rounding import main as norm_main

    assert main(["onset", "--model", "tiny-llama", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device is available on this machine" in err and "note:" not in err
    assert norm_main(["--model", "tiny-llama", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device is available" in err and "note:" not in err and "recording" not in err
    assert norm_main(["--model", "tiny-llama", "--prompt-len", "-3"]) == 2
    err = capsys.readouterr().err
    assert "--prompts and --prompt-len must be >= 1, but got 2 and -3" in err and "recording" not in err


def test_onset_reports_the_pin_and_the_same_findings(tmp_path) -> None:
    """Pinned to math on both sides of an HF-vs-HF onset: parity (both sides run the same kernel), both traces say
    the pin, and a run without one says nothing of it (reports of unpinned runs unchanged)."""
    out = tmp_path / "math.json"
    assert main(["onset", "--model", "tiny-qwen3.5", "--candidate", "hf", "--sdpa", "math", "--quiet",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["reference"]["sdpa"] == data["candidate"]["sdpa"] == "math"
    plain = tmp_path / "plain.json"
    assert main(["onset", "--model", "tiny-qwen3.5", "--candidate", "hf", "--quiet", "--json", str(plain)]) == 0
    assert "sdpa" not in json.loads(plain.read_text())["reference"]



@pytest.mark.gpu
@pytest.mark.parametrize("backend, op", [("flash", "_scaled_dot_product_flash_attention"),
                                         ("cudnn", "_scaled_dot_product_cudnn_attention"),
                                         ("math", "_safe_softmax")])
def test_each_pin_runs_its_kernel_on_cuda(backend, op) -> None:
    """On CUDA every backend is a different aten op: the pinned one runs, prefill and decode, and no other fused
    kernel does (the 0.8B shape's attention: 8 query heads over 2 key/value heads of 256)."""
    model = build_model("qwen3.5-0.8b", device="cuda", sdpa=backend)
    ops = _attention_ops(model)
    fused = {o for o in ops if o.startswith("_scaled_dot_product")}
    assert op in ops and fused <= {op}


@pytest.mark.gpu
def test_a_flash_pin_repeats_its_bits_where_torchs_choice_did_not() -> None:
    """The finding behind --sdpa (H200, torch 2.11): 8 prompts of 512 tokens through the 0.8B shape, three runs'
    logits at every step bitwise the same with the flash pin."""
    model = build_model("qwen3.5-0.8b", device="cuda", sdpa="flash")
    prompts = make_prompts(model.config.vocab_size, 8, 512, 0, "cuda")
    runs = []
    for _ in range(3):
        steps: list[torch.Tensor] = []
        with torch.no_grad():
            greedy(model, prompts, 8, on_logits=lambda step, logits, steps=steps: steps.append(logits[:, -1].clone()))
        runs.append(torch.stack(steps))
    assert all(torch.equal(runs[0].view(torch.int16), r.view(torch.int16)) for r in runs[1:])


def test_the_note_reaches_stderr_unless_quiet(monkeypatch, capsys) -> None:
    """Where the note applies (CUDA, torch's choice, cuDNN's attention enabled) a command says it once on stderr;
    --quiet keeps it out. The device here is a CPU, so the test asks as if it were not."""
    import ulptrace.sdpa

    monkeypatch.setattr(ulptrace.sdpa, "default_note", lambda device, backend: f"note: {device} {backend}")
    assert main(["onset", "--model", "tiny-qwen3.5", "--candidate", "hf", "--no-oracle"]) == 0
    assert capsys.readouterr().err.count("[ulptrace] note: cpu default") == 1
    assert main(["onset", "--model", "tiny-qwen3.5", "--candidate", "hf", "--no-oracle", "--quiet"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_a_compiled_path_refuses_a_pin_it_would_not_honour(capsys) -> None:
    """torch.compile's Inductor lowers attention at compile time and does not read the pin (measured: a math pin left
    the CPU flash kernel in Inductor's code): refused before any build, and when the path meets a pinned model."""
    from ulptrace.paths import apply_path

    with pytest.raises(ValueError, match="path 'compile' compiles the model .* use --sdpa default"):
        RunConfig(candidate="compile", sdpa="math").validate()
    RunConfig(candidate="compile").validate()  # torch's choice: nothing to refuse
    assert main(["onset", "--model", "tiny-qwen3.5", "--reference", "compile:emulate", "--sdpa", "flash",
                 "--quiet"]) == 2
    assert "path 'compile:emulate' compiles the model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--sdpa math pins .* path 'compile'"):
        apply_path(build_model("tiny-qwen3.5", sdpa="math"), "compile")


def test_a_pin_no_attention_call_would_read_is_refused() -> None:
    """Both sides on HF's eager attention: no SDPA call, so a pin is an option that changes nothing — refused; one
    side on SDPA is a pin that holds there."""
    with pytest.raises(ValueError, match=r"use eager attention: the pin would change nothing; drop --sdpa"):
        RunConfig(reference="hf:attn=eager", candidate="hf:attn=eager", sdpa="math").validate()
    RunConfig(reference="hf", candidate="hf:attn=eager", sdpa="math").validate()
