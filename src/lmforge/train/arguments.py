"""Translate `cfg.train` into HF TrainingArguments (the only place that knows both vocabularies)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainingArguments

from lmforge.config.schema import OptimizerConfig, TrainConfig, lower_is_better
from lmforge.run_layout import RunPaths
from lmforge.train.precision import autocast_precision
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
    streaming: bool = False,
    args_class: type[TrainingArguments] = TrainingArguments,
    engine_args: dict[str, Any] | None = None,
    stage_args: dict[str, Any] | None = None,
) -> TrainingArguments:
    """HF TrainingArguments, or a TRL config class (`args_class`, a subclass): lmforge's values from
    `cfg`, then the distributed engine's (`engine_args`), then the stage's (`stage_args`).
    `precision` is the plan's, resolved once for this device (fp32, bf16, fp16 or fp8). `streaming`: the
    training data is a stream, whose resume restores its saved position instead of skipping batches."""
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
        **schedule_arguments(cfg),
        weight_decay=cfg.weight_decay,
        adam_beta2=cfg.adam_beta2,
        max_grad_norm=cfg.max_grad_norm,
        **optimizer_arguments(cfg.optimizer),
        bf16=autocast_precision(precision) == "bf16",  # fp8: bf16 autocast around the float8 layers
        fp16=precision == "fp16",
        use_cpu=not use_cuda,
        **memory_arguments(cfg, on_gpu=use_cuda),
        # HF's torch_compile compiles the whole model; `layers` compiles each decoder layer in place
        # instead, outside HF (train/regional_compile.py), and leaves HF's switch off.
        torch_compile=cfg.compile == "model",
        torch_compile_mode=cfg.compile_mode if cfg.compile == "model" else None,
        use_liger_kernel=cfg.kernels == "liger",
        logging_strategy="steps",
        logging_steps=cfg.log_every,
        logging_first_step=True,
        # HF's default replaces a NaN/inf loss in the logged average: the log would look
        # healthy while bad gradients are applied (NOTES.md). Keep NaNs visible.
        logging_nan_inf_filter=False,
        include_num_input_tokens_seen="no",  # counted exactly by the Trainer adapter (train/numerics.py)
        eval_strategy="steps" if evaluate else "no",
        eval_steps=cfg.eval_every if evaluate else None,
        save_strategy="steps" if cfg.save_every else "no",
        save_steps=cfg.save_every or 500,
        save_total_limit=None,  # rotation happens on sealed checkpoints (CheckpointCommitCallback)
        seed=seed,
        dataloader_num_workers=cfg.dataloader_workers,
        # A stream resumes from the position saved in its checkpoint (train/stream_loading.py);
        # HF's skip would read and drop that many batches again after it.
        ignore_data_skip=streaming,
        dataloader_pin_memory=use_cuda,
        report_to=[],  # sinks are attached explicitly by lmforge
        # lmforge's datasets and collators produce exactly the model's inputs; HF's column
        # filter would only drop the packed rows' position_ids on some architectures.
        remove_unused_columns=False,
        # No KV cache in a training or eval forward (HF's default, said here because packing needs it):
        # transformers finds the samples of a packed row from its restarting position ids only in a
        # forward without one, which is what keeps them apart under flex_attention (data/collate.py).
        use_cache=False,
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


# train.optimizer.name -> transformers' `optim` name. Muon is not among transformers' optimizers:
# The Trainer adapter (train/hf_trainer.py) builds it (train/optimizers.py) and `optim` only names what the record shows.
OPTIM_NAMES = {
    "adamw": "adamw_torch_fused",  # torch's fused kernel, on CPUs as well as GPUs
    "adafactor": "adafactor",
    "lion": "lion_32bit",  # bitsandbytes' Lion (it runs on CPUs too)
    "galore": "galore_adamw",
    "muon": "adamw_torch_fused",
    "adamw_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
}


def optimizer_arguments(optimizer: OptimizerConfig) -> dict[str, Any]:
    values: dict[str, Any] = {"optim": OPTIM_NAMES[optimizer.name]}
    if optimizer.name == "galore":
        galore = optimizer.galore
        values["optim_target_modules"] = galore.targets
        values["optim_args"] = (
            f"rank={galore.rank},update_proj_gap={galore.update_interval},scale={galore.scale}"
        )
    return values


def schedule_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """HF's scheduler name and settings. WSD's decay length is a share of all steps, which HF
    knows only once training starts: the Trainer adapter turns `decay_ratio` into steps then."""
    warmup: float = cfg.warmup_ratio if cfg.warmup_ratio is not None else cfg.warmup_steps
    if cfg.schedule == "wsd":
        return {
            "lr_scheduler_type": "warmup_stable_decay",
            "lr_scheduler_kwargs": {"decay_ratio": cfg.decay_ratio, "min_lr_ratio": cfg.min_lr_ratio},
            "warmup_steps": warmup,
        }
    if cfg.schedule == "cosine" and cfg.min_lr_ratio > 0:
        return {
            "lr_scheduler_type": "cosine_with_min_lr",
            "lr_scheduler_kwargs": {"min_lr_rate": cfg.min_lr_ratio},
            "warmup_steps": warmup,
        }
    # HF's "constant" ignores warmup_steps (its "constant_with_warmup" is the one that warms up, and
    # with no warmup it is constant from the first step): train.schedule constant is warmup, then flat.
    name = "constant_with_warmup" if cfg.schedule == "constant" else cfg.schedule
    return {"lr_scheduler_type": name, "warmup_steps": warmup}


def warmup_outlasting_the_run(cfg: TrainConfig) -> str | None:
    """The start banner's warning for a warmup of at least train.max_steps (a sweep's space that pairs
    a long warmup with a short run, a max_steps lowered for a quick try): the learning rate is still
    rising when the run ends and never reaches train.lr. None when the run outlasts its warmup."""
    if cfg.max_steps is None or cfg.warmup_ratio is not None or cfg.warmup_steps < cfg.max_steps:
        return None
    return (
        f"train.warmup_steps={cfg.warmup_steps} is not below train.max_steps={cfg.max_steps}: the learning rate "
        f"is still warming up when the run ends and peaks at about {cfg.max_steps / cfg.warmup_steps:.0%} of "
        "train.lr. Fix: lower train.warmup_steps, or set train.warmup_ratio (a share of the steps; 0.03 is common)"
    )


def memory_arguments(cfg: TrainConfig, *, on_gpu: bool) -> dict[str, Any]:
    """Activation checkpointing through transformers' own switch: every Nth decoder layer
    (`every_n_layers`), torch's non-reentrant checkpoint by default, and with activation offload
    the checkpointed layers' inputs in host memory (the rest of the activations are moved by
    the Trainer adapter's save_on_cpu)."""
    values: dict[str, Any] = {
        "activation_checkpointing": cfg.gradient_checkpointing,
        "torch_empty_cache_steps": cfg.empty_cache_steps,
    }
    if cfg.gradient_checkpointing:
        values["activation_checkpointing_kwargs"] = {
            "use_reentrant": cfg.checkpoint_reentrant,
            "every_n_layers": cfg.checkpoint_every,
            # transformers' offload pins host memory, which needs an accelerator; on a CPU the
            # save_on_cpu around the forward already holds every saved tensor.
            "offload": cfg.activation_offload and on_gpu,
        }
    return values
