"""3-D layouts for `lmforge estimate`: which (data-shard, tensor, context, pipeline, expert) degrees fit
a device, and which one to use.

The order follows what Megatron-LM and torchtitan users do: shard states across the data dimension
first (ZeRO / FSDP: no change to the maths of a layer, communication overlapped with compute), then a
tensor-parallel degree that divides the attention and KV heads inside one node (it adds two
all-reduces per layer, so it wants the fastest links), then context parallelism for long sequences,
then pipeline stages (a bubble of idle time per step). A layout is recommended only when nothing
earlier in that order fits and lmforge's training step can run it.

Per-device memory of a layout, with d = data, t = tensor, c = context, p = pipeline, e = expert:
- parameters / gradients / optimizer: the rank's slice of the model (dense weights / (t p), experts /
  (e p), or / (t p) when experts are tensor-split instead) sharded again d c ways by FSDP2, plus one
  decoder layer gathered whole for compute, as the FSDP rows of the strategy table count it;
- activations: one micro-batch's (estimate.activation_bytes) over t (sequence parallelism splits the
  norms too) and c (each rank holds seq / c tokens); a pipeline cuts the micro-batch into m chunks
  (distributed.pipeline_microbatches, default p) of its L / p layers, and keeps min(p, m) of them in
  flight on the first stage under 1F1B, all m under GPipe;
- logits: transformers' TP plan gathers the output head's logits on every rank (colwise_rep), so TP
  does not divide them; context parallelism does;
- bubble: (p - 1) / (v m + p - 1), v = 2 virtual stages per rank under interleaved 1F1B.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lmforge.config.schema import LmforgeConfig
from lmforge.distributed.estimate import Estimate, ModelShape, activation_bytes, logits_bytes
from lmforge.distributed.layout import STAGEABLE_FAMILIES

__all__ = ["LayoutMemory", "LayoutPlan", "Workload", "plan_layouts", "plan_layouts_for"]

# Bytes per parameter, split so that a data-only layout equals the strategy table's FSDP row
# (DeepSpeed's ZeRO-3 estimator: 18 per parameter under mixed precision with AdamW = 2 of 16-bit
# weights + 4 of gradients + 4 of fp32 master + 8 of moments). In fp32 the weights' 4 bytes are
# counted too (DeepSpeed's fp32 figure leaves the partitioned weights out).
_GRAD_BYTES = 4
_MASTER_BYTES = {True: 4, False: 0}  # fp32 master copy under mixed precision


@dataclass(frozen=True)
class Workload:
    """What one device computes per micro-batch, the same under every layout."""

    micro_batch: int
    seq_len: int
    pipeline_microbatches: int | None  # chunks each micro-batch is cut into (None: one per stage)
    mixed: bool
    optimizer_bytes: float  # the optimizer's state per parameter (AdamW: 8)
    checkpointing: bool
    sdpa: bool
    interleaved: bool = False  # interleaved 1F1B: two virtual stages per rank
    gpipe: bool = False  # GPipe runs every chunk's forward before any backward


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
    rows = [
        _layout_memory(shape, work, (world // (t * c * p), t, c, p, e), budget)
        for t, c, p, e in _candidate_degrees(shape, world, gpus_per_node, work.seq_len)
    ]
    rows.sort(key=lambda r: (r.pipeline, r.context, r.tensor, r.expert))
    return _recommend(rows, budget)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidate_degrees(
    shape: ModelShape, world: int, gpus_per_node: int, seq_len: int
) -> list[tuple[int, int, int, int]]:
    heads, kv = shape.num_heads, shape.num_kv_heads or shape.num_heads
    tensors = [t for t in _divisors(gpus_per_node) if heads % t == 0 and kv % t == 0]
    if not shape.has_tp_plan:
        tensors = [1]
    contexts = [c for c in _divisors(world) if c == 1 or seq_len % (2 * c) == 0]
    pipelines = [p for p in _divisors(world) if shape.num_layers % p == 0]
    experts = _divisors(shape.num_experts) if shape.num_experts else [1]
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
    w = 2 if work.mixed else 4
    dense = shape.total_params - shape.expert_params
    experts_split = expert if expert > 1 else tensor
    rank_params = dense / (tensor * pipeline) + shape.expert_params / (experts_split * pipeline)
    shard = data * context  # FSDP2 shards over the data and context ranks together (torchtitan's dp_shard_cp)
    # FSDP2 unshards one layer at a time (counted in fp32, as the strategy table does)
    gathered = 4 * shape.largest_layer_params / tensor if shard > 1 else 0
    parameters = int(w * rank_params / shard + gathered)
    gradients = int(_GRAD_BYTES * rank_params / shard)
    optimizer = int((_MASTER_BYTES[work.mixed] + work.optimizer_bytes) * rank_params / shard)
    seq = work.seq_len // context
    whole = activation_bytes(
        shape,
        batch=work.micro_batch,
        seq=seq,
        weight_bytes=w,
        checkpointing=work.checkpointing,
        sdpa=work.sdpa,
    )
    # The pipeline cuts each micro-batch into m chunks; 1F1B keeps min(p, m) of them in flight on
    # the first stage, GPipe all m.
    micro_batches = work.pipeline_microbatches or pipeline
    in_flight = micro_batches if work.gpipe else min(pipeline, micro_batches)
    activations = (
        int(whole / micro_batches / tensor / pipeline * in_flight) if pipeline > 1 else int(whole / tensor)
    )
    logits = logits_bytes(shape, batch=work.micro_batch, seq=seq, weight_bytes=w)
    total = parameters + gradients + optimizer + activations + logits
    virtual = 2 if work.interleaved else 1
    bubble = (pipeline - 1) / (virtual * micro_batches + pipeline - 1) if pipeline > 1 else 0.0
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
        fits=None if budget is None else total <= budget,
        runnable=runnable,
        note=note,
    )


def _runs_here(shape: ModelShape, tensor: int, context: int, pipeline: int, expert: int) -> tuple[bool, str]:
    """Whether lmforge's training step runs this layout (distributed/layout.py refuses the rest)."""
    if pipeline > 1 and shape.model_type and shape.model_type not in STAGEABLE_FAMILIES:
        return False, f"pipeline stages are cut for {', '.join(sorted(STAGEABLE_FAMILIES))} only"
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


def _recommend(rows: list[LayoutMemory], budget: float | None) -> LayoutPlan:
    if budget is None:
        return LayoutPlan(rows, None, "no device memory given")
    fitting = [r for r in rows if r.fits]
    runnable = [r for r in fitting if r.runnable]
    if runnable:
        choice = runnable[0]
        why = "the first layout in the order data-shard, tensor, context, pipeline that fits"
        if fitting[0] is not choice:
            why += f" and that lmforge runs ({fitting[0].degrees()} fits first: {fitting[0].note})"
        return LayoutPlan(rows, choice, why)
    if fitting:
        return LayoutPlan(rows, None, f"only layouts lmforge cannot run yet fit ({fitting[0].note})")
    return LayoutPlan(
        rows, None, "no layout fits: add devices, shrink the micro-batch or sequence, or checkpoint"
    )
