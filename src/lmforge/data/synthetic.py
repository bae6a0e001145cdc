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


# The JSON schema of train/tools.py's calculator, as transformers derives it from the function
# (tests/test_rl_tools.py keeps the two equal; data/ does not import train/).
CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": 'Numbers with + - * / // % ** and parentheses, e.g. "12 * (3 + 4)".',
                }
            },
            "required": ["expression"],
        },
        "return": {"type": "string"},
    },
}
CALCULATOR_QUESTIONS = ("What is {a} {op} {b}?",)


def calculator_task_rows(count: int, *, seed: int) -> list[dict[str, str]]:
    """Question / answer rows of two-digit sums, differences and products: too hard for a tiny
    model to work out, easy with the calculator tool."""
    return [{"question": q, "answer": answer} for q, _, answer in _calculations(count, seed)]


def calculator_sft_rows(count: int, *, tool_share: float, seed: int) -> list[dict[str, Any]]:
    """OpenAI-messages rows teaching the format: a `tool_share` of them call the calculator and
    answer with its result, the rest answer at once (the answer a small model cannot compute, so
    after SFT it calls the tool only sometimes, and RL has something to learn)."""
    rng = random.Random(seed)
    rows = []
    for question, expression, answer in _calculations(count, seed):
        user = {"role": "user", "content": question}
        if rng.random() < tool_share:
            call = {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": expression}},
            }
            messages = [
                user,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": answer},
                {"role": "assistant", "content": answer},
            ]
        else:
            messages = [user, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "tools": [CALCULATOR_SCHEMA]})
    return rows


def calculator_tokenizer(rows: list[dict[str, Any]], *, vocab_size: int = 512) -> Any:
    """A byte-level BPE trained on `rows` (calculator_sft_rows) as the llama3 template renders them,
    with that template: a small model's tokenizer for the tool-use tests and benchmark."""
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.chat_templates import BUILTIN_TEMPLATES, ensure_template_tokens
    from lmforge.data.tokenizer import train_tokenizer

    def with_llama3(tokenizer: Any) -> Any:
        ensure_template_tokens(tokenizer, "llama3")
        tokenizer.chat_template = BUILTIN_TEMPLATES["llama3"]
        return tokenizer

    probe = with_llama3(train_tokenizer(["x y"] * 10, TokenizerTrainConfig(vocab_size=300, min_frequency=1)))
    texts = [probe.apply_chat_template(r["messages"], tools=r["tools"], tokenize=False) for r in rows]
    return with_llama3(train_tokenizer(texts, TokenizerTrainConfig(vocab_size=vocab_size, min_frequency=1)))


def _calculations(count: int, seed: int) -> list[tuple[str, str, str]]:
    """(question, expression, answer) of `count` random two-digit calculations."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        # The expression keeps the space before each number: a byte-level BPE then gives the numbers
        # the same tokens in the question and in the tool call, so a small model learns to copy them.
        out.append((rng.choice(CALCULATOR_QUESTIONS).format(a=a, op=op, b=b), f" {a} {op} {b}", str(value)))
    return out


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path


def write_examples(directory: Path) -> None:
    """The preference, KTO and calculator-tool example datasets in examples/data."""
    write_jsonl(directory / "arithmetic_preference.jsonl", arithmetic_preference_rows(160, seed=1))
    write_jsonl(directory / "arithmetic_kto.jsonl", arithmetic_kto_rows(160, seed=2))
    write_jsonl(
        directory / "calculator_sft.jsonl",
        calculator_sft_rows(2000, tool_share=0.5, seed=3),
    )
    write_jsonl(directory / "calculator_questions.jsonl", calculator_task_rows(400, seed=4))


if __name__ == "__main__":
    write_examples(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data"))
