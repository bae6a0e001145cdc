"""Resuming a checkpoint under another world size: which path applies, and the conversions.

Every checkpoint records the engine and world size that wrote it (`lmforge_writer.json`); a
resume takes one of these paths (`resume_path`):

| written by                 | this run                          | path                                     |
|----------------------------|-----------------------------------|------------------------------------------|
| one process or DDP         | one process, DDP, FSDP2 (+ TP),   | `whole`: HF loads the whole states;      |
|                            | any world size                    | under FSDP2 each rank keeps its shards   |
|                            |                                   | (`load_whole_model`/`_optimizer`)        |
| one process or DDP         | DeepSpeed ZeRO-1/2/3, any world   | `deepspeed_universal`: its whole states  |
|                            | size                              | written as DeepSpeed's universal         |
|                            |                                   | checkpoint (`whole_to_universal.py`),    |
|                            |                                   | then `load_universal`                    |
| the same engine and world  |                                   | `same`                                   |
| FSDP2 (torch DCP)          | FSDP2, another world size         | `dcp_reshard`: accelerate's DCP load;    |
|                            |                                   | DCP's metadata keeps each tensor's       |
|                            |                                   | global shape and offsets, so each rank   |
|                            |                                   | reads its new shard                      |
| FSDP2 (torch DCP)          | one process, or DDP               | `dcp_to_plain`: loaded by parameter name |
|                            |                                   | into the plain model and optimizer       |
| DeepSpeed ZeRO-N           | ZeRO-N, another world size        | `deepspeed_universal`: DeepSpeed's       |
|                            |                                   | `ds_to_universal`, then `load_universal` |
| anything else              | (another engine or ZeRO stage)    | refused: consolidate, start a new run    |

`ReshardResume` (a Trainer mixin) does the loading. Every read here runs inside
`ckpt/safe_load.py:no_code_from_checkpoints` (train/runner.py holds it for the whole run): DCP
metadata goes through lmforge's allow-list and every `torch.load`, `ds_to_universal`'s included,
is weights-only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lmforge.distributed.deepspeed_config import zero_stage_of
from lmforge.distributed.ranks import wait_for_everyone
from lmforge.distributed.whole_to_universal import optimizer_group_names, whole_weights
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)

WRITER_FILE = "lmforge_writer.json"
# accelerate's FSDP checkpoint directories (FSDP_MODEL_NAME / OPTIMIZER_NAME, index 0), torch DCP each.
DCP_MODEL_DIR = "pytorch_model_fsdp_0"
DCP_OPTIMIZER_DIR = "optimizer_0"
_RNG_FILE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")

ResumeKind = Literal["whole", "same", "dcp_reshard", "dcp_to_plain", "deepspeed_universal"]
_HOW = {
    "dcp_reshard": "torch DCP reshards it as it loads",
    "dcp_to_plain": "its torch DCP shards load into the whole model and optimizer",
    "deepspeed_universal": "through DeepSpeed's universal checkpoint",
}


def write_writer(checkpoint: Path, summary: dict[str, Any]) -> None:
    (checkpoint / WRITER_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")


def read_writer(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint / WRITER_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class ResumePath:
    """How a checkpoint loads under this run: the path, and the engine of each side in words."""

    kind: ResumeKind
    wrote: str
    now: str

    @property
    def resharded(self) -> bool:
        return self.kind in _HOW

    def describe(self) -> str:
        return f"resuming a checkpoint of {self.wrote} as {self.now}: {_HOW.get(self.kind, 'as written')}"


def resume_path(checkpoint: Path, writer: dict[str, Any] | None, now: dict[str, Any]) -> ResumePath:
    """The path that resumes `checkpoint` (written by `writer`; None before lmforge recorded one)
    under the engine `now` (both as `Plan.summary()` records them). UserInputError where no engine
    loads it, with the reason and the way forward."""
    if writer is None:  # written before lmforge recorded its writer: a single-process or DDP checkpoint
        writer = {"engine": "none"}
    kind = _kind(writer, now)
    if kind is None:
        raise UserInputError(_refusal(checkpoint, writer, now))
    if kind == "deepspeed_universal" and (checkpoint / "adapter_model.safetensors").is_file():
        # The universal checkpoint is written from whole model states (whole_to_universal.py).
        raise UserInputError(
            f"train.resume: {checkpoint} holds a LoRA adapter (adapter_model.safetensors), and lmforge writes "
            "DeepSpeed's universal checkpoint from whole model states only. Fix: resume it with "
            "distributed.strategy=ddp (on any number of processes) or in one process"
        )
    wrote = engine_words(writer) if "world_size" in writer else "an unrecorded engine"
    return ResumePath(kind, wrote, engine_words(now))


def _kind(writer: dict[str, Any], now: dict[str, Any]) -> ResumeKind | None:
    engine = writer["engine"]
    if engine not in ("fsdp", "deepspeed"):
        # Whole states load under FSDP2 (with or without TP: `load_whole_model`), DDP and one process,
        # on any world size. DeepSpeed loads only its own ZeRO checkpoints: lmforge writes the whole
        # states as its universal checkpoint, which every ZeRO stage and world size loads.
        return "deepspeed_universal" if now["engine"] == "deepspeed" else "whole"
    same_stage = writer.get("zero_stage") == now.get("zero_stage")
    if engine == now["engine"] and writer["world_size"] == now["world_size"] and same_stage:
        return "same"
    if engine == "fsdp":
        # FSDP with one process trains as a single process (strategy.plan_for).
        return {"fsdp": "dcp_reshard", "none": "dcp_to_plain", "ddp": "dcp_to_plain"}.get(now["engine"])  # type: ignore[return-value]
    return "deepspeed_universal" if now["engine"] == "deepspeed" and same_stage else None


def _refusal(checkpoint: Path, writer: dict[str, Any], now: dict[str, Any]) -> str:
    if writer["engine"] == now["engine"] == "deepspeed":
        why = (
            "DeepSpeed's universal checkpoint resumes under another world size, not another ZeRO stage "
            "(it keeps its stage's layout: a ZeRO-3 engine reads zero_pp_rank_* model states, ZeRO-1/2 "
            "write mp_rank_* ones)"
        )
        fix = f"relaunch with distributed.zero_stage={writer.get('zero_stage')}"
    else:
        shards = "DeepSpeed's ZeRO partitions" if writer["engine"] == "deepspeed" else "torch DCP shards"
        loader = "a single process" if now["engine"] == "none" else now["engine"]
        why = f"it holds {shards}, which {loader} does not load"
        fix = f"relaunch with distributed.strategy={writer['engine']}"
        if writer["engine"] == "deepspeed":
            fix += f" distributed.zero_stage={writer.get('zero_stage')}"
    return (
        f"train.resume: {checkpoint} was written by {engine_words(writer)} and this run is "
        f"{engine_words(now)}; {why}. Fix: {fix} (on any number of processes), or make a whole model "
        f"of it with `lmforge ckpt consolidate {checkpoint} --out DIR` and start a new run from it "
        "(model.path=DIR, train.resume=never)"
    )


def engine_words(summary: dict[str, Any]) -> str:
    engine = summary["engine"]
    if engine == "none":
        return "one process"
    if engine == "deepspeed":
        engine = f"deepspeed ZeRO-{summary.get('zero_stage')}"
    return f"{engine} on {summary['world_size']} process(es)"


# ---- DeepSpeed: the universal checkpoint ----


def load_universal(deepspeed: dict[str, Any]) -> None:
    """Make a DeepSpeed config load universal checkpoints: every checkpoint the launch resumes,
    rollbacks included, then goes through `convert_to_universal` (`ReshardResume.train`)."""
    deepspeed["checkpoint"] = {**deepspeed.get("checkpoint", {}), "load_universal": True}


def loads_universal(deepspeed: Any) -> bool:
    return isinstance(deepspeed, dict) and bool(deepspeed.get("checkpoint", {}).get("load_universal"))


def universal_dir(checkpoint: Path, staging: Path) -> Path:
    """Where the universal form of `checkpoint` goes: in the run being trained, never in the run
    resumed from (it may be another run's, or read-only). `staging` is the run's checkpoints/.staging
    (HF's output_dir): removed with the run's partial writes (`clear_partial_writes`) should a launch
    die before removing it, and under a name (step-N.universal) that no tool takes for a checkpoint."""
    return staging / f"{checkpoint.name}.universal"


def is_zero_checkpoint(checkpoint: Path) -> bool:
    """Whether DeepSpeed wrote `checkpoint` (its global_step*/ directories); a ZeRO-3 checkpoint holds
    a gathered model.safetensors too, so `has_whole_states` alone does not tell."""
    return any(p.is_dir() for p in checkpoint.glob("global_step*"))


def convert_to_universal(
    checkpoint: Path, target: Path, *, whole_groups: list[list[str]] | None = None, zero_stage: int = 0
) -> Path:
    """Write the universal form of `checkpoint` at `target`, atomically, with the files HF Trainer
    reads on a resume; one process does it. A ZeRO checkpoint goes through DeepSpeed's
    `ds_to_universal` (whole fp32 weights and optimizer moments per parameter, whatever the world
    size that wrote them); the whole states of one process or DDP (`whole_groups`: this run's
    optimizer groups by parameter name) are written in that layout directly."""
    from deepspeed.checkpoint import ds_to_universal

    from lmforge.distributed.whole_to_universal import write_universal_from_whole

    tags = sorted(p for p in checkpoint.glob("global_step*") if p.is_dir())
    if not tags and whole_groups is None:
        raise UserInputError(f"train.resume: {checkpoint} holds no DeepSpeed global_step* directory")
    partial = target.with_name(f".{target.name}.partial")
    started = time.perf_counter()
    try:
        shutil.rmtree(partial, ignore_errors=True)
        if whole_groups is not None:
            write_universal_from_whole(checkpoint, partial, group_names=whole_groups, zero_stage=zero_stage)
        else:
            printed = io.StringIO()  # DeepSpeed's progress prints: train.log gets them, the console one line
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                ds_to_universal.main(_universal_arguments(tags[-1], partial / tags[-1].name))
            log.debug("ds_to_universal:\n%s", printed.getvalue())
        _link_trainer_files(checkpoint, partial)
        shutil.rmtree(target, ignore_errors=True)  # left by a launch killed before it removed it
        os.rename(partial, target)
    except OSError as err:
        raise UserInputError(
            f"train.resume: could not write the universal form of {checkpoint} into {target.parent} ({err}); "
            "free space there (run.output_dir) or resume under distributed.strategy=fsdp or ddp"
        ) from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # a refused or failed conversion leaves nothing
    log.info(
        "converted %s checkpoint %s to a universal checkpoint at %s (%.1f s); it is removed when this launch ends",
        "DeepSpeed" if whole_groups is None else "whole-state",
        checkpoint,
        target,
        time.perf_counter() - started,
    )
    return target


def _link_trainer_files(checkpoint: Path, target: Path) -> None:
    """What HF Trainer (and a TRL trainer) reads besides the engine's files: trainer state, scheduler,
    RNG states. Hard links where the file system allows (the copy sits next to the original)."""
    for source in checkpoint.iterdir():
        if not source.is_file() or source.name == "latest":  # DeepSpeed's tag pointer: not universal
            continue
        try:
            os.link(source, target / source.name)
        except OSError:
            shutil.copy2(source, target / source.name)


def _universal_arguments(source: Path, output: Path) -> argparse.Namespace:
    """`ds_to_universal`'s command line (its `parse_arguments`): every option, with these values."""
    return argparse.Namespace(
        input_folder=str(source),
        output_folder=str(output),
        num_extract_workers=1,  # in this process: its loads stay under lmforge's weights-only guard
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # HF Trainer's DeepSpeed checkpoints carry no universal_checkpoint_info (Megatron-DeepSpeed
        # writes it); data-parallel ZeRO checkpoints need nothing in it but its version.
        inject_missing_state=True,
    )


def separate_step_counters(zero_optimizer: Any) -> int:
    """Give each parameter sub-group its own Adam step counter again; returns how many were split.

    DeepSpeed 0.19.8's ZeRO-3 universal load (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`)
    puts one `step` tensor object into the state of every sub-group. torch's Adam adds 1 to the
    step in place, once per sub-group, so the counter runs ahead and every bias correction after
    the resume is wrong: the resumed loss left the uninterrupted curve by 6e-5 after one step and
    3e-3 after two (ZeRO-3 2 -> 1 and 2 -> 4 processes; equal to it with the counters split)."""
    inner = getattr(zero_optimizer, "optimizer", None)  # the torch optimizer ZeRO steps
    if inner is None:
        return 0
    seen: set[int] = set()
    split = 0
    for state in inner.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
                split += 1
            seen.add(id(step))
    return split


def restore_group_settings(zero_optimizer: Any, universal: Path) -> int:
    """Give each parameter group its own settings (lr, weight_decay, ...) again after a ZeRO-3
    universal load; returns how many groups it set.

    DeepSpeed 0.19.8's `load_hp_checkpoint_state_from_checkpoint_dir_stage3` copies the settings of
    group 0 into every group, so HF's no-decay group (norms, biases) decays after the resume: with
    weight_decay 0.5 a resumed ZeRO-3 run left the uninterrupted curve by 1.3e-4 relative one step
    after the resume and 2e-4 after two. The universal checkpoint keeps every group's settings in
    zero/optimizer_state.pt, in the optimizer's group order, which ZeRO-3 keeps (sub-groups step
    inside their own group)."""
    inner = getattr(zero_optimizer, "optimizer", None)  # the torch optimizer ZeRO steps
    tag = universal / "latest_universal"
    if inner is None or not tag.is_file():
        return 0
    state = universal / tag.read_text(encoding="utf-8").strip() / "zero" / "optimizer_state.pt"
    saved = torch.load(state, map_location="cpu", weights_only=True)["param_groups"]
    if len(saved) != len(inner.param_groups):
        return 0
    for group, theirs in zip(inner.param_groups, saved, strict=True):
        group.update({key: value for key, value in theirs.items() if key != "params"})
    return len(saved)


# ---- torch DCP (FSDP2) into a plain model and optimizer ----


def is_dcp_checkpoint(checkpoint: Path) -> bool:
    return (checkpoint / DCP_MODEL_DIR / ".metadata").is_file()


def load_dcp_model(model: torch.nn.Module, checkpoint: Path) -> None:
    """The FSDP2 checkpoint's model state into a plain (unsharded) `model`: DCP reads each whole
    tensor from the shards its metadata locates."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    # accelerate saved {"model": <state dict by parameter name>}; the template says what to read.
    state = {"model": get_model_state_dict(model)}
    _load_in_this_process(state, checkpoint / DCP_MODEL_DIR)
    set_model_state_dict(model, state["model"])


def load_dcp_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path, *, collective: bool = False
) -> None:
    """The FSDP2 checkpoint's optimizer state (moments, step counts, group settings) into the
    `optimizer` of `model`: the plain one of a single process or DDP replica, or (`collective`,
    every rank calls it) this rank's shard. DCP keys each state by parameter name, not position,
    so it lands on the same parameter whatever order this optimizer holds them in; a flattened
    checkpoint (`save_flat_dcp_optimizer`) keys the group settings by parameter name too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    directory = checkpoint / DCP_OPTIMIZER_DIR
    options = StateDictOptions(flatten_optimizer_state_dict=dcp_optimizer_is_flat(directory))
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    # The template creates the empty moments to fill.
    state = {"optimizer": get_optimizer_state_dict(model, inner, options=options)}
    if collective:
        dcp.load(state, checkpoint_id=str(directory))
    else:
        _load_in_this_process(state, directory)
    set_optimizer_state_dict(model, inner, state["optimizer"], options=options)


def save_flat_dcp_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path
) -> None:
    """The optimizer as a torch DCP checkpoint where the group settings (lr, betas, ...) are keyed
    by parameter name like the moments. accelerate's format keeps one list of groups, which DCP
    takes from a single rank: right when every rank holds a shard of every parameter (FSDP2), but
    ranks that hold different parameters (pipeline stages) would each lose theirs (measured: a
    resume failed with KeyError 'betas'). A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {"optimizer": get_optimizer_state_dict(model, inner, options=options)}
    dcp.save(state, checkpoint_id=str(checkpoint / DCP_OPTIMIZER_DIR))


def dcp_optimizer_is_flat(directory: Path) -> bool:
    """Whether a DCP optimizer checkpoint keys its group settings by parameter name (flattened)
    rather than by group position ("optimizer.param_groups.0.lr")."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    prefix = "optimizer.param_groups."
    return any(key.startswith(prefix) and not key[len(prefix) :].split(".")[0].isdigit() for key in keys)


def _load_in_this_process(state: dict[str, Any], directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # Each process reads the whole state (one process, or each DDP replica): no collective, even
    # where a process group exists. DCP warns about that intent where there is none.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)


# ---- whole states (one process, DDP) into sharded parameters (FSDP2, FSDP2 + TP) ----

_WHOLE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def has_whole_states(checkpoint: Path) -> bool:
    """Whether `checkpoint` holds a whole model and optimizer as HF writes them in one process or
    a DDP replica (model.safetensors, optimizer.pt), rather than torch DCP shards."""
    return not is_dcp_checkpoint(checkpoint) and any((checkpoint / name).is_file() for name in _WHOLE_WEIGHTS)


def load_whole_model(model: torch.nn.Module, checkpoint: Path) -> None:
    """A whole model's weights into `model`, whose parameters are sharded DTensors (FSDP2, on a 1-D
    or a 2-D tensor-parallel mesh): every rank reads the file and keeps its own shard (torch's
    `set_model_state_dict` with full state dicts distributes each tensor to the parameter's mesh and
    placements). A tied output head is absent from the file; it is the embedding's parameter."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    weights = whole_weights(checkpoint)
    expected = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    missing = sorted({name for name, _ in model.named_parameters()} - set(weights))
    if missing:
        raise UserInputError(
            f"train.resume: {checkpoint} holds no weights for {', '.join(missing[:5])}: it was written for "
            "another model; resume it with the model config that wrote it"
        )
    state: dict[str, Any] = {key: value for key, value in weights.items() if key in expected}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def load_whole_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """A whole optimizer state (HF's optimizer.pt of one process: moments keyed by position in the
    parameter groups) into the `optimizer` of the sharded `model`. Both optimizers were built the
    same way from the same model (HF's decay / no-decay groups in parameter order), so position i
    of group g is the same parameter; torch's `set_optimizer_state_dict` then keys by parameter name
    and keeps each rank's shard of every moment."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    saved = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    names = {id(param): name for name, param in model.named_parameters()}
    shapes = [len(group["params"]) for group in saved["param_groups"]]
    if shapes != [len(group["params"]) for group in inner.param_groups]:
        raise UserInputError(
            f"train.resume: {checkpoint}/optimizer.pt holds parameter groups of {shapes} parameters and this "
            f"run's optimizer {[len(g['params']) for g in inner.param_groups]}: another model or optimizer "
            "wrote it; resume it with the config that wrote it"
        )
    state: dict[str, Any] = {}
    groups = []
    for theirs, ours in zip(saved["param_groups"], inner.param_groups, strict=True):
        fqns = [names[id(param)] for param in ours["params"]]
        for index, fqn in zip(theirs["params"], fqns, strict=True):
            if index in saved["state"]:
                state[fqn] = saved["state"][index]
        groups.append({**theirs, "params": fqns})
    set_optimizer_state_dict(
        model, inner, {"state": state, "param_groups": groups}, options=StateDictOptions(full_state_dict=True)
    )


# ---- RNG states of another world size ----


def rng_stand_in(checkpoint: Path, *, rank: int, world_size: int) -> Path | None:
    """The RNG file this rank continues from when the checkpoint has none under the name HF looks
    for (another world size wrote it): rank r takes writer rank r mod N's. None when HF finds its
    own file, or there is none at all."""
    own = "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"
    if (checkpoint / own).is_file():
        return None
    found = {}
    for path in checkpoint.glob("rng_state*.pth"):
        match = _RNG_FILE.match(path.name)
        if match:
            found[int(match.group(1) or 0)] = path
    if not found:
        return None
    ranks = sorted(found)
    return found[ranks[rank % len(ranks)]]


def restore_rng(path: Path, *, distributed: bool) -> None:
    """Python, numpy, torch CPU (and CUDA) RNG states from an HF `rng_state*.pth`, as HF restores them."""
    from transformers.trainer_pt_utils import safe_globals, set_rng_state_for_device

    with safe_globals():  # HF's allow-list for numpy's RNG state
        state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        set_rng_state_for_device("CUDA", torch.cuda, state, distributed)


class ReshardResume:
    """Trainer mixin: resumes checkpoints another world size wrote (the module's table).

    - `train`: where the DeepSpeed config loads universal checkpoints, rank 0 converts the
      checkpoint first (a ZeRO one with `ds_to_universal`, whole states with `whole_to_universal`;
      the others wait) into this run's checkpoints/.staging and HF resumes from the converted
      directory; a rollback in the same launch passes here too.
    - `_load_optimizer_and_scheduler`: also splits the step counters of a ZeRO-3 universal load and
      gives each parameter group its own settings again.
    - `_load_from_checkpoint` / `_load_optimizer_and_scheduler`: an FSDP2 checkpoint resumed
      without FSDP loads into the plain model and optimizer (HF refuses it there).
    - `_load_rng_state`: a rank with no RNG file of its own continues a writer rank's.
    """

    def train(
        self, resume_from_checkpoint: str | None = None, trial: Any = None, ignore_keys_for_eval: Any = None
    ) -> Any:
        trainer: Any = self  # a mixin: the Trainer attributes exist only on the final class
        if resume_from_checkpoint is None or not loads_universal(trainer.args.deepspeed):
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)  # type: ignore[misc]
        checkpoint = Path(resume_from_checkpoint)
        target = universal_dir(checkpoint, Path(trainer.args.output_dir))
        if trainer.is_world_process_zero():
            whole = not is_zero_checkpoint(checkpoint) and has_whole_states(checkpoint)
            convert_to_universal(
                checkpoint,
                target,
                whole_groups=optimizer_group_names(trainer) if whole else None,
                zero_stage=zero_stage_of(trainer.args.deepspeed),
            )
        wait_for_everyone()
        try:
            return super().train(str(target), trial, ignore_keys_for_eval)  # type: ignore[misc]
        finally:
            if trainer.is_world_process_zero():  # derived data: the next launch that needs it converts again
                shutil.rmtree(target, ignore_errors=True)

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        trainer: Any = self
        checkpoint = Path(resume_from_checkpoint)
        if trainer.is_fsdp_enabled and has_whole_states(checkpoint):
            # accelerate's FSDP2 load reads torch DCP shards only
            if trainer.is_world_process_zero():
                log.info(
                    "resuming the whole model and optimizer of %s: each rank keeps its shards", checkpoint
                )
            load_whole_model(model if model is not None else trainer.model, checkpoint)
            return
        if trainer.is_fsdp_enabled or not is_dcp_checkpoint(checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        load_dcp_model(model if model is not None else trainer.model, checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        trainer: Any = self
        if (
            checkpoint is not None
            and trainer.is_deepspeed_enabled
            and loads_universal(trainer.args.deepspeed)
        ):
            # HF calls this right after DeepSpeed loaded the checkpoint into its engine.
            separate_step_counters(trainer.model_wrapped.optimizer)
            if zero_stage_of(trainer.args.deepspeed) == 3:
                restore_group_settings(trainer.model_wrapped.optimizer, Path(checkpoint))
        if checkpoint is not None and trainer.is_fsdp_enabled and has_whole_states(Path(checkpoint)):
            load_whole_optimizer(trainer.model, trainer.optimizer, Path(checkpoint))
            trainer.lr_scheduler.load_state_dict(
                torch.load(Path(checkpoint) / "scheduler.pt", weights_only=True)
            )
            return
        plain = not (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled)
        # accelerate's FSDP2 load reads group settings by position: a flattened checkpoint (pipeline
        # stages wrote it) loads here, under FSDP2 too.
        flat = (
            checkpoint is not None
            and trainer.is_fsdp_enabled
            and is_dcp_checkpoint(Path(checkpoint))
            and dcp_optimizer_is_flat(Path(checkpoint) / DCP_OPTIMIZER_DIR)
        )
        if checkpoint is None or not is_dcp_checkpoint(Path(checkpoint)) or not (plain or flat):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        load_dcp_optimizer(trainer.model, trainer.optimizer, Path(checkpoint), collective=flat)
        # Rank 0 saved the schedule as a plain torch file, as under every engine.
        trainer.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / "scheduler.pt", weights_only=True))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        trainer: Any = self
        args = trainer.args
        stand_in = None
        if checkpoint is not None:
            stand_in = rng_stand_in(Path(checkpoint), rank=args.process_index, world_size=args.world_size)
        if stand_in is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        restore_rng(stand_in, distributed=args.world_size > 1)
