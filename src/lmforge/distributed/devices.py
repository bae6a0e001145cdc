"""Device questions, answered in one place: does this device compute bf16 natively, and on which
device do collectives run (nccl needs CUDA tensors; gloo takes CPU tensors)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_CONTROL_GROUP: dict[str, Any] = {}


def cpu_supports_bf16() -> bool:
    """True when this CPU has native bf16 matmul (AVX512-BF16 or AMX): autocast to bf16 is then faster."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def bf16_supported(*, use_cuda: bool | None = None) -> bool:
    """Native bf16 on the device training runs on (the current GPU, else this CPU)."""
    cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    return bool(torch.cuda.is_bf16_supported()) if cuda else cpu_supports_bf16()


def collective_device() -> torch.device:
    """Where tensors handed to torch.distributed collectives must live for the current backend."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_group() -> Any:
    """The process group for small control messages held on the CPU (the stop flag): the default
    group where that is gloo already, else one gloo group beside NCCL, made on first use, so that
    agreeing on a flag never waits behind the GPU's queue. Making it is a collective: every rank
    calls this first at the same point of the step."""
    if dist.get_backend() == "gloo":
        return None  # the default group
    if "gloo" not in _CONTROL_GROUP:
        _CONTROL_GROUP["gloo"] = dist.new_group(backend="gloo")
    return _CONTROL_GROUP["gloo"]
