"""`.npy` files of int32 token blocks that grow while they are written.

Pretraining data (`data.text`) appends its token stream straight to an `.npy` file whose
header claims 0 rows; when the stream ends the header is rewritten in place (numpy pads it
so the row count can grow) and the tail cut to whole blocks. A hold-out moves rows to a
second file and compacts the rest in place, in bounded memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

_COPY_ROWS = 16_384  # blocks moved per step when splitting off eval blocks: bounded memory


def write_header(handle: Any, rows: int, block_length: int) -> None:
    """An .npy header for an int32 array of shape [rows, block_length], at the handle's position."""
    header = {"descr": "<i4", "fortran_order": False, "shape": (rows, block_length)}
    np.lib.format.write_array_header_1_0(handle, header)


def set_rows(file: Path, rows: int, block_length: int) -> None:
    """Make `file` (npy header + int32 stream) an .npy of shape [rows, block_length]:
    rewrite its header in place (numpy pads it so the row count can grow) and cut the tail."""
    with file.open("r+b") as handle:
        np.lib.format.read_magic(handle)
        np.lib.format.read_array_header_1_0(handle)
        data_offset = handle.tell()
        handle.seek(0)
        write_header(handle, rows, block_length)
        if handle.tell() != data_offset:  # cannot happen while numpy keeps its growth padding
            raise RuntimeError(f"{file}: .npy header changed size; the stream would be misread")
        handle.truncate(data_offset + rows * block_length * 4)


def move_rows(train_file: Path, eval_file: Path, train_rows: np.ndarray, eval_rows: np.ndarray) -> None:
    """Write rows `eval_rows` of `train_file` to `eval_file` and keep only `train_rows` (sorted)
    in `train_file`, in order."""
    blocks = np.load(train_file, mmap_mode="r+", allow_pickle=False)
    block_length = blocks.shape[1]
    np.save(eval_file, blocks[eval_rows], allow_pickle=False)
    # Compact the kept rows to the front, in order. Safe in place: train_rows is sorted and
    # train_rows[i] >= i, so no chunk overwrites a row that a later chunk still reads.
    for start in range(0, len(train_rows), _COPY_ROWS):
        rows = train_rows[start : start + _COPY_ROWS]
        blocks[start : start + len(rows)] = blocks[rows]
    blocks.flush()
    del blocks
    set_rows(train_file, len(train_rows), block_length)
