"""Read a YAML config, apply `key=value` overrides, validate, and explain every error at once.

Errors name the file, the line, the dotted key path, what is wrong and the fix
(for an unknown key: the closest valid key). They are raised as `UserInputError`.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lmforge.config.cross_checks import cross_section_problems
from lmforge.config.redact import remember_config_secrets
from lmforge.config.schema import LmforgeConfig
from lmforge.config.yaml_bounds import check_expanded_size, load_yaml_bounded
from lmforge.errors import UserInputError

KeyPath = tuple[str, ...]

# Names users bring from HF TrainingArguments, axolotl and LLaMA-Factory configs.
FAMILIAR_NAMES = {
    "learning_rate": "train.lr",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "per_device_train_batch_size": "train.micro_batch_size",
    "micro_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "lr_scheduler_type": "train.schedule",
    "lr_scheduler": "train.schedule",
    "logging_steps": "train.log_every",
    "eval_steps": "train.eval_every",
    "save_steps": "train.save_every",
    "save_total_limit": "train.keep_last",
    "resume_from_checkpoint": "train.resume",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "sequence_len": "data.max_length",
    "cutoff_len": "data.max_length",
    "block_size": "data.max_length",
    "model_name_or_path": "model.path",
    "base_model": "model.path",
    "output_dir": "run.output_dir",
    "finetuning_type": "train.method",
    "adapter": "train.method",
    "lora_r": "train.lora.r",
    "lora_rank": "train.lora.r",
    "lora_alpha": "train.lora.alpha",
    "lora_dropout": "train.lora.dropout",
    "lora_target": "train.lora.target_modules",
    "lora_target_modules": "train.lora.target_modules",
    "use_dora": "train.method",
    "pref_beta": "train.dpo.beta",
    "pref_loss": "train.dpo.loss",
    "loss_type": "train.dpo.loss",
    "metric_for_best_model": "train.best_metric",
    "template": "data.chat_template",  # LLaMA-Factory's `template: llama3`
}


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    *,
    base: dict[str, Any] | None = None,
    tokenizer_optional: bool = False,
) -> LmforgeConfig:
    """Load `path` (or start from `base`), apply dotted overrides and validate.

    `tokenizer_optional`: a config that names no tokenizer is accepted (estimating an architecture
    alone); training configs need one. Raises UserInputError listing every problem with file, line
    and key path.
    """
    source = str(path) if path is not None else "<built-in config>"
    raw: dict[str, Any] = dict(base or {})
    lines: dict[KeyPath, int] = {}
    if path is not None:
        raw, lines = _read_yaml_with_lines(Path(path))
    for override in overrides or []:
        apply_override(raw, override)
        # An override's problems are reported against the override, not a YAML line.
        lines[tuple(override.partition("=")[0].split("."))] = -1
    try:
        cfg = LmforgeConfig.model_validate(raw, context={"tokenizer_optional": tokenizer_optional})
    except ValidationError as err:
        problems = sorted((_explain(e, source, lines, raw) for e in err.errors()), key=lambda p: p[0])
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        body = "\n".join(f"  {text}" for _, text in problems)
        raise UserInputError(f"invalid config ({count}):\n{body}") from None
    broken = cross_section_problems(cfg)
    if broken:
        body = "\n".join(
            f"  {_where(tuple(key.split('.')), source, lines)}: {message}" for key, message in broken
        )
        raise UserInputError(
            f"invalid config ({len(broken)} problem{'s' if len(broken) > 1 else ''}):\n{body}"
        )
    remember_config_secrets(cfg.model_dump(mode="json"))  # redacted from command lines and messages too
    return cfg


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping in the YAML document sets the same key twice."""

    def __init__(self, key: str, first: yaml.Mark, again: yaml.Mark) -> None:
        super().__init__(None, None, f"duplicate key {key!r}", again)
        self.key, self.first_line, self.line = key, first.line + 1, again.line + 1


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys: plain YAML keeps the last value and
    silently drops the first, so a config could train with a value its author never sees."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Hashable, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # keys merged in from `<<: *base` may be overridden on purpose
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class reports unhashable keys itself
            if key in seen:
                raise DuplicateKeyError(str(key), seen[key], key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _read_yaml_with_lines(path: Path) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    if path.is_dir():
        yamls = sorted(p.name for p in path.glob("*.y*ml"))[:5]
        hint = f" (YAML files there: {', '.join(yamls)})" if yamls else ""
        raise UserInputError(
            f"config {path} is a directory; a YAML config file is expected{hint}. "
            "Fix: pass the path of the .yaml file, for example examples/pretrain_tiny.yaml."
        )
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "not found"
        raise UserInputError(f"config file {what}: {path} (pass the path of a YAML file; see examples/)")
    text = path.read_text(encoding="utf-8")
    loader = _UniqueKeyLoader(text)
    node: yaml.Node | None = None
    try:
        node = loader.get_single_node()
        check_expanded_size(node, str(path))
        data = loader.construct_document(node) if node is not None else None
    except DuplicateKeyError as err:
        raise UserInputError(
            f"{path}:{err.line}: {_dotted_key(node, err)}: duplicate key (first set on line "
            f"{err.first_line}); YAML would silently keep only the last value. Fix: delete one of "
            "the two lines, or merge them."
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserInputError(f"{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserInputError(
            f"{path}: the top level must be a mapping of sections (run:, model:, data:, ...)"
        )
    lines: dict[KeyPath, int] = {}
    _collect_lines(node, (), lines)
    return data, lines


def _dotted_key(root: yaml.Node | None, err: DuplicateKeyError) -> str:
    """The dotted path of the duplicated key (`train.lr`), found by its line in the document."""
    lines: dict[KeyPath, int] = {}
    _collect_lines(root, (), lines)
    found = [p for p, line in lines.items() if line == err.line and p[-1] == err.key]
    return ".".join(found[0]) if found else err.key


def _collect_lines(node: yaml.Node | None, prefix: KeyPath, out: dict[KeyPath, int]) -> None:
    """Map every key path in the YAML document to its 1-based line number (a repeated key: its last)."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = (*prefix, str(key_node.value))
            out[path] = key_node.start_mark.line + 1
            _collect_lines(value_node, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = (*prefix, str(i))
            out[path] = item.start_mark.line + 1
            _collect_lines(item, path, out)


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (so 1e-4, true, [a, b] work)."""
    key, sep, value_text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserInputError(f"bad override {override!r}: write dotted.key=value, for example train.lr=1e-4")
    try:
        value = load_yaml_bounded(value_text, f"override {key}") if value_text != "" else ""
    except yaml.YAMLError:
        value = value_text
    node: Any = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[_list_index(node, parts, depth, override)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise UserInputError(
                f"bad override {override!r}: {'.'.join(parts[:depth])} is a value, not a section or list"
            )
    if isinstance(node, list):
        node[_list_index(node, parts, len(parts) - 1, override)] = value
    elif isinstance(node, dict):
        node[parts[-1]] = value
    else:
        raise UserInputError(
            f"bad override {override!r}: {'.'.join(parts[:-1])} is a value, not a section or list"
        )


def _list_index(items: list[Any], parts: list[str], depth: int, override: str) -> int:
    """The index `parts[depth]` names in the list at `parts[:depth]`; an error saying the list's
    size when it is no index or out of range (an override changes items, it never adds one)."""
    name, part = ".".join(parts[:depth]), parts[depth]
    count = len(items)
    size = f"{count} item{'' if count == 1 else 's'}"
    size += f" (index {'0' if count == 1 else f'0 to {count - 1}'})" if count else ""
    if not part.isdigit():
        raise UserInputError(
            f"bad override {override!r}: {name} is a list of {size}; {part!r} is not an index. "
            f"Fix: write {name}.0.{'.'.join(parts[depth:])}=... for its first item."
        )
    if int(part) >= count:
        raise UserInputError(
            f"bad override {override!r}: the list {name} has {size}, so index {part} is out of range. "
            f"Fix: use an existing index; to add an item, add it under {name} in the YAML file "
            "(an override changes items, it cannot add one)."
        )
    return int(part)


def _explain(error: Any, source: str, lines: dict[KeyPath, int], raw: dict[str, Any]) -> tuple[int, str]:
    """(line, "file:line: key: problem; fix") for one validation error."""
    loc = tuple(str(p) for p in error["loc"])
    line = _nearest_line(loc, lines)
    where = _where(loc, source, lines)
    kind = error["type"]
    if kind == "extra_forbidden":
        suggestion = _closest_key(loc)
        hint = (
            f"; did you mean '{suggestion}'?" if suggestion else "; remove it (see `lmforge config schema`)"
        )
        return max(line or 0, 0), f"{where}: unknown key{hint}"
    if kind == "missing":
        return max(line or 0, 0), f"{where}: required key is missing; add it (see `lmforge config schema`)"
    message = error["msg"].removeprefix("Value error, ")
    if loc and kind != "value_error":
        # pydantic's own input first: a shorthand (`optimizer: adamw_torch`) fails at a key
        # (`optimizer.name`) that the YAML does not spell out.
        message = f"{message}, got {error.get('input', _value_at(raw, loc))!r}"
    return max(line or 0, 0), f"{where}: {message}"


def _where(loc: KeyPath, source: str, lines: dict[KeyPath, int]) -> str:
    """`file:line: key`, or `override key` for a key set on the command line."""
    key = ".".join(loc) if loc else "(config)"
    line = _nearest_line(loc, lines)
    if line == -1:
        return f"override {key}"
    return f"{source}:{line}: {key}" if line else f"{source}: {key}"


def _nearest_line(loc: KeyPath, lines: dict[KeyPath, int]) -> int | None:
    for n in range(len(loc), 0, -1):
        if loc[:n] in lines and (lines[loc[:n]] != -1 or n == len(loc)):
            return lines[loc[:n]]
    return None


def _value_at(raw: Any, loc: KeyPath) -> Any:
    node = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _closest_key(loc: KeyPath) -> str | None:
    """The valid dotted key closest to an unknown one: the exact name in another section,
    else a near spelling in the same section, else a near spelling anywhere."""
    every = _all_key_paths(LmforgeConfig)
    exact = [p for p in every if p.split(".")[-1] == loc[-1]]
    if exact:
        return exact[0]
    if loc[-1] in FAMILIAR_NAMES:
        return FAMILIAR_NAMES[loc[-1]]
    model = _section_model(loc[:-1])
    candidates = {}
    if model is not None:
        prefix = ".".join(loc[:-1])
        for name in model.model_fields:
            candidates[name] = f"{prefix}.{name}" if prefix else name
    match = difflib.get_close_matches(loc[-1], list(candidates), n=1, cutoff=0.5)
    if match:
        return candidates[match[0]]
    match = difflib.get_close_matches(loc[-1], [p.split(".")[-1] for p in every], n=1, cutoff=0.8)
    if match:
        return next(p for p in every if p.split(".")[-1] == match[0])
    return None


def _section_model(loc: KeyPath) -> type[BaseModel] | None:
    model: type[BaseModel] | None = LmforgeConfig
    for part in loc:
        if model is None or part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = model_in_annotation(field.annotation)
    return model


def model_in_annotation(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model in a field's annotation (`X`, `X | None`, `list[X]`), if there is one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = model_in_annotation(arg)
        if found is not None:
            return found
    return None


def _all_key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        sub = model_in_annotation(field.annotation)
        if sub is not None:
            paths.extend(_all_key_paths(sub, path))
    return paths


def schema_rows(model: type[BaseModel] = LmforgeConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, description) for every key, for `lmforge config schema`."""
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        sub = model_in_annotation(field.annotation)
        default = "" if field.is_required() else _default_text(field)
        type_text = "section" if sub is not None and sub is field.annotation else _type_text(field.annotation)
        rows.append((path, type_text, default, field.description or ""))
        if sub is not None:
            rows.extend(schema_rows(sub, path))
    return rows


def _default_text(field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return repr(value) if not isinstance(value, Path) else str(value)


def _type_text(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(str(choice) for choice in typing.get_args(annotation))
    choices = typing.get_args(annotation)
    if any(typing.get_origin(choice) is typing.Literal for choice in choices):  # `Literal[...] | None`
        return " | ".join("None" if choice is type(None) else _type_text(choice) for choice in choices)
    if typing.get_origin(annotation) is list:
        return f"list of {_type_text(typing.get_args(annotation)[0])}"
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("lmforge.config.schema.", "")
