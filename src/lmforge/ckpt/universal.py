"""A checkpoint written as DeepSpeed's universal checkpoint, which every ZeRO stage loads on any
world size: a ZeRO checkpoint through DeepSpeed's `ds_to_universal`, whole states (one process,
DDP) through `whole_to_universal.py`. Written atomically next to the run's partial writes, with
the files HF Trainer reads on a resume; `distributed/reshard.py` decides when a resume needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import time
from pathlib import Path

from lmforge.ckpt.whole_to_universal import write_universal_from_whole
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)


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
