"""The DeepSpeed config of a run: generated from `distributed.*` and `train.*`, or the user's JSON
with its "auto" values resolved.

Batch sizes are always explicit and never include `train_batch_size`: DeepSpeed derives it as
micro-batch x accumulation x world size, which passes its own batch-size assertion for any
world size. (With `train_batch_size: "auto"` HF fills in a product that disagreed with
DeepSpeed's world size on CPU: NOTES.md.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.config.schema import DistributedConfig, TrainConfig
from lmforge.errors import UserInputError

# Never let DeepSpeed print its own step lines: lmforge logs every step already.
_QUIET_STEPS = 2**31 - 1


def generated_config(
    dist: DistributedConfig, train: TrainConfig, *, precision: str, on_gpu: bool
) -> dict[str, Any]:
    """A ZeRO config for `distributed.zero_stage` / `offload`, batch and clipping from `train`."""
    zero: dict[str, Any] = {"stage": dist.zero_stage, "contiguous_gradients": True, "overlap_comm": on_gpu}
    if dist.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if dist.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if dist.zero_stage == 3:
        # final/ must hold whole weights: gather the partitions when the model is saved.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
    }
    if dist.offload != "none":
        # Offloaded states are stepped on the CPU by DeepSpeed's own CPU Adam (DeepSpeed refuses
        # a torch optimizer there); HF Trainer fills the "auto"s from train.lr, adam_beta2, ...
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    return config


def read_user_config(path: Path) -> dict[str, Any]:
    """The user's DeepSpeed JSON, or an error naming the file, the line and the fix."""
    where = f"distributed.deepspeed_config: {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise UserInputError(f"{where}: cannot read it ({err.strerror}); check the path") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserInputError(
            f"{where}:{err.lineno}: not valid JSON: {err.msg} (column {err.colno})"
        ) from None
    if not isinstance(data, dict):
        raise UserInputError(
            f"{where}: must hold a JSON object (the DeepSpeed config), got {type(data).__name__}"
        )
    return data


def resolve_user_config(
    data: dict[str, Any], train: TrainConfig, *, precision: str, world_size: int, source: str
) -> dict[str, Any]:
    """The user's config with every "auto" that lmforge's config decides filled in, and its batch
    sizes checked against `train.*` and the world size (DeepSpeed's own assertion, said earlier).

    Optimizer and scheduler "auto"s (lr, betas, warmup, total steps) are left to HF Trainer,
    which fills them from the same TrainingArguments lmforge builds from `train.*`."""
    resolved = json.loads(json.dumps(data))  # a deep copy that is certainly plain JSON
    own = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.max_grad_norm,
    }
    for key, value in own.items():
        given = resolved.get(key, "auto")
        if given == "auto":
            resolved[key] = value
        elif key != "gradient_clipping" and given != value:
            config_key = "micro_batch_size" if key.startswith("train_micro") else "grad_accum"
            raise UserInputError(
                f"{source}: {key} is {given} but train.{config_key} is {value}; set it in one place "
                f'(write "auto" in the JSON to take train.{config_key})'
            )
    expected = train.micro_batch_size * train.grad_accum * world_size
    batch = resolved.pop("train_batch_size", "auto")
    if batch != "auto" and batch != expected:
        raise UserInputError(
            f"{source}: train_batch_size is {batch}, but micro-batch {train.micro_batch_size} x accumulation "
            f"{train.grad_accum} x world size {world_size} = {expected}; DeepSpeed would refuse it. "
            'Remove train_batch_size (or write "auto"): DeepSpeed derives it'
        )
    for section, enabled in (("bf16", precision == "bf16"), ("fp16", precision == "fp16")):
        block = resolved.get(section)
        if isinstance(block, dict) and block.get("enabled") == "auto":
            block["enabled"] = enabled
    zero = resolved.get("zero_optimization")
    if zero is not None and not isinstance(zero, dict):
        raise UserInputError(f"{source}: zero_optimization must be an object with a stage")
    if zero is not None and zero.get("stage", 0) not in (0, 1, 2, 3):
        raise UserInputError(
            f"{source}: zero_optimization.stage must be 0, 1, 2 or 3, got {zero.get('stage')!r}"
        )
    if zero is not None and zero.get("stage") == 3:
        # final/ must hold whole weights: ZeRO-3 gathers its partitions on save only when asked.
        if zero.get("stage3_gather_16bit_weights_on_model_save") is False:
            raise UserInputError(
                f"{source}: zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so the "
                "final model would be saved without weights; remove the key or set it to true"
            )
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return resolved


def zero_stage_of(config: dict[str, Any]) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def write_resolved(config: dict[str, Any], path: Path) -> None:
    """The exact DeepSpeed config of the run, beside config.yaml."""
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
