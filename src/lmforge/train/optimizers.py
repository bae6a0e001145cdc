"""The optimizers HF Trainer does not build from an `optim` name: Muon (pytorch-optimizer's,
AdamW for the parameters Muon cannot step) and LoRA+ (PEFT's, over the optimizer the name
selects). Everything else is transformers' own `optim` (train/arguments.py: OPTIM_NAMES)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from lmforge.config.schema import OptimizerConfig


def needs_own_optimizer(settings: OptimizerConfig) -> bool:
    return settings.name == "muon" or settings.lora_plus_ratio is not None


def build_optimizer(
    settings: OptimizerConfig, model: torch.nn.Module, args: TrainingArguments, decay: set[str]
) -> torch.optim.Optimizer:
    """Muon or LoRA+ for `model`'s trainable parameters; `decay` names the parameters that take
    weight decay (HF's choice: not biases and norms)."""
    if settings.name == "muon":
        return _muon(settings, model, args, decay)
    assert settings.lora_plus_ratio is not None
    from peft.optimizers import create_loraplus_optimizer

    # The optimizer class and its keyword arguments (betas, eps, fused) exactly as HF builds them
    # for train.optimizer.name; LoRA+ only splits the parameters into its groups.
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)  # type: ignore[arg-type]
    kwargs = {k: v for k, v in kwargs.items() if k != "lr"}
    return create_loraplus_optimizer(
        model,  # type: ignore[arg-type]
        optimizer_cls,
        lr=args.learning_rate,
        loraplus_lr_ratio=settings.lora_plus_ratio,
        weight_decay=args.weight_decay,
        **kwargs,
    )


def _muon(
    settings: OptimizerConfig, model: torch.nn.Module, args: TrainingArguments, decay: set[str]
) -> torch.optim.Optimizer:
    """Muon orthogonalises the updates of the hidden weight matrices; embeddings, the head, norms
    and biases are stepped by AdamW inside the same optimizer (its `use_muon: False` groups), so
    HF's scheduler, clipping and checkpoints see one optimizer."""
    from pytorch_optimizer import Muon

    hidden: list[tuple[str, torch.nn.Parameter]] = []
    other: list[tuple[str, torch.nn.Parameter]] = []
    heads = _embedding_parameters(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (hidden if param.ndim == 2 and id(param) not in heads else other).append((name, param))
    muon = settings.muon

    def groups(params: list[tuple[str, Any]], **extra: Any) -> list[dict[str, Any]]:
        with_decay = [p for n, p in params if n in decay]
        without = [p for n, p in params if n not in decay]
        return [
            {"params": chosen, "weight_decay": wd, **extra}
            for chosen, wd in ((with_decay, args.weight_decay), (without, 0.0))
            if chosen
        ]

    return Muon(
        [
            *groups(hidden, use_muon=True, lr=args.learning_rate),
            *groups(other, use_muon=False, lr=muon.adamw_lr, betas=(args.adam_beta1, args.adam_beta2)),
        ],
        lr=args.learning_rate,
        momentum=muon.momentum,
        ns_steps=muon.ns_steps,
        adamw_lr=muon.adamw_lr,
        adamw_betas=(args.adam_beta1, args.adam_beta2),
        adamw_eps=args.adam_epsilon,
    )


def _embedding_parameters(model: torch.nn.Module) -> set[int]:
    """The input embeddings and the output head: 2-D, but Muon's orthogonalised update does not
    suit them (the Muon authors step them with AdamW)."""
    found: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None:
            found.update(id(p) for p in module.parameters())
    return found


def wsd_scheduler_kwargs(kwargs: dict[str, Any], num_training_steps: int) -> dict[str, Any]:
    """transformers' warmup-stable-decay wants its decay length in steps: train.decay_ratio of
    all steps, known once HF has counted them."""
    if "decay_ratio" not in kwargs:
        return kwargs
    rest = {k: v for k, v in kwargs.items() if k != "decay_ratio"}
    return {**rest, "num_decay_steps": max(1, round(kwargs["decay_ratio"] * num_training_steps))}
