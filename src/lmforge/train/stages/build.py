"""`train.stage` -> the trainer that runs it, from the stage's spec (config/stages.py).

pretrain and sft run HF Trainer over lmforge's own prepared samples and collators; dpo, kto
and rm run TRL's trainers (train/stages/preference.py), fed the data stage's validated
conversational rows; grpo and rloo run TRL's GRPOTrainer and RLOOTrainer on prompts with the
rewards of `train.rewards` (train/stages/online_rl.py); distill runs TRL's DistillationTrainer on
prompts with the teacher of `train.distill` (train/stages/distill.py). Each gets the same
TrainingArguments mapping and callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback, TrainingArguments

from lmforge.config import LmforgeConfig
from lmforge.config.schema import ADAPTER_METHODS
from lmforge.config.stages import StageSpec, stage_spec
from lmforge.data.run_data import RunData
from lmforge.distributed.parallel_state import ParallelState
from lmforge.models.build import DTYPES
from lmforge.run_layout import RunPaths
from lmforge.train.arguments import build_training_arguments
from lmforge.train.hf_trainer import HFTrainerAdapter, with_stage_trainer
from lmforge.train.numerics import CountingCollator
from lmforge.train.preflight import uses_vllm
from lmforge.train.rl_stage import build_rl_rewards, record_rl_settings
from lmforge.train.stages.binding import TrlStage, resolve_class
from lmforge.train.stages.distill import distill_stage
from lmforge.train.stages.online_rl import online_rl_stage, resolved_rl_settings
from lmforge.train.stages.preference import PREFERENCE_STAGES
from lmforge.train.step import TrainStep
from lmforge.verbosity import datasets_bars_off

__all__ = ["build_stage_trainer", "needs_reference_model"]


def needs_reference_model(cfg: LmforgeConfig) -> bool:
    """Whether the stage compares against a frozen copy of the starting model (DPO, IPO, KTO):
    a separate copy unless an adapter can be switched off to get the base back."""
    if stage_spec(cfg.train.stage).reference != "in_memory" or cfg.train.method in ADAPTER_METHODS:
        return False
    return PREFERENCE_STAGES[cfg.train.stage](cfg).takes_reference


def build_stage_trainer(
    cfg: LmforgeConfig,
    model: PreTrainedModel,
    reference: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    data: RunData,
    paths: RunPaths,
    callbacks: list[TrainerCallback],
    *,
    has_eval: bool,
    configure: Callable[[TrainingArguments], None],
    precision: str,
    train_step: TrainStep,
    parallel: ParallelState,
    engine_args: dict[str, Any] | None = None,
) -> Trainer:
    """The trainer for `cfg.train.stage`; `configure` adjusts the arguments every stage shares,
    `engine_args` select the distributed engine (distributed/strategy.py). The Trainer adapter
    (train/hf_trainer.py) gets the run's step and parallel state."""
    adapter: dict[str, Any] = {
        "train_step": train_step,
        "parallel": parallel,
        "train_settings": cfg.train,
        # final/ is written in model.dtype whatever the engine trained in (DeepSpeed: a 16-bit copy).
        "weights_dtype": DTYPES[cfg.model.dtype],
    }
    evaluation = data.eval if has_eval else None
    spec = stage_spec(cfg.train.stage)
    stage = _trl_stage(cfg, spec, data, tokenizer, model)
    args = build_training_arguments(
        cfg.train,
        paths,
        seed=cfg.run.seed,
        has_eval=has_eval,
        precision=precision,
        streaming=cfg.data.streaming,
        args_class=stage.config if stage else resolve_class(spec.arguments),
        engine_args=engine_args,
        # TRL's collators take only the tokenized columns; the text columns must be dropped.
        stage_args={"remove_unused_columns": True, **stage.values} if stage else None,
    )
    if stage is None:
        configure(args)
        assert data.collator is not None
        return HFTrainerAdapter(
            model=model,
            args=args,
            train_dataset=data.train,
            eval_dataset=evaluation,
            data_collator=CountingCollator(data.collator),
            processing_class=tokenizer,
            callbacks=callbacks,
            **adapter,
        )
    configure(args)
    if spec.online_rl:
        record_rl_settings(resolved_rl_settings(args, cfg.train), paths)
    extra: dict[str, Any] = {"ref_model": reference} if stage.takes_reference else {}
    extra.update(stage.extra)
    # TRL's preference trainers tokenize and filter the pairs lmforge's data stage already checked,
    # counted and reported (data_report.json): their datasets bars stay off the console.
    with datasets_bars_off():
        return with_stage_trainer(stage.trainer)(
            model=model,
            args=args,
            train_dataset=data.train,
            eval_dataset=evaluation,
            # dpo's image pairs are batched by TRL with the processor; every other TRL stage gets text.
            processing_class=data.processor
            if data.processor is not None and spec.offline_preference
            else tokenizer,
            callbacks=callbacks,
            **extra,
            **adapter,
        )


def _trl_stage(
    cfg: LmforgeConfig,
    spec: StageSpec,
    data: RunData,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
) -> TrlStage | None:
    """The TRL trainer binding of `spec`'s stage; None for the language-model stages, which run
    HF Trainer over lmforge's own samples and collators."""
    if spec.online_rl:
        rewards = build_rl_rewards(cfg.train, data.train, tokenizer)
        return online_rl_stage(cfg.train, rewards, tokenizer, use_vllm=uses_vllm(cfg.train.rl))
    if spec.offline_preference:
        return PREFERENCE_STAGES[spec.name](cfg)
    if spec.teacher:
        return distill_stage(cfg, model)
    return None
