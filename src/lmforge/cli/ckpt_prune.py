"""`lmforge ckpt prune` (being built)."""

from __future__ import annotations


def command() -> None:
    """(being built)"""
    raise NotImplementedError
