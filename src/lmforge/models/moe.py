"""Mixture-of-Experts models: what makes a config one, the router settings of `model.moe`, and the
router loss a training forward adds.

transformers names the same settings differently per family (`num_experts` / `num_local_experts`,
`num_experts_per_tok`, `router_aux_loss_coef`, `router_z_loss_coef`); the helpers here read and
write the HF config fields so that the rest of lmforge never guesses a family's spelling.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from transformers import PretrainedConfig

from lmforge.config.schema import MoeConfig
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)

# Config fields holding the number of routed experts, in the order families use them.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# `model.moe` key -> the HF config field it sets.
ROUTER_FIELDS = {
    "top_k": "num_experts_per_tok",
    "router_aux_loss_coef": "router_aux_loss_coef",
    "router_z_loss_coef": "router_z_loss_coef",
}
# Config fields of families that drop tokens past an expert's capacity (Switch Transformers'
# expert_capacity); the decoder families lmforge presets (qwen2_moe, qwen3_moe, mixtral) have none.
CAPACITY_FIELDS = ("expert_capacity", "capacity_factor", "moe_capacity_factor")
MOE_PRESETS_HINT = "qwen2-moe-tiny, qwen3-moe-tiny or mixtral-tiny"


def is_moe(config: PretrainedConfig) -> bool:
    """A config with routed experts: it can return router logits (what TRL checks) or counts experts."""
    text = config.get_text_config()
    return hasattr(text, "output_router_logits") or expert_count(config) is not None


def expert_count(config: PretrainedConfig) -> int | None:
    text = config.get_text_config()
    for field in EXPERT_COUNT_FIELDS:
        value = getattr(text, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def capacity_of(config: PretrainedConfig) -> tuple[str, Any] | None:
    """(field, value) of a capacity limit past which the family drops tokens; None when routing is dropless."""
    text = config.get_text_config()
    for field in CAPACITY_FIELDS:
        value = getattr(text, field, None)
        if value is not None:
            return field, value
    return None


def apply_router_settings(config: PretrainedConfig, settings: MoeConfig | None) -> None:
    """Write `model.moe` into the HF config fields the model reads (before the model is built)."""
    if settings is None:
        return
    given = settings.model_dump(exclude_none=True)
    model_type = getattr(config, "model_type", "?")
    if not is_moe(config):
        raise UserInputError(
            f"model.moe: {model_type} is not a Mixture-of-Experts model (its config has no experts), so "
            f"{', '.join(f'model.moe.{k}' for k in given) or 'model.moe'} has nothing to set; remove model.moe, "
            f"or train an MoE model (model.preset {MOE_PRESETS_HINT}, or a model.path whose config has experts)"
        )
    text = config.get_text_config()
    for key, value in given.items():
        field = ROUTER_FIELDS[key]
        if not hasattr(text, field):
            raise UserInputError(
                f"model.moe.{key}: the {model_type} family has no {field} (its router has no such term); "
                f"remove model.moe.{key}"
            )
        setattr(text, field, value)
    experts = expert_count(config)
    if settings.top_k is not None and experts is not None and settings.top_k > experts:
        raise UserInputError(
            f"model.moe.top_k={settings.top_k} but the model has {experts} experts per layer; "
            f"set model.moe.top_k to at most {experts}"
        )


def describe_routing(config: PretrainedConfig) -> str:
    """One line for train.log and the console: experts, top-k, loss coefficients, capacity."""
    text = config.get_text_config()
    parts = [f"{expert_count(config) or '?'} experts", f"top-{getattr(text, 'num_experts_per_tok', '?')}"]
    for field in ("router_aux_loss_coef", "router_z_loss_coef"):
        if hasattr(text, field):
            parts.append(f"{field} {getattr(text, field)}")
    capacity = capacity_of(config)
    parts.append(
        f"capacity {capacity[0]}={capacity[1]}"
        if capacity
        else "dropless (no capacity factor: every token reaches its top-k experts, so no dropped-token count)"
    )
    return f"MoE {getattr(config, 'model_type', '?')}: " + ", ".join(parts)


def hf_model(model: torch.nn.Module) -> Any:
    """The transformers model inside a PEFT wrapper (the model itself when there is none)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def fused_expert_parameters(model: torch.nn.Module) -> list[str]:
    """Suffixes (`experts.gate_up_proj`) of the 3-D parameters that hold every expert of a layer at
    once: transformers 5 fuses expert weights so, and PEFT reaches them only through target_parameters."""
    suffixes = {".".join(name.split(".")[-2:]) for name, param in model.named_parameters() if param.ndim == 3}
    return sorted(suffixes)


def add_router_loss_in_training(model: torch.nn.Module) -> None:
    """Make every training forward return the router logits, so the family adds its auxiliary loss
    (router_aux_loss_coef x aux) to the loss, while evaluation forwards leave it out.

    The config's output_router_logits stays as the model had it (so final/config.json and any later
    eval loss are unchanged) and a caller that passes output_router_logits itself (TRL's trainers,
    which add the aux loss on their own) is left alone. The hook sits on the outermost module the
    trainer calls: PEFT's wrappers call the inner model's forward() directly, past its hooks."""
    inner = hf_model(model)
    if not is_moe(inner.config) or "output_router_logits" not in inspect.signature(inner.forward).parameters:
        return

    def route_in_training(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if kwargs.get("output_router_logits") is None:
            kwargs["output_router_logits"] = module.training
        return args, kwargs

    model.register_forward_pre_hook(route_in_training, with_kwargs=True)
    log.info(describe_routing(inner.config))
