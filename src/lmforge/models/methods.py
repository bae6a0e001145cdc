"""`train.method`: which weights a run trains.

full trains everything; freeze trains the top N transformer layers (plus named modules);
lora / dora / qlora wrap the model in PEFT adapters, so checkpoints and `final/adapter/`
are PEFT-format and load with `PeftModel.from_pretrained`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Literal

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig, PreTrainedModel

from lmforge.config.schema import ADAPTER_METHODS, TrainConfig
from lmforge.config.schema import LoraConfig as LoraSettings
from lmforge.errors import UserInputError
from lmforge.models.adapter_audit import (
    audit_adapters,
    check_targets_adapted,
    check_targets_exist,
    report_audit,
)
from lmforge.models.moe import add_router_loss_in_training, fused_expert_parameters, is_moe
from lmforge.models.vision import is_vision_config, vision_parameter_markers

log = logging.getLogger(__name__)

Head = Literal["causal", "score"]


def quantization_for(cfg: TrainConfig, compute_dtype: torch.dtype) -> BitsAndBytesConfig | None:
    """The 4-bit NF4 load settings QLoRA trains over (None for every other method)."""
    if cfg.method != "qlora":
        return None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def apply_training_method(
    base: PreTrainedModel, cfg: TrainConfig, *, head: Head = "causal", audit_path: Path | None = None
) -> PreTrainedModel | PeftModel:
    """The model with only the weights `cfg.method` trains left trainable; an adapter method's
    audit (what got adapters) is logged, and written to `audit_path` when given. A
    Mixture-of-Experts model adds its router loss in every training forward."""
    model: Any = base
    frozen_image_side = frozen_vision_markers(base, cfg)
    if cfg.method == "freeze":
        freeze_all_but_top_layers(model, cfg.freeze.trainable_layers, cfg.freeze.trainable_modules)
    elif cfg.method in ADAPTER_METHODS:
        model = _with_adapters(model, cfg, head, audit_path, excluded=frozen_image_side)
    if is_vision_config(base.config):
        _set_image_side(model, cfg, frozen_image_side)
    add_router_loss_in_training(model)
    trainable, total = trainable_parameters(model)
    log.info(
        "method %s: %.2fM of %.2fM parameters train (%.2f%%)",
        cfg.method,
        trainable / 1e6,
        total / 1e6,
        100 * trainable / max(total, 1),
    )
    return model


def frozen_vision_markers(model: Any, cfg: TrainConfig) -> tuple[str, ...]:
    """The name pieces of a vision-language model's parts that `train.vision` freezes (none for a
    text model)."""
    if not is_vision_config(model.config):
        return ()
    tower, projector = vision_parameter_markers(model.config)
    return tuple(
        marker
        for marker, setting in ((tower, cfg.vision.tower), (projector, cfg.vision.projector))
        if setting == "freeze"
    )


def _set_image_side(model: Any, cfg: TrainConfig, frozen: tuple[str, ...]) -> None:
    """Freeze the image-side parts `train.vision` freezes; a full or freeze-method run trains the
    others whole (under an adapter method they train through their adapters). Logs each part's
    trainable count."""
    tower, projector = vision_parameter_markers(model.config)
    whole = cfg.method in ("full", "freeze")
    counts = {"vision tower": [0, 0], "projector": [0, 0], "language model": [0, 0]}
    for name, param in model.named_parameters():
        part = "vision tower" if tower in name else "projector" if projector in name else "language model"
        if part != "language model":
            if any(marker in name for marker in frozen):
                param.requires_grad_(False)
            elif whole:
                param.requires_grad_(True)
        counts[part][0] += param.numel() if param.requires_grad else 0
        counts[part][1] += param.numel()
    log.info(
        "trainable: %s (train.vision: tower %s, projector %s)",
        "; ".join(f"{part} {done:,} of {total:,}" for part, (done, total) in counts.items()),
        cfg.vision.tower,
        cfg.vision.projector,
    )


def _with_adapters(
    model: Any, cfg: TrainConfig, head: Head, audit_path: Path | None, *, excluded: tuple[str, ...] = ()
) -> PeftModel:
    """get_peft_model with every requested target checked before and after, and the audit reported."""
    parameters = target_parameters_for(model, cfg)
    if parameters and cfg.method == "dora":
        raise UserInputError(
            f"train.method: dora has no adapters for parameters (PEFT), and this run targets {', '.join(parameters)} "
            "(train.lora.target_parameters; by default the fused experts of an MoE model); use train.method: "
            "lora, or set train.lora.target_parameters: [] to leave those weights frozen"
        )
    check_targets_exist(model, cfg.lora, parameters)
    if cfg.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    peft_config = lora_config(cfg, head, parameters, excluded=excluded)
    try:
        model = get_peft_model(model, peft_config)
    except ValueError as err:  # a named module PEFT cannot wrap (a router, a norm, ...)
        raise UserInputError(f"train.lora: PEFT cannot adapt the targets given ({err})") from None
    audit = audit_adapters(model)
    check_targets_adapted(audit, cfg.lora, parameters)
    request = {
        "method": cfg.method,
        "target_modules": cfg.lora.target_modules,
        "target_parameters": parameters,
        "dropout": peft_config.lora_dropout,
    }
    report_audit(audit, request, audit_path)
    return model


def target_parameters_for(model: PreTrainedModel, cfg: TrainConfig) -> list[str]:
    """train.lora.target_parameters, or by default (all-linear on an MoE model) every fused expert
    parameter: transformers 5 stores experts as 3-D parameters, which no linear-layer target reaches."""
    lora = cfg.lora
    if lora.target_parameters is not None:
        return list(lora.target_parameters)
    if lora.target_modules == "all-linear" and is_moe(model.config):
        return fused_expert_parameters(model)
    return []


def lora_dropout(cfg: TrainConfig, target_parameters: list[str]) -> float:
    """train.lora.dropout, except that adapters on parameters (fused MoE experts) cannot drop out:
    PEFT applies an adapter to a parameter as a weight delta, with no input to drop. At its default
    value the dropout is then 0 (said in the log; a recorded config.yaml that spells the default out
    runs too); another value above 0 is refused."""
    lora = cfg.lora
    if not target_parameters or lora.dropout == 0:
        return lora.dropout
    if lora.dropout != LoraSettings.model_fields["dropout"].default:
        raise UserInputError(
            f"train.lora.dropout={lora.dropout}: adapters on parameters ({', '.join(target_parameters)}) train "
            "without dropout (PEFT adapts a parameter as a weight delta, with no input to drop); set "
            "train.lora.dropout: 0, or leave train.lora.target_parameters empty ([])"
        )
    log.info(
        "train.lora.dropout: 0 (not the default %s): the adapters on %s cannot drop out",
        lora.dropout,
        ", ".join(target_parameters),
    )
    return 0.0


def lora_config(
    cfg: TrainConfig,
    head: Head,
    target_parameters: list[str] | None = None,
    *,
    excluded: tuple[str, ...] = (),
) -> PeftLoraConfig:
    """PEFT's LoraConfig for the run; modules whose names contain an `excluded` piece (a frozen
    vision tower or projector) get no adapters."""
    lora = cfg.lora
    return PeftLoraConfig(
        exclude_modules="|".join(f".*{re.escape(marker)}.*" for marker in excluded) or None,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora_dropout(cfg, target_parameters or []),
        target_modules=lora.target_modules,
        target_parameters=target_parameters or None,
        modules_to_save=lora.modules_to_save or None,
        use_dora=cfg.method == "dora",
        # SEQ_CLS makes PEFT train and save the new reward head with the adapter.
        task_type=TaskType.SEQ_CLS if head == "score" else TaskType.CAUSAL_LM,
    )


def freeze_all_but_top_layers(model: PreTrainedModel, top: int, modules: list[str]) -> None:
    """requires_grad only on the last `top` decoder layers and on parameters named by `modules`."""
    layers = decoder_layers(model)
    if top > len(layers):
        raise UserInputError(
            f"train.freeze.trainable_layers={top} but the model has {len(layers)} layers; lower it"
        )
    trainable_ids = {id(p) for layer in layers[len(layers) - top :] for p in layer.parameters()}
    matched: set[str] = set()
    for param in model.parameters():
        param.requires_grad_(id(param) in trainable_ids)
    # Every name of a shared (tied) tensor counts: lm_head names the embedding when they are tied.
    for name, param in model.named_parameters(remove_duplicate=False):
        hits = [m for m in modules if m in name]
        matched.update(hits)
        if hits:
            param.requires_grad_(True)
    unmatched = sorted(set(modules) - matched)
    if unmatched:
        raise UserInputError(
            f"train.freeze.trainable_modules: no parameter name contains {unmatched}; "
            f"names look like {next(iter(dict(model.named_parameters())))!r}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise UserInputError(
            "train.freeze: nothing would train; raise trainable_layers or name trainable_modules"
        )


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The stack of transformer blocks: the ModuleList as long as config.num_hidden_layers."""
    count = model.config.get_text_config().num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise UserInputError(
        f"train.method: freeze cannot find the {count} transformer layers of {type(model).__name__}; "
        "use train.freeze.trainable_modules with parameter names instead"
    )


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) distinct parameters."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
