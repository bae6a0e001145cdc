"""Tokenized fine-tuning samples stored flat (a ragged array), and their torch datasets.

`RaggedSamples` is what the SFT cache holds per split (`<split>.input_ids.npy`,
`<split>.labels.npy`, `<split>.offsets.npy`, and `<split>.images.json` when samples carry
images: each sample's image files in the order of its image tokens); `SampleDataset` gives one
sample per item (padded or padding-free batches), `PackedDataset` one best-fit packed row per item.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.data.packing import best_fit_pack


@dataclass
class RaggedSamples:
    """Variable-length samples stored flat: sample i is ids[offsets[i]:offsets[i+1]]."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    images: list[list[str]] | None = None  # per sample; None for text-only data

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, index: int) -> dict[str, Any]:
        start, end = self.offsets[index], self.offsets[index + 1]
        sample: dict[str, Any] = {"input_ids": self.input_ids[start:end], "labels": self.labels[start:end]}
        if self.images is not None:
            sample["images"] = self.images[index]
        return sample

    def save(self, directory: Path, split: str) -> None:
        for name in ("input_ids", "labels", "offsets"):
            np.save(directory / f"{split}.{name}.npy", getattr(self, name), allow_pickle=False)
        if self.images is not None:
            (directory / f"{split}.images.json").write_text(json.dumps(self.images), encoding="utf-8")

    @classmethod
    def load(cls, directory: Path, split: str) -> RaggedSamples:
        arrays = {
            name: np.load(directory / f"{split}.{name}.npy", mmap_mode="r", allow_pickle=False)
            for name in ("input_ids", "labels", "offsets")
        }
        listed = directory / f"{split}.images.json"
        images = json.loads(listed.read_text(encoding="utf-8")) if listed.is_file() else None
        return cls(**arrays, images=images)

    @classmethod
    def from_chunks(
        cls,
        ids: list[np.ndarray],
        labels: list[np.ndarray],
        lengths: list[np.ndarray],
        images: list[list[list[str]]] | None = None,
    ) -> RaggedSamples:
        """Samples from chunks of flat ids and labels, each chunk with its samples' lengths (and
        their image files, when any sample has images)."""
        all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(len(all_lengths) + 1, dtype=np.int64)
        np.cumsum(all_lengths, out=offsets[1:])
        empty = np.zeros(0, dtype=np.int32)
        flat_images = [sample for chunk in images for sample in chunk] if images else None
        if flat_images is not None and not any(flat_images):
            flat_images = None  # text-only data stores no image lists
        return cls(
            np.concatenate(ids) if ids else empty,
            np.concatenate(labels) if labels else empty,
            offsets,
            flat_images,
        )

    def subset(self, rows: np.ndarray) -> RaggedSamples:
        """The samples at `rows`, in that order, as a new ragged array."""
        pieces = [self.sample(int(i)) for i in rows]
        ids = [p["input_ids"] for p in pieces]
        lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
        images = [[p["images"] for p in pieces]] if self.images is not None else None
        subset = RaggedSamples.from_chunks(ids, [p["labels"] for p in pieces], [lengths], images)
        if self.images is not None and subset.images is None:
            subset.images = [[] for _ in pieces]  # a split of image data keeps its image lists
        return subset


class SampleDataset(torch.utils.data.Dataset):
    """One tokenized sample per item (padded or padding-free batches)."""

    def __init__(self, samples: RaggedSamples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.samples.sample(index)
        item: dict[str, Any] = {
            "input_ids": sample["input_ids"].tolist(),
            "labels": sample["labels"].tolist(),
        }
        if "images" in sample:
            item["images"] = sample["images"]
        return item


class PackedDataset(torch.utils.data.Dataset):
    """One packed row per item: the samples of one best-fit bin, kept as separate pieces."""

    def __init__(self, samples: RaggedSamples, capacity: int) -> None:
        self.samples = samples
        self.bins = best_fit_pack(samples.lengths(), capacity)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, Any]:
        pieces = [self.samples.sample(i) for i in self.bins[index]]
        row: dict[str, Any] = {
            "input_ids": [p["input_ids"].tolist() for p in pieces],
            "labels": [p["labels"].tolist() for p in pieces],
        }
        if self.samples.images is not None:  # the row's images, in the order of its image tokens
            row["images"] = [image for p in pieces for image in p["images"]]
            row["image_counts"] = [len(p["images"]) for p in pieces]
        return row
