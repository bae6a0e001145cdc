"""Model sources: presets, inline configs, local HF directories, and the safety rules for weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.models.build import build_model, count_parameters
from lmforge.train.precision import resolve_precision


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    text = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 200
    return train_tokenizer(text, TokenizerTrainConfig(vocab_size=400, min_frequency=1))


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "mistral-tiny", "gpt2-tiny"])
def test_presets_build_about_5m_parameters_sized_to_the_tokenizer(preset: str, tokenizer) -> None:
    model = build_model(ModelConfig(preset=preset), tokenizer, max_length=128)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert 0.5e6 < count_parameters(model) < 6e6  # the 400-token vocab makes them smaller than with 8k


def test_inline_config_overrides_preset_and_any_architecture_builds(tokenizer) -> None:
    model = build_model(
        ModelConfig(preset="llama-tiny", config={"num_hidden_layers": 1}), tokenizer, max_length=64
    )
    assert model.config.num_hidden_layers == 1
    phi = build_model(
        ModelConfig(
            config={
                "model_type": "phi3",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
            }
        ),
        tokenizer,
        max_length=64,
    )
    assert phi.config.model_type == "phi3"


def test_unknown_preset_lists_valid_ones(tokenizer) -> None:
    with pytest.raises(UserInputError, match="choose one of gpt2-tiny, llama-tiny"):
        build_model(ModelConfig(preset="llama-huge"), tokenizer, max_length=64)


def test_sequence_longer_than_position_table_is_refused(tokenizer, tmp_path: Path) -> None:
    model = build_model(ModelConfig(preset="gpt2-tiny"), tokenizer, max_length=64)
    model.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(
        UserInputError,
        match="data.max_length=4096 exceeds the model's max_position_embeddings=1024; lower data.max_length",
    ):
        build_model(ModelConfig(path=str(tmp_path / "gpt2")), tokenizer, max_length=4096)


def test_local_directory_loads_safetensors_with_same_weights(tokenizer, tmp_path: Path) -> None:
    model = build_model(ModelConfig(preset="llama-tiny"), tokenizer, max_length=64)
    model.save_pretrained(tmp_path / "m")
    loaded = build_model(ModelConfig(path=str(tmp_path / "m")), tokenizer, max_length=64)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_score_head_on_a_causal_lm_is_one_line_and_a_missing_body_weight_is_named(
    tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reward model starts from a causal LM: the new score head is expected and said in one line;
    a body weight the directory lacks is a warning that names it (it would start random)."""
    model = build_model(ModelConfig(preset="llama-tiny"), tokenizer, max_length=64)
    model.save_pretrained(tmp_path / "lm")
    with caplog.at_level(logging.INFO):
        build_model(ModelConfig(path=str(tmp_path / "lm")), tokenizer, max_length=64, head="score")
    ours = [r for r in caplog.records if r.name == "lmforge.models.build"]
    assert [(r.levelname, r.getMessage()) for r in ours] == [
        ("INFO", f"model: a new score head (score, one output) on {tmp_path / 'lm'}; this run trains it")
    ]
    weights = load_file(str(tmp_path / "lm" / "model.safetensors"))
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "lm" / "model.safetensors"), metadata={"format": "pt"})
    caplog.clear()
    with caplog.at_level(logging.INFO):
        build_model(ModelConfig(path=str(tmp_path / "lm")), tokenizer, max_length=64, head="score")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        f"model.path: {tmp_path / 'lm'} lacks 1 weight(s) of the model besides its score head "
        "(model.layers.0.mlp.up_proj.weight): they start random (transformers' load report is in train.log)"
    ]


@pytest.mark.usefixtures("unreachable_hub")
def test_a_model_path_not_made_yet_fails_at_once_without_a_hub(
    tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused at once without a hub, unless the hub id was downloaded before: a model in the local hub
    cache loads offline, as transformers loads it."""
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UserInputError, match=r"^model.path: 'runs/sft' is no local directory .*Connection refused"
    ):
        build_model(ModelConfig(path="runs/sft"), tokenizer, max_length=64)
    cache = tmp_path / "hub-cache"
    snapshot = cache / "models--owner--tiny" / "snapshots" / ("0" * 40)
    build_model(ModelConfig(preset="llama-tiny"), tokenizer, max_length=64).save_pretrained(snapshot)
    (cache / "models--owner--tiny" / "refs").mkdir()
    (cache / "models--owner--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(
        huggingface_hub.constants, "HF_HUB_OFFLINE", True
    )  # HF_HUB_OFFLINE=1, as read at import
    assert build_model(ModelConfig(path="owner/tiny"), tokenizer, max_length=64).config.model_type == "llama"


def test_bin_weights_need_explicit_opt_in(tokenizer, tmp_path: Path) -> None:
    model = build_model(ModelConfig(preset="llama-tiny"), tokenizer, max_length=64)
    model.config.save_pretrained(tmp_path / "legacy")
    torch.save(model.state_dict(), tmp_path / "legacy" / "pytorch_model.bin")
    with pytest.raises(UserInputError, match="only legacy .bin weights.*model.allow_bin_weights=true"):
        build_model(ModelConfig(path=str(tmp_path / "legacy")), tokenizer, max_length=64)
    loaded = build_model(
        ModelConfig(path=str(tmp_path / "legacy"), allow_bin_weights=True), tokenizer, max_length=64
    )
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_directory_without_config_is_explained(tokenizer, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match="has no config.json"):
        build_model(ModelConfig(path=str(tmp_path / "empty")), tokenizer, max_length=64)


def test_remote_code_is_off_unless_asked() -> None:
    assert ModelConfig(preset="llama-tiny").trust_remote_code is False


def test_precision_auto_follows_native_bf16_on_cpu_and_gpu() -> None:
    assert resolve_precision("auto", use_cuda=False, native_bf16=True) == "bf16"
    assert resolve_precision("auto", use_cuda=False, native_bf16=False) == "fp32"
    assert resolve_precision("auto", use_cuda=True, native_bf16=False) == "fp16"
    assert resolve_precision("fp32", use_cuda=True, native_bf16=True) == "fp32"
    with pytest.raises(UserInputError, match="fp16 needs a CUDA GPU"):
        resolve_precision("fp16", use_cuda=False)


def test_loaded_model_runs_forward_with_from_pretrained(tokenizer, tmp_path: Path) -> None:
    build_model(ModelConfig(preset="qwen2-tiny"), tokenizer, max_length=64).save_pretrained(tmp_path / "q")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    out = model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(out.loss)
