"""Chat templates: golden renders, loss masks from the rendering, end-of-turn supervision, lengths."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.chat import (
    IGNORE_INDEX,
    Dropped,
    TokenizedSample,
    end_of_turn_ids,
    resolve_template,
    tokenize_conversation,
    tokenize_conversations,
)
from lmforge.data.chat_render import batched_ids_and_assistant_turns as _batched_ids_and_assistant_turns
from lmforge.data.chat_render import message_dicts, render_conversation
from lmforge.data.chat_templates import ensure_template_tokens
from lmforge.data.examples import Conversation, Message, Origin
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = Conversation(
    [
        Message("system", "Answer briefly."),
        Message("user", "What is two plus two?"),
        Message("assistant", "It is four."),
        Message("user", "And three plus three?"),
        Message("assistant", "Six."),
    ],
    Origin("chat.jsonl", 7),
)
TOOL_CHAT = Conversation(
    [
        Message("user", "What is the weather in Paris?"),
        Message(
            "assistant",
            "",
            tool_calls=[
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        ),
        Message("tool", '{"temp_c": 21}', name="get_weather"),
        Message("assistant", "It is 21 degrees in Paris."),
    ],
    Origin("tools.jsonl", 2),
    tools=[WEATHER_TOOL],
)
# The tokenizer's own ChatML template has no tool syntax; chatml/llama3 get the plain chat only.
CASES = [
    (None, CHAT),
    ("chatml", CHAT),
    ("llama3", CHAT),
    ("qwen2", CHAT),
    ("llama3", TOOL_CHAT),
    ("qwen2", TOOL_CHAT),
]
IDS = ["own-chat", "chatml-chat", "llama3-chat", "qwen2-chat", "llama3-tools", "qwen2-tools"]


@pytest.fixture(scope="module")
def base_tokenizer() -> PreTrainedTokenizerFast:
    text = ["What is two plus two? It is four. The weather in Paris is 21 degrees.\n"] * 100
    return train_tokenizer(text, TokenizerTrainConfig(vocab_size=400, min_frequency=1))


def with_template(base: PreTrainedTokenizerFast, name: str | None) -> tuple[PreTrainedTokenizerFast, str]:
    tokenizer = copy.deepcopy(base)
    if name:
        ensure_template_tokens(tokenizer, name)
    return tokenizer, resolve_template(tokenizer, name)


def tokenize(conv: Conversation, tokenizer, template: str, **kw) -> TokenizedSample | Dropped:
    settings = {"train_on": "assistant", "max_length": 4096, "over_length": "error", **kw}
    return tokenize_conversation(conv, tokenizer, template=template, **settings)


def supervised_text(tokenizer, sample: TokenizedSample) -> str:
    return tokenizer.decode([int(t) for t in sample.labels if t != IGNORE_INDEX])


@pytest.mark.parametrize(("name", "conv"), CASES, ids=IDS)
def test_training_text_is_what_apply_chat_template_renders(base_tokenizer, name, conv) -> None:
    tokenizer, template = with_template(base_tokenizer, name)
    if name is None:
        tokenizer.chat_template = template  # the tokenizer's own template, used by default
    expected = tokenizer.apply_chat_template(
        message_dicts(conv.messages), tools=conv.tools, chat_template=template, tokenize=False
    )
    assert render_conversation(conv, tokenizer, template) == expected
    sample = tokenize(conv, tokenizer, template)
    assert isinstance(sample, TokenizedSample)
    # The sample is the rendered text, less only the whitespace the template writes after the last turn.
    decoded = tokenizer.decode(sample.input_ids.tolist())
    assert expected.startswith(decoded) and not expected[len(decoded) :].strip()


@pytest.mark.parametrize(("name", "conv"), CASES, ids=IDS)
def test_sample_ends_with_a_supervised_end_of_turn_token(base_tokenizer, name, conv) -> None:
    tokenizer, template = with_template(base_tokenizer, name)
    sample = tokenize(conv, tokenizer, template)
    assert isinstance(sample, TokenizedSample)
    assert int(sample.input_ids[-1]) in end_of_turn_ids(tokenizer)
    assert sample.labels[-1] == sample.input_ids[-1]


@pytest.mark.parametrize(
    ("name", "end"),
    [(None, "<|im_end|>"), ("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("qwen2", "<|im_end|>")],
)
def test_labels_are_exactly_the_assistant_turns(base_tokenizer, name, end) -> None:
    tokenizer, template = with_template(base_tokenizer, name)
    sample = tokenize(CHAT, tokenizer, template)
    assert supervised_text(tokenizer, sample) == f"It is four.{end}Six.{end}"
    last = tokenize(CHAT, tokenizer, template, train_on="last_assistant")
    assert supervised_text(tokenizer, last) == f"Six.{end}"
    every = tokenize(CHAT, tokenizer, template, train_on="all")
    assert np.array_equal(every.labels, every.input_ids)


def test_qwen2_tool_calls_are_supervised_and_tool_results_are_not(base_tokenizer) -> None:
    tokenizer, template = with_template(base_tokenizer, "qwen2")
    text = render_conversation(TOOL_CHAT, tokenizer, template)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert "<|im_start|>user\n<tool_response>\n" in text
    sample = tokenize(TOOL_CHAT, tokenizer, template)
    assert supervised_text(tokenizer, sample) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        "It is 21 degrees in Paris.<|im_end|>"
    )


def test_own_template_without_generation_markers_is_masked_from_the_rendering(base_tokenizer) -> None:
    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    sample = tokenize(CHAT, tokenizer, resolve_template(tokenizer, None))
    assert supervised_text(tokenizer, sample) == "It is four.<|im_end|>Six.<|im_end|>"
    assert sample.labels[-1] == sample.input_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_template_resolution_and_added_tokens(base_tokenizer) -> None:
    tokenizer = copy.deepcopy(base_tokenizer)
    assert resolve_template(tokenizer, None) == tokenizer.chat_template
    before = len(tokenizer)
    assert ensure_template_tokens(tokenizer, "llama3") == [
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    assert len(tokenizer) == before + 3 and ensure_template_tokens(tokenizer, "llama3") == []
    assert tokenizer.tokenize("<|eot_id|>") == ["<|eot_id|>"]  # one special token, never split
    assert ensure_template_tokens(tokenizer, "chatml") == []
    tokenizer.chat_template = None
    with pytest.raises(
        UserInputError,
        match=r"has no chat template; set data.chat_template to your model family's template: chatml, llama2, ",
    ):
        resolve_template(tokenizer, None)
    with pytest.raises(UserInputError, match="unknown chat template 'vicuna'"):
        resolve_template(tokenizer, "vicuna")


def test_over_length_truncate_drop_and_error(base_tokenizer) -> None:
    tokenizer, template = with_template(base_tokenizer, "chatml")
    full = tokenize(CHAT, tokenizer, template)
    limit = len(full.input_ids) - 3
    cut = tokenize(CHAT, tokenizer, template, max_length=limit, over_length="truncate")
    assert isinstance(cut, TokenizedSample)
    assert np.array_equal(cut.input_ids, full.input_ids[:limit])
    assert np.array_equal(cut.labels, full.labels[:limit])
    dropped = tokenize(CHAT, tokenizer, template, max_length=limit, over_length="drop")
    assert isinstance(dropped, Dropped) and dropped.reason == "over_length"
    assert dropped.origin == CHAT.origin and dropped.length == len(full.input_ids)
    message = f"chat.jsonl:7: the sample is {len(full.input_ids)} tokens, longer than data.max_length={limit}"
    with pytest.raises(UserInputError, match=message) as err:
        tokenize(CHAT, tokenizer, template, max_length=limit, over_length="error")
    assert "raise data.max_length, or set data.over_length to truncate or drop" in str(err.value)


def test_truncation_that_leaves_no_supervised_token_is_dropped(base_tokenizer) -> None:
    tokenizer, template = with_template(base_tokenizer, "chatml")
    # Only the final assistant turn is supervised, and truncation removes all of it.
    sample = tokenize(
        CHAT, tokenizer, template, max_length=12, over_length="truncate", train_on="last_assistant"
    )
    assert isinstance(sample, Dropped)
    assert sample.reason == "no supervised tokens after truncation"


@pytest.mark.parametrize("name", [None, "chatml", "llama3", "qwen2"])
def test_batched_tokenization_equals_one_by_one(base_tokenizer, name) -> None:
    """The batched fast path (used by `lmforge prepare`) gives exactly the per-row results."""
    tokenizer, template = with_template(base_tokenizer, name)
    conversations = [CHAT, TOOL_CHAT if name in ("llama3", "qwen2") else CHAT, CHAT]
    settings = {"train_on": "assistant", "max_length": 40, "over_length": "truncate"}
    batched = tokenize_conversations(conversations, tokenizer, template=template, **settings)
    single = [tokenize_conversation(c, tokenizer, template=template, **settings) for c in conversations]
    assert len(batched) == len(single) == 3
    for one, other in zip(batched, single, strict=True):
        assert type(one) is type(other)
        if isinstance(one, TokenizedSample):
            assert one.input_ids.tolist() == other.input_ids.tolist()
            assert one.labels.tolist() == other.labels.tolist()


@pytest.mark.parametrize(("name", "conv"), [c for c in CASES if c[0] is not None], ids=IDS[1:])
def test_assistant_spans_match_apply_chat_template_mask(base_tokenizer, name, conv) -> None:
    """lmforge maps the renderer's character spans to tokens itself (no per-token loop);
    the result must be exactly the mask transformers' apply_chat_template computes."""
    tokenizer, template = with_template(base_tokenizer, name)
    reference = tokenizer.apply_chat_template(
        message_dicts(conv.messages),
        tools=conv.tools,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    [(ids, turns)] = _batched_ids_and_assistant_turns([conv], tokenizer, template, conv.tools)
    mask = np.zeros(len(ids), dtype=int)
    for start, end in turns:
        mask[start:end] = 1
    assert ids == list(reference["input_ids"])
    assert mask.tolist() == list(reference["assistant_masks"])
