"""Expert parallelism for Mixture-of-Experts models, with FSDP2 over the data ranks, through the HF Trainer.

The engine is transformers' own (5.23, `transformers.distributed.expert_parallel`): the model
config's `base_model_ep_plan` splits each layer's fused expert weights (`experts.gate_up_proj`,
`experts.down_proj`: style `grouped_gemm`, `Shard(0)` on the expert dimension of a torch DTensor)
and replaces the experts' forward (`experts`: style `ep_dispatch_experts`) by a token dispatch
(`AllToAllEP`: two `all_to_all_single` per MoE layer, one sending each (token, expert) pair to the
rank that owns the expert, one bringing the results back, differentiable both ways). No parallel
maths lives here: this module builds the meshes, asks transformers for the plan and hands the
engines their dimensions, as distributed/tensor_parallel.py does for tensor parallelism.

Why this layout (transformers' `DistributedConfig(fsdp_size=data, ep_size=expert)`, not the
expert plan on the tensor dimension): `distributed.expert_parallel` borrows ranks that hold
*different* batches (layout.py). Each rank then runs attention and the dense parts of every
layer on its own batch only, and holds num_experts / expert whole experts; the all-to-all brings
every rank's tokens to the experts they picked. Putting the experts on a tensor-parallel group
(ranks sharing one batch) would run the dense layers once per rank for the same tokens.

Two meshes over the same ranks, as transformers builds them (`TransformersDeviceMesh`):
- dense  (dp_shard, tp): tensor_parallel.build_mesh. FSDP2 shards attention, norms, routers,
  shared experts and embeddings over dp_shard (tensor_parallel.shard_data_over_mesh), and
  accelerate's data loader gives each dp_shard rank its own batch;
- expert (efsdp, ep), ep = expert x tensor (transformers counts the ranks of a tensor group in
  the expert group), efsdp = data / expert: the copies of one expert, which FSDP2 shards between
  them. `shard_experts_over_data` wraps each experts module over efsdp *before* its decoder layer
  is wrapped over dp_shard, so the layer's FSDP2 unit leaves the expert weights alone. Both meshes
  travel in the `ParallelState` (`mesh`, `experts`) that distributed/parallel.py:parallelize returns.

Gradient scale: each expert's gradient sums the contributions of the `expert` batches of its
group (the all-to-all's backward brings them all), and FSDP2 reduces it over the `efsdp` copies:
`data` batches in all, so the experts divide by `data` (transformers'
`set_gradient_divide_factor(dp_size)`), as the dense parameters' FSDP2 average over dp_shard does.
Gloo has no PREMUL_SUM, so with efsdp > 1 the reduction is a plain sum divided afterwards.

Measured on CPU/gloo, torch 2.13, transformers 5.23, accelerate 1.15, tiny MoEs in fp32
(tests/test_expert_parallel_engine.py; its docstring has the tolerances):
- 2 processes, expert = data = 2, Qwen2-MoE with 4 experts: rank r stores experts [2r, 2r+1]
  ([2, 64, 64] of [4, 64, 64]); first-step gradients within 3.5e-7 of each parameter's largest
  single-process gradient; the loss within 9.5e-7 of ~4.5 over 3 AdamW steps and over 3 HF
  Trainer steps (clipping on); eval, DCP checkpoint and resume, and the gathered final model run;
- the same first step for Qwen3-MoE and Mixtral; 4 processes, data 4 x expert 2 (efsdp = 2, each
  rank one expert of 4): loss within 4.8e-7 and gradients within 1.8e-6 over 3 AdamW steps.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lmforge.distributed.layout import Layout, divisors, expert_count
from lmforge.distributed.parallel_state import DimensionHooks, ExpertShards, ParallelState
from lmforge.distributed.plan_terms import MemorySplit
from lmforge.distributed.tensor_parallel import DATA_DIM, TENSOR_DIM, build_mesh

if TYPE_CHECKING:
    # Annotations only (the imports a run needs are in its functions): `plan_layout` and the
    # planner read this dimension's checks before the training stack loads.
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel

    from lmforge.config.schema import DistributedConfig
    from lmforge.distributed.estimate import ModelShape
    from lmforge.distributed.plan_terms import Workload

log = logging.getLogger(__name__)

__all__ = [
    "EXPERT",
    "ExpertParallel",
    "build_expert_mesh",
    "expert_parallel_plan",
    "expert_parallel_size",
    "shard_experts",
    "shard_experts_over_data",
]

EXPERT_SHARD_DIM, EXPERT_DIM = "efsdp", "ep"
# The ranks of an expert group hold different batches (tensor = 1): only the all-to-all dispatch
# is correct there ("all_reduce" needs one shared batch; "auto" would pick all_to_all anyway).
EP_IMPLEMENTATION = "all_to_all"


def expert_parallel_size(layout: Layout) -> int:
    """transformers' `ep_size`: ranks that split one set of experts, tensor ranks included."""
    return layout.expert * layout.tensor


def build_expert_mesh(layout: Layout, *, on_gpu: bool) -> DeviceMesh:
    """The (efsdp, ep) mesh, ep innermost: an expert group is neighbouring ranks, so the
    all-to-all stays on the fastest links. Same ranks as the dense mesh, another view of them."""
    from torch.distributed.device_mesh import init_device_mesh

    ep = expert_parallel_size(layout)
    return init_device_mesh(
        "cuda" if on_gpu else "cpu",
        (layout.data * layout.tensor // ep, ep),
        mesh_dim_names=(EXPERT_SHARD_DIM, EXPERT_DIM),
    )


def expert_parallel_plan(model: PreTrainedModel, layout: Layout) -> dict[str, str]:
    """The model's ep_plan resolved by transformers for this layout: one entry per expert weight
    (`grouped_gemm`) and per experts module (`ep_dispatch_experts`), layer numbers filled in."""
    from transformers.distributed import DistributedConfig

    settings = DistributedConfig(
        tp_size=layout.tensor, fsdp_size=layout.data, ep_size=expert_parallel_size(layout)
    )
    _, plan, _ = model._resolve_parallel_plans(settings)
    return plan


def shard_experts(
    model: PreTrainedModel, layout: Layout, *, on_gpu: bool, mesh: Any = None
) -> tuple[Any, ExpertShards] | None:
    """Keep this rank's experts of every MoE layer and route tokens to the others, in place; the
    dense mesh (`mesh`, tensor parallelism's, else a new one) and the experts' own, or None.

    A no-op unless `layout.expert > 1`. Each rank must hold the same full weights beforehand (same
    seed or same files): the expert weights keep this rank's rows, no data moves. Call it after
    `shard_tensor_parallel` (the dense mesh is shared); `shard_experts_over_data` must then wrap the
    experts before `shard_data_over_mesh` wraps the layers."""
    import torch

    if layout.expert == 1:
        return None
    if layout.tensor > 1:  # the combination is in transformers' engine, but unmeasured here
        raise NotImplementedError("expert_parallel with tensor_parallel > 1 has not been measured")
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    dense = mesh if mesh is not None else build_mesh(layout, on_gpu=on_gpu)
    experts = build_expert_mesh(layout, on_gpu=on_gpu)
    if on_gpu:  # each slice stays on the device its weights are on: this rank's GPU
        model.to(torch.device("cuda", torch.cuda.current_device()))  # type: ignore[arg-type]  # transformers' .to stub
    plan = expert_parallel_plan(model, layout)
    apply_expert_parallelism(model, experts[EXPERT_DIM], dense[TENSOR_DIM], plan, EP_IMPLEMENTATION)
    modules = [name for name, style in plan.items() if style == "ep_dispatch_experts"]
    log.info(
        "expert parallel: %d MoE layers, experts split over %d ranks (%d copies of each)",
        len(modules),
        experts[EXPERT_DIM].size(),
        experts[EXPERT_SHARD_DIM].size(),
    )
    # The dense mesh is shard_data_over_mesh's cue: FSDP2 over dp_shard.
    return dense, ExpertShards(experts, modules)


def shard_experts_over_data(model: torch.nn.Module, state: ParallelState, plugin: Any | None = None) -> bool:
    """FSDP2 for each experts module over its copies (efsdp); True if it applied (`state` holds
    expert shards).

    Must run before the decoder layers are wrapped over dp_shard (a parameter belongs to the
    innermost FSDP2 unit). `plugin` is accelerate's FSDP plugin, for the mixed precision and
    offload the rest of the model gets (None: FSDP2's defaults)."""
    found, dense = state.experts, state.mesh
    if found is None or dense is None:
        return False
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    names = found.modules
    copies = found.mesh[EXPERT_SHARD_DIM]
    data = dense[DATA_DIM].size()
    settings: dict[str, Any] = {
        "mesh": copies,
        "mp_policy": getattr(plugin, "mixed_precision_policy", None) or MixedPrecisionPolicy(),
        "offload_policy": getattr(plugin, "cpu_offload", None) or OffloadPolicy(),
    }
    for name in names:
        if isinstance(model.get_submodule(name), FSDPModule):
            continue  # already wrapped (a second call): wrapping twice would shard the shards
        module: Any = fully_shard(model.get_submodule(name), reshard_after_forward=True, **settings)
        # The gradient of an expert covers `data` batches (module docstring), not `copies`.
        module.set_gradient_divide_factor(float(data))
        if copies.size() > 1:  # no PREMUL_SUM on gloo: sum, then divide locally
            module.set_force_sum_reduction_for_comms(True)
    return True


class ExpertParallel(DimensionHooks):
    """Expert parallelism as a parallel dimension: it splits the experts and records both meshes;
    the data-shard dimension wraps the experts over their copies, then the layers."""

    name = "expert"

    def problems(self, settings: DistributedConfig, model_config: Any, world_size: int) -> list[str]:
        ep = settings.expert_parallel
        if ep == 1:
            return []
        experts = expert_count(model_config)
        if experts is None:
            return [
                f"expert_parallel: {ep}: {getattr(model_config, 'model_type', '?')!r} is a dense model (no experts); "
                "set expert_parallel: 1 or train a Mixture-of-Experts model"
            ]
        problems = []
        if experts % ep:
            problems.append(
                f"expert_parallel: {ep} does not divide the model's {experts} experts; choose a divisor of {experts}"
            )
        spare = world_size // max(settings.model_parallel_degree, 1)
        if spare % ep:
            problems.append(
                f"expert_parallel: {ep} must divide the data ranks ({spare} of {world_size}): the experts are split "
                "over ranks that read different batches; launch a multiple of "
                f"{ep * settings.model_parallel_degree} processes or lower expert_parallel"
            )
        if not getattr(model_config, "base_model_ep_plan", None):
            problems.append(
                f"expert_parallel: transformers has no expert-parallel plan for {model_config.model_type!r}"
            )
        # Experts x tensor / context: config/layout_rules.py refuses them when the config loads.
        return problems

    def planner_degrees(
        self, shape: ModelShape, *, world: int, gpus_per_node: int, seq_len: int
    ) -> list[int]:
        return divisors(shape.num_experts) if shape.num_experts else [1]

    def planner_split(self, degree: int, work: Workload) -> MemorySplit:
        return MemorySplit(experts=degree)

    def used_by(self, layout: Layout) -> bool:
        return layout.expert > 1

    def apply(self, model: nn.Module, state: ParallelState) -> None:
        assert state.layout is not None
        hf_model: Any = model
        found = shard_experts(hf_model, state.layout, on_gpu=state.on_gpu, mesh=state.mesh)
        if found is not None:
            state.mesh, state.experts = found


EXPERT = ExpertParallel()
