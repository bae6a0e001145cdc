"""Setting a run up in its run directory, before any model is built: how it starts, its data,
what changed since the launch that wrote it, and the records that say what ran."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase, set_seed

from lmforge.ckpt.atomic import remove_within
from lmforge.config import LmforgeConfig
from lmforge.data.run_data import RunData, prepare_data_for_run
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.distributed.deepspeed_config import write_resolved
from lmforge.distributed.ranks import main_first
from lmforge.distributed.strategy import Plan, check_resume_world
from lmforge.monitor.metrics import MetricsLog
from lmforge.run_layout import RunPaths
from lmforge.train.provenance import (
    LaunchChanges,
    changes_since_last_launch,
    keep_launch_history,
    refuse_unless_allowed,
)
from lmforge.train.run_start import RunStart, decide_start
from lmforge.train.rundir import write_manifest, write_resolved_config

log = logging.getLogger(__name__)


@dataclass
class RunSetup:
    start: RunStart
    tokenizer: PreTrainedTokenizerBase | None = None  # None when the run had finished already
    data: RunData | None = None
    changes: LaunchChanges = field(default_factory=lambda: LaunchChanges([], []))


def set_up_run(cfg: LmforgeConfig, plan: Plan, paths: RunPaths) -> RunSetup:
    """Decide how the run starts (fresh, resumed, extended, finished), get the tokenizer and the
    data; on a resume, check what changed since the last launch (train/provenance.py) and keep
    that launch's records in history/; write config.yaml and manifest.json. Rank 0 goes first and
    writes; the other ranks then read the run directory and the data cache it filled."""
    world = plan.world
    with main_first(world):
        start = decide_start(cfg.train, paths, overwrite=cfg.run.overwrite, act=world.is_main)
        if start.finished is not None:
            return RunSetup(start)
        resume = start.resume
        check_resume_world(resume.path if resume else None, plan)
        if world.is_main:
            clear_partial_writes(paths)  # leftovers of a save or final/ interrupted by a crash
        set_seed(cfg.run.seed)
        tokenizer, data = prepare_data_for_run(
            cfg, paths, write_report=world.is_main, rank=world.rank, world_size=world.size
        )
        # config.yaml records what ran: train.precision as the plan resolved it (auto -> bf16 ...).
        resolved = cfg.model_copy(
            update={"train": cfg.train.model_copy(update={"precision": plan.precision})}
        )
        fingerprints = {
            "data_fingerprint": data.fingerprint,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        }
        changes = LaunchChanges([], [])
        if world.is_main:
            if resume is not None:
                changes = changes_since_last_launch(
                    resolved, paths, fingerprints, data_parallel=plan.layout.data
                )
                refuse_unless_allowed(changes, cfg, paths)  # before any model is built
                keep_launch_history(paths)
            write_resolved_config(resolved, paths)
            write_manifest(paths, **fingerprints, distributed=plan.summary())
            if plan.deepspeed is not None:
                write_resolved(plan.deepspeed, paths.deepspeed_config)
            if resume is not None:
                dropped = MetricsLog(paths.metrics).truncate_after(resume.step)
                log.info("resuming from %s (%d metric records after it dropped)", resume.path, dropped)
    return RunSetup(start, tokenizer, data, changes)


def write_in_progress(paths: RunPaths) -> Path | None:
    """The partial directory of the checkpoint or final/ being written when a failure struck, if any."""
    partial = list(paths.staging.glob("checkpoint-*")) if paths.staging.is_dir() else []
    if partial:
        return max(partial, key=lambda p: p.stat().st_mtime)
    return paths.final_partial if paths.final_partial.exists() else None


def clear_partial_writes(paths: RunPaths) -> None:
    """Remove what an interrupted or failed save left half-written; sealed checkpoints and final/
    are never partial (each appears with one rename)."""
    for partial in (paths.staging, paths.final_partial):
        try:
            remove_within(partial, paths.root)
        except OSError as err:
            log.error("could not remove the partial %s: %s", partial, err)
