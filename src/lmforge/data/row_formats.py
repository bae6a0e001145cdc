"""Fine-tuning row formats: a raw row (a dict) -> an `Example`, or a `BadRow` saying why not.

The entry point for whole sources is `lmforge.data.formats.iter_source_examples`; which
format a source is in and which column holds each role is `format_detection`'s part
(`RowFormat`, with the table of column roles).

alpaca follows LLaMA-Factory: the user turn is `instruction + "\\n" + input` when input is
non-empty, `history` is [[user, assistant], ...] turns before it. In the preference layouts
`chosen`/`rejected` are strings (alpaca) or single turns ({from, value} or {role, content}).
A kto label is a boolean (or the strings "true"/"false", as csv files hold it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from lmforge.data.bad_rows import EMPTY_TURN, MISSING_FIELD, MISTYPED_FIELD, WRONG_ROLE_ORDER, excerpt
from lmforge.data.conversation_formats import (
    RowError,
    decode_json_field,
    function_call_message,
    openai_messages,
    parse_tools,
    require_text,
    sharegpt_messages,
    tool_call,
    type_name,
)
from lmforge.data.examples import (
    BadRow,
    Conversation,
    Example,
    LabeledConversation,
    Message,
    Origin,
    PreferencePair,
)
from lmforge.data.format_detection import LAYOUT_COLUMNS, RowFormat
from lmforge.data.images import IMAGE_COUNT, IMAGE_PLACEHOLDER, ImageError, check_row_images


def read_row(data: Any, origin: Origin, row_format: RowFormat, raw: str = "") -> Example | BadRow:
    """One raw row as an Example, or a BadRow with the reason and the exact problem."""
    try:
        if not isinstance(data, dict):
            raise RowError(MISTYPED_FIELD, f"the row is {type_name(data)}; expected a JSON object")
        return _read_example(data, origin, row_format)
    except RowError as err:
        return BadRow(origin, err.reason, err.detail, raw=excerpt(raw or _row_text(data)))


def _row_text(data: Any) -> str:
    try:
        return json.dumps(data, ensure_ascii=False, default=str)[:4000]
    except (TypeError, ValueError):
        return repr(data)[:4000]


def _read_example(row: dict[str, Any], origin: Origin, fmt: RowFormat) -> Example:
    cols = fmt.columns
    tools = parse_tools(row.get(cols["tools"]), repr(cols["tools"])) if "tools" in cols else None
    if fmt.task == "preference":
        if fmt.layout == "alpaca" and not cols["prompt"]:
            return _implicit_prompt_pair(row, cols, origin, tools)
        if fmt.layout == "alpaca" and isinstance(decode_json_field(row.get(cols["prompt"]), list), list):
            # TRL's conversational rows: the prompt is a list of {role, content} messages.
            fmt = RowFormat(
                "messages", "preference", {**LAYOUT_COLUMNS["messages"], **cols, "messages": cols["prompt"]}
            )
        prompt_images: list[Any] = []
        prompt = _conversation(row, fmt, final="user", part_images=prompt_images)
        chosen = _answer(row, cols["chosen"], fmt)
        rejected = _answer(row, cols["rejected"], fmt)
        _check_text_answers(chosen, rejected, cols)
        images = _row_images(row, cols.get("images", "images"), prompt_images, prompt, origin)
        return PreferencePair(prompt, chosen, rejected, origin, tools=tools, images=images)
    part_images: list[Any] = []
    messages = _conversation(row, fmt, final="assistant", part_images=part_images)
    images = _row_images(row, cols.get("images", "images"), part_images, messages, origin)
    if fmt.task == "kto":
        return LabeledConversation(messages, _label(row, cols["kto_tag"]), origin, images=images)
    return Conversation(messages, origin, tools=tools, images=images)


def _check_text_answers(chosen: Message, rejected: Message, cols: Mapping[str, str]) -> None:
    """A preference pair's images belong to its prompt: both answers are compared on the same images."""
    for column, answer in ((cols["chosen"], chosen), (cols["rejected"], rejected)):
        if IMAGE_PLACEHOLDER in answer.content:
            raise RowError(
                IMAGE_COUNT,
                f"{column!r} holds an {IMAGE_PLACEHOLDER} placeholder; a pair's images go in its prompt "
                "(both answers are scored on the same images)",
            )


def _row_images(
    row: dict[str, Any], column: str, part_images: list[Any], messages: list[Message], origin: Origin
) -> list[str]:
    """The row's image files, checked, in placeholder order: the references of OpenAI image parts,
    else the images column (LLaMA-Factory's, or TRL's beside `{"type": "image"}` parts that name
    no file). A row without images and without the column has none; placeholders are then text."""
    listed = decode_json_field(row.get(column), list)
    if listed is not None and not isinstance(listed, list):
        listed = [listed]  # one image given as a string
    refs = part_images if any(ref is not None for ref in part_images) else (listed or [])
    if not refs and listed is None and not part_images:
        return []
    try:
        facts = check_row_images([m.content for m in messages], refs, Path(origin.file).parent)
    except ImageError as err:
        raise RowError(err.reason, err.detail) from None
    return [str(fact.path) for fact in facts]


def _conversation(
    row: dict[str, Any],
    fmt: RowFormat,
    final: Literal["user", "assistant"],
    part_images: list[Any] | None = None,
) -> list[Message]:
    """The conversation of a row; for a preference prompt it ends with a user (or tool) turn.
    The references of OpenAI-style image content parts are appended to `part_images`."""
    cols = fmt.columns
    if fmt.layout == "alpaca":
        return _alpaca_messages(row, cols, with_response=final == "assistant")
    column = cols["messages"]
    turns = decode_json_field(_required(row, column), list)
    if fmt.layout == "sharegpt":
        messages = sharegpt_messages(turns, column, cols)
        system = _optional_text(row, cols["system"])
        if system is not None and not any(m.role == "system" for m in messages):
            messages.insert(0, Message("system", system))
    else:
        messages = openai_messages(turns, column, cols["role_tag"], cols["content_tag"], part_images)
    _check_final_turn(messages, column, final)
    return messages


def _check_final_turn(messages: list[Message], column: str, final: str) -> None:
    turns = [m for m in messages if m.role != "system"]
    if not turns:
        raise RowError(EMPTY_TURN, f"{column!r} has no user or assistant turns")
    last = turns[-1].role
    if final == "assistant" and last != "assistant":
        raise RowError(
            WRONG_ROLE_ORDER,
            f"{column!r} ends with a {last!r} turn: missing final assistant turn (the answer to train on)",
        )
    if final == "user" and last == "assistant":
        raise RowError(
            WRONG_ROLE_ORDER,
            f"{column!r} ends with an assistant turn; a preference prompt must end with a user turn "
            "(the answers go in chosen/rejected)",
        )


def _implicit_prompt_pair(
    row: dict[str, Any], cols: Mapping[str, str], origin: Origin, tools: list[dict[str, Any]] | None
) -> PreferencePair:
    """TRL's implicit-prompt row: chosen and rejected are whole conversations; the turns they share
    are the prompt and each must end in one assistant turn of its own."""
    chosen = openai_messages(decode_json_field(_required(row, cols["chosen"]), list), cols["chosen"])
    rejected = openai_messages(decode_json_field(_required(row, cols["rejected"]), list), cols["rejected"])
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    for column, turns in ((cols["chosen"], chosen), (cols["rejected"], rejected)):
        if len(turns) != shared + 1 or turns[-1].role != "assistant":
            raise RowError(
                WRONG_ROLE_ORDER,
                f"{column!r} must be the shared prompt turns followed by one assistant answer (TRL's "
                f"implicit-prompt rows); it has {len(turns) - shared} turn(s) after the {shared} shared ones",
            )
    prompt = chosen[:shared]
    _check_final_turn(prompt, f"{cols['chosen']} and {cols['rejected']} (shared turns)", "user")
    return PreferencePair(prompt, chosen[-1], rejected[-1], origin, tools=tools)


def _alpaca_messages(row: dict[str, Any], cols: Mapping[str, str], with_response: bool) -> list[Message]:
    messages: list[Message] = []
    system = _optional_text(row, cols["system"])
    if system is not None:
        messages.append(Message("system", system))
    for i, pair in enumerate(_history(row, cols["history"])):
        messages.append(Message("user", require_text(pair[0], f"{cols['history']}[{i}][0]")))
        messages.append(Message("assistant", require_text(pair[1], f"{cols['history']}[{i}][1]")))
    instruction = _required(row, cols["prompt"])
    query = _optional_text(row, cols["query"], allow_empty=True) or ""
    instruction = require_text(instruction, repr(cols["prompt"]), allow_empty=bool(query.strip()))
    prompt = "\n".join(part for part in (instruction, query) if part)
    messages.append(Message("user", require_text(prompt, f"{cols['prompt']!r} + {cols['query']!r}")))
    if with_response:
        messages.append(
            Message("assistant", require_text(_required(row, cols["response"]), repr(cols["response"])))
        )
    return messages


def _history(row: dict[str, Any], column: str) -> list[Any]:
    history = decode_json_field(row.get(column), list)
    if history is None or history == "":
        return []
    pairs_ok = isinstance(history, list) and all(isinstance(p, list | tuple) and len(p) == 2 for p in history)
    if not pairs_ok:
        raise RowError(
            MISTYPED_FIELD, f"{column!r} is {type_name(history)}; expected [[user, assistant], ...]"
        )
    return history


def _answer(row: dict[str, Any], column: str, fmt: RowFormat) -> Message:
    """A chosen/rejected answer: a string, or one turn in the row's layout."""
    value = decode_json_field(_required(row, column), dict)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # TRL's conversational rows: a list holding the one assistant turn
    if isinstance(value, str):
        return Message("assistant", require_text(value, repr(column)))
    if not isinstance(value, dict):
        raise RowError(
            MISTYPED_FIELD, f"{column!r} is {type_name(value)}; expected a string or one turn object"
        )
    cols = fmt.columns
    role_tag = cols.get("role_tag", "from" if fmt.layout != "messages" else "role")
    content_tag = cols.get("content_tag", "value" if fmt.layout != "messages" else "content")
    role = value.get(role_tag, cols.get("assistant_tag", "assistant"))
    if role == cols.get("function_tag"):
        return function_call_message(value.get(content_tag), f"{column}.{content_tag}")
    if role not in (cols.get("assistant_tag", "gpt"), "assistant"):
        raise RowError(
            WRONG_ROLE_ORDER,
            f"{column}.{role_tag} is {role!r}; a chosen/rejected answer must be an assistant turn",
        )
    calls = value.get("tool_calls")
    if calls:
        return Message("assistant", "", tool_calls=[tool_call(c, f"{column}.tool_calls") for c in calls])
    if content_tag not in value:
        raise RowError(MISSING_FIELD, f"{column} has no {content_tag!r} (keys: {', '.join(sorted(value))})")
    return Message("assistant", require_text(value[content_tag], f"{column}.{content_tag}"))


def _label(row: dict[str, Any], column: str) -> bool:
    value = _required(row, column)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise RowError(MISTYPED_FIELD, f"{column!r} is {value!r} ({type_name(value)}); expected true or false")


def _required(row: dict[str, Any], column: str) -> Any:
    if column not in row:
        raise RowError(
            MISSING_FIELD, f"no {column!r} field (fields present: {', '.join(sorted(row)) or 'none'})"
        )
    if row[column] is None:
        raise RowError(MISSING_FIELD, f"{column!r} is null")
    return row[column]


def _optional_text(row: dict[str, Any], column: str, *, allow_empty: bool = False) -> str | None:
    """An optional text column: absent, null or empty means none; whitespace-only is an empty turn."""
    value = row.get(column)
    if value is None or value == "":
        return None
    return require_text(value, repr(column), allow_empty=allow_empty)
