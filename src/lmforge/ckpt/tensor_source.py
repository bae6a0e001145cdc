"""A checkpoint tensor that is read only when it is written out, shared by the ZeRO and DCP readers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSource:
    """A tensor of the checkpoint: its shape, dtype and how to read it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]
