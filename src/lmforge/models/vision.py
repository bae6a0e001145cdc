"""Tiny vision-language models built from a config, offline: SmolVLM's architecture (Idefics3: a
SigLIP-style vision tower, a pixel-shuffle projector, a Llama text model) at a size that trains on
a CPU, with the processor that goes with it (`AutoProcessor` reloads both from the saved folder).

The tokenizer is lmforge's own (trained on the spot); the image tokens Idefics3's processor
writes around each image are added to it as special tokens.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from lmforge.errors import UserInputError

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


def add_image_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    """Register Idefics3's image tokens as special tokens of `tokenizer` (in place; idempotent)."""
    missing = [token for token in IMAGE_TOKENS if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing})  # type: ignore[dict-item]


def build_vision_model(preset: str, tokenizer: PreTrainedTokenizerBase) -> tuple[Any, Any]:
    """(model, processor) of a vision preset, randomly initialised, for `tokenizer` (its image
    tokens added). The processor's chat template is the tokenizer's."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlamaConfig,
    )

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
    model = Idefics3ForConditionalGeneration(config)
    edge = {"longest_edge": spec["image_size"]}
    image_processor = Idefics3ImageProcessor(do_image_splitting=False, size=edge, max_image_size=edge)
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=spec["image_seq_len"],
        chat_template=getattr(tokenizer, "chat_template", None),
    )
    return model, processor


def save_vision_model_dir(out: Any, model: Any, processor: Any) -> None:
    """A vision-language model folder (weights, config, tokenizer, processor) that
    AutoModelForImageTextToText and AutoProcessor load: what `model.path` points a VLM run at."""
    model.save_pretrained(out)
    processor.save_pretrained(out)
