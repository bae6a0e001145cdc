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

Every refusal names the key, why the engine cannot do it, and the fix. What the config alone
decides (the engine, stages, degree pairs, pipeline micro-batches) is config/layout_rules.py's,
checked when the config loads; this module checks the layout against the architecture and the world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmforge.config.schema import DistributedConfig, LmforgeConfig
from lmforge.errors import UserInputError

__all__ = ["STAGEABLE_FAMILIES", "Layout", "expert_count", "launch_mesh_note", "plan_layout"]

# Families whose decoder takes `inputs_embeds` as the hidden states unchanged (no embedding scale
# or other work between the embedding and the first layer), so a later pipeline stage can resume
# there (distributed/pipeline_parallel.py).
STAGEABLE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


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


def expert_count(hf_config: Any) -> int | None:
    """Experts per MoE layer, or None for a dense model (families name it differently)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def plan_layout(settings: DistributedConfig, hf_config: Any, world_size: int) -> Layout:
    """The mesh of this run, or a UserInputError listing every reason it cannot run."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    problems = [
        *_world_problems(settings, world_size),
        *_tensor_problems(settings, text_config),
        *_pipeline_problems(settings, text_config),
        *_context_problems(settings, text_config),
        *_expert_problems(settings, text_config, world_size),
    ]
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


def _world_problems(settings: DistributedConfig, world_size: int) -> list[str]:
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


def _tensor_problems(settings: DistributedConfig, config: Any) -> list[str]:
    tp = settings.tensor_parallel
    if tp == 1:
        return []
    model_type = getattr(config, "model_type", "?")
    if not getattr(config, "base_model_tp_plan", None):
        return [
            f"tensor_parallel: {tp}: transformers has no tensor-parallel plan (tp_plan) for {model_type!r}; "
            "use an architecture that has one (llama, qwen2, mistral, gemma, phi3, mixtral, qwen2_moe, ...) or "
            "distributed.strategy: fsdp alone"
        ]
    problems = []
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    counts = {
        key: n
        for key, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
        if isinstance(n, int)
    }
    broken = [f"{key} ({n})" for key, n in counts.items() if n % tp]
    if broken:
        divisors = [d for d in range(1, min(counts.values()) + 1) if all(n % d == 0 for n in counts.values())]
        problems.append(
            f"tensor_parallel: {tp} does not divide the model's {' and '.join(broken)}: each rank must hold "
            f"whole heads; choose tensor_parallel from {divisors}"
        )
    experts = expert_count(config)
    inner = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None)
    if isinstance(inner, int) and inner % tp:
        problems.append(
            f"tensor_parallel: {tp} does not divide the MLP width ({inner}, "
            f"{'moe_intermediate_size' if experts else 'intermediate_size'}); choose a degree that divides it"
        )
    return problems


def _pipeline_problems(settings: DistributedConfig, config: Any) -> list[str]:
    pp = settings.pipeline_parallel
    if pp == 1:
        return []
    layers = getattr(config, "num_hidden_layers", None)
    model_type = getattr(config, "model_type", "?")
    problems = []
    if not getattr(config, "base_model_pp_plan", None):
        problems.append(
            f"pipeline_parallel: {pp}: transformers has no pipeline plan (pp_plan) for {model_type!r}"
        )
    stages = pp * (2 if settings.pipeline_schedule == "interleaved_1f1b" else 1)
    if isinstance(layers, int) and layers % stages:
        problems.append(
            f"pipeline_parallel: {pp} with schedule {settings.pipeline_schedule} makes {stages} stages, which do "
            f"not divide the model's {layers} layers; choose a degree whose stage count divides {layers}"
        )
    if model_type not in STAGEABLE_FAMILIES:
        problems.append(
            f"pipeline_parallel: {model_type!r} is not a family whose stages lmforge cuts (a later stage resumes "
            f"from the hidden states, which {sorted(STAGEABLE_FAMILIES)} take unchanged); use one of those, or "
            "distributed.strategy: fsdp with tensor_parallel"
        )
    # Pipeline x tensor / context / expert: config/layout_rules.py refuses them when the config loads.
    return problems


def _context_problems(settings: DistributedConfig, config: Any) -> list[str]:
    cp = settings.context_parallel
    if cp == 1:
        return []
    # Ring attention runs plain causal attention over the whole sequence: a layer that looks at a
    # window only would silently be trained with full attention (accelerate refuses it too).
    layer_types = getattr(config, "layer_types", None) or []
    windowed = sorted({kind for kind in layer_types if kind != "full_attention"})
    if (
        not layer_types
        and getattr(config, "sliding_window", None)
        and getattr(config, "use_sliding_window", True)
    ):
        windowed = ["sliding_attention"]
    if windowed:
        return [
            f"context_parallel: {cp}: {getattr(config, 'model_type', '?')!r} has {', '.join(windowed)} layers; ring "
            "attention runs full causal attention only, so those layers would train with the wrong mask; use a "
            "full-attention model (or set its sliding_window: null), or set context_parallel: 1"
        ]
    return []


def _expert_problems(settings: DistributedConfig, config: Any, world_size: int) -> list[str]:
    ep = settings.expert_parallel
    if ep == 1:
        return []
    experts = expert_count(config)
    if experts is None:
        return [
            f"expert_parallel: {ep}: {getattr(config, 'model_type', '?')!r} is a dense model (no experts); "
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
    if not getattr(config, "base_model_ep_plan", None):
        problems.append(
            f"expert_parallel: transformers has no expert-parallel plan for {config.model_type!r}"
        )
    # Experts x tensor / context: config/layout_rules.py refuses them when the config loads.
    return problems


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
