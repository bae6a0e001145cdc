"""Small synthetic tasks with checkable answers, written by the project itself (no downloads).

Used by the quickstart (fine-tune, then measure held-out accuracy) and to write the example
datasets under examples/data: `python -m lmforge.data.synthetic examples/data`.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Words in four groups; each word is one or two tokens for a small BPE tokenizer.
CATEGORIES = {
    "fruit": [
        "apple",
        "pear",
        "plum",
        "lemon",
        "lime",
        "melon",
        "grape",
        "peach",
        "cherry",
        "mango",
        "berry",
        "fig",
    ],
    "animal": ["cat", "dog", "fox", "owl", "bee", "horse", "sheep", "mouse", "tiger", "lion", "bear", "wolf"],
    "color": [
        "red",
        "blue",
        "green",
        "black",
        "white",
        "yellow",
        "purple",
        "orange",
        "pink",
        "brown",
        "grey",
        "gold",
    ],
    "tool": [
        "hammer",
        "saw",
        "drill",
        "knife",
        "axe",
        "spoon",
        "brush",
        "rope",
        "ladder",
        "shovel",
        "wrench",
        "needle",
    ],
}
QUESTION_TEMPLATES = (
    "Which group is {word} in: fruit, animal, color or tool?",
    "Is {word} a fruit, an animal, a color or a tool?",
    "{word}: fruit, animal, color or tool?",
    "Name the group of the word {word}.",
    "What kind of thing is {word}?",
    "Classify {word} as fruit, animal, color or tool.",
)


def category_task_rows(*, held_out: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, test) question/answer rows: name the group of a word, asked in several phrasings.

    Every (word, phrasing) pair occurs once; the test pairs are never in train, so a model
    passes only by learning each word's group from the other phrasings, not by recall."""
    rows = [
        {"question": template.format(word=word), "answer": group}
        for group, words in CATEGORIES.items()
        for word in words
        for template in QUESTION_TEMPLATES
    ]
    random.Random(seed).shuffle(rows)
    return rows[held_out:], rows[:held_out]


def as_alpaca(rows: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    return [{"instruction": r["question"], "input": "", "output": r["answer"]} for r in rows]


def arithmetic_preference_rows(count: int, *, seed: int) -> list[dict[str, Any]]:
    """Alpaca-form preference pairs: the correct sum is chosen, an off-by-some answer rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        wrong = a + b + rng.choice([-11, -10, -2, -1, 1, 2, 10])
        rows.append(
            {
                "instruction": f"What is {a} + {b}?",
                "input": "",
                "chosen": f"{a} + {b} = {a + b}",
                "rejected": f"{a} + {b} = {wrong}",
            }
        )
    return rows


def arithmetic_kto_rows(count: int, *, seed: int) -> list[dict[str, Any]]:
    """OpenAI-messages rows with a boolean label: true when the stated sum is right."""
    rows = []
    for pair in arithmetic_preference_rows(count, seed=seed):
        good = random.Random(pair["instruction"]).random() < 0.5
        answer = pair["chosen"] if good else pair["rejected"]
        messages = [
            {"role": "user", "content": pair["instruction"]},
            {"role": "assistant", "content": answer},
        ]
        rows.append({"messages": messages, "label": good})
    return rows


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path


def write_examples(directory: Path) -> None:
    """The preference and KTO example datasets in examples/data."""
    write_jsonl(directory / "arithmetic_preference.jsonl", arithmetic_preference_rows(160, seed=1))
    write_jsonl(directory / "arithmetic_kto.jsonl", arithmetic_kto_rows(160, seed=2))


if __name__ == "__main__":
    write_examples(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data"))
