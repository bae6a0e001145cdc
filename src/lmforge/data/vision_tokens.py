"""Images inside fine-tuning samples: placeholders become the model's image tokens, batches
carry the pixels.

A row's text holds one `<image>` placeholder per image (lmforge.data.images). The chat template
renders it as the placeholder token; `ImageTokens` then replaces each one with the tokens the
model's own processor writes for that image (Idefics3: `<fake_token_around_image><global-img>`,
`<image>` x image_seq_len, `<fake_token_around_image>`; LLaVA: `<image>` once per patch; the count
depends on the image's size for processors that split or tile). The expansion is computed by the processor itself on a
blank image of the same size, once per size, so the cached token ids and the pixels the
collator computes later agree by construction. Image tokens never carry loss.

`VisionCollator` wraps a text collator: the text batch as before, plus `pixel_values` (and the
processor's other image inputs) for the images of each row, in the order of its image tokens,
which is the order the model fills its image-token positions in (for packed rows too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lmforge.config.model_kind import SUPPORTED_VISION_TYPES, vision_model_type
from lmforge.data.chat_templates import with_image_parts
from lmforge.data.images import IMAGE_PLACEHOLDER
from lmforge.errors import UserInputError


def load_processor(path: str, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
    """The processor saved with the vision-language model at `path`, around the run's own
    `tokenizer` (the one the data is rendered with: its chat template and added tokens)."""
    from transformers import AutoProcessor

    model_type = vision_model_type(path)
    if model_type not in SUPPORTED_VISION_TYPES:
        raise UserInputError(
            f"model.path: {path} is a {model_type!r} vision-language model; lmforge places images for "
            f"{', '.join(SUPPORTED_VISION_TYPES)} (SmolVLM's and LLaVA-1.5's architectures) so far. Fix: fine-tune "
            "one of those"
        )
    try:
        return AutoProcessor.from_pretrained(path, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserInputError(
            f"model.path: {path} has no processor transformers can load ({err}); save the model's processor "
            "into it (processor.save_pretrained)"
        ) from None


class ImageTokens:
    """How a placeholder token becomes the processor's image tokens, per image size."""

    def __init__(self, processor: Any) -> None:
        tokenizer = processor.tokenizer
        placeholder = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
        if not isinstance(placeholder, int) or placeholder == tokenizer.unk_token_id:
            raise UserInputError(
                f"the model's tokenizer has no {IMAGE_PLACEHOLDER} token, so image rows cannot be placed in "
                "its text; use the tokenizer saved with the vision model (its processor's)"
            )
        self.processor = processor
        self.placeholder_id: int = placeholder
        # The token whose positions the image features fill (Idefics3: the placeholder itself).
        image_token = getattr(processor, "image_token", IMAGE_PLACEHOLDER)
        self.image_token_id: int = tokenizer.convert_tokens_to_ids(str(image_token))
        self._by_size: dict[tuple[int, int], list[int]] = {}

    def fingerprint(self) -> str:
        """What decides the expansions: the image processor's settings and the processor's own."""
        import hashlib
        import json

        settings = {
            "image_processor": self.processor.image_processor.to_dict(),
            "processor": {
                key: value
                for key, value in vars(self.processor).items()
                if isinstance(value, int | float | str | bool) and not key.startswith("_")
            },
        }
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()

    def expansion(self, image_path: str) -> list[int]:
        """The token ids one image of this file's size becomes."""
        from PIL import Image

        with Image.open(image_path) as image:
            size = image.size  # the header only: the pixels are the collator's to read
        if size not in self._by_size:
            blank = Image.new("RGB", size)
            encoded = self.processor(
                text=[IMAGE_PLACEHOLDER], images=[[blank]], add_special_tokens=False, return_tensors=None
            )
            self._by_size[size] = list(encoded["input_ids"][0])
        return self._by_size[size]

    def expand(
        self, ids: list[int], turns: list[tuple[int, int]], images: Sequence[str]
    ) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
        """`ids` with each placeholder replaced by its image's tokens, the assistant `turns`
        (start, end) shifted to match, and the (start, end) span of each image's tokens."""
        positions = [i for i, token in enumerate(ids) if token == self.placeholder_id]
        if len(positions) != len(images):
            raise ValueError(
                f"{len(positions)} image placeholder token(s) after rendering for {len(images)} image(s): "
                "the chat template changed the placeholders"
            )
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        shifts: list[tuple[int, int]] = []  # (position in ids, tokens added before anything after it)
        previous, added = 0, 0
        for position, image in zip(positions, images, strict=True):
            out.extend(ids[previous:position])
            tokens = self.expansion(image)
            spans.append((len(out), len(out) + len(tokens)))
            out.extend(tokens)
            added += len(tokens) - 1
            shifts.append((position, added))
            previous = position + 1
        out.extend(ids[previous:])
        return out, [(_shifted(start, shifts), _shifted(end, shifts)) for start, end in turns], spans


def _shifted(index: int, shifts: list[tuple[int, int]]) -> int:
    """Where token `index` of the unexpanded ids sits after the expansions before it."""
    added = 0
    for position, total in shifts:
        if position < index:
            added = total
    return index + added


class VisionCollator:
    """A text collator's batch plus the pixels of each row's images (`pixel_values` and the
    processor's other image inputs, e.g. Idefics3's `pixel_attention_mask`)."""

    def __init__(self, text_collator: Callable[[list[Any]], dict[str, Any]], processor: Any) -> None:
        self.text_collator = text_collator
        self.image_processor = processor.image_processor

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        images = [feature.get("images") or [] for feature in features]
        batch = self.text_collator([_without_images(feature) for feature in features])
        if any(images):
            batch.update(pixel_inputs(self.image_processor, images))
        return batch


def _without_images(feature: Any) -> Any:
    if not isinstance(feature, dict):
        return feature
    return {k: v for k, v in feature.items() if k not in ("images", "image_counts")}


def pixel_inputs(image_processor: Any, images: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The model's image inputs (pixel_values, ...) for rows of image files."""
    return dict(image_processor(images=[_open_all(paths) for paths in images], return_tensors="pt"))


def _open_all(paths: Sequence[str]) -> list[Any]:
    from PIL import Image

    opened = []
    for path in paths:
        with Image.open(path) as image:
            opened.append(image.convert("RGB"))
    return opened


def save_image_parts_template(tokenizer: Any, processor: Any) -> None:
    """A vision-language run's tokenizer and processor get the run's template made to take image
    parts (`with_image_parts`), so the model it saves answers processor.apply_chat_template and
    vLLM's multimodal chat, not only lmforge's own placeholder rows. Called once the data stage
    adopted the template (the data was rendered with the plain one: the same text)."""
    template = with_image_parts(str(tokenizer.chat_template))
    tokenizer.chat_template = template
    processor.chat_template = template
