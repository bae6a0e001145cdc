"""How each tensor is stored in a GGUF file: its storage type, byte size and encoding.

`PlannedTensor` says where a tensor's data comes from and how it is stored; `encode_blocks`
reads the HF tensor a block of rows at a time and turns it into those bytes: the RoPE row
permutation llama.cpp expects for Llama/Mistral q_proj/k_proj, then f32, f16, bf16 or ggml's
Q8_0 (`quantize_q8_0`); `write_complete` streams a planned file out that way.
Used by `lmforge.export.to_gguf` and `lmforge.export.gguf_vision`.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from lmforge.export.safetensors_stream import DTYPES, Entry, SafetensorsReader
from lmforge.verbosity import progress_bar

QType = gguf.GGMLQuantizationType
_Q8_ROWS_PER_CHUNK = 256  # bounds the float32 scratch of q8_0 quantization (a few MB)
_BLOCK_BYTES = 4 << 20  # source bytes read, converted and written at a time


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor: where its data comes from and how it is stored."""

    name: str
    qtype: QType
    source: Path | None = None
    entry: Entry | None = None
    permute_heads: int = 0  # >0: apply the rope row permutation with this many heads
    computed: np.ndarray | None = None  # a tensor made here (rope_freqs), not read from the source
    # A stack of source tensors along a new first axis (an MoE layer's experts), in order.
    parts: tuple[tuple[Path, Entry], ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        if self.computed is not None:
            return tuple(self.computed.shape)
        if self.parts:
            return (len(self.parts), *self.parts[0][1].shape)
        assert self.entry is not None
        return self.entry.shape

    def pieces(self) -> list[tuple[Path, PlannedTensor]]:
        """What to read, in the GGUF's order: the tensor itself, or each stacked part on its own."""
        if not self.parts:
            assert self.source is not None
            return [(self.source, self)]
        return [(source, PlannedTensor(self.name, self.qtype, source, entry)) for source, entry in self.parts]

    @property
    def nbytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        rows = math.prod(self.shape[:-1])
        return rows * (self.shape[-1] // block) * type_size


def storage_type(shape: tuple[int, ...], weight_type: QType) -> QType:
    """Norms, biases (1-D) stay f32, as llama.cpp keeps them; q8_0 needs rows in whole 32-blocks.
    Matrices (2-D) and stacked experts (3-D) take `weight_type`."""
    if len(shape) < 2:
        return QType.F32
    block, _ = gguf.GGML_QUANT_SIZES[weight_type]
    return weight_type if shape[-1] % block == 0 else QType.F16


def rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of one head go from [first halves | second halves] (HF) to interleaved pairs (llama.cpp)."""
    shape = weight.shape
    return weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def encode_blocks(reader: SafetensorsReader, planned: PlannedTensor) -> Iterator[np.ndarray]:
    """The bytes of one tensor as the GGUF stores it, in order, a block of rows at a time (their
    nbytes add up to planned.nbytes): each block is read from `reader` and converted on its own, so
    memory holds one block, never the whole tensor or its converted copy."""
    assert planned.entry is not None
    entry = planned.entry
    rows, width = math.prod(entry.shape[:-1]), entry.shape[-1] if entry.shape else 1
    row_bytes = planned.nbytes // rows
    block = max(1, _BLOCK_BYTES // (width * DTYPES[entry.dtype].itemsize))
    if planned.permute_heads:  # the rope permutation moves rows within a head: whole heads per block
        head_rows = rows // planned.permute_heads
        block = max(1, block // head_rows) * head_rows
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        source = reader.rows(entry, start, stop)
        if planned.permute_heads:
            source = rope_permute(source, (stop - start) // head_rows)
        out = np.empty((stop - start, row_bytes), dtype=np.uint8)
        _encode_rows(source, planned.qtype, out)
        yield out


def _encode_rows(source: torch.Tensor, qtype: QType, out: np.ndarray) -> None:
    """Convert a block of rows into `out`, their bytes in the GGUF (copy_ converts without a temporary)."""
    if qtype == QType.F32:
        torch.from_numpy(out.view(np.float32)).copy_(source)
    elif qtype == QType.F16:
        torch.from_numpy(out.view(np.float16)).copy_(source)
    elif qtype == QType.BF16:
        torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).copy_(source)
    else:
        quantize_q8_0(source, out)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while the weights are converted (the previous count is restored).

    The work is many small ops (a few MB each); on a 2-core machine running other jobs, torch's
    second intra-op thread spin-waits between them and takes the core from the first: a 322M
    Llama's q8_0 export took 24-38 s on 2 threads and 5-6 s on one, f16 6.8 s and 4.1-4.7 s
    (load average 3-4), the same bytes."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def quantize_q8_0(rows: torch.Tensor, out: np.ndarray | None = None) -> np.ndarray:
    """ggml's Q8_0, bit for bit as gguf.quants (and ggml-quants.c) compute it: per block of 32
    weights an f16 scale max|x|/127 and int8 values round-half-away-from-zero(x / scale).
    In torch rather than numpy: 20 ms per 8M weights on one core, gguf.quants 73 ms. Writes into
    `out` (uint8, one row of blocks per row) when given; returns it."""
    block, type_size = gguf.GGML_QUANT_SIZES[QType.Q8_0]
    if out is None:
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


def write_complete(writer: gguf.GGUFWriter, plan: list[PlannedTensor], partial: Path, final: Path) -> None:
    """Write `plan` through `writer` (opened on `partial`), then move the file to `final`: a file
    under the final name is always whole, and a failure leaves no partial one."""
    try:
        with one_thread():
            write_streaming(writer, plan)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    writer.close()
    os.replace(partial, final)


def write_streaming(writer: gguf.GGUFWriter, plan: list[PlannedTensor]) -> None:
    """Header, metadata and tensor index first (sizes are known from the safetensors headers),
    then each tensor's data, a block of rows at a time: read, convert, append, drop.

    The data goes to the file here, laid out as GGUFWriter.write_tensor_data lays it (each tensor
    padded to the file's alignment): that method takes whole tensors, so the largest converted
    tensor (the embedding: 250 MiB in f16 for a 7B Llama) would sit in memory at once."""
    for tensor in plan:
        writer.add_tensor_info(
            tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes, raw_dtype=tensor.qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None and len(writer.fout) == 1  # one file: no split was asked for
    out = writer.fout[0]
    byteswap = writer.endianess != (gguf.GGUFEndian.BIG if sys.byteorder == "big" else gguf.GGUFEndian.LITTLE)
    readers: dict[Path, SafetensorsReader] = {}
    try:
        for tensor in progress_bar(plan, desc="write gguf", unit="tensor"):
            writer.write_padding(out, out.tell())
            if tensor.computed is not None:
                blocks: Iterable[np.ndarray] = [tensor.computed]
            else:
                blocks = itertools.chain.from_iterable(
                    encode_blocks(readers.setdefault(source, SafetensorsReader(source)), part)
                    for source, part in tensor.pieces()
                )
            for block in blocks:
                out.write((block.byteswap() if byteswap else block).data)
            writer.write_padding(out, tensor.nbytes)
    finally:
        for reader in readers.values():
            reader.close()
