"""Tiny vision-language models built from a config, offline, at a size that trains on a CPU, with
the processor that goes with each (`AutoProcessor` reloads both from the saved folder): SmolVLM's
architecture (Idefics3: a SigLIP-style tower, a pixel-shuffle projector, a Llama text model) and
LLaVA-1.5's (a CLIP tower read at its second-to-last layer, a 2-layer GELU MLP, a Llama).

The tokenizer is lmforge's own (trained on the spot); the image tokens each family's processor
writes around an image are added to it as special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from lmforge.config.model_kind import (
    FAMILY_IMAGE_TOKENS,
    IMAGE_TOKENS,
    VISION_PRESETS,
    add_image_tokens,
    preset_family,
    preset_processor,
)
from lmforge.errors import UserInputError

__all__ = [
    "FAMILY_IMAGE_TOKENS",
    "IMAGE_TOKENS",
    "VISION_PRESETS",
    "add_image_tokens",
    "build_vision_model",
    "preset_family",
]


def build_vision_model(
    preset: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: Any = None,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """(model, processor) of a vision preset, randomly initialised, for `tokenizer` (its image
    tokens added). The processor's chat template is the tokenizer's."""
    from transformers import AutoModelForImageTextToText

    _require_preset(preset)
    add_image_tokens(tokenizer, preset)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert isinstance(image_token_id, int)
    config = vision_preset_config(
        preset,
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config.image_token_id = image_token_id
    if config.model_type == "llava":
        config.image_token_index = image_token_id  # LlavaConfig's older name for it
    extra: dict[str, Any] = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if dtype is not None:
        extra["dtype"] = dtype
    model = AutoModelForImageTextToText.from_config(config, **extra)
    return model, preset_processor(preset, tokenizer)


def _require_preset(preset: str) -> None:
    if preset not in VISION_PRESETS:
        raise UserInputError(
            f"model.preset: unknown vision preset {preset!r}; choose one of {', '.join(sorted(VISION_PRESETS))}"
        )


def save_vision_model_dir(out: Any, model: Any, processor: Any) -> None:
    """A vision-language model folder (weights, config, tokenizer, processor) that
    AutoModelForImageTextToText and AutoProcessor load: what `model.path` points a VLM run at."""
    model.save_pretrained(out)
    processor.save_pretrained(out)


# What `lmforge estimate` and MFU know about a VLM, read from its config's shapes alone (no weights,
# no tokenizer), per family; another family is refused by name rather than given numbers computed
# for a layout it does not have.
VISION_FAMILIES = ("idefics3", "llava")
# The processor frames each (unsplit) Idefics3 image's tokens with
# <fake_token_around_image><global-img> before and <fake_token_around_image> after: sequence
# positions the text model runs on too. LLaVA's image is its run of <image> tokens alone.
IDEFICS3_FRAME_TOKENS = 3
# Parameter-name pieces of the image side (tower, projector) of each family, matched as `.experts.`
# is in numerics: they still match under a PEFT or FSDP wrapper's name prefix.
IDEFICS3_VISION_MARKERS: tuple[str, str] = (".vision_model.", ".connector.")
_MARKERS: dict[str, tuple[str, str]] = {
    "idefics3": IDEFICS3_VISION_MARKERS,
    "llava": (".vision_tower.", ".multi_modal_projector."),
}


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config describes a vision-language model (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def vision_preset_config(preset: str, vocab_size: int | None = None, **text_ids: Any) -> Any:
    """The config `build_vision_model` builds for `preset`, without a tokenizer: the same shapes,
    with `vocab_size` (the tokenizer's length, image tokens included) or LlamaConfig's default.
    What the estimate sizes a preset by before any tokenizer exists."""
    from transformers import Idefics3Config, LlamaConfig, LlavaConfig

    _require_preset(preset)
    spec = VISION_PRESETS[preset]
    text = {key: value for key, value in spec["text_config"].items() if key != "model_type"}
    if vocab_size is not None:
        text["vocab_size"] = vocab_size
    text_config = LlamaConfig(**text, **text_ids).to_dict()
    if preset_family(preset) == "llava":
        return LlavaConfig(
            vision_config=dict(spec["vision_config"]),
            text_config=text_config,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            tie_word_embeddings=False,
        )
    return Idefics3Config(
        vision_config=dict(spec["vision_config"]),
        text_config=text_config,
        scale_factor=spec["scale_factor"],
        tie_word_embeddings=False,
    )


def _family(config: Any) -> str:
    """The family of `config` when lmforge knows its layout; a UserInputError naming it otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in VISION_FAMILIES:
        raise UserInputError(
            f"model: lmforge counts the vision side of {', '.join(VISION_FAMILIES)} models only, not "
            f"model_type {model_type!r}; estimate it without its images or add the family to models/vision.py"
        )
    return str(model_type)


def _patches(config: Any, image_size: int | None) -> int:
    """Patches one image is cut into: (side / patch)^2, the side defaulting to the tower's own."""
    _family(config)
    vision = config.vision_config
    side = vision.image_size if image_size is None else image_size
    if side % vision.patch_size:
        raise UserInputError(f"image size {side} is not a multiple of the patch size {vision.patch_size}")
    return int((side // vision.patch_size) ** 2)


@dataclass(frozen=True)
class _Tower:
    """The vision tower's parameters by part and what runs through it, for one image."""

    patch: int  # the patch convolution
    positions: int  # the position table (and CLIP's class embedding): lookups, no FLOPs
    layer: int  # one encoder layer
    norms: int  # the LayerNorms outside the layers (SigLIP: final; CLIP: pre and final)
    layers: int  # encoder layers
    tokens: int  # positions through the tower: the patches (and CLIP's class token)
    backward_layers: int  # layers a gradient reaches: LLaVA reads an earlier layer's output
    backward_norms: int  # the outside LayerNorms a gradient reaches


def _tower(config: Any, image_size: int | None = None) -> _Tower:
    """SigLIP (Idefics3): patch convolution with bias, a position per patch, final LayerNorm.
    CLIP (LLaVA): convolution without bias plus the class embedding, a position per patch and one
    for the class token, LayerNorms before and after the layers; the features come from
    `vision_feature_layer` (-2: the second-to-last layer's output), so the last layer and the final
    LayerNorm run forward but no gradient reaches them. Each encoder layer: q, k, v, out with
    biases, two LayerNorms, fc1 and fc2 with biases."""
    family, vision = _family(config), config.vision_config
    h, inner = vision.hidden_size, vision.intermediate_size
    patches, count = _patches(config, image_size), vision.num_hidden_layers
    layer = 4 * (h * h + h) + 2 * 2 * h + 2 * h * inner + inner + h
    conv = vision.num_channels * vision.patch_size**2 * h
    if family == "llava":
        used = _feature_layers(config.vision_feature_layer, count)
        return _Tower(conv, (_patches(config, None) + 2) * h, layer, 4 * h, count, patches + 1, used, 2 * h)
    return _Tower(conv + h, _patches(config, None) * h, layer, 2 * h, count, patches, count, 2 * h)


def _feature_layers(feature_layer: int | list[int], count: int) -> int:
    """How many encoder layers produce the hidden state(s) LLaVA reads (index 0 is the embeddings'
    output, index i the i-th layer's, negative from the end of the count + 1 states)."""
    layers = feature_layer if isinstance(feature_layer, list) else [feature_layer]
    return max(index if index >= 0 else count + 1 + index for index in layers)


def _text_params(text: Any, tied: bool) -> int:
    """Parameters of a Llama text model and its output head (once when tied to the embeddings)."""
    if text.model_type != "llama":
        raise UserInputError(
            f"model: lmforge counts a VLM's text model for model_type 'llama' only, not {text.model_type!r}"
        )
    d, head_dim = text.hidden_size, text.head_dim or text.hidden_size // text.num_attention_heads
    q, kv = (
        text.num_attention_heads * head_dim,
        (text.num_key_value_heads or text.num_attention_heads) * head_dim,
    )
    attention = d * q + 2 * d * kv + q * d + (q + 2 * kv + d if text.attention_bias else 0)
    mlp = 3 * d * text.intermediate_size + (2 * text.intermediate_size + d if text.mlp_bias else 0)
    embeddings = text.vocab_size * d * (1 if tied else 2)
    return text.num_hidden_layers * (attention + mlp + 2 * d) + d + embeddings


def _projector_params(config: Any) -> int:
    """Idefics3: pixel shuffle, then one bias-free linear from scale^2 x vision width to the text
    width. LLaVA: linear (vision width -> text width), GELU, linear (text -> text), with biases."""
    vision_width, text_width = config.vision_config.hidden_size, config.text_config.hidden_size
    if _family(config) == "llava":
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        return vision_width * text_width + text_width * text_width + (2 * text_width if bias else 0)
    return vision_width * config.scale_factor**2 * text_width


def vision_parts(config: Any) -> dict[str, int]:
    """Parameters of a VLM by part, from its config's shapes: `vision_tower`, `projector` and
    `text` (the language model and its head). The estimate's model states count all three; MFU
    counts the first two per image and the text per token."""
    tower = _tower(config)
    return {
        "vision_tower": tower.patch + tower.positions + tower.layers * tower.layer + tower.norms,
        "projector": _projector_params(config),
        "text": _text_params(config.text_config, bool(config.tie_word_embeddings)),
    }


def image_tokens_per_image(config: Any, image_size: int | None = None) -> int:
    """Image tokens one square image of side `image_size` (default: the tower's) becomes in the text
    sequence. Idefics3: its patches pixel-shuffled by the scale factor in each direction
    (`image_seq_len`), without image splitting, which the presets turn off. LLaVA: one per patch
    (the class token's too with the "full" feature strategy)."""
    patches = _patches(config, image_size)
    if _family(config) == "llava":
        return patches + int(getattr(config, "vision_feature_select_strategy", "default") == "full")
    return patches // int(config.scale_factor) ** 2


def frame_tokens_per_image(config: Any) -> int:
    """Tokens the processor writes around each image's image tokens."""
    return IDEFICS3_FRAME_TOKENS if _family(config) == "idefics3" else 0


def vision_flops_per_image(
    config: Any, *, trainable_vision: bool, trainable_projector: bool = True, image_size: int | None = None
) -> float:
    """Training FLOPs of the vision tower and projector for one image, by the convention of
    `numerics.flops_per_token` (PaLM): 2 per parameter per position forward, 2 more backward for the
    activation gradient, 2 more for the weight gradient of trained weights; attention scores and
    values 4 * L * h * n per position forward (n positions attend to each other), twice that
    backward. The position table is a lookup and not counted, as text embeddings are not.

    Unlike a frozen text layer, a frozen tower runs no backward at all: nothing before it needs a
    gradient (the pixels do not), so it costs its forward only. For the same reason the patch
    convolution never computes an activation gradient, and the projector computes one only to
    feed a trained tower. A gradient reaches only the layers whose output the projector reads."""
    tower, h = _tower(config, image_size), config.vision_config.hidden_size
    patches = _patches(config, image_size)
    behind = tower.layers * tower.layer + tower.norms  # behind the convolution
    forward = (
        tower.tokens * (2.0 * behind + 4.0 * tower.layers * h * tower.tokens) + patches * 2.0 * tower.patch
    )
    backward = 0.0
    if trainable_vision:
        reached = tower.backward_layers * tower.layer + tower.backward_norms
        attention = 4.0 * tower.backward_layers * h * tower.tokens
        backward = (
            tower.tokens * (2.0 * reached + 2.0 * reached + 2.0 * attention) + patches * 2.0 * tower.patch
        )
    per_token = 2.0 * _projector_params(config) * (1 + int(trainable_vision) + int(trainable_projector))
    return forward + backward + image_tokens_per_image(config, image_size) * per_token


def vision_activation_bytes(
    config: Any, *, weight_bytes: int, sdpa: bool, checkpointing: bool, image_size: int | None = None
) -> int:
    """Activations the vision tower and projector save for backward for one image, in bytes, in the
    manner of `distributed.estimate.activation_bytes`. Per patch: the pixels the patch convolution
    keeps (channels x patch^2); per encoder layer and position the two LayerNorms' inputs and
    outputs (4h), q, k, v (3h), the attention output (h: sdpa lays it out for out_proj already, so
    the reshape is a view; measured on Idefics3), fc1's output and its GELU (2I); the final
    LayerNorm's input and the pixel-shuffled copy the projector keeps (2h; CLIP's pre-LayerNorm the
    same). LayerNorm statistics and sdpa's log-sum-exp (a few elements per position) are left out.
    Eager attention adds the heads' n x n scores per layer, counted as for text layers. With
    gradient checkpointing each layer keeps its input only, plus one layer recomputed in full.
    LLaVA (measured within 1% on llava-tiny): CLIP's quick_gelu keeps one more I per position, and
    the MLP projector its hidden layer twice (2 x text width) per image token."""
    tower, vision = _tower(config, image_size), config.vision_config
    n, h = tower.tokens, vision.hidden_size
    # CLIP's quick_gelu (x * sigmoid(1.702 x)) keeps the sigmoid's output as well: 3I, not 2I.
    mlp = (3 if getattr(vision, "hidden_act", "") == "quick_gelu" else 2) * vision.intermediate_size
    per_layer = n * (8 * h + mlp) * weight_bytes
    if not sdpa:  # softmax, dropout output and mask, and the fp32 softmax under mixed precision
        score_bytes = 2 * weight_bytes + 1 + (0 if weight_bytes == 4 else 4)
        per_layer += vision.num_attention_heads * n * n * score_bytes
    layers = tower.layers
    kept = layers * n * h * weight_bytes + per_layer if checkpointing else layers * per_layer
    pixels = _patches(config, image_size) * vision.num_channels * vision.patch_size**2
    # LLaVA's MLP projector keeps its first linear's output and the GELU's per image token.
    projector = 2 * config.text_config.hidden_size * image_tokens_per_image(config, image_size)
    return (pixels + n * 2 * h + (projector if _family(config) == "llava" else 0)) * weight_bytes + kept


def vision_parameter_markers(config: Any) -> tuple[str, str]:
    """Name pieces of the image side's parameters in the model of `config`: (tower, projector)."""
    return _MARKERS[_family(config)]
