"""The catalogue of built-in chat templates: for each model family, its Jinja text, the special
tokens it writes and the tokens generation stops on.

`data.chat` picks the template a run trains with (a built-in by name, else the tokenizer's own);
the texts live in `data.chat_template_texts` and `data.chat_template_tool_texts`. The names,
and LLaMA-Factory's names for them, are `config.chat_template_names` (the schema validates with
them). Every built-in wraps what the assistant writes in `{% generation %}` markers, so the loss
mask comes from the rendering itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from lmforge.config.chat_template_names import CHAT_TEMPLATE_NAMES, canonical_chat_template
from lmforge.data.chat_template_texts import (
    GEMMA_TEMPLATE,
    GLM4_TEMPLATE,
    LLAMA2_TEMPLATE,
    MISTRAL_TEMPLATE,
    PHI3_TEMPLATE,
    PHI4_TEMPLATE,
)
from lmforge.data.chat_template_tool_texts import (
    DEEPSEEK_TEMPLATE,
    GLM4_MOE_TEMPLATE,
    LLAMA3_TEMPLATE,
    QWEN2_TEMPLATE,
    QWEN3_NOTHINK_TEMPLATE,
    QWEN3_TEMPLATE,
)
from lmforge.data.images import IMAGE_PLACEHOLDER
from lmforge.data.tokenizer import CHATML_TEMPLATE
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_TEMPLATES",
    "CATALOGUE",
    "LLAMA3_TEMPLATE",
    "QWEN2_TEMPLATE",
    "TEMPLATE_TOKENS",
    "ChatTemplate",
    "builtin_template_name",
    "canonical_name",
    "ensure_template_tokens",
]


@dataclass(frozen=True)
class ChatTemplate:
    """One built-in chat template."""

    text: str  # the Jinja template, with {% generation %} around what the assistant writes
    # Special tokens it writes; a tokenizer that lacks them gets them added (the embedding grows).
    # Markup the family's tokenizers keep as plain text (Llama 2's [INST], Qwen's <tool_call>) is not listed.
    special_tokens: tuple[str, ...]
    # Tokens that end the assistant's turn, which generation stops on (the tokenizer's EOS always
    # stops it too: for Llama 2 and Mistral, EOS is the end of the turn).
    stop_tokens: tuple[str, ...]


_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
_GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
# GLM ends a turn with the next role token; <|endoftext|> (its EOS) ends the conversation.
_GLM_STOPS = ("<|user|>", "<|observation|>", "<|endoftext|>")

CATALOGUE: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate(CHATML_TEMPLATE, _CHATML_TOKENS, ("<|im_end|>",)),
    "llama2": ChatTemplate(LLAMA2_TEMPLATE, (), ()),
    "llama3": ChatTemplate(
        LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), ("<|eot_id|>",)
    ),
    "mistral": ChatTemplate(MISTRAL_TEMPLATE, (), ()),
    "gemma": ChatTemplate(GEMMA_TEMPLATE, ("<start_of_turn>", "<end_of_turn>"), ("<end_of_turn>",)),
    "phi3": ChatTemplate(PHI3_TEMPLATE, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), ("<|end|>",)),
    "phi4": ChatTemplate(PHI4_TEMPLATE, ("<|im_start|>", "<|im_sep|>", "<|im_end|>"), ("<|im_end|>",)),
    "qwen2": ChatTemplate(QWEN2_TEMPLATE, _CHATML_TOKENS, ("<|im_end|>", "<|endoftext|>")),
    "qwen3": ChatTemplate(QWEN3_TEMPLATE, _CHATML_TOKENS, ("<|im_end|>", "<|endoftext|>")),
    "qwen3_nothink": ChatTemplate(QWEN3_NOTHINK_TEMPLATE, _CHATML_TOKENS, ("<|im_end|>", "<|endoftext|>")),
    "deepseek": ChatTemplate(
        DEEPSEEK_TEMPLATE,
        ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),  # tool-call markers stay text elsewhere
        ("<｜end▁of▁sentence｜>",),
    ),
    "glm4": ChatTemplate(GLM4_TEMPLATE, _GLM_TOKENS, _GLM_STOPS),
    "glm4_moe": ChatTemplate(GLM4_MOE_TEMPLATE, _GLM_TOKENS, _GLM_STOPS),
}
assert tuple(CATALOGUE) == CHAT_TEMPLATE_NAMES, "config.chat_template_names lists the catalogue"

BUILTIN_TEMPLATES: dict[str, str] = {name: template.text for name, template in CATALOGUE.items()}
TEMPLATE_TOKENS: dict[str, list[str]] = {
    name: list(template.special_tokens) for name, template in CATALOGUE.items()
}
_NAME_OF_TEXT = {template.text: name for name, template in CATALOGUE.items()}


def canonical_name(name: str) -> str:
    """The built-in `name` stands for (a LLaMA-Factory alias resolved); UserInputError listing the names."""
    try:
        return canonical_chat_template(name)
    except ValueError as err:
        raise UserInputError(f"data.chat_template: {err}") from None


def builtin_template_name(template: object) -> str | None:
    """The built-in whose text `template` is (a tokenizer's chat_template, also once
    `with_image_parts` prefixed it), or None for any other."""
    return _NAME_OF_TEXT.get(template.removeprefix(IMAGE_PARTS_PREFIX)) if isinstance(template, str) else None


# Put before a text chat template, this lets it render what vision-language tools send: a message
# whose content is a list of parts (TRL's, vLLM's and AutoProcessor.apply_chat_template's
# {"type": "image"} / {"type": "text", "text": ...}) becomes its text with the placeholder where
# each image is; text content passes through, so the template renders text messages as before.
IMAGE_PARTS_PREFIX = (
    "{%- set lmforge_parts = namespace(messages=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string or message['content'] is none -%}"
    "{%- set lmforge_parts.messages = lmforge_parts.messages + [message] -%}"
    "{%- else -%}"
    "{%- set lmforge_text = namespace(value='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "{%- set lmforge_text.value = lmforge_text.value + '" + IMAGE_PLACEHOLDER + "' -%}"
    "{%- elif part['type'] == 'text' -%}"
    "{%- set lmforge_text.value = lmforge_text.value + part['text'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set lmforge_parts.messages = lmforge_parts.messages"
    " + [{'role': message['role'], 'content': lmforge_text.value}] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set messages = lmforge_parts.messages -%}\n"
)


def with_image_parts(template: str) -> str:
    """`template` made to take messages whose content is a list of image and text parts (idempotent)."""
    return template if template.startswith(IMAGE_PARTS_PREFIX) else IMAGE_PARTS_PREFIX + template


def ensure_template_tokens(tokenizer: PreTrainedTokenizerBase, name: str | None) -> list[str]:
    """Add the special tokens built-in template `name` needs and the tokenizer lacks (none for None).

    Returns the tokens added (and logs them): the model's embedding grows to fit at build time.
    """
    if name is None:
        return []
    vocab = tokenizer.get_vocab()
    missing = [token for token in CATALOGUE[canonical_name(name)].special_tokens if token not in vocab]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
        log.warning(
            "chat template %s: added special tokens %s to the tokenizer; the embedding grows to %d rows",
            name,
            ", ".join(missing),
            len(tokenizer),
        )
    return missing
