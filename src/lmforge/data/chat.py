"""Chat templates and turning a conversation into training tokens with a loss mask.

The loss mask always comes from the template rendering, never from searching for the
answer string: templates with `{% generation %}` markers (all built-ins, and the ChatML
template of `train_tokenizer`) give transformers' assistant-token mask; for a tokenizer's
own template without markers, each assistant turn is located by rendering the conversation
up to it (with and without the turn) and mapping those character spans to tokens.
The catalogue of built-in templates is `data.chat_templates`, the rendering and the assistant
turns' token spans are in `data.chat_render`; this module chooses the template, sets the labels
and says which tokens end a turn (training) and stop generation.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
from transformers import PreTrainedTokenizerBase

from lmforge.config.chat_template_names import CHAT_TEMPLATE_NAMES
from lmforge.data.chat_render import (
    batched_ids_and_assistant_turns,
    has_generation_markers,
    ids_and_assistant_turns,
)
from lmforge.data.chat_templates import (
    CATALOGUE,
    builtin_template_name,
    canonical_name,
    ensure_template_tokens,
)
from lmforge.data.examples import Conversation, Origin
from lmforge.errors import UserInputError

if TYPE_CHECKING:
    from lmforge.data.vision_tokens import ImageTokens

IGNORE_INDEX = -100
TrainOn = Literal["assistant", "all", "last_assistant"]
OverLength = Literal["truncate", "drop", "error"]

# Tokens that close a turn in the families' templates (every built-in's stop tokens); a sample
# must end with one of these (or EOS), and generation under a template that is no built-in stops on them.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<｜end▁of▁sentence｜>",
    "<|user|>",
    "<|observation|>",
)


@dataclass
class TokenizedSample:
    """Token ids of one training sample and its labels (IGNORE_INDEX where no loss)."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, IGNORE_INDEX where no loss
    origin: Origin | None = None
    truncated: bool = False  # cut to data.max_length (over_length: truncate)
    images: list[str] = field(default_factory=list)  # one per image-token span, in order

    def as_features(self) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids, "labels": self.labels}


@dataclass
class Dropped:
    """A sample left out of training, with the reason counted in the data report."""

    reason: str  # "over_length" or "no supervised tokens after truncation"
    origin: Origin | None = None
    length: int = 0


def adopt_template(tokenizer: PreTrainedTokenizerBase, name: str | None) -> str:
    """The template to train with (built-in `name`, else the tokenizer's own), stored on the
    tokenizer with the tokens it needs, so the tokenizer saved with the model (final/,
    `lmforge generate`, TRL's tokenization) renders exactly what training rendered. Generation
    and final/'s generation_config find the template's stop tokens from it (`stop_token_ids`)."""
    template = resolve_template(tokenizer, name)
    ensure_template_tokens(tokenizer, name)
    if name is not None:
        tokenizer.chat_template = template
    return template


def resolve_template(tokenizer: PreTrainedTokenizerBase, name: str | None) -> str:
    """The Jinja chat template to render with: built-in `name` (or its LLaMA-Factory alias) when
    given, else the tokenizer's own."""
    if name is not None:
        return CATALOGUE[canonical_name(name)].text
    own = tokenizer.chat_template
    if isinstance(own, dict):  # several named templates: "default" is what apply_chat_template uses
        own = own.get("default")
    if not own:
        raise UserInputError(
            f"tokenizer {tokenizer.name_or_path or type(tokenizer).__name__} has no chat template; "
            f"set data.chat_template to your model family's template: {', '.join(CHAT_TEMPLATE_NAMES)}"
        )
    return str(own)


def tokenize_conversation(
    conversation: Conversation,
    tokenizer: PreTrainedTokenizerBase,
    *,
    template: str,
    train_on: TrainOn,
    max_length: int,
    over_length: OverLength,
    image_tokens: ImageTokens | None = None,
) -> TokenizedSample | Dropped:
    """Tokens and labels of one conversation, ending with a supervised end-of-turn token.

    Labels follow `train_on`; a sample over `max_length` is truncated on the right, dropped,
    or raises UserInputError naming its file:line, per `over_length`. A conversation with images
    has each placeholder replaced by its image's tokens (`image_tokens`), which carry no loss.
    """
    ids, turns = ids_and_assistant_turns(conversation, tokenizer, template)
    return _finish_with_images(
        conversation, ids, turns, tokenizer, train_on, max_length, over_length, image_tokens
    )


def tokenize_conversations(
    conversations: Sequence[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    *,
    template: str,
    train_on: TrainOn,
    max_length: int,
    over_length: OverLength,
    image_tokens: ImageTokens | None = None,
) -> list[TokenizedSample | Dropped]:
    """`tokenize_conversation` for many conversations, same results, faster: conversations
    without tools under a template with generation markers are rendered one by one but
    tokenized in one batch call (the Rust backend spreads it over every core)."""
    marked = has_generation_markers(template)
    batchable = [i for i, c in enumerate(conversations) if not c.tools and marked]
    results: list[TokenizedSample | Dropped | None] = [None] * len(conversations)
    if batchable:
        batch = [conversations[i] for i in batchable]
        for i, (ids, turns) in zip(
            batchable, batched_ids_and_assistant_turns(batch, tokenizer, template), strict=True
        ):
            results[i] = _finish_with_images(
                conversations[i], ids, turns, tokenizer, train_on, max_length, over_length, image_tokens
            )
    for i, conversation in enumerate(conversations):
        if results[i] is None:
            results[i] = tokenize_conversation(
                conversation,
                tokenizer,
                template=template,
                train_on=train_on,
                max_length=max_length,
                over_length=over_length,
                image_tokens=image_tokens,
            )
    return [r for r in results if r is not None]


def _finish_with_images(
    conversation: Conversation,
    ids: list[int],
    turns: list[tuple[int, int]],
    tokenizer: PreTrainedTokenizerBase,
    train_on: TrainOn,
    max_length: int,
    over_length: OverLength,
    image_tokens: ImageTokens | None,
) -> TokenizedSample | Dropped:
    """`_finish_sample`, after each image placeholder became its image's tokens (masked)."""
    if not conversation.images:
        return _finish_sample(ids, turns, conversation.origin, tokenizer, train_on, max_length, over_length)
    if image_tokens is None:
        raise UserInputError(
            f"{conversation.origin.file}:{conversation.origin.line}: the row has images but the model is "
            "text-only; set model.path to a vision-language model (one AutoModelForImageTextToText loads)"
        )
    ids, turns, spans = image_tokens.expand(ids, turns, conversation.images)
    sample = _finish_sample(
        ids, turns, conversation.origin, tokenizer, train_on, max_length, over_length, image_spans=spans
    )
    if isinstance(sample, TokenizedSample):
        if spans[-1][1] > len(sample.input_ids):  # truncation must not cut an image's tokens
            return Dropped("an image cut by truncation", conversation.origin, len(ids))
        sample.images = list(conversation.images)
    return sample


def _finish_sample(
    ids: list[int],
    turns: list[tuple[int, int]],
    origin: Origin,
    tokenizer: PreTrainedTokenizerBase,
    train_on: TrainOn,
    max_length: int,
    over_length: OverLength,
    image_spans: Sequence[tuple[int, int]] = (),
) -> TokenizedSample | Dropped:
    """End with the end-of-turn token, set labels per `train_on`, apply the length policy.
    The tokens in `image_spans` never carry loss, whatever turn they sit in."""
    ids, turns = _end_with_end_of_turn(ids, turns, tokenizer)
    array = np.asarray(ids, dtype=np.int32)  # converted once: the labels copy from it
    labels = _labels_for(array, turns, train_on)
    for start, end in image_spans:
        labels[start:end] = IGNORE_INDEX
    if len(array) > max_length:
        if over_length == "error":
            raise UserInputError(
                f"{origin.file}:{origin.line}: the sample is {len(array)} tokens, longer than "
                f"data.max_length={max_length}. Fix: raise data.max_length, or set data.over_length "
                "to truncate or drop"
            )
        if over_length == "drop":
            return Dropped("over_length", origin, len(array))
        array, labels = array[:max_length], labels[:max_length]
        if not np.any(labels != IGNORE_INDEX):
            return Dropped("no supervised tokens after truncation", origin, len(array))
        return TokenizedSample(array, labels, origin, truncated=True)
    return TokenizedSample(array, labels, origin)


# get_vocab() builds a dict of the whole vocabulary: computed once per tokenizer (and
# again if tokens were added since), not once per sample.
_END_OF_TURN_CACHE: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[int, frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of the tokenizer's EOS and of every family's end-of-turn tokens (END_OF_TURN_TOKENS) it has."""
    cached = _END_OF_TURN_CACHE.get(tokenizer)
    if cached is not None and cached[0] == len(tokenizer):
        return cached[1]
    vocab = tokenizer.get_vocab()
    ids = {vocab[token] for token in END_OF_TURN_TOKENS if token in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    _END_OF_TURN_CACHE[tokenizer] = (len(tokenizer), frozenset(ids))
    return frozenset(ids)


def turn_end_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The tokens that end the assistant's turn under the tokenizer's chat template, main one first:
    the built-in's stop tokens when the template is one (the tokenizer of a run trained with a
    built-in carries it, see `adopt_template`), else every family's (END_OF_TURN_TOKENS)."""
    name = builtin_template_name(tokenizer.chat_template)
    return CATALOGUE[name].stop_tokens if name is not None else END_OF_TURN_TOKENS


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids generation stops on: the tokenizer's EOS and the `turn_end_tokens` it has. Under a
    built-in, only the tokens that end its turns (`end_of_turn_ids` has every family's)."""
    if builtin_template_name(tokenizer.chat_template) is None:
        return end_of_turn_ids(tokenizer)
    vocab = tokenizer.get_vocab()
    ids = {vocab[token] for token in turn_end_tokens(tokenizer) if token in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _end_with_end_of_turn(
    ids: list[int], turns: list[tuple[int, int]], tokenizer: PreTrainedTokenizerBase
) -> tuple[list[int], list[tuple[int, int]]]:
    """Cut what the template writes after the last assistant turn when it is only whitespace
    (ChatML's newline), and make sure the sample's last token is a supervised end of turn,
    so the model learns to stop."""
    if turns:
        last_end = turns[-1][1]
        if _is_blank(tokenizer, ids[last_end:]):
            ids = ids[:last_end]
    if ids and ids[-1] in end_of_turn_ids(tokenizer) and turns and turns[-1][1] == len(ids):
        return ids, turns
    if tokenizer.eos_token_id is None:
        raise UserInputError(
            "the chat template does not end the assistant turn with an end-of-turn token and the tokenizer "
            "has no eos_token; set data.chat_template or give the tokenizer an eos_token"
        )
    # The template's turn ends in plain text (GLM's last turn: the next role token would end it),
    # or later turns follow it: append EOS, supervised, as part of the last turn when it ends there
    # (so train_on: last_assistant trains the answer with it, not the EOS alone).
    eos = int(tokenizer.eos_token_id)
    if turns and turns[-1][1] == len(ids):
        return [*ids, eos], [*turns[:-1], (turns[-1][0], len(ids) + 1)]
    return [*ids, eos], [*turns, (len(ids), len(ids) + 1)]


# What the template writes after the last turn is the same few tokens in almost every sample
# (ChatML's newline): whether they decode to whitespace is remembered per tokenizer.
_BLANK_TAIL_CACHE: weakref.WeakKeyDictionary[
    PreTrainedTokenizerBase, tuple[int, dict[tuple[int, ...], bool]]
] = weakref.WeakKeyDictionary()
_BLANK_TAIL_MAX = 8  # longer tails are decoded every time (and not cached)


def _is_blank(tokenizer: PreTrainedTokenizerBase, tail: list[int]) -> bool:
    """Whether `tail` decodes to whitespace only (or nothing)."""
    if len(tail) > _BLANK_TAIL_MAX:
        return not str(tokenizer.decode(tail)).strip()
    cached = _BLANK_TAIL_CACHE.get(tokenizer)
    if cached is None or cached[0] != len(tokenizer):
        cached = (len(tokenizer), {})
        _BLANK_TAIL_CACHE[tokenizer] = cached
    key = tuple(tail)
    blank = cached[1].get(key)
    if blank is None:
        blank = cached[1][key] = not str(tokenizer.decode(tail)).strip()
    return blank


def _labels_for(ids: np.ndarray, turns: list[tuple[int, int]], train_on: TrainOn) -> np.ndarray:
    """Labels (int32): every token (all), assistant turns (assistant), or the final assistant turn only."""
    ids_array = np.asarray(ids, dtype=np.int32)
    if train_on == "all":
        return ids_array.copy()
    labels = np.full_like(ids_array, IGNORE_INDEX)
    chosen = turns if train_on == "assistant" else turns[-1:]
    for start, end in chosen:
        labels[start:end] = ids_array[start:end]
    return labels
