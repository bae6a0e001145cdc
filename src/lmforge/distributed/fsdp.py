"""FSDP2 through the HF Trainer, on GPUs and on CPU (gloo) alike.

Why this module exists: with `use_cpu=True` under torchrun, accelerate's `AcceleratorState`
classifies the run as `DistributedType.MULTI_CPU` and only upgrades *GPU-like* distributed types
to `DistributedType.FSDP` when an FSDP plugin is given. The Trainer still passes the plugin, but
the state silently drops it, so every rank trains a full DDP replica. `torch.distributed.fsdp.
fully_shard` itself works on CPU with gloo, so the only thing missing is that state switch.
The `DataShard` dimension applies it right after the Trainer builds its Accelerator (its `wrap`
hook, called by the Trainer adapter, train/hf_trainer.py); from then on the Trainer and
accelerate take their own FSDP2 paths (`fsdp2_prepare_model`, DTensor-aware grad clipping,
torch-DCP checkpoint save/load), exactly as on CUDA, where the switch does nothing. No sharding
code lives here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.config.model_kind import run_processor_files
from lmforge.distributed.expert_parallel import shard_experts_over_data
from lmforge.distributed.layout import Layout
from lmforge.distributed.parallel_state import DimensionHooks, ParallelState
from lmforge.distributed.plan_terms import MemorySplit
from lmforge.distributed.tensor_parallel import shard_data_over_mesh
from lmforge.run_layout import RunPaths

if TYPE_CHECKING:
    # Annotations only (the imports a run needs are in its functions): `plan_layout` and the
    # planner read this dimension's checks before the training stack loads.
    import torch
    from torch import nn
    from transformers import Trainer

    from lmforge.distributed.plan_terms import Workload

__all__ = [
    "DATA_SHARD",
    "DataShard",
    "enable_cpu_fsdp",
    "fsdp_training_arguments",
    "local_parameter_numel",
]


def _layer_classes_to_wrap(model: nn.Module) -> list[str]:
    """Layer class names FSDP2 should shard as units: the repeated blocks `_no_split_modules`
    points at.

    Transformers models list their repeated blocks (e.g. `LlamaDecoderLayer`) there. accelerate
    falls back to the same list, but naming the classes makes the saved TrainingArguments
    self-describing; names not instantiated in this model are dropped because accelerate raises
    on a class it cannot find. Some entries are a part of a block rather than the block: Idefics3
    (SmolVLM) lists its vision tower's `Idefics3VisionAttention`, so wrapping by the list leaves the
    tower's MLPs and norms in the root unit, gathered whole for every forward and mixed with
    trained parameters. Such an entry is replaced by the repeated block holding it (the element of
    an `nn.ModuleList`), here `Idefics3EncoderLayer`: one unit per tower layer, all frozen together
    when the tower is frozen.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    found: dict[str, str] = {}  # a listed class -> the class of the repeated block that holds it
    for path, module in model.named_modules():  # in model order: the same list on every rank
        name = type(module).__name__
        if name in names and name not in found:
            found[name] = _repeated_block(model, path) or name
    return list(dict.fromkeys(found.values()))


def _repeated_block(model: nn.Module, path: str) -> str | None:
    """The class name of the innermost `nn.ModuleList` element on the way to the module at `path`
    (the module itself when it is one), or None when no list holds it."""
    from torch import nn

    parts = path.split(".") if path else []
    found = None
    for depth in range(1, len(parts)):
        parent = model.get_submodule(".".join(parts[:depth]))
        if isinstance(parent, nn.ModuleList):
            found = type(parent[int(parts[depth])]).__name__
    return found


def fsdp_training_arguments(
    model: nn.Module,
    *,
    sharded_checkpoints: bool = True,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    offload: bool = False,
    wrap_layers: bool = True,
) -> dict[str, Any]:
    """`TrainingArguments` kwargs that select FSDP2 full sharding for `model`.

    - `fsdp=True` + `fsdp_config["version"] = 2`: the transformers 5.x spelling (strings such as
      "full_shard auto_wrap" are deprecated; FSDP2 expresses the strategy as
      `reshard_after_forward`: True = ZeRO-3-like full shard, False = ZeRO-2-like).
    - `state_dict_type="SHARDED_STATE_DICT"`: intermediate checkpoints are torch DCP directories
      written by every rank in parallel (no gather of the full model on rank 0). Plain
      `Trainer.save_model()` then writes no weights; `DataShard.save_model` gathers and writes the
      full HF safetensors model instead.
    - `activation_checkpointing` here (FSDP's own) is preferred over the TrainingArguments
      `gradient_checkpointing`, which adds a redundant all-gather in backward.
    - `offload`: parameters, gradients and optimizer states live in CPU memory between uses
      (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU).
    - `wrap_layers=False`: lmforge wraps the model itself (a tensor-parallel model, on its 2-D mesh:
      distributed/tensor_parallel.py); accelerate's wrap policy would look the layer classes up by
      name and not find them behind FSDP2's wrapper classes.
    """
    config: dict[str, Any] = {
        "version": 2,
        "reshard_after_forward": reshard_after_forward,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if wrap_layers else "NO_WRAP",
        "state_dict_type": "SHARDED_STATE_DICT" if sharded_checkpoints else "FULL_STATE_DICT",
        "activation_checkpointing": activation_checkpointing,
        "cpu_ram_efficient_loading": False,
        "cpu_offload": offload,
    }
    layers = _layer_classes_to_wrap(model) if wrap_layers else []
    if layers:
        config["transformer_layer_cls_to_wrap"] = layers
    return {"fsdp": True, "fsdp_config": config}


def enable_cpu_fsdp(accelerator: Any, fsdp_plugin: Any) -> bool:
    """Switch an already-built CPU `Accelerator` from MULTI_CPU to FSDP; True if it did.

    Mirrors what `AcceleratorState.__init__` does for GPU types (set the distributed type, hand
    the plugin its mixed precision, store it). The type lives in two shared-state dicts
    (`AcceleratorState` and `PartialState`); both must change, or objects created later
    (dataloaders, `GradientState`, other `AcceleratorState()` instances) see the old value.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if fsdp_plugin is None or state.distributed_type != DistributedType.MULTI_CPU:
        return False  # no FSDP requested, or accelerate already chose (GPU: FSDP already set)
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


class DataShard(DimensionHooks):
    """The data-shard dimension: real FSDP2 on CPU/gloo (also over the data dimension of a
    tensor-parallel, context-parallel, expert-parallel or pipeline model's mesh), and a full HF model
    from `save_model` under FSDP and DeepSpeed (gathered from the shards, without a duplicate of a
    tied output head).

    In effect in every run: each hook checks the engine the Trainer runs. The state switch is a no-op
    unless the run is multi-process CPU and the TrainingArguments request FSDP
    (`fsdp_plugin_args`); on CUDA accelerate already picks FSDP.
    """

    name = "data_shard"

    def planner_split(self, degree: int, work: Workload) -> MemorySplit:
        return MemorySplit(states=degree)

    def used_by(self, layout: Layout) -> bool:
        return True

    def wrap(self, state: ParallelState, trainer: Trainer) -> None:
        plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
        if plugin_args is None:
            return
        from accelerate.utils import FullyShardedDataParallelPlugin

        # The Trainer built a plugin from the same args, but the state discarded it; rebuild it
        # the same way rather than reaching into the Accelerator's constructor arguments.
        plugin = FullyShardedDataParallelPlugin(**plugin_args)
        if enable_cpu_fsdp(trainer.accelerator, plugin):
            # Trainer.__init__ calls this hook *before* deciding model placement, and every later
            # FSDP branch (no device move, FSDP2 prepare with the optimizer, DCP checkpoint
            # save/load, full-state save_model) keys off this flag, so setting it here suffices.
            trainer.is_fsdp_enabled = True
        # A tensor-parallel, expert-parallel or pipeline model gets its FSDP2 over the data dimension
        # of its own mesh here, with this plugin's settings (the experts first: a parameter belongs
        # to its innermost FSDP2 unit); accelerate's prepare() then finds it already wrapped.
        model: Any = trainer.model
        shard_experts_over_data(model, state, getattr(trainer.accelerator.state, "fsdp_plugin", None))
        shard_data_over_mesh(trainer, state.mesh, _layer_classes_to_wrap(model))

    def model_checkpointed(self, state: ParallelState, trainer: Trainer, checkpoint: str) -> None:
        if not trainer.args.should_save:
            return
        if _sharded(trainer):
            _save_model_description(trainer, Path(checkpoint))
        _copy_processor_files(trainer, Path(checkpoint))

    def save_model(
        self, state: ParallelState, trainer: Trainer, output_dir: str, dtype: torch.dtype | None
    ) -> bool:
        """Always a full HF model, where the Trainer's `save_model` would not write one.

        Under FSDP with `SHARDED_STATE_DICT` the Trainer's `save_model` writes *no weights at all*
        (it leaves that to the DCP checkpoint). The end-of-training export must produce
        `model.safetensors` for `from_pretrained`, so gather the full state dict with accelerate (a
        collective: every rank must call this) and let rank 0 save it. Checkpoint saves keep the
        Trainer's behaviour (the adapter does not ask here): the DCP shards are the resumable state
        and gathering the full model there would cost a full all-gather per save.
        """
        # DeepSpeed's gathered state dict also carries the tied head: gather it the same way.
        if not (_sharded(trainer) or trainer.is_deepspeed_enabled):
            return False
        engine = trainer.deepspeed if trainer.is_deepspeed_enabled else trainer.model
        state_dict = trainer.accelerator.get_state_dict(
            engine
        )  # a collective; ZeRO-3 returns it on rank 0 only
        if trainer.is_deepspeed_enabled and dtype is not None:
            state_dict = _in_configured_dtype(
                trainer.accelerator.unwrap_model(trainer.model), state_dict, dtype
            )
        if trainer.args.should_save:
            trainer._save(output_dir, state_dict=_without_tied_head(trainer.model, state_dict))
            if dtype is not None:
                _record_dtype(Path(output_dir), dtype)
        return True


DATA_SHARD = DataShard()


def _sharded(trainer: Trainer) -> bool:
    """FSDP writing sharded (DCP) checkpoints: the Trainer's own save_model writes no weights."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return bool(
        trainer.is_fsdp_enabled and plugin is not None and "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    )


def _save_model_description(trainer: Any, checkpoint: Path) -> None:
    """config.json, generation config and tokenizer beside a checkpoint's DCP shards. The Trainer
    writes none of them under SHARDED_STATE_DICT, so `lmforge ckpt consolidate checkpoints/step-N`
    had no config to build the model from and asked for --config."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    checkpoint.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(checkpoint)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(checkpoint)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(checkpoint)


def _copy_processor_files(trainer: Any, checkpoint: Path) -> None:
    """A vision-language model's processor settings beside every checkpoint's model, from the folder
    the model was loaded from (what final/ copies too): the Trainer saves the tokenizer alone, so
    `lmforge ckpt consolidate` of a sharded checkpoint, or AutoProcessor on a checkpoint, found
    no image processor."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    run = RunPaths(Path(trainer.args.output_dir).parent.parent)  # output_dir is checkpoints/.staging
    for source in run_processor_files(getattr(model, "name_or_path", None) or None, run.processor):
        shutil.copy2(source, checkpoint / source.name)


def _in_configured_dtype(
    model: Any, state_dict: dict[str, Any] | None, dtype: torch.dtype
) -> dict[str, Any] | None:
    """DeepSpeed's bf16/fp16 modes train a 16-bit copy of the module and keep fp32 master weights in
    the optimizer; its state dict is the 16-bit copy. The saved model must be what a single process
    of the same config saves (`model.dtype`), so trained weights come from the masters (a
    collective: every rank calls this) and everything else is cast."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for name, param in model.named_parameters():
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is not None:
            masters[name] = full
    if state_dict is None:  # ZeRO-3 gathers onto rank 0 only
        return None
    return {
        key: (masters.get(key, value).to(dtype).cpu() if value.is_floating_point() else value)
        for key, value in state_dict.items()
    }


def _record_dtype(model_dir: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype its weights were written in (save_pretrained takes it from the
    module's parameters, which DeepSpeed cast)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return  # an adapter directory: adapter_config.json carries no dtype
    config = json.loads(path.read_text(encoding="utf-8"))
    config["dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _without_tied_head(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The gathered state dict holds a tied output head as a tensor of its own; the saved model
    must not (from_pretrained ties it back), or final/ would differ from a plain save."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config.get_text_config(), "tie_word_embeddings", False):
        return state_dict
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if head is not None and module is head:
            state_dict.pop(f"{name}.weight", None)
    return state_dict


def local_parameter_numel(model: nn.Module) -> int:
    """Parameter elements this rank really stores: a DTensor's local shard (FSDP2), a ZeRO-3
    partition (`ds_tensor`), else the whole tensor.

    Under FSDP2 every parameter is a DTensor sharded on dim 0; `.numel()` would report the global
    size, which is why sharding has to be checked through `.to_local()`.
    """
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        partition = getattr(p, "ds_tensor", None)
        data: torch.Tensor = (
            partition if partition is not None else p.to_local() if isinstance(p, DTensor) else p
        )
        total += data.numel()
    return total
