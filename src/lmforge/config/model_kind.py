"""What kind of model a run trains, known before anything is built: whether a `model.path` holds a
vision-language model (read from its config.json alone), and the vision presets' shapes, image
tokens and processor. The data stage and the model builder both need them and import neither
each other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What a vision-language model's folder holds besides the tokenizer and the weights: the image
# processor's and the processor's settings (AutoProcessor reads them with the tokenizer's files).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# The families whose processors lmforge places images with, tested: Idefics3 (SmolVLM's architecture).
SUPPORTED_VISION_TYPES = ("idefics3",)
# The tokens Idefics3's processor expands each `<image>` placeholder into, and its end of turn.
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")

VISION_PRESETS: dict[str, dict[str, Any]] = {
    # About 0.5M parameters: 32x32 images in 8x8 patches (16), pixel-shuffled by 2 into 4 image
    # tokens; a 2-layer vision tower of width 64 and a 2-layer Llama of width 128.
    "smolvlm-tiny": {
        "image_size": 32,
        "image_seq_len": 4,
        "vision_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        "scale_factor": 2,
        "text_config": {
            "model_type": "llama",
            "hidden_size": 128,
            "intermediate_size": 344,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "tie_word_embeddings": False,
        },
    },
}


def add_image_tokens(tokenizer: Any) -> None:
    """Register Idefics3's image tokens as special tokens of `tokenizer` (in place; idempotent)."""
    missing = [token for token in IMAGE_TOKENS if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing})


# Vision-language presets: a run builds one from its config (lmforge.models.vision) around the
# run's tokenizer, with the processor `preset_processor` makes; `lmforge estimate` sizes them.
VISION_PRESET_NAMES = tuple(VISION_PRESETS)


def vision_model_type(path: str | Path | None) -> str | None:
    """The model_type of the vision-language model at `path` (its config.json has a
    `vision_config`), or None for a text model, a hub name or no path."""
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return str(config.get("model_type")) if "vision_config" in config else None


def processor_files(path: str | Path | None) -> list[Path]:
    """The processor settings files of the vision-language model at `path` (none for a text model)."""
    if vision_model_type(path) is None:
        return []
    assert path is not None
    return saved_processor_files(path)


def saved_processor_files(folder: str | Path) -> list[Path]:
    """The processor settings files in `folder` (a model's, or a processor saved alone)."""
    return [Path(folder) / name for name in PROCESSOR_FILES if (Path(folder) / name).is_file()]


def preset_image_settings(preset: str) -> dict[str, Any]:
    """The image processor settings of vision preset `preset`: each image whole, one tile of the
    preset's size."""
    edge = {"longest_edge": VISION_PRESETS[preset]["image_size"]}
    return {"do_image_splitting": False, "size": edge, "max_image_size": edge}


def preset_processor(preset: str, tokenizer: Any) -> Any:
    """The Idefics3 processor of vision preset `preset` around `tokenizer` (its image tokens added):
    one unsplit image of the preset's size a placeholder, `image_seq_len` image tokens. The data
    stage places images with it and the model builder saves it beside the model."""
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    spec = VISION_PRESETS[preset]
    add_image_tokens(tokenizer)
    image_processor = Idefics3ImageProcessor(**preset_image_settings(preset))
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=spec["image_seq_len"],
        chat_template=getattr(tokenizer, "chat_template", None),
    )
