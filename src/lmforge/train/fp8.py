"""train.precision fp8: the linear layers' matmuls in float8 through torchao, the rest in bf16.

torchao's Float8Linear (`torchao.float8.convert_to_float8_training`) casts a linear layer's input,
weight and output gradient to float8 with dynamic scales (one per tensor, or one per row with the
rowwise recipe) and runs the forward and both backward matmuls in float8. The weight itself stays
what it was (the optimizer, checkpoints and final/ see the parameters a bf16 run has; under FSDP2's
float8 all-gather it is wrapped in torchao's tensor subclass, same values), and the
rest of the model (embeddings, norms, attention scores, the loss) runs under bf16 autocast, as at
train.precision bf16. Layers kept in bf16: names listed in train.fp8.exclude (lm_head by default:
the logits are the most sensitive matmul), sizes that are not multiples of 16 (float8 matmuls need
them) and a head tied to the input embeddings (their lookup has no float8 form).

MFU stays measured against the device's bf16 peak (torchtitan's convention), so float8's gain
shows as a higher MFU than the same run in bf16, not a lower one against a doubled peak.

lmforge imports torchao only here, in a run that asked for fp8 (transformers imports it itself
whenever it is installed; lmforge/verbosity.py keeps its import notices off the console).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from torch import nn
from transformers import TrainerCallback

from lmforge.config.schema import Fp8Config
from lmforge.distributed.strategy import Plan
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)

# torch._scaled_mm needs both sizes of a float8 weight to be multiples of 16.
SIZE_MULTIPLE = 16
_NAMES_SHOWN = 12  # the log line names this many groups of kept layers, then counts the rest


def convert_linears_to_float8(model: nn.Module, settings: Fp8Config, *, fsdp: bool) -> list[str]:
    """Swap `model`'s linear layers for torchao's Float8Linear in place, except those
    `kept_in_bf16` names; returns the qualified names of the converted layers and logs one line
    with them counted and the kept ones named. `fsdp`: the run shards the model with FSDP2
    (`sharded_by_fsdp2`), which then all-gathers the weights in float8 (tensorwise recipe,
    train.fp8.fsdp_float8_all_gather).
    Call it once the model is built (and tensor / pipeline split), before FSDP2 wraps it."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(settings.recipe)
    all_gather = float8_all_gather(settings, fsdp=fsdp)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    tied = _input_embedding_weight(model)
    converted: list[str] = []
    kept: dict[str, str] = {}

    def in_float8(module: nn.Module, name: str) -> bool:
        reason = kept_in_bf16(module, name, settings.exclude, tied_weight=tied)
        if reason is None:
            converted.append(name)
        else:
            kept[name] = reason
        return reason is None

    convert_to_float8_training(model, config=config, module_filter_fn=in_float8)
    log.info("%s", describe_conversion(settings.recipe, converted, kept, all_gather=all_gather))
    if not converted:
        log.warning("fp8: no linear layer qualifies for float8; this run trains as bf16 would")
    return converted


def refuse_fp8_plan(engine: str, *, tensor_parallel: int) -> None:
    """UserInputError for an engine torchao's float8 training does not run under, as the worker
    resolved it (config/cross_checks.py refuses the same settings written in the config)."""
    if engine == "deepspeed":
        raise UserInputError(
            "train.precision=fp8 trains through torchao's float8 layers, which work with FSDP2, DDP and one "
            "process, not inside DeepSpeed's engine. Fix: set distributed.strategy: fsdp (or ddp), or "
            "train.precision: bf16 with DeepSpeed"
        )
    if tensor_parallel > 1:
        raise UserInputError(
            f"train.precision=fp8 with distributed.tensor_parallel: {tensor_parallel}: float8 under tensor "
            "parallelism needs torchao's own float8 parallel styles, which the model's tensor-parallel plan "
            "does not use. Fix: set distributed.tensor_parallel: 1 (FSDP2 shards the model), or "
            "train.precision: bf16"
        )


def sharded_by_fsdp2(plan: Plan) -> bool:
    """Whether FSDP2 splits the weights over more than one rank: the data ranks, with the context
    ranks under context parallelism. A pipeline-parallel layout alone shards over one rank, where a
    float8 all-gather moves nothing, and its gathered state dict would keep torchao's weight wrapper,
    which safetensors cannot write (measured on an H200: over one rank the wrapper stays)."""
    return plan.engine == "fsdp" and plan.layout.data * plan.layout.context > 1


def float8_all_gather(settings: Fp8Config, *, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers the float8 weights (torchao does it for the tensorwise recipe only)."""
    return fsdp and settings.recipe == "tensorwise" and settings.fsdp_float8_all_gather


def kept_in_bf16(module: nn.Module, name: str, exclude: list[str], *, tied_weight: Any = None) -> str | None:
    """Why the linear layer `name` stays in bf16, or None when it trains in float8."""
    if type(module) is not nn.Linear:  # bitsandbytes' and other libraries' Linear subclasses
        return f"a {type(module).__name__}"
    if any(entry in name for entry in exclude):
        return "train.fp8.exclude"
    if tied_weight is not None and module.weight is tied_weight:
        return "tied to the input embeddings"
    out_features, in_features = module.weight.shape
    if in_features % SIZE_MULTIPLE or out_features % SIZE_MULTIPLE:
        return f"{in_features}x{out_features}, not multiples of {SIZE_MULTIPLE}"
    return None


def describe_conversion(recipe: str, converted: list[str], kept: dict[str, str], *, all_gather: bool) -> str:
    """The run's log line: 'fp8 (tensorwise): 28 linear layers in float8, kept in bf16: lm_head
    (train.fp8.exclude), model.layers.*.mlp.gate x24 (...); ...'. Layers that differ only in
    their layer number are named once, with their count; excluded names come first."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, why in kept.items():
        groups.setdefault((re.sub(r"\.\d+\.", ".*.", name), why), []).append(name)
    ordered = sorted(groups.items(), key=lambda item: item[0][1] != "train.fp8.exclude")
    names = [
        f"{names[0]} ({why})" if len(names) == 1 else f"{pattern} x{len(names)} ({why})"
        for (pattern, why), names in ordered
    ]
    shown = ", ".join(names[:_NAMES_SHOWN]) + (
        f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    )
    line = f"fp8 ({recipe}): {len(converted)} linear layers in float8, kept in bf16: {shown or 'none'}"
    if all_gather:
        line += "; FSDP2 all-gathers their weights in float8"
    return line + "; MFU is measured against the bf16 peak"


def _input_embedding_weight(model: nn.Module) -> Any:
    getter: Any = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    return getattr(embedding, "weight", None)


class Float8ScalesCallback(TrainerCallback):
    """Under FSDP2 with float8 all-gather: the float8 scales of every sharded weight, computed in one
    all-reduce after each optimizer step, as torchao's README recommends
    (`precompute_float8_dynamic_scale_for_fsdp`); and once more when training (re)starts, after a
    checkpoint load or a rollback replaced the weights the last scales were computed from."""

    def _precompute(self, model: Any) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        if model is not None:
            precompute_float8_dynamic_scale_for_fsdp(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        self._precompute(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        self._precompute(model)
