"""The token store's shard format: one shard per input file, written by one task.

A shard is three files side by side:
- `<name>.tokens`: raw little-endian int32 token ids, each document followed by EOS: exactly
  the cached path's stream for that file;
- `<name>.index`: raw little-endian int64 end offsets (in tokens) of its documents, so document
  boundaries survive tokenization (packing with per-document masking can use them);
- `<name>.json`: the sidecar: where the tokens came from and what they hold.

Raw arrays rather than .npy: any reader (numpy, a C loader, `np.memmap`) maps them with no
header to parse, and a truncated file shows as a size that is not tokens x 4. Every file is
written under a temporary name and renamed, the sidecar last: a shard whose sidecar exists is
complete, and a killed task leaves only `.tmp` files that the next run overwrites.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
INDEX_DTYPE = np.dtype("<i8")
_TMP = ".tmp"


@dataclass
class ShardInfo:
    """A shard's sidecar: its input file, its tokenizer and its counts (JSON, no pickle)."""

    source: int  # index of the source in data.<split>
    split: str  # "train" or "eval"
    input_path: str
    input_size: int
    input_mtime_ns: int
    input_sha256: str  # computed by the task while it reads the file
    tokenizer_fingerprint: str
    documents: int
    empty_documents_skipped: int
    tokens: int  # EOS included: the size of the .tokens file in tokens
    length_histogram: dict[str, Any] = field(default_factory=dict)  # document lengths, EOS excluded

    def to_json(self) -> str:
        """The sidecar's text."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardInfo:
        """A sidecar read back from its text."""
        return cls(**json.loads(text))


def shard_stem(store: Path, split: str, source: int, file_number: int) -> Path:
    """Where input file `file_number` of source `source` of `split` is stored (without suffix)."""
    return store / split / f"source-{source:03d}" / f"file-{file_number:06d}"


def tokens_path(stem: Path) -> Path:
    """The shard's token ids (raw little-endian int32)."""
    return stem.with_suffix(".tokens")


def index_path(stem: Path) -> Path:
    """The shard's document end offsets (raw little-endian int64)."""
    return stem.with_suffix(".index")


def sidecar_path(stem: Path) -> Path:
    """The shard's JSON sidecar, present once the shard is complete."""
    return stem.with_suffix(".json")


class ShardWriter:
    """Appends documents' tokens to a shard under temporary names; `commit` makes it complete."""

    def __init__(self, stem: Path) -> None:
        self.stem = stem
        stem.parent.mkdir(parents=True, exist_ok=True)
        sidecar_path(stem).unlink(missing_ok=True)  # redoing a shard: it is incomplete until commit
        self._tokens: BinaryIO = _temporary(tokens_path(stem)).open("wb")
        self._index: BinaryIO = _temporary(index_path(stem)).open("wb")
        self.tokens = 0

    def append(self, stream: np.ndarray, document_ends: np.ndarray) -> None:
        """`stream`: EOS-joined ids of a batch of documents; `document_ends`: their end offsets
        within the batch (the index stores them shifted to offsets within the shard)."""
        stream.astype(TOKEN_DTYPE, copy=False).tofile(self._tokens)
        (document_ends.astype(INDEX_DTYPE, copy=False) + self.tokens).tofile(self._index)
        self.tokens += int(stream.size)

    def commit(self, info: ShardInfo) -> None:
        """Close the arrays, move them into place, then the sidecar (last: it marks completion)."""
        for handle in (self._tokens, self._index):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        for final in (tokens_path(self.stem), index_path(self.stem)):
            os.replace(_temporary(final), final)
        sidecar = sidecar_path(self.stem)
        _temporary(sidecar).write_text(info.to_json(), encoding="utf-8")
        os.replace(_temporary(sidecar), sidecar)

    def abandon(self) -> None:
        """Close the temporary files of a shard that failed (the next run overwrites them)."""
        for handle in (self._tokens, self._index):
            handle.close()


def read_sidecar(stem: Path) -> ShardInfo | None:
    """The shard's sidecar, or None while the shard is not complete."""
    path = sidecar_path(stem)
    return ShardInfo.from_json(path.read_text(encoding="utf-8")) if path.is_file() else None


def _temporary(final: Path) -> Path:
    return final.with_name(final.name + _TMP)
