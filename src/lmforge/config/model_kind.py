"""What kind of model a `model.path` holds, read from its config.json alone: the data stage and
the model builder both need to know whether a run is vision-language before either builds
anything."""

from __future__ import annotations

import json
from pathlib import Path

# What a vision-language model's folder holds besides the tokenizer and the weights: the image
# processor's and the processor's settings (AutoProcessor reads them with the tokenizer's files).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# The families whose processors lmforge places images with, tested: Idefics3 (SmolVLM's architecture).
SUPPORTED_VISION_TYPES = ("idefics3",)
# Vision-language presets (lmforge.models.vision.VISION_PRESETS): `lmforge estimate` sizes them;
# a run fine-tunes a saved model folder (model.path), whose processor places the images.
VISION_PRESET_NAMES = ("smolvlm-tiny",)


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
    return [Path(path) / name for name in PROCESSOR_FILES if (Path(path) / name).is_file()]
