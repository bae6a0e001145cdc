"""What a finished run hands to the sinks that publish artifacts (W&B, MLflow): where its model
and data report are, a summary of its numbers, and a few greedy generations of the trained model.

`finished_run` builds it once for every sink. The generations come from final/ loaded again (the
model the sinks publish, adapter or merged; whole under every engine, where the trainer's copy may
be sharded across ranks), on prompts from the eval data (train data when there is none):
- pretrain: the first tokens of a block; the block's next tokens are the reference;
- sft: a sample's tokens before its first supervised token (the turns rendered with the chat
  template, generation prompt included); the supervised reply is the reference;
- dpo / kto: the prompt turns rendered with the chat template; the chosen (or good) answer is the reference;
- rm: none (a reward model scores, it does not generate).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.config.redact import redact, redact_text
from lmforge.config.stages import stage_spec
from lmforge.monitor.metrics import read_metrics
from lmforge.run_layout import RunPaths, read_finished, read_json_object

if TYPE_CHECKING:
    from lmforge.data.run_data import RunData

# Greedy generations of the trained model in `model_dir` for prompts of a dataset (evaluate/samples.py;
# passed in by the trainer: monitor sits below evaluate).
SampleGenerator = Callable[[Path, Any], list["Sample"]]

log = logging.getLogger(__name__)
ADAPTER_CONFIG = "adapter/adapter_config.json"


@dataclass
class Sample:
    prompt: str
    completion: str
    reference: str | None = None
    reward: float | None = None  # online RL: the completion's total reward


@dataclass
class FinishedRun:
    """A run that finished: final/ and its exports are written."""

    paths: RunPaths
    name: str
    step: int
    summary: dict[str, float | int]  # steps, final loss, best eval, HF Trainer's end-of-run figures
    model_metadata: dict[str, Any]  # stage, base model of an adapter, fingerprints, parameters
    data_metadata: dict[str, Any]  # data and tokenizer fingerprints
    samples: list[Sample] = field(default_factory=list)
    samples_note: str | None = None  # why there are no samples

    def data_report(self) -> str | None:
        """data_report.json with secrets redacted (a source path may carry a token); None when absent."""
        report = read_json_object(self.paths.data_report)
        return json.dumps(redact(report), indent=2) if report else None


def finished_run(
    paths: RunPaths,
    name: str,
    *,
    stage: str,
    data: RunData,
    trainer_summary: dict[str, Any],
    generate: SampleGenerator,
) -> FinishedRun:
    """Everything the sinks publish about the run in `paths`, with generations for prompts of `data`."""
    manifest = read_json_object(paths.manifest)
    fingerprints: dict[str, Any] = {
        key: manifest[key] for key in ("data_fingerprint", "tokenizer_fingerprint") if key in manifest
    }
    summary = run_summary(paths, trainer_summary)
    finished = read_finished(paths) or {}
    adapter = read_json_object(paths.final / ADAPTER_CONFIG)
    model_metadata: dict[str, Any] = {
        "stage": stage,
        "steps": summary.get("steps"),
        "parameters": finished.get("parameters"),
        "final_loss": summary.get("final_loss"),
        "best_eval_loss": summary.get("best_eval_loss"),
        "adapter": adapter.get("peft_type") if adapter else None,
        "base_model": adapter.get("base_model_name_or_path") if adapter else None,
        **fingerprints,
    }
    run = FinishedRun(
        paths=paths,
        name=name,
        step=int(summary.get("steps", 0)),
        summary=summary,
        model_metadata=redact({k: v for k, v in model_metadata.items() if v is not None}),
        data_metadata=redact(fingerprints),
    )
    if stage_spec(stage).head == "score":
        run.samples_note = (
            "no sample generations: a reward model (train.stage: rm) scores, it does not generate"
        )
        log.info("%s", run.samples_note)
        return run
    has_eval = data.eval is not None and len(data.eval) > 0  # type: ignore[arg-type]
    log.info("sampling greedy generations from %s", paths.final)
    try:
        run.samples = generate(paths.final, data.eval if has_eval else data.train)
    except Exception as err:  # the samples are a view of the model, never a reason to fail the run
        run.samples_note = f"no sample generations: {type(err).__name__}: {redact_text(str(err))}"
        log.warning("%s", run.samples_note)
    return run


def run_summary(paths: RunPaths, trainer_summary: dict[str, Any]) -> dict[str, float | int]:
    """Steps, the last training loss, the best and last evaluation (from metrics.jsonl), and
    HF Trainer's end-of-run figures (train_loss, train_runtime, ...) that no step record carries;
    finite numbers only."""
    records = read_metrics(paths.metrics)
    finished = read_finished(paths) or {}
    per_step = {key for record in records for key in record}  # "epoch": already logged at its step
    summary: dict[str, float | int] = {
        k: v
        for k, v in trainer_summary.items()
        if _finite(v) and not isinstance(v, bool) and k not in per_step
    }
    steps = finished.get("step", records[-1]["step"] if records else 0)
    summary["steps"] = int(steps)
    losses = [r["loss"] for r in records if _finite(r.get("loss"))]
    if losses:
        summary["final_loss"] = float(losses[-1])
    evals = [r for r in records if _finite(r.get("eval_loss"))]
    if evals:
        best = min(evals, key=lambda r: float(r["eval_loss"]))
        summary.update(best_eval_loss=float(best["eval_loss"]), best_eval_step=int(best["step"]))
        summary["last_eval_loss"] = float(evals[-1]["eval_loss"])
        if _finite(best.get("eval_ppl")):
            summary["best_eval_ppl"] = float(best["eval_ppl"])
    return summary


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
