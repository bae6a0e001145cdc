"""Best-fit bin packing of tokenized samples into rows of a fixed token capacity.

Packing only decides which samples share a row; keeping them apart inside the row
(restarting position ids, a block-diagonal attention mask, no loss across a boundary)
is the collator's job (`lmforge.data.collate.PackedCollator`).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

IGNORE_INDEX = -100


def best_fit_pack(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Group sample indices into bins of at most `capacity` tokens, best-fit decreasing.

    Longest samples are placed first, each into the open bin whose free space fits it most
    tightly (a new bin when none fits). Every index appears in exactly one bin.
    O(n log n) searches over a sorted list of (free space, bin); fine for 1e5+ samples.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > capacity:
        too_long = int(np.argmax(lengths))
        raise ValueError(
            f"sample {too_long} has {int(lengths[too_long])} tokens, more than the row capacity {capacity}; "
            "truncate or drop over-length samples before packing"
        )
    bins: list[list[int]] = []
    # (free tokens, bin index), kept sorted so the tightest fit is one bisect away.
    free: list[tuple[int, int]] = []
    # Stable sort on -length: ties keep their input order, so packing is deterministic.
    for index in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[index])
        slot = bisect.bisect_left(free, (length, -1))
        if slot == len(free):
            bins.append([index])
            bisect.insort(free, (capacity - length, len(bins) - 1))
            continue
        space, bin_index = free.pop(slot)
        bins[bin_index].append(index)
        bisect.insort(free, (space - length, bin_index))
    return bins


def packing_stats(bins: Sequence[Sequence[int]], lengths: np.ndarray, capacity: int) -> dict[str, float]:
    """Rows, samples, tokens, efficiency (tokens / (rows * capacity)) and pad fraction of a packing."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = len(bins)
    tokens = int(sum(int(lengths[list(b)].sum()) for b in bins if len(b)))
    slots = rows * capacity
    efficiency = tokens / slots if slots else 1.0
    return {
        "rows": rows,
        "samples": int(sum(len(b) for b in bins)),
        "tokens": tokens,
        "efficiency": efficiency,
        "pad_fraction": 1.0 - efficiency,
    }


def pack_samples(samples: Sequence[Mapping[str, Any]], bins: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """Rows of concatenated samples, one per bin: input_ids, labels and seq_lengths (int32 arrays).

    Labels are concatenated as they are; `PackedCollator` makes the boundary targets -100.
    """
    rows = []
    for bin_indices in bins:
        members = [samples[i] for i in bin_indices]
        rows.append(
            {
                "input_ids": np.concatenate([np.asarray(s["input_ids"], dtype=np.int32) for s in members]),
                "labels": np.concatenate([np.asarray(s["labels"], dtype=np.int32) for s in members]),
                "seq_lengths": np.asarray([len(s["input_ids"]) for s in members], dtype=np.int32),
            }
        )
    return rows
