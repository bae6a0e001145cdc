"""`distributed.*` -> the engine this worker trains on, decided once per run, before the model is built.

The world comes from the environment torchrun / the deepspeed launcher set (WORLD_SIZE,
LOCAL_WORLD_SIZE). `strategy: auto` asks the memory estimator (distributed/estimate.py)
for the cheapest strategy that fits one device of this machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

from lmforge.config import LmforgeConfig
from lmforge.config.layout_rules import layout_problems, pipeline_microbatches
from lmforge.config.schema import DistributedConfig, TrainConfig
from lmforge.config.stages import stage_spec
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
from lmforge.distributed.layout import Layout
from lmforge.distributed.parallel import plan_layout
from lmforge.distributed.ranks import World, current_world
from lmforge.distributed.reshard import WRITER_FILE as WRITER_FILE
from lmforge.distributed.reshard import ResumePath, load_universal, read_writer, resume_path
from lmforge.distributed.reshard import write_writer as write_writer
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
    layout: Layout  # the device mesh's degrees (distributed/layout.py)
    precision: str = "fp32"  # train.precision resolved for this device, once: fp32 | bf16 | fp16 | fp8

    def summary(self) -> dict[str, Any]:
        """What manifest.json and every checkpoint record of the engine that wrote them."""
        return {
            "engine": self.engine,
            "world_size": self.world.size,
            "zero_stage": zero_stage_of(self.deepspeed) if self.deepspeed is not None else None,
            "offload": self.settings.offload if self.engine in ("deepspeed", "fsdp") else "none",
            "tensor_parallel": self.layout.tensor,
            "layout": self.layout.to_dict(),
            "reason": self.reason,
        }

    def optimizer_and_schedule(self, train: TrainConfig) -> str:
        """The start banner's line on the optimizer and lr schedule (a DeepSpeed JSON may bring its own)."""
        return describe_optimizer_and_schedule(self.deepspeed or {}, train)

    def describe_engine(self) -> str:
        if self.layout.on_lmforge_mesh:
            return self._describe_mesh()
        if self.engine == "deepspeed":
            offload = f", offload {self.settings.offload}" if self.settings.offload != "none" else ""
            return f"deepspeed ZeRO-{self.summary()['zero_stage']}{offload}"
        if self.engine == "fsdp" and self.settings.offload != "none":
            return "fsdp (FSDP2 full shard, CPU offload)"
        return {"none": "single process", "ddp": "ddp", "fsdp": "fsdp (FSDP2 full shard)"}[self.engine]

    def _describe_mesh(self) -> str:
        """'fsdp x tp (2-D mesh data_shard=2 x tensor=2)', 'cp x tp (3-D mesh data_shard=1 x context=2 x
        tensor=2)'; tensor, context or pipeline parallel alone runs on the same mesh with one data
        shard (distributed/tensor_parallel.py, context_parallel.py, pipeline_parallel.py)."""
        offload = ", CPU offload" if self.settings.offload != "none" else ""
        layout = self.layout
        # Experts split over the data ranks add no dimension of their own.
        if layout.tensor == layout.context == layout.pipeline == 1:
            return f"fsdp x ep ({layout.describe()}{offload})"
        models = [
            name
            for name, d in (("pp", layout.pipeline), ("cp", layout.context), ("tp", layout.tensor))
            if d > 1
        ]
        kind = " x ".join(["fsdp", *models] if layout.data > 1 else models)
        schedule = ""
        if layout.pipeline > 1:
            settings = self.settings
            schedule = (
                f"; schedule {settings.pipeline_schedule}, {pipeline_microbatches(settings)} pipeline "
                "micro-batches per micro-batch"
            )
        return f"{kind} ({len(layout.mesh_dims())}-D mesh {layout.describe()}{offload}{schedule})"

    def describe(self) -> str:
        return f"{self.describe_engine()} on {self.world.size} process(es): {self.reason}"


def plan_for(cfg: LmforgeConfig, *, precision: str, on_gpu: bool, world: World | None = None) -> Plan:
    """Decide the engine of this run; bad combinations fail here, before any model is built."""
    world = world or current_world()
    cfg, launcher_reason = _with_launcher_choice(cfg, world, precision)
    settings, reason = _chosen_settings(cfg, world, on_gpu=on_gpu)
    reason = launcher_reason or reason
    engine: Engine = "deepspeed" if settings.deepspeed_config is not None else settings.strategy  # type: ignore[assignment]
    _check_layout_rules(cfg, settings)
    layout = _layout(cfg, settings, world)
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
        engine=engine,
        settings=settings,
        world=world,
        deepspeed=deepspeed,
        reason=reason,
        layout=layout,
        precision=precision,
    )


def _layout(cfg: LmforgeConfig, settings: DistributedConfig, world: World) -> Layout:
    """The run's mesh, refused here when the model or the world cannot hold it. The architecture is
    read only when a model-parallel degree asks for it (heads, layers, experts, the tp_plan)."""
    hf_config = None
    if settings.model_parallel_degree * settings.expert_parallel > 1:
        from lmforge.models.build import architecture_config  # transformers: only when it is needed

        hf_config = architecture_config(cfg.model)
    layout = plan_layout(settings, hf_config, world.size)
    if layout.sequence_parallel and not _has_sequence_parallel_plan(hf_config):
        log.info(
            "distributed.sequence_parallel: %s's tp_plan shards nothing along the sequence; its norms and "
            "dropout run replicated on each rank of a tensor group",
            getattr(hf_config, "model_type", "this model"),
        )
        layout = replace(layout, sequence_parallel=False)
    return layout


def _check_layout_rules(cfg: LmforgeConfig, settings: DistributedConfig) -> None:
    """What the mesh engines (distributed/tensor_parallel.py, context_parallel.py,
    pipeline_parallel.py, expert_parallel.py) cannot run, all reasons at once: config/layout_rules.py's
    table, which already refused the config at load, checked again on the settings this worker
    resolved (strategy auto, an accelerate config's engine) with the same words. Adapters are
    refused with strategy fsdp by config/cross_checks.py; what needs the architecture by
    distributed/layout.py."""
    problems = layout_problems(cfg.model_copy(update={"distributed": settings}))
    if problems:
        raise UserInputError(
            "distributed: this layout cannot run:\n  - "
            + "\n  - ".join(f"{key}: {message}" for key, message in problems)
        )


def _has_sequence_parallel_plan(hf_config: Any) -> bool:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return "sequence_parallel" in (getattr(text, "base_model_tp_plan", None) or {}).values()


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
    if settings.model_parallel_degree * settings.expert_parallel > 1:
        return settings.model_copy(update={"strategy": "fsdp"}), (
            "auto: tensor, context, pipeline and expert parallelism run on FSDP2's device mesh"
        )
    if world.size == 1:
        return settings.model_copy(update={"strategy": "none"}), "auto: one process"
    from lmforge.distributed.estimate import estimate_memory

    device_bytes = _device_memory(world, on_gpu=on_gpu)
    estimate = estimate_memory(cfg, gpus=world.local_size, gpu_mem_bytes=device_bytes, nodes=world.nodes)
    if estimate.recommended is None or "offload" in estimate.recommended:
        # Model parallelism keeps everything on the devices; offloading moves states over PCIe.
        model_parallel = _model_parallel_choice(cfg, estimate, device_bytes, world.size)
        if model_parallel is not None:
            return model_parallel
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


def _model_parallel_choice(
    cfg: LmforgeConfig, estimate: Any, device_bytes: int, world_size: int
) -> tuple[DistributedConfig, str] | None:
    """FSDP2 x TP, x context, x pipeline or x experts from the layout planner, when no data-parallel
    strategy fits without offload: the first fitting layout, in the planner's order, that this run
    passes the same checks for as a configured layout (full fine-tuning; no reference or teacher model
    under TP; context and pipeline parallelism for pretrain and sft; sdpa for the ring; the
    architecture's heads, layers and attention windows)."""
    spec = stage_spec(cfg.train.stage)
    if cfg.train.method != "full" or spec.reference != "none" or spec.teacher:
        return None
    from lmforge.distributed.planner import plan_layouts_for
    from lmforge.models.build import architecture_config

    plan = plan_layouts_for(cfg, estimate)
    hf_config = architecture_config(cfg.model)
    for row in plan.layouts:
        if not (row.fits and row.runnable) or row.tensor == row.context == row.pipeline == row.expert == 1:
            continue
        chosen = _layout_settings(cfg, hf_config, row, world_size)
        if chosen is not None:
            mesh = " x ".join(
                [f"data {row.data}"]
                + [f"{name} {d}" for name, d in (("tensor", row.tensor), ("context", row.context),
                                                  ("pipeline", row.pipeline), ("expert", row.expert)) if d > 1]
            )  # fmt: skip
            reason = (
                f"auto: no data-parallel strategy fits without offload; {row.note} ({mesh}) does "
                f"({row.total / 2**30:.2f} of {device_bytes / 2**30:.1f} GiB per device, `lmforge estimate`)"
            )
            return chosen, reason
    return None  # no layout this run can take fits: the data-parallel choice stands


def _layout_settings(
    cfg: LmforgeConfig, hf_config: Any, row: Any, world_size: int
) -> DistributedConfig | None:
    """The distributed settings of a planner layout, or None when this run cannot take it."""
    chosen = cfg.distributed.model_copy(
        update={
            "strategy": "fsdp",
            "tensor_parallel": row.tensor,
            "context_parallel": row.context,
            "pipeline_parallel": row.pipeline,
            "expert_parallel": row.expert,
        }
    )
    try:
        _check_layout_rules(cfg, chosen)
        plan_layout(chosen, hf_config, world_size)
    except UserInputError:
        return None
    return chosen


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

        if plan.layout.on_lmforge_mesh:
            # lmforge wraps a tensor- or pipeline-parallel model on its own mesh, where
            # accelerate's activation checkpointing finds no wrap policy: the Trainer's own switch
            # (the model's gradient checkpointing) recomputes the layers instead.
            return fsdp_training_arguments(model, offload=plan.settings.offload != "none", wrap_layers=False)
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


def check_resume_world(checkpoint: Path | None, plan: Plan) -> ResumePath | None:
    """How the checkpoint to resume from loads under this run's engine and world size
    (distributed/reshard.py): as written, resharded by torch DCP, loaded whole into one process or
    DDP, or through DeepSpeed's universal checkpoint (then this run's DeepSpeed config loads
    universal checkpoints). UserInputError where no engine can load it (an engine change)."""
    if checkpoint is None:
        return None
    path = resume_path(checkpoint, read_writer(checkpoint), plan.summary())
    if path.kind == "deepspeed_universal" and plan.deepspeed is not None:
        load_universal(plan.deepspeed)
    if path.resharded and plan.world.is_main:
        log.info("%s", path.describe())
    return path
