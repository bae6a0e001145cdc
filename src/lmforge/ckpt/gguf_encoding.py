"""How each tensor is stored in a GGUF file: its storage type, byte size and encoding.

`PlannedTensor` says where a tensor's data comes from and how it is stored; `encode_tensor`
turns the HF tensor into those bytes: the RoPE row permutation llama.cpp expects for
Llama/Mistral q_proj/k_proj, then f32, f16, bf16 or ggml's Q8_0 (`quantize_q8_0`).
Used by `lmforge.ckpt.to_gguf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from lmforge.ckpt.safetensors_stream import Entry

QType = gguf.GGMLQuantizationType
_Q8_ROWS_PER_CHUNK = 256  # bounds the float32 scratch of q8_0 quantization (a few MB)


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor: where its data comes from and how it is stored."""

    name: str
    qtype: QType
    source: Path | None = None
    entry: Entry | None = None
    permute_heads: int = 0  # >0: apply the rope row permutation with this many heads
    computed: np.ndarray | None = None  # a tensor made here (rope_freqs), not read from the source

    @property
    def shape(self) -> tuple[int, ...]:
        if self.computed is not None:
            return tuple(self.computed.shape)
        assert self.entry is not None
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        rows = math.prod(self.shape[:-1])
        return rows * (self.shape[-1] // block) * type_size


def storage_type(shape: tuple[int, ...], weight_type: QType) -> QType:
    """Norms, biases (1-D) stay f32, as llama.cpp keeps them; q8_0 needs rows in whole 32-blocks."""
    if len(shape) != 2:
        return QType.F32
    block, _ = gguf.GGML_QUANT_SIZES[weight_type]
    return weight_type if shape[-1] % block == 0 else QType.F16


def rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of one head go from [first halves | second halves] (HF) to interleaved pairs (llama.cpp)."""
    shape = weight.shape
    return weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def encode_tensor(tensor: torch.Tensor, planned: PlannedTensor) -> np.ndarray:
    """The bytes of one tensor as the GGUF stores it (a numpy array whose nbytes is planned.nbytes)."""
    if planned.permute_heads:
        tensor = rope_permute(tensor, planned.permute_heads)
    if planned.qtype == QType.F32:
        return tensor.to(torch.float32).contiguous().numpy()
    if planned.qtype == QType.F16:
        return tensor.to(torch.float16).contiguous().numpy()
    if planned.qtype == QType.BF16:
        return tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)
    return quantize_q8_0(tensor.reshape(-1, tensor.shape[-1]))


def quantize_q8_0(rows: torch.Tensor) -> np.ndarray:
    """ggml's Q8_0, bit for bit as gguf.quants (and ggml-quants.c) compute it: per block of 32
    weights an f16 scale max|x|/127 and int8 values round-half-away-from-zero(x / scale).
    In torch rather than numpy: the element-wise work runs on every core."""
    block, type_size = gguf.GGML_QUANT_SIZES[QType.Q8_0]
    out = np.empty((rows.shape[0], rows.shape[1] // block * type_size), dtype=np.uint8)
    for start in range(0, rows.shape[0], _Q8_ROWS_PER_CHUNK):
        blocks = rows[start : start + _Q8_ROWS_PER_CHUNK].to(torch.float32).reshape(-1, block)
        scale = blocks.abs().amax(dim=1, keepdim=True) / 127
        inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
        scaled = blocks * inverse
        values = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8)
        packed = torch.cat([scale.to(torch.float16).view(torch.uint8), values.view(torch.uint8)], dim=1)
        out[start : start + _Q8_ROWS_PER_CHUNK] = packed.reshape(-1, out.shape[1]).numpy()
    return out
