"""`lmforge train`: one training job in this process, from config to `final/`.

The flow reads top to bottom: choose the engine (one process, DDP, FSDP or DeepSpeed), lock the
run directory, decide how the run starts (fresh, resumed, extended or already finished: see
run_start.py), get the tokenizer, prepare the data, build the model, train with HF Trainer, save. Under `lmforge launch` every worker runs this; rank 0 sets
the run directory up and writes the shared files.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback

from lmforge.ckpt.atomic import CheckpointStatus, find_latest_complete
from lmforge.ckpt.safe_load import no_code_from_checkpoints
from lmforge.config import LmforgeConfig, dump_config
from lmforge.config.model_kind import VISION_PRESET_NAMES, run_processor_files
from lmforge.config.schema import MonitorConfig
from lmforge.config.stages import stage_spec
from lmforge.distributed.parallel import parallelize
from lmforge.distributed.parallel_state import ParallelState
from lmforge.distributed.pipeline_parallel import whole_parameter_count
from lmforge.distributed.ranks import share_node_cores
from lmforge.distributed.strategy import Plan, plan_for
from lmforge.errors import TrainingStopped, WorkFailed, explain_write_failure
from lmforge.evaluate.samples import sample_generations
from lmforge.export.run_export import SUMMARY_NAME as EXPORT_SUMMARY
from lmforge.export.run_export import ExportOutcome, run_export
from lmforge.models.build import build_model, count_parameters
from lmforge.models.methods import Head, apply_training_method, quantization_for
from lmforge.monitor.events import EventLog
from lmforge.monitor.metrics import MetricsLog
from lmforge.monitor.run_monitor import open_run_monitor
from lmforge.run_layout import RunPaths, read_json_object
from lmforge.train.arguments import warmup_outlasting_the_run
from lmforge.train.assembly import assemble_trainer
from lmforge.train.callbacks import (
    MetricsCallback,
    NothingLeftToTrain,
)
from lmforge.train.final import refuse_nonfinite_final_eval, save_final
from lmforge.train.fp8 import convert_linears_to_float8, refuse_fp8_plan, sharded_by_fsdp2
from lmforge.train.guard_callback import GuardCallback
from lmforge.train.memory_savers import describe_memory_savers
from lmforge.train.oom_ladder import OomRestart, TrainingEngine, climb, forget_rungs, read_rungs
from lmforge.train.outcome import TrainOutcome, outcome_of
from lmforge.train.precision import resolve_precision
from lmforge.train.preflight import check_runs_here, held_out_file
from lmforge.train.provenance import describe
from lmforge.train.rl_stage import reference_model_path
from lmforge.train.rollback import train_with_rollbacks
from lmforge.train.run_lock import RunLock
from lmforge.train.run_log import run_log
from lmforge.train.run_setup import RunSetup, clear_partial_writes, set_up_run, write_in_progress
from lmforge.train.rundir import make_run_dir
from lmforge.train.stages.build import needs_reference_model
from lmforge.train.step import OutOfMemoryGivenUp, TrainStep
from lmforge.train.teacher import check_teacher_vocabulary
from lmforge.upstream import quiet_progress_bars, route_deepspeed_logs
from lmforge.verbosity import FILE_ONLY, is_verbose

if TYPE_CHECKING:
    from lmforge.data.run_data import RunData

log = logging.getLogger(__name__)


def run_training(
    cfg: LmforgeConfig,
    *,
    extra_callbacks: list[TrainerCallback] | None = None,
    after_run: Callable[[Path], None] | None = None,
) -> TrainOutcome:
    """Train as `cfg` says and write the run directory; resumes when `train.resume` allows.

    `extra_callbacks` are added to the Trainer after lmforge's own (for library users and benchmarks).
    `after_run(run_dir)` is called on rank 0 once training began and then ended, finished or failed:
    the CLI writes report.html there (training never imports the report).
    """
    check_runs_here(cfg)  # what this machine lacks for the run, before any work
    if not is_verbose():
        # DeepSpeed's own lines: train.log, and the console when they matter. Routed before the run
        # is set up: resuming a LoRA run imports PEFT (and so DeepSpeed) while reading its checkpoint.
        route_deepspeed_logs()
        quiet_progress_bars()
    share_node_cores()  # OMP_NUM_THREADS from this node's cores where no launcher set it
    on_gpu = torch.cuda.is_available()
    plan = plan_for(cfg, precision=resolve_precision(cfg.train.precision, use_cuda=on_gpu), on_gpu=on_gpu)
    if plan.precision == "fp8":  # the engine an accelerate config chose, or strategy auto
        refuse_fp8_plan(plan.engine, tensor_parallel=plan.layout.tensor)
    log.info("distributed: %s", plan.describe())
    log.info("%s", plan.optimizer_and_schedule(cfg.train))
    warmup = warmup_outlasting_the_run(cfg.train) if plan.world.is_main else None
    if warmup is not None and not (plan.deepspeed or {}).get("scheduler"):  # a DeepSpeed JSON's is its own
        log.warning("%s", warmup)
    savers = describe_memory_savers(cfg.train)
    if savers:
        log.info("memory savers: %s", savers)
    paths = RunPaths(cfg.run.dir)
    lock = RunLock(paths.root)
    if plan.world.is_main:  # one launch, one holder: rank 0 holds it for every worker
        make_run_dir(paths)
        lock.acquire()
    try:
        with no_code_from_checkpoints():
            return _run_locked(cfg, plan, paths, extra_callbacks or [], after_run or _nothing)
    finally:
        lock.release()


def _nothing(run_dir: Path) -> None:
    return None


def _run_locked(
    cfg: LmforgeConfig,
    plan: Plan,
    paths: RunPaths,
    extra_callbacks: list[TrainerCallback],
    after_run: Callable[[Path], None],
) -> TrainOutcome:
    if cfg.run.overwrite and plan.world.is_main:  # before set_up_run, which the other ranks wait for
        forget_rungs(paths.root)
    setup = set_up_run(cfg, plan, paths)
    if setup.start.finished is not None:
        return _already_finished(cfg, paths, setup.start.finished, is_main=plan.world.is_main)
    # train.log starts once the run directory is settled (a fresh start may have moved an old one).
    with run_log(paths, is_main=plan.world.is_main):
        return _train_run(cfg, plan, paths, setup, extra_callbacks, after_run)


def _save_run_processor(data: RunData, paths: RunPaths) -> None:
    """A vision preset run's processor (built by the data stage around the run's tokenizer) saved in
    the run, for final/ and the checkpoints to carry beside the model (RunPaths.processor)."""
    if data.processor is not None:
        data.processor.save_pretrained(str(paths.processor))


def images_per_token(report: dict[str, Any]) -> float:
    """The training split's images per token, from the data report (0 for text data)."""
    train = report.get("train", {})
    return float(train.get("images", 0)) / train["tokens"] if train.get("tokens") else 0.0


def _train_run(
    cfg: LmforgeConfig,
    plan: Plan,
    paths: RunPaths,
    setup: RunSetup,
    extra_callbacks: list[TrainerCallback],
    after_run: Callable[[Path], None],
) -> TrainOutcome:
    world = plan.world
    start = setup.start
    resume = start.resume
    tokenizer, data = setup.tokenizer, setup.data
    assert tokenizer is not None and data is not None  # set for every run that trains
    metrics = MetricsLog(paths.metrics)  # read after the directory was settled (resumed, cleared)

    if stage_spec(cfg.train.stage).teacher:  # two tokenizers compared before either model is built
        check_teacher_vocabulary(cfg, tokenizer)
    head: Head = stage_spec(cfg.train.stage).head
    model: Any = build_model(
        cfg.model,
        tokenizer,
        max_length=cfg.data.max_length,
        head=head,
        quantization=quantization_for(cfg.train, compute_dtype=_compute_dtype(plan)),
    )
    parameters = count_parameters(model)
    log.info("model: %s, %.2fM parameters", model.config.model_type, parameters / 1e6)
    # Before anything reads the parameters: each rank keeps its slice, its experts or its pipeline
    # stage, and its attention turns causal-only for the ring (distributed/parallel.py: only the
    # dimensions the layout uses).
    parallel = parallelize(
        model,
        plan.layout,
        on_gpu=torch.cuda.is_available(),
        pipeline_schedule=plan.settings.pipeline_schedule,
        pipeline_microbatches=plan.settings.pipeline_microbatches,
    )
    # The reference is the starting model, frozen: copied before any weight trains.
    reference = copy.deepcopy(model).eval() if needs_reference_model(cfg) else None
    if stage_spec(cfg.train.stage).reference == "on_disk":
        reference_model_path(model, cfg.train, paths, is_main=world.is_main)
    model = apply_training_method(
        model, cfg.train, head=head, audit_path=paths.adapter_audit if world.is_main else None
    )
    if plan.precision == "fp8":  # after the reference copy (it stays bf16), before FSDP2 wraps the model
        convert_linears_to_float8(model, cfg.train.fp8, fsdp=sharded_by_fsdp2(plan))
        if not cfg.train.compile:
            log.info(
                "fp8: torchao's float8 casts are fused by torch.compile; set train.compile for its speed"
            )

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
    rungs_before = read_rungs(paths.root)  # the OOM ladder's rungs this run took before this start
    step = TrainStep.from_config(
        cfg,
        model,
        resume.path if resume else None,
        update_in_backward=plan.engine == "deepspeed",
        precision=plan.precision,
        oom_ladder_climbed=bool(rungs_before),
        images_per_token=images_per_token(data.report),
    )
    guard = GuardCallback(
        step,
        events,
        stacks_dir=paths.stacks,
        stall_seconds=cfg.monitor.guard.stall_seconds,
        update_in_backward=plan.engine == "deepspeed",
    )
    trainer = assemble_trainer(
        cfg, model, reference, tokenizer, data, paths, metrics, resume, guard, monitor, plan, parallel
    )
    for callback in extra_callbacks:
        trainer.add_callback(callback)
    if _checks_rl_at_start(cfg, plan, resume):
        from lmforge.train.rewards import RewardSet
        from lmforge.train.rl_check import warn_before_updates

        rewards = RewardSet(list(trainer.reward_funcs), trainer.reward_weights.tolist())  # type: ignore[attr-defined]
        warn_before_updates(cfg, trainer.model, tokenizer, rewards, data.train, trainer)
    rank0 = trainer.is_world_process_zero()
    if rank0 and cfg.model.preset in VISION_PRESET_NAMES:
        _save_run_processor(data, paths)
    changed = [*setup.changes.maths, *setup.changes.harmless]
    if rank0 and changed:  # also in history/: the settings each launch ran with
        events.emit(
            "config_changed", resume.step if resume else 0, f"since the last launch: {describe(changed)}"
        )
    if rank0 and start.extends is not None:
        events.emit(
            "extended",
            start.extends,
            f"the finished run continues from step {start.extends} to {_target(cfg)}",
        )
    try:
        export = _train_and_export(cfg, trainer, guard, tokenizer, metrics, paths, resume, parallel)
    except BaseException as err:
        writing = write_in_progress(paths) if rank0 else None  # named in the message: gone just below
        if rank0:
            clear_partial_writes(paths)
        ladder = _oom_ladder_stop(err, cfg, plan, paths, events, rungs_before)
        failure = ladder or explain_write_failure(err, writing)
        if failure is not None:  # the console gets the message; train.log also the traceback
            log.error("%s failed", type(err).__name__, exc_info=err, extra={FILE_ONLY: True})
        if rank0:
            if ladder is None:  # the ladder recorded its own event
                kind = "stopped" if isinstance(err, TrainingStopped) else "failed"
                events.emit(kind, trainer.state.global_step, str(failure or f"{type(err).__name__}: {err}"))
            after_run(paths.root)
        if failure is not None:
            raise failure from None
        raise
    else:
        if rank0 and guard.signal_stop is None:  # finished: final/ and the exports are written
            summary = _metrics_summary(trainer)
            monitor.publish_run(
                paths,
                cfg.run.name,
                stage=cfg.train.stage,
                data=data,
                trainer_summary=summary,
                generate=sample_generations,
            )
    finally:
        monitor.close()
    if rank0:
        after_run(paths.root)
    if guard.signal_stop is not None:  # checkpointed at a step boundary; the same command resumes
        return TrainOutcome(
            paths.root,
            paths.final,
            trainer.state.global_step,
            resume.path if resume else None,
            parameters,
            interrupted_by=guard.signal_stop,
        )
    summary = _metrics_summary(trainer)
    outcome = outcome_of(
        paths, trainer.state.global_step, parameters, resumed_from=resume.path if resume else None
    )
    outcome.summary, outcome.export = summary, export
    return outcome


def _already_finished(
    cfg: LmforgeConfig, paths: RunPaths, finished: dict[str, Any], *, is_main: bool
) -> TrainOutcome:
    """The run finished before: train nothing, finish an export that never ran, report the run."""
    log.info("run %s already finished at step %d; nothing to train", paths.root, finished["step"])
    outcome = outcome_of(paths, finished["step"], int(finished.get("parameters", 0)), resumed_from=None)
    outcome.already_finished = True
    summary = paths.export / EXPORT_SUMMARY
    if cfg.export.formats and is_main and not summary.is_file():
        outcome.export = run_export(cfg.export, paths.final, paths.export, held_out=held_out_file(cfg))
    elif cfg.export.formats and summary.is_file():  # the exports of the finished run, as they were
        outcome.export = ExportOutcome(paths.export, read_json_object(summary).get("artifacts", {}))
    return outcome


def _train_and_export(
    cfg: LmforgeConfig,
    trainer: Trainer,
    guard: GuardCallback,
    tokenizer: PreTrainedTokenizerBase,
    metrics: MetricsLog,
    paths: RunPaths,
    resume: CheckpointStatus | None,
    parallel: ParallelState,
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
    finished["parameters"] = whole_parameter_count(
        trainer.accelerator.unwrap_model(trainer.model), parallel.pipeline
    )
    refuse_nonfinite_final_eval(trainer.state.log_history, paths)  # every rank holds it: all decide alike
    save_final(
        trainer,
        tokenizer,
        paths,
        merge_lora=cfg.export.merge_lora,
        finished=finished,
        extra_files=run_processor_files(cfg.model.path, paths.processor),
    )
    if trainer.is_world_process_zero():
        clear_partial_writes(paths)  # a finished run keeps no empty checkpoints/.staging
    export = None
    if cfg.export.formats and trainer.is_world_process_zero():
        export = run_export(cfg.export, paths.final, paths.export, held_out=held_out_file(cfg))
    if trainer.is_world_process_zero():
        guard.events.emit("finished", step, f"finished after {step} steps")
    return export


def _metrics_summary(trainer: Trainer) -> dict[str, float]:
    """HF Trainer's end-of-training figures (train_loss, train_runtime, ...)."""
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, MetricsCallback)).summary


def _target(cfg: LmforgeConfig) -> str:
    return f"step {cfg.train.max_steps}" if cfg.train.max_steps else f"{cfg.train.epochs:g} epochs"


def _oom_ladder_stop(
    err: BaseException,
    cfg: LmforgeConfig,
    plan: Plan,
    paths: RunPaths,
    events: EventLog,
    rungs_before: list[dict[str, Any]],
) -> WorkFailed | None:
    """How the run stops for the OOM ladder (train/oom_ladder.py), or None when `err` is no
    business of the ladder's: this rank ran out of memory with nothing left to halve; or another
    rank did and recorded the next rung, and `err` is only the echo here (a collective with the
    rank that left fails), which is neither a failure nor a traceback to show."""
    if isinstance(err, OutOfMemoryGivenUp):
        summary = plan.summary()
        engine = TrainingEngine(
            plan.engine, summary["zero_stage"], summary["offload"], torch.cuda.is_available()
        )
        return climb(err, cfg, engine, paths, events, rank=plan.world.rank)
    if read_rungs(paths.root) != rungs_before:
        return OomRestart(
            f"another rank ran out of memory and stopped the run for the OOM ladder ({type(err).__name__} here)"
        )
    return None


def _compute_dtype(plan: Plan) -> torch.dtype:
    """The dtype 4-bit layers compute in: fp16 where the run trains in fp16 (GPUs without bf16), else bf16."""
    return torch.float16 if plan.precision == "fp16" else torch.bfloat16


def _checks_rl_at_start(cfg: LmforgeConfig, plan: Plan, resume: CheckpointStatus | None) -> bool:
    """`lmforge rl check` before the first update (train.rl.check_at_start): online RL, a fresh start,
    one process whose model is whole on its device (a sharded or multi-process model would need every
    rank to generate)."""
    return (
        stage_spec(cfg.train.stage).online_rl
        and cfg.train.rl.check_at_start
        and resume is None
        and plan.world.size == 1
        and plan.engine not in ("deepspeed", "fsdp")
    )
