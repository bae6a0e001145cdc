"""The out-of-memory ladder: what a run does when memory runs out with nothing left to halve.

The in-process back-off (train/step.py) runs each micro-batch as 2, 4, ... chunks. Once a chunk
is one sample, or in any distributed run (ranks split in lockstep or not at all), the run stops
and `lmforge launch` restarts it from the newest complete checkpoint with the next rung of
`monitor.guard.oom_ladder` switched on:

    the worker (`climb`)                                the launcher (cli/launch.py)
      next rung: the first of the ladder that is
        not on yet and applies to this run
      an oom_ladder event; the rung and its step
        appended to <run>/oom_ladder.json
      exit OOM_LADDER_EXIT                              a rung was recorded during the attempt:
                                                        one line, then the same command again with
                                                        every recorded rung's overrides; resume is
                                                        train.resume=auto (the newest checkpoint)
      no rung left, or the ladder is []: a `failed`
        event, what was tried and what to do next, exit 1

A rung is a list of `key=value` overrides, as the command line takes them. None of them changes
the maths of a step (train/provenance.py's MATHS_KEYS), so resuming with them is not refused.
This module imports no torch: the launcher reads the ladder before any worker starts.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.ckpt.atomic import check_checkpoint, list_step_dirs
from lmforge.config import LmforgeConfig
from lmforge.config.schema import OOM_RUNGS
from lmforge.config.stages import stage_spec
from lmforge.errors import WorkFailed
from lmforge.monitor.events import EventLog
from lmforge.run_layout import RunPaths, read_json_object

if TYPE_CHECKING:
    from lmforge.train.step import OutOfMemoryGivenUp

# Exit code of a worker that stopped for a restart one rung up the ladder (documented in
# `lmforge launch --help`; 0, 1, 2 and 3 are taken, see cli/main.py).
OOM_LADDER_EXIT = 4
# Not one of RunPaths.owned(): an attempt set aside because it ended before its first checkpoint
# (train/run_start.py) keeps the rungs it took; run.overwrite forgets them (`forget_rungs`).
LADDER_FILE = "oom_ladder.json"
# Set by `lmforge launch` for its workers: someone restarts them, so a worker only says why it stops.
DRIVER_ENV = "LMFORGE_OOM_LADDER_DRIVER"
RESTART_OVERRIDES = ("run.overwrite=false", "train.resume=auto")  # a restart always resumes
RUNG_WORDS = {
    "gradient_checkpointing": "gradient checkpointing",
    "chunked_cross_entropy": "the chunked cross-entropy loss",
    "activation_offload": "activation offload",
    "offload": "CPU offload of the sharded states",
}


@dataclass(frozen=True)
class TrainingEngine:
    """The engine this worker trains on, as distributed/strategy.py resolved it."""

    name: str = "none"  # none | ddp | fsdp | deepspeed
    zero_stage: int | None = None
    offload: str = "none"
    on_gpu: bool = False


@dataclass(frozen=True)
class RungChoice:
    """The next rung for this run (None: the ladder is used up or off) and the rungs passed over."""

    rung: str | None
    number: int = 0  # 1-based place in monitor.guard.oom_ladder
    overrides: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "<words> (<why>)"


def rung_overrides(rung: str, cfg: LmforgeConfig, engine: TrainingEngine) -> tuple[list[str], str]:
    """The overrides that switch `rung` on for this run, or ([], why it is passed over)."""
    train = cfg.train
    if rung == "gradient_checkpointing":
        return (
            ([], "already on")
            if train.gradient_checkpointing
            else (["train.gradient_checkpointing=true"], "")
        )
    if rung == "chunked_cross_entropy":
        if train.chunked_cross_entropy:
            return [], "already on"
        if not stage_spec(train.stage).language_model_loss:
            return [], f"stage {train.stage} computes its own loss"
        if train.kernels == "liger":
            return [], "Liger's fused loss never builds the logits either"
        if engine.name == "fsdp" or (engine.name == "deepspeed" and engine.zero_stage == 3):
            return [], "it calls the head in backward, where FSDP / ZeRO-3 released the sharded weight"
        return ["train.chunked_cross_entropy=true"], ""
    if rung == "activation_offload":
        if train.activation_offload:
            return [], "already on"
        if not engine.on_gpu:
            return [], "training on the CPU: activations are in host memory already"
        return ["train.activation_offload=true"], ""
    return _offload(cfg, engine)


def _offload(cfg: LmforgeConfig, engine: TrainingEngine) -> tuple[list[str], str]:
    if engine.offload != "none":
        return [], "already on"
    if engine.name in ("none", "ddp"):
        return [], "a single process shards nothing" if engine.name == "none" else "ddp shards nothing"
    if not engine.on_gpu:
        return [], "training on the CPU: the states are in host memory already"
    if engine.name == "fsdp":
        return ["distributed.offload=optimizer+params"], ""
    if cfg.distributed.deepspeed_config is not None:
        return [], "distributed.deepspeed_config (your own DeepSpeed JSON) decides offload"
    if (engine.zero_stage or 0) < 2:
        return [], f"DeepSpeed offloads from ZeRO-2 up and this run is ZeRO-{engine.zero_stage}"
    return ["distributed.offload=optimizer"], ""


def _pin(cfg: LmforgeConfig, engine: TrainingEngine) -> list[str]:
    """`distributed.strategy: auto` decides again at each start; a restart must keep the engine
    that wrote the checkpoints (a sharded checkpoint resumes only under its own engine)."""
    if cfg.distributed.strategy != "auto" or engine.name == "none":
        return []
    pin = [f"distributed.strategy={engine.name}"]
    if engine.name == "deepspeed":
        pin += [f"distributed.zero_stage={engine.zero_stage}", f"distributed.offload={engine.offload}"]
    return pin


def next_rung(cfg: LmforgeConfig, engine: TrainingEngine) -> RungChoice:
    """The first rung of monitor.guard.oom_ladder that is not on yet and applies to this run."""
    skipped: list[str] = []
    for number, rung in enumerate(cfg.monitor.guard.oom_ladder, start=1):
        overrides, why = rung_overrides(rung, cfg, engine)
        if overrides:
            return RungChoice(rung, number, [*_pin(cfg, engine), *overrides], skipped)
        skipped.append(f"{RUNG_WORDS[rung]} ({why})")
    return RungChoice(None, skipped=skipped)


# -- oom_ladder.json: the rungs taken, oldest first ------------------------------------------------
def read_rungs(run_dir: Path) -> list[dict[str, Any]]:
    """The rungs <run_dir>/oom_ladder.json records as taken ([] without one)."""
    rungs = read_json_object(run_dir / LADDER_FILE).get("rungs")
    if not isinstance(rungs, list):
        return []
    return [r for r in rungs if isinstance(r, dict) and r.get("rung") in OOM_RUNGS]


def overrides_of(rungs: list[dict[str, Any]]) -> list[str]:
    """Every override of the rungs taken, in the order they were taken."""
    return [str(o) for rung in rungs for o in rung.get("overrides", [])]


def forget_rungs(run_dir: Path) -> None:
    """A run started over (run.overwrite) starts without the rungs an earlier run took."""
    (run_dir / LADDER_FILE).unlink(missing_ok=True)


def _write_rungs(run_dir: Path, rungs: list[dict[str, Any]]) -> None:
    """Replace oom_ladder.json atomically (written aside, fsynced, renamed)."""
    path = run_dir / LADDER_FILE
    partial = path.with_name(LADDER_FILE + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(json.dumps({"rungs": rungs}, indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


# -- the worker ---------------------------------------------------------------------------------
class OomRestart(WorkFailed):
    """The run stopped for a restart one rung up the OOM ladder (exit code OOM_LADDER_EXIT).

    Its message is for `lmforge train` run alone: how to go on; under `lmforge launch` the
    oom_ladder event already said it and the launcher restarts the run."""


def climb(
    oom: OutOfMemoryGivenUp,
    cfg: LmforgeConfig,
    engine: TrainingEngine,
    paths: RunPaths,
    events: EventLog,
    *,
    rank: int,
) -> WorkFailed:
    """After `oom`: record the next rung (an oom_ladder event, oom_ladder.json) and return the
    OomRestart to stop with; or, with no rung left, a `failed` event and the WorkFailed saying
    what was tried and what to do next. On the rank that ran out of memory (the others wait in a
    collective until the launcher stops them)."""
    taken = read_rungs(paths.root)
    choice = next_rung(cfg, engine)
    at = f"out of memory at step {oom.step} with micro-batch {oom.micro_batch}"
    if choice.rung is None:
        stopped = f"{at}, {_nothing_left(cfg, taken, choice)}"
        events.emit("failed", oom.step, stopped, rank=rank, error=str(oom.__cause__ or oom))
        return WorkFailed(f"{stopped}. {_what_next(cfg, engine)}")
    checkpoint = _newest_checkpoint(paths)
    entry = {
        "rung": choice.rung,
        "number": choice.number,
        "of": len(cfg.monitor.guard.oom_ladder),
        "step": oom.step,
        "micro_batch": oom.micro_batch,
        "checkpoint": checkpoint,
        "overrides": choice.overrides,
        "skipped": choice.skipped,
        "error": str(oom.__cause__ or oom),
        "time": time.time(),
    }
    # One record per rung and step: ranks out of memory together, or `lmforge train` run again
    # without the rung, get here with the same one.
    if not taken or (taken[-1]["rung"], taken[-1].get("step")) != (choice.rung, oom.step):
        _write_rungs(paths.root, [*taken, entry])
    events.emit("oom_ladder", oom.step, restart_line(entry, verb="restart"), rank=rank, **_fields(entry))
    return OomRestart(
        f"{at}. Under `lmforge launch` (also with --nproc-per-node 1) the run restarts by itself from "
        f"{_where(checkpoint)} with {RUNG_WORDS[choice.rung]} on (rung {choice.number} of {entry['of']} of "
        "monitor.guard.oom_ladder), one rung further at each such out-of-memory; or resume it yourself: this "
        f"`lmforge train` command with {' '.join(choice.overrides)}"
    )


def restart_line(entry: dict[str, Any], *, verb: str = "restarting") -> str:
    """`out of memory at step 3 with micro-batch 1: restarting from checkpoints/step-2 with gradient
    checkpointing on (rung 1 of 4)` for the rung `entry` records, and the rungs passed over."""
    words = RUNG_WORDS.get(str(entry.get("rung")), str(entry.get("rung")))
    text = (
        f"out of memory at step {entry.get('step')} with micro-batch {entry.get('micro_batch')}: {verb} from "
        f"{_where(entry.get('checkpoint'))} with {words} on (rung {entry.get('number')} of {entry.get('of')})"
    )
    skipped = entry.get("skipped") or []
    return text + (f"; passed over: {', '.join(skipped)}" if skipped else "")


def _fields(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        key: entry[key] for key in ("rung", "number", "of", "micro_batch", "checkpoint", "overrides", "error")
    }


def _where(checkpoint: str | None) -> str:
    return checkpoint or "the start (no complete checkpoint yet)"


def _newest_checkpoint(paths: RunPaths) -> str | None:
    """checkpoints/step-N of the newest sealed checkpoint (its hashes are checked when it resumes)."""
    for directory in list_step_dirs(paths.checkpoints):
        if check_checkpoint(directory, verify_hashes=False).complete:
            return f"{paths.checkpoints.name}/{directory.name}"
    return None


def _nothing_left(cfg: LmforgeConfig, taken: list[dict[str, Any]], choice: RungChoice) -> str:
    if not cfg.monitor.guard.oom_ladder:
        return "and the OOM ladder is off (monitor.guard.oom_ladder: [])"
    tried = [f"{RUNG_WORDS.get(r['rung'], r['rung'])} at step {r.get('step')}" for r in taken]
    text = "and the OOM ladder has no rung left"
    text += f"; tried: {', '.join(tried)}" if tried else ""
    return text + (f"; passed over: {', '.join(choice.skipped)}" if choice.skipped else "")


def _what_next(cfg: LmforgeConfig, engine: TrainingEngine) -> str:
    hints = [
        "lower data.max_length or train.micro_batch_size (raise train.grad_accum to keep the global batch)"
    ]
    if not cfg.monitor.guard.oom_ladder:
        switches = [o for rung in OOM_RUNGS for o in rung_overrides(rung, cfg, engine)[0]]
        if switches:
            hints.append(f"save memory with {' '.join(switches)}")
    hints.append(
        "train on more devices (`lmforge launch CONFIG --nproc-per-node N` with distributed.strategy fsdp or "
        "deepspeed; `lmforge estimate CONFIG` shows the memory per device of each)"
    )
    return f"What to try next: {'; '.join(hints)}; or a smaller model"
