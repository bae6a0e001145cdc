"""Pick the mixed-precision mode a run uses."""

from __future__ import annotations

import torch

from lmforge.distributed.devices import bf16_supported
from lmforge.errors import UserInputError

# Float8 matmuls (torch._scaled_mm) need Ada Lovelace or Hopper tensor cores, or newer.
FP8_MIN_CAPABILITY = (8, 9)


def resolve_precision(requested: str, *, use_cuda: bool, native_bf16: bool | None = None) -> str:
    """`auto` -> bf16 where the device has native bf16 (GPUs and CPUs alike), else fp16 on
    older GPUs and fp32 on CPUs. `native_bf16` defaults to asking the device. fp8 is refused
    where the device has no float8 matmul (`require_fp8_device`)."""
    if native_bf16 is None:
        native_bf16 = bf16_supported(use_cuda=use_cuda)
    if requested == "auto":
        if native_bf16:
            return "bf16"
        return "fp16" if use_cuda else "fp32"
    if requested == "fp16" and not use_cuda:
        raise UserInputError("train.precision=fp16 needs a CUDA GPU; on CPU use bf16 or fp32 (or auto)")
    if requested == "fp8":
        require_fp8_device(use_cuda=use_cuda)
    return requested


def autocast_precision(precision: str) -> str:
    """The autocast mode a resolved precision trains under: fp8 is bf16 autocast with the linear
    layers swapped for torchao's float8 ones (train/fp8.py); the others are their own."""
    return "bf16" if precision == "fp8" else precision


def require_fp8_device(*, use_cuda: bool, capability: tuple[int, int] | None = None) -> None:
    """UserInputError unless this machine has a CUDA GPU with float8 matmuls (compute capability
    8.9 or newer). `capability` defaults to asking the current CUDA device."""
    if not use_cuda:
        raise UserInputError(
            "train.precision=fp8 runs the linear layers' matmuls in float8 on a CUDA GPU of compute "
            "capability 8.9 or newer (H100, H200, L4, L40S, RTX 4090 and later), and this machine has no CUDA "
            "GPU. Fix: set train.precision: bf16 (or auto) here, or run on such a GPU"
        )
    if capability is None:
        capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "this GPU"
        raise UserInputError(
            f"train.precision=fp8 needs float8 matmuls, which CUDA GPUs of compute capability 8.9 or newer "
            f"have (H100, H200, L4, L40S, RTX 4090 and later); {name} is {capability[0]}.{capability[1]}. "
            "Fix: set train.precision: bf16 (or auto) on this GPU"
        )
