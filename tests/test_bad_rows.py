"""Bad rows: every class with its exact message, the error and skip policies, huge lines, streaming."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from lmforge.config.schema import SourceConfig
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.examples import BadRow, Conversation
from lmforge.data.formats import iter_source_examples
from lmforge.data.rows import iter_raw_rows
from lmforge.errors import UserInputError

GOOD = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}


def turns(*pairs: tuple[str, Any]) -> dict[str, Any]:
    return {"conversations": [{"from": role, "value": value} for role, value in pairs]}


def read(path: Path, fmt: str = "sharegpt", budget: int = 16) -> list[Any]:
    source = SourceConfig(path=str(path), format=fmt)  # type: ignore[arg-type]
    return list(iter_source_examples(source, memory_budget_mb=budget))


def one_bad(tmp_path: Path, line: bytes | dict[str, Any], fmt: str = "sharegpt") -> str:
    """The message of the only bad row of a file holding a good row and then `line`."""
    path = tmp_path / "d.jsonl"
    text = line if isinstance(line, bytes) else json.dumps(line).encode()
    good_row = GOOD if fmt == "sharegpt" else {"instruction": "q", "output": "a"}
    path.write_bytes(json.dumps(good_row).encode() + b"\n" + text + b"\n")
    good, bad = read(path, fmt)
    assert isinstance(good, Conversation) and isinstance(bad, BadRow)
    return bad.message().removeprefix(f"{path}:")


SHAREGPT_CASES = [
    (
        b'{"conversations": [',
        "2: malformed JSON: Expecting value at column 20 (near '{\"conversations\": [')",
    ),
    ({"messages": []}, "2: missing field: no 'conversations' field (fields present: messages)"),
    ({"conversations": "hi"}, "2: mistyped field: 'conversations' is a string; expected a list of turns"),
    (
        turns(("human", "q"), ("gpt", 3)),
        "2: mistyped field: conversations[1].value is a number; expected a string",
    ),
    (
        {"conversations": [{"from": "human"}]},
        "2: missing field: conversations[0] has no 'value' (keys: from)",
    ),
    (turns(("human", "  \n"), ("gpt", "a")), "2: empty turn: conversations[0].value is whitespace-only"),
    (turns(("human", "q"), ("gpt", "")), "2: empty turn: conversations[1].value is empty"),
    (
        turns(("gpt", "a"), ("human", "q")),
        "2: wrong role order: conversations[0] is 'gpt', a leading assistant turn; "
        "the first turn must be human or observation",
    ),
    (
        turns(("human", "q")),
        "2: wrong role order: 'conversations' ends with a 'user' turn: missing final assistant turn "
        "(the answer to train on)",
    ),
    (
        turns(("human", "q"), ("human", "q2"), ("gpt", "a")),
        "2: wrong role order: conversations[1] is 'human', a second user-side turn in a row; expected gpt or "
        "function_call (turns alternate user/observation and assistant/function_call)",
    ),
    (
        turns(("human", "q"), ("gpt", "a"), ("system", "late")),
        "2: wrong role order: conversations[2] is a system turn; system is only allowed first",
    ),
    (
        turns(("human", "q"), ("bot", "a")),
        "2: unknown role: conversations[1].from is 'bot'; expected one of system, human, observation, gpt, "
        "function_call (set columns.user_tag/assistant_tag/... when your file uses other names)",
    ),
    (
        turns(("human", "q"), ("function_call", "weather()")),
        "2: mistyped field: conversations[1].value (a function call {name, arguments}) is not valid JSON "
        "(Expecting value at column 1)",
    ),
    (
        b'{"conversations": "caf\xe9"}',
        "2: invalid UTF-8: byte 23 of the line (b'\\xe9'): invalid continuation byte",
    ),
    (b'{"conversations": "a\x00"}', "2: NUL byte: raw NUL byte at byte 21 of the line"),
    (b"[1, 2]", "2: mistyped field: the row is a list; expected a JSON object"),
]


@pytest.mark.parametrize(("line", "expected"), SHAREGPT_CASES)
def test_sharegpt_bad_row_classes(tmp_path: Path, line: bytes | dict[str, Any], expected: str) -> None:
    assert one_bad(tmp_path, line) == expected


MESSAGES_CASES = [
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ]
        },
        "2: wrong role order: messages[1] is a second 'user' message in a row",
    ),
    (
        {"messages": [{"role": "assistant", "content": "a"}]},
        "2: wrong role order: messages[0] is a leading 'assistant' message; the first turn must be 'user'",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]},
        "2: unknown role: messages[1].role is 'robot'; expected one of system, user, assistant, tool",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]},
        "2: wrong role order: messages[1] is a tool result without an assistant tool call before it",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
        "2: missing field: messages[1] has no 'content' (keys: role)",
    ),
]


@pytest.mark.parametrize(("row", "expected"), MESSAGES_CASES)
def test_messages_bad_row_classes(tmp_path: Path, row: dict[str, Any], expected: str) -> None:
    path = tmp_path / "m.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    _, bad = read(path, "messages")
    assert bad.message() == f"{path}:{expected}"


def test_alpaca_bad_rows(tmp_path: Path) -> None:
    assert one_bad(tmp_path, {"instruction": "x"}, "alpaca") == (
        "2: missing field: no 'output' field (fields present: instruction)"
    )
    assert (
        one_bad(tmp_path, {"instruction": "x", "output": None}, "alpaca")
        == "2: missing field: 'output' is null"
    )
    assert one_bad(tmp_path, {"instruction": " ", "output": "y"}, "alpaca") == (
        "2: empty turn: 'instruction' is whitespace-only"
    )
    assert one_bad(tmp_path, {"instruction": "x", "output": "y", "history": "no"}, "alpaca") == (
        "2: mistyped field: 'history' is a string; expected [[user, assistant], ...]"
    )


def test_error_policy_stops_at_first_bad_row_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{oops\n" + json.dumps(GOOD) + "\n")
    policy = BadRowPolicy("error", 0.01)
    with pytest.raises(UserInputError) as err:
        list(policy.filter(read_lazily(path)))
    assert str(err.value).startswith(
        f"{path}:2: malformed JSON: Expecting property name enclosed in double quotes"
    )
    assert "Fix: correct the row, or set data.on_bad_row: skip" in str(err.value)


def read_lazily(path: Path, fmt: str = "sharegpt", budget: int = 16) -> Any:
    return iter_source_examples(SourceConfig(path=str(path), format=fmt), memory_budget_mb=budget)  # type: ignore[arg-type]


def test_skip_policy_quarantines_and_enforces_max_bad_fraction(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [json.dumps(GOOD)] * 8 + ["{oops", json.dumps(turns(("gpt", "a")))]
    path.write_text("\n".join(rows) + "\n")
    quarantine = tmp_path / "run" / "bad_rows.jsonl"
    policy = BadRowPolicy("skip", 0.25, quarantine)
    kept = list(policy.filter(read_lazily(path)))
    policy.finish()  # 2 of 10 <= 25%
    assert len(kept) == 8
    records = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in records] == [
        (str(path), 9, "malformed JSON"),
        (str(path), 10, "wrong role order"),
    ]
    assert records[0]["raw"] == "{oops" and records[1]["detail"].startswith("conversations[0] is 'gpt'")
    assert policy.counts() == {
        "rows_read": 10,
        "rows_kept": 8,
        "rows_bad": 2,
        "bad_by_reason": {"malformed JSON": 1, "wrong role order": 1},
    }
    strict = BadRowPolicy("skip", 0.1, quarantine)
    list(strict.filter(read_lazily(path)))
    with pytest.raises(UserInputError) as err:
        strict.finish()
    assert str(err.value).startswith(
        "2 of 10 rows are bad (20.0%) > data.max_bad_fraction=0.1; top reasons: malformed JSON (1), "
        f"wrong role order (1); see {quarantine}."
    )
    assert len(quarantine.read_text().splitlines()) == 2  # a new policy rewrites, never appends to old rows


def test_every_row_bad(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"{a\n{b\n{c\n" + json.dumps(turns(("gpt", "x"))).encode() + b"\n\xff\n")
    policy = BadRowPolicy("skip", 1.0)
    assert list(policy.filter(read_lazily(path))) == []
    with pytest.raises(UserInputError, match=r"^0 valid rows of 5; top reasons: malformed JSON \(3\), "):
        policy.finish()


def test_ten_megabyte_lines(tmp_path: Path) -> None:
    big = "x" * (10 << 20)
    path = tmp_path / "big.jsonl"
    row = turns(("human", big), ("gpt", "ok"))
    path.write_text(json.dumps(row) + "\n" + "{" + big + "\n" + json.dumps(GOOD) + "\n")
    valid, garbage, good = read(path)
    assert isinstance(valid, Conversation) and len(valid.messages[0].content) == 10 << 20
    assert isinstance(garbage, BadRow) and garbage.reason == "malformed JSON"
    assert garbage.detail.startswith("Expecting property name enclosed in double quotes at column 2")
    assert len(garbage.raw) < 300  # a short excerpt, never the 10 MB line
    assert isinstance(good, Conversation)


def test_line_longer_than_the_budget_is_a_bad_row_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text(
        json.dumps(turns(("human", "y" * (3 << 20)), ("gpt", "a"))) + "\n" + json.dumps(GOOD) + "\n"
    )
    too_long, good = read(path, budget=1)
    assert isinstance(too_long, BadRow) and isinstance(good, Conversation)
    assert too_long.message() == (
        f"{path}:1: line too long: the line is {path.stat().st_size - len(json.dumps(GOOD)) - 1} bytes, "
        "more than data.memory_budget_mb=1; split the record or raise data.memory_budget_mb"
    )


def test_jsonl_larger_than_the_budget_streams_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "stream.jsonl"
    line = json.dumps(turns(("human", "q" * 900), ("gpt", "a"))) + "\n"
    path.write_text(line * 4000)  # ~3.7 MB against a 1 MB budget
    assert path.stat().st_size > 3 << 20
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_lazily(path, budget=1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 4000
    assert peak < path.stat().st_size / 8, f"peak {peak} bytes"


def test_json_array_larger_than_the_budget_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps([GOOD] * 20000))  # > 1 MB
    with pytest.raises(UserInputError, match=r"cannot be streamed. Fix: convert it to .jsonl"):
        read(path, budget=1)


def test_csv_invalid_utf8_and_nul_are_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_bytes(b"instruction,output\nhi,there\nbad\xff,row\nnul\x00,row\nok,fine\n")
    rows = list(iter_raw_rows(path, memory_budget_mb=16))
    assert [getattr(r, "reason", None) for r in rows] == [None, "invalid UTF-8", "NUL byte", None]
    bad = rows[1]
    assert isinstance(bad, BadRow)
    assert bad.message() == f"{path}:2: invalid UTF-8: byte 4 of the line: invalid start byte (file line 3)"
