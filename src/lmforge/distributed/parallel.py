"""The parallel dimensions lmforge runs, in the order they apply, and `parallelize`, which applies them.

Each dimension is one module in distributed/ implementing `parallel_state.ParallelDimension`;
adding one is that module plus a line in `DIMENSIONS` (and a Layout field for its degree). Its
checks reach `plan_layout` and its planner terms reach distributed/planner.py through `DIMENSIONS`.
The order matters: tensor parallelism builds the mesh the context and expert dimensions share,
the pipeline cuts the stages last, and the data-shard dimension (FSDP2 over the data ranks of
whatever mesh the others built) wraps the model once the Trainer has its Accelerator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmforge.config.schema import DistributedConfig, LmforgeConfig
from lmforge.distributed.context_parallel import CONTEXT
from lmforge.distributed.expert_parallel import EXPERT
from lmforge.distributed.fsdp import DATA_SHARD
from lmforge.distributed.layout import Layout, world_problems
from lmforge.distributed.parallel_state import ParallelDimension, ParallelState
from lmforge.distributed.pipeline_parallel import PIPELINE
from lmforge.distributed.tensor_parallel import TENSOR
from lmforge.errors import UserInputError

if TYPE_CHECKING:
    # Annotations only: this registry and every dimension module import without torch, so a
    # config's layout is checked (`plan_layout`, `lmforge launch`) before the training stack loads.
    from torch import nn

__all__ = ["DIMENSIONS", "launch_mesh_note", "no_parallelism", "parallelize", "plan_layout"]

# Application order (module docstring); the Trainer adapter asks their hooks in this order too.
DIMENSIONS: tuple[ParallelDimension, ...] = (TENSOR, CONTEXT, EXPERT, PIPELINE, DATA_SHARD)


def plan_layout(settings: DistributedConfig, hf_config: Any, world_size: int) -> Layout:
    """The mesh of this run, or a UserInputError listing every reason it cannot run: the world's
    problems, then each dimension's in registry order.

    What the config alone decides (the engine, which degrees pair, pipeline micro-batches) is
    config/layout_rules.py's, checked when the config loads; this checks the layout against the
    architecture and the world."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    problems = world_problems(settings, world_size)
    for dimension in DIMENSIONS:
        problems.extend(dimension.problems(settings, text_config, world_size))
    if problems:
        raise UserInputError("distributed: this layout cannot run:\n  - " + "\n  - ".join(problems))
    data = world_size // settings.model_parallel_degree
    return Layout(
        world_size=world_size,
        data=data,
        data_sharded=settings.strategy == "fsdp",
        tensor=settings.tensor_parallel,
        context=settings.context_parallel,
        pipeline=settings.pipeline_parallel,
        expert=settings.expert_parallel,
        sequence_parallel=settings.sequence_parallel and settings.tensor_parallel > 1,
    )


def launch_mesh_note(cfg: LmforgeConfig, world_size: int) -> str | None:
    """`lmforge launch`'s line on the mesh (None for data parallelism alone), after the same checks the
    workers make, so an impossible layout stops before any process starts."""
    settings = cfg.distributed
    if settings.model_parallel_degree * settings.expert_parallel == 1:
        return None
    from lmforge.models.build import architecture_config

    hf_config = architecture_config(cfg.model)
    layout = plan_layout(settings, hf_config, world_size)
    return f"device mesh: {layout.describe()} ({world_size} processes)"


def parallelize(
    model: nn.Module,
    layout: Layout,
    *,
    on_gpu: bool,
    pipeline_schedule: str = "1f1b",
    pipeline_microbatches: int | None = None,
) -> ParallelState:
    """Cut `model` for this rank by every dimension `layout` uses, in registry order, right after
    the model is built and before anything reads its parameters; what they built, for the Trainer.

    Every rank must have built the same full model beforehand (same seed or same files)."""
    state = ParallelState(
        layout=layout,
        on_gpu=on_gpu,
        pipeline_schedule=pipeline_schedule,
        pipeline_microbatches=pipeline_microbatches or layout.pipeline,
        dimensions=tuple(dimension for dimension in DIMENSIONS if dimension.used_by(layout)),
    )
    for dimension in state.dimensions:
        dimension.apply(model, state)
    return state


def no_parallelism() -> ParallelState:
    """The state of a model no dimension cut (one process, DDP, plain FSDP2 or DeepSpeed): only the
    data-shard dimension, whose hooks follow the engine the Trainer runs."""
    return ParallelState(dimensions=(DATA_SHARD,))
