"""What `lmforge train` returns: the run's steps, eval numbers, export verdict and how it ended."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.export.run_export import ExportOutcome
from lmforge.monitor.metrics import read_metrics
from lmforge.run_layout import RunPaths


@dataclass
class TrainOutcome:
    run_dir: Path
    final_dir: Path
    steps: int
    resumed_from: Path | None
    parameters: int
    first_eval_ppl: float | None = None  # before training (step 0); None when nothing was measured then
    last_eval_ppl: float | None = None
    first_eval_loss: float | None = None
    last_eval_loss: float | None = None
    last_loss: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    export: ExportOutcome | None = None
    interrupted_by: str | None = None  # the signal that stopped the run at a checkpoint
    already_finished: bool = False  # the run had finished before this call: nothing was trained


def outcome_of(paths: RunPaths, steps: int, parameters: int, *, resumed_from: Path | None) -> TrainOutcome:
    """The outcome of a run that reached its end, with the eval numbers from its metrics.jsonl."""
    records = read_metrics(paths.metrics)
    evals = [r["eval_ppl"] for r in records if "eval_ppl" in r]
    eval_losses = [r["eval_loss"] for r in records if "eval_loss" in r]
    # "Before" is the evaluation at step 0 (eval_on_start, with train.eval_every): without one, the
    # first eval on record is a trained model's (the end's, when eval data runs once) and no start.
    before = next((r for r in records if r.get("step") == 0 and "eval_loss" in r), {})
    return TrainOutcome(
        run_dir=paths.root,
        final_dir=paths.final,
        steps=steps,
        resumed_from=resumed_from,
        parameters=parameters,
        first_eval_ppl=float(before["eval_ppl"]) if "eval_ppl" in before else None,
        last_eval_ppl=float(evals[-1]) if evals else None,
        first_eval_loss=float(before["eval_loss"]) if "eval_loss" in before else None,
        last_eval_loss=float(eval_losses[-1]) if eval_losses else None,
        last_loss=next((float(r["loss"]) for r in reversed(records) if "loss" in r), None),
    )
