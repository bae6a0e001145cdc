"""Tiny vision-language models built from a config, offline: SmolVLM's architecture (Idefics3: a
SigLIP-style vision tower, a pixel-shuffle projector, a Llama text model) at a size that trains on
a CPU, with the processor that goes with it (`AutoProcessor` reloads both from the saved folder).

The tokenizer is lmforge's own (trained on the spot); the image tokens Idefics3's processor
writes around each image are added to it as special tokens.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from lmforge.config.model_kind import IMAGE_TOKENS, VISION_PRESETS, add_image_tokens, preset_processor
from lmforge.errors import UserInputError

__all__ = ["IMAGE_TOKENS", "VISION_PRESETS", "add_image_tokens", "build_vision_model"]


def build_vision_model(
    preset: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: Any = None,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """(model, processor) of a vision preset, randomly initialised, for `tokenizer` (its image
    tokens added). The processor's chat template is the tokenizer's."""
    from transformers import AutoModelForImageTextToText, Idefics3Config, LlamaConfig

    if preset not in VISION_PRESETS:
        raise UserInputError(
            f"model.preset: unknown vision preset {preset!r}; choose one of {', '.join(sorted(VISION_PRESETS))}"
        )
    spec = VISION_PRESETS[preset]
    add_image_tokens(tokenizer)
    text = dict(spec["text_config"])
    text.pop("model_type")
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **text,
    )
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert isinstance(image_token_id, int)
    config = Idefics3Config(
        vision_config=spec["vision_config"],
        text_config=text_config.to_dict(),
        scale_factor=spec["scale_factor"],
        image_token_id=image_token_id,
        tie_word_embeddings=False,
    )
    extra: dict[str, Any] = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if dtype is not None:
        extra["dtype"] = dtype
    model = AutoModelForImageTextToText.from_config(config, **extra)
    return model, preset_processor(preset, tokenizer)


def save_vision_model_dir(out: Any, model: Any, processor: Any) -> None:
    """A vision-language model folder (weights, config, tokenizer, processor) that
    AutoModelForImageTextToText and AutoProcessor load: what `model.path` points a VLM run at."""
    model.save_pretrained(out)
    processor.save_pretrained(out)


# What `lmforge estimate` and MFU know about a VLM, read from its config's shapes alone (no weights,
# no tokenizer). Idefics3 only for now: another family is refused by name rather than given numbers
# computed for a layout it does not have.
VISION_FAMILIES = ("idefics3",)
# The processor frames each (unsplit) image's tokens with <fake_token_around_image><global-img> before
# and <fake_token_around_image> after: sequence positions the text model runs on too.
IDEFICS3_FRAME_TOKENS = 3
# Parameter-name pieces of the image side of an Idefics3 model (tower and projector), matched as
# `.experts.` is in numerics: they still match under a PEFT or FSDP wrapper's name prefix.
IDEFICS3_VISION_MARKERS: tuple[str, str] = (".vision_model.", ".connector.")


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config describes a vision-language model (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def vision_preset_config(preset: str, vocab_size: int | None = None) -> Any:
    """The Idefics3Config `build_vision_model` builds for `preset`, without a tokenizer: the same
    shapes, with `vocab_size` (the tokenizer's length, image tokens included) or LlamaConfig's
    default. What the estimate sizes a preset by before any tokenizer exists."""
    from transformers import Idefics3Config, LlamaConfig

    if preset not in VISION_PRESETS:
        raise UserInputError(
            f"model.preset: unknown vision preset {preset!r}; choose one of {', '.join(sorted(VISION_PRESETS))}"
        )
    spec = VISION_PRESETS[preset]
    text = {key: value for key, value in spec["text_config"].items() if key != "model_type"}
    if vocab_size is not None:
        text["vocab_size"] = vocab_size
    return Idefics3Config(
        vision_config=spec["vision_config"],
        text_config=LlamaConfig(**text).to_dict(),
        scale_factor=spec["scale_factor"],
        tie_word_embeddings=False,
    )


def _idefics3(config: Any) -> Any:
    """`config` itself when lmforge knows its family's layout; a UserInputError naming it otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in VISION_FAMILIES:
        raise UserInputError(
            f"model: lmforge counts the vision side of {', '.join(VISION_FAMILIES)} models only, not "
            f"model_type {model_type!r}; estimate it without its images or add the family to models/vision.py"
        )
    return config


def _patches(config: Any, image_size: int | None) -> int:
    """Patches one image is cut into: (side / patch)^2, the side defaulting to the tower's own."""
    vision = _idefics3(config).vision_config
    side = vision.image_size if image_size is None else image_size
    if side % vision.patch_size:
        raise UserInputError(f"image size {side} is not a multiple of the patch size {vision.patch_size}")
    return int((side // vision.patch_size) ** 2)


def _tower_shapes(config: Any) -> dict[str, int]:
    """Parameters of the Idefics3 (SigLIP) vision tower by part: the patch convolution (weight and
    bias), the position table, one encoder layer (q, k, v, out with biases, two LayerNorms, fc1 and
    fc2 with biases) and the final LayerNorm."""
    vision = _idefics3(config).vision_config
    h, inner = vision.hidden_size, vision.intermediate_size
    return {
        "patch": vision.num_channels * vision.patch_size**2 * h + h,
        "positions": _patches(config, None) * h,
        "layer": 4 * (h * h + h) + 2 * 2 * h + 2 * h * inner + inner + h,
        "post_norm": 2 * h,
    }


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


def vision_parts(config: Any) -> dict[str, int]:
    """Parameters of a VLM by part, from its config's shapes: `vision_tower`, `projector` (the
    connector: pixel shuffle, then one bias-free linear from scale^2 x vision width to the text
    width) and `text` (the language model and its head). The estimate's model states count all
    three; MFU counts the first two per image and the text per token."""
    config = _idefics3(config)
    tower = _tower_shapes(config)
    return {
        "vision_tower": tower["patch"]
        + tower["positions"]
        + config.vision_config.num_hidden_layers * tower["layer"]
        + tower["post_norm"],
        "projector": config.vision_config.hidden_size
        * config.scale_factor**2
        * config.text_config.hidden_size,
        "text": _text_params(config.text_config, bool(config.tie_word_embeddings)),
    }


def image_tokens_per_image(config: Any, image_size: int | None = None) -> int:
    """Image tokens one square image of side `image_size` (default: the tower's) becomes in the text
    sequence: its patches, pixel-shuffled by the scale factor in each direction (Idefics3's
    `image_seq_len`). Without image splitting, which the presets turn off."""
    return _patches(config, image_size) // int(_idefics3(config).scale_factor) ** 2


def vision_flops_per_image(
    config: Any, *, trainable_vision: bool, trainable_projector: bool = True, image_size: int | None = None
) -> float:
    """Training FLOPs of the vision tower and projector for one image, by the convention of
    `numerics.flops_per_token` (PaLM): 2 per parameter per patch forward, 2 more backward for the
    activation gradient, 2 more for the weight gradient of trained weights; attention scores and
    values 4 * L * h * n per patch forward (n patches attend to each other), twice that backward.
    The position table is a lookup and not counted, as text embeddings are not.

    Unlike a frozen text layer, a frozen tower runs no backward at all: nothing before it needs a
    gradient (the pixels do not), so it costs its forward only. For the same reason the patch
    convolution never computes an activation gradient, and the projector computes one only to
    feed a trained tower."""
    config = _idefics3(config)
    vision = config.vision_config
    patches = _patches(config, image_size)
    tower = _tower_shapes(config)
    layers = vision.num_hidden_layers * tower["layer"] + tower["post_norm"]  # behind the convolution
    attention = 4.0 * vision.num_hidden_layers * vision.hidden_size * patches  # per patch, forward
    per_patch = 2.0 * (tower["patch"] + layers) + attention
    if trainable_vision:
        per_patch += 2.0 * layers + 2.0 * (tower["patch"] + layers) + 2.0 * attention
    projector = vision_parts(config)["projector"]
    per_token = 2.0 * projector * (1 + int(trainable_vision) + int(trainable_projector))
    return patches * per_patch + image_tokens_per_image(config, image_size) * per_token


def vision_activation_bytes(
    config: Any, *, weight_bytes: int, sdpa: bool, checkpointing: bool, image_size: int | None = None
) -> int:
    """Activations the vision tower and projector save for backward for one image, in bytes, in the
    manner of `distributed.estimate.activation_bytes`. Per patch: the pixels the patch convolution
    keeps (channels x patch^2); per encoder layer the two LayerNorms' inputs and outputs (4h), q, k,
    v (3h), the attention output (h: sdpa lays it out for out_proj already, so the reshape is a
    view; measured), fc1's output and its GELU (2I); the final LayerNorm's input and the
    pixel-shuffled copy the projector keeps (2h). LayerNorm statistics and sdpa's log-sum-exp (a
    few elements per patch) are left out. Eager attention adds the heads' n x n scores per layer,
    counted as for text layers. With gradient checkpointing each layer keeps its input only, plus
    one layer recomputed in full."""
    vision = _idefics3(config).vision_config
    patches, h = _patches(config, image_size), vision.hidden_size
    per_layer = patches * (8 * h + 2 * vision.intermediate_size) * weight_bytes
    if not sdpa:  # softmax, dropout output and mask, and the fp32 softmax under mixed precision
        score_bytes = 2 * weight_bytes + 1 + (0 if weight_bytes == 4 else 4)
        per_layer += vision.num_attention_heads * patches * patches * score_bytes
    layers = vision.num_hidden_layers
    kept = layers * patches * h * weight_bytes + per_layer if checkpointing else layers * per_layer
    return patches * (vision.num_channels * vision.patch_size**2 + 2 * h) * weight_bytes + kept


def vision_parameter_markers(config: Any) -> tuple[str, str]:
    """Name pieces of the image side's parameters in the model of `config`: (tower, projector)."""
    _idefics3(config)
    return IDEFICS3_VISION_MARKERS
