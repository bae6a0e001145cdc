"""The trainer of one run: the stage's HF / TRL trainer with lmforge's callbacks in their order
(guardrails, metrics, checkpoint sealing, the last step's log and eval, the shard report)."""

from __future__ import annotations

import logging
from typing import Any

from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from lmforge.ckpt.atomic import CheckpointStatus
from lmforge.config import LmforgeConfig
from lmforge.config.stages import stage_spec
from lmforge.data.run_data import RunData
from lmforge.distributed.parallel_state import ParallelState
from lmforge.distributed.strategy import Plan, engine_arguments
from lmforge.errors import UserInputError
from lmforge.monitor.metrics import MetricsLog
from lmforge.monitor.run_monitor import RunMonitor
from lmforge.run_layout import RunPaths
from lmforge.train.callbacks import (
    CheckpointCommitCallback,
    EarlyStopping,
    EngineStartup,
    KillDrillCallback,
    MetricsCallback,
    ShardReport,
    StopAtTheEnd,
)
from lmforge.train.comm_callback import comm_timing
from lmforge.train.console_progress import ConsoleProgress
from lmforge.train.eval_generations import eval_generations_callbacks
from lmforge.train.fp8 import Float8ScalesCallback, float8_all_gather, sharded_by_fsdp2
from lmforge.train.guard_callback import GuardCallback
from lmforge.train.histograms import HistogramCallback
from lmforge.train.memory_savers import check_chunked_loss_fits
from lmforge.train.moe_metrics import expert_load_callback
from lmforge.train.profiling import ProfileCallback
from lmforge.train.regional_compile import compile_layers
from lmforge.train.rl_samples import RlSamples
from lmforge.train.stages.build import build_stage_trainer
from lmforge.train.stream_loading import StreamReportCallback
from lmforge.verbosity import is_verbose

log = logging.getLogger(__name__)


class _FinalStepCallback(TrainerCallback):
    """Log (and evaluate) at the last step too, whatever the cadence: a run's record always
    ends with its final loss and, when there is eval data, a fresh eval loss (also with eval
    data but no train.eval_every: the held-out data is measured once, at the end)."""

    def __init__(self, has_eval: bool) -> None:
        self.has_eval = has_eval

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step >= state.max_steps:
            control.should_log = True
            control.should_evaluate = self.has_eval


def _early_stopping(
    cfg: LmforgeConfig, paths: RunPaths, monitor: RunMonitor, *, has_eval: bool
) -> EarlyStopping:
    settings = cfg.train.early_stopping
    assert settings is not None
    if not has_eval:
        raise UserInputError(
            "train.early_stopping watches an eval metric, but this run has no eval data; add data.eval "
            "(or data.eval_fraction) or remove train.early_stopping"
        )
    kept = paths.checkpoints if cfg.train.kept_best_metric is not None else None
    return EarlyStopping(settings, monitor.events, paths.metrics, kept)


def assemble_trainer(
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
    parallel: ParallelState,
) -> Trainer:
    """The stage's HF / TRL trainer with lmforge's callbacks, in the order they must run; the
    Trainer adapter gets the guard's step (`guard.step`) and the model's `parallel` state."""
    has_eval = data.eval is not None and len(data.eval) > 0  # type: ignore[arg-type]
    if cfg.train.chunked_cross_entropy:
        check_chunked_loss_fits(model)
    watched = cfg.monitor.enabled
    comm = comm_timing(cfg.monitor, plan.engine, plan.world.size)  # None unless distributed and watched
    comm_record = comm.take_window if comm is not None else dict
    experts = expert_load_callback(model, plan.world.size) if watched else None  # MoE models only
    expert_record = experts.take_record if experts is not None else dict
    metrics_callback = MetricsCallback(
        metrics,
        step_record=(
            lambda logs, window: {
                **guard.extra_metrics(logs, window),
                **monitor.system_metrics(),
                **comm_record(),
                **expert_record(),
            }
        )
        if watched
        else (lambda logs, window: guard.step.record(logs, window, guarded=False)),
        language_model_loss=stage_spec(cfg.train.stage).language_model_loss,
        stage_metric_prefixes=stage_spec(cfg.train.stage).metric_prefixes,
        listeners=monitor.record_listeners(),
    )
    callbacks: list[TrainerCallback] = [
        StopAtTheEnd(),
        *(
            [guard] if watched else []
        ),  # first: its on_save writes guard state before the checkpoint is sealed
        metrics_callback,
        # Right after it: an eval step's record is open when the generations' scores join it.
        *eval_generations_callbacks(
            cfg, data, tokenizer, metrics=metrics_callback, monitor=monitor, paths=paths, plan=plan
        ),
        CheckpointCommitCallback(
            paths.staging,
            paths.checkpoints,
            cfg.train.keep_last,
            best_metric=cfg.train.kept_best_metric,
            writer=plan.summary(),
            drills=guard.step.drills,
        ),
        _FinalStepCallback(has_eval),
        # After it: the expert load is taken at each step that logs, the last one included.
        *([experts] if experts is not None else []),
        ShardReport(plan.engine, parallel.pipeline),
        EngineStartup(
            plan.describe_engine(),
            # Only DeepSpeed builds ops at start; the other engines start in seconds.
            is_main=plan.world.is_main and plan.engine == "deepspeed",
            deepspeed_record=paths.deepspeed_config if plan.deepspeed is not None else None,
        ),
    ]
    if data.stream_report is not None:  # a stream's data report grows as it is read
        callbacks.append(StreamReportCallback(paths.data_report, data.report, data.stream_report))
    if comm is not None:
        callbacks.append(comm)
    if watched and cfg.monitor.histograms is not None:
        callbacks.append(HistogramCallback(cfg.monitor.histograms, monitor, paths.histograms))
    if watched and cfg.monitor.profile is not None:
        callbacks.append(ProfileCallback(cfg.monitor.profile, paths, monitor.events))
    rl_samples = None
    if watched and stage_spec(cfg.train.stage).online_rl and cfg.train.rl.log_completions:
        rl_samples = RlSamples(cfg.train.rl.log_completions, monitor, paths.rl_samples, at_eval=has_eval)
        callbacks.append(rl_samples)
    if cfg.train.early_stopping is not None:
        callbacks.append(_early_stopping(cfg, paths, monitor, has_eval=has_eval))
    if cfg.debug.crash_at_step is not None:
        callbacks.append(KillDrillCallback(guard.step.drills))
    if plan.precision == "fp8" and float8_all_gather(cfg.train.fp8, fsdp=sharded_by_fsdp2(plan)):
        callbacks.append(Float8ScalesCallback())  # the float8 weights' scales, after each optimizer step
    # Last: it prints the step's record once every other callback has added to it.
    callbacks.append(
        ConsoleProgress(cfg.train.stage, lambda: metrics_callback.pending, show=not is_verbose())
    )

    def configure(args: TrainingArguments) -> None:
        # A fresh run measures where it starts; a resumed one already has that record.
        args.eval_on_start = args.eval_strategy != "no" and resume is None

    trainer = build_stage_trainer(
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
        train_step=guard.step,
        parallel=parallel,
        engine_args=engine_arguments(plan, model, gradient_checkpointing=cfg.train.gradient_checkpointing),
    )
    if cfg.train.compile == "layers":
        # Once the Trainer holds the model (PEFT-wrapped where adapters train) and before `train()`
        # applies Liger and activation checkpointing to its layers and FSDP2 shards them: the layers
        # compile at their first forward, with all of that in place (train/regional_compile.py).
        log.info("%s", compile_layers(model, cfg.train.compile_mode))
    if rl_samples is not None:
        rl_samples.watch(trainer)
    if comm is not None:
        comm.watch(trainer)  # it hooks the engine's collectives once the Trainer has wrapped the model
    if not is_verbose():
        trainer.remove_callback(PrinterCallback)  # HF's print of raw log dicts (disable_tqdm adds it)
    return trainer
