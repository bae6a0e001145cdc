"""Tensor parallelism, alone or with FSDP2 on a 2-D (data_shard x tensor) mesh, through the HF Trainer.

The engines are transformers' tensor-parallel plan (`tp_plan`: which linear layers split by
output columns, which by input rows, on torch DTensor) and torch FSDP2 (`fully_shard`) over the
data dimension of one torch device mesh. No parallel maths lives here: this module builds the
mesh, hands each engine its dimension, and tells accelerate where the data dimension is.

Why not accelerate's own path (`TrainingArguments(parallelism_config=ParallelismConfig(...))`),
measured with accelerate 1.15 and transformers 5.23:
- on CPU, `Accelerator()` refuses any ParallelismConfig under MULTI_CPU, the same fallback that
  distributed/fsdp.py switches to FSDP after the fact;
- under FSDP2, `Accelerator._prepare_tp` imports `ReplicateParallel` from
  `transformers.integrations.tensor_parallel`, which transformers 5.23 removed: every FSDP2 x TP
  `prepare()` raises ImportError, whatever the device (tests/test_tensor_parallel.py watches for
  a fix);
- transformers' own `from_pretrained(distributed_config=DistributedConfig(tp_size=...))` marks
  the model "sharded at load time", and the Trainer then refuses to checkpoint its optimizer.

So: `shard_tensor_parallel` (the `TensorParallel` dimension's `apply`, run by
distributed/parallel.py:parallelize) applies the model's tp_plan on the mesh's `tp` dimension right
after the model is built (every rank builds the same weights from the same seed or files, and each
keeps its slice); the mesh travels in the `ParallelState`. Once the Trainer has its Accelerator,
`shard_data_over_mesh` (called by the data-shard dimension, distributed/fsdp.py) wraps the decoder layers and the root with FSDP2 over `dp_shard`, with the FSDP
plugin's own mixed precision, offload and resharding, and gives accelerate the mesh, from which
its data loader shards batches over the data dimension only: the ranks of one tensor group read
the same batch. From there the Trainer takes its FSDP2 path unchanged: DTensor-aware gradient
clipping, torch-DCP checkpoints that resume, a full model gathered at the end. Tensor parallelism
alone is the same mesh with data_shard = 1 (FSDP2 over one rank shards nothing; it carries the
checkpointing and the data-loader mesh).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lmforge.distributed.layout import Layout, divisors, expert_count
from lmforge.distributed.parallel_state import DimensionHooks, ParallelState
from lmforge.distributed.plan_terms import MemorySplit

if TYPE_CHECKING:
    # Annotations only (the imports a run needs are in its functions): `plan_layout` and the
    # planner read this dimension's checks before the training stack loads.
    import torch
    from torch import nn
    from transformers import PreTrainedModel

    from lmforge.config.schema import DistributedConfig
    from lmforge.distributed.estimate import ModelShape
    from lmforge.distributed.plan_terms import Workload

log = logging.getLogger(__name__)

__all__ = [
    "TENSOR",
    "TensorParallel",
    "build_mesh",
    "gather_once_per_batch_group",
    "local_shapes",
    "shard_data_over_mesh",
    "shard_tensor_parallel",
    "tensor_parallel_plan",
]

DATA_DIM, CONTEXT_DIM, TENSOR_DIM = "dp_shard", "cp", "tp"
# FSDP2's dimension under context parallelism: the data and context ranks flattened (torchtitan's
# name), since the context ranks of one sequence hold different tokens and sum their gradients.
SHARD_DIM = "dp_shard_cp"


def build_mesh(layout: Layout, *, on_gpu: bool) -> Any:
    """The (dp_shard[, cp], tp) device mesh, tensor innermost: a tensor group is neighbouring ranks,
    then a context group (its ring passes key/value blocks every layer).

    The dimension names are accelerate's: its data loader reads `dp_shard`, `cp` and `tp` off the
    mesh to give the ranks of a tensor or context group the same batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from lmforge.distributed.ranks import ensure_process_group

    ensure_process_group()
    dims = {DATA_DIM: layout.data, CONTEXT_DIM: layout.context, TENSOR_DIM: layout.tensor}
    if layout.context == 1:
        del dims[CONTEXT_DIM]
    return init_device_mesh("cuda" if on_gpu else "cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))


def _data_shard_mesh(mesh: Any) -> Any:
    """The mesh FSDP2 shards the weights over: the data dimension, with the context ranks flattened
    into it (once: torch wants the flattened mesh kept, not sliced from the root again)."""
    if CONTEXT_DIM not in (mesh.mesh_dim_names or ()):
        return mesh[DATA_DIM]
    return mesh[DATA_DIM, CONTEXT_DIM]._flatten(SHARD_DIM)


def _batch_replicas(mesh: Any) -> int:
    """Ranks of the mesh that read one batch (a tensor x context group): the data loader gives them
    the same rows, and tokens and eval rows count once per group."""
    names = mesh.mesh_dim_names or ()
    return mesh[TENSOR_DIM].size() * (mesh[CONTEXT_DIM].size() if CONTEXT_DIM in names else 1)


def tensor_parallel_plan(model: PreTrainedModel, degree: int) -> dict[str, str]:
    """The model's tp_plan resolved by transformers for `degree` ranks: one entry per parameter
    (how it is split) and per module (the forward hooks that move activations between ranks).

    A tied output head is the input embedding under a second name; `named_parameters()` lists it
    once, so its own entry is dropped here and the head is tied back to the sharded embedding
    (both split the vocabulary on dim 0, so one DTensor serves both)."""
    from transformers.distributed import DistributedConfig

    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=degree))
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_modules()}
    return {name: style for name, style in plan.items() if name in names}


def shard_tensor_parallel(model: PreTrainedModel, layout: Layout, *, on_gpu: bool) -> Any:
    """Split the model's attention heads and MLP columns over the mesh's tensor dimension, in place;
    the (dp_shard[, cp], tp) mesh it built, or None.

    A no-op unless `layout.tensor > 1`. Each rank must hold the same full weights beforehand
    (same seed or same files): every parameter keeps this rank's slice, no data moves."""
    import torch

    if layout.tensor == 1:
        return None
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    mesh = build_mesh(layout, on_gpu=on_gpu)
    if on_gpu:  # each slice stays on the device its weights are on: this rank's GPU
        model.to(torch.device("cuda", torch.cuda.current_device()))  # type: ignore[arg-type]  # transformers' .to stub
    apply_tensor_parallelism(model, mesh[TENSOR_DIM], tensor_parallel_plan(model, layout.tensor))
    model.tie_weights()  # the head pointed at the embedding that sharding replaced
    log.info("tensor parallel: %s split over %d ranks per tensor group", type(model).__name__, layout.tensor)
    return mesh


class TensorParallel(DimensionHooks):
    """Tensor parallelism as a parallel dimension: it cuts the model and builds the shared mesh; the
    data-shard dimension then wraps FSDP2 over that mesh's data dimension, and HF Trainer's
    FSDP2 path does the rest."""

    name = "tensor"

    def problems(self, settings: DistributedConfig, model_config: Any, world_size: int) -> list[str]:
        tp = settings.tensor_parallel
        if tp == 1:
            return []
        model_type = getattr(model_config, "model_type", "?")
        if not getattr(model_config, "base_model_tp_plan", None):
            return [
                f"tensor_parallel: {tp}: transformers has no tensor-parallel plan (tp_plan) for {model_type!r}; "
                "use an architecture that has one (llama, qwen2, mistral, gemma, phi3, mixtral, qwen2_moe, ...) or "
                "distributed.strategy: fsdp alone"
            ]
        problems = []
        heads = getattr(model_config, "num_attention_heads", None)
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        counts = {
            key: n
            for key, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
            if isinstance(n, int)
        }
        broken = [f"{key} ({n})" for key, n in counts.items() if n % tp]
        if broken:
            whole_heads = [
                d for d in range(1, min(counts.values()) + 1) if all(n % d == 0 for n in counts.values())
            ]
            problems.append(
                f"tensor_parallel: {tp} does not divide the model's {' and '.join(broken)}: each rank must hold "
                f"whole heads; choose tensor_parallel from {whole_heads}"
            )
        experts = expert_count(model_config)
        inner = getattr(model_config, "moe_intermediate_size", None) or getattr(
            model_config, "intermediate_size", None
        )
        if isinstance(inner, int) and inner % tp:
            problems.append(
                f"tensor_parallel: {tp} does not divide the MLP width ({inner}, "
                f"{'moe_intermediate_size' if experts else 'intermediate_size'}); choose a degree that divides it"
            )
        return problems

    def planner_degrees(
        self, shape: ModelShape, *, world: int, gpus_per_node: int, seq_len: int
    ) -> list[int]:
        # within one node (two all-reduces a layer want the fastest links), whole heads per rank
        if not shape.has_tp_plan:
            return [1]
        heads, kv = shape.num_heads, shape.num_kv_heads or shape.num_heads
        return [t for t in divisors(gpus_per_node) if heads % t == 0 and kv % t == 0]

    def planner_split(self, degree: int, work: Workload) -> MemorySplit:
        return MemorySplit(within_layer=degree)

    def used_by(self, layout: Layout) -> bool:
        return layout.tensor > 1

    def apply(self, model: nn.Module, state: ParallelState) -> None:
        assert state.layout is not None
        hf_model: Any = model
        state.mesh = shard_tensor_parallel(hf_model, state.layout, on_gpu=state.on_gpu)


TENSOR = TensorParallel()


def shard_data_over_mesh(trainer: Any, mesh: Any, layer_classes: list[str]) -> bool:
    """FSDP2 over the data dimension of a tensor-parallel model's `mesh` (None: no-op); True if it applied.

    Called once the Trainer's Accelerator exists (its FSDP plugin holds the mixed precision,
    offload and resharding settings, as accelerate would pass them to `fully_shard`). Decoder
    layers (`layer_classes`) are the FSDP units, then the root (embeddings, final norm and head,
    tied or not, in one group). Under context parallelism the data dimension is `dp_shard_cp`, the
    data and context ranks together. The Accelerator gets the mesh for its data loader; the model its
    tensor degree, by which the Trainer divides its token count and loss scale
    (`Trainer.get_tp_size`: the ranks of a tensor group share one batch; `get_cp_size` does the same
    for a context group, distributed/context_parallel.py); and the Accelerator an eval gather that
    counts each batch once (`gather_once_per_batch_group`)."""
    model, accelerator = trainer.model, trainer.accelerator
    if mesh is None:
        return False
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    shards = _data_shard_mesh(mesh)
    settings: dict[str, Any] = {
        "mesh": shards,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "offload_policy": plugin.cpu_offload or OffloadPolicy(),
        "shard_placement_fn": no_empty_shards(shards.size()),
    }
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, reshard_after_forward=plugin.reshard_after_forward, **settings)
    fully_shard(model, **settings)  # the root: FSDP2 keeps its parameters gathered after forward
    accelerator.state.device_mesh = mesh
    model._tp_size = mesh[TENSOR_DIM].size()
    # On the Accelerator too: evaluation resets the Trainer's `gather_function` to
    # `accelerator.gather_for_metrics` after every loop.
    gather = gather_once_per_batch_group(accelerator, _batch_replicas(mesh))
    accelerator.gather_for_metrics = trainer.gather_function = gather
    return True


def no_empty_shards(ranks: int) -> Any:
    """FSDP2's placement for a parameter whose first dimension is smaller than the data ranks (a
    Qwen2-MoE shared-expert gate, [1, hidden]): split along its longest dimension instead, so no
    rank holds an empty shard. accelerate's `prepare()` matches the optimizer's parameters to the
    model's by the local shard's data_ptr, and two empty shards share one: the optimizer then held
    one such parameter twice and another not at all (its Adam step counted 2 per step; measured: a
    resumed run's step-4 loss 5.7e-6 off the uninterrupted one). None keeps FSDP2's dim-0 split."""
    from torch.distributed.tensor import Shard

    def place(param: nn.Parameter) -> Any:
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.ndim < 2 or local.shape[0] >= ranks:
            return None
        longest = max(range(local.ndim), key=lambda dim: local.shape[dim])
        return Shard(longest) if local.shape[longest] >= ranks else None

    return place


def gather_once_per_batch_group(accelerator: Any, replicas: int) -> Any:
    """`Accelerator.gather_for_metrics` for a mesh whose tensor (x context) groups read one batch.

    accelerate gathers from every rank, then cuts the last batch to the dataset's remainder as if
    each rank had read its own samples; under tensor parallelism every batch would be counted
    `replicas` times and the cut would keep copies instead of samples (eval_loss measured 1e-3 off
    the single process). So gather, keep the rows of the first rank of each group (rank order is
    data-major, then context, tensor innermost), then cut as accelerate does."""
    from accelerate.utils import recursively_apply

    def first_of_each_group(gathered: torch.Tensor) -> torch.Tensor:
        world = accelerator.num_processes
        rows = gathered.reshape(world, -1, *gathered.shape[1:])[::replicas]
        return rows.reshape(-1, *gathered.shape[1:])

    def gather(input_data: Any, use_gather_object: bool = False) -> Any:
        if use_gather_object:
            raise NotImplementedError(
                "eval gathers Python objects: not supported under tensor or context parallelism"
            )
        kept = recursively_apply(first_of_each_group, accelerator.gather(input_data))
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return recursively_apply(lambda t: t[: state.remainder], kept)
        return kept

    return gather


def local_shapes(model: nn.Module) -> dict[str, tuple[list[int], list[int]]]:
    """Parameter name -> (full shape, shape of this rank's slice): what the rank really stores."""
    from torch.distributed.tensor import DTensor

    shapes = {}
    for name, param in model.named_parameters():
        data: torch.Tensor = param.to_local() if isinstance(param, DTensor) else param
        shapes[name] = (list(param.shape), list(data.shape))
    return shapes
