"""Rules on `distributed.{tensor,context,pipeline,expert}_parallel` that the config alone decides.

One table, read twice with the same words: when the config loads (config/cross_checks.py, so
`lmforge train`, `lmforge launch --dry-run` and `lmforge estimate` refuse in about a second, before
any worker starts) and by each worker on the settings it resolved (distributed/strategy.py: an
accelerate config may choose the engine there). What needs the architecture (heads, layers,
experts, attention windows) or the world size is distributed/layout.py's, which `lmforge launch`
also runs before starting workers.

Tensor, context, pipeline and expert parallelism all run on lmforge's FSDP2 device mesh
(distributed/tensor_parallel.py): FSDP2 shards over its data dimension, and the data loader hands
one batch to the ranks of a model group. DDP cannot stand in: it would all-reduce the different
slices of the tensor (or stage, or expert) ranks together, and its data loader would give those
ranks different batches. With the degrees' product equal to the number of processes, FSDP2 shards
nothing, so `strategy: fsdp` is also the way to run a model-parallel layout alone.
"""

from __future__ import annotations

from collections.abc import Callable

from lmforge.config.schema import DistributedConfig, LmforgeConfig
from lmforge.config.stages import stage_spec

__all__ = ["LAYOUT_RULES", "layout_problems", "mesh_engine", "pipeline_microbatches"]

# (applies?, key path, message): the message is built from the config it names and reads on from
# the key ("distributed.strategy" + ": ddp with tensor_parallel: 2: ..."), as every config error shows it.
LayoutRule = tuple[Callable[[LmforgeConfig], bool], str, Callable[[LmforgeConfig], str]]

# key -> (why DDP / DeepSpeed cannot run it, what strategy fsdp does with it alone)
_MESH = {
    "tensor_parallel": (
        "tensor parallelism runs on FSDP2's (data_shard x tensor) device mesh",
        "with tensor_parallel equal to the number of processes FSDP2 shards nothing and the run is tensor "
        "parallel alone",
    ),
    "context_parallel": (
        "the context ranks of a sequence hold different tokens and their gradients are summed by FSDP2 over "
        "the (data x context) mesh",
        "with context_parallel equal to the number of processes FSDP2 shards the weights over the context "
        "ranks alone",
    ),
    "pipeline_parallel": (
        "pipeline stages run on FSDP2's (pipeline x data_shard) device mesh",
        "with pipeline_parallel equal to the number of processes FSDP2 shards nothing and the run is pipeline "
        "parallel alone",
    ),
    "expert_parallel": (
        "the ranks hold different experts, so DDP's all-reduce would average unrelated gradients",
        "FSDP2 shards the dense layers over the data ranks, the experts are split between them",
    ),
}
# setting -> is it on (fp16: the loss scaler steps outside the schedule)
_UNSUPPORTED_IN_PIPELINE = {
    "train.precision: fp16": lambda c: c.train.precision == "fp16",
    "train.compile: model": lambda c: c.train.compile == "model",
    "train.compile: layers": lambda c: c.train.compile == "layers",
    "train.kernels: liger": lambda c: c.train.kernels == "liger",
    "train.chunked_cross_entropy: true": lambda c: c.train.chunked_cross_entropy,
    "train.activation_offload: true": lambda c: c.train.activation_offload,
}


def mesh_engine(settings: DistributedConfig) -> str:
    """The engine a model-parallel layout would run on: a DeepSpeed JSON means deepspeed, and
    strategy auto chooses fsdp for it (distributed/strategy.py)."""
    if settings.deepspeed_config is not None:
        return "deepspeed"
    return "fsdp" if settings.strategy == "auto" else settings.strategy


def pipeline_microbatches(settings: DistributedConfig) -> int:
    """Pipeline micro-batches per train.micro_batch_size batch: the configured count, else one per stage."""
    return settings.pipeline_microbatches or settings.pipeline_parallel


def _degree(key: str) -> Callable[[LmforgeConfig], int]:
    return lambda c: int(getattr(c.distributed, key))


def _engine_words(settings: DistributedConfig) -> str:
    if settings.deepspeed_config is not None and settings.strategy != "deepspeed":
        return f"{settings.strategy} + distributed.deepspeed_config (DeepSpeed)"
    return settings.strategy


def _engine_rule(key: str) -> LayoutRule:
    degree = _degree(key)
    return (
        lambda c: degree(c) > 1 and mesh_engine(c.distributed) != "fsdp",
        "distributed.strategy",
        lambda c: (
            f"{_engine_words(c.distributed)} with {key}: {degree(c)}: {_MESH[key][0]}; set "
            f"distributed.strategy: fsdp ({_MESH[key][1]})"
            + ("; remove distributed.deepspeed_config" if c.distributed.deepspeed_config is not None else "")
        ),
    )


def _pipeline_feature_rule(setting: str, on: Callable[[LmforgeConfig], bool]) -> LayoutRule:
    return (
        lambda c: c.distributed.pipeline_parallel > 1 and on(c),
        setting.split(":")[0],
        lambda c: (
            f"{setting.split(': ')[1]} with pipeline_parallel: {c.distributed.pipeline_parallel}: the pipeline "
            "schedule runs each "
            "stage's plain forward and the last stage's own cross-entropy; turn it off, or set "
            "distributed.pipeline_parallel: 1"
        ),
    )


def _pairing_rule(outer: str, inner: str, why: str) -> LayoutRule:
    """`outer` > 1 cannot combine with `inner` > 1 (layout.py's mesh has no such dimension pair)."""
    return (
        lambda c: _degree(outer)(c) > 1 and _degree(inner)(c) > 1,
        f"distributed.{outer}",
        lambda c: (
            f"{_degree(outer)(c)} with {inner}: {_degree(inner)(c)}: {why}; set {inner}: 1, or {outer}: 1"
        ),
    )


def _interleaved_problem(c: LmforgeConfig) -> bool:
    d = c.distributed
    return (
        d.pipeline_parallel > 1
        and d.pipeline_schedule == "interleaved_1f1b"
        and pipeline_microbatches(d) % d.pipeline_parallel != 0
    )


def _interleaved_message(c: LmforgeConfig) -> str:
    d = c.distributed
    chunks, stages = pipeline_microbatches(d), d.pipeline_parallel
    up = -(-chunks // stages) * stages
    return (
        f"{chunks}: interleaved_1f1b (torch's ScheduleInterleaved1F1B) runs "
        f"rounds of one micro-batch per rank, so it must be a multiple of pipeline_parallel ({stages}); "
        f"set distributed.pipeline_microbatches: {up} (and train.micro_batch_size at least that), or "
        "pipeline_schedule: 1f1b or gpipe"
    )


def _second_model_in_memory(c: LmforgeConfig) -> bool:
    """The stage's loss runs a second, frozen model beside the trained one: a copy of the starting
    model (DPO, KTO), or the distillation teacher. TRL prepares it with accelerate, outside the mesh."""
    spec = stage_spec(c.train.stage)
    return spec.reference == "in_memory" or spec.teacher


LAYOUT_RULES: list[LayoutRule] = [
    *(_engine_rule(key) for key in _MESH),
    # tensor parallelism
    (
        lambda c: c.distributed.tensor_parallel > 1 and _second_model_in_memory(c),
        "train.stage",
        lambda c: (
            f"{c.train.stage} with tensor_parallel: {c.distributed.tensor_parallel}: TRL prepares the "
            "reference (or teacher) model with accelerate's FSDP2 path, which needs a ParallelismConfig "
            "accelerate cannot take for this mesh (measured: AttributeError 'fsdp_dim_names' in trl prepare_fsdp); set "
            "distributed.tensor_parallel: 1 (strategy fsdp alone shards this stage)"
        ),
    ),
    (
        lambda c: (
            c.distributed.tensor_parallel > 1
            and stage_spec(c.train.stage).reference == "on_disk"
            and c.train.rl.beta > 0
        ),
        "train.rl.beta",
        lambda c: (
            f"{c.train.rl.beta} with tensor_parallel: {c.distributed.tensor_parallel}: rank 0 writes "
            "the reference model from the sharded one alone, and gathering its slices is a collective the other "
            "ranks never join (measured: a hang); set train.rl.beta: 0 or distributed.tensor_parallel: 1"
        ),
    ),
    # context parallelism
    (
        lambda c: c.distributed.context_parallel > 1 and not stage_spec(c.train.stage).language_model_loss,
        "train.stage",
        lambda c: (
            f"{c.train.stage} with context_parallel: {c.distributed.context_parallel}: the split "
            "sequences carry a token-level language-model loss (pretrain, sft); a preference or RL loss sums each "
            "sequence's log-probabilities, which no rank holds whole; set distributed.context_parallel: 1"
        ),
    ),
    (
        lambda c: c.distributed.context_parallel > 1 and c.model.attn_implementation != "sdpa",
        "model.attn_implementation",
        lambda c: (
            f"{c.model.attn_implementation} with context_parallel: "
            f"{c.distributed.context_parallel}: ring attention replaces torch's scaled_dot_product_attention; "
            "set model.attn_implementation: sdpa"
        ),
    ),
    *(
        (
            (lambda c, flag=flag: c.distributed.context_parallel > 1 and bool(getattr(c.data, flag))),
            f"data.{flag}",
            (
                lambda c, flag=flag: (
                    f"true with context_parallel: {c.distributed.context_parallel}: ring attention "
                    "runs one causal mask over the whole row, so packed samples would attend to each other; "
                    f"set data.{flag}: false (each sample its own row) or context_parallel: 1"
                )
            ),
        )
        for flag in ("packing", "padding_free")
    ),
    (
        lambda c: c.distributed.context_parallel > 1 and c.train.kernels == "liger",
        "train.kernels",
        lambda c: (
            f"liger with context_parallel: {c.distributed.context_parallel}: not measured with "
            "torch's ring attention, which swaps the attention function while each step runs; remove "
            "train.kernels, or set context_parallel: 1"
        ),
    ),
    # expert parallelism
    (
        lambda c: (
            c.distributed.expert_parallel > 1
            and (
                _second_model_in_memory(c)
                or (stage_spec(c.train.stage).reference == "on_disk" and c.train.rl.beta > 0)
            )
        ),
        "train.stage",
        lambda c: (
            f"{c.train.stage} with expert_parallel: {c.distributed.expert_parallel}: the reference "
            "(or teacher) model would run its own forward on some ranks only, and every expert-parallel "
            "forward is a collective over the expert group (a hang); set distributed.expert_parallel: 1"
            + (" or train.rl.beta: 0" if stage_spec(c.train.stage).reference == "on_disk" else "")
        ),
    ),
    *(
        _pairing_rule(
            "expert_parallel",
            key,
            "experts split over the data ranks with FSDP2 only here (transformers' engine would take the tensor "
            "ranks into the expert group; not measured)",
        )
        for key in ("tensor_parallel", "context_parallel")
    ),
    # pipeline parallelism
    *(
        _pairing_rule("pipeline_parallel", key, "pipeline stages compose with data sharding (FSDP2) only")
        for key in ("tensor_parallel", "context_parallel", "expert_parallel")
    ),
    (
        lambda c: c.distributed.pipeline_parallel > 1 and not stage_spec(c.train.stage).language_model_loss,
        "train.stage",
        lambda c: (
            f"{c.train.stage} with pipeline_parallel: {c.distributed.pipeline_parallel}: the pipeline "
            "step computes the causal language-model loss only (pretrain, sft); set distributed.pipeline_parallel: 1"
        ),
    ),
    *(_pipeline_feature_rule(setting, on) for setting, on in _UNSUPPORTED_IN_PIPELINE.items()),
    (
        lambda c: (
            c.distributed.pipeline_parallel > 1
            and c.train.micro_batch_size < pipeline_microbatches(c.distributed)
        ),
        "train.micro_batch_size",
        lambda c: (
            f"{c.train.micro_batch_size} is smaller than the "
            f"{pipeline_microbatches(c.distributed)} pipeline micro-batches it is cut into; raise "
            "train.micro_batch_size or lower distributed.pipeline_microbatches"
        ),
    ),
    (
        lambda c: (
            c.distributed.pipeline_parallel > 1
            and c.distributed.pipeline_schedule == "1f1b"
            and pipeline_microbatches(c.distributed) < c.distributed.pipeline_parallel
        ),
        "distributed.pipeline_microbatches",
        lambda c: (
            f"{pipeline_microbatches(c.distributed)} < "
            f"{c.distributed.pipeline_parallel} stages: 1f1b needs one micro-batch per stage; raise it to "
            f"{c.distributed.pipeline_parallel} or use pipeline_schedule: gpipe"
        ),
    ),
    (_interleaved_problem, "distributed.pipeline_microbatches", _interleaved_message),
]


def layout_problems(cfg: LmforgeConfig) -> list[tuple[str, str]]:
    """(key path, message) for every layout rule `cfg` breaks; `f"{key}: {message}"` is the sentence."""
    return [(key, message(cfg)) for applies, key, message in LAYOUT_RULES if applies(cfg)]
