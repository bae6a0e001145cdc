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
from lmforge.distributed.layout import Layout, plan_layout
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
    precision: str = "fp32"  # train.precision resolved for this device, once: fp32 | bf16 | fp16

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
        return f"{kind} ({len(layout.mesh_dims())}-D mesh {layout.describe()}{offload})"

    def describe(self) -> str:
        return f"{self.describe_engine()} on {self.world.size} process(es): {self.reason}"


def plan_for(cfg: LmforgeConfig, *, precision: str, on_gpu: bool, world: World | None = None) -> Plan:
    """Decide the engine of this run; bad combinations fail here, before any model is built."""
    world = world or current_world()
    cfg, launcher_reason = _with_launcher_choice(cfg, world, precision)
    settings, reason = _chosen_settings(cfg, world, on_gpu=on_gpu)
    reason = launcher_reason or reason
    engine: Engine = "deepspeed" if settings.deepspeed_config is not None else settings.strategy  # type: ignore[assignment]
    layout = _layout(cfg, settings, world)
    if layout.tensor > 1:
        _check_tensor_parallel(cfg, settings, engine)
    if layout.context > 1:
        _check_context_parallel(cfg, settings, engine)
    if layout.pipeline > 1:
        _check_pipeline_parallel(cfg, settings, engine)
    if layout.expert > 1:
        _check_expert_parallel(cfg, settings, engine)
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


def _check_tensor_parallel(cfg: LmforgeConfig, settings: DistributedConfig, engine: str) -> None:
    """What the tensor-parallel engine (distributed/tensor_parallel.py) cannot run, all reasons at once.
    Adapters are refused with strategy fsdp by config/cross_checks.py (measured under TP: PEFT's
    full-width adapter output meets the rank's slice of the base layer, a shape error)."""
    degree = settings.tensor_parallel
    problems = []
    if engine != "fsdp":
        problems.append(
            f"distributed.strategy: {settings.strategy} with tensor_parallel: {degree}: tensor parallelism runs on "
            "FSDP2's (data_shard x tensor) device mesh; set distributed.strategy: fsdp (with tensor_parallel equal "
            "to the number of processes FSDP2 shards nothing and the run is tensor parallel alone)"
        )
    if cfg.train.stage in ("dpo", "kto"):
        problems.append(
            f"train.stage: {cfg.train.stage} with tensor_parallel: {degree}: TRL prepares the reference model with "
            "accelerate's FSDP2 path, which needs a ParallelismConfig accelerate cannot take for this mesh "
            "(measured: AttributeError 'fsdp_dim_names' in trl prepare_fsdp); set distributed.tensor_parallel: 1 "
            "(strategy fsdp alone shards this stage)"
        )
    if cfg.train.stage in ("grpo", "rloo") and cfg.train.rl.beta > 0:
        problems.append(
            f"train.rl.beta: {cfg.train.rl.beta} with tensor_parallel: {degree}: rank 0 writes the reference model "
            "from the sharded one alone, and gathering its slices is a collective the other ranks never join "
            "(measured: a hang); set train.rl.beta: 0 or distributed.tensor_parallel: 1"
        )
    if problems:
        raise UserInputError("distributed.tensor_parallel cannot run this:\n  - " + "\n  - ".join(problems))


def _check_context_parallel(cfg: LmforgeConfig, settings: DistributedConfig, engine: str) -> None:
    """What context parallelism (distributed/context_parallel.py) cannot run, all reasons at once.
    Adapters are refused with strategy fsdp by config/cross_checks.py; sliding-window layers by
    distributed/layout.py, which reads the architecture."""
    degree, train, data = settings.context_parallel, cfg.train, cfg.data
    key = f"context_parallel: {degree}"
    problems = []
    if engine != "fsdp":
        problems.append(
            f"distributed.strategy: {settings.strategy} with {key}: the context ranks of a sequence hold different "
            "tokens and their gradients are summed by FSDP2 over the (data x context) mesh; set "
            "distributed.strategy: fsdp (with context_parallel equal to the number of processes FSDP2 shards "
            "the weights over the context ranks alone)"
        )
    if train.stage not in ("pretrain", "sft"):
        problems.append(
            f"train.stage: {train.stage} with {key}: the split sequences carry a token-level language-model loss "
            "(pretrain, sft); a preference or RL loss sums each sequence's log-probabilities, which no rank holds "
            "whole; set distributed.context_parallel: 1"
        )
    if cfg.model.attn_implementation != "sdpa":
        problems.append(
            f"model.attn_implementation: {cfg.model.attn_implementation} with {key}: ring attention replaces "
            "torch's scaled_dot_product_attention; set model.attn_implementation: sdpa"
        )
    for setting, on in (("data.packing: true", data.packing), ("data.padding_free: true", data.padding_free)):
        if on:
            problems.append(
                f"{setting} with {key}: ring attention runs one causal mask over the whole row, so packed samples "
                "would attend to each other; turn it off (each sample its own row) or set context_parallel: 1"
            )
    if train.kernels == "liger":
        problems.append(
            f"train.kernels: liger with {key}: not measured with torch's ring attention, which swaps the "
            "attention function while each step runs; remove train.kernels, or set context_parallel: 1"
        )
    if problems:
        raise UserInputError("distributed.context_parallel cannot run this:\n  - " + "\n  - ".join(problems))


def _check_expert_parallel(cfg: LmforgeConfig, settings: DistributedConfig, engine: str) -> None:
    """What expert parallelism (distributed/expert_parallel.py) cannot run, all reasons at once.
    Adapters are refused with strategy fsdp by config/cross_checks.py."""
    degree, stage = settings.expert_parallel, cfg.train.stage
    problems = []
    if engine != "fsdp":
        problems.append(
            f"distributed.strategy: {settings.strategy} with expert_parallel: {degree}: the ranks hold different "
            "experts, so DDP's all-reduce would average unrelated gradients; set distributed.strategy: fsdp "
            "(FSDP2 shards the dense layers over the data ranks, the experts are split between them)"
        )
    if stage in ("dpo", "kto") or (stage in ("grpo", "rloo") and cfg.train.rl.beta > 0):
        problems.append(
            f"train.stage: {stage} with expert_parallel: {degree}: the reference model would run its own "
            "forward on some ranks only, and every expert-parallel forward is a collective over the expert "
            "group (a hang); set distributed.expert_parallel: 1"
            + (" or train.rl.beta: 0" if stage in ("grpo", "rloo") else "")
        )
    if problems:
        raise UserInputError("distributed.expert_parallel cannot run this:\n  - " + "\n  - ".join(problems))


def _check_pipeline_parallel(cfg: LmforgeConfig, settings: DistributedConfig, engine: str) -> None:
    """What the pipeline engine (distributed/pipeline_parallel.py) cannot run, all reasons at once.
    Adapters are refused with strategy fsdp by config/cross_checks.py."""
    stages, train = settings.pipeline_parallel, cfg.train
    chunks = settings.pipeline_microbatches or stages
    problems = []
    if engine != "fsdp":
        problems.append(
            f"distributed.strategy: {settings.strategy} with pipeline_parallel: {stages}: pipeline stages run on "
            "FSDP2's (pipeline x data_shard) device mesh; set distributed.strategy: fsdp (with pipeline_parallel "
            "equal to the number of processes FSDP2 shards nothing and the run is pipeline parallel alone)"
        )
    if train.stage not in ("pretrain", "sft"):
        problems.append(
            f"train.stage: {train.stage} with pipeline_parallel: {stages}: the pipeline step computes the "
            "causal language-model loss only (pretrain, sft); set distributed.pipeline_parallel: 1"
        )
    unsupported = {
        "train.precision: fp16": train.precision == "fp16",  # the loss scaler steps outside the schedule
        "train.compile: true": train.compile,
        "train.kernels: liger": train.kernels == "liger",
        "train.chunked_cross_entropy: true": train.chunked_cross_entropy,
        "train.activation_offload: true": train.activation_offload,
    }
    for setting, on in unsupported.items():
        if on:
            problems.append(
                f"{setting} with pipeline_parallel: {stages}: the pipeline schedule runs each stage's plain forward "
                "and the last stage's own cross-entropy; turn it off, or set distributed.pipeline_parallel: 1"
            )
    if train.micro_batch_size < chunks:
        problems.append(
            f"train.micro_batch_size {train.micro_batch_size} is smaller than the {chunks} pipeline micro-batches "
            "it is cut into; raise train.micro_batch_size or lower distributed.pipeline_microbatches"
        )
    if settings.pipeline_schedule == "1f1b" and chunks < stages:
        problems.append(
            f"distributed.pipeline_microbatches {chunks} < {stages} stages: 1f1b needs one micro-batch per stage; "
            f"raise it to {stages} or use pipeline_schedule: gpipe"
        )
    if settings.pipeline_schedule == "interleaved_1f1b" and chunks % stages:
        problems.append(
            f"distributed.pipeline_microbatches {chunks}: interleaved_1f1b runs rounds of one micro-batch per "
            f"rank, so it must be a multiple of pipeline_parallel ({stages})"
        )
    if problems:
        raise UserInputError("distributed.pipeline_parallel cannot run this:\n  - " + "\n  - ".join(problems))


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
    passes the same checks for as a configured layout (full fine-tuning; no reference model under TP;
    context and pipeline parallelism for pretrain and sft; sdpa for the ring; the architecture's heads,
    layers and attention windows)."""
    if cfg.train.method != "full" or cfg.train.stage in ("dpo", "kto", "grpo", "rloo"):
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
    checks = ((row.tensor, _check_tensor_parallel), (row.context, _check_context_parallel),
              (row.pipeline, _check_pipeline_parallel), (row.expert, _check_expert_parallel))  # fmt: skip
    try:
        for degree, check in checks:
            if degree > 1:
                check(cfg, chosen, "fsdp")
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
