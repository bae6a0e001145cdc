"""`distributed.{tensor,context,pipeline,expert}_parallel` -> one device mesh, checked against the
model and the world before anything is built.

The mesh follows accelerate's order: (data, context, tensor), tensor innermost so a tensor-parallel
group sits on neighbouring ranks (one node, the fastest links). Pipeline stages compose with data
sharding only, and also sit inside the data dimension (data, pipeline): accelerate's data loader
gives one batch to neighbouring ranks, which is what the stages of one pipeline need (torchtitan
puts stages outermost, across nodes; lmforge would have to shard the data itself for that).
The data degree is what is left: world size / (tensor x context x pipeline). Expert parallelism
borrows ranks from the data x context dimensions (experts are split over ranks that hold different
tokens), so it adds no dimension of its own.

Every refusal names the key, why the engine cannot do it, and the fix. This module holds what the
world size decides; each dimension checks itself against the architecture (its `problems` hook,
distributed/<dimension>.py), and distributed/parallel.py's `plan_layout` asks them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmforge.config.schema import DistributedConfig

__all__ = ["Layout", "divisors", "expert_count", "world_problems"]


@dataclass(frozen=True)
class Layout:
    """The degrees of one run's device mesh; their product is the world size."""

    world_size: int
    data: int  # data-parallel degree: sharded (FSDP2) or replicated (DDP)
    data_sharded: bool = False
    tensor: int = 1
    context: int = 1
    pipeline: int = 1
    expert: int = 1
    sequence_parallel: bool = False

    @property
    def on_lmforge_mesh(self) -> bool:
        """Tensor, context, pipeline or expert parallelism: lmforge builds the mesh and wraps the model
        on it (distributed/tensor_parallel.py, context_parallel.py, pipeline_parallel.py,
        expert_parallel.py), not accelerate."""
        return self.tensor > 1 or self.context > 1 or self.pipeline > 1 or self.expert > 1

    def mesh_dims(self) -> dict[str, int]:
        """Mesh dimension name -> size, outermost first, dimensions of size 1 left out (the data
        dimension is always there: the data loader shards over it)."""
        data_name = "dp_shard" if self.data_sharded else "dp_replicate"
        dims = {data_name: self.data, "pp": self.pipeline, "cp": self.context, "tp": self.tensor}
        return {name: size for name, size in dims.items() if size > 1 or name == data_name}

    def describe(self) -> str:
        """'data_shard=2 x tensor=2' style, for the start banner and `launch --dry-run`."""
        words = {
            "pp": "pipeline",
            "dp_shard": "data_shard",
            "dp_replicate": "data",
            "cp": "context",
            "tp": "tensor",
        }
        text = " x ".join(f"{words[name]}={size}" for name, size in self.mesh_dims().items())
        if self.expert > 1:
            text += f", expert={self.expert} (over data x context)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "data": self.data,
            "data_sharded": self.data_sharded,
            "tensor": self.tensor,
            "context": self.context,
            "pipeline": self.pipeline,
            "expert": self.expert,
        }


def divisors(n: int) -> list[int]:
    """Every degree that splits `n` evenly, smallest first (the planner's candidates)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_count(hf_config: Any) -> int | None:
    """Experts per MoE layer, or None for a dense model (families name it differently)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def world_problems(settings: DistributedConfig, world_size: int) -> list[str]:
    """What the world size decides for every dimension together: the degrees' product divides it, and
    only FSDP2's mesh runs model parallelism."""
    degree = settings.model_parallel_degree
    problems = []
    if degree > 1 and world_size % degree:
        problems.append(
            f"tensor_parallel x context_parallel x pipeline_parallel = {degree} does not divide the world size "
            f"{world_size}; launch a multiple of {degree} processes (`lmforge launch CONFIG --nproc-per-node "
            f"{degree}`), or lower the degrees"
        )
    if degree * settings.expert_parallel > 1 and (
        settings.strategy == "deepspeed" or settings.deepspeed_config is not None
    ):
        problems.append(
            "DeepSpeed ZeRO runs data parallelism only here; tensor, context, pipeline and expert parallelism run "
            "on FSDP2's device mesh (config/layout_rules.py): set distributed.strategy: fsdp (with the degrees' "
            "product equal to the number of processes it shards nothing) and remove distributed.deepspeed_config"
        )
    return problems
