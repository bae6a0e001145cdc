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
|                            |                                   | checkpoint (`ckpt/universal.py`),        |
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

The resume functions at the bottom (`resumed_from`, `load_resumed_model`, `load_resumed_optimizer`,
`load_stand_in_rng`), which the Trainer adapter (train/hf_trainer.py) calls from HF's resume
hooks, do the loading, through the readers and writers in
`ckpt/reshard_states.py` and `ckpt/universal.py`. Every read runs inside
`ckpt/safe_load.py:no_code_from_checkpoints` (train/runner.py holds it for the whole run): DCP
metadata goes through lmforge's allow-list and every `torch.load`, `ds_to_universal`'s included,
is weights-only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from lmforge.ckpt.reshard_states import (
    DCP_OPTIMIZER_DIR,
    dcp_optimizer_is_flat,
    has_whole_states,
    is_dcp_checkpoint,
    load_dcp_model,
    load_dcp_optimizer,
    load_whole_model,
    load_whole_optimizer,
    restore_rng,
    rng_stand_in,
)
from lmforge.ckpt.universal import convert_to_universal, is_zero_checkpoint, universal_dir
from lmforge.ckpt.whole_to_universal import optimizer_group_names
from lmforge.distributed.deepspeed_config import zero_stage_of
from lmforge.distributed.ranks import wait_for_everyone
from lmforge.errors import UserInputError

if TYPE_CHECKING:
    from transformers import Trainer

log = logging.getLogger(__name__)

WRITER_FILE = "lmforge_writer.json"

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
    rollbacks included, then goes through `convert_to_universal` (`resumed_from`)."""
    deepspeed["checkpoint"] = {**deepspeed.get("checkpoint", {}), "load_universal": True}


def loads_universal(deepspeed: Any) -> bool:
    return isinstance(deepspeed, dict) and bool(deepspeed.get("checkpoint", {}).get("load_universal"))


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


# ---- the resume, as HF Trainer's hooks reach it (train/hf_trainer.py calls these) ----


@contextlib.contextmanager
def resumed_from(trainer: Trainer, checkpoint: str | None) -> Iterator[str | None]:
    """The checkpoint HF should resume from (`Trainer.train`'s argument).

    Where the DeepSpeed config loads universal checkpoints, rank 0 converts the checkpoint first
    (a ZeRO one with `ds_to_universal`, whole states with `whole_to_universal`; the others wait)
    into this run's checkpoints/.staging, and HF resumes from the converted directory, removed
    afterwards; a rollback in the same launch passes here too. Otherwise `checkpoint` itself."""
    deepspeed: Any = trainer.args.deepspeed  # the config as a dict once the Trainer has read it
    if checkpoint is None or not loads_universal(deepspeed):
        yield checkpoint
        return
    source = Path(checkpoint)
    target = universal_dir(source, Path(str(trainer.args.output_dir)))
    if trainer.is_world_process_zero():
        whole = not is_zero_checkpoint(source) and has_whole_states(source)
        convert_to_universal(
            source,
            target,
            whole_groups=optimizer_group_names(trainer) if whole else None,
            zero_stage=zero_stage_of(deepspeed),
        )
    wait_for_everyone()
    try:
        yield str(target)
    finally:
        if trainer.is_world_process_zero():  # derived data: the next launch that needs it converts again
            shutil.rmtree(target, ignore_errors=True)


def load_resumed_model(trainer: Trainer, checkpoint: str, model: torch.nn.Module | None) -> bool:
    """Load a checkpoint's model where HF cannot (`_load_from_checkpoint`); False leaves it to HF.

    Whole states under FSDP2 (accelerate's FSDP2 load reads torch DCP shards only): each rank keeps
    its shards. An FSDP2 checkpoint resumed without FSDP: loaded into the plain model (HF refuses)."""
    source = Path(checkpoint)
    target: Any = model if model is not None else trainer.model
    if trainer.is_fsdp_enabled and has_whole_states(source):
        if trainer.is_world_process_zero():
            log.info("resuming the whole model and optimizer of %s: each rank keeps its shards", source)
        load_whole_model(target, source)
        return True
    if trainer.is_fsdp_enabled or not is_dcp_checkpoint(source):
        return False
    load_dcp_model(target, source)
    return True


def load_resumed_optimizer(trainer: Trainer, checkpoint: str | None) -> bool:
    """Load a checkpoint's optimizer and schedule where HF cannot (`_load_optimizer_and_scheduler`);
    False leaves it to HF. Also splits the step counters of a ZeRO-3 universal load and gives each
    parameter group its own settings again (HF calls the hook right after DeepSpeed loaded the
    checkpoint into its engine)."""
    deepspeed: Any = trainer.args.deepspeed  # the config as a dict once the Trainer has read it
    if checkpoint is not None and trainer.is_deepspeed_enabled and loads_universal(deepspeed):
        engine: Any = trainer.model_wrapped
        separate_step_counters(engine.optimizer)
        if zero_stage_of(deepspeed) == 3:
            restore_group_settings(engine.optimizer, Path(checkpoint))
    if checkpoint is None:
        return False
    source = Path(checkpoint)
    model: Any = trainer.model
    optimizer: Any = trainer.optimizer
    schedule: Any = trainer.lr_scheduler
    if trainer.is_fsdp_enabled and has_whole_states(source):
        load_whole_optimizer(model, optimizer, source)
        schedule.load_state_dict(torch.load(source / "scheduler.pt", weights_only=True))
        return True
    plain = not (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled)
    # accelerate's FSDP2 load reads group settings by position: a flattened checkpoint (pipeline
    # stages wrote it) loads here, under FSDP2 too.
    flat = (
        trainer.is_fsdp_enabled
        and is_dcp_checkpoint(source)
        and dcp_optimizer_is_flat(source / DCP_OPTIMIZER_DIR)
    )
    if not is_dcp_checkpoint(source) or not (plain or flat):
        return False
    load_dcp_optimizer(model, optimizer, source, collective=flat)
    # Rank 0 saved the schedule as a plain torch file, as under every engine.
    schedule.load_state_dict(torch.load(source / "scheduler.pt", weights_only=True))
    return True


def load_stand_in_rng(trainer: Trainer, checkpoint: str | None) -> bool:
    """A rank with no RNG file of its own in `checkpoint` (another world size wrote it) continues a
    writer rank's (`_load_rng_state`); False leaves it to HF."""
    args = trainer.args
    if checkpoint is None:
        return False
    stand_in = rng_stand_in(Path(checkpoint), rank=args.process_index, world_size=args.world_size)
    if stand_in is None:
        return False
    restore_rng(stand_in, distributed=args.world_size > 1)
    return True
