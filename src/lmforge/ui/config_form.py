"""The config form and its YAML twin: the form is generated from the schema (`schema_rows`, what
`lmforge config schema` prints), and both views edit the same YAML text — a form field is one
dotted override applied by the CLI's own `apply_override`, the YAML is parsed with the CLI's
bounded loader — so the form can hold nothing the YAML could not.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from lmforge.config.load import apply_override, schema_rows
from lmforge.config.yaml_bounds import load_yaml_bounded
from lmforge.errors import UserInputError

_SCALARS = {"int": "int", "float": "float", "str": "text", "bool": "bool", "Path": "text"}
_COMPLEX = re.compile(r"list|dict|\[|Config\b|Config\s|^[A-Z]\w*Config")


def form_fields() -> list[dict[str, Any]]:
    """Every config key as a form field: its section, kind (choice, bool, int, float, text, or yaml
    for lists, mappings and nested sections edited as YAML), choices, default and description. The
    keys inside a list (data.train's sources, the rewards) are the YAML view's."""
    rows = schema_rows()
    parents = {key.rsplit(".", 1)[0] for key, *_ in rows if "." in key}
    fields: list[dict[str, Any]] = []
    lists: list[str] = []  # keys holding a list of sections: their fields are edited in the YAML
    for key, type_text, default, description in rows:
        if any(key.startswith(prefix + ".") for prefix in lists):
            continue
        if type_text.startswith("list of "):
            lists.append(key)
        # An optional subsection (model.moe: MoeConfig | None) is a section of the form too.
        if type_text == "section" or (key in parents and key not in lists):
            fields.append({"key": key, "kind": "section", "description": description})
            continue
        fields.append({"key": key, "description": description, "default": default, **_kind(type_text)})
    return fields


def _kind(type_text: str) -> dict[str, Any]:
    parts = [part.strip() for part in type_text.split("|")]
    nullable = "None" in parts
    parts = [part for part in parts if part != "None"]
    if len(parts) == 1 and parts[0] in _SCALARS:
        return {"kind": _SCALARS[parts[0]], "nullable": nullable}
    if parts and not any(part in _SCALARS or _COMPLEX.search(part) for part in parts):
        return {"kind": "choice", "choices": parts, "nullable": nullable}
    return {"kind": "yaml", "type": type_text, "nullable": nullable}


def parse(text: str) -> dict[str, Any]:
    """The editor's YAML as a mapping; UserInputError with the YAML error's line."""
    try:
        raw = load_yaml_bounded(text, "config") if text.strip() else {}
    except yaml.YAMLError as err:
        raise UserInputError(f"config: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise UserInputError(
            "config: the top level must be a mapping of sections (run:, model:, train:, ...)"
        )
    return raw


def set_key(text: str, key: str, value: str) -> str:
    """The YAML text with `key` set to `value` (parsed as YAML, as a `key=value` override is); an
    empty value removes the key, so the default applies."""
    raw = parse(text)
    if value == "":
        _remove(raw, key.split("."))
    else:
        apply_override(raw, f"{key}={value}")
    return yaml.safe_dump(raw, sort_keys=False, default_flow_style=None, width=100)


def _remove(node: Any, parts: list[str]) -> None:
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
    if isinstance(node, dict):
        node.pop(parts[-1], None)
