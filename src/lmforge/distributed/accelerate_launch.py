"""Workers started by `accelerate launch` (directly, or through `lmforge launch --backend accelerate`).

accelerate passes its choices to the workers in the environment (ACCELERATE_USE_DEEPSPEED,
ACCELERATE_DEEPSPEED_ZERO_STAGE, ACCELERATE_USE_FSDP, ACCELERATE_MIXED_PRECISION, ...). lmforge
builds the engine itself from `distributed.*`, so those choices are read once here: mapped onto
`distributed.*` when the config leaves the strategy to auto, refused when they contradict it, and
then removed from the environment so that HF Trainer's Accelerator builds only what lmforge asked.

Measured with accelerate 1.15 on a machine without CUDA: `accelerate launch --num_processes 2 --cpu`
(or a MULTI_CPU config without mpirun, or no --multi_gpu at all) starts ONE process; several CPU
processes start only with `--multi_gpu` (torchrun underneath, gloo). A worker that finds itself
alone although more were asked for stops with the command that works.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lmforge.config.schema import DistributedConfig
from lmforge.errors import UserInputError

# Set by every `accelerate launch` (its default is "no"): how a worker knows who started it.
LAUNCHED_BY = "ACCELERATE_MIXED_PRECISION"
_ENGINE_VARIABLES = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_CONFIG_DS_FIELDS")
_ENGINE_PREFIXES = ("ACCELERATE_DEEPSPEED_", "FSDP_")


@dataclass(frozen=True)
class AccelerateChoice:
    """What the accelerate launch asked of the engine, from the workers' environment."""

    engine: str | None  # "deepspeed", "fsdp" or None (plain data parallel)
    zero_stage: int | None = None
    offload: str = "none"
    deepspeed_config_file: Path | None = None
    mixed_precision: str = "no"
    grad_accum: int | None = None

    def words(self) -> str:
        if self.engine == "deepspeed":
            return f"DeepSpeed ZeRO-{self.zero_stage}" + (
                f", offload {self.offload}" if self.offload != "none" else ""
            )
        return "FSDP" if self.engine == "fsdp" else "data parallel"


def accelerate_choice(env: Mapping[str, str]) -> AccelerateChoice | None:
    """The accelerate launch's choices, or None when accelerate did not start this worker."""
    if LAUNCHED_BY not in env:
        return None
    accumulation = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    common: dict[str, Any] = {
        "mixed_precision": env[LAUNCHED_BY],
        "grad_accum": int(accumulation) if accumulation and accumulation.isdigit() else None,
    }
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        offload = "none"
        if env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") == "cpu":
            offload = "optimizer"
        if env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") == "cpu":
            offload = "optimizer+params"
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return AccelerateChoice(
            "deepspeed",
            zero_stage=int(stage) if stage and stage.isdigit() else None,
            offload=offload,
            deepspeed_config_file=Path(config_file) if config_file and config_file != "none" else None,
            **common,
        )
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return AccelerateChoice("fsdp", **common)
    return AccelerateChoice(None, **common)


def settings_for_accelerate(
    dist: DistributedConfig, choice: AccelerateChoice, *, grad_accum: int
) -> tuple[DistributedConfig, str | None]:
    """`distributed.*` with the accelerate config's engine when the lmforge config leaves it to auto
    (and a note saying so); a contradiction is an error naming both."""
    if choice.grad_accum not in (None, 1, grad_accum):
        raise UserInputError(
            f"accelerate launch: the accelerate config's gradient_accumulation_steps is {choice.grad_accum} but "
            f"train.grad_accum is {grad_accum}; set train.grad_accum (lmforge's config decides the batch)"
        )
    if choice.engine is None:
        return dist, None
    wanted: dict[str, Any] = {"strategy": choice.engine}
    if choice.engine == "deepspeed":
        if choice.deepspeed_config_file is not None:
            wanted = {"strategy": "deepspeed", "deepspeed_config": choice.deepspeed_config_file}
        else:
            wanted.update(zero_stage=choice.zero_stage or dist.zero_stage, offload=choice.offload)
    configured = dist.strategy != "auto" or dist.deepspeed_config is not None
    if not configured:
        return dist.model_copy(update=wanted), f"accelerate launch asked for {choice.words()}"
    if dist.strategy not in ("auto", choice.engine) or (
        choice.engine == "deepspeed"
        and choice.deepspeed_config_file is None
        and choice.zero_stage is not None
        and dist.deepspeed_config is None
        and choice.zero_stage != dist.zero_stage
    ):
        ours = (
            dist.strategy if dist.strategy != "deepspeed" else f"deepspeed with zero_stage {dist.zero_stage}"
        )
        raise UserInputError(
            f"accelerate launch asked for {choice.words()} but the config says distributed.strategy: {ours}; "
            "say it in one place: leave distributed.strategy at auto (the accelerate config decides) or "
            "launch with an accelerate config without an engine section (distributed_type: MULTI_GPU)"
        )
    return dist, None


def forget_engine_choice(env: MutableMapping[str, str]) -> None:
    """Remove accelerate's engine variables once lmforge has taken them into `distributed.*`: HF
    Trainer's Accelerator would otherwise build a second, differently configured engine from them."""
    for name in list(env):
        if name in _ENGINE_VARIABLES or name.startswith(_ENGINE_PREFIXES):
            del env[name]


def check_precision(choice: AccelerateChoice, precision: str) -> None:
    """`accelerate launch --mixed_precision X` must agree with train.precision (which decides).
    train.precision fp8 autocasts to bf16 around torchao's float8 layers (train/fp8.py): bf16 agrees
    with it, and accelerate's own fp8 (a second float8 conversion) does not."""
    if choice.mixed_precision == "fp8":
        raise UserInputError(
            "accelerate launch --mixed_precision fp8 converts the model with accelerate's own float8 backend; "
            "lmforge trains in float8 through train.precision: fp8 (torchao). Fix: drop --mixed_precision "
            "(or pass bf16) and set train.precision: fp8"
        )
    if choice.mixed_precision in ("no", precision) or (precision, choice.mixed_precision) == ("fp8", "bf16"):
        return
    raise UserInputError(
        f"accelerate launch --mixed_precision {choice.mixed_precision}, but train.precision resolved to "
        f"{precision}; set train.precision: {choice.mixed_precision} (lmforge's config decides precision) or "
        "drop --mixed_precision"
    )


def check_all_processes_started(world_size: int, asked: int | None) -> None:
    """accelerate started one process although `asked` were asked for: stop and say what works."""
    if asked is None or asked <= 1 or world_size > 1:
        return
    raise UserInputError(
        f"accelerate launch started 1 process although {asked} were asked for: without CUDA, accelerate "
        "starts several processes only with --multi_gpu (torchrun, gloo on CPU; --cpu and MULTI_CPU need "
        f"mpirun). Run `accelerate launch --multi_gpu --num_processes {asked} -m lmforge.cli.main train "
        f"CONFIG`, or `lmforge launch CONFIG --backend accelerate --nproc-per-node {asked}`"
    )


def processes_asked(launcher_argv: Sequence[str]) -> int | None:
    """How many processes the `accelerate launch` command line asked for: --num_processes, else its
    config file's num_processes (the given --config_file, or accelerate's default one)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--num_processes", "--num-processes", type=int)
    parser.add_argument("--config_file", "--config-file")
    known, _ = parser.parse_known_args(list(launcher_argv))
    if known.num_processes is not None:
        return int(known.num_processes)
    config_file = known.config_file or _default_accelerate_config()
    if config_file is None or not Path(config_file).is_file():
        return None
    with open(config_file, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    value = data.get("num_processes") if isinstance(data, dict) else None
    return int(value) if isinstance(value, int) else None


def _default_accelerate_config() -> str | None:
    from accelerate.commands.config.config_args import default_config_file

    return str(default_config_file)


def launcher_argv() -> list[str]:
    """The command line of the process that started this worker (accelerate's simple launcher runs
    the worker as its direct child)."""
    import psutil

    try:
        return list(psutil.Process(os.getppid()).cmdline())
    except (psutil.Error, OSError):
        return []
