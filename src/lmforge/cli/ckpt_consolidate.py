"""`lmforge ckpt consolidate` (being built)."""

from __future__ import annotations


def command() -> None:
    """(being built)"""
    raise NotImplementedError
