"""Issue 39's estimate and MFU of a vision-language model: the parameter counts read from an
Idefics3 config equal the built model's, the vision FLOPs equal torch's FLOP counter on a real
forward and backward, the saved activations a measurement, and `lmforge estimate` reports the
vision tower and image tokens while a text model's estimate stays as it was."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from lmforge.cli.estimate import estimate
from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.distributed.estimate import Estimate, ModelShape, activation_bytes, vision_estimate
from lmforge.errors import UserInputError
from lmforge.models.vision import (
    build_vision_model,
    image_tokens_per_image,
    vision_activation_bytes,
    vision_flops_per_image,
    vision_parameter_markers,
    vision_parts,
    vision_preset_config,
)
from lmforge.train.numerics import active_parameters, flops_per_token, vlm_rank_flops

PATCHES = 16  # a 32x32 image in 8x8 patches
# smolvlm-tiny with a 300-token tokenizer and its 4 image tokens: tower, projector, text and head.
TOWER, PROJECTOR, TEXT = 80_448, 32_768, 440_960


@pytest.fixture(scope="module")
def tiny_vlm() -> Any:
    """smolvlm-tiny built as a run builds it, on a tokenizer trained on the spot."""
    texts = [f"what colour is the circle? {word} {n}" for word in ("red", "green", "blue") for n in range(50)]
    tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    torch.manual_seed(0)
    model, _ = build_vision_model("smolvlm-tiny", tokenizer)
    return model


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_counts_from_the_config_are_the_built_models(tiny_vlm: Any) -> None:
    parts = vision_parts(tiny_vlm.config)
    assert parts == {
        "vision_tower": _numel(tiny_vlm.model.vision_model),
        "projector": _numel(tiny_vlm.model.connector),
        "text": _numel(tiny_vlm.model.text_model) + _numel(tiny_vlm.lm_head),
    }
    assert sum(parts.values()) == _numel(tiny_vlm)
    # The tokenizer-free config the estimate uses has the same shapes for the same vocabulary.
    assert vision_parts(vision_preset_config("smolvlm-tiny", tiny_vlm.config.text_config.vocab_size)) == parts
    assert vision_parts(vision_preset_config("smolvlm-tiny", 304)) == {
        "vision_tower": TOWER,
        "projector": PROJECTOR,
        "text": TEXT,
    }
    assert image_tokens_per_image(tiny_vlm.config) == 4  # 16 patches, pixel-shuffled by 2 each way
    assert image_tokens_per_image(tiny_vlm.config, 64) == 16


def test_other_families_are_refused_by_name() -> None:
    from transformers import Qwen2VLConfig

    for call in (vision_parts, image_tokens_per_image):
        with pytest.raises(UserInputError, match="not model_type 'qwen2_vl'"):
            call(Qwen2VLConfig())
    with pytest.raises(UserInputError, match="not a multiple of the patch size 8"):
        image_tokens_per_image(vision_preset_config("smolvlm-tiny"), 36)


def test_llava_counts_are_the_built_models_and_its_flops_what_the_counter_measures() -> None:
    """llava-tiny (a CLIP tower read at its second-to-last layer, a 2-layer MLP projector): the
    parts' parameters are the built model's; the FLOPs, with the 1-D parameters' 2 per position
    taken out as for Idefics3, are what torch's counter measures, forward and with the tower
    trained (where no gradient reaches the last layer or the final LayerNorm: their output is not
    read); the activation formula is within 1% of what autograd saves."""
    texts = [f"what colour is the circle? {word} {n}" for word in ("red", "green", "blue") for n in range(50)]
    tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    torch.manual_seed(0)
    model, processor = build_vision_model("llava-tiny", tokenizer)
    config, tower = model.config, model.model.vision_tower
    parts = vision_parts(config)
    assert parts == {
        "vision_tower": _numel(tower),
        "projector": _numel(model.model.multi_modal_projector),
        "text": _numel(model.model.language_model) + _numel(model.lm_head),
    }
    assert sum(parts.values()) == _numel(model)
    assert vision_parts(vision_preset_config("llava-tiny", config.text_config.vocab_size)) == parts
    assert image_tokens_per_image(config) == 16 and processor.num_additional_image_tokens == 1
    assert vision_parameter_markers(config) == (".vision_tower.", ".multi_modal_projector.")

    def counted(*, backward: bool) -> int:
        with FlopCounterMode(display=False) as counter:
            features = model.model.get_image_features(torch.randn(1, 3, 32, 32))
            features = features.pooler_output if hasattr(features, "pooler_output") else features
            if backward:
                torch.cat(list(features)).sum().backward()
        model.zero_grad(set_to_none=True)
        return int(counter.get_total_flops())

    positions, layer = 17, tower.encoder.layers[0]  # 16 patches + the class token
    one_d = lambda module: sum(p.numel() for p in module.parameters() if p.ndim == 1)  # noqa: E731
    elementwise = one_d(tower) - tower.embeddings.class_embedding.numel()
    reached = one_d(layer) + one_d(tower.pre_layrnorm)  # the 1-D parameters a gradient reaches
    biases = 16 * one_d(model.model.multi_modal_projector)  # the projector's, per image token
    model.set_attn_implementation("eager")
    try:
        forward = vision_flops_per_image(config, trainable_vision=False, trainable_projector=False)
        assert forward - 2 * positions * elementwise - 2 * biases == counted(backward=False)
        trained = vision_flops_per_image(config, trainable_vision=True)
        not_seen = 2 * positions * elementwise + 4 * positions * reached + 6 * biases
        assert trained - not_seen == counted(backward=True)
    finally:
        model.set_attn_implementation("sdpa")
    measured = _saved_bytes(model, torch.randn(1, 3, 32, 32))
    formula = vision_activation_bytes(config, weight_bytes=4, sdpa=True, checkpointing=False)
    print("llava-tiny activations: formula", formula, "measured", measured)
    assert abs(formula - measured) <= 0.01 * measured


def _counted(model: Any, *, backward: bool) -> int:
    """FLOPs torch's counter sees for one 32x32 image through the tower and the projector."""
    pixels = torch.randn(1, 1, 3, 32, 32)
    with FlopCounterMode(display=False) as counter:
        features = model.model.get_image_features(pixels).pooler_output[0]
        if backward:
            features.sum().backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def test_vision_flops_are_what_the_flop_counter_measures(tiny_vlm: Any) -> None:
    """The counter counts matmuls and convolutions exactly and nothing else: not the 2 FLOPs per
    patch the formula charges each bias and LayerNorm parameter (1-D), as PaLM's 6N charges every
    weight. With those taken out the two agree to the FLOP (tolerance 0). The counter has no
    formula for the CPU's sdpa kernel, so the tower runs eager attention here: its two batched
    matmuls are the formula's 4 L h n per patch."""
    config = tiny_vlm.config
    tower = tiny_vlm.model.vision_model
    elementwise = sum(p.numel() for p in tower.parameters() if p.ndim == 1)
    conv_bias = tower.embeddings.patch_embedding.bias.numel()
    tiny_vlm.set_attn_implementation("eager")
    try:
        forward = vision_flops_per_image(config, trainable_vision=False, trainable_projector=False)
        assert forward - 2 * PATCHES * elementwise == _counted(tiny_vlm, backward=False) == 2_883_584
        # All trained: activation gradients everywhere but into the pixels, weight gradients everywhere.
        trained = vision_flops_per_image(config, trainable_vision=True)
        not_seen = PATCHES * (2 * elementwise + 2 * (elementwise - conv_bias) + 2 * elementwise)
        assert trained - not_seen == _counted(tiny_vlm, backward=True)
        # A frozen tower runs no backward: only the projector's weight gradient follows its forward.
        for param in tower.parameters():
            param.requires_grad_(False)
        frozen = vision_flops_per_image(config, trainable_vision=False)
        assert frozen - 2 * PATCHES * elementwise == _counted(tiny_vlm, backward=True)
        assert frozen - forward == 2 * 4 * PROJECTOR  # 4 image tokens through the projector
    finally:
        tiny_vlm.set_attn_implementation("sdpa")
        for param in tower.parameters():
            param.requires_grad_(True)


def _saved_bytes(model: Any, pixels: torch.Tensor) -> int:
    """Bytes autograd keeps for backward over the image features of `pixels` (parameters not
    counted, each storage once)."""
    weights = {p.data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(saved: torch.Tensor) -> torch.Tensor:
        if saved.data_ptr() not in weights:
            storages[saved.untyped_storage().data_ptr()] = saved.untyped_storage().nbytes()
        return saved

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda saved: saved):
        model.model.get_image_features(pixels)
    return sum(storages.values())


def test_vision_activations_are_what_autograd_saves(tiny_vlm: Any) -> None:
    """Bytes autograd keeps for backward over one image (sdpa, fp32; parameters not counted, a
    storage once), against the formula: within 2%, the LayerNorm statistics, sdpa's log-sum-exp
    and the position ids it leaves out (16 elements per patch of 1,872 measured)."""
    measured = _saved_bytes(tiny_vlm, torch.randn(1, 1, 3, 32, 32))
    formula = vision_activation_bytes(tiny_vlm.config, weight_bytes=4, sdpa=True, checkpointing=False)
    assert formula == PATCHES * (192 + 2 * 64 + 2 * (8 * 64 + 2 * 128)) * 4 == 118_784
    assert measured == 119_808 and abs(formula - measured) <= 0.02 * measured


def test_mfu_counts_the_text_per_token_and_the_image_side_per_image(tiny_vlm: Any) -> None:
    text = tiny_vlm.model.text_model
    layers, hidden = tiny_vlm.config.text_config.num_hidden_layers, tiny_vlm.config.text_config.hidden_size
    text_weights = _numel(text) - text.embed_tokens.weight.numel() + _numel(tiny_vlm.lm_head)  # no lookup
    flops = vlm_rank_flops(tiny_vlm, seq_len=64)
    assert flops.text_per_token == flops_per_token(text_weights, layers, hidden, 64)
    assert flops.per_image == vision_flops_per_image(tiny_vlm.config, trainable_vision=True)
    assert flops.step(tokens=640, images=10) == 640 * flops.text_per_token + 10 * flops.per_image
    assert flops.per_token(640, 10) == flops.step(640, 10) / 640
    # Without `skip` every weight counts per token, the tower's attention layers among the text's.
    whole = active_parameters(tiny_vlm)
    assert whole.layers == 4 and whole.total > text_weights
    for param in tiny_vlm.model.vision_model.parameters():
        param.requires_grad_(False)
    try:
        frozen = vlm_rank_flops(tiny_vlm, seq_len=64)
    finally:
        for param in tiny_vlm.model.vision_model.parameters():
            param.requires_grad_(True)
    assert frozen.per_image == vision_flops_per_image(tiny_vlm.config, trainable_vision=False)
    assert frozen.text_per_token == flops.text_per_token


def _estimate(tmp_path: Path, model: str, *args: str) -> tuple[int, str]:
    config = tmp_path / f"{model.replace(': ', '-')}.yaml"
    config.write_text(
        f"model:\n  {model}\ntokenizer:\n  train:\n    vocab_size: 300\n"
        "data:\n  train:\n    - path: builtin:python-stdlib\n  max_length: 64\n"
        "train:\n  micro_batch_size: 2\n  precision: bf16\n"
    )
    app = typer.Typer()
    app.command("estimate")(estimate)
    app.command("other")(lambda: None)  # a second command keeps `estimate` a subcommand
    result = CliRunner().invoke(app, ["estimate", str(config), "--gpu-mem", "24GB", *args])
    return result.exit_code, result.output


def test_estimate_counts_the_vision_tower_and_the_image_tokens(tmp_path: Path) -> None:
    code, output = _estimate(tmp_path, "preset: smolvlm-tiny")
    assert code == 0, output
    assert "vision tower 80,448 + projector 32,768 parameters" in output
    assert "4 image tokens per 32x32 image (7 sequence tokens" in output
    assert "assuming 1 image per sample" in output and "counted in the model states as trained" in output
    code, output = _estimate(tmp_path, "preset: smolvlm-tiny", "--json")
    assert code == 0, output
    doc = json.loads(output)
    bf16_image = PATCHES * (192 + 2 * 64 + 2 * (8 * 64 + 2 * 128)) * 2  # the measured layout, 2 bytes
    assert doc["vision"] == {
        "model_type": "idefics3",
        "vision_tower_params": TOWER,
        "projector_params": PROJECTOR,
        "text_params": TEXT,
        "trainable": True,
        "images_per_sample": 1,
        "image_size": 32,
        "image_tokens_per_image": 4,
        "sequence_tokens_per_image": 7,
        "activations_per_image": bf16_image,
        "activations": 2 * bf16_image,
        "flops_per_image": vision_flops_per_image(
            vision_preset_config("smolvlm-tiny"), trainable_vision=True
        ),
    }
    total = TOWER + PROJECTOR + TEXT
    assert doc["model"]["total_params"] == total and doc["model"]["hidden_size"] == 128
    assert doc["strategies"][0]["model_states_gpu"] == 20 * total  # bf16 weights 2 + DeepSpeed's 18
    text_only = activation_bytes(
        ModelShape(**doc["model"]), batch=2, seq=64, weight_bytes=2, checkpointing=False, sdpa=True
    )
    assert doc["activations_no_checkpointing"] == text_only + 2 * bf16_image
    # LLaVA: 16 image tokens an image and nothing around them; its tokenizer gains one token.
    code, output = _estimate(tmp_path, "preset: llava-tiny", "--json")
    assert code == 0, output
    llava = json.loads(output)["vision"]
    assert llava["model_type"] == "llava" and llava["image_tokens_per_image"] == 16
    assert llava["sequence_tokens_per_image"] == 16
    assert (llava["vision_tower_params"], llava["projector_params"]) == (80_640, 24_832)
    assert llava["text_params"] == TEXT - 3 * 2 * 128  # 301 tokens, not 304: 3 fewer rows in 2 tables


def test_estimate_refuses_a_sequence_without_room_for_the_image() -> None:
    """data.max_length's own floor (8) holds smolvlm-tiny's 7 tokens, so the check is called directly;
    it matters for real sizes (SmolVLM's 64 image tokens per image, more with image splitting)."""
    with pytest.raises(UserInputError, match="data.max_length: 6 tokens cannot hold a sample's 1 image"):
        vision_estimate(
            vision_preset_config("smolvlm-tiny"),
            batch=1,
            seq=6,
            weight_bytes=2,
            checkpointing=False,
            sdpa=True,
        )


def test_a_text_models_estimate_has_no_vision_fields(tmp_path: Path) -> None:
    code, output = _estimate(tmp_path, "preset: llama-tiny", "--json")
    assert code == 0, output
    doc = json.loads(output)
    fields = {f.name for f in dataclasses.fields(Estimate)} - {"vision"}
    assert set(doc) == fields | {"layouts", "recommendation", "gpu_mem_source"}
    assert doc["model"]["total_params"] == 2_979_072  # 4 layers of width 256, a tied 300-token table
    text_only = activation_bytes(
        ModelShape(**doc["model"]), batch=2, seq=64, weight_bytes=2, checkpointing=False, sdpa=True
    )
    assert doc["activations_no_checkpointing"] == text_only
