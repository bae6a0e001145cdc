"""Turn lists of the two chat layouts into `Message`s, checking fields and role order.

- sharegpt (LLaMA-Factory): turns of {from, value}; roles human -> user, gpt -> assistant,
  system (first turn only), function_call -> an assistant tool call (value is JSON
  {name, arguments}, or a list of them), observation -> a tool result. After an optional
  leading system turn, user/observation turns sit at positions 1, 3, 5, ... and
  gpt/function_call turns at 2, 4, 6, ... (LLaMA-Factory's rule). Tag names are configurable
  through `columns` (role_tag, content_tag, user_tag, assistant_tag, observation_tag,
  function_tag, system_tag), as in LLaMA-Factory's dataset_info `tags`.
- messages (OpenAI): [{role, content, tool_calls?, name?}] with roles system (first only),
  user, assistant, tool. user and assistant alternate; tool results follow an assistant turn
  with tool_calls (several in a row for parallel calls) and are followed by an assistant turn.

Tool calls become OpenAI-style {"type": "function", "function": {"name", "arguments"}} with
`arguments` a dict (JSON strings are parsed), which is what HF chat templates expect.
Problems raise `RowError(reason, detail)`; the caller turns it into a `BadRow`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lmforge.data.bad_rows import (
    EMPTY_TURN,
    MISSING_FIELD,
    MISTYPED_FIELD,
    UNKNOWN_ROLE,
    WRONG_ROLE_ORDER,
)
from lmforge.data.examples import Message
from lmforge.data.images import ImageError, openai_content_text


class RowError(Exception):
    """A row cannot become an example: `reason` is a bad-row class, `detail` says exactly why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def type_name(value: Any) -> str:
    """The JSON name of a value's type, for messages ('string', 'number', 'object', ...)."""
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list"}
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    return names.get(type(value), type(value).__name__)


def decode_json_field(value: Any, expected: type) -> Any:
    """A list/object stored as a JSON string (csv, parquet) decoded; other values unchanged."""
    if isinstance(value, str) and value.lstrip().startswith(("[", "{")) and expected is not str:
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def require_text(value: Any, where: str, *, allow_empty: bool = False) -> str:
    """`value` as a turn's text: a non-blank string (or a list of OpenAI text parts)."""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        value = "".join(str(p.get("text", "")) for p in value)
    if not isinstance(value, str):
        raise RowError(MISTYPED_FIELD, f"{where} is {type_name(value)}; expected a string")
    if not allow_empty and not value.strip():
        raise RowError(EMPTY_TURN, f"{where} is {'empty' if not value else 'whitespace-only'}")
    return value


def parse_json_field(text: str, where: str, expected: str = "") -> Any:
    """A field holding JSON text, parsed; bad JSON is a mistyped-field row error naming the field."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RowError(
            MISTYPED_FIELD, f"{where}{expected} is not valid JSON ({err.msg} at column {err.colno})"
        ) from None


def parse_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """The tools column (a JSON string or a list of function schemas) as OpenAI-style tool specs."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        value = parse_json_field(value, where)
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowError(MISTYPED_FIELD, f"{where} is {type_name(value)}; expected a list of function schemas")
    return [t if "type" in t else {"type": "function", "function": t} for t in value] or None


def tool_call(value: Any, where: str) -> dict[str, Any]:
    """One tool call, {name, arguments} or OpenAI's {type, function: {...}}, normalized."""
    call = value.get("function", value) if isinstance(value, dict) else value
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise RowError(MISTYPED_FIELD, f"{where} is not a tool call object with a 'name' string")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments = parse_json_field(arguments, f"{where}.arguments") if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise RowError(MISTYPED_FIELD, f"{where}.arguments is {type_name(arguments)}; expected an object")
    return {"type": "function", "function": {"name": call["name"], "arguments": arguments}}


def function_call_message(value: Any, where: str) -> Message:
    """A sharegpt function_call turn (JSON {name, arguments} or a list of them) as an assistant tool call."""
    parsed = parse_json_field(require_text(value, where), where, " (a function call {name, arguments})")
    calls = parsed if isinstance(parsed, list) else [parsed]
    return Message("assistant", "", tool_calls=[tool_call(c, where) for c in calls])


SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}


_OPENAI_STYLE_HINT = (
    "; these are OpenAI-style turns: set `format: messages` and columns.messages to this column"
)


def sharegpt_messages(turns: Any, column: str, tags: Mapping[str, str]) -> list[Message]:
    """A sharegpt turn list as messages (system first when present), role order checked.

    The last turn is not checked here: SFT needs an assistant, a preference prompt a user.
    """
    if not isinstance(turns, list):
        raise RowError(MISTYPED_FIELD, f"{column!r} is {type_name(turns)}; expected a list of turns")
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    odd = (tags["user_tag"], tags["observation_tag"])
    even = (tags["assistant_tag"], tags["function_tag"])
    messages: list[Message] = []
    position = 0  # position among non-system turns: user/observation at even indices here
    for i, turn in enumerate(turns):
        where = f"{column}[{i}]"
        if not isinstance(turn, dict):
            raise RowError(MISTYPED_FIELD, f"{where} is {type_name(turn)}; expected an object")
        for key in (role_tag, content_tag):
            if key not in turn:
                hint = _OPENAI_STYLE_HINT if {"role", "content"} <= set(turn) and role_tag != "role" else ""
                raise RowError(
                    MISSING_FIELD, f"{where} has no {key!r} (keys: {', '.join(sorted(turn))}){hint}"
                )
        role = turn[role_tag]
        known = (tags["system_tag"], *odd, *even)
        if role not in known:
            raise RowError(
                UNKNOWN_ROLE,
                f"{where}.{role_tag} is {role!r}; expected one of {', '.join(known)} "
                "(set columns.user_tag/assistant_tag/... when your file uses other names)",
            )
        value_where = f"{where}.{content_tag}"
        if role == tags["system_tag"]:
            if i != 0:
                raise RowError(WRONG_ROLE_ORDER, f"{where} is a system turn; system is only allowed first")
            messages.append(Message("system", require_text(turn[content_tag], value_where)))
            continue
        expected = odd if position % 2 == 0 else even
        if role not in expected:
            raise RowError(WRONG_ROLE_ORDER, _sharegpt_order_detail(where, role, position, expected))
        messages.append(_sharegpt_message(role, turn[content_tag], value_where, tags, messages))
        position += 1
    return messages


def _sharegpt_order_detail(where: str, role: str, position: int, expected: tuple[str, ...]) -> str:
    if position == 0:
        return (
            f"{where} is {role!r}, a leading assistant turn; the first turn must be {' or '.join(expected)}"
        )
    side = "assistant" if position % 2 == 0 else "user"  # the side of `role`, which repeats
    return (
        f"{where} is {role!r}, a second {side}-side turn in a row; expected {' or '.join(expected)} "
        "(turns alternate user/observation and assistant/function_call)"
    )


def _sharegpt_message(
    role: str, value: Any, where: str, tags: Mapping[str, str], previous: list[Message]
) -> Message:
    if role == tags["function_tag"]:
        return function_call_message(value, where)
    if role == tags["observation_tag"]:
        calls = previous[-1].tool_calls if previous else None
        name = calls[0]["function"]["name"] if calls and len(calls) == 1 else None
        return Message("tool", require_text(value, where), name=name)
    return Message("user" if role == tags["user_tag"] else "assistant", require_text(value, where))


OPENAI_ROLES = ("system", "user", "assistant", "tool")


def openai_messages(
    turns: Any,
    column: str,
    role_tag: str = "role",
    content_tag: str = "content",
    images: list[Any] | None = None,
) -> list[Message]:
    """An OpenAI-style message list as messages, role order checked (not the final role). A
    content given as a list of parts becomes text with an `<image>` placeholder per image part,
    whose reference is appended to `images`."""
    if not isinstance(turns, list):
        raise RowError(MISTYPED_FIELD, f"{column!r} is {type_name(turns)}; expected a list of messages")
    messages: list[Message] = []
    for i, turn in enumerate(turns):
        where = f"{column}[{i}]"
        if not isinstance(turn, dict):
            raise RowError(MISTYPED_FIELD, f"{where} is {type_name(turn)}; expected an object")
        if role_tag not in turn:
            raise RowError(MISSING_FIELD, f"{where} has no {role_tag!r} (keys: {', '.join(sorted(turn))})")
        role = turn[role_tag]
        if role not in OPENAI_ROLES:
            raise RowError(
                UNKNOWN_ROLE, f"{where}.{role_tag} is {role!r}; expected one of {', '.join(OPENAI_ROLES)}"
            )
        _check_openai_order(messages, role, where)
        messages.append(_openai_message(turn, role, where, content_tag, images))
    return messages


def _check_openai_order(previous: list[Message], role: str, where: str) -> None:
    last = previous[-1] if previous else None
    if role == "system":
        if previous:
            raise RowError(WRONG_ROLE_ORDER, f"{where} is a system message; system is only allowed first")
        return
    if last is None or last.role == "system":
        if role != "user":
            raise RowError(
                WRONG_ROLE_ORDER, f"{where} is a leading {role!r} message; the first turn must be 'user'"
            )
        return
    if role == "tool" and not (last.role == "tool" or last.tool_calls):
        raise RowError(WRONG_ROLE_ORDER, f"{where} is a tool result without an assistant tool call before it")
    if role == last.role and role != "tool":
        raise RowError(WRONG_ROLE_ORDER, f"{where} is a second {role!r} message in a row")
    if role == "user" and last.role == "tool":
        raise RowError(
            WRONG_ROLE_ORDER, f"{where} is a 'user' message right after a tool result; expected 'assistant'"
        )
    if last.tool_calls and role != "tool":
        raise RowError(WRONG_ROLE_ORDER, f"{where} is {role!r} after an assistant tool call; expected 'tool'")


def _openai_message(
    turn: dict[str, Any], role: str, where: str, content_tag: str, images: list[Any] | None = None
) -> Message:
    raw_calls = turn.get("tool_calls")
    content = turn.get(content_tag)
    if isinstance(content, list):  # content parts: text and images
        try:
            content = openai_content_text(content, images if images is not None else [])
        except ImageError as err:
            raise RowError(err.reason, f"{where}.{content_tag}: {err.detail}") from None
        turn = {**turn, content_tag: content}
    if not raw_calls and type(content) is str and content.strip():
        # The common turn, plain non-blank text: what the checks below accept unchanged, without
        # building the field names their messages would need (a tenth of the row's read time).
        name = turn.get("name")
        return Message(role, content, name=name if isinstance(name, str) else None)  # type: ignore[arg-type]
    calls = None
    if raw_calls:
        if role != "assistant" or not isinstance(raw_calls, list):
            raise RowError(MISTYPED_FIELD, f"{where}.tool_calls must be a list on an assistant message")
        calls = [tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls)]
    if content_tag not in turn and not calls:
        raise RowError(MISSING_FIELD, f"{where} has no {content_tag!r} (keys: {', '.join(sorted(turn))})")
    content = turn.get(content_tag)
    text = (
        ""
        if calls and content is None
        else require_text(content, f"{where}.{content_tag}", allow_empty=bool(calls))
    )
    name = turn.get("name") if isinstance(turn.get("name"), str) else None
    return Message(role, text, tool_calls=calls, name=name)  # type: ignore[arg-type]
