"""Translate `cfg.train` into HF TrainingArguments (the only place that knows both vocabularies)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainingArguments

from lmforge.config.schema import TrainConfig, lower_is_better
from lmforge.run_layout import RunPaths
from lmforge.verbosity import is_verbose

# Arguments an engine or a stage may set to another value than lmforge's base, and why. Any
# other clash is a bug (two places deciding one setting), raised rather than resolved by order.
OVERRIDABLE = {
    "activation_checkpointing": "FSDP checkpoints activations itself (an extra all-gather otherwise)",
    "remove_unused_columns": "TRL's collators take only the tokenized columns",
    "per_device_eval_batch_size": "online RL evaluates whole groups of completions per prompt",
}


def build_training_arguments(
    cfg: TrainConfig,
    paths: RunPaths,
    *,
    seed: int,
    has_eval: bool,
    precision: str,
    args_class: type[TrainingArguments] = TrainingArguments,
    engine_args: dict[str, Any] | None = None,
    stage_args: dict[str, Any] | None = None,
) -> TrainingArguments:
    """HF TrainingArguments, or a TRL config class (`args_class`, a subclass): lmforge's values from
    `cfg`, then the distributed engine's (`engine_args`), then the stage's (`stage_args`).
    `precision` is the plan's, resolved once for this device (fp32, bf16 or fp16)."""
    use_cuda = torch.cuda.is_available()
    length = {"max_steps": cfg.max_steps} if cfg.max_steps else {"num_train_epochs": cfg.epochs}
    evaluate = has_eval and cfg.eval_every is not None
    values: dict[str, Any] = dict(
        output_dir=str(paths.staging),
        **length,
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.lr,
        lr_scheduler_type=cfg.schedule,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        adam_beta2=cfg.adam_beta2,
        max_grad_norm=cfg.max_grad_norm,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not use_cuda,
        activation_checkpointing=cfg.gradient_checkpointing,
        logging_strategy="steps",
        logging_steps=cfg.log_every,
        logging_first_step=True,
        # HF's default replaces a NaN/inf loss in the logged average: the log would look
        # healthy while bad gradients are applied (NOTES.md). Keep NaNs visible.
        logging_nan_inf_filter=False,
        include_num_input_tokens_seen="no",  # counted exactly by LmforgeTrainer (train/numerics.py)
        eval_strategy="steps" if evaluate else "no",
        eval_steps=cfg.eval_every if evaluate else None,
        save_strategy="steps" if cfg.save_every else "no",
        save_steps=cfg.save_every or 500,
        save_total_limit=None,  # rotation happens on sealed checkpoints (CheckpointCommitCallback)
        seed=seed,
        dataloader_num_workers=cfg.dataloader_workers,
        dataloader_pin_memory=use_cuda,
        report_to=[],  # sinks are attached explicitly by lmforge
        # lmforge's datasets and collators produce exactly the model's inputs; HF's column
        # filter would only drop the packed rows' position_ids on some architectures.
        remove_unused_columns=False,
        # HF's tqdm bars and raw log dicts make way for train/console_progress.py unless --verbose.
        disable_tqdm=not is_verbose(),
        **_early_stopping_arguments(cfg),
    )
    for source, extra in (("engine", engine_args or {}), ("stage", stage_args or {})):
        clashes = sorted(
            k for k, v in extra.items() if k in values and values[k] != v and k not in OVERRIDABLE
        )
        if clashes:
            raise ValueError(
                f"the {source} arguments would silently replace {clashes}; add them to OVERRIDABLE"
            )
        values.update(extra)
    return args_class(**values)


def _early_stopping_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """HF's EarlyStoppingCallback reads its metric and direction from TrainingArguments."""
    if cfg.early_stopping is None:
        return {}
    metric = cfg.early_stopping.metric
    return {"metric_for_best_model": metric, "greater_is_better": not lower_is_better(metric)}
