"""What binds a stage's spec (config/stages.py) to its trainer: the classes it names, resolved,
and the values lmforge sets on the trainer's arguments."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from transformers import Trainer, TrainingArguments


@dataclass
class TrlStage:
    """A TRL trainer class, its config class and the config values lmforge sets for it."""

    trainer: type[Trainer]
    config: type[TrainingArguments]
    values: dict[str, Any]
    takes_reference: bool  # pass a frozen reference copy when there is no adapter to switch off
    extra: dict[str, Any] = field(default_factory=dict)  # more constructor arguments (RL: reward_funcs)


def resolve_class(name: str) -> type:
    """The class a "module:Class" import string names (a spec's `trainer` or `arguments`).
    Imported on use: TRL's trainers take seconds to import, and only the run's own is needed."""
    module, _, attribute = name.partition(":")
    resolved = getattr(importlib.import_module(module), attribute)
    if not isinstance(resolved, type):
        raise TypeError(f"{name} names {type(resolved).__name__}, not a class")
    return resolved


def trl_stage(
    trainer: str,
    arguments: str,
    values: dict[str, Any],
    *,
    takes_reference: bool,
    extra: dict[str, Any] | None = None,
) -> TrlStage:
    """A `TrlStage` from the import strings of its trainer and arguments classes."""
    return TrlStage(
        resolve_class(trainer),
        resolve_class(arguments),
        values,
        takes_reference=takes_reference,
        extra=extra or {},
    )
