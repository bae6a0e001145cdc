"""Chat templates and turning a conversation into training tokens with a loss mask.

The loss mask always comes from the template rendering, never from searching for the
answer string: templates with `{% generation %}` markers (all built-ins, and the ChatML
template of `train_tokenizer`) give transformers' assistant-token mask; for a tokenizer's
own template without markers, each assistant turn is located by rendering the conversation
up to it (with and without the turn) and mapping those character spans to tokens.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from lmforge.data.examples import Conversation, Message, Origin
from lmforge.data.tokenizer import CHATML_TEMPLATE
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
TrainOn = Literal["assistant", "all", "last_assistant"]
OverLength = Literal["truncate", "drop", "error"]

# Llama 3 instruct layout (header / content / <|eot_id|>). Tool results use the `ipython`
# role and tool calls are JSON objects with name + parameters, as Llama 3.1 writes them.
LLAMA3_TEMPLATE = (
    "{% if bos_token is defined and bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['tool_calls'] is defined %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{ '{\"name\": \"' + call['name'] + '\", \"parameters\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}' }}"
    "{% endfor %}"
    "{% else %}{{ message['content'] | trim }}{% endif %}"
    "{{ '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2 / Qwen2.5 instruct layout: ChatML with a default system turn, tool schemas in a
# <tools> block of the system turn, calls in <tool_call> tags and results in <tool_response>
# tags of a user turn. The default system text is Qwen2's generic one, not "You are Qwen".
_QWEN2_TOOLS_INTRO = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_QWEN2_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)
QWEN2_TEMPLATE = (
    "{% set default_system = 'You are a helpful assistant.' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}{{ default_system }}{% endif %}"
    '{{ "' + _QWEN2_TOOLS_INTRO + '" }}'
    '{% for tool in tools %}{{ "\\n" }}{{ tool | tojson }}{% endfor %}'
    '{{ "' + _QWEN2_TOOLS_OUTRO + '" }}'
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{% if message['tool_calls'] is defined %}"
    "{% if message['content'] %}{{ message['content'] + '\n' }}{% endif %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "qwen2": QWEN2_TEMPLATE,
}
# Special tokens each built-in writes; a tokenizer that lacks them gets them added.
TEMPLATE_TOKENS: dict[str, list[str]] = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen2": ["<|im_start|>", "<|im_end|>"],
}
# Tokens that close a turn in common templates; a sample must end with one of these (or EOS).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class TokenizedSample:
    """Token ids of one training sample and its labels (IGNORE_INDEX where no loss)."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, IGNORE_INDEX where no loss
    origin: Origin | None = None

    def as_features(self) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids, "labels": self.labels}


@dataclass
class Dropped:
    """A sample left out of training, with the reason counted in the data report."""

    reason: str  # "over_length" or "no supervised tokens after truncation"
    origin: Origin | None = None
    length: int = 0


def ensure_template_tokens(tokenizer: PreTrainedTokenizerBase, name: str | None) -> list[str]:
    """Add the special tokens built-in template `name` needs and the tokenizer lacks (none for None).

    Returns the tokens added (and logs them): the model's embedding grows to fit at build time.
    """
    vocab = tokenizer.get_vocab()
    missing = [token for token in TEMPLATE_TOKENS.get(name or "", []) if token not in vocab]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
        log.warning(
            "chat template %s: added special tokens %s to the tokenizer; the embedding grows to %d rows",
            name,
            ", ".join(missing),
            len(tokenizer),
        )
    return missing


def adopt_template(tokenizer: PreTrainedTokenizerBase, name: str | None) -> str:
    """The template to train with (built-in `name`, else the tokenizer's own), stored on the
    tokenizer with the tokens it needs, so the tokenizer saved with the model (final/,
    `lmforge generate`, TRL's tokenization) renders exactly what training rendered."""
    ensure_template_tokens(tokenizer, name)
    template = resolve_template(tokenizer, name)
    if name is not None:
        tokenizer.chat_template = template
    return template


def resolve_template(tokenizer: PreTrainedTokenizerBase, name: str | None) -> str:
    """The Jinja chat template to render with: built-in `name` when given, else the tokenizer's own."""
    if name is not None:
        if name not in BUILTIN_TEMPLATES:
            raise UserInputError(
                f"data.chat_template: unknown template {name!r}; choose one of {', '.join(BUILTIN_TEMPLATES)}"
            )
        return BUILTIN_TEMPLATES[name]
    own = tokenizer.chat_template
    if isinstance(own, dict):  # several named templates: "default" is what apply_chat_template uses
        own = own.get("default")
    if not own:
        raise UserInputError(
            f"tokenizer {tokenizer.name_or_path or type(tokenizer).__name__} has no chat template; "
            "set data.chat_template: chatml|llama3|qwen2"
        )
    return str(own)


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


def tokenize_conversation(
    conversation: Conversation,
    tokenizer: PreTrainedTokenizerBase,
    *,
    template: str,
    train_on: TrainOn,
    max_length: int,
    over_length: OverLength,
) -> TokenizedSample | Dropped:
    """Tokens and labels of one conversation, ending with a supervised end-of-turn token.

    Labels follow `train_on`; a sample over `max_length` is truncated on the right, dropped,
    or raises UserInputError naming its file:line, per `over_length`.
    """
    ids, turns = _ids_and_assistant_turns(conversation, tokenizer, template)
    return _finish_sample(ids, turns, conversation.origin, tokenizer, train_on, max_length, over_length)


def tokenize_conversations(
    conversations: Sequence[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    *,
    template: str,
    train_on: TrainOn,
    max_length: int,
    over_length: OverLength,
) -> list[TokenizedSample | Dropped]:
    """`tokenize_conversation` for many conversations, same results, faster: conversations
    without tools under a template with generation markers are rendered one by one but
    tokenized in one batch call (the Rust backend spreads it over every core)."""
    marked = _GENERATION_MARKER.search(template) is not None
    batchable = [i for i, c in enumerate(conversations) if not c.tools and marked]
    results: list[TokenizedSample | Dropped | None] = [None] * len(conversations)
    if batchable:
        batch = [conversations[i] for i in batchable]
        for i, (ids, turns) in zip(
            batchable, _batched_ids_and_assistant_turns(batch, tokenizer, template), strict=True
        ):
            results[i] = _finish_sample(
                ids, turns, conversations[i].origin, tokenizer, train_on, max_length, over_length
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
            )
    return [r for r in results if r is not None]


def _batched_ids_and_assistant_turns(
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


def _finish_sample(
    ids: list[int],
    turns: list[tuple[int, int]],
    origin: Origin,
    tokenizer: PreTrainedTokenizerBase,
    train_on: TrainOn,
    max_length: int,
    over_length: OverLength,
) -> TokenizedSample | Dropped:
    """End with the end-of-turn token, set labels per `train_on`, apply the length policy."""
    ids, turns = _end_with_end_of_turn(ids, turns, tokenizer)
    array = np.asarray(ids, dtype=np.int32)  # converted once: the labels copy from it
    labels = _labels_for(array, turns, train_on)
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
    return TokenizedSample(array, labels, origin)


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


def _ids_and_assistant_turns(
    conversation: Conversation, tokenizer: PreTrainedTokenizerBase, template: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the rendered conversation and each assistant turn's [start, end) token span."""
    if _GENERATION_MARKER.search(template):
        return _batched_ids_and_assistant_turns([conversation], tokenizer, template, conversation.tools)[0]
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
                "so assistant turns cannot be located; set data.chat_template: chatml|llama3|qwen2, or add "
                "{% generation %} markers around assistant content in the template"
            )
        spans.append((len(prompt), len(upto.rstrip())))
    return spans


# get_vocab() builds a dict of the whole vocabulary: computed once per tokenizer (and
# again if tokens were added since), not once per sample.
_END_OF_TURN_CACHE: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[int, frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of the tokenizer's EOS and of the common end-of-turn tokens it has."""
    cached = _END_OF_TURN_CACHE.get(tokenizer)
    if cached is not None and cached[0] == len(tokenizer):
        return cached[1]
    vocab = tokenizer.get_vocab()
    ids = {vocab[token] for token in END_OF_TURN_TOKENS if token in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    _END_OF_TURN_CACHE[tokenizer] = (len(tokenizer), frozenset(ids))
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
    # The template's turn ends in plain text (or later turns follow it): append EOS as its own supervised turn.
    return [*ids, int(tokenizer.eos_token_id)], [*turns, (len(ids), len(ids) + 1)]


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
