"""Optional lm-evaluation-harness tasks on a loaded model (the `lm-eval` extra, never required)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmforge.errors import UserInputError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def require_harness() -> None:
    """Raise UserInputError with the install command when lm-evaluation-harness is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserInputError(
            "--tasks needs lm-evaluation-harness, an optional extra that is not installed; "
            "fix: pip install lm-eval"
        ) from None


def run_harness_tasks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    *,
    limit: int | None = None,
    batch_size: int = 8,
) -> dict[str, Any]:
    """lm_eval.simple_evaluate on `tasks` with an HFLM wrapping the already-loaded model: the
    per-task results dict."""
    require_harness()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        output = lm_eval.simple_evaluate(model=wrapped, tasks=tasks, limit=limit)
    except KeyError as err:  # lm_eval's way of saying a task name is unknown
        raise UserInputError(f"--tasks: unknown task {err}") from None
    return dict((output or {}).get("results", {}))
