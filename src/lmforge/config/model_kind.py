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
# The families whose processors lmforge places images with, tested: Idefics3 (SmolVLM's
# architecture) and LLaVA (a CLIP tower, an MLP projector, each image a fixed run of `<image>`).
SUPPORTED_VISION_TYPES = ("idefics3", "llava")
# The tokens each family's processor writes for an image (and Idefics3's end of turn): a preset's
# tokenizer gets them as special tokens.
FAMILY_IMAGE_TOKENS: dict[str, tuple[str, ...]] = {
    "idefics3": ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"),
    "llava": ("<image>",),
}
IMAGE_TOKENS = FAMILY_IMAGE_TOKENS["idefics3"]

_TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# A 2-layer vision tower of width 64 reading 32x32 images in 8x8 patches (16).
_TINY_TOWER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}
VISION_PRESETS: dict[str, dict[str, Any]] = {
    # About 0.5M parameters: the 16 patches pixel-shuffled by 2 into 4 image tokens (SigLIP tower).
    "smolvlm-tiny": {
        "family": "idefics3",
        "image_size": 32,
        "image_seq_len": 4,
        "vision_config": _TINY_TOWER,
        "scale_factor": 2,
        "text_config": _TINY_LLAMA,
    },
    # LLaVA-1.5's layout at the same size: a CLIP tower whose second-to-last layer's 16 patch
    # features (the class token dropped) go through a 2-layer GELU MLP: 16 image tokens.
    "llava-tiny": {
        "family": "llava",
        "image_size": 32,
        "image_seq_len": 16,
        "vision_config": {**_TINY_TOWER, "model_type": "clip_vision_model", "projection_dim": 64},
        "text_config": _TINY_LLAMA,
    },
}


def preset_family(preset: str) -> str:
    """The model_type (family) vision preset `preset` builds."""
    return str(VISION_PRESETS[preset]["family"])


def add_image_tokens(tokenizer: Any, preset: str = "smolvlm-tiny") -> None:
    """Register the image tokens of `preset`'s family as special tokens of `tokenizer` (in place;
    idempotent)."""
    tokens = FAMILY_IMAGE_TOKENS[preset_family(preset)]
    missing = [token for token in tokens if token not in tokenizer.get_vocab()]
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


def run_processor_files(model_path: str | Path | None, run_processor_dir: str | Path) -> list[Path]:
    """The processor settings files a run's final/ and checkpoints carry beside its model: those of
    the vision-language `model_path`, else (a vision preset has no folder) the ones the run saved in
    `run_processor_dir` (RunPaths.processor); none for a text model."""
    return processor_files(model_path) or saved_processor_files(run_processor_dir)


def preset_image_settings(preset: str) -> dict[str, Any]:
    """The image processor settings of vision preset `preset`: each image whole, at the preset's
    size (Idefics3: one tile; LLaVA: the shortest edge resized to it, then the centre crop)."""
    side = int(VISION_PRESETS[preset]["image_size"])
    if preset_family(preset) == "llava":
        return {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
    edge = {"longest_edge": side}
    return {"do_image_splitting": False, "size": edge, "max_image_size": edge}


def preset_processor(preset: str, tokenizer: Any) -> Any:
    """The processor of vision preset `preset` around `tokenizer` (its image tokens added): one
    whole image of the preset's size a placeholder, `image_seq_len` image tokens. The data stage
    places images with it and the model builder saves it beside the model."""
    spec = VISION_PRESETS[preset]
    add_image_tokens(tokenizer, preset)
    template = getattr(tokenizer, "chat_template", None)
    # The PIL image processors: the same pixels whether or not torchvision is installed (the
    # default classes switch to it when it is), so an export verified elsewhere sees what training saw.
    if spec["family"] == "llava":
        from transformers import CLIPImageProcessorPil, LlavaProcessor

        return LlavaProcessor(
            image_processor=CLIPImageProcessorPil(**preset_image_settings(preset)),
            tokenizer=tokenizer,
            patch_size=spec["vision_config"]["patch_size"],
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # CLIP's class token, which "default" drops
            chat_template=template,
        )
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    return Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(**preset_image_settings(preset)),
        tokenizer=tokenizer,
        image_seq_len=spec["image_seq_len"],
        chat_template=template,
    )
