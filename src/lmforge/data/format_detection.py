"""Which format the rows of a fine-tuning source are in, and which column holds each role.

`build_row_format` turns a source's `format` and `columns` settings (and the keys of its
first row, for `format: auto` and for the layout of preference / kto rows) into the
`RowFormat` that `row_formats.read_row` reads every row with.

Column roles and their default column names (override any with `source.columns`, which
uses LLaMA-Factory's role names, e.g. `columns: {prompt: question, response: answer}`):

| format | roles (default column) |
|---|---|
| alpaca | prompt (instruction), query (input), response (output), system (system), history (history) |
| sharegpt | messages (conversations), system (system), tools (tools); tags: see `conversation_formats` |
| messages | messages (messages), tools (tools), role_tag (role), content_tag (content) |
| preference | chosen (chosen), rejected (rejected) + the prompt in alpaca, sharegpt or messages layout, or TRL's rows: prompt (prompt; a string or messages), or none when chosen / rejected are whole conversations |
| kto | kto_tag (kto_tag, else label) + a conversation in alpaca, sharegpt or messages layout |
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from lmforge.data.conversation_formats import SHAREGPT_TAGS
from lmforge.errors import UserInputError

Layout = Literal["alpaca", "sharegpt", "messages"]
Task = Literal["sft", "preference", "kto"]

LAYOUT_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
        "images": "images",
    },
    "sharegpt": {
        "messages": "conversations",
        "system": "system",
        "tools": "tools",
        "images": "images",
        **SHAREGPT_TAGS,
    },
    "messages": {
        "messages": "messages",
        "tools": "tools",
        "role_tag": "role",
        "content_tag": "content",
        "images": "images",
    },
}
TASK_COLUMNS: dict[str, dict[str, str]] = {
    "sft": {},
    "preference": {"chosen": "chosen", "rejected": "rejected"},
    "kto": {"kto_tag": "kto_tag"},
}
FORMAT_VALUES = "text, alpaca, sharegpt, messages, preference, kto"
# Two-column rows people write, prompt column first: read as alpaca with these columns when a
# row has no layout's own keys (format: auto), and named in the fix when `format: alpaca` is
# given without `columns:`.
PROMPT_RESPONSE_PAIRS = (
    ("prompt", "response"),
    ("question", "answer"),
    ("input", "output"),
    ("query", "response"),
    ("prompt", "completion"),
    ("instruction", "response"),
)


def prompt_response_columns(keys: Collection[str]) -> dict[str, str] | None:
    """`columns:` for a row whose keys are one of PROMPT_RESPONSE_PAIRS, else None."""
    for prompt, response in PROMPT_RESPONSE_PAIRS:
        if prompt in keys and response in keys:
            return {"prompt": prompt, "response": response}
    return None


@dataclass(frozen=True)
class RowFormat:
    """How to read the rows of one source: the layout of the conversation, the task, the columns."""

    layout: Layout
    task: Task
    columns: Mapping[str, str] = field(default_factory=dict)  # role -> column name, defaults filled in


def detect_format(keys: Collection[str], file: str, columns: Mapping[str, str] | None = None) -> str:
    """The format a row with these keys is in: text, alpaca, sharegpt, messages, preference or kto.

    Raises UserInputError naming the file, the keys and the `format:` values when the keys
    fit no format or more than one.
    """
    present = _canonical_keys(keys, columns or {})
    layouts = [name for name, needs in _LAYOUT_KEYS.items() if needs <= present]
    if not layouts and prompt_response_columns(present):
        layouts = ["alpaca"]  # {prompt, response}, {question, answer}, ...: build_row_format maps them
    tasks = [
        t for t, needs in (("preference", {"chosen", "rejected"}), ("kto", {"kto_tag"})) if needs <= present
    ]
    if not layouts and tasks == ["preference"]:
        layouts = ["alpaca"]  # TRL's {prompt, chosen, rejected} or prompt-less {chosen, rejected} rows
    if "label" in present and "kto_tag" not in present:
        tasks.append("kto")
    problem = None
    if len(layouts) != 1:
        problem = (
            "they fit no known format" if not layouts else f"they fit several formats ({', '.join(layouts)})"
        )
    elif len(tasks) > 1:
        problem = "they hold both preference (chosen/rejected) and kto (kto_tag/label) columns"
    elif tasks and layouts[0] == "text":
        problem = f"a text row cannot be a {tasks[0]} row"
    if problem:
        raise UserInputError(
            f"{file}: cannot detect the data format from the row keys ({', '.join(sorted(keys)) or 'none'}): "
            f"{problem}. Fix: set `format:` on this source to one of {FORMAT_VALUES} "
            "(and `columns:` to map your column names)."
        )
    return tasks[0] if tasks else layouts[0]


_LAYOUT_KEYS = {
    "sharegpt": {"conversations"},
    "messages": {"messages"},
    "alpaca": {"instruction"},
    "text": {"text"},
}


def _canonical_keys(keys: Collection[str], columns: Mapping[str, str]) -> set[str]:
    # A mapped column counts as its role's default name, so `columns: {prompt: question}` finds alpaca.
    defaults = {
        **LAYOUT_COLUMNS["alpaca"],
        "messages": "conversations",
        "chosen": "chosen",
        "rejected": "rejected",
    }
    present = set(keys)
    for role, column in columns.items():
        if column in keys and role in defaults:
            present.add(defaults[role])
        if column in keys and role == "kto_tag":
            present.add("kto_tag")
    return present


_SHAREGPT_ONLY_TAGS = {"user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag"}


def layout_of(keys: Collection[str], columns: Mapping[str, str]) -> Layout:
    """The conversation layout of a preference or kto row: sharegpt, messages or alpaca.

    Explicit columns decide first (sharegpt tags -> sharegpt, alpaca roles -> alpaca, a
    `messages` column -> sharegpt as in LLaMA-Factory), then the row's keys.
    """
    if _SHAREGPT_ONLY_TAGS & set(columns):
        return "sharegpt"
    if {"prompt", "query", "response", "history"} & set(columns):
        return "alpaca"
    if "messages" in columns and columns["messages"] in keys:
        return "messages" if "role_tag" in columns else "sharegpt"
    for layout in ("sharegpt", "messages", "alpaca"):
        if _LAYOUT_KEYS[layout] <= set(keys):
            return layout  # type: ignore[return-value]
    return "alpaca"  # its missing-field errors then say which columns are needed


def build_row_format(
    format_name: str, columns: Mapping[str, str], first_keys: Collection[str], file: str
) -> RowFormat:
    """The RowFormat of a source given its `format` and `columns` and the keys of its first row."""
    requested = format_name
    if format_name == "auto":
        format_name = detect_format(first_keys, file, columns)
        if format_name == "alpaca" and not columns and "instruction" not in first_keys:
            columns = prompt_response_columns(first_keys) or columns
    if format_name == "text":
        raise UserInputError(
            f"{file}: the rows hold plain text (format text), which is pretraining data. Fix: use "
            "train.stage: pretrain, or set `format:` to one of alpaca, sharegpt, messages, preference, kto."
        )
    task: Task = format_name if format_name in ("preference", "kto") else "sft"  # type: ignore[assignment]
    layout: Layout = format_name if task == "sft" else layout_of(first_keys, columns)  # type: ignore[assignment]
    defaults = {**LAYOUT_COLUMNS[layout], **TASK_COLUMNS[task]}
    if task == "kto" and "kto_tag" not in columns and "kto_tag" not in first_keys and "label" in first_keys:
        defaults["kto_tag"] = "label"
    unknown = sorted(set(columns) - set(defaults))
    if unknown:
        raise UserInputError(
            f"{file}: columns.{unknown[0]} is not a column role of format {format_name} ({layout} layout). "
            f"Fix: use the roles {', '.join(defaults)}."
        )
    if requested == "alpaca":
        _check_alpaca_columns(columns, first_keys, file)
    merged = {**defaults, **columns}
    if task == "preference" and layout == "alpaca" and "prompt" not in columns:
        merged["prompt"] = _trl_prompt_column(first_keys, merged["prompt"])
    if layout == "alpaca" and "query" not in columns and merged["query"] == merged["prompt"]:
        merged["query"] = ""  # the prompt is read from alpaca's default input column: no second input
    return RowFormat(layout, task, merged)


def _trl_prompt_column(first_keys: Collection[str], alpaca_prompt: str) -> str:
    """The prompt column of preference rows without alpaca's `instruction`: TRL's `prompt` (a string
    or a list of messages), or "" for TRL's implicit-prompt rows, whose chosen and rejected are whole
    conversations that share the prompt turns."""
    if not first_keys or alpaca_prompt in first_keys:
        return alpaca_prompt
    return "prompt" if "prompt" in first_keys else ""


def _check_alpaca_columns(columns: Mapping[str, str], first_keys: Collection[str], file: str) -> None:
    """`format: alpaca` over rows that hold neither the prompt nor the response column it reads
    is a column mapping to fix, not bad rows to skip: say which `columns:` would read them."""
    prompt = columns.get("prompt", LAYOUT_COLUMNS["alpaca"]["prompt"])
    response = columns.get("response", LAYOUT_COLUMNS["alpaca"]["response"])
    if not first_keys or prompt in first_keys or response in first_keys:
        return  # no row seen yet, or the columns are there
    pair = prompt_response_columns(first_keys)
    fix = (
        f"set `columns: {{prompt: {pair['prompt']}, response: {pair['response']}}}` on this source (or "
        "`format: auto`, which recognises these columns)"
        if pair
        else "map your columns with `columns: {prompt: <question column>, response: <answer column>}`"
    )
    raise UserInputError(
        f"{file}: format alpaca reads the prompt from '{prompt}' and the response from '{response}', "
        f"but the rows hold {', '.join(sorted(first_keys)) or 'no keys'}. Fix: {fix}."
    )
