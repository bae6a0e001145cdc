"""3-D layouts for `lmforge estimate`: which (data-shard, tensor, context, pipeline, expert) degrees fit
a device, and which one to use.

The order follows what Megatron-LM and torchtitan users do: shard states across the data dimension
first (ZeRO / FSDP: no change to the maths of a layer, communication overlapped with compute), then a
tensor-parallel degree that divides the attention and KV heads inside one node (it adds two
all-reduces per layer, so it wants the fastest links), then context parallelism for long sequences,
then pipeline stages (a bubble of idle time per step). A layout is recommended only when nothing
earlier in that order fits and lmforge's training step can run it. Before any model parallelism the
planner weighs the memory levers that leave the maths alone: the chunked loss
(train.chunked_cross_entropy), then gradient checkpointing (train.gradient_checkpointing), then both;
a recommendation names the keys it needs.

Each dimension's terms are its own (`planner_degrees`, `planner_refusal`, `planner_split` in
distributed/<dimension>.py, asked through the registry `parallel.DIMENSIONS`); this module
combines them. Per-device memory of a layout, with d = data, t = tensor, c = context, p = pipeline, e = expert:
- parameters / gradients / optimizer: the dense weights' slice / (t p) sharded d c ways by FSDP2; the
  experts' slice / (e t p) sharded over the d c / e ranks that hold the same experts (the expert
  data-parallel group, expert_parallel.py's efsdp), so expert parallelism moves expert states
  between ranks but does not shrink them: both terms come to P / (d c t p) per rank. Plus the largest
  module gathered whole for compute (4 bytes a parameter, as the FSDP rows of the strategy table
  count it): a layer's experts / (e t) only while efsdp > 1 (with efsdp = 1 they are resident);
- activations: one micro-batch's (estimate.activation_bytes, with the tensor degree: no sequence
  parallelism, so the norms stay whole, Korthikanti's 10 + 24/t) over c (each rank holds seq / c
  tokens); a pipeline cuts the micro-batch into m chunks
  (distributed.pipeline_microbatches, default p) of its L / p layers, and keeps min(p, m) of them in
  flight on the first stage under 1F1B, all m under GPipe;
- logits: transformers' TP plan gathers the output head's logits on every rank (colwise_rep), so TP
  does not divide them; context parallelism does; the chunked loss holds one chunk's;
- bubble: (p - 1) / (v m + p - 1), v = 2 virtual stages per rank under interleaved 1F1B.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from lmforge.config.schema import LmforgeConfig
from lmforge.distributed import parallel
from lmforge.distributed.estimate import (
    Estimate,
    ModelShape,
    activation_bytes,
    chunked_logits_bytes,
    fits_budget,
    logits_bytes,
)
from lmforge.distributed.plan_terms import Workload, combined_split

__all__ = [
    "LEVERS",
    "LayoutMemory",
    "LayoutPlan",
    "overall_recommendation",
    "plan_layouts",
    "plan_layouts_for",
]

# Bytes per parameter, split so that a data-only layout equals the strategy table's FSDP row
# (DeepSpeed's ZeRO-3 estimator: 18 per parameter under mixed precision with AdamW = 2 of 16-bit
# weights + 4 of gradients + 4 of fp32 master + 8 of moments). In fp32 the weights' 4 bytes are
# counted too (DeepSpeed's fp32 figure leaves the partitioned weights out).
_GRAD_BYTES = 4
_MASTER_BYTES = {True: 4, False: 0}  # fp32 master copy under mixed precision


# Memory levers weighed before model parallelism, cheapest first: the chunked loss recomputes only
# the output head per chunk; checkpointing recomputes every layer's forward (about a third more).
LEVERS: tuple[tuple[str, ...], ...] = (
    ("train.chunked_cross_entropy",),
    ("train.gradient_checkpointing",),
    ("train.chunked_cross_entropy", "train.gradient_checkpointing"),
)
_LEVER_FIELDS = {
    "train.chunked_cross_entropy": "chunked_loss",
    "train.gradient_checkpointing": "checkpointing",
}


@dataclass(frozen=True)
class LayoutMemory:
    """Bytes per device of one layout, and whether it fits and runs here."""

    data: int
    tensor: int
    context: int
    pipeline: int
    expert: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    total: int
    bubble: float
    fits: bool | None
    runnable: bool
    note: str
    levers: tuple[str, ...] = ()  # config keys (true) this row's memory assumes beyond the config

    def degrees(self) -> str:
        return f"dp{self.data} tp{self.tensor} cp{self.context} pp{self.pipeline} ep{self.expert}"


@dataclass(frozen=True)
class LayoutPlan:
    layouts: list[LayoutMemory]
    recommended: LayoutMemory | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "layouts": [asdict(row) for row in self.layouts],
            "recommended": None if self.recommended is None else asdict(self.recommended),
            "reason": self.reason,
        }


def plan_layouts_for(config: LmforgeConfig, estimate: Estimate) -> LayoutPlan:
    """The layouts of `config` on the devices `estimate` was made for (`lmforge estimate`, `strategy: auto`)."""
    work = Workload(
        micro_batch=estimate.micro_batch_size,
        seq_len=estimate.seq_len,
        pipeline_microbatches=config.distributed.pipeline_microbatches,
        mixed=estimate.mixed_precision,
        optimizer_bytes=estimate.optimizer_state_bytes_per_param,
        checkpointing=estimate.gradient_checkpointing,
        sdpa=config.model.attn_implementation != "eager",
        interleaved=config.distributed.pipeline_schedule == "interleaved_1f1b",
        gpipe=config.distributed.pipeline_schedule == "gpipe",
        chunked_loss=estimate.chunked_cross_entropy,
        checkpoint_every=estimate.checkpoint_every,
        activation_offload=estimate.activation_offload,
    )
    budget = None if estimate.gpu_mem_bytes is None else estimate.gpu_mem_bytes * (1 - estimate.headroom)
    return plan_layouts(
        estimate.model, work, gpus_per_node=estimate.gpus_per_node, nodes=estimate.nodes, budget=budget
    )


def plan_layouts(
    shape: ModelShape, work: Workload, *, gpus_per_node: int, nodes: int, budget: float | None
) -> LayoutPlan:
    """Every layout of `gpus_per_node x nodes` devices the model allows, in the preferred order;
    `budget`: usable bytes per device (None: no fit check)."""
    world = gpus_per_node * nodes
    degrees = [
        (world // (t * c * p), t, c, p, e)
        for t, c, p, e in _candidate_degrees(shape, world, gpus_per_node, work.seq_len)
    ]
    degrees.sort(key=lambda d: (d[3], d[2], d[1], d[4]))  # pipeline, context, tensor, expert
    rows = [_layout_memory(shape, work, d, budget) for d in degrees]
    return _recommend(shape, work, rows, budget)


def _candidate_degrees(
    shape: ModelShape, world: int, gpus_per_node: int, seq_len: int
) -> list[tuple[int, int, int, int]]:
    """(tensor, context, pipeline, expert) degrees: each dimension's own candidates (its
    `planner_degrees`), combined where they divide the world."""
    tried = {
        dimension.name: dimension.planner_degrees(
            shape, world=world, gpus_per_node=gpus_per_node, seq_len=seq_len
        )
        for dimension in parallel.DIMENSIONS
    }
    tensors, contexts, pipelines, experts = (
        tried[name] for name in ("tensor", "context", "pipeline", "expert")
    )
    out: list[tuple[int, int, int, int]] = []
    for t in tensors:
        for c in contexts:
            for p in pipelines:
                if world % (t * c * p):
                    continue
                data_context = world // (t * p)
                out.extend((t, c, p, e) for e in experts if data_context % e == 0)
    return out


def _layout_memory(
    shape: ModelShape, work: Workload, degrees: tuple[int, int, int, int, int], budget: float | None
) -> LayoutMemory:
    data, tensor, context, pipeline, expert = degrees
    # Each dimension says how it divides the memory at its degree (its `planner_split`).
    by_name = {
        "data_shard": data,
        "tensor": tensor,
        "context": context,
        "pipeline": pipeline,
        "expert": expert,
    }
    split = combined_split(
        [dimension.planner_split(by_name.get(dimension.name, 1), work) for dimension in parallel.DIMENSIONS]
    )
    w = 2 if work.mixed else 4
    dense = shape.total_params - shape.expert_params
    shard = split.states  # FSDP2 shards over the data and context ranks together (torchtitan's dp_shard_cp)
    expert_shard = shard // split.experts  # efsdp: the ranks holding the same experts shard them
    # transformers' expert group takes the tensor ranks too (ep_size = expert x tensor)
    expert_slice = shape.expert_params / (split.experts * split.within_layer * split.layers)
    shard_params = dense / (split.within_layer * split.layers) / shard + expert_slice / expert_shard
    gathered = _gathered_params(shape, split.within_layer, split.experts, expert_shard) if shard > 1 else 0
    parameters = int(w * shard_params + 4 * gathered)  # the gathered layer in fp32, as the strategy table
    gradients = int(_GRAD_BYTES * shard_params)
    optimizer = int((_MASTER_BYTES[work.mixed] + work.optimizer_bytes) * shard_params)
    seq = work.seq_len // split.tokens
    whole = activation_bytes(
        shape,
        batch=work.micro_batch,
        seq=seq,
        weight_bytes=w,
        checkpointing=work.checkpointing,
        sdpa=work.sdpa,
        every=work.checkpoint_every,
        offload=work.activation_offload,
        tensor=split.within_layer,
    )
    # Stages hold their layers' share of the chunks in flight (pipeline_parallel.py's split).
    held = int(whole / split.chunks / split.layers * split.chunks_held)
    activations = held if split.layers > 1 else whole
    if work.chunked_loss:
        logits = chunked_logits_bytes(shape, batch=work.micro_batch, seq=seq)
    else:
        logits = logits_bytes(shape, batch=work.micro_batch, seq=seq, weight_bytes=w)
    total = parameters + gradients + optimizer + activations + logits
    bubble = split.bubble
    runnable, note = _runs_here(shape, tensor, context, pipeline, expert)
    return LayoutMemory(
        data=data,
        tensor=tensor,
        context=context,
        pipeline=pipeline,
        expert=expert,
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        logits=logits,
        total=total,
        bubble=round(bubble, 4),
        fits=fits_budget(total, budget),
        runnable=runnable,
        note=note,
    )


def _gathered_params(shape: ModelShape, tensor: int, expert: int, expert_shard: int) -> float:
    """The largest module FSDP2 unshards for compute: a dense one's tensor slice, or a layer's
    experts (their expert x tensor slice) while other ranks hold shards of the same experts."""
    dense = shape.largest_dense_layer_params or shape.largest_layer_params
    experts = shape.expert_layer_params / (expert * tensor) if expert_shard > 1 else 0
    return max(dense / tensor, experts)


def _runs_here(shape: ModelShape, tensor: int, context: int, pipeline: int, expert: int) -> tuple[bool, str]:
    """Whether lmforge's training step runs this layout (`plan_layout` refuses the rest): each
    dimension's own refusal (its `planner_refusal`), then the pairs config/layout_rules.py refuses."""
    degrees = {"tensor": tensor, "context": context, "pipeline": pipeline, "expert": expert}
    for dimension in parallel.DIMENSIONS:
        refusal = dimension.planner_refusal(shape, degrees)
        if refusal is not None:
            return False, refusal
    if pipeline > 1 and (tensor > 1 or context > 1 or expert > 1):
        return False, "pipeline stages compose with data sharding only"
    if expert > 1 and (tensor > 1 or context > 1):
        return False, "expert parallelism composes with data sharding only"
    kinds = [
        name
        for name, degree in (("cp", context), ("tp", tensor), ("pp", pipeline), ("ep", expert))
        if degree > 1
    ]
    return True, " x ".join(["fsdp", *kinds])


def _recommend(
    shape: ModelShape, work: Workload, rows: list[LayoutMemory], budget: float | None
) -> LayoutPlan:
    """The first layout that fits and runs: data sharding alone as configured, then with each lever
    (LEVERS), and only then model parallelism in the layout order, as configured and then with each
    lever."""
    if budget is None:
        return LayoutPlan(rows, None, "no device memory given")
    levers = [()] + [keys for keys in LEVERS if not any(getattr(work, _LEVER_FIELDS[k]) for k in keys)]
    data_only = [r for r in rows if not _model_parallel(r)]
    model_parallel = [r for r in rows if _model_parallel(r)]
    for group in (data_only, model_parallel):
        for keys in levers:
            with_levers = replace(work, **{_LEVER_FIELDS[k]: True for k in keys})
            candidates = [
                row if not keys else _with_levers(shape, with_levers, row, budget, keys) for row in group
            ]
            choice = next((r for r in candidates if r.fits and r.runnable), None)
            if choice is not None:
                return LayoutPlan(rows, choice, _why(choice, candidates))
    fitting = [r for r in rows if r.fits]
    if fitting:
        return LayoutPlan(rows, None, f"only layouts lmforge cannot run yet fit ({fitting[0].note})")
    return LayoutPlan(
        rows,
        None,
        "no layout fits, even with train.chunked_cross_entropy and train.gradient_checkpointing: "
        "add devices, or shrink the micro-batch or the sequence",
    )


def _with_levers(
    shape: ModelShape, work: Workload, row: LayoutMemory, budget: float | None, keys: tuple[str, ...]
) -> LayoutMemory:
    degrees = (row.data, row.tensor, row.context, row.pipeline, row.expert)
    return replace(_layout_memory(shape, work, degrees, budget), levers=keys)


def _model_parallel(row: LayoutMemory) -> bool:
    return max(row.tensor, row.context, row.pipeline, row.expert) > 1


def _why(choice: LayoutMemory, candidates: list[LayoutMemory]) -> str:
    if _model_parallel(choice):
        why = "data sharding alone does not fit, even with the chunked loss and gradient checkpointing; "
        why += "the first layout in the order data-shard, tensor, context, pipeline that fits"
    else:
        why = "data sharding alone fits"
    if choice.levers:
        why += f" with {' and '.join(choice.levers)}"
    first = next(r for r in candidates if r.fits)
    if first is not choice:
        why += f" and that lmforge runs ({first.degrees()} fits first: {first.note})"
    return why


@dataclass(frozen=True)
class Recommendation:
    """`lmforge estimate`'s one verdict over the strategy table and the layouts."""

    kind: str  # strategy | layout | offload | none
    name: str  # the strategy, or the layout's degrees
    total: int | None  # bytes per device
    settings: list[str]  # config keys to set, "key: value"
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def overall_recommendation(estimate: Estimate, plan: LayoutPlan) -> Recommendation:
    """In order: the cheapest data-parallel strategy that fits as configured without offload; the
    planner's layout (data sharding with memory levers before model parallelism); a strategy that
    offloads to host memory; else nothing fits."""
    rows = {r.strategy: r for r in estimate.strategies}
    chosen = estimate.recommended
    if chosen is not None and "offload" not in chosen:
        return Recommendation(
            "strategy", chosen, rows[chosen].total_gpu, [], "the cheapest strategy that fits"
        )
    best = plan.recommended
    if best is not None:
        degrees = {
            k: getattr(best, k) for k in ("tensor", "context", "pipeline", "expert") if getattr(best, k) > 1
        }
        mesh = " x ".join([f"data {best.data}", *(f"{k} {d}" for k, d in degrees.items())])
        settings = [
            "distributed.strategy: fsdp",
            *(f"distributed.{k}_parallel: {d}" for k, d in degrees.items()),
            *(f"{key}: true" for key in best.levers),
        ]
        return Recommendation("layout", mesh, best.total, settings, plan.reason)
    if chosen is not None:
        return Recommendation(
            "offload", chosen, rows[chosen].total_gpu, [], "only offloading model states to host memory fits"
        )
    return Recommendation("none", "nothing fits", None, [], plan.reason)
