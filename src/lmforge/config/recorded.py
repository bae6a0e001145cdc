"""A run's config.yaml read back through the schema, for the tools that look at finished runs
(`lmforge doctor`, `lmforge report`, `lmforge runs compare`).

A run directory outlives the code that wrote it: a key may have been renamed or removed since,
or a file may be hand-edited. Reading it must not fail and must not fall back to hand-copied
defaults, so each section is validated on its own: a key the schema no longer has is left out,
a value that no longer validates takes the schema's default, and each such repair is a note the
caller shows. Every value a tool reads is then typed and has the schema's one default.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lmforge.config.load import model_in_annotation
from lmforge.config.schema import (
    DataConfig,
    DebugConfig,
    DistributedConfig,
    ExportConfig,
    LmforgeConfig,
    ModelConfig,
    MonitorConfig,
    RunConfig,
    TokenizerConfig,
    TrainConfig,
)


@dataclass(frozen=True)
class RecordedConfig:
    """The sections of a recorded config, each typed. `model` and `data` have no defaults (a run
    names its own), so they are None where config.yaml has no valid one."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig | None = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    found: bool = False  # config.yaml existed and held a mapping
    sections: frozenset[str] = frozenset()  # the sections config.yaml held and that were read
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """Plain data of every section that is there (for comparing runs key by key)."""
        out: dict[str, Any] = {}
        for name in LmforgeConfig.model_fields:
            section = getattr(self, name)
            if section is not None:
                out[name] = section.model_dump(mode="json")
        return out


def read_recorded_config(path: Path) -> RecordedConfig:
    """config.yaml at `path` through the schema; a missing or unparsable file gives the defaults
    with a note (the tools still read the run's metrics)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError:
        return RecordedConfig(notes=(f"{path.name}: not found; the schema's defaults are assumed",))
    except yaml.YAMLError as err:
        return RecordedConfig(
            notes=(f"{path.name} is not valid YAML ({err}); the schema's defaults are assumed",)
        )
    if not isinstance(data, dict):
        return RecordedConfig(notes=(f"{path.name} holds no mapping; the schema's defaults are assumed",))
    return recorded_config_from(data, source=path.name)


def recorded_config_from(data: dict[str, Any], *, source: str = "config.yaml") -> RecordedConfig:
    """`data` (a parsed config.yaml) section by section, repaired as the module docstring says."""
    notes: list[str] = []
    sections: dict[str, Any] = {}
    for name in set(data) - set(LmforgeConfig.model_fields):
        notes.append(f"{source}: section '{name}' is not part of lmforge's config (any more); ignored")
    for name, info in LmforgeConfig.model_fields.items():
        model = model_in_annotation(info.annotation)
        assert model is not None  # every field of LmforgeConfig is a section
        raw = data.get(name)
        if raw is None:
            continue
        if not isinstance(raw, dict):
            notes.append(f"{source}: {name} is not a mapping; ignored")
            continue
        sections[name] = _validated(model, raw, name, source, notes)
    read = {k: v for k, v in sections.items() if v is not None}
    return RecordedConfig(**read, found=True, sections=frozenset(read), notes=tuple(notes))


def _validated(
    model: type[BaseModel], raw: dict[str, Any], name: str, source: str, notes: list[str]
) -> BaseModel | None:
    """The section validated after leaving out unknown keys and then any key that fails; None
    when it still does not validate (a section-wide rule, or a required key missing)."""
    known = _known_keys(model, raw, name, source, notes)
    for _ in range(2):
        try:
            return model.model_validate(known)
        except ValidationError as err:
            failing = {e["loc"][0] for e in err.errors() if e["loc"] and e["loc"][0] in known}
            if not failing:
                problem = "; ".join(e["msg"] for e in err.errors())
                notes.append(f"{source}: section {name} does not validate ({problem}); not read")
                return None
            for key in sorted(str(k) for k in failing):
                notes.append(
                    f"{source}: {name}.{key}={known[key]!r} no longer validates; the default is used"
                )
                known = {k: v for k, v in known.items() if k != key}
    return None


def _known_keys(
    model: type[BaseModel], raw: dict[str, Any], dotted: str, source: str, notes: list[str]
) -> dict[str, Any]:
    """`raw` without the keys `model` does not have (nested sections too), each one noted."""
    kept: dict[str, Any] = {}
    for key, value in raw.items():
        info = model.model_fields.get(key)
        if info is None:
            notes.append(f"{source}: {dotted}.{key} is not a key of lmforge's config (any more); ignored")
            continue
        nested = model_in_annotation(info.annotation)
        item = model_in_annotation(_list_item(info.annotation))
        if nested is not None and isinstance(value, dict):
            value = _known_keys(nested, value, f"{dotted}.{key}", source, notes)
        elif item is not None and isinstance(value, list):
            value = [
                _known_keys(item, v, f"{dotted}.{key}.{i}", source, notes) if isinstance(v, dict) else v
                for i, v in enumerate(value)
            ]
        kept[key] = value
    return kept


def _list_item(annotation: Any) -> Any:
    """The item type of `list[X]` (or `list[X] | None`), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is list:
            return typing.get_args(candidate)[0]
    return None
