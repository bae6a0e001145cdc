"""`distributed.*` -> the engine this worker trains on, decided once per run, before the model is built.

The world comes from the environment torchrun / the deepspeed launcher set (WORLD_SIZE,
LOCAL_WORLD_SIZE). `strategy: auto` asks the memory estimator (distributed/estimate.py)
for the cheapest strategy that fits one device of this machine.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

from lmforge.config import LmforgeConfig
from lmforge.config.schema import DistributedConfig, TrainConfig
from lmforge.distributed.accelerate_launch import (
    accelerate_choice,
    check_all_processes_started,
    check_precision,
    forget_engine_choice,
    launcher_argv,
    processes_asked,
    settings_for_accelerate,
)
from lmforge.distributed.deepspeed_config import (
    add_comms_logger,
    describe_optimizer_and_schedule,
    generated_config,
    read_user_config,
    resolve_user_config,
    zero_stage_of,
)
from lmforge.distributed.ranks import World, current_world
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)

Engine = Literal["none", "ddp", "fsdp", "deepspeed"]

# The estimator's strategy names -> distributed settings.
_ESTIMATOR_CHOICES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "deepspeed", "zero_stage": 1},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "fsdp": {"strategy": "fsdp"},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
    "zero3+offload_optimizer": {"strategy": "deepspeed", "zero_stage": 3, "offload": "optimizer"},
    "zero3+offload_params": {"strategy": "deepspeed", "zero_stage": 3, "offload": "optimizer+params"},
}


@dataclass(frozen=True)
class Plan:
    """What this run trains on: the engine, its settings, and why (for the log and the manifest)."""

    engine: Engine
    settings: DistributedConfig
    world: World
    deepspeed: dict[str, Any] | None
    reason: str
    precision: str = "fp32"  # train.precision resolved for this device, once: fp32 | bf16 | fp16

    def summary(self) -> dict[str, Any]:
        """What manifest.json and every checkpoint record of the engine that wrote them."""
        return {
            "engine": self.engine,
            "world_size": self.world.size,
            "zero_stage": zero_stage_of(self.deepspeed) if self.deepspeed is not None else None,
            "offload": self.settings.offload if self.engine in ("deepspeed", "fsdp") else "none",
            "reason": self.reason,
        }

    def optimizer_and_schedule(self, train: TrainConfig) -> str:
        """The start banner's line on the optimizer and lr schedule (a DeepSpeed JSON may bring its own)."""
        return describe_optimizer_and_schedule(self.deepspeed or {}, train)

    def describe_engine(self) -> str:
        if self.engine == "deepspeed":
            offload = f", offload {self.settings.offload}" if self.settings.offload != "none" else ""
            return f"deepspeed ZeRO-{self.summary()['zero_stage']}{offload}"
        if self.engine == "fsdp" and self.settings.offload != "none":
            return "fsdp (FSDP2 full shard, CPU offload)"
        return {"none": "single process", "ddp": "ddp", "fsdp": "fsdp (FSDP2 full shard)"}[self.engine]

    def describe(self) -> str:
        return f"{self.describe_engine()} on {self.world.size} process(es): {self.reason}"


def plan_for(cfg: LmforgeConfig, *, precision: str, on_gpu: bool, world: World | None = None) -> Plan:
    """Decide the engine of this run; bad combinations fail here, before any model is built."""
    world = world or current_world()
    cfg, launcher_reason = _with_launcher_choice(cfg, world, precision)
    settings, reason = _chosen_settings(cfg, world, on_gpu=on_gpu)
    reason = launcher_reason or reason
    engine: Engine = "deepspeed" if settings.deepspeed_config is not None else settings.strategy  # type: ignore[assignment]
    if engine == "none" and world.size > 1:
        raise UserInputError(
            f"distributed.strategy is none but {world.size} workers were launched; "
            "set distributed.strategy (ddp, fsdp, deepspeed or auto), or launch one process"
        )
    if engine == "fsdp" and world.size == 1:
        log.info("distributed.strategy fsdp with one process: nothing to shard, training as a single process")
        engine, reason = "none", "fsdp with one process shards nothing"
    if engine == "ddp" and world.size == 1:
        engine, reason = "none", "ddp with one process is a single process"
    deepspeed = None
    if engine == "deepspeed":
        deepspeed = _deepspeed_config(cfg, settings, precision=precision, on_gpu=on_gpu, world=world)
    return Plan(
        engine=engine, settings=settings, world=world, deepspeed=deepspeed, reason=reason, precision=precision
    )


def _with_launcher_choice(
    cfg: LmforgeConfig, world: World, precision: str, env: MutableMapping[str, str] = os.environ
) -> tuple[LmforgeConfig, str | None]:
    """Under `accelerate launch`: all asked processes started, its precision agrees, and its engine
    choice taken into `distributed.*` (distributed/accelerate_launch.py)."""
    choice = accelerate_choice(env)
    if choice is None:
        return cfg, None
    if "WORLD_SIZE" not in env:  # accelerate's simple launcher: one process, started directly
        check_all_processes_started(world.size, processes_asked(launcher_argv()))
    check_precision(choice, precision)
    settings, reason = settings_for_accelerate(cfg.distributed, choice, grad_accum=cfg.train.grad_accum)
    forget_engine_choice(env)
    return cfg.model_copy(update={"distributed": settings}), reason


def _chosen_settings(cfg: LmforgeConfig, world: World, *, on_gpu: bool) -> tuple[DistributedConfig, str]:
    settings = cfg.distributed
    if settings.strategy != "auto" or settings.deepspeed_config is not None:
        return settings, "as configured"
    if world.size == 1:
        return settings.model_copy(update={"strategy": "none"}), "auto: one process"
    from lmforge.distributed.estimate import estimate_memory

    device_bytes = _device_memory(world, on_gpu=on_gpu)
    estimate = estimate_memory(cfg, gpus=world.local_size, gpu_mem_bytes=device_bytes, nodes=world.nodes)
    if estimate.recommended is None:
        raise UserInputError(
            f"distributed.strategy auto: no strategy fits {device_bytes / 2**30:.1f} GiB per device "
            "(see `lmforge estimate`); lower train.micro_batch_size or data.max_length, turn on "
            "train.gradient_checkpointing, or add devices"
        )
    chosen = settings.model_copy(update=_ESTIMATOR_CHOICES[estimate.recommended])
    total = next(r.total_gpu for r in estimate.strategies if r.strategy == estimate.recommended)
    reason = (
        f"auto: {estimate.recommended} is the cheapest strategy that fits "
        f"({total / 2**30:.2f} of {device_bytes / 2**30:.1f} GiB per device, `lmforge estimate`)"
    )
    return chosen, reason


def _device_memory(world: World, *, on_gpu: bool) -> int:
    """One device's memory: the GPU's, or on CPU this node's RAM shared by its workers."""
    if on_gpu:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return int(psutil.virtual_memory().total // max(world.local_size, 1))


def _deepspeed_config(
    cfg: LmforgeConfig, settings: DistributedConfig, *, precision: str, on_gpu: bool, world: World
) -> dict[str, Any]:
    if settings.deepspeed_config is None:
        config = generated_config(settings, cfg.train, precision=precision, on_gpu=on_gpu)
    else:
        path = settings.deepspeed_config
        config = resolve_user_config(
            read_user_config(path),
            cfg.train,
            precision=precision,
            world_size=world.size,
            source=f"distributed.deepspeed_config: {path}",
            schedule_set="schedule" in cfg.train.model_fields_set,
        )
    if cfg.monitor.enabled and cfg.monitor.comm_metrics and world.size > 1:
        add_comms_logger(config, on_gpu=on_gpu)
    return config


def engine_arguments(plan: Plan, model: Any, *, gradient_checkpointing: bool) -> dict[str, Any]:
    """The TrainingArguments that select the engine (DDP needs none: torchrun's environment is enough)."""
    if plan.engine == "deepspeed":
        return {"deepspeed": plan.deepspeed}
    if plan.engine == "fsdp":
        from lmforge.distributed.fsdp import fsdp_training_arguments

        # FSDP checkpoints activations itself; the Trainer's own switch would all-gather twice.
        return {
            **fsdp_training_arguments(
                model,
                activation_checkpointing=gradient_checkpointing,
                offload=plan.settings.offload != "none",
            ),
            "activation_checkpointing": False,
        }
    return {}


# Engines whose checkpoints hold each rank's shard: resuming needs the same world and engine.
_SHARDED = ("deepspeed", "fsdp")


def check_resume_world(checkpoint: Path | None, plan: Plan) -> None:
    """The checkpoint to resume from resumes under the engine and world size that wrote it; DDP and
    single-process checkpoints hold whole states and resume under any world size (and engine, with
    new shards)."""
    if checkpoint is None:
        return
    writer = read_writer(checkpoint)
    if writer is None:
        return  # written before lmforge recorded its writer: a single-process or DDP checkpoint
    same = writer["engine"] == plan.engine and writer["world_size"] == plan.world.size
    if writer.get("engine") == "deepspeed" and plan.engine == "deepspeed":
        same = same and writer.get("zero_stage") == plan.summary()["zero_stage"]
    if same or writer["engine"] not in _SHARDED:
        return
    wrote = _engine_words(writer)
    now = _engine_words(plan.summary())
    raise UserInputError(
        f"train.resume: {checkpoint} was written by {wrote} and this run is {now}; a sharded checkpoint "
        f"resumes only under the engine and world size that wrote it. Relaunch with the same settings "
        f"(`lmforge launch CONFIG --nproc-per-node ...` for {writer['world_size']} processes in all), or make "
        f"a whole model of it with `lmforge ckpt consolidate {checkpoint} --out DIR` and start a new run "
        f"from it (model.path=DIR, train.resume=never)"
    )


def _engine_words(writer: dict[str, Any]) -> str:
    engine = writer["engine"]
    if engine == "deepspeed":
        engine = f"deepspeed ZeRO-{writer.get('zero_stage')}"
    return f"{engine} on {writer['world_size']} process(es)"


WRITER_FILE = "lmforge_writer.json"


def write_writer(checkpoint: Path, summary: dict[str, Any]) -> None:
    (checkpoint / WRITER_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")


def read_writer(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint / WRITER_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None
