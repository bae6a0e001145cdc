"""The catalogue of built-in chat templates: each renders what its family's own template renders,
masks exactly what the assistant writes, and stops generation on the family's stop tokens.

The families' own templates come from TRL, installed here (trl/chat_templates/*.jinja, whose
README.md says where each came from). Families TRL has none of (Llama 2, Mistral, Phi-4, GLM-4,
ChatML) are checked against golden strings of their published formats. Deliberate differences
are named where they are tested.
"""

from __future__ import annotations

import copy
import json
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from lmforge.config.chat_template_names import CHAT_TEMPLATE_NAMES, LLAMAFACTORY_ALIASES
from lmforge.config.load import load_config
from lmforge.config.schema import DataConfig, SourceConfig, TokenizerTrainConfig
from lmforge.data import sft
from lmforge.data.chat import (
    END_OF_TURN_TOKENS,
    IGNORE_INDEX,
    TokenizedSample,
    adopt_template,
    end_of_turn_ids,
    stop_token_ids,
    tokenize_conversation,
    turn_end_tokens,
)
from lmforge.data.chat_render import batched_ids_and_assistant_turns, has_generation_markers, message_dicts
from lmforge.data.chat_templates import BUILTIN_TEMPLATES, CATALOGUE, ensure_template_tokens
from lmforge.data.examples import Conversation, Message, Origin
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.evaluate.generation import generation_kwargs
from lmforge.train.final import stop_at_template_turn_end

SYSTEM = {"role": "system", "content": "You answer briefly."}
USER_1 = {"role": "user", "content": "What is two plus two?"}
ANSWER_1 = {"role": "assistant", "content": "It is four."}
USER_2 = {"role": "user", "content": "And three plus three?"}
ANSWER_2 = {"role": "assistant", "content": "Six."}
CONVERSATIONS = {
    "single": [USER_1, ANSWER_1],
    "multi": [USER_1, ANSWER_1, USER_2, ANSWER_2],
    "system-single": [SYSTEM, USER_1, ANSWER_1],
    "system-multi": [SYSTEM, USER_1, ANSWER_1, USER_2, ANSWER_2],
    "prompt": [USER_1],
    "system-prompt": [SYSTEM, USER_1],
    "system-multi-prompt": [SYSTEM, USER_1, ANSWER_1, USER_2],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# Family-like special tokens for the renders (the templates read them as variables).
SPECIAL = {"bos_token": "<BOS>", "eos_token": "<EOS>"}


def trl_template(file_name: str) -> str:
    return (files("trl") / "chat_templates" / file_name).read_text(encoding="utf-8")


def render(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """What apply_chat_template renders, through the same transformers renderer."""
    rendered, _ = render_jinja_template(
        [messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        **{**SPECIAL, **variables},
    )
    return str(rendered[0])


def tool_conversation(arguments_as_text: bool = False, content: str = "") -> list[dict[str, Any]]:
    """Two tool calls in one turn, two results, then the answer."""

    def call(name: str) -> dict[str, Any]:
        arguments: Any = {"city": "Paris"}
        return {
            "type": "function",
            "function": {
                "name": name,
                "arguments": json.dumps(arguments) if arguments_as_text else arguments,
            },
        }

    return [
        SYSTEM,
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": [call("get_weather"), call("get_time")]},
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "tool", "content": '{"time": "10:00"}'},
        {"role": "assistant", "content": "21 degrees at 10 am."},
    ]


# (ours, TRL file, conversations compared, template variables). Differences, all deliberate:
# - gemma: gemma.jinja refuses a system message; ours puts it at the top of the first user turn, as
#   gemma3.jinja (same turn format) and LLaMA-Factory do, so conversations with one are compared there;
# - qwen2: with no system message ours adds Qwen2's "You are a helpful assistant.", Qwen2.5's
#   template "You are Qwen, created by Alibaba Cloud. ...": compared with an explicit system message;
# - deepseek: DeepSeek's template (the R1 revision TRL ships) always opens the answer with
#   "<think>\n"; ours only with enable_thinking=True, so a model tuned on plain answers is prompted
#   as it was trained (test_deepseek_differences);
# - llama3 is Llama 3's layout: Llama 3.1's template (llama3_1.jinja) adds a dated system header.
WITHOUT_SYSTEM = [name for name in CONVERSATIONS if not name.startswith("system")]
WITH_SYSTEM = [name for name in CONVERSATIONS if name.startswith("system")]
GOLDEN_AGAINST_TRL = [
    ("llama3", "llama3.jinja", list(CONVERSATIONS), {}),
    ("gemma", "gemma.jinja", WITHOUT_SYSTEM, {}),
    ("gemma", "gemma3.jinja", list(CONVERSATIONS), {}),
    ("phi3", "phi3.jinja", list(CONVERSATIONS), {}),
    ("phi3", "phi3_5.jinja", list(CONVERSATIONS), {}),
    ("qwen2", "qwen2_5.jinja", WITH_SYSTEM, {}),
    ("qwen3", "qwen3.jinja", list(CONVERSATIONS), {}),
    ("qwen3", "qwen3.jinja", list(CONVERSATIONS), {"enable_thinking": False}),
    ("qwen3_nothink", "qwen3_instruct_2507.jinja", list(CONVERSATIONS), {}),
    ("deepseek", "deepseekv3.jinja", list(CONVERSATIONS), {"enable_thinking": True}),
    ("deepseek", "deepseek_r1_distill.jinja", list(CONVERSATIONS), {"enable_thinking": True}),
    ("glm4_moe", "glm4moe.jinja", list(CONVERSATIONS), {}),
    ("glm4_moe", "glm4moe.jinja", list(CONVERSATIONS), {"enable_thinking": False}),
]


@pytest.mark.parametrize(
    ("name", "trl_file", "conversations", "variables"),
    GOLDEN_AGAINST_TRL,
    ids=[f"{g[0]}-vs-{g[1]}{'-' + str(g[3]) if g[3] else ''}" for g in GOLDEN_AGAINST_TRL],
)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_renders_what_the_familys_own_template_renders(
    name: str, trl_file: str, conversations: list[str], variables: dict[str, Any], add_generation_prompt: bool
) -> None:
    theirs = trl_template(trl_file)
    for conversation in conversations:
        messages = CONVERSATIONS[conversation]
        expected = render(theirs, messages, add_generation_prompt, **variables)
        assert render(BUILTIN_TEMPLATES[name], messages, add_generation_prompt, **variables) == expected, (
            conversation
        )


# Tool calls: dict arguments, except DeepSeek's own template, which only concatenates strings
# (TRL's deepseekv3_training.jinja applies tojson to them: compared with dict arguments there).
GOLDEN_TOOLS = [
    ("qwen2", "qwen2_5.jinja", False),
    ("qwen3", "qwen3.jinja", False),
    ("qwen3_nothink", "qwen3_instruct_2507.jinja", False),
    ("deepseek", "deepseekv3.jinja", True),
    ("deepseek", "deepseekv3_training.jinja", False),
    ("glm4_moe", "glm4moe.jinja", False),
]


@pytest.mark.parametrize(("name", "trl_file", "arguments_as_text"), GOLDEN_TOOLS)
@pytest.mark.parametrize("content", ["", "Let me check."])
def test_tool_calls_render_as_the_familys_own_template(
    name: str, trl_file: str, arguments_as_text: bool, content: str
) -> None:
    theirs = trl_template(trl_file)
    messages = tool_conversation(arguments_as_text, content)
    for upto, prompt in ((len(messages), False), (len(messages) - 1, True)):  # answered, and awaiting one
        variables = {"enable_thinking": True} if name == "deepseek" else {}
        expected = render(theirs, messages[:upto], prompt, [WEATHER, TIME], **variables)
        assert (
            render(BUILTIN_TEMPLATES[name], messages[:upto], prompt, [WEATHER, TIME], **variables) == expected
        )


# Families TRL has no template of: golden strings of their published formats.
GOLDEN_PUBLISHED = [
    (
        "chatml",
        "system-multi-prompt",
        "<|im_start|>system\nYou answer briefly.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nIt is four.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    # Meta's Llama-2-chat: <<SYS>> inside the first [INST], BOS before every [INST], ' {answer} </s>'.
    (
        "llama2",
        "system-multi",
        "<s>[INST] <<SYS>>\nYou answer briefly.\n<</SYS>>\n\nWhat is two plus two? [/INST] It is four. </s>"
        "<s>[INST] And three plus three? [/INST] Six. </s>",
    ),
    ("llama2", "prompt", "<s>[INST] What is two plus two? [/INST]"),
    # Mistral instruct v0.3.
    (
        "mistral",
        "multi",
        "<s>[INST] What is two plus two?[/INST] It is four.</s>[INST] And three plus three?[/INST] Six.</s>",
    ),
    ("mistral", "system-prompt", "<s>[INST] You answer briefly.\n\nWhat is two plus two?[/INST]"),
    # microsoft/phi-4.
    (
        "phi4",
        "system-multi-prompt",
        "<|im_start|>system<|im_sep|>You answer briefly.<|im_end|><|im_start|>user<|im_sep|>What is two plus "
        "two?<|im_end|><|im_start|>assistant<|im_sep|>It is four.<|im_end|><|im_start|>user<|im_sep|>And three "
        "plus three?<|im_end|><|im_start|>assistant<|im_sep|>",
    ),
    # GLM-4-9B-chat / GLM-4-0414.
    (
        "glm4",
        "system-multi",
        "[gMASK]<sop><|system|>\nYou answer briefly.<|user|>\nWhat is two plus two?<|assistant|>\nIt is four."
        "<|user|>\nAnd three plus three?<|assistant|>\nSix.",
    ),
    ("glm4", "prompt", "[gMASK]<sop><|user|>\nWhat is two plus two?<|assistant|>"),
]


@pytest.mark.parametrize(("name", "conversation", "expected"), GOLDEN_PUBLISHED)
def test_renders_the_published_format(name: str, conversation: str, expected: str) -> None:
    messages = CONVERSATIONS[conversation]
    prompt = messages[-1]["role"] != "assistant"
    assert render(BUILTIN_TEMPLATES[name], messages, prompt, bos_token="<s>", eos_token="</s>") == expected


def test_documented_differences() -> None:
    # Mistral v0.3's own template puts the system prompt in the last user message (and drops it once
    # an assistant turn ends the chat); ours keeps it in the first, as v0.1/v0.2 and LLaMA-Factory.
    mistral = render(
        BUILTIN_TEMPLATES["mistral"], CONVERSATIONS["system-multi"], bos_token="<s>", eos_token="</s>"
    )
    assert mistral.startswith("<s>[INST] You answer briefly.\n\nWhat is two plus two?[/INST]")
    qwen2 = render(BUILTIN_TEMPLATES["qwen2"], CONVERSATIONS["prompt"], True)
    assert qwen2.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    llama31 = render(trl_template("llama3_1.jinja"), CONVERSATIONS["prompt"], True)
    assert "Cutting Knowledge Date" in llama31
    assert "Cutting Knowledge Date" not in render(BUILTIN_TEMPLATES["llama3"], CONVERSATIONS["prompt"], True)


def test_deepseek_differences() -> None:
    """Reasoning stays in the training target (DeepSeek's template drops everything up to </think>),
    and the generation prompt opens no <think> block unless asked to."""
    reasoned = [USER_1, {"role": "assistant", "content": "<think>\n2+2\n</think>\n\nIt is four."}]
    ours = render(BUILTIN_TEMPLATES["deepseek"], reasoned)
    assert ours.endswith("<｜Assistant｜><think>\n2+2\n</think>\n\nIt is four.<｜end▁of▁sentence｜>")
    assert "<think>" not in render(trl_template("deepseekv3.jinja"), reasoned)
    prompt = render(BUILTIN_TEMPLATES["deepseek"], CONVERSATIONS["prompt"], True)
    assert prompt == "<BOS><｜User｜>What is two plus two?<｜Assistant｜>"


@pytest.mark.parametrize("name", CHAT_TEMPLATE_NAMES)
@pytest.mark.parametrize("conversation", ["system-multi", "multi"])
def test_the_answer_starts_where_the_generation_prompt_ends(name: str, conversation: str) -> None:
    """What generation is prompted with is what training rendered before the answer, and the
    supervised span starts right there: the model learns to write exactly what follows the prompt."""
    messages = CONVERSATIONS[conversation]
    prompt = render(BUILTIN_TEMPLATES[name], messages[:-1], True)
    rendered, spans = render_jinja_template(
        [messages], chat_template=BUILTIN_TEMPLATES[name], return_assistant_tokens_mask=True, **SPECIAL
    )
    assert rendered[0].startswith(prompt)
    assert spans[0][-1][0] == len(prompt)


@pytest.fixture(scope="module")
def base_tokenizer() -> PreTrainedTokenizerFast:
    text = ["What is two plus two? It is four. And three plus three? Six. You answer briefly.\n"] * 100
    return train_tokenizer(text, TokenizerTrainConfig(vocab_size=400, min_frequency=1))


def adopted(base: PreTrainedTokenizerFast, name: str) -> PreTrainedTokenizerFast:
    tokenizer = copy.deepcopy(base)
    adopt_template(tokenizer, name)
    return tokenizer


CHAT = Conversation(
    [Message(m["role"], m["content"]) for m in CONVERSATIONS["system-multi"]], Origin("chat.jsonl", 1)
)
EOS = "<|endoftext|>"  # the test tokenizer's; Llama 2 and Mistral end a turn with EOS
# What the assistant writes in CHAT under each template: content and the token ending its turn
# (GLM: the next role token, and EOS after the last answer; Phi-3: the template's closing EOS).
SUPERVISED = {
    "chatml": ("It is four.<|im_end|>", "Six.<|im_end|>"),
    "llama2": (f" It is four. {EOS}", f" Six. {EOS}"),
    "llama3": ("It is four.<|eot_id|>", "Six.<|eot_id|>"),
    "mistral": (f" It is four.{EOS}", f" Six.{EOS}"),
    "gemma": ("It is four.<end_of_turn>", "Six.<end_of_turn>"),
    "phi3": ("It is four.<|end|>", f"Six.<|end|>\n{EOS}"),
    "phi4": ("It is four.<|im_end|>", "Six.<|im_end|>"),
    "qwen2": ("It is four.<|im_end|>", "Six.<|im_end|>"),
    "qwen3": ("It is four.<|im_end|>", "<think>\n\n</think>\n\nSix.<|im_end|>"),
    "qwen3_nothink": ("It is four.<|im_end|>", "Six.<|im_end|>"),
    "deepseek": ("It is four.<｜end▁of▁sentence｜>", "Six.<｜end▁of▁sentence｜>"),
    "glm4": ("\nIt is four.<|user|>", f"\nSix.{EOS}"),
    "glm4_moe": ("\n<think></think>\nIt is four.<|user|>", f"\n<think></think>\nSix.{EOS}"),
}


def supervised_text(tokenizer: PreTrainedTokenizerFast, sample: TokenizedSample) -> str:
    return str(tokenizer.decode([int(t) for t in sample.labels if t != IGNORE_INDEX]))


@pytest.mark.parametrize("name", CHAT_TEMPLATE_NAMES)
def test_labels_are_exactly_what_the_assistant_writes(base_tokenizer, name: str) -> None:
    tokenizer = adopted(base_tokenizer, name)
    settings: dict[str, Any] = {"max_length": 4096, "over_length": "error"}
    template = BUILTIN_TEMPLATES[name]
    sample = tokenize_conversation(CHAT, tokenizer, template=template, train_on="assistant", **settings)
    last = tokenize_conversation(CHAT, tokenizer, template=template, train_on="last_assistant", **settings)
    assert isinstance(sample, TokenizedSample) and isinstance(last, TokenizedSample)
    assert supervised_text(tokenizer, sample) == "".join(SUPERVISED[name])
    assert supervised_text(tokenizer, last) == SUPERVISED[name][1]  # the answer, not its EOS alone
    assert int(sample.input_ids[-1]) in end_of_turn_ids(tokenizer)
    assert sample.labels[-1] == sample.input_ids[-1]


@pytest.mark.parametrize("name", CHAT_TEMPLATE_NAMES)
def test_assistant_spans_match_apply_chat_template_mask(base_tokenizer, name: str) -> None:
    tokenizer = adopted(base_tokenizer, name)
    reference = tokenizer.apply_chat_template(
        message_dicts(CHAT.messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    [(ids, turns)] = batched_ids_and_assistant_turns([CHAT], tokenizer, BUILTIN_TEMPLATES[name])
    mask = np.zeros(len(ids), dtype=int)
    for start, end in turns:
        mask[start:end] = 1
    assert ids == list(reference["input_ids"])
    assert mask.tolist() == list(reference["assistant_masks"])


# The tokens generation must stop on, besides the tokenizer's EOS (Llama 2, Mistral: EOS only).
STOPS = {
    "chatml": ["<|im_end|>"],
    "llama2": [],
    "llama3": ["<|eot_id|>"],
    "mistral": [],
    "gemma": ["<end_of_turn>"],
    "phi3": ["<|end|>"],
    "phi4": ["<|im_end|>"],
    "qwen2": ["<|im_end|>", EOS],
    "qwen3": ["<|im_end|>", EOS],
    "qwen3_nothink": ["<|im_end|>", EOS],
    "deepseek": ["<｜end▁of▁sentence｜>"],
    "glm4": ["<|user|>", "<|observation|>", EOS],
    "glm4_moe": ["<|user|>", "<|observation|>", EOS],
}


@pytest.mark.parametrize("name", CHAT_TEMPLATE_NAMES)
def test_generation_stops_on_the_templates_stop_tokens(base_tokenizer, name: str) -> None:
    tokenizer = adopted(base_tokenizer, name)
    assert list(turn_end_tokens(tokenizer)) == STOPS[name]
    expected = {tokenizer.convert_tokens_to_ids(t) for t in STOPS[name]} | {tokenizer.eos_token_id}
    assert stop_token_ids(tokenizer) == expected
    assert generation_kwargs(tokenizer, 8)["eos_token_id"] == sorted(expected)
    assert set(STOPS[name]) <= set(END_OF_TURN_TOKENS)  # training recognises them as turn ends too


def test_a_template_that_is_no_built_in_stops_on_every_familys_turn_end(base_tokenizer) -> None:
    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.chat_template = BUILTIN_TEMPLATES["chatml"].replace("<|im_end|>\n", "<|im_end|>\n\n")
    assert turn_end_tokens(tokenizer) == END_OF_TURN_TOKENS
    assert stop_token_ids(tokenizer) == end_of_turn_ids(tokenizer)


@pytest.mark.parametrize(
    ("name", "expected"), [("llama3", "<|eot_id|>"), ("gemma", "<end_of_turn>"), ("glm4", "<|user|>")]
)
def test_final_generation_config_stops_at_the_end_of_the_turn(
    base_tokenizer, name: str, expected: str
) -> None:
    tokenizer = adopted(base_tokenizer, name)
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=3))
    stop_at_template_turn_end(model, tokenizer)
    listed = model.generation_config.eos_token_id
    assert listed == sorted({3} | stop_token_ids(tokenizer))
    assert tokenizer.convert_tokens_to_ids(expected) in listed
    own = copy.deepcopy(base_tokenizer)
    own.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no built-in: left alone
    untouched = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=3))
    stop_at_template_turn_end(untouched, own)
    assert untouched.generation_config.eos_token_id == 3


def test_the_catalogue_is_complete_and_marked() -> None:
    assert tuple(CATALOGUE) == CHAT_TEMPLATE_NAMES
    for name, template in CATALOGUE.items():
        assert has_generation_markers(template.text), name
    assert set(LLAMAFACTORY_ALIASES.values()) <= set(CHAT_TEMPLATE_NAMES)


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("gemma2", "gemma"),
        ("gemma3", "gemma"),
        ("phi", "phi3"),
        ("qwen", "qwen2"),
        ("deepseek3", "deepseek"),
        ("deepseekr1", "deepseek"),
        ("yi", "chatml"),
        ("llama3", "llama3"),
        ("glm4_moe", "glm4_moe"),
    ],
)
def test_llamafactory_names_resolve(base_tokenizer, alias: str, name: str) -> None:
    assert DataConfig(train=[SourceConfig(path="x.jsonl")], chat_template=alias).chat_template == name
    tokenizer = copy.deepcopy(base_tokenizer)
    adopt_template(tokenizer, alias)
    assert tokenizer.chat_template == BUILTIN_TEMPLATES[name]


def test_unknown_and_refused_names_are_explained(base_tokenizer, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("model: {path: x}\ndata:\n  train: [{path: a.jsonl}]\n  chat_template: vicuna\n")
    with pytest.raises(UserInputError) as err:
        load_config(config)
    message = str(err.value)
    assert "config.yaml:4: data.chat_template: unknown chat template 'vicuna'" in message
    assert (
        "(chatml, llama2, llama3, mistral, gemma, phi3, phi4, qwen2, qwen3, qwen3_nothink, deepseek"
        in message
    )
    assert "qwen -> qwen2" in message
    with pytest.raises(
        UserInputError, match="'default' is LLaMA-Factory's own 'Human: ... Assistant: ...' format"
    ):
        load_config(config, ["data.chat_template=default"])
    with pytest.raises(UserInputError, match="unknown chat template 'vicuna'"):
        adopt_template(copy.deepcopy(base_tokenizer), "vicuna")


@pytest.mark.parametrize(
    ("yaml_text", "where"),
    [
        ("model: {path: x}\ndata:\n  train: [{path: a.jsonl}]\n  template: llama3\n", "data.template"),
        ("model: {path: x}\ntemplate: llama3\ndata:\n  train: [{path: a.jsonl}]\n", "template"),
    ],
)
def test_llamafactorys_template_key_points_to_chat_template(
    tmp_path: Path, yaml_text: str, where: str
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml_text)
    with pytest.raises(UserInputError, match=f"{where}: unknown key; did you mean 'data.chat_template'"):
        load_config(config)


def test_templates_without_a_tool_format_refuse_tools(base_tokenizer) -> None:
    tokenizer = adopted(base_tokenizer, "gemma")
    conversation = Conversation(
        [Message(m["role"], m["content"], tool_calls=m.get("tool_calls")) for m in tool_conversation()[1:]],
        Origin("tools.jsonl", 1),
        tools=[WEATHER],
    )
    with pytest.raises(UserInputError, match="the gemma chat template has no tool-call format; use llama3"):
        tokenize_conversation(
            conversation,
            tokenizer,
            template=BUILTIN_TEMPLATES["gemma"],
            train_on="assistant",
            max_length=4096,
            over_length="error",
        )


@pytest.mark.parametrize("name", ["llama2", "mistral", "gemma"])
def test_a_later_system_message_is_refused_where_the_family_has_no_place_for_it(name: str) -> None:
    messages = [*CONVERSATIONS["system-single"], {"role": "system", "content": "Now in French."}, USER_2]
    with pytest.raises(Exception, match=f"the {name} chat template takes one system message, the first"):
        render(BUILTIN_TEMPLATES[name], messages, True)


def test_added_tokens_are_single_special_tokens(base_tokenizer) -> None:
    tokenizer = copy.deepcopy(base_tokenizer)
    assert ensure_template_tokens(tokenizer, "gemma2") == ["<start_of_turn>", "<end_of_turn>"]
    assert tokenizer.tokenize("<end_of_turn>") == ["<end_of_turn>"]
    assert ensure_template_tokens(tokenizer, "llama2") == []  # [INST] is text in Llama 2's tokenizer


@pytest.mark.parametrize(
    ("chat_template", "first_turn"),
    [
        ("gemma2", "<start_of_turn>user\nYou answer questions about words briefly.\n\nHow many letters"),
        ("mistral", "[INST] You answer questions about words briefly.\n\nHow many letters"),
    ],
)
def test_sft_prepare_with_a_family_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chat_template: str, first_turn: str
) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": "How many letters are in 'emubc'?"},
                {"role": "assistant", "content": "'emubc' has 5 letters."},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "You answer questions about words briefly."},
                {"role": "user", "content": "How many letters are in 'bqgbcnn'?"},
                {"role": "assistant", "content": "'bqgbcnn' has 7 letters."},
                {"role": "user", "content": "Spell 'bqgbcnn' backwards."},
                {"role": "assistant", "content": "nncbgqb"},
            ]
        },
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = train_tokenizer(
        [json.dumps(row) for row in rows] * 20, TokenizerTrainConfig(vocab_size=400, min_frequency=1)
    )
    monkeypatch.setattr(sft, "_worker_count", lambda: 1)
    cfg = DataConfig(train=[SourceConfig(path=str(data))], max_length=256, chat_template=chat_template)
    prepared = sft.prepare_sft_data(
        cfg, tokenizer, seed=0, cache_dir=tmp_path / "cache", quarantine_path=tmp_path / "bad.jsonl"
    )
    assert cfg.chat_template == {"gemma2": "gemma", "mistral": "mistral"}[chat_template]
    assert prepared.report["chat_template"] == cfg.chat_template  # what rendered, not the alias
    end = "<end_of_turn>" if cfg.chat_template == "gemma" else EOS
    lead = "" if cfg.chat_template == "gemma" else " "
    texts = {}
    for index in range(len(prepared.train)):
        sample = prepared.train.sample(index)
        ids, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
        texts[tokenizer.decode(ids)] = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
        assert labels[-1] == ids[-1] == tokenizer.convert_tokens_to_ids(end)
    [(text, supervised)] = [(t, s) for t, s in texts.items() if "bqgbcnn" in t]
    assert first_turn in text
    assert supervised == f"{lead}'bqgbcnn' has 7 letters.{end}{lead}nncbgqb{end}"
