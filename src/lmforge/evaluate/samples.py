"""Greedy generations of a model on prompts taken from its own data: what the W&B and MLflow
sinks publish with a finished run (monitor/run_artifacts.py), what each eval step shows and scores
during training (train/eval_generations.py), and what `lmforge eval` scores on a run's eval data.

Prompts by stage: pretrain, the first tokens of a block (the next tokens are the reference);
sft, a sample's tokens before its first supervised token (the reply is the reference); dpo / kto,
the prompt turns rendered with the chat template (the chosen or good answer is the reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from lmforge.config.redact import redact_text
from lmforge.monitor.run_artifacts import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SAMPLE_COUNT = 4
MAX_NEW_TOKENS = 32  # bounds the cost: 4 x 32 greedy tokens
PROMPT_TOKENS = 16  # the head of a pretraining block that serves as its prompt


def sample_generations(model_dir: Path, dataset: Any, count: int = SAMPLE_COUNT) -> list[Sample]:
    """Greedy completions of the first `count` prompts of `dataset` by the model in `model_dir`."""
    import torch

    from lmforge.evaluate.loading import load_for_inference

    model, tokenizer = load_for_inference(model_dir)
    prompts = sample_prompts(dataset, tokenizer, count)
    if not prompts:
        raise ValueError("the data holds no row to prompt with")
    try:
        return complete_prompts(model, tokenizer, prompts, MAX_NEW_TOKENS)
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the copy loaded for sampling gives its memory back


def complete_prompts(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    max_new_tokens: int,
    *,
    batch_size: int = 1,
    image_processor: Any = None,
) -> list[Sample]:
    """Greedy completions of `sample_prompts`' prompts, as redacted `Sample`s.

    Batches are left-padded so that every completion starts at the same position; `batch_size=1`
    (the default) generates each prompt alone, exactly as a user's single request would. A prompt
    with images (a vision-language run) gets their pixels from `image_processor`."""
    import torch

    from lmforge.data.chat import stop_token_ids
    from lmforge.data.vision_tokens import pixel_inputs
    from lmforge.evaluate.generation import generation_kwargs, until_stop

    stops = stop_token_ids(tokenizer) | {tokenizer.pad_token_id}
    generate: Any = model.generate  # typed upstream as a Tensor attribute
    samples = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            input_ids, mask = _left_padded([p.ids for p in batch], tokenizer.pad_token_id, model.device)
            images: dict[str, Any] = {}
            if image_processor is not None and any(p.images for p in batch):
                images = {
                    name: value.to(model.device)
                    for name, value in pixel_inputs(image_processor, [p.images for p in batch]).items()
                }
            output = generate(
                input_ids=input_ids,
                attention_mask=mask,
                **images,
                **generation_kwargs(tokenizer, max_new_tokens),
            )
            for (ids, reference, _), row in zip(batch, output[:, input_ids.shape[1] :].tolist(), strict=True):
                new = until_stop(row, stops)
                samples.append(
                    Sample(
                        prompt=redact_text(str(tokenizer.decode(ids))),
                        completion=redact_text(str(tokenizer.decode(new, skip_special_tokens=True))),
                        reference=redact_text(reference) if reference is not None else None,
                    )
                )
    return samples


def _left_padded(rows: list[list[int]], pad_id: int, device: Any) -> tuple[Any, Any]:
    """(input_ids, attention_mask) of `rows` padded on the left to the longest."""
    import torch

    longest = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[i, longest - len(ids) :] = 1
    return input_ids.to(device), mask.to(device)


class Prompt(NamedTuple):
    """A prompt to complete: its token ids, the reference reply (None: nothing to score against)
    and its image files (a vision-language sample's, in the order of its image tokens)."""

    ids: list[int]
    reference: str | None
    images: Sequence[str] = ()


def sample_prompts(
    dataset: Any,
    tokenizer: PreTrainedTokenizerBase,
    count: int,
    *,
    reference_tokens: int = MAX_NEW_TOKENS,
    processor: Any = None,
) -> list[Prompt]:
    """The prompts of the first `count` rows of a training or eval dataset of any stage: token rows
    (pretrain blocks, SFT samples or packed rows, with their images) or TRL's conversational rows
    (dpo, kto; dpo rows with images come rendered, and the vision-language model's `processor`
    places their image tokens). A pretraining block's reference is its next `reference_tokens`
    tokens (as many as a completion may have, so that a perfect one matches it)."""
    prompts: list[Prompt] = []
    for index in range(len(dataset)):
        item = dataset[index]
        if "prompt" in item:
            prompts.append(_conversation_prompt(item, tokenizer, processor))
        else:
            prompts.extend(_token_prompts(item, tokenizer, reference_tokens))
        if len(prompts) >= count:
            break
    return [p for p in prompts if p.ids][:count]


def _token_prompts(
    item: dict[str, Any], tokenizer: PreTrainedTokenizerBase, reference_tokens: int
) -> list[Prompt]:
    """The prompt of each sample of a token row (a packed row holds several), with its images."""
    ids, labels = _as_list(item["input_ids"]), _as_list(item["labels"])
    images = tuple(item.get("images") or ())
    if not (ids and isinstance(ids[0], list)):
        return [Prompt(*_token_prompt(ids, labels, tokenizer, reference_tokens), images)]
    counts = item.get("image_counts") or [0] * len(ids)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [
        Prompt(*_token_prompt(i, lab, tokenizer, reference_tokens), images[start : start + count])
        for i, lab, start, count in zip(ids, labels, starts, counts, strict=True)
    ]


def _token_prompt(
    ids: list[int], labels: list[int], tokenizer: PreTrainedTokenizerBase, reference_tokens: int
) -> tuple[list[int], str | None]:
    """A prompt masked out of the loss (SFT) ends where supervision starts; the reply is the
    reference. A row supervised throughout (pretraining) is cut after its first tokens."""
    first = next((i for i, label in enumerate(labels) if label != -100), len(labels))
    if 0 < first < len(ids):
        end = next((i for i in range(first, len(labels)) if labels[i] == -100), len(labels))
        return ids[:first], str(tokenizer.decode(ids[first:end], skip_special_tokens=True))
    cut = min(PROMPT_TOKENS, max(1, len(ids) // 2))
    reference = ids[cut : cut + reference_tokens]
    return ids[:cut], str(tokenizer.decode(reference, skip_special_tokens=True)) if reference else None


def _conversation_prompt(item: dict[str, Any], tokenizer: PreTrainedTokenizerBase, processor: Any) -> Prompt:
    """A dpo / kto row: its prompt turns rendered with the generation prompt, the good answer as reference."""
    from lmforge.evaluate.generation import render_prompt

    if isinstance(item["prompt"], str):
        return _rendered_image_prompt(item, tokenizer, processor)
    text = render_prompt(tokenizer, item["prompt"])
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    answer = item.get("chosen") if "chosen" in item else item.get("completion") if item.get("label") else None
    reference = str(answer[-1].get("content", "")) if isinstance(answer, list) and answer else None
    return Prompt(ids, reference)


def _rendered_image_prompt(
    item: dict[str, Any], tokenizer: PreTrainedTokenizerBase, processor: Any
) -> Prompt:
    """A dpo row with images, as the data stage hands it to TRL (data.preference.rendered_image_pairs):
    the prompt already rendered, each `<image>` placeholder expanded by the model's processor."""
    images = tuple(item.get("images") or ())
    if processor is None:
        ids = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
    else:
        inputs = processor(
            text=[item["prompt"]], images=[list(images)] if images else None, add_special_tokens=False
        )
        ids = inputs["input_ids"][0]
    return Prompt([int(i) for i in ids], item.get("reference"), images)


def _as_list(value: Any) -> list[Any]:
    return value.tolist() if hasattr(value, "tolist") else list(value)
