"""Nested config data as dotted keys, the way `key=value` overrides name them (train.lr)."""

from __future__ import annotations

from typing import Any


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (lists stay whole values), as `key=value` overrides name them."""
    if not isinstance(data, dict):
        return {prefix: data} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flatten(value, path))
        else:
            flat[path] = value
    return flat
