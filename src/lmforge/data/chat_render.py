"""Rendering conversations with a chat template, and where the assistant turns fall in the tokens.

`data.chat` turns a conversation into training ids and labels; this module supplies the
rendering and the assistant turns' [start, end) token spans it sets labels from. With
`{% generation %}` markers the spans come from the renderer (batched, and in plain Python
for ChatML); without them, by rendering the conversation up to each assistant turn.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from lmforge.config.chat_template_names import CHAT_TEMPLATE_NAMES
from lmforge.data.examples import Conversation, Message
from lmforge.data.tokenizer import CHATML_TEMPLATE
from lmforge.errors import UserInputError

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template: str) -> bool:
    """Whether `template` marks assistant content with `{% generation %}` (the fast, batched path)."""
    return _GENERATION_MARKER.search(template) is not None


def message_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as the dicts chat templates read (keys left out when unset)."""
    out = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.name:
            entry["name"] = message.name
        out.append(entry)
    return out


def render_conversation(conversation: Conversation, tokenizer: PreTrainedTokenizerBase, template: str) -> str:
    """The text the template renders for the whole conversation (what training tokenizes)."""
    return str(
        _render(tokenizer, message_dicts(conversation.messages), conversation.tools, template, tokenize=False)
    )


def batched_ids_and_assistant_turns(
    conversations: Sequence[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    tools: list[dict[str, Any]] | None = None,
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Token ids and assistant [start, end) token spans of conversations sharing `tools`, for a
    template with generation markers. What `apply_chat_template(..., return_assistant_tokens_mask=True)`
    computes, without its per-token Python loop: render (transformers' renderer, which returns
    each assistant span's characters, or `_render_chatml` for ChatML), tokenize the batch in one
    call, map spans to tokens.
    tests/test_chat_templates.py checks it against apply_chat_template's mask."""
    if template == CHATML_TEMPLATE and not tools:
        rendered, generation_spans = _render_chatml(conversations)
    else:
        rendered, generation_spans = _render_with_generation_spans(conversations, tokenizer, template, tools)
    # Only the ids and the offsets are used: no attention mask or type ids lists to build per row.
    encoded = tokenizer(
        rendered, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False
    )
    return [
        (list(encoded["input_ids"][row]), _token_spans(encoded, row, spans))
        for row, spans in enumerate(generation_spans)
    ]


def _render_with_generation_spans(
    conversations: Sequence[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    tools: list[dict[str, Any]] | None,
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Rendered texts and each assistant span's characters, from transformers' Jinja renderer."""
    # Template variables as apply_chat_template passes them (bos_token, eos_token, ...).
    special_tokens: dict[str, Any] = dict(tokenizer.special_tokens_map)
    try:
        # Annotated upstream as `-> str`, it returns (rendered texts, assistant character spans).
        rendered_and_spans: Any = render_jinja_template(
            conversations=[message_dicts(c.messages) for c in conversations],
            tools=list(tools) if tools else None,
            chat_template=template,
            return_assistant_tokens_mask=True,
            **special_tokens,
        )
        rendered, generation_spans = rendered_and_spans
    except TemplateError as err:
        raise UserInputError(f"chat template failed to render a conversation: {err}") from None
    return rendered, generation_spans


def _render_chatml(
    conversations: Sequence[Conversation],
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """CHATML_TEMPLATE (built-in `chatml`, and the template `train_tokenizer` writes) rendered in
    plain Python: the same text and assistant character spans as the Jinja renderer at a
    fraction of the cost (the sandboxed Jinja render took ~60 of the ~330 us a chat row cost
    to tokenize). The template reads only role and content, which every Message has as
    strings; tests/test_chat_templates.py checks the result against apply_chat_template."""
    texts: list[str] = []
    all_spans: list[list[tuple[int, int]]] = []
    for conversation in conversations:
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        length = 0
        for message in conversation.messages:
            if message.role == "assistant":
                turn = message.content + "<|im_end|>"
                start = length + len("<|im_start|>assistant\n")
                spans.append((start, start + len(turn)))
                piece = "<|im_start|>assistant\n" + turn + "\n"
            else:
                piece = "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n"
            parts.append(piece)
            length += len(piece)
        texts.append("".join(parts))
        all_spans.append(spans)
    return texts, all_spans


def _token_spans(encoded: Any, row: int, char_spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) token spans covering the [start, end) character spans of row `row`."""
    length = len(encoded["input_ids"][row])
    turns = []
    for start_char, end_char in char_spans:
        start = encoded.char_to_token(row, start_char)
        if start is None or end_char <= start_char:  # an empty span at the very end renders no token
            continue
        end = encoded.char_to_token(row, end_char - 1)
        turns.append((start, end + 1 if end is not None else length))
    return turns


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str,
    **kwargs: Any,
) -> Any:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=list(tools) if tools else None, chat_template=template, **kwargs
        )
    except TemplateError as err:
        raise UserInputError(f"chat template failed to render a conversation: {err}") from None


def ids_and_assistant_turns(
    conversation: Conversation, tokenizer: PreTrainedTokenizerBase, template: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the rendered conversation and each assistant turn's [start, end) token span."""
    if has_generation_markers(template):
        return batched_ids_and_assistant_turns([conversation], tokenizer, template, conversation.tools)[0]
    messages = message_dicts(conversation.messages)
    text = str(_render(tokenizer, messages, conversation.tools, template, tokenize=False))
    char_spans = _assistant_char_spans(tokenizer, messages, conversation.tools, template, text)
    encoded = tokenizer([text], add_special_tokens=False)
    return list(encoded["input_ids"][0]), _token_spans(encoded, 0, char_spans)


def _assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str,
    text: str,
) -> list[tuple[int, int]]:
    """Character spans of assistant turns in `text`, for templates without generation markers:
    the turn is what rendering it adds after the generation prompt, less trailing whitespace."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = str(
            _render(tokenizer, messages[:i], tools, template, tokenize=False, add_generation_prompt=True)
        )
        upto = str(_render(tokenizer, messages[: i + 1], tools, template, tokenize=False))
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise UserInputError(
                "the tokenizer's chat template renders earlier turns differently as the conversation grows, "
                "so assistant turns cannot be located; set data.chat_template to your model family's built-in "
                f"({', '.join(CHAT_TEMPLATE_NAMES)}), or add "
                "{% generation %} markers around assistant content in the template"
            )
        spans.append((len(prompt), len(upto.rstrip())))
    return spans
