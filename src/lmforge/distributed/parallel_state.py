"""What a parallel dimension is to lmforge: the `ParallelDimension` interface and the
`ParallelState` that `parallel.parallelize` builds and the Trainer adapter (train/hf_trainer.py)
carries.

A dimension (data-shard, tensor, context, expert, pipeline: distributed/<dimension>.py) does three
things. When a config is checked or planned, before the training stack loads (so every dimension
module imports without torch), it says what keeps a layout from running (`problems`, asked by
`parallel.plan_layout`) and what the planner should count for it (`planner_*`, asked by
distributed/planner.py: candidate degrees, a refusal, how it divides a device's memory). At
build time it cuts the model (`apply`) and records what it built (meshes, the pipeline) in the
state. During training the adapter calls its hooks where HF Trainer has a hook
of its own; a dimension answers only where it changes what the Trainer does, and every default
here says "not mine" (None / False / the value unchanged). So the adapter overrides each HF hook
once and asks the dimensions in effect, in their registry order, instead of each dimension
overriding HF hooks as a mixin.

This module holds no dimension (they import it); the registry and `parallelize` are in
distributed/parallel.py, above them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lmforge.distributed.layout import Layout
from lmforge.distributed.plan_terms import MemorySplit

if TYPE_CHECKING:
    # Annotations only: `plan_layout` asks the dimensions for their checks when a config is
    # checked, before the training stack (torch, transformers) loads.
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import Trainer

    from lmforge.config.schema import DistributedConfig
    from lmforge.distributed.estimate import ModelShape
    from lmforge.distributed.plan_terms import Workload

__all__ = ["DimensionHooks", "ExpertShards", "ParallelDimension", "ParallelState"]


@dataclass
class ExpertShards:
    """Expert parallelism's own view of the ranks: the (efsdp, ep) mesh and the names of the
    experts modules it dispatches tokens to (FSDP2 wraps each over its copies)."""

    mesh: DeviceMesh
    modules: list[str]


@dataclass
class ParallelState:
    """How this rank's model is split, built once by `parallelize` and read by the Trainer adapter.

    `mesh` is the dense device mesh ((dp_shard[, cp], tp), or (dp_shard, stage) for a pipeline)
    whose data dimension FSDP2 shards over; None for a model no dimension cut (plain FSDP2 / DDP /
    DeepSpeed take the Trainer's own path)."""

    layout: Layout | None = None
    on_gpu: bool = False
    pipeline_schedule: str = "1f1b"  # distributed.pipeline_schedule
    pipeline_microbatches: int = 1
    mesh: DeviceMesh | None = None
    # distributed/pipeline_parallel.py:Pipeline (typed loosely: that module imports this one)
    pipeline: Any = None
    experts: ExpertShards | None = None
    dimensions: tuple[ParallelDimension, ...] = field(default_factory=tuple)  # in effect, registry order


class ParallelDimension(Protocol):
    """One way of splitting the work over ranks. Hooks are listed in the order a run reaches them:
    the config-time ones (`problems`, the planner's) first, then those of a run."""

    name: str  # the Layout field of its degree, where it has one (data_shard: `data`)

    def problems(self, settings: DistributedConfig, model_config: Any, world_size: int) -> list[str]:
        """Why `settings` cannot run this dimension on this architecture and world (key, reason, fix)."""
        ...

    def planner_degrees(
        self, shape: ModelShape, *, world: int, gpus_per_node: int, seq_len: int
    ) -> list[int]:
        """The degrees `lmforge estimate` tries for this dimension; the planner combines them where
        their product divides the world."""
        ...

    def planner_refusal(self, shape: ModelShape, degrees: Mapping[str, int]) -> str | None:
        """Why lmforge's step cannot run a planned layout (`degrees`: dimension name -> degree), or None."""
        ...

    def planner_split(self, degree: int, work: Workload) -> MemorySplit:
        """How this dimension at `degree` divides one device's memory and time (planner terms)."""
        ...

    def used_by(self, layout: Layout) -> bool:
        """Whether `layout` runs this dimension (its hooks are asked only then)."""
        ...

    def apply(self, model: nn.Module, state: ParallelState) -> None:
        """Cut `model` for this rank right after it is built, recording meshes / stages in `state`."""
        ...

    def wrap(self, state: ParallelState, trainer: Trainer) -> None:
        """Once the Trainer has its Accelerator (before it prepares the model): engine settings."""
        ...

    def batch_ranks(self, state: ParallelState) -> int | None:
        """Ranks that read different tokens of one batch (HF's `get_cp_size`), or None."""
        ...

    def split_batch(
        self, state: ParallelState, inputs: dict[str, Any]
    ) -> tuple[Callable[..., Any], dict[str, Any]] | None:
        """The context to run forward and backward in, and the batch it cuts, or None."""
        ...

    def run_batch(
        self,
        state: ParallelState,
        trainer: Trainer,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items: Any,
        *,
        training: bool,
    ) -> torch.Tensor | None:
        """A micro-batch run this dimension's way (its loss, backward done when training), or None."""
        ...

    def eval_loss(
        self, state: ParallelState, loss: torch.Tensor, *, losses_only: bool
    ) -> torch.Tensor | None:
        """An evaluation batch's loss as the Trainer should gather it (logits dropped), or None."""
        ...

    def grad_norm(
        self, state: ParallelState, trainer: Trainer, model: nn.Module, max_norm: float
    ) -> torch.Tensor | None:
        """The step's gradient norm over every rank that holds a part (clipped to `max_norm`), or None."""
        ...

    def save_optimizer(self, state: ParallelState, trainer: Trainer, output_dir: str) -> bool:
        """Write a checkpoint's optimizer and schedule; False leaves it to the Trainer."""
        ...

    def model_checkpointed(self, state: ParallelState, trainer: Trainer, checkpoint: str) -> None:
        """After the Trainer wrote a checkpoint's model: what else the checkpoint needs."""
        ...

    def save_model(
        self, state: ParallelState, trainer: Trainer, output_dir: str, dtype: torch.dtype | None
    ) -> bool:
        """Write the final model in `dtype` (a collective); False leaves it to the Trainer."""
        ...


class DimensionHooks:
    """The "not mine" answer to every hook: a dimension subclasses it and overrides its own."""

    name = "dimension"

    def problems(self, settings: DistributedConfig, model_config: Any, world_size: int) -> list[str]:
        return []

    def planner_degrees(
        self, shape: ModelShape, *, world: int, gpus_per_node: int, seq_len: int
    ) -> list[int]:
        return [1]

    def planner_refusal(self, shape: ModelShape, degrees: Mapping[str, int]) -> str | None:
        return None

    def planner_split(self, degree: int, work: Workload) -> MemorySplit:
        return MemorySplit()

    def used_by(self, layout: Layout) -> bool:
        return False

    def apply(self, model: nn.Module, state: ParallelState) -> None:
        return None

    def wrap(self, state: ParallelState, trainer: Trainer) -> None:
        return None

    def batch_ranks(self, state: ParallelState) -> int | None:
        return None

    def split_batch(
        self, state: ParallelState, inputs: dict[str, Any]
    ) -> tuple[Callable[..., Any], dict[str, Any]] | None:
        return None

    def run_batch(
        self,
        state: ParallelState,
        trainer: Trainer,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items: Any,
        *,
        training: bool,
    ) -> torch.Tensor | None:
        return None

    def eval_loss(
        self, state: ParallelState, loss: torch.Tensor, *, losses_only: bool
    ) -> torch.Tensor | None:
        return None

    def grad_norm(
        self, state: ParallelState, trainer: Trainer, model: nn.Module, max_norm: float
    ) -> torch.Tensor | None:
        return None

    def save_optimizer(self, state: ParallelState, trainer: Trainer, output_dir: str) -> bool:
        return False

    def model_checkpointed(self, state: ParallelState, trainer: Trainer, checkpoint: str) -> None:
        return None

    def save_model(
        self, state: ParallelState, trainer: Trainer, output_dir: str, dtype: torch.dtype | None
    ) -> bool:
        return False
