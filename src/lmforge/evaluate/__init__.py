"""Evaluation stage: perplexity, QA accuracy, chat generation, optional lm-evaluation-harness tasks.

The public functions are importable from here; their modules load on first use, so that
importing the package (as the CLI does for a fast failure on a bad path) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "answer_accuracy": "lmforge.evaluate.accuracy",
    "read_qa_rows": "lmforge.evaluate.rows",
    "load_for_inference": "lmforge.evaluate.loading",
    "generate_answers": "lmforge.evaluate.generation",
    "generate_ids": "lmforge.evaluate.generation",
    "text_perplexity": "lmforge.evaluate.perplexity",
    "answer_perplexity": "lmforge.evaluate.perplexity",
    "dataset_perplexity": "lmforge.evaluate.perplexity",
    "evaluate": "lmforge.evaluate.run",
    "EvalRequest": "lmforge.evaluate.run",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmforge.evaluate' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
