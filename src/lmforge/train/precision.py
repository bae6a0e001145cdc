"""Pick the mixed-precision mode a run uses."""

from __future__ import annotations

from lmforge.distributed.devices import bf16_supported
from lmforge.errors import UserInputError


def resolve_precision(requested: str, *, use_cuda: bool, native_bf16: bool | None = None) -> str:
    """`auto` -> bf16 where the device has native bf16 (GPUs and CPUs alike), else fp16 on
    older GPUs and fp32 on CPUs. `native_bf16` defaults to asking the device."""
    if native_bf16 is None:
        native_bf16 = bf16_supported(use_cuda=use_cuda)
    if requested == "auto":
        if native_bf16:
            return "bf16"
        return "fp16" if use_cuda else "fp32"
    if requested == "fp16" and not use_cuda:
        raise UserInputError("train.precision=fp16 needs a CUDA GPU; on CPU use bf16 or fp32 (or auto)")
    return requested
