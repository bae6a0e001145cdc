"""Reading evaluation files: plain text for perplexity, question/answer rows for accuracy.

QA rows are jsonl objects with {"question", "answer"}, alpaca {"instruction", "input",
"output"}, chat {"messages"}, or another prompt/response pair ({prompt, response},
{input, output}, {query, response}, ...; `--columns question=COL,answer=COL` names any
other); a bad row stops the read with its file:line (evaluation numbers over a silently
shortened file would mislead).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from lmforge.data.format_detection import prompt_response_columns
from lmforge.errors import UserInputError

DataKind = Literal["text", "qa"]
QA_KEYS = (
    'expected {"question", "answer"}, alpaca {"instruction", "input", "output"} or chat {"messages"} rows'
)


def data_kind(path: Path) -> DataKind:
    """ "text" for .txt files and jsonl whose first row has "text", else "qa"."""
    _check_file(path)
    if path.suffix == ".txt":
        return "text"
    for _, row in _jsonl_rows(path):
        return "text" if "text" in row and not _is_qa(row) else "qa"
    raise UserInputError(f"{path}: no rows; {QA_KEYS}, or {{'text'}} rows")


def read_texts(path: Path) -> list[str]:
    """The documents of a .txt file (the whole file) or of a jsonl file's "text" fields."""
    _check_file(path)
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    texts = []
    for line, row in _jsonl_rows(path):
        if not isinstance(row.get("text"), str):
            raise UserInputError(f"{path}:{line}: row has no string 'text' field")
        texts.append(row["text"])
    return texts


def read_qa_rows(path: str | Path, columns: dict[str, str] | None = None) -> list[dict[str, str]]:
    """{"question", "answer"} dicts from a jsonl file of QA, alpaca, chat or prompt/response rows;
    `columns` ({"question": COL, "answer": COL}) names the two columns to read instead.

    Raises UserInputError naming file:line for malformed JSON or a row without a question
    or an answer.
    """
    path = Path(path)
    _check_file(path)
    rows = []
    for line, row in _jsonl_rows(path):
        where = f"{path}:{line}"
        rows.append(_mapped_row(row, columns, where) if columns else _qa_row(row, where))
    if not rows:
        raise UserInputError(f"{path}: no rows; {QA_KEYS}")
    return rows


def _mapped_row(row: dict[str, Any], columns: dict[str, str], where: str) -> dict[str, str]:
    question, answer = row.get(columns["question"]), row.get(columns["answer"])
    for role, value in (("question", question), ("answer", answer)):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise UserInputError(
                f"{where}: row has no '{columns[role]}' (--columns {role}={columns[role]}); its keys: "
                f"{', '.join(sorted(row))}"
            )
    return {"question": str(question), "answer": str(answer)}


def _qa_row(row: dict[str, Any], where: str) -> dict[str, str]:
    if "messages" in row:
        return _chat_row(row["messages"], where)
    pair = prompt_response_columns(row) if "question" not in row and "instruction" not in row else None
    if pair is not None:  # {prompt, response}, {input, output}, {query, response}, ...
        return _mapped_row(row, {"question": pair["prompt"], "answer": pair["response"]}, where)
    if "instruction" in row or "output" in row:
        question: Any = str(row.get("instruction") or "")
        if row.get("input"):
            question = f"{question}\n\n{row['input']}"
        answer = row.get("output")
    else:
        question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise UserInputError(f"{where}: row has no question; {QA_KEYS}")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise UserInputError(f"{where}: row has no answer; {QA_KEYS}")
    return {"question": question, "answer": str(answer)}


def _chat_row(messages: Any, where: str) -> dict[str, str]:
    """A chat row as one question/answer: its final assistant reply and the user turn before it
    (earlier turns are not carried over)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise UserInputError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
    last = messages[-1] if messages else {}
    users = [m for m in messages[:-1] if m.get("role") == "user"]
    if last.get("role") != "assistant" or not isinstance(last.get("content"), str) or not users:
        raise UserInputError(f"{where}: 'messages' must end with a user turn and then an assistant answer")
    return {"question": str(users[-1].get("content", "")), "answer": last["content"]}


def _is_qa(row: dict[str, Any]) -> bool:
    qa_keys = ("question", "answer", "instruction", "output", "messages")
    return any(key in row for key in qa_keys) or prompt_response_columns(row) is not None


def parse_columns(text: str | None) -> dict[str, str] | None:
    """`--columns question=prompt,answer=response` as {"question": ..., "answer": ...}."""
    if not text:
        return None
    pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
    columns = {k.strip(): v.strip() for k, v in (p for p in pairs if len(p) == 2)}
    if len(pairs) != 2 or set(columns) != {"question", "answer"} or not all(columns.values()):
        raise UserInputError(
            f"--columns {text!r}: name both roles, for example --columns question=prompt,answer=response"
        )
    return columns


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise UserInputError(f"--data {path}: no such file; expected .txt text or .jsonl rows")


def _jsonl_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as err:
                raise UserInputError(f"{path}:{line}: malformed JSON: {err.msg}") from None
            if not isinstance(row, dict):
                raise UserInputError(f"{path}:{line}: expected a JSON object, got {type(row).__name__}")
            rows.append((line, row))
    return rows
