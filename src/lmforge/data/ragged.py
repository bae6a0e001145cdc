"""Tokenized fine-tuning samples stored flat (a ragged array), and their torch datasets.

`RaggedSamples` is what the SFT cache holds per split (`<split>.input_ids.npy`,
`<split>.labels.npy`, `<split>.offsets.npy`); `SampleDataset` gives one sample per item
(padded or padding-free batches), `PackedDataset` one best-fit packed row per item.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.data.packing import best_fit_pack


@dataclass
class RaggedSamples:
    """Variable-length samples stored flat: sample i is ids[offsets[i]:offsets[i+1]]."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, index: int) -> dict[str, np.ndarray]:
        start, end = self.offsets[index], self.offsets[index + 1]
        return {"input_ids": self.input_ids[start:end], "labels": self.labels[start:end]}

    def save(self, directory: Path, split: str) -> None:
        for name in ("input_ids", "labels", "offsets"):
            np.save(directory / f"{split}.{name}.npy", getattr(self, name), allow_pickle=False)

    @classmethod
    def load(cls, directory: Path, split: str) -> RaggedSamples:
        arrays = {
            name: np.load(directory / f"{split}.{name}.npy", mmap_mode="r", allow_pickle=False)
            for name in ("input_ids", "labels", "offsets")
        }
        return cls(**arrays)

    @classmethod
    def from_chunks(
        cls, ids: list[np.ndarray], labels: list[np.ndarray], lengths: list[np.ndarray]
    ) -> RaggedSamples:
        """Samples from chunks of flat ids and labels, each chunk with its samples' lengths."""
        all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(len(all_lengths) + 1, dtype=np.int64)
        np.cumsum(all_lengths, out=offsets[1:])
        empty = np.zeros(0, dtype=np.int32)
        return cls(
            np.concatenate(ids) if ids else empty, np.concatenate(labels) if labels else empty, offsets
        )

    def subset(self, rows: np.ndarray) -> RaggedSamples:
        """The samples at `rows`, in that order, as a new ragged array."""
        pieces = [self.sample(int(i)) for i in rows]
        ids = [p["input_ids"] for p in pieces]
        lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
        return RaggedSamples.from_chunks(ids, [p["labels"] for p in pieces], [lengths])


class SampleDataset(torch.utils.data.Dataset):
    """One tokenized sample per item (padded or padding-free batches)."""

    def __init__(self, samples: RaggedSamples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        sample = self.samples.sample(index)
        return {"input_ids": sample["input_ids"].tolist(), "labels": sample["labels"].tolist()}


class PackedDataset(torch.utils.data.Dataset):
    """One packed row per item: the samples of one best-fit bin, kept as separate pieces."""

    def __init__(self, samples: RaggedSamples, capacity: int) -> None:
        self.samples = samples
        self.bins = best_fit_pack(samples.lengths(), capacity)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, list[list[int]]]:
        pieces = [self.samples.sample(i) for i in self.bins[index]]
        return {
            "input_ids": [p["input_ids"].tolist() for p in pieces],
            "labels": [p["labels"].tolist() for p in pieces],
        }
