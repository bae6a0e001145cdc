"""The texts a model is checked on (verification) or calibrated on (a GGUF importance matrix), as
the model reads them: a data file's texts, or its question/answer rows chat-rendered with their
answers; built-in texts without a file. Apart from verify.py so that converters can use it
without importing the verifier, which imports the converters' dispatcher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n",
    "Question: what is 12 + 30?\nAnswer: 42. Question: what colour is the sky?\nAnswer: blue.",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
)


def rendered_texts(
    tokenizer: Any, data: Path | None, max_rows: int | None
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """The texts a model is checked on, as it reads them: the data file's texts (built-in texts
    without one), or its QA rows chat-rendered with their answers; then, for QA rows, each row's
    chat prompt and the row. The first `max_rows` (None: all)."""
    from lmforge.evaluate.generation import chat_messages, render_prompt
    from lmforge.evaluate.rows import data_kind, read_qa_rows, read_texts

    if data is None:
        return list(DEFAULT_TEXTS), [], []
    if data_kind(data) == "text":
        return read_texts(data)[:max_rows], [], []
    rows = read_qa_rows(data)[:max_rows]
    prompts = [render_prompt(tokenizer, chat_messages(row["question"])) for row in rows]
    return [prompt + row["answer"] for prompt, row in zip(prompts, rows, strict=True)], prompts, rows
