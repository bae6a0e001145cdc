"""What `ckpt verify` compares a vision-language model on: rows with images, as training read them.

The rows of a data file (ShareGPT, messages, alpaca; the run's eval file is one) are read by the
data stage's own readers (image files resolved and checked) and rendered by its chat code, each
`<image>` placeholder becoming the processor's image tokens (`ImageTokens`), exactly as the SFT
cache holds them. Each row gives the token ids, where its answer starts (the answer's tokens are
scored) and its image files, which the runtime turns into pixels with the model's processor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.errors import UserInputError

# One sequence to compare on: token ids, the position its scored tokens start at, its image files.
Scored = tuple[list[int], int, tuple[str, ...]]
# Image tokens are never cut, so a row longer than this is left out rather than truncated
# (SmolVLM's processor writes 64 to 1,000+ tokens per image).
VISION_MAX_TOKENS = 4096


def image_rows(
    processor: Any, tokenizer: Any, data: Path, max_rows: int
) -> tuple[list[Scored], list[dict[str, Any]]]:
    """The first `max_rows` conversation rows of `data` as sequences to score (their last
    assistant answer) and as questions (the prompt ids up to that answer, the answer, the images)."""
    from lmforge.config.schema import SourceConfig
    from lmforge.data.chat import IGNORE_INDEX, TokenizedSample, resolve_template, tokenize_conversation
    from lmforge.data.examples import BadRow, Conversation
    from lmforge.data.formats import iter_source_examples
    from lmforge.data.vision_tokens import ImageTokens

    image_tokens, template = ImageTokens(processor), resolve_template(tokenizer, None)
    scored: list[Scored] = []
    questions: list[dict[str, Any]] = []
    too_long = 0
    for row in iter_source_examples(SourceConfig(path=str(data)), memory_budget_mb=256):
        if isinstance(row, BadRow):
            raise UserInputError(f"--data {row.message()}")
        if not isinstance(row, Conversation):
            raise UserInputError(
                f"--data {data}: {type(row).__name__} rows; verify compares on conversations"
            )
        sample = tokenize_conversation(
            row,
            tokenizer,
            template=template,
            train_on="last_assistant",
            max_length=VISION_MAX_TOKENS,
            over_length="drop",
            image_tokens=image_tokens,
        )
        if not isinstance(sample, TokenizedSample):
            too_long += 1
            continue
        ids = [int(token) for token in sample.input_ids]
        supervised = [i for i, label in enumerate(sample.labels) if label != IGNORE_INDEX]
        start, images = supervised[0], tuple(sample.images or ())
        scored.append((ids, start, images))
        answer = [ids[i] for i in supervised]
        questions.append(
            {
                "prompt_ids": ids[:start],
                "answer": str(tokenizer.decode(answer, skip_special_tokens=True)).strip(),
                "new_tokens": len(answer) + 8,
                "images": images,
            }
        )
        if len(scored) == max_rows:
            break
    if not scored:
        raise UserInputError(
            f"--data {data}: no row to compare on ({too_long} longer than {VISION_MAX_TOKENS} tokens)"
        )
    return scored, questions


def images_checked(scored: list[Scored]) -> dict[str, Any]:
    """What the verdict says about the images it was checked on."""
    if not any(images for _, _, images in scored):
        return {"checked": False, "why": "the data's rows have no images; compared on their text alone"}
    return {
        "checked": True,
        "rows": len(scored),
        "rows_with_images": sum(1 for _, _, images in scored if images),
        "images": sum(len(images) for _, _, images in scored),
    }
