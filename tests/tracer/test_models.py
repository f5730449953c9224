"""Embedded models: no download, seeded, realistic parameters, non-degenerate greedy decoding."""

from __future__ import annotations

import pytest
import torch
from ulptrace.catalog import MODELS
from ulptrace.models import build_model, count_parameters, list_models, twin
from ulptrace.run import greedy, make_prompts


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-llama"])
def test_greedy_decoding_is_not_degenerate(name: str) -> None:
    model = build_model(name)
    prompts = make_prompts(model.config.vocab_size, 4, 12, seed=0)
    tokens = greedy(model, prompts, 16)
    assert tokens.shape == (4, 16)
    for row in tokens.tolist():
        assert len(set(row)) >= 8, f"{name}: degenerate greedy row {row}"


def test_same_seed_same_weights_other_seed_differs() -> None:
    a, b, c = build_model("tiny-qwen3.5", seed=3), build_model("tiny-qwen3.5", seed=3), build_model("tiny-qwen3.5", seed=4)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-llama"])
def test_a_twin_is_a_second_build_without_drawing_again(name: str) -> None:
    """build_pair builds once and copies: the copy must be what a second build gives — every parameter and buffer
    bitwise, the same outputs, its own memory — and the random state after it the state after two builds."""
    first = build_model(name, seed=5)
    second = build_model(name, seed=5)
    after_two = torch.get_rng_state()
    built = build_model(name, seed=5)
    copy = twin(built)
    assert torch.equal(torch.get_rng_state(), after_two)
    for (name_a, a), (name_b, b) in zip(second.state_dict().items(), copy.state_dict().items(), strict=True):
        assert name_a == name_b and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(dict(copy.named_buffers()).values(),
                                                   dict(first.named_buffers()).values(), strict=True))
    prompts = make_prompts(first.config.vocab_size, 2, 8, seed=0)
    assert torch.equal(copy(prompts).logits, first(prompts).logits)
    param = next(copy.parameters())
    before = next(built.parameters()).clone()
    param.data.add_(1)  # its own storage: the model it was copied from is untouched
    assert torch.equal(next(built.parameters()), before)
    assert copy.ulptrace_model_name == built.ulptrace_model_name and copy.ulptrace_seed == 5


def test_prepare_imports_what_a_build_needs_and_builds_nothing() -> None:
    """A process handed its model prepares by importing the model's modules (most of a first build's time); in a
    fresh interpreter: the model's modeling module imported, an unknown name refused as build_model refuses it."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from ulptrace.models import prepare\n"
            "name = 'transformers.models.llama.modeling_llama'\n"
            "assert name not in sys.modules\n"
            "prepare('tiny-llama')\n"
            "assert name in sys.modules\n"
            "try:\n    prepare('no-such-model')\nexcept KeyError as e:\n    print('refused', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "refused" in done.stdout and "tiny-llama" in done.stdout  # the error lists the known names


def test_parameters_have_realistic_spread() -> None:
    model = build_model("tiny-qwen3.5")
    assert model.dtype == torch.bfloat16
    assert model.config.tie_word_embeddings is False
    layer = model.model.layers[0]
    # zero-centred norm: (1 + w) with w spread around 0, never the all-zero init that hides (1 + w) defects
    w = layer.input_layernorm.weight.float()
    assert 0.05 < w.std() < 0.5 and abs(w.mean()) < 0.1
    # the gated norm scales by w directly: spread around 1
    g = layer.linear_attn.norm.weight.float()
    assert 0.05 < g.std() < 0.5 and abs(g.mean() - 1) < 0.1
    gdn = layer.linear_attn
    assert gdn.dt_bias.float().std() > 0.3
    a = gdn.A_log.float().exp()
    assert (a > 0.01).all() and (a < 16.01).all() and a.std() > 0.5
    llama = build_model("tiny-llama")
    lw = llama.model.layers[0].input_layernorm.weight.float()
    assert 0.05 < lw.std() < 0.5 and abs(lw.mean() - 1) < 0.1


def test_real_shape_config_matches_shared_json() -> None:
    import json
    from pathlib import Path

    shared = Path(__file__).resolve().parents[3] / "shared" / "models" / "qwen3.5-0.8b.json"
    if not shared.exists():
        pytest.skip("shared/models not beside this checkout")
    expected = {k: v for k, v in json.loads(shared.read_text()).items() if not k.startswith("_") and k != "model_type"}
    assert MODELS["qwen3.5-0.8b"].config == expected


def test_list_models_and_unknown_name() -> None:
    listed = {m["name"]: m for m in list_models()}
    assert set(listed) == {"tiny-qwen3.5", "tiny-llama", "qwen3.5-0.8b"}
    for name, spec in MODELS.items():  # the table's counts are the models' (built on the meta device)
        assert listed[name]["parameters"] == spec.parameters == count_parameters(name), name
    assert 700e6 < listed["qwen3.5-0.8b"]["parameters"] < 900e6
    with pytest.raises(KeyError, match="unknown model 'nope'.*tiny-qwen3.5.*tiny-llama"):
        build_model("nope")


def test_local_checkpoint_directory_loads(tmp_path) -> None:
    model = build_model("tiny-llama")
    model.save_pretrained(tmp_path / "ckpt")
    loaded = build_model(str(tmp_path / "ckpt"))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_decoder_layers_found_once_and_again_when_the_list_is_replaced() -> None:
    """``ulptrace.sites.decoder_layers`` remembers where a model's layer list is (a site's formula looks its layer up
    there for every site), and finds the list again when a path puts another one in its place."""
    from ulptrace.sites import decoder_layers

    model = build_model("tiny-llama")
    layers = decoder_layers(model)
    assert layers is model.model.layers and len(layers) == model.config.num_hidden_layers
    assert decoder_layers(model) is layers
    model.model.layers = torch.nn.ModuleList(list(layers)[:1])
    assert decoder_layers(model) is model.model.layers and len(decoder_layers(model)) == 1
    with pytest.raises(ValueError, match="no ModuleList of decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("tied", [False, True])
def test_the_draws_give_the_weights_their_definition_gives(tied: bool) -> None:
    """``realistic_init_`` draws in place and skips the arithmetic of a tied embedding's first draw, which the output
    embedding's draw overwrites: the weights must stay bitwise what the definition — every draw ``randn * std + mean``
    out of place, each embedding drawn in turn, one seeded generator — gives (the embedded models' weights, and so
    every report, unchanged). Both a tied and an untied model; every parameter compared by its bits."""
    import copy

    import transformers
    from ulptrace.models import _config, realistic_init_

    config = _config(MODELS["tiny-qwen3.5"])
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    built = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert (built.get_input_embeddings().weight is built.get_output_embeddings().weight) is tied
    expected = copy.deepcopy(built)
    gen = torch.Generator().manual_seed(7 + 1)
    with torch.no_grad():  # the definition, written out
        for module in expected.modules():
            if "RMSNorm" in type(module).__name__:
                mean = 0.0 if "Qwen3_5RMSNorm" == type(module).__name__ else 1.0
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.15 + mean)
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.A_log.copy_((torch.rand(module.A_log.shape, generator=gen) * 15.99 + 0.01).log())
                module.dt_bias.copy_(torch.randn(module.dt_bias.shape, generator=gen) * 1.0 + 0.0)
        std = config.initializer_range
        for emb in (expected.get_input_embeddings(), expected.get_output_embeddings()):
            emb.weight.copy_(torch.randn(emb.weight.shape, generator=gen) * (4 * std) + 0.0)
    realistic_init_(built, 7)
    for (name, a), (_, b) in zip(built.state_dict().items(), expected.state_dict().items(), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
