"""Typed config: schema, loading with overrides and precise errors, redaction."""

from lmforge.config.load import load_config
from lmforge.config.redact import redact
from lmforge.config.schema import LmforgeConfig

__all__ = ["LmforgeConfig", "load_config", "redact", "dump_config"]


def dump_config(cfg: LmforgeConfig) -> dict:
    """The resolved config as plain data with secrets redacted (for config.yaml and `config show`)."""
    return redact(cfg.model_dump(mode="json"))
