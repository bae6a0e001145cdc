"""Task accuracy: greedy answers to questions, scored against the expected answers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmforge.evaluate.generation import chat_messages, generate_answers

Scoring = Literal["exact", "contains"]
EXAMPLES_SHOWN = 5


def normalize(text: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped; case kept."""
    return " ".join(text.split())


def is_correct(got: str, expected: str, scoring: Scoring) -> bool:
    """exact: equal after whitespace normalisation (case-sensitive); contains: expected appears in got."""
    if scoring == "exact":
        return normalize(got) == normalize(expected)
    return normalize(expected) in normalize(got)


def answer_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, str]],
    *,
    scoring: Scoring = "exact",
    max_new_tokens: int = 32,
    batch_size: int = 16,
    system: str | None = None,
) -> dict[str, Any]:
    """Accuracy of greedy chat-template answers to `rows` ({"question", "answer"} dicts).

    Returns {"accuracy", "correct", "total", "scoring", "examples"}; examples holds the
    first few {"question", "expected", "got", "correct"}.
    """
    if scoring not in ("exact", "contains"):
        raise ValueError(f"scoring must be exact or contains, not {scoring!r}")
    replies = generate_answers(
        model,
        tokenizer,
        [chat_messages(row["question"], system) for row in rows],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    return score_answers(rows, replies, scoring)


def score_answers(rows: Sequence[dict[str, str]], replies: list[str], scoring: Scoring) -> dict[str, Any]:
    """answer_accuracy's summary of replies already generated (lmforge eval also scores them
    for generation quality)."""
    verdicts = [is_correct(got, row["answer"], scoring) for row, got in zip(rows, replies, strict=True)]
    examples = [
        {"question": row["question"], "expected": row["answer"], "got": got, "correct": ok}
        for row, got, ok in list(zip(rows, replies, verdicts, strict=True))[:EXAMPLES_SHOWN]
    ]
    correct = sum(verdicts)
    return {
        "accuracy": correct / len(rows) if rows else 0.0,
        "correct": correct,
        "total": len(rows),
        "scoring": scoring,
        "examples": examples,
    }
