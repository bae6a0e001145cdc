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
  is wrapped over dp_shard, so the layer's FSDP2 unit leaves the expert weights alone.

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

import torch

from lmforge.distributed.layout import Layout
from lmforge.distributed.tensor_parallel import DATA_DIM, MESH_ATTRIBUTE, TENSOR_DIM, build_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

__all__ = [
    "EXPERT_MESH_ATTRIBUTE",
    "build_expert_mesh",
    "expert_parallel_plan",
    "expert_parallel_size",
    "shard_experts",
    "shard_experts_over_data",
]

# The model attribute that carries the expert mesh and the names of the dispatched experts modules
# from model building to the Trainer's FSDP2 wrapping.
EXPERT_MESH_ATTRIBUTE = "lmforge_expert_mesh"
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


def shard_experts(model: PreTrainedModel, layout: Layout, *, on_gpu: bool) -> None:
    """Keep this rank's experts of every MoE layer and route tokens to the others, in place.

    A no-op unless `layout.expert > 1`. Each rank must hold the same full weights beforehand (same
    seed or same files): the expert weights keep this rank's rows, no data moves. Call it after
    `shard_tensor_parallel` (the dense mesh is shared); `shard_experts_over_data` must then wrap the
    experts before `shard_data_over_mesh` wraps the layers."""
    if layout.expert == 1:
        return
    if layout.tensor > 1:  # the combination is in transformers' engine, but unmeasured here
        raise NotImplementedError("expert_parallel with tensor_parallel > 1 has not been measured")
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    dense = getattr(model, MESH_ATTRIBUTE, None) or build_mesh(layout, on_gpu=on_gpu)
    experts = build_expert_mesh(layout, on_gpu=on_gpu)
    if on_gpu:  # each slice stays on the device its weights are on: this rank's GPU
        model.to(torch.device("cuda", torch.cuda.current_device()))  # type: ignore[arg-type]  # transformers' .to stub
    plan = expert_parallel_plan(model, layout)
    apply_expert_parallelism(model, experts[EXPERT_DIM], dense[TENSOR_DIM], plan, EP_IMPLEMENTATION)
    setattr(model, MESH_ATTRIBUTE, dense)  # shard_data_over_mesh's cue: FSDP2 over dp_shard
    modules = [name for name, style in plan.items() if style == "ep_dispatch_experts"]
    setattr(model, EXPERT_MESH_ATTRIBUTE, (experts, modules))
    log.info(
        "expert parallel: %d MoE layers, experts split over %d ranks (%d copies of each)",
        len(modules),
        experts[EXPERT_DIM].size(),
        experts[EXPERT_SHARD_DIM].size(),
    )


def shard_experts_over_data(model: torch.nn.Module, plugin: Any | None = None) -> bool:
    """FSDP2 for each experts module over its copies (efsdp); True if it applied.

    Must run before the decoder layers are wrapped over dp_shard (a parameter belongs to the
    innermost FSDP2 unit). `plugin` is accelerate's FSDP plugin, for the mixed precision and
    offload the rest of the model gets (None: FSDP2's defaults)."""
    found = getattr(model, EXPERT_MESH_ATTRIBUTE, None)
    if found is None:
        return False
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    experts_mesh, names = found
    copies = experts_mesh[EXPERT_SHARD_DIM]
    data = getattr(model, MESH_ATTRIBUTE)[DATA_DIM].size()
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
