"""`train.stage` -> the trainer that runs it.

pretrain and sft run HF Trainer over lmforge's own prepared samples and collators; dpo, kto
and rm run TRL's trainers (DPOTrainer for the sigmoid and ipo losses, TRL's ORPO and CPO
trainers for orpo and simpo, KTOTrainer, RewardTrainer), fed the data stage's validated
conversational rows; grpo and rloo run TRL's GRPOTrainer and RLOOTrainer on prompts with the
rewards of `train.rewards` (train/rl_stage.py). Each gets the same TrainingArguments mapping
and callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback, TrainingArguments

from lmforge.config import LmforgeConfig
from lmforge.config.schema import ADAPTER_METHODS, RL_STAGES, TrainConfig
from lmforge.data.run_data import RunData
from lmforge.run_layout import RunPaths
from lmforge.train.arguments import build_training_arguments
from lmforge.train.numerics import CountingCollator
from lmforge.train.preflight import uses_vllm
from lmforge.train.rewards import RewardSet
from lmforge.train.rl_stage import build_rl_rewards, rl_config_values
from lmforge.train.trainer import LmforgeTrainer, with_lmforge_step


@dataclass
class TrlStage:
    """A TRL trainer class, its config class and the config values lmforge sets for it."""

    trainer: type[Trainer]
    config: type[TrainingArguments]
    values: dict[str, Any]
    takes_reference: bool  # pass a frozen reference copy when there is no adapter to switch off
    extra: dict[str, Any] = field(default_factory=dict)  # more constructor arguments (RL: reward_funcs)


def needs_reference_model(cfg: LmforgeConfig) -> bool:
    """Whether the stage compares against a frozen copy of the starting model (DPO, IPO, KTO):
    a separate copy unless an adapter can be switched off to get the base back."""
    if cfg.train.stage not in ("dpo", "kto") or cfg.train.method in ADAPTER_METHODS:
        return False
    return _trl_stage(cfg).takes_reference


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
    engine_args: dict[str, Any] | None = None,
) -> Trainer:
    """The trainer for `cfg.train.stage`; `configure` adjusts the arguments every stage shares,
    `engine_args` select the distributed engine (distributed/strategy.py)."""
    evaluation = data.eval if has_eval else None
    language_model = cfg.train.stage in ("pretrain", "sft")
    if cfg.train.stage in RL_STAGES:
        stage: TrlStage | None = _rl_stage(cfg.train, build_rl_rewards(cfg.train, data.train, tokenizer))
    else:
        stage = None if language_model else _trl_stage(cfg)
    args = build_training_arguments(
        cfg.train,
        paths,
        seed=cfg.run.seed,
        has_eval=has_eval,
        precision=precision,
        args_class=stage.config if stage else TrainingArguments,
        engine_args=engine_args,
        # TRL's collators take only the tokenized columns; the text columns must be dropped.
        stage_args={"remove_unused_columns": True, **stage.values} if stage else None,
    )
    if stage is None:
        configure(args)
        assert data.collator is not None
        return LmforgeTrainer(
            model=model,
            args=args,
            train_dataset=data.train,
            eval_dataset=evaluation,
            data_collator=CountingCollator(data.collator),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    configure(args)
    extra: dict[str, Any] = {"ref_model": reference} if stage.takes_reference else {}
    extra.update(stage.extra)
    return with_lmforge_step(stage.trainer)(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        callbacks=callbacks,
        **extra,
    )


def _rl_stage(train: TrainConfig, rewards: RewardSet) -> TrlStage:
    values = rl_config_values(train, rewards, use_vllm=uses_vllm(train.rl))
    extra = {"reward_funcs": rewards.functions}
    if train.stage == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        return TrlStage(RLOOTrainer, RLOOConfig, values, takes_reference=False, extra=extra)
    from trl import GRPOConfig, GRPOTrainer

    return TrlStage(GRPOTrainer, GRPOConfig, values, takes_reference=False, extra=extra)


def _trl_stage(cfg: LmforgeConfig) -> TrlStage:
    train, max_length = cfg.train, cfg.data.max_length
    if train.stage == "kto":
        from trl import KTOConfig, KTOTrainer

        kto = train.kto
        return TrlStage(
            KTOTrainer,
            KTOConfig,
            {
                "beta": kto.beta,
                "desirable_weight": kto.desirable_weight,
                "undesirable_weight": kto.undesirable_weight,
                "max_length": max_length,
            },
            takes_reference=True,
        )
    if train.stage == "rm":
        from trl import RewardConfig, RewardTrainer

        return TrlStage(RewardTrainer, RewardConfig, {"max_length": max_length}, takes_reference=False)
    dpo = train.dpo
    if dpo.loss == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return TrlStage(
            ORPOTrainer,
            ORPOConfig,
            {"beta": dpo.beta, "max_length": max_length},
            takes_reference=False,
        )
    if dpo.loss == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        return TrlStage(
            CPOTrainer,
            CPOConfig,
            {
                "loss_type": "simpo",
                "cpo_alpha": 0.0,  # pure SimPO: no behaviour-cloning term
                "simpo_gamma": dpo.simpo_gamma,
                "beta": dpo.beta,
                "max_length": max_length,
            },
            takes_reference=False,
        )
    from trl import DPOConfig, DPOTrainer

    return TrlStage(
        DPOTrainer,
        DPOConfig,
        {
            "loss_type": [dpo.loss],
            "beta": dpo.beta,
            "max_length": max_length,
            "truncation_mode": "keep_start",
        },
        takes_reference=True,
    )
