"""Pick the mixed-precision mode a run uses."""

from __future__ import annotations

import torch

from lmforge.errors import UserInputError


def cpu_supports_bf16() -> bool:
    """True when this CPU has native bf16 matmul (AVX512-BF16 or AMX): autocast to bf16 is then faster."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_precision(requested: str, *, use_cuda: bool, native_bf16: bool | None = None) -> str:
    """`auto` -> bf16 where the device has native bf16 (GPUs and CPUs alike), else fp16 on
    older GPUs and fp32 on CPUs. `native_bf16` defaults to asking the device."""
    if native_bf16 is None:
        native_bf16 = torch.cuda.is_bf16_supported() if use_cuda else cpu_supports_bf16()
    if requested == "auto":
        if native_bf16:
            return "bf16"
        return "fp16" if use_cuda else "fp32"
    if requested == "fp16" and not use_cuda:
        raise UserInputError("train.precision=fp16 needs a CUDA GPU; on CPU use bf16 or fp32 (or auto)")
    return requested
