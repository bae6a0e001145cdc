"""The DeepSpeed config of a run: generated from `distributed.*` and `train.*`, or the user's JSON
with its "auto" values resolved.

Batch sizes are always explicit and never include `train_batch_size`: DeepSpeed derives it as
micro-batch x accumulation x world size, which passes its own batch-size assertion for any
world size. (With `train_batch_size: "auto"` HF fills in a product that disagreed with
DeepSpeed's world size on CPU: NOTES.md.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lmforge.config.schema import DistributedConfig, TrainConfig
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)
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


# DeepSpeed's comms logger, the source of comm_* metrics under DeepSpeed (distributed/comm_timing.py).
# When enabled it synchronises the device after every collective (deepspeed.comm.timed_op), which
# on GPUs serialises communication with compute (ZeRO's overlap_comm): more than the monitoring
# overhead budget, so lmforge turns it on by itself on CPU only, where that synchronise is a no-op.
# On GPUs a `comms_logger` block in the user's DeepSpeed JSON turns it on, at that cost.
COMMS_LOGGER = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}


def add_comms_logger(config: dict[str, Any], *, on_gpu: bool) -> None:
    """Turn DeepSpeed's comms logger on for monitor.comm_metrics, unless the config says otherwise."""
    if "comms_logger" in config:
        return  # the user's JSON decides
    if on_gpu:
        log.info(
            "monitor.comm_metrics: DeepSpeed's comms logger synchronises the GPU after every collective, so "
            'it stays off; add "comms_logger": {"enabled": true} to a distributed.deepspeed_config JSON '
            "to log comm_* metrics at that cost"
        )
        return
    config["comms_logger"] = dict(COMMS_LOGGER)


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
    data: dict[str, Any],
    train: TrainConfig,
    *,
    precision: str,
    world_size: int,
    source: str,
    schedule_set: bool = False,
) -> dict[str, Any]:
    """The user's config with every "auto" that lmforge's config decides filled in, and its batch
    sizes checked against `train.*` and the world size (DeepSpeed's own assertion, said earlier).

    An `optimizer` or `scheduler` block is honoured (DeepSpeed steps it) with its "auto"s filled
    from `train.*` here, so the resolved file holds the numbers that run; a value that contradicts
    `train.*` is refused, and so is a scheduler when the config also sets `train.schedule` (two
    schedules for one lr). `bf16` / `fp16` blocks must agree with the resolved precision."""
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
    _resolve_precision_blocks(resolved, precision, source)
    _resolve_optimizer(resolved, train, source)
    _resolve_scheduler(resolved, train, source, schedule_set=schedule_set)
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


def _resolve_precision_blocks(config: dict[str, Any], precision: str, source: str) -> None:
    """`bf16` / `fp16` blocks say what train.precision resolved to: "auto" is filled, a missing
    block is written out, and an explicit `enabled` that contradicts it is refused."""
    for section in ("bf16", "fp16"):
        wanted = precision == section
        block = config.setdefault(section, {"enabled": "auto"})
        if not isinstance(block, dict):
            raise UserInputError(f'{source}: {section} must be an object like {{"enabled": "auto"}}')
        given = block.get("enabled", "auto")
        if given == "auto":
            block["enabled"] = wanted
        elif bool(given) != wanted:
            raise UserInputError(
                f"{source}: {section}.enabled is {str(given).lower()} but train.precision resolved to "
                f'{precision}; set train.precision: {section if given else precision} or write "enabled": "auto" '
                "in the JSON (lmforge's precision decides)"
            )


# HF TrainingArguments values lmforge does not expose as train.* keys (HF's defaults).
_ADAM_BETA1 = 0.9
_ADAM_EPSILON = 1e-8


def _optimizer_values(train: TrainConfig) -> dict[str, Any]:
    """What each DeepSpeed optimizer "auto" stands for: the values HF Trainer would fill in."""
    return {
        "lr": train.lr,
        "betas": [_ADAM_BETA1, train.adam_beta2],
        "eps": _ADAM_EPSILON,
        "weight_decay": train.weight_decay,
    }


def _resolve_optimizer(config: dict[str, Any], train: TrainConfig, source: str) -> None:
    optimizer = config.get("optimizer")
    if optimizer is None:
        return
    params = optimizer.setdefault("params", {}) if isinstance(optimizer, dict) else None
    if not isinstance(params, dict) or "type" not in optimizer:
        raise UserInputError(f'{source}: optimizer must be an object with a "type" and "params"')
    params.setdefault("lr", "auto")  # DeepSpeed's own default lr (1e-3) would silently replace train.lr
    _fill_autos(params, _optimizer_values(train), "optimizer.params", source, _OPTIMIZER_KEYS)


def _resolve_scheduler(
    config: dict[str, Any], train: TrainConfig, source: str, *, schedule_set: bool
) -> None:
    scheduler = config.get("scheduler")
    if scheduler is None:
        return
    if not isinstance(scheduler, dict) or "type" not in scheduler:
        raise UserInputError(f'{source}: scheduler must be an object with a "type" and "params"')
    if schedule_set:
        raise UserInputError(
            f"{source}: the JSON's scheduler ({scheduler['type']}) and train.schedule ({train.schedule}) "
            "would both decide the learning rate. Remove the scheduler block from the JSON to use "
            "train.schedule, or remove train.schedule from the config to run the JSON's scheduler"
        )
    params = scheduler.setdefault("params", {})
    if params.get("warmup_min_lr") == "auto":
        params["warmup_min_lr"] = 0  # as HF fills it; an explicit floor is the user's to choose
    for key in _SCHEDULER_DEFAULTED.get(scheduler["type"], ()):
        # DeepSpeed's defaults (peak 1e-3, 1000 warmup steps) would silently replace train.*.
        params.setdefault(key, "auto")
    values: dict[str, Any] = {
        "warmup_max_lr": train.lr,
        "warmup_num_steps": max(1, train.warmup_steps),  # DeepSpeed refuses 0 (as HF fills it)
    }
    if train.max_steps is not None:
        values["total_num_steps"] = train.max_steps
    elif params.get("total_num_steps", "auto") != "auto":
        raise UserInputError(
            f"{source}: scheduler.params.total_num_steps is {params['total_num_steps']} but the run length is "
            'counted in train.epochs; write "auto" (HF Trainer counts the steps) or set train.max_steps'
        )
    _fill_autos(params, values, "scheduler.params", source, _SCHEDULER_KEYS)


# Where each filled JSON value comes from in lmforge's config, for the mismatch message.
_OPTIMIZER_KEYS = {
    "lr": "train.lr",
    "betas": f"[{_ADAM_BETA1}, train.adam_beta2]",
    "eps": f"HF's default {_ADAM_EPSILON} (no lmforge key)",
    "weight_decay": "train.weight_decay",
}
# Parameters of DeepSpeed's warmup schedulers that default to DeepSpeed's numbers when left out.
_SCHEDULER_DEFAULTED = {
    "WarmupLR": ("warmup_max_lr", "warmup_num_steps"),
    "WarmupDecayLR": ("warmup_max_lr", "warmup_num_steps", "total_num_steps"),
}
_SCHEDULER_KEYS = {
    "warmup_max_lr": "train.lr",
    "warmup_num_steps": "train.warmup_steps (at least 1)",
    "total_num_steps": "train.max_steps",
}


def _fill_autos(
    params: dict[str, Any], values: dict[str, Any], where: str, source: str, origins: dict[str, str]
) -> None:
    """Replace "auto" with lmforge's value; an explicit value that differs is refused (HF Trainer
    would stop on it later, after the model was built)."""
    for key, value in values.items():
        given = params.get(key)
        if given == "auto":
            params[key] = value
        elif given is not None and not _same(given, value):
            raise UserInputError(
                f"{source}: {where}.{key} is {given} but lmforge trains with {value} ({origins[key]}); "
                f'set it in one place (write "auto" in the JSON to take {origins[key]})'
            )


def _same(given: Any, value: Any) -> bool:
    if isinstance(value, list):
        return isinstance(given, list) and len(given) == len(value) and all(map(_same, given, value))
    return isinstance(given, (int, float)) and abs(float(given) - float(value)) <= 1e-12 * max(
        1.0, abs(value)
    )


def describe_optimizer_and_schedule(config: dict[str, Any], train: TrainConfig) -> str:
    """One line for the start banner: which optimizer and lr schedule run, and whose they are
    (`config`: the run's DeepSpeed config, empty for other engines)."""
    optimizer = config.get("optimizer")
    scheduler = config.get("scheduler")
    opt = (
        f"optimizer: DeepSpeed {optimizer['type']} from your JSON (lr {optimizer['params'].get('lr')})"
        if optimizer
        else f"optimizer: {_optimizer_words(train)}"
    )
    if not scheduler:
        sched = f"lr schedule: {_schedule_words(train)} (train.schedule)"
    else:
        sched = f"lr schedule: DeepSpeed {scheduler['type']} from your JSON, " + _scheduler_shape(scheduler)
    return f"{opt}; {sched}"


_OPTIMIZER_WORDS = {
    "adamw": "AdamW",
    "adafactor": "Adafactor",
    "lion": "Lion",
    "galore": "GaLore AdamW",
    "muon": "Muon",
    "adamw_8bit": "8-bit AdamW",
    "paged_adamw_8bit": "paged 8-bit AdamW",
    "paged_adamw_32bit": "paged AdamW",
}


def _optimizer_words(train: TrainConfig) -> str:
    optimizer = train.optimizer
    words = f"{_OPTIMIZER_WORDS[optimizer.name]} (lr {train.lr:g})"
    if optimizer.name == "galore":
        galore = optimizer.galore
        words += f", rank {galore.rank} every {galore.update_interval} steps on {', '.join(galore.targets)}"
    if optimizer.name == "muon":
        words += f" on the hidden matrices, AdamW (lr {optimizer.muon.adamw_lr:g}) on the rest"
    if optimizer.lora_plus_ratio is not None:
        words += f", LoRA+ (B matrices at {optimizer.lora_plus_ratio:g}x lr)"
    return words


def _schedule_words(train: TrainConfig) -> str:
    warmup = (
        f"a warmup over {train.warmup_ratio:.0%} of the steps"
        if train.warmup_ratio is not None
        else f"{train.warmup_steps} warmup steps"
    )
    shape = {
        "wsd": f"warmup-stable-decay (the last {train.decay_ratio:.0%} of the steps decay)",
    }.get(train.schedule, train.schedule)
    floor = f" to {train.min_lr_ratio:g} x lr" if train.min_lr_ratio > 0 else ""
    return f"{shape}{floor} after {warmup}"


def _scheduler_shape(scheduler: dict[str, Any]) -> str:
    params = scheduler.get("params", {})
    warmup = params.get("warmup_num_steps", 1000)  # DeepSpeed's defaults
    shape = params.get("warmup_type", "log")
    rise = f"{shape} warmup {params.get('warmup_min_lr', 0)} -> {params.get('warmup_max_lr', 0.001)} over {warmup} steps"
    if scheduler["type"] == "WarmupLR":
        return f"{rise}, then flat (no decay)"
    if scheduler["type"] == "WarmupDecayLR":
        return f"{rise}, then linear decay to step {params.get('total_num_steps', 'auto')}"
    if scheduler["type"] == "WarmupCosineLR":
        return f"warmup over {warmup} steps, then cosine to step {params.get('total_num_steps', 'auto')}"
    return "with its own parameters (see deepspeed_config.json)"


def zero_stage_of(config: dict[str, Any]) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def write_resolved(config: dict[str, Any], path: Path) -> None:
    """The exact DeepSpeed config of the run, beside config.yaml, as strict JSON (HF Trainer sets
    steps_per_print to infinity, which JSON cannot hold)."""
    if config.get("steps_per_print") == float("inf"):
        config = {**config, "steps_per_print": _QUIET_STEPS}
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
