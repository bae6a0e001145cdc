"""`lmforge train`: one training job in this process, from config to `final/`.

The flow reads top to bottom: decide whether to resume, claim the run directory,
get the tokenizer, prepare the data, build the model, train with HF Trainer, save.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback, set_seed
from transformers.integrations import TensorBoardCallback

from lmforge.ckpt.atomic import CheckpointStatus, check_checkpoint, find_latest_complete
from lmforge.config import LmforgeConfig
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import UserInputError
from lmforge.models.build import build_model, count_parameters
from lmforge.monitor.metrics import MetricsLog, read_metrics
from lmforge.train.arguments import build_training_arguments
from lmforge.train.callbacks import CheckpointCommitCallback, CrashDrillCallback, MetricsCallback
from lmforge.train.numerics import CountingCollator
from lmforge.train.prepare import RunData, prepare_data_for_run
from lmforge.train.rundir import RunPaths, claim_run_dir, write_manifest, write_resolved_config
from lmforge.train.trainer import LmforgeTrainer

log = logging.getLogger(__name__)


@dataclass
class TrainOutcome:
    run_dir: Path
    final_dir: Path
    steps: int
    resumed_from: Path | None
    parameters: int
    first_eval_ppl: float | None = None
    last_eval_ppl: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def run_training(cfg: LmforgeConfig, *, extra_callbacks: list[TrainerCallback] | None = None) -> TrainOutcome:
    """Train as `cfg` says and write the run directory; resumes when `train.resume` allows.

    `extra_callbacks` are added to the Trainer after lmforge's own (for library users and benchmarks).
    """
    paths = RunPaths(cfg.run.dir)
    resume = resolve_resume(cfg.train.resume, paths)
    claim_run_dir(paths, resuming=resume is not None, overwrite=cfg.run.overwrite)
    set_seed(cfg.run.seed)

    tokenizer, data = prepare_data_for_run(cfg, paths)
    write_resolved_config(cfg, paths)
    write_manifest(
        paths, data_fingerprint=data.fingerprint, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer)
    )

    model = build_model(cfg.model, tokenizer, max_length=cfg.data.max_length)
    parameters = count_parameters(model)
    log.info("model: %s, %.2fM parameters", model.config.model_type, parameters / 1e6)

    metrics = MetricsLog(paths.metrics)
    if resume is not None:
        dropped = metrics.truncate_after(resume.step)
        log.info("resuming from %s (%d metric records after it dropped)", resume.path, dropped)
    trainer = _build_trainer(cfg, model, tokenizer, data, paths, metrics, resume)
    for callback in extra_callbacks or []:
        trainer.add_callback(callback)
    shutil.rmtree(paths.staging, ignore_errors=True)  # leftovers of a save interrupted by a crash
    trainer.train(resume_from_checkpoint=str(resume.path) if resume else None)

    _save_final(trainer, tokenizer, paths.final)
    evals = [r["eval_ppl"] for r in read_metrics(paths.metrics) if "eval_ppl" in r]
    summary = next(c for c in trainer.callback_handler.callbacks if isinstance(c, MetricsCallback)).summary
    return TrainOutcome(
        run_dir=paths.root,
        final_dir=paths.final,
        steps=trainer.state.global_step,
        resumed_from=resume.path if resume else None,
        parameters=parameters,
        first_eval_ppl=float(evals[0]) if evals else None,
        last_eval_ppl=float(evals[-1]) if evals else None,
        summary=summary,
    )


def resolve_resume(setting: str, paths: RunPaths) -> CheckpointStatus | None:
    """The checkpoint to resume from: `never`, `auto` (newest complete one) or an explicit path."""
    if setting == "never":
        return None
    if setting == "auto":
        latest, rejected = find_latest_complete(paths.checkpoints)
        for bad in rejected:
            log.warning("not resuming from %s: %s", bad.path, bad.problem)
        return latest
    status = check_checkpoint(Path(setting))
    if not status.complete:
        raise UserInputError(f"train.resume: {setting} is not a complete checkpoint: {status.problem}")
    return status


class _FinalStepCallback(TrainerCallback):
    """Log (and evaluate) at the last step too, whatever the cadence: a run's record always
    ends with its final loss and, when there is eval data, a fresh eval loss."""

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step >= state.max_steps:
            control.should_log = True
            control.should_evaluate = args.eval_strategy != "no"


def _build_trainer(
    cfg: LmforgeConfig,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    data: RunData,
    paths: RunPaths,
    metrics: MetricsLog,
    resume: CheckpointStatus | None,
) -> Trainer:
    has_eval = data.eval is not None and len(data.eval) > 0  # type: ignore[arg-type]
    args = build_training_arguments(cfg.train, paths, seed=cfg.run.seed, has_eval=has_eval)
    # A fresh run measures where it starts; a resumed one already has that record.
    args.eval_on_start = args.eval_strategy != "no" and resume is None
    callbacks: list[TrainerCallback] = [
        MetricsCallback(metrics),
        CheckpointCommitCallback(paths.staging, paths.checkpoints, cfg.train.keep_last),
        _FinalStepCallback(),
    ]
    if "tensorboard" in cfg.monitor.loggers:
        # purge_step drops events a crashed run logged after its checkpoint, so the TB
        # step axis never goes backwards either.
        writer = SummaryWriter(str(paths.tensorboard), purge_step=resume.step + 1 if resume else None)
        callbacks.append(TensorBoardCallback(tb_writer=writer))
    if cfg.debug.crash_at_step is not None:
        callbacks.append(CrashDrillCallback(cfg.debug.crash_at_step))
    return LmforgeTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval if has_eval else None,
        data_collator=CountingCollator(data.collator),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def _save_final(trainer: Trainer, tokenizer: PreTrainedTokenizerBase, final: Path) -> None:
    """final/: HF-format model and tokenizer, written aside and renamed into place."""
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    trainer.save_model(str(staging))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(str(staging))
        (staging / "training_args.bin").unlink(missing_ok=True)  # a pickle nobody needs in an export
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)
