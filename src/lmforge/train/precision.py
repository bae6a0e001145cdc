"""Pick the mixed-precision mode a run uses."""

from __future__ import annotations

import torch

from lmforge.errors import UserInputError


def cpu_supports_bf16() -> bool:
    """True when this CPU has native bf16 matmul (AVX512-BF16 or AMX): autocast to bf16 is then faster."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_precision(requested: str, *, use_cuda: bool) -> str:
    """`auto` -> bf16 where the device has native bf16 (GPUs and CPUs alike), else fp32."""
    if requested == "auto":
        if use_cuda:
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if cpu_supports_bf16() else "fp32"
    if requested == "fp16" and not use_cuda:
        raise UserInputError("train.precision=fp16 needs a CUDA GPU; on CPU use bf16 or fp32 (or auto)")
    return requested
