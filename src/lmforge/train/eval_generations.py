"""`monitor.eval_generations`: at each eval step, greedy completions of the first eval prompts by
the live model, scored against their references and shown to the sinks.

What a step adds: `eval_bleu`, `eval_chrf`, `eval_rouge1`, `eval_rouge2`, `eval_rougeL`,
`eval_exact_match` (and `eval_bertscore`) in its metrics.jsonl record (evaluate/quality.py says how
each is computed), the samples as text in the sinks (TensorBoard text, a W&B table, an MLflow JSON
table, SwanLab text) and, for the report, one line per sample in <run>/eval_samples.jsonl.

Rank 0 generates alone, with no collective: under DDP (and a single process) it holds the whole
model, and the other ranks wait for it at the next step's all-reduce. Under FSDP and DeepSpeed
ZeRO-3 each rank holds a shard, and a forward on one rank alone would wait forever for the others:
there the generations are skipped, said once in the log. Greedy decoding draws no random number
and the model is put back in training mode, so the run trains exactly as it would without them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import (
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from lmforge.config import LmforgeConfig
from lmforge.config.schema import EvalGenerationsConfig
from lmforge.config.stages import stage_spec
from lmforge.data.run_data import RunData
from lmforge.distributed.strategy import Plan
from lmforge.evaluate.quality import generation_quality
from lmforge.evaluate.samples import Prompt, complete_prompts, sample_prompts
from lmforge.monitor.metrics import drop_records_after
from lmforge.monitor.run_artifacts import Sample
from lmforge.monitor.run_monitor import RunMonitor
from lmforge.run_layout import RunPaths
from lmforge.train.callbacks import MetricsCallback

log = logging.getLogger(__name__)


class EvalGenerations(TrainerCallback):
    """Generates, scores and logs at each evaluation (see the module docstring). Listed after
    MetricsCallback: the step's eval record is open when this runs, and the scores join it."""

    def __init__(
        self,
        settings: EvalGenerationsConfig,
        eval_data: Any,
        tokenizer: PreTrainedTokenizerBase,
        *,
        metrics: MetricsCallback,
        monitor: RunMonitor,
        samples_path: Path,
        skip_reason: str | None = None,
        image_processor: Any = None,
        processor: Any = None,
    ) -> None:
        self.settings = settings
        self.image_processor = image_processor  # a vision-language run's: its prompts carry images
        self.processor = processor  # places a rendered dpo prompt's image tokens
        self.eval_data = eval_data
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.monitor = monitor
        self.samples_path = samples_path
        self.skip_reason = skip_reason  # set when this engine cannot generate on one rank
        self._told = False  # the skip is logged once, not at every evaluation
        self._prompts: list[Prompt] | None = None  # read from eval_data once

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.is_world_process_zero:  # a resume (or rollback) replays the steps after its checkpoint
            drop_records_after(self.samples_path, state.global_step)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        if self.skip_reason is not None:
            if not self._told:
                log.info("eval generations skipped: %s", self.skip_reason)
                self._told = True
            return
        if kw.get("model") is None:
            return
        step = state.global_step
        try:
            samples = self._generate(kw["model"])
            scores = self._score(samples)
            append_samples(self.samples_path, step, samples)
        except Exception as err:  # a view of the model, never a reason to stop a run of hours
            log.warning("eval generations at step %d failed: %s: %s", step, type(err).__name__, err)
            return
        if scores:
            self.metrics.add_to_step(step, {f"eval_{name}": value for name, value in scores.items()})
        self.monitor.log_samples(step, samples)  # never raises

    def _generate(self, model: Any) -> list[Sample]:
        from accelerate.utils import extract_model_from_parallel

        if self._prompts is None:
            self._prompts = sample_prompts(
                self.eval_data,
                self.tokenizer,
                self.settings.prompts,
                reference_tokens=self.settings.max_new_tokens,
                processor=self.processor,
            )
        model = extract_model_from_parallel(model)  # DDP / DeepSpeed's wrapper: generate on the module
        was_training = model.training
        model.eval()  # no dropout: greedy completions of the weights as they are
        try:
            # Eager: compiled layers (train.compile) would recompile for each length the KV cache grows to.
            with torch.compiler.set_stance("force_eager"):
                return complete_prompts(
                    model,
                    self.tokenizer,
                    self._prompts,
                    self.settings.max_new_tokens,
                    image_processor=self.image_processor,
                )
        finally:
            model.train(was_training)

    def _score(self, samples: list[Sample]) -> dict[str, float]:
        """Scores of the samples that have a reference (none: nothing to score)."""
        scored = [s for s in samples if s.reference is not None]
        if not self.settings.metrics or not scored:
            return {}
        return generation_quality(
            [s.completion for s in scored],
            [s.reference or "" for s in scored],
            bertscore_model=self.settings.bertscore_model,
        )


def eval_generations_callbacks(
    cfg: LmforgeConfig,
    data: RunData,
    tokenizer: PreTrainedTokenizerBase,
    *,
    metrics: MetricsCallback,
    monitor: RunMonitor,
    paths: RunPaths,
    plan: Plan,
) -> list[TrainerCallback]:
    """[EvalGenerations] when the run asks for it and can use it, else []: the monitor is on,
    `monitor.eval_generations` is set, there is eval data, and the model generates (not rm)."""
    settings = cfg.monitor.eval_generations
    has_eval = data.eval is not None and len(data.eval) > 0  # type: ignore[arg-type]
    if (
        not cfg.monitor.enabled
        or settings is None
        or not has_eval
        or not stage_spec(cfg.train.stage).eval_generations
    ):
        return []
    callback = EvalGenerations(
        settings,
        data.eval,
        tokenizer,
        metrics=metrics,
        monitor=monitor,
        samples_path=paths.eval_samples,
        skip_reason=sharding_reason(plan),
        image_processor=data.image_processor,
        processor=data.processor,
    )
    return [callback]


def sharding_reason(plan: Plan) -> str | None:
    """Why this engine cannot generate on rank 0 alone (its parameters are sharded), else None."""
    if plan.engine == "fsdp" or plan.summary()["zero_stage"] == 3:
        return (
            f"{plan.describe_engine()} shards the parameters across ranks, and rank 0 alone cannot run them"
        )
    return None


def append_samples(path: Path, step: int, samples: list[Sample]) -> None:
    """One JSON line per sample: {"step", "prompt", "completion", "reference"}."""
    with path.open("a", encoding="utf-8") as handle:
        for sample in samples:
            handle.write(json.dumps({"step": step, **asdict(sample)}) + "\n")
