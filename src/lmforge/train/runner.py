"""`lmforge train`: one training job in this process, from config to `final/`.

The flow reads top to bottom: choose the engine (one process, DDP, FSDP or DeepSpeed), lock the
run directory, decide how the run starts (fresh, resumed, extended or already finished: see
run_start.py), get the tokenizer, prepare the data, build the model, train with HF Trainer, save. Under `lmforge launch` every worker runs this; rank 0 sets
the run directory up and writes the shared files.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback, TrainingArguments, set_seed

from lmforge.ckpt.atomic import CheckpointStatus, find_latest_complete, remove_within
from lmforge.ckpt.export import SUMMARY_NAME as EXPORT_SUMMARY
from lmforge.ckpt.export import ExportOutcome, run_export
from lmforge.ckpt.safe_load import no_code_from_checkpoints
from lmforge.config import LmforgeConfig, dump_config
from lmforge.config.schema import MonitorConfig
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.distributed.deepspeed_config import write_resolved
from lmforge.distributed.ranks import main_first
from lmforge.distributed.strategy import Plan, check_resume_world, engine_arguments, plan_for
from lmforge.errors import TrainingStopped, explain_write_failure
from lmforge.models.build import build_model, count_parameters
from lmforge.models.methods import Head, apply_training_method, check_method_runs_here, quantization_for
from lmforge.monitor.metrics import MetricsLog, read_metrics
from lmforge.monitor.run_monitor import RunMonitor, open_run_monitor
from lmforge.train.callbacks import (
    CheckpointCommitCallback,
    KillDrillCallback,
    MetricsCallback,
    NothingLeftToTrain,
    ShardReport,
    StopAtTheEnd,
)
from lmforge.train.final import save_final
from lmforge.train.guard_callback import GuardCallback, attach_train_step, build_train_step
from lmforge.train.precision import resolve_precision
from lmforge.train.prepare import RunData, prepare_data_for_run
from lmforge.train.rollback import train_with_rollbacks
from lmforge.train.run_lock import RunLock
from lmforge.train.run_start import RunStart, decide_start
from lmforge.train.rundir import RunPaths, make_run_dir, write_manifest, write_resolved_config
from lmforge.train.stages import build_stage_trainer, needs_reference_model
from lmforge.upstream import check_upstream_versions

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
    first_eval_loss: float | None = None
    last_eval_loss: float | None = None
    last_loss: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    export: ExportOutcome | None = None
    interrupted_by: str | None = None  # the signal that stopped the run at a checkpoint
    already_finished: bool = False  # the run had finished before this call: nothing was trained


def run_training(cfg: LmforgeConfig, *, extra_callbacks: list[TrainerCallback] | None = None) -> TrainOutcome:
    """Train as `cfg` says and write the run directory; resumes when `train.resume` allows.

    `extra_callbacks` are added to the Trainer after lmforge's own (for library users and benchmarks).
    """
    check_method_runs_here(cfg.train)  # qlora on a CPU-only machine fails here, before any work
    check_upstream_versions()  # warns when a library lmforge patches is outside its tested range
    on_gpu = torch.cuda.is_available()
    plan = plan_for(cfg, precision=resolve_precision(cfg.train.precision, use_cuda=on_gpu), on_gpu=on_gpu)
    log.info("distributed: %s", plan.describe())
    paths = RunPaths(cfg.run.dir)
    lock = RunLock(paths.root)
    if plan.world.is_main:  # one launch, one holder: rank 0 holds it for every worker
        make_run_dir(paths)
        lock.acquire()
    try:
        with no_code_from_checkpoints():
            return _run_locked(cfg, plan, paths, extra_callbacks or [])
    finally:
        lock.release()


def _run_locked(
    cfg: LmforgeConfig, plan: Plan, paths: RunPaths, extra_callbacks: list[TrainerCallback]
) -> TrainOutcome:
    world = plan.world
    start, tokenizer, data = _set_up_run(cfg, plan, paths)
    if start.finished is not None:
        return _already_finished(cfg, paths, start.finished, is_main=world.is_main)
    resume = start.resume
    metrics = MetricsLog(paths.metrics)  # read after the directory was settled (resumed, cleared)

    head: Head = "score" if cfg.train.stage == "rm" else "causal"
    model: Any = build_model(
        cfg.model,
        tokenizer,
        max_length=cfg.data.max_length,
        head=head,
        quantization=quantization_for(cfg.train, compute_dtype=_compute_dtype(plan)),
    )
    parameters = count_parameters(model)
    log.info("model: %s, %.2fM parameters", model.config.model_type, parameters / 1e6)
    # The reference is the starting model, frozen: copied before any weight trains.
    reference = copy.deepcopy(model).eval() if needs_reference_model(cfg) else None
    model = apply_training_method(model, cfg.train, head=head)

    monitor = open_run_monitor(
        cfg.monitor
        if cfg.monitor.enabled
        else MonitorConfig(enabled=False, loggers=cfg.monitor.loggers, system_metrics_seconds=None),
        paths.root,
        cfg.run.name,
        rank=world.rank,
        config=dump_config(cfg),
        resume_step=resume.step if resume else None,
    )
    events = monitor.events
    step = build_train_step(
        cfg, model, resume.path if resume else None, update_in_backward=plan.engine == "deepspeed"
    )
    guard = GuardCallback(
        step,
        events,
        stacks_dir=paths.root / "stacks",
        stall_seconds=cfg.monitor.guard.stall_seconds,
        update_in_backward=plan.engine == "deepspeed",
    )
    trainer = _build_trainer(
        cfg, model, reference, tokenizer, data, paths, metrics, resume, guard, monitor, plan
    )
    attach_train_step(trainer, step)
    for callback in extra_callbacks:
        trainer.add_callback(callback)
    rank0 = trainer.is_world_process_zero()
    if rank0 and start.extends is not None:
        events.emit(
            "extended",
            start.extends,
            f"the finished run continues from step {start.extends} to {_target(cfg)}",
        )
    try:
        export = _train_and_export(cfg, trainer, guard, tokenizer, metrics, paths, resume)
    except BaseException as err:
        if rank0:
            _clear_partial_writes(paths)
        failure = explain_write_failure(err)
        if rank0:
            kind = "stopped" if isinstance(err, TrainingStopped) else "failed"
            events.emit(kind, trainer.state.global_step, str(failure or f"{type(err).__name__}: {err}"))
            _write_report(paths.root)
        if failure is not None:
            raise failure from None
        raise
    finally:
        monitor.close()
    if rank0:
        _write_report(paths.root)
    if guard.signal_stop is not None:  # checkpointed at a step boundary; the same command resumes
        return TrainOutcome(
            paths.root,
            paths.final,
            trainer.state.global_step,
            resume.path if resume else None,
            parameters,
            interrupted_by=guard.signal_stop,
        )
    summary = next(c for c in trainer.callback_handler.callbacks if isinstance(c, MetricsCallback)).summary
    outcome = _outcome(
        paths, trainer.state.global_step, parameters, resumed_from=resume.path if resume else None
    )
    outcome.summary, outcome.export = summary, export
    return outcome


def _outcome(paths: RunPaths, steps: int, parameters: int, *, resumed_from: Path | None) -> TrainOutcome:
    """The outcome of a run that reached its end, with the eval numbers from its metrics.jsonl."""
    records = read_metrics(paths.metrics)
    evals = [r["eval_ppl"] for r in records if "eval_ppl" in r]
    eval_losses = [r["eval_loss"] for r in records if "eval_loss" in r]
    return TrainOutcome(
        run_dir=paths.root,
        final_dir=paths.final,
        steps=steps,
        resumed_from=resumed_from,
        parameters=parameters,
        first_eval_ppl=float(evals[0]) if evals else None,
        last_eval_ppl=float(evals[-1]) if evals else None,
        first_eval_loss=float(eval_losses[0]) if eval_losses else None,
        last_eval_loss=float(eval_losses[-1]) if eval_losses else None,
        last_loss=next((float(r["loss"]) for r in reversed(records) if "loss" in r), None),
    )


def _set_up_run(
    cfg: LmforgeConfig, plan: Plan, paths: RunPaths
) -> tuple[RunStart, PreTrainedTokenizerBase, RunData]:
    """Decide how the run starts (fresh, resumed, extended, finished), get the tokenizer and the
    data, write config.yaml and manifest.json. Rank 0 goes first and writes; the other ranks then
    read the run directory and the data cache it filled."""
    world = plan.world
    with main_first(world):
        start = decide_start(cfg.train, paths, overwrite=cfg.run.overwrite, act=world.is_main)
        if start.finished is not None:
            return start, None, None  # type: ignore[return-value]
        resume = start.resume
        check_resume_world(resume, plan)
        if world.is_main:
            _clear_partial_writes(paths)  # leftovers of a save or final/ interrupted by a crash
        set_seed(cfg.run.seed)
        tokenizer, data = prepare_data_for_run(cfg, paths, write_report=world.is_main)
        if world.is_main:
            write_resolved_config(cfg, paths)
            write_manifest(
                paths,
                data_fingerprint=data.fingerprint,
                tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                distributed=plan.summary(),
            )
            if plan.deepspeed is not None:
                write_resolved(plan.deepspeed, paths.root / "deepspeed_config.json")
            if resume is not None:
                dropped = MetricsLog(paths.metrics).truncate_after(resume.step)
                log.info("resuming from %s (%d metric records after it dropped)", resume.path, dropped)
    return start, tokenizer, data


def _clear_partial_writes(paths: RunPaths) -> None:
    """Remove what an interrupted or failed save left half-written; sealed checkpoints and final/
    are never partial (each appears with one rename)."""
    for partial in (paths.staging, paths.final_partial):
        try:
            remove_within(partial, paths.root)
        except OSError as err:
            log.error("could not remove the partial %s: %s", partial, err)


def _already_finished(
    cfg: LmforgeConfig, paths: RunPaths, finished: dict[str, Any], *, is_main: bool
) -> TrainOutcome:
    """The run finished before: train nothing, finish an export that never ran, report the run."""
    log.info("run %s already finished at step %d; nothing to train", paths.root, finished["step"])
    outcome = _outcome(paths, finished["step"], int(finished.get("parameters", 0)), resumed_from=None)
    outcome.already_finished = True
    if cfg.export.formats and is_main and not (paths.export / EXPORT_SUMMARY).is_file():
        outcome.export = run_export(cfg.export, paths.final, paths.export)
    return outcome


def _train_and_export(
    cfg: LmforgeConfig,
    trainer: Trainer,
    guard: GuardCallback,
    tokenizer: PreTrainedTokenizerBase,
    metrics: MetricsLog,
    paths: RunPaths,
    resume: CheckpointStatus | None,
) -> ExportOutcome | None:
    """Train (rolling back as the guardrails ask), then write final/ and the exports.

    Raises TrainingStopped when the guardrails stop the run; returns early, with nothing
    written, when a signal stopped it at a checkpoint."""
    try:
        train_with_rollbacks(
            trainer,
            guard,
            metrics,
            paths.checkpoints,
            str(resume.path) if resume else None,
            lr_scale=cfg.monitor.guard.rollback_lr_scale,
        )
    except NothingLeftToTrain:  # resumed from the last step's checkpoint: final/ was not written yet
        log.info("step %d is the last step: final/ is written from its checkpoint", trainer.state.global_step)
    finally:
        guard.close()
    step = trainer.state.global_step
    if guard.stop_reason is not None:
        if guard.update_in_backward:  # the bad update is in the weights: the last good state is older
            latest, _ = find_latest_complete(paths.checkpoints)
            good = f"checkpoints/{latest.path.name}" if latest else "not checkpointed (set train.save_every)"
        else:
            good = f"checkpoints/step-{step}"
        raise TrainingStopped(f"{guard.stop_reason}; the last good state is {good}")
    if guard.signal_stop is not None:
        return None
    finished = {"step": step, "target": {"max_steps": cfg.train.max_steps, "epochs": cfg.train.epochs}}
    finished["parameters"] = count_parameters(trainer.accelerator.unwrap_model(trainer.model))
    save_final(trainer, tokenizer, paths, merge_lora=cfg.export.merge_lora, finished=finished)
    if trainer.is_world_process_zero():
        _clear_partial_writes(paths)  # a finished run keeps no empty checkpoints/.staging
    export = None
    if cfg.export.formats and trainer.is_world_process_zero():
        export = run_export(cfg.export, paths.final, paths.export)
    if trainer.is_world_process_zero():
        guard.events.emit("finished", step, f"finished after {step} steps")
    return export


def _target(cfg: LmforgeConfig) -> str:
    return f"step {cfg.train.max_steps}" if cfg.train.max_steps else f"{cfg.train.epochs:g} epochs"


def _write_report(run_dir: Path) -> None:
    """report.html for whatever state the run ended in; a report never fails the run."""
    from lmforge.report import write_report

    try:
        # Checkpoints were hashed when they were sealed; `lmforge report` re-hashes on demand.
        log.info("report: %s", write_report(run_dir, verify_hashes=False))
    except Exception as err:
        log.warning("could not write report.html: %s", err)


def _compute_dtype(plan: Plan) -> torch.dtype:
    """The dtype 4-bit layers compute in: fp16 where the run trains in fp16 (GPUs without bf16), else bf16."""
    return torch.float16 if plan.precision == "fp16" else torch.bfloat16


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
    reference: Any,
    tokenizer: PreTrainedTokenizerBase,
    data: RunData,
    paths: RunPaths,
    metrics: MetricsLog,
    resume: CheckpointStatus | None,
    guard: GuardCallback,
    monitor: RunMonitor,
    plan: Plan,
) -> Trainer:
    has_eval = data.eval is not None and len(data.eval) > 0  # type: ignore[arg-type]
    watched = cfg.monitor.enabled
    callbacks: list[TrainerCallback] = [
        StopAtTheEnd(),
        *(
            [guard] if watched else []
        ),  # first: its on_save writes guard state before the checkpoint is sealed
        MetricsCallback(
            metrics,
            step_record=(
                lambda logs, window: {**guard.extra_metrics(logs, window), **monitor.system_metrics()}
            )
            if watched
            else (lambda logs, window: guard.step.record(logs, window, guarded=False)),
            language_model_loss=cfg.train.stage in ("pretrain", "sft"),
            listeners=monitor.record_listeners(),
        ),
        CheckpointCommitCallback(
            paths.staging,
            paths.checkpoints,
            cfg.train.keep_last,
            best_metric=cfg.train.best_metric,
            writer=plan.summary(),
            drills=guard.step.drills,
        ),
        _FinalStepCallback(),
        ShardReport(sum(p.numel() for p in model.parameters()), plan.engine),
    ]
    if cfg.debug.crash_at_step is not None:
        callbacks.append(KillDrillCallback(guard.step.drills))

    def configure(args: TrainingArguments) -> None:
        # A fresh run measures where it starts; a resumed one already has that record.
        args.eval_on_start = args.eval_strategy != "no" and resume is None

    return build_stage_trainer(
        cfg,
        model,
        reference,
        tokenizer,
        data,
        paths,
        callbacks,
        has_eval=has_eval,
        configure=configure,
        precision=plan.precision,
        engine_args=engine_arguments(plan, model, gradient_checkpointing=cfg.train.gradient_checkpointing),
    )
