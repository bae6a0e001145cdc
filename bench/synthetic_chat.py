"""Synthetic chat data for the SFT benchmarks: `messages` rows with lognormal answer lengths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by",
         "this", "are", "from", "at", "or", "an", "have", "not"]  # fmt: skip


def write_synthetic_chat(
    path: Path,
    rows: int,
    *,
    answer_words: tuple[float, float] = (4.1, 0.9),
    max_answer_words: int = 900,
    max_turns: int = 1,
    system_share: float = 0.0,
    seed: int = 0,
) -> None:
    """Write `rows` conversations; each answer has lognormal(*answer_words) words, capped."""
    rng = np.random.default_rng(seed)
    with path.open("w") as handle:
        for _ in range(rows):
            turns = (
                [{"role": "system", "content": "You are a helpful assistant."}]
                if rng.random() < system_share
                else []
            )
            for _ in range(int(rng.integers(1, max_turns + 1))):
                question = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 30))))
                words = int(min(max(rng.lognormal(*answer_words), 3), max_answer_words))
                turns.append({"role": "user", "content": question})
                turns.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, size=words))})
            handle.write(json.dumps({"messages": turns}) + "\n")
