"""Chat-template generation that stops at the end of the assistant's turn.

Prompts are rendered with the tokenizer's chat template (generation prompt added) and
tokenized without extra special tokens, as training saw them. Generation stops at any of
`stop_token_ids(tokenizer)` (the trained built-in template's stop tokens and EOS); the stop token
is never part of the returned text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmforge.data.chat import stop_token_ids
from lmforge.verbosity import progress_bar


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """[system?, user] as chat templates read them."""
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The chat template's text for `messages`, ending with the assistant's generation prompt."""
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def generation_kwargs(
    tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, temperature: float = 0.0
) -> dict[str, Any]:
    """generate() settings: stop at end of turn; greedy at temperature 0, else sampling."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "eos_token_id": sorted(stop_token_ids(tokenizer)),
        "pad_token_id": tokenizer.pad_token_id,
        "do_sample": temperature > 0,
    }
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    return kwargs


@torch.inference_mode()
def generate_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    streamer: Any = None,
    images: Sequence[Any] = (),
    processor: Any = None,
) -> list[int]:
    """New token ids for one conversation; ends with the end-of-turn id when the model stopped.
    A vision-language model's `images` (PIL images, one per `<image>` placeholder in the messages,
    in order) go through its `processor`, which writes their image tokens and pixels."""
    text = render_prompt(tokenizer, messages)
    if images:
        encoded = processor(text=[text], images=[list(images)], add_special_tokens=False, return_tensors="pt")
    else:
        encoded = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    encoded = encoded.to(model.device)
    generate: Any = model.generate  # typed upstream as a Tensor attribute
    output = generate(
        **encoded, streamer=streamer, **generation_kwargs(tokenizer, max_new_tokens, temperature)
    )
    return [int(t) for t in output[0, encoded["input_ids"].shape[1] :]]


@torch.inference_mode()
def generate_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[list[dict[str, str]]],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 16,
) -> list[str]:
    """Greedy replies to many conversations, in batches left-padded so replies start together."""
    stops = stop_token_ids(tokenizer) | {tokenizer.pad_token_id}
    replies: list[str] = []
    for start in progress_bar(
        range(0, len(conversations), batch_size), desc="generate answers", unit="batch"
    ):
        texts = [render_prompt(tokenizer, m) for m in conversations[start : start + batch_size]]
        encoded = tokenizer(
            texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt"
        ).to(model.device)
        generate: Any = model.generate  # typed upstream as a Tensor attribute
        output = generate(**encoded, **generation_kwargs(tokenizer, max_new_tokens))
        for row in output[:, encoded["input_ids"].shape[1] :].tolist():
            replies.append(str(tokenizer.decode(until_stop(row, stops), skip_special_tokens=True)))
    return replies


def until_stop(ids: Sequence[int], stops: frozenset[int] | set[int]) -> list[int]:
    """`ids` up to (not including) the first stop id."""
    out: list[int] = []
    for token in ids:
        if token in stops:
            break
        out.append(int(token))
    return out
