"""SPACE.yaml: the search space of a sweep, one dotted config key per entry.

    train.lr: {low: 1.0e-5, high: 1.0e-2, log: true}   # a float range (log scale)
    train.warmup_steps: {low: 0, high: 100}            # integers when both bounds are integers
    train.micro_batch_size: [4, 8, 16]                 # a list: one of these choices

Every key must be one `lmforge train CONFIG key=value` accepts: each bound and choice is applied
to the base config and validated before any trial starts, so a typo or an impossible value is a
config error naming the key, not a failed trial.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from lmforge.config import load_config
from lmforge.config.yaml_bounds import load_yaml_bounded
from lmforge.errors import UserInputError

RANGE_KEYS = {"low", "high", "log", "step"}


@dataclass(frozen=True)
class SearchSpace:
    source: Path
    distributions: dict[str, BaseDistribution]

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """`key=value` overrides for one trial's parameters, in the space's order."""
        return [override(key, params[key]) for key in self.distributions]

    def grid(self) -> dict[str, list[Any]]:
        """The grid of a grid search: every key must be a list of choices (or an integer range)."""
        grid: dict[str, list[Any]] = {}
        for key, dist in self.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                grid[key] = list(dist.choices)
            elif isinstance(dist, IntDistribution) and not dist.log:
                grid[key] = list(range(dist.low, dist.high + 1, dist.step))
            else:
                raise UserInputError(
                    f"{self.source}: {key}: a grid search needs a list of values (or an integer range); "
                    f"write for example `{key}: [{dist.low:g}, {dist.high:g}]`, or use --sampler tpe"  # type: ignore[attr-defined]
                )
        return grid


def override(key: str, value: Any) -> str:
    """`key=value` with the value written so the override parser reads it back unchanged (JSON is YAML)."""
    return f"{key}={json.dumps(value)}"


def load_space(path: Path, config: Path, base_overrides: list[str]) -> SearchSpace:
    """Read and check SPACE.yaml against the base config; UserInputError names the file and key."""
    if not path.is_file():
        raise UserInputError(
            f"--space: {path} does not exist; write a YAML file mapping config keys to ranges"
        )
    try:
        raw = load_yaml_bounded(path.read_text(), str(path))
    except yaml.YAMLError as err:
        raise UserInputError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict) or not raw:
        raise UserInputError(
            f"{path}: expected a mapping of config keys to ranges or choices, for example\n"
            "  train.lr: {low: 1.0e-5, high: 1.0e-2, log: true}\n  train.warmup_steps: [0, 50, 100]"
        )
    distributions = {str(key): _distribution(path, str(key), spec) for key, spec in raw.items()}
    for key, dist in distributions.items():
        for value in _extremes(dist):
            try:
                load_config(config, [*base_overrides, override(key, value)])
            except UserInputError as err:
                raise UserInputError(
                    f"{path}: {key}: the value {value!r} is not a valid config:\n{err}"
                ) from None
    return SearchSpace(path, distributions)


def _distribution(path: Path, key: str, spec: Any) -> BaseDistribution:
    where = f"{path}: {key}"
    if isinstance(spec, list):
        if not spec:
            raise UserInputError(f"{where}: an empty list of choices; list at least one value")
        if not all(isinstance(v, (str, int, float, bool)) or v is None for v in spec):
            raise UserInputError(f"{where}: choices must be plain values (numbers, strings, true/false)")
        return CategoricalDistribution(spec)
    if not isinstance(spec, dict):
        raise UserInputError(
            f"{where}: expected a range {{low, high, log}} or a list of choices, got {spec!r}"
        )
    unknown = sorted(set(spec) - RANGE_KEYS)
    if unknown or "low" not in spec or "high" not in spec:
        raise UserInputError(
            f"{where}: a range has low and high (and optionally log: true, step); "
            + (f"unknown {unknown}" if unknown else "low or high is missing")
        )
    low, high, step = _number(spec["low"]), _number(spec["high"]), _number(spec.get("step"))
    log = bool(spec.get("log", False))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
    if not numbers:
        raise UserInputError(f"{where}: low and high must be numbers, got {low!r} and {high!r}")
    if step is not None and not (isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0):
        raise UserInputError(f"{where}: step must be a positive number, got {step!r}")
    if not low < high:
        raise UserInputError(f"{where}: low ({low}) must be below high ({high})")
    if log and low <= 0:
        raise UserInputError(f"{where}: a log range needs low > 0 (got {low})")
    if log and step is not None:
        raise UserInputError(f"{where}: a log range takes no step")
    if isinstance(low, int) and isinstance(high, int):
        return IntDistribution(low, high, log=log, step=int(step or 1))
    return FloatDistribution(float(low), float(high), log=log, step=float(step) if step else None)


def _number(value: Any) -> Any:
    """A number written as people write learning rates: YAML 1.1 reads `1e-6` (no dot) as a string,
    which the config itself accepts as a float (`train.lr: 1e-4`); so does the space."""
    if not isinstance(value, str):
        return value
    try:
        number = float(value)
    except ValueError:
        return value  # not a number: refused by the caller, naming the value
    return number if math.isfinite(number) else value


def _extremes(dist: BaseDistribution) -> list[Any]:
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    return [dist.low, dist.high]  # type: ignore[attr-defined]
