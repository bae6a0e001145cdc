"""Pipeline parallelism through the HF Trainer: torch.distributed.pipelining runs the schedule.

The engine is torch's `PipelineStage` with its `ScheduleGPipe` / `Schedule1F1B` /
`ScheduleInterleaved1F1B` (the one distributed.pipeline_schedule names): it splits each
micro-batch into pipeline micro-batches, sends activations forward and their gradients back
between neighbouring stages, and interleaves forwards and backwards. No schedule, send or
receive lives here; this module decides which layers a stage owns and hands the engine a stage
and a loss.

How a stage is cut (the split transformers' own `pp_plan` describes: embed_tokens -> layers ->
norm, then the head): every rank builds the whole model, then the modules another stage owns are
replaced by a pass-through, so each rank keeps only its own weights and every parameter keeps
its full name (`model.layers.3.mlp...` on whichever rank owns layer 3). That keeps the rest of
the HF machinery unchanged: the optimizer sees this stage's parameters, torch DCP checkpoints
merge the stages' distinct keys into one checkpoint (and reshard it onto another pipeline degree
on load), and the final model is one safetensors shard per stage under one index. A stage runs
the HF model's own forward (`pipeline_stages.StageForward`): the first stage from input_ids, the others from
the hidden states they receive (as `inputs_embeds`); only the last stage's head produces logits.

Around the engine, the Trainer path is the one tensor parallelism takes
(distributed/tensor_parallel.py): a (dp_shard, stage) mesh with FSDP2 over the data dimension
(one rank per stage shards nothing; it carries the DCP checkpoints), and the stage dimension is
given to accelerate under the name `tp`, which to accelerate and the HF Trainer means "these
ranks read one batch": each stage sees the same batch (the first needs its inputs, the last its
labels) and the token count is counted once per pipeline. What the Trainer cannot know is
handled by the `PipelineParallel` dimension, whose hooks the Trainer adapter (train/hf_trainer.py)
calls: the training step runs the schedule, the gradient norm is taken over
all stages (clipping by one stage's norm would clip each stage differently), a tied embedding
(first stage) and output head (last stage) add their gradients, and evaluation runs the
schedule forward only.

Loss: the last stage sums token cross-entropies and divides by the step's token count (the HF
Trainer's own normalisation), with gradient scaling off, so the sum over pipeline micro-batches
is exactly the loss and gradient of the whole micro-batch (measured: loss equal, gradients within
3e-8 of one process on a 4-layer Llama).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.distributed.layout import Layout, divisors
from lmforge.distributed.parallel_state import DimensionHooks, ParallelState
from lmforge.distributed.plan_terms import MemorySplit
from lmforge.distributed.tensor_parallel import DATA_DIM, TENSOR_DIM

if TYPE_CHECKING:
    from collections.abc import Mapping

    # Annotations only (the imports a run needs are in its functions): `plan_layout` and the
    # planner read this dimension's checks before the training stack loads.
    import torch
    from torch import nn
    from transformers import PreTrainedModel, Trainer

    from lmforge.config.schema import DistributedConfig
    from lmforge.distributed.estimate import ModelShape
    from lmforge.distributed.plan_terms import Workload

log = logging.getLogger(__name__)

__all__ = [
    "PIPELINE",
    "Pipeline",
    "PipelineParallel",
    "save_pipeline_model",
    "schedule_note",
    "split_into_stages",
    "whole_parameter_count",
]

# Families whose decoder takes `inputs_embeds` as the hidden states unchanged (no embedding scale
# or other work between the embedding and the first layer), so a later pipeline stage can resume
# there (distributed/pipeline_parallel.py).
STAGEABLE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

IGNORE_INDEX = -100
_CACHED_SCHEDULES = 8  # one per batch shape seen (dynamic padding); the oldest go first


@dataclass
class Pipeline:
    """One rank's place in the pipeline and the schedules it has built."""

    stage: int  # this rank's place in the pipeline (its first stage under interleaved 1F1B)
    stages: int  # ranks in the pipeline
    schedule: str  # gpipe | 1f1b | interleaved_1f1b
    microbatches: int
    group: Any  # the process group of this rank's pipeline (its mesh row)
    device: torch.device
    tied_name: str | None = None  # a tied embedding's name on the first and last stage
    tied_group: Any = None  # first and last stage of this pipeline, to add the tied gradients
    whole_parameters: int = 0  # the whole model's, before the cut
    normalizer: float = 1.0  # the current step's loss divisor (token count / data-rank scale)
    _schedules: OrderedDict[tuple[Any, ...], Any] = field(default_factory=OrderedDict)

    @property
    def first(self) -> bool:
        """This rank holds stage 0 (the embedding)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """This rank holds the last stage (final norm and head)."""
        return self.stage == self.stages - 1

    @property
    def per_rank(self) -> int:
        """Stages each rank runs: two under interleaved 1F1B (rank r: stages r and r + ranks)."""
        return 2 if self.schedule == "interleaved_1f1b" else 1

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One pipeline micro-batch's next-token cross-entropy, summed and divided by the step's
        count: transformers' own causal-LM loss, as the model computes it given the count."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=self.normalizer)  # type: ignore[arg-type]

    def schedule_for(self, model: nn.Module, shape: tuple[int, ...], *, training: bool) -> Any:
        """The schedule for batches of `shape` (each stage's receive buffers are sized by it)."""
        from torch.distributed.pipelining import PipelineStage

        from lmforge.distributed.pipeline_stages import StageForward

        chunks = min(self.microbatches, shape[0])
        key = (shape, training)
        if key not in self._schedules:
            total = self.stages * self.per_rank
            hf_model: Any = model
            layers = len(getattr(hf_model, hf_model.base_model_prefix).layers)
            stages = [
                PipelineStage(
                    StageForward(model, index=index, total=total, layers=_stage_layers(index, total, layers)),
                    index,
                    total,
                    self.device,
                    group=self.group,
                )
                for index in range(self.stage, total, self.stages)  # this rank's stages
            ]
            kind = _schedule_class(self.schedule, chunks, self.stages)
            note = schedule_note(self.schedule, kind, rows=shape[0], chunks=chunks, ranks=self.stages)
            if note:
                log.warning("%s", note)
            run_on = stages if self.per_rank > 1 else stages[0]
            self._schedules[key] = kind(run_on, n_microbatches=chunks, loss_fn=self.loss, scale_grads=False)
            while len(self._schedules) > _CACHED_SCHEDULES:
                self._schedules.popitem(last=False)
        self._schedules.move_to_end(key)
        return self._schedules[key]

    def run(self, model: nn.Module, inputs: dict[str, Any], *, training: bool) -> torch.Tensor:
        """One batch through the schedule (forward and backward, or forward only); every stage
        returns the batch's loss, which only the last stage computes."""
        import torch
        import torch.distributed as dist

        ids, labels = inputs["input_ids"], inputs["labels"]
        extra = {
            key: inputs[key] for key in ("attention_mask", "position_ids") if inputs.get(key) is not None
        }
        unknown = sorted(set(inputs) - {"input_ids", "labels", "attention_mask", "position_ids"})
        if unknown:
            raise RuntimeError(f"pipeline_parallel: batch keys {unknown} have no path through the stages")
        schedule = self.schedule_for(model, tuple(ids.shape), training=training)
        losses: list[torch.Tensor] = []
        run = schedule.step if training else schedule.eval
        args = (ids,) if self.first else ()
        if self.last:
            run(*args, target=labels, losses=losses, **extra)
        else:
            run(*args, **extra)
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
        dist.broadcast(loss, group_src=self.stages - 1, group=self.group)
        return loss

    def add_tied_gradients(self, model: nn.Module) -> None:
        """The tied embedding is a copy on the first stage (input side) and the last (head): add
        the two gradients, so both copies take the same update and stay one weight."""
        import torch.distributed as dist

        if self.tied_group is None or not (self.first or self.last):
            return
        grad = model.get_parameter(self.tied_name).grad  # type: ignore[arg-type]
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.tied_group)

    def grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The gradient norm over every stage (a tied weight counted once), clipped by it."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        parameters = [p for p in model.parameters() if p.grad is not None]
        counted = parameters
        if self.tied_name is not None and self.last:  # the first stage counts the tied weight
            tied = model.get_parameter(self.tied_name)
            counted = [p for p in parameters if p is not tied]
        norm = (
            get_total_norm([p.grad for p in counted if p.grad is not None])
            if counted
            else torch.zeros((), device=self.device)
        )
        local = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squared = local.float().pow(2)
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        if max_norm != float("inf"):
            clip_grads_with_norm_(parameters, max_norm, total)
        return total


def split_into_stages(
    model: PreTrainedModel, layout: Layout, *, on_gpu: bool, schedule: str, microbatches: int
) -> tuple[Any, Pipeline] | None:
    """Keep this rank's stage of `model` (a no-op unless `layout.pipeline > 1`): the decoder layers
    of its stage, the embedding on the first stage, the final norm and head on the last; the
    (dp_shard, stage) mesh and this rank's `Pipeline`, or None.

    Each rank must have built the same full model beforehand (same seed or files)."""
    import torch

    from lmforge.distributed.ranks import ensure_process_group
    from lmforge.models.build import count_parameters

    if layout.pipeline == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    ensure_process_group()
    # Stages innermost, under accelerate's name for "ranks that read one batch" (module docstring).
    mesh = init_device_mesh(
        "cuda" if on_gpu else "cpu", (layout.data, layout.pipeline), mesh_dim_names=(DATA_DIM, TENSOR_DIM)
    )
    stages_mesh = mesh[TENSOR_DIM]
    stage, stages = stages_mesh.get_local_rank(), stages_mesh.size()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if on_gpu:
        model.to(device)  # type: ignore[arg-type]  # transformers' .to stub
    whole = count_parameters(model)
    per_rank = 2 if schedule == "interleaved_1f1b" else 1
    tied_name = _cut_stage(model, stage, stages, per_rank)
    # FSDP2 warns that the root returned a view: on a stage without the head, the model's "logits"
    # are a slice of its hidden states. The schedule only sends them on, never edits them in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    pipeline = Pipeline(
        stage=stage,
        stages=stages,
        schedule=schedule,
        microbatches=microbatches,
        group=stages_mesh.get_group(),
        device=device,
        tied_name=tied_name,
        tied_group=_tied_groups(mesh) if tied_name else None,
        whole_parameters=whole,
    )
    owned = sum(p.numel() for p in model.parameters())
    log.info(
        "pipeline parallel: rank %d of %d in its pipeline (%d stage(s) each) holds %s parameter elements",
        stage + 1,
        stages,
        per_rank,
        f"{owned:,}",
    )
    return mesh, pipeline


def _stage_layers(index: int, total: int, layers: int) -> range:
    """The decoder layers of stage `index` of `total`: consecutive, the same count each."""
    per_stage = layers // total
    return range(index * per_stage, (index + 1) * per_stage)


# distributed.pipeline_schedule -> the torch schedule that runs it as configured.
_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


def _schedule_class(schedule: str, chunks: int, ranks: int) -> Any:
    """torch's schedule for `chunks` pipeline micro-batches over `ranks` ranks. A short last batch
    (fewer chunks than 1F1B needs) runs the all-forwards-first variant: the same sums."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
    )

    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B if chunks >= ranks and chunks % ranks == 0 else ScheduleLoopedBFS
    return Schedule1F1B if schedule == "1f1b" and chunks >= ranks else ScheduleGPipe


def schedule_note(schedule: str, kind: Any, *, rows: int, chunks: int, ranks: int) -> str | None:
    """The warning for a batch that runs on another schedule than distributed.pipeline_schedule, or
    None. Only a batch shorter than the configured micro-batches (the last of an epoch) gets one:
    config/layout_rules.py refuses a configured count the schedule cannot take."""
    if kind.__name__ == _SCHEDULE_CLASSES[schedule]:
        return None
    return (
        f"pipeline_parallel: a batch of {rows} rows runs as {chunks} pipeline micro-batches, which {schedule} "
        f"cannot take over {ranks} ranks; torch's {kind.__name__} runs this batch (the same sums)"
    )


def _cut_stage(model: PreTrainedModel, stage: int, stages: int, per_rank: int) -> str | None:
    """Replace what this rank's stages do not own by pass-throughs; the tied embedding's name."""
    from lmforge.distributed.pipeline_stages import PassThrough, StageLayers

    base: Any = getattr(model, model.base_model_prefix)
    total = stages * per_rank
    owned = {
        i for index in range(stage, total, stages) for i in _stage_layers(index, total, len(base.layers))
    }
    base.layers = StageLayers(
        layer if index in owned else PassThrough() for index, layer in enumerate(base.layers)
    )
    first, last = stage == 0, stage == stages - 1
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    embedding_name = _module_name(model, model.get_input_embeddings()) + ".weight"
    if not first and not (tied and last):  # the last stage keeps a tied embedding: it is the head
        base.embed_tokens = PassThrough()
    if not last:
        base.norm = PassThrough()
        model.lm_head = PassThrough()
        # transformers re-ties lm_head to the embedding on load; only the last stage has a head.
        model.all_tied_weights_keys = {}
    return embedding_name if tied else None


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def _tied_groups(mesh: Any) -> Any:
    """The (first stage, last stage) group of each pipeline; every rank creates every group
    (a collective), and keeps its own pipeline's."""
    import torch.distributed as dist

    rows = mesh.mesh.tolist()
    mine = None
    for row in rows:
        group = dist.new_group([row[0], row[-1]])
        if dist.get_rank() in (row[0], row[-1]):
            mine = group
    return mine


def whole_parameter_count(model: nn.Module, pipeline: Pipeline | None) -> int:
    """The model's distinct parameters (tied weights once), all stages of `pipeline` included."""
    from lmforge.models.build import count_parameters

    if pipeline is not None:
        return pipeline.whole_parameters
    return count_parameters(model)


class PipelineParallel(DimensionHooks):
    """Pipeline parallelism as a parallel dimension: the training step, evaluation, gradient norm,
    checkpointed optimizer and final model of a pipeline-parallel model; everything else is the
    Trainer's FSDP2 path. The adapter runs lmforge's own step (token counts, drills) around it."""

    name = "pipeline"

    def problems(self, settings: DistributedConfig, model_config: Any, world_size: int) -> list[str]:
        pp = settings.pipeline_parallel
        if pp == 1:
            return []
        layers = getattr(model_config, "num_hidden_layers", None)
        model_type = getattr(model_config, "model_type", "?")
        problems = []
        if not getattr(model_config, "base_model_pp_plan", None):
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

    def planner_degrees(
        self, shape: ModelShape, *, world: int, gpus_per_node: int, seq_len: int
    ) -> list[int]:
        return [p for p in divisors(world) if shape.num_layers % p == 0]

    def planner_refusal(self, shape: ModelShape, degrees: Mapping[str, int]) -> str | None:
        if degrees.get(self.name, 1) > 1 and shape.model_type and shape.model_type not in STAGEABLE_FAMILIES:
            return f"pipeline stages are cut for {', '.join(sorted(STAGEABLE_FAMILIES))} only"
        return None

    def planner_split(self, degree: int, work: Workload) -> MemorySplit:
        if degree == 1:
            return MemorySplit()
        # Each micro-batch is cut into m chunks; 1F1B keeps min(p, m) of them in flight on the
        # first stage, GPipe all m. Bubble: (p - 1) / (v m + p - 1), v = 2 under interleaved 1F1B.
        chunks = work.pipeline_microbatches or degree
        held = chunks if work.gpipe else min(degree, chunks)
        virtual = 2 if work.interleaved else 1
        bubble = (degree - 1) / (virtual * chunks + degree - 1)
        return MemorySplit(layers=degree, chunks=chunks, chunks_held=held, bubble=bubble)

    def used_by(self, layout: Layout) -> bool:
        return layout.pipeline > 1

    def apply(self, model: nn.Module, state: ParallelState) -> None:
        assert state.layout is not None
        hf_model: Any = model
        found = split_into_stages(
            hf_model,
            state.layout,
            on_gpu=state.on_gpu,
            schedule=state.pipeline_schedule,
            microbatches=state.pipeline_microbatches,
        )
        if found is not None:
            state.mesh, state.pipeline = found

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
        import torch

        pipeline: Pipeline | None = state.pipeline
        if pipeline is None:
            return None
        inputs = trainer._prepare_inputs(inputs)
        if not training:
            pipeline.normalizer = float(_label_tokens(inputs["labels"]))  # this batch's mean, as HF's eval
            with torch.no_grad():
                return pipeline.run(model, inputs, training=False)
        model.train()
        pipeline.normalizer = _step_normalizer(trainer, inputs, num_items)
        loss = pipeline.run(model, inputs, training=True)
        if trainer.accelerator.sync_gradients:  # the step's last micro-batch: gradients are whole
            whole: Any = trainer.model
            pipeline.add_tied_gradients(whole)
        return loss

    def grad_norm(
        self, state: ParallelState, trainer: Trainer, model: nn.Module, max_norm: float
    ) -> torch.Tensor | None:
        pipeline: Pipeline | None = state.pipeline
        return pipeline.grad_norm(model, max_norm) if pipeline is not None else None

    def save_optimizer(self, state: ParallelState, trainer: Trainer, output_dir: str) -> bool:
        import torch

        from lmforge.ckpt.reshard_states import save_flat_dcp_optimizer

        if state.pipeline is None:
            return False
        from accelerate.utils import save_fsdp_model

        # The model's DCP shards as the Trainer writes them (the stages' keys are distinct); the
        # optimizer with its group settings keyed by parameter name (save_flat_dcp_optimizer).
        model: Any = trainer.model
        optimizer: Any = trainer.optimizer
        schedule: Any = trainer.lr_scheduler
        save_fsdp_model(trainer.accelerator.state.fsdp_plugin, trainer.accelerator, model, output_dir)
        save_flat_dcp_optimizer(model, optimizer, Path(output_dir))
        if trainer.args.should_save:
            torch.save(schedule.state_dict(), Path(output_dir) / "scheduler.pt")
        return True

    def save_model(
        self, state: ParallelState, trainer: Trainer, output_dir: str, dtype: torch.dtype | None
    ) -> bool:
        if state.pipeline is None:
            return False
        save_pipeline_model(trainer, state.pipeline, output_dir, dtype)
        return True


PIPELINE = PipelineParallel()


def _saved(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A gathered weight as final/ stores it: in the configured dtype, on the CPU, contiguous."""
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    return value.detach().cpu().contiguous()


def _label_tokens(labels: torch.Tensor) -> int:
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _step_normalizer(trainer: Any, inputs: dict[str, Any], num_items_in_batch: Any) -> float:
    """What HF's loss divides by: the step's token count over all data ranks (then times the
    data degree, since the data ranks' gradients are averaged), or, without a count, this
    micro-batch's tokens times the accumulation steps."""
    if num_items_in_batch is None:
        return float(_label_tokens(inputs["labels"]) * trainer.current_gradient_accumulation_steps)
    count = float(num_items_in_batch)
    if trainer.args.average_tokens_across_devices:
        count /= trainer.accelerator.num_processes // trainer.get_tp_size()
    return count


def save_pipeline_model(trainer: Any, pipeline: Pipeline, output_dir: str, dtype: torch.dtype | None) -> None:
    """final/ as one safetensors shard per stage under one index, as `save_pretrained` shards a
    large model: each stage writes its own weights (no gather of the whole model on one rank),
    rank 0 the index, config and generation config. A collective: every rank calls it."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lmforge.distributed.pipeline_stages import PassThrough

    model = trainer.model
    # Gathered over the data ranks (FSDP2), this stage's weights only.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if pipeline.tied_name is not None and not pipeline.first:
        state.pop(pipeline.tied_name, None)  # written once, by the first stage
    head = model.get_output_embeddings()
    if pipeline.tied_name is not None and head is not None and not isinstance(head, PassThrough):
        state.pop(_module_name(model, head) + ".weight", None)  # from_pretrained ties it back
    tensors = {key: _saved(value, dtype) for key, value in state.items() if isinstance(value, torch.Tensor)}
    name = f"model-{pipeline.stage + 1:05d}-of-{pipeline.stages:05d}.safetensors"
    out = Path(output_dir)
    if dist.get_rank() < pipeline.stages:  # the stages of data rank 0 (stages are the inner mesh dimension)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    sizes = {key: t.numel() * t.element_size() for key, t in tensors.items()}
    shards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (name, sizes))  # after every stage wrote its file
    if dist.get_rank() != 0:
        return
    weight_map = {key: shard for shard, sized in shards for key in sized}
    total = sum(size for _, sized in shards[: pipeline.stages] for size in sized.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = model.config
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(str(out))
