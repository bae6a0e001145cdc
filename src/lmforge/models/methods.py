"""`train.method`: which weights a run trains.

full trains everything; freeze trains the top N transformer layers (plus named modules);
lora / dora / qlora wrap the model in PEFT adapters, so checkpoints and `final/adapter/`
are PEFT-format and load with `PeftModel.from_pretrained`.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig, PreTrainedModel

from lmforge.config.schema import ADAPTER_METHODS, ModelConfig, TrainConfig
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)

Head = Literal["causal", "score"]


def check_method_runs_here(cfg: TrainConfig) -> None:
    """Fail before any work when the method cannot run on this machine (qlora without CUDA + bitsandbytes)."""
    if cfg.method != "qlora":
        return
    if not torch.cuda.is_available():
        raise UserInputError(
            "train.method: qlora needs a CUDA GPU (bitsandbytes 4-bit kernels); none is visible here. "
            "Use train.method: lora on this machine, or run on a GPU host"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserInputError(
            "train.method: qlora needs bitsandbytes; install it with `pip install bitsandbytes`"
        )


def check_attention_runs_here(cfg: ModelConfig) -> None:
    """flash_attention_2 needs a CUDA GPU and the flash-attn package: say so before any work
    (transformers would raise a long ImportError once the model is built)."""
    if cfg.attn_implementation != "flash_attention_2":
        return
    if not torch.cuda.is_available():
        raise UserInputError(
            "model.attn_implementation: flash_attention_2 runs on CUDA GPUs only and none is visible here. "
            "Use model.attn_implementation: sdpa on this machine (with data.packing: true instead of "
            "data.padding_free), or run on a GPU host"
        )
    if importlib.util.find_spec("flash_attn") is None:
        raise UserInputError(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package; install it with "
            "`pip install flash-attn --no-build-isolation`, or use model.attn_implementation: sdpa"
        )


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
    base: PreTrainedModel, cfg: TrainConfig, *, head: Head = "causal"
) -> PreTrainedModel | PeftModel:
    """The model with only the weights `cfg.method` trains left trainable."""
    model: Any = base
    if cfg.method == "freeze":
        freeze_all_but_top_layers(model, cfg.freeze.trainable_layers, cfg.freeze.trainable_modules)
    elif cfg.method in ADAPTER_METHODS:
        if cfg.method == "qlora":
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=cfg.gradient_checkpointing
            )
        model = get_peft_model(model, lora_config(cfg, head))
    trainable, total = trainable_parameters(model)
    log.info(
        "method %s: %.2fM of %.2fM parameters train (%.2f%%)",
        cfg.method,
        trainable / 1e6,
        total / 1e6,
        100 * trainable / max(total, 1),
    )
    return model


def lora_config(cfg: TrainConfig, head: Head) -> PeftLoraConfig:
    lora = cfg.lora
    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
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
